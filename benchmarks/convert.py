"""import-hf and export-hf of a generated ~2 GB HuggingFace MoE checkpoint: time against ``cp``, peak memory.

    python benchmarks/convert.py [--size-gb 2.0] [--repeats 6] [--json benchmarks/results/convert.json]

Writes a Qwen3-MoE checkpoint (bf16, hidden 1024, 32 experts of FFN 1024, vocab 32000, as many layers as
fit the size) with safetensors directly, in shards of ~500 MB with an index, in a temporary directory
(deleted at the end), and imports it once (untimed) as the checkpoint every export-hf reads. Then
``--repeats`` rounds (a multiple of 3) of three steps, each writing the same 2 GB into a directory that
is deleted right after it:

- ``cp -r`` of the HF directory, then ``sync`` (the converter fsyncs what it writes and ``cp`` does not,
  so the time target is checked against "cp + sync"; plain "cp" is reported too);
- ``import-hf`` (layout ``--tp 2 --pp 1 --ep 2 --etp 2``: attention and experts cut into TP / ETP
  shards, experts spread over EP; ``down_proj`` and ``o_proj`` are cut along columns, so a third of the
  bytes must be gathered in memory rather than copied) and ``export-hf`` back, each in a child process:
  the conversion is timed inside the child after its imports (Python, torch and transformers take
  seconds to import; reported apart as "startup"; transformers' model registry, which it loads on first
  use, ~0.4 s, is still inside the conversion time). The child reports its peak RSS (``VmHWM``: resident
  pages of mapped input files included); ``getrusage`` of a child would count the pages of the parent
  it was forked from.

Every step starts after a ``sync`` and reads from the page cache. The order of the three steps rotates
from round to round, so each step runs first, second and third equally often: on this kind of VM the
disk writes each further gigabyte of a burst more slowly (measured: an export right after another one
took 1.7x to 2.8x as long), so a fixed order charges that to whichever step comes last. Medians over
the rounds.

Targets: conversion time <= 1.5x the copy time; peak RSS <= the largest tensor + 512 MB. Prints a table
and writes JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import argument_parser, write_results  # sibling module

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, FFN, VOCAB = 1024, 16, 4, 64, 32, 1024, 32000
SHARD_BYTES = 500 * 10**6
LAYOUT = ["--tp", "2", "--pp", "1", "--ep", "2", "--etp", "2"]      # import-hf's target layout
DTYPE = torch.bfloat16
MIB = 2**20

# The child: import first, then time the conversion alone; print the seconds as the last line.
CHILD = """
import sys, time
t0 = time.perf_counter()
import torch, transformers  # noqa: F401,E401 - imported by the converter anyway; timed as startup
import checkpoint_tools.export_hf, checkpoint_tools.import_hf  # noqa: F401,E401
from checkpoint_tools.cli import main
t1 = time.perf_counter()
code = main(sys.argv[1:])
t2 = time.perf_counter()
with open("/proc/self/status") as f:
    peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(f"RESULT {t1 - t0:.4f} {t2 - t1:.4f} {peak_kib}")
