"""Which chunks of which logical tensors a parallel layout holds, found without starting its ranks.

How a converted checkpoint is laid out
--------------------------------------
Each logical tensor is cut exactly as a training run under the target layout saves it
(:func:`megamoe.checkpoint.format.save_checkpoint`): one chunk per TP / ETP shard, each expert once
(replicas are one logical chunk), no copy per data-parallel rank. The chunks are read off the model
itself: for one rank of each role of the layout's smallest world (:func:`_roles`), this module creates
the rank's process groups under torch's fake process group (no communication, one process), builds that
rank's :class:`~megamoe.models.GPTMoEModel` on the meta device and lists
:func:`~megamoe.checkpoint_state.sharded_state_dict`, plus the routed-expert chunks each EP peer in its role
holds (:func:`_ep_peer_chunks`). Why this rather than storing whole logical
tensors and relying on lazy slice loads (which would load as well):

- the layout is validated by the model's own checks (heads, KV heads and FFN sizes divisible,
  dispatcher constraints, slots divisible over EP, pipeline split), not by a second copy of the rules;
- a converted checkpoint is the checkpoint a training run under that layout writes, so one reader
  (``load_checkpoint(path, sharded_state_dict(model))``) serves both, and every rank of the target layout
  reads whole contiguous chunks (a whole-tensor store turns each row-parallel shard into a strided read);
- it costs tens of milliseconds per model, pp * lcm(tp, etp) of them (not one per rank, which at
  TP 8 x EP 64 x ETP 8 x PP 8 is 4096): parameters live on the meta device and the random initialisation
  the modules run at construction is skipped (:class:`_SkipRandomInit`).

Any other layout still loads it: the format assembles every requested region from the stored chunks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megamoe.checkpoint.chunk_regions import Region, _check_tiling
from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.layout import ParallelLayout
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.models import GPTMoEConfig, GPTMoEModel, LayerSpec
from megamoe.moe.moe_layer import MoELayer
from megamoe.moe.placement.expert_slots import ExpertPlacement
from parallel_state import GROUP_KINDS, GroupInfo, ParallelState, compute_rank_groups

__all__ = ["TensorChunks", "LayoutPlan", "plan_layout", "plan_grid"]

logger = logging.getLogger(__name__)

Chunk = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]   # name, global shape, offsets, shape


@dataclass(frozen=True)
class TensorChunks:
    """The distinct chunks of one logical tensor under a layout: disjoint, covering it, by offset."""

    global_shape: tuple[int, ...]
    regions: tuple[Region, ...]


@dataclass(frozen=True)
class LayoutPlan:
    """Every logical tensor a model holds under ``layout``, with its chunks."""

    layout: ParallelLayout
    tensors: dict[str, TensorChunks]


class _SkipRandomInit(TorchFunctionMode):
    """Turns the random draws of parameter initialisation into no-ops.

    The parallel layers draw each FULL logical weight on the CPU at construction and keep their chunk
    (layout-invariant seeding); on the meta device that chunk is discarded, so the draw is pure cost
    (the whole model, once per model the plan builds). Skipped, the CPU buffers are allocated but never touched.
    """

    _DRAWS = (torch.Tensor.normal_, torch.Tensor.uniform_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._DRAWS:
            return args[0]
        return func(*args, **(kwargs or {}))


def _virtual_rank_state(grid, rank: int, groups_of: dict[str, dict[int, tuple[int, ...]]]) -> ParallelState:
    """This rank's ParallelState over fake process groups (the default group must be a fake one)."""
    infos: dict[str, GroupInfo | None] = {}
    for kind in GROUP_KINDS:
        mine = groups_of[kind].get(rank)
        if mine is None:                    # embedding, on a middle pipeline stage
            infos[kind] = None
            continue
        group = None if len(mine) == 1 else dist.new_group(list(mine), backend="fake")
        infos[kind] = GroupInfo(group=group, ranks=mine, rank=mine.index(rank), size=len(mine))
    return ParallelState(world_size=grid.world_size, rank=rank, order=grid.order, **infos)


