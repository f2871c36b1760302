"""Measured memory (megamoe.training.memory_measure) and the closed-form estimate (memory_estimate).

The instruments are checked on computations whose saved tensors and allocations are known by hand;
the estimate against the measurement of real training steps: parameters, gradients and optimizer
state exactly, saved activations within 10% (in practice to a few bytes on one process, where the
routing is the whole batch's)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.memory_estimate import estimate_memory, stage_parameters
from megamoe.training.memory_measure import LiveMemory, SavedActivations, measure_state_bytes, measure_train_step
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import RopeConfig
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.mlp import MLPConfig
from megamoe.transformer.recompute import RecomputeConfig
from parallel_state import ParallelState
from tests.helpers.memory import H, LAYERS, MICRO, SEQ, VOCAB, _batches, qwen3_like

pytestmark = pytest.mark.usefixtures("one_thread")


def deepseek_like(**overrides) -> GPTMoEConfig:
    """MLA with q LoRA, a dense first layer, sigmoid group-limited routing, a shared expert."""
    return GPTMoEConfig(
        family="custom", vocab_size=VOCAB, hidden_size=H, num_layers=LAYERS,
        attention=MLAConfig(hidden_size=H, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
                            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                            rope=RopeConfig(dim=4, layout="interleaved")),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=4, top_k=2, score_func="sigmoid",
                                          norm_topk_prob=True, use_expert_bias=True, n_group=2, topk_group=1,
                                          group_score="top2_sum"),
                      ffn_hidden_size=16, expert_backend="torch", shared_experts=SharedExpertsConfig(H, 16)),
        dense_mlp=MLPConfig(H, 48), moe_layer_ids=(1,), **overrides)


def _measured_step(config: GPTMoEConfig, dtype=torch.float32):
    state = ParallelState.single_process()
    model = GPTMoEModel(config, state, dtype=dtype)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-3))
    first, second = _batches()
    trainer.train_step(first)                 # the optimizer state exists from the first step on
    memory, _ = measure_train_step(trainer, second)
    return memory, model


# ---- the instruments ------------------------------------------------------------------------------
def test_saved_activations_count_unique_storages_and_exclude_parameters():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivations() as saved:
        saved._excluded.add(weight.untyped_storage()._cdata)
        h = x @ weight           # saves x [4, 8] and the weight (a parameter: excluded)
        y = h.sin()              # saves h
        a = y.view(-1).cos()     # saves a view of y: y's storage
        b = y * y                # saves y twice: still its one storage
    assert saved.held_bytes == saved.peak_bytes == 3 * 32 * 4
    assert saved.packed_bytes == 3 * 32 * 4 and saved.by_category["other"] == 3 * 32 * 4
    (a.sum() + b.sum()).backward()     # the graph is freed, and with it what only it held
    del h, y, a, b
    assert saved.held_bytes == 32 * 4                   # x, still alive in this frame
    assert saved.peak_bytes == 3 * 32 * 4


def test_saved_activations_under_checkpoint_count_what_autograd_holds():
    """Non-reentrant checkpointing: the region's inputs are held, its own saved tensors are not (they
    exist only while its backward recomputes them)."""
    x = torch.randn(16, 32, requires_grad=True)

    def region(t):
        return t.sin().cos().exp()               # three [16, 32] tensors saved without checkpointing

    with SavedActivations() as plain:
        region(x * 2).sum()
    with SavedActivations() as checkpointed:
        out = checkpoint(region, x * 2, use_reentrant=False).sum()
    assert plain.peak_bytes == 3 * 16 * 32 * 4
    assert checkpointed.peak_bytes == 16 * 32 * 4          # the region's input only
    out.backward()                                        # the recomputation goes to the checkpoint's hooks
    assert checkpointed.peak_bytes == 16 * 32 * 4


def test_saved_activations_categorise_by_module():
    config = qwen3_like()
    model = GPTMoEModel(config, ParallelState.single_process())
    inputs, labels = _batches(1)[0][0]
    with SavedActivations(model) as saved:
        model(inputs, labels=labels)
    categories = saved.peak_by_category
    assert sum(categories.values()) == saved.peak_bytes
    assert categories["embedding"] == inputs.nbytes           # the token ids
    # Each decoder norm and the final norm: its input, rsqrt and output (fp32).
    T = MICRO * SEQ
    assert categories["norm"] == (2 * LAYERS + 1) * (2 * T * H + T) * 4
    assert min(categories["attention"], categories["mlp"], categories["lm_head"]) > 0


def test_live_memory_peak_follows_allocations_and_frees():
    with LiveMemory() as live:
        a = torch.empty(1000)
        b = torch.empty(2000)
        assert live.current_bytes == 12000
        del a
        c = torch.empty(500)
        assert live.current_bytes == 10000
        d = b.view(-1)[:10] + 1           # a view: no new bytes; the add: 40
        assert live.current_bytes == 10040
    assert live.peak_bytes == 12000
    live.reset_peak()
    assert live.peak_bytes == live.current_bytes == 10040
    del b, c, d


def test_live_memory_tracks_tensors_alive_before_it_started():
    before = torch.empty(256)
    with LiveMemory() as live:
        live.track(before, [before.view(16, 16)])       # one storage, however often named
        assert live.current_bytes == 1024
        x = before * 2
    assert live.peak_bytes == 2048
    del x


# ---- the estimate against the measurement ----------------------------------------------------------
RECOMPUTE_CASES = [
    ("qwen3-like GQA", qwen3_like, "flash", RecomputeConfig()),
    ("qwen3-like GQA", qwen3_like, "flash", RecomputeConfig("full")),
    ("qwen3-like GQA", qwen3_like, "flash", RecomputeConfig("selective", ("core_attn", "moe_act"))),
    ("qwen3-like GQA", qwen3_like, "flash", RecomputeConfig("selective", ("layernorm", "moe"))),
    ("deepseek-like MLA", deepseek_like, "math", RecomputeConfig()),
    ("deepseek-like MLA", deepseek_like, "math", RecomputeConfig("full")),
    ("deepseek-like MLA", deepseek_like, "math", RecomputeConfig("selective", ("mla_up_proj", "mlp", "moe_act"))),
    # bf16 parameters: fp32 master weights, moments and gradient shards in the (unsharded) distributed
    # optimizer; the norms', router's and CPU math attention's fp32 copies
    ("qwen3-like GQA bf16", qwen3_like, "flash", RecomputeConfig()),
    ("deepseek-like MLA bf16", deepseek_like, "math", RecomputeConfig()),
    ("deepseek-like MLA bf16", deepseek_like, "math", RecomputeConfig("full")),
]


@pytest.mark.parametrize("name, make_config, sdpa, recompute", RECOMPUTE_CASES,
                         ids=[f"{c[0]}-{c[3].granularity}-{'+'.join(c[3].modules)}" for c in RECOMPUTE_CASES])
def test_estimate_matches_the_measured_step_on_one_process(name, make_config, sdpa, recompute, monkeypatch):
    # The estimate models the per-slot expert GEMMs that a GPU runs. On CPU, bf16 experts may instead run one
    # padded bmm over the slots (megamoe.moe.experts.grouped_bmm), which saves the padding rows too: a
    # CPU-only speed layout that no memory plan is made for, so the measurement takes the per-slot path.
    monkeypatch.setattr("megamoe.moe.experts.grouped_mlp.padded_bmm_applies", lambda *args, **kwargs: False)
    config = make_config(recompute=recompute)
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    memory, model = _measured_step(config, dtype)
    estimate = estimate_memory(config, micro_batch=MICRO, seq_len=SEQ, sdpa_backend=sdpa, recompute=recompute,
                               param_dtype=dtype)
    (stage,) = estimate.stages
    state = memory.state
    assert (state.param_bytes, state.grad_bytes, state.optimizer_bytes) == (
        stage.param_bytes, stage.grad_bytes, stage.optimizer_bytes), name
    assert (state.dense_optimizer_bytes, state.expert_optimizer_bytes) == (
        stage.dense_optimizer_bytes, stage.expert_optimizer_bytes)
    assert stage.dense_param_bytes == state.dense_param_bytes      # (bf16: the routers' fp32 gates included)
    assert stage.activation_bytes == pytest.approx(memory.saved_activation_bytes, rel=0.10)
    for category, nbytes in memory.saved_by_category.items():
        assert stage.breakdown[category] == pytest.approx(nbytes, rel=0.10, abs=64), category
    # What the hooks cannot see: fully recomputed layers hold the rotary cos / sin by reference.
    assert (stage.breakdown["held_by_reference"] > 0) == (recompute.granularity == "full")
    # The peak holds the state and the activations at least; the estimate's total is that sum.
    assert memory.peak_live_bytes >= state.param_bytes + state.optimizer_bytes + memory.saved_activation_bytes
    assert estimate.total == stage.total


def test_stage_parameters_are_the_models_at_its_local_shapes():
    config = deepseek_like()
    model = GPTMoEModel(config, ParallelState.single_process(), device="meta")
    measured = {name: p.numel() for name, p in model.named_parameters()}
    estimated = {p.name: p.numel for p in stage_parameters(config)}
    # Names agree up to the ``.weight`` suffix of parameters that are not modules.
    assert sorted(estimated.values()) == sorted(measured.values())
    assert sum(estimated.values()) == sum(measured.values())
    assert measure_state_bytes(model).param_bytes == 4 * sum(estimated.values())


def _deepseek_v3() -> GPTMoEConfig:
    """DeepSeek-V3's config.json values (no download), through the HF config class and config_from_hf."""
    from transformers import DeepseekV3Config

    from megamoe.models.families import config_from_hf
    hf = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
              num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
              n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
              qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8,
              topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
              max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000,
              rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}, initializer_range=0.02)
    return config_from_hf(DeepseekV3Config(**hf))


