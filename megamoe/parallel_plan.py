"""The layout plan: what dispatches how and what is sharded over which group, computed ONCE per rank.

:func:`build_parallel_plan` turns a model config (``GPTMoEConfig``, with its ``MoEConfig``) and a
:class:`parallel_state.ParallelState` into a frozen :class:`ParallelPlan`. The model builds it once
(``GPTMoEModel.plan``) and passes it to every decoder layer, which hands the MoE layer the groups it names;
the trainer reads the expert gradient scale and the expert-load counting from it (:func:`moe_layout_of`). Nothing
else re-derives these rules from the config.

Per layer kind:

- dense layers (attention, dense MLPs, embedding, output layer), :class:`DenseLayout`: the weights are
  sharded over TP; under sequence parallelism the hidden states between blocks are this rank's chunk of the
  sequence over TP; under context parallelism attention's sequence is split over CP;
- MoE layers, :class:`MoELayout`: the dispatcher class (looked up by name,
  :func:`megamoe.moe.token_dispatcher.dispatcher_class`, whose layout rules it applies), slots over EP, each
  expert's FFN dim over ETP, replicas of a slot over expert-DP; whether the tokens entering the layer are split
  over TP (sequence parallelism holds them split; MoE parallel folding splits the replicated tokens on entry
  and gathers them on exit, :mod:`megamoe.models.moe_folding`), the dispatcher's reduction group, the router's
  statistics group, and how many ranks of an expert-DP group compute the same tokens;
- gradients, :class:`GradientReduction`: dense ones averaged over DP x CP, expert ones summed over expert-DP
  and scaled, ``sequence_parallel``-tagged ones summed over TP first, tied embeddings over the embedding group
  (:mod:`megamoe.training.grad_sync`);
- pipeline, :class:`StageSplit`: this rank's layer ranges, one per model chunk (virtual stage).

Groups are named by their ``ParallelState`` field (``"tp"``, ``"ep_etp"``, ...; None: no such split);
:meth:`ParallelPlan.group` resolves a name to this rank's process group. Each dataclass validates itself
(ValueError naming the field), so a hand-made or edited plan cannot describe an impossible layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megamoe.moe.token_dispatcher import TokenDispatcher, dispatcher_class
from megamoe.pipeline.partition import chunk_layer_ranges

__all__ = ["DenseLayout", "GradientReduction", "MoELayout", "ParallelPlan", "StageSplit", "build_parallel_plan",
           "build_moe_layout", "check_moe_layout", "default_etp", "folds_moe_layers", "moe_layout_of", "uses_sequence_parallel"]

# The ParallelState fields a plan may name.
GROUP_NAMES = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "etp", "edp", "ep_etp", "etp_edp", "embedding", "tp_cp")


def _check_choice(owner: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {tuple(choices)}, got {value!r}")


def _check_positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")


def default_etp(tp: int, dispatcher: str | None, etp: int | None = None) -> int:
    """The expert-TP size of a layout: ``etp`` when given, else what ``dispatcher`` runs with by default (its
    class's ``default_etp``: ``tp`` for all-to-all, where etp < tp folds the MoE layers; 1 for all-gather, EP
    inside the TP group); 1 without MoE layers (``dispatcher`` None)."""
    if etp is not None:
        return etp
    return 1 if dispatcher is None else dispatcher_class(dispatcher).default_etp(tp)


def uses_sequence_parallel(config, tp: int) -> bool:
    """Whether the hidden states between blocks are split over TP: ``config.sequence_parallel`` and tp > 1."""
    return bool(getattr(config, "sequence_parallel", False)) and tp > 1


def folds_moe_layers(config, tp: int, etp: int) -> bool:
    """Whether the MoE layers fold (:mod:`megamoe.models.moe_folding`): a dispatcher that folds over TP, no
    sequence parallelism, tp > 1 and etp < tp."""
    moe = getattr(config, "moe", None)
    return (moe is not None and dispatcher_class(moe.dispatcher).folds_over_tp and tp > 1 and etp < tp
            and not uses_sequence_parallel(config, tp))


def check_moe_layout(config, state) -> None:
    """ValueError naming the sizes unless the MoE layers' dispatcher can run on this rank's layout (its class's
    ``check_layout``; skipped under sequence parallelism, where every rank holds its own tokens and the
    dispatchers gather what they need). ``state`` needs only ``rank`` and the ``tp``, ``ep``, ``etp`` and
    ``ep_etp`` groups' sizes and ranks (a launcher checks a grid before any process group exists)."""
    moe = getattr(config, "moe", None)
    if moe is not None and not uses_sequence_parallel(config, state.tp.size):
        dispatcher_class(moe.dispatcher).check_layout(moe, state)


