"""A training run's HF starting and end points.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_hf_start.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe.data.token_dataset import TokenDataset
from megamoe.moe.placement.expert_slots import ExpertPlacement, save_expert_load
from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.hf_models import lazy_transformers
from tests.helpers.hf_start import ATOL, SEQ, _train_args, ids, sentences

REPO = Path(__file__).resolve().parents[2]
E = 8                                       # experts of the tiny qwen3_moe (MoE layer 1 only)


# ----------------------------------------------------------------------------------------------
# In process, two ranks: EP 2 with replica slots from an expert-load file
# ----------------------------------------------------------------------------------------------
LOADS = {1: [50, 1, 1, 1, 1, 1, 1, 30]}      # the only MoE layer of the tiny qwen3_moe


def _ep2_worker(rank, world_size, directory, expert_load, input_ids, expected):
    from megamoe.checkpoint.hf_checkpoint import HFCheckpoint
    from megamoe.inference.pipeline_forward import pipeline_logits
    from megamoe.training.hf_start import load_hf_weights, start_from_hf
    from parallel_state import destroy_model_parallel, initialize_model_parallel

    state = initialize_model_parallel(ep=2)
    try:
        model, _ = start_from_hf(directory, state, num_expert_slots=10, expert_load=expert_load,
                                 expert_backend="torch", load_weights=False)
        hf = HFCheckpoint.open(directory)
        read = load_hf_weights(model, hf)
        diff = (pipeline_logits(model.eval(), state, input_ids) - expected).abs().max().item()
        placement = model.moe_layers()[1].placement
        experts = sorted({int(placement.slot_to_expert[s]) for s in placement.local_slots(state.ep.rank)})
        return diff, placement.to_dict(), experts, read, hf.total_bytes
    finally:
        destroy_model_parallel()


@pytest.mark.slow
def test_start_from_hf_on_two_ranks_with_ep2_and_replica_slots(hf_dir, tmp_path):
    directory, expected = hf_dir
    save_expert_load(tmp_path / "load.json", LOADS, num_experts=E)
    results = run_on_ranks(_ep2_worker, 2, args=(directory, str(tmp_path / "load.json"), ids(), expected),
                           timeout_s=300)
    balanced = ExpertPlacement.balanced(LOADS[1], 10, 2)
    assert balanced.replica_counts[0] > 1, "the load file must give the hot expert replicas"
    held = []
    for diff, placement, experts, read, total in results:
        assert diff <= ATOL, f"logits differ by {diff:.2e}"
        assert ExpertPlacement.from_dict(placement) == balanced
        assert read < total, "each rank reads only the HF tensors it holds a part of"
        held.append(set(experts))
    assert held[0] | held[1] == set(range(E)) and held[0] != held[1]


def _hf_loss(directory, data):
    """transformers' mean next-token loss of the model in ``directory`` over every sample of ``data``."""
    model = lazy_transformers().AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    dataset = TokenDataset(data, SEQ)
    inputs, labels = dataset.batch(range(len(dataset)))
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


@pytest.mark.slow
def test_fine_tune_an_hf_model_on_two_ranks_and_export_it(hf_dir, token_file, tmp_path):
    """The issue's end-to-end run: an HF Qwen3-MoE and its own tokenizer, a JSONL file, EP 2 with replica
    slots, a cosine schedule with warmup, held-out eval, then transformers loads the export, and its loss
    on the data is at least 10% below the original model's."""
    directory, _ = hf_dir
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in sentences(400)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(REPO / "examples/pretrain_moe.py"),
           "--hf-model", directory, "--ep", "2", "--num-expert-slots", "10", "--export-hf", str(tmp_path / "out"),
           "--lr-schedule", "cosine", "--warmup-steps", "3", "--eval-fraction", "0.05", "--eval-every", "10",
           *map(str, _train_args(tmp_path, jsonl, 30))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "out"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == Path(directory, name).read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads(Path(directory, "config.json").read_text())
    # The JSONL file was tokenized (once, into the work dir's cache) into the same ids as token_file.
    cached, = (tmp_path / "work" / "data_cache").glob("x_*.bin")
    assert cached.read_bytes() == token_file.read_bytes()
    before, after = _hf_loss(directory, token_file), _hf_loss(out, token_file)
    assert after <= 0.9 * before, f"the exported model's loss {after:.3f} must be 10% below the original's {before:.3f}"

    records = [json.loads(line) for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for record in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "skipped"} <= record.keys()
        assert record["skipped"] is False and record["tflops"] > 0 and 0 < record["mfu"]
    lrs = [r["lr"] for r in steps]
    assert lrs[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3]) and lrs[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:])), "cosine decay after the warmup"
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
