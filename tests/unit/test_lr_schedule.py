"""LR schedules: each style's values at key steps against its closed form, validation, the trainer setting
each step's LR, and a resume mid-schedule continuing the uninterrupted run (a changed schedule refused
unless overridden)."""

import logging
import math

import pytest
import torch

from megamoe.checkpoint.format import CheckpointError
from tests.helpers.checkpointed_training import build_sampler, build_trainer, dataset
from megamoe.training.checkpoint import checkpoint_path, load_training_checkpoint, save_training_checkpoint
from megamoe.training.lr_schedule import LRScheduleConfig
from megamoe.training.trainer import TrainConfig

PEAK, MIN_RATIO, WARMUP, DECAY = 2.0, 0.1, 10, 110
MIN = PEAK * MIN_RATIO


def _schedule(style, **kw):
    return LRScheduleConfig(style=style, warmup_steps=WARMUP, decay_steps=None if style == "constant" else DECAY,
                            min_lr_ratio=MIN_RATIO, **kw)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "wsd"])
def test_linear_warmup_reaches_the_peak_at_its_last_step(style):
    schedule = _schedule(style, **({"wsd_decay_steps": 20} if style == "wsd" else {}))
    assert [schedule.lr_at(s, PEAK) for s in (1, 5, WARMUP)] == [PEAK / WARMUP, PEAK / 2, PEAK]


def test_constant_stays_at_the_peak():
    schedule = _schedule("constant")
    assert [schedule.lr_at(s, PEAK) for s in (WARMUP + 1, 1000, 10**6)] == [PEAK] * 3
    assert LRScheduleConfig().lr_at(1, PEAK) == PEAK          # the default: no warmup, no decay


def test_linear_and_cosine_decay_to_the_minimum():
    quarter, middle = WARMUP + (DECAY - WARMUP) // 4, WARMUP + (DECAY - WARMUP) // 2
    linear, cosine = _schedule("linear"), _schedule("cosine")
    assert linear.lr_at(middle, PEAK) == pytest.approx(MIN + (PEAK - MIN) * 0.5)
    assert linear.lr_at(quarter, PEAK) == pytest.approx(MIN + (PEAK - MIN) * 0.75)
    assert cosine.lr_at(middle, PEAK) == pytest.approx(MIN + (PEAK - MIN) * 0.5)
    assert cosine.lr_at(quarter, PEAK) == pytest.approx(MIN + (PEAK - MIN) * (1 + math.cos(math.pi / 4)) / 2)
    for schedule in (linear, cosine):
        assert schedule.lr_at(DECAY, PEAK) == pytest.approx(MIN)
        assert schedule.lr_at(DECAY + 1, PEAK) == schedule.lr_at(10 * DECAY, PEAK) == MIN


