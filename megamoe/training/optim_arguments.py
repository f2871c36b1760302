"""Command-line flags of a training script for the LR schedule, the non-finite guard, fp16 loss scaling and the
optimizer's memory layout (``--distributed-optimizer``, ``--zero-stage``, ``--param-dtype``, as Megatron-LM's
``--use-distributed-optimizer`` and ``--bf16``),
``--lr-schedule {constant,linear,cosine,wsd}`` (Megatron-LM's ``--lr-decay-style``) and ``--warmup-steps``,
the others named as Megatron-LM's (``--lr-wsd-decay-style``, ``--override-opt-param-scheduler``,
``--initial-loss-scale``, ``--loss-scale-window``, ``--min-loss-scale``), and the AdamW hyperparameters under
Megatron-LM's names (``--weight-decay``, ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``, ``--clip-grad``)::

    add_optim_arguments(parser)
    ...
    config = TrainConfig(lr=args.lr, **train_config_kwargs(args, train_steps=args.steps))
    load_training_checkpoint(..., override_lr_schedule=args.override_opt_param_scheduler)
"""

from __future__ import annotations

import math
import re

import torch

from megamoe.errors import UsageError
from megamoe.training.loss_scaling import LossScaleConfig
from megamoe.training.lr_schedule import LR_SCHEDULE_STYLES, WSD_DECAY_STYLES, LRScheduleConfig
from megamoe.training.trainer import TrainConfig

__all__ = ["add_optim_arguments", "train_config_kwargs", "param_dtype", "PARAM_DTYPES"]

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_ADAMW = TrainConfig()          # the flags' defaults are TrainConfig's

_FLAGS = {"style": "--lr-schedule", "warmup_steps": "--warmup-steps", "decay_steps": "--lr-decay-steps",
          "min_lr_ratio": "--min-lr-ratio", "wsd_decay_style": "--lr-wsd-decay-style",
          "wsd_decay_steps": "--lr-wsd-decay-steps", "wsd_decay_fraction": "--lr-wsd-decay-fraction",
          "initial_scale": "--initial-loss-scale", "growth_interval": "--loss-scale-window",
          "min_scale": "--min-loss-scale"}


def add_optim_arguments(parser) -> None:
    """Add the flags (an argument group "LR schedule and guard rails")."""
    g = parser.add_argument_group("LR schedule and guard rails")
    g.add_argument("--lr-schedule", choices=list(LR_SCHEDULE_STYLES), type=str.lower, default="constant", help="LR after the warmup: constant at --lr, or decaying to --min-lr-ratio "
                                            "of it (WSD: warmup-stable-decay)")
    g.add_argument("--warmup-steps", "--lr-warmup-steps", type=int, default=0,
                   help="steps of linear warmup from 0 to --lr (at most the run's --steps)")
    g.add_argument("--lr-decay-steps", type=int, default=None,
                   help="the step at which the decay ends (default: the run's last step)")
    g.add_argument("--min-lr-ratio", type=float, default=0.0, help="the LR the decay ends at, as a fraction of --lr")
    g.add_argument("--lr-wsd-decay-style", choices=list(WSD_DECAY_STYLES), default="linear",
                   help="shape of WSD's final decay")
    g.add_argument("--lr-wsd-decay-steps", type=int, default=None, help="length of WSD's final decay, in steps")
    g.add_argument("--lr-wsd-decay-fraction", type=float, default=None,
                   help="length of WSD's final decay, as a fraction of --lr-decay-steps (default with WSD: 0.2)")
    g.add_argument("--override-opt-param-scheduler", action="store_true",
                   help="on resume, use these schedule flags even if the checkpoint was saved with others "
                        "(otherwise a changed schedule is an error)")
    g.add_argument("--max-skipped-steps", type=int, default=10,
                   help="stop after this many consecutive non-finite (skipped) steps; 0: never")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16, help="fp16: the initial loss scale")
    g.add_argument("--loss-scale-window", type=int, default=2000,
                   help="fp16: good steps in a row before the loss scale doubles")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="fp16: the loss scale never backs off below this; overflows above it lower the scale "
                        "and do not count toward --max-skipped-steps")
    a = parser.add_argument_group("AdamW (Megatron-LM's flag names; biases and norms are not decayed)")
    a.add_argument("--weight-decay", type=float, default=_ADAMW.weight_decay, help="decoupled weight decay")
    a.add_argument("--adam-beta1", type=float, default=_ADAMW.betas[0], help="decay of the first moment, in [0, 1)")
    a.add_argument("--adam-beta2", type=float, default=_ADAMW.betas[1], help="decay of the second moment, in [0, 1)")
    a.add_argument("--adam-eps", type=float, default=_ADAMW.eps, help="added to the second moment's root, > 0")
    a.add_argument("--clip-grad", type=float, default=_ADAMW.grad_clip,
                   help="clip the global gradient norm to this; 0: no clipping")
    m = parser.add_argument_group("optimizer memory")
    m.add_argument("--distributed-optimizer", action="store_true",
                   help="shard the Adam moments (and the fp32 master weights of bf16 parameters) over the data-"
                        "parallel ranks (experts: over expert-DP); gradients are reduce-scattered, parameters "
                        "all-gathered (ZeRO-1)")
    m.add_argument("--zero-stage", type=int, choices=(1, 2), default=1,
                   help="2: also free the full gradients after the reduce-scatter (needs --distributed-optimizer)")
    o = parser.add_argument_group("communication overlap")
    o.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each gradient bucket's data-parallel all-reduce (reduce-scatter under "
                        "--distributed-optimizer) asynchronously during the last micro-batch's backward, as soon "
                        "as its gradients are ready; waited for before the optimizer step")
    o.add_argument("--grad-bucket-mb", type=float, default=40.0,
                   help="MB of (fp32) gradient per reduction bucket, > 0")
    m.add_argument("--param-dtype", choices=list(PARAM_DTYPES), default="fp32",
                   help="dtype of the model's parameters; bf16 keeps fp32 master weights in the optimizer")


