"""Attention under masks with GQA: the path megamoe takes against SDPA's math kernel, per mask kind.

    python benchmarks/attention.py [--quick] [--device cuda] [--json benchmarks/results/attention.json]

One :func:`megamoe.transformer.attention.causal_attention` call (forward and backward; the decoding
row forward only, under ``no_grad``) with grouped query heads, for each mask kind: none (plain causal,
the ``is_causal`` kernel), left padding, packed documents, a sliding window shorter than the sequence,
sinks, CP's query positions (rank 0 of 2: half the queries over every key) and a padded decoding step.
Two paths per kind, measured in the same run:

- ``chosen``: the call as the library makes it on this device (off CPU, masked calls expand the KV
  heads so that CUDA's memory-efficient kernel takes the mask; CPU keeps ``enable_gqa``);
- ``math``: the same call under ``sdpa_kernel([MATH])``: SDPA's math kernel, which is where a mask
  with ``enable_gqa`` went on CUDA before (it materialises [B, Hq, Sq, Sk] scores and probabilities).

``fused``: whether the chosen call runs with the math kernel disabled (flash, memory-efficient and
cuDNN allowed); when it does not, the chosen row is measured with every kernel allowed. Time: the
minimum over ``--repeats`` calls after one warm-up (the median beside it; a median/min spread above
1.3 means the host was busy). Peak: the most bytes allocated at once during one call above what was
allocated before it (CUDA: ``max_memory_allocated``; CPU: the profiler's allocation records, summed in
order). Ratios are chosen / math. Prints a table, writes JSON (default benchmarks/results/attention.json).

On CPU the chosen path is CPU's flash kernel with ``enable_gqa`` (it takes masks; with sinks the KV
heads are expanded there too), so the rows show fused-versus-math on CPU, not CUDA's kernels.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import NOISY_SPREAD, argument_parser, write_results  # sibling module
from megamoe.transformer.attention import causal_attention, masked_attention_expands_kv_heads
from megamoe.transformer.context_parallel import cp_token_index

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
KINDS = ("causal", "padding", "documents", "sliding_window", "sinks", "context_parallel", "padded_decode")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv):
    parser = argument_parser(__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to run on (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="q / k / v dtype (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: 4096 on cuda, "
                                                                  "1024 on cpu, 128 with --quick)")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (a divisor of --heads)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim")
    parser.add_argument("--window", type=int, default=None, help="sliding window (default: seq-len / 4)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row")
    parser.add_argument("--quick", action="store_true", help="a small shape and 2 repeats (a smoke run)")
    parser.add_argument("--json", default="benchmarks/results/attention.json", help="where to write the results")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.quick:
        args.seq_len, args.heads, args.kv_heads, args.head_dim, args.repeats = 128, 8, 2, 32, 2
    args.seq_len = args.seq_len or (4096 if cuda else 1024)
    args.window = args.window or max(1, args.seq_len // 4)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if args.heads % args.kv_heads or args.seq_len % 4:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads}) and --seq-len "
                     f"({args.seq_len}) a multiple of 4")
    return args


def case_inputs(kind: str, args, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
    """(q, k, v, causal_attention keyword arguments, whether to run backward) of one mask kind."""
    batch, seq = args.batch, args.seq_len
    q_len = {"context_parallel": seq // 2, "padded_decode": 1}.get(kind, seq)
    training = kind != "padded_decode"

    def tensor(*shape):
        t = torch.randn(*shape, generator=generator).to(device, dtype)
        return t.requires_grad_(training)

    q = tensor(batch, args.heads, q_len, args.head_dim)
    k, v = (tensor(batch, args.kv_heads, seq, args.head_dim) for _ in range(2))
    padding = torch.ones(batch, seq, dtype=torch.bool, device=device)
    padding[:, : seq // 8] = False                                           # left padding
    kwargs = {
        "causal": {},
        "padding": dict(attention_mask=padding),
        # documents of seq / 8, seq / 4, seq / 8, seq / 2 tokens, the same in every row
        "documents": dict(document_ids=torch.repeat_interleave(
            torch.arange(4, device=device), torch.tensor([seq // 8, seq // 4, seq // 8, seq // 2], device=device)
        ).expand(batch, seq)),
        "sliding_window": dict(sliding_window=args.window),
        "sinks": dict(sinks=torch.randn(args.heads, generator=generator).to(device, dtype).requires_grad_(training)),
        "context_parallel": dict(query_positions=cp_token_index(seq, 0, 2, device=device)),
        "padded_decode": dict(attention_mask=padding),
    }[kind]
    return q, k, v, kwargs, training


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(fn, device: torch.device) -> int:
    """The most bytes allocated at once while ``fn()`` runs, above what was allocated before it."""
    if device.type == "cuda":
        _synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    allocated = peak = 0
    for _, nbytes in records:              # frees are negative
        allocated += nbytes
        peak = max(peak, allocated)
    return peak


def measure(call, device: torch.device, repeats: int) -> dict:
    call()                                                                     # warm-up
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    best, median = min(times), statistics.median(times)
    return {"times_s": times, "min_s": best, "median_s": median, "spread": median / best,
            "peak_bytes": peak_bytes(call, device)}


def run_kind(kind: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    q, k, v, kwargs, training = case_inputs(kind, args, device, dtype, torch.Generator().manual_seed(0))
    out_grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    scale = args.head_dim ** -0.5

    def call(backends):
        def step():
            with sdpa_kernel(backends), torch.set_grad_enabled(training):
                out = causal_attention(q, k, v, scale, **kwargs)
                if training:
                    out.backward(out_grad)
                    for t in (q, k, v, kwargs.get("sinks")):
                        if t is not None:
                            t.grad = None
        return step

    try:
        call(FUSED)()
        fused = True
    except RuntimeError as error:             # only the math kernel takes the call
        if "No available kernel" not in str(error):
            raise
        fused = False
    chosen = measure(call(FUSED if fused else [*FUSED, SDPBackend.MATH]), device, args.repeats)
    math = measure(call([SDPBackend.MATH]), device, args.repeats)
    masked = bool(kwargs) or q.shape[-2] != k.shape[-2]
    return {"kind": kind, "q_len": q.shape[-2], "k_len": k.shape[-2], "training": training, "fused": fused,
            "kv_heads_expanded": "sinks" in kwargs or masked and masked_attention_expands_kv_heads(device),
            "chosen": chosen, "math": math,
            "time_over_math": chosen["min_s"] / math["min_s"],
            "peak_over_math": chosen["peak_bytes"] / math["peak_bytes"]}


def print_table(rows: list[dict]) -> None:
    mib = 2**20
    print(f"{'mask kind':<17} {'fused':>5} {'kv x':>4} {'chosen ms':>10} {'math ms':>9} {'time/math':>9} "
          f"{'chosen MiB':>10} {'math MiB':>9} {'peak/math':>9}")
    for r in rows:
        print(f"{r['kind']:<17} {str(r['fused']):>5} {'yes' if r['kv_heads_expanded'] else 'no':>4} "
              f"{r['chosen']['min_s'] * 1e3:>10.2f} {r['math']['min_s'] * 1e3:>9.2f} {r['time_over_math']:>9.2f} "
              f"{r['chosen']['peak_bytes'] / mib:>10.1f} {r['math']['peak_bytes'] / mib:>9.1f} "
              f"{r['peak_over_math']:>9.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    rows = [run_kind(kind, args, device, dtype) for kind in KINDS]
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{args.dtype}, batch {args.batch}, seq {args.seq_len}, heads {args.heads} / kv {args.kv_heads}, "
          f"head dim {args.head_dim}, window {args.window}, torch {torch.__version__}")
    print_table(rows)
    noisy = [f"{r['kind']}/{path}" for r in rows for path in ("chosen", "math") if r[path]["spread"] > NOISY_SPREAD]
    if noisy:
        print(f"WARNING: median/min above {NOISY_SPREAD} in {', '.join(noisy)}: the host was busy "
              "(judge by the minima)")
    write_results(Path(args.json), {"device": str(device), "dtype": args.dtype, "batch": args.batch,
                                    "seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.kv_heads,
                                    "head_dim": args.head_dim, "window": args.window, "repeats": args.repeats,
                                    "torch": torch.__version__, "noisy_rows": noisy, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
