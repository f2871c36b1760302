"""``megamoe preprocess`` (alias ``megamoe-preprocess``): tokenize documents into a megamoe token file
with :func:`megamoe.data.preprocess.preprocess`::

    megamoe preprocess --input data/ more.jsonl --tokenizer tok/ --output tokens.bin
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from megamoe.cli.launch import HelpFormatter, run_script
from megamoe.data.documents import DEFAULT_TEXT_SUFFIXES, FORMATS
from megamoe.data.parallel_encode import default_workers
from megamoe.data.preprocess import preprocess
from megamoe.data.tokenizer import Tokenizer
from megamoe.errors import UsageError

__all__ = ["parse_args", "main", "cli"]

PROG = "megamoe-preprocess"
_DESCRIPTION = """\
Tokenize documents into a megamoe token file (OUT plus its sidecar OUT.json), for TokenDataset.

Formats, by suffix (or --format):
  .jsonl, .json  one JSON object per line, one document each, its text in --text-field
  .parquet       one row per document, its text in the string column --text-field
                 (needs pyarrow: pip install megamoe[data])
  anything else  the whole UTF-8 file is one document
A directory stands for its files of these formats, recursively, in sorted order, hidden ones skipped
(text files: those ending in one of --text-suffixes).

Workers tokenize chunks of documents and the ids are written in document order: the output is
byte-identical for any --workers. On any error (named with its file and line) no output is left."""



def parse_args(argv: Sequence[str] | None = None, *, prog: str = PROG) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter, description=_DESCRIPTION,
    )
    parser.add_argument("--input", nargs="+", required=True, type=Path, metavar="PATH",
                        help="files or directories of documents, read in the order given")
    parser.add_argument("--tokenizer", required=True, type=Path, metavar="PATH",
                        help="a sentencepiece .model, an HF tokenizer.json, or a directory holding one (as "
                             "written by transformers' save_pretrained; EOS from its tokenizer_config.json)")
    parser.add_argument("--output", required=True, type=Path, metavar="OUT",
                        help="the token file to write (and OUT.json, its sidecar)")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the JSONL field or Parquet column holding each document's text")
    parser.add_argument("--format", choices=("auto",) + FORMATS, default="auto",
                        help="read every input file in this format instead of choosing it by suffix")
    parser.add_argument("--text-suffixes", nargs="+", default=list(DEFAULT_TEXT_SUFFIXES), metavar="SUFFIX",
                        help="the suffixes of the text files a directory contributes")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help=f"tokenizing processes (default: every core, {default_workers()} here)")
    parser.add_argument("--no-append-eos", dest="append_eos", action="store_false",
                        help="do not end each document with the tokenizer's EOS token")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args = parse_args(argv, prog=prog)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    try:
        tokenizer = Tokenizer.from_path(args.tokenizer)
    except (ValueError, OSError, ImportError) as error:
        raise UsageError(f"--tokenizer {args.tokenizer}: {error}") from None
    try:
        preprocess(
            args.input, tokenizer, args.output, text_field=args.text_field,
            format=None if args.format == "auto" else args.format,
            text_suffixes=args.text_suffixes,
            workers=args.workers, append_eos=args.append_eos,
        )
    except ImportError as error:  # pyarrow missing: a setup step the user takes, not a bug
        raise UsageError(str(error)) from None
    return 0


def cli(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    """The ``megamoe-preprocess`` console script (and ``megamoe preprocess``)."""
    return run_script(lambda argv: main(argv, prog=prog), argv, prog=prog)


if __name__ == "__main__":
    sys.exit(cli())
