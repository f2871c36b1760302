"""The expert-parallel MoE layer: route -> map experts to slots -> dispatch -> experts -> combine.

Experts are the model's (router ids, checkpoint keys); slots are the engine's (where weights live,
``num_expert_slots >= num_experts``, a hot expert may own several). The layer maps each (token,
expert) pair to one slot of that expert with a rule every rank computes identically
(:meth:`ExpertPlacement.choose_slots`), so replicas are never double counted. Replicas hold identical
weights; their gradients are per slot, and the training loop sums them across replicas.

Subclassing: override :meth:`build_router`, :meth:`build_experts` or :meth:`build_dispatcher` to swap
a component; ``forward`` only strings them together. Each method's docstring states what it receives
and what its component must provide. ``__init__`` calls them in this order, after ``self.config``,
the groups, ``ep_size`` / ``ep_rank``, ``etp_size`` / ``etp_rank``, ``placement`` and ``local_slots``
are set: ``build_router``, ``build_experts``, (the shared experts), ``build_dispatcher``; then it tags
the experts' parameters ``expert_parallel``, creates ``load_counter`` and calls
:meth:`reset_parameters`. To use a subclass in the shipped model, pass it as
``GPTMoEModel(config, state, layer_spec=LayerSpec(moe=MySubclass))``
(:class:`megamoe.models.LayerSpec`).

What the rest of the library reads from a layer (keep these when overriding): the trainer resets and
reads ``load_counter`` every step, calls ``router.update_expert_bias(load)`` after the optimizer step
when ``router.config.use_expert_bias``, and reports ``placement.balancedness``; the gradient sync and
the gradient norm call :meth:`reduce_replica_grads` and :meth:`local_replica_counts` and read the
experts' ``expert_weight_shards``; checkpoints call :meth:`sharded_state_dict` and store
``placement.to_dict()``. Online rebalancing (:func:`megamoe.moe.placement.expert_migration.migrate_layer`) reads
``placement``, ``local_slots``, ``ep_group`` / ``ep_rank`` / ``ep_size`` and the experts'
``slot_parameters`` / ``slot_buffers``, and REPLACES ``placement`` (``local_slots`` never change): a
subclass must read whatever it derives from the placement from ``self.placement`` when it runs, never
cache it at construction.

Compiled decoding: under ``torch.compile`` without gradients, when no communication is needed (EP
and the dispatcher's reduction group of size 1) and the step has at most one (token, expert) pair
per local slot, the layer skips dispatch and computes the pairs one by one
(:meth:`GroupedExperts.forward_per_pair`): static shapes, no host sync, one captured graph. Eager
calls always take the grouped path, which reads each used slot's weights once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch._compile import _disable_dynamo
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.checkpoint_state import LogicalChunk, default_sharded_state_dict
from megamoe.gradients import main_grad
from megamoe.moe.experts.fp8 import FP8AmaxReduction, FP8Config
from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
from megamoe.moe.placement.expert_slots import ExpertLoadCounter, ExpertPlacement
from megamoe.moe.router import Router, RouterConfig
from megamoe.moe.shared_experts import SharedExperts, SharedExpertsConfig
from megamoe.moe.token_dispatcher import DEFAULT_DISPATCHER, TokenDispatcher, dispatcher_class
from megamoe.quantization.block_fp8 import block_scale_shape, scale_inv_name
from megamoe.tensor_parallel.init import normal_init, seeded_generator
from megamoe.transformer.recompute import is_recomputing

__all__ = ["MoEConfig", "MoELayer", "expert_capacity"]

def expert_capacity(num_pairs: int, num_experts: int, capacity_factor: float, min_capacity: int | None = None) -> int:
    """The most (token, expert) pairs an expert keeps under ``capacity_factor``: ``ceil((num_pairs /
    num_experts) * capacity_factor)``, raised to ``min_capacity`` when given; Megatron-Core's
    ``get_capacity`` (megatron/core/transformer/moe/moe_utils.py), called with T * K pairs. Its order of
    evaluation matters in floating point: at cf 1.1, 160 experts and 1600 pairs it gives 11, where
    ``ceil(cf * pairs / experts)`` gives 12 (1.1 * 1600 is 1760.0000000000002)."""
    capacity = math.ceil((num_pairs / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


@dataclass
class MoEConfig:
    """One MoE layer. ``router`` carries hidden_size, num_experts and top_k."""

    router: RouterConfig
    ffn_hidden_size: int                       # per routed expert
    num_expert_slots: int | None = None        # default: num_experts (no replicas)
    dispatcher: str = DEFAULT_DISPATCHER       # a registered name: "alltoall" | "allgather" | register_dispatcher's
    input_sharded: bool = False                # allgather: tokens sharded over the EP x ETP group
    expert_backend: str = "auto"               # "auto" | "torch" | "loop" | "te" | "fp8_emulated"
    expert_fp8: FP8Config | None = None        # FP8 expert GEMMs (see megamoe.moe.experts.fp8)
    activation: str = "swiglu"                 # see ExpertsConfig ("swiglu_clamped": gpt-oss)
    expert_bias: bool = False                  # routed experts with gate/up and down biases (gpt-oss)
    swiglu_alpha: float = 1.702                # activation "swiglu_clamped" only
    swiglu_limit: float = 7.0
    shared_experts: SharedExpertsConfig | None = None
    capacity_factor: float | None = None       # None: dropless
    init_std: float = 0.02
    # alltoall with EP > 1 and shared experts: start the dispatch all-to-all asynchronously and compute the
    # shared experts while it is in flight (megamoe.comms.async_collectives). An engine field: a checkpoint
    # resumes with either choice; results are bit-identical.
    shared_expert_overlap: bool = False
    # Add the combine's rows (and the token gradients) in a fixed order, without atomics, as torch's
    # use_deterministic_algorithms(True) also asks (megamoe.moe.row_sums): reproducible on CUDA run to run.
    # An engine field; on the CPU both orders are bit-identical.
    deterministic: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size < 1:
            raise ValueError(f"MoEConfig.ffn_hidden_size must be >= 1, got {self.ffn_hidden_size}")
        if self.num_expert_slots is None:
            self.num_expert_slots = self.router.num_experts
        if self.num_expert_slots < self.router.num_experts:
            raise ValueError(f"MoEConfig.num_expert_slots ({self.num_expert_slots}) must be >= num_experts "
                             f"({self.router.num_experts}): every expert needs a slot")
        dispatcher = dispatcher_class(self.dispatcher)        # ValueError naming the field: not registered
        if self.input_sharded and not dispatcher.accepts_input_sharded:
            raise ValueError(f"MoEConfig.input_sharded applies to dispatchers that take tokens sharded over their "
                             f"group (dispatcher='allgather'), not to dispatcher={self.dispatcher!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor must be > 0 or None, got {self.capacity_factor}")
        for name in ("shared_expert_overlap", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.shared_experts is not None and self.shared_experts.hidden_size != self.router.hidden_size:
            raise ValueError("MoEConfig.shared_experts.hidden_size must equal router.hidden_size")

    @property
    def hidden_size(self) -> int:
        return self.router.hidden_size

    @property
    def num_experts(self) -> int:
        return self.router.num_experts


class MoELayer(nn.Module):
    """Mixture-of-experts layer over this rank's expert slots.

    Args:
        ep_group: expert-parallel group; slots are split evenly and contiguously over it.
        etp_group: expert-tensor-parallel group; each expert's FFN dim is split over it.
        expert_group: the EP x ETP group (``ParallelState.ep_etp``), needed by the all-gather
            dispatcher: its ranks all see every token and share one reduction.
        etp_edp_group: the ETP x expert-DP group (``ParallelState.etp_edp``): the ranks holding shards or
            replicas of this rank's slots. Used only by FP8 experts, whose delayed-scaling amaxes are
            reduced over it so that every shard and replica quantises alike (see megamoe.moe.experts.fp8).
        placement: slot -> expert table; default: experts in order, extra slots round-robin replicas.
        sequence_group: under sequence parallelism, the group whose ranks hold the other chunks of this
            layer's sequences (the TP group; None otherwise). Every rank then routes its own tokens:
            the dispatcher takes sharded input (all-gather: ``input_sharded`` over EP x ETP; all-to-all:
            gathered over ETP first), the router's balancing losses are those of the whole sequences
            (``Router.sequence_group``), and the parameters fed only this rank's tokens (the router,
            the shared-expert gate, and the shared experts unless they are sharded over a group that
            holds the whole TP group's tokens) are tagged ``sequence_parallel``: their gradients are
            summed over TP by the gradient sync.
        fold_group: MoE parallel folding (all-to-all dispatcher, etp < tp, no sequence parallelism;
            :mod:`megamoe.models.moe_folding`): the TP group, whose ranks hold the SAME tokens. Each
            rank then takes a DISJOINT share of them on entry (the chunk of the sequence dim sequence
            parallelism would hold; backward: all-gather), runs as with ``sequence_group`` = this
            group on that share, and all-gathers its output over the group on exit (backward: keeps
            its share of the gradient). The shares partition the tokens, so no token reaches an
            expert twice. Calls without gradients (generation, evaluation) run replicated, any token
            count, TP rank 0 counting the load; with gradients, a token count tp does not divide
            raises ValueError. Excludes ``sequence_group``.
        statistics_group: context parallelism (:mod:`megamoe.transformer.context_parallel`): the group
            whose ranks hold the rest of this layer's sequences, over which the router's balancing
            statistics are reduced: the CP group, or tp x cp (``ParallelState.tp_cp``) with a
            ``sequence_group`` or ``fold_group``. Default (None): the ``sequence_group``. It changes no
            dispatch: CP ranks hold different tokens, like DP ranks.
        context_parallel_size: the CP size (1 by default): the router's share of the losses is scaled
            by it, since the gradient sync averages the router's gradient over CP (see
            :mod:`megamoe.moe.router`).

    ``forward(hidden [..., H]) -> (output [..., H], aux_loss [])``; a 3-D input is [batch, seq, H]
    (the sequence-level aux loss uses the batch dim).
    """

    def __init__(self, config: MoEConfig, *, ep_group: ProcessGroup | None = None,
                 etp_group: ProcessGroup | None = None, expert_group: ProcessGroup | None = None,
                 etp_edp_group: ProcessGroup | None = None, placement: ExpertPlacement | None = None,
                 sequence_group: ProcessGroup | None = None, fold_group: ProcessGroup | None = None,
                 statistics_group: ProcessGroup | None = None, context_parallel_size: int = 1,
                 device=None, dtype=None):
        super().__init__()
        self.config = config
        self.ep_group, self.etp_group, self.expert_group = ep_group, etp_group, expert_group
        self.etp_edp_group = etp_edp_group
        self.fold_group = fold_group if comms.group_size(fold_group) > 1 else None
        if self.fold_group is not None and comms.group_size(sequence_group) > 1:
            raise ValueError("MoELayer: fold_group (MoE parallel folding) and sequence_group (sequence "
                             "parallelism) exclude each other: under sequence parallelism tokens are already split")
        self.dispatcher_class = dispatcher_class(config.dispatcher)
        if self.fold_group is not None and not self.dispatcher_class.folds_over_tp:
            raise ValueError(f"MoELayer: fold_group applies to dispatchers that fold over TP (dispatcher='alltoall'), "
                             f"not to dispatcher={config.dispatcher!r}")
        # Under folding each rank routes its own share, exactly as under sequence parallelism: the
        # same group plays the role of the sequence group (router losses, tags, sharded dispatch).
        if self.fold_group is not None:
            sequence_group = self.fold_group
        self.sequence_group = sequence_group if comms.group_size(sequence_group) > 1 else None
        self.ep_size, self.ep_rank = comms.group_size(ep_group), comms.group_rank(ep_group)
        self.etp_size, self.etp_rank = comms.group_size(etp_group), comms.group_rank(etp_group)
        if (self.dispatcher_class.reduce_group_kind == "ep_etp"
                and comms.group_size(expert_group) != self.ep_size * self.etp_size):
            raise ValueError(
                f"the {config.dispatcher} dispatcher needs expert_group = the EP x ETP group of size "
                f"{self.ep_size * self.etp_size}, got a group of size {comms.group_size(expert_group)}: "
                "pass expert_group=state.ep_etp.group")
        self.placement = placement or ExpertPlacement.default(
            config.num_experts, config.num_expert_slots, self.ep_size)
        if (self.placement.num_experts, self.placement.num_slots, self.placement.ep_size) != (
                config.num_experts, config.num_expert_slots, self.ep_size):
            raise ValueError(
                f"placement is for {self.placement.num_experts} experts / {self.placement.num_slots} slots / "
                f"EP {self.placement.ep_size}, the layer has {config.num_experts} / {config.num_expert_slots} / "
                f"EP {self.ep_size}")
        self.local_slots = self.placement.local_slots(self.ep_rank)
        factory = {"device": device, "dtype": dtype}
        self.router = self.build_router(config, **factory)
        self.experts = self.build_experts(config, **factory)
        self.shared_experts = (
            SharedExperts(config.shared_experts, shard_group=self.dispatcher_reduce_group(), **factory)
            if config.shared_experts is not None else None)
        self.dispatcher = self.build_dispatcher(config)
        if self.sequence_group is not None:
            self._tag_sequence_parallel()
        # Context parallelism: the balancing statistics span the CP ranks' tokens too (the dispatch
        # does not change: CP ranks hold different tokens, like DP ranks).
        self.statistics_group = statistics_group if comms.group_size(statistics_group) > 1 else self.sequence_group
        if context_parallel_size < 1:
            raise ValueError(f"MoELayer: context_parallel_size must be >= 1, got {context_parallel_size}")
        if isinstance(self.router, Router):
            self.router.sequence_group = self.statistics_group
            self.router.averaged_shards = context_parallel_size
        # Expert parameters are reduced over expert-DP (not DP) and summed across replicas; see
        # megamoe.training.grad_sync.
        for param in self.experts.parameters():
            param.expert_parallel = True
        self.load_counter = ExpertLoadCounter(config.num_experts, config.num_expert_slots, device=device)
        self.reset_parameters()

    # ---- components (override to customise) --------------------------------------------------
    def build_router(self, config: MoEConfig, **factory) -> nn.Module:
        """The router: ``config`` is the layer's MoEConfig, ``factory`` its ``device`` / ``dtype``.

        Must return a module with ``config`` (a :class:`RouterConfig`; the layer and the trainer read
        ``num_experts``, ``top_k`` and ``use_expert_bias``, and the trainer logs the balancing from
        ``aux_loss_coeff``, ``seq_aux_loss_coeff``, ``z_loss_coeff`` and ``expert_bias_update_rate``) and
        ``forward(x [T, H], num_sequences) -> RouterOutput``, of which the layer uses ``expert_ids`` [T, K]
        (int64, in [0, num_experts)), ``weights`` [T, K] (the combine weights; their gradient trains the router)
        and ``aux_loss`` [] (summed over layers, back-propagated and reported by the trainer). With
        ``use_expert_bias`` it must also provide ``update_expert_bias(tokens_per_expert [E])``, called by the
        trainer after each optimizer step with the load summed over all ranks. Its parameters are dense ones
        (the gradient sync averages them over data parallel); ``reset_parameters(generator=None)``, if defined,
        is called by :func:`megamoe.tensor_parallel.initialize_parameters`; checkpoints hold its parameters and
        persistent buffers as ``router.<name>``.

        The simplest custom router subclasses :class:`Router` and overrides
        :meth:`Router.gate_logits`."""
        return Router(config.router, **factory)

    def build_experts(self, config: MoEConfig, **factory) -> nn.Module:
        """The routed experts of this rank's ``len(self.local_slots)`` slots (ETP shard
        ``self.etp_rank`` of ``self.etp_size``). ``factory``: ``device`` / ``dtype``.

        Must return a module with ``forward(tokens [N, H] grouped by local slot, tokens_per_slot
        [S_local] int64) -> [N, H]`` (a partial sum over the ETP group), ``load_expert_weights(local_slot,
        gate, up, down)`` (full HF-layout weights: used by :meth:`reset_parameters`) and
        ``expert_weight_shards(local_slot, grad=False) -> {"gate", "up", "down"}`` (views of this
        rank's shards in HF layout: used by checkpoints, the replica gradient sum and the gradient
        norm). Optional: ``supports_per_pair`` and ``forward_per_pair`` (compiled decoding, see the
        module docstring); ``slot_parameters(local_slot)`` and ``slot_buffers(local_slot)`` (what moves
        with a slot: needed by :func:`megamoe.moe.placement.expert_migration.migrate_layer`, see
        :meth:`GroupedExperts.slot_parameters`). Every parameter is tagged ``expert_parallel`` after this
        returns."""
        return GroupedExperts(ExpertsConfig(
            num_local_slots=len(self.local_slots), hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size, activation=config.activation,
            backend=config.expert_backend, etp_size=self.etp_size, etp_rank=self.etp_rank,
            fp8=config.expert_fp8, bias=config.expert_bias, swiglu_alpha=config.swiglu_alpha,
            swiglu_limit=config.swiglu_limit),
            fp8_amax_reduction=(FP8AmaxReduction(etp_group=self.etp_group, slot_group=self.etp_edp_group)
                                if config.expert_fp8 is not None else FP8AmaxReduction()),
            **factory)

    def dispatcher_reduce_group(self) -> ProcessGroup | None:
        """The group the dispatcher's combine reduces over (its class's ``reduce_group_kind``)."""
        return self.expert_group if self.dispatcher_class.reduce_group_kind == "ep_etp" else self.etp_group

    def build_dispatcher(self, config: MoEConfig) -> TokenDispatcher:
        """The :class:`TokenDispatcher` moving (token, slot) pairs to the ranks holding the slots and
        back (see :mod:`megamoe.moe.token_dispatcher` for the interface: ``dispatch``, ``combine``,
        ``token_positions``, ``to_token_view``, ``token_view``, ``ep_size``, ``reduce_group``). Called
        after the router, the experts and the shared experts exist; the shared experts are sharded
        over :meth:`dispatcher_reduce_group`, which a custom dispatcher's ``reduce_group`` must equal.
        With a ``sequence_group`` (sequence parallelism) every rank's tokens differ: the dispatcher must
        take sharded input (the shipped ones do: ``input_sharded``). The default builds the class registered as
        ``config.dispatcher`` (:func:`megamoe.moe.token_dispatcher.dispatcher_class`)."""
        return self.dispatcher_class.build(
            config.num_expert_slots, ep_group=self.ep_group, etp_group=self.etp_group, expert_group=self.expert_group,
            input_sharded=config.input_sharded or self.sequence_group is not None, deterministic=config.deterministic)

    def _tag_sequence_parallel(self) -> None:
        """Sequence parallelism: tag the parameters whose gradient each TP rank gets from its own tokens
        only (see ``sequence_group`` in the class docstring); the router learns the sequence group."""
        if isinstance(self.router, Router):
            self.router.sequence_group = self.sequence_group
        tagged = list(self.router.parameters())
        if self.shared_experts is not None:
            if self.shared_experts.gate_weight is not None:         # computed on this rank's tokens
                tagged.append(self.shared_experts.gate_weight)
            # The shared experts run on the dispatcher's token view (gathered over its reduce group):
            # their gradients are complete when that group is the TP group, this rank's share when it is
            # this rank alone (then summed over TP). A group reaching other TP groups would shard these
            # dense parameters across data-parallel ranks, which average them: refused.
            tp_ranks = set(comms.group_ranks(self.sequence_group))
            reduce_ranks = set(comms.group_ranks(self.dispatcher_reduce_group()))
            if len(reduce_ranks) == 1:
                tagged += [p for name, p in self.shared_experts.named_parameters() if name != "gate_weight"]
            elif reduce_ranks != tp_ranks:
                raise ValueError(f"sequence parallelism: the shared experts are sharded over the dispatcher's group "
                                 f"{sorted(reduce_ranks)}, which must be the TP group {sorted(tp_ranks)} or one rank "
                                 f"(they are dense parameters, averaged over data parallel); change ep / etp")
        for param in tagged:
            param.sequence_parallel = True

    # ---- parameters ---------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Routed experts: each EXPERT's full weights drawn from a generator seeded by its id, so
        every replica, layout and ETP shard sees the same expert. (Router and shared experts reset
        themselves.)"""
        base_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        if any(p.is_meta for p in self.experts.parameters()):
            return                          # no values to hold (e.g. a layout being planned)
        init = normal_init(self.config.init_std)
        H, F = self.config.hidden_size, self.config.ffn_hidden_size
        gated = self.config.activation in ("swiglu", "swiglu_clamped")
        for local_slot, slot in enumerate(self.local_slots):
            g = seeded_generator(base_seed, f"expert.{int(self.placement.slot_to_expert[slot])}")
            gate, up, down = torch.empty(F, H), torch.empty(F, H), torch.empty(H, F)
            for t in (gate, up, down):
                init(t, g)
            self.experts.load_expert_weights(local_slot, gate, up if gated else None, down)

    def sharded_state_dict(self, prefix: str = "") -> list[LogicalChunk]:
        """Router and shared experts as usual; routed experts under per-EXPERT logical names in HF
        layout (``experts.<id>.gate_proj.weight`` [F, H], ``up_proj`` [F, H], ``down_proj`` [H, F];
        with ``expert_bias`` also ``gate_proj.bias`` / ``up_proj.bias`` [F] and ``down_proj.bias`` [H]),
        each slot contributing its ETP chunk. Replicas (and the ETP ranks' copies of the down bias)
        yield the same chunk: stored once."""
        chunks = []
        for name, child in self.named_children():
            if name != "experts":
                chunks += default_sharded_state_dict(child, f"{prefix}{name}.")
        F, H = self.config.ffn_hidden_size, self.config.hidden_size
        f_offset = self.etp_rank * (F // self.etp_size)
        for local_slot, slot in enumerate(self.local_slots):
            expert = int(self.placement.slot_to_expert[slot])
            shards = self.experts.expert_weight_shards(local_slot)
            key = f"{prefix}experts.{expert}"
            chunks.append(LogicalChunk(f"{key}.gate_proj.weight", shards["gate"], (F, H), (f_offset, 0)))
            if "up" in shards:
                chunks.append(LogicalChunk(f"{key}.up_proj.weight", shards["up"], (F, H), (f_offset, 0)))
            chunks.append(LogicalChunk(f"{key}.down_proj.weight", shards["down"], (H, F), (0, f_offset)))
            if "down_bias" in shards:
                chunks.append(LogicalChunk(f"{key}.gate_proj.bias", shards["gate_bias"], (F,), (f_offset,)))
                chunks.append(LogicalChunk(f"{key}.up_proj.bias", shards["up_bias"], (F,), (f_offset,)))
                chunks.append(LogicalChunk(f"{key}.down_proj.bias", shards["down_bias"], (H,), (0,)))
            chunks += self._scale_chunks(key, local_slot, f_offset)
        lora = self.experts._modules.get("lora_adapters")
        if lora is not None:      # megamoe.lora: experts.<id>.<proj>.weight.lora_A / lora_B
            chunks += lora.sharded_state_dict(f"{prefix}experts.")
        return chunks

    def _scale_chunks(self, key: str, local_slot: int, f_offset: int) -> list[LogicalChunk]:
        """Kept block-FP8 experts: each weight's block scales, ``<weight name>_scale_inv`` [ceil(rows / bo),
        ceil(cols / bi)], cut like the weight (ETP shards start on block boundaries)."""
        scale_shards = getattr(self.experts, "expert_scale_shards", lambda s: {})(local_slot)
        if not scale_shards:
            return []
        bo, bi = self.experts.weight_quantization.block_size
        F, H = self.config.ffn_hidden_size, self.config.hidden_size
        up_shape = block_scale_shape((F, H), (bo, bi))
        projections = {"gate": ("gate_proj", up_shape, (f_offset // bo, 0)),
                       "up": ("up_proj", up_shape, (f_offset // bo, 0)),
                       "down": ("down_proj", block_scale_shape((H, F), (bo, bi)), (0, f_offset // bi))}
        return [LogicalChunk(scale_inv_name(f"{key}.{projections[k][0]}.weight"), tensor, projections[k][1],
                             projections[k][2]) for k, tensor in scale_shards.items()]

    def local_replica_counts(self) -> torch.Tensor:
        """[S_local] number of slots (on any rank) holding the expert of each local slot."""
        experts = self.placement.slot_to_expert[self.local_slots.start:self.local_slots.stop]
        return self.placement.replica_counts[experts]

    @torch.no_grad()
    def reduce_replica_grads(self) -> None:
        """Sum each replicated expert's gradients over all its slots (on this rank and across the EP
        group) and give every replica the sum, so replicas stay identical after the optimizer step.
        One all-reduce over EP per weight kind, of a buffer holding only the replicated experts."""
        lora = self.experts._modules.get("lora_adapters")     # megamoe.lora: adapters of all experts, EP-summed
        if lora is not None:
            lora.reduce_grads()
        replicated = torch.nonzero(self.placement.replica_counts > 1, as_tuple=True)[0]
        if replicated.numel() == 0 or any(main_grad(p) is None for p in self.experts.parameters()):
            return
        row_of_expert = torch.full((self.config.num_experts,), -1, dtype=torch.long)
        row_of_expert[replicated] = torch.arange(replicated.numel())
        local_rows = [int(row_of_expert[self.placement.slot_to_expert[slot]]) for slot in self.local_slots]
        grads = [self.experts.expert_weight_shards(s, grad=True) for s in range(len(self.local_slots))]
        for name, first in grads[0].items():
            buffer = first.new_zeros((replicated.numel(), *first.shape))
            for local_slot, row in enumerate(local_rows):
                if row >= 0:
                    buffer[row] += grads[local_slot][name]
            comms.all_reduce_(buffer, self.ep_group)
            for local_slot, row in enumerate(local_rows):
                if row >= 0:
                    grads[local_slot][name].copy_(buffer[row])

    # ---- forward ------------------------------------------------------------------------------
    def experts_to_slots(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] expert ids -> [T, K] slot ids (-1 for pairs dropped by the capacity limit)."""
        positions = None
        if self.placement.num_slots > self.placement.num_experts:     # replicas: the choice needs positions
            positions = self.dispatcher.token_positions(expert_ids.shape[0], device=expert_ids.device)
        slot_ids = self.placement.choose_slots(expert_ids, positions)
        if self.config.capacity_factor is not None:
            slot_ids = slot_ids.masked_fill(~self._within_capacity(expert_ids), -1)
        return slot_ids

    def _within_capacity(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Keep each expert's first :func:`expert_capacity` pairs in (token, k) order; drop the rest."""
        num_pairs = expert_ids.numel()
        capacity = expert_capacity(num_pairs, self.config.num_experts, self.config.capacity_factor)
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sorted_ids = flat[order]
        starts = torch.searchsorted(sorted_ids, sorted_ids, right=False)
        rank_in_expert = torch.empty_like(flat)
        rank_in_expert[order] = torch.arange(num_pairs, device=flat.device) - starts
        return (rank_in_expert < capacity).view_as(expert_ids)

    def forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None = None):
        """``hidden`` [B, S, H] or [T, H] -> (output of the same shape, aux_loss []).
        ``token_mask`` [T] (True: a real token): the other tokens (padding) reach no expert and are not
        counted in the load; their output is unspecified (their routing still enters the aux loss)."""
        if self.fold_group is not None:
            return self._folded_forward(hidden, token_mask)
        return self._forward(hidden, token_mask)

    def _folded_forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None):
        """MoE parallel folding (``fold_group``): this rank's disjoint share in, everyone's out."""
        shares, rank = comms.group_size(self.fold_group), comms.group_rank(self.fold_group)
        dim = 1 if hidden.dim() == 3 else 0           # [B, S, H]: the sequence dim, as under SP
        if not torch.is_grad_enabled():
            # No gradients (generation, evaluation): every TP rank computes all its tokens, which is
            # correct for any token count (each gets its own copy back), and TP rank 0 alone counts
            # them, as every inference tool expects (see megamoe.models.moe_folding).
            return self._forward(hidden, token_mask, count_load=rank == 0)
        if hidden.shape[dim] % shares:
            raise ValueError(f"MoE parallel folding splits the tokens over the TP group: the "
                             f"{'sequence length' if dim else 'token count'} {hidden.shape[dim]} must be "
                             f"divisible by tp={shares} when training")
        share = comms.scatter_to_sequence_parallel_region(hidden, self.fold_group, dim=dim)
        if token_mask is not None:
            token_mask = token_mask.reshape(hidden.shape[:-1]).chunk(shares, dim=dim)[rank].reshape(-1)
        output, aux_loss = self._forward(share, token_mask)
        # The gradient of the output is the same on every TP rank: each keeps its own share's rows.
        return comms.gather_from_sequence_parallel_region(output, self.fold_group, reduce_grad=False, dim=dim), aux_loss

    def _forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None, count_load: bool = True):
        shape = hidden.shape
        num_sequences = shape[0] if hidden.dim() == 3 else 1
        x = hidden.reshape(-1, shape[-1])                                   # [T, H]

        routing = self.router(x, num_sequences)                             # route (fp32)
        slot_ids = self.experts_to_slots(routing.expert_ids)                # experts -> slots
        counted_expert_ids = routing.expert_ids
        if token_mask is not None:
            padding = ~token_mask.reshape(-1, 1)
            slot_ids = slot_ids.masked_fill(padding, -1)
            counted_expert_ids = counted_expert_ids.masked_fill(padding, -1)
        if count_load and not is_recomputing():  # activation recomputation re-runs this forward: count once
            with torch.no_grad():
                self.load_counter.record(counted_expert_ids, slot_ids)
        if self._computes_per_pair(slot_ids):                               # compiled decoding
            output = self.experts.forward_per_pair(x, slot_ids, routing.weights)
            if self.shared_experts is not None:
                output = output + self.shared_experts(x, self.shared_experts.gate(x))
        else:
            output = self.dispatch_and_compute(x, slot_ids, routing.weights)
        return output.view(shape), routing.aux_loss

    # Row counts and split sizes are read on the host by design: never traced by torch.compile, which
    # would otherwise recompile its pieces for every new count. torch.compiler.disable, but made at the first
    # call (torch's own lazy form): the decorator imports torch._dynamo, over a second of CPU in every process
    # that imports this module, and most (training ranks, conversions) never compile.
    @_disable_dynamo
    def dispatch_and_compute(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """dispatch -> experts -> combine (with the shared experts): [T, H] for this rank's tokens.

        ``MoEConfig.shared_expert_overlap`` (all-to-all dispatcher, EP > 1, shared experts): the dispatch
        all-to-alls are started and the shared experts' first GEMMs (gate / up projections) run while they are
        in flight; after the routed experts, the combine all-to-all is started and the shared experts' down
        projection runs while it is in flight. The backward mirrors it (each reverse exchange runs during the
        backward of the GEMMs it overlapped). The same operations on the same values in another order:
        identical results."""
        if self._overlaps_shared_experts():
            self.dispatcher.dispatch(x, slot_ids, weights, overlap=True)
            with comms.timed("shared_experts_up", tag="moe"):
                gate = self.shared_experts.gate(x)
                if gate is not None:
                    gate = self.dispatcher.to_token_view(gate)
                hidden = self.shared_experts.up(self.dispatcher.token_view)
            expert_input, tokens_per_slot = self.dispatcher.dispatch_finish()
            expert_output = self._run_experts(expert_input, tokens_per_slot)

            def shared_down():
                with comms.timed("shared_experts_down", tag="moe"):
                    return self.shared_experts.down(hidden, gate)
            return self.dispatcher.combine(expert_output, during=shared_down)
        expert_input, tokens_per_slot = self.dispatcher.dispatch(x, slot_ids, weights)
        expert_output = self._run_experts(expert_input, tokens_per_slot)   # grouped GEMMs
        with comms.timed("shared_experts", tag="moe"):
            shared_output = self._shared_experts_partial(x)
        return self.dispatcher.combine(expert_output, shared_output)        # weighted sum + ONE reduction

    def _run_experts(self, expert_input: torch.Tensor, tokens_per_slot: torch.Tensor) -> torch.Tensor:
        """The shipped experts also get the rows per slot the dispatcher read on the host (no second read);
        custom ones (``build_experts``) the documented two arguments."""
        rows_per_slot = getattr(self.dispatcher, "rows_per_slot", None)
        if isinstance(self.experts, GroupedExperts) and rows_per_slot is not None:
            return self.experts(expert_input, tokens_per_slot, rows_per_slot=rows_per_slot)
        return self.experts(expert_input, tokens_per_slot)

    def _overlaps_shared_experts(self) -> bool:
        return (self.config.shared_expert_overlap and self.shared_experts is not None
                and getattr(self.dispatcher, "overlaps_dispatch", lambda: False)())

    def _computes_per_pair(self, slot_ids: torch.Tensor) -> bool:
        """See the module docstring: compiled inference, nothing to communicate, few pairs."""
        return (torch.compiler.is_compiling() and not torch.is_grad_enabled()
                and getattr(self.experts, "supports_per_pair", False)
                and self.dispatcher.ep_size == 1 and comms.group_size(self.dispatcher.reduce_group) == 1
                and slot_ids.numel() <= len(self.local_slots))

    def _shared_experts_partial(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_experts is None:
            return None
        gate = self.shared_experts.gate(x)
        if gate is not None:
            gate = self.dispatcher.to_token_view(gate)
        return self.shared_experts(self.dispatcher.token_view, gate)
