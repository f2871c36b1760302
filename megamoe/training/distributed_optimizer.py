"""The distributed optimizer (ZeRO-1 / ZeRO-2): AdamW whose state is sharded over data-parallel ranks.

Layout. Every parameter is sharded on its own. A parameter is viewed as ``[S, n]``: ``S`` = its number of
expert slots for a stacked expert parameter ``[S, ...]`` (each slot row sharded separately), 1 for everything
else. ``n`` is padded to ``n_pad``, a multiple of its group's size ``N``, and rank ``r`` of the group owns
columns ``[r * c, (r + 1) * c)`` of every row, ``c = n_pad / N``: its state tensors are ``[S, c]``. Dense
parameters are sharded over DP x CP (``state.dp_cp``), expert parameters (tagged ``expert_parallel``) over
expert-DP (``state.edp``). Slot ``k``'s state therefore sits on the same edp rank in every EP rank, so an
expert migration (:mod:`megamoe.moe.placement.expert_migration`, an exchange over the EP group between ranks of one edp
index) moves a slot's shard rows exactly like a stacked parameter's rows (:meth:`slot_state_views`).

Buckets. Parameters of one (group, dtype, model chunk, deferred or not) are packed, in reverse registration
order, into buckets of at most ``bucket_numel`` padded elements (:func:`~megamoe.training.grad_buckets.plan_buckets`;
the Trainer's ``TrainConfig.grad_bucket_mb``), laid out ``[N, shard_numel]``: rank ``r``'s pieces of every
parameter of the bucket are contiguous (parameter after parameter, each ``[S, c]``), so one
:func:`~megamoe.comms.reduce_scatter_flat` per bucket leaves rank ``r`` the sum of exactly its pieces, and one
:func:`~megamoe.comms.all_gather_flat` of the updated pieces rebuilds every parameter. The bound keeps the
transient buffer of a big model small.

Overlap (``overlap=True``, ``TrainConfig.overlap_grad_reduce``): each bucket's reduce-scatter starts
asynchronously from backward hooks as soon as its gradients are final in the last micro-batch's backward
(:meth:`on_last_backward`, called by the schedule; :mod:`megamoe.training.grad_buckets`), and
:meth:`reduce_gradients` launches the rest and waits for all of them. Deferred buckets, whose parameters need a
sum first (``sequence_parallel`` parameters under TP > 1, tied embeddings, the experts of a layer with replica
slots), are launched in :meth:`reduce_gradients`, after GradientSync did those sums. Overlap on or off, the same
buckets are reduced from the same buffers: identical results. Memory: an overlapped bucket's [N, shard_numel]
buffer lives from its launch to its wait in :meth:`reduce_gradients` (so up to one fp32 copy of this rank's
gradients at the end of the backward, on top of ZeRO-2's); without overlap one bucket's at a time, as before.

Gradient reduction (the order of :mod:`megamoe.training.grad_sync`): :class:`GradientSync` built with
``data_parallel=False`` first sums sequence-parallel grads over TP, tied embedding grads over the embedding
group and the expert replicas across their slots (``MoELayer.reduce_replica_grads``: every replica slot then
holds the same summed gradient; with the same starting state, each gets the same update). Then
:meth:`reduce_gradients` reduce-scatters each bucket and scales it: dense by 1 / |dp_cp| (the mean over DP
ranks), experts by GradientSync's ``expert_scale`` (1 / (|dp_cp| x expert token replicas)). The reduction
runs in fp32 whatever the parameters' dtype. ZeRO-1 leaves the accumulated gradient as it was (``p.grad``,
or ``p.main_grad`` below: this rank's own, TP / tied / replica-summed but not DP-reduced contribution; the
reduced values live only in the shards) until the next :meth:`zero_grad`; ZeRO-2 frees it right after the
reduce-scatter (``p.grad = None``, and the fp32 buffer below). Either way the reduced shards
(:meth:`gradient_shards`) live until the step.

fp32 gradient accumulation (non-fp32 parameters). Every bucket of bf16 / fp16 parameters owns one fp32 gradient
buffer laid out parameter after parameter (allocated, zeroed, at the first gradient of a step), and each of its
parameters gets ``p.main_grad``: a view of its slice, shaped like the parameter. A hook
(``register_post_accumulate_grad_hook``) adds each micro-batch's gradient, as autograd leaves it in ``p.grad``
(the parameter dtype), into ``p.main_grad`` and sets ``p.grad = None``: the sum over micro-batches is rounded in
fp32, not bf16 (as Megatron's ``main_grad`` with ``--accumulate-allreduce-grads-in-fp32``), and a bf16 gradient
lives only during one micro-batch's backward. (One such optimizer per model at a time: its hooks take the
gradients; they hold it weakly, so a dropped optimizer stops taking them.) Everything downstream (GradientSync's
TP, tied and replica sums, :meth:`reduce_gradients`, the norm, clipping, the fp16 unscale, the non-finite
search) reads :func:`megamoe.gradients.main_grad`, and so works in fp32 on those parameters; fp32 parameters
keep their ``p.grad``, untouched. With groups of one rank (``shard=False``, or a group of size 1) the buffer
already has the bucket's layout, so it IS the reduced shard: no copy, no second buffer. Larger groups copy it
into the reduce-scatter buffer as they copy ``p.grad`` for fp32 parameters (that buffer puts rank ``r``'s
columns of every parameter together, so a parameter's gradient is not a view of the parameter's shape there,
which the TP / tied / replica sums need). Per rank at the step, a non-fp32 parameter of ``n`` elements holds:
ZeRO-1, the fp32 buffer (``4 n`` bytes) plus its reduced shard (``4 n / N``; the shard is the buffer when
``N = 1``); ZeRO-2, the shard only. :meth:`zero_grad` frees the buffer (``set_to_none=False``: zeroes it).

Master weights. fp32 parameters ARE the master: the step copies the owned shard out into the bucket's
all-gather buffer, updates it there, and gathers; persistent state is the two fp32 moments only (8 bytes
per parameter / N) plus Adam's step count. Other dtypes (bf16, fp16) keep a persistent fp32 ``master``
shard, updated and then gathered in the model's dtype. Gradients of such parameters accumulate over
micro-batches in fp32 (above).

``shard=False`` (what the Trainer builds for bf16 parameters without ``distributed_optimizer``): groups of
one rank, so ``N = 1``; GradientSync then does its usual DP all-reduces (in fp32, on ``p.main_grad``) and
:meth:`reduce_gradients` takes the fp32 buffers as the shards (no communication, no copy).

The norm (:meth:`clip_grad_norm_`) is computed on the shards: each element of a sharded parameter is held by
one rank of its group, so only the remaining replication counts (TP-replicated parameters, tied copies on
two stages, expert replicas in several slots, and the DP replicas of an unsharded optimizer), as in
:func:`~megamoe.training.grad_sync.global_grad_norm`; it equals the plain norm.

Checkpoints (:mod:`megamoe.training.checkpoint`) store LOGICAL state, the plain optimizer's, moved between the
shards and the files bucket by bucket through host memory, so that the device never holds a full-shape copy
(the 12 bytes per parameter of master and moments that ZeRO exists to spread). Saving, :meth:`logical_state`:
each bucket's state is gathered over its group one state key at a time (the device holds that one gathered
buffer, then drops it) and its writer, rank ``i % N`` of the group for bucket ``i`` (so the writes and their
host memory spread over the group), copies it out parameter by parameter into host buffers
(:func:`megamoe.host_staging.host_buffer`) as full-shape tensors; the others write none of it (they hold
the same values). Loading, :meth:`logical_state_buckets`: each bucket's full-shape tensors are made in host
buffers and only their dim-0 slices holding this rank's columns are read from the files
(:meth:`owned_chunks`: about 1/N of the state per rank), then :meth:`load_logical_state` copies those
columns into its shards before the next bucket is read. The fp32 master weights are saved AS the model's
weights (the checkpoint's parameter tensors hold the master in fp32, not the rounded bf16 copy), so there
is no separate ``master`` key: a plain fp32 run resuming loads the master as its weights, and a bf16 run
resuming from any checkpoint takes its master from the stored weights (its columns, as the moments) and
its parameters from the same weights, rounded on read (:meth:`master_parameters`: the parameters whose
weights are written from the master, by the bucket's writer only).

Parameters without a gradient on a step are treated as having a zero gradient (unlike torch's AdamW, which
skips them): the models here give every trainable parameter a gradient on every step.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref

import torch
from torch.optim.adam import adam as _adam
from torch import nn

from megamoe import comms
from megamoe.gradients import main_grad
from megamoe.host_values import host_floats
from megamoe.moe.moe_layer import MoELayer
from megamoe.training.grad_buckets import (GradReadiness, deferred_parameters, grad_bucket_numel, parameter_chunks,
                                           plan_buckets)
from megamoe.training.grad_sync import _replication
from megamoe.training.optimizer_state_checkpoint import ShardedStateCheckpointing
from megamoe.training.optimizer_shards import ShardBucket, ShardEntry, ShardGroup, stacked_slot_rows

__all__ = ["DistributedOptimizer", "DEFAULT_BUCKET_NUMEL"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_NUMEL = 40_000_000     # padded elements per reduce-scatter bucket


def _provide_main_grad(optimizer_ref, param: nn.Parameter) -> torch.Tensor | None:
    """``param.main_grad_provider`` (:func:`megamoe.gradients.main_grad_target`): the fp32 ``main_grad`` the live
    optimizer accumulates ``param`` in (allocated on first use); None once it is gone or does not hold ``param``
    (a copy of the model)."""
    optimizer = optimizer_ref()
    if optimizer is None or param not in optimizer._entries:
        return None
    return optimizer._main_grad_of(param)


class DistributedOptimizer(ShardedStateCheckpointing, torch.optim.Optimizer):
    """AdamW (the hyper-parameters and weight-decay rule of ``build_optimizer``: decay on matrices only)
    with its state sharded (see the module docstring).

    ``model``: one pipeline stage; ``state``: its ParallelState. ``shard=False``: groups of one rank
    (fp32 master weights for non-fp32 parameters, no sharding). ``zero_stage`` 1 or 2. ``bucket_numel``:
    the most padded elements of one reduce-scatter bucket (a parameter bigger than that gets a bucket of
    its own). ``tied_params`` and ``expert_token_replicas`` as for
    :class:`~megamoe.training.grad_sync.GradientSync`. ``state[param]`` holds this rank's shard tensors
    ``exp_avg``, ``exp_avg_sq``, ``master`` (non-fp32 parameters), each [S, ceil(n / N)], and ``step``.

    Per step the Trainer calls :meth:`reduce_gradients` (after GradientSync), :meth:`clip_grad_norm_`, then
    :meth:`step` (the update and the all-gather of the parameters).
    """

    def __init__(self, model: nn.Module, state, *, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, shard: bool = True, zero_stage: int = 1,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, tied_params=(), expert_token_replicas: int = 1,
                 overlap: bool = False):
        if zero_stage not in (1, 2):
            raise ValueError(f"DistributedOptimizer zero_stage must be 1 or 2, got {zero_stage!r}")
        if not (isinstance(bucket_numel, int) and bucket_numel >= 1):
            raise ValueError(f"DistributedOptimizer bucket_numel must be an int >= 1, got {bucket_numel!r}")
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        super().__init__([g for g in groups if g["params"]],
                         dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.model, self.parallel_state, self.shard, self.zero_stage = model, state, shard, zero_stage
        self.tied_ids = {id(p) for p in tied_params}
        self.dense_scale = 1.0 / state.dp_cp.size if shard else 1.0
        self.expert_scale = 1.0 / (state.dp_cp.size * expert_token_replicas) if shard else 1.0
        solo = ShardGroup(None, 1, 0)
        dense = ShardGroup(state.dp_cp.group, state.dp_cp.size, state.dp_cp.rank) if shard else solo
        expert = ShardGroup(state.edp.group, state.edp.size, state.edp.rank) if shard else solo
        stacked = stacked_slot_rows(model)
        self.device = params[0].device
        self._entries: dict[nn.Parameter, ShardEntry] = {}
        self._buckets: list[ShardBucket] = []
        entries: dict[int, ShardEntry] = {}
        for p in params:
            if not p.is_contiguous():
                raise ValueError(f"DistributedOptimizer needs contiguous parameters; one of shape {tuple(p.shape)} "
                                 "is not (its shards are column ranges of its flat view)")
            is_expert = bool(getattr(p, "expert_parallel", False))
            group = expert if is_expert else dense
            rows = stacked.get(id(p), 1) if p.numel() else 1
            row_numel = p.numel() // rows
            entries[id(p)] = ShardEntry(p, rows, row_numel, math.ceil(row_numel / group.size), group.rank, is_expert)
        deferred = deferred_parameters(model, state, tied_params, replicated_experts=True)
        chunks = parameter_chunks(model)

        def key(p):
            return (entries[id(p)].expert, p.dtype, chunks.get(id(p), 0), id(p) in deferred)

        def size(p):
            e = entries[id(p)]
            return e.numel * (expert if e.expert else dense).size
        plan = plan_buckets(params, key, size, bucket_numel)
        for index, planned in enumerate(plan):
            is_expert = planned.key[0]
            bucket = ShardBucket(expert if is_expert else dense, planned.key[1], is_expert)
            bucket.chunk, bucket.deferred = planned.key[2], planned.key[3]
            for p in planned.params:
                entry = entries[id(p)]
                entry.bucket, entry.offset = index, bucket.shard_numel
                bucket.entries.append(entry)
                bucket.shard_numel += entry.numel
            self._buckets.append(bucket)
        # Registration order (the checkpoint's and the non-finite search's), whatever the bucket order.
        for p in params:
            self._entries[p] = entries[id(p)]
        # fp32 gradient accumulation for non-fp32 parameters (see the module docstring). The hook holds the
        # optimizer weakly: an optimizer dropped for a new one stops taking the parameters' gradients.
        self._hooks = []
        this = weakref.ref(self)

        def accumulate(param: nn.Parameter) -> None:
            optimizer = this()
            if optimizer is not None:
                optimizer._accumulate(param)
        for bucket in self._buckets:
            if bucket.dtype == torch.float32:
                continue
            bucket.accumulate_fp32 = True
            for e in bucket.entries:
                e.grad_offset = bucket.grad_numel
                bucket.grad_numel += e.param.numel()
                self._hooks.append(e.param.register_post_accumulate_grad_hook(accumulate))
                e.param.main_grad_provider = functools.partial(_provide_main_grad, this, e.param)
        # Overlapped reduce-scatters (see the module docstring): hooks registered after the accumulation hooks
        # above, so a bf16 parameter's main_grad holds its gradient when the parameter is marked ready.
        self.overlap = bool(overlap)
        self._handles: dict[int, comms.CommHandle] = {}
        self._readiness = GradReadiness([[e.param for e in b.entries] for b in self._buckets],
                                        [b.chunk for b in self._buckets],
                                        [id(b.group.group) for b in self._buckets],
                                        [b.deferred for b in self._buckets], self._launch_bucket,
                                        hooks=self.overlap and shard)
        # torch's fused AdamW kernel where it exists (as build_optimizer), else the single-tensor loop.
        self._fused = self.device.type in ("cpu", "cuda")
        self._names = {id(p): name for name, p in model.named_parameters()}
        logger.info("distributed optimizer (ZeRO-%d%s): %d parameters in %d buckets (%d deferred)%s, dense over %d "
                    "ranks, experts over %d; %s", zero_stage, "" if shard else ", unsharded", len(params),
                    len(self._buckets), sum(b.deferred for b in self._buckets),
                    ", reduce-scatters overlapped with the backward" if self.overlap and shard else "",
                    dense.size, expert.size, "fp32 master weights and gradient accumulation"
                    if any(p.dtype != torch.float32 for p in params) else "the fp32 parameters are the master weights")

    @classmethod
    def from_config(cls, model: nn.Module, state, config, *, shard: bool, tied_params=(),
                    expert_token_replicas: int = 1, bucket_numel: int | None = None):
        """From a :class:`~megamoe.training.trainer.TrainConfig` (lr, betas, eps, weight_decay, zero_stage,
        overlap_grad_reduce; ``bucket_numel`` default: grad_bucket_mb of fp32 gradient)."""
        if bucket_numel is None:
            bucket_numel = grad_bucket_numel(config.grad_bucket_mb)
        return cls(model, state, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
                   shard=shard, zero_stage=config.zero_stage, bucket_numel=bucket_numel, tied_params=tied_params,
                   expert_token_replicas=expert_token_replicas, overlap=config.overlap_grad_reduce)

    def on_last_backward(self, chunk: int) -> None:
        """The schedule's hook: the last backward of ``chunk`` starts (its buckets may launch from now)."""
        self._readiness.arm(chunk)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def num_deferred_buckets(self) -> int:
        return sum(b.deferred for b in self._buckets)

    def discard_pending(self) -> None:
        """Forget a step that did not reach :meth:`reduce_gradients` (an error mid-backward): wait for the
        reduce-scatters it started and disarm the hooks."""
        for handle in self._handles.values():
            handle.wait()
        self._handles.clear()
        self._readiness.reset()

    # ---- state ---------------------------------------------------------------------------------
    def _state_of(self, entry: ShardEntry) -> dict:
        """This parameter's state, created on first use (zeros, step 0; the master from the parameter)."""
        s = self.state[entry.param]
        if not s:
            shape = (entry.rows, entry.cols)
            p = entry.param
            s["exp_avg"] = torch.zeros(shape, dtype=torch.float32, device=self.device)
            s["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=self.device)
            if p.dtype != torch.float32:
                master = torch.zeros(shape, dtype=torch.float32, device=self.device)
                master[:, :entry.valid].copy_(entry.owned(p.detach()))
                s["master"] = master
            # As torch's AdamW: the fused kernel wants the step on the device; the single-tensor loop reads
            # it on the host (a 0-dim CPU scalar, the meta device's case).
            s["step"] = (torch.zeros((), dtype=torch.float32, device=self.device) if self._fused
                         else torch.tensor(0.0, dtype=torch.float32))
        return s

    def materialize_state(self) -> None:
        """Create every parameter's state (zeros, step 0) without a step: what a checkpoint loads into."""
        for entry in self._entries.values():
            self._state_of(entry)

    # ---- gradients -----------------------------------------------------------------------------
    @torch.no_grad()
    def _accumulate(self, param: nn.Parameter) -> None:
        """The post-accumulate-grad hook of a non-fp32 parameter: add this micro-batch's ``p.grad`` into its
        fp32 ``p.main_grad`` (the bucket's buffer, allocated zeroed on the step's first gradient), then free
        ``p.grad``, so the next micro-batch's gradient starts afresh instead of adding into it in bf16. (None
        where the backward added the gradient into ``main_grad`` itself: :func:`megamoe.gradients.main_grad_target`.)"""
        grad = param.grad
        if grad is None:
            return
        self._main_grad_of(param).add_(grad)
        param.grad = None

    def _main_grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """``param.main_grad``, with its bucket's fp32 buffer allocated zeroed on the step's first use."""
        bucket = self._buckets[self._entries[param].bucket]
        if bucket.main_grad is None:
            bucket.main_grad = torch.zeros(bucket.grad_numel, dtype=torch.float32, device=self.device)
            for e in bucket.entries:
                e.param.main_grad = bucket.main_grad[e.grad_offset:e.grad_offset + e.param.numel()].view(
                    e.param.shape)
        return param.main_grad

    def _free_main_grads(self, bucket: ShardBucket) -> None:
        bucket.main_grad = None
        for e in bucket.entries:
            e.param.main_grad = None

    @torch.no_grad()
    def _launch_bucket(self, index: int) -> None:
        """Copy bucket ``index``'s gradients into its [N, shard_numel] buffer and start its reduce-scatter."""
        bucket = self._buckets[index]
        size = bucket.group.size
        if bucket.main_grad is not None and size == 1:
            # One rank: the fp32 accumulation buffer has the bucket's layout (each parameter whole, in
            # order), so it is the flat buffer and, reduced over nobody, the shard.
            flat = bucket.main_grad
        else:
            flat = torch.zeros(size * bucket.shard_numel, dtype=torch.float32, device=self.device)
        chunks = flat.view(size, bucket.shard_numel)
        for e in bucket.entries:
            grad = main_grad(e.param)
            if flat is bucket.main_grad or grad is None or not e.numel:
                continue
            rows = grad.reshape(e.rows, e.row_numel)
            if size * e.cols != e.row_numel:
                rows = torch.nn.functional.pad(rows, (0, size * e.cols - e.row_numel))
            # [N, S, c] view of the bucket <- [S, N, c] of the padded gradient: rank r's columns land
            # in rank r's chunk.
            chunks[:, e.offset:e.offset + e.numel].view(size, e.rows, e.cols).copy_(
                rows.view(e.rows, size, e.cols).transpose(0, 1))
        self._handles[index] = comms.reduce_scatter_flat_async(flat, bucket.group.group, tag="grad_bucket")
        if bucket.deferred or not (self.overlap and self.shard):
            # Nothing to overlap with (launched at the end): finish it before the next one, so one flat buffer
            # is alive at a time, as without overlap. Overlapped buckets keep theirs until the wait.
            self._complete_bucket(index)

    @torch.no_grad()
    def _complete_bucket(self, index: int) -> None:
        """Wait for bucket ``index``'s reduce-scatter, scale the shard; ZeRO-2: free the full gradients."""
        bucket = self._buckets[index]
        shard = self._handles.pop(index).wait()
        scale = self.expert_scale if bucket.expert else self.dense_scale
        if scale != 1.0:
            shard.mul_(scale)
        bucket.grad_shard = shard
        if self.zero_stage == 2:
            for e in bucket.entries:
                e.param.grad = None
            self._free_main_grads(bucket)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the gradients into this rank's fp32 shards (one collective per bucket), scaled to
        the mean over DP (see the module docstring); ZeRO-2 then frees ``p.grad`` and the fp32 accumulation
        buffers. Call after ``GradientSync(data_parallel=False).sync()`` (sharded) or the full sync
        (``shard=False``). Buckets started during the backward (overlap) are waited for here; the others
        start here, in bucket order, the deferred ones last."""
        self._readiness.finish()
        for index, bucket in enumerate(self._buckets):
            if bucket.deferred:
                self._launch_bucket(index)
        for index in sorted(self._handles):
            self._complete_bucket(index)

    def gradient_shards(self) -> list[torch.Tensor]:
        """The reduced-gradient shard tensors this rank keeps ([shard_numel] fp32 per bucket), from
        :meth:`reduce_gradients` to the next :meth:`zero_grad`; [] when none are kept."""
        return [b.grad_shard for b in self._buckets if b.grad_shard is not None]

    def named_gradient_shards(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, its [S, c] reduced-gradient shard) in registration order (non-finite search)."""
        out = []
        for p, e in self._entries.items():
            shard = self._buckets[e.bucket].grad_shard
            if shard is not None:
                out.append((self._names.get(id(p), "?"), e.shard_of(shard)))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients, the reduced shards and the fp32 accumulation buffers (``set_to_none=False``:
        zero the gradients and buffers instead)."""
        super().zero_grad(set_to_none=set_to_none)
        for bucket in self._buckets:
            bucket.grad_shard = None
            if bucket.main_grad is not None:
                if set_to_none:
                    self._free_main_grads(bucket)
                else:
                    bucket.main_grad.zero_()

    def _row_weights(self) -> dict[int, torch.Tensor | float]:
        """id(expert param) -> weight of each slot row in the norm (1 / replicas of its expert): [S] for
        stacked parameters, a float for per-slot ones (te backend). Read from the current placements."""
        weights: dict[int, torch.Tensor | float] = {}
        for layer in (m for m in self.model.modules() if isinstance(m, MoELayer)):
            counts = layer.local_replica_counts()
            if not bool((counts > 1).any()):
                continue
            per_slot = (1.0 / counts.double()).to(self.device)
            for local_slot in range(counts.numel()):
                for param, index in layer.experts.slot_parameters(local_slot):
                    if isinstance(index, int):
                        weights[id(param)] = per_slot
                    else:
                        weights[id(param)] = 1.0 / float(counts[local_slot])
        return weights

    @torch.no_grad()
    def grad_norm(self, world_group) -> float:
        """The global L2 norm of the reduced gradients, from the shards: equal to the plain optimizer's
        :func:`~megamoe.training.grad_sync.global_grad_norm` (same weighting of replicated values; the
        sharding group's replication is gone, each element has one owner in it). One all-reduce."""
        state = self.parallel_state
        row_weights = self._row_weights()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for bucket in self._buckets:
            if bucket.grad_shard is None:
                continue
            for e in bucket.entries:
                copies = _replication(e.param, state, id(e.param) in self.tied_ids)
                copies /= (state.edp.size if e.expert else state.dp_cp.size) if self.shard else 1
                rows = e.shard_of(bucket.grad_shard).double()
                sq = (rows * rows).sum(dim=1)     # [S]: pow(2)'s values; CPU's fp64 pow (and square) is ~1.4x slower
                rows = row_weights.get(id(e.param))
                if rows is not None:
                    sq = sq * rows
                total += sq.sum() / copies
        comms.all_reduce_(total, world_group)
        total, = host_floats(total)      # the step's one host read of the norm (NaN on the meta device)
        return math.sqrt(max(total, 0.0))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, world_group) -> float:
        """Scale the gradient shards so the global norm is at most ``max_norm`` (as
        :func:`~megamoe.training.grad_sync.clip_grad_norm_`); returns the norm before clipping."""
        norm = self.grad_norm(world_group)
        if max_norm > 0 and norm > max_norm:
            shards = self.gradient_shards()
            if shards:
                torch._foreach_mul_(shards, max_norm / (norm + 1e-6))
        return norm

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on this rank's shards (with the reduced gradient shards of :meth:`reduce_gradients`; none:
        zero gradients), then one all-gather per bucket, in the parameters' dtype, copied back into them."""
        loss = closure() if closure is not None else None
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for bucket in self._buckets:
            size = bucket.group.size
            updated = torch.zeros(bucket.shard_numel, dtype=bucket.dtype, device=self.device)
            grads = (bucket.grad_shard if bucket.grad_shard is not None
                     else torch.zeros(bucket.shard_numel, dtype=torch.float32, device=self.device))
            work: dict[int, tuple[dict, list]] = {}        # param group -> (group, [targets, grads, m, v, steps])
            for e in bucket.entries:
                s = self._state_of(e)
                if "master" in s:
                    target = s["master"]
                else:     # fp32: the parameter is the master; update its owned piece in the gather buffer
                    target = e.shard_of(updated)
                    target[:, :e.valid].copy_(e.owned(e.param.detach()))
                group = group_of[id(e.param)]
                lists = work.setdefault(id(group), (group, [[], [], [], [], []]))[1]
                for lst, t in zip(lists, (target, e.shard_of(grads), s["exp_avg"], s["exp_avg_sq"], s["step"])):
                    lst.append(t)
            for group, (targets, gs, ms, vs, steps) in work.values():
                beta1, beta2 = group["betas"]
                _adam(targets, gs, ms, vs, [], steps, foreach=False, fused=self._fused or None,
                      decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                      weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            for e in bucket.entries:
                if "master" in self.state[e.param]:
                    e.shard_of(updated).copy_(self.state[e.param]["master"])
            gathered = comms.all_gather_flat(updated, bucket.group.group)
            for e in bucket.entries:
                if e.numel:
                    e.param.detach().copy_(e.full_from(gathered, size, bucket.shard_numel))
        return loss

    # ---- expert migration ----------------------------------------------------------------------
    def slot_state_views(self, param: nn.Parameter, index) -> list[torch.Tensor]:
        """This rank's state rows of one expert slot of ``param`` (``index``: the slot's row of a stacked
        parameter, or ``slice(None)`` for a per-slot one): master (if any) and moments, sorted by key; [] before
        the first step. What :func:`megamoe.moe.placement.expert_migration.migrate_layer` moves with the slot."""
        s = self.state.get(param)
        if not s:
            return []
        return [s[key][index] for key in sorted(s) if s[key].dim() > 0]

    def master_parameters(self) -> list[nn.Parameter]:
        """The parameters whose checkpointed weights are their fp32 master (non-fp32 parameters), in
        registration order."""
        return [p for p in self._entries if p.dtype != torch.float32]

    # ---- memory --------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """This rank's optimizer-state bytes (moments, masters, steps)."""
        return sum(t.nbytes for s in self.state.values() for t in s.values())
