"""LoRA adapters on dense weights (attention, dense MLPs, shared experts, routers), following the base's TP shard.

An adapter of a weight ``W`` [out, in] holds ``A`` [r, in] and ``B`` [out, r]; the layer multiplies by
``W + scaling * B @ A`` (:func:`megamoe.quantization.kept_weights.linear_weight` asks the owner's
``lora_adapters`` child for it), which is PEFT's ``y = base(x) + scaling * (x A^T) B^T`` without dropout,
computed on the weight as PEFT's ``target_parameters`` does. Every code path that multiplies by the weight
(fused QKV, sequence parallelism, MLA's absorbed ``kv_b_proj``, kept block-FP8 weights dequantized per call)
therefore sees the adapted weight. Cost: one transient weight-sized tensor per call, kept for backward.

Shards (the base's :class:`~megamoe.sharding.ShardSpec`):

- column-parallel (split on ``out``): ``B`` split like the base's rows, ``A`` whole on every rank; ``A``'s
  gradient is summed over the TP group (``copy_to_tensor_parallel_region`` on ``A``);
- row-parallel (split on ``in``): ``A`` split like the base's columns, ``B`` whole; ``B``'s gradient summed
  over TP; the adapter's part of the output is reduced with the base's;
- replicated: both whole, tagged like the base (``sequence_parallel``: summed over TP by the gradient sync).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.checkpoint_state import LogicalChunk, chunk_from_shard_spec
from megamoe.moe.experts.lora_experts import lora_a_init_
from megamoe.sharding import ShardSpec, get_shard_spec, set_shard_spec

__all__ = ["DenseAdapter", "DenseAdapters"]

_COPIED_TAGS = ("sequence_parallel", "expert_parallel")


class DenseAdapter(nn.Module):
    """The adapter of one (possibly TP-sharded) weight; ``group`` is the group the base is sharded over."""

    def __init__(self, weight: torch.Tensor, rank: int, scaling: float, *, group: ProcessGroup | None,
                 name: str, dtype: torch.dtype) -> None:
        super().__init__()
        spec = get_shard_spec(weight)
        if weight.dim() != 2 or spec.padded_size is not None:
            raise ValueError(f"{name}: LoRA adapts 2-D weights without vocabulary padding, got shape "
                             f"{tuple(weight.shape)}")
        out_features, in_features = spec.global_shape
        self.scaling, self.rank, self.group = scaling, rank, group
        self.kind = "replicated" if spec.dim is None or spec.count == 1 else ("column" if spec.dim == 0 else "row")
        if self.kind != "replicated" and comms.group_size(group) != spec.count:
            raise ValueError(
                f"{name}: its {spec.count} shards are not one per rank of its group of {comms.group_size(group)} "
                "(a k / v head replicated over TP ranks: more TP ranks than key-value heads); LoRA follows only "
                "plain TP shards: use a TP size <= num_key_value_heads, or leave 'attention' out of the targets")
        factory = {"device": weight.device, "dtype": dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, **factory))
        if self.kind == "column":
            self.lora_B = nn.Parameter(torch.zeros(spec.local_shape[0], rank, **factory))
            set_shard_spec(self.lora_B, ShardSpec((out_features, rank), 0, spec.index, spec.count))
        elif self.kind == "row":
            self.lora_A = nn.Parameter(torch.empty(rank, spec.local_shape[1], **factory))
            set_shard_spec(self.lora_A, ShardSpec((rank, in_features), 1, spec.index, spec.count))
        for tag in _COPIED_TAGS:
            if getattr(weight, tag, False):
                for param in (self.lora_A, self.lora_B):
                    setattr(param, tag, getattr(weight, tag))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """``A`` as PEFT draws it (the full tensor, this rank's part kept), ``B`` zeros."""
        if self.lora_A.is_meta:
            return
        spec = get_shard_spec(self.lora_A)
        full = torch.empty(spec.global_shape)
        lora_a_init_(full, generator)
        self.lora_A.copy_(spec.slice_of(full))
        self.lora_B.zero_()

    def delta(self) -> torch.Tensor:
        """``scaling * B @ A`` of this rank's shard of the weight, the gradients of the whole factors summed over
        TP where the shard sees only part of them."""
        a, b = self.lora_A, self.lora_B
        if self.kind == "column":
            a = comms.copy_to_tensor_parallel_region(a, self.group)
        elif self.kind == "row":
            b = comms.copy_to_tensor_parallel_region(b, self.group)
        return (b @ a) * self.scaling


class DenseAdapters(nn.Module):
    """The adapters of one module's weights, by attribute name (the module's child ``lora_adapters``)."""

    def __init__(self) -> None:
        super().__init__()

    def adapted(self, attr: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (the parameter, or a kept weight dequantized) plus its adapter's update, if it has one."""
        adapter = self._modules.get(attr)
        if adapter is None:
            return weight
        return weight + adapter.delta().to(weight.dtype)

    @torch.no_grad()
    def reset_parameters(self, generator_for: Callable[[str], torch.Generator]) -> None:
        for attr, adapter in self.named_children():
            adapter.reset_parameters(generator_for(attr))

    def sharded_state_dict(self, prefix: str = "") -> list[LogicalChunk]:
        """``<owner>.<attr>.lora_A`` / ``.lora_B``: named after the base weight (``prefix`` ends in
        ``lora_adapters.``, dropped)."""
        owner = prefix[:-len("lora_adapters.")] if prefix.endswith("lora_adapters.") else prefix
        chunks = []
        for attr, adapter in self.named_children():
            chunks.append(chunk_from_shard_spec(f"{owner}{attr}.lora_A", adapter.lora_A))
            chunks.append(chunk_from_shard_spec(f"{owner}{attr}.lora_B", adapter.lora_B))
        return chunks
