"""GPTMoEModel's construction hooks (LayerSpec) and the Trainer's model protocol: a MoELayer subclass with
its own router is built into the model, trained, checkpointed and resumed (2 ranks, EP 2); custom
attention and MLP classes are used; a model missing part of the protocol is refused by name."""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megamoe.checkpoint.format import read_manifest
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.models import GPTMoEModel, LayerSpec
from megamoe.moe.moe_layer import MoELayer
from megamoe.moe.router import Router
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import MLP, Attention
from parallel_state import ParallelState
from test_training import GLOBAL_BATCH, MICRO_BATCH, S, V, tiny_config

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


# ----------------------------------------------------------------------------------------------
# End to end: 2 ranks, EP 2
# ----------------------------------------------------------------------------------------------
def _train_save_resume(rank, world_size, directory):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    torch.set_num_threads(1)
    state = initialize_model_parallel(ep=2)                 # DP 2 x EP 2, all-to-all
    batches = _batches(5)
    trainer = _offset_trainer(state, dist.group.WORLD)
    losses, expert0_share = [], []
    for step, batch in enumerate(batches):
        losses.append(trainer.train_step(_micro_batches(batch, state)).loss)
        expert0_share.append([int(layer.load_counter.per_expert[0]) for layer in trainer.model.moe_layers().values()])
        if step == 2:
            save_training_checkpoint(directory, trainer, sampler_state={"next_batch": 3},
                                     world_group=dist.group.WORLD)
    offsets = {i: layer.router.logit_offset.detach().tolist() for i, layer in trainer.model.moe_layers().items()}

    resumed = _offset_trainer(state, dist.group.WORLD)
    extra = load_training_checkpoint(directory, resumed, world_group=dist.group.WORLD)
    resumed_losses = [resumed.train_step(_micro_batches(batch, state)).loss
                      for batch in batches[extra["sampler_state"]["next_batch"]:]]
    resumed_offsets = {i: layer.router.logit_offset.detach().tolist()
                       for i, layer in resumed.model.moe_layers().items()}
    destroy_model_parallel()
    return dict(losses=losses, resumed_losses=resumed_losses, expert0=expert0_share, offsets=offsets,
                resumed_offsets=resumed_offsets, tokens=_tokens_per_rank(state), step=resumed.step)


@pytest.mark.slow
def test_custom_router_in_the_model_trains_saves_and_resumes_on_two_ranks(tmp_path):
    directory = tmp_path / "step_3"
    ranks = run_on_ranks(_train_save_resume, 2, args=(str(directory),), timeout_s=600)
    for result in ranks:
        assert result["step"] == 5
        assert result["resumed_losses"] == result["losses"][3:], "the resumed run continues bitwise"
        assert result["resumed_offsets"] == result["offsets"]
        assert result["expert0"][0] == [result["tokens"]] * 3, "the custom router routed every token to expert 0"
        assert all(offsets[0] != OFFSET for offsets in result["offsets"].values())
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    tensors = read_manifest(directory)["tensors"]
    assert all(f"layers.{i}.mlp.router.logit_offset" in tensors for i in (1, 2, 3))
    assert "optim.exp_avg.layers.1.mlp.router.logit_offset" in tensors


def test_trainer_accepts_a_wrapper_whose_forward_takes_any_keyword():
    """A wrapper such as torch.compile's forwards ``**kwargs``: its ``labels`` cannot be seen, only passed."""
    state = ParallelState.single_process()

    class Wrapped(GPTMoEModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    Trainer(Wrapped(tiny_config("alltoall"), state), state, TrainConfig())