def _with_flag_names(message: str) -> str:
    message = re.sub(r"\b(LRScheduleConfig|LossScaleConfig)(\.|: )", "", message)
    for field in sorted(_FLAGS, key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){field}\b", _FLAGS[field], message)
    return message


def train_config_kwargs(args, *, train_steps: int) -> dict:
    """``TrainConfig`` keyword arguments (``lr_schedule``, ``max_skipped_steps``, ``loss_scale``) from the
    flags of :func:`add_optim_arguments`; the decay ends at ``train_steps`` unless ``--lr-decay-steps``.
    Also ``distributed_optimizer``, ``zero_stage``, ``overlap_grad_reduce``, ``grad_bucket_mb`` and AdamW's
    ``weight_decay``, ``betas``, ``eps``, ``grad_clip``. Raises :class:`~megamoe.cli.launch.UsageError` naming the
    flag."""
    style = args.lr_schedule
    wsd_fraction = args.lr_wsd_decay_fraction
    if style == "wsd" and wsd_fraction is None and args.lr_wsd_decay_steps is None:
        wsd_fraction = 0.2
    if style != "wsd" and (args.lr_wsd_decay_steps is not None or args.lr_wsd_decay_fraction is not None):
        raise UsageError(f"--lr-wsd-decay-steps / --lr-wsd-decay-fraction need --lr-schedule wsd, "
                         f"not {args.lr_schedule}")
    if args.max_skipped_steps < 0:
        raise UsageError(f"--max-skipped-steps must be >= 0 (0: never stop), got {args.max_skipped_steps}")
    if args.zero_stage == 2 and not args.distributed_optimizer:
        raise UsageError("--zero-stage 2 needs --distributed-optimizer (ZeRO-2 frees the gradients outside the "
                         "shards the distributed optimizer keeps)")
    if not 0 < args.grad_bucket_mb < float("inf"):
        raise UsageError(f"--grad-bucket-mb must be a number > 0 (MB of gradient per bucket), got {args.grad_bucket_mb}")
    for flag, value, valid, rule in (
            ("--weight-decay", args.weight_decay, 0 <= args.weight_decay < math.inf, "a finite number >= 0"),
            ("--adam-beta1", args.adam_beta1, 0 <= args.adam_beta1 < 1, "in [0, 1)"),
            ("--adam-beta2", args.adam_beta2, 0 <= args.adam_beta2 < 1, "in [0, 1)"),
            ("--adam-eps", args.adam_eps, 0 < args.adam_eps < math.inf, "a finite number > 0"),
            ("--clip-grad", args.clip_grad, 0 <= args.clip_grad < math.inf, "a finite number >= 0 (0: no clipping)")):
        if not valid:
            raise UsageError(f"{flag} must be {rule}, got {value}")
    # The decay ends at the run's last step unless --lr-decay-steps says otherwise: a warmup too long for the
    # run blames the flags the user gave.
    decays_to_run_end = style != "constant" and args.lr_decay_steps is None
    if args.warmup_steps > train_steps or (decays_to_run_end and args.warmup_steps >= train_steps):
        raise UsageError(f"--warmup-steps {args.warmup_steps} is too long for the run (--steps {train_steps})"
                         + (f": --lr-schedule {style} decays after the warmup until the last step" if decays_to_run_end
                            else ": the LR would never reach --lr")
                         + "; lower --warmup-steps or raise --steps")
    decay_steps = train_steps if args.lr_decay_steps is None else args.lr_decay_steps
    try:
        schedule = LRScheduleConfig(
            style=style, warmup_steps=args.warmup_steps, decay_steps=None if style == "constant" else decay_steps,
            min_lr_ratio=args.min_lr_ratio, wsd_decay_style=args.lr_wsd_decay_style,
            wsd_decay_steps=args.lr_wsd_decay_steps if style == "wsd" else None,
            wsd_decay_fraction=wsd_fraction if style == "wsd" else None)
        loss_scale = LossScaleConfig(initial_scale=args.initial_loss_scale, growth_interval=args.loss_scale_window,
                                     min_scale=args.min_loss_scale)
    except ValueError as e:
        raise UsageError(_with_flag_names(str(e))) from None
    return {"lr_schedule": schedule, "max_skipped_steps": args.max_skipped_steps, "loss_scale": loss_scale,
            "distributed_optimizer": args.distributed_optimizer, "zero_stage": args.zero_stage,
            "overlap_grad_reduce": args.overlap_grad_reduce, "grad_bucket_mb": args.grad_bucket_mb,
            "weight_decay": args.weight_decay, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_eps,
            "grad_clip": args.clip_grad}


def param_dtype(args) -> torch.dtype:
    """The model's parameter dtype from ``--param-dtype``."""
    return PARAM_DTYPES[args.param_dtype]
