"""What a module (and its optimizer) puts into a checkpoint: logical, layout-independent chunks.

A checkpoint never stores "rank 3's weight"; it stores pieces of *logical* tensors: a name that does not
depend on the parallel layout (``layers.3.attn.q_proj.weight``, ``layers.5.mlp.experts.17.w1``), the
logical tensor's global shape, and where this rank's piece sits in it. A checkpoint written under one
layout (TP/PP/EP/ETP, number of expert slots) therefore loads under any other: each rank asks for the
pieces it holds and the loader reads just those slices (:mod:`megamoe.checkpoint.format`).

The module protocol
-------------------
:func:`sharded_state_dict` walks a module. By default every parameter and persistent buffer becomes one
chunk described by its :class:`~megamoe.sharding.ShardSpec`, named by its qualified name. A submodule
that stores tensors in a layout unlike its logical one (the MoE experts: stacked per-*slot* weights whose
logical names are per-*expert*) defines its own ``sharded_state_dict(prefix) -> list[LogicalChunk]``; the
walker then calls it for that whole subtree. Several chunks may be the *same* logical chunk (expert
replicas in several slots): the checkpoint stores it once and loading fills every copy.

Tied tensors reached under two names are listed under both (``state_dict`` semantics); loading writes the
same values twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from megamoe.sharding import get_shard_spec

__all__ = [
    "LogicalChunk", "chunk_from_shard_spec", "sharded_state_dict", "default_sharded_state_dict",
    "chunks_by_parameter", "optimizer_chunks", "materialize_optimizer_state", "same_view_of",
]


@dataclass
class LogicalChunk:
    """This rank's piece ``tensor`` of the logical tensor ``name`` of shape ``global_shape``, starting at
    ``offsets``.

    ``tensor`` is in the LOGICAL layout (same dim order as the logical tensor) but may be a
    non-contiguous view of a parameter: saving reads it, loading copies into it in place.
    """

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self):
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.offsets = tuple(int(o) for o in self.offsets)
        shape = tuple(self.tensor.shape)
        if not (len(shape) == len(self.global_shape) == len(self.offsets)):
            raise ValueError(
                f"LogicalChunk {self.name!r}: tensor shape {shape}, global_shape {self.global_shape} and offsets "
                f"{self.offsets} must have the same number of dims")
        for dim, (size, offset, total) in enumerate(zip(shape, self.offsets, self.global_shape)):
            if offset < 0 or offset + size > total:
                raise ValueError(
                    f"LogicalChunk {self.name!r}: dim {dim} covers [{offset}, {offset + size}), outside the "
                    f"logical size {total}; fix offsets {self.offsets} or global_shape {self.global_shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def chunk_from_shard_spec(name: str, tensor: torch.Tensor) -> LogicalChunk:
    """The chunk a (possibly sharded) parameter or buffer holds, from its :class:`ShardSpec`: its real
    rows only, where the spec pads the split dim (a padded vocabulary: the padding is never saved)."""
    spec = get_shard_spec(tensor)
    return LogicalChunk(name, spec.logical_part(tensor.detach()), spec.global_shape, spec.offsets)


def sharded_state_dict(module: nn.Module, prefix: str = "") -> list[LogicalChunk]:
    """Every logical chunk ``module`` holds, names prefixed by ``prefix``.

    Uses ``module.sharded_state_dict(prefix)`` when the module defines one (for itself and everything
    below it), :func:`default_sharded_state_dict` otherwise.
    """
    custom = getattr(module, "sharded_state_dict", None)
    if callable(custom):
        return list(custom(prefix))
    return default_sharded_state_dict(module, prefix)


def default_sharded_state_dict(module: nn.Module, prefix: str = "") -> list[LogicalChunk]:
    """The module's own parameters and persistent buffers via their ShardSpecs, then each child through
    :func:`sharded_state_dict` (so a child's custom method is honoured).

    A custom ``sharded_state_dict`` can call this on a child, or build on it for its own tensors.
    """
    chunks = [chunk_from_shard_spec(prefix + name, param) for name, param in module.named_parameters(recurse=False)]
    for name, buffer in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            chunks.append(chunk_from_shard_spec(prefix + name, buffer))
    for child_name, child in module.named_children():
        chunks.extend(sharded_state_dict(child, f"{prefix}{child_name}."))
    return chunks


# ----------------------------------------------------------------------------------------------
# Optimizer state
# ----------------------------------------------------------------------------------------------
def _storage_extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last] element offsets ``t`` touches in its storage."""
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.storage_offset(), last


def chunks_by_parameter(parameters: Iterable[torch.Tensor],
                        chunks: Iterable[LogicalChunk]) -> dict[torch.Tensor, list[LogicalChunk]]:
    """Group ``chunks`` by the parameter whose memory their tensor views (chunks of buffers, which view
    no parameter, are left out). Parameters may share one flat storage; chunks are matched by address."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for param in parameters:
        if param.numel():
            by_storage.setdefault(param.untyped_storage().data_ptr(), []).append(param)
    grouped: dict[torch.Tensor, list[LogicalChunk]] = {}
    for chunk in chunks:
        if not chunk.tensor.numel():
            continue
        start, _ = _storage_extent(chunk.tensor)
        for param in by_storage.get(chunk.tensor.untyped_storage().data_ptr(), ()):
            first, last = _storage_extent(param)
            if first <= start <= last:
                grouped.setdefault(param, []).append(chunk)
                break
    return grouped


def same_view_of(state: torch.Tensor, param: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The view of ``state`` (shaped and strided like ``param``) that ``view`` is of ``param``."""
    if view.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        raise ValueError("a parameter's chunk tensor is not a view of the parameter; optimizer state can only be "
                         "cut along chunks that view their parameter")
    if state.stride() != param.stride():
        raise ValueError(f"optimizer state strides {state.stride()} differ from the parameter's {param.stride()}; "
                         "cannot map the parameter's chunks onto it")
    delta = view.storage_offset() - param.storage_offset()
    return state.as_strided(view.shape, view.stride(), state.storage_offset() + delta)


def optimizer_chunks(optimizer: torch.optim.Optimizer,
                     param_chunks_by_param: Mapping[torch.Tensor, Sequence[LogicalChunk]]) -> list[LogicalChunk]:
    """The optimizer's per-parameter state as logical chunks named ``optim.<state_key>.<logical name>``.

    State shaped like the parameter (``exp_avg``, ``exp_avg_sq``) is cut exactly like the parameter's
    chunks, so it reshards with it. Scalar state (``step``) becomes one 0-dim logical tensor per logical
    parameter name, stored once however many ranks or slots hold the parameter.

    ``param_chunks_by_param``: every optimized parameter -> its chunks, whose tensors must be views of
    that parameter (see :func:`chunks_by_parameter`). Loading needs the state to exist first: call
    :func:`materialize_optimizer_state` on a fresh optimizer.
    """
    out: list[LogicalChunk] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not param.numel():
                continue
            chunks = param_chunks_by_param.get(param)
            if not chunks:
                raise ValueError(f"optimized parameter of shape {tuple(param.shape)} has no logical chunk; "
                                 "param_chunks_by_param must cover every parameter the optimizer updates")
            state = optimizer.state.get(param)
            if not state:
                raise ValueError(f"optimizer has no state for parameter {chunks[0].name!r}; call "
                                 "materialize_optimizer_state(optimizer) (or take a step) first")
            for key, value in sorted(state.items()):
                if not torch.is_tensor(value):
                    raise ValueError(f"optimizer state {key!r} of {chunks[0].name!r} is a {type(value).__name__}, "
                                     "not a tensor; only tensor state can be checkpointed")
                if value.shape == param.shape:
                    out.extend(LogicalChunk(f"optim.{key}.{c.name}", same_view_of(value, param, c.tensor),
                                            c.global_shape, c.offsets) for c in chunks)
                elif value.dim() == 0:
                    for name in dict.fromkeys(c.name for c in chunks):
                        out.append(LogicalChunk(f"optim.{key}.{name}", value, (), ()))
                else:
                    raise ValueError(f"optimizer state {key!r} of {chunks[0].name!r} has shape {tuple(value.shape)}: "
                                     f"neither the parameter's {tuple(param.shape)} nor a scalar")
    return out


@torch.no_grad()
def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (so a checkpoint can be loaded into it) without changing parameters.

    Runs one step with zero gradients and every learning rate set to 0, then restores learning rates and
    gradients. No-op when every parameter already has state; refuses a partly initialised optimizer
    (the step would alter the existing state).
    """
    materialize_state = getattr(optimizer, "materialize_state", None)
    if materialize_state is not None:      # an optimizer that creates its state itself (no step)
        materialize_state()
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.numel()]
    with_state = [p for p in params if optimizer.state.get(p)]
    if len(with_state) == len(params):
        return
    if with_state:
        raise ValueError(f"optimizer has state for {len(with_state)} of {len(params)} parameters; "
                         "materialize_optimizer_state needs a fresh optimizer")
    saved_grads = [p.grad for p in params]
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            g["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad
