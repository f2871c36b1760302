"""Column- and row-parallel linear layers (Megatron-style), holding local shards.

Shard math (``tp`` = group size, ``r`` = rank in the group), weights in nn.Linear layout [out, in]:

- ``ColumnParallelLinear``: W [out, in] is split along ``out``; rank r holds rows
  ``r*out/tp : (r+1)*out/tp`` (and that slice of the bias). Input: full (or, with sequence
  parallelism, this rank's ``1/tp`` of the first dim, all-gathered). Output: the local columns of
  ``y``, or the full ``y`` with ``gather_output``.
- ``RowParallelLinear``: W [out, in] is split along ``in``; rank r holds columns
  ``r*in/tp : (r+1)*in/tp``. Input: the matching chunk of the last dim. The partial products are
  all-reduced (or reduce-scattered along the first dim under sequence parallelism); the bias is
  replicated and added once after the reduction.

Gradients: weight and bias shards get complete gradients locally (no reduction over TP), except the
row-parallel bias under sequence parallelism, which sees only this rank's tokens and is tagged
``sequence_parallel`` so the gradient sync all-reduces it over TP. Data-parallel reduction is the
training loop's job.

Kept block-FP8 weights (``weight`` e4m3 plus ``weight_scale_inv``, :mod:`megamoe.quantization.kept_weights`)
are dequantized for each call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.quantization.kept_weights import linear_weight
from megamoe.sharding import ShardSpec, set_shard_spec
from megamoe.tensor_parallel.init import InitMethod, init_sharded_, normal_init, zeros_init
from megamoe.tensor_parallel.main_grad_linear import linear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split along its output features over ``tp_group``.

    Args:
        gather_output: all-gather the output's last dim so every rank gets the full ``y``.
        skip_bias_add: return ``(y_without_bias, bias)`` so the caller can fuse the bias add.
        sequence_parallel: the input is this rank's chunk of the sequence dim ``sequence_dim``
            (default the first; 1 for batch-first [B, S, H]); it is all-gathered forward and the
            input gradient reduce-scattered backward.
        init_method: draws the FULL weight, ``init(tensor, generator)``; default N(0, 0.02).
        padded_out_features: the output features are padded to this many (a multiple of the TP
            size) before the split: the output layer of a vocabulary TP does not divide
            (:mod:`megamoe.tensor_parallel.vocab_padding`). The padding rows of the weight (and
            bias) are zero and not part of the logical weight; masking their outputs is the caller's.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group: ProcessGroup | None = None,
                 bias: bool = True, gather_output: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = 0, init_method: InitMethod | None = None,
                 padded_out_features: int | None = None, device=None, dtype=None):
        super().__init__()
        self.sequence_dim = sequence_dim
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output and sequence_parallel cannot both be set "
                             "(a sequence-parallel column layer feeds a row-parallel layer)")
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = comms.group_size(tp_group), comms.group_rank(tp_group)
        self.in_features, self.out_features = in_features, out_features
        if padded_out_features is not None and padded_out_features < out_features:
            raise ValueError(f"ColumnParallelLinear padded_out_features ({padded_out_features}) must be >= "
                             f"out_features ({out_features})")
        padded = padded_out_features if padded_out_features != out_features else None
        what = "ColumnParallelLinear " + ("padded_out_features" if padded else "out_features")
        self.out_features_per_rank = _divide(padded or out_features, self.tp_size, what)
        self.gather_output, self.skip_bias_add, self.sequence_parallel = gather_output, skip_bias_add, sequence_parallel
        self.init_method = init_method or normal_init()
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_features_per_rank, in_features, **factory))
        set_shard_spec(self.weight, ShardSpec((out_features, in_features), 0, self.tp_rank, self.tp_size,
                                              padded_size=padded))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features_per_rank, **factory))
            set_shard_spec(self.bias, ShardSpec((out_features,), 0, self.tp_rank, self.tp_size, padded_size=padded))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_sharded_(self.weight, self.init_method, generator)
        if self.bias is not None:
            init_sharded_(self.bias, zeros_init, generator)

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel:
            x = comms.gather_from_sequence_parallel_region(x, self.tp_group, dim=self.sequence_dim)
        else:
            x = comms.copy_to_tensor_parallel_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        y = linear(x, linear_weight(self, "weight", x.dtype), bias)
        if self.gather_output:
            y = comms.gather_from_tensor_parallel_region(y, self.tp_group)
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.out_features_per_rank}), tp={self.tp_size}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split along its input features over ``tp_group``.

    Args:
        input_is_parallel: the input already is this rank's chunk of the last dim (the output of a
            ColumnParallelLinear); otherwise the full input is split here.
        skip_bias_add: return ``(y_without_bias, bias)``.
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` (default the first; 1 for
            batch-first [B, S, H]) instead of all-reducing.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group: ProcessGroup | None = None,
                 bias: bool = True, input_is_parallel: bool = True, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = 0, init_method: InitMethod | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.sequence_dim = sequence_dim
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = comms.group_size(tp_group), comms.group_rank(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_rank = _divide(in_features, self.tp_size, "RowParallelLinear in_features")
        self.input_is_parallel, self.skip_bias_add, self.sequence_parallel = (
            input_is_parallel, skip_bias_add, sequence_parallel)
        self.init_method = init_method or normal_init()
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_rank, **factory))
        set_shard_spec(self.weight, ShardSpec((out_features, in_features), 1, self.tp_rank, self.tp_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_sharded_(self.weight, self.init_method, generator)
        if self.bias is not None:
            init_sharded_(self.bias, zeros_init, generator)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = comms.scatter_to_tensor_parallel_region(x, self.tp_group)
        y = linear(x, linear_weight(self, "weight", x.dtype))
        if self.sequence_parallel:
            y = comms.reduce_scatter_to_sequence_parallel_region(y, self.tp_group, dim=self.sequence_dim)
        else:
            y = comms.reduce_from_tensor_parallel_region(y, self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.in_features_per_rank}), "
                f"out_features={self.out_features}, tp={self.tp_size}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")
