"""`megamoe train --lora-rank` on an HF Qwen3-MoE start: the base stays bit-identical, only the adapters train
and have optimizer state, the checkpoint holds lora.json (config + base fingerprint), a resume continues, and a
resume under another LoRA config or base (or a bad flag) is one error line."""

import json
import shutil

import pytest
import torch

from megamoe.checkpoint.model_loading import build_model_from_checkpoint
from megamoe.cli.launch import run_script
from megamoe.lora import LoRAConfig, apply_lora
from megamoe.models.hf_loading import gather_logical_state
from megamoe.training.checkpoint import latest_checkpoint
from megamoe.training.lora_run import base_fingerprint
from megamoe.checkpoint.manifest import read_manifest
from parallel_state import ParallelState
from tests.helpers.hf_start import _train_args, hf_dir, token_file  # noqa: F401  (fixtures)


def _run(demo, argv, capsys):
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    return code, out, err


def _lora_argv(hf_dir, token_file, tmp_path, steps, *extra):
    return ["--hf-model", hf_dir[0], "--lora-rank", 4, "--lora-alpha", 8, *extra,
            *_train_args(tmp_path, token_file, steps)]


def test_lora_run_trains_only_the_adapters_and_resumes(demo, hf_dir, token_file, tmp_path, capsys):
    code, _, err = _run(demo, _lora_argv(hf_dir, token_file, tmp_path, 2), capsys)
    assert code == 0, err[-3000:]
    first = latest_checkpoint(tmp_path / "ckpt")
    record = json.loads((tmp_path / "ckpt" / first.rsplit("/", 1)[-1] / "hf_files" / "lora.json").read_text())
    assert record["config"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                "targets": ["attention", "dense_mlp", "shared_experts", "experts"]}
    assert record["base"]["sha256"] == base_fingerprint(hf_dir[0])
    manifest = read_manifest(first)
    optim = {name for name in manifest["tensors"] if name.startswith("optim.")}
    assert optim and all(".lora_" in name for name in optim), sorted(optim)[:5]
    # The base weights are the HF model's, bit for bit; the adapters' B moved from zero.
    trained = build_model_from_checkpoint(first, ParallelState.single_process(), expert_backend="torch")
    from megamoe.training.hf_start import start_from_hf
    base, _ = start_from_hf(hf_dir[0], ParallelState.single_process(), expert_backend="torch")
    base_state = gather_logical_state(base)
    apply_lora(base, LoRAConfig(4, 8))
    saved = {n: t for n, t in gather_logical_state(trained).items()}
    for name, tensor in base_state.items():
        assert torch.equal(saved[name], tensor), name
    moved = [n for n in manifest["tensors"] if n.endswith(".lora_B") and not n.startswith("optim.")]
    assert moved
    code, _, err = _run(demo, _lora_argv(hf_dir, token_file, tmp_path, 3), capsys)
    assert code == 0, err[-3000:]
    starts = [json.loads(line) for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()
              if '"run_start"' in line or '"resumed_from_step"' in line]
    assert starts[-1]["resumed_from_step"] == 2 and latest_checkpoint(tmp_path / "ckpt").endswith("3")
    # Another LoRA config, or no LoRA, on this checkpoint: one error line, exit 1.
    code, _, err = _run(demo, [a if a != 4 else 8 for a in _lora_argv(hf_dir, token_file, tmp_path, 4)], capsys)
    assert code == 1 and "use the same --lora-* flags to resume it" in err and "Traceback" not in err, err[-2000:]
    argv = _lora_argv(hf_dir, token_file, tmp_path, 4)
    code, _, err = _run(demo, argv[:2] + argv[6:], capsys)
    assert code == 1 and "is a LoRA run's checkpoint" in err, err[-2000:]


def test_lora_resume_on_another_base_is_refused(demo, hf_dir, token_file, tmp_path, capsys):
    other = tmp_path / "other_base"
    shutil.copytree(hf_dir[0], other)
    code, _, err = _run(demo, _lora_argv(hf_dir, token_file, tmp_path, 1), capsys)
    assert code == 0, err[-3000:]
    with open(next(other.glob("*.safetensors")), "r+b") as f:     # another base: one byte of a weight
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 1]))
    code, _, err = _run(demo, _lora_argv((str(other),), token_file, tmp_path, 2), capsys)
    assert code == 1 and "is not the base" in err and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("flags,message", [
    (["--lora-rank", 0], "--lora-rank: LoRAConfig.rank must be an integer >= 1"),
    (["--lora-rank", 2, "--lora-targets", "attention,mlp"], "--lora-targets: LoRAConfig.targets"),
    (["--lora-rank", 2, "--lora-dropout", 0.1], "--lora-*: LoRAConfig.dropout"),
])
def test_bad_lora_flags_end_in_one_error_line(demo, flags, message, hf_dir, token_file, tmp_path, capsys):
    code, _, err = _run(demo, ["--hf-model", hf_dir[0], *flags, *_train_args(tmp_path, token_file, 1)], capsys)
    assert code == 1 and message in err and "Traceback" not in err, err[-2000:]
