"""A collective that times out raises CollectiveTimeout naming the operation, its ranks and the rank
that did not arrive, within the process groups' timeout (the model-parallel groups included).

The stalled rank waits for flag files the other ranks write once they have their error: no
assertion depends on timing, and a broken timeout shows up as a RankTimeout of the harness."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from datetime import timedelta

from megamoe import comms
from megamoe.spawned_ranks import run_on_ranks

COLLECTIVE_TIMEOUT_S = 8       # gloo's timeout inside the ranks (the grace period: a quarter of it, at least 2 s)
HARNESS_TIMEOUT_S = 300        # only reached if a collective does not time out


def _stall_until(flags, limit_s=HARNESS_TIMEOUT_S):
    """A rank that is alive but never joins the collective: it waits for the others' flag files."""
    end = time.monotonic() + limit_s
    while not all(os.path.exists(f) for f in flags) and time.monotonic() < end:
        time.sleep(0.1)


def _timeout_of(fn, flag):
    try:
        fn()
    except comms.CollectiveTimeout as e:
        return dict(message=str(e), operation=e.operation, ranks=e.group_ranks, missing=e.missing,
                    first_report=e.first_report)
    finally:
        open(flag, "w").close()
    raise AssertionError("the collective did not time out")


def _tp_group_all_reduce_with_a_stalled_rank(rank, world_size, flag_dir):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    state = initialize_model_parallel(tp=2)
    dist.barrier()
    flag = os.path.join(flag_dir, "rank0.done")
    if rank == 1:
        _stall_until([flag])
        return None
    result = _timeout_of(lambda: comms.all_reduce_(torch.ones(4), state.tp.group), flag)
    destroy_model_parallel()
    return result


