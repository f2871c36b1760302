"""HF families end to end (fp32): config_from_hf + the checkpoint adapters + load_logical_state give a
GPTMoEModel whose logits equal transformers' for tiny random models of every family, single process and
under several parallel layouts; the adapters round-trip both HF forms bitwise and reject bad input.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_hf_families.py."""

import dataclasses

import pytest
import torch

from megamoe.hf.adapters import adapter_for
from megamoe.models import GPTMoEModel
from megamoe.models.hf_loading import load_logical_state
from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.hf_models import ATOL, _hf_logits, _ids, _stage_logits, hf_model


# ----------------------------------------------------------------------------------------------
# Parallel layouts (4 ranks)
# ----------------------------------------------------------------------------------------------
LAYOUTS = {   # name: (parallel sizes, dispatcher, expert slots per expert)
    "tp2 ep2 allgather": (dict(tp=2, ep=2), "allgather", 1),
    "ep4 alltoall 2E slots": (dict(ep=4), "alltoall", 2),
    "tp2 pp2 ep2 allgather": (dict(tp=2, pp=2, ep=2), "allgather", 1),
    "tp2 etp2 ep2 alltoall": (dict(tp=2, etp=2, ep=2), "alltoall", 1),
}


def _layouts_worker(rank, world_size, cases, ids, layouts):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = []
    for name, (sizes, dispatcher, slots_per_expert) in layouts.items():
        state = initialize_model_parallel(**sizes)
        sequence = state.dp.rank            # every data-parallel replica checks its own sequence
        for family, config, logical, expected in cases:
            moe = dataclasses.replace(config.moe, dispatcher=dispatcher,
                                      num_expert_slots=slots_per_expert * config.moe.num_experts)
            model = GPTMoEModel(dataclasses.replace(config, moe=moe), state)
            load_logical_state(model, logical)
            with torch.no_grad():
                logits = _stage_logits(model, state, ids[sequence:sequence + 1])
            if logits is not None:
                diff = (logits[0] - expected[sequence]).abs().max().item()
                results.append((name, family, diff))
        destroy_model_parallel()
    return results


@pytest.mark.slow
def test_families_under_parallel_layouts():
    ids = _ids(4, seed=2)
    cases = []
    for family in ("qwen2_moe", "qwen3_moe", "deepseek_v3"):   # + tied embeddings under pp
        hf, config = hf_model(family)
        logical = adapter_for(family).hf_to_megamoe(hf.state_dict(), config)
        cases.append((family, config, logical, _hf_logits(hf, ids)))
    checked = {}
    for per_rank in run_on_ranks(_layouts_worker, 4, args=(cases, ids, LAYOUTS)):
        for name, family, diff in per_rank:
            assert diff <= ATOL, f"{family} under {name}: logits differ by {diff:.2e}"
            checked[name, family] = True
    assert len(checked) == len(LAYOUTS) * len(cases)
