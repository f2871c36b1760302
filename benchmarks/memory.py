"""Measured memory per rank against the closed-form estimate, for a Qwen3-MoE-shaped model on 4 gloo ranks.

    python benchmarks/memory.py [--quick] [--layouts dp4 ep4 ...] [--json out.json]

The model (:data:`MODEL`): Qwen3-MoE's shape, small: GQA with per-head q/k norms, every layer a
top-k softmax-routed MoE without shared experts (all-to-all dispatcher, ``torch`` experts), fp32 (or
``--param-dtype bf16``). Layouts on 4 ranks (:data:`LAYOUTS`): ``dp4``; ``ep4`` (EP over the DP ranks);
``tp2_sp_ep2`` (TP 2 with sequence parallelism, EP 2, ETP 2); ``pp2_ep2`` (PP 2, EP 2, DP 2; 1F1B over
``--micro-batches``); and ``tp2_ep2``, the same TP layout without sequence parallelism, run only
as the baseline of the sequence-parallel target; and ``dp4_math_seq4x``, dp4 with the math attention
kernel and sequences 4x longer, run with recompute none and selective only (plain optimizer): the
selective target under the kind of attention it was set for (below). Each layout runs with every ``--recompute`` mode
(``none``, ``selective`` = ``core_attn moe_act``, ``full``) and both ``--optimizers`` (``plain``:
torch's AdamW; ``distributed``: the ZeRO-1 DistributedOptimizer; ``zero2``, not run by default: ZeRO-2).

Each run takes one warm-up step (the optimizer state exists from the first step on) and then measures
one training step (:func:`megamoe.training.memory_measure.measure_train_step`), on every rank:

- ``param`` / ``grad`` / ``opt``: bytes of unique storages of the parameters, of the gradients held at
  the optimizer step (``p.grad``, bf16 parameters' fp32 ``p.main_grad`` and the distributed optimizer's
  reduced shards) and of every tensor in ``optimizer.state``;
- ``act``: the most bytes saved for backward held at once over the step (``saved_tensors_hooks``;
  with 1F1B, several micro-batches), parameters excluded; ``norm`` is its decoder-norm part;
- ``peak``: the most live bytes of every storage over the step (a ``TorchDispatchMode``): state,
  activations and temporaries.

Beside each, the estimate (:func:`megamoe.training.memory_estimate.estimate_memory`) and the ratio
measured / estimated (the ``act`` estimate without the rotary cos / sin that fully recomputed layers
hold by reference, which the hooks cannot see; the JSON has that part). Rows are per pipeline stage:
the mean over the stage's ranks (EP ranks differ in their routed tokens; the mean is the balanced
routing the estimate assumes; the JSON has the largest too). The issue's targets follow as PASS / FAIL lines with their figures:

- optimizer state per rank with the distributed optimizer <= 1/DP of the plain optimizer's (dense
  parameters) and 1/EDP (expert parameters), plus 1% for padding (recompute none);
- full recompute saves >= 70% fewer activation bytes than none; selective (``core_attn moe_act``)
  >= 25% fewer (plain optimizer, every layout, on every pipeline stage; the least saving stage shown);
- sequence parallelism at TP 2 halves the norm/residual activation bytes (``tp2_sp_ep2`` against
  ``tp2_ep2``).

The recompute lines say where the bytes went (``freed_<category>``). Selective ``core_attn`` frees only
the attention kernel's output and log-sum-exp here: fused (flash) attention keeps no ``S x S``
probabilities, which is what Megatron's selective recomputation was designed to drop; ``moe_act`` the
experts' activation ``N x F``. Everything a checkpointed region saves except its inputs is freed, so
the measured saving is also the most that recomputing those regions can save on that model: the bound
the target is judged against. ``dp4_math_seq4x`` shows the same regions under the math kernel, which
keeps the probabilities.

Then ZeRO-1 checkpoints (``--no-checkpoints`` skips them), on every layout but the baseline and math ones: a
distributed optimizer with small buckets (``--checkpoint-bucket-mb``) takes one step, then the device peak
over its state (:class:`~megamoe.training.memory_measure.DeviceMemory`: host staging buffers not counted, so
the figure is the device's on this CPU run too) of the optimizer's side of a save (its state gathered to
host memory bucket by bucket) and of a load (read into host buffers bucket by bucket, then sliced into the
shards), beside the same work done as before (5773a8d: every bucket gathered into full-shape fp32 tensors
on the device; full-shape zeros on the device to load into), and of the whole ``save_training_checkpoint``
/ ``load_training_checkpoint``; each as a ratio of the full-shape fp32 state, computed from the optimizer's
parameters (12 bytes per parameter with fp32 masters, 8 without). Target: the optimizer's side at most one
bucket (its gathered state and shard) plus two parameters.

After them, estimates only (no model is built): DeepSeek-V3 (its config.json values through
``config_from_hf``) at EP 64, PP 16, DP 64 (1024 ranks), bf16 parameters, sequences of 4096, micro-batch
1, 16 micro-batches, flash attention, for each recompute mode and optimizer: the most loaded stage.

LoRA (one process, :func:`lora_rows`; ``--lora-only`` runs just these, ``--lora-ranks`` the ranks): the same
model trained in full and with LoRA adapters of each rank on the default targets (attention and every routed
expert here; the base frozen), one warm-up step and one measured step each: the trainable parameters and the
optimizer state bytes, as a fraction of full fine-tuning's. Targets: the optimizer state scales with the
adapters (the state of rank ``r`` is ``r / 16`` times rank 16's, within 1%: every adapter is ``r * (in + out)``;
AdamW's per-tensor step counters do not scale), and
rank 16 holds at most 5% of full fine-tuning's state, on :data:`MODEL` and on :data:`LORA_WIDE_MODEL` (the
fraction is about ``r * (in + out) / (in * out)`` per weight, so it depends on the widths: the narrow
:data:`MODEL` (hidden 256, expert FFN 128) cannot meet it at rank 16; the rows say by how much).

Writes JSON (default ``benchmarks/results/memory.json``).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile

import torch
import torch.distributed as dist

from common import argument_parser, write_results      # sibling module
from megamoe.lora import LoRAConfig, apply_lora
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.memory_estimate import estimate_memory
from megamoe.training.memory_measure import DeviceMemory, measure_train_step
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, RopeConfig
from parallel_state import ParallelState

__all__ = ["MODEL", "QUICK_MODEL", "LAYOUTS", "RECOMPUTE", "model_config", "run", "verdicts"]

WORLD_SIZE = 4
# hidden, layers, heads, KV heads, head dim, experts, top-k, expert FFN, vocab, sequence length, micro-batch
# size, micro-batches per step (per DP rank).
MODEL = dict(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, experts=8, top_k=2, ffn=128, vocab=1024,
             seq=128, micro=2, micro_batches=2)
QUICK_MODEL = dict(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2, ffn=16, vocab=64,
                   seq=16, micro=2, micro_batches=2)
# A wider shape for the LoRA rows (hidden 1024, expert FFN 512): one process.
LORA_WIDE_MODEL = dict(hidden=1024, layers=2, heads=8, kv_heads=4, head_dim=128, experts=4, top_k=2, ffn=512,
                       vocab=1024, seq=32, micro=1, micro_batches=1)
LORA_RANKS, LORA_TARGET_RANK, LORA_TARGET = (4, 16, 64), 16, 0.05
LAYOUTS = {
    "dp4": dict(tp=1, pp=1, ep=1, sp=False),
    "ep4": dict(tp=1, pp=1, ep=4, sp=False),
    "tp2_sp_ep2": dict(tp=2, pp=1, ep=2, sp=True),
    "pp2_ep2": dict(tp=1, pp=2, ep=2, sp=False),
    "tp2_ep2": dict(tp=2, pp=1, ep=2, sp=False),     # the sequence-parallel target's baseline only
    # dp4 with the math attention kernel (it keeps the S x S probabilities, what selective core_attn was
    # designed to drop) and sequences 4x longer: the selective target under the kernel it assumes.
    "dp4_math_seq4x": dict(tp=1, pp=1, ep=1, sp=False, sdpa="math", seq_factor=4),
}
BASELINE_ONLY = ("tp2_ep2",)
SELECTIVE_ONLY = ("dp4_math_seq4x",)       # recompute none and selective, plain optimizer
RECOMPUTE = {"none": ("none", ()), "selective": ("selective", ("core_attn", "moe_act")), "full": ("full", ())}
OPTIMIZERS = ("plain", "distributed")                  # the default set
OPTIMIZER_CHOICES = (*OPTIMIZERS, "zero2")             # zero2: the distributed optimizer with --zero-stage 2
_TRAIN_CONFIG = {"plain": {}, "distributed": {"distributed_optimizer": True},
                 "zero2": {"distributed_optimizer": True, "zero_stage": 2}}
OPTIMIZER_SLACK, FULL_TARGET, SELECTIVE_TARGET, SP_TARGET = 0.01, 0.70, 0.25, 0.5
CHECKPOINT_PEAKS = ("save_before", "save_now", "load_before", "load_now", "save_whole_now", "load_whole_now")
# MB of fp32 per distributed-optimizer bucket in the checkpoint runs, by model: a few parameters per bucket
CHECKPOINT_BUCKET_MB = {"model": 0.25, "quick": 0.005}
_FIELDS = ("param", "grad", "opt", "act", "peak")


def _recompute_config(mode: str):
    from megamoe.transformer.recompute import RecomputeConfig
    granularity, modules = RECOMPUTE[mode]
    return RecomputeConfig(granularity=granularity, modules=modules)


def model_config(m: dict, *, recompute: str = "none", sequence_parallel: bool = False) -> GPTMoEConfig:
    """The benchmark's Qwen3-MoE-shaped config at the sizes ``m`` (:data:`MODEL` or :data:`QUICK_MODEL`)."""
    extra = {}
    if recompute != "none":
        extra["recompute"] = _recompute_config(recompute)
    if sequence_parallel:
        extra["sequence_parallel"] = True
    return GPTMoEConfig(
        family="custom", vocab_size=m["vocab"], hidden_size=m["hidden"], num_layers=m["layers"],
        attention=AttentionConfig(hidden_size=m["hidden"], num_attention_heads=m["heads"],
                                  num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"],
                                  rope=RopeConfig(dim=m["head_dim"]), qk_norm="per_head"),
        moe=MoEConfig(router=RouterConfig(hidden_size=m["hidden"], num_experts=m["experts"], top_k=m["top_k"],
                                          norm_topk_prob=True, aux_loss_coeff=1e-3),
                      ffn_hidden_size=m["ffn"], dispatcher="alltoall", expert_backend="torch"),
        moe_layer_ids=tuple(range(m["layers"])), **extra)


