"""Sequence parallelism in the model: which layouts use it, and the checks and facts others need.

With ``GPTMoEConfig.sequence_parallel`` under tensor parallelism (tp > 1), the hidden states between
blocks, and between pipeline stages, are [B, S / tp, H]: TP rank r holds the contiguous chunk
``r * S / tp : (r + 1) * S / tp`` of the sequence dim (dim 1). The layout of one decoder layer:

- embedding: the vocab-parallel partial embeddings are reduce-scattered along dim 1 (instead of
  all-reduced); the input ids and labels stay the full [B, S] on every TP rank;
- norms, residuals (and dropout) on the chunk;
- attention / dense MLP: one all-gather along dim 1 before the column-parallel projections (MLA:
  of the latents, its down projections running on the chunk) and one reduce-scatter after the
  row-parallel output projection; attention sees the whole gathered sequence, so ``position_ids``
  and ``document_ids`` stay the full [B, S];
- MoE: every rank routes its own chunk (the all-gather dispatcher gathers the EP x ETP group's
  tokens, the all-to-all dispatcher gathers over ETP), the balancing losses are those of the whole
  sequences;
- final norm on the chunk, then an all-gather along dim 1 before the vocab-parallel output layer:
  the logits, and so the loss, are those of the layout without sequence parallelism.

Gradients: every parameter replicated over TP but fed only this rank's chunk (the layer norms, the
final norm, the row-parallel biases, MLA's down projections and latent norms, the routers, the
shared-expert gate and shared experts not sharded over the TP group) is tagged
``param.sequence_parallel = True``; the gradient sync sums those gradients over TP before the
data-parallel reduction. Expert parameters see the tokens of every rank of their expert group, so
no TP rank computes the same tokens twice: :func:`megamoe.models.gpt_moe.expert_token_replicas` is 1.
Expert loads: each TP rank counts its own tokens, so the trainer sums every rank's loads
(:func:`counts_own_tokens`). Under context parallelism each CP rank routes (and counts) its own
tokens as well: TP rank 0 of every CP rank counts, or every rank with sequence parallelism.

A training feature: a forward with a KV cache or a padding mask (generation) is refused; build the
model with ``sequence_parallel=False`` there (the same function, the same checkpoint).
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from megamoe.parallel_plan import moe_layout_of, uses_sequence_parallel
from megamoe.transformer.context_parallel import check_context_parallel_length

__all__ = ["sequence_parallel_group", "check_sequence_length", "counts_own_tokens", "stage_hidden_shape"]


def sequence_parallel_group(config, state) -> ProcessGroup | None:
    """The group the sequence is split over: the TP group when ``config.sequence_parallel`` and
    tp > 1, else None (one chunk: the plain layout)."""
    if uses_sequence_parallel(config, state.tp.size):
        return state.tp.group
    return None


def check_sequence_length(seq_len: int, tp: int) -> None:
    """ValueError unless the sequence splits into ``tp`` equal chunks."""
    if seq_len % tp:
        raise ValueError(f"sequence parallelism splits the sequence over the TP group: the sequence length "
                         f"{seq_len} must be divisible by tp={tp}")


def counts_own_tokens(model, state) -> bool:
    """Whether this rank's expert-load counters hold tokens no other TP rank counts: every rank under
    sequence parallelism (each routes its own chunk) and under MoE parallel folding (each dispatches
    its own share: :mod:`megamoe.models.moe_folding`), TP rank 0 otherwise (TP ranks route the same
    tokens)."""
    config = getattr(model, "config", None)
    if getattr(config, "moe", None) is not None:        # the plan's rule (megamoe.parallel_plan)
        return moe_layout_of(model, state).counts_own_tokens
    return state.tp.rank == 0 or sequence_parallel_group(config, state) is not None


def stage_hidden_shape(model, state, batch: int, seq_len: int) -> tuple[int, int, int]:
    """The hidden states pipeline stages exchange: [batch, seq_len, H], or this rank's sequence chunk
    [batch, seq_len / tp, H] under sequence parallelism; divided by cp again under context parallelism
    (this CP rank's seq_len / cp tokens: :mod:`megamoe.transformer.context_parallel`)."""
    config = getattr(model, "config", None)
    cp = getattr(getattr(state, "cp", None), "size", 1)
    if cp > 1:
        check_context_parallel_length(seq_len, cp)
        seq_len //= cp
    chunks = state.tp.size if sequence_parallel_group(config, state) is not None else 1
    if chunks > 1:
        check_sequence_length(seq_len, chunks)
    return batch, seq_len // chunks, config.hidden_size
