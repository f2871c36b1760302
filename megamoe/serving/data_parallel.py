"""Data-parallel attention with expert-parallel MoE in the serving engine (``EngineConfig.data_parallel_attention``).

The layout (the seeds' DP-attention + EP design): every rank of the parallel state's data-parallel group holds the
attention and dense weights whole, the routed experts' slots are split over the EP group, which spans
data-parallel ranks (replica slots allowed; the model's MoE layers take each rank's own tokens: the all-to-all
dispatcher, or the all-gather one built with ``input_sharded``). Each data-parallel rank has its own scheduler,
paged KV cache and requests, so no two ranks compute the same attention.

One engine step, on every rank (:class:`~megamoe.serving.engine.Engine` calls the pieces here):

1. rank 0 broadcasts the changes since the last step (:mod:`megamoe.serving.step_broadcast`); each added
   request names its data-parallel rank, and only that rank adds it. Aborts and stops reach every rank; a rank
   drops the ids it holds (a client that disconnects from a request living on rank 1 frees its blocks there).
2. every rank schedules its own requests, and the ranks agree with ONE all-reduce of one flag
   (:func:`megamoe.comms.any_rank`) whether any of them has work. If none has, nobody runs the model (an idle
   heartbeat). If any has, ALL run it together, so that the MoE layers' collectives match: a rank with nothing
   scheduled runs it over an empty row [1, 0] (its attention computes nothing, its MoE layers send and receive
   no token, and nothing is sampled).
3. every rank's report (its new tokens, finished requests, and its state: :class:`RankReport`) reaches rank 0
   in one gather over the data-parallel group (:func:`megamoe.comms.all_gather_sizes` then
   :func:`~megamoe.comms.all_gather_into`). Rank 0 keeps a mirror of every request it sent to another rank: it
   appends that rank's tokens to it (checking the stop strings there, since the other ranks have no tokenizer:
   a stop is broadcast before the next step) and reports them as its own, so HTTP responses and streams work
   for requests on any rank; ``metrics()`` adds up the ranks' states and lists each
   (:class:`~megamoe.serving.metrics.DataParallelRankMetrics`).

Rank 0 assigns each new request to the least loaded data-parallel rank by tokens: the prompt tokens plus
``max_tokens`` of the unfinished requests it serves (the KV positions they may take), ties to the lowest rank.
The ranks stop together: rank 0's ``shutdown()`` ends every ``follow()``.

Supported: tp = 1 and pp = 1 (each data-parallel rank is one whole model replica but for the experts), no
speculation. TP or PP inside a data-parallel rank, and MTP drafts (their MoE layers would need the same
agreement), are refused with a ValueError naming ``EngineConfig.data_parallel_attention``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from megamoe import comms
from megamoe.serving.metrics import DataParallelRankMetrics, EngineMetrics
from megamoe.serving.request import Request, RequestOutput
from megamoe.serving.step_broadcast import _bits_float, _float_bits

__all__ = ["DataParallelSteps", "RankReport", "RemoteOutput", "check_data_parallel_layout", "check_moe_input",
           "decode_report", "encode_report", "least_loaded", "report_of"]

_MAGIC = 0x5E4E_D001                   # format of a rank's report; rank 0 refuses any other
_FINISH_CODES = {None: 0, "stop": 1, "length": 2}


def check_data_parallel_layout(tp: int, pp: int, speculative_tokens: int) -> None:
    """ValueError naming ``EngineConfig.data_parallel_attention`` for what the engine cannot run with it."""
    if tp != 1 or pp != 1:
        raise ValueError(f"EngineConfig.data_parallel_attention runs each data-parallel rank as one whole replica of "
                         f"the attention (tp=1, pp=1), got tp={tp} pp={pp}: serve with tp=1 and pp=1 (EP spans the "
                         "data-parallel ranks), or without data-parallel attention")
    if speculative_tokens:
        raise ValueError(f"EngineConfig.data_parallel_attention cannot run MTP speculation (speculative_tokens="
                         f"{speculative_tokens}): the drafts' MoE layers would run on one rank alone; set "
                         "speculative_tokens=0, or serve without data-parallel attention")


def check_moe_input(model, state, data_parallel_attention: bool) -> None:
    """ValueError when the model's MoE layers gather tokens sharded over data-parallel ranks (all-gather
    dispatch built with ``input_sharded``) but every rank would run the same batch: they would count each token
    once per rank."""
    moe = model.config.moe
    if moe is not None and moe.input_sharded and state.ep_etp.size > 1 and not data_parallel_attention:
        raise ValueError("the model's MoE layers take each data-parallel rank's own tokens (input_sharded "
                         "all-gather dispatch): set EngineConfig.data_parallel_attention=True, or build the model "
                         "with input_sharded=False")


def least_loaded(requests: Iterable[Request], size: int) -> int:
    """The data-parallel rank (of ``size``) whose unfinished ``requests`` take the fewest tokens (prompt +
    ``max_tokens`` each: the KV positions they may hold); ties to the lowest rank."""
    loads = [0] * size
    for request in requests:
        loads[request.dp_rank] += len(request.prompt) + request.params.max_tokens
    return min(range(size), key=loads.__getitem__)


@dataclass(frozen=True)
class RemoteOutput:
    """What a data-parallel rank's step produced for one of its requests (aborts are not reported: rank 0
    aborted them)."""

    request_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    num_cached_tokens: int


@dataclass(frozen=True)
class RankReport:
    """One data-parallel rank's step: its outputs, its state, and its counters since the start."""

    outputs: tuple[RemoteOutput, ...]
    state: DataParallelRankMetrics
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_computed: int = 0
    preemptions: int = 0