@dataclass(frozen=True)
class DenseLayout:
    """Attention, dense MLPs, the embedding and the output layer."""

    weight_group: str = "tp"                 # column / row-parallel weights and the vocabulary rows
    sequence_group: str | None = None        # "tp" under sequence parallelism: blocks exchange S / tp chunks
    context_group: str | None = None         # "cp" under context parallelism: attention's sequence split

    def __post_init__(self):
        _check_choice("DenseLayout", "weight_group", self.weight_group, ("tp",))
        _check_choice("DenseLayout", "sequence_group", self.sequence_group, (None, "tp"))
        _check_choice("DenseLayout", "context_group", self.context_group, (None, "cp"))


@dataclass(frozen=True)
class MoELayout:
    """The MoE layers: how tokens reach the experts and what is sharded over which group."""

    dispatcher: str                          # MoEConfig.dispatcher, a registered name
    dispatcher_class: type[TokenDispatcher]  # the class registered under it: its layout rules
    reduce_group: str                        # the combine's reduction (and the shared experts' shards)
    token_split_group: str | None = None     # "tp": each rank routes its own share of the TP group's tokens
    folded: bool = False                     # the layer splits them itself (folding), vs held split (SP)
    input_sharded: bool = False              # the dispatcher's input differs across its reduce group's ranks
    statistics_group: str | None = None      # the router's balancing statistics span it (whole sequences)
    expert_token_replicas: int = 1           # ranks of an expert-DP group computing the same tokens
    counts_own_tokens: bool = True           # this rank's expert-load counts are no other TP rank's
    slot_group: str = "ep"                   # slots split evenly and contiguously over it
    expert_shard_group: str = "etp"          # each expert's FFN dim split over it
    replica_group: str = "edp"               # the same slots' shards on other data

    def __post_init__(self):
        owner = "MoELayout"
        if dispatcher_class(self.dispatcher) is not self.dispatcher_class:
            raise ValueError(f"{owner}.dispatcher_class must be the class registered as {self.dispatcher!r} "
                             f"({dispatcher_class(self.dispatcher).__name__}), got {self.dispatcher_class!r}")
        _check_choice(owner, "reduce_group", self.reduce_group, (self.dispatcher_class.reduce_group_kind,))
        _check_choice(owner, "token_split_group", self.token_split_group, (None, "tp"))
        if self.folded and (self.token_split_group != "tp" or not self.dispatcher_class.folds_over_tp):
            raise ValueError(f"{owner}.folded needs token_split_group='tp' and a dispatcher that folds over TP, got "
                             f"token_split_group={self.token_split_group!r} with dispatcher={self.dispatcher!r}")
        _check_choice(owner, "statistics_group", self.statistics_group, (None, "tp", "cp", "tp_cp"))
        _check_positive_int(owner, "expert_token_replicas", self.expert_token_replicas)
        if self.token_split_group is not None and self.expert_token_replicas != 1:
            raise ValueError(f"{owner}.expert_token_replicas must be 1 when every rank routes its own tokens "
                             f"(token_split_group={self.token_split_group!r}), got {self.expert_token_replicas}")
        _check_choice(owner, "slot_group", self.slot_group, ("ep",))
        _check_choice(owner, "expert_shard_group", self.expert_shard_group, ("etp",))
        _check_choice(owner, "replica_group", self.replica_group, ("edp",))