def test_deepseek_v3_at_ep64_pp16_without_building_a_model():
    config = _deepseek_v3()
    # One rank holds everything: DeepSeek-V3's 671B parameters (the MTP module aside).
    (whole,) = estimate_memory(config, seq_len=4096).stages
    assert whole.dense_param_count + whole.expert_param_count == pytest.approx(671.0e9, rel=2e-3)
    estimate = estimate_memory(config, pp=16, ep=64, dp=64, micro_batch=1, seq_len=4096, num_micro_batches=16,
                               distributed_optimizer=True, param_dtype="bf16")
    assert len(estimate.stages) == 16 and [len(s.layer_ids) for s in estimate.stages] == [4] * 13 + [3] * 3
    # Every stage's ranks together hold the stage's experts once (4 slots each of the 256 per layer).
    moe_layers = sum(1 for i in estimate.stages[1].layer_ids if config.is_moe_layer(i))
    expert_numel = 3 * config.hidden_size * config.moe.ffn_hidden_size
    assert estimate.stages[1].expert_param_count == moe_layers * 4 * expert_numel
    # bf16 weights and gradients; fp32 moments and master weights sharded over DP 64 (dense) and EDP 1.
    stage = estimate.stages[1]
    routers = sum(1 for i in stage.layer_ids if config.is_moe_layer(i)) * config.moe.num_experts * config.hidden_size
    assert stage.dense_param_bytes == 2 * stage.dense_param_count + 2 * routers        # the routers' gates: fp32
    assert stage.param_bytes == stage.dense_param_bytes + 2 * stage.expert_param_count
    assert stage.expert_optimizer_bytes >= 12 * stage.expert_param_count
    assert stage.dense_optimizer_bytes < 12 * stage.dense_param_count / 60
    # 1F1B: the first stage holds a micro-batch per stage, the last one.
    assert [s.micro_batches_in_flight for s in estimate.stages] == list(range(16, 0, -1))
    assert estimate.worst.total == max(s.total for s in estimate.stages)


@pytest.mark.parametrize("kwargs, field", [
    (dict(tp=0), "tp"), (dict(ep=3), "ep"), (dict(zero_stage=2), "zero_stage"), (dict(zero_stage=3), "zero_stage"),
    (dict(param_dtype="fp8"), "param_dtype"), (dict(sdpa_backend="cudnn"), "sdpa_backend"),
    (dict(seq_len=31, cp=2), "seq_len")])
def test_estimate_rejects_impossible_layouts_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        estimate_memory(qwen3_like(), **kwargs)
