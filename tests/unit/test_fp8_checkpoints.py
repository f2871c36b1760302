"""Block-FP8 HF checkpoints (DeepSeek's layout: e4m3 weights + ``*.weight_scale_inv`` per block), made here by
quantizing tiny random models: imported dequantized they give transformers' own FP8 loader's logits, imported
kept they export back byte for byte (also from a TP2 x EP2 layout), exported dequantized they load in
transformers; ue8m0 scales and unquantized modules pass; every inconsistent release is refused cleanly.

The oracle is transformers' ``FineGrainedFP8Config(dequantize=True)`` where it applies. It cannot dequantize
partial edge blocks (transformers 5.24 derives the block from ``rows // scale_rows``: a ValueError, or wrong
blocks when that divides), so releases with partial blocks are checked against the published definition
``w[i, j] = q[i, j] * scale_inv[i // bo, j // bi]``, written out here with index arithmetic.
"""

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from megamoe.checkpoint.format import iter_logical_tensors, read_manifest
from megamoe.quantization.block_fp8 import is_block_fp8_weight, quantize_block_fp8
from tests.helpers.hf_checkpoints import assert_same_tensors, convert, hf_tensors, ids, save_hf_model
from tests.helpers.hf_models import V, lazy_transformers


SCALE = "_scale_inv"


def _partial_block_config():
    """DeepSeek-V3 sized so that [8, 8] blocks leave partial ones (hidden 36, q_lora 12, kv_a 20 rows, expert
    ffn 24 x hidden 36) while every TP2 shard is whole blocks (q_b 24, kv_b 32, o_proj 16, dense 16, shared 24)."""
    return lazy_transformers().DeepseekV3Config(
        vocab_size=V, hidden_size=36, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        rms_norm_eps=1e-5, num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, q_lora_rank=12, intermediate_size=32, moe_intermediate_size=24, n_routed_experts=8,
        n_shared_experts=2, first_k_dense_replace=1, num_hidden_layers=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5)


def _quantizable_hf_keys(hf_dir):
    from megamoe.hf.adapters import adapter_for
    from megamoe.hf.import_hf import model_config_from_hf
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = model_config_from_hf(json.load(f), hf_dir, hf_keys=hf_tensors(hf_dir))     # MTP layers too
    return {hf for name, hf in adapter_for(config.family).renames(config).items() if is_block_fp8_weight(name)}


def make_fp8_release(source, target, block, *, scale_fmt="float", scale_dtype=None, not_converted=(),
                     edit=None, **quantization):
    """``source`` (an unquantized HF directory) as a block-FP8 release in ``target``: each linear weight a
    block-FP8 release quantizes becomes e4m3 + ``weight_scale_inv`` (``scale_dtype``, default the format's),
    except the modules matching ``not_converted`` (listed in modules_to_not_convert, left as they are)."""
    from megamoe.hf.hf_quantization import module_is_listed
    os.makedirs(target)
    state = {}
    for key, tensor in hf_tensors(source).items():
        if key in _quantizable_hf_keys(source) and not module_is_listed(key.removesuffix(".weight"), not_converted):
            q, scale = quantize_block_fp8(tensor, tuple(block), scale_fmt)
            state[key], state[key + SCALE] = q, scale if scale_dtype is None else scale.to(scale_dtype)
        else:
            state[key] = tensor
    if edit:
        edit(state)
    # Every scale in the second shard, away from its weight: the import reads each pair together anyway.
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in state.items() if not k.endswith(SCALE)},
             "model-00002-of-00002.safetensors": {k: v for k, v in state.items() if k.endswith(SCALE)}}
    for name, part in files.items():
        save_file(part, os.path.join(target, name), metadata={"format": "pt"})
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: name for name, part in files.items() for k in part}}, f)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    if quantization.get("quant_method", "fp8") is not None:      # None: the FP8 files under the plain config.json
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
            **({"scale_fmt": scale_fmt} if scale_fmt != "float" else {}),
            **({"modules_to_not_convert": list(not_converted)} if not_converted else {}), **quantization}
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    return str(target)