@dataclass(frozen=True)
class GradientReduction:
    """Which gradients are reduced over which group (:mod:`megamoe.training.grad_sync`)."""

    expert_scale: float                      # expert gradients: summed over expert_group, then times this
    dense_group: str = "dp_cp"               # dense gradients: averaged over it
    expert_group: str = "edp"
    sequence_parallel_group: str | None = None  # tagged ``sequence_parallel``: summed over it first
    tied_group: str | None = None            # tied embedding copies on the first and last stage: summed

    def __post_init__(self):
        owner = "GradientReduction"
        if not (isinstance(self.expert_scale, float) and 0 < self.expert_scale <= 1):
            raise ValueError(f"{owner}.expert_scale must be a float in (0, 1], got {self.expert_scale!r}")
        _check_choice(owner, "dense_group", self.dense_group, ("dp_cp",))
        _check_choice(owner, "expert_group", self.expert_group, ("edp",))
        _check_choice(owner, "sequence_parallel_group", self.sequence_parallel_group, (None, "tp"))
        _check_choice(owner, "tied_group", self.tied_group, (None, "embedding"))


@dataclass(frozen=True)
class StageSplit:
    """This rank's share of the pipeline: one layer range per model chunk (virtual stage ``chunk * pp +
    pp_rank``, :func:`megamoe.pipeline.partition.chunk_layer_ranges`), and the MTP layers on the last stage."""

    pp_rank: int
    chunk_layer_ids: tuple[range, ...]
    mtp_layer_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.pp_rank, bool) or not isinstance(self.pp_rank, int) or self.pp_rank < 0:
            raise ValueError(f"StageSplit.pp_rank must be an int >= 0, got {self.pp_rank!r}")
        if not self.chunk_layer_ids or not all(isinstance(r, range) for r in self.chunk_layer_ids):
            raise ValueError(f"StageSplit.chunk_layer_ids must be one range per model chunk, got "
                             f"{self.chunk_layer_ids!r}")

    @property
    def virtual_pipeline_stages(self) -> int:
        return len(self.chunk_layer_ids)

    @property
    def layer_ids(self) -> list[int]:
        """This rank's decoder layers over all its chunks, in chunk order."""
        return [i for chunk in self.chunk_layer_ids for i in chunk]


@dataclass(frozen=True)
class ParallelPlan:
    """One rank's layout (see the module docstring). ``state`` (not compared) resolves group names."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int
    dense: DenseLayout
    moe: MoELayout | None
    gradients: GradientReduction
    stages: StageSplit
    state: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
            _check_positive_int("ParallelPlan", name, getattr(self, name))
        if self.ep * self.etp * self.edp != self.tp * self.cp * self.dp:
            raise ValueError(f"ParallelPlan.edp must be tp * cp * dp / (ep * etp) = {self.tp} * {self.cp} * {self.dp} "
                             f"/ ({self.ep} * {self.etp}) (the expert grid spans the dense one), got {self.edp}")
        if self.dense.sequence_group is not None and self.tp == 1:
            raise ValueError("ParallelPlan.dense.sequence_group must be None with tp=1 (one chunk)")
        if (self.dense.context_group is not None) != (self.cp > 1):
            raise ValueError(f"ParallelPlan.dense.context_group must be 'cp' exactly when cp > 1, got "
                             f"{self.dense.context_group!r} with cp={self.cp}")
        if self.stages.pp_rank >= self.pp:
            raise ValueError(f"ParallelPlan.stages.pp_rank must be < pp={self.pp}, got {self.stages.pp_rank}")

    def group(self, name: str | None):
        """This rank's process group named ``name`` (a ParallelState field; None for ``None``: no split)."""
        if name is None:
            return None
        _check_choice("ParallelPlan.group", "name", name, GROUP_NAMES)
        if self.state is None:
            raise ValueError("ParallelPlan.state is None: build the plan with build_parallel_plan to resolve groups")
        info = getattr(self.state, name)
        return None if info is None else info.group


