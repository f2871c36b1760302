"""A training script's data flags: what to train on, the blend, the held-out data; checked before any
rank starts, then turned into the run's datasets (what ``examples/pretrain_moe.py`` calls)::

    add_data_arguments(parser)                  # --data, --data-weights, --text-field, --eval-*
    check_data_arguments(args)                  # UsageError naming the flag, before any work
    vocab = data_vocab_size(args, tokenizer)    # opens every token source once (validating it)
    data = prepare_training_data(args, rank, world_group, tokenizer, vocab_size=..., work_dir=...)

``--data`` takes token files (``megamoe-preprocess``), Megatron datasets (``PREFIX`` of
``PREFIX.bin`` / ``PREFIX.idx``) and documents (text, JSON Lines, Parquet files, directories of them).
Documents are tokenized by rank 0 into ``<work_dir>/data_cache`` once (a rerun reuses the token file
while the files, the tokenizer and ``--text-field`` are unchanged); the other ranks wait for it within
the collective timeout, so tokenize a large corpus beforehand with ``megamoe-preprocess``.

Chat JSON Lines (records holding ``messages`` or ``prompt`` / ``completion``,
:mod:`megamoe.data.chat_records`) make the run chat SFT, with no other flag: rendered with the
tokenizer's chat template, packed whole with their document masks, labels on the assistant's tokens only
(:mod:`megamoe.data.chat_training_data`); ``--sft-overlong`` says what becomes of a conversation longer
than ``--seq-len``. Every ``--data`` and ``--eval-data`` path is then a chat file.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from megamoe import comms
from megamoe.data.chat_records import is_chat_file
from megamoe.data.chat_samples import OVERLONG_CHOICES
from megamoe.data.chat_training_data import build_chat_train_eval_data, chat_encoder, tokenized_chat_paths
from megamoe.data.token_source import open_token_source
from megamoe.data.tokenizer import Tokenizer
from megamoe.data.training_data import (TrainEvalData, build_train_eval_data, check_data_weights, is_token_source,
                                        tokenized_path)
from megamoe.errors import UsageError

__all__ = ["add_data_arguments", "check_data_arguments", "data_vocab_size", "is_chat_run", "on_rank_0",
           "prepare_training_data"]

logger = logging.getLogger(__name__)


def add_data_arguments(parser: argparse.ArgumentParser, *, default_data_help: str = "") -> None:
    """The flags, as two argument groups: "data" and "evaluation on held-out data"."""
    d = parser.add_argument_group("data")
    d.add_argument("--data", type=Path, nargs="+", default=None, metavar="PATH",
                   help="train on these: token files (megamoe-preprocess), Megatron datasets (PREFIX of "
                        "PREFIX.bin/.idx), or documents (text files, .jsonl, .parquet, directories of them), which "
                        "are tokenized once into <work-dir>/data_cache; several are blended" + default_data_help)
    d.add_argument("--data-weights", type=float, nargs="+", default=None, metavar="W",
                   help="one weight per --data path (the blend's shares; default: each source's size)")
    d.add_argument("--text-field", default="text", metavar="NAME",
                   help="the text field of JSON Lines records and the text column of Parquet files")
    d.add_argument("--sft-overlong", choices=OVERLONG_CHOICES, default="truncate",
                   help="chat data (.jsonl records with messages, or prompt/completion): a conversation longer than "
                        "--seq-len is truncated to its first --seq-len + 1 tokens (dropped if no assistant token is "
                        "left) or dropped; never split across rows (default: %(default)s)")
    e = parser.add_argument_group("evaluation on held-out data")
    e.add_argument("--eval-data", type=Path, nargs="+", default=[], metavar="PATH",
                   help="held-out data, in the formats of --data (documents tokenized with the run's tokenizer)")
    e.add_argument("--eval-fraction", type=float, default=None, metavar="F",
                   help="hold out a random fraction F (0 < F < 1) of every training source's documents instead (the "
                        "same documents for the same --seed)")
    e.add_argument("--eval-every", type=int, default=20, metavar="N",
                   help="with held-out data: the eval loss every N steps and at the end")
    e.add_argument("--eval-iters", type=int, default=10, metavar="N",
                   help="global batches of held-out data per evaluation (the first N, the same ones every time); "
                        "0: all of it")


def _data_paths(args) -> list[tuple[str, Path]]:
    return [("--data", path) for path in args.data or []] + [("--eval-data", path) for path in args.eval_data]


def _check_document_directory(flag: str, path: Path) -> None:
    """A directory of files this script does not read (e.g. ``.py``): one line saying what does work, as the
    training script has no flag for the suffixes (megamoe-preprocess's ``--text-suffixes``)."""
    from megamoe.data.documents import list_document_files
    try:
        list_document_files([path])
    except ValueError as e:
        suffixes = sorted({f.suffix.lower() for f in path.rglob("*") if f.is_file() and f.suffix})
        example = suffixes[0] if suffixes else ".py"
        raise UsageError(f"{flag} {e.args[0].split(' (hidden')[0]}: name its files instead (a file named directly is "
                         f"read as text whatever its suffix), e.g. {flag} {path}/*{example}, or tokenize the directory "
                         f"first with megamoe-preprocess --text-suffixes {example} and pass the token file") from None


def is_chat_run(args) -> bool:
    """Whether ``--data`` names chat JSON Lines files (a chat SFT run)."""
    return any(is_chat_file(path) for path in args.data or [])


def _check_chat_arguments(args) -> None:
    """A chat run: every --data and --eval-data path a chat file, no weights, no EOS-based packing flags."""
    others = [f"{flag} {path}" for flag, path in _data_paths(args) if not is_chat_file(path)]
    if others:
        raise UsageError(f"--data names chat JSON Lines (records with messages or prompt/completion), so every "
                         f"--data and --eval-data path must be one, but {others[0]} is not: train chat and other "
                         "data in separate runs")
    if args.data_weights is not None:
        raise UsageError("--data-weights does not apply to chat data: several chat files are packed together, each "
                         "conversation once (repeat a file's lines to weigh it more)")
    flags = [flag for flag, on in (("--reset-position-ids", args.reset_position_ids),
                                   ("--reset-attention-mask", args.reset_attention_mask),
                                   ("--eod-mask-loss", args.eod_mask_loss)) if on]
    if flags:
        raise UsageError(f"{', '.join(flags)}: not for chat data, whose conversations are packed with their own "
                         "document masks and positions, labels on assistant tokens only; drop "
                         + ("it" if len(flags) == 1 else "them"))


def check_data_arguments(args) -> None:
    """The flags on their own (paths exist, weights, eval flags); UsageError naming the flag."""
    for flag, path in _data_paths(args):
        if not (is_token_source(path) or path.exists()):
            raise UsageError(f"{flag} {path} does not exist (expected a token file, a Megatron dataset prefix, "
                             "or documents: a text, .jsonl or .parquet file or a directory)")
        if path.is_dir() and not is_token_source(path):
            _check_document_directory(flag, path)
    if is_chat_run(args):
        _check_chat_arguments(args)
    if args.data_weights is not None:
        if args.data is None:
            raise UsageError("--data-weights needs --data")
        try:
            check_data_weights(args.data, args.data_weights)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.eval_fraction is not None:
        if args.eval_data:
            raise UsageError("--eval-fraction and --eval-data both choose the held-out data; give one of them")
        if not 0 < args.eval_fraction < 1:
            raise UsageError(f"--eval-fraction must be between 0 and 1 (exclusive), got {args.eval_fraction}")
    for flag, value, low in (("--eval-every", args.eval_every, 1), ("--eval-iters", args.eval_iters, 0)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    if not args.text_field:
        raise UsageError("--text-field must name a field")


def data_vocab_size(args, tokenizer: Tokenizer | None) -> int | None:
    """Opens (so validates) every token file and Megatron dataset of --data / --eval-data, checks that a
    token file was made by ``tokenizer`` and that documents have a tokenizer; returns the largest
    vocabulary the token files record (None: none does, e.g. only Megatron datasets or documents)."""
    vocab = None
    if is_chat_run(args) and tokenizer is not None:
        try:
            chat_encoder(tokenizer)
        except ValueError as e:
            raise UsageError(str(e)) from None
    for flag, path in _data_paths(args):
        if not is_token_source(path):
            if tokenizer is None:
                raise UsageError(f"{flag} {path} holds documents, which need a tokenizer: give --tokenizer (or "
                                 "--hf-model, whose tokenizer is the default)")
            continue
        try:
            source = open_token_source(path)
        except (ValueError, OSError) as e:
            raise UsageError(f"{flag}: {e}") from None
        if source.meta is None:
            continue                                 # Megatron: its ids are checked when training opens it
        if tokenizer is not None and source.meta.tokenizer_sha256 != tokenizer.sha256:
            raise UsageError(f"{flag} {path} was tokenized with {source.meta.tokenizer_path}, not with the run's "
                             f"tokenizer {tokenizer.path}: tokenize it again (megamoe-preprocess) or pass the "
                             "tokenizer it was made with (--tokenizer)")
        vocab = max(vocab or 0, source.meta.vocab_size)
    return vocab


def on_rank_0(work, rank: int, world_group):
    """``work()`` on rank 0 while the others wait; its result (a picklable value), or its error (a
    ValueError or OSError), raised on every rank as the same UsageError, is handed to all ranks."""
    outcome = None
    if rank == 0:
        try:
            outcome = ("ok", work())
        except (ValueError, OSError) as e:
            outcome = ("error", str(e))
    outcome = comms.all_gather_object(outcome, world_group)[0]
    if outcome[0] == "error":
        raise UsageError(outcome[1])
    return outcome[1]


def prepare_training_data(args, rank: int, world_group, tokenizer: Tokenizer | None, *, vocab_size: int | None,
                          work_dir: Path, default_train_paths: list[Path] = ()) -> TrainEvalData:
    """The run's train and eval datasets: --data (or ``default_train_paths`` without it), documents
    tokenized by rank 0 into ``work_dir / "data_cache"``; ``vocab_size`` (the tokenizer's, else the
    model's; None: what each token file records) bounds every token id, checked as each source opens.
    Collective."""
    cache = work_dir / "data_cache"
    if is_chat_run(args):
        return _prepare_chat_data(args, rank, world_group, tokenizer, vocab_size, cache)

    def tokenized(paths) -> list[str]:
        return [os.fspath(tokenized_path(path, tokenizer, cache, text_field=args.text_field)) for path in paths]

    named = args.data if args.data is not None else list(default_train_paths)
    train_paths = [Path(p) for p in on_rank_0(lambda: tokenized(named), rank, world_group)]
    eval_paths = [Path(p) for p in on_rank_0(lambda: tokenized(args.eval_data), rank, world_group)]
    try:
        data = build_train_eval_data(train_paths, weights=args.data_weights, seq_len=args.seq_len,
                                     vocab_size=vocab_size, eval_fraction=args.eval_fraction,
                                     eval_paths=eval_paths, seed=args.seed)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    for path, dataset in zip(named, data.sources):
        logger.info("data %s: %d samples of %d tokens (%s, %d documents)", path, len(dataset), args.seq_len,
                    dataset.source.format, dataset.source.num_documents)
    counts = getattr(data.train, "dataset_sample_counts", None)
    if counts is not None:
        logger.info("blend of %d samples: %s", len(data.train),
                    ", ".join(f"{path}: {n}" for path, n in zip(named, counts)))
    return data


def _prepare_chat_data(args, rank: int, world_group, tokenizer: Tokenizer, vocab_size: int | None,
                       cache: Path) -> TrainEvalData:
    """prepare_training_data for chat files: rank 0 tokenizes them into ``cache``, every rank packs them."""
    def tokenized(paths) -> list[str]:
        return [os.fspath(path) for path in tokenized_chat_paths(paths, tokenizer, cache)]

    train_paths = on_rank_0(lambda: tokenized(args.data), rank, world_group)
    eval_paths = on_rank_0(lambda: tokenized(args.eval_data), rank, world_group)
    pad_id = next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)
    try:
        return build_chat_train_eval_data(train_paths, seq_len=args.seq_len, vocab_size=vocab_size,
                                          overlong=args.sft_overlong, pad_id=pad_id, eval_fraction=args.eval_fraction,
                                          eval_paths=eval_paths, seed=args.seed)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