def dequantized_by_definition(state, block):
    """The HF state with every (weight, weight_scale_inv) pair replaced by q[i, j] * s[i // bo, j // bi]."""
    out = {}
    for key, tensor in state.items():
        if key.endswith(SCALE):
            continue
        if key + SCALE in state:
            rows, cols = tensor.shape
            scale = state[key + SCALE].float()
            per_element = scale[torch.arange(rows) // block[0]][:, torch.arange(cols) // block[1]]
            tensor = tensor.float() * per_element
        out[key] = tensor
    return out


def _logical(hf_state, hf_dir):
    from megamoe.hf.adapters import adapter_for
    from megamoe.hf.import_hf import model_config_from_hf
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = model_config_from_hf(json.load(f), hf_dir)
    return adapter_for(config.family).hf_to_megamoe(hf_state, config)


def _logits_of_checkpoint(checkpoint):
    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from parallel_state import ParallelState
    model = build_model_from_checkpoint(checkpoint, ParallelState.single_process()).eval()
    with torch.no_grad():
        return model(ids())[0]


def _bytes_equal(actual, expected, what):
    assert set(actual) == set(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))[:6]}"
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, f"{what}: {key} is {actual[key].dtype}, not {tensor.dtype}"
        assert torch.equal(actual[key].view(torch.uint8), tensor.view(torch.uint8)), f"{what}: {key} differs"


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """(unquantized HF directory, its [8, 8]-block FP8 release) of the partial-block DeepSeek-V3."""
    root = tmp_path_factory.mktemp("fp8")
    save_hf_model(root / "ds", "deepseek_v3", config=_partial_block_config())
    return str(root / "ds"), make_fp8_release(root / "ds", root / "ds_fp8", (8, 8))


# ----------------------------------------------------------------------------------------------
# Dequantized import: transformers' FP8 loader is the oracle
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, block", [("deepseek_v3", (4, 4)), ("qwen3_moe", (8, 8)), ("glm4_moe", (4, 4)),
                                           ("minimax_m2", (4, 4))])
