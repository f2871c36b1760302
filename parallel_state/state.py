"""Process groups for one rank layout, held in a frozen :class:`ParallelState`.

Layers receive the groups they need as arguments (``state.tp.group``, ``state.ep.group``, ...); a
``group`` of ``None`` means "one rank, no communication". Typical use in a script::

    dist.init_process_group("nccl")
    state = initialize_model_parallel(tp=2, ep=4, pp=2)
    model = build_model(config, state)          # passes groups down explicitly
    ...
    destroy_model_parallel()

See :mod:`parallel_state.rank_grid` for which ranks land in which group.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .rank_grid import DEFAULT_ORDER, GROUP_KINDS, compute_rank_groups

__all__ = [
    "GroupInfo",
    "ParallelState",
    "destroy_model_parallel",
    "get_parallel_state",
    "initialize_model_parallel",
    "model_group_backend",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupInfo:
    """One process group as seen from this process.

    ``ranks`` are global ranks in group order, ``rank`` is this process's index among them. ``group``
    is None exactly when ``size == 1``, so single-rank layers never issue collectives.
    """

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int
    size: int

    def __post_init__(self):
        if self.size != len(self.ranks):
            raise ValueError(f"size {self.size} != len(ranks) {len(self.ranks)}; pass size=len(ranks)")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if self.size == 1 and self.group is not None:
            raise ValueError("a single-rank GroupInfo must have group=None (None means no communication)")


def _solo(global_rank: int) -> GroupInfo:
    return GroupInfo(group=None, ranks=(global_rank,), rank=0, size=1)


@dataclass(frozen=True)
class ParallelState:
    """All groups of this process for one layout (see :func:`initialize_model_parallel`).

    ``embedding`` is None on middle pipeline stages, which hold neither embedding nor output layer.
    Kinds over the same ranks hold the same process group (one communicator, see
    :func:`initialize_model_parallel`).
    """

    world_size: int
    rank: int
    order: str
    tp: GroupInfo
    cp: GroupInfo
    dp: GroupInfo
    dp_cp: GroupInfo
    pp: GroupInfo
    mp: GroupInfo
    ep: GroupInfo
    etp: GroupInfo
    edp: GroupInfo
    ep_etp: GroupInfo
    etp_edp: GroupInfo
    embedding: GroupInfo | None
    tp_cp: GroupInfo               # tp x cp: the ranks holding tokens of the same sequences

    @classmethod
    def single_process(cls) -> ParallelState:
        """The state of a lone process: every group is this rank alone; needs no torch.distributed."""
        solo = _solo(0)
        return cls(world_size=1, rank=0, order=DEFAULT_ORDER, tp=solo, cp=solo, dp=solo, dp_cp=solo,
                   pp=solo, mp=solo, ep=solo, etp=solo, edp=solo, ep_etp=solo, etp_edp=solo, embedding=solo,
                   tp_cp=solo)

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def pp_prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage, None on the first stage."""
        return None if self.is_first_pp_stage else self.pp.ranks[self.pp.rank - 1]

    @property
    def pp_next_rank(self) -> int | None:
        """Global rank of the next pipeline stage, None on the last stage."""
        return None if self.is_last_pp_stage else self.pp.ranks[self.pp.rank + 1]


# Kept only to refuse a second initialisation and to serve get_parallel_state() to scripts.
_current_state: ParallelState | None = None
_created_groups: list[dist.ProcessGroup] = []


