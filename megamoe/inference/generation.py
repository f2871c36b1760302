"""Batched generation with a KV cache: one prefill, then one decode step per new token.

Every rank of the model calls :func:`generate` (it is collective). Per step, each pipeline stage
receives the previous stage's hidden states (:func:`megamoe.comms.batch_send_recv`), runs its layers on
its own :class:`~megamoe.inference.kv_cache.StaticKVCache` per layer, and the last stage gathers the
vocabulary shards of the LAST position's logits over TP (a padded vocabulary's padding stripped:
:func:`~megamoe.tensor_parallel.vocab_padding.gather_vocab_parallel_logits`), picks the next tokens
(:mod:`megamoe.inference.sampling`) and broadcasts them over the pipeline group, so every rank
knows them and the next step starts.

Batches of prompts of different lengths are LEFT-padded: every row ends at the same cache index,
a decode step appends one column for the whole batch, the last position is every row's newest
token, and the index-based causal and sliding-window masks stay exact. A boolean mask
[B, prompt + new tokens] marks the real tokens; position ids count only real tokens (as HF). A row
that has finished (stop token) keeps running as padding: its later tokens are masked, skip the
MLP / MoE layers and are not counted in the expert load.

Positions. Every prompt plus ``max_new_tokens`` must fit in the model's positions, its rope's
``max_position_embeddings`` (:func:`max_sequence_length`): transformers caps its default ``max_length``
there and, past it, warns that a model may give "exceptions, performance degradation, or nothing at
all"; :func:`generate` refuses instead (the model would run, on positions it was never trained on),
naming how many new tokens fit. No limit where the model declares none (a config built by hand or by
``pretrain_moe.py``) nor for dynamic-NTK rope, which grows its base past that length by design: there
memory is the bound (``examples/generate.py`` estimates the KV cache before loading).

Compiled decoding (``generate(..., compiled=True)``): the prefill runs eagerly; every decode step
runs the model through ``torch.compile`` without host syncs (:meth:`GPTMoEModel.run_layers_static`):
the caches are written at a position held in a tensor, finished rows stay in the batch as padding
that reaches no expert, and the MoE layers compute their few (token, expert) pairs without sorting
(see :mod:`megamoe.moe.moe_layer`). The number of cached positions and the cache length are
dynamic dimensions of the compiled graph, and so is the batch size from two rows up, so the first
decode step compiles (tens of seconds on a CPU) and later steps and calls reuse it (a batch of one
row compiles its own graph; the time of steps that compiled is reported as
``GenerationOutput.compile_seconds``); tokens equal
the eager ones up to floating-point summation order. Collectives, sampling and the bookkeeping
between steps stay eager.

Requests and ranks. The ranks of a TP group and of a pipeline hold the same requests. Data-parallel
ranks either all pass the same prompts (replicated), or each passes its own (data-parallel
attention: attention runs on each rank's requests, the MoE layers are expert-parallel across ranks
through an all-to-all or an input-sharded all-gather dispatcher). Ranks may hold different numbers
of requests, zero included: a rank without requests runs one padding row, whose tokens reach no
expert, so that its collectives stay in step. All ranks run the same number of steps: after each
step the count of unfinished requests is summed over the data-parallel group, and generation stops
when it is zero or after ``max_new_tokens``. Pass global ``request_ids`` under data-parallel
attention so that sampled tokens do not depend on how requests are spread over ranks.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from megamoe import comms
from megamoe.host_values import host_ints
from megamoe.inference.kv_cache import StaticKVCache
from megamoe.inference.sampling import SamplingConfig, request_generator, sample_next_tokens
from megamoe.models.config import GPTMoEConfig
from megamoe.models.gpt_moe import GPTMoEModel
from megamoe.moe.placement.eplb import EPLBConfig, EPLBReport, ExpertRebalancer
from megamoe.pipeline.stage_dtype import stage_hidden_dtype
from megamoe.tensor_parallel.vocab_padding import gather_vocab_parallel_logits

__all__ = ["GenerationConfig", "GenerationOutput", "check_generation_request", "generate", "left_padded_batch",
           "max_sequence_length"]


@dataclass(frozen=True)
class GenerationConfig:
    """Stop after ``max_new_tokens`` new tokens, or at the first token in ``stop_token_ids`` (kept in
    the output). ``sampling``: greedy by default."""

    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"GenerationConfig.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        negative = [t for t in self.stop_token_ids if t < 0]
        if negative:
            raise ValueError(f"GenerationConfig.stop_token_ids {negative} are negative: token ids are >= 0")


@dataclass
class GenerationOutput:
    """This rank's requests, in the order given, with the timings this rank measured."""

    token_ids: list[list[int]]           # new tokens of each request (a stop token included)
    finish_reasons: list[str]            # "stop" (a stop token) or "length" (max_new_tokens)
    prompt_tokens: int                   # real (unpadded) prompt tokens
    prefill_seconds: float               # prefill forward up to the first new tokens
    decode_seconds: float                # every later step
    decode_steps: int                    # forward passes after the prefill (the same on every rank)
    compile_seconds: float = 0.0         # of decode_seconds, in steps during which torch.compile compiled
    compile_tokens: int = 0              # of decode_tokens, produced by those steps
    eplb_reports: list[EPLBReport] = field(default_factory=list)   # generate(eplb=...): each rebalancing round

    @property
    def decode_tokens(self) -> int:
        """New tokens produced by decode steps (each request's first token comes from the prefill)."""
        return sum(max(len(ids) - 1, 0) for ids in self.token_ids)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Over the decode steps that did not compile (``compiled=True``): their tokens in their time, the
        steady-state rate that a compilation of tens of seconds would otherwise hide (the compiling
        steps' time and tokens are ``compile_seconds`` and ``compile_tokens``)."""
        seconds = self.decode_seconds - self.compile_seconds
        return (self.decode_tokens - self.compile_tokens) / seconds if seconds > 0 else 0.0


def left_padded_batch(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one batch, padded on the left (as transformers' ``generate()``
    takes them): (ids [B, P] int64 with 0 as padding, mask [B, P] bool, True at real tokens)."""
    prompt_len = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), prompt_len, dtype=torch.int64)
    mask = torch.zeros(len(prompts), prompt_len, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, prompt_len - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
        mask[row, prompt_len - len(prompt):] = True
    return ids, mask


def _left_padded(prompts: list[list[int]], max_new_tokens: int, real: bool):
    """(ids [B, P], mask [B, P + max_new_tokens] with the real prompt tokens set, positions [B, P])."""
    ids, prompt_mask = left_padded_batch(prompts)
    mask = torch.zeros(len(prompts), ids.shape[1] + max_new_tokens, dtype=torch.bool)
    mask[:, :ids.shape[1]] = prompt_mask & real
    positions = (mask[:, :ids.shape[1]].cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, positions


def max_sequence_length(model_config: GPTMoEConfig) -> int | None:
    """The most positions (prompt + new tokens) one sequence may take: the model's
    ``max_position_embeddings``; None where it declares none or its rope is dynamic NTK (see the module
    docstring)."""
    rope = model_config.attention.rope
    return None if rope.rope_type == "dynamic" else rope.max_position_embeddings


def check_generation_request(model_config: GPTMoEConfig, prompts: Sequence[Sequence[int]],
                             config: GenerationConfig) -> list[list[int]]:
    """What :func:`generate` checks before it allocates anything (callable before a model is built, with
    its config): every prompt holds tokens, all of them and every stop token in the vocabulary, and
    each prompt with ``max_new_tokens`` fits in :func:`max_sequence_length`. ValueError naming the
    prompt (by index) or field; returns the prompts as lists of ints."""
    vocab_size = model_config.vocab_size
    outside = [t for t in config.stop_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(f"GenerationConfig.stop_token_ids {outside} are outside the model's vocabulary "
                         f"[0, {vocab_size}): no generated token could match them")
    limit = max_sequence_length(model_config)
    checked = []
    for index, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} holds token ids {bad[:4]} outside the vocabulary [0, {vocab_size})")
        if limit is not None and len(prompt) + config.max_new_tokens > limit:
            fix = (f"at most {limit - len(prompt)} new tokens fit after it" if len(prompt) < limit else
                   f"shorten it to at most {limit - 1} tokens")
            raise ValueError(f"prompt {index} ({len(prompt)} tokens) with GenerationConfig.max_new_tokens "
                             f"{config.max_new_tokens} needs {len(prompt) + config.max_new_tokens} positions, more "
                             f"than the model's {limit} (max_position_embeddings): {fix}")
        checked.append(prompt)
    return checked


def _stage_forward(model: GPTMoEModel, inputs, positions, caches, attention_mask, token_mask=None, chunk: int = 0):
    """This stage's layers (model chunk ``chunk`` of them with virtual pipeline stages): the last
    position's local logits [B, V / tp] on the last virtual stage, the hidden states [B, S, H] elsewhere.
    ``token_mask`` given: the step without host syncs (compiled decoding)."""
    if token_mask is None:
        hidden, _ = model.run_layers(inputs, positions, caches, attention_mask, chunk=chunk)
    else:
        hidden, _ = model.run_layers_static(inputs, positions, caches, attention_mask, token_mask, chunk=chunk)
    return model.logits(hidden[:, -1]) if model.chunk_is_last(chunk) else hidden


# One compiled callable for every model: dynamo caches a graph per model. The lengths that change
# from step to step and call to call are marked dynamic (see generate), so one graph serves them all.
# Made at the first compiled step: torch.compile imports dynamo and inductor, seconds of CPU in every
# process that imports this module, and most (training, eager decoding) never compile.
@functools.cache
def _compiled_stage_forward():
    return torch.compile(_stage_forward)


def _step(model: GPTMoEModel, state, inputs: torch.Tensor, positions: torch.Tensor, caches: dict,
          attention_mask: torch.Tensor, sampling: SamplingConfig, generators: list,
          token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One forward pass of the whole pipeline on ``inputs`` [B, S] token ids: the next token of every
    row [B], on every rank. With ``token_mask`` [B * S], the compiled step.

    With virtual pipeline stages the hidden states go around the pipeline ring once per model chunk
    (the last rank's chunk c feeds the first rank's chunk c + 1); each hop is one send and its receive,
    in order, so no two ranks wait on each other, each posted as a batch (comms.batch_send_recv): on NCCL
    the pipeline group's communicator carries it, not a two-rank one per neighbour pair."""
    batch, seq = inputs.shape
    device = attention_mask.device
    ranks = state.pp.ranks
    prev_rank, next_rank = ranks[(state.pp.rank - 1) % len(ranks)], ranks[(state.pp.rank + 1) % len(ranks)]
    forward = _stage_forward if token_mask is None else _compiled_stage_forward()
    tokens = None
    for chunk in range(getattr(model, "virtual_pipeline_stages", 1)):
        chunk_inputs = inputs
        if not model.chunk_is_first(chunk):
            buffer = torch.empty(batch, seq, model.config.hidden_size, dtype=stage_hidden_dtype(model), device=device)
            chunk_inputs, = comms.batch_send_recv([], [(buffer, prev_rank)], state.pp.group)
        output = forward(model, chunk_inputs, positions, caches, attention_mask, token_mask, chunk)
        if model.chunk_is_last(chunk):
            logits = gather_vocab_parallel_logits(output, state.tp.group, model.config.vocab_size)   # [B, V]
            tokens = sample_next_tokens(logits.float(), sampling, generators)
        else:
            comms.batch_send_recv([(output, next_rank)], [], state.pp.group)
    if tokens is None:
        tokens = torch.empty(batch, dtype=torch.int64, device=device)
    return comms.broadcast_(tokens, state.pp.ranks[-1], state.pp.group)


def _mark_dynamic(inputs, positions, visible, token_mask, caches: dict) -> None:
    """The sizes the compiled step takes as symbolic, so that one graph serves every step and later
    call: the number of cached positions, the cache length and, from two rows up, the batch size (a
    batch of one row gets its own graph: dynamo specialises sizes 0 and 1). The batch only "maybe":
    a model whose code branches on it is specialised instead of failing to compile."""
    buffers = [buffer for cache in caches.values() for buffer in cache.buffers]
    torch._dynamo.mark_dynamic(visible, 1)
    for buffer in buffers:
        torch._dynamo.mark_dynamic(buffer, buffer.dim() - 2)
    if inputs.shape[0] > 1:
        for tensor in (inputs, positions, visible, token_mask, *buffers):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


def _frames_compiled() -> int:
    """How many frames dynamo has compiled in this process (its own counter)."""
    return torch._dynamo.utils.counters["frames"]["total"]


def _any_unfinished(finished: torch.Tensor, state, device) -> bool:
    remaining = (~finished).sum().reshape(1).to(device)
    # A meta dry run (see megamoe.host_values) runs every step: its rows never finish.
    return host_ints(comms.all_reduce_(remaining, state.dp.group), on_meta=[1])[0] > 0


@torch.no_grad()
def generate(model: GPTMoEModel, state, prompts: Sequence[Sequence[int]], config: GenerationConfig, *,
             request_ids: Sequence[int] | None = None, compiled: bool = False, eplb: EPLBConfig | None = None,
             data_parallel_attention: bool = False) -> GenerationOutput:
    """Generate continuations of ``prompts`` (lists of token ids) on this rank's pipeline stage
    ``model`` of the layout ``state`` (see the module docstring for who passes which prompts).

    ``request_ids`` (default ``0 .. len(prompts) - 1``) seed each request's sampling generator.
    ``compiled``: decode steps through ``torch.compile`` (see the module docstring; every rank must
    pass the same). Returns this rank's requests' new token ids, why each stopped, and timings.

    ``eplb``: online expert rebalancing (:mod:`megamoe.moe.placement.eplb`) between decode steps: the load window
    and ``interval`` count forward passes (the prefill is the first); the KV caches are untouched, and
    ``GenerationOutput.eplb_reports`` lists the rounds. The load counts each token once, as
    :func:`~megamoe.inference.expert_load.gather_expert_load` does: pass ``data_parallel_attention=True``
    when each data-parallel rank serves its own requests (their loads are then summed). Not with
    ``compiled=True``: the compiled decode graph would keep the old placement's tables.
    """
    if state.cp.size > 1:
        raise ValueError(f"generation cannot split the sequence over the CP group (cp={state.cp.size}): the KV cache "
                         "and single-token decoding need every position on one rank; generate with a layout of cp=1 "
                         "(the same checkpoint loads into it)")
    prompts = check_generation_request(model.config, prompts, config)
    request_ids = list(range(len(prompts))) if request_ids is None else [int(r) for r in request_ids]
    if len(request_ids) != len(prompts):
        raise ValueError(f"request_ids has {len(request_ids)} entries for {len(prompts)} prompts")
    if eplb is not None and compiled:
        raise ValueError("generate(compiled=True) cannot rebalance experts (eplb): the compiled decode step captures "
                         "the expert placement's tables, which a rebalance replaces; pass compiled=False to rebalance, "
                         "or eplb=None to compile")
    rebalancer = None
    if eplb is not None:
        rebalancer = ExpertRebalancer(
            model, state, eplb, world_group=torch.distributed.group.WORLD if state.world_size > 1 else None,
            counts_tokens=state.tp.rank == 0 and (data_parallel_attention or state.dp.rank == 0),
            cumulative_counters=True)
    device = next(model.parameters()).device
    has_requests = bool(prompts)
    rows = prompts if has_requests else [[0]]                    # no request: one padding row
    ids, mask, positions = _left_padded(rows, config.max_new_tokens, real=has_requests)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    prompt_len = ids.shape[1]
    caches = {int(layer_id): StaticKVCache(mask.shape[1]) for layer_id in model.layers}
    sampling = config.sampling
    generators = [request_generator(sampling.seed, r) for r in (request_ids if has_requests else [-1])]
    finished = torch.full((len(rows),), not has_requests, dtype=torch.bool)
    new_ids: list[list[int]] = [[] for _ in prompts]
    reasons = ["length"] * len(prompts)
    stop_ids = set(config.stop_token_ids)

    started = time.perf_counter()
    tokens = _step(model, state, ids, positions, caches, mask[:, :prompt_len], sampling, generators)
    prefill_done = time.perf_counter()
    forward_passes = 1
    if rebalancer is not None:
        rebalancer.record()
    token_mask = None
    if compiled:                  # decode steps write every cache at one position held in a tensor
        write_index = torch.zeros(1, dtype=torch.int64, device=device)
        for cache in caches.values():
            cache.write_index = write_index
        token_mask = torch.empty(len(rows), dtype=torch.bool, device=device)
    decode_steps, compile_seconds, compile_tokens = 0, 0.0, 0
    for step in range(config.max_new_tokens):
        # The step's one host read of the sampled tokens (token 0 everywhere in a meta dry run).
        for row, token in enumerate(host_ints(tokens, on_meta=[0] * tokens.numel())[:len(prompts)]):
            if finished[row]:
                continue
            new_ids[row].append(token)
            if token in stop_ids:
                finished[row] = True
                reasons[row] = "stop"
        if step + 1 == config.max_new_tokens or not _any_unfinished(finished, state, device):
            break
        if rebalancer is not None and rebalancer.due(forward_passes):   # between decode steps
            rebalancer.rebalance(forward_passes)
        column = prompt_len + step                              # cache index of the token fed now
        mask[:, column] = ~finished.to(device)                  # finished rows continue as padding
        positions = positions[:, -1:] + 1
        visible, inputs = mask[:, :column + 1], tokens[:, None]
        if compiled:
            write_index.fill_(column)
            token_mask.copy_(mask[:, column])
            if step == 0:
                _mark_dynamic(inputs, positions, visible, token_mask, caches)
        frames_before = _frames_compiled() if compiled else 0
        step_started = time.perf_counter()
        tokens = _step(model, state, inputs, positions, caches, visible, sampling, generators, token_mask)
        if compiled and _frames_compiled() != frames_before:
            compile_seconds += time.perf_counter() - step_started
            compile_tokens += int((~finished[:len(prompts)]).sum())   # one new token per unfinished request
        decode_steps += 1
        forward_passes += 1
        if rebalancer is not None:
            rebalancer.record()
    return GenerationOutput(
        token_ids=new_ids, finish_reasons=reasons, prompt_tokens=sum(len(p) for p in prompts),
        prefill_seconds=prefill_done - started, decode_seconds=time.perf_counter() - prefill_done,
        decode_steps=decode_steps, compile_seconds=compile_seconds, compile_tokens=compile_tokens,
        eplb_reports=rebalancer.reports if rebalancer is not None else [])
