"""Kept block-FP8 weights.

The cases that spawn ranks or run scripts end to end; the in-process ones are in
tests/unit/test_fp8_block_weights.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.hf_models import _ids, _stage_logits
from tests.helpers.fp8_block_weights import kept_case, kept_model

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- (b) parallel layouts ---------------------------------------------------------------------------------
# Blocks that TP / ETP shards hold whole: 4 x 4 where attention, the dense MLP and the (shared) experts are
# sharded; 4 x 12 (partial blocks along the 32 hidden and the 16 FFN columns) where only the slots are.
LAYOUTS = {   # name: (parallel sizes, dispatcher, expert slots per expert, block)
    "tp2 ep2 allgather": (dict(tp=2, ep=2), "allgather", 1, (4, 4)),
    "ep2 alltoall 2E slots, migrated": (dict(ep=2), "alltoall", 2, (4, 12)),
    "tp2 etp2 ep2 alltoall": (dict(tp=2, etp=2, ep=2), "alltoall", 1, (4, 4)),
}


def _max_diff(logits, expected):
    return None if logits is None else (logits - expected).abs().max().item()


def _layouts_worker(rank, world_size, cases, ids, layouts):
    from megamoe.moe.placement.expert_migration import migrate_layer
    from megamoe.moe.placement.expert_slots import ExpertPlacement
    from parallel_state import destroy_model_parallel, initialize_model_parallel

    results = []
    for name, (sizes, dispatcher, slots_per_expert, block) in layouts.items():
        state = initialize_model_parallel(**sizes)
        for family, config, kept, expected in cases[block]:
            moe = dataclasses.replace(config.moe, dispatcher=dispatcher,
                                      num_expert_slots=slots_per_expert * config.moe.num_experts)
            model = kept_model(dataclasses.replace(config, moe=moe), kept, state)
            with torch.no_grad():
                results.append((name, family, _max_diff(_stage_logits(model, state, ids), expected)))
            if "migrated" in name:       # every slot's expert reversed: the scales travel with their weights
                for layer in model.moe_layers().values():
                    table = layer.placement.slot_to_expert.flip(0)
                    migrate_layer(layer, ExpertPlacement(table, layer.placement.num_experts, state.ep.size))
                with torch.no_grad():
                    results.append((name + " after", family, _max_diff(_stage_logits(model, state, ids), expected)))
        destroy_model_parallel()
    return results


@pytest.mark.slow
def test_kept_model_under_parallel_layouts():
    ids = _ids(1, seed=2)
    cases = {}
    for block in {layout[3] for layout in LAYOUTS.values()}:
        for family in ("deepseek_v3", "qwen3_moe"):
            config, kept, _, _ = kept_case(family, block=block)
            with torch.no_grad():
                expected = kept_model(config, kept)(ids)[0]
            cases.setdefault(block, []).append((family, config, kept, expected))
    checked = {}
    for per_rank in run_on_ranks(_layouts_worker, 4, args=(cases, ids, LAYOUTS)):
        for name, family, diff in per_rank:
            if diff is None:           # a stage without logits
                continue
            assert diff <= 1e-5, f"{family} under {name}: kept logits differ from one process by {diff:.2e}"
            checked[name, family] = checked.get((name, family), 0) + 1
    names = [*LAYOUTS, *(name + " after" for name in LAYOUTS if "migrated" in name)]
    assert set(checked) == {(name, family) for name in names for family in ("deepseek_v3", "qwen3_moe")}
