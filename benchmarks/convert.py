"""import-hf and export-hf of a generated ~2 GB HuggingFace MoE checkpoint: time against ``cp``, peak memory.

    python benchmarks/convert.py [--size-gb 2.0] [--repeats 6] [--fp8-size-gb 2.0] [--fp8-repeats 3] [--fp8-experts 32]
        [--json benchmarks/results/convert.json]

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

FP8 row: the same model as a block-FP8 release (DeepSeek's layout: the attention and expert weights
``float8_e4m3fn`` with fp32 ``*.weight_scale_inv`` per 128 x 128 block, the rest bf16; random bytes,
written shard by shard), ``--fp8-size-gb`` of files, imported to bf16 (each weight dequantized with its
scales) and kept (``--dtype keep``: e4m3 weights and scales copied), rotated with a ``cp`` of the same
directory over ``--fp8-repeats`` rounds (``--fp8-experts`` per layer: fewer make a small quick row). The
dequantized import writes twice the bytes it reads, and converting e4m3 to fp32 (one thread, as every
conversion runs) is most of its time.

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
FP8_BLOCK = 128
LAYOUT = ["--tp", "2", "--pp", "1", "--ep", "2", "--etp", "2"]      # import-hf's target layout
DTYPE = torch.bfloat16
MIB = 2**20

# The child: import first, then time the conversion alone; print the seconds as the last line.
CHILD = """
import sys, time
t0 = time.perf_counter()
import torch, transformers  # noqa: F401,E401 - imported by the converter anyway; timed as startup
import megamoe.hf.export_hf, megamoe.hf.import_hf  # noqa: F401,E401
from megamoe.cli.convert import main
t1 = time.perf_counter()
code = main(sys.argv[1:])
t2 = time.perf_counter()
with open("/proc/self/status") as f:
    peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(f"RESULT {t1 - t0:.4f} {t2 - t1:.4f} {peak_kib}")
