"""The torchrun entry points: the pretraining demo learns and resumes, a rerun in the same directories
loses nothing and reuses the tokenizer and token file, user errors end in one line before any
expensive work, and a failing rank ends a job promptly with its own error."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megamoe.cli.launch import run_script
from megamoe.training.checkpoint import checkpoint_run_id, list_checkpoints
from tests.helpers.demo import REPO, TINY, _assert_only_complete_checkpoint_of_step_1, _fault_line, _records


def _run(demo, argv, capsys):
    """(exit code, stdout, stderr) of the script's entry point, as ``sys.exit(run_script(main))`` runs it."""
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_error_line(code, err, *fragments):
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _cut_manifest_dir(tmp_path):
    step = tmp_path / "cut" / "step_00000003"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text('{"format": "megamoe-checkpoint", "format_vers')
    return step.parent


USER_ERRORS = {   # name: (extra arguments, WORLD_SIZE, fragments of the error line)
    "missing --load-dir checkpoint": (["--load-dir", "{tmp}/nothing"], None, ["--load-dir", "no complete checkpoint"]),
    "cut manifest": (["--load-dir", "{cut}"], None, ["cannot read", "step_00000003/manifest.json"]),
    "layout vs one rank": (["--tp", "2"], None, ["--tp 2", "does not fit 1 rank(s)"]),
    "layout vs 6 ranks": (["--pp", "4"], "6", ["--pp 4", "does not fit 6 rank(s)", "--nproc-per-node"]),
    "allgather layout": (["--tp", "2", "--ep", "4", "--dispatcher", "allgather"], "8",
                         ["--dispatcher allgather", "ep * etp must divide tp, got ep=4 etp=1 tp=2"]),
    "--log-json folder": (["--log-json", "{tmp}/no/such/log.jsonl"], None, ["--log-json", "does not exist"]),
    "foreign --save-dir": (["--load-dir", "{cut}", "--save-dir", "{cut}/../other"], None,
                           ["--save-dir", "--overwrite"]),
    "bad flag value": (["--global-batch", "0"], None, ["--global-batch must be >= 1"]),
    "negative --seed": (["--seed", "-1"], None, ["--seed must be >= 0, got -1"]),
    "--mtp-loss-coeff without MTP layers": (["--mtp-loss-coeff", "0.3"], None, ["--mtp-loss-coeff 0.3", "has none"]),
    "negative --mtp-loss-coeff": (["--mtp-layers", "1", "--mtp-loss-coeff", "-1"], None,
                                  ["--mtp-loss-coeff must be a finite number >= 0"]),
    # Model-shape flags next to what decides the shape were ignored without a word (the default value too).
    "shape flags with --hf-model": (["--hf-model", "{tmp}/hf", "--experts", "8"], None,
                                    ["--hidden, --layers, --experts, --vocab-size cannot be combined with --hf-model",
                                     "drop them"]),
    "--mtp-layers with --model-config": (["--model-config", "{tmp}/two_fields.json", "--mtp-layers", "1"], None,
                                         ["--mtp-layers cannot be combined with --model-config", "MTP layers"]),
    "--vocab-size with --tokenizer": (["--tokenizer", "{tmp}/tok"], None,
                                      ["--vocab-size cannot be combined with --tokenizer", "drop it"]),
    # Checked before rank 0 tokenizes the corpus (the heads were checked when the model was built).
    "--tp 3 on a 4-head model": (["--tp", "3"], "3", ["--tp 3 splits the attention heads",
                                                      "has 4 heads, not divisible by 3"]),
    "empty --sample-prompt": (["--sample-prompt", ""], None, ["--sample-prompt is empty", "--sample-tokens 0"]),
    # A directory of .py files: no --text-suffixes flag here; say what works.
    "directory of .py files": (["--data", "{tmp}/pyfiles"], None,
                               ["--data input directory", "holds no file ending in", "name its files instead",
                                "pyfiles/*.py", "megamoe-preprocess --text-suffixes .py"]),
    "warmup longer than the run": (["--warmup-steps", "500", "--lr-schedule", "cosine", "--steps", "100"], None,
                                   ["--warmup-steps 500 is too long for the run (--steps 100)"]),
    # Two fields: transformers filled in Qwen3-MoE's full size (24 layers, 128 experts, a 151,936 vocabulary).
    "incomplete --model-config": (["--model-config", "{tmp}/two_fields.json"], None,
                                  ["two_fields.json does not give the model's size: vocab_size, num_hidden_layers, "
                                   "num_attention_heads, num_experts_per_tok, num_experts or num_local_experts or "
                                   "n_routed_experts missing"]),
}


