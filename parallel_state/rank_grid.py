"""Which global ranks share which parallel group: pure arithmetic, no torch.distributed.

Ranks are laid out on two grids over the same ``world_size`` ranks (the Megatron-Core convention):

- the **dense grid** ``tp x cp x dp x pp`` used by attention, dense MLPs and embeddings, where
  ``dp = world_size / (tp * cp * pp)``;
- the **expert grid** ``etp x ep x edp x pp`` used by MoE experts, where
  ``edp = world_size / (etp * ep * pp)``. EP may therefore span ranks that are TP or DP ranks of the
  dense grid.

The ``order`` string lists the dimensions from the smallest rank stride (leftmost) to the largest, e.g.
``"tp-cp-ep-dp-pp"``. Both grids read the same order: in the dense grid ``ep`` has size 1; in the
expert grid the ``tp`` slot holds ``etp``, the ``dp`` slot holds ``edp`` and ``cp`` has size 1.

Worked example: ``world_size=8, tp=2, pp=2`` with the default order gives ``dp = 2`` and strides
tp=1, dp=2, pp=4, so rank ``r = tp_index + 2 * dp_index + 4 * pp_index``::

    tp groups  (0,1) (2,3) (4,5) (6,7)      ranks differing only in tp_index
    dp groups  (0,2) (1,3) (4,6) (5,7)      ranks differing only in dp_index
    pp groups  (0,4) (1,5) (2,6) (3,7)      ranks differing only in pp_index
    mp groups  (0,1,4,5) (2,3,6,7)          one model replica: tp x pp
    embedding  (0,4) (1,5) (2,6) (3,7)      first and last stage of each pp group

Adding ``ep=2`` (etp=1, so edp=2) to the same layout puts the expert grid's ep on stride 1:
ep groups (0,1) (2,3) ..., edp groups (0,2) (1,3) ...: here EP runs over the dense TP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

__all__ = ["DEFAULT_ORDER", "GROUP_KINDS", "RankGroups", "compute_rank_groups"]

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
# Every kind of group RankGroups holds, in the order process groups are created.
GROUP_KINDS = ("tp", "cp", "dp", "dp_cp", "pp", "mp", "ep", "etp", "edp", "ep_etp", "etp_edp", "embedding", "tp_cp")

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankGroups:
    """The groups of every kind for one layout; each kind's groups are tuples of sorted global ranks.

    Every kind partitions all ranks, except ``embedding``: it holds the first and last pipeline
    stage of each pp group (one rank when ``pp_size == 1``), so middle stages are in none.
    """

    world_size: int
    order: str  # the normalised order: every token present, lower case
    tp_size: int
    cp_size: int
    dp_size: int
    pp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    tp: Groups
    cp: Groups
    dp: Groups
    dp_cp: Groups  # dense gradients are reduced over dp x cp
    pp: Groups
    mp: Groups  # model parallel: tp x pp, the ranks that hold one replica's weights
    ep: Groups
    etp: Groups
    edp: Groups
    ep_etp: Groups  # expert model parallel: etp x ep, the ranks that together hold every expert once
    etp_edp: Groups  # etp x edp: the ranks holding shards or replicas of the same expert slots
    embedding: Groups
    # tp x cp: the ranks holding the tokens of the same sequences (context parallelism); under
    # sequence parallelism, the group the MoE routers' balancing statistics are reduced over.
    tp_cp: Groups

    def communicator_ranks(self) -> Groups:
        """Every rank set of more than one rank that some kind holds, once: the communicators the layout
        needs. Kinds over the same ranks share one (dp_cp is dp when cp = 1, ep_etp is ep when etp = 1, mp
        is tp when pp = 1, embedding is pp when pp = 2, ...); a single rank needs none. In a fixed order
        (kinds in ``GROUP_KINDS`` order, each kind's groups in order), the same on every rank, as
        ``torch.distributed.new_group`` must be called."""
        seen: dict[tuple[int, ...], None] = {}
        for kind in GROUP_KINDS:
            for ranks in getattr(self, kind):
                if len(ranks) > 1:
                    seen.setdefault(ranks, None)
        return tuple(seen)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...] | None]:
        """Kind -> the group holding ``rank``; ``embedding`` maps to None for a middle pp stage."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        found: dict[str, tuple[int, ...] | None] = {}
        for kind in GROUP_KINDS:
            found[kind] = next((g for g in getattr(self, kind) if rank in g), None)
        return found


def _normalise_order(order: str, sizes_by_token: dict[str, int]) -> list[str]:
    """Order tokens, smallest stride first; absent tokens (allowed only at size 1) are appended."""
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in ORDER_TOKENS]
    if unknown:
        raise ValueError(
            f"order {order!r} has unknown token(s) {unknown}; use '-'-separated tokens from "
            f"{list(ORDER_TOKENS)}, e.g. {DEFAULT_ORDER!r}"
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"order {order!r} repeats token(s) {repeated}; list each token once")
    for token in ORDER_TOKENS:
        if token not in tokens:
            if sizes_by_token[token] != 1:
                raise ValueError(
                    f"order {order!r} omits {token!r}, whose size is {sizes_by_token[token]}; "
                    "add it to the order (only size-1 dimensions may be omitted)"
                )
            tokens.append(token)
    return tokens


