"""The order in which training visits samples: independent of the data-parallel layout, and resumable.

One **global order** is defined for the whole run: the concatenation of per-epoch permutations of
``range(num_samples)``, epoch ``e``'s drawn by a ``torch.Generator`` seeded from ``(seed, e)``. Global
batch ``s`` is the ``global_batch_size`` consecutive entries starting at position
``s * global_batch_size``; DP rank ``r`` takes the ``r``-th contiguous ``1 / dp_size`` part of it and
splits that into micro-batches. So the samples of a step, and hence the loss curve, do not depend on
``dp_size`` or the micro-batch size. A global batch may straddle two epochs (no sample is dropped at an
epoch's end); that keeps a position in the order a plain count, so the only state is
``consumed_samples``, and a run resumed under another ``dp_size`` (or even another global batch size)
continues with exactly the next samples of the order.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import torch

__all__ = ["ResumableSampler"]


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed per (seed, epoch); hashed so that nearby pairs give unrelated streams."""
    digest = hashlib.sha256(f"megamoe.ResumableSampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class ResumableSampler:
    """Yields this DP rank's micro-batches of sample indices (int64 tensors [micro_batch_size]) from
    the global order described in the module docstring, forever.

    ``num_micro_batches = global_batch_size / (dp_size * micro_batch_size)`` micro-batches make one
    global batch on each rank. ``consumed_samples`` counts the global order's positions handed out;
    it advances by ``global_batch_size`` as a global batch's micro-batches are produced, so
    ``state_dict()`` taken after the last micro-batch of a step resumes at the next step.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ):
        for name, value in (("num_samples", num_samples), ("global_batch_size", global_batch_size),
                            ("micro_batch_size", micro_batch_size), ("dp_size", dp_size)):
            if value < 1:
                raise ValueError(f"ResumableSampler {name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"ResumableSampler dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if global_batch_size % (dp_size * micro_batch_size) != 0:
            raise ValueError(
                f"ResumableSampler global_batch_size ({global_batch_size}) must be divisible by dp_size * "
                f"micro_batch_size ({dp_size} * {micro_batch_size} = {dp_size * micro_batch_size}): change "
                "global_batch_size or micro_batch_size"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = 0
        self._cached_epoch: tuple[int, torch.Tensor] | None = None  # (epoch, its order [num_samples])

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    @property
    def epoch(self) -> int:
        """The epoch of the next sample to be handed out."""
        return self.consumed_samples // self.num_samples

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                order = torch.randperm(self.num_samples, generator=generator)
            else:
                order = torch.arange(self.num_samples)
            self._cached_epoch = (epoch, order)
        return self._cached_epoch[1]

    def global_order(self, start: int, count: int) -> torch.Tensor:
        """Sample indices at positions ``[start, start + count)`` of the global order: int64 [count]."""
        parts = []
        position, end = start, start + count
        while position < end:
            epoch, offset = divmod(position, self.num_samples)
            take = min(end - position, self.num_samples - offset)
            parts.append(self._epoch_order(epoch)[offset:offset + take])
            position += take
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def next_micro_batches(self) -> list[torch.Tensor]:
        """This rank's ``num_micro_batches`` micro-batches of the next global batch; advances
        ``consumed_samples`` by ``global_batch_size``."""
        global_batch = self.global_order(self.consumed_samples, self.global_batch_size)
        per_rank = self.global_batch_size // self.dp_size
        rank_part = global_batch[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        self.consumed_samples += self.global_batch_size
        return list(rank_part.split(self.micro_batch_size))

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield from self.next_micro_batches()

    def state_dict(self) -> dict[str, Any]:
        """``consumed_samples`` is the position; the other entries identify the order and are checked
        by :meth:`load_state_dict`. No layout entry: any dp_size may resume."""
        return {"consumed_samples": self.consumed_samples, "num_samples": self.num_samples,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consumed = state.get("consumed_samples")
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise ValueError(f"sampler state needs an int consumed_samples >= 0, got {consumed!r}")
        for name in ("num_samples", "seed", "shuffle"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"sampler state has {name}={state[name]!r} but this sampler has {getattr(self, name)!r}: "
                    "the saved position belongs to another sample order (dataset or seed changed)"
                )
        self.consumed_samples = consumed
