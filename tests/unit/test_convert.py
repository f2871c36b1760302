"""megamoe-convert: HF -> megamoe -> HF round trips are bit-exact for every family, layout and slot count;
converted checkpoints give transformers' logits on spawned ranks under their own layout and others;
reshard carries optimizer state; every bad input fails with its message, a non-zero exit and no output.
"""

import collections
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from megamoe.checkpoint.format import iter_logical_tensors, read_manifest
from megamoe.checkpoint.hf_checkpoint import HFCheckpoint
from megamoe.models.families import SUPPORTED_FAMILIES
from megamoe.moe.placement.expert_slots import ExpertPlacement, save_expert_load
from tests.helpers.hf_models import lazy_transformers
from tests.helpers.hf_checkpoints import (ATOL, SIDE_FILES, _single_file_copy, assert_same_tensors, convert, hf_tensors, ids,
                                   save_hf_model)

E = 8   # experts per MoE layer in every tiny config


def hf_as_logical(hf_dir):
    """The logical tensors an import of ``hf_dir`` must hold, by the family's adapter."""
    from megamoe.hf.adapters import adapter_for
    from megamoe.hf.import_hf import model_config_from_hf
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = model_config_from_hf(json.load(f), hf_dir)
    return adapter_for(config.family).hf_to_megamoe(hf_tensors(hf_dir), config)


# ----------------------------------------------------------------------------------------------
# Round trips (one process)
# ----------------------------------------------------------------------------------------------
ROUND_TRIP_LAYOUTS = {   # import layout (CLI options) and a reshard layout, per family
    "mixtral": (["--tp", 2, "--pp", 2, "--ep", 2, "--num-expert-slots", 12],
                ["--tp", 1, "--pp", 1, "--ep", 4, "--num-expert-slots", 16]),
    "qwen2_moe": (["--tp", 1, "--pp", 1, "--ep", 4, "--num-expert-slots", 16],
                  ["--tp", 2, "--pp", 2, "--ep", 2, "--etp", 1, "--dispatcher", "allgather"]),
    "qwen3_moe": (["--tp", 2, "--pp", 2, "--ep", 1, "--etp", 2],
                  ["--tp", 2, "--pp", 1, "--ep", 2, "--num-expert-slots", 10]),
    "olmoe": (["--tp", 2, "--pp", 1, "--ep", 2, "--etp", 1, "--dispatcher", "allgather", "--num-expert-slots", 10],
              ["--tp", 1, "--pp", 2, "--ep", 1]),
    "deepseek_v2": (["--tp", 2, "--pp", 1, "--ep", 2, "--num-expert-slots", 12],
                    ["--tp", 1, "--pp", 3, "--ep", 2]),
    "deepseek_v3": (["--tp", 1, "--pp", 2, "--ep", 2, "--num-expert-slots", 16],
                    ["--tp", 2, "--pp", 1, "--ep", 4, "--etp", 2]),
    "glm4_moe": (["--tp", 2, "--pp", 1, "--ep", 2, "--etp", 2, "--num-expert-slots", 12],
                 ["--tp", 1, "--pp", 3, "--ep", 2]),
    "minimax_m2": (["--tp", 2, "--pp", 2, "--ep", 2, "--dispatcher", "allgather"],
                   ["--tp", 1, "--pp", 1, "--ep", 4, "--dispatcher", "alltoall", "--num-expert-slots", 16]),
    "gpt_oss": (["--tp", 2, "--pp", 1, "--ep", 2, "--etp", 2, "--num-expert-slots", 12],
                ["--tp", 1, "--pp", 3, "--ep", 4, "--num-expert-slots", 16]),
}


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_round_trip_is_bit_exact(family, hf_models, tmp_path):
    hf_dir, expected_logits = hf_models(family)
    import_layout, reshard_layout = ROUND_TRIP_LAYOUTS[family]
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", *import_layout) == 0
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "hf_out", "--max-shard-size", "30KB") == 0
    original = hf_tensors(hf_dir)
    assert_same_tensors(hf_tensors(tmp_path / "hf_out"), original, f"{family} import -> export")
    assert os.path.isfile(tmp_path / "hf_out" / "model.safetensors.index.json")       # several shards
    with open(os.path.join(hf_dir, "config.json")) as f, open(tmp_path / "hf_out" / "config.json") as g:
        assert json.load(f) == json.load(g)
    for name, text in SIDE_FILES.items():
        assert (tmp_path / "hf_out" / name).read_text() == text
    with safe_open(glob.glob(str(tmp_path / "hf_out" / "*.safetensors"))[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}

    # Through another layout and slot count, then back to HF, into a single shard.
    assert convert("reshard", tmp_path / "ckpt", tmp_path / "resharded", *reshard_layout) == 0
    assert convert("export-hf", tmp_path / "resharded", tmp_path / "hf_again") == 0
    assert sorted(os.listdir(tmp_path / "hf_again")) == sorted(
        ["config.json", "model.safetensors", "generation_config.json", *SIDE_FILES])
    assert_same_tensors(hf_tensors(tmp_path / "hf_again"), original, f"{family} import -> reshard -> export")

    # transformers loads the export and computes the original logits.
    model = lazy_transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "hf_again", attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids()).logits, expected_logits)


