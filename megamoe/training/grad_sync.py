"""Gradient synchronisation and clipping across every parallel dimension.

Loss convention: each data-parallel rank back-propagates the mean loss of its own micro-batches;
the global loss is the mean over DP ranks. After :meth:`GradientSync.sync` every rank holds the
gradient of that global loss for its local parameters:

- parameters tagged ``sequence_parallel`` (replicated over TP but fed only this rank's tokens under
  sequence parallelism: norms, row-parallel biases, MLA's down projections, routers, shared-expert
  gates and shared experts not sharded over the TP group; see :mod:`megamoe.models.sequence_parallel`):
  summed over TP;
- dense parameters: averaged over DP x CP (``state.dp_cp``);
- expert parameters (tagged ``expert_parallel``): summed over expert-DP, then divided by the DP x
  CP size times ``expert_token_replicas``. (Each expert already saw the tokens of every DP rank in
  its EP group, so only the edp replicas are missing from its sum, and the global mean divides by
  the number of DP ranks; edp ranks that computed the same tokens, see
  :func:`megamoe.models.gpt_moe.expert_token_replicas`, are counted once.)
- replicas of one expert in several slots: summed across their slots (``MoELayer.reduce_replica_grads``);
- tied embedding / output weights on the first and last pipeline stages: summed over the
  embedding group.

The TP, tied and replica sums are one coalesced all-reduce per (group, dtype). The DP x CP and
expert-DP reductions are one all-reduce per gradient bucket (:mod:`megamoe.training.grad_buckets`: at most
``bucket_numel`` elements, per group, dtype and model chunk, in reverse registration order), scaled after
the sum. With ``overlap=True`` the buckets' all-reduces start asynchronously from backward hooks during the
last micro-batch's backward (:meth:`GradientSync.on_last_backward`, called by the schedule), and
:meth:`GradientSync.sync` waits for them; parameters whose DP reduction must follow the TP or tied sum
(``sequence_parallel`` ones under TP > 1, tied embeddings) are in deferred buckets reduced in ``sync`` after
it. Overlap on or off, the same buckets are reduced on the same buffers: identical results. With
``data_parallel=False`` (the distributed optimizer, :mod:`megamoe.training.distributed_optimizer`) the DP x CP
and expert-DP all-reduces are left out (the optimizer reduce-scatters them) and the replica sum comes first.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megamoe import comms
from megamoe.gradients import gradients, main_grad
from megamoe.host_values import host_floats
from megamoe.moe.moe_layer import MoELayer
from megamoe.sharding import get_shard_spec
from megamoe.training.grad_buckets import (GradReadiness, deferred_parameters, grad_bucket_numel, parameter_chunks,
                                           plan_buckets)

__all__ = ["GradientSync", "clip_grad_norm_", "global_grad_norm", "global_param_norm"]


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    """Sum ``grads`` (those that exist) over ``group``: one flat all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        comms.all_reduce_coalesced_(same, group)


