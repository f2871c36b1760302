"""The ``megamoe`` command: subcommand dispatch and the alias console scripts, ``--help`` printed once under
torchrun, TOML run configs (``--config``, ``--section.key`` overrides, ``--print-config`` read back to the
same run), bad config files as one ``error:`` line, the shipped configs/ passing the checks (DeepSeek-V3's
at its 1024-rank world size, no model built), ``--nproc-per-node`` checking before it launches, and a run's
progress line, summary and recorded config (every checkpoint's ``run_config.toml``, covered by its
checksums; a resumed run logs what changed)."""

import io
import json
import logging
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

from megamoe.cli import main as megamoe_main
from megamoe.cli import train
from megamoe.cli.launch import run_script
from megamoe.training import pretrain_checks
from megamoe.training.run_config_file import RUN_CONFIG_FILE, SECTION_OF_FIELD, render_run_config
from megamoe.training.run_summary import RunSummary, TrainingProgress

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
TINY = ["--corpus-bytes", "200000", "--vocab-size", "512", "--hidden", "32", "--layers", "2", "--sample-tokens", "4"]


def _megamoe(argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``megamoe ARGV`` run in this process, as the console script runs it."""
    try:
        code = megamoe_main.main([str(a) for a in argv])
    except SystemExit as e:             # argparse: --help (0) or a malformed command line (2)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(code, err, prog, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(autouse=True)
def _plain_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


# ---- dispatch and aliases ------------------------------------------------------------------------------
@pytest.mark.parametrize("subcommand, usage", [
    ("train", "usage: megamoe train"), ("generate", "usage: megamoe generate"),
    ("convert", "usage: megamoe convert"), ("preprocess", "usage: megamoe preprocess"),
    ("inspect", "usage: megamoe inspect"), ("serve", "usage: megamoe serve")])
def test_each_subcommand_has_its_own_help(subcommand, usage, capsys):
    code, out, _ = _megamoe([subcommand, "--help"], capsys)
    assert code == 0 and out.startswith(usage), out[:300]


def test_the_command_dispatches_and_names_the_subcommand_in_its_errors(tmp_path, capsys):
    code, out, _ = _megamoe(["--help"], capsys)
    assert code == 0 and all(name in out for name in ("train", "generate", "serve", "convert", "preprocess", "inspect"))
    code, _, err = _megamoe(["serv"], capsys)
    assert code == 2 and "megamoe: error: argument SUBCOMMAND: invalid choice: 'serv'" in err, err
    code, _, err = _megamoe(["inspect", tmp_path / "missing"], capsys)
    assert code == 1 and err.startswith("megamoe inspect: error: "), err
    code, _, err = _megamoe(["train", "--tp", "0"], capsys)
    _one_error_line(code, err, "megamoe train", "--tp")
    code, _, err = _megamoe(["generate", tmp_path / "missing", "--prompt", "x"], capsys)
    _one_error_line(code, err, "megamoe generate")
    code, _, err = _megamoe(["preprocess", "--input", tmp_path / "none.txt", "--tokenizer", tmp_path / "t.model",
                             "--output", tmp_path / "out.bin"], capsys)
    _one_error_line(code, err, "megamoe preprocess", "--tokenizer")


def test_the_console_scripts_are_the_command_and_its_aliases():
    import importlib
    text = (REPO / "setup.py").read_text()
    scripts = {}
    for line in text[text.index('"console_scripts"'):].splitlines()[1:]:
        if line.strip().startswith("]"):
            break
        if "=" in line and not line.strip().startswith("#"):
            name, target = (part.strip(' ",') for part in line.split("="))
            scripts[name] = target
    assert scripts == {"megamoe": "megamoe.cli.main:main", "megamoe-convert": "megamoe.cli.convert:main",
                       "megamoe-preprocess": "megamoe.cli.preprocess:cli"}
    for target in scripts.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function))


def test_the_aliases_keep_their_names(tmp_path, capsys):
    from megamoe.cli import convert, preprocess
    assert convert.main(["inspect", str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err.startswith("megamoe-convert inspect: error: ")
    code = preprocess.cli(["--input", str(tmp_path / "x"), "--tokenizer", str(tmp_path / "t"), "--output",
                           str(tmp_path / "o.bin")])
    _one_error_line(code, capsys.readouterr().err, "megamoe-preprocess", "--tokenizer")


@pytest.mark.parametrize("subcommand", ["train", "generate"])
def test_help_is_printed_by_local_rank_0_only(subcommand, monkeypatch, capsys):
    """Under torchrun every rank parses the flags: only local rank 0 prints (4 ranks printed it 4 times)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    code, out, err = _megamoe([subcommand, "--help"], capsys)
    assert code == 0 and out == err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, out, _ = _megamoe([subcommand, "--help"], capsys)
    assert code == 0 and out.count(f"usage: megamoe {subcommand}") == 1


@pytest.mark.slow
def test_help_once_under_torchrun(tmp_path):
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megamoe",
                             "train", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("usage: megamoe train") == 1 and result.stdout.count("show this help message") == 1


# ---- config files ----------------------------------------------------------------------------------------
def test_every_flag_belongs_to_exactly_one_section():
    assert train.config_fields(train.build_parser()) == set(SECTION_OF_FIELD)


def test_config_file_then_overrides_then_flags(tmp_path):
    args = train.parse_args(["--config", str(CONFIGS / "demo.toml"), "--optimizer.lr", "3e-4",
                             "--parallel.sequence_parallel", "true", "--steps", "7", "--schedule.steps=9"])
    assert (args.tp, args.ep, args.dispatcher, args.hidden) == (2, 2, "allgather", 128)    # the file
    assert args.lr == 3e-4 and args.sequence_parallel is True                            # dotted overrides
    assert args.steps == 7                                                               # the flag wins
    assert args.save_dir == Path("runs/pretrain_moe/checkpoints") and args.work_dir == Path("runs/pretrain_moe")
    # A flag wins over the file too; an on/off key set false in a file stays at its default.
    run = tmp_path / "run.toml"
    run.write_text('[parallel]\ntp = 4\nsequence_parallel = false\n[checkpoint]\nverify_checksums = false\n'
                   '[data]\neval_data = ["a.bin", "b.bin"]\n[logging]\nsample_prompt = "-- x"\nprogress = false\n')
    args = train.parse_args(["--config", str(run), "--tp", "2"])
    assert args.tp == 2 and args.sequence_parallel is False and args.verify_checksums is False
    assert args.eval_data == [Path("a.bin"), Path("b.bin")] and args.sample_prompt == "-- x" and not args.progress


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_print_config_reads_back_to_the_same_run(config, tmp_path, capsys):
    argv = ["--config", str(CONFIGS / config), "--optimizer.lr", "1e-3", "--steps", "11", "--eval-data", "x.bin"]
    code = train.main([*argv, "--print-config"])
    printed = capsys.readouterr().out
    assert code == 0 and tomllib.loads(printed)["schedule"]["steps"] == 11
    (tmp_path / "printed.toml").write_text(printed)
    again = train.parse_args(["--config", str(tmp_path / "printed.toml")])
    first = train.parse_args(argv)
    ignored = {"config", "print_config", "nproc_per_node"}
    assert {k: v for k, v in vars(again).items() if k not in ignored} == \
        {k: v for k, v in vars(first).items() if k not in ignored}
    assert render_run_config(again) == printed


@pytest.mark.parametrize("text, fragments", [
    ("[optimizer]\nlrr = 1e-3\n", ["unknown key optimizer.lrr", "did you mean optimizer.lr?"]),
    ("[model]\nlr = 1e-3\n", ["unknown key model.lr", "did you mean optimizer.lr?"]),
    ("[optimiser]\nlr = 1e-3\n", ["unknown section [optimiser]", "did you mean optimizer?"]),
    ("lr = 1e-3\n", ["lr = ... is outside any section; put it under [optimizer]"]),
    ("[parallel]\nsequence_parallel = 1\n", ["parallel.sequence_parallel must be true or false"]),
    ("[parallel]\ntp = [2]\n", ["parallel.tp takes one value"]),
    ("[parallel]\ntp = 'two'\n", ["argument --tp: invalid int value: 'two'"]),
    ("[moe]\ndispatcher = 'a2a'\n", ["argument --dispatcher: invalid choice: 'a2a'"]),
    ("[parallel\ntp = 2\n", ["not a valid TOML file"]),
    ("[model]\nhf_model = 'x'\nhidden = 64\n", ["--hidden cannot be combined with --hf-model x"]),
])
def test_a_bad_config_file_is_one_error_line_naming_the_key(text, fragments, tmp_path, capsys):
    run = tmp_path / "run.toml"
    run.write_text(text)
    code = run_script(train.main, ["--config", str(run), "--print-config"], prog="megamoe train")
    err = capsys.readouterr().err
    _one_error_line(code, err, "megamoe train", *fragments)


def test_bad_overrides_and_a_missing_file(tmp_path, capsys):
    code = run_script(train.main, ["--optimizer.lrr", "1"], prog="megamoe train")
    _one_error_line(code, capsys.readouterr().err, "megamoe train", "--optimizer.lrr", "did you mean optimizer.lr?")
    code = run_script(train.main, ["--config", str(tmp_path / "none.toml")], prog="megamoe train")
    _one_error_line(code, capsys.readouterr().err, "megamoe train", "--config", "none.toml")


def test_the_shipped_demo_config_passes_the_checks_at_its_world_size():
    args = train.parse_args(["--config", str(CONFIGS / "demo.toml")])
    source = pretrain_checks.check_arguments(args, 4)
    assert source.footprint.total_params > 0
    with pytest.raises(ValueError, match="does not fit 3 rank"):
        pretrain_checks.check_arguments(args, 3)


def _tiny_hf_qwen3(directory: Path) -> None:
    """A tiny random HF Qwen3-MoE with a WordLevel tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(["the cat sat on a mat"], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>"}))


def test_the_shipped_qwen3_finetune_config_passes_the_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)         # its relative paths: the work dir, the export dir
    _tiny_hf_qwen3(tmp_path / "qwen3")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": "the cat sat"}) + "\n" for _ in range(50)))
    args = train.parse_args(["--config", str(CONFIGS / "qwen3_moe_finetune.toml"), "--model.hf_model", "qwen3"])
    assert args.hf_model == Path("qwen3") and args.num_expert_slots == 10 and args.lr_schedule == "cosine"
    source = pretrain_checks.check_arguments(args, 2)
    assert source.config.family == "qwen3_moe" and source.provenance is not None      # exportable


def test_the_shipped_deepseek_v3_layout_passes_the_checks_at_1024_ranks(monkeypatch):
    """Its world size (pp 16 x dp 64, EP 64 over the data-parallel ranks) and a 141 GiB GPU each: the checks
    read the config and estimate the memory per rank; no model is built, no group created."""
    args = train.parse_args(["--config", str(CONFIGS / "deepseek_v3_layout.toml")])
    monkeypatch.setattr(pretrain_checks, "available_memory_bytes", lambda device: (141 * 2**30, "GPU memory"))
    source = pretrain_checks.check_arguments(args, 1024, torch.device("cuda", 0))
    config = source.config
    assert config.family == "deepseek_v3" and config.moe.num_experts == 256 and config.num_layers == 61
    assert type(config.attention).__name__ == "MLAConfig" and config.moe.shared_experts is not None
    assert source.footprint.total_params == pytest.approx(671.0e9, rel=2e-3)
    assert source.footprint.bytes_per_rank < 141 * 2**30
    with pytest.raises(ValueError, match="does not fit 512 rank"):
        pretrain_checks.check_arguments(args, 512, torch.device("cuda", 0))


# ---- launching ---------------------------------------------------------------------------------------------
def test_nproc_per_node_checks_the_config_before_starting_ranks(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(train, "subprocess", types.SimpleNamespace(Popen=lambda *a, **k: started.append(a)))
    code = run_script(train.main, ["--config", str(CONFIGS / "demo.toml"), "--nproc-per-node", "3"],
                      prog="megamoe train")
    _one_error_line(code, capsys.readouterr().err, "megamoe train", "does not fit 3 rank")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    code = run_script(train.main, ["--config", str(CONFIGS / "demo.toml"), "--nproc-per-node", "4"],
                      prog="megamoe train")
    _one_error_line(code, capsys.readouterr().err, "megamoe train", "under torchrun")
    assert not started


@pytest.mark.parametrize("code", [0, 1])
def test_nproc_per_node_runs_torchrun_with_the_same_command(code, monkeypatch):
    """It returns torchrun's exit code; after a failed job, once the helpers printed the error line again."""
    commands, waited = [], []

    class Torchrun:
        pid = 12345

        def __init__(self, command):
            commands.append(command)

        def wait(self):
            return code

    monkeypatch.setattr(train, "subprocess", types.SimpleNamespace(Popen=Torchrun))
    monkeypatch.setattr(train, "wait_for_lines_after", waited.append)
    assert train.main(["--config", str(CONFIGS / "demo.toml"), "--nproc-per-node=4", "--steps", "3"]) == code
    assert waited == ([12345] if code else [])
    (command,) = commands
    assert command == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "megamoe",
                       "train", "--config", str(CONFIGS / "demo.toml"), "--steps", "3"]


