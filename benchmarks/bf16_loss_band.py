"""The band within which a bf16 training run of the demo model follows the fp32 run's loss curve.

    python benchmarks/bf16_loss_band.py [--steps 200] [--window 10] [--threads 2] [--json out.json]

The demo's own model (examples/pretrain_moe.py's defaults: hidden 128, 4 layers, 8 experts, top-2, vocab
2048), one process, ``torch.set_num_threads(--threads)`` (one thread runs faster than two on a host whose
other jobs hold the cores: its steps never wait for a descheduled partner thread; measured 3.3 against 65 s
per step at load average 13 on 2 cores), initialised once (seed 0) and trained three ways on the
same global batches (16 sequences of 64 tokens, micro-batches of 2, the demo's lr 5e-3 with AdamW, no
schedule): fp32; ``bf16``: bf16 parameters with fp32 master weights and fp32 gradient accumulation (the
Trainer's main_grad path, ``--param-dtype bf16``); ``autocast``: fp32 parameters under bf16 autocast
(``--autocast bf16``). The batches are 32 fixed random batches, cycled, so the loss falls well below
ln(vocab) within 200 steps (the model memorises them). Prints the losses every 20 steps and the band of
each bf16 run (:func:`megamoe.training.loss_band.loss_band`: the largest relative difference of
``--window``-step mean losses, the final window's, and the largest per-step one) and the wall time of
each run; writes JSON (default benchmarks/results/bf16_loss_band.json).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common import argument_parser, write_results  # sibling module
from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.loss_band import loss_band, train_losses
from megamoe.training.trainer import TrainConfig
from parallel_state import ParallelState

GLOBAL_BATCH, MICRO_BATCH, SEQ, DISTINCT_BATCHES, LR = 16, 2, 64, 32, 5e-3
logger = logging.getLogger("bf16_loss_band")


def demo_model_config():
    """`megamoe train`'s own model at its default flags (the demo's)."""
    from megamoe.cli.train import parse_args
    from megamoe.training.pretrain_checks import model_config
    args = parse_args([])
    return model_config(args, args.vocab_size)


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of each run")
    parser.add_argument("--window", type=int, default=10, help="steps per window mean of the band")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "bf16_loss_band.json"),
                        help="where to write the results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    config = demo_model_config()
    generator = torch.Generator().manual_seed(1)
    distinct = torch.randint(0, config.vocab_size, (DISTINCT_BATCHES, GLOBAL_BATCH, SEQ + 1), generator=generator)
    batches = [distinct[step % DISTINCT_BATCHES] for step in range(args.steps)]
    initial = None
    runs = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "autocast": (torch.float32, "bf16")}
    curves, seconds = {}, {}
    for name, (dtype, autocast) in runs.items():
        model = GPTMoEModel(config, ParallelState.single_process())    # fp32 initial weights, then cast
        if initial is None:
            initialize_parameters(model, seed=0)
            initial = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(initial)
        model.to(dtype)
        start = time.perf_counter()
        curves[name] = train_losses(model, tqdm(batches, desc=name, leave=False),
                                    TrainConfig(lr=LR, autocast=autocast), micro_batch=MICRO_BATCH)
        seconds[name] = time.perf_counter() - start
    print(f"demo model, {args.steps} steps of {GLOBAL_BATCH}x{SEQ} tokens, lr {LR}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'step':>5s}" + "".join(f" {name:>9s}" for name in curves))
    for step in [*range(0, args.steps, 20), args.steps - 1]:
        print(f"{step + 1:5d}" + "".join(f" {curve[step]:9.4f}" for curve in curves.values()))
    results = {"steps": args.steps, "window": args.window, "global_batch": GLOBAL_BATCH, "seq": SEQ, "lr": LR,
               "threads": torch.get_num_threads(), "torch": torch.__version__, "curves": curves,
               "seconds": seconds, "bands": {}}
    print(f"\nband against fp32 (relative, {args.window}-step window means): max, final window, max per step; "
          "wall s")
    for name in ("bf16", "autocast"):
        band = loss_band(curves["fp32"], curves[name], window=args.window)
        results["bands"][name] = vars(band)
        print(f"{name:9s} {band.max_rel:8.4f} {band.final_rel:8.4f} {band.max_step_rel:8.4f} {seconds[name]:8.1f}")
    print(f"{'fp32':9s} {'':8s} {'':8s} {'':8s} {seconds['fp32']:8.1f}")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
