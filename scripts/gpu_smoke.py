"""GPU smoke test: does the library train, run its FP8 experts and compile its decoding on this machine?

    python scripts/gpu_smoke.py [--device auto|cpu|cuda] [--steps 20] [--no-compile]

(``scripts/gpu_smoke.sh`` runs it on CUDA, then the ``cuda``-marked tests.) Checks, one table row each:

- ``train bf16``: ``--steps`` training steps (``Trainer.train_step``, bf16 autocast, fp32 master weights)
  of a small MoE model on one fixed batch: every loss finite, the last below the first.
- ``fp8 <backend>/<recipe>``: the FP8 grouped experts of ``backend`` (``torch``: ``torch._scaled_grouped_mm``;
  ``te``: TransformerEngine) against the ``fp8_emulated`` CPU reference on the same bf16 weights and
  tokens, relative error within the tolerance of ``tests/unit/test_fp8.py``. Skipped, with the reason, where
  the backend cannot run (no sm90 / sm89 GPU, no TransformerEngine).
- ``generate compiled``: greedy decoding through ``torch.compile`` gives the eager tokens, by the margin
  rule of :func:`greedy_tokens_agree`: in bf16 a random model's logits are nearly flat, and a 1-ulp
  difference between the compiled and eager kernels may flip a near tie, after which the two continuations
  differ for good; only a flip where the top two logits are further apart than bf16's error is a failure.

Every check runs, whatever an earlier one did: an exception is that row's FAIL (its traceback on stderr).
Prints the table; exits 0 when nothing failed (skipped rows are not failures), 1 otherwise, and 1 with
one ``error:`` line for a usage error (``--device cuda`` without a GPU).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from megamoe.inference.generation import GenerationConfig, generate  # noqa: E402
from megamoe.cli.launch import HelpFormatter, add_device_argument, resolve_device, run_script  # noqa: E402
from megamoe.models import GPTMoEConfig, GPTMoEModel  # noqa: E402
from megamoe.moe.experts.fp8 import FP8Config, resolve_fp8_backend  # noqa: E402
from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts  # noqa: E402
from megamoe.moe.moe_layer import MoEConfig  # noqa: E402
from megamoe.moe.router import RouterConfig  # noqa: E402
from megamoe.moe.shared_experts import SharedExpertsConfig  # noqa: E402
from megamoe.tensor_parallel.init import initialize_parameters  # noqa: E402
from megamoe.training.trainer import TrainConfig, Trainer  # noqa: E402
from megamoe.transformer import AttentionConfig, MLPConfig, RopeConfig  # noqa: E402
from parallel_state import ParallelState  # noqa: E402

logger = logging.getLogger("gpu_smoke")

V, E, SEQ, BATCH, MICRO_BATCH = 512, 8, 64, 8, 4
# tests/unit/test_fp8.py's tolerances: bf16 rounding plus accumulation order (torch), TE's scale timing (te).
FP8_CHECKS = (("torch", "tensorwise", 2e-2), ("torch", "rowwise", 2e-2), ("torch", "delayed", 2e-2),
              ("te", "delayed", 5e-2), ("te", "tensorwise", 5e-2))
FP8_SLOTS, FP8_H, FP8_F, FP8_COUNTS = 4, 64, 96, (37, 0, 64, 19)
# Top-2 logit gap below which compiled and eager greedy decoding may pick different tokens: 8 bf16 ulps
# (2^-8 relative each) of the larger logit's magnitude (at least 1): one ulp per rounding of a fused
# kernel that the other path rounds differently, a few of them through the layers.
BF16_LOGIT_TOLERANCE = 8 * 2.0 ** -8


@dataclass
class Row:
    check: str
    status: str          # "ok" | "FAIL" | "skipped"
    detail: str


def small_config(hidden_size: int) -> GPTMoEConfig:
    """A 4-layer MoE model (8 experts, top 2, a shared expert; 1.1M parameters at hidden size 128)."""
    H, head_dim = hidden_size, hidden_size // 4
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=4,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                  rope=RopeConfig(dim=head_dim), qk_norm="per_head"),
        moe=MoEConfig(
            router=RouterConfig(hidden_size=H, num_experts=E, top_k=2, norm_topk_prob=True, aux_loss_coeff=0.01),
            ffn_hidden_size=H // 2, dispatcher="alltoall", expert_backend="auto",
            shared_experts=SharedExpertsConfig(H, H // 2, gate=True)),
        moe_layer_ids=(1, 2, 3), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=2 * H))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_training(device: torch.device, steps: int, hidden_size: int) -> Row:
    state = ParallelState.single_process()
    model = GPTMoEModel(small_config(hidden_size), state, device=device)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=3e-3, autocast="bf16"))
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, V, (BATCH, SEQ + 1), generator=g).to(device)
    micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)]
    losses, rates = [], []
    for _ in range(steps):
        metrics = trainer.train_step(micro_batches)
        losses.append(metrics.loss)
        rates.append(metrics.tokens_per_s)
    _synchronize(device)
    finite = all(math.isfinite(loss) for loss in losses)
    ok = finite and len(losses) > 1 and losses[-1] < losses[0]
    detail = (f"{steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"{sorted(rates)[len(rates) // 2]:.0f} tokens/s (median)")
    return Row("train bf16", "ok" if ok else "FAIL", detail if finite else f"non-finite loss: {losses}")


def _reference_experts(fp8: FP8Config) -> GroupedExperts:
    module = GroupedExperts(ExpertsConfig(FP8_SLOTS, FP8_H, FP8_F, backend="fp8_emulated", fp8=fp8))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.w_gate_up.copy_(torch.randn(module.w_gate_up.shape, generator=g) * FP8_H ** -0.5)
        module.w_down.copy_(torch.randn(module.w_down.shape, generator=g) * FP8_F ** -0.5)
    return module


def check_fp8(backend: str, recipe: str, tol: float, device: torch.device) -> Row:
    name = f"fp8 {backend}/{recipe}"
    fp8 = FP8Config(recipe=recipe)
    try:
        resolve_fp8_backend(backend, device)
    except ValueError as why:
        return Row(name, "skipped", str(why).split(": run on such")[0])
    reference = _reference_experts(fp8)
    candidate = GroupedExperts(ExpertsConfig(FP8_SLOTS, FP8_H, FP8_F, backend=backend, fp8=fp8), device=device,
                               dtype=torch.bfloat16)
    for slot in range(FP8_SLOTS):
        shards = reference.expert_weight_shards(slot)
        candidate.load_expert_weights(slot, shards["gate"].to(device), shards["up"].to(device),
                                      shards["down"].to(device))
    reference = reference.to(torch.bfloat16).float()          # the same bf16-rounded weights
    g = torch.Generator().manual_seed(1)
    tokens, counts = torch.randn(sum(FP8_COUNTS), FP8_H, generator=g), torch.tensor(FP8_COUNTS)
    want = reference(tokens, counts)
    got = candidate(tokens.to(device).bfloat16(), counts.to(device)).float().cpu()
    error = ((got - want).norm() / want.norm()).item()
    return Row(name, "ok" if error < tol else "FAIL", f"relative error {error:.2e} vs fp8_emulated (tol {tol:g})")


@torch.no_grad()
def greedy_tokens_agree(model: GPTMoEModel, prompt: list[int], eager: list[int], other: list[int],
                        tolerance: float = BF16_LOGIT_TOLERANCE) -> tuple[bool, str]:
    """The margin rule for two greedy continuations of ``prompt``: equal up to their first difference, and
    there the eager step's top two logits (recomputed by one eager forward over prompt + eager tokens) within
    ``tolerance`` x max(1, |top logit|) of each other, a near tie that rounding may break either way. Later
    tokens are not compared (their contexts differ). Returns (agree, what was found)."""
    first = next((i for i, (a, b) in enumerate(zip(eager, other)) if a != b), None)
    if first is None:
        return len(eager) == len(other), "identical" if len(eager) == len(other) else "lengths differ"
    device = next(model.parameters()).device
    inputs = torch.tensor([prompt + eager[:first + 1]], device=device)
    logits = model(inputs)[0][0, len(prompt) - 1 + first].float()
    top2 = logits.topk(2).values
    gap, allowed = (top2[0] - top2[1]).item(), tolerance * max(1.0, abs(top2[0].item()))
    found = f"token {first} differs, top-2 logit gap {gap:.3g} (near tie below {allowed:.3g})"
    return gap <= allowed, found


def check_compiled_generation(device: torch.device, hidden_size: int, seed: int = 0) -> Row:
    state = ParallelState.single_process()
    dtype = torch.bfloat16 if device.type == "cuda" else None      # bf16 rows: torch._grouped_mm on the GPU
    model = GPTMoEModel(small_config(hidden_size), state, device=device, dtype=dtype)
    initialize_parameters(model, seed=seed)
    model.eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    config = GenerationConfig(max_new_tokens=16)
    eager = generate(model, state, prompts, config)
    started = time.perf_counter()
    compiled = generate(model, state, prompts, config, compiled=True)
    seconds = time.perf_counter() - started
    verdicts = [greedy_tokens_agree(model, prompt, want, got)
                for prompt, want, got in zip(prompts, eager.token_ids, compiled.token_ids)]
    ok = all(agree for agree, _ in verdicts)
    detail = (f"seed {seed}, {config.max_new_tokens} greedy tokens x {len(prompts)} prompts, compiled vs eager: "
              f"{'; '.join(found for _, found in verdicts)}; {compiled.decode_tokens_per_second:.0f} decode "
              f"tokens/s after {compiled.compile_seconds:.1f} s compiling ({seconds:.1f} s in all)")
    return Row("generate compiled", "ok" if ok else "FAIL", detail)


def run_check(name: str, check, *args) -> Row:
    """``check(*args)``'s row, or a FAIL row naming the exception (its traceback on stderr): one broken
    check never hides the others'."""
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 - reported as the row's failure
        traceback.print_exc()
        return Row(name, "FAIL", f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}")