# ---- progress, summary, recorded config ----------------------------------------------------------------------
def test_the_progress_line_is_drawn_on_a_terminal_only():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, enabled, rank, drawn in ((Terminal(), True, 0, True), (io.StringIO(), True, 0, False),
                                         (Terminal(), False, 0, False), (Terminal(), True, 1, False)):
        progress = TrainingProgress(start_step=0, end_step=4, enabled=enabled, rank=rank, stream=stream)
        progress.step(2, 1.2345, 1000.0)
        progress.close()
        text = stream.getvalue()
        assert (("2/4" in text and "loss 1.2345" in text and "1,000 tok/s" in text) if drawn else text == ""), text


def test_the_summary_says_what_the_run_did():
    summary = RunSummary(start_step=2, save_dir="ck")
    for step, loss in ((3, 2.5), (4, 2.0)):
        summary.step(step, loss, tokens=100, skipped=step == 3)
    summary.evaluated(3, 2.6)
    summary.evaluated(4, 2.7)
    summary.saved("ck/step_4")
    summary.seconds = 2.0
    assert summary.lines() == ["run summary: steps 3-4 (2 trained, 1 skipped (non-finite)), 200 tokens in 2.0 s "
                               "(100 tokens/s)", "  final training loss 2.0000",
                               "  eval loss: final 2.7000, best 2.6000 (step 3)", "  checkpoints in ck, newest ck/step_4"]
    assert RunSummary(start_step=5, save_dir="ck").lines()[0] == \
        "run summary: no step trained (the run was at step 5 already)"