def encode_report(report: RankReport) -> list[int]:
    """A report as int64 values (the log-probabilities by their IEEE-754 bits: they arrive exactly)."""
    s = report.state
    out = [_MAGIC, s.running, s.waiting, s.kv_blocks_used, s.kv_blocks_total, s.step_tokens,
           report.prefix_cache_queries, report.prefix_cache_hits, report.prompt_tokens_computed, report.preemptions,
           len(report.outputs)]
    for o in report.outputs:
        out += [o.request_id, _FINISH_CODES[o.finish_reason], o.num_cached_tokens, len(o.token_ids), *o.token_ids,
                *(_float_bits(lp) for lp in o.logprobs)]
    return out


def decode_report(values: Sequence[int]) -> RankReport:
    if not values or values[0] != _MAGIC:
        raise RuntimeError("a data-parallel rank's step report is not in this version's format: every rank must run "
                           "the same megamoe")
    reasons = {code: reason for reason, code in _FINISH_CODES.items()}
    outputs, at = [], 11
    for _ in range(values[10]):
        request_id, code, cached, count = values[at:at + 4]
        at += 4
        tokens = tuple(values[at:at + count])
        logprobs = tuple(_bits_float(bits) for bits in values[at + count:at + 2 * count])
        at += 2 * count
        if code not in reasons:
            raise RuntimeError(f"a data-parallel rank's step report holds an unknown finish code {code}")
        outputs.append(RemoteOutput(request_id, tokens, logprobs, reasons[code], cached))
    return RankReport(tuple(outputs), DataParallelRankMetrics(*values[1:6]), *values[6:10])


class DataParallelSteps:
    """The per-step collectives of data-parallel attention over the data-parallel group of ``state`` (on
    ``device``, the model's: NCCL moves device tensors), and, on rank 0, the other ranks' latest reports."""

    def __init__(self, state, device, num_blocks: int):
        self.group, self.rank, self.size, self.device = state.dp.group, state.dp.rank, state.dp.size, device
        idle = DataParallelRankMetrics(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=num_blocks,
                                       step_tokens=0)
        self.reports = [RankReport((), idle) for _ in range(self.size)]      # rank 0: each rank's latest

    def any_work(self, scheduled: bool) -> bool:
        """Whether any data-parallel rank scheduled tokens this step (then every rank runs the model)."""
        return comms.any_rank(scheduled, self.group, self.device)

    def gather(self, report: RankReport) -> list[RankReport] | None:
        """Every rank's report, on rank 0 (None on the others): one gather over the data-parallel group."""
        values = torch.tensor(encode_report(report), dtype=torch.int64, device=self.device)
        sizes = comms.all_gather_sizes(values.numel(), self.group, self.device)
        gathered = comms.all_gather_into(values, self.group, sizes=sizes).cpu().tolist()
        if self.rank != 0:
            return None
        starts = [sum(sizes[:r]) for r in range(self.size)]
        self.reports = [decode_report(gathered[start:start + n]) for start, n in zip(starts, sizes)]
        return self.reports

    def combined_metrics(self, local: EngineMetrics) -> EngineMetrics:
        """Rank 0's ``local`` metrics (its own requests; tokens generated on every rank, which it appends) with
        the other ranks' latest states and counters added, and every rank's state listed."""
        own = DataParallelRankMetrics(running=local.running, waiting=local.waiting,
                                      kv_blocks_used=local.kv_blocks_used, kv_blocks_total=local.kv_blocks_total,
                                      step_tokens=self.reports[0].state.step_tokens)
        others = self.reports[1:]
        states = (own, *(r.state for r in others))
        return dataclasses.replace(
            local, running=sum(s.running for s in states), waiting=sum(s.waiting for s in states),
            kv_blocks_used=sum(s.kv_blocks_used for s in states), kv_blocks_total=sum(s.kv_blocks_total for s in states),
            prefix_cache_queries=local.prefix_cache_queries + sum(r.prefix_cache_queries for r in others),
            prefix_cache_hits=local.prefix_cache_hits + sum(r.prefix_cache_hits for r in others),
            prompt_tokens_computed=local.prompt_tokens_computed + sum(r.prompt_tokens_computed for r in others),
            preemptions=local.preemptions + sum(r.preemptions for r in others), data_parallel=states)


def report_of(outputs: Sequence[RequestOutput], scheduler, prompt_tokens_computed: int,
              step_tokens: int) -> RankReport:
    """This rank's report of a step: its ``outputs`` (aborts left out: rank 0 aborted them) and the state of its
    ``scheduler`` after it."""
    reported = tuple(RemoteOutput(o.request_id, tuple(o.new_token_ids), tuple(o.logprobs) if o.logprobs is not None
                                  else (0.0,) * len(o.new_token_ids), o.finish_reason, o.num_cached_tokens)
                     for o in outputs if o.finish_reason != "abort")
    state = DataParallelRankMetrics(running=len(scheduler.running), waiting=len(scheduler.waiting),
                                    kv_blocks_used=scheduler.pool.num_used, kv_blocks_total=scheduler.pool.num_blocks,
                                    step_tokens=step_tokens)
    cache = scheduler.prefix_cache
    return RankReport(reported, state, cache.queries if cache else 0, cache.hits if cache else 0,
                      prompt_tokens_computed, scheduler.preemptions)
