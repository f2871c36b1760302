"""Data side: stdlib corpus, sentencepiece training + Tokenizer wrapper + CLI, token files, TokenDataset,
ResumableSampler (layout-independent global batches, resume, epochs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch

from megamoe.atomic_file import atomic_write
from megamoe.data.corpus import stdlib_corpus_files
from megamoe.data.resumable_sampler import ResumableSampler
from megamoe.data.token_dataset import (
    TokenDataset, TokenFileMeta, build_token_file, micro_batches, sidecar_path,
)
from megamoe.data.tokenizer import (
    BOS_ID, EOS_ID, PAD_ID, UNK_ID, HFTokenizer, SentencePieceTokenizer, Tokenizer, train_sentencepiece,
)
from megamoe.cli.launch import run_script


CORPUS_BYTES = 150_000
VOCAB = 600
# Not in the training slice (the slice is a sorted prefix); tabs, non-ASCII, an emoji and blank lines.
UNSEEN_TEXT = "def f(x):\n\tif x:\n        return 'é ü 漢字 🙂'\n\n\n    # trailing  spaces  \n"


@pytest.fixture(scope="module")
def corpus_files() -> list[Path]:
    return stdlib_corpus_files(CORPUS_BYTES)


@pytest.fixture(scope="module")
def sp_model(corpus_files, tmp_path_factory) -> Path:
    return train_sentencepiece(corpus_files, tmp_path_factory.mktemp("sp") / "tok", VOCAB)


@pytest.fixture(scope="module")
def sp_tokenizer(sp_model) -> Tokenizer:
    return Tokenizer.from_path(sp_model)


class _ListTokenizer(Tokenizer):
    """Tokenizer stub: one id per character (code point + 10), for dtype / error-path tests."""

    def __init__(self, path: Path, vocab_size: int, eos_id: int | None = 0, fail_on: str | None = None):
        path.write_text("stub")
        self.path, self.vocab_size, self.eos_id, self.bos_id, self.pad_id = path, vocab_size, eos_id, None, None
        self.fail_on = fail_on

    def encode(self, text: str) -> list[int]:
        if self.fail_on is not None and self.fail_on in text:
            raise RuntimeError("simulated crash while tokenizing")
        return [ord(c) + 10 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i - 10) for i in ids)


# ---------------------------------------------------------------- corpus


def test_stdlib_corpus_files_sorted_filtered_and_prefix_limited():
    files = stdlib_corpus_files()
    assert files == stdlib_corpus_files()
    assert len(files) > 100 and all(p.suffix == ".py" and p.is_file() for p in files)
    excluded = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    assert not any(excluded & set(p.parts) for p in files)
    root = Path(os.path.commonpath(files))
    keys = [p.relative_to(root).parts for p in files]
    assert keys == sorted(keys)

    limited = stdlib_corpus_files(CORPUS_BYTES)
    assert limited == files[:len(limited)]
    assert sum(p.stat().st_size for p in limited) <= CORPUS_BYTES
    assert sum(p.stat().st_size for p in files[:len(limited) + 1]) > CORPUS_BYTES  # longest such prefix
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus_files(0)
    with pytest.raises(ValueError, match="smaller than the first source file"):
        stdlib_corpus_files(1)


# ---------------------------------------------------------------- tokenizer


def test_sentencepiece_round_trip_and_special_ids(sp_tokenizer, sp_model):
    assert isinstance(sp_tokenizer, SentencePieceTokenizer)
    assert sp_tokenizer.vocab_size == VOCAB
    assert (sp_tokenizer.bos_id, sp_tokenizer.eos_id, sp_tokenizer.pad_id) == (BOS_ID, EOS_ID, PAD_ID)
    unseen_file = stdlib_corpus_files()[-1].read_text(encoding="utf-8")
    for text in (UNSEEN_TEXT, unseen_file, ""):
        ids = sp_tokenizer.encode(text)
        assert all(isinstance(i, int) and 0 <= i < VOCAB for i in ids)
        assert not {BOS_ID, EOS_ID, PAD_ID, UNK_ID} & set(ids)  # no special added; byte fallback, no unk
        assert sp_tokenizer.decode(ids) == text
    # The BPE learnt something: far fewer tokens than UTF-8 bytes on code.
    assert len(sp_tokenizer.encode(unseen_file)) < 0.6 * len(unseen_file.encode("utf-8"))
    assert len(sp_tokenizer.sha256) == 64
    assert Tokenizer.from_path(sp_model.parent).encode(UNSEEN_TEXT) == sp_tokenizer.encode(UNSEEN_TEXT)


def test_training_is_deterministic_and_seed_drives_the_line_sample(corpus_files, tmp_path):
    first = train_sentencepiece(corpus_files, tmp_path / "a", VOCAB)
    second = train_sentencepiece(corpus_files, tmp_path / "sub" / "b", VOCAB)
    assert first.read_bytes() == second.read_bytes()
    # sentencepiece's own sampling ignores its seed; ours (input_sentence_size < number of lines) must not.
    sampled = [train_sentencepiece(corpus_files, tmp_path / f"s{i}", VOCAB, input_sentence_size=800, seed=seed)
               for i, seed in enumerate((1, 1, 2))]
    assert sampled[0].read_bytes() == sampled[1].read_bytes()
    assert sampled[0].read_bytes() != sampled[2].read_bytes()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.model", "b.model", "s0.model", "s1.model",
                                                           "s2.model", "sub"]  # no temporary left


def test_training_errors_leave_no_files(corpus_files, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(FileNotFoundError, match="not found"):
        train_sentencepiece([tmp_path / "missing.txt"], tmp_path / "m", VOCAB)
    with pytest.raises(ValueError, match="no training text"):
        train_sentencepiece([empty], tmp_path / "m", VOCAB)
    with pytest.raises(ValueError, match="vocab_size must be >= 261"):
        train_sentencepiece(corpus_files, tmp_path / "m", 100)
    with pytest.raises(ValueError, match="model_type"):
        train_sentencepiece(corpus_files, tmp_path / "m", VOCAB, model_type="wordpiece")
    with pytest.raises(ValueError, match="cannot train a 50000-piece model on this corpus: Vocabulary size too high"):
        train_sentencepiece(corpus_files[:1], tmp_path / "m", 50_000)   # sentencepiece: too many pieces for this text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_a_vocabulary_too_small_for_the_corpus_says_the_smallest_that_fits(corpus_files, tmp_path, demo, capsys,
                                                                           monkeypatch):
    """Fewer pieces than the corpus's characters + 260 (special and byte pieces): one error naming the
    minimum, which then trains; and in pretrain_moe.py one error line, no traceback."""
    with pytest.raises(ValueError, match=r"vocabulary of 270 pieces is too small for this corpus: it needs at "
                                         r"least (\d+) .* \(--vocab-size\) of \1 or more") as error:
        train_sentencepiece(corpus_files, tmp_path / "m", 270)
    needed = int(str(error.value).split("at least ")[1].split()[0])
    assert 270 < needed < VOCAB
    assert Tokenizer.from_path(train_sentencepiece(corpus_files, tmp_path / "m", needed)).vocab_size == needed
    monkeypatch.delenv("MEGAMOE_TRACEBACK", raising=False)
    code = run_script(demo.main, ["--vocab-size", "270", "--corpus-bytes", str(CORPUS_BYTES), "--steps", "1",
                                  "--work-dir", str(tmp_path / "work"), "--save-dir", str(tmp_path / "ckpt")],
                      prog=demo.PROG)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: "), lines
    assert f"needs at least {needed}" in lines[0] and "--vocab-size" in lines[0]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_atomic_write_keeps_old_file_on_error(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(KeyError):
        with atomic_write(target) as file:
            file.write(b"partial")
            raise KeyError("crash")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    with atomic_write(target, "w") as file:
        file.write("new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["f.bin"]


def test_atomic_write_leaves_the_permissions_of_a_plain_write(tmp_path):
    previous = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "new.bin") as file:      # a new file: 0o666 less the umask, not 0o600
            file.write(b"x")
        (tmp_path / "plain.bin").write_bytes(b"x")
        assert os.stat(tmp_path / "new.bin").st_mode & 0o777 == os.stat(tmp_path / "plain.bin").st_mode & 0o777 == 0o640
        os.chmod(tmp_path / "plain.bin", 0o604)                 # an existing file keeps its own
        with atomic_write(tmp_path / "plain.bin", "w") as file:
            file.write("y")
        assert os.stat(tmp_path / "plain.bin").st_mode & 0o777 == 0o604
        assert os.umask(0o027) == 0o027, "atomic_write must leave the umask as it was"
    finally:
        os.umask(previous)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megamoe.data.tokenizer", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_train_success_and_failures(corpus_files, sp_model, tmp_path):
    inputs = [str(p) for p in corpus_files]
    done = _run_cli("train", "--input", *inputs, "--model-prefix", str(tmp_path / "cli"), "--vocab-size", str(VOCAB))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "cli.model")
    assert (tmp_path / "cli.model").read_bytes() == sp_model.read_bytes()  # same defaults as the library

    helped = _run_cli("train", "--help")
    assert helped.returncode == 0 and "--vocab-size" in helped.stdout and "--input-sentence-size" in helped.stdout

    missing = _run_cli("train", "--input", str(tmp_path / "nope.txt"), "--model-prefix", str(tmp_path / "x"),
                       "--vocab-size", str(VOCAB))
    assert missing.returncode == 1 and "not found" in missing.stderr and "nope.txt" in missing.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    no_text = _run_cli("train", "--input", str(empty), "--model-prefix", str(tmp_path / "x"), "--vocab-size", "500")
    assert no_text.returncode == 1 and "no training text" in no_text.stderr
    usage = _run_cli("train", "--input", inputs[0], "--model-prefix", str(tmp_path / "x"), "--vocab-size", "big")
    assert usage.returncode == 2 and "--vocab-size" in usage.stderr
    assert not (tmp_path / "x.model").exists()


def _hf_tokenizer_dir(directory: Path, config: dict | None) -> Path:
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator([UNSEEN_TEXT * 3, "def g(y): return y + 1\n"], trainer)
    directory.mkdir()
    hf.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_hf_tokenizer_json_and_from_path_dispatch(sp_model, tmp_path):
    config = {"eos_token": "<|endoftext|>", "bos_token": {"content": "<s>", "lstrip": False}, "pad_token": None}
    hf_dir = _hf_tokenizer_dir(tmp_path / "hf", config)
    hf = Tokenizer.from_path(hf_dir)
    assert isinstance(hf, HFTokenizer) and hf.path == hf_dir / "tokenizer.json"
    assert (hf.eos_id, hf.bos_id, hf.pad_id) == (0, 1, None)
    ids = hf.encode(UNSEEN_TEXT)
    assert hf.decode(ids) == UNSEEN_TEXT and 0 not in ids and max(ids) < hf.vocab_size
    assert hf.decode([hf.eos_id]) == "<|endoftext|>"  # special tokens are decoded, not dropped
    bare = Tokenizer.from_path(_hf_tokenizer_dir(tmp_path / "bare", None) / "tokenizer.json")
    assert (bare.bos_id, bare.eos_id, bare.pad_id) == (None, None, None)

    # A directory holding both formats (as many HF repos do) prefers tokenizer.json.
    (hf_dir / "tokenizer.model").write_bytes(sp_model.read_bytes())
    assert isinstance(Tokenizer.from_path(hf_dir), HFTokenizer)
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(ValueError, match="cannot tell the tokenizer format"):
        Tokenizer.from_path(tmp_path / "other.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer found in directory"):
        Tokenizer.from_path(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_path(tmp_path / "absent")
    (tmp_path / "broken.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot load sentencepiece model"):
        Tokenizer.from_path(tmp_path / "broken.model")


# ---------------------------------------------------------------- token file + dataset


def test_token_file_round_trip(sp_tokenizer, corpus_files, tmp_path):
    documents = ["first document", corpus_files[0], "", UNSEEN_TEXT]
    out = tmp_path / "sub" / "train.bin"
    meta = build_token_file(documents, sp_tokenizer, out)
    texts = ["first document", corpus_files[0].read_text(encoding="utf-8"), "", UNSEEN_TEXT]
    expected = [i for text in texts for i in sp_tokenizer.encode(text) + [EOS_ID]]
    assert np.fromfile(out, dtype="<u2").tolist() == expected
    assert meta == TokenFileMeta.read(sidecar_path(out))
    assert (meta.dtype, meta.num_tokens, meta.num_documents, meta.vocab_size) == ("uint16", len(expected), 4, VOCAB)
    assert meta.tokenizer_sha256 == sp_tokenizer.sha256 and meta.eos_id == EOS_ID and meta.append_eos
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.bin", "train.bin.json"]

    assert sp_tokenizer.decode(expected) == "".join(texts)  # sentencepiece decodes control pieces to ""

    no_eos = build_token_file(["ab"], sp_tokenizer, tmp_path / "no_eos.bin", append_eos=False)
    assert no_eos.num_tokens == len(sp_tokenizer.encode("ab"))


def test_token_file_dtype_follows_vocab_size(tmp_path):
    wide = build_token_file(["ab"], _ListTokenizer(tmp_path / "w", 70_000), tmp_path / "wide.bin")
    assert wide.dtype == "uint32" and np.fromfile(tmp_path / "wide.bin", "<u4").tolist() == [107, 108, 0]
    edge = build_token_file(["ab"], _ListTokenizer(tmp_path / "e", 1 << 16), tmp_path / "edge.bin")
    assert edge.dtype == "uint16"
    with pytest.raises(TypeError, match="wrap it in a list"):
        build_token_file("ab", _ListTokenizer(tmp_path / "w", 70_000), tmp_path / "one.bin")
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=100\\)"):
        build_token_file(["ab"], _ListTokenizer(tmp_path / "s", 100), tmp_path / "small.bin")
    with pytest.raises(ValueError, match="no EOS token"):
        build_token_file(["ab"], _ListTokenizer(tmp_path / "n", 200, eos_id=None), tmp_path / "noeos.bin")


def test_dataset_samples_are_shifted_windows(sp_tokenizer, corpus_files, tmp_path):
    out = tmp_path / "train.bin"
    meta = build_token_file(corpus_files[:3], sp_tokenizer, out)
    tokens = torch.from_numpy(np.fromfile(out, dtype="<u2").astype(np.int64))
    seq_len = 16
    dataset = TokenDataset(out, seq_len)
    assert len(dataset) == (meta.num_tokens - 1) // seq_len
    for index in (0, 1, len(dataset) - 1):
        inputs, labels = dataset[index]
        assert inputs.shape == labels.shape == (seq_len,) and inputs.dtype == labels.dtype == torch.int64
        window = tokens[index * seq_len:index * seq_len + seq_len + 1]
        assert torch.equal(inputs, window[:-1]) and torch.equal(labels, window[1:])
    inputs_bs, labels_bs = dataset.batch(torch.tensor([3, 0, 3]))
    assert inputs_bs.shape == labels_bs.shape == (3, seq_len) and inputs_bs.is_contiguous()
    assert torch.equal(inputs_bs[1], dataset[0][0]) and torch.equal(labels_bs[2], dataset[3][1])
    for bad in (len(dataset), -1):
        with pytest.raises(IndexError):
            dataset[bad]
    with pytest.raises(ValueError, match="too few for one sample"):
        TokenDataset(out, meta.num_tokens)
    with pytest.raises(ValueError, match="seq_len"):
        TokenDataset(out, 0)


def test_dataset_rejects_truncated_corrupt_and_incomplete_files(sp_tokenizer, tmp_path):
    out = tmp_path / "t.bin"
    build_token_file(["some text " * 20], sp_tokenizer, out)
    sidecar = sidecar_path(out)
    good_bin, good_json = out.read_bytes(), sidecar.read_text()

    out.write_bytes(good_bin[:-2])  # one uint16 token short
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TokenDataset(out, 4)
    out.write_bytes(good_bin)
    for corrupt in (good_json[:-5], "[" * 100_000 + "]" * 100_000):
        sidecar.write_text(corrupt)
        with pytest.raises(ValueError, match="sidecar .* is corrupt"):
            TokenDataset(out, 4)
    for key, value in (("format_version", 99), ("dtype", "int8"), ("num_tokens", -1), ("eos_id", 10**6)):
        sidecar.write_text(json.dumps({**json.loads(good_json), key: value}))
        with pytest.raises(ValueError, match=key):
            TokenDataset(out, 4)
    sidecar.write_text(json.dumps({k: v for k, v in json.loads(good_json).items() if k != "vocab_size"}))
    with pytest.raises(ValueError, match="expected keys"):
        TokenDataset(out, 4)
    sidecar.write_text(good_json)
    TokenDataset(out, 4)

    # A rebuild that dies half way leaves the old token file unreadable (no sidecar), not silently stale.
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_token_file(["ok", "boom"], _ListTokenizer(tmp_path / "stub", 1000, fail_on="boom"), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stub", "t.bin"]
    with pytest.raises(FileNotFoundError, match="no sidecar"):
        TokenDataset(out, 4)


# ---------------------------------------------------------------- sampler


def _global_batches(num_samples, steps, *, dp_size, micro_batch_size, global_batch_size=8, seed=0, start=None):
    """Per step: the concatenation, in rank order, of every DP rank's micro-batches."""
    samplers = [ResumableSampler(num_samples, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                                 dp_rank=rank, dp_size=dp_size, seed=seed) for rank in range(dp_size)]
    if start is not None:
        for sampler in samplers:
            sampler.load_state_dict(start)
    batches = []
    for _ in range(steps):
        per_rank = [sampler.next_micro_batches() for sampler in samplers]
        assert all(len(mbs) == samplers[0].num_micro_batches for mbs in per_rank)
        assert all(mb.shape == (micro_batch_size,) for mbs in per_rank for mb in mbs)
        batches.append(torch.cat([mb for mbs in per_rank for mb in mbs]).tolist())
    return batches, samplers[0].state_dict()


