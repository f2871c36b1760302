"""Serving: the megamoe engine against static generate() and transformers' continuous batching, same weights.

    python benchmarks/serving.py [--tiny] [--models qwen3_moe deepseek_v3] [--bf16] [--threads 1] [--json out.json]

One process, CPU, fp32 (``--bf16``: also bf16 rows), greedy, no stop token (every request generates exactly its
``max_tokens``, so every system produces the same number of tokens per request). A Qwen3-MoE-like model and a
DeepSeek-V3-like model (MLA, one MTP layer) are built by transformers with seeded random weights and imported
into megamoe through the HF adapter, so every system runs the same weights (the MTP layer exists on megamoe's
side only). The DeepSeek-V3-like model is first trained, main and MTP losses together (megamoe's Trainer,
``train_steps`` steps), on a seeded synthetic corpus with structure (:func:`structured_corpus`: each token
followed by its fixed successor 90% of the time), and its trained weights are copied to transformers' model
(:func:`train_on_corpus`; cached under ``--train-cache``): random MTP weights draft nothing a random model
accepts (acceptance 0.00 on the random model, the same through ``generate_with_mtp_draft`` and teacher-forced:
the random model's greedy continuations are unpredictable), a head trained with its model does.

On a host shared with other jobs run it with ``--threads 1``: two intra-op threads on two busy vCPUs made tiny
steps tens of times slower (each op waits for the descheduled thread).

Load: seeded traces (:func:`make_trace`) of requests with prompt and output lengths drawn uniformly from
ranges. Scenarios, each over the same trace for every system:

- ``offline``: every request queued at t = 0;
- ``online``: Poisson arrivals at ``--online-load`` (0.7) of the engine's offline request rate;
- ``shared_prefix``: offline, every prompt a shared ``--system-prompt`` (512) token prefix plus its own tokens;
- ``mtp`` (models with MTP layers): one request at a time (batch 1), prompts from the training corpus, the
  engine with and without MTP drafts, interleaved request by request.

Systems:

- ``hf/cb``: transformers' continuous batching (the manager ``generate_batch`` runs, ``sdpa_paged``), fed each
  request at its arrival with its own ``max_new_tokens``;
- ``hf/static-B`` and ``megamoe/static-B``: a static server over ``generate()``: whenever it is idle it takes up
  to B arrived requests, runs them as one left-padded batch to their longest ``max_tokens`` and returns them;
- ``engine`` (prefix caching on), ``engine/no-prefix``, and ``engine/mtp`` (``speculative_tokens``): the
  megamoe engine, stepped as a server would, requests added at their arrival, up to ``MAX_SEQS`` (256) running
  under a ``TOKEN_BUDGET`` (512) token step budget (transformers' manager gets the same budget and block size).
- with ``--bf16``, the ``offline_bf16`` rows: both models' weights rounded to bf16, the static servers at their
  fp32 best batch size and the engine (``same_ids`` against megamoe's bf16 static generate()).

Per system: output tokens/s (every request's own tokens over the time from the first arrival to the last
finish), TTFT p50/p99 (first token - arrival), TPOT p50/p99 (per request: (finish - first token) / (tokens -
1)), peak KV memory (positions held at once x the model's KV bytes per position), and for the engine the prompt
tokens it computed (prefix-cache hits are not). Token times: the engine's step that returns them; transformers'
from its own timestamps (``hf/cb``) or a stopping criterion called once per generated token (``hf/static``);
megamoe's static ``generate()`` reports its prefill and decode seconds, and its k-th token is placed at
prefill + k x the mean decode step. The tokens of every system are compared with megamoe's static generate()
(``same_ids``: the fraction of requests with identical ids).

Targets (issue 31), as ratios measured in this run: offline engine >= 1.5x the best static row and >= 4x
``hf/cb``; online p99 TTFT <= 1/3 of the best static system's (its best offline batch size); the shared prefix
cuts the engine's computed prompt tokens >= 3x; MTP >= 1.3x decode tokens/s at batch 1. Writes JSON (default
benchmarks/results/serving.json) and prints a table.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import tqdm

from common import argument_parser, write_results  # sibling module
from megamoe.hf.adapters import adapter_for
from megamoe.inference.generation import GenerationConfig, generate, left_padded_batch
from megamoe.inference.generation_memory import estimate_generation_memory
from megamoe.models import GPTMoEModel
from megamoe.models.families import config_from_hf
from megamoe.models.hf_loading import gather_logical_state, load_logical_state
from parallel_state import ParallelState

log = logging.getLogger("benchmarks.serving")

FULL = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, vocab_size=8192, max_position_embeddings=2048,
            moe_intermediate_size=256, intermediate_size=512, num_experts_per_tok=2, experts=16)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512, max_position_embeddings=256,
            moe_intermediate_size=32, intermediate_size=64, num_experts_per_tok=2, experts=4)
SCENARIOS = ("offline", "online", "shared_prefix", "mtp")
BLOCK_SIZE = 16          # KV block (page) size of the engine and of transformers' continuous batching
TOKEN_BUDGET = 512       # tokens per step of both
MAX_SEQS = 256           # requests the engine runs at once (transformers' manager: as many as its budget and pool hold)
MTP_LOSS_COEFF = 0.3     # DeepSeek-V3's weight of the MTP loss (its first 10T training tokens)
TARGETS = {"offline_over_best_static": 1.5, "offline_over_hf_cb": 4.0, "online_ttft_p99_over_best_static": 1 / 3,
           "shared_prefix_prefill_cut": 3.0, "mtp_decode_speedup": 1.3}


def hf_config(family: str, size: dict):
    import transformers
    common = dict(vocab_size=size["vocab_size"], hidden_size=size["hidden_size"],
                  num_hidden_layers=size["num_hidden_layers"], num_attention_heads=size["num_attention_heads"],
                  max_position_embeddings=size["max_position_embeddings"], num_experts_per_tok=size["num_experts_per_tok"],
                  moe_intermediate_size=size["moe_intermediate_size"], intermediate_size=size["intermediate_size"],
                  tie_word_embeddings=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    head_dim = size["hidden_size"] // size["num_attention_heads"]
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=head_dim,
                                           num_experts=size["experts"], norm_topk_prob=True)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, num_key_value_heads=size["num_attention_heads"], n_routed_experts=size["experts"],
            n_shared_experts=1, kv_lora_rank=head_dim, q_lora_rank=3 * head_dim // 2, qk_nope_head_dim=head_dim // 2,
            qk_rope_head_dim=head_dim // 4, v_head_dim=head_dim // 2, first_k_dense_replace=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5)
    raise ValueError(f"--models: unknown family {family!r} (qwen3_moe, deepseek_v3)")


def build_models(family: str, size: dict, seed: int, attn_implementation: str = "sdpa"):
    """(transformers model, megamoe model) holding the same weights; the DeepSeek-V3-like megamoe model also
    has one MTP layer (megamoe's own initialization, trained with the model by :func:`train_on_corpus`)."""
    import transformers
    cfg = hf_config(family, size)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation).eval()
    plain = config_from_hf(cfg, expert_backend="torch")
    mtp_layers = 1 if family == "deepseek_v3" else 0
    config = dataclasses.replace(config_from_hf(cfg, expert_backend="torch", mtp_num_layers=mtp_layers),
                                 mtp_loss_coeff=MTP_LOSS_COEFF) if mtp_layers else plain
    model = GPTMoEModel(config, ParallelState.single_process()).eval()
    logical = gather_logical_state(model)                       # the MTP layer keeps its own initialization
    logical.update(adapter_for(family).hf_to_megamoe(hf.state_dict(), plain))
    load_logical_state(model, logical)
    return hf, model


