"""What :class:`~megamoe.training.trainer.Trainer` needs of a model: the :class:`TrainableModel` protocol.

:class:`~megamoe.models.GPTMoEModel` meets it (with any :class:`~megamoe.models.LayerSpec`); so may a
model of one's own. :func:`check_trainable_model` checks a model up front and names what is missing,
instead of an AttributeError deep inside a training step.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from megamoe.moe.moe_layer import MoELayer

__all__ = ["TrainableModel", "check_trainable_model", "model_chunk_is_first", "model_chunk_is_last"]


@runtime_checkable
class TrainableModel(Protocol):
    """One pipeline stage of a model the Trainer can train (an ``nn.Module``).

    - ``config``: reads ``hidden_size`` (the hidden states passed between pipeline stages are
      [micro-batch, seq, hidden_size]), ``num_layers`` and ``moe`` (None, or the MoEConfig whose
      ``num_experts``, ``dispatcher`` and ``input_sharded`` the expert statistics and gradient
      reduction use); checkpoints also store ``config.to_dict()`` (a :class:`GPTMoEConfig` has all).
    - ``is_first_stage`` / ``is_last_stage``: whether this stage takes token ids / returns the loss.
    - ``tied_parameters()``: parameters held by both the first and the last stage whose gradients are
      summed over the embedding group (``()`` when none).
    - ``moe_layers()``: ``{global layer id: MoELayer}`` of this stage (layer ids < ``config.num_layers``, plus
      its ``mtp_num_layers`` if it has the field);
      every MoELayer (subclasses included) in the module tree must be listed.
    - ``forward(inputs, labels=None) -> (output, aux_loss [])``: ``inputs`` are token ids [B, S] on the
      first stage, the previous stage's hidden states otherwise; the output is the mean token loss
      (last stage, with ``labels``) or the hidden states for the next stage; ``aux_loss`` is this
      stage's sum of balancing losses (a 0-dim tensor, zero when there is none). Only for packed
      micro-batches (:class:`~megamoe.data.packing.MicroBatch`) does the Trainer also pass the
      keywords ``position_ids`` / ``document_ids`` [B, S] (those that are not None).

    Optional, for the interleaved pipeline schedule: ``virtual_pipeline_stages`` (an int; 1 when absent),
    and with more than one ``chunk_is_first(chunk)`` / ``chunk_is_last(chunk)`` and a ``chunk`` keyword
    of ``forward`` that runs that model chunk only (as :class:`~megamoe.models.GPTMoEModel` has).

    Parallel layers (:mod:`megamoe.tensor_parallel`) tag their parameters' sharding; a parameter of
    one's own that each rank holds a different piece of needs
    :func:`megamoe.sharding.shard_parameter`, or checkpoints and the gradient norm treat it as
    replicated.
    """

    config: Any
    is_first_stage: bool
    is_last_stage: bool

    def tied_parameters(self) -> tuple[nn.Parameter, ...]: ...

    def moe_layers(self) -> dict[int, MoELayer]: ...

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None): ...


_ATTRIBUTES = {
    "config": "the model config (hidden_size, num_layers, moe)",
    "is_first_stage": "whether this pipeline stage takes the token ids",
    "is_last_stage": "whether this pipeline stage computes the loss",
    "tied_parameters": "a method returning the parameters tied across the first and last stage, () if none",
    "moe_layers": "a method returning {layer id: MoELayer} of this stage, {} if none",
}
_CONFIG_FIELDS = ("hidden_size", "num_layers", "moe")
_FIX = ("the Trainer needs a model meeting the protocol megamoe.training.TrainableModel (its docstring lists "
        "what; GPTMoEModel meets it)")


def check_trainable_model(model) -> None:
    """TypeError naming the first thing ``model`` lacks of :class:`TrainableModel`."""
    kind = type(model).__name__
    if not isinstance(model, nn.Module):
        raise TypeError(f"{kind} is not a torch.nn.Module; {_FIX}")
    for name, what in _ATTRIBUTES.items():
        if not hasattr(model, name):
            raise TypeError(f"{kind} has no attribute {name!r} ({what}); {_FIX}")
    for name in ("tied_parameters", "moe_layers"):
        if not callable(getattr(model, name)):
            raise TypeError(f"{kind}.{name} must be a method ({_ATTRIBUTES[name]}); {_FIX}")
    for field in _CONFIG_FIELDS:
        if not hasattr(model.config, field):
            raise TypeError(f"{kind}.config ({type(model.config).__name__}) has no field {field!r}; {_FIX}")
    parameters = inspect.signature(model.forward).parameters
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())  # wrappers
    if "labels" not in parameters and not takes_any_keyword:
        raise TypeError(f"{kind}.forward takes no 'labels' argument: it must be forward(inputs, labels=None) -> "
                        f"(output, aux_loss); {_FIX}")
    virtual_stages = getattr(model, "virtual_pipeline_stages", 1)
    if virtual_stages != 1:
        for name in ("chunk_is_first", "chunk_is_last"):
            if not callable(getattr(model, name, None)):
                raise TypeError(f"{kind} has virtual_pipeline_stages={virtual_stages} but no method {name}(chunk); "
                                f"{_FIX}")
        if "chunk" not in parameters and not takes_any_keyword:
            raise TypeError(f"{kind} has virtual_pipeline_stages={virtual_stages} but its forward takes no 'chunk' "
                            f"keyword; {_FIX}")
    layers = model.moe_layers()
    if not isinstance(layers, dict):
        raise TypeError(f"{kind}.moe_layers() returned a {type(layers).__name__}, not a dict {{layer id: MoELayer}}; "
                        f"{_FIX}")
    for layer_id, layer in layers.items():
        if not isinstance(layer, MoELayer):
            raise TypeError(f"{kind}.moe_layers()[{layer_id!r}] is a {type(layer).__name__}, not a MoELayer; {_FIX}")
        count = model.config.num_layers + getattr(model.config, "mtp_num_layers", 0)     # MTP layers follow
        if not (isinstance(layer_id, int) and 0 <= layer_id < count):
            raise TypeError(f"{kind}.moe_layers() has the key {layer_id!r}: keys must be layer ids in "
                            f"[0, config.num_layers + mtp_num_layers = {count}); {_FIX}")
    listed = {id(layer) for layer in layers.values()}
    unlisted = [name for name, m in model.named_modules() if isinstance(m, MoELayer) and id(m) not in listed]
    if unlisted:
        raise TypeError(f"{kind}.moe_layers() leaves out the MoELayer modules {unlisted}: their expert loads and "
                        f"expert biases would not be updated; {_FIX}")


def model_chunk_is_first(model, chunk: int) -> bool:
    """Whether ``model``'s chunk ``chunk`` takes the token ids: ``is_first_stage`` without virtual stages."""
    if getattr(model, "virtual_pipeline_stages", 1) == 1:
        return model.is_first_stage
    return model.chunk_is_first(chunk)


def model_chunk_is_last(model, chunk: int) -> bool:
    """Whether ``model``'s chunk ``chunk`` returns the loss: ``is_last_stage`` without virtual stages."""
    if getattr(model, "virtual_pipeline_stages", 1) == 1:
        return model.is_last_stage
    return model.chunk_is_last(chunk)
