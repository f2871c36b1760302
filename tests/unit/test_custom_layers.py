"""examples/custom_layers.py (the README's subclassing example): a parameter declared with
shard_parameter is checkpointed as one logical tensor, so the gated MLP trained at TP 2 reloads at TP 1
with the same loss, and trains on the single-process loss and gradient-norm curve.

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_custom_layers.py."""

import pytest
import torch
from torch import nn

from megamoe.sharding import ShardSpec, get_shard_spec, shard_parameter


def test_shard_parameter_declares_the_logical_tensor_and_refuses_bad_dims():
    param = shard_parameter(nn.Parameter(torch.ones(3, 4)), dim=-1, group=None)
    assert get_shard_spec(param) == ShardSpec((3, 4), 1, 0, 1)
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        shard_parameter(nn.Parameter(torch.ones(3, 4)), dim=2, group=None)
    with pytest.raises(ValueError, match="0-dim"):
        shard_parameter(nn.Parameter(torch.ones(())), dim=0, group=None)
