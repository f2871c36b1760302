"""Communication overlapped with compute: gradient buckets reduced asynchronously from backward hooks
(``TrainConfig.overlap_grad_reduce``, plain all-reduce and the distributed optimizer's reduce-scatter) and the
MoE dispatch all-to-all in flight while the shared experts compute (``MoEConfig.shared_expert_overlap``).

The oracle is the non-overlapped run of the same layout and bucket size: losses and gradient norms bit for bit,
and the same collectives with the same bytes. The layouts of issue #17 (MoE parallel folding, context
parallelism, the interleaved pipeline) with overlap on are also held to one process's losses (rel <= 1e-5). The timeline (:func:`megamoe.comms.comm_timeline`) proves the
overlap: a gradient bucket's collective is issued before the backward produced its last gradient, and the
shared experts' GEMMs run between the dispatch all-to-all's issue and its wait; the non-overlapped runs fail
both checks (negative controls)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer.recompute import RecomputeConfig
from tests.helpers.tiny_model import S, V, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 4
STEPS = 2
GLOBAL_BATCH, MICRO = 8, 1        # 4 micro-batches of 1 sequence per DP rank at dp 2, 2 at dp 4
SMALL_BUCKET_MB = 0.016           # ~4k fp32 elements: several buckets in the tiny model


# ---- multi-rank: one spawn, every layout ------------------------------------------------------------
def _batches(steps):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, V, (steps, GLOBAL_BATCH, S + 1), generator=g)


def _run(state, *, overlap: bool, bucket_mb: float, distributed=False, zero_stage=1, shared_overlap=False,
         recompute=None, sequence_parallel=False, virtual_pipeline_stages=1, single_process=False):
    """Losses, grad norms, comm bytes and calls, the last step's timeline and last-gradient time, deferred buckets."""
    config = tiny_config("alltoall")
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, shared_expert_overlap=shared_overlap),
                                 sequence_parallel=sequence_parallel)
    if recompute is not None:      # the overlapped MoE forward runs again inside the backward
        config = dataclasses.replace(config, recompute=RecomputeConfig(recompute))
    model = GPTMoEModel(config, state, virtual_pipeline_stages=virtual_pipeline_stages)
    initialize_parameters(model, seed=0)
    # Registered before the Trainer's hooks, so each records its gradient before a bucket launches from it.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: comms.record_event("param_grad", "end"))
    trainer = Trainer(model, state, TrainConfig(lr=1e-2, distributed_optimizer=distributed, zero_stage=zero_stage,
                                                overlap_grad_reduce=overlap, grad_bucket_mb=bucket_mb),
                      world_group=None if single_process else dist.group.WORLD)
    per_rank = GLOBAL_BATCH // state.dp.size      # CP ranks train on the same sequences
    losses, norms = [], []
    with comms.comm_counter() as counter:
        for batch in _batches(STEPS):
            mine = batch[state.dp.rank * per_rank:(state.dp.rank + 1) * per_rank]
            with comms.comm_timeline() as timeline:
                m = trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO)])
            losses.append(m.loss)
            norms.append(m.grad_norm)
    last_grad = max(timeline.select("param_grad", "end"))
    reducer = trainer.optimizer if distributed else trainer.grad_sync
    return dict(losses=losses, norms=norms, bytes=dict(counter._bytes), calls=dict(counter._calls),
                events=list(timeline.events), last_grad=last_grad, deferred=reducer.num_deferred_buckets)


def _bucket_issues(run, kind):
    return [e.time for e in run["events"] if e.name == kind and e.phase == "issue" and e.tag == "grad_bucket"]


def _runs_in_flight(events, region: str, tag: str) -> bool:
    """Every ``region`` compute span ran after an all-to-all tagged ``tag`` was issued and before anyone
    waited for it (no wait of a ``tag`` collective between that issue and the span's end); at least one span."""
    spans = 0
    for i, e in enumerate(events):
        if e.name != region or e.phase != "start":
            continue
        spans += 1
        end = next(j for j in range(i + 1, len(events)) if events[j].name == region and events[j].phase == "end")
        before = [x for x in events[:i] if x.tag == tag]
        after = [x for x in events[end + 1:] if x.tag == tag]
        if not (before and before[-1].phase == "issue" and after and after[0].phase in ("wait_start", "wait")):
            return False
        if not before[-1].time <= e.time <= events[end].time <= after[0].time:
            return False
    return spans > 0


