"""megamoe-convert: HF -> megamoe -> HF round trips are bit-exact for every family, layout and slot count;
converted checkpoints give transformers' logits on spawned ranks under their own layout and others;
reshard carries optimizer state; every bad input fails with its message, a non-zero exit and no output.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_convert.py."""

import collections

import pytest

from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.hf_checkpoints import ATOL, convert, ids


# ----------------------------------------------------------------------------------------------
# Logits on spawned ranks: the import layout and another one
# ----------------------------------------------------------------------------------------------
LAYOUTS = {   # 4 ranks: parallel sizes and the dispatcher they need
    "tp2 ep2 allgather": (dict(tp=2, pp=1, ep=2, etp=1), "allgather"),
    "ep4 alltoall": (dict(tp=1, pp=1, ep=4, etp=1), "alltoall"),
    "tp2 pp2 ep2 allgather": (dict(tp=2, pp=2, ep=2, etp=1), "allgather"),
    "tp2 etp2 ep2 alltoall": (dict(tp=2, pp=1, ep=2, etp=2), "alltoall"),
}
CONVERSIONS = {   # family: two (layout, expert slots); each checkpoint loads under both
    "mixtral": [("tp2 pp2 ep2 allgather", 12), ("ep4 alltoall", 8)],
    "qwen2_moe": [("ep4 alltoall", 16), ("tp2 etp2 ep2 alltoall", 8)],
    "qwen3_moe": [("tp2 etp2 ep2 alltoall", 12), ("tp2 pp2 ep2 allgather", 8)],
    "olmoe": [("tp2 ep2 allgather", 10), ("tp2 etp2 ep2 alltoall", 12)],
    "deepseek_v2": [("tp2 etp2 ep2 alltoall", 12), ("tp2 pp2 ep2 allgather", 16)],
    "deepseek_v3": [("tp2 pp2 ep2 allgather", 16), ("ep4 alltoall", 12)],
    "glm4_moe": [("tp2 pp2 ep2 allgather", 12), ("tp2 etp2 ep2 alltoall", 16)],
    "minimax_m2": [("tp2 etp2 ep2 alltoall", 8), ("ep4 alltoall", 12)],
    "gpt_oss": [("tp2 etp2 ep2 alltoall", 12), ("tp2 pp2 ep2 allgather", 16)],
}


def _logits_worker(rank, world_size, cases, input_ids):
    """Every case on this rank: (family, layout, difference to the HF logits) from the reporting rank."""
    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from megamoe.inference.pipeline_forward import pipeline_logits
    from parallel_state import destroy_model_parallel, initialize_model_parallel

    results = []
    for layout_name, per_layout in cases.items():
        sizes, dispatcher = LAYOUTS[layout_name]
        state = initialize_model_parallel(**sizes)
        for family, checkpoint, slots, expected in per_layout:
            model = build_model_from_checkpoint(checkpoint, state, dispatcher=dispatcher, num_expert_slots=slots)
            logits = pipeline_logits(model.eval(), state, input_ids)
            if state.is_last_pp_stage and state.tp.rank == 0:
                results.append((family, layout_name, slots, (logits - expected).abs().max().item()))
        destroy_model_parallel()
    return results


@pytest.mark.slow
def test_converted_checkpoints_match_transformers_on_ranks(hf_models, tmp_path):
    cases = collections.defaultdict(list)
    for family, conversions in CONVERSIONS.items():
        hf_dir, expected = hf_models(family)
        for index, (layout, slots) in enumerate(conversions):
            sizes, dispatcher = LAYOUTS[layout]
            checkpoint = str(tmp_path / f"{family}-{index}")
            assert convert("import-hf", hf_dir, checkpoint, "--tp", sizes["tp"], "--pp", sizes["pp"], "--ep",
                           sizes["ep"], "--etp", sizes["etp"], "--dispatcher", dispatcher, "--num-expert-slots",
                           slots) == 0
            for load_layout, load_slots in conversions:          # its own layout and the other one
                cases[load_layout].append((family, checkpoint, load_slots, expected))
    checked = collections.Counter()
    for per_rank in run_on_ranks(_logits_worker, 4, args=(dict(cases), ids())):
        for family, layout, slots, diff in per_rank:
            assert diff <= ATOL, f"{family} under {layout} with {slots} slots: logits differ by {diff:.2e}"
            checked[family, layout] += 1
    # every family under both layouts (each checkpoint under each), seen by at least one reporting rank
    assert set(checked) == {(f, layout) for f, conversions in CONVERSIONS.items() for layout, _ in conversions}
