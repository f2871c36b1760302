"""Tiny HF checkpoints on disk, their tensors, and ``python -m checkpoint_tools`` run in this process
(:func:`convert`). Shared by the conversion tests of both tiers and by the other checkpoint tests."""

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.cli.convert import main
from tests.helpers.hf_models import V, hf_config, lazy_transformers  # tiny random HF models of every family
ATOL = 1e-4
SIDE_FILES = {"tokenizer.json": '{"model": {"type": "BPE"}}', "tokenizer_config.json": '{"model_max_length": 64}',
              "special_tokens_map.json": '{"eos_token": "</s>"}'}


def save_hf_model(directory, family, *, seed=0, dtype=torch.float32, sharded=False, config=None):
    """A random HF model of ``family``'s tiny config (or ``config``) written with save_pretrained (norms
    around 1, weights N(0, 0.2^2)) plus side files; returns its logits on ``ids()``."""
    t = lazy_transformers()
    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(config or hf_config(family), attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed + len(family))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=g) * 0.2
            tensor.copy_(1.0 + noise if "norm" in name else noise)
        logits = model(input_ids=ids()).logits
    model.to(dtype).save_pretrained(directory, max_shard_size="40KB" if sharded else "50GB")
    for name, text in SIDE_FILES.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    return logits


def ids(batch=2, seq=9):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(7))


def hf_tensors(directory):
    state = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        state.update(load_file(path))
    return state


def assert_same_tensors(actual, expected, what):
    assert set(actual) == set(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))[:6]}"
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype and torch.equal(actual[key], tensor), f"{what}: {key} differs"


def convert(*argv):
    """Run the CLI in process; the exit code."""
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """family -> (HF directory, fp32 logits on ids()), made once per module; half the families sharded."""
    root = tmp_path_factory.mktemp("hf")
    made = {}

    def get(family):
        if family not in made:
            directory = root / family
            logits = save_hf_model(directory, family, sharded=family in ("qwen2_moe", "deepseek_v3", "mixtral"))
            made[family] = (str(directory), logits)
        return made[family]
    return get


# ----------------------------------------------------------------------------------------------
# Bad input: an error message, a non-zero exit code, nothing at OUT_DIR
# ----------------------------------------------------------------------------------------------
def _single_file_copy(hf_dir, target, edit):
    """``hf_dir`` rewritten as one model.safetensors after ``edit(state)``."""
    os.makedirs(target)
    state = hf_tensors(hf_dir)
    edit(state)
    save_file(state, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    return target