sys.exit(code)
"""


def layer_tensors(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    shapes = {
        p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
        p + "mlp.gate.weight": (EXPERTS, HIDDEN),
    }
    for e in range(EXPERTS):
        shapes[f"{p}mlp.experts.{e}.gate_proj.weight"] = (FFN, HIDDEN)
        shapes[f"{p}mlp.experts.{e}.up_proj.weight"] = (FFN, HIDDEN)
        shapes[f"{p}mlp.experts.{e}.down_proj.weight"] = (HIDDEN, FFN)
    return shapes


def nbytes(shape) -> int:
    n = DTYPE.itemsize
    for s in shape:
        n *= s
    return n


def generate(directory: Path, size_bytes: int) -> dict:
    """Write config.json, the shards and the index; returns the checkpoint's facts."""
    import transformers
    outer = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
             "lm_head.weight": (VOCAB, HIDDEN)}
    per_layer = sum(nbytes(s) for s in layer_tensors(0).values())
    num_layers = max(1, round((size_bytes - sum(nbytes(s) for s in outer.values())) / per_layer))
    shapes = dict(outer)
    for i in range(num_layers):
        shapes.update(layer_tensors(i))
    directory.mkdir(parents=True)
    transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, num_hidden_layers=num_layers, intermediate_size=4 * HIDDEN, moe_intermediate_size=FFN,
        num_experts=EXPERTS, num_experts_per_tok=4, dtype="bfloat16").to_json_file(directory / "config.json")
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    generator = torch.Generator().manual_seed(0)
    weight_map, shard, shard_bytes, shard_index = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, shard_index
        shard_index += 1
        name = f"model-{shard_index:05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for key, shape in shapes.items():
        if shard and shard_bytes + nbytes(shape) > SHARD_BYTES:
            flush()
        shard[key] = (torch.randn(shape, generator=generator) * 0.02).to(DTYPE)
        shard_bytes += nbytes(shape)
    flush()
    total = sum(nbytes(s) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"num_layers": num_layers, "tensors": len(shapes), "tensor_bytes": total, "shards": shard_index,
            "largest_tensor_bytes": max(nbytes(s) for s in shapes.values())}


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def convert(argv: list[str]) -> dict:
    """Run the CLI in a child: its import and conversion times and its peak RSS."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed:\n{run.stdout}\n{run.stderr}")
    startup, conversion, peak_kib = run.stdout.strip().splitlines()[-1].split()[1:]
    return {"startup_s": float(startup), "conversion_s": float(conversion), "peak_rss_bytes": int(peak_kib) * 1024}


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--size-gb", type=float, default=2.0, help="size of the generated checkpoint (10^9 bytes)")
    parser.add_argument("--repeats", type=int, default=6,
                        help="rounds of cp / import-hf / export-hf, a multiple of 3 (medians)")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "convert.json"),
                        help="where to write the results")
    parser.add_argument("--workdir", default=None, help="where to put the temporary files (default: system temp)")
    args = parser.parse_args(argv)

    if args.repeats < 3 or args.repeats % 3:
        parser.error("--repeats must be a positive multiple of 3 (each step takes each position equally often)")
    work = Path(tempfile.mkdtemp(prefix="megamoe-convert-bench-", dir=args.workdir))
    runs: dict[str, list] = {"cp": [], "cp_sync": [], "import-hf": [], "export-hf": []}
    try:
        hf, checkpoint, output = work / "hf", work / "megamoe", work / "output"
        facts = generate(hf, int(args.size_gb * 1e9))
        dir_bytes = sum(f.stat().st_size for f in hf.iterdir())
        convert(["import-hf", str(hf), str(checkpoint), *LAYOUT])         # what every export reads

        def copy_step() -> None:
            seconds = timed(["cp", "-r", str(hf), str(output)])
            runs["cp"].append(seconds)
            runs["cp_sync"].append(seconds + timed(["sync"]))

        def import_step() -> None:
            runs["import-hf"].append(convert(["import-hf", str(hf), str(output), *LAYOUT]))

        def export_step() -> None:
            runs["export-hf"].append(convert(["export-hf", str(checkpoint), str(output), "--max-shard-size", "500MB"]))

        steps = {"cp": copy_step, "import-hf": import_step, "export-hf": export_step}
        names, orders = list(steps), []
        for round_index in range(args.repeats):
            orders.append(names[round_index % 3:] + names[:round_index % 3])
            for name in orders[-1]:
                subprocess.run(["sync"], check=True)
                steps[name]()
                shutil.rmtree(output)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    copy, copy_sync = statistics.median(runs["cp"]), statistics.median(runs["cp_sync"])
    rss_budget = facts["largest_tensor_bytes"] + 512 * MIB
    result = {"checkpoint": {**facts, "directory_bytes": dir_bytes, "dtype": str(DTYPE).removeprefix("torch.")},
              "import_layout": " ".join(LAYOUT), "repeats": args.repeats, "orders": orders, "cp_s": copy,
              "cp_sync_s": copy_sync,
              "cp_runs_s": runs["cp"], "cp_sync_runs_s": runs["cp_sync"], "peak_rss_budget_bytes": rss_budget,
              "steps": {}}
    print(f"HF checkpoint: {dir_bytes / 1e9:.2f} GB in {facts['shards']} shards, {facts['tensors']} tensors, largest "
          f"{facts['largest_tensor_bytes'] / MIB:.1f} MiB; median of {args.repeats}: cp {copy:.2f} s, "
          f"cp + sync {copy_sync:.2f} s")
    print(f"import-hf layout: {' '.join(LAYOUT)}; export-hf --max-shard-size 500MB")
    print(f"{'step':<10} {'convert s':>9} {'x cp':>6} {'x cp+sync':>9} {'startup s':>9} {'peak RSS MiB':>12} "
          f"{'budget MiB':>10}  targets")
    for step in ("import-hf", "export-hf"):
        seconds = statistics.median(r["conversion_s"] for r in runs[step])
        peak = max(r["peak_rss_bytes"] for r in runs[step])
        ratio, ratio_sync = seconds / copy, seconds / copy_sync
        time_ok, rss_ok = ratio_sync <= 1.5, peak <= rss_budget
        result["steps"][step] = {"conversion_s": seconds, "runs": runs[step], "x_cp": ratio, "x_cp_sync": ratio_sync,
                                 "peak_rss_bytes": peak, "time_target_met": time_ok, "rss_target_met": rss_ok}
        print(f"{step:<10} {seconds:>9.2f} {ratio:>6.2f} {ratio_sync:>9.2f} "
              f"{statistics.median(r['startup_s'] for r in runs[step]):>9.2f} {peak / MIB:>12.0f} "
              f"{rss_budget / MIB:>10.0f}  time {'ok' if time_ok else 'MISSED'}, RSS {'ok' if rss_ok else 'MISSED'}")
    write_results(args.json, result)


if __name__ == "__main__":
    main()
