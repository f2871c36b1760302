"""examples/pretrain_moe.py on the user's data: documents, token files and Megatron datasets blended by
weight, held-out eval, packing; and every bad-data case ends in one ``error:`` line naming the file
(and line) before any training, with nothing half-written."""

import json
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megamoe.data.tokenizer import Tokenizer
from megamoe.cli.launch import run_script
from tests.helpers.hf_start import save_tokenizer, sentences
from tests.helpers.pretrain_data import TINY

GENERATE = str(Path(__file__).resolve().parents[2] / "examples" / "generate.py")


def _run(demo, argv, capsys):
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    return code, out, err


def _base(tmp_path, inputs):
    root, _ = inputs
    return ["--tokenizer", root / "tok", "--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt", *TINY]


def test_every_format_blended_with_eval_and_packing(demo, inputs, tmp_path, capsys, caplog):
    root, tokenizer = inputs
    caplog.set_level("INFO")
    argv = [*_base(tmp_path, inputs), "--data", root / "a.jsonl", root / "texts", root / "c.bin", root / "meg",
            "--data-weights", 4, 1, 1, 2, "--text-field", "body", "--eval-fraction", 0.1, "--eval-every", 2,
            "--steps", 3, "--reset-position-ids", "--reset-attention-mask", "--lr-schedule", "linear",
            "--warmup-steps", 1]
    code, _, err = _run(demo, argv, capsys)
    assert code == 0, err
    blend = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("blend of"))
    counts = [int(part.rsplit(": ", 1)[1]) for part in blend.split(": ", 1)[1].split(", ")]
    assert sum(counts) > 0 and counts[0] > counts[3] > counts[1]             # weights 4 : 1 : 1 : 2
    assert "packed documents: PackingConfig(" in caplog.text
    # The documents were tokenized into the cache with the tokenizer: the same ids as build_token_file's.
    cached_jsonl, = (tmp_path / "work" / "data_cache").glob("a_*.bin")
    expected = [i for t in sentences(120, seed=1) for i in tokenizer.encode(t) + [tokenizer.eos_id]]
    assert np.fromfile(cached_jsonl, dtype="<u2").tolist() == expected
    records = [json.loads(line) for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 3]
    assert [r["lr"] for r in records if "loss" in r] == pytest.approx([5e-3, 2.5e-3, 0.0])


