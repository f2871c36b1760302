"""Online expert rebalancing (EPLB): balancedness, slots moved and placement time under a drifting load.

    python benchmarks/eplb.py [--part simulated|real|all] [--quick] [--json out.json]

``--part simulated`` (no ranks, one core): 256 experts, 288 and 320 slots, EP 32 and 64 (288 slots do
not divide over 64 ranks), flat and hierarchical (8 expert groups on 4 nodes at EP 32, on 8 at EP 64).
Each of ``--layers`` layers sees its own drifting load: Zipf weights, the exponent drawn per layer in
[1.0, 1.5], over a ranking of the experts that drifts (:func:`drifting_loads`), times 5% multiplicative
noise per window. Seeded: every run sees the same loads. Each window, every row re-places from that
window's observed load; it is judged on that load (``own``) and on the NEXT window's expected load
(``next``: what the layer then serves, less the noise that no placement can foresee):

- ``static``: the balanced placement of the first window, never changed;
- ``from scratch``: :meth:`ExpertPlacement.balanced` every window (DeepSeek EPLB's way: nearly every
  slot changes expert);
- ``from scratch, ranks matched``: the same, its ranks relabelled to keep most experts on their rank;
- ``movement-aware``: :func:`megamoe.moe.replace_experts` from the previous placement.

Columns: time-averaged balancedness (mean rank load / max; ``min``: the lowest ``next``), the
fraction of slots moved per window, and the time of one rebalance of a 61-layer model (placement
computation only, the least of ``--repeats`` calls: the mean time per layer and window x 61, and the
slowest window's). ``bound`` bounds the ``own`` balancedness
(:func:`megamoe.moe.placement.replacement.peak_bound`: flat, of any placement; hierarchical, of the
from-scratch policy's assignment of groups to nodes), which explains where a row stays low.

The 5% noise check starts each layer from the movement-aware placement of its load (a fixed point)
and perturbs that load by 5%: slots moved, and balancedness against a from-scratch placement for the
perturbed load (``at scratch stop``: the slots moved with ``compare_to_scratch=True``, which stops at
0.99x that from-scratch balancedness instead of at the runtime bound). Verdicts for the issue's
three targets follow the tables.

``--part real`` (4 gloo ranks training a small model) lives in ``benchmarks/eplb_real.py``; ``all``
runs both. Writes JSON (default benchmarks/results/eplb.json).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import eplb_real  # sibling module: the real-ranks half
from common import argument_parser, write_results  # sibling module
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.moe.placement.replacement import matched_to, peak_bound, replace_experts

MODEL_LAYERS = 61  # the layer count the time per rebalance is given for (the issue's, DeepSeek-V3's)
NOISE = 0.05
DRIFT_KEEP = 0.998  # of an expert's latent popularity score per window
SOFT_RANK = 0.5  # width of the score difference over which two experts trade ranks
MOVED_TARGET, SCRATCH_RATIO_TARGET, DRIFT_TARGET, TIME_TARGET_S = 0.15, 0.99, 0.95, 1.0


@dataclass(frozen=True)
class Config:
    num_experts: int
    num_slots: int
    ep_size: int
    num_groups: int | None = None
    num_nodes: int | None = None

    @property
    def name(self) -> str:
        layout = "flat" if self.num_nodes is None else f"{self.num_groups} groups / {self.num_nodes} nodes"
        return f"{self.num_experts} experts, {self.num_slots} slots, EP {self.ep_size}, {layout}"

    @property
    def hierarchy(self) -> dict:
        return {} if self.num_nodes is None else {"num_groups": self.num_groups, "num_nodes": self.num_nodes}


CONFIGS = [
    Config(256, 288, 32), Config(256, 320, 32), Config(256, 320, 64),
    Config(256, 288, 32, 8, 4), Config(256, 320, 32, 8, 4), Config(256, 320, 64, 8, 8),
]
QUICK_CONFIGS = [Config(64, 72, 8), Config(64, 80, 8, 8, 2)]


def drifting_loads(num_experts: int, windows: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """One layer's per-window (observed, expected) loads: Zipf weights by a drifting ranking of the
    experts (expected), times 5% noise (observed: what a window of statistics reports).

    Expert ``e`` carries ``(1 + rank_e) ** -exponent``, its rank a soft count of the experts with a
    higher latent score (a sigmoid of width ``SOFT_RANK``, so two experts trading places do so over a few
    windows, not at once). The scores follow a mean-reverting random walk of unit variance (each window
    keeps ``DRIFT_KEEP`` of the score and adds fresh noise), so the hot experts change over tens of windows.
    """
    rng = np.random.default_rng(seed)
    exponent = rng.uniform(1.0, 1.5)
    scores = rng.standard_normal(num_experts)
    loads = []
    for _ in range(windows):
        above = 1.0 / (1.0 + np.exp(-(scores[None, :] - scores[:, None]) / SOFT_RANK))  # [e, other]
        ranks = above.sum(axis=1) - 0.5  # without the expert itself
        expected = (1.0 + ranks) ** -exponent * 1e6
        loads.append((_noisy(expected, rng), expected))
        scores = DRIFT_KEEP * scores + np.sqrt(1 - DRIFT_KEEP**2) * rng.standard_normal(num_experts)
    return loads


def _noisy(load: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.clip(load * (1 + NOISE * rng.standard_normal(load.shape[0])), 0, None)


def _changed(old: ExpertPlacement, new: ExpertPlacement) -> int:
    return int((old.slot_to_expert != new.slot_to_expert).sum())


def _timed(fn, repeats: int):
    """(result of ``fn()``, the least seconds of ``repeats`` calls): other processes only add time, and
    the placement functions are deterministic, so every call returns the same."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return result, min(seconds)


