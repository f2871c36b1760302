"""HF families end to end (fp32): config_from_hf + the checkpoint adapters + load_logical_state give a
GPTMoEModel whose logits equal transformers' for tiny random models of every family, single process and
under several parallel layouts; the adapters round-trip both HF forms bitwise and reject bad input.
"""

import dataclasses
import json
import os
import tempfile

import pytest
import torch

from megamoe.hf.adapters import AdapterError, adapter_for
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.models.families import SUPPORTED_FAMILIES, config_from_hf
from megamoe.models.hf_loading import gather_logical_state, load_logical_state
from parallel_state import ParallelState
from tests.helpers.hf_models import ATOL, _hf_logits, _ids, hf_config, hf_model, lazy_transformers


def _checkpoint_form(model):
    """What save_pretrained writes (read back with safetensors)."""
    from safetensors.torch import load_file
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        state = {}
        for name in sorted(os.listdir(d)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(d, name)))
    return state


def _assert_bitwise(actual, expected, what):
    assert set(actual) == set(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))[:6]}"
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype and torch.equal(actual[key], tensor), f"{what}: {key} differs"


# ----------------------------------------------------------------------------------------------
# Single process
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_family_matches_transformers(family):
    hf, config = hf_model(family)
    adapter = adapter_for(family)
    fused_state = hf.state_dict()           # transformers 5.24 in memory: experts fused [E, 2F, H] / [E, H, F]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused_state)
    logical = adapter.hf_to_megamoe(fused_state, config)

    model = GPTMoEModel(config, ParallelState.single_process())
    assert load_logical_state(model, logical) == []             # every logical tensor used, none missing
    ids = _ids(2)
    with torch.no_grad():
        logits, _ = model(ids)
    expected = _hf_logits(hf, ids)
    diff = (logits - expected).abs().max().item()
    assert diff <= ATOL, f"{family}: logits differ by {diff:.2e}"
    _assert_bitwise(gather_logical_state(model), logical, f"{family} gather")

    # In-memory (fused) form round trip; the tied lm_head alias is the one key dropped on import.
    kept = {k: v for k, v in fused_state.items() if not adapter.is_ignored(k, config)}
    _assert_bitwise(adapter.megamoe_to_hf(logical, config, fused=True), kept, f"{family} fused round trip")
    # Checkpoint form: save_pretrained writes per-expert keys (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2);
    # gpt-oss has no conversion mapping: its checkpoint form is the fused one.
    on_disk = _checkpoint_form(hf)
    if family == "gpt_oss":
        _assert_bitwise(on_disk, fused_state, "gpt_oss checkpoint form = in-memory form")
    else:
        assert not any("gate_up_proj" in k for k in on_disk)
        per_expert = ("block_sparse_moe.experts.0.w1.weight" if family in ("mixtral", "minimax_m2")
                      else "mlp.experts.0.gate_proj.weight")
        assert any(k.endswith(per_expert) for k in on_disk)
    _assert_bitwise(adapter.hf_to_megamoe(on_disk, config), logical, f"{family} from checkpoint form")
    _assert_bitwise(adapter.megamoe_to_hf(logical, config, fused=False), on_disk, f"{family} checkpoint round trip")