def _grid_groups(world_size: int, dims: list[tuple[str, int]], varying: set[str]) -> Groups:
    """Groups of ranks whose grid coordinates differ only in the ``varying`` dimensions.

    ``dims`` lists (token, size) from the smallest stride up; rank = sum(index_d * stride_d).
    """
    by_fixed_coords: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        fixed, rest = [], rank
        for token, size in dims:
            index, rest = rest % size, rest // size
            if token not in varying:
                fixed.append(index)
        by_fixed_coords.setdefault(tuple(fixed), []).append(rank)
    return tuple(sorted(tuple(sorted(g)) for g in by_fixed_coords.values()))


def compute_rank_groups(
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    cp: int = 1,
    order: str = DEFAULT_ORDER,
) -> RankGroups:
    """Compute every dense and expert group of a ``world_size``-rank layout (see the module docstring).

    Raises ValueError when a size is < 1, ``tp*cp*pp`` does not divide ``world_size``, ``ep*etp`` does
    not divide the ranks of one pp stage, the order is malformed, or the order gives the two grids
    different pp groups.
    """
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("ep", ep),
                        ("etp", etp), ("cp", cp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if world_size % (tp * cp * pp):
        raise ValueError(
            f"world_size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp}"
        )
    ranks_per_stage = world_size // pp
    if ranks_per_stage % (ep * etp):
        raise ValueError(
            f"ep*etp must divide the ranks of a PP stage: ep*etp = {ep}*{etp} = {ep * etp} does not "
            f"divide world_size/pp = {world_size}/{pp} = {ranks_per_stage}"
        )
    dp = world_size // (tp * cp * pp)
    edp = ranks_per_stage // (ep * etp)

    dense_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert_sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    # A token may be omitted only when it has size 1 in both grids.
    combined = {t: max(dense_sizes[t], expert_sizes[t]) for t in ORDER_TOKENS}
    tokens = _normalise_order(order, combined)
    dense_dims = [(t, dense_sizes[t]) for t in tokens]
    expert_dims = [(t, expert_sizes[t]) for t in tokens]

    def dense(*varying: str) -> Groups:
        return _grid_groups(world_size, dense_dims, set(varying))

    def expert(*varying: str) -> Groups:
        return _grid_groups(world_size, expert_dims, set(varying))

    pp_groups = dense("pp")
    if pp_groups != expert("pp"):
        pp_position = tokens.index("pp")
        raise ValueError(
            f"order {order!r} gives the dense and expert grids different pp groups: the pp rank "
            f"stride is {prod(s for _, s in dense_dims[:pp_position])} in the dense grid but "
            f"{prod(s for _, s in expert_dims[:pp_position])} in the expert grid (the product of the "
            f"sizes left of 'pp'); put 'pp' last (e.g. {DEFAULT_ORDER!r})"
        )
    embedding = tuple((g[0], g[-1]) if len(g) > 1 else g for g in pp_groups)
    return RankGroups(
        world_size=world_size,
        order="-".join(tokens),
        tp_size=tp,
        cp_size=cp,
        dp_size=dp,
        pp_size=pp,
        ep_size=ep,
        etp_size=etp,
        edp_size=edp,
        tp=dense("tp"),
        cp=dense("cp"),
        dp=dense("dp"),
        dp_cp=dense("dp", "cp"),
        pp=pp_groups,
        mp=dense("tp", "pp"),
        ep=expert("ep"),
        etp=expert("tp"),
        edp=expert("dp"),
        ep_etp=expert("tp", "ep"),
        etp_edp=expert("tp", "dp"),
        embedding=embedding,
        tp_cp=dense("tp", "cp"),
    )