def test_round_trip_keeps_bf16_and_casts_on_request(tmp_path):
    hf_dir = tmp_path / "hf_bf16"
    save_hf_model(hf_dir, "qwen2_moe", dtype=torch.bfloat16)
    original = hf_tensors(hf_dir)
    assert {t.dtype for t in original.values()} == {torch.bfloat16}
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 2) == 0
    assert {e["dtype"] for e in read_manifest(tmp_path / "ckpt")["tensors"].values()} == {"bfloat16"}
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "keep") == 0
    assert_same_tensors(hf_tensors(tmp_path / "keep"), original, "bf16 keep")
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "fp32", "--dtype", "fp32") == 0
    assert_same_tensors(hf_tensors(tmp_path / "fp32"), {k: v.float() for k, v in original.items()}, "bf16 -> fp32")
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    assert convert("import-hf", hf_dir, tmp_path / "ckpt16", "--tp", 1, "--pp", 1, "--ep", 1, "--dtype", "fp16") == 0
    assert {e["dtype"] for e in read_manifest(tmp_path / "ckpt16")["tensors"].values()} == {"float16"}


def test_streaming_reads_every_hf_tensor_once(hf_models, tmp_path, monkeypatch):
    """Each HF tensor goes through the adapter once; those that are only renamed and cut along their first
    dimension go through as meta placeholders (their bytes are copied file to file; only the NaN/Inf scan
    reads them, from the mapping)."""
    hf_dir, _ = hf_models("deepseek_v3")
    reads, placeholders = collections.Counter(), set()
    original = HFCheckpoint.iter_tensors

    def counting(self, keys, window, placeholders_for=(), scan=None):
        for key, tensor in original(self, keys, window, placeholders_for, scan):
            reads[key] += 1
            if tensor.is_meta:
                placeholders.add(key)
            yield key, tensor
    monkeypatch.setattr(HFCheckpoint, "iter_tensors", counting)
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 2) == 0
    assert set(reads) == set(hf_tensors(hf_dir)) and set(reads.values()) == {1}
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in placeholders          # etp 2: cut along rows
    assert "model.layers.1.mlp.experts.0.down_proj.weight" not in placeholders      # cut along columns
    assert "model.layers.0.self_attn.o_proj.weight" not in placeholders
    assert_same_tensors(dict(iter_logical_tensors(tmp_path / "ckpt")),
                        hf_as_logical(hf_dir), "deepseek_v3 import")


