"""Full training step (forward, backward, AdamW step) of a small Qwen3-MoE model: megamoe against
transformers' ``Qwen3MoeForCausalLM`` with the same config and weights.

    python benchmarks/train_step.py [--quick] [--repeats N] [--dtype fp32|bf16|all] [--profile]
                                    [--default-allocator] [--json out.json]

On CPU, one process, ``torch.set_num_threads(2)`` (``--threads``), fp32 rows and ``bf16 ``-prefixed rows (``--dtype``,
default both, all timed interleaved in one run). In bf16, megamoe's model holds bf16 parameters with fp32
master weights and fp32 gradient accumulation (the Trainer's ``main_grad`` path: no per-call weight
casts); transformers' model is cast to bf16 and trained with fused AdamW on its bf16 parameters; the bf16
bounds run their GEMMs and dense ops in bf16 (the optimizer step over fp32 parameters, as the master
weights). The matmul peak per dtype measured in the same run is printed first, with a note when the
machine has no fast bf16. bf16 rows check their first loss against the fp32 rows' within
:data:`BF16_LOSS_RTOL` and are compared with bf16 rows; the issue-33 targets of the bf16 default backend
(:data:`BF16_TARGETS`) are printed as verdicts. The model (see :data:`MODEL` / :data:`QUICK_MODEL`)
is built once by transformers with its own random init; megamoe's copy is ``config_from_hf`` + the
checkpoint adapter (``hf_to_megamoe``) + ``load_logical_state``, so both start from identical weights
(every row trains its own copy). Rows, timed interleaved repeat by repeat in one process (so that
load from other processes hits every row alike):

- ``megamoe/<backend>``: :class:`megamoe.training.trainer.Trainer` with ``TrainConfig`` on
  ``ParallelState.single_process()``, one micro-batch, expert backend ``torch`` and ``loop``.
- ``bound``: a lower bound for any implementation: the step's matmul FLOPs as dense GEMMs (the experts
  over tokens * top_k rows, as in ``benchmarks/moe_layer.py``) plus the same optimizer step over as many
  parameters; attention scores, norms, router, loss and every other elementwise pass are left out.
- ``extended bound``: ``bound`` plus the step's dense non-GEMM work, each as one torch op on the
  step's shapes, forward and backward: causal SDPA per layer (GQA), the loss (log-softmax and NLL over
  tokens x vocab), every RMSNorm (two per layer, q/k norms, the final one), RoPE on q and k, the router's
  softmax and top-k. What is still left out (the permutation, the SiLU gate, residual adds) is small
  and implementation-specific: this is a floor, not an estimate.
- ``hf/<experts implementation>``: ``Qwen3MoeForCausalLM`` (SDPA attention, as megamoe uses) with
  every experts implementation transformers offers (``config._experts_implementation``); those that
  cannot run here are listed with the reason. Its step: ``zero_grad``, ``model(input_ids,
  labels).loss.backward()``, ``clip_grad_norm_``, ``AdamW.step``.

Same work on both sides: the same optimizer, built by megamoe's ``build_optimizer`` for both models
(torch's fused AdamW, which is also what transformers' ``Trainer`` uses by default with torch >= 2.8;
no weight decay), global-norm clipping at 1.0, and no load-balancing loss: transformers
adds ``router_aux_loss_coef * aux`` only when ``output_router_logits`` (off here), and
``config_from_hf(..., for_training=False)`` then sets megamoe's ``aux_loss_coeff`` to 0. Before timing,
the script asserts that both compute the same loss on the same batch, and again after one optimizer step
on each (same gradients, same update). transformers shifts the labels inside its loss; megamoe takes them shifted.

Timing on a noisy host: ``--repeats`` rounds (default 9), each timing every row once in turn, so load
from other processes hits every row alike. Other processes only ever add time, so every ratio and
verdict is taken on the MINIMUM step time; the table also shows the median and the spread (median /
min), and warns when a row's spread exceeds 1.3 (the machine was busy: rerun for figures worth
quoting). Prints tokens/s and the ratios of the minima against every HF row and against the extended
bound, the verdict on the targets of the default expert backend (the one ``auto`` picks here), and
writes JSON (default benchmarks/results/train_step.json). ``--profile`` adds a breakdown of one step
per row by op category (torch.profiler self CPU time; the profiler's own overhead inflates the many
small ops). The allocator is set as in ``benchmarks/moe_layer.py`` (freed memory stays in the heap).
"""

