"""Turn a user's text, JSON Lines or Parquet files into a megamoe token file (see
:mod:`megamoe.data.token_dataset`), ready for ``TokenDataset``.

Command line: ``megamoe preprocess`` (alias ``megamoe-preprocess``), :mod:`megamoe.cli.preprocess`.

The documents are read in order by one process (see :mod:`megamoe.data.documents` for the formats),
tokenized in chunks by ``--workers`` processes (default: every core) and written in document order, so
the output is byte-identical for any number of workers. The token file and its sidecar appear only
when everything succeeded: after any error (a bad JSONL line, a document the tokenizer cannot encode,
an interrupt) neither is left, not even an older token file of the same name once writing began (an
error found before, such as a missing input, leaves an existing output as it was).
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

from megamoe.data.documents import (
    DEFAULT_TEXT_SUFFIXES, import_pyarrow, list_document_files, read_document_files,
)
from megamoe.data.parallel_encode import DEFAULT_CHUNK_CHARS, DocumentEncoder, default_workers
from megamoe.data.token_dataset import TokenFileMeta, check_token_file_targets, sidecar_path, write_token_file
from megamoe.data.tokenizer import Tokenizer

__all__ = ["preprocess"]

logger = logging.getLogger(__name__)


def preprocess(
    inputs: Iterable[str | os.PathLike],
    tokenizer: Tokenizer,
    output: str | os.PathLike,
    *,
    text_field: str = "text",
    format: str | None = None,
    text_suffixes: Sequence[str] = DEFAULT_TEXT_SUFFIXES,
    workers: int | None = None,
    append_eos: bool = True,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
) -> TokenFileMeta:
    """Tokenize every document of ``inputs`` (files or directories) into the token file ``output``
    with ``workers`` processes (None: one per core); returns its metadata. ValueError (or
    FileNotFoundError) names what is wrong: a missing input, a bad document (file and line), no
    documents or no tokens, a tokenizer without EOS while ``append_eos``."""
    inputs = [Path(item) for item in inputs]
    if not inputs:
        raise ValueError("no inputs given: name at least one file or directory")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    output = Path(output)
    if output.is_dir():
        raise ValueError(f"output {output} is a directory; name the token file to write")
    check_token_file_targets(output)     # a FIFO or a device there would be replaced by a regular file
    if append_eos and tokenizer.eos_id is None:
        raise ValueError(
            f"tokenizer {tokenizer.path} has no EOS token to end each document with: name one (eos_token in "
            "tokenizer_config.json for an HF tokenizer), or do without (--no-append-eos, append_eos=False)"
        )
    outputs = (output, sidecar_path(output))
    for path in inputs:
        if any(_same_file(path, written) for written in outputs):
            raise ValueError(f"input {path} is the output or its sidecar: write the token file elsewhere")
    for path in tokenizer.files():
        written = next((written for written in outputs if _same_file(path, written)), None)
        if written is not None:
            raise ValueError(f"output {written} is the tokenizer's file {path}: writing token ids there would destroy "
                             "the tokenizer; write the token file elsewhere")
    # A rerun writing into an input directory must not read its own sidecar (a .json) as documents.
    files = [(path, file_format)
             for path, file_format in list_document_files(inputs, format=format, text_suffixes=text_suffixes)
             if not any(_same_file(path, written) for written in outputs)]
    if any(file_format == "parquet" for _, file_format in files):
        import_pyarrow()  # the "pip install" error now rather than after the files before it
    documents = read_document_files(files, text_field=text_field)
    first = next(documents, None)
    if first is None:
        raise ValueError(f"no documents in {', '.join(map(str, inputs))} ({len(files)} file(s), all empty)")
    logger.info("tokenizing %d file(s) with %s (vocab %d) in %d worker(s) -> %s",
                len(files), tokenizer.path, tokenizer.vocab_size, workers, output)
    try:
        with DocumentEncoder(tokenizer, workers=workers, chunk_chars=chunk_chars) as encoder:
            return write_token_file(encoder.encode(itertools.chain([first], documents)), tokenizer, output,
                                    append_eos=append_eos)
    except BaseException:
        if output.is_file() and not sidecar_path(output).exists():
            output.unlink()  # an old token file whose sidecar the failed write removed: leave no token file
        raise


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: through links (symbolic or hard) and relative paths alike."""
    try:
        return os.path.samefile(a, b)
    except OSError:                                  # one does not exist (yet): compare where they lead
        return a.resolve() == b.resolve()
