"""Command-line flags of online expert rebalancing (:mod:`megamoe.moe.placement.eplb`), shared by the training and
generation scripts::

    add_eplb_arguments(parser, unit="steps")
    ...
    eplb = eplb_config_from_args(args)          # None without --eplb-interval; UsageError naming the flag
"""

from __future__ import annotations

import re

from megamoe.errors import UsageError
from megamoe.moe.placement.eplb import EPLBConfig

__all__ = ["add_eplb_arguments", "eplb_config_from_args"]

_FLAGS = {"interval": "--eplb-interval", "window": "--eplb-window", "balancedness_threshold": "--eplb-threshold",
          "max_layers_per_round": "--eplb-max-layers"}


def add_eplb_arguments(parser, *, unit: str) -> None:
    """Add the flags (an argument group); ``unit``: what the interval and window count ("steps" in
    training, "forward passes" in generation)."""
    g = parser.add_argument_group("online expert rebalancing (EPLB)")
    g.add_argument("--eplb-interval", type=int, default=None, metavar="N",
                   help=f"re-place experts over their slots every N {unit} from the recent expert load, moving "
                        "only the slots that change (default: off)")
    g.add_argument("--eplb-window", type=int, default=None, metavar="N",
                   help=f"{unit} of expert-load statistics a rebalance uses (default: --eplb-interval)")
    g.add_argument("--eplb-threshold", type=float, default=1.0, metavar="X",
                   help="re-place only the MoE layers whose balancedness (mean / max EP-rank load) is below X, in "
                        "(0, 1]; 1.0: every layer that is not perfectly balanced")
    g.add_argument("--eplb-max-layers", type=int, default=None, metavar="N",
                   help="re-place at most N layers per rebalance, the least balanced first (default: all)")


def eplb_config_from_args(args) -> EPLBConfig | None:
    """The :class:`EPLBConfig` of the flags, None without ``--eplb-interval``; raises
    :class:`~megamoe.cli.launch.UsageError` naming the flag."""
    if args.eplb_interval is None:
        given = [flag for flag, value in (("--eplb-window", args.eplb_window),
                                          ("--eplb-threshold", None if args.eplb_threshold == 1.0 else 1),
                                          ("--eplb-max-layers", args.eplb_max_layers)) if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} need --eplb-interval N (how often to rebalance)")
        return None
    window = args.eplb_window if args.eplb_window is not None else args.eplb_interval
    try:
        return EPLBConfig(window=window, interval=args.eplb_interval, balancedness_threshold=args.eplb_threshold,
                          max_layers_per_round=args.eplb_max_layers)
    except ValueError as e:
        message = re.sub(r"\bEPLBConfig\.(\w+)", lambda m: _FLAGS.get(m.group(1), m.group(0)), str(e))
        raise UsageError(message) from None