def structured_corpus(count: int, length: int, *, seed: int, alphabet: int, follow: float = 0.9) -> torch.Tensor:
    """[count, length] token ids of a seeded synthetic language with structure: over the ids 1..``alphabet``, each
    token is followed by its fixed successor (a seeded permutation) with probability ``follow``, else by a
    uniformly drawn id. A model trained on it predicts the successor; greedy continuations follow the chain."""
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(alphabet, generator=generator) + 1                  # successor[t - 1]
    out = torch.empty(count, length, dtype=torch.int64)
    out[:, 0] = torch.randint(1, alphabet + 1, (count,), generator=generator)
    for i in range(1, length):
        jump = torch.rand(count, generator=generator) >= follow
        out[:, i] = torch.where(jump, torch.randint(1, alphabet + 1, (count,), generator=generator),
                                successor[out[:, i - 1] - 1])
    return out


def train_on_corpus(hf, model: GPTMoEModel, family: str, steps: int, seed: int, alphabet: int,
                    cache_dir: str | None = None, batch: int = 8, length: int = 32) -> dict:
    """Train ``model`` (main and MTP losses, megamoe's Trainer, Adam at 3e-3) for ``steps`` steps of ``batch``
    sequences of :func:`structured_corpus`, then copy the main model's weights into ``hf`` (so every side serves
    the same trained weights): an MTP head trained with its model drafts what the model then accepts (random MTP
    weights draft nothing a random model accepts: acceptance 0.00). With ``cache_dir``, the trained weights are
    kept there (safetensors, named by everything that decides them) and a later run with the same settings loads
    them instead of training. Returns what it did, for the results."""
    import safetensors.torch
    from megamoe.training.trainer import TrainConfig, Trainer
    names = gather_logical_state(model)
    key = hashlib.sha256(repr((family, model.config, seed, steps, alphabet, batch, length)).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"serving_{family}_{key}.safetensors" if cache_dir else None
    if path is not None and path.exists():
        logical = safetensors.torch.load_file(str(path))
        if {k: tuple(v.shape) for k, v in logical.items()} != {k: tuple(v.shape) for k, v in names.items()}:
            raise RuntimeError(f"{path} does not hold this model's tensors: delete it to train again")
        load_logical_state(model, logical)
        info = {"steps": steps, "cached": str(path)}
    else:
        state = ParallelState.single_process()
        corpus = structured_corpus(steps * batch, length + 1, seed=seed, alphabet=alphabet)
        trainer = Trainer(model, state, TrainConfig(lr=3e-3))
        model.train()
        started, losses = time.perf_counter(), []
        for step in tqdm.trange(steps, desc=f"training {family}", disable=None):
            ids = corpus[step * batch:(step + 1) * batch]
            losses.append(trainer.train_step([(ids[:, :-1], ids[:, 1:])]).loss)
        model.eval()
        for p in model.parameters():
            p.grad = None
        info = {"steps": steps, "first_loss": losses[0], "last_loss": losses[-1],
                "seconds": time.perf_counter() - started}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            safetensors.torch.save_file({k: v.contiguous() for k, v in gather_logical_state(model).items()},
                                        str(partial))
            partial.replace(path)
    plain = config_from_hf(hf.config, expert_backend="torch")
    mtp = tuple(f"layers.{i}." for i in model.mtp_layer_ids)
    logical = {k: v for k, v in gather_logical_state(model).items() if not k.startswith(mtp)}
    missing, unexpected = hf.load_state_dict(adapter_for(family).megamoe_to_hf(logical, plain, fused=True),
                                             strict=False)
    if missing or unexpected:
        raise RuntimeError(f"the trained weights do not fit transformers' model: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    return dict(info, alphabet=alphabet, batch=batch, length=length)


# ---------------------------------------------------------------------------------------------------- load
@dataclass(frozen=True)
class TraceRequest:
    request_id: int
    arrival_s: float
    prompt: list[int]
    max_tokens: int


def make_trace(count: int, *, seed: int, vocab_size: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
               rate_per_s: float | None = None, shared_prefix: int = 0) -> list[TraceRequest]:
    """``count`` requests, seeded: prompt and output lengths uniform in the (inclusive) ranges, token ids uniform
    in [1, vocab); arrivals all at 0 (``rate_per_s`` None) or a Poisson process of that rate (exponential gaps);
    with ``shared_prefix``, every prompt starts with the same that many tokens."""
    if count < 1 or prompt_lens[0] < 1 or output_lens[0] < 1:
        raise ValueError("make_trace needs count >= 1 and lengths >= 1")
    generator = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=generator))    # noqa: E731
    prefix = torch.randint(1, vocab_size, (shared_prefix,), generator=generator).tolist()
    trace, clock = [], 0.0
    for request_id in range(count):
        if rate_per_s is not None:
            clock += float(torch.empty(1).exponential_(rate_per_s, generator=generator))
        prompt = prefix + torch.randint(1, vocab_size, (draw(*prompt_lens),), generator=generator).tolist()
        trace.append(TraceRequest(request_id, clock, prompt, draw(*output_lens)))
    return trace


