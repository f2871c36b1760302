"""A request's state inside the engine, and what a step reports about it.

A request's tokens are ``prompt + output``; ``num_computed`` of them have their K/V in the cache (at the
positions of its block table). A step computes the next ones (a prefill chunk, or the one decode token);
when a step reaches the last token, the logits there choose a new token. A preempted request keeps its
tokens and its sampling generator and starts again at ``num_computed = 0`` (its cached prefix blocks may
still be found), so its next tokens are those it would have produced anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megamoe.serving.sampling_params import SamplingParams

__all__ = ["Request", "RequestOutput"]


@dataclass
class RequestOutput:
    """What one step (or an abort) tells about one request. ``new_token_ids``: this step's tokens;
    ``token_ids``: every generated token so far; ``logprobs``: of the new tokens (when asked);
    ``finish_reason``: "stop" (a stop token or string), "length" (max_tokens) or "abort", None while
    running; ``stop_reason``: the stop token id or stop string that ended it; ``num_cached_tokens``:
    prompt tokens found in the prefix cache (not computed)."""

    request_id: int
    new_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    spec_proposed: int = 0
    spec_accepted: int = 0
    stop_reason: int | str | None = None


@dataclass(eq=False)
class Request:
    """The engine's bookkeeping of one request (see the module docstring)."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival: int                                   # order of admission into the engine
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0                          # tokens whose K/V are in the cache
    block_table: list[int | None] = field(default_factory=list)   # None: a block freed behind a sliding window
    window_table: list[int | None] = field(default_factory=list)  # the sliding layers' own (a split cache)
    block_hashes: list[bytes] = field(default_factory=list)       # chained hashes of its full blocks
    blocks_registered: int = 0                     # leading blocks offered to the prefix cache
    num_cached_tokens: int | None = None           # prompt tokens found in the prefix cache (first admission)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec_proposed: int = 0
    spec_accepted: int = 0
    text_checked: int = 0                          # characters of the decoded output searched for stop strings
    dp_rank: int = 0                               # the data-parallel rank that serves it (data-parallel attention)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building the whole list (a step reads a few tokens of a long one)."""
        prompt = len(self.prompt)
        if start >= prompt:
            return self.output[start - prompt:end - prompt]
        return self.prompt[start:end] + self.output[:max(0, end - prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def report(self, new_token_ids: list[int], new_logprobs: list[float]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, new_token_ids=new_token_ids, token_ids=list(self.output),
            logprobs=list(new_logprobs) if self.params.logprobs else None, finished=self.finished,
            finish_reason=self.finish_reason, num_prompt_tokens=len(self.prompt),
            num_cached_tokens=self.num_cached_tokens or 0, spec_proposed=self.spec_proposed,
            spec_accepted=self.spec_accepted, stop_reason=self.stop_reason)
