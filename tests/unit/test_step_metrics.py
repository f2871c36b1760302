"""The Trainer's per-step throughput and MoE metrics: model TFLOP/s and MFU, each MoE layer's aux loss,
balancedness and expert load, peak memory; and the per-layer values are the same under a 2-rank
pipeline and expert-parallel layout as in one process.

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_step_metrics.py."""

import pytest

from megamoe.training.flops import flops_per_token
from parallel_state import ParallelState
from tests.helpers.step_metrics import E, GLOBAL_BATCH, MOE_LAYERS, S, TOP_K, _config, _step


def test_per_layer_moe_metrics_add_up_to_the_step_totals():
    m, trainer = _step(ParallelState.single_process())
    assert sorted(m.moe_layers) == list(MOE_LAYERS)
    # every token of the global batch reaches top_k experts in every MoE layer (dropless)
    for layer_id, layer_metrics in m.moe_layers.items():
        assert len(layer_metrics.tokens_per_expert) == E
        assert sum(layer_metrics.tokens_per_expert) == GLOBAL_BATCH * S * TOP_K
        placement = trainer.model.moe_layers()[layer_id].placement
        assert layer_metrics.balancedness == pytest.approx(placement.balancedness(layer_metrics.tokens_per_expert))
    assert sum(l.aux_loss for l in m.moe_layers.values()) == pytest.approx(m.aux_loss, rel=1e-6)   # the model sums in fp32
    assert all(l.aux_loss > 0 for l in m.moe_layers.values())
    assert len({l.aux_loss for l in m.moe_layers.values()}) == len(MOE_LAYERS), "each layer its own aux loss"
    assert sum(l.balancedness for l in m.moe_layers.values()) / len(MOE_LAYERS) == pytest.approx(m.balancedness)


def test_tflops_and_mfu_follow_the_flops_formula():
    m, _ = _step(ParallelState.single_process(), peak_tflops=2.0)
    # tflops and tokens/s share the step time: their ratio is the training FLOPs per token (one rank)
    assert m.tflops / m.tokens_per_s == pytest.approx(flops_per_token(_config(), S).training / 1e12, rel=1e-9)
    assert m.mfu == pytest.approx(m.tflops / 2.0, rel=1e-12)
    without_peak, _ = _step(ParallelState.single_process())
    assert without_peak.mfu is None and without_peak.tflops > 0
    # on CPU: the process's peak resident set, a real (large) size
    assert m.peak_memory_bytes is not None and m.peak_memory_bytes > 1 << 20