def _runs(layouts, recomputes, optimizers):
    """(layout, recompute, optimizer) of every run: baseline-only layouts with recompute none, plain."""
    for layout in layouts:
        for recompute in recomputes:
            for optimizer in optimizers:
                if layout in BASELINE_ONLY and (recompute != "none" or optimizer != "plain"):
                    continue
                if layout in SELECTIVE_ONLY and (recompute == "full" or optimizer != "plain"):
                    continue
                yield layout, recompute, optimizer


def _batches(m_run: dict, state) -> list[list]:
    """Two steps' micro-batches of this DP rank (the same data in every run)."""
    per_rank = m_run["micro"] * m_run["micro_batches"]
    data = torch.randint(0, m_run["vocab"], (2, per_rank * state.dp_cp.size, m_run["seq"] + 1),
                         generator=torch.Generator().manual_seed(0))
    batches = []
    for step in range(2):
        mine = data[step, state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
        # contiguous: the embedding saves its ids, whose storage would otherwise be the whole batch
        batches.append([(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in mine.split(m_run["micro"])])
    return batches


def _worker(rank, world_size, m, runs, param_dtype, checkpoint_layouts=(), checkpoint_dir=None,
            checkpoint_bucket_mb=CHECKPOINT_BUCKET_MB["model"]):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype]
    results = []
    for layout, recompute, optimizer in runs:
        lay = LAYOUTS[layout]
        state = initialize_model_parallel(tp=lay["tp"], pp=lay["pp"], ep=lay["ep"], etp=lay["tp"])
        m_run = _model_of(m, lay)
        config = model_config(m_run, recompute=recompute, sequence_parallel=lay["sp"])
        model = GPTMoEModel(config, state, dtype=dtype)
        initialize_parameters(model, seed=0)
        train_config = TrainConfig(lr=1e-3, **_TRAIN_CONFIG[optimizer])
        trainer = Trainer(model, state, train_config,
                          world_group=dist.group.WORLD)
        batches = _batches(m_run, state)
        with _attention_kernel(lay):
            trainer.train_step(batches[0])                 # the optimizer state exists from here on
            memory, _ = measure_train_step(trainer, batches[1])
        s = memory.state
        results.append({
            "layout": layout, "recompute": recompute, "optimizer": optimizer, "rank": rank,
            "stage": state.pp.rank, "param": s.param_bytes, "grad": s.grad_bytes, "opt": s.optimizer_bytes,
            "dense_opt": s.dense_optimizer_bytes, "expert_opt": s.expert_optimizer_bytes,
            "act": memory.saved_activation_bytes, "norm": memory.saved_by_category["norm"],
            "act_by_category": memory.saved_by_category, "peak": memory.peak_live_bytes,
            "dp": state.dp_cp.size, "edp": state.edp.size})
        destroy_model_parallel()
    checkpoints = [_checkpoint_peaks(rank, m, layout, dtype, checkpoint_dir, checkpoint_bucket_mb)
                   for layout in checkpoint_layouts]
    return results, checkpoints


# ---- ZeRO checkpoints: the device peak of saving and loading, before (full-shape state on the device) and now
@torch.no_grad()
def _full_state_on_device(optimizer) -> list[torch.Tensor]:
    """What a save did before (``logical_state(gather=True)`` at 5773a8d): every bucket's state gathered
    into full-shape fp32 tensors on the device, all held until the files are written."""
    from megamoe import comms
    optimizer.materialize_state()
    full = []
    for bucket in optimizer._buckets:
        for key in sorted(k for k in optimizer.state[bucket.entries[0].param] if k != "step"):
            flat = torch.cat([optimizer.state[e.param][key].reshape(-1) for e in bucket.entries])
            gathered = comms.all_gather_flat(flat, bucket.group.group)
            full += [e.full_from(gathered, bucket.group.size, bucket.shard_numel).contiguous() for e in bucket.entries]
    return full


def _zeros_on_device(optimizer) -> list[torch.Tensor]:
    """What a load did before (``logical_state(gather=False)``): full-shape zeros of every state tensor on the
    device, read into, then sliced."""
    return [torch.zeros(e.param.shape, dtype=torch.float32, device=optimizer.device)
            for e in optimizer._entries.values() for key in optimizer.state[e.param] if key != "step"]


def _checkpoint_peaks(rank, m, layout, dtype, directory, bucket_mb) -> dict:
    """The device peak over the model and optimizer state (:class:`DeviceMemory`: host staging buffers not
    counted) of a ZeRO-1 checkpoint's optimizer side, before and now, and of the whole save and load now."""
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    lay = LAYOUTS[layout]
    state = initialize_model_parallel(tp=lay["tp"], pp=lay["pp"], ep=lay["ep"], etp=lay["tp"])
    m_run = _model_of(m, lay)
    model = GPTMoEModel(model_config(m_run, sequence_parallel=lay["sp"]), state, dtype=dtype)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-3, distributed_optimizer=True, grad_bucket_mb=bucket_mb),
                      world_group=dist.group.WORLD)
    with _attention_kernel(lay):
        trainer.train_step(_batches(m_run, state)[0])
    optimizer = trainer.optimizer
    path = f"{directory}/{layout}"

    def peak(fn) -> int:
        with DeviceMemory(optimizer.device) as live:
            live.track(list(model.parameters()), list(model.buffers()),
                       [list(s.values()) for s in optimizer.state.values()])
            baseline = live.current_bytes
            fn()
        return live.peak_bytes - baseline

    def load_now():
        for part in optimizer.logical_state_buckets():
            optimizer.load_logical_state(part)

    row = {"layout": layout, "rank": rank, "stage": state.pp.rank, "buckets": optimizer.num_buckets,
           "full_state": sum(4 * (len(s) - 1) * p.numel() for p, s in optimizer.state.items()),
           # the largest bucket's gathered state for one key with its shard, and the largest parameter in fp32
           "bucket": max(4 * b.shard_numel * (b.group.size + 1) for b in optimizer._buckets),
           "param": max(4 * p.numel() for p in optimizer.state),
           "save_before": peak(lambda: _full_state_on_device(optimizer)), "save_now": peak(optimizer.logical_state),
           "load_before": peak(lambda: _zeros_on_device(optimizer)), "load_now": peak(load_now),
           "save_whole_now": peak(lambda: save_training_checkpoint(path, trainer, sampler_state=None,
                                                                   world_group=dist.group.WORLD)),
           "load_whole_now": peak(lambda: load_training_checkpoint(path, trainer, world_group=dist.group.WORLD))}
    destroy_model_parallel()
    return row


