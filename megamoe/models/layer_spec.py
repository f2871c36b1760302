"""Which classes build the parts of a :class:`~megamoe.models.gpt_moe.DecoderLayer`: the construction
hooks of :class:`~megamoe.models.gpt_moe.GPTMoEModel`.

``GPTMoEModel(config, state, layer_spec=LayerSpec(moe=MyMoELayer))`` builds every MoE layer with
``MyMoELayer`` (e.g. a :class:`~megamoe.moe.moe_layer.MoELayer` subclass whose ``build_router``
returns a custom router); the other parts keep the shipped classes. Each field is a class or any
callable with that class's constructor signature, called once per decoder layer with:

- ``attention(config.attention_of(i), tp_group=..., device=..., dtype=...)`` (``config.attention``, without
  its sliding window on the layers ``sliding_window_layer_ids`` leaves out): a module whose
  ``forward(hidden [B, S, H], position_ids [B, S], kv_cache, attention_mask [B, S_past + S] | None,
  position_embeddings (cos, sin) | None) -> [B, S, H]`` is complete on every TP rank (like
  :class:`~megamoe.transformer.attention.Attention`). Default (None): ``Attention`` for an
  ``AttentionConfig``, ``MultiHeadLatentAttention`` for an ``MLAConfig``. Packed documents
  (:mod:`megamoe.data.packing`) reach it as the keyword ``document_ids`` [B, S], and only then: a
  module without that keyword works unchanged, and a packed forward through it raises ValueError.
- ``mlp(config.dense_mlp, tp_group=..., device=..., dtype=...)``: the MLP of the layers not in
  ``moe_layer_ids``; ``forward(x [..., H]) -> [..., H]`` complete on every TP rank, or
  ``(output, aux_loss [])``. Default :class:`~megamoe.transformer.mlp.MLP`.
- ``moe(config.moe, ep_group=..., etp_group=..., expert_group=..., etp_edp_group=..., placement=...,
  device=..., dtype=...)``: must build a :class:`~megamoe.moe.moe_layer.MoELayer` (or subclass):
  the trainer, the gradient sync, checkpoints and the expert-load tools use its API (see its
  docstring). Default ``MoELayer``.

Under sequence parallelism (``GPTMoEConfig.sequence_parallel`` with TP > 1) attention and mlp also
receive ``sequence_parallel=True`` (their input and output are this rank's sequence chunk
[B, S / tp, H]) and moe ``sequence_group=`` the TP group; without it they receive neither keyword.
Under context parallelism (cp > 1, :mod:`megamoe.transformer.context_parallel`) attention also receives
``cp_group=`` the CP group (its input is this CP rank's S / cp tokens; a builder without the keyword
raises ValueError) and moe ``statistics_group=`` / ``context_parallel_size=`` (the router's balancing
statistics over the whole sequences).
Under MoE parallel folding (all-to-all dispatcher, etp < tp, no sequence parallelism;
:mod:`megamoe.models.moe_folding`) moe receives ``fold_group=`` the TP group.

A part's parameters are saved under their module names (``layers.<i>.mlp.<name>``); a parameter a
rank holds only a piece of must carry its sharding (:func:`megamoe.sharding.shard_parameter`). The
spec is code, not config: a checkpoint does not record it, so whoever loads a checkpoint of a
customised model builds the model with the same spec.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from torch import nn

from megamoe.moe.moe_layer import MoELayer
from megamoe.transformer import MLP, Attention, AttentionConfig, MultiHeadLatentAttention

__all__ = ["LayerSpec"]


def _accepts_keyword(builder: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):        # no signature to read (a builtin): let the call decide
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


@dataclass(frozen=True)
class LayerSpec:
    """The builders of a decoder layer's attention, dense MLP and MoE layer (see the module docstring)."""

    attention: Callable[..., nn.Module] | None = None
    mlp: Callable[..., nn.Module] = MLP
    moe: Callable[..., MoELayer] = MoELayer

    def __post_init__(self):
        for name in ("attention", "mlp", "moe"):
            value = getattr(self, name)
            if not callable(value) and not (name == "attention" and value is None):   # None: by config kind
                raise ValueError(f"LayerSpec.{name} must be a class or a callable building the module, got "
                                 f"{type(value).__name__} {value!r}")
        if isinstance(self.moe, type) and not issubclass(self.moe, MoELayer):
            raise ValueError(f"LayerSpec.moe must be MoELayer or a subclass of it, got {self.moe.__name__}: the "
                             "trainer, gradient sync and checkpoints rely on MoELayer's API; subclass MoELayer "
                             "and override build_router / build_experts / build_dispatcher")

    def build_attention(self, config, *, tp_group, sequence_parallel: bool = False, cp_group=None, device=None,
                        dtype=None) -> nn.Module:
        builder = self.attention
        if builder is None:
            builder = Attention if isinstance(config, AttentionConfig) else MultiHeadLatentAttention
        # ``sequence_parallel`` and ``cp_group`` reach the builder only when on, so custom modules need
        # not know them.
        extra = {"sequence_parallel": True} if sequence_parallel else {}
        if cp_group is not None:
            if not _accepts_keyword(builder, "cp_group"):
                raise ValueError(f"context parallelism (cp > 1) needs an attention that gathers keys over the CP "
                                 f"group, but the attention builder {getattr(builder, '__name__', builder)!r} takes "
                                 "no cp_group keyword; add `cp_group=None` to it (see "
                                 "megamoe.transformer.context_parallel) or train with cp=1")
            extra["cp_group"] = cp_group
        return builder(config, tp_group=tp_group, device=device, dtype=dtype, **extra)

    def build_mlp(self, config, *, tp_group, sequence_parallel: bool = False, device=None, dtype=None) -> nn.Module:
        extra = {"sequence_parallel": True} if sequence_parallel else {}
        return self.mlp(config, tp_group=tp_group, device=device, dtype=dtype, **extra)

    def build_moe(self, config, *, device=None, dtype=None, **groups) -> MoELayer:
        layer = self.moe(config, device=device, dtype=dtype, **groups)
        if not isinstance(layer, MoELayer):
            raise TypeError(f"LayerSpec.moe built a {type(layer).__name__}, not a MoELayer: the trainer, gradient "
                            "sync and checkpoints rely on MoELayer's API; return a MoELayer (subclass)")
        return layer
