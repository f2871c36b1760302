"""Shared by tests/unit/test_model_hooks.py and tests/multirank/test_model_hooks.py: the builders and constants of
the model hooks tests."""

import torch
from torch import nn

from megamoe.models import GPTMoEModel, LayerSpec
from megamoe.moe.moe_layer import MoELayer
from megamoe.moe.router import Router
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.tiny_model import GLOBAL_BATCH, MICRO_BATCH, S, V, tiny_config

OFFSET = 5.0      # router logits are ~0.1: expert 0 wins every token's top-k


class OffsetRouter(Router):
    """Adds a learned per-expert offset to the gate logits, initialised to favour expert 0."""

    def __init__(self, config, *, device=None, dtype=None):
        super().__init__(config, device=device, dtype=dtype)
        self.logit_offset = nn.Parameter(torch.tensor([OFFSET] + [0.0] * (config.num_experts - 1), device=device))

    def gate_logits(self, hidden):
        return super().gate_logits(hidden) + self.logit_offset


class OffsetMoELayer(MoELayer):
    def build_router(self, config, **factory):
        return OffsetRouter(config.router, **factory)


def _batches(steps):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, V, (steps, GLOBAL_BATCH, S + 1), generator=g)


def _micro_batches(batch, state):
    per_rank = GLOBAL_BATCH // state.dp_cp.size
    mine = batch[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)]


def _offset_trainer(state, world_group=None):
    model = GPTMoEModel(tiny_config(), state, layer_spec=LayerSpec(moe=OffsetMoELayer))
    initialize_parameters(model, seed=0)
    return Trainer(model, state, TrainConfig(lr=1e-2), world_group=world_group)


def _tokens_per_rank(state):
    return GLOBAL_BATCH // state.dp_cp.size * S
