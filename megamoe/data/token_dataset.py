"""A flat file of token ids (memory-mapped) with a JSON sidecar, and the dataset of fixed-length samples.

File format (``FORMAT_VERSION`` 1): ``<name>`` holds every document's ids back to back (each followed
by EOS when ``append_eos``), as little-endian uint16 when the vocabulary fits (ids < 65536) else
uint32; ``<name>.json`` holds :class:`TokenFileMeta`. The sidecar is the commit marker: a build deletes
the old sidecar first and writes the new one last (both files under temporary names, then renamed),
so an interrupted build leaves a token file without sidecar, which :class:`TokenDataset` refuses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from megamoe.atomic_file import atomic_write, check_output_target
from megamoe.data.resumable_sampler import ResumableSampler
from megamoe.data.sample_dataset import checked_sample_indices
from megamoe.data.token_file_meta import FORMAT_VERSION, TOKEN_DTYPES, TokenFileMeta, sidecar_path
from megamoe.data.token_source import TokenSource, open_token_source
from megamoe.data.tokenizer import Tokenizer

__all__ = [
    "FORMAT_VERSION", "TokenFileMeta", "sidecar_path", "check_token_file_targets", "build_token_file",
    "write_token_file", "token_file_matches", "TokenDataset", "micro_batches", "recorded_tokenizer",
]

logger = logging.getLogger(__name__)

# Tokens buffered before a write: bounds memory (8 bytes per buffered id) for corpora of any size.
_FLUSH_TOKENS = 1 << 20


def _documents(files_or_texts: Iterable[str | os.PathLike]) -> Iterator[str]:
    for item in files_or_texts:
        if isinstance(item, str):
            yield item
            continue
        try:
            yield Path(item).read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"document file {item} is not UTF-8 text ({error})") from None


def build_token_file(
    files_or_texts: Iterable[str | os.PathLike],
    tokenizer: Tokenizer,
    out_path: str | os.PathLike,
    *,
    append_eos: bool = True,
) -> TokenFileMeta:
    """Tokenize documents into a token file at ``out_path`` plus its sidecar; returns the metadata.

    Each item is one document: a ``str`` is the document's text, a path object (``Path``) names a
    UTF-8 file to read. With ``append_eos`` every document is followed by ``tokenizer.eos_id``, so
    samples that span documents see where one ends. See :func:`write_token_file` for the errors.
    """
    if isinstance(files_or_texts, (str, os.PathLike)):
        raise TypeError("files_or_texts must be a collection of documents, not one str or path: wrap it in a list")
    total = len(files_or_texts) if isinstance(files_or_texts, Sequence) else None
    encoded = (tokenizer.encode(text) for text in _documents(files_or_texts))
    return write_token_file(encoded, tokenizer, out_path, append_eos=append_eos, total=total)


def check_token_file_targets(out_path: str | os.PathLike) -> None:
    """The token file ``out_path`` and its sidecar must be regular files or new paths (see
    :func:`~megamoe.atomic_file.check_output_target`): AtomicWriteError otherwise."""
    for target in (Path(out_path), sidecar_path(out_path)):
        check_output_target(target)


def write_token_file(
    encoded_documents: Iterable[Sequence[int] | np.ndarray],
    tokenizer: Tokenizer,
    out_path: str | os.PathLike,
    *,
    append_eos: bool = True,
    total: int | None = None,
) -> TokenFileMeta:
    """Write already tokenized documents (each item one document's ids, by ``tokenizer``) as a token
    file at ``out_path`` plus its sidecar; returns the metadata. ``total`` (documents) sizes the
    progress bar.

    On an error (raised here or by the iterable) no new file is left behind, and an existing token
    file at ``out_path`` is left without its sidecar (see the module docstring). No documents, or no
    tokens at all, is an error (such a file holds no sample).
    """
    if append_eos and tokenizer.eos_id is None:
        raise ValueError(f"append_eos=True but tokenizer {tokenizer.path} has no EOS token; pass append_eos=False")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    dtype_name = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    dtype = TOKEN_DTYPES[dtype_name]
    sidecar = sidecar_path(out_path)
    check_token_file_targets(out_path)     # before the unlink: a FIFO or a device there stays as it was
    sidecar.unlink(missing_ok=True)  # from here on the old pair reads as incomplete until the new sidecar lands
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64) if append_eos else None
    num_tokens = num_documents = buffered = 0
    buffer: list[np.ndarray] = []

    def flush(file) -> None:
        ids = np.concatenate(buffer) if buffer else np.zeros(0, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
            raise ValueError(
                f"tokenizer {tokenizer.path} produced an id outside [0, vocab_size={tokenizer.vocab_size}): "
                f"min {int(ids.min())}, max {int(ids.max())}"
            )
        file.write(ids.astype(dtype).tobytes())
        buffer.clear()

    with atomic_write(out_path) as file:
        for ids in tqdm(encoded_documents, total=total, desc="tokenizing", unit="doc", disable=None):
            ids = np.asarray(ids, dtype=np.int64)
            buffer.append(ids)
            if append_eos:
                buffer.append(eos)
            num_tokens += ids.size + append_eos
            buffered += ids.size + append_eos
            num_documents += 1
            if buffered >= _FLUSH_TOKENS:
                flush(file)
                buffered = 0
        flush(file)
        if num_tokens == 0:
            raise ValueError(
                f"no tokens to write to {out_path}: " + (f"the {num_documents} documents are all empty "
                "(tokenize to nothing)" if num_documents else "there are no documents")
            )

    meta = TokenFileMeta(
        format_version=FORMAT_VERSION, dtype=dtype_name, num_tokens=num_tokens, num_documents=num_documents,
        vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, append_eos=append_eos,
        tokenizer_path=os.fspath(tokenizer.path.resolve()), tokenizer_sha256=tokenizer.sha256,
    )
    with atomic_write(sidecar, "w") as file:
        json.dump(dataclasses.asdict(meta), file, indent=1)
    logger.info("wrote %d tokens of %d documents to %s (%s)", num_tokens, num_documents, out_path, dtype_name)
    return meta


def token_file_matches(path: str | os.PathLike, tokenizer: Tokenizer) -> bool:
    """Whether ``path`` is a complete token file (sidecar present and valid, size as recorded) of
    ``tokenizer`` (same file digest): a cache check, so that a rerun reuses it instead of
    re-tokenizing. False, never an error, for anything else."""
    path = Path(path)
    try:
        meta = TokenFileMeta.read(sidecar_path(path))
        return (meta.tokenizer_sha256 == tokenizer.sha256
                and path.stat().st_size == meta.num_tokens * meta.numpy_dtype.itemsize)
    except (OSError, ValueError):
        return False


def recorded_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer the sidecar of the token file ``path`` records (``tokenizer_path``), when it is still
    there with the recorded digest; None when there is no valid sidecar or the tokenizer moved or changed."""
    try:
        meta = TokenFileMeta.read(sidecar_path(path))
        tokenizer = Tokenizer.from_path(meta.tokenizer_path)
        return tokenizer if tokenizer.sha256 == meta.tokenizer_sha256 else None
    except (OSError, ValueError, ImportError):
        return None


class TokenDataset:
    """Fixed-length samples of a token source: sample ``i`` is the window
    ``tokens[i * seq_len : i * seq_len + seq_len + 1]``, returned as (inputs, labels) = (window[:-1],
    window[1:]), int64. Consecutive samples share one token (the last label of one is the first input
    of the next), so every token is predicted once. The tokens are memory-mapped, never read whole.

    ``source`` is a :class:`~megamoe.data.token_source.TokenSource` or a path for
    :func:`~megamoe.data.token_source.open_token_source` (a megamoe token file, or a Megatron dataset's
    prefix, ``.bin`` or ``.idx``). Every id is checked once, here, against the smaller of ``vocab_size``
    (the tokenizer's vocabulary: not the model's, which padding may make larger and so hide a wrong id)
    and the vocabulary the source records (megamoe token files do, Megatron datasets do not): an id out
    of range is a ValueError before any training, not a row of the embedding that no token should reach.
    """

    def __init__(self, source: TokenSource | str | os.PathLike, seq_len: int, *, vocab_size: int | None = None):

        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (or None), got {vocab_size}")
        self.source = source if isinstance(source, TokenSource) else open_token_source(source)
        self.path = self.source.path
        self.meta = self.source.meta
        self.seq_len = seq_len
        known = [size for size in (vocab_size, self.source.vocab_size) if size is not None]
        self.vocab_size = min(known) if known else None
        if self.vocab_size is not None:
            self.source.check_ids(self.vocab_size)
        self.num_samples = (self.source.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"{self.source} has {self.source.num_tokens} tokens, too few for one sample of seq_len {seq_len} "
                "(needs seq_len + 1)"
            )
        self.tokens = self.source.tokens

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range [0, {self.num_samples})")
        inputs, labels = self.batch([index])
        return inputs[0], labels[0]

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` stacked: (inputs [B, S], labels [B, S]), int64."""
        indices_b = checked_sample_indices(indices, self.num_samples)
        starts_b = indices_b * self.seq_len
        windows_bw = torch.from_numpy(self.tokens[starts_b[:, None] + np.arange(self.seq_len + 1)].astype(np.int64))
        return windows_bw[:, :-1].contiguous(), windows_bw[:, 1:].contiguous()


def micro_batches(dataset: TokenDataset, sampler: ResumableSampler) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches, (inputs [mb, S], labels [mb, S]), in the sampler's order, forever;
    ``sampler.state_dict()`` after a global batch's last micro-batch resumes at the next global batch."""
    if sampler.num_samples != len(dataset):
        raise ValueError(
            f"sampler.num_samples ({sampler.num_samples}) != len(dataset) ({len(dataset)}): build the sampler "
            "with ResumableSampler(len(dataset), ...)"
        )
    for indices in sampler:
        yield dataset.batch(indices)
