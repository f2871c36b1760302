"""FP8 grouped experts vs bf16 grouped experts vs one dense FP8 GEMM of the same FLOPs (GPU).

    python benchmarks/fp8_experts.py [--quick] [--json benchmarks/results/fp8_experts.json]

Shape: DeepSeek-V3-like routing (T tokens, hidden H, expert FFN F, E experts, top-K) restricted to
one EP rank's ``E_local`` experts, with the T * K routed rows spread evenly over all E experts (so
this rank gets ``T * K * E_local / E`` rows, split evenly over its experts). Rows, forward and
forward+backward, TFLOP/s (expert MLP FLOPs: ``6 N H F`` forward, 3x that forward+backward):

- ``bf16/torch``: ``GroupedExperts`` backend ``torch`` in bf16 (``torch._grouped_mm``).
- ``fp8/torch/<recipe>``: backend ``torch`` with ``FP8Config(recipe)`` (``torch._scaled_grouped_mm``
  forward; its backward GEMMs run in bf16, see :mod:`megamoe.moe.experts.fp8_experts`). sm90+.
- ``fp8/te/<recipe>``: backend ``te`` under ``fp8_autocast`` (when TransformerEngine is installed).
- ``dense_fp8``: forward only, ``torch._scaled_mm`` with row-wise scales over the same rows and one
  weight: ``[N, H] @ [H, 2F]`` and ``[N, F] @ [F, H]``, the FP8 ceiling the grouped rows aim for.

Without CUDA it says it needs a GPU, runs the CPU FP8 emulation once at a tiny shape (so the code
path is exercised), writes no JSON, and exits 0.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

from common import argument_parser, write_results  # sibling module
from megamoe.moe.experts.fp8 import FP8Config, compute_scale, quantize
from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts

FULL = dict(T=16384, H=7168, F=2048, E=256, K=8, E_local=32)
QUICK = dict(T=4096, H=7168, F=2048, E=256, K=8, E_local=32)
TINY_CPU = dict(T=64, H=32, F=16, E=8, K=2, E_local=4)


def rows_per_slot(shape: dict) -> list[int]:
    rows = shape["T"] * shape["K"] * shape["E_local"] // shape["E"]
    base, extra = divmod(rows, shape["E_local"])
    return [base + (1 if s < extra else 0) for s in range(shape["E_local"])]


def time_cuda(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median seconds per call, CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def build_experts(shape: dict, backend: str, fp8: FP8Config | None, device: str) -> GroupedExperts:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return GroupedExperts(ExpertsConfig(shape["E_local"], shape["H"], shape["F"], backend=backend, fp8=fp8),
                          device=device, dtype=dtype)


def expert_steps(experts: GroupedExperts, tokens: torch.Tensor, counts: torch.Tensor):
    """(forward, forward+backward) closures."""
    grad_out = torch.randn_like(tokens)
    x = tokens.detach().requires_grad_()

    def forward():
        with torch.no_grad():
            return experts(tokens, counts)

    def forward_backward():
        experts(x, counts).backward(grad_out)

    return forward, forward_backward


def dense_fp8_forward(shape: dict, num_rows: int) -> Callable[[], object]:
    H, F_ = shape["H"], shape["F"]
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(num_rows, H, device="cuda")
    w1, w2 = torch.randn(2 * F_, H, device="cuda"), torch.randn(H, F_, device="cuda")
    a = torch.randn(num_rows, F_, device="cuda")

    def rowwise(t):  # -> (fp8 [R, C], dequant scale [R, 1])
        scale = compute_scale(t.abs().amax(1, keepdim=True), e4m3, 0)
        return quantize(t, scale, e4m3), scale.reciprocal()

    (xq, xs), (w1q, w1s), (aq, as_), (w2q, w2s) = rowwise(x), rowwise(w1), rowwise(a), rowwise(w2)

    def forward():
        torch._scaled_mm(xq, w1q.t(), scale_a=xs, scale_b=w1s.t(), out_dtype=torch.bfloat16)
        torch._scaled_mm(aq, w2q.t(), scale_a=as_, scale_b=w2s.t(), out_dtype=torch.bfloat16)

    return forward


def run_gpu(shape: dict, repeats: int) -> dict:
    counts_list = rows_per_slot(shape)
    num_rows = sum(counts_list)
    counts = torch.tensor(counts_list, device="cuda")
    tokens = torch.randn(num_rows, shape["H"], device="cuda", dtype=torch.bfloat16)
    flops_forward = 6 * num_rows * shape["H"] * shape["F"]
    variants: list[tuple[str, str, FP8Config | None]] = [("bf16/torch", "torch", None)]
    variants += [(f"fp8/torch/{r}", "torch", FP8Config(recipe=r)) for r in ("rowwise", "tensorwise", "delayed")]
    variants += [(f"fp8/te/{r}", "te", FP8Config(recipe=r)) for r in ("delayed", "tensorwise")]
    results = {"shape": shape, "rows": num_rows, "device": torch.cuda.get_device_name(), "rows_results": {}}
    for name, backend, fp8 in variants:
        try:
            experts = build_experts(shape, backend, fp8, "cuda")
        except (ValueError, RuntimeError) as error:
            results["rows_results"][name] = {"skipped": str(error)}
            print(f"{name:24s} skipped: {error}")
            continue
        forward, forward_backward = expert_steps(experts, tokens, counts)
        t_fwd, t_fb = time_cuda(forward, repeats), time_cuda(forward_backward, repeats)
        row = {"forward_s": t_fwd, "forward_tflops": flops_forward / t_fwd / 1e12,
               "fwd_bwd_s": t_fb, "fwd_bwd_tflops": 3 * flops_forward / t_fb / 1e12}
        results["rows_results"][name] = row
        print(f"{name:24s} fwd {row['forward_tflops']:7.1f} TFLOP/s   fwd+bwd {row['fwd_bwd_tflops']:7.1f} TFLOP/s")
        del experts
        torch.cuda.empty_cache()
    t_dense = time_cuda(dense_fp8_forward(shape, num_rows), repeats)
    results["rows_results"]["dense_fp8"] = {"forward_s": t_dense, "forward_tflops": flops_forward / t_dense / 1e12}
    print(f"{'dense_fp8':24s} fwd {flops_forward / t_dense / 1e12:7.1f} TFLOP/s")
    return results


def run_cpu_emulation() -> None:
    """The FP8 emulation once at a tiny shape: exercises the code path on a machine without CUDA."""
    shape = TINY_CPU
    counts = torch.tensor(rows_per_slot(shape))
    tokens = torch.randn(int(counts.sum()), shape["H"], requires_grad=True)
    emulated = build_experts(shape, "fp8_emulated", FP8Config(recipe="delayed"), "cpu")
    reference = build_experts(shape, "torch", None, "cpu")
    reference.load_state_dict(emulated.state_dict())
    out = emulated(tokens, counts)
    out.sum().backward()
    want = reference(tokens.detach(), counts)
    error = ((out.detach() - want).norm() / want.norm()).item()
    print(f"CPU FP8 emulation at {shape}: relative error vs fp32 {error:.4f} (step 0, scale 1); "
          "gradients finite: " + str(bool(torch.isfinite(tokens.grad).all())))


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help=f"T={QUICK['T']} and 5 repeats instead of 20")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "fp8_experts.json"),
                        help="where to write the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/fp8_experts.py needs a CUDA GPU (FP8 kernels); running the CPU emulation only")
        run_cpu_emulation()
        return 0
    results = run_gpu(QUICK if args.quick else FULL, repeats=5 if args.quick else 20)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
