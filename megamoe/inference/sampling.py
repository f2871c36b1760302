"""Next-token choice: greedy, or sampling with temperature, top-k and top-p.

Reproducibility. Each request draws from its own CPU generator, seeded by ``(seed, request id)``
(:func:`request_generator`), one uniform number per decoding step, and picks the token by inverse CDF
over the filtered distribution. A request's tokens therefore depend only on the seed, its id and its
logits: not on the batch it shares, nor on which rank serves it, nor on the parallel layout (up to
the last-bit differences of the logits that a different reduction order can bring). Within one run
every rank that samples holds the same gathered logits and the same generators, and the generation
loop broadcasts the last stage's tokens over the pipeline.

Filters, in HF's order: temperature, then top-k (keep the k highest scores, and every score tied
with the k-th), then top-p (keep the smallest set of highest-probability tokens whose probability
reaches ``top_p``, at least one; ties ordered by token id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megamoe.tensor_parallel.init import seeded_generator

__all__ = ["SamplingConfig", "request_generator", "sample_next_tokens"]


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0``: greedy (argmax, lowest id on ties). Otherwise sample from
    ``softmax(logits / temperature)`` restricted by ``top_k`` (None: no limit) and ``top_p``."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        # inf would divide every logit to 0 (a uniform draw), NaN would make every probability NaN.
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"SamplingConfig.temperature must be a finite number >= 0 (0: greedy), got "
                             f"{self.temperature}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"SamplingConfig.top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.seed) or self.seed < 0:       # as numpy's seeds: a negative one is a slip
            raise ValueError(f"SamplingConfig.seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def request_generator(seed: int, request_id: int) -> torch.Generator:
    """The CPU generator of one request: its state depends only on ``seed`` and ``request_id``."""
    return seeded_generator(seed, f"request.{request_id}")


def _filtered_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[B, V] fp32 logits -> [B, V] fp64 probabilities after temperature, top-k and top-p."""
    scores = logits.double() / config.temperature
    if config.top_k is not None and config.top_k < scores.shape[-1]:
        kth_best = scores.topk(config.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    probs = scores.softmax(dim=-1)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)   # ties: lower id first
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs          # probability of the better tokens
        sorted_probs = sorted_probs.masked_fill(mass_before >= config.top_p, 0.0)   # the best one always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample_next_tokens(logits: torch.Tensor, config: SamplingConfig,
                       generators: Sequence[torch.Generator]) -> torch.Tensor:
    """logits [B, V] (full vocabulary: the padding of a padded one stripped, as
    :func:`~megamoe.tensor_parallel.vocab_padding.gather_vocab_parallel_logits` gives them) -> next token
    ids [B] int64. ``generators``: one per row, each advanced by one draw (not used when greedy)."""
    if config.greedy:
        return logits.argmax(dim=-1)
    if len(generators) != logits.shape[0]:
        raise ValueError(f"sample_next_tokens needs one generator per row: {logits.shape[0]} rows, "
                         f"{len(generators)} generators")
    probs = _filtered_probs(logits, config)
    draws = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])   # [B] on CPU
    cdf = probs.cumsum(dim=-1)
    targets = draws.to(cdf.device)[:, None] * cdf[:, -1:]               # scaled: the cdf may end at 1 - eps
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return tokens.clamp(max=logits.shape[-1] - 1)
