"""Online expert rebalancing (EPLB) in a real training run: the "real" half of ``benchmarks/eplb.py``.

    python benchmarks/eplb_real.py [--real-steps N] [--real-interval N] [--real-window N] [--json out.json]

``--real-ranks`` gloo ranks on this CPU (default 4, EP = ranks, all-to-all dispatcher) train a small MoE
model (:data:`MODEL`) with SKEWED, DRIFTING routing: every router's selection bias favours a few hot
experts (:data:`SKEW`), and the hot set moves on by one expert every ``--real-drift-every`` steps (the
aux-loss-free bias update is off, so nothing else balances the load). Two runs from the same weights
and batches, one after the other in the same spawn:

- ``static``: the default placement (experts in slot order, the extra slots replicating the first ones);
- ``eplb``: ``TrainConfig(eplb=EPLBConfig(window, interval))``, re-placing experts every interval.

Reported per run: the balancedness (mean / max EP-rank load of the step's routed tokens under the
placement that served them, mean over MoE layers: ``StepMetrics.balancedness``) over time and its mean
after the first interval; the rebalancing rounds with the slots and bytes moved; and the step time of a
rebalancing step against a normal one, both medians of rank 0's wall time of ``train_step`` in the same
run (a rebalancing step is a normal step plus the round: one reduction, the placement search, the
agreement check and the migration). The 4 ranks share this host's cores, so times are noisy: the ratio
of two medians of one run is the figure to read, not the absolute times.

:func:`run` returns the rows (one dict per run) for ``benchmarks/eplb.py --part real``; run standalone,
the script prints a table and writes JSON (default ``benchmarks/results/eplb_real.json``).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from common import argument_parser, write_results      # sibling module
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.placement.eplb import EPLBConfig
from megamoe.moe.router import RouterConfig
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, RopeConfig

__all__ = ["add_real_arguments", "run", "MODEL", "SKEW"]

# hidden, layers (all MoE), experts, slots (25% extra: one replica per rank at EP 4), top-k, FFN, vocab,
# sequence length, global batch (sequences), micro-batch.
MODEL = dict(hidden=64, layers=4, experts=16, slots=20, top_k=2, ffn=64, vocab=256, seq=32, batch=16, micro=4)
# Selection bias by expert (rolled by the layer id, then by one every drift period): a few hot experts.
SKEW = (0.06, 0.05, 0.04, 0.03, 0.02) + (0.0,) * 11


def add_real_arguments(parser) -> None:
    g = parser.add_argument_group("real run (gloo ranks on this CPU)")
    g.add_argument("--real-ranks", type=int, default=4, help="gloo ranks (= EP size); must divide the slots (20)")
    g.add_argument("--real-steps", type=int, default=40, help="training steps per run")
    g.add_argument("--real-interval", type=int, default=5, help="EPLB: rebalance every N steps")
    g.add_argument("--real-window", type=int, default=5, help="EPLB: steps of load statistics")
    g.add_argument("--real-drift-every", type=int, default=20, help="the hot experts move on every N steps")


def _config() -> GPTMoEConfig:
    m = MODEL
    return GPTMoEConfig(
        family="custom", vocab_size=m["vocab"], hidden_size=m["hidden"], num_layers=m["layers"],
        attention=AttentionConfig(hidden_size=m["hidden"], num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=m["hidden"] // 4, rope=RopeConfig(dim=m["hidden"] // 4)),
        moe=MoEConfig(router=RouterConfig(hidden_size=m["hidden"], num_experts=m["experts"], top_k=m["top_k"],
                                          norm_topk_prob=True, use_expert_bias=True, expert_bias_update_rate=0.0),
                      ffn_hidden_size=m["ffn"], num_expert_slots=m["slots"], dispatcher="alltoall",
                      expert_backend="torch"),
        moe_layer_ids=tuple(range(m["layers"])))


def _skew(model, shift: int) -> None:
    for layer_id, layer in model.moe_layers().items():
        layer.router.expert_bias.copy_(torch.tensor(SKEW).roll(layer_id + shift))


def _worker(rank, world_size, steps, interval, window, drift_every):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    state = initialize_model_parallel(ep=world_size)
    m = MODEL
    per_rank = m["batch"] // state.dp_cp.size
    data = torch.randint(0, m["vocab"], (steps, m["batch"], m["seq"] + 1), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, eplb in (("static", None), ("eplb", EPLBConfig(window=window, interval=interval))):
        model = GPTMoEModel(_config(), state)
        initialize_parameters(model, seed=0)
        trainer = Trainer(model, state, TrainConfig(lr=3e-3, eplb=eplb), world_group=dist.group.WORLD)
        series = []
        for step in range(steps):
            _skew(model, step // drift_every)
            mine = data[step, state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
            started = time.perf_counter()
            metrics = trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in mine.split(m["micro"])])
            series.append({"step": metrics.step, "seconds": time.perf_counter() - started, "loss": metrics.loss,
                           "balancedness": metrics.balancedness, "eplb": metrics.eplb})
        runs[name] = series
    destroy_model_parallel()
    return runs


def _summary(name: str, series: list[dict], interval: int) -> dict:
    rounds = [s["eplb"] for s in series if s["eplb"] is not None]
    rebalancing = [s["seconds"] for s in series if s["eplb"] is not None]
    normal = [s["seconds"] for s in series[1:] if s["eplb"] is None]     # the first step warms up
    settled = [s["balancedness"] for s in series if s["step"] > interval]
    row = {
        "run": name,
        "balancedness_by_step": [round(s["balancedness"], 4) for s in series],
        "mean_balancedness": statistics.fmean(settled) if settled else float("nan"),
        "final_loss": series[-1]["loss"],
        "rebalances": len(rounds),
        "moved_slots": sum(r.moved_slots for r in rounds),
        "local_copies": sum(r.local_copies for r in rounds),
        "moved_bytes": sum(r.moved_bytes for r in rounds),
        "moved_bytes_per_round": [r.moved_bytes for r in rounds],
        "balancedness_before_after": [(round(r.balancedness_before, 4), round(r.balancedness_after, 4))
                                      for r in rounds],
        "normal_step_s": statistics.median(normal) if normal else float("nan"),
    }
    if rebalancing:
        row["rebalancing_step_s"] = statistics.median(rebalancing)
        row["rebalancing_over_normal"] = row["rebalancing_step_s"] / row["normal_step_s"]
        row["round_s"] = statistics.median(r.seconds for r in rounds)
    return row


def run(args) -> list[dict]:
    """Train both runs on ``args.real_ranks`` spawned gloo ranks; one row per run (see the module docstring)."""
    for flag in ("real_ranks", "real_steps", "real_interval", "real_window", "real_drift_every"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if MODEL["slots"] % args.real_ranks:
        raise ValueError(f"--real-ranks {args.real_ranks} must divide the model's {MODEL['slots']} expert slots")
    runs = run_on_ranks(_worker, args.real_ranks, args=(args.real_steps, args.real_interval, args.real_window,
                                                        args.real_drift_every), timeout_s=1800)[0]
    return [_summary(name, series, args.real_interval) for name, series in runs.items()]


def print_table(rows: list[dict]) -> None:
    print(f"{'run':8s} {'mean bal.':>9s} {'rounds':>6s} {'moved slots':>11s} {'local':>5s} {'moved MB':>8s} "
          f"{'normal ms':>9s} {'rebal. ms':>9s} {'ratio':>6s}")
    for row in rows:
        rebalancing = row.get("rebalancing_step_s")
        print(f"{row['run']:8s} {row['mean_balancedness']:9.4f} {row['rebalances']:6d} {row['moved_slots']:11d} "
              f"{row['local_copies']:5d} {row['moved_bytes'] / 1e6:8.3f} {row['normal_step_s'] * 1e3:9.1f} "
              + (f"{rebalancing * 1e3:9.1f} {row['rebalancing_over_normal']:6.2f}" if rebalancing else
                 f"{'-':>9s} {'-':>6s}"))
    print("\nbalancedness over time (every step):")
    for row in rows:
        print(f"  {row['run']:8s} " + " ".join(f"{b:.2f}" for b in row["balancedness_by_step"]))
    for row in rows:
        if row["rebalances"]:
            print(f"\n{row['run']}: balancedness before -> after each round: "
                  + ", ".join(f"{b:.3f}->{a:.3f}" for b, a in row["balancedness_before_after"]))


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    add_real_arguments(parser)
    parser.add_argument("--json", default="benchmarks/results/eplb_real.json", help="write the results here")
    args = parser.parse_args(argv)
    try:
        rows = run(args)
    except ValueError as e:
        parser.error(str(e))
    print(f"torch {torch.__version__}; {args.real_ranks} gloo ranks (EP {args.real_ranks}); model {MODEL}; "
          f"{args.real_steps} steps, EPLB every {args.real_interval} steps over a window of {args.real_window}; "
          f"hot experts drift every {args.real_drift_every} steps")
    print_table(rows)
    write_results(args.json, {"model": MODEL, "skew": SKEW, "ranks": args.real_ranks, "steps": args.real_steps,
                              "interval": args.real_interval, "window": args.real_window,
                              "drift_every": args.real_drift_every, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