class GradientSync:
    """Reduce the gradients of ``model`` (this rank's pipeline stage) for the layout ``state``.

    ``tied_params``: parameters shared by the first and last pipeline stage (tied input embedding
    and output layer); their gradients are summed over the embedding group. ``bucket_numel``: the most
    gradient elements of one DP all-reduce bucket (default: 40 MB of fp32). ``overlap``: start the buckets'
    all-reduces from backward hooks (see the module docstring; the schedule must be given
    :meth:`on_last_backward`).
    """

    def __init__(self, model: nn.Module, state, *, tied_params: tuple[nn.Parameter, ...] = (),
                 expert_token_replicas: int = 1, data_parallel: bool = True, bucket_numel: int | None = None,
                 overlap: bool = False):
        self.state = state
        # False under the distributed optimizer: it reduce-scatters the dense and expert gradients itself
        # (megamoe.training.distributed_optimizer); this sync then does only the sums that must come first.
        self.data_parallel = data_parallel
        self.expert_scale = 1.0 / (state.dp_cp.size * expert_token_replicas)
        params = [p for p in model.parameters() if p.requires_grad]
        self.expert_params = [p for p in params if getattr(p, "expert_parallel", False)]
        self.dense_params = [p for p in params if not getattr(p, "expert_parallel", False)]
        self.sequence_parallel_params = [p for p in self.dense_params if getattr(p, "sequence_parallel", False)]
        self.moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        self.tied_params = tuple(tied_params)
        self.overlap = bool(overlap) and data_parallel
        self._buckets: list[list[nn.Parameter]] = []
        self._bucket_groups: list[tuple] = []       # (group, scale) per bucket
        self._handles: dict[int, tuple[comms.CommHandle | None, list[nn.Parameter]]] = {}   # launched buckets
        self._readiness: GradReadiness | None = None
        if data_parallel:
            self._plan(params, grad_bucket_numel(40.0) if bucket_numel is None else bucket_numel, model)

    def _plan(self, params: list[nn.Parameter], bucket_numel: int, model: nn.Module) -> None:
        state = self.state
        chunks = parameter_chunks(model)
        # The DP reduction of these must follow a sum over another group (TP, the embedding group). The replica
        # sum comes after the DP reduction here, so replicated experts overlap like any other.
        deferred = deferred_parameters(model, state, self.tied_params, replicated_experts=False)

        def key(p):
            expert = bool(getattr(p, "expert_parallel", False))
            return (expert, p.dtype, chunks.get(id(p), 0), id(p) in deferred)
        plan = plan_buckets(params, key, lambda p: p.numel(), bucket_numel)
        dense = (state.dp_cp.group, 1.0 / state.dp_cp.size)
        expert = (state.edp.group, self.expert_scale)
        self._buckets = [b.params for b in plan]
        self._bucket_groups = [expert if b.key[0] else dense for b in plan]
        self._deferred = [b.key[3] for b in plan]
        self._readiness = GradReadiness(self._buckets, [b.key[2] for b in plan],
                                        # one launch order per process group (dense and expert may share one)
                                        [id(group) for group, _ in self._bucket_groups], self._deferred,
                                        self._launch, hooks=self.overlap)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def num_deferred_buckets(self) -> int:
        return sum(self._deferred) if self._buckets else 0

    def on_last_backward(self, chunk: int) -> None:
        """The schedule's hook: the last backward of ``chunk`` starts (its buckets may launch from now)."""
        if self._readiness is not None:
            self._readiness.arm(chunk)

    def discard_pending(self) -> None:
        """Forget a step that did not reach :meth:`sync` (an error mid-backward): wait for the all-reduces it
        started and disarm the hooks."""
        for handle, _ in self._handles.values():
            if handle is not None:
                handle.wait()
        self._handles.clear()
        if self._readiness is not None:
            self._readiness.reset()

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        """Start bucket ``i``'s all-reduce on a flat copy of its gradients (those that exist)."""
        group, _ = self._bucket_groups[i]
        params = [p for p in self._buckets[i] if main_grad(p) is not None]
        if not params:
            return
        if comms.group_size(group) == 1:          # nothing to reduce: only the scale, in place, at the end
            self._handles[i] = (None, params)
            return
        flat = torch.cat([main_grad(p).reshape(-1) for p in params])
        self._handles[i] = (comms.all_reduce_async(flat, group, tag="grad_bucket"), params)
        if not self.overlap:
            # Nothing to overlap with: finish it before the next one, so one flat copy is alive at a time.
            self._complete(i)

    @torch.no_grad()
    def _complete(self, i: int) -> None:
        """Wait for bucket ``i``, scale it and copy it back into the gradients."""
        entry = self._handles.pop(i, None)
        if entry is None:
            return
        handle, params = entry
        _, scale = self._bucket_groups[i]
        if handle is None:
            if scale != 1.0:
                for p in params:
                    main_grad(p).mul_(scale)
            return
        flat = handle.wait()
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for p in params:
            g = main_grad(p)
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def sync(self) -> None:
        state = self.state
        if self.data_parallel:
            # Every bucket not launched from a hook starts now (all of them without overlap), in bucket order.
            self._readiness.finish()
            for i in sorted(self._handles):
                self._complete(i)
        _all_reduce_coalesced(gradients(self.sequence_parallel_params), state.tp.group)
        if state.embedding is not None and self.tied_params:
            _all_reduce_coalesced(gradients(self.tied_params), state.embedding.group)
        if not self.data_parallel:
            # The replica sum (a sum over slots, on this rank and across EP) before the optimizer's shard
            # reduction: every replica slot then holds the same summed gradient and gets the same update.
            for layer in self.moe_layers:
                layer.reduce_replica_grads()
            return
        # The deferred buckets (after the TP and tied sums), blocking, in bucket order.
        for i, deferred in enumerate(self._deferred):
            if deferred:
                self._launch(i)
                self._complete(i)
        for layer in self.moe_layers:
            layer.reduce_replica_grads()


