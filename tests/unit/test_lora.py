"""megamoe.lora against PEFT on the transformers models (fp32), merge_lora, LoRA over kept block-FP8 experts,
replica slots, the frozen base and the config's validation."""

import dataclasses

import pytest
import torch

from megamoe.hf.adapters import adapter_for
from megamoe.lora import LoRAConfig, apply_lora, load_lora_state_dict, lora_parameters, lora_state_dict, merge_lora
from megamoe.models import GPTMoEModel
from megamoe.models.hf_loading import gather_logical_state, load_logical_state
from parallel_state import ParallelState
from tests.helpers.fp8_block_weights import kept_case, kept_model
from tests.helpers.hf_models import _ids, hf_model
from tests.helpers.lora import lora_grad_state_dict, peft_lora_state, peft_model, random_adapters, token_loss

SOLO = ParallelState.single_process()


def _model(family, config=None, logical=None):
    hf, hf_config = hf_model(family)
    config = config or hf_config
    model = GPTMoEModel(config, SOLO)
    load_logical_state(model, logical if logical is not None else adapter_for(family).hf_to_megamoe(
        hf.state_dict(), hf_config))
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits, _ = model(ids)
    loss = token_loss(logits, ids)
    loss.backward()
    return loss.detach(), lora_grad_state_dict(model)


def _assert_close_per_tensor(actual, expected, rel):
    assert actual.keys() == expected.keys()
    for key, ref in expected.items():
        scale = ref.abs().max().clamp(min=1e-12)
        err = (actual[key] - ref).abs().max()
        assert err <= rel * scale, f"{key}: max error {err:.3g} against max |ref| {scale:.3g}"


@pytest.mark.parametrize("family,targets", [
    ("qwen3_moe", ("attention", "dense_mlp", "experts", "router")),
    ("deepseek_v3", ("attention", "dense_mlp", "shared_experts", "experts", "router")),
])
def test_same_loss_and_adapter_gradients_as_peft(family, targets):
    """The same adapters in PEFT (fused 3-D experts through target_parameters) and in megamoe: the same loss and
    the same gradient of every adapter, experts included (fp32, 1e-5 relative)."""
    hf, config = hf_model(family)
    lora = LoRAConfig(rank=4, alpha=8, targets=targets)
    reference = peft_model(hf, lora).train()
    ids = _ids(2)
    ref_loss = token_loss(reference(input_ids=ids).logits, ids)
    ref_loss.backward()
    model = _model(family).train()
    apply_lora(model, lora)
    adapters = peft_lora_state(reference, family, config)
    assert adapters.keys() == lora_state_dict(model).keys()
    load_lora_state_dict(model, adapters)
    loss, grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
    _assert_close_per_tensor(grads, peft_lora_state(reference, family, config, grad=True), 1e-5)


def test_base_frozen_and_only_adapters_trained():
    """apply_lora freezes every base weight; backward leaves them without gradients, the adapters get theirs."""
    model = _model("qwen3_moe").train()
    apply_lora(model, LoRAConfig(rank=2, alpha=4))
    adapters = {id(p) for p in lora_parameters(model)}
    assert adapters and {id(p) for p in model.parameters() if p.requires_grad} == adapters
    _loss_and_grads(model, _ids(1))
    assert all(p.grad is None for p in model.parameters() if id(p) not in adapters)
    # B starts at zero (the adapted model is the base), so only B has a gradient on the first step
    assert all(p.grad is not None for p in lora_parameters(model))


def test_merge_lora_gives_the_adapted_model():
    """merge_lora(state, adapters) loaded into a plain model computes the adapted model's logits."""
    family = "deepseek_v3"
    hf, config = hf_model(family)
    lora = LoRAConfig(rank=4, alpha=16)
    adapted = _model(family).eval()
    base_state = gather_logical_state(adapted)
    apply_lora(adapted, lora)
    adapters = random_adapters(adapted, seed=3)
    merged = _model(family, logical=merge_lora(base_state, adapters, lora)).eval()
    ids = _ids(2)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids)[0], adapted(ids)[0], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(_model(family).eval()(ids)[0], adapted(ids)[0], atol=1e-3)


def test_merge_lora_refuses_bad_adapters():
    lora = LoRAConfig(rank=2, alpha=2)
    state = {"w": torch.zeros(3, 4)}
    with pytest.raises(ValueError, match="no base weight x"):
        merge_lora(state, {"x.lora_A": torch.zeros(2, 4), "x.lora_B": torch.zeros(3, 2)}, lora)
    with pytest.raises(ValueError, match="w has lora_A but not lora_B"):
        merge_lora(state, {"w.lora_A": torch.zeros(2, 4)}, lora)
    with pytest.raises(ValueError, match=r"w is \(3, 4\) but its adapter"):
        merge_lora(state, {"w.lora_A": torch.zeros(2, 5), "w.lora_B": torch.zeros(3, 2)}, lora)


