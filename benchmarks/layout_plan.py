"""What planning an import at scale costs: :func:`plan_layout` and the rest of an import's planning.

    python benchmarks/layout_plan.py [--reference] [--json benchmarks/results/layout_plan.json]

DeepSeek-V3's full config (61 layers + its MTP layer, 256 routed experts on 320 slots; built here, nothing is
downloaded), no weights, one layout per row:

- ``ep64-pp8``: EP 64 x PP 8 (world 512), the figure of issue #19;
- ``tp8-ep64-pp8-fold``: TP 8 x EP 64 x PP 8 with ETP 1 (folding: EP over the TP ranks, world 512);
- ``tp8-ep64-etp8-pp8``: TP 8 x EP 64 x PP 8 with experts cut by TP too (ETP 8, the CLI's default
  for the all-to-all dispatcher: world 4096).

Each row runs in a fresh process and reports the planner's wall and CPU seconds (the host is shared:
CPU seconds are what the planner costs, wall seconds what it took here), the models it built, and the
process's peak RSS after planning (including the ~0.34 GB of imported torch / transformers, measured
before planning as ``base_rss``). Then the rest of an import's planning at that layout: ``build_placements``, the
manifest fields (and their JSON size), and the checkpoint writer's file layout
(:class:`CheckpointStreamWriter` over every chunk, ``chunks_are_runs``). ``--reference`` also plans
the rows of world <= ``--reference-max-world`` with one model per rank (the planner before roles) and
checks the plans are equal. ``--quick``: a tiny DeepSeek-V3 (hidden 32) on two layouts, with the
reference, in this process.
"""

from __future__ import annotations

import json
import multiprocessing
import resource
import sys
import tempfile
import time

from common import argument_parser, write_results  # sibling module

# name, tp, ep, etp, pp, expert slots
CASES = [("ep64-pp8", 1, 64, 1, 8, 320), ("tp8-ep64-pp8-fold", 8, 64, 1, 8, 320),
         ("tp8-ep64-etp8-pp8", 8, 64, 8, 8, 320)]
QUICK_CASES = [("tp2-ep2-etp2-pp2", 2, 2, 2, 2, 12), ("tp2-ep4-pp2-fold", 2, 4, 1, 2, 12)]
TINY_DEEPSEEK_V3 = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                        max_position_embeddings=64, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=12,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, intermediate_size=24,
                        moe_intermediate_size=16, n_routed_experts=8, first_k_dense_replace=1, num_hidden_layers=5,
                        n_group=4, topk_group=2, n_shared_experts=1)
GiB = 2**30


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # Linux: KiB


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - wall, time.process_time() - cpu


