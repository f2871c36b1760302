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
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.host_values import host_ints
from megamoe.moe.permutation import permute_by_slot, unpermute_and_combine

__all__ = ["TokenDispatcher", "AllGatherDispatcher", "AllToAllDispatcher"]


class TokenDispatcher:
    """Base class: subclasses set ``reduce_group`` and implement the methods below."""

    reduce_group: ProcessGroup | None
    token_view: torch.Tensor | None = None

    def __init__(self, num_slots: int, ep_group: ProcessGroup | None):
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = comms.group_size(ep_group), comms.group_rank(ep_group)
        if num_slots % self.ep_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of the EP size ({self.ep_size})")
        self.num_slots = num_slots
        self.slots_per_rank = num_slots // self.ep_size
        self.first_local_slot = self.ep_rank * self.slots_per_rank

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

    def __init__(self, num_slots: int, *, ep_group: ProcessGroup | None = None,
                 expert_group: ProcessGroup | None = None, input_sharded: bool = False):
        super().__init__(num_slots, ep_group)
        if comms.group_size(expert_group) % self.ep_size:
            raise ValueError(f"expert_group size ({comms.group_size(expert_group)}) must be a multiple of the "
                             f"EP size ({self.ep_size}): pass the EP x ETP group")
        self.reduce_group = expert_group
        self.input_sharded = input_sharded
        self._tokens_per_rank: list[int] | None = None   # sharded input: every rank's token count

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
        if self.input_sharded:
            self._tokens_per_rank = comms.all_gather_sizes(x.shape[0], self.reduce_group, x.device)
        self.token_view = self.to_token_view(x)                          # [T_all, H]
        if self.input_sharded:                                           # no grad: integer ids
            slot_ids = comms.all_gather_into(slot_ids, self.reduce_group, sizes=self._tokens_per_rank)
        weights = self.to_token_view(weights)                            # [T_all, K]
        local_slot_ids = slot_ids - self.first_local_slot
        local_slot_ids = local_slot_ids.masked_fill(
            (slot_ids < 0) | (local_slot_ids < 0) | (local_slot_ids >= self.slots_per_rank), -1)
        expert_input, tokens_per_slot, self._permutation = permute_by_slot(
            self.token_view, local_slot_ids, self.slots_per_rank)
        self._weights = weights
        return expert_input, tokens_per_slot

    def combine(self, expert_output, shared_output=None):
        out = unpermute_and_combine(expert_output, self._weights, self._permutation)  # [T_all, H]
        if shared_output is not None:
            out = out + shared_output
        self._permutation = self._weights = self.token_view = None
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

    def __init__(self, num_slots: int, *, ep_group: ProcessGroup | None = None,
                 etp_group: ProcessGroup | None = None, input_sharded: bool = False):
        super().__init__(num_slots, ep_group)
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

    def overlaps_dispatch(self) -> bool:
        """Whether :meth:`dispatch` can leave its exchange in flight (``overlap=True``): EP > 1."""
        return self.ep_size > 1

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
            # dominates small batches, e.g. decoding).
            expert_input, tokens_per_slot, self._permutation = permute_by_slot(
                self.token_view, slot_ids, self.slots_per_rank)
            self._recv_weights, self._send_token = weights, None
            return expert_input, tokens_per_slot
        dest_rank = torch.where(slot_ids >= 0, torch.div(slot_ids, self.slots_per_rank, rounding_mode="floor"),
                                torch.full_like(slot_ids, -1))
        # Deduplicate per destination: token t goes to rank r once, carrying the local slot ids (and
        # routing weights) of all its pairs on r; -1 pads pairs that live elsewhere.
        sends = torch.zeros(self.ep_size, num_tokens, dtype=torch.bool, device=x.device)
        valid = dest_rank >= 0
        sends[dest_rank[valid], torch.nonzero(valid, as_tuple=True)[0]] = True
        send_rank, send_token = torch.nonzero(sends, as_tuple=True)       # sorted by rank, then token
        # index_add_ rather than bincount: no device sync for the output size (and a meta kernel).
        send_counts = torch.zeros(self.ep_size, dtype=torch.int64, device=x.device).index_add_(
            0, send_rank, torch.ones_like(send_rank))
        pair_dest = dest_rank[send_token]                                  # [n_send, K]
        on_dest = pair_dest == send_rank.unsqueeze(1)
        send_local_slots = torch.where(on_dest, slot_ids[send_token] - send_rank.unsqueeze(1) * self.slots_per_rank,
                                       torch.full_like(pair_dest, -1))
        send_weights = weights[send_token] * on_dest                       # [n_send, K]

        recv_counts = comms.all_to_all_counts(send_counts, self.ep_group)
        # The one host read of the exchange: the split sizes, which size the receive buffers. A meta
        # dry run sends every token to every rank (see megamoe.host_values).
        counts = host_ints(torch.cat([send_counts, recv_counts]), on_meta=[num_tokens] * (2 * self.ep_size))
        self._send_splits, self._recv_splits = counts[:self.ep_size], counts[self.ep_size:]
        self._send_token, self._num_tokens = send_token, num_tokens
        if not overlap:
            recv_tokens = comms.all_to_all(self.token_view[send_token], self._recv_splits, self._send_splits,
                                           self.ep_group, tag="moe_dispatch")
            recv_local_slots = _all_to_all_no_grad(send_local_slots, self._recv_splits, self._send_splits,
                                                   self.ep_group, tag="moe_dispatch")
            recv_weights = comms.all_to_all(send_weights, self._recv_splits, self._send_splits, self.ep_group,
                                            tag="moe_dispatch")
            return self._permute_received(recv_tokens, recv_local_slots, recv_weights)
        # Started in the order the blocking path runs them (one process group: they complete in order).
        tokens = comms.all_to_all_start(self.token_view[send_token], self._recv_splits, self._send_splits,
                                        self.ep_group, tag="moe_dispatch")
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

    def _permute_received(self, recv_tokens, recv_local_slots, recv_weights):
        expert_input, tokens_per_slot, self._permutation = permute_by_slot(
            recv_tokens, recv_local_slots, self.slots_per_rank)
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
            out = torch.zeros(self._num_tokens, returned.shape[-1], dtype=returned.dtype, device=returned.device)
            out = out.index_add(0, self._send_token, returned)
        if shared_output is not None:
            out = out + shared_output
        self._permutation = self._recv_weights = self.token_view = self._send_token = None
        if self.input_sharded:
            return comms.reduce_scatter_to_sequence_parallel_region(out, self.reduce_group)
        return comms.reduce_from_tensor_parallel_region(out, self.reduce_group)


def _all_to_all_no_grad(x, output_splits, input_splits, group, tag=None):
    with torch.no_grad():
        return comms.all_to_all(x, output_splits, input_splits, group, tag=tag)