def simulate(config: Config, layers: int, windows: int, repeats: int) -> dict:
    """Every row over ``windows`` windows of ``layers`` layers; the movement-aware and matching times are
    the least of ``repeats`` calls (the from-scratch placement is timed once: it is the slow one)."""
    c = config
    rows = {name: {"balancedness": [], "own": [], "moved": [], "seconds": np.zeros(windows)}
            for name in ("static", "from scratch", "from scratch, ranks matched", "movement-aware")}
    bounds = []
    for layer in range(layers):
        loads = drifting_loads(c.num_experts, windows + 1, seed=layer)
        first = ExpertPlacement.balanced(loads[0][0], c.num_slots, c.ep_size, **c.hierarchy)
        placements = {name: first for name in rows}
        for window in range(windows):
            load, next_load = loads[window][0], loads[window + 1][1]
            bounds.append(load.sum() / c.ep_size / peak_bound(load, c.num_slots, c.ep_size,
                                                           c.num_groups or 1, c.num_nodes or 1))
            scratch, seconds = _timed(lambda: ExpertPlacement.balanced(load, c.num_slots, c.ep_size, **c.hierarchy), 1)
            rows["from scratch"]["seconds"][window] += seconds
            table, seconds = _timed(lambda: matched_to(placements["from scratch, ranks matched"], scratch,
                                                       c.num_nodes or 1), repeats)
            matched = ExpertPlacement(table.tolist(), c.num_experts, c.ep_size)
            rows["from scratch, ranks matched"]["seconds"][window] += seconds
            update, seconds = _timed(lambda: replace_experts(placements["movement-aware"], load, **c.hierarchy),
                                     repeats)
            rows["movement-aware"]["seconds"][window] += seconds
            new = {"static": first, "from scratch": scratch, "from scratch, ranks matched": matched,
                   "movement-aware": update.placement}
            for name, placement in new.items():
                rows[name]["moved"].append(_changed(placements[name], placement) / c.num_slots)
                rows[name]["balancedness"].append(placement.balancedness(next_load))
                rows[name]["own"].append(placement.balancedness(load))
                placements[name] = placement
    # The matched row's search includes the from-scratch placement it relabels.
    rows["from scratch, ranks matched"]["seconds"] += rows["from scratch"]["seconds"]
    result = {"config": c.name, "bound": float(np.mean(bounds)), "rows": {}}
    for name, row in rows.items():
        per_layer = row["seconds"] / layers
        result["rows"][name] = {
            "balancedness": float(np.mean(row["balancedness"])),
            "min_balancedness": float(np.min(row["balancedness"])),
            "own_balancedness": float(np.mean(row["own"])),
            "moved": float(np.mean(row["moved"])),
            "max_moved": float(np.max(row["moved"])),
            "rebalance_61_layers_s": float(per_layer.mean() * MODEL_LAYERS),
            "slowest_rebalance_61_layers_s": float(per_layer.max() * MODEL_LAYERS),
        }
    return result