def checkpoint_rows(per_rank: list[dict]) -> list[dict]:
    """Per (layout, stage): the most loaded rank's figures and their ratios to the full-state bytes."""
    rows = []
    for key in sorted({(r["layout"], r["stage"]) for r in per_rank}):
        ranks = [r for r in per_rank if (r["layout"], r["stage"]) == key]
        row = {"layout": key[0], "stage": key[1], "ranks": sorted(r["rank"] for r in ranks)}
        for field in ("buckets", "full_state", "bucket", "param", *CHECKPOINT_PEAKS):
            row[field] = max(r[field] for r in ranks)
        row["ratio"] = {f: row[f] / row["full_state"] for f in ("bucket", *CHECKPOINT_PEAKS)}
        rows.append(row)
    return rows


def checkpoint_verdicts(rows: list[dict]) -> list[dict]:
    """The issue's target for ZeRO checkpoints: the optimizer's side of saving and loading holds about one
    bucket on the device (its gathered state and shard, plus a parameter or two in transit), not the full
    state the old path held. (The whole save's figure also holds the pickled chunk lists of every rank that
    ``all_gather_object`` exchanges, which NCCL stages on the device: metadata, not state.)"""
    out = []
    for r in rows:
        bound = r["bucket"] + 2 * r["param"]
        now = {f: r[f] for f in ("save_now", "load_now")}
        out.append({"target": f"{r['layout']} stage {r['stage']}: ZeRO checkpoint state gather / scatter device "
                              "peak <= one bucket + 2 parameters (the old path: the full state)",
                    "met": max(now.values()) <= bound < r["full_state"] <= min(r["save_before"], r["load_before"]),
                    "figures": {"full_state": r["full_state"], "bound": bound, **now,
                                "save_before": r["save_before"], "load_before": r["load_before"]}})
    return out