@pytest.mark.parametrize("case", USER_ERRORS)
def test_user_errors_end_in_one_line_before_any_work(demo, case, tmp_path, capsys, monkeypatch):
    extra, world, fragments = USER_ERRORS[case]
    cut = _cut_manifest_dir(tmp_path)
    (tmp_path / "two_fields.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 64}')
    (tmp_path / "pyfiles").mkdir()
    (tmp_path / "pyfiles" / "a.py").write_text("x = 1\n")
    if case == "foreign --save-dir":        # --save-dir holds a run's checkpoints, --load-dir names another
        (tmp_path / "other" / "step_00000001").mkdir(parents=True)
        (tmp_path / "other" / "step_00000001" / "manifest.json").write_text("{}")
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    work = tmp_path / "work"
    argv = ["--work-dir", work, "--save-dir", tmp_path / "ckpt", *TINY]
    if "--model-config" in extra:           # TINY's shape flags would be refused first
        argv = [a for a in argv if a not in ("--hidden", "32", "--layers", "2")]
    argv += [a.format(tmp=tmp_path, cut=cut) for a in extra]
    code, out, err = _run(demo, argv, capsys)
    _assert_one_error_line(code, err, *fragments)
    assert "Traceback" not in err and not out
    assert not work.exists(), "the error must come before the tokenizer is trained"


def test_a_second_stdlib_token_file_reuses_the_tokenizer_and_the_token_file(demo, tmp_path, monkeypatch):
    args = demo.parse_args(["--work-dir", str(tmp_path), *TINY])
    tokenizer, token_file = demo.stdlib_token_file(args, 0, None, None)
    files = sorted(tmp_path.iterdir())
    stamps = {p.name: p.stat().st_mtime_ns for p in files}
    assert {p.name for p in files} == {"tokenizer_512_200000.model", "tokens_512_200000.bin",
                                       "tokens_512_200000.bin.json"}

    def must_not_run(*args, **kwargs):
        raise AssertionError("the second run must reuse what the first one built")

    for name in ("train_sentencepiece", "build_token_file", "stdlib_corpus_files"):
        monkeypatch.setattr(demo, name, must_not_run)
    again, again_file = demo.stdlib_token_file(args, 0, None, None)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps
    assert again.sha256 == tokenizer.sha256 and again_file == token_file

    # A token file of another tokenizer (or a damaged one) is rebuilt, not reused.
    monkeypatch.undo()
    sidecar = tmp_path / "tokens_512_200000.bin.json"
    sidecar.write_text(sidecar.read_text().replace(tokenizer.sha256, "0" * 64))
    demo.stdlib_token_file(args, 0, None, None)
    assert tokenizer.sha256 in sidecar.read_text()


@pytest.mark.slow
def test_a_rerun_resumes_and_loses_nothing_and_overwrite_moves_aside(demo, tmp_path, capsys, caplog):
    """``make demo`` twice: the second run resumes the first one's newest checkpoint (at --steps: it
    trains nothing), deletes nothing, says where it starts in the log. Then --overwrite with a diverging
    learning rate: the old checkpoints are moved aside, the run stops at its first non-finite step in one line."""
    caplog.set_level(logging.INFO, logger="megamoe.training")
    work, ckpt = tmp_path / "work", tmp_path / "work" / "ckpt"
    argv = ["--work-dir", work, "--save-dir", ckpt, *TINY, "--steps", "2", "--save-every", "1"]
    code, out, _ = _run(demo, argv, capsys)
    assert code == 0 and "--- greedy sample ---" in out and "--- sample 3 (temperature 0.8" in out
    first = list_checkpoints(ckpt)
    assert [step for step, _ in first] == [1, 2]
    manifests = {p: (Path(p) / "manifest.json").read_bytes() for _, p in first}
    run_id = checkpoint_run_id(first[0][1])
    assert run_id and checkpoint_run_id(first[1][1]) == run_id

    caplog.clear()
    code, again, _ = _run(demo, argv, capsys)
    assert code == 0 and again == out, "same checkpoint, same seed: the same samples"
    assert {p: (Path(p) / "manifest.json").read_bytes() for _, p in list_checkpoints(ckpt)} == manifests
    messages = [r.getMessage() for r in caplog.records]
    assert f"resuming from {first[1][1]} at step 2 (run {run_id})" in messages
    assert any(m.startswith("nothing to train: the run is at step 2") for m in messages)
    assert any(re.fullmatch(r"model: [\d,]+ parameters, [\d,]+ active per token; estimated memory per rank "
                            r"[\d.]+ [KMG]iB \(.*\)", m) for m in messages), messages
    assert any(m.startswith("reusing tokenizer") for m in messages) and any(
        m.startswith("reusing token file") for m in messages)
    records = _records(work / "log.jsonl")
    assert [("run_start" in r, r.get("step")) for r in records] == [(True, None), (False, 1), (False, 2),
                                                                   (True, None)]
    assert records[0]["resumed_from"] is None and records[3]["resumed_from_step"] == 2
    assert records[3]["run_id"] == records[0]["run_id"] == run_id and records[3]["args"]["steps"] == 2

    # A diverging run: its non-finite steps are skipped (the weights stay finite) until
    # --max-skipped-steps in a row stop it, in one line; the checkpoints saved before remain.
    code, _, err = _run(demo, [*argv[:-4], "--steps", "6", "--save-every", "1", "--lr", "1e4", "--max-skipped-steps",
                               "1", "--overwrite"], capsys)
    _assert_one_error_line(code, err, "training stopped at step", "1 consecutive steps were non-finite")
    replaced, = ckpt.glob("replaced_*")
    assert {p: (replaced / Path(p).name / "manifest.json").read_bytes() for p in manifests} == {
        p: data for p, data in manifests.items()}, "--overwrite moves the old checkpoints aside intact"
    new = list_checkpoints(ckpt)
    assert new and all(checkpoint_run_id(p) not in (None, run_id) for _, p in new)
    refused_step = int(err.split("training stopped at step ")[1].split(":")[0])
    assert [step for step, _ in new] == list(range(max(1, refused_step - 2), refused_step))


def test_demo_help_explains_the_flags():
    out = subprocess.run([sys.executable, str(REPO / "examples/pretrain_moe.py"), "--help"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0
    for flag in ("--tp", "--pp", "--ep", "--etp", "--dispatcher", "--expert-backend", "--num-expert-slots",
                 "--steps", "--micro-batch", "--seed", "--save-dir", "--load-dir", "--log-json", "--overwrite",
                 "--comm-timeout"):
        assert flag in out.stdout
    text = " ".join(out.stdout.split())                           # argparse wraps lines anywhere
    assert "until this optimizer step (default: 120)" in text
    assert "(default: checkpoints/ in --work-dir)" in text.replace("- ", "-")    # not runs/pretrain_moe's


def test_save_dir_made_read_only_mid_run_is_one_line(tmp_path, capsys):
    # As under torchrun (a CheckpointError: the enospc case above), in one process: the save dir has become
    # read-only before step 2's save (root ignores chmod: the fault is injected). Before: "OSError: [Errno 30]
    # Read-only file system: '...'", no fix.
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from tests.helpers import torchrun_faults
    finally:
        sys.path.remove(str(REPO / "tests"))
    assert run_script(torchrun_faults.main, ["erofs", str(tmp_path / "ckpt")], prog="torchrun_faults.py") == 1
    err = capsys.readouterr().err
    assert _fault_line("erofs", tmp_path / "ckpt").fullmatch(err.strip()), err
    _assert_only_complete_checkpoint_of_step_1(tmp_path / "ckpt")


# Each of these exhausted memory (an allocator traceback, or the OOM killer for the last two); the estimate
# refuses them before anything is allocated, with the machine's memory (here a 16 GiB machine).
HUGE = {"--hidden 1e6": ["--hidden", "1000000"], "--experts 1e6": ["--experts", "1000000"],
        "--layers 1e5": ["--layers", "100000"], "--mtp-layers 1e6": ["--mtp-layers", "1000000"],
        "--sample-tokens 1e9": ["--sample-tokens", "1000000000"],
        "--micro-batch 1e6": ["--micro-batch", "1000000", "--global-batch", "1000000"],
        "--hidden 65536": ["--hidden", "65536"]}


@pytest.mark.parametrize("case", HUGE)
def test_sizes_beyond_the_machines_memory_are_refused_before_any_work(demo, case, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "available_memory_bytes", lambda device: (16 * 2**30, "available host memory"))
    work = tmp_path / "work"
    argv = ["--work-dir", work, "--save-dir", tmp_path / "ckpt", "--corpus-bytes", "200000", "--vocab-size", "512"]
    code, out, err = _run(demo, [*argv, *HUGE[case]], capsys)
    _assert_one_error_line(code, err, "the run needs at least", "per rank", "parameters) but the available host "
                           "memory is 16 GiB: choose smaller sizes")
    assert not work.exists() and not out


def test_the_start_logs_parameter_counts_and_memory_per_rank(demo, monkeypatch):
    """The footprint the start logs: the parameters the model really has, and the estimate per rank."""
    from megamoe.models import GPTMoEModel
    from parallel_state import ParallelState
    args = demo.parse_args(["--hidden", "32", "--layers", "3", "--experts", "4", "--mtp-layers", "1"])
    footprint = demo.check_arguments(args, 1).footprint
    model = GPTMoEModel(demo.model_config(args, args.vocab_size), ParallelState.single_process())
    assert footprint.total_params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert footprint.active_params == footprint.total_params - experts + experts * args.top_k // args.experts
    assert 0 < footprint.bytes_per_rank < 2**30
    monkeypatch.setattr(demo, "available_memory_bytes", lambda device: (footprint.bytes_per_rank - 1, "test"))
    with pytest.raises(demo.UsageError, match="the run needs at least"):
        demo.check_arguments(args, 1)


def _fake_python(path: Path, has_torch: bool, interpreter: str = sys.executable) -> Path:
    """An interpreter stand-in for the Makefile: logs its arguments, has torch or not, pretends pip works,
    and runs anything else with ``interpreter`` (whose sys.prefix names the stamp)."""
    path.write_text(f"""#!/bin/sh
echo "$*" >> "{path}.log"
if [ "$2" = "import torch" ]; then exit {0 if has_torch else 1}; fi
if [ "$1" = "-m" ]; then exit 0; fi
exec {interpreter} "$@"
""")
    path.chmod(0o755)
    return path


def test_make_install_keeps_an_installed_torch_and_stamps_each_interpreter(tmp_path):
    """A second virtualenv gets its own install (the stamp belonged to the checkout: `make demo` then failed
    with "No module named 'torch'"), and the torch pin is only installed where there is no torch (it would
    replace a GPU user's CUDA build)."""
    for name in ("Makefile", "setup.py", "pyproject.toml"):
        (tmp_path / name).write_bytes((REPO / name).read_bytes())

    def install(python: Path) -> list[str]:
        subprocess.run(["make", "-s", "-C", str(tmp_path), "install", f"PYTHON={python}"], check=True, timeout=60,
                       capture_output=True)
        log = Path(f"{python}.log")
        return log.read_text().splitlines() if log.exists() else []

    with_torch = install(_fake_python(tmp_path / "gpu_python", has_torch=True))
    assert "-c import torch" in with_torch and not any("torch==" in line for line in with_torch)
    assert "-m pip install -q -e .[test]" in with_torch
    other = tmp_path / "venv"       # another interpreter (sys.prefix): not covered by the first one's stamp
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True, timeout=120)
    without_torch = install(_fake_python(tmp_path / "venv_python", has_torch=False,
                                         interpreter=str(other / "bin" / "python")))
    assert "-m pip install -q torch==2.13.0" in without_torch and "-m pip install -q -e .[test]" in without_torch
    assert len(list(tmp_path.glob(".deps-installed-*"))) == 2
    assert not install(_fake_python(tmp_path / "gpu_python2", has_torch=True))[1:], "stamped: nothing to do"


def test_each_sample_is_labelled_with_what_seeds_it(demo, capsys):
    """The three temperature samples all said "seed 1234": one seed, but each request has its own stream,
    seeded by (seed, request number), and the label says which."""
    from megamoe.models import GPTMoEModel
    from parallel_state import ParallelState
    from tests.helpers.tiny_model import tiny_config

    class Tokens:
        def encode(self, text):
            return [1, 2, 3]

        def decode(self, ids):
            return " ".join(map(str, ids))

    state = ParallelState.single_process()
    model = GPTMoEModel(tiny_config(num_layers=2), state)
    demo.print_samples(model, state, Tokens(), demo.parse_args(["--sample-tokens", "3"]), rank=0)
    labels = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--- sample")]
    assert labels == [f"--- sample {i + 1} (temperature 0.8, top-k 40, seed 1234 request {i}) ---" for i in range(3)]