def test_expert_load_gives_balanced_placements(hf_models, tmp_path):
    hf_dir, _ = hf_models("qwen2_moe")
    loads = {0: [90, 5, 5, 5, 5, 5, 5, 5], 2: [1, 1, 1, 1, 1, 1, 40, 60]}
    save_expert_load(tmp_path / "load.json", loads, num_experts=E)
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 1, "--pp", 1, "--ep", 4,
                   "--num-expert-slots", 12, "--expert-load", tmp_path / "load.json") == 0
    saved = read_manifest(tmp_path / "ckpt")["expert_placement"]
    for layer, load in loads.items():
        assert ExpertPlacement.from_dict(saved[str(layer)]) == ExpertPlacement.balanced(load, 12, 4)
    assert ExpertPlacement.from_dict(saved["0"]).replica_counts[0] > 1
    info = subprocess.run([sys.executable, "-m", "megamoe", "inspect", str(tmp_path / "ckpt"), "--json"],
                          capture_output=True, text=True, check=True)
    inspected = json.loads(info.stdout)
    assert inspected["verification"]["ok"] and inspected["expert_placement"]["0"]["replicated"]["0"] >= 2
    assert inspected["parallel_layout"]["ep"] == 4 and inspected["model"]["num_expert_slots"] == 12
    # The saved (balanced) placement survives a reshard that keeps slots and EP; a new slot count resets it.
    assert convert("reshard", tmp_path / "ckpt", tmp_path / "tp2", "--tp", 2, "--pp", 1, "--ep", 4) == 0
    assert read_manifest(tmp_path / "tp2")["expert_placement"] == saved
    assert convert("reshard", tmp_path / "ckpt", tmp_path / "s8", "--tp", 1, "--pp", 1, "--ep", 4,
                   "--num-expert-slots", 8) == 0
    assert ExpertPlacement.from_dict(read_manifest(tmp_path / "s8")["expert_placement"]["0"]) == \
        ExpertPlacement.default(E, 8, 4)


