"""Shared by tests/unit/test_checkpoint_format.py and tests/multirank/test_checkpoint_format.py: the builders and
constants of the checkpoint format tests."""

import glob

import torch
from torch import nn

from megamoe.checkpoint_state import (LogicalChunk, chunks_by_parameter, materialize_optimizer_state,
                                      optimizer_chunks, sharded_state_dict)
from megamoe.sharding import get_shard_spec
from megamoe.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                     seeded_generator)

V, H, F = 16, 8, 12            # vocabulary, hidden, ffn (divisible by 4)
EXPERT_SHAPE = (6, 4)          # one expert's weight [out, in]
OPTIM_STEP = 5.0


class TinyModel(nn.Module):
    """Embedding -> column -> row, one persistent and one non-persistent buffer."""

    def __init__(self, tp_group=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = VocabParallelEmbedding(V, H, tp_group=tp_group)
        self.up = ColumnParallelLinear(H, F, tp_group=tp_group)
        self.down = RowParallelLinear(F, H, tp_group=tp_group)
        self.register_buffer("scale", torch.full((H,), float(seed)))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


class SlotExperts(nn.Module):
    """Stacked per-slot weights [slots, out, in] whose logical names are per expert (as the MoE layer's):
    replicas of one expert in several slots are one logical tensor."""

    def __init__(self, slot_to_expert):
        super().__init__()
        self.slot_to_expert = list(slot_to_expert)
        self.weight = nn.Parameter(torch.zeros(len(self.slot_to_expert), *EXPERT_SHAPE))

    def sharded_state_dict(self, prefix):
        return [LogicalChunk(f"{prefix}experts.{e}.weight", self.weight.detach()[s], EXPERT_SHAPE, (0, 0))
                for s, e in enumerate(self.slot_to_expert)]


class WithExperts(nn.Module):
    def __init__(self, slot_to_expert):
        super().__init__()
        self.router = nn.Linear(4, 3, bias=False)
        self.moe = SlotExperts(slot_to_expert)


def _logical(name, shape):
    """The reference value of a logical tensor, the same on every rank."""
    return torch.randn(shape, generator=seeded_generator(0, name))


@torch.no_grad()
def _set_reference(model, optimizer=None):
    """Parameters and AdamW state := slices of the reference logical tensors (through the ShardSpecs and
    optimizer.state directly, not through the code under test)."""
    for name, p in model.named_parameters():
        spec = get_shard_spec(p)
        p.copy_(spec.slice_of(_logical(name, spec.global_shape)))
        if optimizer is not None:
            state = optimizer.state[p]
            state["exp_avg"].copy_(spec.slice_of(_logical(f"optim.exp_avg.{name}", spec.global_shape)))
            state["exp_avg_sq"].copy_(spec.slice_of(_logical(f"optim.exp_avg_sq.{name}", spec.global_shape)).abs())
            state["step"].fill_(OPTIM_STEP)


def _assert_reference(model, optimizer=None):
    for name, p in model.named_parameters():
        spec = get_shard_spec(p)
        assert torch.equal(p, spec.slice_of(_logical(name, spec.global_shape))), name
        if optimizer is not None:
            state = optimizer.state[p]
            assert torch.equal(state["exp_avg"], spec.slice_of(_logical(f"optim.exp_avg.{name}", spec.global_shape)))
            assert torch.equal(state["exp_avg_sq"],
                               spec.slice_of(_logical(f"optim.exp_avg_sq.{name}", spec.global_shape)).abs())
            assert state["step"].item() == OPTIM_STEP, name


def _model_and_optimizer(tp_group=None, seed=0):
    model = TinyModel(tp_group, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    materialize_optimizer_state(optimizer)
    return model, optimizer


def _all_chunks(model, optimizer):
    chunks = sharded_state_dict(model)
    return chunks + optimizer_chunks(optimizer, chunks_by_parameter(model.parameters(), chunks))


def _leftovers(path):
    return sorted(glob.glob(str(path) + ".tmp-*") + glob.glob(str(path) + ".old"))


def _failing_save_file(*args, **kwargs):
    raise OSError("disk full")
