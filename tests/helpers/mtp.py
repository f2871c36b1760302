"""Shared by tests/unit/test_mtp.py and tests/multirank/test_mtp.py (and other tests): the builders and constants of
the mtp tests."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.models.mtp import shift_left
from tests.helpers.hf_models import V, hf_config, lazy_transformers

L, DEPTHS, S = 3, 2, 9          # the tiny deepseek_v3 has 3 layers; MTP layers 3 and 4


def _decoder_layer_class(family):
    t = lazy_transformers()
    return {"deepseek_v3": t.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer,
            "glm4_moe": t.models.glm4_moe.modeling_glm4_moe.Glm4MoeDecoderLayer}[family]


def _mtp_layer_tensors(hf_cfg, layer_id: int, generator) -> dict[str, torch.Tensor]:
    """One MTP layer's HF checkpoint tensors under ``model.layers.{layer_id}.`` (without the embedding / head
    copies): transformers' own decoder layer with random weights, its fused experts split per expert as
    ``save_pretrained`` writes them, plus enorm / hnorm / eh_proj / shared_head.norm."""
    layer = _decoder_layer_class(hf_cfg.model_type)(hf_cfg, layer_id)
    H = hf_cfg.hidden_size
    own = {"enorm.weight": torch.empty(H), "hnorm.weight": torch.empty(H), "shared_head.norm.weight": torch.empty(H),
           "eh_proj.weight": torch.empty(H, 2 * H)}
    state = {**layer.state_dict(), **own}
    out = {}
    for name, tensor in state.items():
        noise = torch.randn(tensor.shape, generator=generator) * 0.2
        value = 1.0 + noise if "norm" in name else noise
        prefix = f"model.layers.{layer_id}."
        if name == "mlp.experts.gate_up_proj":        # [E, 2F, H] -> per expert gate [F, H], up [F, H]
            F_ = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = value[e, :F_].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = value[e, F_:].clone()
        elif name == "mlp.experts.down_proj":         # [E, H, F] -> per expert [H, F]
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e].clone()
        else:
            out[prefix + name] = value.contiguous()
    return out


def _save_hf_with_mtp(directory, family, depths):
    """A tiny HF directory of ``family`` whose checkpoint also holds ``depths`` MTP layers (with the embedding /
    head copies DeepSeek's and GLM's releases store), config.json declaring them."""
    from tests.helpers.hf_checkpoints import save_hf_model
    save_hf_model(directory, family)
    state = load_file(directory / "model.safetensors")
    hf_cfg = hf_config(family)
    L = hf_cfg.num_hidden_layers
    g = torch.Generator().manual_seed(11)
    for k in range(depths):
        state.update(_mtp_layer_tensors(hf_cfg, L + k, g))
        state[f"model.layers.{L + k}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[f"model.layers.{L + k}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = depths
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def mtp_hf_dir(tmp_path_factory):
    """A tiny deepseek_v3 with 2 MTP layers (see _save_hf_with_mtp)."""
    return _save_hf_with_mtp(tmp_path_factory.mktemp("hf_mtp") / "deepseek_v3", "deepseek_v3", DEPTHS)


def hf_tensors(directory):
    state = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(directory, name)))
    return state


def _config(hf_dir, **engine):
    from megamoe.hf.import_hf import model_config_from_hf
    return model_config_from_hf(json.loads((hf_dir / "config.json").read_text()), str(hf_dir),
                                hf_keys=hf_tensors(hf_dir).keys(), **engine)


def _ids(batch=2, seed=7):
    return torch.randint(0, V, (batch, S), generator=torch.Generator().manual_seed(seed))


def _labels(ids):
    labels = shift_left(ids, 1, -100)
    labels[0, 2] = -100                                  # an ignored target inside the sequence
    return labels
