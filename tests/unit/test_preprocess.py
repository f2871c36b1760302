"""megamoe.data.preprocess and its command (megamoe preprocess), the parallel encoder, HF tokenizer directories, and
check_tokenizer_fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from megamoe.data.parallel_encode import DocumentEncoder
from megamoe.cli.preprocess import PROG, main
from megamoe.data.preprocess import preprocess
from megamoe.data.token_dataset import TokenDataset, sidecar_path
from megamoe.data.tokenizer import HFTokenizer, Tokenizer, check_tokenizer_fits
from megamoe.cli.launch import run_script
from tests.helpers.atomic_file import NOT_REGULAR  # FIFO, links to /dev/null and /dev/full

EOS = "</s>"
TRAINING_TEXT = ["the quick brown fox jumps over the lazy dog", "def f(x):\n    return x * 2\n", "ünïcödé ✓"]
DOCS = [f"document {i}: " + TRAINING_TEXT[i % 3] * (1 + i % 4) for i in range(23)] + ["", "last one\n"]


def _bpe_tokenizer_dir(directory: Path, config: dict | None = None, special_tokens_map: dict | None = None) -> Path:
    """A small byte-level BPE saved as an HF tokenizer directory (tokenizer.json + its configs)."""
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", EOS], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(TRAINING_TEXT * 4, trainer)
    directory.mkdir(parents=True)
    hf.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if special_tokens_map is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return _bpe_tokenizer_dir(tmp_path_factory.mktemp("tok") / "hf", config={"eos_token": EOS})


def _ids(path: Path) -> list[int]:
    meta = json.loads(sidecar_path(path).read_text())
    return np.fromfile(path, dtype={"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]).tolist()


def _expected_ids(tokenizer: Tokenizer, docs: list[str]) -> list[int]:
    return [i for doc in docs for i in tokenizer.encode(doc) + [tokenizer.eos_id]]


def _write_inputs(directory: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents as a directory of text files, a JSONL file and a Parquet file."""
    text_dir = directory / "text"
    text_dir.mkdir(parents=True)
    for i, doc in enumerate(docs):
        (text_dir / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    jsonl = directory / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    parquet = directory / "docs.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"content": docs}), parquet, row_group_size=5)
    return {"text": text_dir, "jsonl": jsonl, "parquet": parquet}


# ---------------------------------------------------------------- HF tokenizer directories


def test_hf_directory_eos_from_config_or_legacy_special_tokens_map(tmp_path):
    hf = Tokenizer.from_path(_bpe_tokenizer_dir(tmp_path / "config", config={"eos_token": EOS}))
    assert isinstance(hf, HFTokenizer) and hf.eos_id == 1 and hf.bos_id is None
    # Older transformers: eos only in special_tokens_map.json, tokenizer_config.json naming it null.
    legacy = Tokenizer.from_path(_bpe_tokenizer_dir(
        tmp_path / "legacy", config={"eos_token": None, "model_max_length": 512},
        special_tokens_map={"eos_token": {"content": EOS, "lstrip": False, "normalized": False}},
    ))
    assert (legacy.eos_id, legacy.bos_id) == (1, None)
    # tokenizer_config.json wins where both name a token (as transformers reads them).
    both = Tokenizer.from_path(_bpe_tokenizer_dir(
        tmp_path / "both", config={"eos_token": EOS, "bos_token": "<unk>"}, special_tokens_map={"eos_token": "<unk>"},
    ))
    assert (both.eos_id, both.bos_id) == (1, 0)
    with pytest.raises(ValueError, match=r"eos_token '<eot>' .* is not in its vocabulary"):
        Tokenizer.from_path(_bpe_tokenizer_dir(tmp_path / "wrong", config={"eos_token": "<eot>"}))


def test_directory_saved_by_transformers(tmp_path, hf_dir):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), eos_token=EOS)
    fast.save_pretrained(tmp_path / "saved")
    loaded = Tokenizer.from_path(tmp_path / "saved")
    assert loaded.eos_id == fast.eos_token_id == 1
    assert loaded.encode(DOCS[5]) == fast.encode(DOCS[5], add_special_tokens=False)