def test_config_mapping():
    v2, v3 = hf_model("deepseek_v2")[1], hf_model("deepseek_v3")[1]
    assert v2.moe_layer_ids == (1, 2) and v2.dense_mlp.intermediate_size == 24
    assert (v2.moe.router.score_func, v2.moe.router.n_group, v2.moe.router.group_score) == ("softmax", 4, "max")
    assert not v2.moe.router.norm_topk_prob and v2.moe.router.routed_scaling_factor == 2.0
    assert v2.moe.shared_experts.ffn_hidden_size == 32 and not v2.moe.shared_experts.gate
    assert v2.attention.rope.layout == "interleaved" and v2.attention.q_lora_rank is None
    r3 = v3.moe.router
    assert (r3.score_func, r3.group_score, r3.use_expert_bias, r3.norm_topk_prob) == ("sigmoid", "top2_sum", True, True)
    qwen2, qwen3 = hf_model("qwen2_moe")[1], hf_model("qwen3_moe")[1]
    assert qwen2.moe_layer_ids == (0, 2) and qwen2.moe.shared_experts.gate and qwen2.attention.qkv_bias
    assert qwen3.moe_layer_ids == (1,) and qwen3.tie_word_embeddings and qwen3.attention.qk_norm == "per_head"
    assert hf_model("mixtral")[1].attention.sliding_window == 5 and hf_model("mixtral")[1].moe.router.norm_topk_prob
    assert hf_model("olmoe")[1].attention.qk_norm == "full_width"
    glm = hf_model("glm4_moe")[1]
    assert glm.moe_layer_ids == (1, 2) and glm.dense_mlp.intermediate_size == 24 and glm.moe.ffn_hidden_size == 16
    rg = glm.moe.router
    assert (rg.score_func, rg.n_group, rg.topk_group, rg.group_score, rg.routed_scaling_factor) == (
        "sigmoid", 2, 1, "top2_sum", 1.5)
    assert rg.use_expert_bias and rg.norm_topk_prob and (rg.aux_loss_coeff, rg.seq_aux_loss_coeff) == (0.0, 0.0)
    assert glm.moe.shared_experts.ffn_hidden_size == 16 and not glm.moe.shared_experts.gate
    ga = glm.attention
    assert (ga.head_dim, ga.rope.dim, ga.rope.layout, ga.qk_norm, ga.qkv_bias, ga.o_proj_bias) == (
        12, 6, "half", "per_head", True, False)
    minimax = hf_model("minimax_m2")[1]
    assert minimax.moe_layer_ids == (0, 1) and minimax.dense_mlp is None and minimax.moe.shared_experts is None
    rm = minimax.moe.router
    assert (rm.score_func, rm.n_group, rm.routed_scaling_factor, rm.norm_topk_prob, rm.use_expert_bias) == (
        "sigmoid", 1, 1.0, True, True)
    assert rm.aux_loss_coeff == pytest.approx(0.001 * 2)      # router_aux_loss_coef * top_k, for training
    assert config_from_hf(hf_config("minimax_m2"), for_training=False).moe.router.aux_loss_coeff == 0.0
    ma = minimax.attention
    assert (ma.num_key_value_heads, ma.head_dim, ma.rope.dim, ma.rope.theta, ma.qk_norm) == (
        1, 12, 8, 5e6, "full_width")
    no_qk_norm = hf_config("glm4_moe")
    no_qk_norm.use_qk_norm = False
    assert config_from_hf(no_qk_norm).attention.qk_norm is None
    oss = hf_model("gpt_oss")[1]
    assert oss.sliding_window_layer_ids == (0, 2) and oss.attention.sliding_window == 4 and oss.attention.sinks
    assert oss.attention.qkv_bias and oss.attention.o_proj_bias and oss.attention.rope.truncate is False
    assert (oss.moe.activation, oss.moe.expert_bias, oss.moe.swiglu_limit) == ("swiglu_clamped", True, 1.0)
    assert oss.moe.router.bias and oss.moe.router.norm_topk_prob and oss.moe_layer_ids == (0, 1, 2)
    # qwen2_moe's mixed layer_types use the same per-layer choice.
    mixed = lazy_transformers().Qwen2MoeConfig(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1,
                                               sliding_window=5)
    sliding = tuple(i for i, kind in enumerate(mixed.layer_types) if kind == "sliding_attention")
    assert 0 < len(sliding) < 3 and config_from_hf(mixed).sliding_window_layer_ids == sliding
    for family in SUPPORTED_FAMILIES:                          # JSON round trip, nested configs included
        config = hf_model(family)[1]
        assert GPTMoEConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    slots = config_from_hf(hf_config("olmoe"), dispatcher="allgather", num_expert_slots=12)
    assert (slots.moe.dispatcher, slots.moe.num_expert_slots) == ("allgather", 12)