@dataclass
class Served:
    """One request as a system served it (times in seconds from the trace's start)."""
    arrival_s: float
    first_token_s: float
    finish_s: float
    token_ids: list[int]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(served: dict[int, Served], trace: list[TraceRequest], reference: dict[int, list[int]] | None,
              peak_kv_bytes: int, **extra) -> dict:
    missing = [r.request_id for r in trace if r.request_id not in served]
    if missing:
        raise RuntimeError(f"requests {missing[:5]} were never served")
    tokens = sum(len(s.token_ids) for s in served.values())
    start = min(r.arrival_s for r in trace)
    makespan = max(s.finish_s for s in served.values()) - start
    ttft = [s.first_token_s - s.arrival_s for s in served.values()]
    tpot = [(s.finish_s - s.first_token_s) / (len(s.token_ids) - 1) for s in served.values() if len(s.token_ids) > 1]
    row = {"output_tokens": tokens, "makespan_s": makespan, "output_tokens_per_s": tokens / makespan,
           "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "tpot_p50_s": percentile(tpot, 50) if tpot else 0.0, "tpot_p99_s": percentile(tpot, 99) if tpot else 0.0,
           "peak_kv_bytes": int(peak_kv_bytes)}
    if reference is not None:
        row["same_ids"] = sum(served[i].token_ids == ids for i, ids in reference.items()) / len(reference)
    row.update(extra)
    return row


