"""The serving engine: requests come and go between steps; each step runs the model once over a mixed batch.

Usage (one process; the scaled layouts build on the same calls)::

    engine = Engine(model, state, EngineConfig(kv_cache_memory=2**30), tokenizer=tokenizer)
    engine.add_request(0, prompt_ids, SamplingParams(max_tokens=32))
    for output in engine.run():        # or: while engine.has_unfinished(): engine.step()
        ...

A step: the scheduler (:mod:`megamoe.serving.scheduler`) picks decode tokens and prefill chunks under the
token budget; they are packed into one row [1, T] with their positions, every attention layer reads and
writes the paged KV cache through its view (:mod:`megamoe.serving.paged_kv_cache`), and the logits at each
request's last scheduled token, when that is its newest token, choose its next token
(:func:`megamoe.inference.sampling.sample_next_tokens`, requests grouped by their sampling rule, each with its
own generator). So a request's tokens depend only on its prompt, parameters, seed and id: greedy output
equals ``generate()``'s, seeded sampling equals ``generate(..., request_ids=[id])`` with the same seed (up to
the last bits a different batch can bring to the logits).

Pipeline and tensor parallelism follow ``generate()``: each stage receives the previous stage's hidden states,
the last stage gathers the logits over TP, samples, and broadcasts the tokens (and their log-probabilities)
over the pipeline group. Every rank must run the same schedule (rank 0 broadcasting it is the scaled layouts'
part); this module's own tests run one process. Under data-parallel attention (``EngineConfig.
data_parallel_attention``) each data-parallel rank runs its own schedule over its own requests and KV cache, and
the ranks run the model together whenever any has work (:mod:`megamoe.serving.data_parallel`).

Refused: context parallelism (the cache needs every position on one rank), sequence parallelism (build the
model without it: ``model.without_sequence_parallel()``), dynamic-NTK rope (its frequencies would depend on the
longest sequence of the batch, so on the other requests).
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from megamoe import comms
from megamoe.inference.generation import max_sequence_length
from megamoe.inference.sampling import request_generator, sample_next_tokens
from megamoe.machine_memory import available_memory_bytes, format_bytes
from megamoe.pipeline.stage_dtype import stage_hidden_dtype
from megamoe.serving.config import EngineConfig
from megamoe.serving.data_parallel import (DataParallelSteps, RemoteOutput, check_data_parallel_layout,
                                           check_moe_input, least_loaded, report_of)
from megamoe.serving.errors import QueueFullError
from megamoe.serving.metrics import EngineMetrics
from megamoe.serving.online_eplb import ServingRebalancer
from megamoe.serving.paged_kv_cache import PagedKVCache, ScheduledChunk, attention_layers
from megamoe.serving.request import Request, RequestOutput
from megamoe.serving.sampling_params import SamplingParams
from megamoe.serving.scheduler import Scheduler, StepSchedule
from megamoe.serving.speculation import MTPSpeculator, check_speculation
from megamoe.serving.step_broadcast import (ABORT, STOPPED, AddRequest, StepBroadcast, agree_num_blocks,
                                           schedule_digest)
from megamoe.tensor_parallel.vocab_padding import gather_vocab_parallel_logits

__all__ = ["Engine"]

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching over ``model`` (this rank's pipeline stage of the layout ``state``); see the module
    docstring. ``tokenizer`` (anything with ``decode(ids, skip_special_tokens=True)``) is needed for stop
    strings only."""

    def __init__(self, model, state, config: EngineConfig, tokenizer=None):
        if not isinstance(config, EngineConfig):
            raise ValueError(f"Engine needs an EngineConfig, got {type(config).__name__}")
        if state.cp.size > 1:
            raise ValueError(f"the engine cannot split sequences over the CP group (cp={state.cp.size}): the KV cache "
                             "needs every position on one rank; serve with a layout of cp=1 (the same checkpoint)")
        if getattr(model, "sequence_group", None) is not None:
            raise ValueError("the engine cannot serve a sequence-parallel model: build it with sequence_parallel=False "
                             "or pass model.without_sequence_parallel() (it computes the same function)")
        if model.config.attention.rope.rope_type == "dynamic":
            raise ValueError("the engine cannot serve dynamic-NTK rope: its frequencies depend on the longest sequence "
                             "in the batch, so a request's tokens would depend on the other requests")
        self.model, self.state, self.config, self.tokenizer = model.eval(), state, config, tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, stage_hidden_dtype(model)
        layer_ids = [i for chunk in model.chunk_layer_ids for i in chunk]
        if config.data_parallel_attention:
            check_data_parallel_layout(state.tp.size, state.pp.size, config.speculative_tokens)
        check_moe_input(model, state, config.data_parallel_attention)
        check_speculation(model, config.speculative_tokens)
        if config.speculative_tokens:
            layer_ids += list(model.mtp_layer_ids)
        layers = attention_layers(model, layer_ids)
        num_blocks = agree_num_blocks(self._num_blocks(layers), self.device)     # one pool size on every rank
        self.cache = PagedKVCache(layers, num_blocks, config.block_size, self.dtype, self.device)
        self.scheduler = Scheduler(config, num_blocks, window=self.cache.common_window,
                                   split_window=self.cache.split_window)
        # MTP drafts (megamoe.serving.speculation): verified in the next step's batch.
        self._speculator = MTPSpeculator(model, self.cache) if config.speculative_tokens else None
        self._hidden = None                               # the last step's hidden states (the drafts read them)
        self.max_positions = max_sequence_length(model.config)
        self.requests: dict[int, Request] = {}           # unfinished, by id
        self._arrivals = 0
        self._pending: list[RequestOutput] = []          # aborts reported by the next step
        self.prompt_tokens_computed = 0
        self.generated_tokens = 0
        # Under torchrun: rank 0 broadcasts each step's changes, the others follow (megamoe.serving.step_broadcast).
        self._broadcast = StepBroadcast(self.device) if state.world_size > 1 else None
        # Online expert rebalancing between steps (megamoe.serving.online_eplb); every rank runs the same steps.
        self.rebalancer = (ServingRebalancer(model, state, config.eplb_interval, config.data_parallel_attention)
                           if config.eplb_interval else None)
        # Data-parallel attention: each data-parallel rank its own requests (megamoe.serving.data_parallel).
        self._dp = (DataParallelSteps(state, self.device, num_blocks)
                    if config.data_parallel_attention and state.dp.size > 1 else None)
        self._dp_rank = self._dp.rank if self._dp is not None else 0
        logger.info("KV cache: %d blocks of %d positions (%s) over %d layers", num_blocks, config.block_size,
                    format_bytes(self.cache.nbytes), len(layers))

    def _num_blocks(self, layers) -> int:
        per_block = PagedKVCache.bytes_per_block(layers, self.config.block_size, self.dtype)
        budget = self.config.kv_cache_memory
        if budget is None:
            available, what = available_memory_bytes(self.device)
            if available is None:
                raise ValueError(f"EngineConfig.kv_cache_memory is None but the {what} is unknown: pass the KV cache "
                                 "size in bytes")
            budget = int(available * self.config.kv_cache_memory_fraction)
        num_blocks = budget // per_block if per_block else 1
        if num_blocks < 1:
            raise ValueError(f"EngineConfig.kv_cache_memory ({budget} bytes) holds no KV block: one block of "
                             f"{self.config.block_size} positions takes {per_block} bytes over this stage's "
                             f"{len(layers)} layers; give at least that much")
        return num_blocks

    # -- requests

    def add_request(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; ValueError naming the problem for a bad one, QueueFullError when the queue is full."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise ValueError(f"request_id must be an integer, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id} is already in the engine; give each request its own id")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = self._check_prompt(prompt_token_ids, params)
        dp_rank = least_loaded(self.requests.values(), self._dp.size) if self._dp is not None else 0
        if self._waiting_on(dp_rank) >= self.config.max_waiting:
            raise QueueFullError(f"the engine's queue is full ({self.config.max_waiting} waiting requests, "
                                 "EngineConfig.max_waiting): retry later")
        self._admit(request_id, prompt, params, dp_rank)
        if self._broadcast is not None:
            self._broadcast.record(AddRequest(request_id, tuple(prompt), params, dp_rank))

    def _admit(self, request_id: int, prompt: list[int], params: SamplingParams, dp_rank: int) -> None:
        """Hold a checked request; schedule it when this rank serves it (under data-parallel attention rank 0
        holds the others' requests too, as mirrors: :meth:`_merge_remote`)."""
        request = Request(request_id, prompt, params, request_generator(params.seed, request_id), self._arrivals,
                          dp_rank=dp_rank)
        self._arrivals += 1
        self.requests[request_id] = request
        if dp_rank == self._dp_rank:
            self.scheduler.add(request)

    def _waiting_on(self, dp_rank: int) -> int:
        """Requests waiting on data-parallel rank ``dp_rank``: another's, as rank 0 knows them (no token yet)."""
        if dp_rank == self._dp_rank:
            return len(self.scheduler.waiting)
        return sum(1 for r in self.requests.values() if r.dp_rank == dp_rank and not r.output)

    def _check_prompt(self, prompt_token_ids, params: SamplingParams) -> list[int]:
        vocab = self.model.config.vocab_size
        if isinstance(prompt_token_ids, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
            raise ValueError("prompt_token_ids must be a list of integer token ids")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty: it needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the prompt holds token ids {bad[:4]} outside the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop (stop strings) needs the engine's tokenizer: pass Engine(..., "
                             "tokenizer=...) or use stop_token_ids")
        positions = len(prompt) + params.max_tokens
        if self.max_positions is not None and positions > self.max_positions:
            fix = (f"at most {self.max_positions - len(prompt)} new tokens fit after it" if len(prompt) <
                   self.max_positions else f"shorten it to at most {self.max_positions - 1} tokens")
            raise ValueError(f"the prompt ({len(prompt)} tokens) with max_tokens {params.max_tokens} needs "
                             f"{positions} positions, more than the model's context of {self.max_positions}: {fix}")
        block_size, window = self.config.block_size, self.cache.common_window
        blocks = -(-positions // block_size)
        if window is not None:      # blocks behind every layer's window are released: a step holds at most these
            blocks = self._sliding_blocks(blocks, window)
        elif self.cache.split_window is not None:      # the full layers' table, and the sliding layers' own
            blocks += self._sliding_blocks(blocks, self.cache.split_window)
        if blocks > self.cache.num_blocks:
            raise ValueError(f"the prompt ({len(prompt)} tokens) with max_tokens {params.max_tokens} needs "
                             f"{blocks} KV blocks, more than the whole KV cache holds "
                             f"({self.cache.num_blocks} blocks of {block_size} positions): lower max_tokens or raise "
                             "EngineConfig.kv_cache_memory")
        return prompt

    def _sliding_blocks(self, blocks: int, window: int) -> int:
        """Of a request's ``blocks``, those a sliding table holds at most in one step (the ones wholly behind
        ``window`` are released)."""
        return min(blocks, -(-(window - 1 + self.config.max_num_batched_tokens) // self.config.block_size) + 1)

    def abort(self, request_id: int) -> None:
        """End a request now (a client disconnect): its blocks are released at once and the next step reports it
        with finish_reason "abort". An id the engine does not hold (finished already, or unknown) is ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if self._broadcast is not None:
            self._broadcast.record((ABORT, request_id))
        self.scheduler.finish(request)
        request.finish_reason = "abort"
        self._pending.append(request.report([], []))

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # -- steps

    def step(self) -> list[RequestOutput]:
        """One model call over the scheduled tokens; an output for every request that got tokens or ended.
        Under torchrun, on rank 0 only (it first broadcasts the changes since the last step; the other ranks run
        :meth:`follow`)."""
        if self._broadcast is not None:
            if not self._broadcast.is_source:
                raise RuntimeError("under torchrun only rank 0 calls Engine.step(); the other ranks call "
                                   "Engine.follow(), which runs the steps rank 0 broadcasts")
            self._broadcast.send()
        return self._step()

    def follow(self) -> None:
        """On every rank but 0 under torchrun: apply rank 0's changes and run its steps, until its
        :meth:`shutdown` (see :mod:`megamoe.serving.step_broadcast`)."""
        if self._broadcast is None or self._broadcast.is_source:
            raise RuntimeError("Engine.follow() runs on the ranks other than 0 under torchrun; rank 0 calls step()")
        while True:
            message = self._broadcast.receive()
            if message.shutdown:
                return
            for change in message.changes:
                if isinstance(change, AddRequest):           # checked by rank 0; added where it is served
                    if change.dp_rank == self._dp_rank:
                        self._admit(change.request_id, list(change.prompt), change.params, change.dp_rank)
                else:
                    self.abort(change[1])
            self._step()

    def shutdown(self) -> None:
        """On rank 0 under torchrun: end the other ranks' :meth:`follow`. Nothing to do in one process."""
        if self._broadcast is not None and self._broadcast.is_source:
            self._broadcast.send(shutdown=True)

    def _step(self) -> list[RequestOutput]:
        """One step on this rank (every rank runs the same steps), then an expert rebalancing round when one is
        due: counted in steps, model-less ones included, so that every rank counts alike in every layout."""
        outputs = self._model_step()
        if self.rebalancer is not None:
            self.rebalancer.after_step()
        return outputs

    @torch.no_grad()
    def _model_step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        speculator = self._speculator
        if speculator is not None:
            speculator.attach(self.scheduler.running)
        schedule = self.scheduler.schedule()
        if speculator is not None:
            speculator.keep_scheduled(schedule.chunks)
        if self._broadcast is not None and self._dp is None:
            self._broadcast.last_digest = schedule_digest(schedule.chunks)
        if not schedule.chunks and (self.scheduler.running or self.scheduler.waiting):
            # Cannot happen: every admitted request fits in the pool alone.
            raise RuntimeError(f"the scheduler found no work for {len(self.scheduler.running)} running and "
                               f"{len(self.scheduler.waiting)} waiting requests ({self.scheduler.pool.num_free} of "
                               f"{self.scheduler.pool.num_blocks} KV blocks free)")
        if not self._runs_model(schedule):
            return outputs
        tokens, logprobs = self._forward(schedule)
        drafted = {}
        if speculator is not None and speculator.drafts:
            speculator.detach()
            drafted = speculator.verify_greedy(schedule.chunks, self._hidden)   # (token, logprob) before each draft
        sampled = iter(zip(tokens, logprobs))
        committed, row = [], 0                 # (request, first position, committed positions, first row)
        for request, count in schedule.chunks:
            start = request.num_computed
            if request in drafted:             # a decode token and its draft: verify
                kept, rollback = speculator.verify(request, *drafted[request], *next(sampled))
                request.num_computed += count - rollback
                new = []
                for token, logprob in kept:
                    if request.finished:
                        break
                    if request.num_tokens == request.num_computed:     # the tokens cover the computed positions
                        self.scheduler.register_full_blocks(request)
                    self._append(request, token, logprob)
                    new.append((token, logprob))
                outputs.append(request.report([t for t, _ in new], [lp for _, lp in new]))
            else:
                request.num_computed += count
                self.scheduler.register_full_blocks(request)
                if request.num_computed < request.num_tokens:       # a prefill chunk before the last
                    self.prompt_tokens_computed += count
                else:
                    self.prompt_tokens_computed += count - 1
                    token, logprob = next(sampled)
                    self._append(request, token, logprob)
                    outputs.append(request.report([token], [logprob]))
            if speculator is not None and not request.finished:
                committed.append((request, start, request.num_computed - start, row))
            row += count
        if speculator is not None:
            speculator.draft(committed, self._hidden)
        if self._dp is not None:
            outputs = self._data_parallel_outputs(outputs, sum(count for _, count in schedule.chunks))
        return outputs

    # -- data-parallel attention (megamoe.serving.data_parallel)

    def _runs_model(self, schedule: StepSchedule) -> bool:
        """Whether this step runs the model: tokens are scheduled here or, under data-parallel attention, on any
        data-parallel rank (one all-reduce; a rank with nothing scheduled then runs it over an empty row)."""
        if self._dp is None:
            return bool(schedule.chunks)
        return self._dp.any_work(bool(schedule.chunks))

    def _data_parallel_outputs(self, outputs: list[RequestOutput], step_tokens: int) -> list[RequestOutput]:
        """After a step that ran the model: every data-parallel rank's report reaches rank 0 (one gather), which
        adds the other ranks' outputs to its own."""
        reports = self._dp.gather(report_of(outputs, self.scheduler, self.prompt_tokens_computed, step_tokens))
        if reports is None:                 # not rank 0: it reports this rank's requests
            return outputs
        for dp_rank, report in enumerate(reports[1:], start=1):
            outputs.extend(self._merge_remote(dp_rank, remote) for remote in report.outputs)
        return outputs

    def _merge_remote(self, dp_rank: int, remote: RemoteOutput) -> RequestOutput:
        """Rank 0: data-parallel rank ``dp_rank``'s new tokens of one of its requests, appended to rank 0's mirror
        of it (stop strings are checked here: a stop reaches that rank before the next step)."""
        request = self.requests.get(remote.request_id)
        if request is None or request.dp_rank != dp_rank:
            raise RuntimeError(f"data-parallel rank {dp_rank} reported request {remote.request_id}, which rank 0 does "
                               "not hold there: the ranks' engines diverged; every rank must serve the same "
                               "checkpoint with the same settings")
        request.num_cached_tokens = remote.num_cached_tokens
        new = []
        for token, logprob in zip(remote.token_ids, remote.logprobs):
            if request.finished:
                break
            self._append(request, token, logprob)
            new.append((token, logprob))
        if remote.finish_reason is not None and not request.finished:
            raise RuntimeError(f"data-parallel rank {dp_rank} finished request {remote.request_id} "
                               f"({remote.finish_reason}) after {len(request.output)} tokens, rank 0 did not: the "
                               "ranks' engines diverged")
        return request.report([t for t, _ in new], [lp for _, lp in new])

    def run(self) -> Iterator[RequestOutput]:
        """Steps until every request finished, yielding each step's outputs."""
        while self.has_unfinished():
            yield from self.step()

    def _append(self, request: Request, token: int, logprob: float) -> None:
        request.output.append(token)
        request.logprobs.append(logprob)
        self.generated_tokens += 1
        params = request.params
        if token in params.stop_token_ids:
            request.finish_reason, request.stop_reason = "stop", token
        elif params.stop and (stop := self._stop_string(request)) is not None:
            request.finish_reason, request.stop_reason = "stop", stop
            if self._broadcast is not None:           # the other ranks get no stop strings: rank 0 ends it there
                self._broadcast.record((STOPPED, request.request_id))
        elif len(request.output) >= params.max_tokens:
            request.finish_reason = "length"
        if request.finished:
            del self.requests[request.request_id]
            self.scheduler.finish(request)

    def _stop_string(self, request: Request) -> str | None:
        """The first stop string in the decoded new tokens, searching only text that a new token could complete."""
        text = self.tokenizer.decode(request.output, skip_special_tokens=True)
        start = max(0, request.text_checked - max(len(s) for s in request.params.stop) + 1)
        request.text_checked = len(text)
        found = [(text.find(s, start), s) for s in request.params.stop]
        found = [(at, s) for at, s in found if at >= 0]
        return min(found)[1] if found else None

    def _forward(self, schedule: StepSchedule) -> tuple[list[int], list[float]]:
        """The model over the packed step; the new token and its log-probability of every request whose chunk
        reaches its newest token, in schedule order (on every rank)."""
        model, state = self.model, self.state
        inputs, positions, rows = [], [], []
        for request, count in schedule.chunks:
            start = request.num_computed
            inputs.extend(request.token_slice(start, start + count))
            positions.extend(range(start, start + count))
            if start + count == request.num_tokens:
                rows.append(len(inputs) - 1)
        ids = torch.tensor([inputs], dtype=torch.int64, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.int64, device=self.device)
        views = self.cache.views([ScheduledChunk(r.block_table, r.num_computed, count, r.window_table)
                                  for r, count in schedule.chunks])
        pp = state.pp
        prev_rank, next_rank = pp.ranks[(pp.rank - 1) % pp.size], pp.ranks[(pp.rank + 1) % pp.size]
        result = None
        for chunk in range(getattr(model, "virtual_pipeline_stages", 1)):
            chunk_inputs = ids
            if not model.chunk_is_first(chunk):
                buffer = torch.empty(1, len(inputs), model.config.hidden_size, dtype=self.dtype, device=self.device)
                chunk_inputs, = comms.batch_send_recv([], [(buffer, prev_rank)], pp.group)
            hidden, _ = model.run_layers(chunk_inputs, position_ids, views, chunk=chunk)
            if model.chunk_is_last(chunk):
                self._hidden = hidden
                index = torch.tensor(rows, dtype=torch.int64, device=self.device)
                logits = gather_vocab_parallel_logits(model.logits(hidden[0].index_select(0, index)), state.tp.group,
                                                      model.config.vocab_size).float()
                result = self._sample(schedule, logits)
            else:
                comms.batch_send_recv([(hidden, next_rank)], [], pp.group)
        if result is None:
            result = torch.empty(2, len(rows), dtype=torch.float64, device=self.device)
        result = comms.broadcast_(result, pp.ranks[-1], pp.group).cpu()
        return [int(t) for t in result[0].tolist()], result[1].tolist()

    def _sample(self, schedule: StepSchedule, logits: torch.Tensor) -> torch.Tensor:
        """[2, rows] float64: the chosen token of every sampled row and its log-probability."""
        sampling_requests = [r for r, count in schedule.chunks if r.num_computed + count == r.num_tokens]
        tokens = torch.empty(len(sampling_requests), dtype=torch.int64, device=logits.device)
        groups: dict = {}
        for row, request in enumerate(sampling_requests):
            groups.setdefault(request.params.sampling, []).append(row)
        for sampling, rows in groups.items():
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            generators = [sampling_requests[row].generator for row in rows]
            tokens[index] = sample_next_tokens(logits.index_select(0, index), sampling, generators)
        logprobs = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return torch.stack([tokens.double(), logprobs])

    # -- metrics

    def metrics(self) -> EngineMetrics:
        scheduler = self.scheduler
        cache = scheduler.prefix_cache
        balance = {layer_id: layer.placement.balancedness(layer.load_counter.per_expert)
                   for layer_id, layer in self.model.moe_layers().items()}
        metrics = EngineMetrics(
            running=len(scheduler.running), waiting=len(scheduler.waiting), kv_blocks_used=scheduler.pool.num_used,
            kv_blocks_total=scheduler.pool.num_blocks, prefix_cache_queries=cache.queries if cache else 0,
            prefix_cache_hits=cache.hits if cache else 0, prompt_tokens_computed=self.prompt_tokens_computed,
            generated_tokens=self.generated_tokens, preemptions=scheduler.preemptions,
            spec_proposed=self._speculator.proposed if self._speculator else 0,
            spec_accepted=self._speculator.accepted if self._speculator else 0, expert_balancedness=balance)
        if self._dp is not None and self._dp.rank == 0:      # every data-parallel rank's, added up and listed
            metrics = self._dp.combined_metrics(metrics)
        return metrics