def _shared_experts_in_flight(events) -> bool:
    """The shared experts' gate / up GEMMs inside the dispatch all-to-all, their down GEMM inside the combine's."""
    return (_runs_in_flight(events, "shared_experts_up", "moe_dispatch")
            and _runs_in_flight(events, "shared_experts_down", "moe_combine"))


_SINGLE_PROCESS: dict = {}


def _single_process_losses(**kwargs):
    """The oracle of the layouts issue #17 added: the same steps on one process, without overlap (once per
    model: shared-expert overlap and virtual stages do not change it)."""
    from parallel_state import ParallelState
    kwargs = {k: v for k, v in kwargs.items() if k not in ("shared_overlap", "virtual_pipeline_stages")}
    key = tuple(sorted(kwargs.items()))
    if key not in _SINGLE_PROCESS:
        _SINGLE_PROCESS[key] = _run(ParallelState.single_process(), overlap=False, bucket_mb=SMALL_BUCKET_MB,
                                    single_process=True, **kwargs)["losses"]
    return _SINGLE_PROCESS[key]


def _layout_checks(rank, world, layout, oracle=False, **kwargs):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    state = initialize_model_parallel(**layout)
    try:
        kind = "reduce_scatter" if kwargs.get("distributed") else "all_reduce"
        on = _run(state, overlap=True, bucket_mb=SMALL_BUCKET_MB, **kwargs)
        out = {
            "reduction_bytes": sum(v for (k, _), v in on["bytes"].items() if k == kind),
            "issued_before_last_grad": min(_bucket_issues(on, kind), default=math.inf) < on["last_grad"],
            "buckets_launched": len(_bucket_issues(on, kind)),
            "deferred_buckets": on["deferred"],
        }
        if oracle != "on_only":     # the non-overlapped run: bit for bit the same, and the negative control
            off = _run(state, overlap=False, bucket_mb=SMALL_BUCKET_MB, **kwargs)
            out.update({
                "bit_identical": on["losses"] == off["losses"] and on["norms"] == off["norms"],
                "same_comms": on["bytes"] == off["bytes"] and on["calls"] == off["calls"],
                "off_issued_before_last_grad": min(_bucket_issues(off, kind), default=math.inf) < off["last_grad"],
                # Reported, never asserted (wall-clock): seconds blocked waiting for the gradient buckets.
                "blocked_s": (comms.Timeline(on["events"]).blocked_seconds("grad_bucket"),
                              comms.Timeline(off["events"]).blocked_seconds("grad_bucket")),
            })
        if kwargs.get("shared_overlap"):
            out["shared_in_flight"] = _shared_experts_in_flight(on["events"])
        if kwargs.get("shared_overlap") and not oracle:     # the negative control, once per kind of layout
            plain = _run(state, overlap=False, bucket_mb=SMALL_BUCKET_MB, **{**kwargs, "shared_overlap": False})
            out["shared_bit_identical"] = plain["losses"] == off["losses"] and plain["norms"] == off["norms"]
            out["plain_shared_in_flight"] = _shared_experts_in_flight(plain["events"])
        if oracle:
            single = _single_process_losses(**kwargs)
            out["single_process_rel"] = max(abs(a - b) / abs(b) for a, b in zip(on["losses"], single))
        if layout == {} and not kwargs:
            # Another bucket size: the same sums in other buffers, equal within fp32 rounding.
            big = _run(state, overlap=True, bucket_mb=40.0)
            out["other_bucket_rel"] = max(abs(a - b) / abs(b) for a, b in zip(big["losses"], off["losses"]))
        return out
    finally:
        destroy_model_parallel()


