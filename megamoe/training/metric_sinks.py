"""Where step records go: a JSON-lines log, TensorBoard, Weights & Biases.

A record is a dict of JSON values: scalars (``step``, ``loss``, ``lr``, ``tflops``, ...) and nested
dicts of them, e.g. ``{"step": 3, "loss": 2.1, "moe": {"layer_1": {"balancedness": 0.9, ...}}}``
(:func:`step_record` builds one from :class:`~megamoe.training.trainer.StepMetrics`). The JSON log
keeps it as it is, one line per record; TensorBoard and W&B get its numbers flattened to tags
joined by ``/`` (:func:`scalar_tags`: ``moe/layer_1/balancedness``), at the record's ``step``. Lists
(the per-expert loads), strings and None (``mfu`` without a peak) are not scalars and are skipped
there; booleans (``skipped``) become 0 / 1.

:func:`build_metric_sinks` builds the sinks asked for on rank 0 and none elsewhere: only rank 0
writes. TensorBoard needs the ``tensorboard`` package and W&B the ``wandb`` package; asking for one
without it raises :class:`MissingPackageError` naming the pip command (a ValueError too, so scripts
report it as one ``error:`` line).

``start_run(info)`` records a run's start (its id, arguments...): the JSON log writes a
``{"run_start": <UTC time>, **info}`` line, TensorBoard a text summary, W&B merges it into the run
config.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Protocol

__all__ = ["JsonlSink", "MetricSink", "MetricSinks", "MissingPackageError", "TensorBoardSink", "WandbSink",
           "build_metric_sinks", "require_sink_packages", "scalar_tags", "step_record"]

logger = logging.getLogger(__name__)

# Keys of a record that are not metrics: the x axis and the wall-clock time (TensorBoard and W&B
# stamp their own).
_NOT_SCALARS = ("step", "time")


class MissingPackageError(ImportError, ValueError):
    """An optional package a sink needs is not installed (the message names the pip command)."""


# (module, what needs it, the pip command installing it)
_TENSORBOARD = ("torch.utils.tensorboard", "TensorBoard logging (tensorboard_dir)",
                "pip install tensorboard (or pip install 'megamoe[tensorboard]')")
_WANDB = ("wandb", "Weights & Biases logging (wandb_project)", "pip install wandb")


def require_sink_packages(*, tensorboard: bool = False, wandb: bool = False) -> None:
    """:class:`MissingPackageError` unless the packages of the sinks asked for are importable."""
    if tensorboard:
        _import_optional(*_TENSORBOARD)
    if wandb:
        _import_optional(*_WANDB)


def _import_optional(module: str, what: str, pip: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingPackageError(f"{what} needs a package that is not installed ({e}): {pip}") from e


class MetricSink(Protocol):
    def start_run(self, info: Mapping[str, Any]) -> None: ...

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def step_record(metrics, **extra: Any) -> dict[str, Any]:
    """The record of one :class:`~megamoe.training.trainer.StepMetrics` (any dataclass works): its
    fields, with ``moe_layers`` as ``moe: {"layer_<id>": {aux_loss, balancedness,
    tokens_per_expert}}``, the wall-clock ``time``, and ``extra`` (e.g. ``lr=...``) added."""
    record = dataclasses.asdict(metrics)
    layers = record.pop("moe_layers", None) or {}
    if layers:
        record["moe"] = {f"layer_{layer_id}": values for layer_id, values in sorted(layers.items())}
    record["time"] = time.time()
    record.update(extra)
    return record


def scalar_tags(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numbers as ``{"a/b/c": float}`` (see the module docstring); ``step`` and ``time``
    excluded."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in _NOT_SCALARS:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalar_tags(value, f"{tag}/"))
        elif isinstance(value, bool):
            out[tag] = float(value)
        elif isinstance(value, (int, float)):
            out[tag] = float(value)
    return out


def _step_of(record: Mapping[str, Any]) -> int:
    if "step" not in record:
        raise ValueError(f"a metric record needs a 'step', got keys {sorted(record)}")
    return int(record["step"])


def _json_safe(value):
    """NaN and infinities as strings: JSON has no literal for them (json.dumps would write NaN,
    which strict parsers reject); a non-finite loss is exactly what one wants to see in the log."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


