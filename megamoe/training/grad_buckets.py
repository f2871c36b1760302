"""Gradient buckets and the backward hooks that start their reduction early (``--overlap-grad-reduce``).

Buckets. The parameters a reducer reduces are grouped into buckets of at most ``bucket_numel`` elements of
gradient (``TrainConfig.grad_bucket_mb`` MB of fp32 gradient, :func:`grad_bucket_numel`; a parameter larger
than that gets a bucket of its own), one bucket list per key: the reduction group, the dtype, the model chunk
(``model.chunk_parameters()``, one chunk without it) and whether the bucket is DEFERRED (below). Parameters
are taken in REVERSE registration order, roughly the order the backward produces their gradients, so the
first buckets fill first. :func:`plan_buckets` does this, for the plain gradient sync
(:class:`~megamoe.training.grad_sync.GradientSync`: one all-reduce per bucket) and the distributed optimizer
(:class:`~megamoe.training.distributed_optimizer.DistributedOptimizer`: one reduce-scatter per bucket).

Overlap. :class:`GradReadiness` registers a post-accumulate-grad hook on every parameter of the non-deferred
buckets. The schedule calls ``on_last_backward(chunk)`` just before the last micro-batch's backward of that
chunk (:mod:`megamoe.pipeline.schedule`); from then on, each hook marks its parameter ready (its gradient is
final: accumulated over every micro-batch), and a bucket whose parameters are all ready is handed to the
reducer's ``launch``, which starts its collective asynchronously (:mod:`megamoe.comms.async_collectives`) while
the backward goes on. Collectives of one process group must be started in the same order on every rank, so
the buckets of one group launch in their planned order (chunks from the last to the first, then bucket
order): a bucket that is complete waits for the earlier ones of its group. :meth:`GradReadiness.finish` (before
the optimizer step) launches what is left, e.g. the buckets of parameters that got no gradient in the last
backward; the reducer then waits for every handle. Without overlap nothing is hooked and ``finish`` launches
every bucket at the end, in the same order, on the same buffers: the same reductions, bit for bit (each is
waited for before the next starts, so one bucket's buffer is alive at a time; overlapped buckets keep theirs
from launch to wait).

Deferred buckets. A parameter whose data-parallel reduction must come after another sum is reduced at the
end, after that sum, never from a hook: parameters tagged ``sequence_parallel`` (summed over TP first, when
TP > 1), tied embedding / output weights (summed over the embedding group first, across pipeline stages),
and, under the distributed optimizer, the experts of a layer with replica slots (summed across their slots
before the reduce-scatter). These do not overlap with the backward; everything else may.

Hook order: the distributed optimizer's fp32 accumulation hook (bf16 parameters: ``p.grad`` into
``p.main_grad``) is registered before these hooks, so it has run when a parameter is marked ready, and the
reduction reads :func:`megamoe.gradients.main_grad`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from torch import nn

__all__ = ["GRAD_REDUCE_BYTES", "grad_bucket_numel", "parameter_chunks", "deferred_parameters", "BucketPlan",
           "plan_buckets", "GradReadiness"]

GRAD_REDUCE_BYTES = 4         # reductions run on fp32 gradients (fp32 p.grad, or the fp32 main_grad of bf16)


def grad_bucket_numel(grad_bucket_mb: float) -> int:
    """Elements of fp32 gradient in ``grad_bucket_mb`` MB (MB = 2**20 bytes), at least 1."""
    if not grad_bucket_mb > 0:
        raise ValueError(f"grad_bucket_mb must be > 0, got {grad_bucket_mb!r}")
    return max(1, int(grad_bucket_mb * 2 ** 20) // GRAD_REDUCE_BYTES)


def parameter_chunks(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> its model chunk (``model.chunk_parameters()`` of a virtual-pipeline model); {} (every
    parameter in chunk 0) for a model without chunks."""
    chunk_parameters = getattr(model, "chunk_parameters", None)
    if chunk_parameters is None:
        return {}
    return {id(p): chunk for chunk, params in enumerate(chunk_parameters()) for p in params}


def deferred_parameters(model: nn.Module, state, tied_params=(), *, replicated_experts: bool) -> set[int]:
    """ids of the parameters whose DP reduction must follow another sum (see the module docstring):
    ``sequence_parallel`` ones under TP > 1, tied embeddings when there is an embedding group, and with
    ``replicated_experts`` (the distributed optimizer) the experts of MoE layers with more slots than experts."""
    from megamoe.moe.moe_layer import MoELayer
    deferred: set[int] = set()
    if state.tp.size > 1:
        deferred |= {id(p) for p in model.parameters() if getattr(p, "sequence_parallel", False)}
    if state.embedding is not None:
        deferred |= {id(p) for p in tied_params}
    if replicated_experts:
        for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
            if layer.placement.num_slots > layer.placement.num_experts:
                deferred |= {id(p) for p in layer.experts.parameters()}
    return deferred