sys.exit(code)
"""


def layer_tensors(i: int, experts: int = EXPERTS) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    shapes = {
        p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
        p + "mlp.gate.weight": (experts, HIDDEN),
    }
    for e in range(experts):
        shapes[f"{p}mlp.experts.{e}.gate_proj.weight"] = (FFN, HIDDEN)
        shapes[f"{p}mlp.experts.{e}.up_proj.weight"] = (FFN, HIDDEN)
        shapes[f"{p}mlp.experts.{e}.down_proj.weight"] = (HIDDEN, FFN)
    return shapes


def nbytes(shape, dtype: torch.dtype = DTYPE) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _fp8_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``shapes`` as a block-FP8 release stores them: the attention and expert projections e4m3 with
    their fp32 block scales, the rest bf16."""
    out = {}
    for key, shape in shapes.items():
        if key.endswith("proj.weight"):
            out[key] = (shape, torch.float8_e4m3fn)
            out[key + "_scale_inv"] = (tuple(-(-s // FP8_BLOCK) for s in shape), torch.float32)
        else:
            out[key] = (shape, DTYPE)
    return out


def _random(shape, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:            # random bytes, NaN (0x7f / 0xff) made the largest finite value
        raw = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        return raw.masked_fill_((raw & 0x7F) == 0x7F, 0x7E).view(dtype)
    if dtype == torch.float32:                  # block scales: small positive
        return torch.rand(shape, generator=generator) * 1e-4 + 1e-6
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)


def generate(directory: Path, size_bytes: int, fp8: bool = False, experts: int = EXPERTS) -> dict:
    """Write config.json, the shards and the index (``fp8``: as a block-FP8 release; ``experts`` per
    layer); returns the checkpoint's facts."""
    import transformers

    def tensors(shapes):
        return _fp8_tensors(shapes) if fp8 else {k: (s, DTYPE) for k, s in shapes.items()}
    outer = tensors({"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
                     "lm_head.weight": (VOCAB, HIDDEN)})
    per_layer = sum(nbytes(s, d) for s, d in tensors(layer_tensors(0, experts)).values())
    num_layers = max(1, round((size_bytes - sum(nbytes(s, d) for s, d in outer.values())) / per_layer))
    specs = dict(outer)
    for i in range(num_layers):
        specs.update(tensors(layer_tensors(i, experts)))
    directory.mkdir(parents=True)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, num_hidden_layers=num_layers, intermediate_size=4 * HIDDEN, moe_intermediate_size=FFN,
        num_experts=experts, num_experts_per_tok=4, dtype="bfloat16").to_dict()
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
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

    for key, (shape, dtype) in specs.items():
        if shard and shard_bytes + nbytes(shape, dtype) > SHARD_BYTES:
            flush()
        shard[key] = _random(shape, dtype, generator)
        shard_bytes += nbytes(shape, dtype)
    flush()
    total = sum(nbytes(s, d) for s, d in specs.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"num_layers": num_layers, "tensors": len(specs), "tensor_bytes": total, "shards": shard_index,
            "largest_tensor_bytes": max(nbytes(s, d) for s, d in specs.values())}


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


def _rotate(steps: dict, repeats: int, output: Path) -> list[list[str]]:
    """``repeats`` rounds of every step, the order rotating (see the module docstring); ``output`` is
    deleted after each step."""
    names, orders = list(steps), []
    for round_index in range(repeats):
        orders.append(names[round_index % len(names):] + names[:round_index % len(names)])
        for name in orders[-1]:
            subprocess.run(["sync"], check=True)
            steps[name]()
            shutil.rmtree(output)
    return orders


def _copy_times(runs: dict) -> dict:
    return {"cp_s": statistics.median(runs["cp"]), "cp_sync_s": statistics.median(runs["cp_sync"]),
            "cp_runs_s": runs["cp"], "cp_sync_runs_s": runs["cp_sync"]}


def _report(runs: dict, steps, copy: float, copy_sync: float, rss_budget: int) -> dict:
    """The table rows of ``steps`` (printed) and their results."""
    print(f"{'step':<15} {'convert s':>9} {'x cp':>6} {'x cp+sync':>9} {'startup s':>9} {'peak RSS MiB':>12} "
          f"{'budget MiB':>10}  targets")
    results = {}
    for step in steps:
        seconds = statistics.median(r["conversion_s"] for r in runs[step])
        peak = max(r["peak_rss_bytes"] for r in runs[step])
        ratio, ratio_sync = seconds / copy, seconds / copy_sync
        time_ok, rss_ok = ratio_sync <= 1.5, peak <= rss_budget
        results[step] = {"conversion_s": seconds, "runs": runs[step], "x_cp": ratio, "x_cp_sync": ratio_sync,
                         "peak_rss_bytes": peak, "time_target_met": time_ok, "rss_target_met": rss_ok}
        print(f"{step:<15} {seconds:>9.2f} {ratio:>6.2f} {ratio_sync:>9.2f} "
              f"{statistics.median(r['startup_s'] for r in runs[step]):>9.2f} {peak / MIB:>12.0f} "
              f"{rss_budget / MIB:>10.0f}  time {'ok' if time_ok else 'MISSED'}, RSS {'ok' if rss_ok else 'MISSED'}")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--size-gb", type=float, default=2.0, help="size of the generated checkpoint (10^9 bytes)")
    parser.add_argument("--repeats", type=int, default=6,
                        help="rounds of cp / import-hf / export-hf, a multiple of 3 (medians)")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "convert.json"),
                        help="where to write the results")
    parser.add_argument("--fp8-size-gb", type=float, default=2.0,
                        help="size of the generated block-FP8 checkpoint (10^9 bytes)")
    parser.add_argument("--fp8-repeats", type=int, default=3, help="rounds of cp / import-hf bf16 / import-hf keep")
    parser.add_argument("--fp8-experts", type=int, default=EXPERTS,
                        help="experts per layer of the block-FP8 checkpoint (at least 4, even: top-4 over EP 2)")
    parser.add_argument("--workdir", default=None, help="where to put the temporary files (default: system temp)")
    args = parser.parse_args(argv)

    if args.repeats < 3 or args.repeats % 3:
        parser.error("--repeats must be a positive multiple of 3 (each step takes each position equally often)")
    if args.fp8_repeats < 1:
        parser.error("--fp8-repeats must be positive")
    if args.fp8_experts < 4 or args.fp8_experts % 2:
        parser.error("--fp8-experts must be even and at least 4 (top-4 routing, EP 2)")
    work = Path(tempfile.mkdtemp(prefix="megamoe-convert-bench-", dir=args.workdir))
    runs: dict[str, list] = {"cp": [], "cp_sync": [], "import-hf": [], "export-hf": []}
    fp8_runs: dict[str, list] = {"cp": [], "cp_sync": [], "import-hf bf16": [], "import-hf keep": []}
    try:
        hf, checkpoint, output = work / "hf", work / "megamoe", work / "output"
        facts = generate(hf, int(args.size_gb * 1e9))
        dir_bytes = sum(f.stat().st_size for f in hf.iterdir())
        convert(["import-hf", str(hf), str(checkpoint), *LAYOUT])         # what every export reads

        def copy_step(source: Path, into: dict) -> None:
            seconds = timed(["cp", "-r", str(source), str(output)])
            into["cp"].append(seconds)
            into["cp_sync"].append(seconds + timed(["sync"]))

        def import_step() -> None:
            runs["import-hf"].append(convert(["import-hf", str(hf), str(output), *LAYOUT]))

        def export_step() -> None:
            runs["export-hf"].append(convert(["export-hf", str(checkpoint), str(output), "--max-shard-size", "500MB"]))

        orders = _rotate({"cp": lambda: copy_step(hf, runs), "import-hf": import_step, "export-hf": export_step},
                         args.repeats, output)
        shutil.rmtree(hf)
        shutil.rmtree(checkpoint)

        fp8_hf = work / "hf_fp8"
        fp8_facts = generate(fp8_hf, int(args.fp8_size_gb * 1e9), fp8=True, experts=args.fp8_experts)
        fp8_dir_bytes = sum(f.stat().st_size for f in fp8_hf.iterdir())
        fp8_steps = {"cp": lambda: copy_step(fp8_hf, fp8_runs)}
        for dtype in ("bf16", "keep"):
            fp8_steps[f"import-hf {dtype}"] = lambda dtype=dtype: fp8_runs[f"import-hf {dtype}"].append(
                convert(["import-hf", str(fp8_hf), str(output), *LAYOUT, "--dtype", dtype]))
        fp8_orders = _rotate(fp8_steps, args.fp8_repeats, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rss_budget = facts["largest_tensor_bytes"] + 512 * MIB
    result = {"checkpoint": {**facts, "directory_bytes": dir_bytes, "dtype": str(DTYPE).removeprefix("torch.")},
              "import_layout": " ".join(LAYOUT), "repeats": args.repeats, "orders": orders,
              "peak_rss_budget_bytes": rss_budget, **_copy_times(runs)}
    print(f"HF checkpoint: {dir_bytes / 1e9:.2f} GB in {facts['shards']} shards, {facts['tensors']} tensors, largest "
          f"{facts['largest_tensor_bytes'] / MIB:.1f} MiB; median of {args.repeats}: cp {result['cp_s']:.2f} s, "
          f"cp + sync {result['cp_sync_s']:.2f} s")
    print(f"import-hf layout: {' '.join(LAYOUT)}; export-hf --max-shard-size 500MB")
    result["steps"] = _report(runs, ("import-hf", "export-hf"), result["cp_s"], result["cp_sync_s"], rss_budget)

    fp8_budget = fp8_facts["largest_tensor_bytes"] + 512 * MIB
    fp8 = {"checkpoint": {**fp8_facts, "directory_bytes": fp8_dir_bytes, "experts": args.fp8_experts,
                          "weights": "float8_e4m3fn",
                          "block_size": [FP8_BLOCK, FP8_BLOCK]},
           "repeats": args.fp8_repeats, "orders": fp8_orders, "peak_rss_budget_bytes": fp8_budget,
           **_copy_times(fp8_runs)}
    print(f"\nblock-FP8 HF checkpoint: {fp8_dir_bytes / 1e9:.2f} GB in {fp8_facts['shards']} shards, "
          f"{fp8_facts['tensors']} tensors (e4m3 + fp32 scales per {FP8_BLOCK}x{FP8_BLOCK} block), largest "
          f"{fp8_facts['largest_tensor_bytes'] / MIB:.1f} MiB; median of {args.fp8_repeats}: cp {fp8['cp_s']:.2f} s, "
          f"cp + sync {fp8['cp_sync_s']:.2f} s")
    fp8["steps"] = _report(fp8_runs, ("import-hf bf16", "import-hf keep"), fp8["cp_s"], fp8["cp_sync_s"], fp8_budget)
    result["fp8"] = fp8
    write_results(args.json, result)


if __name__ == "__main__":
    main()
