"""The training and eval datasets of a run, from the user's data paths: what a training script calls.

``--data`` names one or more sources: megamoe token files, Megatron dataset prefixes, or documents
(text, JSON Lines, Parquet, directories of them), which :func:`tokenized_path` tokenizes once into a
cache; ``--data-weights`` gives each its weight. Several sources are blended (:class:`~megamoe.data.blending.BlendedDataset`); without weights each
weighs its number of samples, so a pass of the blend is a pass of every source. Held-out eval data is
either a seeded random set of every source's documents (``eval_fraction``, :mod:`megamoe.data.eval_split`,
split before blending so that no eval document is also drawn for training) or separate sources
(``eval_paths``, concatenated).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megamoe.data.blending import BlendedDataset
from megamoe.data.eval_split import ConcatenatedDataset, split_train_eval
from megamoe.data.sample_dataset import SampleDataset
from megamoe.data.indexed_dataset import is_megatron_dataset
from megamoe.data.token_dataset import TokenDataset, sidecar_path, token_file_matches
from megamoe.data.tokenizer import Tokenizer

__all__ = ["is_token_source", "check_data_weights", "tokenized_path", "TrainEvalData", "build_train_eval_data"]

logger = logging.getLogger(__name__)


def is_token_source(path: str | os.PathLike) -> bool:
    """Whether ``path`` is already tokenized: a megamoe token file (it has its sidecar) or a Megatron
    dataset (a prefix, or either of its ``.bin`` / ``.idx`` files); anything else is documents."""
    path = Path(path)
    return sidecar_path(path).is_file() or is_megatron_dataset(path)


def check_data_weights(paths: Sequence, weights: Sequence[float] | None) -> list[float] | None:
    """``weights`` as floats, checked against ``paths`` (one positive finite weight per path); ValueError
    naming ``--data-weights`` otherwise."""
    if not paths:
        raise ValueError("--data needs at least one path")
    if weights is None:
        return None
    if len(weights) != len(paths):
        raise ValueError(f"--data-weights has {len(weights)} weight(s) for {len(paths)} --data path(s): give one "
                         "weight per path, in the same order")
    for weight, path in zip(weights, paths):
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"--data-weights: the weight {weight!r} of {path} must be a positive number")
    return [float(weight) for weight in weights]


def _documents_cache_key(files: Sequence[tuple[Path, str]], tokenizer: Tokenizer, text_field: str) -> str:
    """What a cached token file of documents depends on: every file's path, size and mtime, the
    tokenizer's digest and the text field (a changed input or tokenizer makes a new key)."""
    digest = hashlib.sha256(f"{tokenizer.sha256}\0{text_field}".encode())
    for file, file_format in files:
        stat = file.stat()
        digest.update(f"\0{file.resolve()}\0{file_format}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def tokenized_path(path: str | os.PathLike, tokenizer: Tokenizer, cache_dir: str | os.PathLike, *,
                   text_field: str = "text", workers: int | None = None) -> Path:
    """A token source for ``path``: ``path`` itself when it is tokenized already (see
    :func:`is_token_source`), else its documents (text, JSON Lines, Parquet files or a directory of
    them, :mod:`megamoe.data.documents`) tokenized into ``cache_dir`` by
    :func:`megamoe.data.preprocess.preprocess`, or the token file an earlier call made of the same
    files (same paths, sizes and mtimes), tokenizer and text field. Call it on one rank, then let the
    others open the returned path."""
    path = Path(path)
    if is_token_source(path):
        return path
    from megamoe.data.documents import list_document_files
    from megamoe.data.preprocess import preprocess

    files = list_document_files([path])
    out = Path(cache_dir) / f"{path.stem or 'documents'}_{_documents_cache_key(files, tokenizer, text_field)}.bin"
    if token_file_matches(out, tokenizer):
        logger.info("reusing token file %s of %s", out, path)
    else:
        logger.info("tokenizing %s (%d file(s)) into %s", path, len(files), out)
        preprocess([path], tokenizer, out, text_field=text_field, workers=workers)
    return out


@dataclass(frozen=True)
class TrainEvalData:
    """``train`` for ``ResumableSampler`` + ``batch``; ``eval`` (None without eval data) for ``eval_batches``;
    ``sources`` the opened token datasets, in ``--data`` order. ``chat``: chat SFT rows
    (:class:`~megamoe.data.chat_samples.ChatSamples`, whose ``micro_batch`` carries their document masks;
    labels on the assistant's tokens only), built by :mod:`megamoe.data.chat_training_data`."""

    train: SampleDataset
    eval: SampleDataset | None
    sources: tuple[TokenDataset, ...]
    chat: bool = False


def build_train_eval_data(
    data_paths: Sequence[str | os.PathLike],
    *,
    seq_len: int,
    vocab_size: int | None,
    weights: Sequence[float] | None = None,
    num_samples: int | None = None,
    eval_fraction: float | None = None,
    eval_paths: Sequence[str | os.PathLike] = (),
    seed: int = 0,
) -> TrainEvalData:
    """Open the token sources ``data_paths`` (megamoe token files or Megatron datasets; see
    :func:`tokenized_path` for documents) as ``TokenDataset``\\ s, their ids checked against
    ``vocab_size`` (the tokenizer's); hold out eval data; blend several sources by ``weights`` (default: each source's
    number of samples) into ``num_samples`` samples (default: ``full_pass_num_samples``, every source
    seen whole). ``seed`` picks the held-out documents and orders each source's passes. One source
    without a weight is used as is."""
    if eval_fraction is not None and eval_paths:
        raise ValueError("give eval_fraction (--eval-fraction) or eval_paths (--eval-data), not both")
    paths = [Path(path) for path in data_paths]
    weights = check_data_weights(paths, weights)
    sources = tuple(TokenDataset(path, seq_len, vocab_size=vocab_size) for path in paths)
    if eval_fraction is not None:
        splits = [split_train_eval(source, eval_fraction, seed=seed) for source in sources]
        train_parts, eval_parts = [train for train, _ in splits], [held_out for _, held_out in splits]
    else:
        train_parts = list(sources)
        eval_parts = [TokenDataset(path, seq_len, vocab_size=vocab_size) for path in eval_paths]
    if len(train_parts) == 1 and weights is None:
        train = train_parts[0]
    else:
        train = BlendedDataset(train_parts, weights or [len(part) for part in train_parts],
                               num_samples=num_samples, seed=seed)
    held_out = None if not eval_parts else eval_parts[0] if len(eval_parts) == 1 else ConcatenatedDataset(eval_parts)
    logger.info("training data: %d samples of %d tokens from %d source(s); eval: %s", len(train), seq_len,
                len(sources), f"{len(held_out)} samples" if held_out is not None else "none")
    return TrainEvalData(train=train, eval=held_out, sources=sources)
