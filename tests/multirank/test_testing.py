"""The multi-rank harness: results come back per rank, a failing or dying rank fails the test fast
and is named as the cause (not the rank that noticed it), and a hung rank times out instead of
hanging CI. No assertion here depends on how busy the machine is: promptness is shown by which
error comes back (a harness that waited for the hung rank would raise RankTimeout instead)."""

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from megamoe.spawned_ranks import BACKEND_ENV, RankFailure, RankTimeout, run_on_ranks

# Generous: spawning ranks and importing torch can take a minute on a loaded machine. None of these
# runs waits for the timeout unless the harness is broken (or, for the hang case, by design).
NEVER_REACHED_S = 600


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (t.item() * scale, torch.get_num_threads(), dist.get_backend())


def _rank_one_raises_while_rank_zero_hangs(rank, world_size, pid_dir):
    if rank == 1:
        dist.barrier()                       # both ranks are up
        raise ValueError("rank one is broken")
    _write_pid(pid_dir, rank)
    dist.barrier()
    time.sleep(NEVER_REACHED_S)              # only a kill ends this rank


def _rank_one_dies_while_rank_zero_waits(rank, world_size, how):
    dist.barrier()
    if rank == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(7)
    dist.barrier()                           # rank 0 waits here for the dead rank


def _rank_zero_hangs(rank, world_size, pid_dir):
    if rank == 0:
        _write_pid(pid_dir, rank)
        time.sleep(NEVER_REACHED_S)


def _write_pid(pid_dir, rank):
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def _assert_process_gone(pid_file):
    pid = int(open(pid_file).read())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_results_failures_and_timeouts(tmp_path, monkeypatch):
    # The backend comes from $MEGAMOE_TEST_BACKEND (`make test-gpu` sets nccl): unset, it is gloo.
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert run_on_ranks(_sum_ranks, 2, args=(10,), timeout_s=NEVER_REACHED_S) == [(10.0, 1, "gloo")] * 2

    # Rank 0 never finishes by itself: the RankFailure (not a RankTimeout after NEVER_REACHED_S)
    # shows that the harness ended the run on rank 1's error without waiting for rank 0.
    with pytest.raises(RankFailure, match=r"^rank 1 of 2 failed:[\s\S]*ValueError: rank one is broken"):
        run_on_ranks(_rank_one_raises_while_rank_zero_hangs, 2, args=(str(tmp_path),), timeout_s=NEVER_REACHED_S)
    _assert_process_gone(tmp_path / "rank0.pid")

    # Rank 1 returns at once; rank 0 hangs until the harness kills it. The timeout leaves rank 1 over 10x
    # the time two ranks take to start (forked from the server the first call above started) and return on
    # this 2-core machine (0.2 s measured at a load of 4), and it is the whole cost of this case, so it
    # is no longer than that.
    with pytest.raises(RankTimeout, match=r"ranks \[0\] of 2 did not finish within 10s"):
        run_on_ranks(_rank_zero_hangs, 2, args=(str(tmp_path),), timeout_s=10)
    _assert_process_gone(tmp_path / "rank0.pid")


@pytest.mark.slow
@pytest.mark.parametrize("how, ended", [("sigkill", r"signal SIGKILL \(exit code -9\)"), ("exit", "exit code 7")])
def test_a_dead_rank_is_named_not_the_rank_that_noticed(how, ended):
    # Rank 0 sees "Connection reset by peer" (or similar) in its barrier; the report must name
    # rank 1, how it ended, and rank 0 at most as a consequence.
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_rank_one_dies_while_rank_zero_waits, 2, args=(how,), timeout_s=NEVER_REACHED_S)
    message = str(failure.value)
    assert message.startswith("rank 1 of 2 died with "), message
    assert re.search(ended, message), message
    assert "rank 0 of 2 failed" not in message, message


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the error raised without two GPUs")
def test_nccl_without_a_gpu_per_rank_is_a_clear_error_before_any_rank_starts(monkeypatch):
    for how in ("argument", "environment"):
        if how == "environment":
            monkeypatch.setenv(BACKEND_ENV, "nccl")
        with pytest.raises(ValueError, match=r"'nccl' needs one CUDA GPU per rank \(2 ranks\), but this machine has"):
            run_on_ranks(_sum_ranks, 2, args=(1,), **({"backend": "nccl"} if how == "argument" else {}))
    with pytest.raises(ValueError, match=r"backend must be one of \('gloo', 'nccl'\), got 'mpi'"):
        run_on_ranks(_sum_ranks, 2, backend="mpi")


def test_tests_of_modules_that_spawn_ranks_are_marked_multirank(request):
    """`make test-gpu` selects them with `-m multirank` (tests/conftest.py marks them)."""
    assert request.node.get_closest_marker("multirank") is not None