from __future__ import annotations

import copy
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from megamoe.hf.adapters import adapter_for
from common import (BATCHED_MM_MEMORY_LIMIT, HF_CUDA_ONLY, NOISY_SPREAD,  # sibling module
                    argument_parser, keep_freed_memory_in_heap, matmul_peaks, time_call, write_results)
from megamoe.models import GPTMoEModel
from megamoe.models.families import config_from_hf
from megamoe.models.hf_loading import load_logical_state
from megamoe.training.trainer import TrainConfig, Trainer, build_optimizer
from parallel_state import ParallelState

MODEL = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
             head_dim=32, num_experts=32, num_experts_per_tok=8, moe_intermediate_size=256, batch=4, seq=256)
QUICK_MODEL = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, batch=2, seq=64)
MEGAMOE_BACKENDS = ("torch", "loop")
# Targets of the default expert backend, on the minimum step times (issue #20).
TARGET_OVER_EXTENDED_BOUND = 1.3      # step time <= 1.3 x the extended bound
TARGET_OVER_HF_GROUPED_MM = 1.2       # tokens/s >= 1.2 x hf/grouped_mm's
TARGET_SLOWER_THAN_OTHER_BACKEND = 1.05   # never more than 5% slower than another megamoe backend
TRAIN = TrainConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0)
LOSS_ATOL = 1e-4
BF16_LOSS_RTOL = 2e-2        # bf16's first loss against fp32's: bf16 rounds at 2^-8 relative
BF16 = "bf16 "               # name prefix of the bf16 rows
# issue 33's targets of the bf16 step of the default backend, on the minimum step times
BF16_TARGETS = {"tokens_per_s_over_fp32": 2.5, "tokens_per_s_over_hf_bf16_grouped_mm": 1.5,
                "over_bf16_extended_bound": 1.6}


@dataclass
class Row:
    """One timed configuration: a model, its optimizer and the batch, behind ``step``."""

    name: str
    step: Callable[[], float] | None        # one training step; returns the (pre-step) loss
    skip_reason: str | None = None
    losses: list[float] = field(default_factory=list)


