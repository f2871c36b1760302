"""MoE parallel folding: the expert grid independent of the dense grid for the all-to-all dispatcher.

With the all-to-all dispatcher and ``etp < tp`` (``etp`` dividing ``tp``) WITHOUT sequence
parallelism, the TP ranks of one data-parallel replica hold the SAME tokens after attention. Left
alone, every TP rank would dispatch them all and each token would be computed ``tp / etp`` times.
Folding gives each TP rank a DISJOINT share of those replicated tokens instead:

- on entry to the MoE layer the tokens are split over the TP group (a local slice, no
  communication; backward: all-gather of the shares' gradients, so each rank's input gradient is
  complete, as the replicated attention path expects): the contiguous chunk ``r * S / tp : (r+1) * S / tp``
  of the sequence dim of a [B, S, H] input (dim 0 of a [T, H] one), exactly the chunk sequence
  parallelism would hold;
- the layer then runs as under sequence parallelism on that share (the dispatcher takes sharded
  input and gathers over ETP, the router's balancing losses are those of the whole sequences, the
  router / shared-expert gate / unsharded shared experts are tagged ``sequence_parallel`` so that
  the gradient sync sums their gradients over TP);
- on exit the layer's output is all-gathered over TP (backward: each rank keeps its own share of the
  gradient, which is identical on every TP rank).

Why no token is computed twice: the shares of one TP group partition its tokens, and the EP x ETP
group's ranks then hold pairwise different tokens (different shares, or different data-parallel
data), so each (token, expert) pair reaches exactly one slot on one EP rank, split once over ETP.
Hence :func:`megamoe.models.gpt_moe.expert_token_replicas` is 1 and every rank counts its own
tokens' expert loads (:func:`megamoe.models.sequence_parallel.counts_own_tokens`).

Calls without gradients (generation with a KV cache, decoding one token at a time, padded
inference, evaluation) are not split: every TP rank computes all its tokens, which is correct for
any token count (each rank gets its own copy back, so greedy generation is token-equal to one rank)
at ``tp / etp`` times the expert compute, and TP rank 0 alone counts the expert load, the
convention every inference tool reads (``generate``'s rebalancer, ``gather_expert_load``). A call
WITH gradients (training) whose token count tp does not divide raises ValueError naming both
numbers: the sequence length must be divisible by tp, as under sequence parallelism.
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from megamoe.parallel_plan import folds_moe_layers

__all__ = ["folding_group", "uses_folding"]


def uses_folding(config, tp: int, etp: int) -> bool:
    """Whether a layout folds the MoE layers (see the module docstring): a dispatcher that folds over TP
    (all-to-all), no sequence parallelism, tp > 1 and etp < tp (the plan's rule,
    :func:`megamoe.parallel_plan.folds_moe_layers`)."""
    return folds_moe_layers(config, tp, etp)


def folding_group(config, state) -> ProcessGroup | None:
    """The group the MoE layers' tokens are split over under folding (the TP group), else None."""
    if uses_folding(config, state.tp.size, state.etp.size):
        return state.tp.group
    return None