def print_checkpoint_table(rows: list[dict]) -> None:
    print("\nZeRO-1 checkpoint: device peak over the state while saving / loading (DeviceMemory, host staging "
          "not counted), as a ratio of the full-shape fp32 state; 'bucket': the largest bucket's gathered state "
          "and shard; 'before' / 'now': the optimizer's gather (save) and scatter (load) as at 5773a8d and now; "
          "'whole_now': save_training_checkpoint / load_training_checkpoint, with the metadata exchange")
    print(f"{'layout':11s} {'st':>2s} {'buckets':>7s} {'full MiB':>8s} {'bucket':>6s} "
          + " ".join(f"{name:>14s}" for name in CHECKPOINT_PEAKS))
    for r in rows:
        print(f"{r['layout']:11s} {r['stage']:2d} {r['buckets']:7d} {_mb(r['full_state'])} {r['ratio']['bucket']:6.3f} "
              + " ".join(f"{r['ratio'][name]:14.3f}" for name in CHECKPOINT_PEAKS))


def _model_of(m: dict, lay: dict) -> dict:
    """The model sizes a layout runs with: ``m``, with the sequence ``seq_factor`` times longer."""
    return dict(m, seq=m["seq"] * lay.get("seq_factor", 1))


def _attention_kernel(lay: dict):
    """The SDPA kernel a layout runs with: torch's choice (a fused kernel on CPU) unless ``sdpa`` says math."""
    if lay.get("sdpa") == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _estimate(m: dict, layout: str, recompute: str, optimizer: str, param_dtype: str):
    lay = LAYOUTS[layout]
    m = _model_of(m, lay)
    dp = WORLD_SIZE // (lay["tp"] * lay["pp"])
    recompute_config = _recompute_config(recompute) if recompute != "none" else None
    return estimate_memory(model_config(m), tp=lay["tp"], pp=lay["pp"], ep=lay["ep"], etp=lay["tp"], dp=dp,
                           micro_batch=m["micro"], seq_len=m["seq"], num_micro_batches=m["micro_batches"],
                           distributed_optimizer=optimizer != "plain", zero_stage=2 if optimizer == "zero2" else 1,
                           recompute=recompute_config,
                           sequence_parallel=lay["sp"], param_dtype=param_dtype,
                           sdpa_backend=lay.get("sdpa", "flash"))


