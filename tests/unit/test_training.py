"""Training under different (tp, pp, dp, ep, etp) layouts reproduces the single-process loss curve,
gradient norm and aux loss: in fp32 over a few steps, with replicated expert slots too, at pp 2 under bf16
autocast, and in fp64
over 30 steps at TP 2 (fp32 rounding, amplified by training, makes long fp32 curves drift).

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_training.py."""

import pytest
import torch

from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.tiny_model import E, MICRO_BATCH, global_batches, tiny_config


def test_single_process_training_reduces_loss_and_keeps_replicas_identical():
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = GPTMoEModel(tiny_config(num_slots=2 * E), state)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2))
    batch = global_batches()[0]
    first = last = None
    for _ in range(4):
        m = trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)])
        first = first if first is not None else m.loss
        last = m.loss
    assert last < first
    for layer in model.moe_layers().values():
        for expert in range(E):
            slots = [s for s in range(layer.placement.num_slots) if int(layer.placement.slot_to_expert[s]) == expert]
            weights = [layer.experts.expert_weight_shards(s) for s in slots]
            for w in weights[1:]:
                assert all(torch.equal(w[k], weights[0][k]) for k in w), f"replicas of expert {expert} diverged"


def test_layout_errors_name_the_fix():
    from parallel_state import ParallelState
    from dataclasses import replace
    state = ParallelState.single_process()
    fake_tp2 = replace(state, tp=replace(state.tp, size=2, ranks=(0, 1)), etp=replace(state.etp, size=4, ranks=(0, 1, 2, 3)))
    with pytest.raises(ValueError, match="etp dividing tp.*etp=4 tp=2"):
        GPTMoEModel(tiny_config("alltoall"), fake_tp2)


def test_bf16_autocast_keeps_fp32_master_weights_and_trains():
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = GPTMoEModel(tiny_config(), state)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2, autocast="bf16"))
    batch = global_batches()[0]
    losses = [trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)]).loss
              for _ in range(2)]
    assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights stay fp32"
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_the_adamw_flags_reach_the_optimizer(demo):
    """--weight-decay, --adam-beta1/2, --adam-eps and --clip-grad (Megatron's names) set TrainConfig, and so
    the optimizer's groups (biases and norms are not decayed) and the clipping the trainer applies."""
    from parallel_state import ParallelState
    from megamoe.errors import UsageError
    from megamoe.training.optim_arguments import train_config_kwargs
    args = demo.parse_args(["--weight-decay", "0.1", "--adam-beta1", "0.8", "--adam-beta2", "0.99",
                            "--adam-eps", "1e-6", "--clip-grad", "0.5"])
    config = TrainConfig(lr=1e-2, **train_config_kwargs(args, train_steps=args.steps))
    assert (config.weight_decay, config.betas, config.eps, config.grad_clip) == (0.1, (0.8, 0.99), 1e-6, 0.5)
    model = GPTMoEModel(tiny_config(num_layers=2), ParallelState.single_process())
    trainer = Trainer(model, ParallelState.single_process(), config)
    groups = trainer.optimizer.param_groups
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]
    assert {(g["betas"], g["eps"]) for g in groups} == {((0.8, 0.99), 1e-6)}
    assert trainer.config.grad_clip == 0.5
    defaults = demo.parse_args([])          # unchanged defaults: TrainConfig's
    assert TrainConfig(**train_config_kwargs(defaults, train_steps=10)) == TrainConfig(
        lr_schedule=config.lr_schedule, loss_scale=config.loss_scale)
    for argv, message in ((["--adam-beta2", "1"], r"^--adam-beta2 must be in \[0, 1\), got 1.0$"),
                          (["--adam-eps", "0"], r"^--adam-eps must be a finite number > 0"),
                          (["--weight-decay", "nan"], r"^--weight-decay must be a finite number >= 0, got nan"),
                          (["--clip-grad", "-1"], r"^--clip-grad must be a finite number >= 0")):
        with pytest.raises(UsageError, match=message):
            train_config_kwargs(demo.parse_args(argv), train_steps=10)


def test_fp16_autocast_with_bf16_parameters_is_refused_naming_the_fields():
    """bf16 parameters under fp16 autocast failed inside the experts at the first step; the Trainer refuses the
    combination up front, naming both settings and the fix."""
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = GPTMoEModel(tiny_config(), state, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"autocast='fp16' with bf16 parameters \(--param-dtype bf16\).*"
                                         r"autocast='bf16'"):
        Trainer(model, state, TrainConfig(lr=1e-2, autocast="fp16"))
    Trainer(model, state, TrainConfig(lr=1e-2, autocast="bf16"))         # the fix the message names is accepted