def _groups_by_rank(grid) -> dict[str, dict[int, tuple[int, ...]]]:
    """Kind -> rank -> the group of that kind holding it: one pass over the grid, where a search per rank
    and kind would cost O(world) each (O(world^2) for a plan)."""
    return {kind: {rank: group for group in getattr(grid, kind) for rank in group} for kind in GROUP_KINDS}


def _ep_peer_chunks(layer: MoELayer, prefix: str, chunks: list[Chunk], ep_peers: tuple[int, ...]) -> list[Chunk]:
    """The routed-expert chunks ``layer`` would hold as each of the EP ranks ``ep_peers`` (indices in its
    EP group), from the ones it holds (``chunks``, this rank's list).

    An EP peer's layer differs only in the slots it owns: every EP rank owns as many, each slot holds
    one expert, whose chunks :meth:`MoELayer.sharded_state_dict` names ``<prefix>experts.<id>.<weight>``
    and cuts by the ETP shard alone. So each of this layer's own experts has the same chunks up to the
    id (checked: the template), and a peer's are the template under the ids of its slots.
    """
    slot_to_expert = layer.placement.slot_to_expert.tolist()
    own = sorted({slot_to_expert[slot] for slot in layer.local_slots})
    by_expert: dict[int, set[tuple]] = {expert: set() for expert in own}
    head = f"{prefix}experts."
    for name, global_shape, offsets, shape in chunks:
        if name.startswith(head):
            expert, _, weight = name[len(head):].partition(".")
            if expert.isdigit() and int(expert) in by_expert:
                by_expert[int(expert)].add((weight, global_shape, offsets, shape))
    template = by_expert[own[0]]
    if not template or any(found != template for found in by_expert.values()):
        raise ConversionError(f"internal: the routed experts of {prefix[:-1]!r} do not all have the same chunks "
                              f"under the names {head}<id>.*; the planner cannot derive its EP peers' chunks")
    experts = {slot_to_expert[slot] for peer in ep_peers for slot in layer.placement.local_slots(peer)}
    return [(f"{head}{expert}.{weight}", global_shape, offsets, shape)
            for expert in sorted(experts - set(own)) for weight, global_shape, offsets, shape in template]


def _rank_chunks(config: GPTMoEConfig, grid, rank: int, placements: dict[int, ExpertPlacement],
                 groups_of: dict[str, dict[int, tuple[int, ...]]] | None = None, ep_peers: tuple[int, ...] = ()):
    """(name, global shape, offsets, shape) of every chunk ``rank`` holds under ``grid``.

    ``ep_peers``: EP ranks (indices in this rank's EP group) whose MoE layers' chunks are added as well,
    for ranks that differ from this one in their EP coordinate only (see :func:`_roles`).
    """
    # Imported here: it registers the "fake" backend with torch.distributed as a side effect.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    groups_of = groups_of if groups_of is not None else _groups_by_rank(grid)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=grid.world_size)
    try:
        state = _virtual_rank_state(grid, rank, groups_of)
        with _SkipRandomInit():
            model = GPTMoEModel(config, state, placements=placements, device="meta")
        chunks = [(c.name, c.global_shape, c.offsets, c.shape) for c in sharded_state_dict(model)]
        if ep_peers:
            chunks += [chunk for name, module in model.named_modules() if isinstance(module, MoELayer)
                       for chunk in _ep_peer_chunks(module, f"{name}.", chunks, ep_peers)]
        return chunks
    finally:
        dist.destroy_process_group()


