"""The layout plan (megamoe.parallel_plan): built once from the config and the parallel state, it says what
dispatches how and what is sharded over which group; the model built on each rank of a grid of layouts uses
exactly the groups the plan names, and the plan's rules are today's (the expected table). A dispatcher a user
registers is picked up by name; bad layouts and hand-made plans raise ValueError naming the field.

Every rank of an 8-rank world is played in this process over torch's fake process group (meta device)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.models import GPTMoEModel
from megamoe.models.sequence_parallel import counts_own_tokens
from megamoe.moe import token_dispatcher
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.token_dispatcher import AllGatherDispatcher, AllToAllDispatcher, dispatcher_class, register_dispatcher
from megamoe.parallel_plan import (DenseLayout, GradientReduction, MoELayout, StageSplit, build_parallel_plan,
                                   default_etp)
from megamoe.pipeline.partition import chunk_layer_ranges
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.p2p_recording import fake_rank
from parallel_state import ParallelState
from tests.helpers.tiny_model import S, V, tiny_config

WORLD = 8

# name -> (dispatcher, layout, config changes, virtual stages, expected MoE rules as on main before the plan:
# (folded, token split group, reduce group, expert token replicas, statistics group)).
LAYOUTS = {
    "a2a-tp2-etp2": ("alltoall", dict(tp=2, etp=2, ep=2), {}, 1, (False, None, "etp", 1, None)),
    "a2a-folding-tp2-etp1": ("alltoall", dict(tp=2, etp=1, ep=4), {}, 1, (True, "tp", "etp", 1, "tp")),
    "a2a-folding-cp2": ("alltoall", dict(tp=2, etp=1, ep=2, cp=2), {}, 1, (True, "tp", "etp", 1, "tp_cp")),
    "a2a-sp-tp2": ("alltoall", dict(tp=2, etp=2, ep=2), dict(sequence_parallel=True), 1,
                   (False, "tp", "etp", 1, "tp")),
    "a2a-cp2-pp2-vpp2": ("alltoall", dict(cp=2, pp=2, ep=2), {}, 2, (False, None, "etp", 1, "cp")),
    "ag-tp2-ep2": ("allgather", dict(tp=2, ep=2), {}, 1, (False, None, "ep_etp", 1, None)),
    "ag-tp4-ep2-replicated": ("allgather", dict(tp=4, ep=2), {}, 1, (False, None, "ep_etp", 2, None)),
    "ag-input-sharded": ("allgather", dict(tp=2, ep=2, order="tp-cp-dp-ep-pp"), dict(input_sharded=True), 1,
                         (False, None, "ep_etp", 2, None)),
    "ag-sp-cp2-pp2": ("allgather", dict(tp=2, ep=2, cp=2), dict(sequence_parallel=True), 1,
                      (False, "tp", "ep_etp", 1, "tp_cp")),
}


def _config(dispatcher, changes):
    config = tiny_config(dispatcher)
    if "input_sharded" in changes:
        config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, input_sharded=True))
    if "sequence_parallel" in changes:
        config = dataclasses.replace(config, sequence_parallel=True)
    return config


def _ranks(group):
    return tuple(comms.group_ranks(group))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_plan_names_the_groups_the_built_model_uses(name):
    dispatcher, layout, changes, vpp, expected = LAYOUTS[name]
    folded, split, reduce_kind, replicas, statistics = expected
    config = _config(dispatcher, changes)
    for rank in range(WORLD):
        with fake_rank(rank, WORLD, **layout) as state:
            model = GPTMoEModel(config, state, device="meta", virtual_pipeline_stages=vpp)
            plan = model.plan
            assert plan == build_parallel_plan(config, state, virtual_pipeline_stages=vpp)
            moe = plan.moe
            assert (moe.dispatcher_class, moe.folded, moe.token_split_group, moe.reduce_group,
                    moe.expert_token_replicas, moe.statistics_group) == (
                dispatcher_class(dispatcher), folded, split, reduce_kind, replicas, statistics)
            assert (plan.tp, plan.cp, plan.pp, plan.ep, plan.etp) == tuple(
                getattr(state, k).size for k in ("tp", "cp", "pp", "ep", "etp"))
            sp = "sequence_parallel" in changes
            assert plan.dense == DenseLayout("tp", "tp" if sp else None, "cp" if state.cp.size > 1 else None)
            # The groups the built layers hold are the ones the expected rules name.
            assert model.sequence_group is (state.tp.group if sp else None)
            assert model.cp_group is (state.cp.group if state.cp.size > 1 else None)
            layers = model.moe_layers()
            assert layers
            for layer in layers.values():
                assert type(layer.dispatcher) is dispatcher_class(dispatcher)
                assert _ranks(layer.dispatcher.reduce_group) == getattr(state, reduce_kind).ranks
                assert _ranks(layer.dispatcher.ep_group) == state.ep.ranks
                assert layer.fold_group is (state.tp.group if folded else None)
                assert layer.sequence_group is (state.tp.group if split else None)
                assert layer.statistics_group is (getattr(state, statistics).group if statistics else None)
                # Routers fed only this rank's share are summed over TP by the gradient sync.
                tagged = all(getattr(p, "sequence_parallel", False) for p in layer.router.parameters())
                assert tagged == (plan.gradients.sequence_parallel_group == "tp") == (split is not None)
            assert counts_own_tokens(model, state) == (state.tp.rank == 0 or split is not None)
            # The pipeline split: this rank's layers, chunk by chunk.
            chunks = chunk_layer_ranges(config.num_layers, state.pp.size, vpp)[state.pp.rank]
            assert plan.stages.chunk_layer_ids == tuple(chunks)
            assert sorted(int(i) for i in model.layers) == [i for c in chunks for i in c]
            # The trainer's expert gradient scale is the plan's: 1 / (dp x cp x the tokens' replicas).
            if rank in (0, WORLD - 1):
                trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
                assert trainer.grad_sync.expert_scale == plan.gradients.expert_scale == 1.0 / (
                    state.dp_cp.size * replicas)


def test_default_etp_is_the_dispatchers():
    assert (default_etp(4, "alltoall"), default_etp(4, "allgather"), default_etp(4, None),
            default_etp(4, "alltoall", 2)) == (4, 1, 1, 2)


@pytest.fixture
def registry(monkeypatch):
    """The dispatcher registry, restored after the test."""
    monkeypatch.setattr(token_dispatcher, "_REGISTRY", dict(token_dispatcher._REGISTRY))


class CountingDispatcher(AllToAllDispatcher):
    """A user's dispatcher: the all-to-all one, counting its dispatches, refusing etp > 1 and folding."""

    name = "counting"
    folds_over_tp = False
    dispatches = 0

    @classmethod
    def default_etp(cls, tp: int) -> int:
        return 1

    @classmethod
    def check_layout(cls, moe_config, state) -> None:
        if state.etp.size > 1:
            raise ValueError(f"the counting dispatcher needs etp=1, got etp={state.etp.size}")

    @classmethod
    def expert_token_replicas(cls, moe_config, tp, ep, etp):
        return tp

    def dispatch(self, *args, **kwargs):
        type(self).dispatches += 1
        return super().dispatch(*args, **kwargs)