def test_check_tokenizer_fits(hf_dir):
    tokenizer = Tokenizer.from_path(hf_dir)
    check_tokenizer_fits(tokenizer, tokenizer.vocab_size)
    check_tokenizer_fits(tokenizer, tokenizer.vocab_size + 64)  # padded embedding: fine
    with pytest.raises(ValueError, match=rf"has {tokenizer.vocab_size} token ids, more than the model's vocab_size "
                                         rf"{tokenizer.vocab_size - 1}"):
        check_tokenizer_fits(tokenizer, tokenizer.vocab_size - 1)
    with pytest.raises(ValueError, match="model_vocab_size must be an int >= 1"):
        check_tokenizer_fits(tokenizer, 0)


# ---------------------------------------------------------------- preprocess (in process)


def test_text_jsonl_and_parquet_give_the_same_tokens(tmp_path, hf_dir):
    tokenizer = Tokenizer.from_path(hf_dir)
    inputs = _write_inputs(tmp_path / "in", DOCS)
    expected = _expected_ids(tokenizer, DOCS)
    for name, path in inputs.items():
        out = tmp_path / f"{name}.bin"
        meta = preprocess([path], tokenizer, out, text_field="content", workers=1)
        assert _ids(out) == expected, name
        assert (meta.num_documents, meta.num_tokens, meta.eos_id) == (len(DOCS), len(expected), 1)
    assert len(TokenDataset(tmp_path / "jsonl.bin", seq_len=8)) == (len(expected) - 1) // 8


def test_output_inside_an_input_directory_is_not_read_back(tmp_path, hf_dir):
    tokenizer = Tokenizer.from_path(hf_dir)
    inputs = _write_inputs(tmp_path / "in", DOCS)
    out = inputs["text"] / "tokens.bin"
    first = preprocess([inputs["text"]], tokenizer, out, workers=1)
    first_bytes = out.read_bytes()
    # The rerun sees tokens.bin.json (a .json file) in its input directory, and skips it.
    assert preprocess([inputs["text"]], tokenizer, out, workers=1) == first and out.read_bytes() == first_bytes
    assert _ids(out) == _expected_ids(tokenizer, DOCS)
    with pytest.raises(ValueError, match="is the output or its sidecar"):
        preprocess([inputs["jsonl"], sidecar_path(out)], tokenizer, out, workers=1)


def test_output_is_byte_identical_for_any_worker_count(tmp_path, hf_dir):
    tokenizer = Tokenizer.from_path(hf_dir)
    inputs = _write_inputs(tmp_path / "in", DOCS)
    outputs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}.bin"
        # Tiny chunks: the 3 workers each tokenize several chunks, whose results arrive out of order.
        preprocess(list(inputs.values()), tokenizer, out, text_field="content", workers=workers, chunk_chars=60)
        outputs.append((out.read_bytes(), sidecar_path(out).read_bytes()))
    assert outputs[0] == outputs[1]
    assert np.frombuffer(outputs[0][0], dtype="<u2").tolist() == _expected_ids(tokenizer, DOCS * 3)


def test_worker_error_names_the_document_and_leaves_no_token_file(tmp_path, hf_dir):
    tokenizer = Tokenizer.from_path(_word_level_dir(tmp_path / "words"))
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "a b"}) + "\n")
    out = tmp_path / "out.bin"
    preprocess([good], tokenizer, out, workers=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("a b", "b a", "a zebra")))
    # An error found before writing (the input) leaves the existing output as it was...
    before = (out.read_bytes(), sidecar_path(out).read_bytes())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        preprocess([bad, tmp_path / "absent.jsonl"], tokenizer, out, workers=2)
    assert (out.read_bytes(), sidecar_path(out).read_bytes()) == before
    # ... one found while writing (here by a worker) leaves neither the old token file nor a new one.
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: tokenizer .* cannot encode this document"):
        preprocess([bad], tokenizer, out, workers=2, chunk_chars=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "words"]
    with pytest.raises(RuntimeError, match="inside its 'with' block"):
        list(DocumentEncoder(tokenizer, workers=2).encode([("a", "x")]))