def test_reshard_carries_optimizer_state(hf_models, tmp_path):
    """A real training checkpoint (AdamW state, asdict model config) survives tp2/ep2/replica slots and back."""
    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    from megamoe.training.trainer import TrainConfig, Trainer
    from parallel_state import ParallelState

    hf_dir, _ = hf_models("qwen2_moe")
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 1, "--pp", 1, "--ep", 1) == 0
    state = ParallelState.single_process()
    trainer = Trainer(build_model_from_checkpoint(tmp_path / "ckpt", state), state, TrainConfig(lr=1e-2))
    tokens = ids(2, 10)
    trainer.train_step([(tokens[:, :-1], tokens[:, 1:])])
    save_training_checkpoint(tmp_path / "trained", trainer, sampler_state={"position": 3}, world_group=None)
    trained = dict(iter_logical_tensors(tmp_path / "trained"))
    assert any(n.startswith("optim.exp_avg.layers.0.mlp.experts.") for n in trained)

    assert convert("reshard", tmp_path / "trained", tmp_path / "wide", "--tp", 2, "--pp", 1, "--ep", 2,
                   "--num-expert-slots", 12) == 0
    wide = read_manifest(tmp_path / "wide")
    assert wide["extra"]["step"] == 1 and wide["extra"]["sampler_state"] == {"position": 3}
    chunks = wide["tensors"]["optim.exp_avg.layers.0.self_attn.q_proj.weight"]["chunks"]
    assert [c["offsets"] for c in chunks] == [[0, 0], [16, 0]]                  # cut like its parameter (tp2)
    assert convert("reshard", tmp_path / "wide", tmp_path / "back", "--tp", 1, "--pp", 1, "--ep", 1,
                   "--num-expert-slots", 8) == 0
    assert_same_tensors(dict(iter_logical_tensors(tmp_path / "back")), trained, "trained -> tp2 ep2 -> back")

    # A training checkpoint keeps no HF config: export takes it from the HF directory, and transformers then
    # computes what the fine-tuned model computes.
    assert convert("export-hf", tmp_path / "trained", tmp_path / "hf_tuned") == 1
    assert convert("export-hf", tmp_path / "trained", tmp_path / "hf_tuned", "--hf-config", hf_dir) == 0
    tuned = lazy_transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "hf_tuned", attn_implementation="eager")
    with torch.no_grad():
        ours, _ = trainer.model(ids())
        diff = (tuned.eval()(input_ids=ids()).logits - ours).abs().max().item()
    assert diff <= ATOL, diff
    assert (tmp_path / "hf_tuned" / "tokenizer.json").read_text() == SIDE_FILES["tokenizer.json"]

    # The training loader takes the resharded checkpoint (another layout: RNG states are not restored).
    fresh = Trainer(build_model_from_checkpoint(tmp_path / "ckpt", state), state, TrainConfig(lr=1e-2))
    assert load_training_checkpoint(tmp_path / "wide", fresh, world_group=None)["step"] == 1
    for param, saved in zip(fresh.optimizer.state.values(), trainer.optimizer.state.values()):
        assert torch.equal(param["exp_avg"], saved["exp_avg"])


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def _truncate(directory):
    path = os.path.join(directory, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _corrupt_header(directory):
    path = os.path.join(directory, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(9)
        f.write(b"garbage!")


EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
BAD_HF = {   # name: (edit of the state dict, edit of the directory, expected message)
    "missing tensor": (lambda s: s.pop(EXPERT), None, "missing HF key for 'layers.1.mlp.experts.3.up_proj.weight'"),
    "unexpected tensor": (lambda s: s.update(bogus=torch.zeros(2)), None, "unexpected HF key 'bogus'"),
    "shape mismatch": (lambda s: s.update({EXPERT: torch.zeros(16, 31)}), None,
                       r"'model.layers.1.mlp.experts.3.up_proj.weight' has shape \(16, 31\), the config expects"),
    "dtype mismatch": (lambda s: s.update({EXPERT: torch.zeros(16, 32, dtype=torch.int32)}), None,
                       "dtype mismatch: .*torch.int32"),
    "truncated file": (None, _truncate, "truncated or corrupt"),
    "corrupt header": (None, _corrupt_header, "truncated or corrupt"),
    "config inconsistent with the weights": (None, lambda d: _edit_config(d, num_hidden_layers=4),
                                             "num_hidden_layers is 4, but the weight files hold 3 layers"),
    "config with a wider expert": (None, lambda d: _edit_config(d, moe_intermediate_size=17),
                                   "do not match config.json.*experts.0.gate_proj.weight"),
    "unknown model_type": (None, lambda d: _edit_config(d, model_type="llama"),
                           "model_type 'llama' is not supported; supported: mixtral, qwen2_moe, qwen3_moe, olmoe, "
                           "deepseek_v2, deepseek_v3"),
    # Absurd sizes: refused against the weight files' headers before anything is allocated or looped over.
    "hidden_size 1e9": (None, lambda d: _edit_config(d, hidden_size=10**9),
                        r"hidden_size is 1000000000, but model.embed_tokens.weight in model.safetensors has 32"),
    "vocab_size 1e12": (None, lambda d: _edit_config(d, vocab_size=10**12),
                        r"vocab_size is 1000000000000, but model.embed_tokens.weight .* has 64"),
    "num_hidden_layers 1e6": (None, lambda d: _edit_config(d, num_hidden_layers=10**6),
                              r"num_hidden_layers is 1000000, but the weight files hold 3 layers"),
    "num_experts 1e6": (None, lambda d: _edit_config(d, num_local_experts=10**6),
                        r"num_local_experts is 1000000, but the weight files hold 8 routed experts"),
    "num_experts beside num_local_experts": (None, lambda d: _edit_config(d, num_experts=10**6),
                                             r"num_experts is 1000000 but num_local_experts is 8"),
    "rope_theta NaN": (None, lambda d: _edit_config(d, rope_parameters={"rope_type": "default",
                                                                        "rope_theta": float("nan")}),
                       r"RopeConfig.theta must be a finite number > 0, got nan"),
    "mlp_only_layers out of range": (None, lambda d: _edit_config(d, mlp_only_layers=[3]),
                                     r"mlp_only_layers \[3\] holds 3, not a layer index in \[0, num_hidden_layers=3\)"),
    "mlp_only_layers negative": (None, lambda d: _edit_config(d, mlp_only_layers=[-1]),
                                 r"mlp_only_layers \[-1\] holds -1"),
}


@pytest.mark.parametrize("case", BAD_HF)
def test_bad_hf_input_fails_cleanly(case, hf_models, tmp_path, capsys):
    edit_state, edit_dir, message = BAD_HF[case]
    hf_dir = _single_file_copy(hf_models("qwen3_moe")[0], str(tmp_path / "hf"), edit_state or (lambda s: None))
    if edit_dir:
        edit_dir(hf_dir)
    out = tmp_path / "out"
    assert convert("import-hf", hf_dir, out, "--tp", 1, "--pp", 1, "--ep", 1) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err, re.S), err
    assert sorted(os.listdir(tmp_path)) == ["hf"]        # no OUT_DIR, no temporary directory


def test_bad_layouts_and_options_fail_cleanly(hf_models, tmp_path, capsys):
    hf_dir, _ = hf_models("qwen3_moe")
    # Slots whose bf16 expert weights (3 matrices of 32 x 16 in the one MoE layer) exceed this machine's memory.
    too_many_slots = 8 * (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (3 * 32 * 16 * 2) // 8 + 1)
    cases = [
        (["--tp", 3, "--pp", 1, "--ep", 1], "impossible for this model.*3"),                  # 4 heads
        (["--tp", 1, "--pp", 4, "--ep", 1], "impossible for this model"),                      # 3 layers
        (["--tp", 2, "--pp", 1, "--ep", 1, "--etp", 4], "etp dividing tp.*etp=4 tp=2"),      # alltoall
        (["--tp", 1, "--pp", 1, "--ep", 3], "cannot be divided evenly over EP 3"),
        (["--tp", 1, "--pp", 1, "--ep", 1, "--num-expert-slots", 6], "num_expert_slots"),      # < 8 experts
        (["--tp", 1, "--pp", 1, "--ep", 1, "--expert-load", tmp_path / "nope.json"], "expert-load file"),
        # Refused before the plan walks a world of that size (minutes), or builds 1e7 slots per layer:
        (["--tp", 1000000, "--pp", 1, "--ep", 1], "--tp 1000000 must divide the 4 attention heads"),
        (["--tp", 100000, "--pp", 1, "--ep", 1], "--tp 100000 must divide the 4 attention heads"),
        (["--tp", 1, "--pp", 1000000, "--ep", 1], r"impossible for this model: num_layers \(3\) < pp_size"),
        (["--tp", 1, "--pp", 1, "--ep", 1, "--num-expert-slots", too_many_slots],
         rf"--num-expert-slots {too_many_slots}: each EP rank would hold .* GiB of expert weights .*, more than "
         r"this machine's memory"),
    ]
    for options, message in cases:
        assert convert("import-hf", hf_dir, tmp_path / "out", *options) == 1, options
        err = capsys.readouterr().err
        assert re.search(message, err) and "Traceback" not in err, (options, err)
        assert not os.path.exists(tmp_path / "out")
    assert convert("import-hf", hf_dir, tmp_path / "out", "--tp", "two", "--pp", 1, "--ep", 1) == 2   # argparse
    assert convert("import-hf", tmp_path / "missing", tmp_path / "out", "--tp", 1, "--pp", 1, "--ep", 1) == 1
    assert "is not a directory" in capsys.readouterr().err

    # An existing OUT_DIR needs --overwrite; a directory that is not a checkpoint is never replaced.
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 1, "--pp", 1, "--ep", 1) == 0
    before = read_manifest(tmp_path / "ckpt")
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 1) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert read_manifest(tmp_path / "ckpt") == before
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 1, "--overwrite") == 0
    assert read_manifest(tmp_path / "ckpt")["parallel_layout"]["tp"] == 2
    os.makedirs(tmp_path / "precious")
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    assert convert("import-hf", hf_dir, tmp_path / "precious", "--tp", 1, "--pp", 1, "--ep", 1, "--overwrite") == 1
    assert "refusing to replace it" in capsys.readouterr().err
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "ckpt" / "hf") == 1                # inside the input
    assert "overlaps the input" in capsys.readouterr().err