class Clock:
    """Seconds since the trace started; sleeps until an arrival."""

    def __init__(self):
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


def kv_bytes_per_position(model: GPTMoEModel) -> int:
    return estimate_generation_memory(model.config, batch=1, sequence_length=1).kv_cache_bytes


# -------------------------------------------------------------------------------------------------- systems
def static_server(trace: list[TraceRequest], batch: int, run_batch, kv_per_position: int) -> tuple[dict, int]:
    """A server over a static ``generate()``: when idle it takes up to ``batch`` arrived requests and runs them
    to their longest ``max_tokens``. ``run_batch(prompts, new_tokens, clock)`` -> (ids per row, the time of
    each generated step)."""
    pending, served, peak = deque(sorted(trace, key=lambda r: r.arrival_s)), {}, 0
    clock = Clock()
    while pending:
        clock.wait_until(pending[0].arrival_s)
        now = clock.now()
        group = []
        while pending and len(group) < batch and pending[0].arrival_s <= now:
            group.append(pending.popleft())
        new_tokens = max(r.max_tokens for r in group)
        peak = max(peak, len(group) * (max(len(r.prompt) for r in group) + new_tokens) * kv_per_position)
        ids, step_times = run_batch([r.prompt for r in group], new_tokens, clock)
        for r, row in zip(group, ids):
            served[r.request_id] = Served(r.arrival_s, step_times[0], step_times[r.max_tokens - 1], row[:r.max_tokens])
    return served, peak


def megamoe_static_batch(model: GPTMoEModel):
    state = ParallelState.single_process()

    def run(prompts, new_tokens, clock):
        started = clock.now()
        out = generate(model, state, prompts, GenerationConfig(max_new_tokens=new_tokens))
        step = out.decode_seconds / out.decode_steps if out.decode_steps else 0.0
        first = started + out.prefill_seconds
        return out.token_ids, [first + k * step for k in range(new_tokens)]
    return run


def hf_static_batch(hf):
    import transformers

    class StepTimes(transformers.StoppingCriteria):
        def __init__(self, clock):
            self.clock, self.times = clock, []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(self.clock.now())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run(prompts, new_tokens, clock):
        ids, mask = left_padded_batch(prompts)
        times = StepTimes(clock)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                              stopping_criteria=transformers.StoppingCriteriaList([times]))
        return out[:, ids.shape[1]:].tolist(), times.times
    return run


def hf_continuous(hf, trace: list[TraceRequest], kv_per_position: int) -> tuple[dict, int]:
    """transformers' continuous batching manager (what ``generate_batch`` runs), each request added at its
    arrival with its own ``max_new_tokens``; token times from its own timestamps."""
    import transformers
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in trace),
                                           eos_token_id=None, pad_token_id=0)
    # Its KV pool sized like the engine's (the default sizes it from free memory: all of the host's RAM on a CPU).
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // BLOCK_SIZE) for r in trace) + 64
    batching = transformers.ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=blocks,
                                                     max_batch_tokens=TOKEN_BUDGET)
    hf.set_attn_implementation("paged|sdpa")
    served, manager = {}, None
    try:
        manager = hf.init_continuous_batching(generation_config=config, continuous_batching_config=batching)
        manager.start()
        clock = Clock()
        for r in sorted(trace, key=lambda r: r.arrival_s):
            clock.wait_until(r.arrival_s)
            manager.add_request(r.prompt, request_id=str(r.request_id), max_new_tokens=r.max_tokens,
                                record_timestamps=True)
        while len(served) < len(trace):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers' continuous batching returned no result in 600 s")
            if not result.is_finished():
                continue
            if result.error:
                raise RuntimeError(f"transformers' continuous batching: {result.error}")
            request = trace[int(result.request_id)]
            stamps = [t - clock.start for t in result.timestamps]
            served[request.request_id] = Served(request.arrival_s, stamps[0], stamps[-1],
                                                list(result.generated_tokens))
    finally:
        if manager is not None:
            manager.stop(block=True)
        hf.set_attn_implementation("sdpa")
    return served, blocks * BLOCK_SIZE * kv_per_position


