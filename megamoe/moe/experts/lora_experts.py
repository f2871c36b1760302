"""LoRA adapters on the routed experts: one adapter per EXPERT, shared by every slot that holds it.

Per expert ``e`` (PEFT's ``target_parameters`` layout of a fused 3-D expert weight)::

    lora_A_gate_up  [E, r, H]            lora_B_gate_up  [E, G * F_shard, r]   rows: gate shard, then up shard
    lora_A_down     [E, r, F_shard]      lora_B_down     [E, H, r]

so that ``gate_up_e += scaling * B_gate_up[e] @ A_gate_up[e]`` and ``down_e += scaling * B_down[e] @ A_down[e]``.
Gate and up share one ``A`` (the fused weight's adapter, as PEFT's on Qwen3-MoE's ``gate_up_proj``); the
logical names of :meth:`ExpertAdapters.sharded_state_dict` split it per HF weight
(``experts.<e>.gate_proj.weight.lora_A`` is that ``A``, ``.lora_B`` the gate rows of ``B``; ``up_proj``
the same ``A`` and the up rows).

Compute (:func:`lora_grouped_mlp`): the adapters run on the activations as grouped GEMMs beside the frozen
base's grouped GEMMs, ``h = X W1^T + s (drop(X) A1^T) B1^T``, ``a = act(h)``, ``y = a W2^T + s (drop(a) A2^T) B2^T``,
with every slot's adapter gathered from its expert's (``index_select``: the backward sums the gradients of
all slots of one expert into it). The base weights get no gradient; kept block-FP8 experts are dequantized
one slot at a time, forward and backward (nothing of their size is saved): LoRA over frozen FP8 experts.

Where the adapters live (the decision for expert parallelism and online EPLB): every EP rank holds the
adapters of ALL experts, identical everywhere. A rank's backward gives the gradient of the experts of its
local slots; :meth:`ExpertAdapters.reduce_grads` (called by the MoE layer's replica-gradient sum, before the
optimizer) sums it over the EP group (and the ETP-replicated factors over ETP), so every rank holds the
whole gradient and takes the same optimizer step. Rebalancing (EPLB) moves slots, never adapters: nothing
to migrate, the Adam state included. The price: adapter memory and one all-reduce of the adapter
gradients per step scale with all experts, not the local ones (with rank 16 they are still a few percent
of the experts' weights; see ``benchmarks/memory.py``).

Expert tensor parallelism follows the base: ``B_gate_up`` is sharded on its rows like ``w_gate_up``
(column-parallel), ``A_down`` on its columns like ``w_down`` (row-parallel, its partial output summed with
the base's by the layer's one reduction); ``A_gate_up`` and ``B_down`` are whole on every ETP rank and their
gradients are summed over ETP.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megamoe import comms
from megamoe.checkpoint_state import LogicalChunk
from megamoe.gradients import main_grad
from megamoe.moe.experts.grouped_mlp import (SlotGroups, _row_slots, grouped_linear, grouped_linear_input_grad,
                                             grouped_linear_weight_grad)
from megamoe.precision import active_autocast_dtype
from megamoe.quantization.block_fp8 import dequantize_block_fp8

__all__ = ["ExpertAdapters", "lora_grouped_mlp", "lora_a_init_"]


@torch.no_grad()
def lora_a_init_(full: torch.Tensor, generator: torch.Generator) -> None:
    """PEFT's init of ``lora_A`` [r, in]: kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)),
    drawn in fp32 on CPU from ``generator`` (the same values for every layout)."""
    bound = 1.0 / math.sqrt(full.shape[-1])
    values = torch.empty(full.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    full.copy_(values)


class ExpertAdapters(nn.Module):
    """The adapters of one MoE layer's routed experts (see the module docstring). ``slot_experts()`` returns
    the expert of every local slot [S_local] (read at each call: the placement can change), ``etp_group`` /
    ``ep_group`` the layer's groups."""

    def __init__(self, experts: nn.Module, num_experts: int, rank: int, scaling: float, dropout: float, *,
                 slot_experts: Callable[[], torch.Tensor], etp_group=None, ep_group=None, dtype=None) -> None:
        super().__init__()
        cfg = experts.config
        if getattr(experts, "backend", None) == "te":
            raise ValueError("LoRA on the routed experts needs backend 'torch' or 'loop' (TransformerEngine's "
                             "GroupedLinear keeps weights of its own): set the experts backend to 'torch'")
        if cfg.fp8 is not None:
            raise ValueError("LoRA on the routed experts runs the frozen base in high precision (kept block-FP8 "
                             "weights are dequantized per slot): build the model with expert_fp8=None")
        self.num_experts, self.rank, self.scaling, self.dropout = num_experts, rank, scaling, dropout
        self.slot_experts = slot_experts
        self.etp_group, self.ep_group = etp_group, ep_group
        self.etp_size, self.etp_rank = cfg.etp_size, cfg.etp_rank
        self.hidden_size, self.ffn_hidden_size, self.ffn_shard_size = cfg.hidden_size, cfg.ffn_hidden_size, \
            cfg.ffn_shard_size
        self.gated = cfg.gated
        E, H, Fs, G = num_experts, cfg.hidden_size, cfg.ffn_shard_size, 2 if cfg.gated else 1
        device = experts.slot_parameters(0)[0][0].device
        factory = {"device": device, "dtype": dtype}
        self.lora_A_gate_up = nn.Parameter(torch.empty(E, rank, H, **factory))
        self.lora_B_gate_up = nn.Parameter(torch.zeros(E, G * Fs, rank, **factory))
        self.lora_A_down = nn.Parameter(torch.empty(E, rank, Fs, **factory))
        self.lora_B_down = nn.Parameter(torch.zeros(E, H, rank, **factory))
        for param in self.parameters():
            param.expert_parallel = True       # reduced over expert-DP, like the experts' weights
            param.ep_replicated = True         # whole (all experts) on every EP rank: see the module docstring
        self.lora_A_gate_up.etp_replicated = True
        self.lora_B_down.etp_replicated = True

    @torch.no_grad()
    def reset_parameters(self, generator_for: Callable[[str], torch.Generator]) -> None:
        """``A`` drawn as PEFT does, per expert, from ``generator_for(<logical name of the base weight>)``
        (full tensors, this rank's ETP columns kept); ``B`` zeros."""
        if self.lora_A_gate_up.is_meta:
            return
        F_ = self.ffn_hidden_size
        cols = slice(self.etp_rank * self.ffn_shard_size, (self.etp_rank + 1) * self.ffn_shard_size)
        for e in range(self.num_experts):
            a = torch.empty(self.rank, self.hidden_size)
            lora_a_init_(a, generator_for(f"{e}.gate_proj.weight"))
            self.lora_A_gate_up[e].copy_(a)
            a = torch.empty(self.rank, F_)
            lora_a_init_(a, generator_for(f"{e}.down_proj.weight"))
            self.lora_A_down[e].copy_(a[:, cols])
        self.lora_B_gate_up.zero_()
        self.lora_B_down.zero_()

    def sharded_state_dict(self, prefix: str = "") -> list[LogicalChunk]:
        """Per-expert logical chunks named after the base weights (``prefix`` is the experts', e.g.
        ``layers.1.mlp.experts.``): ``<e>.gate_proj.weight.lora_A`` [r, H] and ``.lora_B`` [F, r], the same for
        ``up_proj`` (the shared ``A``, the up rows of ``B``), ``<e>.down_proj.weight.lora_A`` [r, F] and
        ``.lora_B`` [H, r]; each rank's ETP part."""
        r, H, F_, Fs = self.rank, self.hidden_size, self.ffn_hidden_size, self.ffn_shard_size
        f0 = self.etp_rank * Fs
        chunks = []
        for e in range(self.num_experts):
            key = f"{prefix}{e}"
            b_gate_up = self.lora_B_gate_up.detach()[e]
            halves = (("gate_proj", b_gate_up[:Fs]),) + ((("up_proj", b_gate_up[Fs:]),) if self.gated else ())
            for name, b in halves:
                chunks.append(LogicalChunk(f"{key}.{name}.weight.lora_A", self.lora_A_gate_up.detach()[e], (r, H),
                                           (0, 0)))
                chunks.append(LogicalChunk(f"{key}.{name}.weight.lora_B", b, (F_, r), (f0, 0)))
            chunks.append(LogicalChunk(f"{key}.down_proj.weight.lora_A", self.lora_A_down.detach()[e], (r, F_),
                                       (0, f0)))
            chunks.append(LogicalChunk(f"{key}.down_proj.weight.lora_B", self.lora_B_down.detach()[e], (H, r),
                                       (0, 0)))
        return chunks

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum the adapters' gradients over the EP group (each rank has those of its local slots' experts), and
        the ETP-replicated factors' over ETP (each ETP rank has its shard's part). Called once per step with the
        replica-gradient sum, before the optimizer (sums commute with the data-parallel reduction)."""
        grads = [main_grad(p) for p in self.parameters()]
        if any(g is None for g in grads):
            return
        comms.all_reduce_coalesced_([main_grad(self.lora_A_gate_up), main_grad(self.lora_B_down)], self.etp_group)
        comms.all_reduce_coalesced_(grads, self.ep_group)




class _GroupedLinear(torch.autograd.Function):
    """Per slot ``y_s = x_s @ weight[s]^T`` with autograd: the weight's gradient only when it needs one (a
    frozen base weight saves no input)."""

    @staticmethod
    def forward(ctx, x, weight, groups: SlotGroups):
        ctx.groups = groups
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        return grouped_linear(x, weight, groups)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = grouped_linear_input_grad(grad_y, weight, ctx.groups) if ctx.needs_input_grad[0] else None
        grad_w = grouped_linear_weight_grad(grad_y, x, ctx.groups) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def _kept_slot_weight(experts, local_slot: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """One slot's kept block-FP8 ``gate_up`` [G * F_shard, H] or ``down`` [H, F_shard], dequantized to ``dtype``."""
    block = experts.weight_quantization.block_size
    weights, scales = experts.expert_weight_shards(local_slot), experts.expert_scale_shards(local_slot)
    keys = ("down",) if kind == "down" else tuple(k for k in ("gate", "up") if k in weights)
    return torch.cat([dequantize_block_fp8(weights[k], scales[k], block, dtype) for k in keys])