LAYOUTS = {
    "plain-dp4": ({}, {}),
    "zero1-dp4": ({}, dict(distributed=True, zero_stage=1)),
    "zero2-dp4": ({}, dict(distributed=True, zero_stage=2)),
    "pp2-1f1b-dp2": (dict(pp=2), {}),
    # Sequence-parallel parameters: summed over TP first, so in deferred buckets reduced after the backward.
    "tp2-sp-dp2": (dict(tp=2), dict(sequence_parallel=True)),
    "ep2-dp2-zero1-shared-experts-recompute": (dict(ep=2), dict(distributed=True, shared_overlap=True,
                                                                recompute="full")),
    # The layouts of issue #17, overlap on, against one process too (oracle=True): MoE parallel folding
    # (its router / shared-expert gradients are summed over TP first: deferred buckets), context parallelism,
    # and the interleaved pipeline (buckets per model chunk, armed by each chunk's last backward).
    "tp2-etp1-ep4-fold-shared-experts": (dict(tp=2, etp=1, ep=4), dict(shared_overlap=True, oracle=True)),
    "cp2-ep2-dp2-shared-experts": (dict(cp=2, ep=2), dict(shared_overlap=True, oracle=True)),
    "pp2-v2-ep2-dp2-shared-experts": (dict(pp=2, ep=2), dict(shared_overlap=True, virtual_pipeline_stages=2,
                                                             oracle=True)),
    # The rest of them, overlap on only, against one process.
    "tp2-sp-etp1-ep4-fold": (dict(tp=2, etp=1, ep=4), dict(sequence_parallel=True, oracle="on_only")),
    "cp2-tp2-etp2": (dict(cp=2, tp=2, etp=2), dict(oracle="on_only")),
    "pp2-v2-dp2": (dict(pp=2), dict(virtual_pipeline_stages=2, oracle="on_only")),
}
DEFERRED = ("tp2-sp", "tp2-etp1")      # layouts with TP-summed (sequence-parallel-tagged) parameters


def _all_layouts(rank, world):
    torch.set_num_threads(1)
    return {name: _layout_checks(rank, world, layout, **kwargs) for name, (layout, kwargs) in LAYOUTS.items()}


@pytest.mark.slow
def test_overlap_is_bit_identical_moves_the_same_bytes_and_overlaps():
    results = run_on_ranks(_all_layouts, WORLD, timeout_s=300)
    for rank, per_layout in enumerate(results):
        for name, r in per_layout.items():
            where = f"{name}, rank {rank}"
            if "bit_identical" in r:
                assert r["bit_identical"], f"{where}: overlap changed the losses or gradient norms"
                assert r["same_comms"], f"{where}: overlap changed the collectives or their bytes"
                assert not r["off_issued_before_last_grad"], f"{where}: without overlap buckets start after the backward"
            assert r["reduction_bytes"] > 0 and r["buckets_launched"] > 1, where
            assert r["issued_before_last_grad"], f"{where}: no bucket started before the backward's last gradient"
            if "shared_in_flight" in r:
                assert r["shared_in_flight"], f"{where}: shared experts not inside the dispatch all-to-all"
            if "plain_shared_in_flight" in r:
                assert r["shared_bit_identical"], f"{where}: shared_expert_overlap changed the results"
                assert not r["plain_shared_in_flight"], f"{where}: without overlap they run after the wait"
            assert (r["deferred_buckets"] > 0) == name.startswith(DEFERRED), f"{where}: {r['deferred_buckets']}"
            if "single_process_rel" in r:
                assert r["single_process_rel"] <= 1e-5, f"{where}: overlap on is off the one-process curve"
            if "other_bucket_rel" in r:
                assert r["other_bucket_rel"] <= 1e-6, f"{where}: another bucket size changed the loss"


class _FakeCudaEvent:
    """torch.cuda.Event's timing interface over a simulated device clock (``now_ms``): record() stamps the
    stream's current time, elapsed_time() is the difference, as CUDA's (milliseconds)."""
    now_ms = 0.0
    streams: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing, "a timeline's events must time"
        self.at = None

    def record(self, stream=None):
        _FakeCudaEvent.streams.append(stream)
        self.at = _FakeCudaEvent.now_ms

    def synchronize(self):
        assert self.at is not None, "synchronised before it was recorded"

    def elapsed_time(self, end):
        return end.at - self.at


