"""The Trainer's per-step throughput and MoE metrics: model TFLOP/s and MFU, each MoE layer's aux loss,
balancedness and expert load, peak memory; and the per-layer values are the same under a 2-rank
pipeline and expert-parallel layout as in one process."""

import pytest
import torch
import torch.distributed as dist

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.moe.router import RouterConfig
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.flops import flops_per_token
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, MLPConfig, RopeConfig
from parallel_state import ParallelState

H, V, E, TOP_K, S, GLOBAL_BATCH, MICRO_BATCH = 32, 64, 4, 2, 12, 8, 2
MOE_LAYERS = (1, 2, 3)


def _config(dispatcher="alltoall") -> GPTMoEConfig:
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=4,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8)),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=E, top_k=TOP_K, aux_loss_coeff=0.01,
                                          z_loss_coeff=0.001),
                      ffn_hidden_size=16, dispatcher=dispatcher, expert_backend="torch"),
        moe_layer_ids=MOE_LAYERS, dense_mlp=MLPConfig(hidden_size=H, intermediate_size=48))


def _batch():
    return torch.randint(0, V, (GLOBAL_BATCH, S + 1), generator=torch.Generator().manual_seed(7))


def _step(state, world_group=None, dispatcher="alltoall", peak_tflops=None):
    """Metrics of one training step on this rank's share of the global batch, plus the trainer."""
    model = GPTMoEModel(_config(dispatcher), state)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=world_group, peak_tflops=peak_tflops)
    per_rank = GLOBAL_BATCH // state.dp_cp.size
    mine = _batch()[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
    return trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)]), trainer


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


def _layouts_worker(rank, world_size, layouts):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = []
    for sizes, dispatcher in layouts:
        state = initialize_model_parallel(**sizes)
        m, _ = _step(state, dist.group.WORLD, dispatcher)
        results.append((m.moe_layers, m.tflops / m.tokens_per_s))
        destroy_model_parallel()
    return results


@pytest.mark.slow
def test_per_layer_metrics_match_single_process_under_pipeline_and_expert_parallelism():
    """PP 2 puts layers 1 and 2-3 on different stages; DP 2 x EP 2 splits the tokens and the experts:
    every rank reports every MoE layer's global values, as one process does."""
    reference, _ = _step(ParallelState.single_process())
    layouts = [(dict(pp=2), "alltoall"), (dict(ep=2), "alltoall")]
    per_rank = run_on_ranks(_layouts_worker, 2, args=(layouts,), timeout_s=600)
    per_token = flops_per_token(_config(), S).training / 1e12
    for rank_results in per_rank:
        for (layers, flops_per_token_per_rank), layout in zip(rank_results, layouts):
            assert sorted(layers) == list(MOE_LAYERS), layout
            # each rank's share: the whole model's FLOPs divided over the 2 ranks
            assert flops_per_token_per_rank == pytest.approx(per_token / 2, rel=1e-9), layout
            for layer_id, want in reference.moe_layers.items():
                got = layers[layer_id]
                assert got.tokens_per_expert == want.tokens_per_expert, (layout, layer_id)
                # balancedness is over the EP ranks of the layout's placement (1.0 without EP)
                placement = ExpertPlacement.default(E, E, layout[0].get("ep", 1))
                assert got.balancedness == pytest.approx(placement.balancedness(want.tokens_per_expert),
                                                         rel=1e-6), (layout, layer_id)   # fp32 rank loads
                assert got.aux_loss == pytest.approx(want.aux_loss, rel=1e-5), (layout, layer_id)
