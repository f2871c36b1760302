"""The steps HF conversion is made of, and the streaming engine that runs them (used by
:mod:`megamoe.hf.adapters`, whose docstring describes the guarantees).

A :class:`KeyTransform` turns a few named tensors of one side (HF) into a few of the other (megamoe
logical names), both ways, with every shape known; :func:`_run` feeds ``(key, tensor)`` pairs in any
order through a list of steps, holding only the inputs of unfinished steps, and raises
:class:`AdapterError` naming the key for anything unknown, repeated, missing or mis-shaped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

__all__ = ["AdapterError", "KeyTransform", "Shape", "Tensors"]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
Tensors = Sequence[torch.Tensor]


class AdapterError(ValueError):
    """A key or tensor that does not fit the family's key map for the given config."""


@dataclass(frozen=True)
class KeyTransform:
    """One step: HF tensors ``hf_keys`` <-> logical tensors ``logical_keys`` (each list in order).

    ``to_logical`` / ``to_hf`` take and return tensors in those orders; outputs may be views of the
    inputs, or an iterator computing each output as it is consumed. ``what`` names the step in errors.
    """

    hf_keys: tuple[str, ...]
    hf_shapes: tuple[Shape, ...]
    logical_keys: tuple[str, ...]
    logical_shapes: tuple[Shape, ...]
    to_logical: Callable[[Tensors], Tensors]
    to_hf: Callable[[Tensors], Tensors]
    what: str = "rename"

    @property
    def is_rename(self) -> bool:
        """One tensor under two names: the output is the input tensor itself."""
        return self.to_logical is _identity and self.to_hf is _identity

    def side(self, to_logical: bool):
        """(input keys, input shapes, output keys, output shapes, function) of one direction."""
        if to_logical:
            return self.hf_keys, self.hf_shapes, self.logical_keys, self.logical_shapes, self.to_logical
        return self.logical_keys, self.logical_shapes, self.hf_keys, self.hf_shapes, self.to_hf


def _identity(tensors: Tensors) -> Tensors:
    return tensors


def _in_step_order(state: Mapping[str, torch.Tensor], steps: list[KeyTransform],
                   to_logical: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``state``'s items, each step's inputs together and in step order (unknown keys last), read lazily."""
    order: dict[str, int] = {}
    for index, step in enumerate(steps):
        for key in step.side(to_logical)[0]:
            order.setdefault(key, index)
    unknown = len(steps)
    for key in sorted(state.keys(), key=lambda k: order.get(k, unknown)):
        yield key, state[key]


def _run(items: Iterable[tuple[str, torch.Tensor]], steps: list[KeyTransform], *, to_logical: bool,
         skip: Callable[[str], bool], side: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Feed ``items`` through ``steps``; see the module docstring for the guarantees."""
    step_of: dict[str, KeyTransform] = {}
    for step in steps:
        for key in step.side(to_logical)[0]:
            step_of[key] = step
    expected_outputs: dict[str, list[KeyTransform]] = {}
    for step in steps:
        for key in step.side(to_logical)[2]:
            expected_outputs.setdefault(key, []).append(step)
    pending: dict[int, dict[str, torch.Tensor]] = {}
    consumed: set[str] = set()
    produced_by: dict[str, str] = {}
    for key, tensor in items:
        step = step_of.get(key)
        if step is None:
            if skip(key):
                logger.debug("ignoring %s key %s", side, key)
                continue
            raise AdapterError(f"unexpected {side} key {key!r}: it is not part of the model the config describes")
        if key in consumed:
            raise AdapterError(f"{side} key {key!r} was given twice")
        consumed.add(key)
        inputs, input_shapes, outputs, output_shapes, fn = step.side(to_logical)
        expected = input_shapes[inputs.index(key)]
        if tuple(tensor.shape) != expected:
            raise AdapterError(f"{side} key {key!r} has shape {tuple(tensor.shape)}, the config expects {expected}")
        buffer = pending.setdefault(id(step), {})
        buffer[key] = tensor
        if len(buffer) < len(inputs):
            continue
        del pending[id(step)]
        results = fn([buffer[k] for k in inputs])
        source = ", ".join(inputs) if len(inputs) <= 2 else f"{inputs[0]} ... ({len(inputs)} keys)"
        for out_key, out_shape, out in zip(outputs, output_shapes, results, strict=True):
            if tuple(out.shape) != out_shape:       # a transform bug, not a user error
                raise AssertionError(f"{step.what} produced {out_key!r} of shape {tuple(out.shape)}, not {out_shape}")
            if out_key in produced_by:
                raise AdapterError(f"{out_key!r} is given twice: by {produced_by[out_key]} and by {source} (an HF "
                                   "state holding both the per-expert and the fused form of the same experts?)")
            produced_by[out_key] = source
            yield out_key, out
    _check_complete(pending, steps, expected_outputs, produced_by, to_logical, side)


def _check_complete(pending, steps, expected_outputs, produced_by, to_logical: bool, side: str) -> None:
    problems = []
    for step in steps:
        buffer = pending.get(id(step))
        if buffer:
            missing = [k for k in step.side(to_logical)[0] if k not in buffer]
            problems.append(f"{step.what}: got {len(buffer)} of its {len(buffer) + len(missing)} {side} keys, "
                            f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    missing_outputs = [k for k in expected_outputs if k not in produced_by]
    for key in missing_outputs[:8]:
        sources = [" + ".join(s.side(to_logical)[0][:2]) + (" ..." if len(s.side(to_logical)[0]) > 2 else "")
                   for s in expected_outputs[key]]
        problems.append(f"missing {side} key for {key!r}: expected {' or '.join(repr(s) for s in sources)}")
    if len(missing_outputs) > 8:
        problems.append(f"... and {len(missing_outputs) - 8} more missing")
    if problems:
        raise AdapterError("incomplete conversion:\n  " + "\n  ".join(problems))