def test_a_registered_dispatcher_is_picked_up_by_name_with_its_layout_rules(registry):
    with pytest.raises(ValueError, match="MoEConfig.dispatcher"):
        tiny_config("counting")
    assert register_dispatcher(CountingDispatcher) is CountingDispatcher
    assert "counting" in token_dispatcher.dispatcher_names() and default_etp(2, "counting") == 1
    tokens = torch.randint(0, V, (2, S))
    outputs = {}
    for name in ("alltoall", "counting"):
        model = GPTMoEModel(tiny_config(name), ParallelState.single_process())
        initialize_parameters(model, seed=0)
        outputs[name] = model(tokens)[0]
        assert all(type(layer.dispatcher) is dispatcher_class(name) for layer in model.moe_layers().values())
    assert CountingDispatcher.dispatches == len(tiny_config().moe_layer_ids)
    torch.testing.assert_close(outputs["counting"], outputs["alltoall"], rtol=0, atol=0)
    # Its rules, not the all-to-all's: the layout check, the replicas, no folding.
    for rank in (0, 1):
        with fake_rank(rank, 4, tp=2, ep=2, etp=2) as state:
            with pytest.raises(ValueError, match="etp=2"):
                build_parallel_plan(tiny_config("counting"), state)
        with fake_rank(rank, 4, tp=2, ep=2, etp=1) as state:
            moe = build_parallel_plan(tiny_config("counting"), state).moe
            assert (moe.folded, moe.token_split_group, moe.expert_token_replicas) == (False, None, 2)
            assert moe.counts_own_tokens == (state.tp.rank == 0)


