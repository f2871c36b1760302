"""Reading tensor values on the host: the few places a training or decoding step needs them go through here.

Library code keeps values on the device of the model: a ``.item()``, ``.tolist()``, ``float(t)`` or
``bool(t)`` of an accelerator tensor waits for the device's queue to drain (a host synchronisation) and
has no value at all on the ``meta`` device. Where the host really needs values, which are data-dependent
sizes (an all-to-all's split sizes, the number of rows routed to the experts) and the step's metrics,
the code reads them with :func:`host_ints` / :func:`host_floats`, so that every such read is one
greppable call; ``megamoe.training.trainer``'s docstring lists those of a training step.

The ``meta`` device (shape-only dry runs: parameters and inputs without storage, e.g. the device-clean
harness of ``tests/unit/test_device_clean.py``) has no values to read. There, :func:`host_floats` gives NaN
(a metric that was not measured), and :func:`host_ints` returns the ``on_meta`` values the caller
passes: the sizes that keep the dry run's shapes consistent, namely those of "every pair is dispatched
to every candidate rank". That is what torch's own meta ``nonzero`` assumes when
``torch.fx.experimental._config.meta_nonzero_assume_all_nonzero`` is set, so the two agree.

:func:`count_host_reads` records, on any device, the operations that read device values on the host
(these reads, ``.item()``, ``nonzero``, boolean-mask indexing...): how the tests count the host
synchronisations of an MoE layer on CPU, where the same operations run.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["host_ints", "host_floats", "even_split", "count_host_reads"]


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
    return [int(v) for v in _to_host(values).tolist()]


def even_split(total: int, parts: int) -> list[int]:
    """``total`` spread as evenly as possible over ``parts`` (the first ones one larger): the per-slot row
    counts a meta dry run assumes."""
    return [total // parts + (p < total % parts) for p in range(parts)]


def host_floats(values: torch.Tensor) -> list[float]:
    """The values of ``values`` (any shape, flattened) as Python floats: one device-to-host copy. NaN
    for each element of a meta tensor (nothing was computed)."""
    if values.is_meta:
        return [float("nan")] * values.numel()
    return [float(v) for v in _to_host(values).tolist()]


def _to_host(values: torch.Tensor) -> torch.Tensor:
    # An explicit copy to the CPU (what ``.tolist()`` of a device tensor does anyway), so that the read is
    # an operation :func:`count_host_reads` sees on the CPU too: there, ``.tolist()`` reads memory directly.
    return values.detach().reshape(-1).to("cpu", copy=True)


# Operations whose result the host needs before it can go on: a value (``.item()``, ``int(t)``, ``bool(t)``),
# or a data-dependent output size.
_HOST_READ_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
                  "aten::_unique2", "aten::unique_consecutive", "aten::bincount", "aten::equal", "aten::is_nonzero",
                  "aten::histc"}


def _reads_host(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in _HOST_READ_OPS:
        return True
    if name == "aten::_to_copy":                # an explicit copy to the host (see _to_host)
        return kwargs.get("device") == torch.device("cpu")
    if name == "aten::copy_":                   # a device tensor copied into a host one
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    if name == "aten::repeat_interleave" and len(args) == 1:      # repeats tensor, output size unknown
        return kwargs.get("output_size") is None
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        return any(i is not None and i.dtype == torch.bool for i in args[1])     # boolean mask: a nonzero
    return False


class _HostReadRecorder(TorchDispatchMode):
    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_host(func, args, kwargs):
            self.reads.append(func._schema.name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_reads() -> Iterator[list[str]]:
    """Yields a list that collects the name of every operation run inside the block that reads device values
    on the host (a synchronisation on accelerators; see the module docstring): ``len(reads)`` is the count.
    On the CPU it sees the same operations an accelerator would wait on."""
    reads: list[str] = []
    with _HostReadRecorder(reads):
        yield reads