def test_config_errors():
    t = lazy_transformers()
    with pytest.raises(ValueError, match="supported: mixtral, qwen2_moe"):
        config_from_hf(t.LlamaConfig())
    with pytest.raises(ValueError, match="supported: mixtral, qwen2_moe"):
        adapter_for("llama")
    v2 = hf_config("deepseek_v2")
    v2.moe_layer_freq = 2
    with pytest.raises(ValueError, match="moe_layer_freq"):
        config_from_hf(v2)
    with pytest.raises(ValueError, match="sliding_window_layer_ids needs attention.sliding_window"):
        dataclasses.replace(hf_model("olmoe")[1], sliding_window_layer_ids=(0,))
    odd = hf_config("glm4_moe")
    odd.rope_parameters["partial_rotary_factor"] = 0.25              # 3 of 12 head dims: not pairs
    with pytest.raises(ValueError, match="partial_rotary_factor.*rotates 3 of the 12"):
        config_from_hf(odd)
    partial_qwen = hf_config("qwen3_moe")                           # transformers' qwen3_moe rotates whole heads
    partial_qwen.rope_parameters["partial_rotary_factor"] = 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor.*only glm4_moe and minimax_m2"):
        config_from_hf(partial_qwen)
    softmax = hf_config("minimax_m2")
    softmax.scoring_func = "softmax"                                 # config.json field transformers never reads
    with pytest.raises(ValueError, match="minimax_m2: scoring_func='softmax' is not supported"):
        config_from_hf(softmax)
    per_head = hf_config("minimax_m2")
    per_head.qk_norm_type = "per_head"
    with pytest.raises(ValueError, match="qk_norm_type='per_head'"):
        config_from_hf(per_head)
    lightning = hf_config("minimax_m2")
    lightning.attn_type_list = [1, 0]
    with pytest.raises(ValueError, match=r"attn_type_list \[1, 0\] has layers other than 1"):
        config_from_hf(lightning)
    released = hf_config("minimax_m2")                               # the fields MiniMax-M2's config.json sets
    for name, value in dict(scoring_func="sigmoid", use_routing_bias=True, shared_intermediate_size=0,
                            use_qk_norm=True, qk_norm_type="per_layer", attn_type_list=[1, 1]).items():
        setattr(released, name, value)
    assert config_from_hf(released, expert_backend="torch") == hf_model("minimax_m2")[1]
    gelu = hf_config("minimax_m2")
    gelu.hidden_act = "gelu"
    with pytest.raises(ValueError, match="minimax_m2: hidden_act 'gelu'"):
        config_from_hf(gelu)
    data = hf_model("olmoe")[1].to_dict()
    data["moe"]["router"]["temperature"] = 1.0
    with pytest.raises(ValueError, match="temperature.*moe.router"):
        GPTMoEConfig.from_dict(data)


