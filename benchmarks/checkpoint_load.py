"""What verifying checksums on load costs: loading a checkpoint with and without ``verify_checksums``.

    python benchmarks/checkpoint_load.py [--size-gb 1.0] [--repeats 6] [--json benchmarks/results/checkpoint_load.json]

Saves a checkpoint of ``--size-gb`` of fp32 tensors (64 MiB each, one process, files of at most 512 MiB)
in a temporary directory (deleted at the end), then ``--repeats`` rounds of three steps, in an order that
alternates from round to round:

- ``load``: ``load_checkpoint(..., verify_checksums=False)`` into preallocated tensors (sizes checked,
  nothing hashed): the time to copy the bytes out of the page cache;
- ``verified load``: the same with ``verify_checksums=True`` after ``forget_verified()``, so that every
  file is hashed (XXH3-128) before it is read, as a first load in a process does;
- ``hash only``: hashing every file (``checksums.file_entry``), the part verification adds.

Every file is read once, untimed, before the first round, so every step reads from the page cache (the
hashing's share of a load from disk is smaller). Minima and medians over the rounds (the host is shared:
noise only adds time). Prints a table and writes JSON, with the verified load as a multiple of the plain
load.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

import torch

from common import argument_parser, time_call, write_results  # sibling module

from megamoe.checkpoint import checksums, integrity
from megamoe.checkpoint.format import load_checkpoint, read_manifest, save_checkpoint
from megamoe.checkpoint_state import LogicalChunk

TENSOR_ELEMENTS = 16 * 2**20          # 64 MiB of fp32
MAX_FILE_BYTES = 512 * 2**20
STEPS = ("load", "verified load", "hash only")


def make_checkpoint(path: str, size_bytes: int) -> list[LogicalChunk]:
    """Save ``size_bytes`` of random fp32 tensors as the checkpoint ``path``; returns chunks to load into."""
    count = max(1, round(size_bytes / (4 * TENSOR_ELEMENTS)))
    elements = min(TENSOR_ELEMENTS, max(1, size_bytes // 4))
    generator = torch.Generator().manual_seed(0)
    saved = [LogicalChunk(f"t{i}", torch.randn(elements, generator=generator), (elements,), (0,))
             for i in range(count)]
    save_checkpoint(path, saved, manifest_fields={}, max_file_bytes=MAX_FILE_BYTES)
    return [LogicalChunk(c.name, torch.empty_like(c.tensor), c.global_shape, c.offsets) for c in saved]


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--size-gb", type=float, default=1.0, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--repeats", type=int, default=6, help="rounds of the three steps")
    parser.add_argument("--json", default="benchmarks/results/checkpoint_load.json", help="where to write results")
    parser.add_argument("--workdir", default=None, help="directory for the temporary checkpoint (default: $TMPDIR)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or not args.size_gb > 0:
        parser.error("--repeats must be >= 1 and --size-gb > 0")

    tmp = tempfile.mkdtemp(prefix="megamoe-load-bench-", dir=args.workdir)
    try:
        path = os.path.join(tmp, "ckpt")
        chunks = make_checkpoint(path, int(args.size_gb * 1e9))
        manifest = read_manifest(path)
        files = [os.path.join(path, name) for name in sorted(manifest["files"])]
        total = sum(info["bytes"] for info in manifest["files"].values())
        for file in files:                                      # into the page cache, untimed
            checksums.file_entry(file)

        def verified_load():
            integrity.forget_verified()
            load_checkpoint(path, chunks, verify_checksums=True)

        run = {"load": lambda: load_checkpoint(path, chunks, verify_checksums=False),
               "verified load": verified_load,
               "hash only": lambda: [checksums.file_entry(file) for file in files]}
        times: dict[str, list[float]] = {step: [] for step in STEPS}
        orders = []
        for round_ in range(args.repeats):
            order = STEPS if round_ % 2 == 0 else STEPS[::-1]
            orders.append(list(order))
            for step in order:
                times[step].append(time_call(run[step]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows = {step: {"min_s": min(t), "median_s": statistics.median(t), "runs_s": t,
                   "gb_per_s": total / min(t) / 1e9} for step, t in times.items()}
    results = {"bytes": total, "files": len(files), "threads": torch.get_num_threads(), "orders": orders,
               "steps": rows,
               "verified_x_load_min": rows["verified load"]["min_s"] / rows["load"]["min_s"],
               "verified_x_load_median": rows["verified load"]["median_s"] / rows["load"]["median_s"]}
    print(f"checkpoint of {total / 1e9:.2f} GB in {len(files)} files, from the page cache, {args.repeats} rounds")
    print(f"{'step':<15}{'min s':>9}{'median s':>10}{'GB/s (min)':>12}")
    for step, row in rows.items():
        print(f"{step:<15}{row['min_s']:>9.3f}{row['median_s']:>10.3f}{row['gb_per_s']:>12.2f}")
    print(f"verified load = {results['verified_x_load_min']:.2f}x the plain load (minima), "
          f"{results['verified_x_load_median']:.2f}x (medians)")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
