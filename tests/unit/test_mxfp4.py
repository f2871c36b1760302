"""MXFP4 (gpt-oss's released experts): the dequantization against the OCP MX definition coded here
independently, and import-hf of an MXFP4 gpt-oss checkpoint against transformers' own dequantizing load
(``Mxfp4Config(dequantize=True)``, which runs on CPU), export of the result as an unquantized HF
directory, and bad MXFP4 input failing cleanly.

The MXFP4 checkpoint is built here from a tiny random gpt-oss model (tests/helpers/hf_models.py's config,
hidden 32, expert FFN 32: one 32-block per row) by quantizing its experts with quantize_mxfp4.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.checkpoint.model_loading import build_model_from_checkpoint
from megamoe.quantization.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from parallel_state import ParallelState
from tests.helpers.hf_checkpoints import convert, hf_tensors, ids, save_hf_model
from tests.helpers.hf_models import lazy_transformers

QUANTIZED = ("experts.gate_up_proj", "experts.down_proj")
MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def ocp_e2m1(code: int) -> float:
    """The OCP MX spec's FP4 E2M1 element: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0
    is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def test_dequantize_matches_the_ocp_definition():
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).repeat(3, 1, 1)      # every byte, [3, 16, 16]
    scales = torch.tensor([[127, 0, 250, 1, 130, 100, 127, 127, 126, 140, 127, 127, 50, 200, 127, 128]] * 3,
                          dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales)                                               # [3, 512]
    assert got.shape == (3, 16 * 32) and got.dtype == torch.float32
    for row in range(3):
        for g in range(16):
            for j in range(16):
                byte, scale = int(blocks[row, g, j]), 2.0 ** (int(scales[row, g]) - 127)
                low, high = ocp_e2m1(byte & 0xF) * scale, ocp_e2m1(byte >> 4) * scale       # low nibble first
                assert got[row, g * 32 + 2 * j].item() == low and got[row, g * 32 + 2 * j + 1].item() == high
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), got.to(torch.bfloat16))   # exact in bf16
    # quantize_mxfp4 inverts it on values it can hold, and stays within MXFP4's error elsewhere.
    representable = dequantize_mxfp4(blocks[:, :, :], torch.full((3, 16), 120, dtype=torch.uint8))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(representable)), representable)
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    error = (dequantize_mxfp4(*quantize_mxfp4(w)) - w).abs().unflatten(-1, (2, 32))
    assert (error <= 0.25 * w.abs().unflatten(-1, (2, 32)).amax(-1, keepdim=True)).all()
    with pytest.raises(ValueError, match=r"scales must be \(3, 16\)"):
        dequantize_mxfp4(blocks, scales[:, :15])
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.float(), scales)


def _write_mxfp4(plain_dir, out_dir, edit=None):
    """``plain_dir``'s gpt-oss checkpoint with its experts stored as released: MXFP4 blocks + scales of
    the rows of gate_up_proj [E, 2F, H] and down_proj [E, H, F], and a quantization_config."""
    state = {}
    for key, tensor in hf_tensors(plain_dir).items():
        if key.endswith(QUANTIZED):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))       # HF's [E, H, 2F] -> rows [E, 2F, H]
            state[key + "_blocks"], state[key + "_scales"] = blocks.contiguous(), scales.contiguous()
        else:
            state[key] = tensor
    if edit:
        edit(state)
    os.makedirs(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(plain_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_CONVERTED}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    save_hf_model(root / "plain", "gpt_oss")
    return _write_mxfp4(str(root / "plain"), str(root / "mxfp4"))


def _hf_logits(model):
    with torch.no_grad():
        return model(input_ids=ids()).logits


def _our_logits(model):
    with torch.no_grad():
        return model(ids())[0]


def test_mxfp4_import_matches_transformers(mxfp4_dir, tmp_path):
    t = lazy_transformers()
    oracle = t.AutoModelForCausalLM.from_pretrained(mxfp4_dir, quantization_config=t.Mxfp4Config(dequantize=True),
                                                    attn_implementation="eager", dtype=torch.float32).eval()
    expected = _hf_logits(oracle)
    assert convert("import-hf", mxfp4_dir, tmp_path / "ckpt", "--tp", 1, "--pp", 1, "--ep", 1, "--dtype", "fp32") == 0
    model = build_model_from_checkpoint(tmp_path / "ckpt", ParallelState.single_process()).eval()
    diff = (_our_logits(model) - expected).abs().max().item()
    assert diff <= 1e-5, f"MXFP4 import: logits differ from transformers' dequantized model by {diff:.2e}"

    # Export: an unquantized gpt-oss directory holding transformers' dequantized weights, bit for bit.
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "hf_out") == 0
    with open(tmp_path / "hf_out" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    exported = hf_tensors(tmp_path / "hf_out")
    for key, tensor in oracle.state_dict().items():
        assert torch.equal(exported[key], tensor), key
    reloaded = t.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", attn_implementation="eager").eval()
    assert torch.equal(_hf_logits(reloaded), expected)

    # bf16: the same values (MXFP4 values are exact in bf16), under a sharded layout.
    assert convert("import-hf", mxfp4_dir, tmp_path / "bf16", "--tp", 2, "--pp", 1, "--ep", 2, "--etp", 2,
                   "--dtype", "bf16") == 0
    assert convert("export-hf", tmp_path / "bf16", tmp_path / "hf_bf16") == 0
    bf16 = hf_tensors(tmp_path / "hf_bf16")
    for key in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
        assert bf16[key].dtype == torch.bfloat16 and torch.equal(bf16[key], exported[key].to(torch.bfloat16))


def _wrong_scales(state):
    key = "model.layers.1.mlp.experts.gate_up_proj_scales"
    state[key] = state[key][:, :, :0].contiguous()


BAD_MXFP4 = {   # name: (edit of the MXFP4 state dict, import options, expected message)
    "kept MXFP4": (None, ["--dtype", "keep"], "holds MXFP4 weights, which import dequantizes: choose --dtype bf16 "
                                              "or fp32"),
    "fp16": (None, ["--dtype", "fp16"], "choose --dtype bf16 or fp32"),
    "wrong scales shape": (_wrong_scales, ["--dtype", "fp32"],
                           r"'model.layers.1.mlp.experts.gate_up_proj_scales' has shape \(8, 64, 0\), the config "
                           r"expects \(8, 64, 1\)"),
    "missing scales": (lambda s: s.pop("model.layers.0.mlp.experts.down_proj_scales"), ["--dtype", "fp32"],
                       r"dequantize the MXFP4 down_proj: got 1 of its 2 HF keys, missing "
                       r"\['model.layers.0.mlp.experts.down_proj_scales'\]"),
}


@pytest.mark.parametrize("case", BAD_MXFP4)
def test_bad_mxfp4_input_fails_cleanly(case, mxfp4_dir, tmp_path, capsys):
    import re
    edit, options, message = BAD_MXFP4[case]
    source = mxfp4_dir
    if edit:
        plain = tmp_path / "plain"
        os.makedirs(plain)
        shutil.copy(os.path.join(os.path.dirname(mxfp4_dir), "plain", "config.json"), plain / "config.json")
        save_file(load_file(os.path.join(os.path.dirname(mxfp4_dir), "plain", "model.safetensors")),
                  str(plain / "model.safetensors"))
        source = _write_mxfp4(str(plain), str(tmp_path / "bad"), edit)
    out = tmp_path / "out"
    assert convert("import-hf", source, out, "--tp", 1, "--pp", 1, "--ep", 1, *options) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("megamoe-convert import-hf: error:")
    assert re.search(message, err), err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
