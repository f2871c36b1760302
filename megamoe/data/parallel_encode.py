"""Tokenize a stream of documents in worker processes, handing back each document's ids in input order.

The caller reads the documents (one process, in order) and writes the ids (in the same order), so the
result does not depend on the number of workers or on how documents are grouped into chunks. Each
worker loads the tokenizer itself from its file (a Rust or C++ tokenizer object is not picklable) and
checks the file's digest against the caller's, so all of them tokenize with the same tokenizer.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Iterator

import numpy as np

from megamoe.data.documents import Document
from megamoe.data.tokenizer import Tokenizer

__all__ = ["DEFAULT_CHUNK_CHARS", "default_workers", "encode_document", "DocumentEncoder"]

# Characters of text per task: large enough that the pickling round trip is small next to the
# tokenizing, small enough that every worker gets work on a corpus of a few MB.
DEFAULT_CHUNK_CHARS = 1 << 20
# Tasks queued per worker: keeps every worker busy while bounding the documents held in memory.
_TASKS_PER_WORKER = 2

_worker_tokenizer: Tokenizer | None = None
_worker_load_error: Exception | None = None


def default_workers() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def encode_document(tokenizer: Tokenizer, text: str, where: str) -> list[int]:
    """``tokenizer.encode(text)``; a failure (an HF tokenizer without unknown token meeting a word
    outside its vocabulary, say) becomes a ValueError naming the document."""
    try:
        return tokenizer.encode(text)
    except Exception as error:  # the tokenizer libraries raise their own exception types
        raise ValueError(f"{where}: tokenizer {tokenizer.path} cannot encode this document ({error})") from None


def _load_worker_tokenizer(tokenizer_path: str, sha256: str) -> None:
    # An exception raised by a pool initializer kills the worker and breaks the pool with no message:
    # keep it and raise it from the first task instead.
    global _worker_tokenizer, _worker_load_error
    # Ctrl-C reaches the whole process group: the caller handles it and shuts the pool down, so the
    # workers do not each print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        tokenizer = Tokenizer.from_path(tokenizer_path)
        if tokenizer.sha256 != sha256:
            raise ValueError(f"tokenizer {tokenizer_path} changed on disk while the documents were tokenized")
        _worker_tokenizer = tokenizer
    except Exception as error:
        _worker_load_error = error


def _check_worker() -> None:
    if _worker_load_error is not None:
        raise _worker_load_error


def _encode_chunk(chunk: list[Document]) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a chunk's documents back to back, and each document's length."""
    _check_worker()
    encoded = [encode_document(_worker_tokenizer, text, where) for text, where in chunk]
    lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
    return ids, lengths


def _chunks(documents: Iterable[Document], chunk_chars: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    chars = 0
    for document in documents:
        chunk.append(document)
        chars += len(document[0])
        if chars >= chunk_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _split(result: tuple[np.ndarray, np.ndarray]) -> Iterator[np.ndarray]:
    ids, lengths = result
    return iter(np.split(ids, np.cumsum(lengths)[:-1]))


class DocumentEncoder:
    """Tokenizes ``(text, where)`` documents (see :mod:`megamoe.data.documents`) with ``tokenizer``.
    ``workers`` 1 tokenizes in this process; more start that many processes (on entering the
    ``with`` block, before the caller starts threads such as a progress bar's), each fed chunks of
    about ``chunk_chars`` characters::

        with DocumentEncoder(tokenizer, workers=4) as encoder:
            for ids in encoder.encode(documents): ...
    """

    def __init__(self, tokenizer: Tokenizer, *, workers: int = 1, chunk_chars: int = DEFAULT_CHUNK_CHARS):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
        self.tokenizer = tokenizer
        self.workers = workers
        self.chunk_chars = chunk_chars
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> DocumentEncoder:
        if self.workers > 1:
            # fork starts a worker in milliseconds, and is safe here: no thread of the caller's is
            # running yet and each worker loads its own tokenizer.
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=context, initializer=_load_worker_tokenizer,
                initargs=(os.fspath(self.tokenizer.path), self.tokenizer.sha256),
            )
            try:
                # The pool forks all its workers on its first task: make that happen now. This also
                # reports a tokenizer that a worker cannot load before any document is tokenized.
                self._pool.submit(_check_worker).result()
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc_info) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def encode(self, documents: Iterable[Document]) -> Iterator[list[int] | np.ndarray]:
        """Each document's ids, in the order of ``documents``. An error in a worker is raised here,
        at the document it concerns, as one process would raise it."""
        if self.workers == 1:
            for text, where in documents:
                yield encode_document(self.tokenizer, text, where)
            return
        if self._pool is None:
            raise RuntimeError("DocumentEncoder with workers > 1 encodes inside its 'with' block only")
        pending = deque()
        for chunk in _chunks(documents, self.chunk_chars):
            pending.append(self._pool.submit(_encode_chunk, chunk))
            if len(pending) >= _TASKS_PER_WORKER * self.workers:
                yield from _split(pending.popleft().result())
        while pending:
            yield from _split(pending.popleft().result())