def test_global_batch_does_not_depend_on_layout():
    num_samples, steps = 13, 7  # 56 samples: several epoch boundaries, some inside a global batch
    reference, _ = _global_batches(num_samples, steps, dp_size=1, micro_batch_size=8)
    for dp_size, micro_batch_size in ((1, 2), (2, 1), (2, 4), (4, 1), (4, 2)):
        batches, state = _global_batches(num_samples, steps, dp_size=dp_size, micro_batch_size=micro_batch_size)
        assert batches == reference, (dp_size, micro_batch_size)
        assert state["consumed_samples"] == steps * 8
    stream = [i for batch in reference for i in batch]
    for epoch in range(4):  # each epoch is a permutation, and epochs differ
        assert sorted(stream[epoch * num_samples:(epoch + 1) * num_samples]) == list(range(num_samples))
    assert stream[:num_samples] != stream[num_samples:2 * num_samples]
    other_seed, _ = _global_batches(num_samples, steps, dp_size=1, micro_batch_size=8, seed=1)
    assert other_seed != reference


def test_resume_continues_exactly_under_any_layout():
    num_samples = 13
    uninterrupted, _ = _global_batches(num_samples, 9, dp_size=1, micro_batch_size=8)
    _, state = _global_batches(num_samples, 4, dp_size=2, micro_batch_size=2)
    for dp_size, micro_batch_size in ((1, 8), (2, 2), (4, 1)):
        resumed, _ = _global_batches(num_samples, 5, dp_size=dp_size, micro_batch_size=micro_batch_size, start=state)
        assert resumed == uninterrupted[4:], dp_size
    # Even a new global batch size continues at the next sample of the same order.
    resumed, _ = _global_batches(num_samples, 2, dp_size=2, micro_batch_size=1, global_batch_size=4, start=state)
    assert [i for b in resumed for i in b] == uninterrupted[4]

    sampler = ResumableSampler(num_samples, global_batch_size=8, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="seed=5"):
        sampler.load_state_dict({**state, "seed": 5})
    with pytest.raises(ValueError, match="num_samples=14"):
        sampler.load_state_dict({**state, "num_samples": 14})
    with pytest.raises(ValueError, match="consumed_samples"):
        sampler.load_state_dict({"consumed_samples": -8})