def run(m: dict, layouts, recomputes, optimizers, param_dtype: str = "fp32", checkpoint_layouts=(),
        checkpoint_bucket_mb: float = CHECKPOINT_BUCKET_MB["model"]) -> tuple[list[dict], list[dict]]:
    """Measure every run on 4 spawned gloo ranks (one spawn) and pair each pipeline stage's largest
    per-rank figures with the estimate: one row per (layout, recompute, optimizer, stage). Then the ZeRO
    checkpoint peaks of ``checkpoint_layouts`` (:func:`checkpoint_rows`). Returns both lists of rows."""
    runs = list(_runs(layouts, recomputes, optimizers))
    with tempfile.TemporaryDirectory() as directory:
        by_rank = run_on_ranks(_worker, WORLD_SIZE, args=(m, runs, param_dtype, tuple(checkpoint_layouts), directory,
                                                          checkpoint_bucket_mb), timeout_s=1800)
    per_rank = [r for results, _ in by_rank for r in results]
    checkpoints = checkpoint_rows([r for _, rows in by_rank for r in rows])
    rows = []
    for layout, recompute, optimizer in runs:
        estimate = _estimate(m, layout, recompute, optimizer, param_dtype)
        mine = [r for r in per_rank if (r["layout"], r["recompute"], r["optimizer"]) == (layout, recompute, optimizer)]
        for stage_estimate in estimate.stages:
            ranks = [r for r in mine if r["stage"] == stage_estimate.stage]
            row = {"layout": layout, "recompute": recompute, "optimizer": optimizer, "stage": stage_estimate.stage,
                   "ranks": sorted(r["rank"] for r in ranks), "dp": ranks[0]["dp"], "edp": ranks[0]["edp"]}
            # The mean over the stage's ranks: they differ only in their routed tokens, whose mean is the
            # balanced figure the estimate computes (the largest is kept beside it).
            for key in (*_FIELDS, "norm", "dense_opt", "expert_opt"):
                row[key] = round(sum(r[key] for r in ranks) / len(ranks))
            for key in ("act", "peak"):
                row[f"{key}_max"] = max(r[key] for r in ranks)
            row["act_by_category"] = {k: round(sum(r["act_by_category"][k] for r in ranks) / len(ranks))
                                      for k in ranks[0]["act_by_category"]}
            # The saved-activation estimate less what the hooks cannot see (the cos / sin fully recomputed
            # layers hold by reference), so that the columns compare alike; the JSON keeps that part.
            by_reference = stage_estimate.breakdown.get("held_by_reference", 0) * stage_estimate.micro_batches_in_flight
            row["held_by_reference_estimate"] = by_reference
            est = {"param": stage_estimate.param_bytes, "grad": stage_estimate.grad_bytes,
                   "opt": stage_estimate.optimizer_bytes, "act": stage_estimate.activation_bytes - by_reference,
                   "peak": stage_estimate.total, "norm": stage_estimate.norm_activation_bytes
                   * stage_estimate.micro_batches_in_flight,
                   "dense_opt": stage_estimate.dense_optimizer_bytes,
                   "expert_opt": stage_estimate.expert_optimizer_bytes}
            row["estimate"] = est
            row["ratio"] = {k: row[k] / est[k] if est[k] else None for k in est}
            rows.append(row)
    return rows, checkpoints


