"""Measured (never computed) memory of a training rank: state bytes, saved activations, peak live bytes.

Three instruments, all counting UNIQUE STORAGES (a view and its base, or a tensor saved twice, count
once; a storage counts with its whole ``nbytes``), on any device (``meta`` included: storages there
have sizes but no data):

- :func:`measure_state_bytes`: parameters, gradients (``p.grad``; the fp32 ``p.main_grad`` of non-fp32
  parameters, :mod:`megamoe.gradients`; plus the persistent reduced-gradient shards a distributed optimizer
  keeps, ``optimizer.gradient_shards()``) and optimizer state (every
  tensor in ``optimizer.state``: for torch's AdamW the moments and the step, for
  :class:`~megamoe.training.distributed_optimizer.DistributedOptimizer` this rank's shards), split into
  dense and expert (``param.expert_parallel``) parameters.
- :class:`SavedActivations`: a ``torch.autograd.graph.saved_tensors_hooks`` context. Every tensor
  autograd saves for backward while it is active passes through its pack hook; it keeps the storages
  that are not parameters or buffers, tracks which of them are still alive (a finaliser per storage),
  and reports the bytes held now, the most held at any time, and a breakdown by the module that saved
  them. Under ``torch.utils.checkpoint`` (non-reentrant) what autograd holds is what passes through
  these hooks: the checkpoint saves its inputs through them (``_CheckpointFrame.save_inputs``), while
  the recomputed region's own tensors go to the checkpoint's inner hooks (a handle, no tensor) in
  forward and exist only during its backward recomputation. So the count is what autograd holds, with
  two gaps: tensors a checkpoint keeps inside a non-tensor argument (a tuple, e.g. the rotary cos / sin
  of fully recomputed layers) are held by reference and never pass the hooks; and a saved storage
  counts until it is freed, so one the caller still references after the graph released it (the
  token ids of a micro-batch) stays counted.
- :class:`LiveMemory`: a ``TorchDispatchMode`` that sees every op run under it (forward, the autograd
  engine's backward on this thread, the optimizer step, and c10d collectives such as gloo's, which
  are dispatcher ops), registers every storage its inputs and outputs use, and removes it when the
  storage is freed (``weakref.finalize``). Its ``peak_bytes`` is the most live bytes at any op
  boundary: parameters, gradients, optimizer state, activations and temporaries. Tensors alive
  before it started and not touched by any op are counted only if passed to :meth:`LiveMemory.track`.
  (Buffers a backend allocates outside the dispatcher, e.g. inside a collective, are not seen.)

Categories of saved activations (:attr:`SavedActivations.by_category`): the innermost module running
when a tensor was saved, by its qualified name in the model:

- ``"norm"``: a decoder-level norm (``input_layernorm``, ``post_attention_layernorm``, the final
  ``norm``): the norm / residual activations, the part sequence parallelism splits over TP (the
  residual adds themselves save nothing: an add's backward needs no tensor);
- ``"attention"``, ``"mlp"`` (dense MLP or MoE layer), ``"embedding"``, ``"lm_head"`` (the output
  layer and the loss: the root module's own ops after the final norm), and ``"other"`` (anything else:
  the root module's ops before it, e.g. the saved inputs of fully recomputed layers, a decoder layer's
  own ops, e.g. the saved inputs of the norms / MLP / MoE layer it recomputes, and ops outside the
  model).

:func:`measure_train_step` runs a whole training step under all three: saved activations are the most
held at once over the step (with 1F1B, several micro-batches' worth), the peak is the step's.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megamoe.host_staging import observe_host_buffers

__all__ = ["StateBytes", "measure_state_bytes", "unique_storage_bytes", "SavedActivations", "LiveMemory",
           "DeviceMemory", "StepMemory", "measure_train_step", "CATEGORIES"]

CATEGORIES = ("embedding", "norm", "attention", "mlp", "lm_head", "other")
_DECODER_NORMS = ("input_layernorm", "post_attention_layernorm")


def _storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (the StorageImpl's address, valid on every device)."""
    return t.untyped_storage()._cdata


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages under ``tensors`` (a shared storage counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


@dataclass(frozen=True)
class StateBytes:
    """One rank's persistent training state, in bytes of unique storages."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    dense_param_bytes: int = 0
    expert_param_bytes: int = 0
    dense_optimizer_bytes: int = 0       # optimizer state of non-expert parameters
    expert_optimizer_bytes: int = 0      # optimizer state of expert (``expert_parallel``) parameters

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer, params) -> list[torch.Tensor]:
    out = []
    for p in params:
        state = optimizer.state.get(p, {})
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def measure_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """Parameters, gradients and optimizer state of this rank (see the module docstring). Gradients are
    those present now: call it after a step's backward (before ``zero_grad``) for the step's figure."""
    params = [p for p in model.parameters()]
    dense = [p for p in params if not getattr(p, "expert_parallel", False)]
    expert = [p for p in params if getattr(p, "expert_parallel", False)]
    grads = _grad_tensors(model, optimizer)
    opt_dense = _optimizer_state_tensors(optimizer, dense) if optimizer is not None else []
    opt_expert = _optimizer_state_tensors(optimizer, expert) if optimizer is not None else []
    # A step counter shared by several parameters (a 0-d tensor per param in torch's AdamW) counts
    # with its own storage: unique storages over all of them.
    return StateBytes(param_bytes=unique_storage_bytes(params), grad_bytes=unique_storage_bytes(grads),
                      optimizer_bytes=unique_storage_bytes(opt_dense + opt_expert),
                      dense_param_bytes=unique_storage_bytes(dense), expert_param_bytes=unique_storage_bytes(expert),
                      dense_optimizer_bytes=unique_storage_bytes(opt_dense),
                      expert_optimizer_bytes=unique_storage_bytes(opt_expert))


def _category(name: str) -> str:
    """The category of a saved tensor from the qualified name of the innermost running module."""
    parts = name.split(".")
    leaf = parts[-1]
    if name == "norm" or (leaf in _DECODER_NORMS and "self_attn" not in parts and "mlp" not in parts):
        return "norm"
    if "self_attn" in parts:
        return "attention"
    if "mlp" in parts:
        return "mlp"
    if parts[0] == "embed_tokens":
        return "embedding"
    if parts[0] in ("lm_head", "norm_and_head"):
        return "lm_head"
    return "other"


class SavedActivations:
    """Bytes of the activations autograd saves for backward while the context is active.

    ``model``: its parameters and buffers are excluded, and its modules name the categories (see the
    module docstring; without a model every saved tensor counts, under ``"other"``). Attributes, after
    (or during) the context:

    - ``held_bytes``: saved storages alive now (before backward: what the graph holds);
    - ``peak_bytes``: the most held at any moment while the context was active (over a whole step
      with several micro-batches in flight, the step's peak);
    - ``packed_bytes``: every distinct storage ever saved, alive or not;
    - ``peak_by_category``: ``{category: bytes}`` held at the moment of ``peak_bytes`` (it sums to it);
    - ``by_category``: ``packed_bytes`` split likewise (the category of the module that first saved
      each storage).

    The context can be entered once. Tensors saved outside a module of ``model`` (e.g. the loss
    scaling in a trainer) count as ``"other"``.
    """

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self._excluded: set[int] = set()
        self._names: dict[nn.Module, str] = {}
        if model is not None:
            self._excluded = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
            self._names = {m: n for n, m in model.named_modules()}
        self._stack: list[str] = []
        self._after_final_norm = False
        self._live: dict[int, tuple[int, str]] = {}    # storage key -> (nbytes, category), while alive
        self._seen: dict[int, tuple[int, str]] = {}
        self._held_by_category = dict.fromkeys(CATEGORIES, 0)
        self.held_bytes = 0
        self.peak_bytes = 0
        self.peak_by_category = dict.fromkeys(CATEGORIES, 0)
        self._handles = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    # ---- module tracking -------------------------------------------------------------------------
    def _push(self, module, args):
        name = self._names.get(module, "")
        if name == "":
            self._after_final_norm = False       # a new forward of the model (a stage) starts
        elif name == "norm":
            self._after_final_norm = True
        self._stack.append(name)

    def _category_now(self) -> str:
        if not self._stack:
            return "other"
        name = self._stack[-1]
        if name == "":
            # The root module's own ops: after the final norm, the output layer and the loss; before it,
            # e.g. the saved inputs of checkpointed (fully recomputed) layers.
            return "lm_head" if self._after_final_norm else "other"
        return _category(name)

    def _pop(self, module, args, output):
        if self._stack:
            self._stack.pop()

    def __enter__(self) -> SavedActivations:
        if self.model is not None:
            for module in self._names:
                self._handles.append(module.register_forward_pre_hook(self._push))
                self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- the pack hook ---------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._excluded or key in self._live:
            return t
        nbytes = storage.nbytes()
        category = self._category_now()
        self._live[key] = (nbytes, category)
        self._seen.setdefault(key, (nbytes, category))
        self.held_bytes += nbytes
        self._held_by_category[category] += nbytes
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes = self.held_bytes
            self.peak_by_category = dict(self._held_by_category)
        weakref.finalize(storage, self._freed, key).atexit = False
        return t

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.held_bytes -= entry[0]
            self._held_by_category[entry[1]] -= entry[0]

    @property
    def packed_bytes(self) -> int:
        return sum(n for n, _ in self._seen.values())

    @property
    def by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for nbytes, category in self._seen.values():
            out[category] += nbytes
        return out


class LiveMemory(TorchDispatchMode):
    """Peak live bytes of every storage the ops run under it touch (see the module docstring).

    ``with LiveMemory() as live: live.track(params, grads, state); step()`` -> ``live.peak_bytes``,
    ``live.current_bytes``. :meth:`reset_peak` starts a new peak from the current bytes.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def track(self, *tensors) -> None:
        """Register tensors that exist already (parameters, gradients, optimizer state) as live."""
        flat, _ = tree_flatten(list(tensors))
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._register(t)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def _register(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):      # a tensor subclass or sparse tensor without one
            return
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current_bytes += nbytes
        weakref.finalize(storage, self._freed, key).atexit = False

    def _freed(self, key: int) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.current_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs, _ = tree_flatten((args, kwargs or {}))
        for t in inputs:
            if isinstance(t, torch.Tensor):
                self._register(t)
        out = func(*args, **(kwargs or {}))
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if isinstance(t, torch.Tensor):
                self._register(t)
        # An op's output may be resized in place (``out=`` variants): re-read what grew.
        for t in inputs:
            if isinstance(t, torch.Tensor):
                self._resync(t)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    def _resync(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        old = self._live.get(key)
        if old is not None and old != storage.nbytes():
            self._live[key] = storage.nbytes()
            self.current_bytes += storage.nbytes() - old


class DeviceMemory(LiveMemory):
    """:class:`LiveMemory` of the storages on ``device`` only, less the host staging buffers
    (:func:`megamoe.host_staging.host_buffer`): the device's live bytes, also where host and device are the
    same memory (a CPU run). A host buffer and every view of it are never counted, whatever the ops that
    touch it; nor is the storage of another device (a ``meta`` tensor standing for shapes on a CPU run)."""

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)
        self._host: set[int] = set()
        self._observing = None

    def _on_host_buffer(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        self._host.add(key)
        weakref.finalize(t.untyped_storage(), self._host.discard, key).atexit = False

    def _register(self, t: torch.Tensor) -> None:
        try:
            if t.device.type != self.device.type or _storage_key(t) in self._host:
                return
        except (RuntimeError, NotImplementedError):
            return
        super()._register(t)

    def __enter__(self):
        self._observing = observe_host_buffers(self._on_host_buffer)
        self._observing.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._observing.__exit__(None, None, None)


@dataclass
class StepMemory:
    """What :func:`measure_train_step` measured on this rank (bytes)."""

    state: StateBytes
    saved_activation_bytes: int          # the most saved-for-backward bytes held at once over the step
    saved_by_category: dict[str, int] = field(default_factory=dict)   # held at the peak, by category
    peak_live_bytes: int = 0             # LiveMemory's peak over the step, state included


def _grad_tensors(model: nn.Module, optimizer) -> list[torch.Tensor]:
    # p.grad, and the fp32 main_grad views (one storage per bucket) of bf16 parameters that accumulate in fp32
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grads += [g for g in (getattr(p, "main_grad", None) for p in model.parameters()) if g is not None]
    if optimizer is not None and hasattr(optimizer, "gradient_shards"):
        grads += list(optimizer.gradient_shards())
    return grads


def measure_train_step(trainer, micro_batches):
    """Run ``trainer.train_step(micro_batches)`` under :class:`SavedActivations` and
    :class:`LiveMemory` (which starts from the parameters, buffers, gradients and optimizer state alive
    before the step) and return ``(StepMemory, StepMetrics)``.

    Gradient bytes are those held when the optimizer step starts (a step pre-hook): ``p.grad`` / ``p.main_grad``
    and the distributed optimizer's reduced shards (ZeRO-2 has freed the full gradients by then); parameters and
    optimizer state are measured after the step (the state exists from the first step on)."""
    model, optimizer = trainer.model, trainer.optimizer
    at_step: dict[str, int] = {}

    def before_step(opt, args, kwargs):
        at_step["grad_bytes"] = unique_storage_bytes(_grad_tensors(model, opt))

    handle = optimizer.register_step_pre_hook(before_step)
    live = LiveMemory()
    try:
        with live, SavedActivations(model) as saved:
            live.track(list(model.parameters()), list(model.buffers()), _grad_tensors(model, optimizer),
                       [list(s.values()) for s in optimizer.state.values()])
            metrics = trainer.train_step(micro_batches)
    finally:
        handle.remove()
    state = measure_state_bytes(model, optimizer)
    if "grad_bytes" in at_step:
        state = dataclasses.replace(state, grad_bytes=at_step["grad_bytes"])
    memory = StepMemory(state=state, saved_activation_bytes=saved.peak_bytes, saved_by_category=saved.peak_by_category,
                        peak_live_bytes=live.peak_bytes)
    return memory, metrics
