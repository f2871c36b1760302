"""The command-line flags of the training metrics (sinks and MFU peak), for scripts such as
``examples/pretrain_moe.py``: :func:`add_metrics_arguments` defines them, :func:`check_metrics_arguments`
validates them before any rank starts (a missing package or a bad value is one ``error:`` line),
:func:`metric_sinks_from_arguments` builds the sinks (rank 0 only)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping

from megamoe.training.metric_sinks import MetricSinks, build_metric_sinks, require_sink_packages

__all__ = ["add_metrics_arguments", "check_metrics_arguments", "metric_sinks_from_arguments"]


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("metrics")
    g.add_argument("--tensorboard", dest="tensorboard_dir", metavar="DIR", type=Path, default=None,
                   help="write TensorBoard event files of the step metrics here (needs: pip install tensorboard)")
    g.add_argument("--wandb-project", default=None,
                   help="log the step metrics to this Weights & Biases project (needs: pip install wandb)")
    g.add_argument("--wandb-run-name", default=None, help="the W&B run's name; default: W&B's own")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="per-device peak TFLOP/s that MFU is measured against; default: the known GPU's dense "
                        "bf16/fp16 peak, else a matmul throughput measured at start")


def check_metrics_arguments(args: argparse.Namespace) -> None:
    """ValueError (a MissingPackageError for a package that is not installed) naming the flag."""
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    if args.tensorboard_dir is not None:
        if args.tensorboard_dir.exists() and not args.tensorboard_dir.is_dir():
            raise ValueError(f"--tensorboard {args.tensorboard_dir} exists and is not a directory")
    if args.wandb_run_name is not None and args.wandb_project is None:
        raise ValueError("--wandb-run-name needs --wandb-project")
    if args.wandb_project is not None:
        if not args.wandb_project.strip():
            raise ValueError("--wandb-project must name a project")
    require_sink_packages(tensorboard=args.tensorboard_dir is not None, wandb=args.wandb_project is not None)


def metric_sinks_from_arguments(args: argparse.Namespace, *, rank: int, jsonl_path: Path | None,
                                run_config: Mapping[str, Any] | None = None) -> MetricSinks:
    """The sinks ``args`` ask for, plus the JSON log at ``jsonl_path``; none on ranks other than 0."""
    return build_metric_sinks(rank=rank, jsonl_path=jsonl_path, tensorboard_dir=args.tensorboard_dir,
                              wandb_project=args.wandb_project, wandb_run_name=args.wandb_run_name,
                              run_config=run_config)
