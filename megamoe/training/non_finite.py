"""Finding what went non-finite in a training step, once the step is known to be non-finite.

The normal step pays nothing for this: :class:`~megamoe.training.trainer.Trainer` decides on values every
rank already holds (the global gradient norm, the reduced loss) and only then calls
:func:`locate_non_finite`, on every rank alike (it is collective over the world). What it names, in order:

1. a parameter whose VALUE holds NaN or Inf (e.g. corrupted by an earlier step, or by hand): everything
   computed from it is non-finite, so it is the cause rather than a symptom;
2. if the forward was finite (the loss is), the gradient that went non-finite first in the backward: the
   one nearest the output (the last pipeline stage holding one, and there its last parameter in
   registration order, i.e. in forward order; the backward runs in reverse, and a non-finite gradient
   makes those of every earlier layer non-finite too);
3. otherwise the forward: the first module (in execution order, innermost first) whose output is
   non-finite, found by re-running micro-batch 0 through the pipeline with forward hooks (RNG states
   restored afterwards, gradients of the re-run discarded by the next step's ``zero_grad``; the
   interleaved schedule re-runs micro-batches 0 .. pp - 1, the fewest it takes).

"Stage" is the virtual pipeline stage under the interleaved schedule (model chunk ``c`` of pipeline rank
``r`` is stage ``c * pp + r``, see :class:`~megamoe.models.GPTMoEModel`), the pipeline rank otherwise.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megamoe import comms
from megamoe.gradients import main_grad
from megamoe.precision import has_non_finite

__all__ = ["NonFiniteTrainingError", "locate_non_finite"]


class NonFiniteTrainingError(RuntimeError):
    """Raised (on every rank) after ``TrainConfig.max_skipped_steps`` consecutive non-finite steps."""


def _first_non_finite_value(model: nn.Module) -> str | None:
    return next((name for name, p in model.named_parameters() if has_non_finite(p.detach())), None)


def _last_non_finite_gradient(model: nn.Module, gradients=None) -> str | None:
    named = gradients() if gradients is not None else [(n, main_grad(p)) for n, p in model.named_parameters()]
    bad = [name for name, g in named if g is not None and has_non_finite(g)]
    return bad[-1] if bad else None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _first_non_finite_module(model: nn.Module, rerun_forward: Callable[[], None]) -> str | None:
    found: list[str] = []

    def hook(name):
        def check(module, inputs, output):
            if not found and any(t.is_floating_point() and has_non_finite(t.detach()) for t in _tensors(output)):
                found.append(name or type(model).__name__)
        return check

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            rerun_forward()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def _gathered(report, world_group) -> list[tuple[int, object]]:
    """(global rank, report) of every rank whose report is not None."""
    reports = comms.all_gather_object(report, world_group)
    return [(rank, r) for rank, r in enumerate(reports) if r is not None]


def locate_non_finite(model: nn.Module, state, world_group, *, loss_finite: bool,
                      rerun_forward: Callable[[], None], gradients: Callable[[], list] | None = None) -> str:
    """What went non-finite first, in words naming the parameter or module and the rank (see the module
    docstring). Collective over ``world_group``: every rank calls it, with the same ``loss_finite``.
    ``gradients``: returns the (parameter name, reduced gradient) pairs to search, in registration order,
    where they are not the parameters' own (the distributed optimizer's shards); default: every parameter's
    :func:`~megamoe.gradients.main_grad` (``p.grad``, or the fp32 ``p.main_grad`` of a bf16 parameter)."""
    values = _gathered(_first_non_finite_value(model), world_group)
    if values:
        rank, name = values[0]
        return f"parameter {name!r} holds NaN or Inf (rank {rank})"
    if loss_finite:
        name = _last_non_finite_gradient(model, gradients)
        found = _on_stage(_gathered((_stage_of(model, state, name), name), world_group), max)
        if found is not None:
            rank, name = found
            return f"the gradient of parameter {name!r} went non-finite first in the backward (rank {rank})"
        return "the gradient norm is non-finite, but no gradient holds NaN or Inf (an overflow of the norm)"
    name = _first_non_finite_module(model, rerun_forward)
    found = _on_stage(_gathered((_stage_of(model, state, name), name), world_group), min)
    if found is not None:
        rank, name = found
        return f"the output of module {name!r} went non-finite first in the forward (rank {rank})"
    return "the loss is non-finite, but no parameter, gradient or module output holds NaN or Inf"


def _stage_of(model: nn.Module, state, name: str | None) -> int:
    """The pipeline stage holding parameter or module ``name`` of this rank: with virtual pipeline stages
    the virtual stage of its model chunk (``layers.<id>`` by the chunk holding the layer; the embedding of
    the first rank with chunk 0, the final norm, output layer and tied embedding copy with the last)."""
    virtual_stages = getattr(model, "virtual_pipeline_stages", 1)
    chunk_layers = getattr(model, "chunk_layer_ids", None)
    if virtual_stages == 1 or name is None or chunk_layers is None:
        return state.pp.rank
    parts = name.split(".")
    chunk = 0
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        # An MTP layer (id >= num_layers, in no chunk's range) runs after the last chunk.
        mtp = int(parts[1]) >= getattr(model.config, "num_layers", int(parts[1]) + 1)
        chunk = next((c for c, ids in enumerate(chunk_layers) if int(parts[1]) in ids), virtual_stages - 1 if mtp else 0)
    elif parts[0] in ("norm", "lm_head") or (parts[0] == "embed_tokens" and not model.is_first_stage):
        chunk = virtual_stages - 1
    return chunk * state.pp.size + state.pp.rank


def _on_stage(gathered: list, choose_stage) -> tuple[int, str] | None:
    """``(rank, name)`` of the first rank reporting a name on the stage ``choose_stage`` (max: the last
    stage, where the backward starts; min: the first, where the forward starts) among ranks' ``(stage,
    name or None)``; None when no rank found one."""
    found = [(rank, (stage, name)) for rank, (stage, name) in gathered if name is not None]
    if not found:
        return None
    stage = choose_stage(stage for _, (stage, _) in found)
    return next((rank, name) for rank, (s, name) in found if s == stage)
