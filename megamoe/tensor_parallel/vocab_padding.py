"""A vocabulary of any size under any TP size: the embedding and output layer are padded internally.

The embedding table and the output layer are split over the TP group by vocabulary rows in equal,
contiguous shards, so their row count must be a multiple of the TP size. As Megatron's
``--make-vocab-size-divisible-by`` does, the rows are padded up to ``Vp``, the smallest multiple of
``divisible_by * tp`` that holds the ``V`` real tokens (:func:`padded_vocab_size`): rank ``r`` holds
padded rows ``[r * Vp / tp, (r + 1) * Vp / tp)``, and rows ``>= V`` are padding.

What the padding is not:

- part of the model: a parameter's :class:`~megamoe.sharding.ShardSpec` records the padded size
  (``padded_size``) next to the logical shape ``[V, H]``, and checkpoints, HF conversion and the
  logical-state helpers see only the real rows, so a checkpoint written under one TP size (one padding)
  loads under any other, and exports to HF with the original shape. ``divisible_by``
  (``GPTMoEConfig.make_vocab_size_divisible_by``) is an engine choice like ``sequence_parallel``.
- ever a winner: the padding rows are zero at initialisation, their logits are set to ``-inf`` on the
  rank that holds them (:func:`mask_padded_logits_`; the cross entropy masks them too when given the
  vocabulary size), so they take no probability in the loss, in greedy decoding or in sampling, and
  their gradients are exactly zero (they stay zero under the optimizer). Logits gathered for a user
  (:func:`gather_vocab_parallel_logits`) have exactly ``V`` columns.

Every rank must hold at least one real row: with ``V`` small against ``divisible_by * tp`` the last
ranks would hold only padding, which no checkpoint chunk could describe; that layout is refused,
naming the numbers.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from megamoe import comms

__all__ = ["padded_vocab_size", "real_rows", "mask_padded_logits_", "gather_vocab_parallel_logits"]


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 1) -> int:
    """The smallest multiple of ``divisible_by * tp`` >= ``vocab_size``. ValueError naming the numbers
    when a TP rank would hold no real row (see the module docstring)."""
    for name, value in (("vocab_size", vocab_size), ("tp", tp), ("make_vocab_size_divisible_by", divisible_by)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"padded_vocab_size: {name} must be an int >= 1, got {value!r}")
    multiple = divisible_by * tp
    padded = -(-vocab_size // multiple) * multiple
    per_rank = padded // tp
    if (tp - 1) * per_rank >= vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} padded to {padded} (a multiple of make_vocab_size_divisible_by * tp = "
            f"{divisible_by} * {tp}) leaves TP rank {tp - 1} with only padding rows ({per_rank} rows per rank): "
            "lower make_vocab_size_divisible_by or the tensor-parallel size")
    return padded


def real_rows(vocab_size: int, vocab_start: int, rows_per_rank: int) -> int:
    """How many of a shard's ``rows_per_rank`` rows, starting at padded row ``vocab_start``, are real tokens."""
    return max(0, min(rows_per_rank, vocab_size - vocab_start))


def mask_padded_logits_(logits_local: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Set, in place, the padding columns of this rank's logits shard [..., Vp / tp] (starting at
    vocabulary row ``vocab_start``) to ``-inf``; returns it. No-op on a shard without padding. Under
    autograd the masked columns pass no gradient, so the padding rows of the weight get exactly zero."""
    real = real_rows(vocab_size, vocab_start, logits_local.shape[-1])
    if real < logits_local.shape[-1]:
        logits_local[..., real:] = float("-inf")
    return logits_local


def gather_vocab_parallel_logits(logits_local: torch.Tensor, tp_group: ProcessGroup | None,
                                 vocab_size: int) -> torch.Tensor:
    """The full logits [..., V] from every TP rank's shard [..., Vp / tp], rank order, padding stripped."""
    full = comms.gather_from_tensor_parallel_region(logits_local, tp_group)
    return full if full.shape[-1] == vocab_size else full[..., :vocab_size]