def test_lora_over_kept_block_fp8_experts():
    """LoRA over frozen kept block-FP8 weights (no FP8 recipe: dequantized per slot, forward and backward) equals
    LoRA over the dequantized weights in high precision; the FP8 bytes are untouched by training."""
    kept_config, kept, dequantized, config = kept_case("deepseek_v3", recipe=None)
    lora = LoRAConfig(rank=4, alpha=8)
    fp8_model = kept_model(kept_config, kept).train()
    plain = _model("deepseek_v3", config=dataclasses.replace(kept_config, weight_quantization=None),
                   logical=dequantized).train()
    before = {n: p.detach().clone() for n, p in fp8_model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert before
    apply_lora(plain, lora)
    adapters = random_adapters(plain, seed=5)
    apply_lora(fp8_model, lora)
    load_lora_state_dict(fp8_model, adapters)
    ids = _ids(2)
    loss, grads = _loss_and_grads(fp8_model, ids)
    ref_loss, ref_grads = _loss_and_grads(plain, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    _assert_close_per_tensor(grads, ref_grads, 1e-4)
    assert any(float(g.abs().max()) > 0 for k, g in grads.items() if ".experts." in k)
    for n, p in fp8_model.named_parameters():
        if n in before:
            assert p.grad is None and torch.equal(p.view(torch.uint8), before[n].view(torch.uint8))


def test_replica_slots_share_their_experts_adapters():
    """Two slots per expert: the replicas use their expert's one adapter and its gradient sums over them, so the
    loss and adapter gradients equal those with one slot per expert."""
    hf, config = hf_model("qwen3_moe")
    logical = adapter_for("qwen3_moe").hf_to_megamoe(hf.state_dict(), config)
    replicated = dataclasses.replace(config, moe=dataclasses.replace(config.moe,
                                                                     num_expert_slots=2 * config.moe.num_experts))
    lora = LoRAConfig(rank=2, alpha=4, targets=("experts",))
    results, adapters = [], None
    for cfg in (config, replicated):
        model = _model("qwen3_moe", config=cfg, logical=logical).train()
        apply_lora(model, lora)
        if adapters is None:
            adapters = random_adapters(model, seed=7)
        load_lora_state_dict(model, adapters)
        results.append(_loss_and_grads(model, _ids(2)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=0)
    _assert_close_per_tensor(results[1][1], results[0][1], 1e-5)


def test_adapters_are_seeded_by_name():
    """The same seed gives the same A (PEFT's kaiming-uniform bound 1/sqrt(in)) and zero B; another seed another A."""
    states = []
    for seed in (0, 0, 1):
        model = _model("qwen3_moe")
        apply_lora(model, LoRAConfig(rank=2, alpha=4), seed=seed)
        states.append(lora_state_dict(model))
    a = states[0]["layers.0.self_attn.q_proj.weight.lora_A"]
    assert torch.equal(a, states[1]["layers.0.self_attn.q_proj.weight.lora_A"])
    assert not torch.equal(a, states[2]["layers.0.self_attn.q_proj.weight.lora_A"])
    assert float(a.abs().max()) <= a.shape[1] ** -0.5 and float(a.abs().max()) > 0.5 * a.shape[1] ** -0.5
    assert all(float(v.abs().max()) == 0 for k, v in states[0].items() if k.endswith(".lora_B"))


@pytest.mark.parametrize("fields,message", [
    (dict(rank=0, alpha=1), "LoRAConfig.rank"),
    (dict(rank=2, alpha=0), "LoRAConfig.alpha"),
    (dict(rank=2, alpha=1, dropout=1.0), "LoRAConfig.dropout"),
    (dict(rank=2, alpha=1, targets=("attention", "mlp")), "LoRAConfig.targets.*'mlp'"),
    (dict(rank=2, alpha=1, targets=()), "LoRAConfig.targets"),
])
def test_config_validates_itself(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**fields)


def test_config_round_trips_through_lora_json():
    config = LoRAConfig(rank=8, alpha=16, dropout=0.1, targets="experts,router")
    assert config.targets == ("experts", "router") and config.scaling == 2.0
    assert LoRAConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="lora.json: LoRAConfig.rank"):
        LoRAConfig.from_json('{"rank": -1, "alpha": 1}')


def test_apply_lora_refuses_what_it_cannot_adapt():
    with pytest.raises(ValueError, match="LoRAConfig.dropout"):
        apply_lora(_model("qwen3_moe"), LoRAConfig(rank=2, alpha=4, dropout=0.1))
    with pytest.raises(ValueError, match="has no shared_experts weights"):
        apply_lora(_model("qwen3_moe"), LoRAConfig(rank=2, alpha=4, targets=("shared_experts",)))
    model = _model("qwen3_moe")
    apply_lora(model, LoRAConfig(rank=2, alpha=4, dropout=0.5, targets=("experts",)))   # experts: dropout on inputs
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, LoRAConfig(rank=2, alpha=4))
