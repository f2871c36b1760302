"""Command-line flags of activation recomputation (:mod:`megamoe.transformer.recompute`), Megatron's names::

    add_recompute_arguments(parser)
    ...
    config = dataclasses.replace(config, recompute=recompute_config_from_args(args))   # UsageError naming the flag
"""

from __future__ import annotations

from megamoe.errors import UsageError
from megamoe.transformer.recompute import DEFAULT_SELECTIVE_MODULES, RECOMPUTE_GRANULARITIES, RECOMPUTE_MODULES, \
    RecomputeConfig

__all__ = ["add_recompute_arguments", "recompute_config_from_args"]


def add_recompute_arguments(parser) -> None:
    """Add ``--recompute`` and ``--recompute-modules`` (an argument group)."""
    g = parser.add_argument_group("activation recomputation")
    g.add_argument("--recompute", choices=RECOMPUTE_GRANULARITIES, default="none",
                   help="recompute activations in backward instead of keeping them: full (each decoder layer "
                        "whole, keeping its input only) or selective (--recompute-modules); a checkpoint resumes "
                        "under any choice")
    g.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, default=None, metavar="MODULE",
                   help=f"with --recompute selective: what to recompute, of {', '.join(RECOMPUTE_MODULES)} "
                        f"(default: {' '.join(DEFAULT_SELECTIVE_MODULES)})")


def recompute_config_from_args(args) -> RecomputeConfig:
    """The :class:`RecomputeConfig` of the flags; :class:`~megamoe.cli.launch.UsageError` naming the flag."""
    if args.recompute_modules is not None and args.recompute != "selective":
        raise UsageError(f"--recompute-modules applies to --recompute selective, got --recompute {args.recompute}")
    try:
        return RecomputeConfig(args.recompute, tuple(args.recompute_modules or ()))
    except ValueError as e:                 # argparse's choices leave nothing to fail here; kept for safety
        raise UsageError(f"--recompute: {e}") from None
