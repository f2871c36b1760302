"""Every TP layer against an unsharded torch reference, forward and backward, TP in {1, 2, 4},
with and without sequence parallelism; communication counted for a column -> row MLP.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_tensor_parallel.py."""

import pytest
import torch.distributed as dist

from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.tensor_parallel import check_all


def _tp_worker(rank, world_size):
    # TP = world (4) and TP = 2 (two subgroups of the same 4 ranks) in one spawn.
    check_all(dist.group.WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    check_all(pairs[rank // 2])
    return rank


@pytest.mark.slow
def test_tensor_parallel_tp2_tp4():
    assert run_on_ranks(_tp_worker, 4) == [0, 1, 2, 3]