class JsonlSink:
    """Appends one JSON object per line to ``path`` (created if missing, earlier runs kept), flushed
    after every record so that a crash loses at most the line being written."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")

    def start_run(self, info: Mapping[str, Any]) -> None:
        self._write({"run_start": datetime.datetime.now(datetime.timezone.utc).isoformat(), **info})

    def write(self, record: Mapping[str, Any]) -> None:
        self._write(record)

    def _write(self, record: Mapping[str, Any]) -> None:
        try:
            self._file.write(json.dumps(_json_safe(dict(record))) + "\n")
            self._file.flush()
        except OSError as e:        # a full disk, say: the error names the file (the OS's does not)
            raise self._write_error(e) from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as e:        # what a failed write left in the buffer fails again: name the file
            raise self._write_error(e) from None

    def _write_error(self, e: OSError) -> OSError:
        error = OSError(f"cannot write the metrics log {self.path}: {e.strerror or e}")
        error.errno = e.errno
        return error


class TensorBoardSink:
    """``torch.utils.tensorboard.SummaryWriter`` event files in ``log_dir`` (``tensorboard --logdir``)."""

    def __init__(self, log_dir: str | os.PathLike):
        tensorboard = _import_optional(*_TENSORBOARD)
        self.log_dir = Path(log_dir)
        self._writer = tensorboard.SummaryWriter(log_dir=os.fspath(self.log_dir))

    def start_run(self, info: Mapping[str, Any]) -> None:
        self._writer.add_text("run_start", "```\n" + json.dumps(_json_safe(dict(info)), indent=1) + "\n```")

    def write(self, record: Mapping[str, Any]) -> None:
        step = _step_of(record)
        for tag, value in scalar_tags(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run in ``project`` (``wandb.init(project=..., name=..., config=...)``); the
    usual W&B environment (``WANDB_API_KEY``, ``WANDB_MODE=offline``, ``WANDB_DIR``, ...) applies."""

    def __init__(self, project: str, *, run_name: str | None = None, config: Mapping[str, Any] | None = None):
        if not project:
            raise ValueError("WandbSink: project must be a non-empty W&B project name")
        wandb = _import_optional(*_WANDB)
        self._run = wandb.init(project=project, name=run_name, config=_json_safe(dict(config or {})))

    def start_run(self, info: Mapping[str, Any]) -> None:
        self._run.config.update(_json_safe(dict(info)), allow_val_change=True)

    def write(self, record: Mapping[str, Any]) -> None:
        self._run.log(scalar_tags(record), step=_step_of(record))

    def close(self) -> None:
        self._run.finish()


class MetricSinks:
    """Several sinks as one (none at all on ranks other than 0): each call goes to every sink.
    A context manager: leaving it closes them."""

    def __init__(self, sinks: list[MetricSink] | tuple[MetricSink, ...] = ()):
        self.sinks = list(sinks)

    def start_run(self, info: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.start_run(info)

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_metric_sinks(*, rank: int, jsonl_path: str | os.PathLike | None = None,
                       tensorboard_dir: str | os.PathLike | None = None, wandb_project: str | None = None,
                       wandb_run_name: str | None = None, run_config: Mapping[str, Any] | None = None
                       ) -> MetricSinks:
    """The sinks asked for (a path / project given) on rank 0; an empty :class:`MetricSinks` on the
    other ranks. Raises :class:`MissingPackageError` for a sink whose package is missing, before
    anything is created."""
    if rank != 0:
        return MetricSinks()
    # Both imports first: a missing package then leaves no log file or event file behind.
    require_sink_packages(tensorboard=tensorboard_dir is not None, wandb=wandb_project is not None)
    # The W&B run first (the likeliest to fail: a login, the network), the local files last: a
    # failure then leaves no new file behind.
    sinks: list[MetricSink] = []
    try:
        if wandb_project is not None:
            sinks.append(WandbSink(wandb_project, run_name=wandb_run_name, config=run_config))
        if tensorboard_dir is not None:
            sinks.append(TensorBoardSink(tensorboard_dir))
            logger.info("TensorBoard event files in %s", tensorboard_dir)
        if jsonl_path is not None:
            sinks.append(JsonlSink(jsonl_path))
    except BaseException:
        MetricSinks(sinks).close()
        raise
    return MetricSinks(sinks)

