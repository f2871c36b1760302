"""Speculative decoding inside the batched engine, drafted by the model's MTP layer (DeepSeek-V3, GLM-4.5):
greedy-exact, one draft token per running greedy request per step (``EngineConfig.speculative_tokens = 1``).

A round, for a request with ``n`` computed positions and its newest token ``x[n]`` (sampled last step):

1. the previous step left a draft ``d`` for ``x[n + 1]``; the scheduler sees it as part of the request's tokens
   (:meth:`MTPSpeculator.attach`), so the step computes positions ``n`` (token ``x[n]``) and ``n + 1`` (``d``),
   their K/V written to the request's blocks like any chunk's. A request the scheduler preempts, or gives
   fewer tokens than that (the budget), drops its draft before the model runs (:meth:`keep_scheduled`);
2. verification (:meth:`verify`): the main model's greedy token ``g0`` at position n (the logits there, from the
   step's hidden states) and the engine's token ``g1`` at n + 1. ``d == g0``: both ``d`` and ``g1`` are the
   tokens plain greedy decoding gives (``g1`` is the argmax given ``x[..n], d``), so two tokens from one step.
   Otherwise only ``g0`` is kept and the request's computed positions roll back to ``n + 1``: the entries
   written at ``n + 1`` are overwritten by the next step before any query reads them (a query reads only
   positions at or before its own), and blocks are offered to the prefix cache only up to the computed
   positions, so no rejected token is ever shared;
3. drafting (:meth:`draft`): after the step, the MTP layer runs once over every scheduled chunk's positions
   that are now committed, as one packed row through its own paged cache (position ``i`` reads the main
   model's normed hidden state ``h_i`` and the embedding of ``x[i + 1]``: :mod:`megamoe.models.mtp`), and its
   logits at a request's last committed position give the draft for the next step.

Every kept token is the main model's argmax given the tokens before it, so the output equals ``generate()``'s
(up to the last bits a different batch brings to the logits); the drafts only decide how many tokens a step
keeps. Sampled requests (temperature > 0) are not drafted. The MTP layer's cache at a prefix-cache hit holds
what the request that computed the block wrote there: drafts may differ, never the output. Counters: each
request's ``spec_proposed`` / ``spec_accepted`` (in its outputs) and the engine totals (in its metrics).
Layouts. The drafts and the verification are the same on every rank (the logits are gathered over TP), so
TP and EP ranks run the same rounds. Pipeline parallelism: the MTP layer lives on the last stage (with the
final norm, the output layer and a copy of the embedding), which alone holds the hidden states the drafts and
the verification read. It verifies (:meth:`MTPSpeculator.verify_greedy`) and drafts, and broadcasts both over
the pipeline group, so that every stage keeps the same draft tokens in its requests' tokens, commits the same
positions and rolls back the same ones (the rollback is only ``num_computed``: each stage's own KV entries at a
rejected position are overwritten by the next step there). Two small broadcasts per step, none at pipeline
size 1.
"""

from __future__ import annotations

import torch

from megamoe import comms
from megamoe.serving.paged_kv_cache import ScheduledChunk
from megamoe.serving.request import Request
from megamoe.tensor_parallel.vocab_padding import gather_vocab_parallel_logits

__all__ = ["MTPSpeculator", "check_speculation"]


def check_speculation(model, speculative_tokens: int) -> None:
    """ValueError naming the problem when the engine cannot draft ``speculative_tokens`` with ``model``."""
    if not speculative_tokens:
        return
    if not model.config.mtp_num_layers:         # (the MTP layers live on the last pipeline stage)
        raise ValueError(f"EngineConfig.speculative_tokens={speculative_tokens} needs a model with MTP layers "
                         "(DeepSeek-V3, GLM-4.5: config.mtp_num_layers > 0); serve this one with speculative_tokens=0")
    if speculative_tokens != 1:
        raise ValueError(f"EngineConfig.speculative_tokens={speculative_tokens}: the engine drafts one token per step "
                         "with the first MTP layer; pass 1 (or 0: no speculation)")