@pytest.mark.slow
def test_a_model_parallel_group_times_out_naming_the_missing_rank(tmp_path):
    # The TP group inherits the world's (short) timeout: torch's default for a new gloo group is 30 min.
    results = run_on_ranks(_tp_group_all_reduce_with_a_stalled_rank, 2, args=(str(tmp_path),),
                           timeout_s=HARNESS_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    report = results[0]
    assert report["operation"] == "all_reduce" and report["ranks"] == (0, 1) and report["missing"] == (1,)
    assert report["first_report"]
    assert report["message"].startswith(f"all_reduce over ranks [0, 1] timed out after {COLLECTIVE_TIMEOUT_S} s "
                                        "on rank 0: rank 1 did not arrive"), report["message"]


def _chain_of_waits(rank, world_size, flag_dir):
    # Rank 1 stalls; rank 0 waits for it in an all-reduce over [0, 1]; rank 2 waits for rank 0 in
    # an all-gather over [0, 2] that rank 0 never enters.
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    pair_01 = dist.new_group([0, 1], timeout=timeout)
    pair_02 = dist.new_group([0, 2], timeout=timeout)
    dist.barrier()
    flags = [os.path.join(flag_dir, f"rank{r}.done") for r in (0, 2)]
    if rank == 1:
        _stall_until(flags)
        return None
    if rank == 0:
        return _timeout_of(lambda: comms.all_reduce_(torch.ones(4), pair_01), flags[0])
    return _timeout_of(lambda: comms.all_gather_into(torch.ones(4), pair_02), flags[1])


@pytest.mark.slow
def test_a_rank_waiting_elsewhere_is_named_with_its_operation(tmp_path):
    zero, _, two = run_on_ranks(_chain_of_waits, 3, args=(str(tmp_path),), timeout_s=HARNESS_TIMEOUT_S,
                                collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    assert zero["missing"] == (1,), zero["message"]
    assert two["operation"] == "all_gather" and two["missing"] == (), two["message"]
    assert "rank 0 is itself waiting in all_reduce over ranks [0, 1]" in two["message"], two["message"]
    assert [zero["first_report"], two["first_report"]].count(True) == 1, "exactly one rank prints the error"


# ---- NCCL: its timeout message, and the host-side watchdog (collectives return before the data moved) ----

# The texts torch raises, as fixtures. gloo: gloo/transport/tcp/unbound_buffer.cc ("Timed out waiting
# <ms>ms for recv operation to complete"). NCCL: torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp,
# WorkNCCL::checkTimeout (logPrefix() + "Watchdog caught collective operation timeout: " + the WorkNCCL's
# operator<< + " ran for <ms> milliseconds before timing out."), the DistBackendError that wait() rethrows
# (TORCH_NCCL_BLOCKING_WAIT=1 or an explicit wait timeout) and the watchdog logs; logPrefix() is
# "[PG ID 0 PG GUID 0(default_pg) Rank 0] " in recent releases, "[Rank 0] " in older ones.
GLOO_TIMEOUT = "Timed out waiting 12000ms for recv operation to complete"
NCCL_TIMEOUTS = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
    "OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=12000) ran for 12053 milliseconds before timing out.",
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=57, OpType=ALLGATHER, NumelIn=191, "
    "NumelOut=1528, Timeout(ms)=12000) ran for 12059 milliseconds before timing out.",
)


def test_nccl_timeouts_are_recognised_as_gloo_ones_and_name_their_timeout():
    from megamoe.collective_timeout import _timeout_seconds, is_peer_failure, is_timeout
    for text in (GLOO_TIMEOUT, *NCCL_TIMEOUTS):
        error = dist.DistBackendError(text)         # a RuntimeError, as raised by torch
        assert is_timeout(error) and not is_peer_failure(error), text
        assert _timeout_seconds(text) == 12.0, text
    assert not is_timeout(RuntimeError("NCCL error: unhandled system error")) and _timeout_seconds("x") is None


def test_comms_hand_collectives_to_an_armed_watchdog_which_finds_the_stuck_one():
    # Over torch's fake process group collectives return at once, as on NCCL: the watchdog's probes say
    # whether the stream got past them. The oldest pending one is reported once it is timeout_s old.
    from megamoe import collective_watchdog
    from tests.helpers.p2p_recording import fake_rank
    probes = []

    def probe():
        probes.append(False)
        index = len(probes) - 1
        return lambda: probes[index]

    watchdog = collective_watchdog.CollectiveWatchdog(30.0, on_timeout=None, probe=probe, poll_s=3600.0)
    with fake_rank(0, 2, tp=2) as state:
        collective_watchdog.arm(watchdog)
        try:
            comms.all_reduce_(torch.ones(4), state.tp.group)
            handle = comms.all_reduce_async(torch.ones(4), state.tp.group, tag="b")   # watched from its wait on
            assert len(probes) == 1
            handle.wait()
            comms.all_gather_into(torch.ones(2), state.tp.group)
        finally:
            collective_watchdog.disarm()
        comms.all_reduce_(torch.ones(4), state.tp.group)                 # disarmed: not handed over
    assert collective_watchdog.armed() is None and len(probes) == 3
    oldest = watchdog._pending[0]
    assert (oldest.operation, oldest.group_ranks) == ("all_reduce", (0, 1))
    assert watchdog.overdue(now=oldest.issued_at + 29.9) is None
    assert watchdog.overdue(now=oldest.issued_at + 30.0) is oldest
    probes[0] = True                                                    # the stream got past the first one
    second = watchdog.overdue(now=handle.issued_at + 30.0)
    assert second.operation == "all_reduce" and second.issued_at == handle.issued_at   # timed from its issue
    probes[1] = True
    assert watchdog.overdue(now=1e12).operation == "all_gather"
    probes[2] = True
    assert watchdog.overdue(now=1e12) is None and not watchdog._pending
    with pytest.raises(ValueError, match="CollectiveWatchdog.timeout_s"):
        collective_watchdog.CollectiveWatchdog(0, on_timeout=None)


# A rank of a 2-rank group (torch's fake process group: collectives return at once, as on NCCL; a real store)
# whose all-reduce never completes on the "stream", blocked afterwards as in a host read of its result.
_STUCK_RANK = """
import sys, threading
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the fake backend
from megamoe import collective_watchdog, comms
from megamoe.cli import launch
dist.init_process_group("cpu:fake", store=dist.HashStore(), rank=0, world_size=2)

def main(argv):
    collective_watchdog.arm(collective_watchdog.CollectiveWatchdog(
        0.5, launch._end_on_stuck_collective, probe=lambda: (lambda: False), poll_s=0.05))
    comms.all_reduce_(torch.ones(4), dist.group.WORLD)
    threading.Event().wait(120)         # the host read that never returns
    return 0

sys.exit(launch.run_script(main, prog="train.py"))
"""


def test_a_stuck_nccl_like_collective_ends_the_rank_with_the_one_error_line(tmp_path):
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "RANK", "MEGAMOE_TRACEBACK")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(comms.__file__))),
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _STUCK_RANK], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=HARNESS_TIMEOUT_S)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        "train.py: error: all_reduce over ranks [0, 1] timed out after 0.5 s on rank 0: rank 1 did not arrive "
        "(stopped, hung, dead, or still busy outside any collective); if a rank is only slow, raise --comm-timeout"
    ], done.stderr
