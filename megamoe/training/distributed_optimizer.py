"""The distributed optimizer (ZeRO-1 / ZeRO-2): AdamW whose state is sharded over data-parallel ranks.

(API skeleton; the implementation follows in the next commits.)
"""

from __future__ import annotations

import torch

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(torch.optim.Optimizer):
    """AdamW (the hyper-parameters and weight-decay rule of ``build_optimizer``) with its state sharded.

    ``model``: one pipeline stage; ``state``: its ParallelState. ``shard=False``: groups of one rank
    (fp32 master weights for bf16 parameters, no sharding). ``zero_stage`` 1 or 2. ``bucket_numel``
    bounds a reduce-scatter bucket. ``state[param]`` holds this rank's shard tensors ``exp_avg``,
    ``exp_avg_sq``, ``master`` (non-fp32 parameters) [S, ceil(n / N)] and ``step``.
    """

    def __init__(self, model, state, *, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, shard: bool = True, zero_stage: int = 1,
                 bucket_numel: int = 40_000_000, tied_params=(), expert_token_replicas: int = 1):
        raise NotImplementedError

    def reduce_gradients(self) -> None:
        """Reduce-scatter the gradients (after GradientSync's TP / tied / replica sums)."""
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm: float, world_group) -> float:
        """Global gradient norm from the shards (== the plain one); clip the shards; returns it."""
        raise NotImplementedError

    def gradient_shards(self) -> list[torch.Tensor]:
        """The persistent reduced-gradient shard tensors (ZeRO-2); [] when none are kept."""
        raise NotImplementedError

    def slot_state_views(self, param, index) -> list[torch.Tensor]:
        """This rank's state rows (master, moments) of one expert slot of ``param`` (migration)."""
        raise NotImplementedError

    def logical_state(self, gather: bool = True):
        """Full-shape state of every parameter (collective when ``gather``), for checkpoints."""
        raise NotImplementedError

    def load_logical_state(self, logical) -> None:
        """Slice this rank's shards out of :meth:`logical_state`'s tensors after a checkpoint load."""
        raise NotImplementedError