def test_bad_checkpoints_fail_cleanly(hf_models, tmp_path, capsys):
    hf_dir, _ = hf_models("olmoe")
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 1) == 0
    assert convert("inspect", tmp_path / "ckpt") == 0
    assert "checksums    OK" in capsys.readouterr().out

    # From scratch (no HF config): not exportable, said clearly.
    from megamoe.checkpoint.format import save_checkpoint
    from megamoe.checkpoint.manifest_fields import model_config_from_manifest
    from megamoe.checkpoint_state import sharded_state_dict
    from megamoe.models import GPTMoEModel
    from parallel_state import ParallelState
    config = dataclasses.replace(model_config_from_manifest(read_manifest(tmp_path / "ckpt")), family="custom")
    model = GPTMoEModel(config, ParallelState.single_process())
    save_checkpoint(tmp_path / "scratch", sharded_state_dict(model), manifest_fields={"model_config": config.to_dict()})
    assert convert("export-hf", tmp_path / "scratch", tmp_path / "out") == 1
    assert "family 'custom', which has no HuggingFace equivalent" in capsys.readouterr().err
    config = dataclasses.replace(config, family="olmoe")
    save_checkpoint(tmp_path / "scratch2", sharded_state_dict(GPTMoEModel(config, ParallelState.single_process())),
                    manifest_fields={"model_config": config.to_dict()})
    assert convert("export-hf", tmp_path / "scratch2", tmp_path / "out") == 1
    assert "holds no HuggingFace config" in capsys.readouterr().err

    # A damaged file: inspect reports it (exit 1); export and reshard refuse to read it.
    part = glob.glob(str(tmp_path / "ckpt" / "part-*.safetensors"))[0]
    with open(part, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    assert convert("inspect", tmp_path / "ckpt") == 1
    assert "checksum mismatch" in capsys.readouterr().out
    with open(part, "r+b") as f:
        f.truncate(os.path.getsize(part) - 8)
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "out") == 1
    assert convert("reshard", tmp_path / "ckpt", tmp_path / "out", "--tp", 1, "--pp", 1, "--ep", 1) == 1
    assert "truncated or overwritten" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
    assert convert("reshard", tmp_path / "scratch", tmp_path / "out", "--tp", 3, "--pp", 1, "--ep", 1) == 1
    assert "impossible" in capsys.readouterr().err
    assert convert("reshard", tmp_path / "scratch", tmp_path / "out", "--tp", 100000, "--pp", 1, "--ep", 1) == 1
    assert "--tp 100000 must divide the 4 attention heads" in capsys.readouterr().err    # at once, not in minutes