# DeepSeek-V3's config.json (the values the estimate reads), built here: nothing is downloaded.
DEEPSEEK_V3_HF = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=163840,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000, initializer_range=0.02,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"})
DEEPSEEK_V3_LAYOUT = dict(tp=1, pp=16, ep=64, dp=64, micro_batch=1, seq_len=4096, num_micro_batches=16,
                          param_dtype="bf16")


def deepseek_v3_estimates() -> list[dict]:
    """The most loaded stage of DeepSeek-V3 under :data:`DEEPSEEK_V3_LAYOUT`, per recompute mode and optimizer."""
    from transformers import DeepseekV3Config

    from megamoe.models.families import config_from_hf
    config = config_from_hf(DeepseekV3Config(**DEEPSEEK_V3_HF))
    rows = []
    for recompute in RECOMPUTE:
        for optimizer in OPTIMIZER_CHOICES:
            worst = estimate_memory(
                config, **DEEPSEEK_V3_LAYOUT, distributed_optimizer=optimizer != "plain",
                zero_stage=2 if optimizer == "zero2" else 1,
                recompute=_recompute_config(recompute) if recompute != "none" else None).worst
            rows.append({"recompute": recompute, "optimizer": optimizer, "stage": worst.stage,
                         "param": worst.param_bytes, "grad": worst.grad_bytes, "opt": worst.optimizer_bytes,
                         "act": worst.activation_bytes, "in_flight": worst.micro_batches_in_flight,
                         "total": worst.total})
    return rows


def print_deepseek_v3(rows: list[dict]) -> None:
    print(f"\nDeepSeek-V3 estimate (no model built): {DEEPSEEK_V3_LAYOUT}; the most loaded stage, GiB per rank")
    print(f"{'recompute':9s} {'optimizer':11s} {'stage':>5s} {'param':>7s} {'grad':>7s} {'opt':>7s} {'act':>7s} "
          f"{'total':>7s}")
    for r in rows:
        print(f"{r['recompute']:9s} {r['optimizer']:11s} {r['stage']:5d}"
              + "".join(f" {r[k] / 2**30:7.1f}" for k in ("param", "grad", "opt", "act", "total")))


def _find(rows, layout, recompute, optimizer):
    return [r for r in rows if (r["layout"], r["recompute"], r["optimizer"]) == (layout, recompute, optimizer)]


