"""The metric sinks (megamoe.training.metric_sinks): the JSON-lines log, TensorBoard event files read
back with tensorboard's EventAccumulator, a W&B run (through a test double of the wandb module: wandb
is an external service and is not installed), the records built from StepMetrics, rank 0 only, and
the errors for a missing package."""

import json
import math
import sys
import types

import pytest

from megamoe.cli.launch import run_script
from megamoe.training.metric_sinks import (JsonlSink, MissingPackageError, TensorBoardSink, WandbSink,
                                           build_metric_sinks, scalar_tags, step_record)
from megamoe.training.metrics_arguments import (add_metrics_arguments, check_metrics_arguments,
                                                 metric_sinks_from_arguments)
from megamoe.training.trainer import MoELayerMetrics, StepMetrics


def _metrics(step, loss=2.5):
    return StepMetrics(step=step, loss=loss, aux_loss=0.03, grad_norm=1.5, tokens_per_s=1000.0, balancedness=0.8,
                       tflops=0.25, mfu=None, peak_memory_bytes=1 << 30,
                       moe_layers={3: MoELayerMetrics(aux_loss=0.01, balancedness=0.7, tokens_per_expert=[5, 3]),
                                   1: MoELayerMetrics(aux_loss=0.02, balancedness=0.9, tokens_per_expert=[4, 4])})


def test_step_record_nests_the_layers_and_scalar_tags_flatten_it():
    record = step_record(_metrics(4), lr=1e-3, skipped=True)
    assert record["moe"] == {"layer_1": {"aux_loss": 0.02, "balancedness": 0.9, "tokens_per_expert": [4, 4]},
                             "layer_3": {"aux_loss": 0.01, "balancedness": 0.7, "tokens_per_expert": [5, 3]}}
    assert "moe_layers" not in record and record["lr"] == 1e-3 and record["time"] > 0
    tags = scalar_tags(record)
    assert tags == {"loss": 2.5, "aux_loss": 0.03, "grad_norm": 1.5, "tokens_per_s": 1000.0, "balancedness": 0.8,
                    "tflops": 0.25, "peak_memory_bytes": float(1 << 30), "lr": 1e-3, "skipped": 1.0, "consecutive_skips": 0.0,
                    "moe/layer_1/aux_loss": 0.02, "moe/layer_1/balancedness": 0.9,
                    "moe/layer_3/aux_loss": 0.01, "moe/layer_3/balancedness": 0.7}   # no step, time, lists, None


def test_jsonl_sink_appends_one_json_object_per_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"earlier": "run"}\n')
    sink = JsonlSink(path)
    sink.start_run({"run_id": "abc", "args": {"work_dir": tmp_path}})
    sink.write(step_record(_metrics(1)))
    sink.write(step_record(_metrics(2, loss=float("nan"))))
    sink.write({"step": 2, "eval_loss": 3.25})
    sink.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]   # strict JSON: no bare NaN
    assert lines[0] == {"earlier": "run"}
    assert lines[1]["run_id"] == "abc" and lines[1]["args"] == {"work_dir": str(tmp_path)} and "run_start" in lines[1]
    assert lines[2]["step"] == 1 and lines[2]["moe"]["layer_3"]["tokens_per_expert"] == [5, 3]
    assert lines[3]["loss"] == "nan"
    assert lines[4] == {"step": 2, "eval_loss": 3.25}


