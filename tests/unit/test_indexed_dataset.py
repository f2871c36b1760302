"""Megatron-LM indexed datasets (MMIDIDX .bin/.idx): the reader against files written here from the format
specification, every corruption it must refuse, and TokenDataset over them against a megamoe token file."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from megamoe.data import indexed_dataset
from megamoe.data.indexed_dataset import MegatronIndexedDataset, is_megatron_dataset
from megamoe.data.token_dataset import TokenDataset, build_token_file
from megamoe.data.token_source import open_token_source
from megamoe.data.tokenizer import Tokenizer
from tests.helpers.indexed_dataset import SPEC_DTYPES, write_megatron
INTEGER_CODES = (1, 2, 3, 4, 5, 8)


def _documents(seed: int, low: int, high: int) -> list[list[list[int]]]:
    """Five documents of 0-3 sequences each (an empty document, an empty sequence), ids in [low, high)."""
    rng = np.random.default_rng(seed)
    documents = [[rng.integers(low, high, size=int(n)).tolist() for n in rng.integers(1, 9, size=int(k))]
                 for k in (3, 1, 0, 2, 3)]
    documents[3][0] = []
    return documents


@pytest.mark.parametrize("code", INTEGER_CODES)
def test_reader_returns_the_written_sequences_for_every_integer_dtype(code, tmp_path):
    info = np.iinfo(np.dtype(SPEC_DTYPES[code]))
    documents = _documents(code, max(info.min, -1000), min(info.max, 70_000) + 1)
    documents[0][0][:2] = [int(info.min), int(info.max)]  # the dtype's extremes survive
    write_megatron(tmp_path / "ds", documents, code)
    sequences = [sequence for document in documents for sequence in document]

    dataset = MegatronIndexedDataset(tmp_path / "ds")
    assert dataset.dtype == np.dtype(SPEC_DTYPES[code]) and dataset.holds_token_ids
    assert len(dataset) == len(sequences) and dataset.num_documents == len(documents)
    assert dataset.sequence_lengths.tolist() == [len(s) for s in sequences]
    assert dataset.document_indices.tolist() == [0, 3, 4, 4, 6, 9]
    assert [dataset[i].tolist() for i in range(len(dataset))] == sequences
    assert dataset[-1].tolist() == sequences[-1]
    assert [dataset.document(j).tolist() for j in range(len(documents))] == [sum(d, []) for d in documents]
    assert dataset.tokens.tolist() == sum(sequences, []) and dataset.num_tokens == sum(map(len, sequences))
    assert isinstance(dataset.tokens, np.memmap) and not dataset[0].flags.writeable  # zero-copy, read-only
    for name in ("ds.bin", "ds.idx"):  # either file names the dataset too
        assert MegatronIndexedDataset(tmp_path / name).tokens.tolist() == dataset.tokens.tolist()
    with pytest.raises(IndexError, match="out of range"):
        dataset[len(dataset)]


def test_token_dataset_over_megatron_equals_token_file(tmp_path):
    """The same documents as a Megatron dataset (uint16 and int32) and as a megamoe token file give the same
    samples; a sample crosses sequence and document boundaries."""
    vocab = 300

    class CharTokenizer(Tokenizer):  # id = code point, EOS 0: exact ids for both writers
        def __init__(self, path: Path):
            path.write_text("chars")
            self.path, self.vocab_size, self.eos_id, self.bos_id, self.pad_id = path, vocab, 0, None, None

        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids) -> str:
            return "".join(map(chr, ids))

    texts = ["first document", "a", "the third one, longer than the rest", "x" * 17, "end"]
    tokenizer = CharTokenizer(tmp_path / "chars")
    build_token_file(texts, tokenizer, tmp_path / "tokens.bin")
    # Megatron's preprocess_data.py: a document's sentences are its sequences, EOS appended to the last.
    documents = [[tokenizer.encode(text[:5]), tokenizer.encode(text[5:]) + [0]] for text in texts]
    seq_len = 7
    reference = TokenDataset(tmp_path / "tokens.bin", seq_len)
    for code in (8, 4):
        write_megatron(tmp_path / f"mega{code}", documents, code)
        source = open_token_source(tmp_path / f"mega{code}.idx")
        assert (source.format, source.num_documents, source.vocab_size, source.eos_id) == (
            "megatron", len(texts), None, None)
        dataset = TokenDataset(source, seq_len, vocab_size=vocab)
        assert len(dataset) == len(reference)
        everything = list(range(len(dataset)))
        for got, expected in zip(dataset.batch(everything), reference.batch(everything)):
            assert torch.equal(got, expected)
    assert open_token_source(tmp_path / "tokens.bin").format == "megamoe"
    assert TokenDataset(tmp_path / "mega8", seq_len).batch([1])[0].tolist() == reference.batch([1])[0].tolist()


def test_token_dataset_checks_every_id_once_when_it_opens_the_data(tmp_path):
    """Against the tokenizer's vocabulary (vocab_size) and the one a token file records, whichever is
    smaller, when the dataset opens: an id no sample of a short run would reach is refused too."""
    write_megatron(tmp_path / "ds", [[[1, 2, 3, 4]], [[5, 6, 2000, 7, 8]]], 4)
    with pytest.raises(ValueError, match=r"megatron token source .*ds: token 6 is id 2000, outside the vocabulary "
                                         r"\[0, 1000\) of the tokenizer"):
        TokenDataset(tmp_path / "ds", 2, vocab_size=1000)
    assert TokenDataset(tmp_path / "ds", 2, vocab_size=2001).batch([3])[0].tolist() == [[2000, 7]]
    assert TokenDataset(tmp_path / "ds", 2).batch([3])[0].tolist() == [[2000, 7]]  # no vocab known: no check
    write_megatron(tmp_path / "neg", [[[1, 2, -3, 4, 5]]], 2)  # int8
    with pytest.raises(ValueError, match="token 2 is id -3"):
        TokenDataset(tmp_path / "neg", 2, vocab_size=1000)

    # A megamoe token file is held to the vocabulary its sidecar records, vocab_size given or not.
    ids = np.arange(40, dtype="<u2") % 30
    ids[33] = 30
    (tmp_path / "t.bin").write_bytes(ids.tobytes())
    (tmp_path / "t.bin.json").write_text(json.dumps({
        "format_version": 1, "dtype": "uint16", "num_tokens": 40, "num_documents": 1, "vocab_size": 30,
        "eos_id": 0, "append_eos": True, "tokenizer_path": "t", "tokenizer_sha256": "0"}))
    for vocab_size in (None, 30, 64):
        with pytest.raises(ValueError, match=r"t\.bin: token 33 is id 30, outside the vocabulary \[0, 30\)"):
            TokenDataset(tmp_path / "t.bin", 4, vocab_size=vocab_size)
    with pytest.raises(ValueError, match=r"token 20 is id 20, outside the vocabulary \[0, 20\)"):
        TokenDataset(tmp_path / "t.bin", 4, vocab_size=20)
    ids[33] = 3
    (tmp_path / "t.bin").write_bytes(ids.tobytes())
    assert len(TokenDataset(tmp_path / "t.bin", 4, vocab_size=64)) == 9


@pytest.mark.parametrize("code", (6, 7))
def test_float_datasets_are_read_but_refused_for_training(code, tmp_path):
    write_megatron(tmp_path / "ds", [[[1, 2, 3]]], code)
    dataset = MegatronIndexedDataset(tmp_path / "ds")
    assert not dataset.holds_token_ids and dataset[0].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=f"float(64|32) values \\(dtype code {code}\\), not token ids"):
        open_token_source(tmp_path / "ds")


def _rewrite_idx(prefix: Path, edit) -> None:
    data = bytearray(Path(f"{prefix}.idx").read_bytes())
    Path(f"{prefix}.idx").write_bytes(bytes(edit(data)))


def _put(data: bytearray, offset: int, fmt: str, value) -> bytearray:
    data[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return data


# Header: magic 0..9, version 9..17, dtype code 17, sequence count 18..26, document index count 26..34;
# then lengths (int32) from 34, pointers (int64), document index (int64). The fixture below has 3 sequences.
LENGTHS_AT, POINTERS_AT = 34, 34 + 3 * 4
DOC_INDEX_AT = POINTERS_AT + 3 * 8
CORRUPTIONS = {
    "magic": (lambda d: _put(d, 0, "9s", b"MMIDIDX\x00\x01"), r"bad header magic"),
    "short": (lambda d: d[:20], r"20 bytes, shorter than the 34-byte header"),
    "version": (lambda d: _put(d, 9, "<Q", 2), r"unknown version 2"),
    "dtype": (lambda d: _put(d, 17, "<B", 9), r"unknown dtype code 9"),
    "dtype zero": (lambda d: _put(d, 17, "<B", 0), r"unknown dtype code 0"),
    "sequence count": (lambda d: _put(d, 18, "<Q", 4), r"header \(4 sequences, 3 document index entries\) needs"),
    "document count": (lambda d: _put(d, 26, "<Q", 2), r"header \(3 sequences, 2 document index entries\) needs"),
    "idx truncated": (lambda d: d[:-8], r"bytes, but its header .* needs"),
    "idx extended": (lambda d: d + bytes(5), r"bytes, but its header .* needs"),
    "multimodal": (lambda d: d + bytes(3), r"multimodal"),
    "length": (lambda d: _put(d, LENGTHS_AT, "<i", 3), r"sequence 1 starts at byte 4 .* not at 6"),
    "negative length": (lambda d: _put(d, LENGTHS_AT + 4, "<i", -1), r"negative sequence length at sequence 1"),
    "last length": (lambda d: _put(d, LENGTHS_AT + 8, "<i", 9), r"describes 14 int16 tokens \(28 bytes\)"),
    "pointer": (lambda d: _put(d, POINTERS_AT + 8, "<q", 2), r"sequence 1 starts at byte 2"),
    "first pointer": (lambda d: _put(d, POINTERS_AT, "<q", 2), r"sequence 0 starts at byte 2 .* not at 0"),
    "document start": (lambda d: _put(d, DOC_INDEX_AT, "<q", 1), r"document index must rise from 0"),
    "document end": (lambda d: _put(d, DOC_INDEX_AT + 16, "<q", 2), r"document index must rise from 0 to .* 3"),
    "document order": (lambda d: _put(d, DOC_INDEX_AT + 8, "<q", 4), r"document index must rise"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_index_is_refused_naming_the_file_and_the_problem(name, tmp_path):
    prefix = tmp_path / "ds"
    write_megatron(prefix, [[[1, 2], [3, 4, 5]], [[6, 7, 8, 9]]], 3)  # int16: 18 bytes of data
    MegatronIndexedDataset(prefix)  # the uncorrupted pair opens
    edit, message = CORRUPTIONS[name]
    _rewrite_idx(prefix, edit)
    with pytest.raises(ValueError, match=message) as error:
        MegatronIndexedDataset(prefix)
    assert str(prefix) in str(error.value)
    with pytest.raises(ValueError, match=message):  # and through the training entry point
        TokenDataset(tmp_path / "ds.bin", 2)


def test_bin_size_mismatch_and_missing_files(tmp_path):
    prefix = tmp_path / "ds"
    write_megatron(prefix, [[[1, 2], [3, 4, 5]]], 4)
    good = Path(f"{prefix}.bin").read_bytes()
    for data in (good[:-4], good + bytes(4), good[:-1]):
        Path(f"{prefix}.bin").write_bytes(data)
        message = rf"{re.escape(str(prefix))}\.bin has {len(data)} bytes, but its index ds\.idx describes"
        with pytest.raises(ValueError, match=message + r" 5 int32 tokens \(20 bytes\)"):
            MegatronIndexedDataset(prefix)
    Path(f"{prefix}.bin").unlink()
    assert is_megatron_dataset(prefix) and is_megatron_dataset(f"{prefix}.bin")
    with pytest.raises(FileNotFoundError, match=r"ds\.bin does not exist"):
        MegatronIndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"ds\.bin does not exist"):
        open_token_source(f"{prefix}.bin")
    Path(f"{prefix}.bin").write_bytes(good)
    Path(f"{prefix}.idx").unlink()
    with pytest.raises(FileNotFoundError, match=r"ds\.idx does not exist"):
        MegatronIndexedDataset(prefix)
    assert not is_megatron_dataset(prefix)
    # Neither a Megatron pair nor a megamoe token file: the token file's errors, mentioning both formats.
    with pytest.raises(FileNotFoundError, match=r"no sidecar .* \.idx beside the \.bin"):
        open_token_source(f"{prefix}.bin")
    with pytest.raises(FileNotFoundError, match=r"does not exist \(nor a Megatron dataset"):
        open_token_source(prefix)


def test_empty_dataset_opens_and_is_too_short_to_train(tmp_path):
    write_megatron(tmp_path / "ds", [], 8)
    dataset = MegatronIndexedDataset(tmp_path / "ds")
    assert (len(dataset), dataset.num_documents, dataset.num_tokens) == (0, 0, 0)
    with pytest.raises(ValueError, match="has 0 tokens, too few for one sample"):
        TokenDataset(tmp_path / "ds", 4)


def test_megamoe_token_file_with_idx_beside_it_stays_a_token_file(tmp_path):
    """A sidecar decides: a megamoe ``x.bin`` is read as a token file even if a stray ``x.idx`` exists."""
    write_megatron(tmp_path / "x", [[[1, 2, 3]]], 8)
    (tmp_path / "x.bin").write_bytes(np.array([5, 6, 7, 8, 9], dtype="<u2").tobytes())
    (tmp_path / "x.bin.json").write_text(json.dumps({
        "format_version": 1, "dtype": "uint16", "num_tokens": 5, "num_documents": 1, "vocab_size": 10,
        "eos_id": 0, "append_eos": True, "tokenizer_path": "t", "tokenizer_sha256": "0" * 64}))
    source = open_token_source(tmp_path / "x.bin")
    assert source.format == "megamoe" and source.tokens.tolist() == [5, 6, 7, 8, 9] and source.vocab_size == 10


def test_validation_in_chunks_sees_every_chunk(tmp_path, monkeypatch):
    """The index is checked a chunk at a time (bounded memory); a fault in a later chunk is still found."""
    monkeypatch.setattr(indexed_dataset, "_CHECK_CHUNK", 2)
    documents = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8, 9]], [[10]]]  # 6 sequences, document index of 5
    write_megatron(tmp_path / "ds", documents, 8)
    assert MegatronIndexedDataset(tmp_path / "ds").tokens.tolist() == list(range(1, 11))
    pointers_at, doc_index_at = 34 + 6 * 4, 34 + 6 * 12
    _rewrite_idx(tmp_path / "ds", lambda d: _put(d, pointers_at + 5 * 8, "<q", 16))  # sequence 5, third chunk
    with pytest.raises(ValueError, match="sequence 5 starts at byte 16 .* not at 18"):
        MegatronIndexedDataset(tmp_path / "ds")
    write_megatron(tmp_path / "ds", documents, 8)
    _rewrite_idx(tmp_path / "ds", lambda d: _put(d, doc_index_at + 3 * 8, "<q", 3))  # [0, 2, 3, 3, 6]: valid
    assert MegatronIndexedDataset(tmp_path / "ds").num_documents == 4
    _rewrite_idx(tmp_path / "ds", lambda d: _put(d, doc_index_at + 1 * 8, "<q", 4))  # [0, 4, 3, 3, 6]: falls
    with pytest.raises(ValueError, match="document index must rise"):  # across the chunk boundary (entries 1, 2)
        MegatronIndexedDataset(tmp_path / "ds")