def _replication(param: nn.Parameter, state, tied: bool) -> float:
    """How many ranks hold an identical copy of this parameter's gradient."""
    if getattr(param, "expert_parallel", False):
        # A tensor every ETP rank holds whole (gpt-oss's expert down bias) is copied over ETP as well; LoRA's
        # expert adapters (megamoe.moe.experts.lora_experts) are whole on every EP rank.
        return float(state.edp.size * (state.etp.size if getattr(param, "etp_replicated", False) else 1)
                     * (state.ep.size if getattr(param, "ep_replicated", False) else 1))
    copies = state.dp_cp.size
    if get_shard_spec(param).count == 1:
        copies *= state.tp.size           # not split: replicated over TP
    if tied and state.pp.size > 1:
        copies *= 2                       # first and last stage
    return float(copies)


@torch.no_grad()
def global_grad_norm(model: nn.Module, state, world_group, *, tied_params=()) -> float:
    """L2 norm of the gradient of the whole (unsharded, deduplicated) model, identical on every rank.

    Each rank sums the squares of its local gradients, weighting every value by 1 / (number of
    ranks holding the same value): DP replicas, TP-replicated parameters, tied copies, and expert
    replicas (several slots of one expert). One all-reduce over the world.
    """
    return _global_norm(model, state, world_group, tied_params=tied_params, grad=True)


@torch.no_grad()
def global_param_norm(model: nn.Module, state, world_group, *, tied_params=()) -> float:
    """L2 norm of the parameters of the whole (unsharded, deduplicated) model, identical on every rank:
    :func:`global_grad_norm` of the weights themselves (e.g. to tell a diverged run by its weights)."""
    return _global_norm(model, state, world_group, tied_params=tied_params, grad=False)


def _global_norm(model: nn.Module, state, world_group, *, tied_params, grad: bool) -> float:
    tied_ids = {id(p) for p in tied_params}
    params = [p for p in model.parameters() if main_grad(p) is not None] if grad else list(model.parameters())
    # Per-tensor norms in the tensors' dtype (one fused kernel), squared and weighted in float64.
    norms = torch._foreach_norm(gradients(params) if grad else [p.detach() for p in params]) if params else []
    device = params[0].device if params else next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param, norm in zip(params, norms):
        weight = 1.0 / _replication(param, state, id(param) in tied_ids)
        total += norm.double().pow(2) * weight
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        # Slots holding a replicated expert: their squares were counted once per replica.
        counts = layer.local_replica_counts().double()
        slot_weight = layer.experts.slot_parameters(0)[0][0]
        if bool((counts > 1).any()) and (slot_weight.requires_grad or not grad):     # (a LoRA run's base: frozen)
            extra = torch.zeros((), dtype=torch.float64, device=device)
            for local_slot, count in enumerate(counts.tolist()):
                if count > 1:
                    shards = layer.experts.expert_weight_shards(local_slot, grad=grad)
                    sq = sum(g.double().pow(2).sum() / (state.etp.size if name == "down_bias" else 1)
                             for name, g in shards.items())
                    extra += sq * (1.0 / count - 1.0)
            total += extra / state.edp.size
    comms.all_reduce_(total, world_group)
    total, = host_floats(total)       # the step's one host read of the norm (NaN on the meta device)
    return math.sqrt(max(total, 0.0))


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, state, world_group, *, tied_params=()) -> float:
    """Scale all gradients so the global norm is at most ``max_norm``; returns the norm before clipping."""
    norm = global_grad_norm(model, state, world_group, tied_params=tied_params)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in gradients(model.parameters()):
            grad.mul_(scale)
    return norm