@pytest.mark.parametrize("shape, coeff_at_half", [
    ("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1), ("minus_sqrt", 1 - 0.5 ** 0.5)])
def test_wsd_warms_up_holds_the_peak_then_decays_over_its_last_steps(shape, coeff_at_half):
    by_steps = _schedule("wsd", wsd_decay_style=shape, wsd_decay_steps=20)
    by_fraction = _schedule("wsd", wsd_decay_style=shape, wsd_decay_fraction=20 / DECAY)
    for schedule in (by_steps, by_fraction):
        assert schedule.wsd_steps() == 20
        assert [schedule.lr_at(s, PEAK) for s in (WARMUP + 1, 50, DECAY - 20)] == [PEAK] * 3     # stable
        assert schedule.lr_at(DECAY - 10, PEAK) == pytest.approx(MIN + (PEAK - MIN) * coeff_at_half)
        assert schedule.lr_at(DECAY, PEAK) == pytest.approx(MIN)
        assert schedule.lr_at(DECAY + 5, PEAK) == MIN
        decay = [schedule.lr_at(s, PEAK) for s in range(DECAY - 20, DECAY + 1)]
        assert all(a > b for a, b in zip(decay, decay[1:])), "the decay falls at every step"


@pytest.mark.parametrize("kwargs, field", [
    (dict(style="step"), "style"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio"),
    (dict(style="cosine"), "decay_steps"),
    (dict(style="linear", warmup_steps=10, decay_steps=10), "decay_steps"),
    (dict(style="cosine", decay_steps=10, wsd_decay_steps=2), "wsd_decay_steps"),
    (dict(style="wsd", decay_steps=10), "exactly one of wsd_decay_steps and wsd_decay_fraction"),
    (dict(style="wsd", decay_steps=10, wsd_decay_steps=2, wsd_decay_fraction=0.2), "exactly one"),
    (dict(style="wsd", decay_steps=10, wsd_decay_fraction=1.5), "wsd_decay_fraction"),
    (dict(style="wsd", decay_steps=10, warmup_steps=5, wsd_decay_steps=6), "must fit between the warmup"),
    (dict(style="wsd", decay_steps=10, wsd_decay_steps=2, wsd_decay_style="step"), "wsd_decay_style"),
])
def test_bad_schedules_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LRScheduleConfig(**kwargs)


def test_script_flags_build_the_schedule_and_bad_ones_name_the_flag():
    import argparse

    from megamoe.errors import UsageError
    from megamoe.training.optim_arguments import add_optim_arguments, train_config_kwargs
    parser = argparse.ArgumentParser()
    add_optim_arguments(parser)
    kwargs = train_config_kwargs(parser.parse_args(["--lr-schedule", "wsd", "--warmup-steps", "5",
                                                    "--min-lr-ratio", "0.1", "--max-skipped-steps", "0"]),
                                 train_steps=100)
    assert kwargs["lr_schedule"] == LRScheduleConfig(style="wsd", warmup_steps=5, decay_steps=100, min_lr_ratio=0.1,
                                                     wsd_decay_fraction=0.2)
    assert kwargs["max_skipped_steps"] == 0 and kwargs["loss_scale"].initial_scale == 2.0 ** 16
    assert kwargs["loss_scale"].min_scale == 1.0
    given = train_config_kwargs(parser.parse_args(["--min-loss-scale", "4"]), train_steps=100)
    assert given["loss_scale"].min_scale == 4
    assert train_config_kwargs(parser.parse_args([]), train_steps=100)["lr_schedule"] == LRScheduleConfig()
    TrainConfig(lr=1e-3, **kwargs)
    for argv, message in ((["--lr-schedule", "cosine", "--warmup-steps", "100", "--lr-decay-steps", "100"],
                           r"^--lr-decay-steps must be an int > --warmup-steps \(100\)"),
                          # --lr-decay-steps not given: the warmup is too long for --steps, which the user gave.
                          (["--lr-schedule", "cosine", "--warmup-steps", "100"],
                           r"^--warmup-steps 100 is too long for the run \(--steps 100\): --lr-schedule cosine "
                           "decays after the warmup until the last step; lower --warmup-steps or raise --steps$"),
                          (["--lr-warmup-steps", "101"], r"^--warmup-steps 101 is too long for the run \(--steps "
                                                          r"100\): the LR would never reach --lr"),
                          (["--lr-schedule", "wsd", "--lr-wsd-decay-steps", "2", "--lr-wsd-decay-fraction", "0.1"],
                           "^--lr-schedule 'wsd' needs exactly one of --lr-wsd-decay-steps and "
                           "--lr-wsd-decay-fraction"),
                          (["--lr-wsd-decay-steps", "3"], "need --lr-schedule wsd"),
                          (["--loss-scale-window", "0"], "^--loss-scale-window must be"),
                          (["--initial-loss-scale", "0.5"],
                           r"^--min-loss-scale must be > 0 and at most --initial-loss-scale \(0.5\), got 1"),
                          (["--initial-loss-scale", "inf"], "^--initial-loss-scale must be a finite number > 0"),
                          (["--max-skipped-steps", "-1"], "^--max-skipped-steps must be >= 0")):
        with pytest.raises(UsageError, match=message):
            train_config_kwargs(parser.parse_args(argv), train_steps=100)


def test_train_config_refuses_a_bad_skip_limit():
    with pytest.raises(ValueError, match="max_skipped_steps"):
        TrainConfig(max_skipped_steps=-1)


# ----------------------------------------------------------------------------------------------
# In the trainer, and across a resume
# ----------------------------------------------------------------------------------------------
SCHEDULE = LRScheduleConfig(style="cosine", warmup_steps=2, decay_steps=7, min_lr_ratio=0.1)
CONFIG = TrainConfig(lr=1e-2, lr_schedule=SCHEDULE)


def _single():
    from parallel_state import ParallelState
    return ParallelState.single_process()


pytestmark = pytest.mark.usefixtures("one_thread")   # bitwise comparisons between runs


def _run(trainer, sampler, data, num_steps):
    """(lr, loss) of the next steps, checking the optimizer ran each step at the LR reported."""
    out = []
    for _ in range(num_steps):
        micro_batches = [(data[i][:, :-1], data[i][:, 1:]) for i in sampler.next_micro_batches()]
        m = trainer.train_step(micro_batches)
        assert all(g["lr"] == m.lr for g in trainer.optimizer.param_groups)
        out.append((m.lr, m.loss))
    return out


def test_trainer_sets_each_steps_lr_and_a_resume_continues_the_schedule_exactly(tmp_path, caplog):
    state, data = _single(), dataset()
    trainer, sampler = build_trainer(state, config=CONFIG), build_sampler(state)
    first = _run(trainer, sampler, data, 3)
    path = checkpoint_path(tmp_path, 3)
    save_training_checkpoint(path, trainer, sampler_state=sampler.state_dict(), world_group=None)
    then = _run(trainer, sampler, data, 5)
    assert [lr for lr, _ in first + then] == [SCHEDULE.lr_at(s, 1e-2) for s in range(1, 9)]
    assert then[-1][0] == pytest.approx(1e-3)                # past decay_steps: the minimum

    resumed, resumed_sampler = build_trainer(state, config=CONFIG), build_sampler(state)
    resumed_sampler.load_state_dict(load_training_checkpoint(path, resumed, world_group=None)["sampler_state"])
    assert _run(resumed, resumed_sampler, data, 5) == then   # same LRs and losses, bitwise

    # Another schedule (or peak): refused, naming the change, unless overridden.
    for changed in (TrainConfig(lr=1e-2, lr_schedule=LRScheduleConfig(style="linear", warmup_steps=2, decay_steps=7,
                                                                        min_lr_ratio=0.1)),
                    TrainConfig(lr=2e-2, lr_schedule=SCHEDULE)):
        with pytest.raises(CheckpointError, match=r"another LR schedule: .*(style 'cosine' -> 'linear'|peak_lr).*"
                                                  r"override_lr_schedule=True"):
            load_training_checkpoint(path, build_trainer(state, config=changed), world_group=None)
    overridden = build_trainer(state, config=changed)
    with caplog.at_level(logging.WARNING, logger="megamoe.training.checkpoint"):
        load_training_checkpoint(path, overridden, world_group=None, override_lr_schedule=True)
    assert "overriding it" in caplog.text and "peak_lr 0.01 -> 0.02" in caplog.text
    assert _run(overridden, build_sampler(state), data, 1)[0][0] == SCHEDULE.lr_at(4, 2e-2)


def _nan_forward(trainer):
    """A hook that makes the forward non-finite (the step is skipped); remove() it to end that."""
    norm = trainer.model.layers["1"].post_attention_layernorm
    return norm.register_forward_hook(lambda module, inputs, output: output * float("nan"))


def test_skipped_steps_do_not_advance_the_schedule_and_a_resume_keeps_its_position(tmp_path):
    """As Megatron's train_step (opt_param_scheduler.step only if update_successful): the LR of the update
    after k skipped steps is the LR the run without them has at that update, before and after a resume."""
    state, data = _single(), dataset()
    clean = build_trainer(state, config=CONFIG)
    want = _run(clean, build_sampler(state), data, 6)

    trainer, sampler = build_trainer(state, config=CONFIG), build_sampler(state)
    got = _run(trainer, sampler, data, 2)
    hook = _nan_forward(trainer)
    off_sampler = [(data[rows][:, :-1], data[rows][:, 1:]) for rows in torch.arange(4).split(2)]
    skipped = [trainer.train_step(off_sampler) for _ in range(3)]
    hook.remove()
    assert all(m.skipped for m in skipped) and trainer.step == 5
    assert [m.lr for m in skipped] == [SCHEDULE.lr_at(3, 1e-2)] * 3     # the LR the next update gets
    assert trainer.lr_schedule_steps == 2
    got += _run(trainer, sampler, data, 1)
    path = checkpoint_path(tmp_path, trainer.step)
    save_training_checkpoint(path, trainer, sampler_state=sampler.state_dict(), world_group=None)
    then = _run(trainer, sampler, data, 3)
    assert got + then == want                     # same LRs and losses, bitwise, as without the skips

    resumed, resumed_sampler = build_trainer(state, config=CONFIG), build_sampler(state)
    resumed_sampler.load_state_dict(load_training_checkpoint(path, resumed, world_group=None)["sampler_state"])
    assert (resumed.step, resumed.lr_schedule_steps, resumed.skipped_steps) == (6, 3, 3)
    assert _run(resumed, resumed_sampler, data, 3) == then


def test_a_checkpoint_without_the_schedule_position_continues_from_its_step_and_a_bad_one_is_refused():
    trainer = build_trainer(_single(), config=CONFIG)
    trainer.step = 7
    trainer.load_training_state({"skipped_steps": 2})      # saved before the position was recorded
    assert trainer.lr_schedule_steps == 7
    for bad in (8, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"training_state\.lr_schedule_steps must be an int in \[0, step=7\]"):
            trainer.load_training_state({"lr_schedule_steps": bad})