def test_a_run_ends_with_its_summary_and_records_its_config(tmp_path, caplog):
    """A tiny run: the summary (steps, tokens, eval losses, checkpoints), run_config.toml in the work dir and in
    every checkpoint (in its manifest's checksummed side files); resumed with other flags, the log names
    the fields that changed; a damaged run_config.toml is refused."""
    from megamoe.checkpoint.format import CheckpointError, read_manifest
    from megamoe.training.checkpoint import checkpoint_path
    from megamoe.training.pretrain import pretrain, read_side_file
    threads = torch.get_num_threads()
    caplog.set_level(logging.INFO, logger="megamoe.training")
    work = tmp_path / "work"
    argv = ["--work-dir", str(work), *TINY, "--steps", "2", "--save-every", "1", "--eval-fraction", "0.05",
            "--eval-every", "1", "--eval-iters", "1", "--global-batch", "4", "--seq-len", "32", "--sample-tokens", "0"]
    try:
        summary = pretrain(train.parse_args(argv))
    finally:
        torch.set_num_threads(threads)
    lines = summary.lines()
    assert lines[0].startswith("run summary: steps 1-2 (2 trained), 256 tokens in "), lines
    assert lines[2].startswith("  eval loss: final ") and "best" in lines[2]
    checkpoint = checkpoint_path(work / "checkpoints", 2)
    assert lines[3] == f"  checkpoints in {work / 'checkpoints'}, newest {checkpoint}"
    assert "\n".join(lines) in caplog.text
    recorded = (work / RUN_CONFIG_FILE).read_text()
    assert tomllib.loads(recorded)["schedule"]["steps"] == 2
    assert RUN_CONFIG_FILE in read_manifest(checkpoint)["extra"]["hf_files"]
    assert read_side_file(checkpoint, RUN_CONFIG_FILE).decode() == recorded

    caplog.clear()
    try:
        pretrain(train.parse_args([*argv, "--steps", "3", "--optimizer.clip_grad", "0.5"]))
    finally:
        torch.set_num_threads(threads)
    assert f"config changes vs {checkpoint}: optimizer.clip_grad 1.0 -> 0.5; schedule.steps 2 -> 3\n" in caplog.text
    damaged = Path(checkpoint_path(work / "checkpoints", 3)) / "hf_files" / RUN_CONFIG_FILE
    damaged.write_text(damaged.read_text().replace("steps = 3", "steps = 4"))
    with pytest.raises(CheckpointError, match=RUN_CONFIG_FILE):
        read_side_file(checkpoint_path(work / "checkpoints", 3), RUN_CONFIG_FILE)