class _StreamWaitWork:
    """A NCCL-like Work: wait() returns at once on the host; the stream waits ``blocked_ms`` for the data."""

    def __init__(self, blocked_ms):
        self.blocked_ms = blocked_ms

    def wait(self):
        _FakeCudaEvent.now_ms += self.blocked_ms


def test_cuda_timelines_time_waits_and_compute_with_stream_events(monkeypatch):
    # On CUDA the blocked time is the stream's (events before and after wait()), not the host's (about 0).
    from megamoe.comms import stream_clock
    from megamoe.comms.async_collectives import CommHandle
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))
    monkeypatch.setattr(_FakeCudaEvent, "now_ms", 1000.0)
    monkeypatch.setattr(_FakeCudaEvent, "streams", [])
    assert stream_clock.clock_for("cpu") is stream_clock.HOST_CLOCK is stream_clock.clock_for("meta")
    assert stream_clock.clock_for(None) is stream_clock.HOST_CLOCK
    with comms.comm_timeline(device="cuda:1") as timeline:
        assert isinstance(timeline.clock, stream_clock.CudaEventClock) and timeline.clock.device.index == 1
        handle = CommHandle(_StreamWaitWork(blocked_ms=250.0), torch.ones(2), "all_reduce", None, "b")
        with comms.timed("gemm", tag="g"):
            _FakeCudaEvent.now_ms += 40.0        # the region's kernels run 40 ms on the device
        handle.wait()
        _FakeCudaEvent.now_ms += 5.0
        with comms.comm_timeline(device="cuda:1") as inner:     # a nested timeline stamps the same events
            handle2 = CommHandle(_StreamWaitWork(blocked_ms=125.0), torch.ones(2), "all_to_all", None, "m")
            handle2.wait()
    assert set(_FakeCudaEvent.streams) == {("stream", torch.device("cuda", 1))}
    assert timeline.blocked_seconds("b") == pytest.approx(0.25) and timeline.blocked_seconds("m") == pytest.approx(0.125)
    assert timeline.blocked_seconds() == pytest.approx(0.375) and inner.blocked_seconds() == pytest.approx(0.125)
    start, end = timeline.select("gemm", "start")[0], timeline.select("gemm", "end")[0]
    assert end - start == pytest.approx(0.040)
    assert [e.phase for e in timeline.events] == ["start", "end", "wait_start", "wait", "wait_start", "wait"]


def test_cpu_timelines_keep_the_host_clock(monkeypatch):
    # CPU (gloo) waits block the host: the times stay time.perf_counter()'s, unchanged.
    from megamoe.comms import stream_clock
    ticks = iter([10.0, 10.5, 12.0, 13.25])
    monkeypatch.setattr(stream_clock.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(torch.cuda, "Event", None)      # never touched on the CPU
    with comms.comm_timeline() as timeline, comms.comm_timeline("cpu") as inner:
        handle = comms.CommHandle(_StreamWaitWork(blocked_ms=0.0), torch.ones(2), "all_reduce", None, "b")
        with comms.timed("gemm"):
            pass
        handle.wait()
    assert [e.time for e in timeline.events] == [10.0, 10.5, 12.0, 13.25] and inner.events == timeline.events
    assert timeline.blocked_seconds("b") == 1.25


class _FakeP2PDist:
    """What point_to_point posts through: every post's work blocks the stream 30 ms (NCCL-like waits)."""
    isend, irecv = "isend", "irecv"

    @staticmethod
    def P2POp(op, tensor, peer=None, group=None, tag=0):
        return op, peer

    @staticmethod
    def batch_isend_irecv(ops):
        return [_StreamWaitWork(blocked_ms=30.0) for _ in ops]


def test_the_pipelines_blocked_time_on_cuda_is_the_streams(monkeypatch):
    from megamoe.comms import point_to_point
    from tests.helpers.p2p_recording import fake_rank
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))
    monkeypatch.setattr(point_to_point, "dist", _FakeP2PDist)
    with fake_rank(0, 2, pp=2) as state, comms.comm_timeline(device="cuda:0") as timeline:
        point_to_point.batch_send_recv([(torch.ones(2), 1)], [(torch.empty(2), 1)], state.pp.group)
    assert timeline.blocked_seconds(point_to_point.PIPELINE_TAG) == pytest.approx(0.060)