@dataclass
class BucketPlan:
    """One bucket: its key (the caller's: group, dtype, chunk, deferred ...), its parameters (reverse
    registration order) and its size in the caller's units."""
    key: tuple
    params: list[nn.Parameter] = field(default_factory=list)
    numel: int = 0


def plan_buckets(params: Sequence[nn.Parameter], key: Callable[[nn.Parameter], tuple],
                 size: Callable[[nn.Parameter], int], bucket_numel: int) -> list[BucketPlan]:
    """Buckets of ``params`` (given in registration order): walked in reverse, one open bucket per
    ``key(p)``, closed when ``size(p)`` more would exceed ``bucket_numel`` (a bucket takes at least one
    parameter). Buckets are returned in the order they were opened."""
    if not (isinstance(bucket_numel, int) and bucket_numel >= 1):
        raise ValueError(f"bucket_numel must be an int >= 1, got {bucket_numel!r}")
    buckets: list[BucketPlan] = []
    open_bucket: dict[tuple, BucketPlan] = {}
    for p in reversed(list(params)):
        k, n = key(p), size(p)
        bucket = open_bucket.get(k)
        if bucket is None or (bucket.params and bucket.numel + n > bucket_numel):
            bucket = open_bucket[k] = BucketPlan(k)
            buckets.append(bucket)
        bucket.params.append(p)
        bucket.numel += n
    return buckets


class GradReadiness:
    """Hooks that launch buckets during the last backward (see the module docstring).

    ``buckets``: each bucket's parameters; ``chunks``: each bucket's model chunk; ``order_keys``: each
    bucket's process-group key (buckets of one key launch in list order, sorted by chunk from the last);
    ``deferred``: buckets never launched by a hook (nor by :meth:`finish`: their owner reduces them after
    the sums they wait for). ``launch(i)`` starts bucket ``i``'s collective. ``hooks``: register the hooks
    (overlap on); without them only :meth:`finish` launches."""

    def __init__(self, buckets: Sequence[Sequence[nn.Parameter]], chunks: Sequence[int],
                 order_keys: Sequence[Hashable], deferred: Sequence[bool], launch: Callable[[int], None], *,
                 hooks: bool):
        self._launch = launch
        self._deferred = list(deferred)
        self._sizes = [len(b) for b in buckets]
        self._chunks = list(chunks)
        # Per order key: its bucket indices in launch order (last chunk first, then plan order).
        self._queues: dict[Hashable, list[int]] = {}
        for i, k in sorted(enumerate(order_keys), key=lambda item: -self._chunks[item[0]]):
            if not self._deferred[i]:
                self._queues.setdefault(k, []).append(i)
        self._queue_of = {i: k for k, q in self._queues.items() for i in q}
        self._bucket_of: dict[int, int] = {id(p): i for i, b in enumerate(buckets) for p in b if not self._deferred[i]}
        self._names: dict[int, str] = {}
        self._hooks = []
        self._armed: set[int] = set()
        self.reset()
        if hooks:
            this = weakref.ref(self)     # a dropped reducer stops taking gradients

            def ready(param: nn.Parameter) -> None:
                readiness = this()
                if readiness is not None:
                    readiness._ready(param)
            for i, b in enumerate(buckets):
                if not self._deferred[i]:
                    for p in b:
                        self._hooks.append(p.register_post_accumulate_grad_hook(ready))

    def reset(self) -> None:
        """Forget the step: nothing armed, ready or launched."""
        self._armed.clear()
        self._ready_count = [0] * len(self._sizes)
        self._seen: set[int] = set()
        self._launched = [False] * len(self._sizes)
        self._next = {k: 0 for k in self._queues}

    def arm(self, chunk: int) -> None:
        """The last backward of ``chunk`` is about to run: its parameters' next gradients are final."""
        self._armed.add(chunk)

    def _ready(self, param: nn.Parameter) -> None:
        i = self._bucket_of.get(id(param))
        if i is None or self._chunks[i] not in self._armed:
            return
        if self._launched[i]:
            raise RuntimeError(f"a parameter of shape {tuple(param.shape)} got a second gradient in its last "
                               "backward after its bucket's reduction started (used in two backward passes of one "
                               "micro-batch?); run without overlap_grad_reduce")
        if id(param) in self._seen:
            return
        self._seen.add(id(param))
        self._ready_count[i] += 1
        if self._ready_count[i] == self._sizes[i]:
            self._drain(self._queue_of[i], only_ready=True)

    def _drain(self, key: Hashable, *, only_ready: bool) -> None:
        queue = self._queues[key]
        while self._next[key] < len(queue):
            i = queue[self._next[key]]
            if only_ready and self._ready_count[i] < self._sizes[i]:
                return
            self._launched[i] = True
            self._next[key] += 1
            self._launch(i)

    def launched(self, i: int) -> bool:
        return self._launched[i]

    def finish(self) -> None:
        """Launch every non-deferred bucket not launched yet (in order), then forget the step."""
        for key in self._queues:
            self._drain(key, only_ready=False)
        self.reset()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
