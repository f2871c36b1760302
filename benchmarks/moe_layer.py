"""Single-rank MoE layer: forward and forward+backward time against the dense-GEMM lower bound.

    python benchmarks/moe_layer.py [--quick] [--dtype fp32|bf16|all] [--json out.json]

On CPU, ``torch.set_num_threads(2)`` (``--threads``), in fp32 and in bf16 (``--dtype``, default both: one table each).
In bf16 every row holds its weights and activations in bf16 (transformers' blocks too; megamoe's router
computes in fp32 inside) and the bound is dense bf16 GEMMs; the matmul peak per dtype measured in the
same run is printed first, with a note when the machine has no fast bf16 (``common.matmul_peaks``).
For each shape (T, H, F, E, K) and dtype it times, in one process and interleaved repeat by repeat (so
that load from other processes hits every row alike):

- ``bound``: the same FLOPs as plain dense GEMMs over T * K rows: ``x[T*K, H] @ [H, 2F]``, SwiGLU,
  ``@ [F, H]``, and their backward. No routing, no permutation, one weight instead of E.
- ``megamoe/<backend>``: the whole single-rank MoE layer (router -> sort by slot -> GroupedExperts ->
  unpermute and weighted combine), built by :func:`build_megamoe_moe`. ``megamoe/torch+grouped_mm``
  is the ``torch`` backend with ``torch._grouped_mm`` forced on CPU (the code path accelerators
  run; on CPU torch's kernel is the same serial loop of GEMMs as the backend's own, which also takes
  dtypes the kernel does not).
- ``<hf block>/<experts implementation>``: transformers' Qwen3-MoE and Mixtral sparse blocks of the
  same sizes, for every experts implementation transformers offers that runs on CPU; the others are
  listed with the reason they are skipped.

Every row shares the same router and expert weights (the layouts coincide), so all route identically.
Prints a table of median times and their ratio to the bound, the ratio of the minima (other processes
only add time: the target's verdict is taken on it) and the fwd+bwd spread (median / min), with a
warning when a spread exceeds 1.3 (a busy host); writes JSON (default benchmarks/results/moe_layer.json).

Allocator: by default this script tells glibc to serve every allocation from the heap and never
give freed memory back (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, -1)``), i.e. what
PyTorch's caching allocator does on GPUs. With glibc's defaults every tensor above 32 MB is a fresh
mmap, and on this kind of VM the page faults of a fresh 256 MB tensor cost ~170 ms on first touch
(8x the memset), charged to whichever row allocates most: the MoE rows, whose weight gradients are E
times the bound's. ``--default-allocator`` measures with glibc's defaults instead.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common import (BATCHED_MM_MEMORY_LIMIT, HF_CUDA_ONLY, NOISY_SPREAD,  # sibling module
                    argument_parser, keep_freed_memory_in_heap, matmul_peaks, time_call, write_results)
from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
from megamoe.moe.experts.grouped_mlp import GroupedMLPFunction, SlotGroups
from megamoe.moe.permutation import permute_by_slot, unpermute_and_combine
from megamoe.moe.router import Router, RouterConfig

SHAPES = [  # (T, H, F, E, K)
    (2048, 1024, 512, 64, 8),
    (2048, 1024, 2816, 8, 2),
    (256, 1024, 512, 64, 8),
]
TARGETS = {  # megamoe/torch forward+backward, as a multiple of the bound
    (2048, 1024, 512, 64, 8): 1.2,
    (2048, 1024, 2816, 8, 2): 1.1,
    (256, 1024, 512, 64, 8): 1.5,
}
BF16_TARGETS = {(2048, 1024, 512, 64, 8): 1.5}    # issue 33: bf16 fwd+bwd within 1.5x the bf16 dense bound
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MEGAMOE_BACKENDS = ("torch", "loop")
HF_BLOCKS = ("qwen3_moe", "mixtral")
# Experts implementations transformers registers; the CUDA-only ones are skipped with a reason.


class MegamoeMoE(nn.Module):
    """Router -> sort by slot -> GroupedExperts -> unpermute and weighted combine (one rank, every
    expert in one slot)."""

    def __init__(self, router: Router, experts: GroupedExperts):
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.router(x)
        rows, tokens_per_slot, state = permute_by_slot(x, routing.expert_ids, self.experts.config.num_local_slots)
        return unpermute_and_combine(self.experts(rows, tokens_per_slot), routing.weights, state)


class GroupedMMKernelExperts(GroupedExperts):
    """The ``torch`` backend with ``torch._grouped_mm`` forced, whatever the device."""

    def forward(self, tokens_sorted: torch.Tensor, tokens_per_slot: torch.Tensor) -> torch.Tensor:
        groups = SlotGroups.from_counts(tokens_per_slot, tokens_sorted.shape[0], use_grouped_mm=True)
        return GroupedMLPFunction.apply(tokens_sorted, self.w_gate_up, self.w_down, groups, self.config.activation)


def build_megamoe_moe(hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                      backend: str) -> nn.Module:
    """The single-rank megamoe MoE layer measured by this benchmark: ``forward(x [T, H]) -> [T, H]``."""
    router = Router(RouterConfig(hidden_size, num_experts, top_k, norm_topk_prob=True))
    experts = GroupedExperts(ExpertsConfig(num_experts, hidden_size, ffn_hidden_size, backend=backend))
    return MegamoeMoE(router, experts)


@dataclass
class Row:
    name: str
    forward: Callable[[], torch.Tensor] | None    # no-grad forward
    train_step: Callable[[], None] | None         # forward + backward, gradients reset before
    skip_reason: str | None = None


def _dense_bound(x: torch.Tensor, H: int, F_: int, K: int, generator: torch.Generator) -> Row:
    rows = x.detach().repeat_interleave(K, dim=0).requires_grad_()     # [T*K, H], in x's dtype
    w1 = (torch.randn(H, 2 * F_, generator=generator) * 0.02).to(x.dtype).requires_grad_()
    w2 = (torch.randn(F_, H, generator=generator) * 0.02).to(x.dtype).requires_grad_()
    grad_out = torch.randn(rows.shape[0], H, generator=generator).to(x.dtype)

    def compute():
        gate, up = (rows @ w1).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2

    def forward():
        with torch.no_grad():
            return compute()

    def train_step():
        for t in (rows, w1, w2):
            t.grad = None
        compute().backward(grad_out)

    return Row("bound", forward, train_step)


def _module_row(name: str, module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> Row:
    x_input = x.detach().clone().requires_grad_()

    def forward():
        with torch.no_grad():
            return module(x_input)

    def train_step():
        module.zero_grad(set_to_none=True)
        x_input.grad = None
        module(x_input).backward(grad_out)

    return Row(name, forward, train_step)


class _HFAdapter(nn.Module):
    """[T, H] in and out around an HF sparse block ([B, S, H])."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x.unsqueeze(0)).squeeze(0)