def verdicts(rows: list[dict]) -> list[dict]:
    """The issue's targets, each ``{"target", "met", "figures"}`` (see the module docstring)."""
    out = []
    for layout in sorted({r["layout"] for r in rows} - set(BASELINE_ONLY)):
        plain = _find(rows, layout, "none", "plain")
        for sharded in ("distributed", "zero2"):
            for p, d in zip(plain, _find(rows, layout, "none", sharded)):
                dense_bound = p["dense_opt"] / p["dp"] * (1 + OPTIMIZER_SLACK)
                expert_bound = p["expert_opt"] / p["edp"] * (1 + OPTIMIZER_SLACK)
                out.append({"target": f"{layout} stage {p['stage']}: {sharded} optimizer state <= 1/DP (dense) and "
                                      f"1/EDP (expert) of plain + 1%",
                            "met": d["dense_opt"] <= dense_bound and d["expert_opt"] <= expert_bound,
                            "figures": {"dp": p["dp"], "edp": p["edp"], "plain_dense": p["dense_opt"],
                                        "distributed_dense": d["dense_opt"], "dense_bound": dense_bound,
                                        "plain_expert": p["expert_opt"], "distributed_expert": d["expert_opt"],
                                        "expert_bound": expert_bound}})
        none = _find(rows, layout, "none", "plain")
        for mode, target in (("full", FULL_TARGET), ("selective", SELECTIVE_TARGET)):
            other = _find(rows, layout, mode, "plain")
            if none and other:
                # per pipeline stage (every rank must meet it); the figures are the least saving stage's
                pairs = [(b, o) for b in none for o in other if o["stage"] == b["stage"]]
                b, o = min(pairs, key=lambda pair: 1 - pair[1]["act"] / pair[0]["act"])
                saved = 1 - o["act"] / b["act"]
                # where the bytes went: the change of each category
                freed = {f"freed_{k}": b["act_by_category"][k] - o["act_by_category"][k] for k in b["act_by_category"]
                         if b["act_by_category"][k] != o["act_by_category"][k]}
                out.append({"target": f"{layout}: {mode} recompute saves >= {target:.0%} of the saved-activation "
                                      "bytes of none", "met": saved >= target,
                            "figures": {"stage": b["stage"], "none": b["act"], mode: o["act"], "saved_fraction": saved,
                                        **freed}})
    sp, no_sp = _find(rows, "tp2_sp_ep2", "none", "plain"), _find(rows, "tp2_ep2", "none", "plain")
    if sp and no_sp:
        ratio = sp[0]["norm"] / no_sp[0]["norm"]
        out.append({"target": "sequence parallelism at TP 2 halves the norm/residual activation bytes",
                    "met": ratio <= SP_TARGET * (1 + OPTIMIZER_SLACK),
                    "figures": {"without_sp": no_sp[0]["norm"], "with_sp": sp[0]["norm"], "ratio": ratio}})
    return out


def _mb(n) -> str:
    return f"{n / 2**20:8.3f}"


def print_table(rows: list[dict]) -> None:
    head = f"{'layout':11s} {'recompute':9s} {'optimizer':11s} {'st':>2s}"
    print(head + "".join(f" {k + ' MiB':>8s} {'est':>8s} {'ratio':>5s}" for k in _FIELDS) + f" {'norm MiB':>8s}")
    for r in rows:
        line = f"{r['layout']:11s} {r['recompute']:9s} {r['optimizer']:11s} {r['stage']:2d}"
        for k in _FIELDS:
            line += f" {_mb(r[k])} {_mb(r['estimate'][k])} {r['ratio'][k]:5.2f}"
        print(line + f" {_mb(r['norm'])}")
    print("(peak 'est' is the estimate's total: state + saved activations, no temporaries)")


def _lora_run(m: dict, rank: int | None) -> dict:
    """One process: full fine-tuning (``rank`` None) or LoRA of ``rank`` on ``m``; state bytes of a measured step."""
    state = ParallelState.single_process()
    model = GPTMoEModel(model_config(m), state)
    initialize_parameters(model, seed=0)
    if rank is not None:
        apply_lora(model, LoRAConfig(rank=rank, alpha=2 * rank))
    trainer = Trainer(model, state, TrainConfig(lr=1e-3))
    batches = _batches(m, state)
    trainer.train_step(batches[0])
    memory, _ = measure_train_step(trainer, batches[1])
    return {"lora_rank": rank, "params": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "param": memory.state.param_bytes, "grad": memory.state.grad_bytes, "opt": memory.state.optimizer_bytes,
            "peak": memory.peak_live_bytes}


def lora_rows(models: dict[str, dict], ranks) -> list[dict]:
    """Per model: full fine-tuning, then LoRA of each rank, each with its optimizer state as a fraction of the
    full run's (``opt_ratio``)."""
    rows = []
    for name, m in models.items():
        full = _lora_run(m, None)
        for run in [full] + [_lora_run(m, r) for r in ranks]:
            rows.append({"model": name, **run, "opt_ratio": run["opt"] / full["opt"],
                         "trainable_ratio": run["trainable"] / full["trainable"]})
    return rows


def lora_verdicts(rows: list[dict]) -> list[dict]:
    checks = []
    for name in dict.fromkeys(r["model"] for r in rows):
        lora = {r["lora_rank"]: r for r in rows if r["model"] == name and r["lora_rank"] is not None}
        if LORA_TARGET_RANK not in lora:
            continue
        base = lora[LORA_TARGET_RANK]
        scale = max(abs(r["opt"] / base["opt"] - k / LORA_TARGET_RANK) for k, r in lora.items())
        checks.append({"target": f"{name}: LoRA optimizer state scales with the adapters (rank r: r / "
                                 f"{LORA_TARGET_RANK} of rank {LORA_TARGET_RANK}'s, within 1%)", "met": scale < 0.01,
                       "figures": {"largest_deviation": scale}})
        checks.append({"target": f"{name}: LoRA rank {LORA_TARGET_RANK} optimizer state <= "
                                 f"{LORA_TARGET:.0%} of full fine-tuning's", "met": base["opt_ratio"] <= LORA_TARGET,
                       "figures": {"ratio": base["opt_ratio"], "lora_opt_mb": base["opt"] / 2**20,
                                   "full_opt_mb": base["opt"] / base["opt_ratio"] / 2**20}})
    return checks