def build_moe_layout(config, state) -> MoELayout | None:
    """The :class:`MoELayout` of ``config.moe`` on this rank of ``state`` (None without MoE layers); ValueError
    naming the sizes when its dispatcher cannot run the layout (the class's ``check_layout``)."""
    moe_config = getattr(config, "moe", None)
    if moe_config is None:
        return None
    tp, cp, ep, etp = state.tp.size, state.cp.size, state.ep.size, state.etp.size
    cls = dispatcher_class(moe_config.dispatcher)
    check_moe_layout(config, state)
    folded = folds_moe_layers(config, tp, etp)
    split = "tp" if (uses_sequence_parallel(config, tp) or folded) else None
    return MoELayout(dispatcher=moe_config.dispatcher, dispatcher_class=cls, reduce_group=cls.reduce_group_kind,
                     token_split_group=split, folded=folded, input_sharded=bool(moe_config.input_sharded or split),
                     statistics_group=("tp_cp" if split else "cp") if cp > 1 else split,
                     expert_token_replicas=1 if split else cls.expert_token_replicas(moe_config, tp, ep, etp),
                     counts_own_tokens=state.tp.rank == 0 or split is not None)


def build_parallel_plan(config, state, *, pp_split=None, virtual_pipeline_stages: int = 1) -> ParallelPlan:
    """The plan of ``config`` (a ``GPTMoEConfig``: ``moe``, ``sequence_parallel``, ``num_layers``,
    ``tie_word_embeddings``, ``mtp_num_layers`` / ``mtp_layer_ids``) on this rank of ``state``. ValueError
    naming the sizes when the dispatcher cannot run the layout (its class's ``check_layout``) or the layers do
    not split over the pipeline (:func:`~megamoe.pipeline.partition.chunk_layer_ranges`)."""
    tp, cp, dp, pp, ep, etp, edp = (getattr(state, k).size for k in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"))
    sp = uses_sequence_parallel(config, tp)
    moe = build_moe_layout(config, state)
    replicas = 1 if moe is None else moe.expert_token_replicas
    tied = getattr(config, "tie_word_embeddings", False) or getattr(config, "mtp_num_layers", 0)
    gradients = GradientReduction(expert_scale=1.0 / (state.dp_cp.size * replicas),
                                  sequence_parallel_group="tp" if (sp or (moe is not None and moe.folded)) else None,
                                  tied_group="embedding" if tied and pp > 1 else None)
    chunks = chunk_layer_ranges(config.num_layers, pp, virtual_pipeline_stages, pp_split)[state.pp.rank]
    last = state.pp.rank == pp - 1
    stages = StageSplit(pp_rank=state.pp.rank, chunk_layer_ids=tuple(chunks),
                        mtp_layer_ids=tuple(getattr(config, "mtp_layer_ids", ())) if last else ())
    return ParallelPlan(rank=state.rank, tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, edp=edp,
                        dense=DenseLayout(sequence_group="tp" if sp else None, context_group="cp" if cp > 1 else None),
                        moe=moe, gradients=gradients, stages=stages, state=state)


def moe_layout_of(model, state) -> MoELayout | None:
    """The MoE layout of ``model``: its plan's when it built one (``GPTMoEModel.plan``), else that of its
    ``config`` (a custom model) on ``state``; None without MoE layers."""
    plan = getattr(model, "plan", None)
    if isinstance(plan, ParallelPlan):
        return plan.moe
    return build_moe_layout(getattr(model, "config", None), state)