def _word_level_dir(directory: Path) -> Path:
    """A word-level tokenizer with no unknown token: it cannot encode a word outside its vocabulary."""
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab={"a": 0, "b": 1, EOS: 2}))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    directory.mkdir()
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return directory


# ---------------------------------------------------------------- the CLI


def _bad_input_cases(tmp_path: Path, hf_dir: Path) -> dict[str, tuple[list, str]]:
    """name: (CLI arguments but --output, what the one error line must say)."""
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "ok"}\n{"text": broken\n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "fine"}\n{"body": "where is text"}\n')
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "garbage.json").write_text("this is not a tokenizer")
    (tmp_path / "words.jsonl").write_text('{"text": "a b"}\n{"text": "a zebra b"}\n')
    (tmp_path / "deep.jsonl").write_text('{"text": "a"}\n{"text": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    words = _word_level_dir(tmp_path / "words")
    return {  # bad_json runs with the default --workers (every core)
        "bad_json": (["--input", tmp_path / "bad.jsonl", "--tokenizer", hf_dir],
                     f"{tmp_path / 'bad.jsonl'}:3: not valid JSON"),
        "no_field": (["--input", tmp_path / "nofield.jsonl", "--tokenizer", hf_dir, "--workers", "1"],
                     f"{tmp_path / 'nofield.jsonl'}:2: no field 'text'"),
        "no_documents": (["--input", tmp_path / "blank.jsonl", "--tokenizer", hf_dir, "--workers", "1"],
                         f"no documents in {tmp_path / 'blank.jsonl'}"),
        "no_tokens": (["--input", tmp_path / "empty.txt", "--tokenizer", hf_dir, "--no-append-eos", "--workers", "1"],
                      "no tokens to write"),
        "missing_input": (["--input", tmp_path / "absent.jsonl", "--tokenizer", hf_dir, "--workers", "1"],
                          f"input {tmp_path / 'absent.jsonl'} does not exist"),
        "bad_tokenizer": (["--input", tmp_path / "bad.jsonl", "--tokenizer", tmp_path / "garbage.json"],
                          f"--tokenizer {tmp_path / 'garbage.json'}: cannot load HF tokenizer"),
        "no_eos": (["--input", tmp_path / "bad.jsonl", "--tokenizer", _bpe_tokenizer_dir(tmp_path / "no_eos")],
                   "has no EOS token to end each document with"),
        "worker_error": (["--input", tmp_path / "words.jsonl", "--tokenizer", words, "--workers", "2"],
                         f"{tmp_path / 'words.jsonl'}:2: tokenizer {words / 'tokenizer.json'} cannot encode"),
        "deep_json": (["--input", tmp_path / "deep.jsonl", "--tokenizer", hf_dir, "--workers", "1"],
                      f"{tmp_path / 'deep.jsonl'}:2: JSON nested too deeply"),
    }


def _check_error(name: str, rc: int, stderr: str, message: str, out_dir: Path) -> None:
    error_lines = [line for line in stderr.splitlines() if "error:" in line]
    assert rc == 1 and "Traceback" not in stderr, (name, stderr)
    assert len(error_lines) == 1 and error_lines[0].startswith("megamoe-preprocess: error: "), (name, stderr)
    assert message in error_lines[0], (name, error_lines[0])
    assert list(out_dir.iterdir()) == [], name  # no token file, no sidecar, no temporary file


def test_cli_bad_input_one_error_line_exit_1_no_output(tmp_path, hf_dir, capsys, monkeypatch):
    # In process (run_script, as `python -m` runs it): a subprocess per case would cost seconds each.
    monkeypatch.delenv("MEGAMOE_TRACEBACK", raising=False)
    for name, (args, message) in _bad_input_cases(tmp_path, hf_dir).items():
        out_dir = tmp_path / "out" / name
        out_dir.mkdir(parents=True)
        rc = run_script(main, [*map(str, args), "--output", str(out_dir / "tokens.bin")], prog=PROG)
        _check_error(name, rc, capsys.readouterr().err, message, out_dir)


def test_cli_output_onto_the_tokenizer_is_refused_and_leaves_it_whole(tmp_path, hf_dir, capsys, monkeypatch):
    """--output (or its sidecar) naming the tokenizer's file or a companion file it reads, directly, by a
    relative path, a symbolic or a hard link: one error line, exit 1, every file as it was."""
    monkeypatch.delenv("MEGAMOE_TRACEBACK", raising=False)
    (tmp_path / "docs.jsonl").write_text('{"text": "the quick brown fox"}\n')
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).write_bytes((hf_dir / name).read_bytes())
    (tmp_path / "bare").mkdir()                         # an HF tokenizer file not named tokenizer.json
    for name, copy in (("tokenizer.json", "t.json"), ("tokenizer_config.json", "tokenizer_config.json")):
        (tmp_path / "bare" / copy).write_bytes((hf_dir / name).read_bytes())
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "symbolic.bin").symlink_to(tok / "tokenizer.json")
    os.link(tok / "tokenizer.json", tmp_path / "links" / "hard.bin")
    monkeypatch.chdir(tok)
    cases = {
        "the file": (tok, tok / "tokenizer.json", "tokenizer.json"),
        "relative": (tok, Path("tokenizer.json"), "tokenizer.json"),
        "through ..": (tok, Path("../tok/tokenizer.json"), "tokenizer.json"),
        "symbolic link": (tok, tmp_path / "links" / "symbolic.bin", "tokenizer.json"),
        "hard link": (tok, tmp_path / "links" / "hard.bin", "tokenizer.json"),
        "companion": (tok, Path("tokenizer_config.json"), "tokenizer_config.json"),
        "sidecar": (tmp_path / "bare" / "t.json", tmp_path / "bare" / "t", "t.json"),
    }
    before = {path: path.read_bytes() for path in [*tok.iterdir(), *(tmp_path / "bare").iterdir()]}
    listing = sorted(tmp_path.rglob("*"))
    for name, (tokenizer, output, hit) in cases.items():
        rc = run_script(main, ["--input", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tokenizer),
                               "--output", str(output), "--workers", "1"], prog=PROG)
        lines = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(lines) == 1, (name, lines)
        assert lines[0].startswith(f"{PROG}: error: output ") and "is the tokenizer's file" in lines[0], (name, lines)
        assert hit in lines[0], (name, lines[0])
        assert {path: path.read_bytes() for path in before} == before, name
        assert sorted(tmp_path.rglob("*")) == listing, name


