"""Communication overlapped with compute.

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_overlap.py."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch
from torch import nn

from megamoe import comms
from megamoe.cli.launch import UsageError, run_script
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.pipeline.schedule import forward_backward_no_pipelining
from megamoe.training.grad_buckets import GradReadiness, grad_bucket_numel, plan_buckets
from megamoe.training.grad_sync import GradientSync
from megamoe.training.optim_arguments import add_optim_arguments, train_config_kwargs
from megamoe.training.trainer import TrainConfig
from tests.helpers.tiny_model import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- fast: bucket assignment, readiness order, schedule hook, config validation ----------------------
class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(10))
        self.b = nn.Parameter(torch.zeros(30))
        self.c = nn.Parameter(torch.zeros(5, dtype=torch.float64))
        self.d = nn.Parameter(torch.zeros(8))
        self.e = nn.Parameter(torch.zeros(4))
        self.d.expert_parallel = True
        self.e.expert_parallel = True


def test_plan_buckets_reverse_order_bound_and_keys():
    m = _Mixed()
    names = {id(p): n for n, p in m.named_parameters()}

    def key(p):
        return (bool(getattr(p, "expert_parallel", False)), p.dtype)
    plan = plan_buckets(list(m.parameters()), key, lambda p: p.numel(), bucket_numel=12)
    got = [(b.key, [names[id(p)] for p in b.params], b.numel) for b in plan]
    assert got == [((True, torch.float32), ["e", "d"], 12),          # reverse registration order, bound 12
                   ((False, torch.float64), ["c"], 5),               # a dtype of its own
                   ((False, torch.float32), ["b"], 30),              # bigger than the bound: alone
                   ((False, torch.float32), ["a"], 10)]
    assert [len(b.params) for b in plan_buckets(list(m.parameters()), key, lambda p: p.numel(), 10 ** 6)] == [2, 1, 2]
    with pytest.raises(ValueError, match="bucket_numel"):
        plan_buckets([m.a], key, lambda p: 1, 0)


def test_grad_bucket_numel_is_fp32_megabytes():
    assert grad_bucket_numel(40.0) == 40 * 2 ** 20 // 4
    assert grad_bucket_numel(1e-9) == 1
    with pytest.raises(ValueError, match="grad_bucket_mb"):
        grad_bucket_numel(0)


def test_gradient_sync_buckets_by_group_dtype_and_deferral():
    """Single process: dense and expert parameters in separate buckets; with TP > 1 the sequence-parallel
    ones would be deferred (here TP 1: none is)."""
    from parallel_state import ParallelState
    m = _Mixed()
    sync = GradientSync(m, ParallelState.single_process(), bucket_numel=12)
    assert sync.num_buckets == 4 and not any(sync._deferred)
    groups = [{bool(getattr(p, "expert_parallel", False)) for p in b} for b in sync._buckets]
    assert groups == [{True}, {False}, {False}, {False}]
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    sync.sync()                                       # one rank: only the scales (1) apply
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in m.parameters())


def test_readiness_launches_in_bucket_order_only_when_armed():
    params = [nn.Parameter(torch.zeros(2)) for _ in range(4)]
    launched = []
    readiness = GradReadiness([[params[0]], [params[1]], [params[2]], [params[3]]], chunks=[0, 0, 0, 0],
                              order_keys=["g", "g", "h", "g"], deferred=[False, False, False, True],
                              launch=launched.append, hooks=True)

    def grad_of(p):
        (p * 1.0).sum().backward()
    grad_of(params[1])
    assert launched == [], "not armed: an earlier micro-batch's gradient is not final"
    readiness.arm(0)
    grad_of(params[1])
    assert launched == [], "bucket 1 waits for bucket 0 of its group (every rank launches in one order)"
    grad_of(params[2])
    assert launched == [2], "another group's bucket launches at once"
    grad_of(params[0])
    assert launched == [2, 0, 1]
    grad_of(params[3])
    assert launched == [2, 0, 1], "a deferred bucket never launches from a hook"
    readiness.finish()
    assert launched == [2, 0, 1], "finish launches what is left, never the deferred ones"
    readiness.arm(0)
    readiness.finish()
    assert launched == [2, 0, 1, 0, 1, 2], "a step whose hooks did not fire: everything at the end, in order"


def test_no_pipelining_calls_on_last_backward_before_the_last_backward():
    w = nn.Parameter(torch.ones(()))
    events = []
    w.register_post_accumulate_grad_hook(lambda p: events.append("grad"))

    def step(_, index):
        return w * (index + 1)
    forward_backward_no_pipelining(step, 3, on_last_backward=lambda chunk: events.append(("last", chunk)))
    assert events == ["grad", "grad", ("last", 0), "grad"]


def test_timeline_records_marked_regions_and_blocked_time():
    from megamoe.comms.timeline import TimelineEvent
    with comms.comm_timeline() as outer:
        with comms.comm_timeline() as inner, comms.timed("gemm", tag="x"):
            handle = comms.all_reduce_async(torch.ones(3), None, tag="x")    # one rank: completed, unrecorded
        assert torch.equal(handle.wait(), torch.ones(3)) and handle.done
    assert [e.phase for e in inner.events] == ["start", "end"] and outer.events == inner.events
    assert not comms.timeline._active_timelines
    synthetic = comms.Timeline([TimelineEvent("all_reduce", "issue", 0.0, "b"),
                                TimelineEvent("all_reduce", "wait_start", 2.0, "b"),
                                TimelineEvent("all_reduce", "wait", 2.5, "b"),
                                TimelineEvent("all_to_all", "wait_start", 3.0, "m"),
                                TimelineEvent("all_to_all", "wait", 4.0, "m")])
    assert synthetic.blocked_seconds("b") == 0.5 and synthetic.blocked_seconds() == 1.5
    assert synthetic.select("all_reduce", "issue") == [0.0]


def test_config_validation_names_the_fields():
    for bad in (0, -1.0, math.nan, math.inf, True, "40"):
        with pytest.raises(ValueError, match="TrainConfig.grad_bucket_mb"):
            TrainConfig(grad_bucket_mb=bad)
    with pytest.raises(ValueError, match="TrainConfig.overlap_grad_reduce"):
        TrainConfig(overlap_grad_reduce=1)
    with pytest.raises(ValueError, match="MoEConfig.shared_expert_overlap"):
        MoEConfig(router=RouterConfig(hidden_size=8, num_experts=2, top_k=1), ffn_hidden_size=8,
                  shared_expert_overlap="yes")
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    add_optim_arguments(parser)
    with pytest.raises(UsageError, match="--grad-bucket-mb must be a number > 0"):
        train_config_kwargs(parser.parse_args(["--grad-bucket-mb", "0"]), train_steps=10)
    kwargs = train_config_kwargs(parser.parse_args(["--overlap-grad-reduce", "--grad-bucket-mb", "2.5"]),
                                 train_steps=10)
    assert kwargs["overlap_grad_reduce"] is True and kwargs["grad_bucket_mb"] == 2.5


def test_shared_expert_overlap_is_an_engine_field():
    """A checkpoint resumes with either choice: only model-defining fields must match."""
    from megamoe.training.checkpoint import _config_differences
    on = tiny_config()
    on = dataclasses.replace(on, moe=dataclasses.replace(on.moe, shared_expert_overlap=True))
    assert _config_differences(tiny_config().to_dict(), on.to_dict()) == []
    wider = dataclasses.replace(on, moe=dataclasses.replace(on.moe, ffn_hidden_size=8))
    assert _config_differences(tiny_config().to_dict(), wider.to_dict()) == ["moe.ffn_hidden_size"]


def test_pretrain_script_rejects_bad_overlap_flags_in_one_line(demo, capsys, tmp_path):
    cases = {("--grad-bucket-mb", "-1"): "--grad-bucket-mb must be a number > 0 (MB of gradient per bucket), got -1.0",
             ("--moe-shared-expert-overlap", "--dispatcher", "allgather"):
                 "--moe-shared-expert-overlap overlaps the shared experts with the dispatch all-to-all: it needs "
                 "--dispatcher alltoall, got --dispatcher allgather"}
    for flags, message in cases.items():
        assert run_script(demo.main, [*flags, "--work-dir", str(tmp_path / "w")], prog=demo.PROG) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"{demo.PROG}: error: {message}"], err