def hf_config(shape: dict):
    """The Qwen3-MoE config both sides are built from: every layer MoE, no aux loss, untied head."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
        num_experts=shape["num_experts"], num_experts_per_tok=shape["num_experts_per_tok"],
        moe_intermediate_size=shape["moe_intermediate_size"], intermediate_size=4 * shape["moe_intermediate_size"],
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
        max_position_embeddings=shape["seq"], tie_word_embeddings=False, attention_dropout=0.0)


def batch(shape: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids [B, S], next-token labels [B, S], -100 on the last position)."""
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]),
                        generator=torch.Generator().manual_seed(seed))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def megamoe_row(hf_model, backend: str, ids: torch.Tensor, labels: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> Row:
    config = config_from_hf(hf_model.config, expert_backend=backend, for_training=False)  # HF's loss, no aux
    state = ParallelState.single_process()
    model = GPTMoEModel(config, state)
    logical = adapter_for(config.family).hf_to_megamoe(hf_model.state_dict(), config)
    unused = load_logical_state(model, logical)
    if unused:
        raise RuntimeError(f"logical tensors megamoe did not load: {unused}")
    model.to(dtype).train()        # bf16: the Trainer keeps fp32 master weights and fp32 main_grad
    trainer = Trainer(model, state, TRAIN)
    return Row(f"{_prefix(dtype)}megamoe/{backend}", lambda: trainer.train_step([(ids, labels)]).loss)


def _prefix(dtype: torch.dtype) -> str:
    return BF16 if dtype == torch.bfloat16 else ""


def hf_row(hf_model, implementation: str, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> Row:
    model = copy.deepcopy(hf_model).to(dtype)
    model.set_experts_implementation(implementation)
    model.train()
    # fp32: the very optimizer the Trainer builds for megamoe; bf16: fused AdamW on the bf16 parameters
    # (build_optimizer asks for fp32 master weights, which transformers' models do not keep)
    optimizer = (build_optimizer(model, TRAIN) if dtype == torch.float32 else
                 torch.optim.AdamW(model.parameters(), lr=TRAIN.lr, weight_decay=TRAIN.weight_decay, fused=True))

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss        # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN.grad_clip)
        optimizer.step()
        return loss.item()

    return Row(f"{_prefix(dtype)}hf/{implementation}", step)


def gemm_shapes(shape: dict) -> list[tuple[int, int, int]]:
    """(rows, in, out) of every matmul of the model's step: attention projections and the lm_head over
    the tokens, the routed experts as dense matmuls over tokens * top_k rows (the MoE layer benchmark's
    bound). Router, attention scores and everything elementwise are left out."""
    tokens, hidden = shape["batch"] * shape["seq"], shape["hidden_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    pairs, ffn = tokens * shape["num_experts_per_tok"], shape["moe_intermediate_size"]
    per_layer = [(tokens, hidden, q + 2 * kv), (tokens, q, hidden), (pairs, hidden, 2 * ffn), (pairs, ffn, hidden)]
    return per_layer * shape["num_hidden_layers"] + [(tokens, hidden, shape["vocab_size"])]


def bound_row(hf_model, shape: dict, dtype: torch.dtype = torch.float32) -> Row:
    """A lower bound on any implementation's step: the step's matmul FLOPs as dense GEMMs in ``dtype``
    (forward, input and weight gradients), then the same optimizer step over as many (fp32) parameters as
    the model has."""
    gemms = []
    for rows, fan_in, fan_out in gemm_shapes(shape):
        x = torch.randn(rows, fan_in).to(dtype).requires_grad_()
        weight = torch.randn(fan_out, fan_in).to(dtype).requires_grad_()
        gemms.append((x, weight, torch.randn(rows, fan_out).to(dtype)))
    params = [torch.nn.Parameter(torch.zeros_like(p)) for p in hf_model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = build_optimizer(torch.nn.ParameterList(params), TRAIN)

    def step() -> float:
        for x, weight, grad in gemms:
            torch.matmul(x, weight.t()).backward(grad)     # y = x W^T; dx = dy W; dW = dy^T x
            x.grad = weight.grad = None
        optimizer.step()
        return float("nan")

    return Row(f"{_prefix(dtype)}bound", step)


def dense_ops_step(shape: dict, dtype: torch.dtype = torch.float32) -> Callable[[], None]:
    """The step's dense non-GEMM work in ``dtype``, each piece one torch op forward and backward on the
    step's shapes (see the module docstring's ``extended bound``)."""
    import torch.nn.functional as F

    B, S, H, L = shape["batch"], shape["seq"], shape["hidden_size"], shape["num_hidden_layers"]
    Hq, Hk, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    T, V, E, K = B * S, shape["vocab_size"], shape["num_experts"], shape["num_experts_per_tok"]
    leaf = lambda *size: torch.randn(*size).to(dtype).requires_grad_()   # noqa: E731
    const = lambda *size: torch.randn(*size).to(dtype)                     # noqa: E731
    q, k, v = leaf(B, Hq, S, D), leaf(B, Hk, S, D), leaf(B, Hk, S, D)
    attention_grad = const(B, Hq, S, D)
    hidden, hidden_grad, norm_weight = leaf(T, H), const(T, H), leaf(H)
    heads, heads_grad, head_weight = leaf(T * (Hq + Hk), D), const(T * (Hq + Hk), D), leaf(D)
    cos, sin = const(S, D), const(S, D)
    router_logits = leaf(T, E)
    logits, labels = leaf(T, V), torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(2))

    def rope(x):                                     # rotate-half RoPE, as Qwen3 applies it
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def step() -> None:
        for _ in range(L):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(attention_grad)
            for _ in range(2):                      # input and post-attention norms
                F.rms_norm(hidden, (H,), norm_weight).backward(hidden_grad)
            F.rms_norm(heads, (D,), head_weight).backward(heads_grad)              # q and k norms
            (rope(q).sum() + rope(k).sum()).backward()
            torch.softmax(router_logits, dim=-1).topk(K, dim=-1).values.sum().backward()
        F.rms_norm(hidden, (H,), norm_weight).backward(hidden_grad)                # the final norm
        F.cross_entropy(logits, labels).backward()
        for tensor in (q, k, v, hidden, norm_weight, heads, head_weight, router_logits, logits):
            tensor.grad = None

    return step


def extended_bound_row(bound: Row, shape: dict, dtype: torch.dtype = torch.float32) -> Row:
    dense = dense_ops_step(shape, dtype)

    def step() -> float:
        bound.step()
        dense()
        return float("nan")

    return Row(f"{_prefix(dtype)}extended bound", step)


def hf_implementations() -> list[str]:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ["eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys())]


def hf_skip_reason(implementation: str, shape: dict) -> str | None:
    if implementation in HF_CUDA_ONLY:
        return HF_CUDA_ONLY[implementation]
    if implementation == "batched_mm":
        # One [3F, H] weight copy per (token, expert) pair and layer, all kept for the backward.
        tokens = shape["batch"] * shape["seq"]
        copies = (tokens * shape["num_experts_per_tok"] * 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
                  * 4 * shape["num_hidden_layers"])
        if copies > BATCHED_MM_MEMORY_LIMIT:
            return f"copies weights per (token, expert) pair: {copies / 2**30:.0f} GiB"
    return None


def build_rows(shape: dict, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> list[Row]:
    """Every row of every dtype, from one HF model's initial weights, all training on the same batch."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_config(shape), attn_implementation="sdpa",
                                                dtype=torch.float32)
    ids, labels = batch(shape, seed=1)
    rows = []
    for dtype in dtypes:
        bound = bound_row(hf_model, shape, dtype)
        rows += [bound, extended_bound_row(bound, shape, dtype)]
        rows += [megamoe_row(hf_model, backend, ids, labels, dtype) for backend in MEGAMOE_BACKENDS]
        for implementation in hf_implementations():
            reason = hf_skip_reason(implementation, shape)
            if reason is not None:
                rows.append(Row(f"{_prefix(dtype)}hf/{implementation}", None, reason))
            else:
                rows.append(hf_row(hf_model, implementation, ids, dtype))
    return rows


def check_same_loss(rows: list[Row]) -> None:
    """The first two steps of every fp32 row (same batch) report the same loss: the second checks the
    gradients and the optimizer update as well. A bf16 row's first loss is the fp32 rows' within
    :data:`BF16_LOSS_RTOL`."""
    runnable = [r for r in rows if r.skip_reason is None and "bound" not in r.name]
    for _ in range(2):
        for row in runnable:
            row.losses.append(row.step())
    reference = runnable[0]
    for row in runnable[1:]:
        if row.name.startswith(BF16):
            if abs(row.losses[0] - reference.losses[0]) > BF16_LOSS_RTOL * abs(reference.losses[0]):
                raise AssertionError(f"{row.name} first loss {row.losses[0]:.6f} is not {reference.name}'s "
                                     f"{reference.losses[0]:.6f} within {BF16_LOSS_RTOL:.0%}")
            continue
        for index, (loss, expected) in enumerate(zip(row.losses, reference.losses)):
            if abs(loss - expected) > LOSS_ATOL:
                raise AssertionError(f"step {index}: {row.name} loss {loss:.6f} differs from {reference.name}'s "
                                     f"{expected:.6f} by more than {LOSS_ATOL}")


def measure(rows: list[Row], repeats: int) -> dict[str, dict]:
    """One warm-up step per row (after the two loss-check steps), then ``repeats`` rounds over all
    rows; step times in seconds: min, median, spread (median / min) and every repeat."""
    runnable = [r for r in rows if r.skip_reason is None]
    for row in runnable:
        row.step()
    times: dict[str, list[float]] = {r.name: [] for r in runnable}
    for _ in range(repeats):
        for row in runnable:
            times[row.name].append(time_call(row.step))
    return {name: {"min_s": min(v), "median_s": statistics.median(v), "spread": statistics.median(v) / min(v),
                   "repeats": len(v), "times_s": v} for name, v in times.items()}


# Op categories of the --profile breakdown, by aten op name (self CPU time: an op's own time, not its
# children's). The first matching category wins.
PROFILE_CATEGORIES = (
    ("GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::linear", "aten::matmul",
              "GroupedMLPFunction")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("adamw", "Optimizer.")),
    ("permutation", ("index", "scatter", "gather", "sort", "histc", "bincount", "cat", "split", "cumsum", "topk")),
    ("elementwise", ("mul", "add", "sub", "div", "exp", "silu", "pow", "rsqrt", "sqrt", "mean", "sum", "norm",
                     "neg", "softmax", "where", "max", "clamp", "sigmoid", "reciprocal", "masked")),
    ("memory", ("fill_", "zero_", "copy_", "empty", "clone", "contiguous", "zeros", "to", "_to_copy")),
)


def profile_rows(rows: list[Row], steps: int = 3) -> dict[str, dict[str, float]]:
    """ms per step by op category (self CPU time under torch.profiler, the mean of ``steps`` steps) of
    every row, and their sum."""
    from torch.profiler import ProfilerActivity, profile

    breakdown = {}
    for row in (r for r in rows if r.skip_reason is None):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                row.step()
        by_category = {name: 0.0 for name, _ in PROFILE_CATEGORIES} | {"other": 0.0}
        for event in prof.key_averages():
            lowered = event.key.lower()
            category = next((name for name, keys in PROFILE_CATEGORIES if any(k.lower() in lowered for k in keys)),
                            "other")
            by_category[category] += event.self_cpu_time_total / 1e3 / steps
        by_category["sum"] = sum(by_category.values())
        breakdown[row.name] = by_category
    return breakdown


def default_backend() -> str:
    """The experts backend ``auto`` picks on this machine's CPU."""
    from megamoe.moe.experts.grouped_experts import GroupedExperts
    return GroupedExperts._resolve_backend("auto", torch.device("cpu"))


def verdicts(timings: dict[str, dict], default: str) -> dict[str, dict]:
    """The targets of the default backend, on the minimum step times."""
    mine = timings[f"megamoe/{default}"]["min_s"]
    others = {name: t["min_s"] for name, t in timings.items() if name.startswith("megamoe/")
              and name != f"megamoe/{default}"}
    out = {"over_extended_bound": {"value": mine / timings["extended bound"]["min_s"],
                                   "target": f"<= {TARGET_OVER_EXTENDED_BOUND}"}}
    out["over_extended_bound"]["met"] = out["over_extended_bound"]["value"] <= TARGET_OVER_EXTENDED_BOUND
    if "hf/grouped_mm" in timings:
        value = timings["hf/grouped_mm"]["min_s"] / mine
        out["tokens_per_s_over_hf_grouped_mm"] = {"value": value, "target": f">= {TARGET_OVER_HF_GROUPED_MM}",
                                                  "met": value >= TARGET_OVER_HF_GROUPED_MM}
    if others:
        value = mine / min(others.values())
        out["over_fastest_other_backend"] = {"value": value, "against": min(others, key=others.get),
                                             "target": f"<= {TARGET_SLOWER_THAN_OTHER_BACKEND}",
                                             "met": value <= TARGET_SLOWER_THAN_OTHER_BACKEND}
    return out


def bf16_verdicts(timings: dict[str, dict], default: str) -> dict[str, dict]:
    """issue 33's targets of the default backend's bf16 step (:data:`BF16_TARGETS`), on the minima."""
    mine = timings[f"{BF16}megamoe/{default}"]["min_s"]
    values = {"tokens_per_s_over_fp32": timings[f"megamoe/{default}"]["min_s"] / mine,
              "over_bf16_extended_bound": mine / timings[f"{BF16}extended bound"]["min_s"]}
    if f"{BF16}hf/grouped_mm" in timings:
        values["tokens_per_s_over_hf_bf16_grouped_mm"] = timings[f"{BF16}hf/grouped_mm"]["min_s"] / mine
    out = {}
    for name, value in values.items():
        at_most = name.startswith("over_")
        target = BF16_TARGETS[name]
        out[name] = {"value": value, "target": f"{'<=' if at_most else '>='} {target}",
                     "met": value <= target if at_most else value >= target}
    return out


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a much smaller model, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="rounds over all rows (default: 9; --quick: 2)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "all"), default="all",
                        help="fp32 rows, bf16 rows or both (bf16 verdicts need both)")
    parser.add_argument("--profile", action="store_true", help="also break one step of every row down by op category")
    parser.add_argument("--default-allocator", action="store_true",
                        help="keep glibc's allocator defaults (large tensors are fresh mmaps)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (1: the figures of docs/bf16.md, taken on a loaded 2-core host)")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "train_step.json"),
                        help="where to write the results")
    args = parser.parse_args(argv)
    allocator = "glibc defaults" if args.default_allocator else keep_freed_memory_in_heap()
    torch.set_num_threads(args.threads)
    shape = QUICK_MODEL if args.quick else MODEL
    repeats = args.repeats or (2 if args.quick else 9)
    tokens = shape["batch"] * shape["seq"]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, allocator: {allocator}")
    peaks = matmul_peaks()
    dtypes = {"fp32": (torch.float32,), "bf16": (torch.bfloat16,), "all": (torch.float32, torch.bfloat16)}[args.dtype]
    rows = build_rows(shape, dtypes)
    check_same_loss(rows)
    timings = measure(rows, repeats)
    default = default_backend()

    hf_rows = sorted({r.name.removeprefix(BF16) for r in rows if "hf/" in r.name and r.skip_reason is None})
    train = {"optimizer": "build_optimizer: fused AdamW", "lr": TRAIN.lr, "grad_clip": TRAIN.grad_clip,
             "weight_decay": TRAIN.weight_decay, "dtype": args.dtype}
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "allocator": allocator,
               "matmul_peaks": peaks, "model": shape, "tokens_per_step": tokens, "train": train, "repeats": repeats,
               "default_backend": default, "loss_check": {r.name: r.losses for r in rows if r.losses}, "rows": []}
    print(f"model: {shape}; {tokens} tokens per step; {repeats} interleaved repeats; loss check passed "
          f"({', '.join(f'{r.name} {r.losses[0]:.4f}' for r in rows if r.losses)})")
    header = "".join(f" {'/ ' + name:>16s}" for name in hf_rows)
    print(f"\n{'row':18s} {'min ms':>8s} {'median ms':>9s} {'spread':>6s} {'tokens/s':>9s} "
          f"{'x ext bound':>11s}{header}")
    noisy = []
    for row in rows:
        if row.skip_reason is not None:
            print(f"{row.name:18s} skipped: {row.skip_reason}")
            results["rows"].append({"name": row.name, "skipped": row.skip_reason})
            continue
        t = timings[row.name]
        prefix = BF16 if row.name.startswith(BF16) else ""       # bf16 rows against bf16 rows
        extended = timings[f"{prefix}extended bound"]["min_s"]
        ratios = {hf: timings[prefix + hf]["min_s"] / t["min_s"] for hf in hf_rows if prefix + hf in timings}
        ratio_text = "".join(f" {ratios[hf]:16.2f}" if hf in ratios else f" {'-':>16s}" for hf in hf_rows)
        print(f"{row.name:18s} {t['min_s'] * 1e3:8.1f} {t['median_s'] * 1e3:9.1f} {t['spread']:6.2f} "
              f"{tokens / t['min_s']:9.0f} {t['min_s'] / extended:11.2f}{ratio_text}")
        if t["spread"] > NOISY_SPREAD:
            noisy.append(row.name)
        results["rows"].append({"name": row.name, **t, "tokens_per_s": tokens / t["min_s"],
                                "over_extended_bound": t["min_s"] / extended, "tokens_per_s_over_hf": ratios})
    print("every ratio is of the MINIMUM step times (other processes only add time); spread = median / min; "
          "/ hf: tokens/s over that HF row's (bf16 rows: over the bf16 HF row's and the bf16 extended bound).")
    if noisy:
        print(f"WARNING: median/min above {NOISY_SPREAD} for {', '.join(noisy)}: the host was busy; rerun for "
              "figures worth quoting")
    results["noisy_rows"] = noisy
    results["verdicts"] = verdicts(timings, default) if "extended bound" in timings else {}
    if f"{BF16}megamoe/{default}" in timings and f"megamoe/{default}" in timings:
        results["verdicts"] |= {f"bf16_{name}": v for name, v in bf16_verdicts(timings, default).items()}
    print(f"\ndefault experts backend (auto on this CPU): {default}")
    for name, verdict in results["verdicts"].items():
        against = f" (against {verdict['against']})" if "against" in verdict else ""
        print(f"  {name}: {verdict['value']:.3f}{against}, target {verdict['target']}: "
              f"{'met' if verdict['met'] else 'NOT met'}")
    if args.profile:
        breakdown = profile_rows(rows)
        results["profile_ms_per_step"] = breakdown
        columns = [name for name, _ in PROFILE_CATEGORIES] + ["other", "sum"]
        print(f"\n{'ms per step':18s}" + "".join(f" {c:>11s}" for c in columns) + f" {'min step':>9s}")
        for name, by_category in breakdown.items():
            print(f"{name:18s}" + "".join(f" {by_category[c]:11.1f}" for c in columns)
                  + f" {timings[name]['min_s'] * 1e3:9.1f}")
        print("self CPU time of the calling thread by op category under torch.profiler, mean of 3 steps (its "
              "overhead inflates the many small ops); min step: the unprofiled minimum above. The bound rows are "
              "each category's floor.")

    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
