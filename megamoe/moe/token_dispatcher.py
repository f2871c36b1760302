"""Token dispatchers: move (token, slot) pairs to the ranks holding the slots, and back.

Both dispatchers share one interface, used by :class:`megamoe.moe.moe_layer.MoELayer`::

    expert_input, tokens_per_slot = dispatcher.dispatch(x, slot_ids, weights)
    expert_output = experts(expert_input, tokens_per_slot)        # rows grouped by local slot
    output = dispatcher.combine(expert_output, shared_output)     # [T, H] for this rank's tokens

A dispatcher owns the state between ``dispatch`` and ``combine`` (permutation, splits, weights).
``token_view`` is the layer's tokens as seen by the experts' reduction group (all gathered tokens for
the all-gather paradigm, this rank's tokens for all-to-all); a shared expert sharded over
``reduce_group`` runs on it and its partial output is added before the single reduction.
``to_token_view`` carries a per-token tensor of this rank's tokens (routing weights, a shared-expert
gate) into that view with gradients that are complete on the rank owning the token.

Pairs whose slot id is -1 (dropped by a capacity limit) are never dispatched.

Host reads: a dispatch reads data-dependent sizes on the host ONCE (a synchronisation on accelerators): the
all-to-all's split sizes together with the rows of every local slot, which size the expert input and the
experts' GEMMs (``rows_per_slot``, passed on to the experts); the all-gather dispatcher's per-slot rows (with
sharded input, together with every rank's token count). A recomputed dispatch (activation recomputation)
reuses its forward's read (:func:`megamoe.transformer.recompute.forward_value`) and skips the count exchange.

Sums: the combine and the token gradients add rows in fp32 and round once; ``deterministic`` (or torch's
deterministic algorithms) adds them in a fixed order (:mod:`megamoe.moe.row_sums`).

Layout rules: each dispatcher class declares its own (class attributes and classmethods of
:class:`TokenDispatcher`: the group it reduces over, its default expert-TP size, the layouts it accepts, how
many ranks compute the same tokens), and is looked up ONCE by the name ``MoEConfig.dispatcher`` holds
(:func:`dispatcher_class`; :func:`register_dispatcher` adds a user's). The layout plan
(:mod:`megamoe.parallel_plan`), the MoE layer, the memory model and the launchers read these rules rather than
testing the name.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.host_values import even_split, host_ints
from megamoe.moe.permutation import pairs_per_slot, permute_by_slot, unpermute_and_combine
from megamoe.moe.row_sums import gather_rows, sum_rows
from megamoe.precision import in_autocast_dtype
from megamoe.transformer.recompute import forward_value

__all__ = ["TokenDispatcher", "AllGatherDispatcher", "AllToAllDispatcher", "DEFAULT_DISPATCHER", "dispatcher_class",
           "dispatcher_names", "register_dispatcher"]


class TokenDispatcher:
    """Base class: subclasses set ``reduce_group`` and implement the methods below.

    Layout rules (class attributes and classmethods, read before any instance exists; a subclass overrides
    what differs). The defaults are the all-to-all paradigm's: each rank dispatches its own tokens, the
    expert shards of a slot are summed over the ETP group.
    """

    # The registry key (``MoEConfig.dispatcher``): see register_dispatcher.
    name: ClassVar[str] = ""
    # The ParallelState group the combine reduces over, over which the shared experts are sharded too:
    # "etp" (the expert-TP group) or "ep_etp" (the EP x ETP group).
    reduce_group_kind: ClassVar[str] = "etp"
    # Whether MoEConfig.input_sharded (tokens sharded over the reduce group: data-parallel attention) applies.
    accepts_input_sharded: ClassVar[bool] = False
    # Whether etp < tp without sequence parallelism folds the MoE layers (each TP rank dispatches a disjoint
    # share of the replicated tokens: megamoe.models.moe_folding).
    folds_over_tp: ClassVar[bool] = True
    # Whether tokens travel by all-to-all exchange within the EP group (their buffers count in the memory model).
    exchanges_tokens: ClassVar[bool] = True
    # Whether dispatch(..., overlap=True) can leave its exchange in flight (MoEConfig.shared_expert_overlap).
    overlaps_shared_experts: ClassVar[bool] = False

    reduce_group: ProcessGroup | None
    token_view: torch.Tensor | None = None
    # Host ints: the rows of every local slot in the last dispatch's expert input (None: not read).
    rows_per_slot: list[int] | None = None

    def __init__(self, num_slots: int, ep_group: ProcessGroup | None, deterministic: bool = False):
        self.ep_group = ep_group
        self.deterministic = deterministic
        self.ep_size, self.ep_rank = comms.group_size(ep_group), comms.group_rank(ep_group)
        if num_slots % self.ep_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of the EP size ({self.ep_size})")
        self.num_slots = num_slots
        self.slots_per_rank = num_slots // self.ep_size
        self.first_local_slot = self.ep_rank * self.slots_per_rank

    @classmethod
    def build(cls, num_slots: int, *, ep_group: ProcessGroup | None, etp_group: ProcessGroup | None,
              expert_group: ProcessGroup | None, input_sharded: bool, deterministic: bool) -> TokenDispatcher:
        """The dispatcher of one MoE layer (:meth:`megamoe.moe.moe_layer.MoELayer.build_dispatcher`): the layer's
        groups, and whether its tokens differ between the ranks of :attr:`reduce_group_kind`."""
        return cls(num_slots, ep_group=ep_group, etp_group=etp_group, input_sharded=input_sharded,
                   deterministic=deterministic)

    @classmethod
    def default_etp(cls, tp: int) -> int:
        """The expert-TP size a layout takes when none is given: ``tp`` (etp < tp folds the MoE layers)."""
        return tp

    @classmethod
    def reduce_group_size(cls, ep: int, etp: int) -> int:
        """The size of the :attr:`reduce_group_kind` group."""
        return ep * etp if cls.reduce_group_kind == "ep_etp" else etp

    @classmethod
    def check_layout(cls, moe_config, state) -> None:
        """ValueError naming the sizes unless this dispatcher can run the layout of ``state`` (sizes and ranks
        of its ``tp``, ``ep``, ``etp`` and ``ep_etp`` groups, and its ``rank``) with tokens replicated over TP
        (the plan skips this check under sequence parallelism, where every rank holds its own tokens)."""
        tp, etp = state.tp.size, state.etp.size
        if tp % etp:
            raise ValueError(f"the {cls.name or cls.__name__} dispatcher needs etp dividing tp (etp == tp: ETP ranks "
                             f"share tokens; etp < tp: each TP rank dispatches its own share, see "
                             f"megamoe.models.moe_folding), got etp={etp} tp={tp}; set etp to a divisor of {tp}")

    @classmethod
    def expert_token_replicas(cls, moe_config, tp: int, ep: int, etp: int) -> int:
        """How many ranks of an expert-DP group compute the SAME tokens with the same expert shards, tokens
        replicated over TP (the expert gradient reduction divides by it): 1, each rank dispatches its own."""
        return 1

    def overlaps_dispatch(self) -> bool:
        """Whether :meth:`dispatch` can leave its exchange in flight (``overlap=True``): a class that
        :attr:`overlaps_shared_experts`, with EP > 1 (else there is no exchange)."""
        return self.overlaps_shared_experts and self.ep_size > 1

    def token_positions(self, num_tokens: int, device=None) -> torch.Tensor:
        """Global positions of this rank's tokens, used for the replica choice (identical on every
        rank that holds the same token)."""
        raise NotImplementedError

    def to_token_view(self, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dispatch(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor):
        raise NotImplementedError

    def combine(self, expert_output: torch.Tensor, shared_output: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class AllGatherDispatcher(TokenDispatcher):
    """Every rank of the expert group (EP x ETP) sees all tokens; ONE reduction per layer.

    Each rank keeps the pairs routed to its local slots, computes them, adds the shared expert's
    partial output, and the partial outputs are summed with one all-reduce over ``expert_group``; or,
    when the layer's input tokens are sharded across that group (``input_sharded``: sequence parallel,
    data-parallel attention), the tokens are all-gathered first and the sum is ONE reduce-scatter back
    to each rank's tokens.

    Sharded input may be uneven: ranks may hold different numbers of tokens, zero included (e.g.
    data-parallel attention, each rank serving its own requests). Each ``dispatch`` exchanges the
    token counts (one all-gather of one integer per rank) and the gather / reduce-scatter pad to the
    largest count (:mod:`megamoe.comms`); equal counts move exactly the unpadded bytes.

    Gradients: forward all-reduce -> backward identity, so each rank's expert-weight gradients are
    complete for its slots; the gradients of the token view (and of the routing weights) are summed
    over the group on the way back (all-reduce, or reduce-scatter for sharded input), so the input and
    router gradients are complete on every rank.
    """

    name = "allgather"
    reduce_group_kind = "ep_etp"
    accepts_input_sharded = True
    folds_over_tp = False
    exchanges_tokens = False

    def __init__(self, num_slots: int, *, ep_group: ProcessGroup | None = None,
                 expert_group: ProcessGroup | None = None, input_sharded: bool = False, deterministic: bool = False):
        super().__init__(num_slots, ep_group, deterministic)
        if comms.group_size(expert_group) % self.ep_size:
            raise ValueError(f"expert_group size ({comms.group_size(expert_group)}) must be a multiple of the "
                             f"EP size ({self.ep_size}): pass the EP x ETP group")
        self.reduce_group = expert_group
        self.input_sharded = input_sharded
        self._tokens_per_rank: list[int] | None = None   # sharded input: every rank's token count

    @classmethod
    def build(cls, num_slots, *, ep_group, etp_group, expert_group, input_sharded, deterministic):
        return cls(num_slots, ep_group=ep_group, expert_group=expert_group, input_sharded=input_sharded,
                   deterministic=deterministic)

    @classmethod
    def default_etp(cls, tp: int) -> int:
        """1: EP inside the TP group."""
        return 1

    @classmethod
    def check_layout(cls, moe_config, state) -> None:
        """The EP x ETP group runs inside the TP group (``ep * etp`` divides ``tp``: tokens are replicated over
        TP after attention), or with ``input_sharded`` spans data-parallel ranks only (no two of its ranks in one
        TP group: they must hold different tokens)."""
        tp, ep, etp = state.tp.size, state.ep.size, state.etp.size
        if moe_config.input_sharded:
            shared = sorted(set(state.ep_etp.ranks) & set(state.tp.ranks))
            if shared != [state.rank]:
                raise ValueError(f"input_sharded all-gather dispatch gathers the tokens of the EP x ETP group "
                                 f"{state.ep_etp.ranks}, whose ranks must hold different tokens, but ranks {shared} "
                                 f"are in one TP group {state.tp.ranks}; span EP over data-parallel ranks (e.g. "
                                 "order='tp-cp-dp-ep-pp') or set input_sharded=False")
        elif tp % (ep * etp):
            raise ValueError(f"the all-gather dispatcher runs inside the TP group: ep * etp must divide tp, got "
                             f"ep={ep} etp={etp} tp={tp}; use dispatcher='alltoall' (with etp == tp) or change the "
                             "layout")

    @classmethod
    def expert_token_replicas(cls, moe_config, tp: int, ep: int, etp: int) -> int:
        """tp / (ep * etp): the TP ranks outside the expert group hold the same tokens; tp with sharded input
        (each TP rank gathers the same tokens in its own expert group)."""
        return tp if moe_config.input_sharded else tp // (ep * etp)

    def token_positions(self, num_tokens: int, device=None) -> torch.Tensor:
        # Sharded input: only the token's owner picks its slots (the ids are then gathered), so the
        # offset merely staggers the ranks' replica cycles; with uneven counts it may repeat.
        offset = comms.group_rank(self.reduce_group) * num_tokens if self.input_sharded else 0
        return torch.arange(offset, offset + num_tokens, device=device)

    def to_token_view(self, values: torch.Tensor) -> torch.Tensor:
        if self.input_sharded:
            return comms.gather_from_sequence_parallel_region(values, self.reduce_group,
                                                              sizes=self._tokens_per_rank)
        return comms.copy_to_tensor_parallel_region(values, self.reduce_group)

    def dispatch(self, x, slot_ids, weights):
        rows_per_slot = None
        if self.input_sharded:
            self._tokens_per_rank, rows_per_slot = forward_value(lambda: self._exchange_counts(x, slot_ids))
        self.token_view = self.to_token_view(x)                          # [T_all, H]
        if self.input_sharded:                                           # no grad: integer ids
            slot_ids = comms.all_gather_into(slot_ids, self.reduce_group, sizes=self._tokens_per_rank)
        weights = self.to_token_view(weights)                            # [T_all, K]
        local_slot_ids = slot_ids - self.first_local_slot
        local_slot_ids = local_slot_ids.masked_fill(
            (slot_ids < 0) | (local_slot_ids < 0) | (local_slot_ids >= self.slots_per_rank), -1)
        if rows_per_slot is None:       # the one host read (replayed by a recomputation)
            rows_per_slot = forward_value(lambda: host_ints(
                pairs_per_slot(local_slot_ids, self.slots_per_rank),
                on_meta=even_split(local_slot_ids.numel(), self.slots_per_rank)))
        expert_input, tokens_per_slot, self._permutation = permute_by_slot(
            self.token_view, local_slot_ids, self.slots_per_rank, rows_per_slot, self.deterministic)
        self.rows_per_slot = rows_per_slot
        self._weights = weights
        return expert_input, tokens_per_slot

    def _exchange_counts(self, x, slot_ids) -> tuple[list[int], list[int]]:
        """Sharded input: (every rank's token count, the rows of every local slot), from ONE all-gather of each
        rank's token count and pairs per slot, and one host read."""
        group_size = comms.group_size(self.reduce_group)
        counts = torch.cat([torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device),
                            pairs_per_slot(slot_ids, self.num_slots)])
        gathered = comms.all_gather_into(counts.unsqueeze(0), self.reduce_group).view(group_size, -1)
        local = gathered[:, 1 + self.first_local_slot:1 + self.first_local_slot + self.slots_per_rank].sum(0)
        # Meta: every rank as many tokens as this one, every pair valid (see megamoe.host_values).
        values = host_ints(torch.cat([gathered[:, 0], local]), on_meta=[x.shape[0]] * group_size + even_split(
            group_size * slot_ids.numel(), self.slots_per_rank))
        return values[:group_size], values[group_size:]

    def combine(self, expert_output, shared_output=None):
        out = unpermute_and_combine(expert_output, self._weights, self._permutation)  # [T_all, H]
        if shared_output is not None:
            out = out + shared_output
        self._permutation = self._weights = self.token_view = self.rows_per_slot = None
        if self.input_sharded:
            tokens_per_rank, self._tokens_per_rank = self._tokens_per_rank, None
            return comms.reduce_scatter_to_sequence_parallel_region(out, self.reduce_group, sizes=tokens_per_rank)
        return comms.reduce_from_tensor_parallel_region(out, self.reduce_group)


