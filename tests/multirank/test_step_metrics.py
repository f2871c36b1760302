"""The Trainer's per-step throughput and MoE metrics: model TFLOP/s and MFU, each MoE layer's aux loss,
balancedness and expert load, peak memory; and the per-layer values are the same under a 2-rank
pipeline and expert-parallel layout as in one process."""

import pytest
import torch.distributed as dist

from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.flops import flops_per_token
from parallel_state import ParallelState
from tests.helpers.step_metrics import E, MOE_LAYERS, S, _config, _step


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