def noise_check(config: Config, layers: int) -> dict:
    """5% noise on a fixed point of the movement-aware placement, per layer."""
    c = config
    moved, ratios, moved_at_scratch_stop = [], [], []
    for layer in range(layers):
        load = drifting_loads(c.num_experts, 1, seed=1000 + layer)[0][0]
        settled = replace_experts(ExpertPlacement.balanced(load, c.num_slots, c.ep_size, **c.hierarchy), load,
                                  **c.hierarchy).placement
        noisy = _noisy(load, np.random.default_rng(2000 + layer))
        update = replace_experts(settled, noisy, **c.hierarchy)
        scratch = ExpertPlacement.balanced(noisy, c.num_slots, c.ep_size, **c.hierarchy).balancedness(noisy)
        moved.append(len(update.changed_slots) / c.num_slots)
        ratios.append(update.balancedness_after / scratch)
        # Stopping at 0.99x this from-scratch balancedness instead of at the runtime bound.
        at_stop = replace_experts(settled, noisy, compare_to_scratch=True, **c.hierarchy)
        moved_at_scratch_stop.append(len(at_stop.changed_slots) / c.num_slots)
    return {"config": c.name, "moved": float(np.mean(moved)), "max_moved": float(np.max(moved)),
            "min_ratio_to_scratch": float(np.min(ratios)), "mean_ratio_to_scratch": float(np.mean(ratios)),
            "max_moved_at_scratch_stop": float(np.max(moved_at_scratch_stop)),
            "met": bool(np.max(moved) <= MOVED_TARGET and np.min(ratios) >= SCRATCH_RATIO_TARGET)}


def run_simulated(configs: list[Config], layers: int, windows: int, repeats: int) -> dict:
    torch.set_num_threads(1)  # the target is for one core; the placement code is single-threaded
    print(f"simulated: {layers} layers x {windows} windows per configuration; balancedness on the window's "
          f"observed load (own) and the next window's expected load (next); time: one rebalance of "
          f"{MODEL_LAYERS} layers (mean / slowest window)")
    drift = [simulate(c, layers, windows, repeats) for c in configs]
    for entry in drift:
        print(f"\n{entry['config']}   bound {entry['bound']:.4f}")
        print(f"{'row':28s} {'own':>6s} {'next':>6s} {'min':>6s} {'moved':>6s} {'max':>6s} {'time s':>7s} "
              f"{'slowest':>7s}")
        for name, row in entry["rows"].items():
            print(f"{name:28s} {row['own_balancedness']:6.4f} {row['balancedness']:6.4f} "
                  f"{row['min_balancedness']:6.3f} {row['moved']:6.3f} "
                  f"{row['max_moved']:6.3f} {row['rebalance_61_layers_s']:7.3f} "
                  f"{row['slowest_rebalance_61_layers_s']:7.3f}")
    noise = [noise_check(c, layers) for c in configs]
    print(f"\n{NOISE:.0%} noise on a settled placement ({layers} layers each): slots moved, balancedness / "
          "from scratch's")
    print(f"{'configuration':48s} {'moved':>6s} {'max':>6s} {'min ratio':>9s} {'mean':>6s} {'at scratch stop':>15s}")
    for entry in noise:
        print(f"{entry['config']:48s} {entry['moved']:6.3f} {entry['max_moved']:6.3f} "
              f"{entry['min_ratio_to_scratch']:9.4f} {entry['mean_ratio_to_scratch']:6.4f} "
              f"{entry['max_moved_at_scratch_stop']:15.3f}")
    verdicts = _verdicts(configs, drift, noise)
    print()
    for verdict in verdicts.values():
        print(f"target {verdict['target']}: {'met' if verdict['met'] else 'NOT met'} ({verdict['detail']})")
    return {"layers": layers, "windows": windows, "timing_repeats": repeats, "drift": drift, "noise": noise,
            "verdicts": verdicts}


