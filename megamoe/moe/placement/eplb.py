"""Online expert rebalancing (EPLB): re-place experts over their slots, while training or generating,
from the load the router produced over a recent window, moving as few weights as possible.

One round, every ``EPLBConfig.interval`` steps (training) or forward passes (generation), on every rank:

1. Reduce the window (:class:`~megamoe.moe.placement.expert_load_window.ExpertLoadWindow`) in ONE all-reduce over
   all ranks: int64 token counts per MoE layer and expert, each token counted once (one TP rank per
   token set; at inference the data-parallel ranks only under data-parallel attention, as
   :func:`~megamoe.inference.expert_load.gather_expert_load`), plus every layer's current placement
   (one reporting rank per pipeline stage), so every rank of every stage sees every layer.
2. Each layer's balancedness under its current placement; the layers below
   ``balancedness_threshold`` are re-placed, worst first, at most ``max_layers_per_round``: all ranks
   choose the same layers from the same numbers.
3. :func:`~megamoe.moe.placement.replacement.replace_experts` for each chosen layer of this stage: a
   deterministic function of (current placement, load), so every rank computes the same placement
   without a broadcast. That is checked, not assumed: one tiny all-reduce (MAX) of a digest of each new
   placement (and of every other layer's current one) and its negation; if two ranks disagree,
   :class:`PlacementDivergenceError` is raised on every rank before any weight moves.
4. :func:`~megamoe.moe.placement.expert_migration.migrate_layer` for each chosen layer whose placement changed:
   only the changed slots receive weights (and, in training, their optimizer state).
5. One tiny all-reduce of what moved, for the :class:`EPLBReport`, which is logged.

A placement never changes the function the model computes (replicas are one expert), so a run with
rebalancing computes what the run without it computes, up to the order of floating-point sums.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass

import torch

from megamoe import comms
from megamoe.host_values import host_floats, host_ints
from megamoe.moe.placement import replacement
from megamoe.moe.placement.argument_checks import hierarchy
from megamoe.moe.placement.expert_load_window import ExpertLoadWindow
from megamoe.moe.placement.expert_migration import migrate_layer
from megamoe.moe.placement.expert_slots import ExpertPlacement

__all__ = ["EPLBConfig", "EPLBReport", "ExpertRebalancer", "PlacementDivergenceError"]

logger = logging.getLogger(__name__)

_NOT_HELD = -(2 ** 63)          # the digest of a layer this rank does not hold (below every digest and its negation)
_DIGEST_MASK = 2 ** 62 - 1


def _positive_int_field(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EPLBConfig.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class EPLBConfig:
    """When and how much to rebalance.

    ``window``: steps (training) or forward passes (generation) of load statistics kept, on the device.
    ``interval``: rebalance every that many steps / forward passes.
    ``balancedness_threshold`` in (0, 1]: re-place a layer only when its balancedness (mean / max EP-rank
    load) under the window's load is below it; 1.0 considers every layer that is not perfectly balanced.
    ``max_layers_per_round``: re-place at most that many layers per round, the worst first (None: all).
    ``num_groups`` / ``num_nodes``: the hierarchical policy (expert groups packed onto nodes, see
    :meth:`ExpertPlacement.balanced`), passed to ``replace_experts``; both or neither.
    """

    window: int = 100
    interval: int = 1000
    balancedness_threshold: float = 1.0
    max_layers_per_round: int | None = None
    num_groups: int | None = None
    num_nodes: int | None = None

    def __post_init__(self):
        _positive_int_field(self.interval, "interval")
        _positive_int_field(self.window, "window")
        threshold = self.balancedness_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
            raise ValueError(f"EPLBConfig.balancedness_threshold must be a number in (0, 1] (1.0: every layer that "
                             f"is not perfectly balanced), got {threshold!r}")
        if self.max_layers_per_round is not None:
            _positive_int_field(self.max_layers_per_round, "max_layers_per_round")
        if (self.num_groups is None) != (self.num_nodes is None):
            raise ValueError("EPLBConfig.num_groups and num_nodes go together (hierarchical placement); give both "
                             "or neither")
        if self.num_groups is not None:
            _positive_int_field(self.num_groups, "num_groups")
            _positive_int_field(self.num_nodes, "num_nodes")


@dataclass(frozen=True)
class EPLBReport:
    """One rebalancing round, identical on every rank (but ``seconds``)."""

    step: int                       # the training step / forward pass it ran after
    layers: tuple[int, ...]         # global ids of the MoE layers whose placement changed
    moved_slots: int                # slots that received an expert from another EP rank (all layers)
    local_copies: int               # slots that received an expert already on their rank
    moved_bytes: int                # bytes sent over the EP groups, summed over all ranks
    balancedness_before: float      # mean over all MoE layers, their placements before, under the window's load
    balancedness_after: float       # the same, after
    seconds: float                  # this rank's wall time of the round


class PlacementDivergenceError(RuntimeError):
    """Ranks computed different expert placements for one layer: migrating would corrupt the model."""


def _digest(layer_id: int, placement: ExpertPlacement) -> int:
    data = f"{layer_id}:{placement.ep_size}:".encode() + placement.slot_to_expert.numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _DIGEST_MASK


class ExpertRebalancer:
    """Records every step's expert loads into the window and rebalances every ``config.interval`` steps
    (see the module docstring). Collective (every rank of the layout calls the same methods in step).

    ``model``: this rank's pipeline stage (a :class:`~megamoe.models.GPTMoEModel` or anything with
    ``config`` and ``moe_layers()``); ``world_group``: all ranks (None for one process). ``optimizer``:
    training, its state moves with the weights. ``counts_tokens``: whether this rank's counts enter the
    load (default: TP rank 0; the trainer passes :func:`megamoe.models.sequence_parallel.counts_own_tokens`,
    every rank under sequence parallelism; see :func:`megamoe.inference.generation.generate` for
    inference's). ``cumulative_counters``: the layers' ``load_counter`` is not reset between steps (as in
    generation), so each record is the difference from the previous one.
    """

    def __init__(self, model, state, config: EPLBConfig, *, world_group, optimizer=None,
                 counts_tokens: bool | None = None, cumulative_counters: bool = False):
        if not isinstance(config, EPLBConfig):
            raise ValueError(f"eplb must be an EPLBConfig, got {type(config).__name__}")
        moe = model.config.moe
        if moe is None or not model.config.moe_layer_ids:
            raise ValueError("expert rebalancing (eplb) needs a model with MoE layers; this one has none")
        self.model, self.state, self.config = model, state, config
        self.world_group, self.optimizer = world_group, optimizer
        self.num_experts, self.num_slots = moe.num_experts, moe.num_expert_slots
        self._check_hierarchy(state.ep.size)
        self.layer_ids = tuple(sorted(model.config.moe_layer_ids))            # every stage's, global ids
        self.layers = dict(sorted(model.moe_layers().items()))                # this stage's
        self.device = next(model.parameters()).device
        self.window = ExpertLoadWindow(config.window, len(self.layers), self.num_experts, self.device)
        self.counts_tokens = state.tp.rank == 0 if counts_tokens is None else bool(counts_tokens)
        # One rank per pipeline stage contributes its layers' placements to the reduction.
        self.reports_placement = state.tp.rank == 0 and state.dp_cp.rank == 0
        # Every EP group of a stage holds the same slots and migrates alike: its count divides the sums.
        self._ep_groups_per_stage = state.world_size // (state.pp.size * state.ep.size)
        self._previous = self._counters().clone() if cumulative_counters else None
        self.reports: list[EPLBReport] = []
        if state.ep.size == 1:
            logger.info("EPLB with EP 1: a single EP rank is always balanced, so no expert will move")

    def _check_hierarchy(self, ep_size: int) -> None:
        groups, nodes = self.config.num_groups, self.config.num_nodes
        try:
            hierarchy(self.num_experts, ep_size, groups, nodes)
        except ValueError as error:
            raise ValueError(f"EPLBConfig.num_groups={groups}, num_nodes={nodes} do not fit {self.num_experts} "
                             f"experts on EP {ep_size}: {error}") from None

    def _counters(self) -> torch.Tensor:
        if not self.layers:
            return torch.zeros(0, self.num_experts, dtype=torch.int64, device=self.device)
        return torch.stack([layer.load_counter.per_expert.to(self.device) for layer in self.layers.values()])

    @torch.no_grad()
    def record(self) -> None:
        """Add this step's (or forward pass's) loads to the window: device work only."""
        counts = self._counters()
        if self._previous is not None:
            counts, self._previous = counts - self._previous, counts
        self.window.record(counts)

    def due(self, step: int) -> bool:
        return step % self.config.interval == 0

    @torch.no_grad()
    def rebalance(self, step: int) -> EPLBReport:
        """One round (module docstring); collective over ``world_group``. On the meta device (a dry run,
        see :mod:`megamoe.host_values`) the loads read as zero: the round reduces and checks, and moves
        nothing."""
        started = time.perf_counter()
        loads, placements = self._reduced_loads_and_placements()
        before = {layer_id: placements[layer_id].balancedness(loads[layer_id]) for layer_id in self.layer_ids}
        chosen = self._choose_layers(loads, before)
        updates = {layer_id: replacement.replace_experts(
            self.layers[layer_id].placement, loads[layer_id],
            num_groups=self.config.num_groups, num_nodes=self.config.num_nodes)
            for layer_id in chosen if layer_id in self.layers}
        self._check_agreement(updates)
        moved = {layer_id: migrate_layer(self.layers[layer_id], update.placement, self.optimizer)
                 for layer_id, update in updates.items() if update.changed_slots}
        report = self._report(step, chosen, before, updates, moved, loads, started)
        self.reports.append(report)
        logger.info("EPLB after step %d: re-placed MoE layers %s (of %d below the threshold %g): %d slots moved, %d "
                    "local copies, %d bytes sent; balancedness %.4f -> %.4f (%.3f s)", step, list(report.layers),
                    len(chosen), self.config.balancedness_threshold, report.moved_slots, report.local_copies,
                    report.moved_bytes, report.balancedness_before, report.balancedness_after, report.seconds)
        return report

    def _reduced_loads_and_placements(self) -> tuple[dict[int, torch.Tensor], dict[int, ExpertPlacement]]:
        """The window's loads [E] (int64, host) and the current placement of EVERY MoE layer, from one
        all-reduce over the world of [layers, E + S] int64: loads from the counting ranks, placements
        (+1, so that zero means "not reported here") from one rank per stage."""
        E, S = self.num_experts, self.num_slots
        row = {layer_id: i for i, layer_id in enumerate(self.layer_ids)}
        table = torch.zeros(len(self.layer_ids), E + S, dtype=torch.int64, device=self.device)
        window_total = self.window.total()
        for i, (layer_id, layer) in enumerate(self.layers.items()):
            if self.counts_tokens:
                table[row[layer_id], :E] = window_total[i]
            if self.reports_placement:
                table[row[layer_id], E:] = layer.placement.slot_to_expert.to(self.device) + 1
        comms.all_reduce_(table, self.world_group)
        on_meta = self._assumed_table().flatten().tolist() if table.is_meta else None
        host = torch.tensor(host_ints(table, on_meta=on_meta), dtype=torch.int64).view_as(table)
        ep_size = self.state.ep.size
        loads = {layer_id: host[row[layer_id], :E] for layer_id in self.layer_ids}
        placements = {layer_id: ExpertPlacement(host[row[layer_id], E:] - 1, E, ep_size) for layer_id in self.layer_ids}
        return loads, placements

    def _assumed_table(self) -> torch.Tensor:
        """What a meta dry run reads as the reduced table: no load, this stage's placements and the default
        one for the other stages' layers."""
        E, S = self.num_experts, self.num_slots
        table = torch.zeros(len(self.layer_ids), E + S, dtype=torch.int64)
        default = ExpertPlacement.default(E, S, self.state.ep.size)
        for row, layer_id in enumerate(self.layer_ids):
            placement = self.layers[layer_id].placement if layer_id in self.layers else default
            table[row, E:] = placement.slot_to_expert + 1
        return table

    def _choose_layers(self, loads: dict[int, torch.Tensor], before: dict[int, float]) -> list[int]:
        """The layers to re-place, worst first (ties: lower layer id): below the threshold, with load."""
        below = sorted((balance, layer_id) for layer_id, balance in before.items()
                       if balance < self.config.balancedness_threshold and int(loads[layer_id].sum()) > 0)
        limit = self.config.max_layers_per_round
        return sorted(layer_id for _, layer_id in below[:limit])

    def _check_agreement(self, updates: dict) -> None:
        """One all-reduce (MAX) of [digest, -digest] per layer of the placement each rank is about to hold
        (the new one of a chosen layer, else the current one): every rank holding a layer must agree (max ==
        min); raises PlacementDivergenceError on every rank otherwise, before anything moves."""
        row = {layer_id: i for i, layer_id in enumerate(self.layer_ids)}
        digests = torch.full((2, len(self.layer_ids)), _NOT_HELD, dtype=torch.int64)
        for layer_id, layer in self.layers.items():
            digest = _digest(layer_id, updates[layer_id].placement if layer_id in updates else layer.placement)
            digests[:, row[layer_id]] = torch.tensor([digest, -digest])
        mine = digests.flatten().tolist()          # a meta dry run: every rank agrees with this one
        digests = digests.to(self.device)
        comms.all_reduce_(digests, self.world_group, op=torch.distributed.ReduceOp.MAX)
        values = host_ints(digests, on_meta=mine)
        highest, negated_lowest = values[:len(row)], values[len(row):]
        diverged = [layer_id for layer_id, i in row.items()
                    if highest[i] != _NOT_HELD and highest[i] != -negated_lowest[i]]
        if diverged:
            raise PlacementDivergenceError(
                f"EPLB: the ranks hold or computed different expert placements for MoE layer(s) {diverged} (from the "
                "same reduced load), so nothing was migrated. replace_experts must be a deterministic function of "
                "(current placement, load): run the same megamoe version and EPLBConfig on every rank, keep any "
                "custom policy free of rank-local state (random numbers, timing), and set a layer's placement on "
                "every rank alike")

    def _report(self, step, chosen, before, updates, moved, loads, started) -> EPLBReport:
        """Sum what moved over the world (one small all-reduce, only when layers were chosen)."""
        after = dict(before)
        changed: list[int] = []
        totals = [0, 0, 0]
        if chosen:
            row = {layer_id: i for i, layer_id in enumerate(chosen)}
            # per chosen layer: [moved slots, local copies, bytes sent, balancedness after, reported]
            stats = torch.zeros(len(chosen), 5, dtype=torch.float64)
            for layer_id, stat in moved.items():
                stats[row[layer_id], :3] = torch.tensor([stat.moved_slots, stat.local_copies, stat.moved_bytes],
                                                        dtype=torch.float64)
            if self.reports_placement:
                for layer_id, update in updates.items():
                    stats[row[layer_id], 3:] = torch.tensor(
                        [update.placement.balancedness(loads[layer_id]), float(bool(update.changed_slots))])
            stats = stats.to(self.device)
            comms.all_reduce_(stats, self.world_group)
            stats = torch.tensor(host_floats(stats), dtype=torch.float64).view(len(chosen), 5)
            for layer_id in chosen:
                after[layer_id] = stats[row[layer_id], 3].item()
                if stats[row[layer_id], 4] > 0:
                    changed.append(layer_id)
            totals = [int(round(v)) for v in stats[:, :3].sum(dim=0).tolist()]
        groups = self._ep_groups_per_stage
        return EPLBReport(step=step, layers=tuple(changed), moved_slots=totals[0] // groups,
                          local_copies=totals[1] // groups, moved_bytes=totals[2],
                          balancedness_before=_mean(before.values()), balancedness_after=_mean(after.values()),
                          seconds=time.perf_counter() - started)


def _mean(values) -> float:
    values = list(values)
    return math.fsum(values) / len(values) if values else 1.0
