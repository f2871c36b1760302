"""One request's sampling parameters: how its next token is chosen (through
:mod:`megamoe.inference.sampling`, the same code as ``generate()``), when it stops, and whether the
log-probabilities of its tokens are returned."""

from __future__ import annotations

from dataclasses import dataclass

from megamoe.inference.sampling import SamplingConfig

__all__ = ["SamplingParams"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0``: greedy. ``seed``: with the request id, seeds the request's own generator
    (:func:`~megamoe.inference.sampling.request_generator`), one draw per token. ``max_tokens``: new tokens
    at most. ``stop_token_ids``: a generated one ends the request (and is kept in its tokens).
    ``stop``: strings that end the request when the decoded new tokens contain one (needs the engine's
    tokenizer). ``logprobs``: return the log-probability of each chosen token (log-softmax of the
    model's logits, before temperature and filters)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False

    def __post_init__(self):
        try:
            self.sampling
        except ValueError as error:
            raise ValueError(str(error).replace("SamplingConfig.", "SamplingParams.")) from None
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids (integers >= 0), got "
                             f"{self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"SamplingParams.logprobs must be True or False, got {self.logprobs!r}")

    @property
    def sampling(self) -> SamplingConfig:
        """The next-token rule, as :func:`~megamoe.inference.sampling.sample_next_tokens` takes it."""
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)