def _world_timeout():
    """The default process group's collective timeout, which the groups created here inherit
    (torch gives a new group its backend's default instead: 30 min for gloo, ignoring the timeout
    passed to ``init_process_group``). None where torch does not expose it: torch's default."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def model_group_backend(world_backend: str) -> str:
    """The backend of the model's groups under a default group of ``world_backend``: only what carries the
    model's tensors.

    A per-device string that names different backends (``"cpu:gloo,cuda:nccl"``: gloo for the host, NCCL
    for the GPUs) keeps its non-CPU part (``"cuda:nccl"``). Every collective on the model's groups moves
    tensors of the model's device (tests/test_device_clean.py refuses a CPU tensor in any collective), so
    a gloo backend per group would only add a gloo context, with connections to every peer, per group;
    host metadata goes over the default group, which keeps both. A backend that serves every device
    itself (``"gloo"``, ``"nccl"``, torch's ``"cpu:fake,meta:fake"``) is kept as it is.
    """
    parts = [tuple(x.strip() for x in part.split(":", 1)) for part in world_backend.lower().split(",")]
    if any(len(part) != 2 for part in parts) or len({name for _, name in parts}) < 2:
        return world_backend
    return ",".join(f"{device}:{name}" for device, name in parts if device != "cpu")


def initialize_model_parallel(
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    cp: int = 1,
    order: str = DEFAULT_ORDER,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> ParallelState:
    """Create every group of the layout and return this process's :class:`ParallelState`.

    Must be called by every rank with the same arguments, after ``torch.distributed`` is initialised;
    ``backend`` (default: :func:`model_group_backend` of the default group's) is the backend of the new
    groups, ``timeout`` their collective timeout (default: the default group's where torch exposes it, as
    for gloo, else the backend's default; pass it for NCCL). Raises RuntimeError if torch.distributed is
    not initialised or the groups already exist (call :func:`destroy_model_parallel` first), ValueError
    for an impossible layout.

    One communicator per distinct rank set (:meth:`~parallel_state.RankGroups.communicator_ranks`): kinds
    over the same ranks share it, so a layout creates a few groups instead of one per kind; their number
    is logged. For NCCL, pass ``device_id`` to ``init_process_group`` (megamoe.process_group.init_distributed does): the world
    communicator then starts at once and the groups here are split from it, instead of each one
    bootstrapping lazily at its first collective.
    """
    global _current_state
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() before "
            "initialize_model_parallel(), or use ParallelState.single_process() for one process"
        )
    if _current_state is not None:
        raise RuntimeError(
            "model parallel groups are already initialised; call destroy_model_parallel() before "
            "initialising them again"
        )
    rank = dist.get_rank()
    timeout = timeout if timeout is not None else _world_timeout()
    grid = compute_rank_groups(dist.get_world_size(), tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, order=order)

    backend = backend if backend is not None else model_group_backend(dist.get_backend())
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in grid.communicator_ranks():
        # new_group must be called by every rank for every group, in the same order everywhere, even for
        # groups this rank is not in.
        group = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
        if rank in ranks:
            groups[ranks] = group
            _created_groups.append(group)

    def info(ranks: tuple[int, ...] | None) -> GroupInfo | None:
        if ranks is None:                       # embedding on a middle pipeline stage
            return None
        if len(ranks) == 1:
            return _solo(rank)
        return GroupInfo(group=groups[ranks], ranks=ranks, rank=ranks.index(rank), size=len(ranks))

    infos = {kind: info(ranks) for kind, ranks in grid.groups_of(rank).items()}
    _current_state = ParallelState(world_size=grid.world_size, rank=rank, order=grid.order, **infos)
    logger.info(
        "model parallel groups created: world %d, tp %d cp %d dp %d pp %d | ep %d etp %d edp %d, order %s: "
        "%d communicators (%d on this rank) for %d group kinds, backend %s",
        grid.world_size, grid.tp_size, grid.cp_size, grid.dp_size, grid.pp_size, grid.ep_size,
        grid.etp_size, grid.edp_size, grid.order, len(grid.communicator_ranks()), len(groups), len(GROUP_KINDS),
        backend,
    )
    return _current_state


def get_parallel_state() -> ParallelState:
    """The state made by :func:`initialize_model_parallel`, for top-level scripts only.

    Layers and library code must never call this: they take their groups as arguments.
    """
    if _current_state is None:
        raise RuntimeError("model parallel groups are not initialised; call initialize_model_parallel()")
    return _current_state


def destroy_model_parallel() -> None:
    """Destroy the groups made by :func:`initialize_model_parallel`; a no-op when there are none."""
    global _current_state
    for group in _created_groups:
        dist.destroy_process_group(group)
    _created_groups.clear()
    _current_state = None