def engine_server(model: GPTMoEModel, trace: list[TraceRequest], kv_per_position: int, **engine_config):
    """The megamoe engine stepped as a server: arrived requests added before each step, idle until the next
    arrival. Returns (served, peak KV bytes, engine metrics)."""
    from megamoe.serving import Engine, EngineConfig, SamplingParams
    engine_config = {"block_size": BLOCK_SIZE, "max_num_batched_tokens": TOKEN_BUDGET, "max_num_seqs": MAX_SEQS,
                     **engine_config}
    block_size = engine_config["block_size"]
    longest = max(len(r.prompt) + r.max_tokens for r in trace)
    memory = engine_config.pop("kv_cache_memory", None) or (
        kv_per_position * block_size * (64 + len(trace) * -(-longest // block_size)))
    engine = Engine(model, ParallelState.single_process(), EngineConfig(kv_cache_memory=memory, **engine_config))
    pending, served, first, peak_blocks = deque(sorted(trace, key=lambda r: r.arrival_s)), {}, {}, 0
    by_id = {r.request_id: r for r in trace}
    clock = Clock()
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_s <= clock.now():
            r = pending.popleft()
            engine.add_request(r.request_id, r.prompt, SamplingParams(max_tokens=r.max_tokens))
        if not engine.has_unfinished():
            clock.wait_until(pending[0].arrival_s)
            continue
        outputs = engine.step()
        now = clock.now()
        peak_blocks = max(peak_blocks, engine.scheduler.pool.num_used)      # not metrics(): every layer's balance
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                r = by_id[out.request_id]
                served[r.request_id] = Served(r.arrival_s, first[r.request_id], now, list(out.token_ids))
    return served, peak_blocks * block_size * kv_per_position, engine.metrics()


# ------------------------------------------------------------------------------------------------- scenarios
def reference_ids(model: GPTMoEModel, trace: list[TraceRequest], batch: int = 32) -> dict[int, list[int]]:
    """megamoe's static generate() of every request (left-padded batches of ``batch``, each row cut at its
    ``max_tokens``): the token ids every system should give."""
    state = ParallelState.single_process()
    out = {}
    for first in range(0, len(trace), batch):
        group = trace[first:first + batch]
        ids = generate(model, state, [r.prompt for r in group],
                       GenerationConfig(max_new_tokens=max(r.max_tokens for r in group))).token_ids
        out.update({r.request_id: row[:r.max_tokens] for r, row in zip(group, ids)})
    return out


def engine_row(model, trace, kv, reference, **config) -> dict:
    served, peak, metrics = engine_server(model, trace, kv, **config)
    extra = {"prompt_tokens_computed": metrics.prompt_tokens_computed,
             "prefix_cache_hit_tokens": metrics.prefix_cache_hits, "preemptions": metrics.preemptions}
    if config.get("speculative_tokens"):
        extra.update(spec_proposed=metrics.spec_proposed, spec_accepted=metrics.spec_accepted,
                     acceptance_rate=metrics.spec_accepted / max(metrics.spec_proposed, 1))
    return summarize(served, trace, reference, peak, **extra)


def static_row(trace, batch, run_batch, kv, reference) -> dict:
    served, peak = static_server(trace, batch, run_batch, kv)
    return summarize(served, trace, reference, peak, batch=batch)


_HF_CB_FAILED: dict[int, str] = {}       # id(model) -> why transformers' continuous batching failed on it


def hf_cb_row(hf, trace, kv, reference) -> dict:
    if id(hf) in _HF_CB_FAILED:          # tried once (the warm-up): not again
        return {"skipped": _HF_CB_FAILED[id(hf)]}
    try:
        served, peak = hf_continuous(hf, trace, kv)
    except Exception as error:         # a peer that cannot serve this model is reported, not fatal
        log.warning("hf/cb skipped: %s", error)
        _HF_CB_FAILED[id(hf)] = f"{type(error).__name__}: {error}"
        return {"skipped": _HF_CB_FAILED[id(hf)]}
    return summarize(served, trace, reference, peak)


def warm_up(hf, model, trace, kv, peers: bool = True, cb: bool = True) -> None:
    """One untimed run of every system to be measured (lazy initializations, allocator growth, transformers'
    manager): the static servers with ``peers``, transformers' continuous batching with ``cb`` too, the engine
    (with MTP drafts too when the model has MTP layers)."""
    if peers:
        static_server(trace, 2, hf_static_batch(hf), kv)
        static_server(trace, 2, megamoe_static_batch(model), kv)
        if cb:
            hf_cb_row(hf, trace, kv, None)
    engine_server(model, trace, kv)
    if model.mtp_layer_ids:
        engine_server(model, trace, kv, speculative_tokens=1)


def bf16_rows(hf, model, trace, kv, best_batch: dict) -> dict:
    """The offline rows of bf16 copies of both models (the same weights rounded to bf16): the static servers at
    the batch sizes given, and the engine; ``same_ids`` against megamoe's bf16 static generate()."""
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    model16 = GPTMoEModel(model.config, ParallelState.single_process()).eval()    # (a deepcopy loses the
    load_logical_state(model16, gather_logical_state(model))                      # parameters' layout attributes)
    model16.to(torch.bfloat16)
    kv16 = kv // 2
    reference = reference_ids(model16, trace)
    warm_up(hf16, model16, trace[:4], kv16, cb=False)
    hf_batch, megamoe_batch = best_batch["hf"], best_batch["megamoe"]
    return {f"hf/static-{hf_batch}": static_row(trace, hf_batch, hf_static_batch(hf16), kv16, reference),
            f"megamoe/static-{megamoe_batch}": static_row(trace, megamoe_batch, megamoe_static_batch(model16), kv16,
                                                          reference),
            "engine": engine_row(model16, trace, kv16, reference)}


def best_static(rows: dict) -> str:
    """The static row with the highest output tokens/s."""
    static = {name: row for name, row in rows.items() if "/static-" in name and "skipped" not in row}
    return max(static, key=lambda name: static[name]["output_tokens_per_s"])


def run_model(family: str, args, size: dict, sizes: dict) -> dict:
    """Every scenario on one model; returns its rows and verdicts."""
    hf, model = build_models(family, size, args.seed)
    kv = kv_bytes_per_position(model)
    result = {"kv_bytes_per_position": kv, "scenarios": {}, "verdicts": {}}
    vocab = size["vocab_size"]
    if model.mtp_layer_ids:
        result["training"] = train_on_corpus(hf, model, family, sizes["train_steps"], args.seed, sizes["alphabet"],
                                             args.train_cache or None)
        log.info("%s: trained on the structured corpus: %s", family, result["training"])
    warm_up(hf, model, make_trace(4, seed=args.seed + 9, vocab_size=vocab, prompt_lens=(4, 8), output_lens=(2, 4)), kv,
            peers=bool({"offline", "online"} & set(args.scenarios)))

    def trace(count, rate=None, prefix=0, prompt_lens=sizes["prompt_lens"], seed=args.seed):
        return make_trace(count, seed=seed, vocab_size=vocab, prompt_lens=prompt_lens,
                          output_lens=sizes["output_lens"], rate_per_s=rate, shared_prefix=prefix)

    def scenario(name, load, rows):
        result["scenarios"][name] = {"requests": len(load), "rows": rows}
        for system, row in rows.items():
            print_row(family, name, system, row)

    engine_rate = None
    if "offline" in args.scenarios:          # every request at t = 0
        offline = trace(sizes["offline_requests"])
        reference = reference_ids(model, offline)
        rows = {"hf/cb": hf_cb_row(hf, offline, kv, reference)}
        for batch in sizes["batches"]:
            rows[f"hf/static-{batch}"] = static_row(offline, batch, hf_static_batch(hf), kv, reference)
            rows[f"megamoe/static-{batch}"] = static_row(offline, batch, megamoe_static_batch(model), kv, reference)
        rows["engine"] = engine_row(model, offline, kv, reference)
        rows["engine/no-prefix"] = engine_row(model, offline, kv, reference, enable_prefix_caching=False)
        scenario("offline", offline, rows)
        best = best_static(rows)
        engine_rate = sizes["offline_requests"] / rows["engine"]["makespan_s"]
        result["verdicts"]["offline_over_best_static"] = verdict(
            rows["engine"]["output_tokens_per_s"] / rows[best]["output_tokens_per_s"], "offline_over_best_static", best)
        if "skipped" not in rows["hf/cb"]:
            result["verdicts"]["offline_over_hf_cb"] = verdict(
                rows["engine"]["output_tokens_per_s"] / rows["hf/cb"]["output_tokens_per_s"], "offline_over_hf_cb",
                "hf/cb")
        best_batch = {kind: max((r for n, r in rows.items() if n.startswith(kind + "/static-")),
                                key=lambda r: r["output_tokens_per_s"])["batch"] for kind in ("hf", "megamoe")}
        if args.bf16:        # the same weights in bf16 on both sides, each static row at its fp32 best batch
            rows16 = bf16_rows(hf, model, offline, kv, best_batch)
            scenario("offline_bf16", offline, rows16)
            best16 = best_static(rows16)
            result["verdicts"]["offline_bf16_over_best_static"] = verdict(
                rows16["engine"]["output_tokens_per_s"] / rows16[best16]["output_tokens_per_s"],
                "offline_over_best_static", best16 + " (bf16)")
    else:
        best_batch = {"hf": sizes["batches"][0], "megamoe": sizes["batches"][0]}
    # The online rate: a fraction of the engine's offline request rate (measured above, or its own short run).
    if engine_rate is None:
        probe = trace(min(sizes["offline_requests"], 32))
        engine_rate = len(probe) / engine_row(model, probe, kv, None)["makespan_s"]
    rate = args.online_load * engine_rate

    if "online" in args.scenarios:           # Poisson arrivals
        online = trace(sizes["online_requests"], rate=rate, seed=args.seed + 1)
        reference = reference_ids(model, online)
        online_rows = {"hf/cb": hf_cb_row(hf, online, kv, reference),
                       f"hf/static-{best_batch['hf']}": static_row(online, best_batch["hf"], hf_static_batch(hf), kv,
                                                                   reference),
                       f"megamoe/static-{best_batch['megamoe']}": static_row(
                           online, best_batch["megamoe"], megamoe_static_batch(model), kv, reference),
                       "engine": engine_row(model, online, kv, reference)}
        scenario("online", online, online_rows)
        result["scenarios"]["online"]["rate_per_s"] = rate
        static_ttft = min(r["ttft_p99_s"] for n, r in online_rows.items() if "/static-" in n)
        result["verdicts"]["online_ttft_p99_over_best_static"] = verdict(
            online_rows["engine"]["ttft_p99_s"] / static_ttft, "online_ttft_p99_over_best_static", "best static p99",
            at_most=True)

    if "shared_prefix" in args.scenarios:    # a shared system prompt, requests arriving at the online rate
        shared = trace(sizes["shared_requests"], rate=rate, prefix=sizes["system_prompt"],
                       prompt_lens=sizes["suffix_lens"], seed=args.seed + 2)
        reference = reference_ids(model, shared)
        shared_rows = {"engine": engine_row(model, shared, kv, reference),
                       "engine/no-prefix": engine_row(model, shared, kv, reference, enable_prefix_caching=False)}
        scenario("shared_prefix", shared, shared_rows)
        result["verdicts"]["shared_prefix_prefill_cut"] = verdict(
            shared_rows["engine/no-prefix"]["prompt_tokens_computed"]
            / max(shared_rows["engine"]["prompt_tokens_computed"], 1), "shared_prefix_prefill_cut", "no prefix")

    if "mtp" in args.scenarios and model.mtp_layer_ids:      # batch 1: one request after the other
        # Prompts from the corpus the model was trained on (its drafts are meaningful there), one at a time.
        prompts = structured_corpus(sizes["mtp_requests"], sizes["prompt_lens"][1], seed=args.seed + 3,
                                    alphabet=sizes["alphabet"]).tolist()
        alone = [TraceRequest(i, 0.0, p, sizes["mtp_tokens"]) for i, p in enumerate(prompts)]
        reference = reference_ids(model, alone)
        systems = (("engine", {}), ("engine/mtp", {"speculative_tokens": args.speculative_tokens}))
        rows_one = {name: [] for name, _ in systems}
        for r in alone:                      # interleaved request by request: host noise hits both alike
            for name, config in systems:
                rows_one[name].append(engine_row(model, [r], kv, {r.request_id: reference[r.request_id]}, **config))
        mtp_rows = {name: batch_one(rows) for name, rows in rows_one.items()}
        scenario("mtp_batch1", alone, mtp_rows)
        result["verdicts"]["mtp_decode_speedup"] = verdict(
            mtp_rows["engine/mtp"]["decode_tokens_per_s"] / mtp_rows["engine"]["decode_tokens_per_s"],
            "mtp_decode_speedup", "engine, no MTP")
    return result


def batch_one(rows: list[dict]) -> dict:
    """Requests served one at a time: decode tokens/s = tokens after the first over the time after the first."""
    decode_tokens = sum(r["output_tokens"] - 1 for r in rows)
    decode_s = sum(r["tpot_p50_s"] * (r["output_tokens"] - 1) for r in rows)
    merged = {"output_tokens": sum(r["output_tokens"] for r in rows),
              "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
              "same_ids": sum(r["same_ids"] for r in rows) / len(rows),
              "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in rows),
              "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rows)}
    for key in ("spec_proposed", "spec_accepted"):
        if key in rows[0]:
            merged[key] = sum(r[key] for r in rows)
    if "spec_proposed" in merged:
        merged["acceptance_rate"] = merged["spec_accepted"] / max(merged["spec_proposed"], 1)
    return merged


def verdict(value: float, target: str, against: str, at_most: bool = False) -> dict:
    goal = TARGETS[target]
    return {"value": value, "target": goal, "against": against, "met": value <= goal if at_most else value >= goal}


def print_row(family: str, scenario: str, system: str, row: dict) -> None:
    if "skipped" in row:
        print(f"{family:>11s} {scenario:>13s} {system:>18s}  skipped: {row['skipped']}", flush=True)
        return
    rate = row.get("output_tokens_per_s", row.get("decode_tokens_per_s", 0.0))
    extra = ""
    if "prompt_tokens_computed" in row:
        extra += f" prefill {row['prompt_tokens_computed']}"
    if "acceptance_rate" in row:
        extra += f" accepted {row['acceptance_rate']:.2f}"
    print(f"{family:>11s} {scenario:>13s} {system:>18s} {rate:9.1f} {row['ttft_p50_s']:8.3f} "
          f"{row.get('ttft_p99_s', 0.0):8.3f} {1e3 * row.get('tpot_p50_s', 0.0):8.1f} {1e3 * row.get('tpot_p99_s', 0.0):8.1f} "
          f"{row['peak_kv_bytes'] / 2**20:8.2f} {row.get('same_ids', 0.0):5.2f}{extra}", flush=True)


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a few requests (the test's mode)")
    parser.add_argument("--models", nargs="+", default=["qwen3_moe", "deepseek_v3"], choices=["qwen3_moe", "deepseek_v3"],
                        help="the model families to serve")
    parser.add_argument("--requests", type=int, default=None, help="offline requests (default 256; --tiny 8)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS,
                        help="the scenarios to run (see above)")
    parser.add_argument("--online-requests", type=int, default=None, help="online requests (default 200; --tiny 8)")
    parser.add_argument("--max-output", type=int, default=None, help="longest output (default 32; --tiny 8)")
    parser.add_argument("--online-load", type=float, default=0.7,
                        help="online arrival rate as a fraction of the engine's offline request rate")
    parser.add_argument("--speculative-tokens", type=int, default=1, help="MTP draft tokens per step")
    parser.add_argument("--bf16", action="store_true",
                        help="also the offline rows of both models in bf16 (static at the fp32 best batch, engine)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the traces")
    parser.add_argument("--train-cache", default=str(Path(__file__).parent / "results" / "cache"),
                        help="where the DeepSeek-V3-like model's trained weights are kept between runs ('': nowhere)")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "serving.json"),
                        help="where to write the results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = TINY if args.tiny else FULL
    sizes = dict(offline_requests=8, online_requests=6, batches=(4, 8), prompt_lens=(4, 24), output_lens=(2, 8),
                 shared_requests=6, system_prompt=64, suffix_lens=(2, 8), mtp_requests=2, mtp_tokens=12,
                 train_steps=15, alphabet=8) if args.tiny else dict(
        offline_requests=256, online_requests=200, batches=(8, 16, 32), prompt_lens=(16, 128), output_lens=(16, 32),
        shared_requests=32, system_prompt=512, suffix_lens=(16, 64), mtp_requests=4, mtp_tokens=32,
        train_steps=120, alphabet=256)
    if args.requests is not None:
        sizes["offline_requests"] = args.requests
    if args.online_requests is not None:
        sizes["online_requests"] = args.online_requests
    if args.max_output is not None:
        sizes["output_lens"] = (min(sizes["output_lens"][0], args.max_output), args.max_output)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "fp32", "model": size,
               "sizes": sizes, "targets": TARGETS, "load_average_before": os.getloadavg(), "models": {}}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, greedy; model {size}; load {sizes}")
    print(f"{'model':>11s} {'scenario':>13s} {'system':>18s} {'tok/s':>9s} {'TTFT p50':>8s} {'TTFT p99':>8s} "
          f"{'TPOT p50':>8s} {'TPOT p99':>8s} {'KV MiB':>8s} {'same':>5s}  (TTFT s, TPOT ms; mtp rows: decode tok/s)")
    for family in args.models:
        results["models"][family] = run_model(family, args, size, sizes)
        results["models"][family]["load_average_after"] = os.getloadavg()     # the host's load (uptime)
        write_results(args.json, results)          # after each model: a long run keeps what it measured
    print("targets (engine over the peer measured in the same run):")
    for family, entry in results["models"].items():
        for name, v in entry["verdicts"].items():
            sign = "<=" if name.startswith("online") else ">="
            print(f"  {family:>11s} {name:>34s}: {v['value']:6.2f} ({sign} {v['target']:.2f} against {v['against']}): "
                  f"{'met' if v['met'] else 'NOT met'}")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
