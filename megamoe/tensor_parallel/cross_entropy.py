"""Cross-entropy over logits whose vocabulary dim is split over the TP group.

The full [.., V] logits are never materialised on one rank. Forward: a max all-reduce (for
stability), an all-reduce of the target logit (only the owning rank contributes) and of the sum of
exponentials. Backward: ``softmax - one_hot(target)`` on the local vocabulary chunk, scaled by the
incoming gradient; no communication.

A padded vocabulary (:mod:`megamoe.tensor_parallel.vocab_padding`): given ``vocab_size``, the columns
at and beyond it are -inf before the max and the exponentials, so they take no probability (the loss
is the unpadded vocabulary's) and get exactly zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.precision import upcast
from megamoe.tensor_parallel.vocab_padding import mask_padded_logits_, real_rows

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, vocab_size):
        vocab_per_rank = logits.shape[-1]
        vocab_start = comms.group_rank(group) * vocab_per_rank
        logits = upcast(logits)
        real = vocab_per_rank if vocab_size is None else real_rows(vocab_size, vocab_start, vocab_per_rank)

        if real:
            logits_max = logits[..., :real].max(dim=-1).values
        else:       # a shard of padding only: the other ranks give the max
            logits_max = logits.new_full(logits.shape[:-1], float("-inf"))
        comms.all_reduce_(logits_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        if real < vocab_per_rank:      # masked in the new tensor: the caller's logits stay as they are
            mask_padded_logits_(shifted, vocab_start, vocab_size)

        ignored = target == ignore_index
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= vocab_per_rank) | ignored
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        # One all-reduce for both reductions.
        packed = comms.all_reduce_(torch.stack([target_logit, sum_exp]), group)
        target_logit, sum_exp = packed[0], packed[1]

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax
        # d loss / d logit_j = softmax_j - [j == target]; zero for ignored positions.
        onehot_value = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_value.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor,
                                 tp_group: ProcessGroup | None = None, ignore_index: int = -100,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss (fp32, fp64 for fp64 logits; shape ``target.shape``; 0 where ``target == ignore_index``).

    ``logits_local`` [..., Vp/tp] is this rank's vocabulary chunk (rank order, as produced by a
    ColumnParallelLinear output layer). ``vocab_size``: the real vocabulary V <= Vp, the columns beyond
    it padding, masked out (None: every column is a token). Average the result over the non-ignored
    tokens yourself.
    """
    if logits_local.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits_local.shape)} and target {tuple(target.shape)} disagree "
                         "on the leading dims")
    return _VocabParallelCrossEntropy.apply(logits_local, target, tp_group, ignore_index, vocab_size)