def test_registering_refuses_a_taken_name_or_a_nameless_class(registry):
    class Impostor(AllToAllDispatcher):
        name = "allgather"

    class Nameless(AllToAllDispatcher):
        pass

    class OddGroup(AllToAllDispatcher):
        name = "odd"
        reduce_group_kind = "tp"

    with pytest.raises(ValueError, match="'allgather' is taken by AllGatherDispatcher"):
        register_dispatcher(Impostor)
    with pytest.raises(ValueError, match="Nameless.name"):
        register_dispatcher(Nameless)
    with pytest.raises(ValueError, match="OddGroup.reduce_group_kind"):
        register_dispatcher(OddGroup)
    with pytest.raises(ValueError, match="TokenDispatcher subclass"):
        register_dispatcher(object)
    assert register_dispatcher(AllGatherDispatcher) is AllGatherDispatcher      # the same class again: a no-op


# (dispatcher, world, layout, config changes, the error's words)
BAD_LAYOUTS = {
    "a2a-etp-not-dividing-tp": ("alltoall", 8, dict(tp=2, etp=4, ep=2), {}, "etp=4 tp=2"),
    "ag-expert-group-beyond-tp": ("allgather", 4, dict(tp=2, ep=2, etp=2), {}, "ep \\* etp must divide tp"),
    "ag-sharded-input-within-tp": ("allgather", 4, dict(tp=2, ep=2), dict(input_sharded=True), "input_sharded"),
    "vpp-without-pp": ("alltoall", 2, dict(ep=2), {}, "virtual_pipeline_stages=2 needs pipeline parallelism"),
}


@pytest.mark.parametrize("name", list(BAD_LAYOUTS))
def test_a_bad_layout_raises_naming_the_field(name):
    dispatcher, world, layout, changes, words = BAD_LAYOUTS[name]
    with fake_rank(0, world, **layout) as state:
        with pytest.raises(ValueError, match=words):
            build_parallel_plan(_config(dispatcher, changes), state, virtual_pipeline_stages=2 if "vpp" in name else 1)


def test_a_hand_made_plan_validates_itself_naming_the_field():
    with pytest.raises(ValueError, match="MoEConfig.dispatcher"):
        MoEConfig(router=tiny_config().moe.router, ffn_hidden_size=16, dispatcher="ring")
    with pytest.raises(ValueError, match="MoEConfig.input_sharded"):
        MoEConfig(router=tiny_config().moe.router, ffn_hidden_size=16, input_sharded=True)
    with pytest.raises(ValueError, match="DenseLayout.sequence_group"):
        DenseLayout(sequence_group="cp")
    with pytest.raises(ValueError, match="MoELayout.reduce_group"):
        MoELayout("alltoall", AllToAllDispatcher, reduce_group="ep_etp")
    with pytest.raises(ValueError, match="MoELayout.dispatcher_class"):
        MoELayout("alltoall", AllGatherDispatcher, reduce_group="ep_etp")
    with pytest.raises(ValueError, match="MoELayout.folded"):
        MoELayout("allgather", AllGatherDispatcher, reduce_group="ep_etp", token_split_group="tp", folded=True)
    with pytest.raises(ValueError, match="MoELayout.expert_token_replicas"):
        MoELayout("allgather", AllGatherDispatcher, reduce_group="ep_etp", token_split_group="tp",
                  expert_token_replicas=2)
    with pytest.raises(ValueError, match="GradientReduction.expert_scale"):
        GradientReduction(expert_scale=2.0)
    with pytest.raises(ValueError, match="StageSplit.chunk_layer_ids"):
        StageSplit(pp_rank=0, chunk_layer_ids=())
    plan = build_parallel_plan(tiny_config(), ParallelState.single_process())
    with pytest.raises(ValueError, match="ParallelPlan.edp"):
        dataclasses.replace(plan, edp=2)
    with pytest.raises(ValueError, match="ParallelPlan.dense.context_group"):
        dataclasses.replace(plan, cp=2, dp=1, edp=2)
    with pytest.raises(ValueError, match="ParallelPlan.stages.pp_rank"):
        dataclasses.replace(plan, stages=StageSplit(pp_rank=1, chunk_layer_ids=(range(4),)))