def test_dequantized_import_matches_transformers_fp8_loader(family, block, tmp_path):
    """Blocks dividing every weight (what transformers' dequantization handles), several per weight."""
    t = lazy_transformers()
    save_hf_model(tmp_path / "hf", family)
    fp8_dir = make_fp8_release(tmp_path / "hf", tmp_path / "fp8", block)
    oracle, info = t.AutoModelForCausalLM.from_pretrained(
        fp8_dir, quantization_config=t.FineGrainedFP8Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info                                 # every tensor used, none missing
    with torch.no_grad():
        expected = oracle.eval()(input_ids=ids()).logits
    assert convert("import-hf", fp8_dir, tmp_path / "ckpt", "--tp", 1, "--pp", 1, "--ep", 1, "--dtype", "fp32") == 0
    manifest = read_manifest(tmp_path / "ckpt")
    assert manifest["model_config"].get("weight_quantization") is None
    assert {e["dtype"] for e in manifest["tensors"].values()} == {"float32"}
    diff = (_logits_of_checkpoint(tmp_path / "ckpt") - expected).abs().max().item()
    assert diff <= 1e-5, diff
    # An ordinary checkpoint: it exports without quantization_config, and transformers computes the same.
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in exported and exported["dtype"] == "float32"
    plain = t.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        assert (plain.eval()(input_ids=ids()).logits - expected).abs().max().item() <= 1e-5


def test_partial_blocks_dequantize_by_definition(partial, tmp_path):
    hf_dir, fp8_dir = partial
    fp8 = hf_tensors(fp8_dir)
    assert fp8["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (3, 5)     # 20 x 36
    reference = _logical(dequantized_by_definition(fp8, (8, 8)), hf_dir)
    assert convert("import-hf", fp8_dir, tmp_path / "fp32", "--tp", 2, "--pp", 1, "--ep", 2, "--dtype", "fp32") == 0
    assert_same_tensors(dict(iter_logical_tensors(tmp_path / "fp32")), reference, "fp32 import")
    assert convert("import-hf", fp8_dir, tmp_path / "bf16", "--tp", 1, "--pp", 1, "--ep", 1, "--dtype", "bf16") == 0
    assert_same_tensors(dict(iter_logical_tensors(tmp_path / "bf16")),
                        {k: v.to(torch.bfloat16) for k, v in reference.items()}, "bf16 import")


# ----------------------------------------------------------------------------------------------
# Kept FP8: bytes in, bytes out
# ----------------------------------------------------------------------------------------------
def test_kept_round_trip_is_byte_identical(partial, tmp_path, capsys):
    hf_dir, fp8_dir = partial
    original = hf_tensors(fp8_dir)
    # ETP 2 would cut the experts' 24 FFN rows into shards of 12, sharing the blocks of 8: refused, not written.
    assert convert("import-hf", fp8_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 2, "--etp", 2) == 1
    assert "not a multiple of the FP8 block" in capsys.readouterr().err and not os.path.exists(tmp_path / "ckpt")
    assert convert("import-hf", fp8_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 2, "--etp", 1) == 0
    manifest = read_manifest(tmp_path / "ckpt")
    quantization = manifest["model_config"]["weight_quantization"]
    assert quantization["block_size"] == [8, 8] and quantization["scale_fmt"] == "float"
    q_b = manifest["tensors"]["layers.1.self_attn.q_b_proj.weight_scale_inv"]
    assert q_b["dtype"] == "float32" and [c["offsets"] for c in q_b["chunks"]] == [[0, 0], [3, 0]]   # TP2 rows
    assert manifest["tensors"]["layers.1.mlp.experts.3.gate_proj.weight"]["dtype"] == "float8_e4m3fn"

    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "out", "--max-shard-size", "20KB") == 0
    _bytes_equal(hf_tensors(tmp_path / "out"), original, "kept import -> export")
    with open(os.path.join(fp8_dir, "config.json")) as f:
        assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.load(f)
    # Through another layout and slot count (scales move with their experts), back into one file.
    assert convert("reshard", tmp_path / "ckpt", tmp_path / "pp2", "--tp", 1, "--pp", 2, "--ep", 4,
                   "--num-expert-slots", 12) == 0
    assert convert("export-hf", tmp_path / "pp2", tmp_path / "again") == 0
    _bytes_equal(hf_tensors(tmp_path / "again"), original, "kept import -> reshard -> export")

    assert convert("inspect", tmp_path / "ckpt") == 0
    text = capsys.readouterr().out
    assert re.search(r"block FP8 +\d+ e4m3 weights in 8x8 blocks, scales float32", text), text
    assert "8 x layers.*.mlp.experts.*.gate_proj.weight" in text
    assert convert("inspect", fp8_dir, "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quant_method"] == "fp8" and info["block_fp8"]["block_size"] == [8, 8]
    assert info["block_fp8"]["weights"] == sum(1 for k in original if k + SCALE in original)

    # Dequantized export: transformers loads it as an ordinary model, with the definition's weights.
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "bf16", "--dtype", "bf16") == 0
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    expected = {k: v.to(torch.bfloat16) for k, v in dequantized_by_definition(original, (8, 8)).items()}
    assert_same_tensors(hf_tensors(tmp_path / "bf16"), expected, "kept -> bf16 export")
    model, info = lazy_transformers().AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("stored", ["float8_e8m0fnu", "float32"])
def test_ue8m0_scales(stored, partial, tmp_path):
    """ue8m0 scales as one-byte float8_e8m0fnu tensors, or as fp32 powers of two (DeepSeek-V3.1's files)."""
    hf_dir, _ = partial
    fp8_dir = make_fp8_release(hf_dir, tmp_path / "fp8", (8, 8), scale_fmt="ue8m0",
                               scale_dtype=getattr(torch, stored))
    original = hf_tensors(fp8_dir)
    scale = original["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"]
    assert scale.dtype == getattr(torch, stored) and torch.equal(scale.float().log2(), scale.float().log2().round())
    assert convert("import-hf", fp8_dir, tmp_path / "deq", "--tp", 1, "--pp", 1, "--ep", 1, "--dtype", "fp32") == 0
    assert_same_tensors(dict(iter_logical_tensors(tmp_path / "deq")),
                        _logical(dequantized_by_definition(original, (8, 8)), hf_dir), "ue8m0 import")
    assert convert("import-hf", fp8_dir, tmp_path / "kept", "--tp", 1, "--pp", 1, "--ep", 2) == 0
    kept = read_manifest(tmp_path / "kept")
    assert kept["model_config"]["weight_quantization"]["scale_fmt"] == ("ue8m0" if stored != "float32" else "float")
    assert convert("export-hf", tmp_path / "kept", tmp_path / "out") == 0
    _bytes_equal(hf_tensors(tmp_path / "out"), original, f"ue8m0 ({stored}) round trip")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"