def test_tensorboard_sink_writes_event_files_that_tensorboard_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sink = TensorBoardSink(tmp_path / "tb")
    sink.start_run({"run_id": "abc"})
    for step in (1, 2, 3):
        sink.write(step_record(_metrics(step, loss=4.0 - step), lr=0.1 * step))
    sink.write({"step": 3, "eval_loss": 1.75})
    with pytest.raises(ValueError, match="step"):
        sink.write({"loss": 1.0})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"loss", "lr", "tflops", "eval_loss", "moe/layer_3/balancedness", "moe/layer_1/aux_loss"} <= scalars
    assert "mfu" not in scalars and "step" not in scalars
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert [e.step for e in events.Scalars("lr")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([0.1, 0.2, 0.3])
    assert [(e.step, e.value) for e in events.Scalars("eval_loss")] == [(3, 1.75)]
    assert [e.value for e in events.Scalars("moe/layer_3/balancedness")] == pytest.approx([0.7] * 3)


class _FakeWandbRun:
    def __init__(self, **init_kwargs):
        self.init_kwargs = init_kwargs
        self.config = types.SimpleNamespace(values=dict(init_kwargs["config"]),
                                            update=lambda d, allow_val_change=False: self.config.values.update(d))
        self.logged, self.finished = [], False

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


def _fake_wandb():
    """A test double of the ``wandb`` module (an external service, not installed here): ``init``
    returns a run that records what it receives."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(_FakeWandbRun(**kwargs))
        return module.runs[-1]
    module.init = init
    return module


def test_wandb_sink_logs_the_scalars_at_their_step(monkeypatch, tmp_path):
    wandb = _fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    sinks = build_metric_sinks(rank=0, wandb_project="moe-runs", wandb_run_name="r1", run_config={"lr": 0.1},
                               jsonl_path=tmp_path / "log.jsonl")
    with sinks:
        sinks.start_run({"run_id": "abc"})
        sinks.write(step_record(_metrics(1), lr=0.1))
        sinks.write({"step": 1, "eval_loss": 2.0})
    (run,) = wandb.runs
    assert run.init_kwargs["project"] == "moe-runs" and run.init_kwargs["name"] == "r1"
    assert run.config.values == {"lr": 0.1, "run_id": "abc"}
    assert [step for step, _ in run.logged] == [1, 1]
    assert run.logged[0][1]["moe/layer_3/balancedness"] == 0.7 and run.logged[0][1]["lr"] == 0.1
    assert run.logged[1][1] == {"eval_loss": 2.0}
    assert run.finished
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 3   # the JSON log got all of it too
    with pytest.raises(ValueError, match="project"):
        WandbSink("")


def test_only_rank_0_writes(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb())
    sinks = build_metric_sinks(rank=1, jsonl_path=tmp_path / "log.jsonl", tensorboard_dir=tmp_path / "tb",
                               wandb_project="p")
    sinks.write({"step": 1, "loss": 1.0})
    sinks.close()
    assert sinks.sinks == [] and list(tmp_path.iterdir()) == [] and sys.modules["wandb"].runs == []


@pytest.mark.parametrize("module, kwargs, pip", [
    ("wandb", {"wandb_project": "p"}, "pip install wandb"),
    ("torch.utils.tensorboard", {"tensorboard_dir": "tb"}, "pip install tensorboard"),
])
def test_a_missing_package_is_a_clear_error_and_leaves_nothing_behind(monkeypatch, tmp_path, capsys, module,
                                                                      kwargs, pip):
    monkeypatch.setitem(sys.modules, module, None)      # `import <module>` now raises ImportError
    kwargs = {k: (tmp_path / v if k == "tensorboard_dir" else v) for k, v in kwargs.items()}
    with pytest.raises(MissingPackageError, match=pip) as info:
        build_metric_sinks(rank=0, jsonl_path=tmp_path / "log.jsonl", **kwargs)
    assert isinstance(info.value, ImportError)
    assert list(tmp_path.iterdir()) == [], "no log file or event file left behind"

    # a script run through megamoe.cli.launch.run_script reports it as one error line, exit code 1
    def main(argv):
        build_metric_sinks(rank=0, **kwargs)
        return 0
    assert run_script(main, [], prog="train.py") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: ") and pip in err[0]


def test_non_finite_values_reach_tensorboard_as_numbers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with build_metric_sinks(rank=0, tensorboard_dir=tmp_path) as sinks:
        sinks.write({"step": 1, "loss": float("inf")})
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert math.isinf(events.Scalars("loss")[0].value)


def _parse(argv):
    import argparse
    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser)
    return parser.parse_args(argv)


def test_metrics_arguments_build_the_sinks_asked_for(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb())
    args = _parse(["--tensorboard", str(tmp_path / "tb"), "--wandb-project", "p", "--peak-tflops", "312"])
    check_metrics_arguments(args)
    assert args.peak_tflops == 312.0
    with metric_sinks_from_arguments(args, rank=0, jsonl_path=tmp_path / "log.jsonl") as sinks:
        assert [type(s).__name__ for s in sinks.sinks] == ["WandbSink", "TensorBoardSink", "JsonlSink"]
    defaults = _parse([])
    check_metrics_arguments(defaults)
    assert metric_sinks_from_arguments(defaults, rank=0, jsonl_path=None).sinks == []


@pytest.mark.parametrize("argv, message", [
    (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
    (["--wandb-run-name", "r"], "--wandb-run-name needs --wandb-project"),
    (["--wandb-project", " "], "--wandb-project must name a project"),
    (["--wandb-project", "p"], "pip install wandb"),              # wandb is not installed here
])
def test_metrics_argument_errors_name_the_flag(monkeypatch, argv, message):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=message):
        check_metrics_arguments(_parse(argv))


def test_tensorboard_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "tb").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        check_metrics_arguments(_parse(["--tensorboard", str(tmp_path / "tb")]))


def test_a_failing_wandb_login_leaves_no_local_file(monkeypatch, tmp_path):
    wandb = _fake_wandb()

    def refuse(**kwargs):
        raise ValueError("wandb: no API key configured; run wandb login")
    wandb.init = refuse
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    with pytest.raises(ValueError, match="wandb login"):
        build_metric_sinks(rank=0, jsonl_path=tmp_path / "log.jsonl", tensorboard_dir=tmp_path / "tb",
                           wandb_project="p")
    assert list(tmp_path.iterdir()) == []
