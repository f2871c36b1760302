"""Moving experts between the slots of an MoE layer: the mechanism of online rebalancing (EPLB).

Slots never move between EP ranks (rank ``r`` always owns ``placement.local_slots(r)``); experts do.
:func:`migrate_layer` gives every slot whose expert differs between the layer's placement and a new one
its new expert's state, and then makes the new placement the layer's. Per changed slot the source is:

- a slot of the same rank that held the expert in the OLD placement: a local copy, no communication;
- else one slot holding it on another rank, chosen deterministically (every rank computes the same
  :func:`plan_migration`), the sending work spread over the expert's old replicas: the rank that has
  sent the fewest slots so far, then the lowest rank, then its lowest slot. A rank that wants one
  expert in several changed slots receives it once; its other slots copy the received one (local).

Every read comes from the old contents before any write, so swaps and cycles of experts are safe. The
remote transfers of a layer are ONE collective over its EP group, :func:`megamoe.comms.exchange_expert_slots`
(an all-to-all of packed bytes), issued by every rank or by none: a placement that changes nothing, or
whose changes are all local copies, communicates nothing.

What moves with a slot (its "payload", the same size for every slot of a layer):

- its weights: every parameter row of the slot (:meth:`GroupedExperts.slot_parameters`, any backend);
- with ``optimizer``: every per-parameter state tensor shaped like the parameter (Adam's ``exp_avg``,
  ``exp_avg_sq``, ``max_exp_avg_sq``; fp32 master weights kept in the state), cut like the parameter.
  0-dim state (Adam's ``step``) is the same for every slot of a parameter (one optimizer step updates
  the whole stacked tensor), so it stays. Other shapes are refused (ValueError): not splittable by slot.
  An optimizer with ``slot_state_views(param, index)`` (the distributed optimizer, whose state is this
  edp rank's shard rows) names the slot's state itself;
- FP8 delayed-scaling state (:meth:`GroupedExperts.slot_buffers`: the slot's amax histories and scales),
  moved rather than reset: the weight history belongs to the expert's weights, the activation histories
  to the tokens the expert attracts, so the slot goes on quantising exactly as its source slot did (and
  the layer computes the same function). A reset would restart the slot at scale 1. TransformerEngine's
  own FP8 state (backend ``te``) is not reachable and stays with the slot: it refills within
  ``amax_history_len`` steps, as after a checkpoint load.

Gradients do not move: call :func:`migrate_layer` after ``optimizer.step()`` and before the next
``zero_grad`` / forward (the trainer zeroes gradients at the start of each step). Everything reading the
placement (choosing slots, the replica-gradient sum, the gradient norm, ``sharded_state_dict``, the
checkpoint's ``expert_placement``) reads ``layer.placement`` when it runs, so it follows from the next step.

Layouts: under expert tensor parallelism each ETP rank moves its own shards over its EP group (the EP
group's ranks share one ETP rank); expert-data-parallel replicas of the layer migrate independently and
identically (same placements, same contents).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megamoe import comms
from megamoe.moe.placement.expert_slots import ExpertPlacement

__all__ = ["MigrationPlan", "MigrationStats", "SlotTransfer", "migrate_layer", "plan_migration"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationStats:
    """What one :func:`migrate_layer` call did on this rank.

    Summed over the EP group, ``moved_bytes == moved_slots * slot_payload_bytes`` exactly.
    """

    moved_slots: int      # slots that received an expert from another EP rank (one payload each)
    local_copies: int     # slots that received an expert already held on the same rank (no communication)
    moved_bytes: int      # bytes this rank SENT over the EP group (weights + optimizer state + FP8 scaling)


@dataclass(frozen=True)
class SlotTransfer:
    """One slot payload sent between EP ranks: the OLD contents of ``src_slot`` go to ``dst_rank``,
    which wants ``expert`` in ``dst_slots`` (global slot ids, ascending)."""

    expert: int
    src_slot: int
    dst_rank: int
    dst_slots: tuple[int, ...]


@dataclass(frozen=True)
class MigrationPlan:
    """Where each changed slot's new contents come from; the same on every rank.

    ``transfers`` are ordered by (destination rank, expert): each pair of ranks packs and unpacks them
    in that order. ``local_sources[dst_slot] = src_slot`` (both on one rank) for slots filled from the
    rank's own old contents; slots of a transfer are filled from its received payload.
    """

    changed_slots: tuple[int, ...]
    transfers: tuple[SlotTransfer, ...]
    local_sources: dict[int, int]


def _check_compatible(current: ExpertPlacement, new: ExpertPlacement) -> None:
    if not isinstance(new, ExpertPlacement):
        raise ValueError(f"new_placement must be an ExpertPlacement, got {type(new).__name__}")
    have = (current.num_experts, current.num_slots, current.ep_size)
    got = (new.num_experts, new.num_slots, new.ep_size)
    if have != got:
        raise ValueError(
            f"new_placement is for {got[0]} experts / {got[1]} slots / EP {got[2]}, the layer has {have[0]} / "
            f"{have[1]} / EP {have[2]}: a migration moves experts between the layer's existing slots; build the "
            "new placement for the same number of experts, slots and EP ranks")


def plan_migration(current: ExpertPlacement, new: ExpertPlacement) -> MigrationPlan:
    """The sources of every slot whose expert changes from ``current`` to ``new`` (a pure function:
    every rank computes the same plan). See the module docstring for the rules."""
    _check_compatible(current, new)
    old_table, new_table = current.slot_to_expert.tolist(), new.slot_to_expert.tolist()
    old_slots_of: dict[int, list[int]] = {}
    for slot, expert in enumerate(old_table):
        old_slots_of.setdefault(expert, []).append(slot)
    changed = tuple(s for s in range(current.num_slots) if old_table[s] != new_table[s])

    local_sources: dict[int, int] = {}
    wanted: dict[tuple[int, int], list[int]] = {}        # (rank, expert) -> changed slots with no local source
    for slot in changed:
        rank, expert = current.slot_owner(slot), new_table[slot]
        local = [s for s in old_slots_of[expert] if current.slot_owner(s) == rank]
        if local:
            local_sources[slot] = local[0]
        else:
            wanted.setdefault((rank, expert), []).append(slot)

    sends = [0] * current.ep_size
    transfers = []
    for (rank, expert), dst_slots in sorted(wanted.items()):
        # Every old slot of the expert is on another rank (else it would be a local copy).
        src_rank = min({current.slot_owner(s) for s in old_slots_of[expert]}, key=lambda r: (sends[r], r))
        src_slot = next(s for s in old_slots_of[expert] if current.slot_owner(s) == src_rank)
        sends[src_rank] += 1
        transfers.append(SlotTransfer(expert, src_slot, rank, tuple(dst_slots)))
    return MigrationPlan(changed, tuple(transfers), local_sources)


def _slot_state(layer, local_slot: int, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Views of everything that moves with ``local_slot``, in an order every rank shares."""
    slot_parameters = getattr(layer.experts, "slot_parameters", None)
    if slot_parameters is None:
        raise ValueError(
            f"{type(layer.experts).__name__} has no slot_parameters(local_slot): migrate_layer needs it to know "
            "which parameter rows hold a slot (see GroupedExperts.slot_parameters); add it to the experts module")
    views = []
    for param, index in slot_parameters(local_slot):
        views.append(param.detach()[index])
        if optimizer is None:
            continue
        slot_state_views = getattr(optimizer, "slot_state_views", None)
        if slot_state_views is not None:
            # A sharded optimizer (megamoe.training.distributed_optimizer): its state is [S, n / N] per
            # stacked parameter, one shard row per slot, on the same edp rank in every EP rank.
            views.extend(slot_state_views(param, index))
            continue
        state = optimizer.state.get(param, {})
        for key in sorted(state):
            value = state[key]
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue                      # scalars (Adam's step): the same for every slot
            if value.shape != param.shape:
                raise ValueError(
                    f"optimizer state {key!r} of an expert parameter has shape {list(value.shape)}, not the "
                    f"parameter's {list(param.shape)}: migrate_layer moves per-element state (moments, master "
                    "weights) and leaves 0-dim scalars; use an optimizer whose state has the parameter's shape")
            views.append(value[index])
    views.extend(getattr(layer.experts, "slot_buffers", lambda s: ())(local_slot))
    return views


