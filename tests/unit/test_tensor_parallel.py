"""Every TP layer against an unsharded torch reference, forward and backward, TP in {1, 2, 4},
with and without sequence parallelism; communication counted for a column -> row MLP."""

import pytest
import torch

from megamoe.sharding import get_shard_spec
from megamoe.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, initialize_parameters,
                                     vocab_parallel_cross_entropy)
from tests.helpers.tensor_parallel import check_all


def test_tensor_parallel_single_rank():
    check_all(None)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="gather_output and sequence_parallel"):
        ColumnParallelLinear(4, 4, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="requires input_is_parallel"):
        RowParallelLinear(4, 4, sequence_parallel=True, input_is_parallel=False)
    with pytest.raises(ValueError, match="must be the same|disagree"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_initialize_parameters_is_seeded_by_name():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = ColumnParallelLinear(4, 6)
            self.b = ColumnParallelLinear(4, 6)
    m1, m2 = Two(), Two()
    initialize_parameters(m1, seed=3)
    initialize_parameters(m2, seed=3)
    assert torch.equal(m1.a.weight, m2.a.weight) and torch.equal(m1.b.weight, m2.b.weight)
    assert not torch.equal(m1.a.weight, m1.b.weight)
    initialize_parameters(m2, seed=4)
    assert not torch.equal(m1.a.weight, m2.a.weight)
    assert get_shard_spec(m1.a.weight).global_shape == (6, 4)