def test_module_entry_point_reports_errors_without_traceback(tmp_path):
    run = subprocess.run([sys.executable, "-m", "megamoe", "convert", "import-hf", str(tmp_path / "none"),
                          str(tmp_path / "out"), "--tp", "1", "--pp", "1", "--ep", "1"], capture_output=True, text=True)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("megamoe convert import-hf: error:")
    for command in ("import-hf", "export-hf", "reshard", "inspect", "verify"):
        assert convert(command, "--help") == 0


@pytest.mark.slow
def test_verify_command(hf_models, tmp_path, capsys):
    hf_dir, _ = hf_models("deepseek_v3")
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 1, "--pp", 2, "--ep", 1) == 0
    assert convert("verify", tmp_path / "ckpt", "--hf", hf_dir) == 0
    assert "\nOK: max abs logit difference" in capsys.readouterr().out
    other = tmp_path / "other"
    save_hf_model(other, "deepseek_v3", seed=1)                        # same shapes, other weights
    assert convert("verify", tmp_path / "ckpt", "--hf", other, "--nproc", 4) == 1
    assert "FAILED: max abs logit difference" in capsys.readouterr().out
    part = glob.glob(str(tmp_path / "ckpt" / "part-*.safetensors"))[0]
    with open(part, "r+b") as f:
        f.truncate(os.path.getsize(part) - 8)
    assert convert("verify", tmp_path / "ckpt", "--hf", hf_dir) == 1
    err = capsys.readouterr().err
    assert "running the checkpoint on 2 ranks failed" in err and "truncated" in err and "Traceback" not in err
