"""Shared by tests/unit/test_blending.py (and other tests): the builders and constants of the blending tests."""

from __future__ import annotations

import json

import numpy as np


# ---------------------------------------------------------------- eval split


def _documents_file(path, documents, *, append_eos=True):
    """A megamoe token file (uint16, EOS 0, vocabulary 100) of ``documents``, each followed by EOS."""
    tokens = [t for document in documents for t in list(document) + ([0] if append_eos else [])]
    path.write_bytes(np.asarray(tokens, dtype="<u2").tobytes())
    path.with_name(path.name + ".json").write_text(json.dumps({
        "format_version": 1, "dtype": "uint16", "num_tokens": len(tokens), "num_documents": len(documents),
        "vocab_size": 100, "eos_id": 0 if append_eos else None, "append_eos": append_eos, "tokenizer_path": "t",
        "tokenizer_sha256": "0"}))
    return path