def _verdicts(configs: list[Config], drift: list[dict], noise: list[dict]) -> dict:
    failed_noise = [e["config"] for e in noise if not e["met"]]
    # The drift target is for 12.5% extra slots at EP 32, flat (the hierarchical bound is far lower), on
    # the load each placement was computed from: on the next window's, 5% noise in the statistics alone
    # costs every row ~4% (see the from-scratch row's ``next``).
    judged = [e for c, e in zip(configs, drift)
              if c.num_nodes is None and c.num_slots * 8 == c.num_experts * 9 and c.ep_size == 32]
    drift_values = [e["rows"]["movement-aware"]["own_balancedness"] for e in judged]
    # The time target is for 256 experts on 288 slots, EP 32 (flat and hierarchical); the others are shown.
    timed = [e for c, e in zip(configs, drift) if c.num_slots * 8 == c.num_experts * 9 and c.ep_size == 32]
    slowest = max((e["rows"]["movement-aware"]["slowest_rebalance_61_layers_s"] for e in timed), default=None)
    times = "; ".join(f"{e['config']}: {e['rows']['movement-aware']['rebalance_61_layers_s']:.3f} mean, "
                      f"{e['rows']['movement-aware']['slowest_rebalance_61_layers_s']:.3f} slowest" for e in drift)
    return {
        "noise": {"target": f"at {NOISE:.0%} noise, <= {MOVED_TARGET:.0%} of slots moved and >= "
                            f"{SCRATCH_RATIO_TARGET}x the from-scratch balancedness",
                  "met": not failed_noise,
                  "detail": "every configuration" if not failed_noise else "not for " + "; ".join(failed_noise)},
        "drift": {"target": f"drifting load, time-averaged balancedness >= {DRIFT_TARGET} with 12.5% extra "
                            f"slots at EP 32 (flat)",
                  "met": bool(judged) and min(drift_values) >= DRIFT_TARGET,
                  "detail": ", ".join(f"{e['config']}: {v:.4f} (bound {e['bound']:.4f})"
                                      for e, v in zip(judged, drift_values)) or "no such configuration run"},
        "time": {"target": f"< {TIME_TARGET_S} s per rebalance of {MODEL_LAYERS} layers x 256 experts (288 slots, "
                           f"EP 32) on one core, every window",
                 "met": slowest is not None and slowest < TIME_TARGET_S,
                 "detail": (f"seconds per {MODEL_LAYERS}-layer rebalance: {times}" if timed
                            else "no configuration with 288 slots / EP 32 was run")},
    }


def main(argv=None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--part", choices=("simulated", "real", "all"), default="simulated",
                        help="which half to run")
    parser.add_argument("--quick", action="store_true",
                        help="simulated: 64 experts on EP 8 (flat, and 8 groups on 2 nodes), 2 layers, 3 windows, "
                             "1 repeat")
    parser.add_argument("--layers", type=int, default=8, help="simulated layers per configuration")
    parser.add_argument("--windows", type=int, default=12, help="load windows (rebalances) per layer")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timing: the least of this many calls of each movement-aware and matching step")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "eplb.json"),
                        help="where to write the results")
    eplb_real.add_real_arguments(parser)
    args = parser.parse_args(argv)
    if min(args.layers, args.windows, args.repeats) < 1:
        print("error: --layers, --windows and --repeats must be >= 1", file=sys.stderr)
        return 1
    results = {}
    if args.part in ("real", "all"):
        try:
            rows = eplb_real.run(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        eplb_real.print_table(rows)
        results["real"] = rows
    if args.part in ("simulated", "all"):
        configs = QUICK_CONFIGS if args.quick else CONFIGS
        layers, windows, repeats = (2, 3, 1) if args.quick else (args.layers, args.windows, args.repeats)
        results["simulated"] = run_simulated(configs, layers, windows, repeats)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