def _bad_cases(root: Path, tmp_path: Path) -> dict[str, tuple[list, tuple[str, ...]]]:
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "the cat ."}\n{"text": "the dog"\n')
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "the cat ."}\n{"body": "the dog ."}\n')
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "the cat ."}\n{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    bad_idx = tmp_path / "badidx"
    for suffix in (".bin", ".idx"):
        Path(f"{bad_idx}{suffix}").write_bytes(Path(f"{root / 'meg'}{suffix}").read_bytes())
    Path(f"{bad_idx}.bin").write_bytes(Path(f"{bad_idx}.bin").read_bytes()[:-4])   # one token short
    big = tmp_path / "bigtok"
    save_tokenizer(big, extra_words=[f"w{i}" for i in range(200)])
    # Ids at the tokenizer's vocabulary size, far past the samples one step draws: the model's vocabulary,
    # padded to a multiple of 64, would hold them.
    vocab = Tokenizer.from_path(root / "tok").vocab_size
    past_vocab = {}
    for name, dtype in (("c.bin", "<u2"), ("meg", "<i4")):
        copy = tmp_path / f"past_{name}"
        for suffix in ((".json", "") if name == "c.bin" else (".idx", ".bin")):
            Path(f"{copy}{suffix}").write_bytes(Path(f"{root / name}{suffix}").read_bytes())
        data_file = copy if name == "c.bin" else Path(f"{copy}.bin")
        ids = np.fromfile(data_file, dtype=dtype)
        ids[-3] = vocab
        ids.tofile(data_file)
        past_vocab[name] = (copy, len(ids) - 3)
    return {
        "not JSON": (["--data", bad_jsonl], (f"{bad_jsonl}:2",)),
        "no text field": (["--data", no_field], (f"{no_field}:2", "'text'")),
        "nested 100k deep": (["--data", deep], (f"{deep}:2: JSON nested too deeply",)),
        "empty dataset": (["--data", empty], (f"{empty}",)),
        "idx vs bin": (["--data", bad_idx], (f"{bad_idx}", ".bin")),
        "weights": (["--data", root / "c.bin", root / "meg", "--data-weights", 1], ("--data-weights", "1 weight",
                                                                                   "2 --data path")),
        "missing": (["--data", tmp_path / "nowhere.jsonl"], ("nowhere.jsonl", "does not exist")),
        "eval flags": (["--data", root / "c.bin", "--eval-data", root / "meg", "--eval-fraction", 0.1],
                       ("--eval-fraction and --eval-data",)),
        "other tokenizer's token file": (["--data", root / "c.bin", "--tokenizer", big], ("was tokenized with",)),
        **{f"ids past the vocabulary: {name}": (
            ["--data", copy, "--make-vocab-size-divisible-by", 64],
            (f"{copy}: token {position} is id {vocab}, outside the vocabulary [0, {vocab}) of the tokenizer",))
           for name, (copy, position) in past_vocab.items()},
    }


@pytest.mark.parametrize("case", ["not JSON", "no text field", "nested 100k deep", "empty dataset", "idx vs bin",
                                  "weights", "missing", "eval flags", "other tokenizer's token file", "ids past the vocabulary: c.bin",
                                  "ids past the vocabulary: meg"])
def test_bad_data_ends_in_one_error_line_and_leaves_no_token_file(demo, inputs, tmp_path, case, capsys):
    root, _ = inputs
    flags, fragments = _bad_cases(root, tmp_path)[case]
    code, _, err = _run(demo, [*_base(tmp_path, inputs), "--steps", 1, *flags], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    cache = tmp_path / "work" / "data_cache"
    assert not cache.exists() or not any(cache.iterdir()), "no partial token file"
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir()), "nothing trained"


def test_a_megatron_dataset_gives_the_samples_of_the_same_documents_as_jsonl(inputs, tmp_path):
    """Megatron's .bin/.idx (written from the format specification) and the same documents as JSON Lines,
    tokenized by megamoe-preprocess, are the same training samples."""
    from megamoe.data.preprocess import preprocess
    from megamoe.data.token_dataset import TokenDataset

    root, tokenizer = inputs
    jsonl = tmp_path / "same.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in sentences(80, seed=4)))
    preprocess([jsonl], tokenizer, tmp_path / "same.bin", workers=1)
    megatron, from_jsonl = TokenDataset(root / "meg", 16, vocab_size=tokenizer.vocab_size), TokenDataset(
        tmp_path / "same.bin", 16)
    assert len(megatron) == len(from_jsonl) > 10
    for got, expected in zip(megatron.batch(range(len(megatron))), from_jsonl.batch(range(len(from_jsonl)))):
        assert torch.equal(got, expected)


def test_a_resumed_run_holds_out_the_same_documents(demo, inputs, tmp_path, capsys):
    """--eval-fraction picks its documents by --seed alone: a run stopped after step 1 and resumed logs the
    training and eval losses of the run that went straight to step 2 (the same held-out documents, the
    same training samples)."""
    root, _ = inputs

    def run(name: str, steps: int) -> list[dict]:
        argv = ["--tokenizer", root / "tok", "--work-dir", tmp_path / name, "--save-dir", tmp_path / f"{name}_ckpt",
                *TINY, "--data", root / "c.bin", "--eval-fraction", 0.2, "--eval-every", 1, "--eval-iters", 1,
                "--save-every", 1, "--steps", steps]
        code, _, err = _run(demo, argv, capsys)
        assert code == 0, err
        return [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]

    def losses(records: list[dict], key: str) -> dict[int, float]:
        return {r["step"]: r[key] for r in records if key in r}

    straight = run("straight", 2)
    first = run("stopped", 1)
    resumed = run("stopped", 2)
    for key in ("loss", "eval_loss"):
        steps = {**losses(first, key), **losses(resumed, key)}
        assert sorted(steps) == sorted(losses(straight, key)) == [1, 2], key
        assert steps == pytest.approx(losses(straight, key), rel=1e-6), key


def test_token_files_bring_their_tokenizer_and_every_checkpoint_generates(demo, inputs, tmp_path, capsys,
                                                                          monkeypatch):
    """--data tokens.bin without --tokenizer: the tokenizer its sidecar records (samples need one). The
    checkpoints go under --work-dir and carry the tokenizer, so generate.py CKPT --prompt runs on each."""
    root, tokenizer = inputs
    argv = ["--work-dir", tmp_path / "work", *TINY, "--data", root / "c.bin", "--steps", 2, "--save-every", 1,
            "--sample-tokens", 2]
    code, out, err = _run(demo, argv, capsys)
    assert code == 0, err
    assert "--- greedy sample ---" in out
    checkpoints = sorted((tmp_path / "work" / "checkpoints").glob("step_*"))
    assert [p.name for p in checkpoints] == ["step_00000001", "step_00000002"]
    for checkpoint in checkpoints:
        tokenizer_file = checkpoint / "hf_files" / "tokenizer.json"
        assert tokenizer_file.read_bytes() == (root / "tok" / "tokenizer.json").read_bytes()
        monkeypatch.setattr(sys, "argv", [GENERATE, str(checkpoint), "--prompt", "the cat", "--max-new-tokens", "3"])
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(GENERATE, run_name="__main__")
        out, err = capsys.readouterr()
        assert exited.value.code == 0, err
        assert re.search(r"--- request 0 \(length, 3 tokens\) ---\nthe cat", out), out