def _pack(views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One slot's state as a 1-D uint8 tensor on ``device`` (each tensor's bytes, in order)."""
    return torch.cat([v.contiguous().view(-1).view(torch.uint8).to(device) for v in views])


def _unpack_into(views: list[torch.Tensor], payload: torch.Tensor) -> None:
    offset = 0
    for view in views:
        nbytes = view.numel() * view.element_size()
        # clone: a fresh buffer at offset 0, so the dtype view is aligned whatever came before it.
        view.copy_(payload[offset:offset + nbytes].clone().view(view.dtype).view(view.shape))
        offset += nbytes


@torch.no_grad()
def migrate_layer(layer, new_placement: ExpertPlacement,
                  optimizer: torch.optim.Optimizer | None = None) -> MigrationStats:
    """Give ``layer`` (an :class:`~megamoe.moe.moe_layer.MoELayer`) the placement ``new_placement``,
    moving each changed slot's weights and, with ``optimizer``, its optimizer state (see the module
    docstring for what moves and when to call it).

    A collective over ``layer.ep_group``: every EP rank calls it with the same ``new_placement`` (e.g. one
    computed by every rank from the same reduced loads). At most one collective; none when nothing has to
    cross ranks. Afterwards ``layer.placement is new_placement`` and ``layer.local_slots`` is unchanged.
    Raises ValueError when ``new_placement`` has another number of experts, slots or EP ranks.
    """
    current = layer.placement
    plan = plan_migration(current, new_placement)
    if not plan.changed_slots:
        layer.placement = new_placement
        return MigrationStats(0, 0, 0)
    my_rank, first = layer.ep_rank, layer.local_slots.start
    device = next(p for p, _ in layer.experts.slot_parameters(0)).device

    # Read everything first (old contents): what this rank sends, and the sources of its local copies.
    send_sizes, recv_sizes = [0] * layer.ep_size, [0] * layer.ep_size
    outgoing, incoming = [], []
    for transfer in plan.transfers:
        src_rank = current.slot_owner(transfer.src_slot)
        if src_rank == my_rank:
            payload = _pack(_slot_state(layer, transfer.src_slot - first, optimizer), device)
            outgoing.append(payload)
            send_sizes[transfer.dst_rank] += payload.numel()
        if transfer.dst_rank == my_rank:
            incoming.append(transfer)
    slot_nbytes = sum(v.numel() * v.element_size() for v in _slot_state(layer, 0, optimizer))
    for transfer in incoming:
        recv_sizes[current.slot_owner(transfer.src_slot)] += slot_nbytes
    local_fills = {dst: src for dst, src in plan.local_sources.items() if current.slot_owner(dst) == my_rank}
    copied = {src: [v.clone() for v in _slot_state(layer, src - first, optimizer)]
              for src in sorted(set(local_fills.values()))}

    # Transfers are packed in plan order, which groups them by destination rank (ascending).
    received = None
    if plan.transfers:                         # the same decision on every rank
        send_buffer = torch.cat(outgoing) if outgoing else torch.empty(0, dtype=torch.uint8, device=device)
        received = comms.exchange_expert_slots(send_buffer, send_sizes, recv_sizes, layer.ep_group)

    # Write. Received payloads arrive grouped by source rank, each group in plan order.
    moved = local = 0
    if incoming:
        offsets, start = {}, 0
        for rank in range(layer.ep_size):
            offsets[rank], start = start, start + recv_sizes[rank]
        for transfer in incoming:
            src_rank = current.slot_owner(transfer.src_slot)
            payload = received[offsets[src_rank]:offsets[src_rank] + slot_nbytes]
            offsets[src_rank] += slot_nbytes
            for dst in transfer.dst_slots:
                _unpack_into(_slot_state(layer, dst - first, optimizer), payload)
            moved += 1
            local += len(transfer.dst_slots) - 1
    for dst, src in local_fills.items():
        for view, value in zip(_slot_state(layer, dst - first, optimizer), copied[src]):
            view.copy_(value)
        local += 1
    layer.placement = new_placement
    stats = MigrationStats(moved_slots=moved, local_copies=local, moved_bytes=sum(send_sizes))
    logger.debug("expert migration over EP rank %d: %s (%d slots changed in the layer)", my_rank, stats,
                 len(plan.changed_slots))
    return stats
