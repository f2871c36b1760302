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
The MTP layer must sit with the last layer (pipeline size 1); the drafts are the same on every rank (the
logits are gathered over TP), so TP and EP ranks run the same verification.
"""

from __future__ import annotations

import torch

from megamoe.serving.paged_kv_cache import ScheduledChunk
from megamoe.serving.request import Request
from megamoe.tensor_parallel.vocab_padding import gather_vocab_parallel_logits

__all__ = ["MTPSpeculator", "check_speculation"]


def check_speculation(model, state, speculative_tokens: int) -> None:
    """ValueError naming the problem when the engine cannot draft ``speculative_tokens`` with ``model``."""
    if not speculative_tokens:
        return
    if not model.mtp_layer_ids:
        raise ValueError(f"EngineConfig.speculative_tokens={speculative_tokens} needs a model with MTP layers "
                         "(DeepSeek-V3, GLM-4.5: config.mtp_num_layers > 0); serve this one with speculative_tokens=0")
    if speculative_tokens != 1:
        raise ValueError(f"EngineConfig.speculative_tokens={speculative_tokens}: the engine drafts one token per step "
                         "with the first MTP layer; pass 1 (or 0: no speculation)")
    if state.pp.size != 1:
        raise ValueError(f"EngineConfig.speculative_tokens needs pipeline size 1 (pp={state.pp.size}): the MTP draft "
                         "reads the main model's last hidden states on the rank that holds the MTP layer")


class MTPSpeculator:
    """The engine's drafts (see the module docstring): ``model`` with MTP layers, the engine's ``cache``
    (:class:`~megamoe.serving.paged_kv_cache.PagedKVCache`, the MTP layer's pools included)."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.layer_id = model.mtp_layer_ids[0]
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
    def verify(self, request: Request, hidden_row: torch.Tensor, token: int, logprob: float) -> tuple[list, int]:
        """The kept tokens [(token, logprob)] of a drafted request and the positions to roll back (0 or 1):
        ``hidden_row`` [H] is the main model's last hidden state at the position before the draft, ``token``
        the engine's choice after the draft."""
        draft = self.drafts.pop(request)
        local = self.model.logits(hidden_row[None])
        logits = gather_vocab_parallel_logits(local, self.model.state.tp.group, self.model.config.vocab_size).float()
        greedy = int(logits.argmax(dim=-1)[0])
        draft_logprob = float(torch.log_softmax(logits.double(), dim=-1)[0, greedy])
        request.spec_proposed += 1
        self.proposed += 1
        if greedy != draft:
            return [(greedy, draft_logprob)], 1
        request.spec_accepted += 1
        self.accepted += 1
        return [(draft, draft_logprob), (token, logprob)], 0

    def draft(self, committed: list[tuple[Request, int, int, int]], hidden: torch.Tensor) -> None:
        """One MTP call over the committed positions of the step: ``committed`` holds (request, first position,
        committed count, row of its first position in ``hidden`` [1, T, H]). Drafts for the requests that end
        at their newest token, are greedy and have at least two tokens to go."""
        if not committed:
            return
        model = self.model
        device = hidden.device
        rows, ids, positions, chunks = [], [], [], []
        for request, start, count, row in committed:
            rows.extend(range(row, row + count))
            ids.extend(request.token_slice(start + 1, start + count + 1))
            positions.extend(range(start, start + count))
            chunks.append(ScheduledChunk(request.block_table, start, count))
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        previous = model.norm(hidden[:, index])
        position_ids = torch.tensor([positions], dtype=torch.int64, device=device)
        embeds = model.embed_tokens(torch.tensor([ids], dtype=torch.int64, device=device))
        view = self.cache.views(chunks)[self.layer_id]
        out, _ = model.layers[str(self.layer_id)].forward_mtp(embeds, previous, position_ids, view, None, None,
                                                              model.rotary(position_ids))
        wanted, last_rows, at = [], [], 0
        for request, start, count, _ in committed:
            at += count
            params = request.params
            if (start + count == request.num_tokens - 1 and params.sampling.greedy
                    and params.max_tokens - len(request.output) >= 2):
                wanted.append(request)
                last_rows.append(at - 1)
        if not wanted:
            return
        local = model.logits(out[0, torch.tensor(last_rows, dtype=torch.int64, device=device)], norm=False)
        drafts = gather_vocab_parallel_logits(local, model.state.tp.group, model.config.vocab_size).argmax(dim=-1)
        for request, token in zip(wanted, drafts.tolist()):
            self.drafts[request] = int(token)
