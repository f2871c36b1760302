"""The training step of one small MoE model under the parallel layouts of 4 gloo ranks, with communication
overlap off and on: step time, bubble fraction, the bytes each collective moves and the overlapped
fraction of communication time.

    python benchmarks/scaling.py [--quick] [--layouts dp4 cp2_ep2 ...] [--steps N] [--json out.json]

The model (:data:`MODEL`): GQA attention (MLA for ``mla_*``), every layer an MoE (top-2 of 8 experts,
all-to-all dispatcher, ``torch`` experts) with a gated shared expert and the load-balancing aux loss,
fp32, sequences of 256 tokens (long enough that CP 2 splits them into 4 chunks of 64). Every layout trains
on the same global batch (``batch`` sequences a step, micro-batches of one sequence, sharded
over DP: ``batch / dp`` micro-batches per DP rank; CP ranks see the same micro-batches) from the
same seed. Layouts (:data:`LAYOUTS`):

- ``dp4``: the baseline; ``tp2_etp1_ep4`` (MoE parallel folding: attention TP 2, experts EP 4 with
  ETP 1), ``tp2_etp1_ep4_sp`` (and sequence parallelism);
- ``cp2_dp2``, ``cp2_tp2`` (ETP 2), ``cp2_ep2``, ``mla_cp2_ep2``: context parallelism;
- ``pp2_dp2`` (1F1B), ``pp2_v2_dp2`` and ``pp2_v2_ep2`` (the interleaved schedule, 2 model chunks a stage).

Each layout runs twice in the same process, from the same initial weights and data: overlap OFF and ON.
ON is ``TrainConfig(overlap_grad_reduce=True)`` (gradient buckets reduced from backward hooks) and, where
the layout has EP > 1 (all-to-all), ``MoEConfig.shared_expert_overlap`` (the shared expert computes
while the dispatch and combine all-to-alls are in flight). Both use buckets of ``--grad-bucket-mb`` (the
same bucket plan: only when a bucket starts differs). One warm-up step, then ``--steps`` measured steps.

Per (layout, overlap) row:

- ``step_ms``: the median and the minimum over the measured steps of the step time, each step's time
  the largest over the ranks (the step ends when the slowest rank does); ``tokens/s`` on the minimum
  (other processes only add time); ``on/off``: the ON step time over the OFF one (min and median);
- ``bubble``: the simulated bubble fraction (:func:`megamoe.pipeline.schedule_simulation.simulate_pipeline`
  for the layout's pp, micro-batches and V; backward 2x forward; its mean over ranks; 0 without PP) and
  the measured one: the share of the step a rank spends blocked in pipeline receives / sends (timeline
  tag ``pipeline``; mean over ranks), which also holds the transfers themselves;
- ``MiB/step``: the bytes this rank hands to each collective kind per step (:func:`megamoe.comms.comm_counter`;
  the mean over ranks, EP ranks differ in their routed tokens; ``send`` and ``recv`` are the pipeline's);
  the JSON has them per group too (labelled by the state's group names, e.g. ``dp/dp_cp``) and per rank;
- ``blocked_ms``: seconds per step the ranks spent blocked waiting for communication
  (:meth:`megamoe.comms.Timeline.blocked_seconds`, mean over ranks): for the gradient buckets
  (``grad_bucket``), the MoE all-to-alls (``moe_dispatch``, ``moe_combine``) and in total (those and the
  pipeline's waits). Blocking collectives count their whole duration as blocked;
- ``overlapped``: per tag, ``1 - blocked(ON) / blocked(OFF)``: the fraction of that communication time
  compute hid (undefined where OFF has none), clamped to [0, 1] in the table (the JSON keeps the raw value:
  negative when ON waited longer, which timing noise can do).

Checks, printed and stored, not asserted: ON's losses equal OFF's bit for bit at every step, and ON moves
the same bytes in the same collectives.

Machine caveat: on a 2-core CPU host 4 gloo ranks share the cores, so "communication" is mostly
another rank's compute and a hidden collective frees no idle hardware: the step-time gains of overlap
are small or negative here, and the time columns are noisy (the minimum is the figure to judge by). The
bytes, the bubble fractions and the overlapped fraction (the share of waiting that overlap removes) are
the figures that transfer to GPUs.

Writes JSON (default ``benchmarks/results/scaling.json``).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from common import argument_parser, write_results      # sibling module
from megamoe import comms
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.pipeline.schedule_simulation import simulate_pipeline
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, RopeConfig
from megamoe.transformer.mla import MLAConfig

__all__ = ["MODEL", "QUICK_MODEL", "LAYOUTS", "QUICK_LAYOUTS", "model_config", "simulated_bubble",
           "run", "main"]

WORLD_SIZE = 4
# hidden, layers, heads, KV heads, head dim, experts, top-k, expert / shared FFN, vocab, sequence length,
# global batch (sequences per step; micro-batches of one sequence).
MODEL = dict(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2, ffn=128, vocab=512,
             seq=256, batch=8)
QUICK_MODEL = dict(hidden=32, layers=4, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2, ffn=16, vocab=64,
                   seq=32, batch=4)
# name -> initialize_model_parallel kwargs plus sp (sequence parallelism), v (model chunks per stage), mla.
LAYOUTS = {
    "dp4": dict(),
    "tp2_etp1_ep4": dict(tp=2, etp=1, ep=4),
    "tp2_etp1_ep4_sp": dict(tp=2, etp=1, ep=4, sp=True),
    "cp2_dp2": dict(cp=2),
    "cp2_tp2": dict(cp=2, tp=2, etp=2),
    "cp2_ep2": dict(cp=2, ep=2),
    "mla_cp2_ep2": dict(cp=2, ep=2, mla=True),
    "pp2_dp2": dict(pp=2),
    "pp2_v2_dp2": dict(pp=2, v=2),
    "pp2_v2_ep2": dict(pp=2, v=2, ep=2),
}
QUICK_LAYOUTS = ("dp4", "pp2_v2_ep2")
OVERLAP = ("off", "on")
TAGS = ("grad_bucket", "moe_dispatch", "moe_combine", "pipeline")
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send", "recv")
# The state's groups, in the order their names label a group of ranks (several can share the same ranks).
_GROUP_NAMES = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "etp", "edp", "ep_etp", "etp_edp", "tp_cp", "mp")


def _parallel_kwargs(lay: dict) -> dict:
    return {k: lay[k] for k in ("tp", "pp", "ep", "etp", "cp") if k in lay}


def _sizes(lay: dict) -> tuple[int, int, int]:
    """(dp, pp, v) of a layout on :data:`WORLD_SIZE` ranks."""
    pp = lay.get("pp", 1)
    dp = WORLD_SIZE // (lay.get("tp", 1) * lay.get("cp", 1) * pp)
    return dp, pp, lay.get("v", 1)


def model_config(m: dict, lay: dict, *, overlap: bool) -> GPTMoEConfig:
    """The benchmark's model at the sizes ``m`` for layout ``lay``; ``overlap``: the shared expert overlaps
    the all-to-alls (only where the layout has EP > 1: elsewhere there is no all-to-all to hide)."""
    h, rope_dim = m["hidden"], m["head_dim"]
    if lay.get("mla"):
        attention = MLAConfig(hidden_size=h, num_attention_heads=m["heads"], q_lora_rank=h // 2,
                              kv_lora_rank=h // 2, qk_nope_head_dim=m["head_dim"], qk_rope_head_dim=rope_dim // 2,
                              v_head_dim=m["head_dim"], rope=RopeConfig(dim=rope_dim // 2))
    else:
        attention = AttentionConfig(hidden_size=h, num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                                    head_dim=m["head_dim"], rope=RopeConfig(dim=rope_dim))
    moe = MoEConfig(router=RouterConfig(hidden_size=h, num_experts=m["experts"], top_k=m["top_k"],
                                        norm_topk_prob=True, aux_loss_coeff=1e-2),
                    ffn_hidden_size=m["ffn"], dispatcher="alltoall", expert_backend="torch",
                    shared_experts=SharedExpertsConfig(hidden_size=h, ffn_hidden_size=m["ffn"], gate=True),
                    shared_expert_overlap=overlap and lay.get("ep", 1) > 1)
    return GPTMoEConfig(family="custom", vocab_size=m["vocab"], hidden_size=h, num_layers=m["layers"],
                        attention=attention, moe=moe, moe_layer_ids=tuple(range(m["layers"])),
                        sequence_parallel=lay.get("sp", False))


def simulated_bubble(lay: dict, global_batch: int) -> float:
    """The layout's simulated bubble fraction (mean over stages; 0 without PP) for ``global_batch``
    micro-batches of one sequence a step."""
    dp, pp, v = _sizes(lay)
    if pp == 1:
        return 0.0
    return simulate_pipeline(pp, global_batch // dp, v).mean_bubble_fraction


def _group_labels(state) -> dict[tuple[int, ...], str]:
    labels: dict[tuple[int, ...], list[str]] = {}
    for name in _GROUP_NAMES:
        info = getattr(state, name)
        if info is not None and info.size > 1:
            labels.setdefault(tuple(info.ranks), []).append(name)
    labels.setdefault(tuple(range(WORLD_SIZE)), []).append("world")
    return {ranks: "/".join(names) for ranks, names in labels.items()}


def _train(m: dict, lay: dict, state, data: torch.Tensor, *, overlap: bool, steps: int, bucket_mb: float) -> dict:
    """One (layout, overlap) run on this rank: warm-up + ``steps`` measured steps."""
    config = model_config(m, lay, overlap=overlap)
    model = GPTMoEModel(config, state, virtual_pipeline_stages=lay.get("v", 1))
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-3, overlap_grad_reduce=overlap, grad_bucket_mb=bucket_mb),
                      world_group=dist.group.WORLD)
    per_rank = m["batch"] // state.dp.size       # CP ranks of one DP rank train on the same sequences
    losses, times, blocked = [], [], {tag: [] for tag in (*TAGS, "total")}
    labels = _group_labels(state)
    with comms.comm_counter() as counter:
        for step in range(1 + steps):
            if step == 1:
                counter.reset()                        # the warm-up step is not counted
            mine = data[step, state.dp.rank * per_rank:(state.dp.rank + 1) * per_rank]
            micro_batches = [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in mine.split(1)]
            with comms.comm_timeline(next(model.parameters()).device) as timeline:   # CUDA events on GPU
                start = time.perf_counter()
                metrics = trainer.train_step(micro_batches)
                elapsed = time.perf_counter() - start
            losses.append(metrics.loss)
            if step >= 1:
                times.append(elapsed)
                for tag in TAGS:
                    blocked[tag].append(timeline.blocked_seconds(tag))
                blocked["total"].append(timeline.blocked_seconds())
    by_group = {f"{kind}@{labels.get(ranks, ranks)}": n / steps for (kind, ranks), n in counter._bytes.items()}
    return {"losses": losses, "times_s": times, "blocked_s": blocked, "bytes_by_group": by_group,
            "bytes_exact": sorted((k, list(r), n) for (k, r), n in counter._bytes.items()),
            "calls_exact": sorted((k, list(r), n) for (k, r), n in counter._calls.items()),
            "bytes": {kind: counter.bytes(kind) / steps for kind in KINDS}}


def _worker(rank, world_size, m, layouts, steps, bucket_mb):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    torch.set_num_threads(1)
    data = torch.randint(0, m["vocab"], (1 + steps, m["batch"], m["seq"] + 1),
                         generator=torch.Generator().manual_seed(0))
    out = {}
    for name in layouts:
        lay = LAYOUTS[name]
        state = initialize_model_parallel(**_parallel_kwargs(lay))
        try:
            for mode in OVERLAP:
                out[(name, mode)] = _train(m, lay, state, data, overlap=mode == "on", steps=steps, bucket_mb=bucket_mb)
        finally:
            destroy_model_parallel()
    return out


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _row(name: str, mode: str, per_rank: list[dict], m: dict) -> dict:
    lay = LAYOUTS[name]
    dp, pp, v = _sizes(lay)
    steps = len(per_rank[0]["times_s"])
    step_times = [max(r["times_s"][i] for r in per_rank) for i in range(steps)]     # the slowest rank's
    minimum, median = min(step_times), statistics.median(step_times)
    blocked = {tag: _mean(_mean(r["blocked_s"][tag]) for r in per_rank) for tag in (*TAGS, "total")}
    measured_bubble = (_mean(_mean(b / t for b, t in zip(r["blocked_s"]["pipeline"], r["times_s"])) for r in per_rank)
                       if pp > 1 else 0.0)
    return {"layout": name, "overlap": mode, "dp": dp, "pp": pp, "v": v, "micro_batches": m["batch"] // dp,
            "steps": steps, "step_times_s": step_times, "median_s": median, "min_s": minimum,
            "tokens_per_s": m["batch"] * m["seq"] / minimum,
            "bubble_simulated": simulated_bubble(lay, m["batch"]), "bubble_measured": measured_bubble,
            "bytes_per_step": {k: _mean(r["bytes"][k] for r in per_rank) for k in KINDS},
            "bytes_per_step_by_group": {k: _mean(r["bytes_by_group"].get(k, 0) for r in per_rank)
                                        for k in sorted({k for r in per_rank for k in r["bytes_by_group"]})},
            "bytes_per_step_per_rank": [r["bytes"] for r in per_rank],
            "blocked_s_per_step": blocked, "losses": per_rank[0]["losses"]}


def _compare(off: dict, on: dict, off_ranks: list[dict], on_ranks: list[dict]) -> dict:
    """What ON changes against OFF: the checks and the ratios, stored on the ON row."""
    overlapped, overlapped_raw = {}, {}
    a2a = ("moe_dispatch", "moe_combine")
    for tag in (*TAGS, "moe_all_to_all", "total"):        # moe_all_to_all: dispatch and combine together
        parts = a2a if tag == "moe_all_to_all" else (tag,)
        base = sum(off["blocked_s_per_step"][t] for t in parts)
        raw = 1 - sum(on["blocked_s_per_step"][t] for t in parts) / base if base > 0 else None
        overlapped_raw[tag] = raw
        overlapped[tag] = None if raw is None else min(1.0, max(0.0, raw))
    return {"losses_bit_identical": all(a["losses"] == b["losses"] for a, b in zip(off_ranks, on_ranks)),
            "bytes_equal": all(a["bytes_exact"] == b["bytes_exact"] and a["calls_exact"] == b["calls_exact"]
                               for a, b in zip(off_ranks, on_ranks)),
            "on_over_off_min": on["min_s"] / off["min_s"], "on_over_off_median": on["median_s"] / off["median_s"],
            "overlapped_fraction": overlapped, "overlapped_fraction_raw": overlapped_raw}


def run(m: dict, layouts, steps: int, bucket_mb: float) -> list[dict]:
    """Every (layout, overlap) on 4 spawned gloo ranks (one spawn): one row each, ON rows with the comparison."""
    results = run_on_ranks(_worker, WORLD_SIZE, args=(m, list(layouts), steps, bucket_mb), timeout_s=1800)
    rows = []
    for name in layouts:
        per_mode = {mode: [r[(name, mode)] for r in results] for mode in OVERLAP}
        off, on = (_row(name, mode, per_mode[mode], m) for mode in OVERLAP)
        on.update(_compare(off, on, per_mode["off"], per_mode["on"]))
        rows += [off, on]
    return rows


def _fraction(x) -> str:
    return "   -" if x is None else f"{x:4.2f}"


def print_table(rows: list[dict]) -> None:
    kinds = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")
    short = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "all_to_all": "A2A", "send": "p2p"}
    print(f"{'layout':16s} {'ovl':3s} {'med ms':>7s} {'min ms':>7s} {'tok/s':>7s} {'on/off':>6s} "
          f"{'bub sim':>7s} {'bub meas':>8s} "
          + " ".join(f"{short[k] + ' MiB':>8s}" for k in kinds)
          + f" {'blk grad':>8s} {'blk a2a':>7s} {'blk all':>7s} {'ovl grad':>8s} {'ovl a2a':>7s}"
            f" {'bit':>3s} {'B=':>3s}")
    for r in rows:
        on = r["overlap"] == "on"
        b = r["blocked_s_per_step"]
        ratio = f"{r['on_over_off_min']:6.2f}" if on else "     -"
        line = (f"{r['layout']:16s} {r['overlap']:3s} {r['median_s'] * 1e3:7.1f} {r['min_s'] * 1e3:7.1f} "
                f"{r['tokens_per_s']:7.0f} {ratio} "
                f"{r['bubble_simulated']:7.3f} {r['bubble_measured']:8.3f} "
                + " ".join(f"{r['bytes_per_step'][k] / 2**20:8.3f}" for k in kinds)
                + f" {b['grad_bucket'] * 1e3:8.1f} {(b['moe_dispatch'] + b['moe_combine']) * 1e3:7.1f}"
                  f" {b['total'] * 1e3:7.1f}")
        if on:
            f = r["overlapped_fraction"]
            line += (f" {_fraction(f['grad_bucket']):>8s} {_fraction(f['moe_all_to_all']):>7s} "
                     f"{'yes' if r['losses_bit_identical'] else 'NO':>3s} {'yes' if r['bytes_equal'] else 'NO':>3s}")
        print(line)
    print("times: per step the slowest rank, median / min over the measured steps; tok/s and on/off on the minimum; "
          "MiB, blk (ms blocked) per step per rank, mean over ranks; p2p: pipeline sends (receives equal them); "
          "ovl: 1 - blocked(ON)/blocked(OFF), clamped to [0, 1] (a2a: dispatch + combine); "
          "bit: ON losses == OFF bit for bit; B=: same collectives and bytes")


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny model (QUICK_MODEL) and, unless --layouts "
                                                             f"says, the layouts {' '.join(QUICK_LAYOUTS)}")
    parser.add_argument("--layouts", nargs="+", default=None, choices=list(LAYOUTS),
                        help="layouts to run (default: all of LAYOUTS)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps after the warm-up step")
    parser.add_argument("--grad-bucket-mb", type=float, default=0.25,
                        help="gradient bucket size (MB of fp32) of both runs: several buckets in the small model")
    parser.add_argument("--json", default="benchmarks/results/scaling.json", help="write the results here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if not args.grad_bucket_mb > 0:
        parser.error(f"--grad-bucket-mb must be > 0, got {args.grad_bucket_mb}")
    m = QUICK_MODEL if args.quick else MODEL
    layouts = args.layouts or (list(QUICK_LAYOUTS) if args.quick else list(LAYOUTS))
    rows = run(m, layouts, args.steps, args.grad_bucket_mb)
    print(f"torch {torch.__version__}; {WORLD_SIZE} gloo ranks, 1 thread each; model {m}; fp32; "
          f"{m['batch']} sequences a step; {args.steps} measured steps after 1 warm-up; buckets "
          f"{args.grad_bucket_mb} MB")
    print_table(rows)
    for on in rows[1::2]:
        if not (on["losses_bit_identical"] and on["bytes_equal"]):
            print(f"CHECK FAILED: {on['layout']}: overlap ON changed the losses or the collectives' bytes")
    write_results(args.json, {"model": m, "world_size": WORLD_SIZE,
                              "steps": args.steps, "grad_bucket_mb": args.grad_bucket_mb,
                              "layouts": {k: LAYOUTS[k] for k in layouts}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
