"""Router: selections and weights against transformers' own router modules, losses, expert bias, config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_balancing_loss
from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func as qwen2_balancing_loss
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from megamoe.moe.router import Router, RouterConfig

HIDDEN = 32
TOKENS = 96


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hidden(seed: int, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=_generator(seed))


# Each case: (HF router class, HF config, matching RouterConfig kwargs). RouterConfig fields follow the
# family table in megamoe/moe/router.py's docstring.
HF_CASES = {
    "mixtral": (
        MixtralTopKRouter,
        lambda: MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2),
        dict(num_experts=8, top_k=2, norm_topk_prob=True),
    ),
    "qwen2_moe-norm": (
        Qwen2MoeTopKRouter,
        lambda: Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
        dict(num_experts=8, top_k=3, norm_topk_prob=True),
    ),
    "qwen2_moe-no-norm": (
        Qwen2MoeTopKRouter,
        lambda: Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
        dict(num_experts=8, top_k=3, norm_topk_prob=False),
    ),
    "qwen3_moe": (
        Qwen3MoeTopKRouter,
        lambda: Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
        dict(num_experts=16, top_k=4, norm_topk_prob=True),
    ),
    "olmoe": (
        OlmoeTopKRouter,
        lambda: OlmoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
        dict(num_experts=8, top_k=2, norm_topk_prob=False),
    ),
    "deepseek_v2-greedy": (
        DeepseekV2TopkRouter,
        lambda: DeepseekV2Config(
            hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy",
            routed_scaling_factor=1.5,
        ),
        dict(num_experts=16, top_k=3, routed_scaling_factor=1.5),
    ),
    "deepseek_v2-group": (
        DeepseekV2TopkRouter,
        lambda: DeepseekV2Config(
            hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
            n_group=4, topk_group=2, routed_scaling_factor=2.0,
        ),
        dict(num_experts=16, top_k=3, n_group=4, topk_group=2, group_score="max", routed_scaling_factor=2.0),
    ),
    "deepseek_v3-norm": (
        DeepseekV3TopkRouter,
        lambda: DeepseekV3Config(
            hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5,
        ),
        dict(num_experts=16, top_k=4, score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
             n_group=4, topk_group=2, group_score="top2_sum", use_expert_bias=True),
    ),
    "deepseek_v3-no-norm": (
        DeepseekV3TopkRouter,
        lambda: DeepseekV3Config(
            hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, n_group=8, topk_group=3,
            norm_topk_prob=False, routed_scaling_factor=1.0,
        ),
        dict(num_experts=16, top_k=3, score_func="sigmoid", norm_topk_prob=False,
             n_group=8, topk_group=3, group_score="top2_sum", use_expert_bias=True),
    ),
}


def _hf_and_ours(case: str, **extra_fields) -> tuple[torch.nn.Module, Router]:
    """HF router with random gate weight (and V3 correction bias) and a Router holding the same values."""
    hf_cls, hf_config, ours_kwargs = HF_CASES[case]
    hf = hf_cls(hf_config())
    gen = _generator(0)
    ours = Router(RouterConfig(hidden_size=HIDDEN, **ours_kwargs, **extra_fields))
    with torch.no_grad():
        # Unit-scale gate weights spread the scores, so near-ties between experts are vanishingly rare.
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        ours.weight.copy_(hf.weight)
        if hasattr(hf, "e_score_correction_bias"):
            hf.e_score_correction_bias.copy_(0.3 * torch.randn(hf.e_score_correction_bias.shape, generator=gen))
            ours.expert_bias.copy_(hf.e_score_correction_bias)
    return hf, ours


def _by_expert_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder each token's (id, weight) pairs by id, so the order topk happened to use is irrelevant."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_matches_hf_router(case):
    hf, ours = _hf_and_ours(case)
    hidden = _hidden(seed=1)
    with torch.no_grad():
        hf_logits, hf_weights, hf_ids = hf(hidden)
        out = ours(hidden)

    assert out.expert_ids.dtype == torch.int64 and out.expert_ids.shape == hf_ids.shape
    assert out.weights.dtype == torch.float32 and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, hf_logits.float(), rtol=1e-6, atol=1e-6)
    ours_ids, ours_weights = _by_expert_id(out.expert_ids, out.weights)
    hf_ids, hf_weights = _by_expert_id(hf_ids.long(), hf_weights.float())
    torch.testing.assert_close(ours_ids, hf_ids, rtol=0, atol=0)
    torch.testing.assert_close(ours_weights, hf_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        out.tokens_per_expert, torch.bincount(hf_ids.flatten(), minlength=ours.config.num_experts)
    )


@pytest.mark.parametrize("case", ["deepseek_v2-group", "deepseek_v3-norm", "deepseek_v3-no-norm"])
def test_group_limit_and_bias_change_the_selection(case):
    """The grouped cases above would pass trivially if groups (or the V3 bias) never mattered."""
    _, ours = _hf_and_ours(case)
    hidden = _hidden(seed=1)
    with torch.no_grad():
        grouped_ids = ours(hidden).expert_ids.sort(dim=-1).values
        cfg = ours.config
        plain_scores = ours(hidden).logits
        plain_scores = plain_scores.softmax(-1) if cfg.score_func == "softmax" else plain_scores.sigmoid()
        if ours.expert_bias is not None:
            biased_ids = plain_scores.add(ours.expert_bias).topk(cfg.top_k).indices.sort(dim=-1).values
            unbiased_ids = plain_scores.topk(cfg.top_k).indices.sort(dim=-1).values
            assert (biased_ids != unbiased_ids).any(dim=-1).sum() >= TOKENS // 8
            plain_scores = plain_scores + ours.expert_bias
        ungrouped_ids = plain_scores.topk(cfg.top_k).indices.sort(dim=-1).values
    assert (grouped_ids != ungrouped_ids).any(dim=-1).sum() >= TOKENS // 8


def test_switch_aux_loss_against_hf_load_balancing_loss():
    """HF divides the counts by tokens, not token-slots: its value is top_k times ours (see router.py)."""
    for case, hf_loss_func in (("mixtral", mixtral_balancing_loss), ("qwen2_moe-norm", qwen2_balancing_loss)):
        hf, ours = _hf_and_ours(case, aux_loss_coeff=0.5)
        hidden = _hidden(seed=2)
        with torch.no_grad():
            hf_logits, _, _ = hf(hidden)
        out = ours(hidden)
        cfg = ours.config
        expected = hf_loss_func((hf_logits,), cfg.num_experts, cfg.top_k) / cfg.top_k
        torch.testing.assert_close(out.aux_loss, 0.5 * expected, rtol=1e-6, atol=1e-7)


def test_sigmoid_aux_loss_uses_normalised_scores():
    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2, score_func="sigmoid", aux_loss_coeff=1.0)
    router = Router(cfg)
    router.reset_parameters(_generator(3))
    hidden = _hidden(seed=4)
    out = router(hidden)
    scores = F.linear(hidden, router.weight).sigmoid()
    normalised = scores / scores.sum(dim=-1, keepdim=True)
    selected = F.one_hot(out.expert_ids, cfg.num_experts).sum(dim=1).float()  # [T, E]
    slot_fraction = selected.mean(dim=0) / cfg.top_k
    expected = cfg.num_experts * (slot_fraction * normalised.mean(dim=0)).sum()
    torch.testing.assert_close(out.aux_loss, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_seq_aux_loss_is_the_mean_of_per_sequence_switch_losses(score_func):
    num_sequences, seq_len = 3, 20
    common = dict(hidden_size=HIDDEN, num_experts=8, top_k=2, score_func=score_func)
    seq_router = Router(RouterConfig(**common, seq_aux_loss_coeff=0.3))
    switch_router = Router(RouterConfig(**common, aux_loss_coeff=0.3))
    seq_router.reset_parameters(_generator(5))
    switch_router.load_state_dict(seq_router.state_dict())
    hidden = _hidden(seed=6, tokens=num_sequences * seq_len)

    per_sequence = [switch_router(chunk).aux_loss for chunk in hidden.split(seq_len)]
    torch.testing.assert_close(
        seq_router(hidden, num_sequences=num_sequences).aux_loss, torch.stack(per_sequence).mean()
    )
    # One sequence: the sequence-level loss is the switch loss; several: it is not.
    torch.testing.assert_close(seq_router(hidden).aux_loss, switch_router(hidden).aux_loss)
    assert not torch.allclose(
        seq_router(hidden, num_sequences=num_sequences).aux_loss, switch_router(hidden).aux_loss
    )


def test_z_loss_formula_and_sum_of_enabled_losses():
    coeffs = dict(aux_loss_coeff=0.01, seq_aux_loss_coeff=0.02, z_loss_coeff=0.003)
    routers = {}
    for name in [*coeffs, "all"]:
        kwargs = coeffs if name == "all" else {name: coeffs[name]}
        routers[name] = Router(RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2, **kwargs))
        routers[name].reset_parameters(_generator(7))
    hidden = _hidden(seed=8)

    z = routers["z_loss_coeff"](hidden, num_sequences=4).aux_loss
    logits = hidden @ routers["z_loss_coeff"].weight.T
    torch.testing.assert_close(z, 0.003 * torch.logsumexp(logits, dim=-1).pow(2).mean())

    parts = sum(routers[name](hidden, num_sequences=4).aux_loss for name in coeffs)
    torch.testing.assert_close(routers["all"](hidden, num_sequences=4).aux_loss, parts)

    no_loss = Router(RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2))(hidden).aux_loss
    assert no_loss.shape == () and no_loss.dtype == torch.float32 and no_loss.item() == 0.0


@pytest.mark.parametrize("loss", ["aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "weights"])
def test_gradients_reach_the_router_weight(loss):
    kwargs = {} if loss == "weights" else {loss: 0.1}
    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=16, top_k=4, score_func="sigmoid", n_group=4, topk_group=2,
                       norm_topk_prob=True, use_expert_bias=True, **kwargs)
    router = Router(cfg, dtype=torch.bfloat16)  # a bf16 router holds its gate in fp32 and backpropagates into it
    router.reset_parameters(_generator(9))
    out = router(_hidden(seed=10).bfloat16(), num_sequences=2)
    # Renormalised weights sum to 1 per token, so weigh them to get a non-constant objective.
    objective = out.aux_loss if loss != "weights" else (out.weights * _hidden(11)[:, : cfg.top_k]).sum()
    objective.backward()
    assert router.weight.dtype == torch.float32
    assert router.weight.grad is not None and router.weight.grad.dtype == torch.float32
    assert router.weight.grad.float().abs().sum() > 0
    assert not router.expert_bias.requires_grad


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_expert_bias_changes_selection_not_weights(norm_topk_prob):
    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2, score_func="sigmoid",
                       norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.0, use_expert_bias=True)
    router = Router(cfg)
    router.reset_parameters(_generator(12))
    hidden = _hidden(seed=13)
    with torch.no_grad():
        router.expert_bias[5] = 10.0  # far above any sigmoid gap: expert 5 is always selected
        out = router(hidden)
    assert (out.expert_ids == 5).any(dim=-1).all()
    scores = torch.sigmoid(hidden @ router.weight.detach().T)
    unbiased = scores.gather(1, out.expert_ids)
    if norm_topk_prob:
        unbiased = unbiased / unbiased.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(out.weights.detach(), 2.0 * unbiased)


def test_update_expert_bias_direction():
    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=4, top_k=1, use_expert_bias=True,
                       expert_bias_update_rate=0.01)
    router = Router(cfg)
    router.update_expert_bias(torch.tensor([10, 0, 5, 5]))  # mean 5
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    router.update_expert_bias(torch.tensor([10, 0, 5, 5]))
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.02, 0.02, 0.0, 0.0]))
    assert router.expert_bias.dtype == torch.float32
    with pytest.raises(ValueError, match="tokens_per_expert"):
        router.update_expert_bias(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="use_expert_bias"):
        Router(RouterConfig(hidden_size=HIDDEN, num_experts=4, top_k=1)).update_expert_bias(torch.zeros(4))


def test_update_expert_bias_balances_a_skewed_router():
    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2, score_func="sigmoid", use_expert_bias=True,
                       expert_bias_update_rate=0.02)
    router = Router(cfg)
    router.reset_parameters(_generator(14))
    with torch.no_grad():
        router.weight[0] += 0.5  # experts 0 and 1 win for most tokens of a mean-shifted input
        router.weight[1] += 0.5
    hidden = _hidden(seed=15, tokens=256) + 0.3
    with torch.no_grad():
        first = router(hidden).tokens_per_expert
        for _ in range(60):
            router.update_expert_bias(router(hidden).tokens_per_expert)
        last = router(hidden).tokens_per_expert
    assert first.max() > 2 * last.max()
    assert router.expert_bias[:2].max() < router.expert_bias[2:].min()


def test_tokens_per_expert_and_shapes():
    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=16, top_k=4, n_group=4, topk_group=2)
    router = Router(cfg)
    router.reset_parameters(_generator(16))
    out = router(_hidden(seed=17))
    assert out.tokens_per_expert.dtype == torch.int64 and out.tokens_per_expert.shape == (16,)
    assert not out.tokens_per_expert.requires_grad
    assert out.tokens_per_expert.sum().item() == TOKENS * 4
    assert out.logits.shape == (TOKENS, 16)
    # Each token's ids are distinct and lie in at most topk_group groups.
    assert (out.expert_ids.sort(dim=-1).values.diff(dim=-1) > 0).all()
    assert all(len(set(row)) <= 2 for row in (out.expert_ids // 4).tolist())


def test_empty_input_gives_finite_zero_losses():
    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2, aux_loss_coeff=0.1, seq_aux_loss_coeff=0.1,
                       z_loss_coeff=0.1)
    out = Router(cfg)(torch.zeros(0, HIDDEN))
    assert out.expert_ids.shape == (0, 2) and out.aux_loss.item() == 0.0
    assert out.tokens_per_expert.tolist() == [0] * 8


def test_forward_rejects_bad_inputs():
    router = Router(RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2))
    with pytest.raises(ValueError, match="hidden"):
        router(torch.zeros(4, HIDDEN + 1))
    with pytest.raises(ValueError, match="num_sequences"):
        router(torch.zeros(10, HIDDEN), num_sequences=3)


def test_reset_parameters_is_deterministic_and_dtype_independent():
    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2, init_std=0.05, use_expert_bias=True)
    a, b = Router(cfg), Router(cfg, dtype=torch.bfloat16)
    a.reset_parameters(_generator(18))
    b.reset_parameters(_generator(18))
    assert b.weight.dtype == torch.float32 and torch.equal(b.weight, a.weight)      # a bf16 router holds fp32
    c = Router(cfg)
    c.reset_parameters(_generator(19))
    assert not torch.equal(a.weight, c.weight)
    assert 0.04 < a.weight.std().item() < 0.06
    with torch.no_grad():
        a.expert_bias.fill_(1.0)
    a.reset_parameters(_generator(18))
    assert a.expert_bias.abs().sum() == 0
    assert set(a.state_dict()) == {"weight", "expert_bias"}
    assert set(Router(RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2)).state_dict()) == {"weight"}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_k=9), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(score_func="relu"), "score_func"),
        (dict(group_score="mean"), "group_score"),
        (dict(n_group=3), "n_group"),
        (dict(n_group=4, topk_group=5), "topk_group"),
        (dict(n_group=4, topk_group=1, top_k=3), "top_k"),
        (dict(n_group=8, top_k=1, group_score="top2_sum"), "group_score"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"),
        (dict(seq_aux_loss_coeff=-1.0), "seq_aux_loss_coeff"),
        (dict(z_loss_coeff=float("nan")), "z_loss_coeff"),
        (dict(expert_bias_update_rate=-0.1), "expert_bias_update_rate"),
        (dict(init_std=-0.1), "init_std"),
    ],
)
def test_config_validation(kwargs, field):
    base = dict(hidden_size=HIDDEN, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=f"RouterConfig.{field}"):
        RouterConfig(**{**base, **kwargs})


def test_gate_logits_stay_fp32_under_autocast():
    # autocast runs eligible GEMMs in bf16/fp16 whatever their inputs: the router must opt out.
    router = Router(RouterConfig(hidden_size=16, num_experts=4, top_k=2))
    hidden = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router.gate_logits(hidden.bfloat16())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.bfloat16().float() @ router.weight.t(), rtol=1e-6, atol=1e-6)


def test_a_low_precision_router_keeps_its_gate_in_fp32():
    """Router in fp32 without a per-call weight cast: built in bf16 or converted with .to(bf16 / fp16), the gate's
    weight and bias stay fp32 (fp64 stays fp64), and the bf16 routing casts no parameter."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = RouterConfig(hidden_size=HIDDEN, num_experts=8, top_k=2, bias=True)
    built = Router(cfg, dtype=torch.bfloat16)
    converted = Router(cfg).to(torch.float16)
    assert {p.dtype for r in (built, converted) for p in r.parameters()} == {torch.float32}
    assert {p.dtype for p in Router(cfg).double().parameters()} == {torch.float64}
    params = {p.data_ptr() for p in built.parameters()}

    class WeightCasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
                WeightCasts.count += any(isinstance(a, torch.Tensor) and a.data_ptr() in params for a in args)
            return func(*args, **(kwargs or {}))

    with WeightCasts():
        built(_hidden(seed=3).bfloat16()).weights.sum().backward()
    assert WeightCasts.count == 0
    assert built.weight.grad.dtype == torch.float32
