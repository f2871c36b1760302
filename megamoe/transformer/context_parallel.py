"""Context parallelism (CP): the sequence split over the CP group, and attention over the whole of it.

Layout. A sequence of ``S`` tokens is cut into ``2 cp`` equal chunks; CP rank ``i`` holds chunks ``i``
and ``2 cp - 1 - i``, concatenated in that order (:func:`cp_token_index`). Under a causal mask the
early chunks attend to few keys and the late ones to many; pairing chunk ``i`` with its mirror
gives every rank the same attention work (Megatron-Core's load-balanced order). Everything between
attentions (norms, MLPs, MoE layers, residuals) is per token, so it runs on this rank's ``S / cp``
tokens unchanged; only attention needs the other ranks' tokens.

Attention (all-gather-KV, exact): each rank computes q, k, v for its own tokens, applies RoPE with its
own positions (the sliced ``position_ids``), all-gathers k and v over CP
(:func:`megamoe.comms.gather_from_context_parallel_region`: backward, a reduce-scatter summing every
rank's gradient of this rank's keys), puts them back in sequence order (:func:`gather_sequence`) and
runs :func:`~megamoe.transformer.attention.causal_attention` with ``query_positions`` = this rank's key
indices: the causal, sliding-window and packed-document masks are built from positions, so each
query sees exactly the keys it sees on one rank. GQA gathers the KV heads only; MLA gathers its
compressed latents (``kv_latent`` and the rotated ``k_pe``) and up-projects the whole sequence locally,
(kv_lora_rank + rope dim) per token instead of heads x (qk + v) dims. No KV cache under CP
(decoding one token cannot be split): generate with a cp = 1 layout.

Per layer, per rank: one all-gather forward and one reduce-scatter backward of
``(cp - 1) / cp`` of the sequence's k / v (or latents) over the CP group.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from megamoe import comms

__all__ = ["check_context_parallel_length", "cp_token_index", "slice_for_context_parallel", "gather_sequence",
           "gather_keys_for_context_parallel", "cp_query_positions"]


def check_context_parallel_length(seq_len: int, cp: int) -> None:
    """ValueError unless the sequence splits into ``2 cp`` equal chunks."""
    if cp < 1:
        raise ValueError(f"context parallelism needs cp >= 1, got cp={cp}")
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"context parallelism splits the sequence into 2*cp = {2 * cp} load-balanced chunks: the "
                         f"sequence length seq_len={seq_len} must be divisible by 2*cp (cp={cp})")


def cp_token_index(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """[seq_len / cp_size] int64: the sequence positions CP rank ``cp_rank`` holds, in its order
    (chunk ``cp_rank`` then chunk ``2 cp_size - 1 - cp_rank``, each ``seq_len / (2 cp_size)`` long).
    ``cp_size`` 1: ``arange(seq_len)``."""
    check_context_parallel_length(seq_len, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    mirror = 2 * cp_size - 1 - cp_rank
    return torch.cat([first, torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)])


def slice_for_context_parallel(x: torch.Tensor, cp_group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``x`` along ``dim`` (default 1: [B, S, ...] ids, labels, positions);
    ``x`` itself for one rank. Not a collective: every CP rank holds the whole micro-batch."""
    cp = comms.group_size(cp_group)
    if cp == 1:
        return x
    index = cp_token_index(x.shape[dim], comms.group_rank(cp_group), cp, device=x.device)
    return x.index_select(dim, index)


def _sequence_order(local_len: int, cp: int, device) -> torch.Tensor:
    """[local_len * cp]: where each sequence position sits in the rank-order concatenation of every
    rank's tokens (the inverse of that concatenation's positions)."""
    seq_len = local_len * cp
    gathered = torch.cat([cp_token_index(seq_len, r, cp, device=device) for r in range(cp)])
    return torch.argsort(gathered)


def gather_sequence(x: torch.Tensor, cp_group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """The whole sequence in order from every CP rank's tokens along ``dim``: all-gather over CP
    (backward: reduce-scatter, summing every rank's gradient of this rank's tokens) and one
    index_select (backward: the matching scatter)."""
    cp = comms.group_size(cp_group)
    if cp == 1:
        return x
    full = comms.gather_from_context_parallel_region(x, cp_group, dim)
    return full.index_select(dim, _sequence_order(x.shape[dim], cp, x.device))


def cp_query_positions(local_len: int, cp_group: ProcessGroup | None, device=None) -> torch.Tensor | None:
    """The key indices of this rank's queries in the gathered sequence (``query_positions`` of
    :func:`~megamoe.transformer.attention.causal_attention`); None for one rank."""
    cp = comms.group_size(cp_group)
    if cp == 1:
        return None
    return cp_token_index(local_len * cp, comms.group_rank(cp_group), cp, device=device)


def gather_keys_for_context_parallel(tensors: tuple[torch.Tensor, ...], cp_group: ProcessGroup | None,
                                     dim: int = -2) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """``tensors`` (this rank's keys and values [B, heads, S / cp, D_i], equal in every dim but the
    last) -> (the same over the whole sequence [B, heads, S, D_i], in order; this rank's query
    positions [S / cp]). One all-gather for all of them (concatenated along the last dim)."""
    if comms.group_size(cp_group) == 1:
        return tensors, None
    widths = [t.shape[-1] for t in tensors]
    joined = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-1)
    local_len = joined.shape[dim]
    full = gather_sequence(joined, cp_group, dim)
    return tuple(full.split(widths, dim=-1)), cp_query_positions(local_len, cp_group, device=joined.device)
