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
from megamoe.testing import run_on_ranks

COLLECTIVE_TIMEOUT_S = 12      # gloo's timeout inside the ranks (the grace period is a quarter of it)
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
