"""RMSNorm, optionally over a feature dim whose heads are split across a tensor-parallel group.

``y = weight * x / sqrt(mean(x^2) + eps)``, computed in fp32 (fp64 for fp64 inputs) and cast back to
the input dtype before the weight multiply (the order HuggingFace's Llama-family ``*RMSNorm`` uses,
so bf16 results match).

Sharded features (OLMoE's q/k norm spans all heads, and heads are split over TP, see
:mod:`megamoe.transformer.head_sharding`): the input and ``weight`` hold this rank's heads. The mean
of squares needs every head once:

- forward: the local sum of squares is all-reduced over TP (divided by the head replication factor
  when heads are replicated);
- backward: the gradient of that sum is all-reduced over TP too, because each rank's output (its
  own heads) contributes a different part of it. ``reduce_from_tensor_parallel_region`` (forward
  all-reduce) followed by ``copy_to_tensor_parallel_region`` (backward all-reduce) gives exactly
  that, so no new collective is needed: one all-reduce of [..., 1] each way.
- The weight shard's gradient is complete locally; a replicated shard's is summed over its replicas.

Replicated weight, different rows per rank (Qwen3's per-head q/k norm applied to this rank's heads):
pass ``weight_grad_group``; each rank's weight gradient is then partial and is all-reduced over that
group in backward (``copy_to_tensor_parallel_region`` on the weight).

bf16 / fp16 inputs of an unsharded norm run :class:`RMSNormFunction`: the same forward (same roundings:
bit-identical), one cast up and one down each way, the same saved bytes, and a hand-written backward of
about half the elementwise ops of autograd's graph of the decomposed norm (which casts the same way). fp32
and fp64 inputs keep the decomposed autograd form: the oracle tests' path, unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.precision import compute_dtype, upcast
from megamoe.sharding import set_shard_spec
from megamoe.tensor_parallel.init import init_sharded_
from megamoe.transformer.head_sharding import head_shard, sum_grad_over_replicas

__all__ = ["RMSNorm", "RMSNormFunction", "rms_norm"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _ones_init(tensor: torch.Tensor, generator: torch.Generator | None) -> None:
    tensor.fill_(1.0)


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rstd).to(x.dtype)``, ``rstd = rsqrt(mean(x^2) + eps)`` over the last dim, computed in
    :func:`~megamoe.precision.compute_dtype` of ``x`` (the decomposed forward of :class:`RMSNorm`, op for op).

    One cast up and one down each way. Saves what autograd's graph of the decomposed norm keeps (the
    normalised rows ``n = x * rstd`` in the compute dtype in place of the upcast input, their cast ``n.to(x.dtype)``,
    ``rstd``): backward ``dweight = sum over rows of grad * n.to(x.dtype)`` (autograd's product), ``g = grad *
    weight`` cast up once, ``dx = rstd * (g - n * mean(g * n))`` cast down once, in 11 ops where autograd runs
    about 20."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x_up = x.to(compute_dtype(x.dtype), copy=True)                         # the cast up
        rstd = torch.rsqrt(x_up.square().mean(-1, keepdim=True).add_(eps))
        rows = x_up.mul_(rstd)                                                  # n, in the compute dtype
        normed = rows.to(x.dtype)                                               # the cast down
        ctx.save_for_backward(rows, normed, weight, rstd)
        return weight * normed

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        rows, normed, weight, rstd = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            products = grad * normed
            grad_weight = products.sum(tuple(range(products.dim() - 1))) if products.dim() > 1 else products
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(rstd.dtype)                                  # the cast up
            dot = (g * rows).mean(-1, keepdim=True)
            grad_x = g.sub_(rows * dot).mul_(rstd).to(normed.dtype)             # the cast down
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNormFunction` (an unsharded RMSNorm over the last dim of ``x``)."""
    return RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim; weight initialised to ones.

    Args:
        num_features: size of the LOGICAL normalised dim.
        tp_group: ``None`` (default): the whole dim is local. Otherwise the dim is made of
            ``num_heads`` equal head blocks split over this group; the input holds this rank's.
        num_heads: head blocks in the dim (required with a ``tp_group`` of more than one rank).
        weight_grad_group: the dim is local and the weight replicated, but the ranks of this group
            normalise different rows, so the weight gradient is summed over it. Not with ``tp_group``.
    """

    def __init__(self, num_features: int, eps: float = 1e-6, *, tp_group: ProcessGroup | None = None,
                 num_heads: int | None = None, weight_grad_group: ProcessGroup | None = None,
                 device=None, dtype=None):
        super().__init__()
        if num_features < 1:
            raise ValueError(f"RMSNorm: num_features must be >= 1, got {num_features}")
        if eps <= 0:
            raise ValueError(f"RMSNorm: eps must be > 0, got {eps}")
        if tp_group is not None and weight_grad_group is not None:
            raise ValueError("RMSNorm: set tp_group (sharded features) or weight_grad_group (replicated weight "
                             "with per-rank rows), not both")
        self.tp_group, self.weight_grad_group = tp_group, weight_grad_group
        self.sharded = comms.group_size(tp_group) > 1
        if self.sharded and num_heads is None:
            raise ValueError("RMSNorm: a norm sharded over a tensor-parallel group needs num_heads "
                             "(the head blocks its feature dim is split by)")
        num_heads = num_heads or 1
        if num_features % num_heads:
            raise ValueError(f"RMSNorm: num_features ({num_features}) must be divisible by num_heads ({num_heads})")
        self.shard = head_shard(tp_group, num_heads, "RMSNorm num_heads")
        self.num_features, self.eps = num_features, eps
        self.weight = nn.Parameter(torch.empty(num_features // self.shard.count, device=device, dtype=dtype))
        set_shard_spec(self.weight, self.shard.spec((num_features,)))
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_sharded_(self.weight, _ones_init, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if input_dtype in _LOW_PRECISION and not self.sharded:
            return rms_norm(x, self._weight(), self.eps)
        x32 = upcast(x)
        if self.sharded:
            sum_sq = x32.pow(2).sum(-1, keepdim=True)
            sum_sq = comms.reduce_from_tensor_parallel_region(sum_sq, self.tp_group)   # forward all-reduce
            sum_sq = comms.copy_to_tensor_parallel_region(sum_sq, self.tp_group)       # backward all-reduce
            variance = sum_sq / (self.shard.replicas * self.num_features)
        else:
            variance = x32.pow(2).mean(-1, keepdim=True)
        normed = (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)
        return self._weight() * normed

    def _weight(self) -> torch.Tensor:
        """The weight, entering the groups its gradient is summed over."""
        if self.weight_grad_group is not None:
            return comms.copy_to_tensor_parallel_region(self.weight, self.weight_grad_group)
        return sum_grad_over_replicas(self.weight, self.weight.shard_spec, self.tp_group, self.shard.replicas)

    def extra_repr(self) -> str:
        return f"{self.num_features} (local {self.weight.shape[0]}), eps={self.eps}, replicas={self.shard.replicas}"