class AllToAllDispatcher(TokenDispatcher):
    """Each EP rank sends each token ONCE to every EP rank holding at least one of its selected
    slots, experts compute, and a second all-to-all returns one weighted partial sum per (token,
    destination rank) for the combine.

    ETP: the ranks of an ETP group hold the same tokens and exchange them identically inside their EP
    groups; each computes its FFN shard, and one all-reduce over ``etp_group`` sums the shards (the
    shared expert's partial included).

    ``input_sharded`` (sequence parallelism: every rank holds its own chunk of the sequence): the ETP
    ranks' tokens differ, so ``dispatch`` first all-gathers them (and their slot ids and routing
    weights) over ``etp_group``, making the ETP ranks share tokens as above, and ``combine`` sums the
    shards with ONE reduce-scatter back to each rank's own tokens instead of the all-reduce. Every
    rank's token count must be the same (the sequence chunks are equal).

    Gradients: the all-to-alls' backward is the reverse exchange, which returns each token's gradient
    to its owner; expert-weight gradients are complete locally; the token view and routing weights
    carry an ETP all-reduce in backward (copy-to-TP region) so they are complete on every ETP rank.
    """

    name = "alltoall"
    overlaps_shared_experts = True

    def __init__(self, num_slots: int, *, ep_group: ProcessGroup | None = None,
                 etp_group: ProcessGroup | None = None, input_sharded: bool = False, deterministic: bool = False):
        super().__init__(num_slots, ep_group, deterministic)
        self.reduce_group = etp_group
        self.input_sharded = input_sharded and comms.group_size(etp_group) > 1

    def token_positions(self, num_tokens: int, device=None) -> torch.Tensor:
        owner = self.ep_rank
        if self.input_sharded:          # every rank's own tokens: a distinct range per (EP, ETP) rank
            owner = owner * comms.group_size(self.reduce_group) + comms.group_rank(self.reduce_group)
        offset = owner * num_tokens
        return torch.arange(offset, offset + num_tokens, device=device)

    def to_token_view(self, values: torch.Tensor) -> torch.Tensor:
        if self.input_sharded:
            return comms.gather_from_sequence_parallel_region(values, self.reduce_group)
        return comms.copy_to_tensor_parallel_region(values, self.reduce_group)

    def dispatch(self, x, slot_ids, weights, overlap: bool = False):
        """See the module docstring. ``overlap`` (EP > 1 only, :meth:`overlaps_dispatch`): start the token,
        slot and weight all-to-alls and return None at once; :meth:`dispatch_finish` waits for them and
        returns the expert input. Compute run in between overlaps the exchange (the shared experts); in the
        backward, the reverse exchanges overlap that compute's backward
        (:func:`~megamoe.comms.all_to_all_start`)."""
        self.token_view = self.to_token_view(x)
        weights = self.to_token_view(weights)
        if self.input_sharded:                                           # no grad: integer ids
            slot_ids = comms.all_gather_into(slot_ids, self.reduce_group)
        num_tokens, top_k = slot_ids.shape
        if self.ep_size == 1:
            # Every slot is local: the exchange is the identity, so skip its bookkeeping (which
            # dominates small batches, e.g. decoding). The one host read: the rows of every slot.
            rows_per_slot = forward_value(lambda: host_ints(pairs_per_slot(slot_ids, self.slots_per_rank),
                                                            on_meta=even_split(slot_ids.numel(), self.slots_per_rank)))
            expert_input, tokens_per_slot, self._permutation = permute_by_slot(
                self.token_view, slot_ids, self.slots_per_rank, rows_per_slot, self.deterministic)
            self._recv_weights, self._send_token, self.rows_per_slot = weights, None, rows_per_slot
            return expert_input, tokens_per_slot
        dest_rank = torch.where(slot_ids >= 0, torch.div(slot_ids, self.slots_per_rank, rounding_mode="floor"),
                                torch.full_like(slot_ids, -1))
        # Deduplicate per destination: token t goes to rank r once, carrying the local slot ids (and
        # routing weights) of all its pairs on r; -1 pads pairs that live elsewhere. Elementwise: no
        # data-dependent size, no host read.
        ranks = torch.arange(self.ep_size, device=x.device).view(-1, 1, 1)
        sends = (dest_rank.unsqueeze(0) == ranks).any(dim=2)                       # [EP, T]
        # The one host read of the dispatch (replayed by a recomputation, which skips the exchange): the
        # split sizes, and the rows of every local slot, which size the expert input and the experts' GEMMs.
        counts = forward_value(lambda: self._exchange_counts(sends, slot_ids))
        self._send_splits, self._recv_splits = counts[:self.ep_size], counts[self.ep_size:2 * self.ep_size]
        self.rows_per_slot = counts[2 * self.ep_size:]
        # The (rank, token) pairs to send, in that order: the first n_send entries of a stable sort of
        # "not sent" (the count is known: no nonzero).
        n_send = sum(self._send_splits)
        flat = torch.sort((~sends).reshape(-1).to(torch.uint8), stable=True).indices[:n_send]
        send_rank, send_token = torch.div(flat, num_tokens, rounding_mode="floor"), flat % num_tokens
        pair_dest = dest_rank[send_token]                                  # [n_send, K]
        on_dest = pair_dest == send_rank.unsqueeze(1)
        send_local_slots = torch.where(on_dest, slot_ids[send_token] - send_rank.unsqueeze(1) * self.slots_per_rank,
                                       torch.full_like(pair_dest, -1))
        send_weights = weights[send_token] * on_dest                       # [n_send, K]
        self._send_token, self._num_tokens, self._top_k = send_token, num_tokens, top_k
        send_rows = gather_rows(self.token_view, send_token, max_per_row=min(top_k, self.ep_size),
                                deterministic=self.deterministic)
        # Under autocast the experts compute in the autocast dtype: the rows cross the wire in it (half the
        # bytes of fp32 tokens), both ways: the backward returns their gradients in it too. Cast after the
        # gather, so that its backward still sums a token's gradients in the token's own dtype.
        send_rows, = in_autocast_dtype(send_rows)
        if not overlap:
            recv_tokens = comms.all_to_all(send_rows, self._recv_splits, self._send_splits, self.ep_group,
                                           tag="moe_dispatch")
            recv_local_slots = _all_to_all_no_grad(send_local_slots, self._recv_splits, self._send_splits,
                                                   self.ep_group, tag="moe_dispatch")
            recv_weights = comms.all_to_all(send_weights, self._recv_splits, self._send_splits, self.ep_group,
                                            tag="moe_dispatch")
            return self._permute_received(recv_tokens, recv_local_slots, recv_weights)
        # Started in the order the blocking path runs them (one process group: they complete in order).
        tokens = comms.all_to_all_start(send_rows, self._recv_splits, self._send_splits, self.ep_group,
                                        tag="moe_dispatch")
        with torch.no_grad():
            slots = comms.all_to_all_start(send_local_slots, self._recv_splits, self._send_splits, self.ep_group,
                                           tag="moe_dispatch")
        weights = comms.all_to_all_start(send_weights, self._recv_splits, self._send_splits, self.ep_group,
                                         tag="moe_dispatch")
        self._pending = (tokens, slots, weights)
        return None

    def dispatch_finish(self):
        """Wait for the exchanges :meth:`dispatch` started with ``overlap=True``; returns what ``dispatch``
        returns (expert input, tokens per slot)."""
        tokens, slots, weights = self._pending
        self._pending = None
        recv_tokens = comms.all_to_all_wait(tokens)
        with torch.no_grad():
            recv_local_slots = comms.all_to_all_wait(slots)
        recv_weights = comms.all_to_all_wait(weights)
        return self._permute_received(recv_tokens, recv_local_slots, recv_weights)

    def _exchange_counts(self, sends, slot_ids) -> list[int]:
        """One all-to-all of, per destination rank, the tokens sent there and the pairs for each of its slots;
        one host read of (send splits, receive splits, rows of every local slot)."""
        send_counts = torch.cat([sends.sum(dim=1, keepdim=True),
                                 pairs_per_slot(slot_ids, self.num_slots).view(self.ep_size, self.slots_per_rank)],
                                dim=1)                                                  # [EP, 1 + S_local]
        recv_counts = comms.all_to_all_counts(send_counts, self.ep_group)
        # A meta dry run sends every token to every rank, every pair valid (see megamoe.host_values).
        num_tokens = slot_ids.shape[0]
        return host_ints(torch.cat([send_counts[:, 0], recv_counts[:, 0], recv_counts[:, 1:].sum(0)]),
                         on_meta=[num_tokens] * (2 * self.ep_size)
                         + even_split(self.ep_size * slot_ids.numel(), self.slots_per_rank))

    def _permute_received(self, recv_tokens, recv_local_slots, recv_weights):
        expert_input, tokens_per_slot, self._permutation = permute_by_slot(
            recv_tokens, recv_local_slots, self.slots_per_rank, self.rows_per_slot, self.deterministic)
        self._recv_weights = recv_weights
        return expert_input, tokens_per_slot

    def combine(self, expert_output, shared_output=None, *, during=None):
        """See the module docstring. ``during`` (instead of ``shared_output``): a callable returning the shared
        output, run while the combine all-to-all is in flight (EP > 1; else right away)."""
        out = unpermute_and_combine(expert_output, self._recv_weights, self._permutation)   # per received token
        if self._send_token is not None and during is not None:
            pending = comms.all_to_all_start(out, self._send_splits, self._recv_splits, self.ep_group,
                                             tag="moe_combine")
            shared_output = during()
            returned = comms.all_to_all_wait(pending)
        elif self._send_token is not None:
            returned = comms.all_to_all(out, self._send_splits, self._recv_splits, self.ep_group, tag="moe_combine")
        elif during is not None:
            shared_output = during()
        if self._send_token is not None:
            # Each token's partial sums from the ranks it went to, accumulated in fp32 with the shared
            # output and rounded once (see megamoe.moe.row_sums).
            total = sum_rows(returned, self._send_token, self._num_tokens, max_per_out=min(self._top_k, self.ep_size),
                             deterministic=self.deterministic)
            dtype = returned.dtype if shared_output is None else torch.promote_types(returned.dtype,
                                                                                     shared_output.dtype)
            out = (total if shared_output is None else total + shared_output).to(dtype)
        elif shared_output is not None:
            out = out + shared_output
        self._permutation = self._recv_weights = self.token_view = self._send_token = self.rows_per_slot = None
        if self.input_sharded:
            return comms.reduce_scatter_to_sequence_parallel_region(out, self.reduce_group)
        return comms.reduce_from_tensor_parallel_region(out, self.reduce_group)