def test_the_launcher_waits_for_the_helpers_lines():
    """A helper holds its claim until its line is printed: the launcher returns once none is held."""
    import threading

    from megamoe import after_torchrun
    pid = os.getpid() + 10_000_000          # no real torchrun: a name no other test uses
    claim = after_torchrun._claim("cause", pid)
    assert claim is not None
    released = threading.Event()
    threading.Timer(0.2, lambda: (released.set(), claim.close())).start()
    after_torchrun.wait_for_lines_after(pid)
    assert released.is_set()
    free = after_torchrun._claim("cause", pid)
    assert free is not None
    free.close()


@pytest.mark.slow
def test_nproc_per_node_trains_on_that_many_ranks(tmp_path):
    """One command: ``python -m megamoe train --nproc-per-node 2`` starts the ranks itself (dp 2), trains,
    saves and ends with the summary."""
    result = subprocess.run([sys.executable, "-m", "megamoe", "train", "--nproc-per-node", "2", *TINY,
                             "--work-dir", str(tmp_path), "--steps", "1", "--global-batch", "4", "--seq-len", "32",
                             "--sample-tokens", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world 2: tp 1 cp 1 pp 1 dp 2" in result.stderr and "run summary: step 1 (1 trained)" in result.stderr
    assert (tmp_path / "checkpoints").is_dir() and (tmp_path / RUN_CONFIG_FILE).is_file()