def _roles(grid, groups_of: dict[str, dict[int, tuple[int, ...]]]) -> dict[int, tuple[int, ...]]:
    """One planned rank per role -> the other EP ranks (indices in its EP group) its role spans.

    A rank's chunks are fixed by its pipeline stage and its tp, etp and ep coordinates: the dense
    weights are cut by (pp, tp), the routed experts by (pp, etp) and named by the slots of the ep rank.
    Context and (expert) data parallelism hold copies, never other cuts. Ranks that agree on
    (pp, tp, etp) and differ in ep hold the same dense chunks, and their MoE layers differ only in the
    slots they own, so one model per (pp, tp, etp) serves them all (:func:`_ep_peer_chunks`). Across a
    plan's smallest world every rank has its own (pp, tp, ep, etp), so this is what saves the builds:
    pp * lcm(tp, etp) models instead of one per rank.
    """
    def index(kind: str, rank: int) -> int:
        return groups_of[kind][rank].index(rank)

    roles: dict[tuple[int, int, int], tuple[int, set[int]]] = {}
    for rank in range(grid.world_size):
        key = (index("pp", rank), index("tp", rank), index("etp", rank))
        roles.setdefault(key, (rank, set()))[1].add(index("ep", rank))
    return {rank: tuple(sorted(ep_ranks - {index("ep", rank)})) for rank, ep_ranks in roles.values()}


def plan_layout(config: GPTMoEConfig, layout: ParallelLayout,
                placements: dict[int, ExpertPlacement]) -> LayoutPlan:
    """The chunks every logical tensor of ``config`` has under ``layout`` with these expert placements.

    ConversionError naming the model's objection when the layout is impossible for the model. Needs a
    process whose default process group is not initialised (it creates fake ones in turn).
    """
    if dist.is_initialized():
        raise ConversionError("planning a layout creates fake process groups and needs a process without an "
                              "initialised torch.distributed default group; run the converter on its own")
    try:
        grid = compute_rank_groups(layout.world_size, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    except ValueError as e:
        raise ConversionError(f"impossible layout {layout}: {e}") from None
    return LayoutPlan(layout, plan_grid(config, grid, placements, f"layout {layout}"))


def plan_grid(config: GPTMoEConfig, grid, placements: dict[int, ExpertPlacement], what: str = "the layout", *,
              every_rank: bool = False) -> dict[str, TensorChunks]:
    """The chunks of every logical tensor over the ranks of ``grid`` (a :class:`parallel_state.RankGroups`
    of any world: context and data parallel copies change nothing), one model per role (:func:`_roles`).
    ``what`` names the layout in errors. ``every_rank``: one model per rank instead, the reference the
    roles are tested against (``grid.world_size`` models)."""
    groups_of = _groups_by_rank(grid)
    roles = {rank: () for rank in range(grid.world_size)} if every_rank else _roles(grid, groups_of)
    found: dict[str, tuple[tuple[int, ...], set[Region]]] = {}
    for rank, ep_peers in roles.items():
        try:
            chunks = _rank_chunks(config, grid, rank, placements, groups_of, ep_peers)
        except ValueError as e:             # the model's own layout checks
            raise ConversionError(f"{what} is impossible for this model: {e}") from None
        for name, global_shape, offsets, shape in chunks:
            entry = found.setdefault(name, (global_shape, set()))
            if entry[0] != global_shape:
                raise ConversionError(f"internal: ranks disagree on the shape of {name!r}")
            entry[1].add((offsets, shape))
    tensors = {name: TensorChunks(shape, tuple(sorted(regions))) for name, (shape, regions) in found.items()}
    for name, chunks in tensors.items():
        _check_tiling(name, chunks.global_shape, list(chunks.regions), f"{what}: the chunks")
    logger.info("%s: %d virtual ranks in %d roles (models built), %d logical tensors, %d chunks", what,
                grid.world_size, len(roles), len(tensors), sum(len(c.regions) for c in tensors.values()))
    return tensors


def logical_tensor_shapes(config: GPTMoEConfig, layer_spec: LayerSpec | None = None) -> dict[str, tuple[int, ...]]:
    """The global shape of every logical tensor a model of ``config`` (built with ``layer_spec``) saves, by
    name (any layout saves the same ones). Built as one process holding the whole model, on the meta
    device: unlike :func:`plan_layout` it creates no process group, so it also runs where
    torch.distributed is in use. ValueError naming the model's objection when ``config`` cannot be built."""
    with _SkipRandomInit():
        model = GPTMoEModel(config, ParallelState.single_process(), device="meta", layer_spec=layer_spec)
    return {c.name: c.global_shape for c in sharded_state_dict(model)}