def measure(case: tuple, quick: bool, reference: bool) -> dict:
    """One row: the planner, then the rest of an import's planning, at ``case``'s layout."""
    import torch
    from transformers import DeepseekV3Config

    from megamoe.checkpoint import layout_plan
    from megamoe.checkpoint.stream import CheckpointStreamWriter, StreamedTensor
    from megamoe.checkpoint.layout import ParallelLayout
    from megamoe.checkpoint.manifest_fields import manifest_fields
    from megamoe.checkpoint.placements import build_placements
    from megamoe.models.families import config_from_hf

    name, tp, ep, etp, pp, slots = case
    if quick:
        hf_config = TINY_DEEPSEEK_V3
    else:
        from memory import DEEPSEEK_V3_HF as hf_config  # sibling module
    # With its MTP layer (num_nextn_predict_layers 1): layer 61, MoE, on the last stage.
    config = config_from_hf(DeepseekV3Config(**hf_config), num_expert_slots=slots, mtp_num_layers=1)
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp)
    row = {"name": name, "tp": tp, "ep": ep, "etp": etp, "pp": pp, "slots": slots, "world": layout.world_size,
           "base_rss": _rss_bytes()}
    placements, row["placements_s"], _ = _timed(lambda: build_placements(config, ep))
    built = []
    real_rank_chunks = layout_plan._rank_chunks

    def counting(*args, **kwargs):
        built.append(args[2])
        return real_rank_chunks(*args, **kwargs)
    layout_plan._rank_chunks = counting
    try:
        plan, row["plan_s"], row["plan_cpu_s"] = _timed(lambda: layout_plan.plan_layout(config, layout, placements))
        row["models_built"] = len(built)
        row["peak_rss"] = _rss_bytes()
        if reference:
            grid = layout_plan.compute_rank_groups(layout.world_size, tp=tp, pp=pp, ep=ep, etp=etp)
            ref, row["reference_s"], row["reference_cpu_s"] = _timed(
                lambda: layout_plan.plan_grid(config, grid, placements, every_rank=True))
            row["reference_models_built"] = len(built) - row["models_built"]
            row["equal_to_reference"] = ref == plan.tensors
            row["peak_rss_with_reference"] = _rss_bytes()
            del ref
    finally:
        layout_plan._rank_chunks = real_rank_chunks
    row["tensors"] = len(plan.tensors)
    row["chunks"] = sum(len(c.regions) for c in plan.tensors.values())
    fields, row["manifest_s"], _ = _timed(lambda: json.dumps(manifest_fields(config, layout, placements, {})))
    row["manifest_fields_bytes"] = len(fields)
    streamed = [StreamedTensor(n, torch.bfloat16, c.global_shape, c.regions) for n, c in plan.tensors.items()]
    with tempfile.TemporaryDirectory() as directory:
        _, row["writer_plan_s"], _ = _timed(lambda: CheckpointStreamWriter(directory, streamed))
    _, row["chunks_are_runs_s"], _ = _timed(lambda: [t.chunks_are_runs for t in streamed])
    return row


def _measure_in_child(queue, case, reference):
    queue.put(measure(case, False, reference))


def _isolated(case: tuple, reference: bool) -> dict:
    """``measure`` in a fresh process, so that each row's peak RSS is its own."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_measure_in_child, args=(queue, case, reference))
    child.start()
    row = queue.get()
    child.join()
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'layout':<20} {'world':>5} {'models':>6} {'plan s':>7} {'cpu s':>6} {'peak GiB':>8} {'ref s':>7} "
          f"{'ref cpu':>7} {'equal':>5} {'chunks':>7} {'manif. MB':>9} {'writer s':>8}")
    for r in rows:
        ref = (f"{r['reference_s']:>7.1f} {r['reference_cpu_s']:>7.1f} {str(r['equal_to_reference']):>5}"
               if "reference_s" in r else f"{'-':>7} {'-':>7} {'-':>5}")
        print(f"{r['name']:<20} {r['world']:>5} {r['models_built']:>6} {r['plan_s']:>7.2f} {r['plan_cpu_s']:>6.2f} "
              f"{r['peak_rss'] / GiB:>8.2f} {ref} {r['chunks']:>7} {r['manifest_fields_bytes'] / 1e6:>9.2f} "
              f"{r['writer_plan_s'] + r['chunks_are_runs_s']:>8.2f}")


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny DeepSeek-V3 on two layouts, with the reference, in this process")
    parser.add_argument("--reference", action="store_true",
                        help="also plan with one model per rank and check the plans are equal")
    parser.add_argument("--reference-max-world", type=int, default=512,
                        help="--reference: only for rows of at most this world (one model per rank: minutes "
                             "at 4096)")
    parser.add_argument("--json", default="benchmarks/results/layout_plan.json", help="where to write results")
    args = parser.parse_args(argv)
    if args.reference_max_world < 1:
        print("error: --reference-max-world must be >= 1", file=sys.stderr)
        return 1
    if args.quick:
        rows = [measure(case, True, True) for case in QUICK_CASES]
    else:
        from megamoe.checkpoint.layout import ParallelLayout
        rows = [_isolated(case, args.reference and ParallelLayout(tp=case[1], pp=case[4], ep=case[2], etp=case[3])
                          .world_size <= args.reference_max_world) for case in CASES]
    print_table(rows)
    write_results(args.json, {"quick": args.quick, "isolated": not args.quick, "rows": rows})
    if any(row.get("equal_to_reference") is False for row in rows):
        print("error: a plan differs from the one-model-per-rank reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
