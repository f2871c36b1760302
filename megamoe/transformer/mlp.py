"""Dense MLP: gated ``down(act(gate(x)) * up(x))`` (SwiGLU with ``silu``) or plain ``down(act(up(x)))``.

Tensor parallelism: ``gate_proj`` and ``up_proj`` are separate column-parallel weights (rank r holds
rows ``r*F/tp:(r+1)*F/tp`` of each, so a shard is a plain slice of the HF tensor) and ``down_proj``
is row-parallel (the matching columns). The input enters the TP region once for both column
shards, so backward all-reduces the input gradient once (not once per projection); forward
all-reduces the output once (``down_proj``). Weight gradients are complete locally.

Sequence parallelism (``sequence_parallel=True``, under TP): the input [B, S / tp, H] is this rank's
chunk of the sequence dim: one all-gather before gate/up (backward: a reduce-scatter of the input
gradient, and the chunk gathered again for the weight gradients: only the chunk is kept) and a
reduce-scatter after ``down_proj`` (its bias is tagged ``sequence_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.quantization.kept_weights import linear_weight
from megamoe.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megamoe.tensor_parallel.init import normal_init
from megamoe.tensor_parallel.main_grad_linear import linear
from megamoe.tensor_parallel.sequence import SEQUENCE_DIM
from megamoe.transformer.swiglu import swiglu

__all__ = ["MLPConfig", "MLP"]

# HF `hidden_act` names of the activations these families use ("gelu" is the exact erf GELU).
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class MLPConfig:
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"     # HF `hidden_act`
    gated: bool = True           # gate_proj present (SwiGLU-style); False: down(act(up(x)))
    bias: bool = False           # DeepSeek `mlp_bias`
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLPConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MLPConfig.activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")


class MLP(nn.Module):
    """Dense (gated) MLP with the intermediate dim split over ``tp_group`` (``None``: one rank)."""

    def __init__(self, config: MLPConfig, *, tp_group: ProcessGroup | None = None, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.sequence_parallel = sequence_parallel and comms.group_size(tp_group) > 1
        self.act = ACTIVATIONS[config.activation]
        init = normal_init(config.init_std)
        hidden, inter = config.hidden_size, config.intermediate_size
        column = dict(tp_group=tp_group, bias=config.bias, init_method=init, device=device, dtype=dtype)
        self.gate_proj = ColumnParallelLinear(hidden, inter, **column) if config.gated else None
        self.up_proj = ColumnParallelLinear(hidden, inter, **column)
        self.down_proj = RowParallelLinear(inter, hidden, tp_group=tp_group, bias=config.bias, input_is_parallel=True,
                                           sequence_parallel=self.sequence_parallel, sequence_dim=SEQUENCE_DIM,
                                           init_method=init, device=device, dtype=dtype)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Redraw every parameter from full logical tensors (same values for every TP layout)."""
        for module in (self.gate_proj, self.up_proj, self.down_proj):
            if module is not None:
                module.reset_parameters(generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H] (complete on every rank)."""
        layers = (self.up_proj,) if self.gate_proj is None else (self.up_proj, self.gate_proj)
        if self.sequence_parallel:   # one all-gather (and one grad reduce-scatter) for gate and up
            outputs = comms.gather_linears_from_sequence_parallel_region(
                x, self.tp_group, [linear_weight(l, "weight", x.dtype) for l in layers], [l.bias for l in layers],
                dim=SEQUENCE_DIM)
        else:                        # one grad all-reduce for gate and up
            x = comms.copy_to_tensor_parallel_region(x, self.tp_group)
            outputs = [linear(x, linear_weight(l, "weight", x.dtype), l.bias) for l in layers]
        up = outputs[0]
        if self.gate_proj is None:
            hidden = self.act(up)
        elif self.config.activation == "silu":     # SwiGLU: one node saving only its inputs (bf16 / fp16)
            hidden = swiglu(outputs[1], up)
        else:
            hidden = self.act(outputs[1]) * up
        return self.down_proj(hidden)