@pytest.mark.parametrize("which", ["output", "sidecar"])
@pytest.mark.parametrize("target", ["fifo", "/dev/null", "/dev/full"])
def test_cli_output_that_is_not_a_regular_file_is_refused_untouched(which, target, tmp_path, hf_dir, capsys,
                                                                    monkeypatch):
    """--output (or its sidecar OUT.json) naming a FIFO or a character device (/dev/null, /dev/full, through a
    link in the test's folder) would be replaced by a regular file: one error line before any document is
    read, and the target left as it was."""
    monkeypatch.delenv("MEGAMOE_TRACEBACK", raising=False)
    make, kind = NOT_REGULAR[target]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    made = make(out_dir)
    output = made if which == "output" else out_dir / "tokens.bin"
    if which == "sidecar":
        made.rename(sidecar_path(output))
        made = sidecar_path(output)
    (tmp_path / "docs.txt").write_text("some text\n")
    before = os.lstat(made)
    rc = run_script(main, ["--input", str(tmp_path / "docs.txt"), "--tokenizer", str(hf_dir), "--workers", "1",
                           "--output", str(output)], prog=PROG)
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert rc == 1 and "Traceback" not in stderr and len(errors) == 1, stderr
    assert f"megamoe-preprocess: error: {made} is {kind}" in errors[0] and "regular file or a new path" in errors[0]
    after = os.lstat(made)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode) and os.listdir(out_dir) == [made.name]


