"""The torchrun entry points: the pretraining demo learns and resumes, a rerun in the same directories
loses nothing and reuses the tokenizer and token file, user errors end in one line before any
expensive work, and a failing rank ends a job promptly with its own error."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megamoe.cli.launch import run_script
from megamoe.training.checkpoint import checkpoint_run_id, list_checkpoints, verify_resume_checkpoint

REPO = Path(__file__).resolve().parent.parent
TINY = ["--corpus-bytes", "200000", "--vocab-size", "512", "--hidden", "32", "--layers", "2", "--sample-tokens", "4"]


def _torchrun(args, nproc, timeout, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_pretrain_demo_learns_saves_and_resumes(tmp_path):
    common = [str(REPO / "examples/pretrain_moe.py"), "--pp", "2", "--ep", "2", "--dispatcher", "alltoall",
              "--work-dir", str(tmp_path), "--save-dir", str(tmp_path / "ckpt"), "--corpus-bytes", "400000",
              "--vocab-size", "512", "--hidden", "64", "--layers", "2", "--sample-tokens", "4", "--save-every", "10"]
    first = _torchrun([*common, "--steps", "30"], 4, 600, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    records = _step_records(tmp_path / "log.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    assert sum(r["loss"] for r in records[-5:]) / 5 < records[0]["loss"] - 1.0, "the loss must clearly fall"
    assert all(0 < r["balancedness"] <= 1 and r["tokens_per_s"] > 0 for r in records)
    assert "--- greedy sample ---" in first.stdout and "--- sample 3 (temperature" in first.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "step_00000020", "step_00000030"]

    # Resume under another layout (tp=2 x ep=2 all-gather) and keep going.
    resumed = _torchrun([*common[:1], "--tp", "2", "--ep", "2", "--dispatcher", "allgather", *common[7:],
                         "--steps", "32", "--load-dir", str(tmp_path / "ckpt")], 4, 600, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = _step_records(tmp_path / "log.jsonl")
    assert [r["step"] for r in records[30:]] == [31, 32]
    starts = [r for r in _records(tmp_path / "log.jsonl") if "run_start" in r]
    assert [r["resumed_from_step"] for r in starts] == [None, 30]
    assert "resuming from" in resumed.stderr and "step 30" in resumed.stderr


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _step_records(path):
    return [r for r in _records(path) if "step" in r]


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


def _assert_ends_with_our_line(stderr: str, line: str) -> None:
    """Our error line is printed by rank 0 only, and again once torchrun has printed its ChildFailedError
    report: the last line on the screen."""
    errors = [text for text in stderr.splitlines() if ": error:" in text]
    assert errors == [line, line], stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == line, stderr[-3000:]


@pytest.mark.slow
def test_torchrun_layout_error_is_one_line_from_rank_0(tmp_path):
    result = _torchrun([str(REPO / "examples/pretrain_moe.py"), "--tp", "3", "--work-dir", str(tmp_path / "w"),
                        *TINY], 2, 300, tmp_path)
    assert result.returncode != 0
    _assert_ends_with_our_line(
        result.stderr, "pretrain_moe.py: error: the layout --tp 3 --pp 1 --ep 1 (etp 3) does not fit 2 rank(s): "
                       "world_size 2 is not divisible by tp*cp*pp = 3*1*1 = 3; change the flags or the number of "
                       "ranks (torchrun --nproc-per-node)")
    assert "examples/pretrain_moe.py\", line" not in result.stderr, "no traceback of the script's code"
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_torchrun_bad_flag_and_help_are_printed_by_one_rank(tmp_path):
    # A bad flag (--comm-timeout inf: an OverflowError under torchrun before): argparse's usage and error once,
    # the error last.
    bad = _torchrun([str(REPO / "examples/pretrain_moe.py"), "--comm-timeout", "inf"], 2, 300, tmp_path)
    assert bad.returncode != 0 and bad.stderr.count("usage: pretrain_moe.py") == 1, bad.stderr[-3000:]
    _assert_ends_with_our_line(bad.stderr, "pretrain_moe.py: error: argument --comm-timeout: must be a number of "
                                           "seconds > 0 and at most 3.1536e+07 (a year), got inf")
    assert "OverflowError" not in bad.stderr
    helped = _torchrun([str(REPO / "examples/pretrain_moe.py"), "--help"], 2, 300, tmp_path)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert helped.stdout.count("usage: pretrain_moe.py") == 1 and helped.stdout.count("show this help message") == 1


@pytest.mark.slow
def test_failing_rank_ends_the_job_promptly(tmp_path):
    # Promptness without a clock: the collective timeout is the default 10 min, so a job that waited for one
    # would run into this 300 s limit (TimeoutExpired) instead of ending. Rank 0 fails alone (a full disk under
    # its metrics log): its error names the file and is the last line; rank 1, left in a collective, prints
    # no gloo traceback (at most a line saying that a peer left).
    result = _torchrun([str(REPO / "tests/torchrun_failing_rank.py")], 2, 300, tmp_path)
    assert result.returncode != 0
    line = "torchrun_failing_rank.py: error: cannot write the metrics log /dev/full: No space left on device"
    assert result.stderr.strip().splitlines()[-1] == line, result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1, "torchrun's own only: " + result.stderr
    assert "torchrun_failing_rank.py\", line" not in result.stderr, "no traceback of a worker"


def _assert_only_complete_checkpoint_of_step_1(save_dir: Path) -> None:
    """The fault at step 2 left the step-1 checkpoint, intact, and nothing half-written next to it."""
    assert sorted(os.listdir(save_dir)) == ["step_00000001"]
    verify_resume_checkpoint(save_dir / "step_00000001", world_group=None)


# The last line of a job whose rank FAULT (tests/torchrun_faults.py) hits at step 2 (after step 1's checkpoint).
FAULT_LINES = {
    "kill": "torchrun_faults.py: error: torchrun stopped the job: a rank's process ended without reporting an error "
            "(killed by a signal, e.g. by the out-of-memory killer, or crashed), or the job itself was signalled; "
            "torchrun's report above names the rank and its exit code; the newest intact checkpoint is "
            "{save_dir}/step_00000001",
    "enospc": "torchrun_faults.py: error: checkpoint save failed while writing files: rank 1: cannot write "
              "{save_dir}/step_00000002.tmp-*/rank00001-0000.safetensors: No space left on device (free space on "
              "that disk or save elsewhere); {save_dir}/step_00000002 was not written (what it held before, and "
              "every other checkpoint, is untouched)",
    "erofs": "torchrun_faults.py: error: checkpoint save failed while exchanging metadata: rank 0: cannot write "
             "{save_dir}/step_00000002.tmp-*: Read-only file system (make that directory writable or save "
             "elsewhere); {save_dir}/step_00000002 was not written (what it held before, and every other checkpoint, "
             "is untouched)"}


def _fault_line(fault: str, save_dir: Path) -> re.Pattern:
    return re.compile(".*".join(map(re.escape, FAULT_LINES[fault].format(save_dir=save_dir).split("*"))))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "enospc"])
def test_torchrun_fault_ends_with_one_line_and_intact_checkpoints(fault, tmp_path):
    # kill: the last rank is SIGKILLed (as by the OOM killer): no rank reports an error, torchrun stops the
    # others (SIGTERM); a line saying so, naming the newest checkpoint, follows torchrun's report (before: the
    # report was the end, or a rank's note that a peer left). enospc: the last rank's checkpoint file meets a
    # full disk; rank 0's line names the file and the fix (before: safetensors' text, naming neither).
    result = _torchrun([str(REPO / "tests/torchrun_faults.py"), fault, str(tmp_path / "ckpt")], 2, 300, tmp_path)
    assert result.returncode != 0
    assert _fault_line(fault, tmp_path / "ckpt").fullmatch(result.stderr.strip().splitlines()[-1]), \
        result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1, "torchrun's own only: " + result.stderr
    assert result.stderr.count("error: torchrun stopped the job") == (fault == "kill"), "one rank says it, once"
    _assert_only_complete_checkpoint_of_step_1(tmp_path / "ckpt")


def test_save_dir_made_read_only_mid_run_is_one_line(tmp_path, capsys):
    # As under torchrun (a CheckpointError: the enospc case above), in one process: the save dir has become
    # read-only before step 2's save (root ignores chmod: the fault is injected). Before: "OSError: [Errno 30]
    # Read-only file system: '...'", no fix.
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import torchrun_faults
    finally:
        sys.path.remove(str(REPO / "tests"))
    assert run_script(torchrun_faults.main, ["erofs", str(tmp_path / "ckpt")], prog="torchrun_faults.py") == 1
    err = capsys.readouterr().err
    assert _fault_line("erofs", tmp_path / "ckpt").fullmatch(err.strip()), err
    _assert_only_complete_checkpoint_of_step_1(tmp_path / "ckpt")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:    # a zombie (exited, not yet reaped by torchrun) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_stopped_rank_ends_the_job_with_one_error_naming_it(tmp_path):
    # Rank 1 SIGSTOPs itself mid-step: without a collective timeout the job would hang (the
    # subprocess limit below, far above --comm-timeout, only catches that). The ranks write their pids
    # into the job's directory, so that a hang can still be cleaned up: torchrun starts each worker in
    # a session of its own.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(REPO / "tests/torchrun_stuck_rank.py"), "--comm-timeout", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    lines: list[str] = []

    def end_the_stopped_rank_once_rank_0_reported():
        # torchrun gives a worker that ignores its SIGTERM 30 s before it kills it, and a stopped process
        # ignores everything but SIGKILL: once rank 0 has reported and exited, the stopped rank is killed
        # here (workers run in sessions of their own, so the job's process group does not reach them).
        for line in job.stderr:
            lines.append(line)
            if line.startswith("torchrun_stuck_rank.py: error:"):
                rank0 = int((tmp_path / "rank0.pid").read_text())
                for _ in range(600):
                    if not _alive(rank0):
                        break
                    time.sleep(0.1)
                _kill(int((tmp_path / "rank1.pid").read_text()))
    reader = threading.Thread(target=end_the_stopped_rank_once_rank_0_reported, daemon=True)
    reader.start()
    try:
        job.wait(timeout=300)
        reader.join(timeout=60)
        stderr = "".join(lines)
    finally:
        if job.poll() is None:      # a hang: end torchrun and its workers (their pids are still theirs)
            for pid_file in tmp_path.glob("rank*.pid"):
                _kill(int(pid_file.read_text()))
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert job.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("torchrun_stuck_rank.py: error:")]
    assert len(errors) == 2 and errors[0] == errors[1], stderr[-3000:]      # again after torchrun's report
    assert stderr.strip().splitlines()[-1] == errors[0], "the error is the last line: " + stderr[-3000:]
    assert re.search(r"error: all_to_all over ranks \[0, 1\] timed out after 10 s on rank 0: rank 1 did not "
                     r"arrive", errors[0]), errors[0]
    assert "CollectiveTimeout" not in stderr, "no worker traceback: " + stderr[-3000:]   # torchrun's own is fine


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
    from test_training import tiny_config

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