class _KeptGroupedLinear(torch.autograd.Function):
    """Per slot ``y_s = x_s @ deq(W_s)^T`` over frozen kept block-FP8 experts: each slot's weight dequantized
    when used, forward and backward (only the input gradient)."""

    @staticmethod
    def forward(ctx, x, experts, kind: str, sizes: list[int]):
        ctx.experts, ctx.kind, ctx.sizes = experts, kind, sizes
        outs = [F.linear(rows, _kept_slot_weight(experts, s, kind, x.dtype))
                for s, rows in enumerate(x.split(sizes))]
        return torch.cat(outs) if outs else x.new_empty(0, 0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        grads = [rows @ _kept_slot_weight(ctx.experts, s, ctx.kind, grad_y.dtype)
                 for s, rows in enumerate(grad_y.split(ctx.sizes))]
        return torch.cat(grads), None, None, None


def _adapter_path(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_experts: torch.Tensor,
                  groups: SlotGroups, scaling: float, dropout: float, training: bool) -> torch.Tensor:
    """``scaling * (drop(x) A_s^T) B_s^T`` per slot, A / B gathered per slot from the experts' adapters."""
    a_slots = a.index_select(0, slot_experts).to(x.dtype)
    b_slots = b.index_select(0, slot_experts).to(x.dtype)
    if dropout > 0:
        x = F.dropout(x, dropout, training)
    low = _GroupedLinear.apply(x, a_slots, groups)                         # [N, r]
    return _GroupedLinear.apply(low, b_slots, groups) * scaling            # [N, out]


def lora_grouped_mlp(experts, adapters: ExpertAdapters, tokens: torch.Tensor, tokens_per_slot: torch.Tensor,
                     rows_per_slot: list[int] | None = None) -> torch.Tensor:
    """The expert MLP of all local slots with their experts' adapters (see the module docstring): ``tokens``
    [N, H] grouped by local slot -> [N, H], a partial sum over ETP like the base's."""
    dtype = active_autocast_dtype(tokens.device.type) or tokens.dtype
    tokens = tokens.to(dtype)
    kept = experts.weight_quantization is not None
    groups = SlotGroups.from_counts(tokens_per_slot.to(tokens.device), tokens.shape[0], dtype=dtype,
                                    known_sizes=rows_per_slot, use_grouped_mm=None if not kept else False)
    slot_experts = adapters.slot_experts().to(device=tokens.device, dtype=torch.long)
    if kept:
        def base(x, kind):
            return _KeptGroupedLinear.apply(x, experts, kind, groups.sizes)
    else:
        def base(x, kind):
            weight = experts.w_gate_up if kind == "gate_up" else experts.w_down
            return _GroupedLinear.apply(x, weight.to(dtype), groups)
    extra = dict(scaling=adapters.scaling, dropout=adapters.dropout, training=adapters.training)
    hidden = base(tokens, "gate_up") + _adapter_path(tokens, adapters.lora_A_gate_up, adapters.lora_B_gate_up,
                                                     slot_experts, groups, **extra)
    rows = _row_slots(groups) if experts.b_gate_up is not None else None
    if rows is not None:
        hidden = hidden + experts.b_gate_up.to(dtype).index_select(0, rows)
    act = experts._activate(hidden)
    out = base(act, "down") + _adapter_path(act, adapters.lora_A_down, adapters.lora_B_down, slot_experts, groups,
                                            **extra)
    if rows is not None and experts.adds_down_bias:
        out = out + experts.b_down.to(dtype).index_select(0, rows)
    return out