def _hf_block(family: str, H: int, F_: int, E: int, K: int, implementation: str) -> nn.Module:
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F_, num_experts=E, num_experts_per_tok=K,
                                norm_topk_prob=True)
        config._experts_implementation = implementation
        return Qwen3MoeSparseMoeBlock(config)
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=H, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=K)
    config._experts_implementation = implementation
    return MixtralSparseMoeBlock(config)


def _hf_implementations() -> list[str]:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ["eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys())]


def build_rows(shape, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> list[Row]:
    """Every row of ``shape``, weights and activations in ``dtype``."""
    T, H, F_, E, K = shape
    x = torch.randn(T, H, generator=generator).to(dtype)
    grad_out = torch.randn(T, H, generator=generator).to(dtype)
    rows = [_dense_bound(x, H, F_, K, generator)]

    # One set of weights for every row: megamoe's stacked [E, 2F, H] / [E, H, F] is HF's layout.
    reference = build_megamoe_moe(H, F_, E, K, "torch")
    with torch.no_grad():
        reference.router.weight.normal_(0.0, 0.02, generator=generator)
        reference.experts.w_gate_up.normal_(0.0, 0.02, generator=generator)
        reference.experts.w_down.normal_(0.0, 0.02, generator=generator)
    reference.to(dtype)
    with torch.no_grad():       # megamoe holds its gate in fp32: the dtype's values, so that every row routes alike
        reference.router.weight.copy_(reference.router.weight.to(dtype))
    router_weight = reference.router.weight
    hf_router_weight = nn.Parameter(router_weight.detach().to(dtype))        # transformers' gate: in the dtype
    w_gate_up, w_down = reference.experts.w_gate_up, reference.experts.w_down

    kernel_forced = MegamoeMoE(reference.router, GroupedMMKernelExperts(reference.experts.config))
    for name, module in [*((f"megamoe/{b}", build_megamoe_moe(H, F_, E, K, b)) for b in MEGAMOE_BACKENDS),
                         ("megamoe/torch+grouped_mm", kernel_forced)]:
        module.router.weight, module.experts.w_gate_up, module.experts.w_down = router_weight, w_gate_up, w_down
        rows.append(_module_row(name, module, x, grad_out))

    for family in HF_BLOCKS:
        for implementation in _hf_implementations():
            name = f"{family}/{implementation}"
            if implementation in HF_CUDA_ONLY:
                rows.append(Row(name, None, None, HF_CUDA_ONLY[implementation]))
                continue
            if implementation == "batched_mm":
                weight_copies = T * K * 3 * H * F_ * 4
                if weight_copies > BATCHED_MM_MEMORY_LIMIT:
                    rows.append(Row(name, None, None, f"copies weights per (token, expert) pair: "
                                                      f"{weight_copies / 2**30:.0f} GiB"))
                    continue
            block = _hf_block(family, H, F_, E, K, implementation).to(dtype)
            block.gate.weight = hf_router_weight
            block.experts.gate_up_proj, block.experts.down_proj = w_gate_up, w_down
            rows.append(_module_row(name, _HFAdapter(block), x, grad_out))
    return rows


def measure(rows: list[Row], repeats: int) -> dict[str, dict]:
    """Warm every row up once, then ``repeats`` rounds over all rows; medians in seconds. A row
    whose warm-up step took over 10 s gets a third of the repeats (at least 1)."""
    runnable = [r for r in rows if r.skip_reason is None]
    times: dict[str, dict[str, list[float]]] = {r.name: {"forward": [], "train_step": []} for r in runnable}
    slow = set()
    for row in runnable:
        row.forward()
        if time_call(row.train_step) > 10.0:
            slow.add(row.name)
    for round_index in range(repeats):
        for row in runnable:
            if row.name in slow and round_index >= max(1, repeats // 3):
                continue
            times[row.name]["forward"].append(time_call(row.forward))
            times[row.name]["train_step"].append(time_call(row.train_step))
    return {name: {kind: {"median_s": statistics.median(v), "min_s": min(v), "repeats": len(v)}
                   for kind, v in kinds.items()}
            for name, kinds in times.items()}


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    parser.add_argument("--dtype", choices=(*DTYPES, "all"), default="all", help="the dtype of the tables")
    parser.add_argument("--default-allocator", action="store_true",
                        help="keep glibc's allocator defaults (large tensors are fresh mmaps)")
    parser.add_argument("--shape", type=int, nargs=5, action="append", metavar=("T", "H", "F", "E", "K"),
                        help="measure this shape instead of the issue's three (repeatable); no target")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (1: the figures of docs/bf16.md, taken on a loaded 2-core host)")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "moe_layer.json"),
                        help="where to write the results")
    args = parser.parse_args(argv)
    allocator = "glibc defaults" if args.default_allocator else keep_freed_memory_in_heap()
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    generator = torch.Generator().manual_seed(0)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, allocator: {allocator}")
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__,
               "allocator": allocator, "matmul_peaks": matmul_peaks(), "shapes": []}
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    for shape, dtype in [(tuple(s), d) for s in (args.shape or SHAPES) for d in dtypes]:
        rows = build_rows(shape, generator, DTYPES[dtype])
        timings = measure(rows, repeats)
        bound = timings["bound"]
        targets = TARGETS if dtype == "fp32" else BF16_TARGETS
        entry = {"T_H_F_E_K": list(shape), "dtype": dtype, "target_megamoe_torch_train": targets.get(shape),
                 "rows": []}
        print(f"\n(T, H, F, E, K) = {shape}, {dtype}   times: median ms over n repeats; ratio: / bound's "
              "(min ratio: fastest repeat / bound's fastest)")
        print(f"{'row':26s} {'fwd ms':>9s} {'ratio':>6s} {'fwd+bwd ms':>11s} {'ratio':>6s} {'min ratio':>9s} "
              f"{'spread':>6s} {'n':>3s}")
        noisy = []
        for row in rows:
            if row.skip_reason is not None:
                print(f"{row.name:26s} skipped: {row.skip_reason}")
                entry["rows"].append({"name": row.name, "skipped": row.skip_reason})
                continue
            t = timings[row.name]
            fwd, train = t["forward"]["median_s"], t["train_step"]["median_s"]
            fwd_ratio, train_ratio = fwd / bound["forward"]["median_s"], train / bound["train_step"]["median_s"]
            train_min_ratio = t["train_step"]["min_s"] / bound["train_step"]["min_s"]
            spread = train / t["train_step"]["min_s"]
            noisy += [row.name] if spread > NOISY_SPREAD else []
            print(f"{row.name:26s} {fwd * 1e3:9.1f} {fwd_ratio:6.2f} {train * 1e3:11.1f} {train_ratio:6.2f} "
                  f"{train_min_ratio:9.2f} {spread:6.2f} {t['train_step']['repeats']:3d}")
            entry["rows"].append({"name": row.name, **t, "forward_ratio": fwd_ratio, "train_step_ratio": train_ratio,
                                  "train_step_min_ratio": train_min_ratio, "train_step_spread": spread})
        entry["noisy_rows"] = noisy
        if noisy:
            print(f"WARNING: fwd+bwd median/min above {NOISY_SPREAD} for {', '.join(noisy)}: the host was busy; "
                  "rerun for figures worth quoting")
        if shape in targets:
            torch_row = next(r for r in entry["rows"] if r["name"] == "megamoe/torch")
            entry["target_met"] = torch_row["train_step_min_ratio"] <= targets[shape]
            print(f"target for megamoe/torch {dtype} fwd+bwd: <= {targets[shape]}x the bound (minima): "
                  f"{'met' if entry['target_met'] else 'NOT met'}")
        results["shapes"].append(entry)
        del rows

    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
