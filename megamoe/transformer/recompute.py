"""Activation recomputation: which parts of a decoder layer keep no activations for backward.

``RecomputeConfig(granularity, modules)`` (a field of :class:`megamoe.models.GPTMoEConfig`), named as
Megatron-Core names them:

- ``"none"``: every activation autograd needs is kept from forward to backward.
- ``"full"``: each decoder layer is recomputed whole; only its inputs are kept (Megatron's
  ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``).
- ``"selective"`` with ``modules`` (default ``("core_attn",)``), each recomputed on its own:

  - ``core_attn``: softmax(QK^T)V, the scaled-dot-product attention after RoPE (GQA and MLA);
  - ``mla_up_proj``: MLA's q / kv up projections, what follows (the split into heads, RoPE, the
    concatenation of the nope and rope parts) and the core attention they feed: its inputs q, k, v
    are the up projections' outputs, which only a region ending after it can drop (only the
    latents are kept);
  - ``moe``: the whole MoE layer (router, dispatch, experts, combine, shared experts);
  - ``moe_act``: the routed experts' activation between their two GEMMs (every expert backend);
  - ``mlp``: the dense MLP of the non-MoE layers;
  - ``layernorm``: each decoder layer's input and post-attention RMSNorm.

How: :func:`checkpointed` runs a function under ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
RNG state preserved, so a recomputed dropout or router jitter draws the same numbers), only when
gradients are enabled: generation and evaluation run the plain path. The one exception is the fused
``torch`` expert backend, one autograd function for the whole expert MLP: with ``moe_act`` it saves
the activation's input only and recomputes the activation inside its own backward
(:class:`megamoe.moe.experts.grouped_experts.GroupedMLPFunction`). Losses and gradients are bit-identical to
``"none"``: backward runs the same kernels on the same recomputed values.

Gradients: recomputation changes what is stored, not what is reduced. The recomputed region's own
backward is the plain one, so every gradient reduction (TP, DP, expert-DP, replica sums) is unchanged.

Side effects of forward happen once per real forward. Recomputation runs a region's forward a second
time, inside backward; whatever forward records is skipped then (:func:`is_recomputing`): the MoE
layer's expert load counts (the expert-bias update and EPLB's load window read them), the per-layer
aux-loss hooks (:class:`megamoe.training.moe_layer_metrics.PerLayerAuxLoss`) and the FP8 delayed
recipe's amax histories. A value forward READ from such state before updating it (the FP8 delayed
scale) is replayed to the recomputation by :func:`forward_value`, so both passes quantise alike.

Collectives: a recomputed region re-issues the collectives of its forward, in backward. ``moe`` (and
``full`` on a MoE layer) runs the dispatcher's exchanges again: the all-to-all dispatcher's two
all-to-alls, the all-gather dispatcher's all-reduce / all-gather + reduce-scatter, but not their count
exchanges (split sizes, rows per slot): the recomputation replays the forward's counts
(:func:`forward_value`), so it reads nothing on the host either; ``mlp`` and ``full`` re-issue the TP all-reduce of the row-parallel output
projections, ``full`` also the attention's. So a recomputed MoE layer issues its forward dispatch
calls twice per step (``tests/multirank/test_recompute.py`` counts them with :func:`megamoe.comms.comm_counter`).
Every rank recomputes the same regions in the same order, so the re-issued collectives match up;
recomputation never stops early (``early_stop=False``), so each region re-issues ALL its collectives
on every rank, whatever the data (zero-token ranks included).

KV caches: a call with a KV cache is never recomputed (the cache update is a side effect that must
happen once); such calls are generation, without gradients, anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_SELECTIVE_MODULES", "RECOMPUTE_GRANULARITIES", "RECOMPUTE_MODULES", "RecomputeConfig",
           "checkpointed", "forward_value", "is_recomputing", "recompute_from_dict", "set_module_flag"]

logger = logging.getLogger(__name__)

RECOMPUTE_GRANULARITIES = ("none", "full", "selective")
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "moe", "moe_act", "mlp", "layernorm")
DEFAULT_SELECTIVE_MODULES = ("core_attn",)

T = TypeVar("T")


@dataclass(frozen=True)
class RecomputeConfig:
    """What a model recomputes in backward instead of storing; see the module docstring.

    ``granularity``: ``"none"`` | ``"full"`` | ``"selective"``. ``modules``: for ``"selective"`` only,
    a subset of :data:`RECOMPUTE_MODULES` (empty: ``("core_attn",)``, Megatron's default); kept in the
    canonical order of :data:`RECOMPUTE_MODULES`, without duplicates.
    """

    granularity: str = "none"
    modules: tuple[str, ...] = ()

    def __post_init__(self):
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"RecomputeConfig.granularity must be one of {RECOMPUTE_GRANULARITIES}, got "
                             f"{self.granularity!r}")
        if isinstance(self.modules, str):
            raise ValueError(f"RecomputeConfig.modules must be a sequence of module names, got the string "
                             f"{self.modules!r} (write ({self.modules!r},))")
        modules = tuple(self.modules)
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ValueError(f"RecomputeConfig.modules: unknown {unknown}; choose from {RECOMPUTE_MODULES}")
        if modules and self.granularity != "selective":
            raise ValueError(f"RecomputeConfig.modules {list(modules)} apply to granularity='selective' only, "
                             f"got granularity={self.granularity!r}")
        if self.granularity == "selective" and not modules:
            modules = DEFAULT_SELECTIVE_MODULES
        object.__setattr__(self, "modules", tuple(m for m in RECOMPUTE_MODULES if m in modules))

    @property
    def full(self) -> bool:
        """Whether every decoder layer is recomputed whole."""
        return self.granularity == "full"

    def recomputes(self, module: str) -> bool:
        """Whether the selective ``module`` (one of :data:`RECOMPUTE_MODULES`) is recomputed."""
        if module not in RECOMPUTE_MODULES:
            raise ValueError(f"unknown recompute module {module!r}; choose from {RECOMPUTE_MODULES}")
        return module in self.modules

    def to_dict(self) -> dict[str, Any]:
        return {"granularity": self.granularity, "modules": list(self.modules)}


# ---- recomputation state ------------------------------------------------------------------------
class _Region:
    """One checkpointed call: the values :func:`forward_value` computed in its forward, replayed in order
    by its recomputation."""

    def __init__(self):
        self.values: list = []
        self.replayed = 0


class _RegionStack(threading.local):
    # Backward (and so recomputation) may run on autograd's device threads: the stack is per thread,
    # and each region's contexts push it on whichever thread runs that pass.
    def __init__(self):
        self.frames: list[tuple[_Region, bool]] = []      # (region, recomputing)


_STACK = _RegionStack()


@contextlib.contextmanager
def _entered(region: _Region, recomputing: bool) -> Iterator[None]:
    _STACK.frames.append((region, recomputing))
    try:
        yield
    finally:
        _STACK.frames.pop()


def _contexts():
    """``context_fn`` of ``torch.utils.checkpoint``: the first context wraps the original forward, the
    second the recomputation (both public API). They tell :func:`is_recomputing` which pass runs."""
    region = _Region()
    return _entered(region, recomputing=False), _entered(region, recomputing=True)


def is_recomputing() -> bool:
    """True while a region run by :func:`checkpointed` is being recomputed (inside backward): forward
    code skips its side effects (load counts, hooks, FP8 histories) then.

    How: torch 2.13 has no public "is recomputing" query (``torch.utils.checkpoint`` keeps its frames
    private), but its non-reentrant ``checkpoint`` takes ``context_fn``, two context managers entered
    around the original forward and around the recomputation; ours push a marker on a thread-local
    stack. Only regions run by :func:`checkpointed` are seen: a caller's own ``checkpoint`` without
    our ``context_fn`` is not."""
    return any(recomputing for _, recomputing in _STACK.frames)


def forward_value(compute: Callable[[], T]) -> T:
    """``compute()`` in a forward; in the recomputation of the same region, the value that forward got.

    For forward code that reads state it then updates (FP8 delayed scaling reads the scale of earlier
    steps, then records this step's amax): the recomputation must see what the forward saw, not the
    updated state. Calls are matched by order within a region; outside any region, ``compute()``.
    Nested regions (a ``moe_act`` region inside a recomputed ``moe`` layer): the value comes from the
    outermost region being recomputed, and every region running its forward keeps it for its own
    recomputation."""
    frames = _STACK.frames
    source = next((region for region, recomputing in frames if recomputing), None)
    if source is None:
        value = compute()
    elif source.replayed < len(source.values):
        value = source.values[source.replayed]
        source.replayed += 1
    else:
        raise RuntimeError("recomputation asked for more forward values than its forward computed: the "
                           "recomputed region took another path than the original forward")
    for region, recomputing in frames:
        if not recomputing:
            region.values.append(value)
    return value


def checkpointed(function: Callable[..., T], *args, enabled: bool = True, **kwargs) -> T:
    """``function(*args, **kwargs)``, recomputed in backward instead of keeping its activations when
    ``enabled`` and gradients are enabled (otherwise a plain call).

    ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False`` (tensors among ``kwargs`` and
    the outputs may be anything; inputs that need no gradient are fine), ``preserve_rng_state=True``
    (dropout and jitter redraw the same numbers) and ``early_stop=False`` (the whole region is
    recomputed, so every rank re-issues all of its collectives; see the module docstring). The
    region's outputs are kept only by whoever consumes them; its inputs are kept by the checkpoint."""
    if not enabled or not torch.is_grad_enabled():
        return function(*args, **kwargs)
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_contexts,
                      early_stop=False, **kwargs)


def set_module_flag(module: Any, attribute: str, value: bool, what: str) -> None:
    """Set a selective-recompute flag (a boolean class attribute of the shipped modules) on ``module``.
    A custom module without the attribute cannot honour it: turning it on logs a warning instead."""
    if hasattr(module, attribute):
        setattr(module, attribute, value)
    elif value:
        logger.warning("%s: %s has no %r flag, so %s is not recomputed in it", what, type(module).__name__,
                       attribute, what)


def recompute_from_dict(data: dict | None) -> RecomputeConfig:
    """The :class:`RecomputeConfig` of :meth:`RecomputeConfig.to_dict` (None or absent: ``"none"``);
    ValueError naming an unknown field."""
    if data is None:
        return RecomputeConfig()
    known = {f.name for f in dataclasses.fields(RecomputeConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"GPTMoEConfig.from_dict: unknown fields {unknown} in recompute (RecomputeConfig)")
    return RecomputeConfig(**data)