def test_modules_to_not_convert_pass_through(partial, tmp_path):
    hf_dir, _ = partial
    listed = ["model.layers.0.self_attn", "model.layers.1.mlp.shared_experts"]   # prefixes at module boundaries
    fp8_dir = make_fp8_release(hf_dir, tmp_path / "fp8", (8, 8), not_converted=listed)
    original = hf_tensors(fp8_dir)
    assert original["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float32
    assert original["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert convert("import-hf", fp8_dir, tmp_path / "kept", "--tp", 2, "--pp", 1, "--ep", 1, "--etp", 1) == 0
    unquantized = read_manifest(tmp_path / "kept")["model_config"]["weight_quantization"]["unquantized"]
    assert "layers.0.self_attn.q_a_proj.weight" in unquantized and "layers.1.mlp.shared_experts.up_proj" in unquantized
    assert "layers.1.self_attn.q_a_proj.weight" not in unquantized
    assert convert("export-hf", tmp_path / "kept", tmp_path / "out") == 0
    _bytes_equal(hf_tensors(tmp_path / "out"), original, "kept with unquantized modules")
    assert convert("import-hf", fp8_dir, tmp_path / "deq", "--tp", 1, "--pp", 1, "--ep", 1, "--dtype", "fp32") == 0
    assert_same_tensors(dict(iter_logical_tensors(tmp_path / "deq")),
                        _logical(dequantized_by_definition(original, (8, 8)), hf_dir), "dequantized, some unquantized")

    # Routed experts are kept FP8 all together (the model stacks them): one left unquantized is read dequantized.
    one_expert = make_fp8_release(hf_dir, tmp_path / "fp8e", (8, 8), not_converted=["model.layers.1.mlp.experts.7"])
    assert convert("import-hf", one_expert, tmp_path / "kept_e", "--tp", 1, "--pp", 1, "--ep", 1) == 1
    assert not os.path.exists(tmp_path / "kept_e")
    assert convert("import-hf", one_expert, tmp_path / "deq_e", "--tp", 1, "--pp", 1, "--ep", 1, "--dtype", "fp32") == 0
    assert_same_tensors(dict(iter_logical_tensors(tmp_path / "deq_e")),
                        _logical(dequantized_by_definition(hf_tensors(one_expert), (8, 8)), hf_dir), "one expert")


# ----------------------------------------------------------------------------------------------
# Bad releases: a named error, exit 1, nothing written
# ----------------------------------------------------------------------------------------------
Q_B = "model.layers.1.self_attn.q_b_proj.weight"
BAD_FP8 = {   # name: (make_fp8_release options, expected message)
    "missing weight_scale_inv": (dict(edit=lambda s: s.pop(Q_B + SCALE)),
                                 f"'{Q_B}' is torch.float8_e4m3fn but '{Q_B}_scale_inv' is missing"),
    "scale of the wrong shape": (dict(edit=lambda s: s.update({Q_B + SCALE: torch.ones(6, 1)})),
                                 rf"'{Q_B}_scale_inv' has shape \(6, 1\), the config expects \(6, 2\)"),
    "scale of an unknown weight": (dict(edit=lambda s: s.update({"model.norm.weight_scale_inv": torch.ones(1, 1)})),
                                   "'model.norm.weight_scale_inv' is a block scale of no weight the model quantizes"),
    "listed but quantized": (dict(edit=lambda s: None, modules_to_not_convert=["model.layers.1.self_attn.q_b_proj"]),
                             "lists 'model.layers.1.self_attn.q_b_proj' as not converted, but .* has block scales"),
    "fp8 embedding": (dict(edit=lambda s: s.update({"model.embed_tokens.weight":
                                                    s["model.embed_tokens.weight"].to(torch.float8_e4m3fn)})),
                      "'model.embed_tokens.weight' is torch.float8_e4m3fn; only the linear weights"),
    "unknown fmt": (dict(fmt="e5m2"), r"quantization_config.fmt 'e5m2' is not supported; supported: \['e4m3'\]"),
    "bad block size": (dict(weight_block_size=[8, 0]), "quantization_config.weight_block_size must be two positive"),
    "per-tensor fp8": (dict(weight_block_size=None), "weight_block_size is missing: per-tensor FP8 is not supported"),
    "static activations": (dict(activation_scheme="static"), "activation_scheme 'static' is not supported"),
    "fp8 without quantization_config": (dict(quant_method=None), r"'model\.layers\.[\w.]+\.weight' is "
                                        "torch.float8_e4m3fn, but config.json has no quantization_config"),
    "gptq": (dict(quant_method="gptq", bits=4), r"quant_method 'gptq' is not supported \(supported: fp8, mxfp4\)"),
    "bitsandbytes": (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported"),
}


@pytest.mark.parametrize("case", BAD_FP8)
def test_bad_fp8_release_fails_cleanly(case, partial, tmp_path, capsys):
    options, message = BAD_FP8[case]
    fp8_dir = make_fp8_release(partial[0], tmp_path / "fp8", (8, 8), **options)
    for dtype in ("keep", "bf16"):
        assert convert("import-hf", fp8_dir, tmp_path / "out", "--tp", 1, "--pp", 1, "--ep", 1, "--dtype", dtype) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("megamoe-convert import-hf: error:")
        assert re.search(message, err), err
        assert sorted(os.listdir(tmp_path)) == ["fp8"]                 # no OUT_DIR, no temporary directory


def test_export_refuses_a_config_without_the_fp8_layout(partial, tmp_path, capsys):
    """A kept checkpoint exported with --hf-config of the unquantized release: the config.json would not
    describe the FP8 weights, so it is refused; --dtype bf16 writes the unquantized release."""
    hf_dir, fp8_dir = partial
    assert convert("import-hf", fp8_dir, tmp_path / "ckpt", "--tp", 1, "--pp", 1, "--ep", 1) == 0
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "out", "--hf-config", hf_dir) == 1
    assert "does not describe the checkpoint's block-FP8 weights" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "out", "--hf-config", hf_dir, "--dtype", "fp32") == 0
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_training_starts_from_an_fp8_release_dequantized(partial):
    """start_from_hf (a run started from HF files, in process) reads a block-FP8 release dequantized."""
    from megamoe.models.hf_loading import gather_logical_state
    from megamoe.training.hf_start import start_from_hf
    from parallel_state import ParallelState
    hf_dir, fp8_dir = partial
    model, start = start_from_hf(fp8_dir, ParallelState.single_process())
    assert start.config.weight_quantization is None and "quantization_config" in start.provenance.config
    assert_same_tensors(gather_logical_state(model), _logical(dequantized_by_definition(hf_tensors(fp8_dir), (8, 8)),
                                                              hf_dir), "training start")


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "deepseek_v3 with MTP layers"])
def test_kept_round_trip_of_other_fp8_families(family, mtp_hf_dir, tmp_path, capsys):
    """The families released in block FP8 beside DeepSeek-V3: GLM-4.5's GQA layout, MiniMax-M2's Mixtral-style
    expert names (w1 / w3 / w2 and their scales), and DeepSeek-V3 with its (quantized) MTP layers: kept
    under TP 2 x EP 2, exported byte-identical."""
    if family.startswith("deepseek_v3"):
        hf_dir = mtp_hf_dir
    else:
        hf_dir = tmp_path / "hf"
        save_hf_model(hf_dir, family)
    fp8_dir = make_fp8_release(hf_dir, tmp_path / "fp8", (4, 4))
    original = hf_tensors(fp8_dir)
    assert sum(t.dtype == torch.float8_e4m3fn for t in original.values()) > 20
    if family.startswith("deepseek_v3"):
        assert original["model.layers.3.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn   # MTP layer L
    assert convert("import-hf", fp8_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 2, "--dtype", "keep") == 0
    assert read_manifest(tmp_path / "ckpt")["model_config"]["weight_quantization"] is not None
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0
    exported = hf_tensors(tmp_path / "out")
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key].view(torch.uint8),
                                                                   tensor.view(torch.uint8)), key
