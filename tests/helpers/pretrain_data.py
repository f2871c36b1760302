"""Shared by tests/unit/test_pretrain_data.py (and other tests): the builders and constants of the pretrain data
tests."""

import json

import pytest

from megamoe.data.token_dataset import build_token_file
from megamoe.data.tokenizer import Tokenizer
from tests.helpers.hf_start import save_tokenizer, sentences
from tests.helpers.indexed_dataset import write_megatron
TINY = ["--hidden", 16, "--layers", 2, "--experts", 4, "--top-k", 2, "--seq-len", 16, "--global-batch", 4,
        "--micro-batch", 2, "--sample-tokens", 0, "--save-every", 100, "--expert-backend", "torch"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tokenizer, and the same kind of text as JSONL, a directory of text files, a token file and a
    Megatron dataset (its ids: the tokenizer's, with EOS after each document)."""
    root = tmp_path_factory.mktemp("inputs")
    save_tokenizer(root / "tok")
    tokenizer = Tokenizer.from_path(root / "tok")
    (root / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in sentences(120, seed=1)))
    (root / "texts").mkdir()
    for i, text in enumerate(sentences(60, seed=2)):
        (root / "texts" / f"{i:03d}.txt").write_text(text)
    build_token_file(sentences(80, seed=3), tokenizer, root / "c.bin")
    docs = [[tokenizer.encode(t) + [tokenizer.eos_id]] for t in sentences(80, seed=4)]
    write_megatron(root / "meg", docs, 4)                                # int32
    return root, tokenizer
