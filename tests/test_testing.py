"""The multi-rank harness: results come back per rank, a failing rank fails the test fast with its
own traceback, and a hung collective times out instead of hanging CI."""

import time

import pytest
import torch
import torch.distributed as dist

from megamoe.testing import RankFailure, RankTimeout, run_on_ranks


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (t.item() * scale, torch.get_num_threads())


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # the healthy rank blocks on the failed one: must not hang the test


def _rank_zero_hangs(rank, world_size):
    if rank == 0:
        time.sleep(120)


@pytest.mark.slow
def test_results_failures_and_timeouts():
    assert run_on_ranks(_sum_ranks, 2, args=(10,)) == [(10.0, 1), (10.0, 1)]

    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 2 failed:[\s\S]*ValueError: rank one is broken"):
        run_on_ranks(_rank_one_raises, 2, timeout_s=60)
    assert time.monotonic() - start < 30, "a failing rank must end the run promptly"

    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0\] of 2 did not finish within 20s"):
        run_on_ranks(_rank_zero_hangs, 2, timeout_s=20)
    assert time.monotonic() - start < 40
