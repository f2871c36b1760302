"""The JSON sidecar of a token file (:mod:`megamoe.data.token_dataset` has the format): where it lies and what it
holds, validated on read. Its own module because both the token-file writer and dataset
(:mod:`~megamoe.data.token_dataset`) and the readers of any token source (:mod:`megamoe.data.token_source`)
read it, and the dataset opens its files through the token sources.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["FORMAT_VERSION", "TOKEN_DTYPES", "TokenFileMeta", "sidecar_path"]

FORMAT_VERSION = 1
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def sidecar_path(token_path: str | os.PathLike) -> Path:
    """``<token_path>.json``: the metadata file of a token file."""
    token_path = Path(token_path)
    return token_path.with_name(token_path.name + ".json")


@dataclass(frozen=True)
class TokenFileMeta:
    """The sidecar of a token file. ``tokenizer_sha256`` identifies the tokenizer the ids belong to;
    ``tokenizer_path`` is where it was at build time (informational)."""

    format_version: int
    dtype: str
    num_tokens: int
    num_documents: int
    vocab_size: int
    eos_id: int | None
    append_eos: bool
    tokenizer_path: str
    tokenizer_sha256: str

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"TokenFileMeta.format_version is {self.format_version}, this code reads version "
                f"{FORMAT_VERSION}: rebuild the token file with build_token_file"
            )
        if self.dtype not in TOKEN_DTYPES:
            raise ValueError(f"TokenFileMeta.dtype must be one of {sorted(TOKEN_DTYPES)}, got {self.dtype!r}")
        for name in ("num_tokens", "num_documents", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TokenFileMeta.{name} must be an int >= 0, got {value!r}")
        if self.vocab_size > np.iinfo(TOKEN_DTYPES[self.dtype]).max + 1:
            raise ValueError(f"TokenFileMeta.vocab_size {self.vocab_size} does not fit dtype {self.dtype}")
        if not isinstance(self.append_eos, bool):
            raise ValueError(f"TokenFileMeta.append_eos must be a bool, got {self.append_eos!r}")
        eos_is_id = type(self.eos_id) is int and 0 <= self.eos_id < self.vocab_size
        if not (eos_is_id or (self.eos_id is None and not self.append_eos)):
            raise ValueError(
                f"TokenFileMeta.eos_id must be an id in [0, vocab_size) (or None without append_eos), "
                f"got {self.eos_id!r}"
            )

    @property
    def numpy_dtype(self) -> np.dtype:
        return TOKEN_DTYPES[self.dtype]

    @classmethod
    def read(cls, path: str | os.PathLike) -> TokenFileMeta:
        """Parse and validate a sidecar; ValueError says what is wrong with which file."""
        path = Path(path)
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"token file sidecar {path} is corrupt: {error}") from None
        except RecursionError:  # json's parser recurses once per level of nesting
            raise ValueError(f"token file sidecar {path} is corrupt: JSON nested too deeply to read") from None
        expected = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) != expected:
            got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise ValueError(f"token file sidecar {path} is corrupt: expected keys {sorted(expected)}, got {got}")
        try:
            return cls(**fields)
        except ValueError as error:
            raise ValueError(f"token file sidecar {path}: {error}") from None