def format_table(rows: list[Row]) -> str:
    header = Row("check", "status", "detail")
    check_width, status_width = (max(len(getattr(r, f)) for r in [header, *rows]) for f in ("check", "status"))
    rule = Row("-" * check_width, "-" * status_width, "------")
    return "\n".join(f"{r.check:<{check_width}}  {r.status:<{status_width}}  {r.detail}"
                     for r in [header, rule, *rows])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_smoke.py", description=__doc__, formatter_class=HelpFormatter)
    add_device_argument(p)
    p.add_argument("--steps", type=int, default=20, help="training steps of the bf16 check")
    p.add_argument("--hidden-size", type=int, default=128,
                   help="hidden size of the model of the training and generation checks (a multiple of 16)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the compiled-generation check (tens of seconds of compilation on a CPU)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (the check compares the first and last loss), got {args.steps}")
    if args.hidden_size < 16 or args.hidden_size % 16:
        raise ValueError(f"--hidden-size must be a positive multiple of 16 (4 heads of an even width), got "
                         f"{args.hidden_size}")
    torch.manual_seed(0)
    rows = [run_check("train bf16", check_training, device, args.steps, args.hidden_size)]
    rows += [run_check(f"fp8 {backend}/{recipe}", check_fp8, backend, recipe, tol, device)
             for backend, recipe, tol in FP8_CHECKS]
    rows.append(run_check("generate compiled", check_compiled_generation, device, args.hidden_size) if args.compile
                else Row("generate compiled", "skipped", "--no-compile"))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    print(f"megamoe smoke test on {device} ({gpu}), torch {torch.__version__}")
    print(format_table(rows))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run_script(main, prog="gpu_smoke.py"))