def print_lora_table(rows: list[dict]) -> None:
    print("\nLoRA (one process, fp32 AdamW; default targets): optimizer state against full fine-tuning")
    print(f"{'model':>8} {'rank':>5} {'params':>11} {'trainable':>11} {'opt MB':>9} {'opt/full':>9} {'peak MB':>9}")
    for r in rows:
        rank = "full" if r["lora_rank"] is None else str(r["lora_rank"])
        print(f"{r['model']:>8} {rank:>5} {r['params']:>11,} {r['trainable']:>11,} {r['opt'] / 2**20:>9.3f} "
              f"{r['opt_ratio']:>9.2%} {r['peak'] / 2**20:>9.2f}")


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny model (QUICK_MODEL): a smoke test in seconds")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), help="layouts to run")
    parser.add_argument("--recompute", nargs="+", default=list(RECOMPUTE), choices=list(RECOMPUTE),
                        help="recompute modes (selective: core_attn moe_act)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZER_CHOICES),
                        help="plain AdamW, the distributed optimizer (ZeRO-1), zero2 (ZeRO-2)")
    parser.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16"), help="model parameter dtype")
    parser.add_argument("--checkpoint-bucket-mb", type=float,
                        help="the distributed optimizer's bucket size (MB of fp32) in the ZeRO checkpoint runs "
                             f"(default {CHECKPOINT_BUCKET_MB['model']}, --quick {CHECKPOINT_BUCKET_MB['quick']})")
    parser.add_argument("--no-checkpoints", action="store_true", help="skip the ZeRO checkpoint save / load runs")
    parser.add_argument("--lora-ranks", nargs="+", type=int, default=list(LORA_RANKS),
                        help="LoRA ranks of the LoRA rows (one process)")
    parser.add_argument("--lora-only", action="store_true", help="run only the LoRA rows")
    parser.add_argument("--json", default="benchmarks/results/memory.json", help="write the results here")
    args = parser.parse_args(argv)
    m = QUICK_MODEL if args.quick else MODEL
    lora_models = {"quick": QUICK_MODEL} if args.quick else {"model": MODEL, "wide": LORA_WIDE_MODEL}
    lora = lora_rows(lora_models, args.lora_ranks)
    print_lora_table(lora)
    lora_checks = lora_verdicts(lora)
    for v in lora_checks:
        figures = ", ".join(f"{k} {v_:.4g}" for k, v_ in v["figures"].items())
        print(f"{'PASS' if v['met'] else 'FAIL'}: {v['target']} ({figures})")
    if args.lora_only:
        write_results(args.json, {"lora": {"models": lora_models, "rows": lora, "verdicts": lora_checks}})
        return 0
    if args.checkpoint_bucket_mb is None:
        args.checkpoint_bucket_mb = CHECKPOINT_BUCKET_MB["quick" if args.quick else "model"]
    checkpoint_layouts = [] if args.no_checkpoints else [k for k in args.layouts if k not in (*BASELINE_ONLY,
                                                                                           *SELECTIVE_ONLY)]
    rows, checkpoints = run(m, args.layouts, args.recompute, args.optimizers, args.param_dtype, checkpoint_layouts,
                            args.checkpoint_bucket_mb)
    print(f"torch {torch.__version__}; {WORLD_SIZE} gloo ranks; model {m}; params {args.param_dtype}")
    print_table(rows)
    checks = verdicts(rows) + checkpoint_verdicts(checkpoints)
    for v in checks:
        figures = ", ".join(f"{k} {v_:.4g}" if isinstance(v_, float) else f"{k} {v_}" for k, v_ in v["figures"].items())
        print(f"{'PASS' if v['met'] else 'FAIL'}: {v['target']} ({figures})")
    if checkpoints:
        print_checkpoint_table(checkpoints)
    deepseek = deepseek_v3_estimates()
    print_deepseek_v3(deepseek)
    write_results(args.json, {"model": m, "world_size": WORLD_SIZE, "param_dtype": args.param_dtype,
                              "layouts": {k: LAYOUTS[k] for k in args.layouts}, "rows": rows, "verdicts": checks,
                              "checkpoints": {"bucket_mb": args.checkpoint_bucket_mb, "rows": checkpoints},
                              "deepseek_v3": {"layout": DEEPSEEK_V3_LAYOUT, "rows": deepseek},
                              "lora": {"models": lora_models, "rows": lora, "verdicts": lora_checks}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
