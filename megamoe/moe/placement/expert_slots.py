"""Expert slots: where each expert's weights live, how tokens pick a replica, and load statistics.

An *expert* is the model's concept (the router scores ``num_experts`` experts, checkpoints key weights by
expert id). An *expert slot* is the engine's: ``num_slots >= num_experts`` slots, divided evenly and
contiguously over the EP ranks (rank ``r`` owns slots ``[r*S/ep, (r+1)*S/ep)``), each holding the weights
of exactly one expert. A hot expert may hold several slots (replicas); tokens routed to it are spread over
them by :meth:`ExpertPlacement.choose_slots`, a rule every rank evaluates identically.

The balanced packing lives in :mod:`megamoe.moe.placement.placement_policy`; the expert-load file (per-layer token
counts per expert, written by inference and read by ``megamoe-convert import-hf --expert-load FILE`` to
build balanced placements) in :mod:`megamoe.moe.placement.expert_load_file`, whose names this module re-exports.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Mapping, Sequence

import torch

from megamoe.moe.placement.argument_checks import hierarchy, positive_int, validated_load
from megamoe.moe.placement.expert_load_file import (EXPERT_LOAD_FORMAT, EXPERT_LOAD_VERSION, load_expert_load,
                                                    save_expert_load)
from megamoe.moe.placement.placement_policy import balanced_slot_to_expert

__all__ = [
    "EXPERT_LOAD_FORMAT",
    "EXPERT_LOAD_VERSION",
    "ExpertLoadCounter",
    "ExpertPlacement",
    "load_expert_load",
    "save_expert_load",
]

logger = logging.getLogger(__name__)


def _index_below(value, bound: int, name: str) -> int:
    try:
        index = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        index = None
    if index is None or not 0 <= index < bound:
        raise ValueError(f"{name} must be an integer in [0, {bound}), got {value!r}")
    return index


def _check_slot_layout(num_experts: int, num_slots: int, ep_size: int) -> None:
    if num_slots < num_experts:
        raise ValueError(
            f"num_slots ({num_slots}) < num_experts ({num_experts}): every expert needs at least one slot; "
            f"use num_slots >= {num_experts}"
        )
    if num_slots % ep_size != 0:
        raise ValueError(
            f"num_slots ({num_slots}) is not a multiple of ep_size ({ep_size}): slots are divided evenly "
            f"over EP ranks; use e.g. num_slots={math.ceil(num_slots / ep_size) * ep_size}"
        )


def _slot_table(slot_to_expert) -> torch.Tensor:
    """[S] int64 CPU copy of a slot -> expert table given as a tensor or a sequence of ints."""
    if isinstance(slot_to_expert, torch.Tensor):
        if slot_to_expert.dim() != 1:
            raise ValueError(
                f"slot_to_expert must be 1-D [num_slots], got shape {tuple(slot_to_expert.shape)}"
            )
        if slot_to_expert.is_floating_point() or slot_to_expert.is_complex() or slot_to_expert.dtype == torch.bool:
            raise ValueError(f"slot_to_expert must hold integer expert ids, got dtype {slot_to_expert.dtype}")
        return slot_to_expert.detach().to(device="cpu", dtype=torch.int64).clone()
    if isinstance(slot_to_expert, (str, bytes)) or not isinstance(slot_to_expert, Sequence):
        raise ValueError(f"slot_to_expert must be a sequence of expert ids, got {type(slot_to_expert).__name__}")
    ids = []
    for slot, expert in enumerate(slot_to_expert):
        try:
            if isinstance(expert, bool):
                raise TypeError
            ids.append(operator.index(expert))
        except TypeError:
            raise ValueError(f"slot_to_expert[{slot}] must be an integer expert id, got {expert!r}") from None
    return torch.tensor(ids, dtype=torch.int64)


class ExpertPlacement:
    """Slot -> expert table for one MoE layer, with its inverse. Immutable; validated on construction.

    ``slot_to_expert[s]`` is the expert whose weights slot ``s`` holds; EP rank ``r`` owns slots
    ``local_slots(r)``. ``expert_to_slots[e, :replica_counts[e]]`` lists expert ``e``'s slots in ascending
    order (the rest of the row is -1). The tensor attributes return copies, so a placement never changes
    once built (it is hashed, compared and cached on devices); build a new one to rebalance.
    """

    __slots__ = (
        "num_experts",
        "num_slots",
        "ep_size",
        "slots_per_rank",
        "_slot_to_expert",
        "_replica_counts",
        "_expert_to_slots",
        "_device_tables",
    )

    def __init__(self, slot_to_expert: Sequence[int] | torch.Tensor, num_experts: int, ep_size: int):
        num_experts = positive_int(num_experts, "num_experts")
        ep_size = positive_int(ep_size, "ep_size")
        table = _slot_table(slot_to_expert)  # [S]
        num_slots = table.numel()
        _check_slot_layout(num_experts, num_slots, ep_size)
        out_of_range = ((table < 0) | (table >= num_experts)).nonzero().flatten()
        if out_of_range.numel():
            slot = int(out_of_range[0])
            raise ValueError(
                f"slot_to_expert[{slot}] = {int(table[slot])} is not an expert id; ids must be in [0, {num_experts})"
            )
        replica_counts = torch.bincount(table, minlength=num_experts)  # [E]
        missing = (replica_counts == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(
                f"experts {missing[:8]}{'...' if len(missing) > 8 else ''} have no slot; every expert needs at "
                f"least one slot: replace some replicas of other experts with them"
            )
        # Slots grouped by expert, ascending slot order within each group (stable sort).
        slots_by_expert = torch.argsort(table, stable=True)  # [S]
        experts_sorted = table[slots_by_expert]
        first_position = torch.cumsum(replica_counts, 0) - replica_counts  # [E]
        replica_index = torch.arange(num_slots) - first_position[experts_sorted]
        expert_to_slots = torch.full((num_experts, int(replica_counts.max())), -1, dtype=torch.int64)
        expert_to_slots[experts_sorted, replica_index] = slots_by_expert

        set_attribute = object.__setattr__
        set_attribute(self, "num_experts", num_experts)
        set_attribute(self, "num_slots", num_slots)
        set_attribute(self, "ep_size", ep_size)
        set_attribute(self, "slots_per_rank", num_slots // ep_size)
        set_attribute(self, "_slot_to_expert", table)
        set_attribute(self, "_replica_counts", replica_counts)
        set_attribute(self, "_expert_to_slots", expert_to_slots)
        set_attribute(self, "_device_tables", {})

    def __setattr__(self, name, value):
        raise AttributeError(f"ExpertPlacement is immutable; build a new placement instead of setting {name!r}")

    def __reduce__(self):
        return (type(self), (self._slot_to_expert.tolist(), self.num_experts, self.ep_size))

    # ------------------------------------------------------------------ tables

    @property
    def slot_to_expert(self) -> torch.Tensor:
        """[S] int64: the expert each slot holds (a copy)."""
        return self._slot_to_expert.clone()

    @property
    def replica_counts(self) -> torch.Tensor:
        """[E] int64: number of slots holding each expert, >= 1 (a copy)."""
        return self._replica_counts.clone()

    @property
    def expert_to_slots(self) -> torch.Tensor:
        """[E, max_replicas] int64: each expert's slots in ascending order, padded with -1 (a copy)."""
        return self._expert_to_slots.clone()

    def local_slots(self, ep_rank: int) -> range:
        """The slots EP rank ``ep_rank`` owns (contiguous)."""
        ep_rank = _index_below(ep_rank, self.ep_size, "ep_rank")
        return range(ep_rank * self.slots_per_rank, (ep_rank + 1) * self.slots_per_rank)

    def slot_owner(self, slot: int) -> int:
        """The EP rank that owns ``slot``."""
        return _index_below(slot, self.num_slots, "slot") // self.slots_per_rank

    def slot_owner_tensor(self, slots: torch.Tensor) -> torch.Tensor:
        """EP rank owning each slot, elementwise (int64, same shape and device). Slots are not range
        checked here: that would force a device sync on every call."""
        return torch.div(slots, self.slots_per_rank, rounding_mode="floor").long()

    # ------------------------------------------------------------------ construction

    @classmethod
    def default(cls, num_experts: int, num_slots: int, ep_size: int) -> "ExpertPlacement":
        """Experts in order in the first E slots; slot ``E + i`` replicates expert ``i % E``."""
        num_experts = positive_int(num_experts, "num_experts")
        num_slots = positive_int(num_slots, "num_slots")
        ep_size = positive_int(ep_size, "ep_size")
        _check_slot_layout(num_experts, num_slots, ep_size)
        return cls([slot % num_experts for slot in range(num_slots)], num_experts, ep_size)

    @classmethod
    def balanced(
        cls,
        expert_load: Sequence[float] | torch.Tensor,
        num_slots: int,
        ep_size: int,
        *,
        num_groups: int | None = None,
        num_nodes: int | None = None,
    ) -> "ExpertPlacement":
        """A placement that keeps the most loaded EP rank light for the given per-expert load.

        1. Replicas: one slot per expert, then each extra slot to the expert with the highest load per
           replica (a replica is assumed to take an even share of its expert's tokens, which is what
           :meth:`choose_slots` does), at most one replica per rank while other experts can take one.
           After the packing (step 2), single replicas are moved from one expert to another while that
           lowers the heaviest rank (with few slots per rank the packing, not the shares, decides).
        2. Packing: replicas onto ranks, exactly ``slots_per_rank`` each, greedy heaviest-first onto the
           lightest rank with room (once avoiding a second replica of an expert on one rank where
           possible, once not), each followed by swaps that lower the heaviest rank, then swaps that
           separate replicas of one expert without raising it; the lighter result is kept (balance wins
           over separation).
        3. If :meth:`default` has a lighter heaviest rank for this load (small, lumpy loads), it is
           returned instead, so the result is never worse than the default layout.

        With ``num_groups`` and ``num_nodes`` (DeepSeek EPLB's hierarchical policy): the experts form
        ``num_groups`` contiguous groups, whole groups are first packed onto ``num_nodes`` nodes (a node
        is a contiguous block of ``ep_size / num_nodes`` ranks), then steps 1-2 run inside each node with
        its share of the slots, so replicas stay in their node and group-limited routing keeps its
        tokens within few nodes. Step 3 does not apply (the default layout ignores nodes).
        Deterministic: ties go to lower indices. Within a rank, slots are ordered by expert id.
        """
        load = validated_load(expert_load, None, "expert_load")
        num_experts = load.numel()
        num_slots = positive_int(num_slots, "num_slots")
        ep_size = positive_int(ep_size, "ep_size")
        _check_slot_layout(num_experts, num_slots, ep_size)
        num_groups, num_nodes = hierarchy(num_experts, ep_size, num_groups, num_nodes)

        slot_to_expert = balanced_slot_to_expert(load.tolist(), num_slots, ep_size, num_groups, num_nodes)
        placement = cls(slot_to_expert, num_experts, ep_size)
        if num_nodes == 1:
            # The heuristic can lose to the naive layout on small, lumpy loads (e.g. five replicas of
            # equal load on two ranks, where replicating a lighter expert would have split evenly); never return
            # something worse than what the engine would use without load statistics. The default
            # layout ignores node boundaries, so the hierarchical policy has no such fallback.
            default = cls.default(num_experts, num_slots, ep_size)
            if default.rank_loads(load).max() < placement.rank_loads(load).max():
                logger.debug("balanced placement: the default layout is better for this load; using it")
                placement = default
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("balanced placement %r: balancedness %.4f", placement, placement.balancedness(load))
        return placement

    # ------------------------------------------------------------------ load accounting

    def rank_loads(self, expert_load: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """[ep] float64 load per EP rank, assuming each expert's load splits evenly over its replicas."""
        load = validated_load(expert_load, self.num_experts, "expert_load")
        slot_load = load[self._slot_to_expert] / self._replica_counts[self._slot_to_expert]  # [S]
        return slot_load.view(self.ep_size, self.slots_per_rank).sum(dim=1)

    def balancedness(self, expert_load: Sequence[float] | torch.Tensor) -> float:
        """Mean rank load / max rank load: 1.0 is perfect; 1.0 too when there is no load at all."""
        loads = self.rank_loads(expert_load)
        peak = loads.max().item()
        return 1.0 if peak == 0 else loads.mean().item() / peak

    # ------------------------------------------------------------------ routing

    def choose_slots(self, expert_ids: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Map routed (token, expert) pairs to slots: expert_ids [T, K], token_positions [T] -> slots [T, K].
        ``token_positions`` may be omitted when no expert is replicated (``num_slots == num_experts``).

        ``token_positions`` are GLOBAL token positions (the same number for the same token on every
        rank). The replica is ``(token_position + expert_id) % replica_counts[expert_id]``: it depends on
        nothing but the pair, so every rank picks the same slot (a per-rank choice would count a pair
        once per rank holding a replica in the all-gather path), and consecutive tokens of one expert
        cycle through its replicas. Adding the expert id staggers the cycles of different experts, so
        one token's K replicated experts do not all take their replica 0 (which tend to share a rank).
        Ids are not range checked here: that would force a device sync on every call.
        """
        if expert_ids.dim() != 2:
            raise ValueError(f"expert_ids must be [T, K], got shape {tuple(expert_ids.shape)}")
        if token_positions is not None and tuple(token_positions.shape) != tuple(expert_ids.shape[:1]):
            raise ValueError(
                f"token_positions must be [T] = [{expert_ids.shape[0]}] to match expert_ids, "
                f"got shape {tuple(token_positions.shape)}"
            )
        for name, ids in (("expert_ids", expert_ids), ("token_positions", token_positions)):
            if ids is not None and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
                raise ValueError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
        replica_counts, expert_to_slots = self._tables_on(expert_ids.device)
        expert_ids = expert_ids.long()
        if self.num_slots == self.num_experts:  # one slot per expert: nothing to choose (a decode hot path)
            return expert_to_slots[expert_ids, 0]
        if token_positions is None:
            raise ValueError("token_positions are required: this placement replicates experts, and the replica "
                             "of a (token, expert) pair depends on the token's global position")
        replica = torch.remainder(token_positions.long().unsqueeze(1) + expert_ids, replica_counts[expert_ids])
        return expert_to_slots[expert_ids, replica]

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Copied to each device once: the tables never change, and a copy per call would be a H2D transfer.
        tables = self._device_tables.get(device)
        if tables is None:
            tables = (self._replica_counts.to(device), self._expert_to_slots.to(device))
            self._device_tables[device] = tables
        return tables

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict:
        """JSON-safe description (plain ints), e.g. for a checkpoint manifest."""
        return {
            "num_experts": self.num_experts,
            "ep_size": self.ep_size,
            "slot_to_expert": self._slot_to_expert.tolist(),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "ExpertPlacement":
        """Inverse of :meth:`to_dict`; validates like the constructor."""
        if not isinstance(d, Mapping):
            raise ValueError(f"an expert placement must be a dict, got {type(d).__name__}")
        expected = {"num_experts", "ep_size", "slot_to_expert"}
        if set(d) != expected:
            missing, unknown = sorted(expected - set(d)), sorted(set(d) - expected, key=str)
            raise ValueError(
                f"expert placement dict must have exactly the keys {sorted(expected)}; "
                f"missing {missing}, unknown {unknown}"
            )
        if not isinstance(d["slot_to_expert"], (list, tuple)):
            raise ValueError(
                f"expert placement 'slot_to_expert' must be a list of ints, got {type(d['slot_to_expert']).__name__}"
            )
        return cls(d["slot_to_expert"], d["num_experts"], d["ep_size"])

    # ------------------------------------------------------------------ identity

    def __eq__(self, other) -> bool:
        if not isinstance(other, ExpertPlacement):
            return NotImplemented
        return (
            self.num_experts == other.num_experts
            and self.ep_size == other.ep_size
            and torch.equal(self._slot_to_expert, other._slot_to_expert)
        )

    def __hash__(self) -> int:
        return hash((self.num_experts, self.ep_size, tuple(self._slot_to_expert.tolist())))

    def __repr__(self) -> str:
        replicated = (self._replica_counts > 1).nonzero().flatten().tolist()
        shown = ", ".join(f"{e}: {int(self._replica_counts[e])}" for e in replicated[:8])
        more = ", ..." if len(replicated) > 8 else ""
        return (
            f"ExpertPlacement(num_experts={self.num_experts}, num_slots={self.num_slots}, "
            f"ep_size={self.ep_size}, replicas={{{shown}{more}}})"
        )


class ExpertLoadCounter:
    """Running per-expert and per-slot token counts for one layer (for rebalancing and benchmarks).

    Counts are created on ``device`` (the layer's), follow the ids they are fed (a model moved to
    another device after construction moves them on the first call) and are updated
    with ``index_add_``, which, unlike ``bincount`` on CUDA, needs no device sync. Negative ids (the
    layer marks a pair dropped by the capacity limit with slot -1) are not counted. Ids past the end
    are not detected here (that would need a sync); on CPU they raise an IndexError.
    """

    def __init__(self, num_experts: int, num_slots: int, device=None):
        self.num_experts = positive_int(num_experts, "num_experts")
        self.num_slots = positive_int(num_slots, "num_slots")
        if self.num_slots < self.num_experts:
            raise ValueError(
                f"num_slots ({self.num_slots}) < num_experts ({self.num_experts}); use num_slots >= num_experts"
            )
        self.per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=device)  # [E]
        self.per_slot = torch.zeros(self.num_slots, dtype=torch.int64, device=device)  # [S]

    @torch.no_grad()
    def record(self, expert_ids: torch.Tensor, slot_ids: torch.Tensor | None = None) -> None:
        """Add one count per routed (token, expert) pair; ``slot_ids`` (same shape) also counts slots.

        ``per_expert`` counts what the router asked for, dropped pairs included (the demand a
        rebalanced placement must serve); ``per_slot`` counts only pairs with a slot (id >= 0).
        """
        if slot_ids is not None and slot_ids.shape != expert_ids.shape:
            raise ValueError(
                f"slot_ids shape {tuple(slot_ids.shape)} must equal expert_ids shape {tuple(expert_ids.shape)}"
            )
        self.per_expert = self._add(self.per_expert, expert_ids, "expert_ids")
        if slot_ids is not None:
            self.per_slot = self._add(self.per_slot, slot_ids, "slot_ids")

    @staticmethod
    def _add(counts: torch.Tensor, ids: torch.Tensor, name: str) -> torch.Tensor:
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
        counts = counts.to(ids.device)
        flat = ids.reshape(-1).long()
        # Negative ids add 0 at index 0 instead of being filtered out, which would need a sync.
        return counts.index_add_(0, flat.clamp(min=0), (flat >= 0).long())

    def reset(self) -> None:
        """Zero both counters (they stay on their device)."""
        self.per_expert.zero_()
        self.per_slot.zero_()
