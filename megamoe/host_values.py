"""Reading tensor values on the host: the few places a training or decoding step needs them go through here.

Library code keeps values on the device of the model: a ``.item()``, ``.tolist()``, ``float(t)`` or
``bool(t)`` of an accelerator tensor waits for the device's queue to drain (a host synchronisation) and
has no value at all on the ``meta`` device. Where the host really needs values, which are data-dependent
sizes (an all-to-all's split sizes, the number of rows routed to the experts) and the step's metrics,
the code reads them with :func:`host_ints` / :func:`host_floats`, so that every such read is one
greppable call; ``megamoe.training.trainer``'s docstring lists those of a training step.

The ``meta`` device (shape-only dry runs: parameters and inputs without storage, e.g. the device-clean
harness of ``tests/test_device_clean.py``) has no values to read. There, :func:`host_floats` gives NaN
(a metric that was not measured), and :func:`host_ints` returns the ``on_meta`` values the caller
passes: the sizes that keep the dry run's shapes consistent, namely those of "every pair is dispatched
to every candidate rank". That is what torch's own meta ``nonzero`` assumes when
``torch.fx.experimental._config.meta_nonzero_assume_all_nonzero`` is set, so the two agree.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["host_ints", "host_floats"]


def host_ints(values: torch.Tensor, *, on_meta: Sequence[int]) -> list[int]:
    """The integers of ``values`` (any shape, flattened) on the host: one device-to-host copy (a
    synchronisation on accelerators). On the meta device: ``on_meta``, which must have ``values.numel()``
    entries (see the module docstring)."""
    if values.is_meta:
        assumed = [int(v) for v in on_meta]
        if len(assumed) != values.numel():
            raise ValueError(f"on_meta has {len(assumed)} values for a tensor of {values.numel()}: give one per "
                             "element")
        return assumed
    return [int(v) for v in values.reshape(-1).tolist()]


def host_floats(values: torch.Tensor) -> list[float]:
    """The values of ``values`` (any shape, flattened) as Python floats: one device-to-host copy. NaN
    for each element of a meta tensor (nothing was computed)."""
    if values.is_meta:
        return [float("nan")] * values.numel()
    return [float(v) for v in values.reshape(-1).tolist()]
