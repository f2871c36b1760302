"""The FLOPs formula (megamoe.training.flops) against torch's FlopCounterMode on a real forward and
forward + backward of GPTMoEModel (one process), and the MFU arithmetic (megamoe.training.mfu)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training import mfu
from megamoe.training.flops import flops_per_token, training_flops
from megamoe.transformer import AttentionConfig, MLAConfig, MLPConfig, RopeConfig
from parallel_state import ParallelState

H, V, BATCH, SEQ = 32, 96, 2, 24


def _moe(num_experts=4, top_k=2, activation="swiglu", shared=None):
    # The "loop" expert backend runs one F.linear per slot in this thread, which FlopCounterMode (a
    # dispatch mode of the calling thread) sees; the "torch" backend's CPU path runs its GEMMs in
    # worker threads, outside the mode.
    return MoEConfig(router=RouterConfig(hidden_size=H, num_experts=num_experts, top_k=top_k, aux_loss_coeff=0.01),
                     ffn_hidden_size=16, expert_backend="loop", activation=activation, shared_experts=shared)


GQA = AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope=RopeConfig(dim=8))
CONFIGS = {
    # dense + MoE layers, GQA, gated shared experts with a gate
    "gqa": GPTMoEConfig(family="custom", vocab_size=V, hidden_size=H, num_layers=3, attention=GQA,
                        moe=_moe(shared=SharedExpertsConfig(H, 24, gate=True)), moe_layer_ids=(1, 2),
                        dense_mlp=MLPConfig(hidden_size=H, intermediate_size=40)),
    # deepseek-style MLA with a q LoRA, ungated experts, an ungated dense MLP
    "mla_q_lora": GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=2,
        attention=MLAConfig(hidden_size=H, num_attention_heads=4, q_lora_rank=12, kv_lora_rank=16,
                            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope=RopeConfig(dim=4)),
        moe=_moe(num_experts=6, top_k=3, activation="gelu", shared=SharedExpertsConfig(H, 16)),
        moe_layer_ids=(1,), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=48, gated=False)),
    # MLA without a q LoRA, MoE layers only, tied embeddings
    "mla_direct_q": GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=2, tie_word_embeddings=True,
        attention=MLAConfig(hidden_size=H, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8,
                            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope=RopeConfig(dim=4)),
        moe=_moe(), moe_layer_ids=(0, 1)),
}


def _measure(config: GPTMoEConfig):
    """(forward FLOPs, forward + backward FLOPs, the MoE layers' routed pairs) counted by FlopCounterMode
    on one training forward and backward of the model. SDPA runs on the math backend: CPU's fused
    flash kernel is invisible to FlopCounterMode (it has no formula for it), the math one is bmm's."""
    torch.manual_seed(0)
    model = GPTMoEModel(config, ParallelState.single_process())
    initialize_parameters(model, seed=0)
    tokens = torch.randint(0, V, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for layer in model.moe_layers().values():
        layer.load_counter.reset()
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward_counter:
            loss, aux = model(tokens[:, :-1], labels=tokens[:, 1:])
        with FlopCounterMode(display=False) as backward_counter:
            (loss + aux).backward()
    routed = {i: int(layer.load_counter.per_expert.sum()) for i, layer in model.moe_layers().items()}
    forward = forward_counter.get_total_flops()
    return forward, forward + backward_counter.get_total_flops(), routed


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_formula_matches_flop_counter_on_a_real_forward_and_backward(name):
    config = CONFIGS[name]
    forward, train, routed = _measure(config)
    num_tokens = BATCH * SEQ
    # dropless routing: every token reaches top_k experts, which is what the formula counts
    assert routed == {i: num_tokens * config.moe.router.top_k for i in config.moe_layer_ids}
    per_token = flops_per_token(config, SEQ)
    assert per_token.forward * num_tokens == pytest.approx(forward, rel=0.05)
    assert training_flops(config, SEQ, num_tokens) == pytest.approx(train, rel=0.05)
    assert per_token.training == 3 * per_token.forward


def test_each_large_component_is_needed_for_the_match():
    """Removing any one component's term (each over 5% of this config's total) puts the formula
    outside the 5% band: the match above is not within tolerance by luck."""
    forward, _, _ = _measure(CONFIGS["gqa"])
    per_token = flops_per_token(CONFIGS["gqa"], SEQ)
    num_tokens = BATCH * SEQ
    for name in ("attention_projections", "attention_scores", "dense_mlp", "routed_experts", "shared_experts",
                 "lm_head"):
        without = (per_token.forward - getattr(per_token, name)) * num_tokens
        assert without < 0.95 * forward, name


def test_attention_scores_grow_with_the_sequence_and_count_the_full_matrix():
    config = CONFIGS["gqa"]
    a = flops_per_token(config, 100)
    b = flops_per_token(config, 200)
    assert b.attention_scores == 2 * a.attention_scores
    # 2 matmuls (q k^T, p v) * 2 FLOPs * S * head_dim * heads per token per layer, the causal half included
    assert a.attention_scores == config.num_layers * 2 * 2 * 100 * 8 * 4
    assert b.forward - b.attention_scores == a.forward - a.attention_scores
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(config, 0)


# ---- MFU ------------------------------------------------------------------------------------------

def test_mfu_arithmetic_on_given_numbers():
    # 8 ranks train 4e15 FLOPs in 2 s: 2e15 FLOP/s in all, 250 TFLOP/s per rank; against 1000: 25%
    assert mfu.model_tflops_per_rank(4e15, step_time_s=2.0, world_size=8) == pytest.approx(250.0)
    assert mfu.model_flops_utilization(250.0, peak_tflops=1000.0) == pytest.approx(0.25)
    assert mfu.model_flops_utilization(250.0, peak_tflops=None) is None
    with pytest.raises(ValueError, match="step_time_s"):
        mfu.model_tflops_per_rank(1.0, step_time_s=0.0, world_size=1)
    with pytest.raises(ValueError, match="world_size"):
        mfu.model_tflops_per_rank(1.0, step_time_s=1.0, world_size=0)
    with pytest.raises(ValueError, match="peak_tflops"):
        mfu.model_flops_utilization(1.0, peak_tflops=-1.0)


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
    ("NVIDIA H100 PCIe", torch.float16, 756.0),
    ("NVIDIA H200", torch.bfloat16, 989.4),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA L40S", torch.bfloat16, 362.05),
    ("NVIDIA L4", torch.float16, 121.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, None),     # the table holds bf16/fp16 tensor-core peaks only
    ("Some Future GPU", torch.bfloat16, None),
])
def test_known_gpu_peaks(name, dtype, expected):
    assert mfu.known_gpu_peak_tflops(name, dtype) == expected


def test_peak_resolution_order(caplog):
    calls = []

    def measure(device, dtype):
        calls.append((device.type, dtype))
        return 0.5

    cpu = torch.device("cpu")
    explicit = mfu.resolve_peak_tflops(cpu, torch.float32, explicit_tflops=123.0, measure=measure)
    assert (explicit.tflops, explicit.source, calls) == (123.0, "given", [])
    with caplog.at_level("INFO", logger="megamoe.training.mfu"):
        measured = mfu.resolve_peak_tflops(cpu, torch.bfloat16, measure=measure)
    assert (measured.tflops, measured.source, calls) == (0.5, "measured", [("cpu", torch.bfloat16)])
    assert "MFU against measured matmul peak 0.5 TFLOP/s" in caplog.text
    with pytest.raises(ValueError, match="peak_tflops"):
        mfu.resolve_peak_tflops(cpu, torch.float32, explicit_tflops=0.0)


def test_measured_matmul_peak_is_a_positive_throughput():
    tflops = mfu.measure_matmul_tflops(torch.device("cpu"), torch.float32, size=128, repeats=3)
    assert 0 < tflops < 1e4
