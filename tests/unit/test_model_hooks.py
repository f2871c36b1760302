"""GPTMoEModel's construction hooks (LayerSpec) and the Trainer's model protocol: a MoELayer subclass with
its own router is built into the model, trained, checkpointed and resumed (2 ranks, EP 2); custom
attention and MLP classes are used; a model missing part of the protocol is refused by name."""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megamoe.checkpoint_state import sharded_state_dict
from megamoe.models import GPTMoEModel, LayerSpec
from megamoe.moe.moe_layer import MoELayer
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import MLP, Attention
from parallel_state import ParallelState
from tests.helpers.tiny_model import V, tiny_config
from tests.helpers.model_hooks import (OFFSET, OffsetMoELayer, OffsetRouter, _batches, _micro_batches,
                                       _offset_trainer, _tokens_per_rank)


# ----------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------
def test_moe_layer_subclass_with_its_own_router_is_built_and_trained():
    state = ParallelState.single_process()
    trainer = _offset_trainer(state)
    model = trainer.model
    layers = model.moe_layers()
    assert sorted(layers) == [1, 2, 3]
    assert all(type(layer) is OffsetMoELayer and type(layer.router) is OffsetRouter for layer in layers.values())
    names = {c.name for c in sharded_state_dict(model)}
    assert {f"layers.{i}.mlp.router.logit_offset" for i in layers} <= names

    trainer.train_step(_micro_batches(_batches(1)[0], state))
    for layer in layers.values():
        # Every token picked expert 0: the custom logits routed this step.
        assert int(layer.load_counter.per_expert[0]) == _tokens_per_rank(state)
        assert layer.router.logit_offset.grad is not None and bool(layer.router.logit_offset.grad.abs().sum() > 0)
        assert float(layer.router.logit_offset.detach()[0]) != OFFSET, "the optimizer trains the custom parameter"


class CountingAttention(Attention):
    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        return super().forward(*args, **kwargs)


class HalvedMLP(MLP):
    def forward(self, x):
        return super().forward(x) * 0.5


def test_attention_and_mlp_classes_of_the_spec_are_used():
    state = ParallelState.single_process()
    ids = _batches(1)[0][:2, :-1]
    torch.manual_seed(0)
    default = GPTMoEModel(tiny_config(), state)
    initialize_parameters(default, seed=0)
    explicit = GPTMoEModel(tiny_config(), state, layer_spec=LayerSpec(attention=Attention, mlp=MLP, moe=MoELayer))
    initialize_parameters(explicit, seed=0)
    assert torch.equal(default(ids)[0], explicit(ids)[0]), "the default spec is the shipped classes"

    custom = GPTMoEModel(tiny_config(), state, layer_spec=LayerSpec(attention=CountingAttention, mlp=HalvedMLP))
    initialize_parameters(custom, seed=0)
    assert type(custom.layers["0"].mlp) is HalvedMLP                          # layer 0 is the dense one
    assert all(type(layer.mlp) is MoELayer for key, layer in custom.layers.items() if key != "0")
    CountingAttention.calls = 0
    logits = custom(ids)[0]
    assert CountingAttention.calls == tiny_config().num_layers
    assert not torch.allclose(logits, default(ids)[0])


def test_layer_spec_refuses_what_cannot_build_a_layer():
    with pytest.raises(ValueError, match="LayerSpec.moe must be MoELayer or a subclass"):
        LayerSpec(moe=MLP)
    with pytest.raises(ValueError, match="LayerSpec.mlp must be a class or a callable"):
        LayerSpec(mlp=3)
    with pytest.raises(TypeError, match="LayerSpec.moe built a Linear, not a MoELayer"):
        GPTMoEModel(tiny_config(), ParallelState.single_process(),
                    layer_spec=LayerSpec(moe=lambda config, **kwargs: nn.Linear(2, 2)))


# ----------------------------------------------------------------------------------------------
# The Trainer's protocol
# ----------------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    """The smallest model of one's own the Trainer accepts: one stage, no MoE layer."""

    is_first_stage = is_last_stage = True

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=16, num_layers=1, moe=None)
        self.embed, self.head = nn.Embedding(V, 16), nn.Linear(16, V)

    def tied_parameters(self):
        return ()

    def moe_layers(self):
        return {}

    def forward(self, inputs, labels=None):
        loss = F.cross_entropy(self.head(self.embed(inputs)).flatten(0, 1), labels.flatten())
        return loss, loss.new_zeros(())


def test_trainer_trains_a_model_meeting_the_protocol():
    state = ParallelState.single_process()
    torch.manual_seed(0)
    trainer = Trainer(TinyLM(), state, TrainConfig(lr=1e-2))
    batch = _micro_batches(_batches(1)[0], state)
    losses = [trainer.train_step(batch).loss for _ in range(3)]
    assert losses[-1] < losses[0]


class NoTiedParameters(TinyLM):
    tied_parameters = None


class HiddenMoE(TinyLM):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=32, num_layers=1, moe=tiny_config().moe)
        self.block = OffsetMoELayer(tiny_config().moe)


class NoLabels(TinyLM):
    def forward(self, inputs):
        return super().forward(inputs)


@pytest.mark.parametrize("model, message", [
    (lambda: SimpleNamespace(), "SimpleNamespace is not a torch.nn.Module"),
    (lambda: nn.Linear(2, 2), "Linear has no attribute 'config'"),
    (NoTiedParameters, "NoTiedParameters.tied_parameters must be a method"),
    (HiddenMoE, r"moe_layers\(\) leaves out the MoELayer modules \['block'\]"),
    (NoLabels, "NoLabels.forward takes no 'labels' argument"),
])
def test_trainer_names_what_a_model_lacks(model, message):
    with pytest.raises(TypeError, match=message) as error:
        Trainer(model(), ParallelState.single_process(), TrainConfig())
    assert "megamoe.training.TrainableModel" in str(error.value)


def test_trainer_logs_the_balancing_in_force(caplog):
    state = ParallelState.single_process()
    with caplog.at_level(logging.INFO, logger="megamoe.training.trainer"):
        _offset_trainer(state)
    assert [r.getMessage() for r in caplog.records] == [
        "expert load balancing of MoE layers [1, 2, 3]: aux loss coeff 0.01, aux-loss-free expert bias "
        "(update rate 0.01)"]

    config = tiny_config()
    config.moe.router.aux_loss_coeff, config.moe.router.use_expert_bias = 0.0, False
    config.moe.router.z_loss_coeff = 1e-3                  # keeps logits small, balances nothing
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megamoe.training.trainer"):
        Trainer(GPTMoEModel(config, state), state, TrainConfig())
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "NO expert load balancing" in record.getMessage()


def test_trainer_accepts_a_wrapper_whose_forward_takes_any_keyword():
    """A wrapper such as torch.compile's forwards ``**kwargs``: its ``labels`` cannot be seen, only passed."""
    state = ParallelState.single_process()

    class Wrapped(GPTMoEModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    Trainer(Wrapped(tiny_config("alltoall"), state), state, TrainConfig())