def test_adapter_rejects_bad_input():
    hf, config = hf_model("deepseek_v3")
    adapter = adapter_for("deepseek_v3")
    state = dict(hf.state_dict())
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    with pytest.raises(AdapterError, match="unexpected HF key 'model.layers.1.mlp.bogus'"):
        adapter.hf_to_megamoe({**state, "model.layers.1.mlp.bogus": torch.zeros(1)}, config)
    with pytest.raises(AdapterError, match=f"missing HF key for 'layers.1.mlp.router.expert_bias'.*'{key}'"):
        adapter.hf_to_megamoe({k: v for k, v in state.items() if k != key}, config)
    with pytest.raises(AdapterError, match=r"'model.layers.2.mlp.experts.gate_up_proj' has shape \(8, 30, 32\)"):
        adapter.hf_to_megamoe({**state, "model.layers.2.mlp.experts.gate_up_proj": torch.zeros(8, 30, 32)}, config)
    with pytest.raises(AdapterError, match="given twice"):           # fused and per-expert form of one expert
        adapter.hf_to_megamoe({**state, "model.layers.1.mlp.experts.3.up_proj.weight": torch.zeros(16, 32)}, config)
    # DeepSeek-V3's multi-token-prediction layer (after the last layer) is skipped, as transformers does.
    mtp = {**state, "model.layers.3.eh_proj.weight": torch.zeros(4, 4)}
    assert set(adapter.hf_to_megamoe(mtp, config)) == set(adapter.hf_to_megamoe(state, config))
    logical = adapter.hf_to_megamoe(state, config)
    del logical["layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(AdapterError, match="missing .*experts.5.up_proj"):
        adapter.megamoe_to_hf(logical, config, fused=True)
    model = GPTMoEModel(config, ParallelState.single_process())
    with pytest.raises(ValueError, match="missing: 'layers.2.mlp.experts.5.up_proj.weight'"):
        load_logical_state(model, logical)
    logical["layers.2.mlp.experts.5.up_proj.weight"] = torch.zeros(16, 31)
    with pytest.raises(ValueError, match=r"experts.5.up_proj.weight' has shape \(16, 31\)"):
        load_logical_state(model, logical)


def test_new_family_adapters_reject_bad_input():
    """MiniMax-M2's block-level expert bias is required in either form; GLM-4.5's MTP layer (after the
    last layer) is skipped by a config built without it, as transformers skips it."""
    hf, config = hf_model("minimax_m2")
    adapter = adapter_for("minimax_m2")
    on_disk = _checkpoint_form(hf)
    key = "model.layers.1.block_sparse_moe.e_score_correction_bias"
    assert key in on_disk and "model.layers.1.mlp.e_score_correction_bias" in hf.state_dict()
    with pytest.raises(AdapterError, match=f"missing HF key for 'layers.1.mlp.router.expert_bias'.*'{key}'"):
        adapter.hf_to_megamoe({k: v for k, v in on_disk.items() if k != key}, config)
    with pytest.raises(AdapterError, match=f"'{key}' has shape \\(4,\\)"):
        adapter.hf_to_megamoe({**on_disk, key: torch.zeros(4)}, config)
    hf, config = hf_model("glm4_moe")
    adapter = adapter_for("glm4_moe")
    state = dict(hf.state_dict())
    mtp = {**state, "model.layers.3.eh_proj.weight": torch.zeros(32, 64),
           "model.layers.3.enorm.weight": torch.ones(32)}
    assert set(adapter.hf_to_megamoe(mtp, config)) == set(adapter.hf_to_megamoe(state, config))
    q_norm = "model.layers.2.self_attn.q_norm.weight"
    with pytest.raises(AdapterError, match="missing HF key for 'layers.2.self_attn.q_norm.weight'"):
        adapter.hf_to_megamoe({k: v for k, v in state.items() if k != q_norm}, config)


def test_adapter_streams_in_any_order():
    """The iterator form takes keys in any order, holding only unfinished steps' inputs."""
    hf, config = hf_model("qwen2_moe")
    adapter = adapter_for("qwen2_moe")
    logical = adapter.hf_to_megamoe(hf.state_dict(), config)
    shuffled = [(k, logical[k]) for k in sorted(logical, key=lambda k: hash(k[::-1]))]
    streamed = dict(adapter.iter_megamoe_to_hf(iter(shuffled), config, fused=True))
    _assert_bitwise(streamed, adapter.megamoe_to_hf(logical, config, fused=True), "streamed export")


def test_each_family_has_its_own_adapter_module():
    """HF conversion is one module per family (megamoe/hf/families/<model_type>.py, as torchtitan's
    models/<family>/state_dict_adapter.py), each registered under its model_type, one for every supported family."""
    import importlib
    import pkgutil

    import megamoe.hf.families
    from megamoe.hf.adapters import ADAPTERS

    modules = {m.name for m in pkgutil.iter_modules(megamoe.hf.families.__path__)}
    assert modules == set(ADAPTERS) == set(SUPPORTED_FAMILIES)
    for name in modules:
        assert ADAPTERS[name] is importlib.import_module(f"megamoe.hf.families.{name}").ADAPTER
        assert adapter_for(name).model_type == name