def test_cli_parquet_without_pyarrow_says_how_to_install(tmp_path, hf_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.delenv("MEGAMOE_TRACEBACK", raising=False)
    (tmp_path / "docs.parquet").write_bytes(b"never read")
    (tmp_path / "out").mkdir()
    args = ["--input", tmp_path / "docs.parquet", "--tokenizer", hf_dir, "--output", tmp_path / "out" / "t.bin"]
    rc = run_script(main, list(map(str, args)), prog=PROG)
    _check_error("no_pyarrow", rc, capsys.readouterr().err, "pip install megamoe[data]", tmp_path / "out")


def test_cli_help_names_the_formats_and_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    help_text = capsys.readouterr().out
    assert exit_info.value.code == 0
    for text in (".jsonl, .json", ".parquet", "pip install megamoe[data]", "--text-field", "--workers",
                 "--no-append-eos", "byte-identical"):
        assert text in help_text, text


def _cli(*args, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("MEGAMOE_TRACEBACK", None)
    return subprocess.Popen([sys.executable, "-m", "megamoe.cli.preprocess", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_cli_subprocess_hf_directory_end_to_end_and_a_worker_error(tmp_path, hf_dir):
    inputs = _write_inputs(tmp_path / "in", DOCS)
    (tmp_path / "good").mkdir()
    good = _cli("--input", inputs["jsonl"], inputs["text"], "--tokenizer", hf_dir, "--text-field", "content",
                "--output", tmp_path / "good" / "tokens.bin", "--workers", 3, cwd=tmp_path)
    args, message = _bad_input_cases(tmp_path, hf_dir)["worker_error"]
    (tmp_path / "bad").mkdir()
    bad = _cli(*args, "--output", tmp_path / "bad" / "tokens.bin", cwd=tmp_path)
    _, good_stderr = good.communicate(timeout=300)
    _, bad_stderr = bad.communicate(timeout=300)

    assert good.returncode == 0, good_stderr
    one_worker = tmp_path / "one.bin"
    preprocess([inputs["jsonl"], inputs["text"]], Tokenizer.from_path(hf_dir), one_worker, text_field="content",
               workers=1)
    three = tmp_path / "good" / "tokens.bin"
    assert (three.read_bytes(), sidecar_path(three).read_bytes()) == (
        one_worker.read_bytes(), sidecar_path(one_worker).read_bytes())
    assert _ids(three) == _expected_ids(Tokenizer.from_path(hf_dir), DOCS * 2)
    _check_error("worker_error", bad.returncode, bad_stderr, message, tmp_path / "bad")


# ---------------------------------------------------------------- documents named by a training run's --data


def test_tokenized_path_tokenizes_documents_once_and_passes_token_sources_through(tmp_path, hf_dir):
    from megamoe.data.training_data import tokenized_path

    tokenizer = Tokenizer.from_path(hf_dir)
    inputs = _write_inputs(tmp_path / "in", DOCS)
    cache = tmp_path / "cache"
    first = tokenized_path(inputs["jsonl"], tokenizer, cache, text_field="content", workers=1)
    assert first.parent == cache and _ids(first) == _expected_ids(tokenizer, DOCS)
    built = first.stat().st_mtime_ns
    assert tokenized_path(inputs["jsonl"], tokenizer, cache, text_field="content", workers=1) == first
    assert first.stat().st_mtime_ns == built                        # reused, not tokenized again
    assert tokenized_path(first, tokenizer, cache) == first          # a token file is used as it is
    # Another text field, or a changed file, is another token file.
    assert tokenized_path(inputs["text"], tokenizer, cache, workers=1) != first
    inputs["jsonl"].write_text(json.dumps({"content": "changed"}) + "\n", encoding="utf-8")
    changed = tokenized_path(inputs["jsonl"], tokenizer, cache, text_field="content", workers=1)
    assert changed != first and _ids(changed) == _expected_ids(tokenizer, ["changed"])
