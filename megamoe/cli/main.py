"""The ``megamoe`` command: ``megamoe SUBCOMMAND [flags]`` (also ``python -m megamoe``, and under torchrun
``torchrun --nproc-per-node N -m megamoe train ...``). Each subcommand parses its own flags (``megamoe
SUBCOMMAND --help``) and reports a mistake as one ``megamoe SUBCOMMAND: error: ...`` line with exit code 1.
``megamoe-convert`` and ``megamoe-preprocess`` are the same as ``megamoe convert`` and ``megamoe preprocess``.
"""

from __future__ import annotations

import sys

from megamoe.cli.launch import HelpFormatter, ScriptArgumentParser

__all__ = ["SUBCOMMANDS", "main"]


def _train(argv):
    from megamoe.cli import train
    return train.cli(argv)


def _generate(argv):
    from megamoe.cli import generate
    return generate.cli(argv)


def _serve(argv):
    from megamoe.cli import serve
    return serve.cli(argv)


def _convert(argv):
    from megamoe.cli import convert
    return convert.main(argv, prog="megamoe convert")


def _inspect(argv):
    from megamoe.cli import convert
    return convert.main(["inspect", *argv], prog="megamoe")      # its errors: "megamoe inspect: error: ..."


def _preprocess(argv):
    from megamoe.cli import preprocess
    return preprocess.cli(argv, prog="megamoe preprocess")


# name -> (what it does, its entry point): imported when chosen, so `megamoe --help` loads no model code.
SUBCOMMANDS = {
    "train": ("pretrain or fine-tune a MoE model (flags or --config run.toml)", _train),
    "generate": ("generate text from a checkpoint under any layout", _generate),
    "serve": ("an OpenAI-compatible HTTP server over a checkpoint (continuous batching)", _serve),
    "convert": ("checkpoint conversion: import-hf, export-hf, reshard, verify, ... (megamoe-convert)", _convert),
    "preprocess": ("tokenize documents into token files (megamoe-preprocess)", _preprocess),
    "inspect": ("describe a checkpoint: layout, placements, parameters, checksums, NaN/Inf", _inspect),
}


def build_parser() -> ScriptArgumentParser:
    parser = ScriptArgumentParser(
        prog="megamoe", formatter_class=HelpFormatter, description=__doc__,
        epilog="subcommands:\n" + "\n".join(f"  {name:<11} {what}" for name, (what, _) in SUBCOMMANDS.items()))
    parser.add_argument("subcommand", choices=list(SUBCOMMANDS), metavar="SUBCOMMAND",
                        help="one of " + ", ".join(SUBCOMMANDS))
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv[:1])          # --help, or the usage error naming the subcommands
    name = parser.parse_args(argv[:1]).subcommand
    return SUBCOMMANDS[name][1](argv[1:])
