"""Which chunks of which logical tensors a parallel layout holds, found without starting its ranks.

How a converted checkpoint is laid out
--------------------------------------
Each logical tensor is cut exactly as a training run under the target layout saves it
(:func:`checkpoint_tools.format.save_checkpoint`): one chunk per TP / ETP shard, each expert once
(replicas are one logical chunk), no copy per data-parallel rank. The chunks are read off the model
itself: for every rank of the layout's smallest world, this module creates the rank's process groups
under torch's fake process group (no communication, one process), builds that rank's
:class:`~megamoe.models.GPTMoEModel` on the meta device and lists
:func:`~megamoe.checkpoint_state.sharded_state_dict`. Why this rather than storing whole logical
tensors and relying on lazy slice loads (which would load as well):

- the layout is validated by the model's own checks (heads, KV heads and FFN sizes divisible,
  dispatcher constraints, slots divisible over EP, pipeline split), not by a second copy of the rules;
- a converted checkpoint is the checkpoint a training run under that layout writes, so one reader
  (``load_checkpoint(path, sharded_state_dict(model))``) serves both, and every rank of the target layout
  reads whole contiguous chunks (a whole-tensor store turns each row-parallel shard into a strided read);
- it costs milliseconds per rank: parameters live on the meta device and the random initialisation the
  modules run at construction is skipped (:class:`_SkipRandomInit`).

Any other layout still loads it: the format assembles every requested region from the stored chunks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from checkpoint_tools.chunk_regions import Region, _check_tiling
from checkpoint_tools.errors import ConversionError
from checkpoint_tools.layout import ParallelLayout
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.expert_slots import ExpertPlacement
from parallel_state import GROUP_KINDS, GroupInfo, ParallelState, compute_rank_groups

__all__ = ["TensorChunks", "LayoutPlan", "plan_layout"]

logger = logging.getLogger(__name__)


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
    (the whole model, once per virtual rank). Skipped, the CPU buffers are allocated but never touched.
    """

    _DRAWS = (torch.Tensor.normal_, torch.Tensor.uniform_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._DRAWS:
            return args[0]
        return func(*args, **(kwargs or {}))


def _virtual_rank_state(grid, rank: int) -> ParallelState:
    """This rank's ParallelState over fake process groups (the default group must be a fake one)."""
    infos: dict[str, GroupInfo | None] = {}
    for kind in GROUP_KINDS:
        mine = next((g for g in getattr(grid, kind) if rank in g), None)
        if mine is None:                    # embedding, on a middle pipeline stage
            infos[kind] = None
            continue
        group = None if len(mine) == 1 else dist.new_group(list(mine), backend="fake")
        infos[kind] = GroupInfo(group=group, ranks=mine, rank=mine.index(rank), size=len(mine))
    return ParallelState(world_size=grid.world_size, rank=rank, order=grid.order, dp_cp_cpu=infos["dp_cp"],
                         **infos)


def _rank_chunks(config: GPTMoEConfig, grid, rank: int, placements: dict[int, ExpertPlacement]):
    # Imported here: it registers the "fake" backend with torch.distributed as a side effect.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=grid.world_size)
    try:
        state = _virtual_rank_state(grid, rank)
        with _SkipRandomInit():
            model = GPTMoEModel(config, state, placements=placements, device="meta")
        return [(c.name, c.global_shape, c.offsets, c.shape) for c in sharded_state_dict(model)]
    finally:
        dist.destroy_process_group()


def plan_layout(config: GPTMoEConfig, layout: ParallelLayout,
                placements: dict[int, ExpertPlacement]) -> LayoutPlan:
    """The chunks every logical tensor of ``config`` has under ``layout`` with these expert placements.

    ConversionError naming the model's objection when the layout is impossible for the model. Needs a
    process whose default process group is not initialised (it creates fake ones in turn).
    """
    if dist.is_initialized():
        raise ConversionError("planning a layout creates fake process groups and needs a process without an "
                              "initialised torch.distributed default group; run the converter on its own")
    world = layout.world_size
    try:
        grid = compute_rank_groups(world, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    except ValueError as e:
        raise ConversionError(f"impossible layout {layout}: {e}") from None
    found: dict[str, tuple[tuple[int, ...], set[Region]]] = {}
    for rank in range(world):
        try:
            chunks = _rank_chunks(config, grid, rank, placements)
        except ValueError as e:             # the model's own layout checks
            raise ConversionError(f"layout {layout} is impossible for this model: {e}") from None
        for name, global_shape, offsets, shape in chunks:
            entry = found.setdefault(name, (global_shape, set()))
            if entry[0] != global_shape:
                raise ConversionError(f"internal: ranks disagree on the shape of {name!r}")
            entry[1].add((offsets, shape))
    tensors = {name: TensorChunks(shape, tuple(sorted(regions))) for name, (shape, regions) in found.items()}
    for name, chunks in tensors.items():
        _check_tiling(name, chunks.global_shape, list(chunks.regions), f"layout {layout}: the chunks")
    logger.info("layout %s: %d virtual ranks, %d logical tensors, %d chunks", layout, world, len(tensors),
                sum(len(c.regions) for c in tensors.values()))
    return LayoutPlan(layout, tensors)