class MTPSpeculator:
    """The engine's drafts (see the module docstring): ``model`` with MTP layers, the engine's ``cache``
    (:class:`~megamoe.serving.paged_kv_cache.PagedKVCache`, the MTP layer's pools included)."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.layer_id = model.mtp_layer_ids[0] if model.mtp_layer_ids else None     # None: not the last stage
        self.device = next(model.parameters()).device
        pp = model.state.pp
        self._pp_group, self._last_stage = pp.group, pp.ranks[-1]
        self.drafts: dict[Request, int] = {}
        self.proposed = self.accepted = 0

    # -- before the step
    def attach(self, running: list[Request]) -> None:
        """Put each running request's draft after its tokens, so that the scheduler schedules it."""
        for request in list(self.drafts):
            if request in running and request.num_computed == request.num_tokens - 1 and not request.finished:
                request.output.append(self.drafts[request])
            else:
                del self.drafts[request]

    def keep_scheduled(self, chunks) -> None:
        """Take back the drafts the step will not compute whole (preempted, or cut by the token budget)."""
        counts = {request: count for request, count in chunks}
        for request in list(self.drafts):
            if counts.get(request) != 2 or request.num_computed != request.num_tokens - 2:
                request.output.pop()
                del self.drafts[request]

    def detach(self) -> None:
        """Take the drafts out of the requests' tokens again (after the model call, before verification)."""
        for request in self.drafts:
            request.output.pop()

    # -- after the model call
    def verify_greedy(self, chunks, hidden: torch.Tensor | None) -> dict[Request, tuple[int, float]]:
        """The main model's greedy token and its log-probability at the position before each draft, by drafted
        request: computed by the last pipeline stage from the step's hidden states ``hidden`` [1, T, H] (None on
        the other stages) at the rows of ``chunks`` (the step's schedule), and broadcast over the pipeline."""
        drafted = [(request, row + count - 2) for request, count, row in _rows(chunks) if request in self.drafts]
        if not drafted:
            return {}
        model = self.model
        result = torch.empty(2, len(drafted), dtype=torch.float64, device=self.device)
        if self.layer_id is not None:
            index = torch.tensor([row for _, row in drafted], dtype=torch.int64, device=hidden.device)
            local = model.logits(hidden[0].index_select(0, index))
            logits = gather_vocab_parallel_logits(local, model.state.tp.group, model.config.vocab_size).float()
            greedy = logits.argmax(dim=-1)
            logprobs = torch.log_softmax(logits.double(), dim=-1).gather(1, greedy[:, None])[:, 0]
            result = torch.stack([greedy.double(), logprobs])
        result = comms.broadcast_(result, self._last_stage, self._pp_group).cpu()
        return {request: (int(token), logprob) for (request, _), token, logprob in
                zip(drafted, result[0].tolist(), result[1].tolist())}

    def verify(self, request: Request, greedy: int, greedy_logprob: float, token: int,
               logprob: float) -> tuple[list, int]:
        """The kept tokens [(token, logprob)] of a drafted request and the positions to roll back (0 or 1):
        ``greedy`` is the main model's choice at the position before the draft (:meth:`verify_greedy`),
        ``token`` the engine's choice after the draft."""
        draft = self.drafts.pop(request)
        request.spec_proposed += 1
        self.proposed += 1
        if greedy != draft:
            return [(greedy, greedy_logprob)], 1
        request.spec_accepted += 1
        self.accepted += 1
        return [(draft, greedy_logprob), (token, logprob)], 0

    def draft(self, committed: list[tuple[Request, int, int, int]], hidden: torch.Tensor | None) -> None:
        """After the step: ``committed`` holds (request, first position, committed count, row of its first
        position in ``hidden`` [1, T, H], the step's hidden states; None off the last pipeline stage). Drafts
        for the requests that end at their newest token, are greedy and have at least two tokens to go: the
        last stage runs the MTP layer (:meth:`_mtp_drafts`) and broadcasts them over the pipeline."""
        wanted = [request for request, start, count, _ in committed
                  if start + count == request.num_tokens - 1 and request.params.sampling.greedy
                  and request.params.max_tokens - len(request.output) >= 2]
        drafts = torch.empty(len(wanted), dtype=torch.int64, device=self.device)
        if self.layer_id is not None and committed:
            drafts = self._mtp_drafts(committed, hidden, wanted)
        if wanted:
            drafts = comms.broadcast_(drafts, self._last_stage, self._pp_group)
        for request, token in zip(wanted, drafts.tolist()):
            self.drafts[request] = int(token)

    def _mtp_drafts(self, committed, hidden: torch.Tensor, wanted: list[Request]) -> torch.Tensor:
        """One MTP call over the committed positions of the step, as one packed row through the MTP layer's
        paged cache (every committed position, so that its cache is complete); the greedy draft of each of
        ``wanted`` [len(wanted)] int64, from the logits at its last committed position."""
        model = self.model
        device = hidden.device
        rows, ids, positions, chunks, last_rows = [], [], [], [], {}
        for request, start, count, row in committed:
            rows.extend(range(row, row + count))
            ids.extend(request.token_slice(start + 1, start + count + 1))
            positions.extend(range(start, start + count))
            chunks.append(ScheduledChunk(request.block_table, start, count, request.window_table))
            last_rows[request] = len(rows) - 1
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        previous = model.norm(hidden[:, index])
        position_ids = torch.tensor([positions], dtype=torch.int64, device=device)
        embeds = model.embed_tokens(torch.tensor([ids], dtype=torch.int64, device=device))
        view = self.cache.views(chunks)[self.layer_id]
        out, _ = model.layers[str(self.layer_id)].forward_mtp(embeds, previous, position_ids, view, None, None,
                                                              model.rotary(position_ids))
        if not wanted:
            return torch.empty(0, dtype=torch.int64, device=device)
        local = model.logits(out[0, torch.tensor([last_rows[r] for r in wanted], dtype=torch.int64, device=device)],
                             norm=False)
        return gather_vocab_parallel_logits(local, model.state.tp.group, model.config.vocab_size).argmax(dim=-1)


def _rows(chunks):
    """(request, count, row of its first token in the packed step) of each of a step's ``chunks``."""
    row = 0
    for request, count in chunks:
        yield request, count, row
        row += count
