"""Shared experts: a dense (gated) MLP every token passes through, beside the routed experts.

Its FFN dim is sharded over the MoE layer's reduction group (EP x ETP for the all-gather paradigm,
ETP for all-to-all), and it returns a PARTIAL output: the layer adds it to the routed experts'
partial output before the one reduction, so shared experts cost no collective of their own.
Rank ``r`` of ``n`` holds rows ``r*F/n:(r+1)*F/n`` of gate/up and the matching columns of down;
those gradients are complete locally.

The optional Qwen2-MoE gate ``sigmoid(x @ gate_weight^T)`` is computed by the layer on its own input
tokens (see :meth:`SharedExperts.gate`) and carried into the dispatcher's token view like the routing
weights, so its gradient is complete on the token's owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.precision import compute_dtype, hold_in_compute_dtype_
from megamoe.quantization.kept_weights import linear_weight
from megamoe.sharding import ShardSpec, set_shard_spec
from megamoe.tensor_parallel.init import init_sharded_, normal_init
from megamoe.tensor_parallel.main_grad_linear import linear
from megamoe.transformer.swiglu import swiglu

__all__ = ["SharedExpertsConfig", "SharedExperts"]

_ACTIVATIONS = {"swiglu": F.silu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu}


@dataclass
class SharedExpertsConfig:
    hidden_size: int
    ffn_hidden_size: int          # total FFN size of all shared experts (num_shared * size each)
    activation: str = "swiglu"    # "swiglu" | "gelu" | "relu" | "silu"
    gate: bool = False            # Qwen2-MoE's sigmoid shared-expert gate
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("hidden_size", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SharedExpertsConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"SharedExpertsConfig.activation must be one of {sorted(_ACTIVATIONS)}, "
                             f"got {self.activation!r}")


class SharedExperts(nn.Module):
    def __init__(self, config: SharedExpertsConfig, *, shard_group: ProcessGroup | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.config, self.shard_group = config, shard_group
        n, r = comms.group_size(shard_group), comms.group_rank(shard_group)
        if config.ffn_hidden_size % n:
            raise ValueError(f"SharedExpertsConfig.ffn_hidden_size ({config.ffn_hidden_size}) must be divisible "
                             f"by the size of the group it is sharded over ({n})")
        H, F_full = config.hidden_size, config.ffn_hidden_size
        factory = {"device": device, "dtype": dtype}
        self.gated = config.activation == "swiglu"
        names = ("gate_proj", "up_proj") if self.gated else ("up_proj",)
        for name in names:
            param = nn.Parameter(torch.empty(F_full // n, H, **factory))
            set_shard_spec(param, ShardSpec((F_full, H), 0, r, n))
            self.register_parameter(name, param)
        self.down_proj = nn.Parameter(torch.empty(H, F_full // n, **factory))
        set_shard_spec(self.down_proj, ShardSpec((H, F_full), 1, r, n))
        # the gate computes in fp32: held in fp32 in every model dtype (no per-call weight cast)
        gate_dtype = compute_dtype(dtype if dtype is not None else torch.get_default_dtype())
        self.gate_weight = nn.Parameter(torch.empty(1, H, device=device, dtype=gate_dtype)) if config.gate else None
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """As nn.Module's, then the gate's weight back to at least fp32 (see ``__init__``)."""
        super()._apply(fn, recurse)
        hold_in_compute_dtype_(self.gate_weight)
        return self

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init = normal_init(self.config.init_std)
        for param in self.parameters():
            init_sharded_(param, init, generator)

    def gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """Per-token gate [T, 1] in fp32 (fp64 for fp64 weights), or None without a gate."""
        if self.gate_weight is None:
            return None
        dtype = compute_dtype(x.dtype, self.gate_weight.dtype)
        return torch.sigmoid(F.linear(x.to(dtype), self.gate_weight.to(dtype)))

    def forward(self, tokens: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Partial output [T, H] of this rank's FFN shard (times ``gate`` when given)."""
        return self.down(self.up(tokens), gate)

    def up(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first half of :meth:`forward`: the activated FFN hidden [T, F / n] of ``tokens`` [T, H]. Split
        from :meth:`down` so that the MoE layer can run the halves while different all-to-alls are in flight."""
        act = _ACTIVATIONS[self.config.activation]
        up = linear(tokens, linear_weight(self, "up_proj", tokens.dtype))
        if self.gated:        # swiglu: one node saving only its inputs (bf16 / fp16)
            return swiglu(linear(tokens, linear_weight(self, "gate_proj", tokens.dtype)), up)
        return act(up)

    def down(self, hidden: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """The second half: the partial output [T, H] of :meth:`up`'s ``hidden`` (times ``gate``)."""
        out = linear(hidden, linear_weight(self, "down_proj", hidden.dtype))
        return out if gate is None else out * gate.to(out.dtype)