def _all_to_all_no_grad(x, output_splits, input_splits, group, tag=None):
    with torch.no_grad():
        return comms.all_to_all(x, output_splits, input_splits, group, tag=tag)


# name -> dispatcher class: MoEConfig.dispatcher's values. The shipped ones; register_dispatcher adds more.
_REGISTRY: dict[str, type[TokenDispatcher]] = {cls.name: cls for cls in (AllToAllDispatcher, AllGatherDispatcher)}
DEFAULT_DISPATCHER = AllToAllDispatcher.name


def register_dispatcher(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
    """Make ``cls`` (a :class:`TokenDispatcher` subclass with its own ``name``) what ``MoEConfig.dispatcher =
    cls.name`` dispatches with; usable as a class decorator. Its layout rules are its class attributes and
    classmethods (see :class:`TokenDispatcher`). Registering the same class again is a no-op; another class
    under a taken name is refused (ValueError): a checkpoint's dispatcher name must keep one meaning."""
    if not (isinstance(cls, type) and issubclass(cls, TokenDispatcher)):
        raise ValueError(f"register_dispatcher: expected a TokenDispatcher subclass, got {cls!r}")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_dispatcher: {cls.__name__}.name must be its own non-empty str (the "
                         f"MoEConfig.dispatcher value that selects it), got {name!r}")
    if cls.reduce_group_kind not in ("etp", "ep_etp"):
        raise ValueError(f"register_dispatcher: {cls.__name__}.reduce_group_kind must be 'etp' or 'ep_etp', got "
                         f"{cls.reduce_group_kind!r}")
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"register_dispatcher: name {name!r} is taken by {_REGISTRY[name].__name__}; give "
                         f"{cls.__name__} another name")
    _REGISTRY[name] = cls
    return cls


def dispatcher_names() -> tuple[str, ...]:
    """The registered dispatcher names (MoEConfig.dispatcher's valid values)."""
    return tuple(_REGISTRY)


def dispatcher_class(name: str) -> type[TokenDispatcher]:
    """The dispatcher class registered as ``name``; ValueError naming ``MoEConfig.dispatcher`` otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"MoEConfig.dispatcher must be one of {dispatcher_names()} (or a name given to "
                         f"register_dispatcher), got {name!r}") from None