def test_sampler_validation_and_unshuffled_order():
    with pytest.raises(ValueError, match="divisible by dp_size \\* micro_batch_size"):
        ResumableSampler(10, global_batch_size=6, micro_batch_size=2, dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        ResumableSampler(10, global_batch_size=8, micro_batch_size=2, dp_rank=2, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="num_samples"):
        ResumableSampler(0, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2, seed=0)
    sampler = ResumableSampler(5, global_batch_size=4, micro_batch_size=2, dp_rank=1, dp_size=2, seed=0,
                               shuffle=False)
    iterator = iter(sampler)
    assert [next(iterator).tolist() for _ in range(3)] == [[2, 3], [1, 2], [0, 1]]
    assert sampler.epoch == 2 and sampler.consumed_samples == 12


def test_micro_batches_feed_dataset_windows(sp_tokenizer, corpus_files, tmp_path):
    out = tmp_path / "train.bin"
    build_token_file(corpus_files[:2], sp_tokenizer, out)
    dataset = TokenDataset(out, 8)
    sampler = ResumableSampler(len(dataset), global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2, seed=3)
    expected = ResumableSampler(len(dataset), global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2, seed=3)
    iterator = micro_batches(dataset, sampler)
    for indices in expected.next_micro_batches():
        inputs, labels = next(iterator)
        assert inputs.shape == labels.shape == (2, 8)
        assert torch.equal(inputs, dataset.batch(indices)[0]) and torch.equal(labels, dataset.batch(indices)[1])
    assert sampler.state_dict() == expected.state_dict()
    wrong = ResumableSampler(len(dataset) + 1, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2, seed=3)
    with pytest.raises(ValueError, match="len\\(dataset\\)"):
        next(micro_batches(dataset, wrong))
