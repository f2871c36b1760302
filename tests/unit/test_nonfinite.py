"""Non-finite steps are skipped on every rank, leave the model untouched and name what went non-finite;
too many in a row stop the run; fp16 dynamic loss scaling backs off and grows, trains like fp32, and is
saved in training checkpoints with the skip counters."""

import logging
import math

import pytest
import torch

from tests.helpers.checkpointed_training import build_sampler, build_trainer, dataset
from megamoe.training.checkpoint import checkpoint_path, load_training_checkpoint, save_training_checkpoint
from megamoe.training.loss_scaling import DynamicLossScaler, LossScaleConfig
from megamoe.training.non_finite import NonFiniteTrainingError
from megamoe.training.trainer import TrainConfig
from tests.helpers.nonfinite import LOGGER, _assert_unchanged, _micro_batches, _poison, _snapshot


def _single():
    from parallel_state import ParallelState
    return ParallelState.single_process()


pytestmark = pytest.mark.usefixtures("one_thread")


def test_poisoned_weight_skips_the_step_names_it_and_stops_after_max_skipped_steps(caplog):
    state = _single()
    trainer = build_trainer(state, config=TrainConfig(lr=1e-2, max_skipped_steps=3))
    assert not trainer.train_step(_micro_batches()).skipped          # an optimizer state to keep unchanged
    name = "layers.2.self_attn.o_proj.weight"
    _poison(trainer.model, name)
    snapshot = _snapshot(trainer)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for step in (2, 3):
            m = trainer.train_step(_micro_batches())
            assert (m.step, m.skipped, m.consecutive_skips) == (step, True, step - 1)
            assert not math.isfinite(m.loss)
            _assert_unchanged(trainer, snapshot)
        assert "step 2 skipped" in caplog.text and f"parameter {name!r} holds NaN or Inf (rank 0)" in caplog.text
        with pytest.raises(NonFiniteTrainingError, match=rf"3 consecutive steps .* parameter '{name}' holds NaN"):
            trainer.train_step(_micro_batches())
    assert trainer.step == 4 and trainer.skipped_steps == 3           # skipped steps still count (Megatron's iteration)
    _assert_unchanged(trainer, snapshot)

    # Repaired, the run goes on and the count of consecutive skips restarts.
    with torch.no_grad():
        dict(trainer.model.named_parameters())[name].copy_(snapshot[0][name].nan_to_num(posinf=0.0))
    m = trainer.train_step(_micro_batches())
    assert (m.skipped, m.consecutive_skips, m.step) == (False, 0, 5) and math.isfinite(m.loss)


def test_a_non_finite_gradient_is_named_when_the_forward_was_finite(caplog):
    state = _single()
    trainer = build_trainer(state, config=TrainConfig(lr=1e-2, max_skipped_steps=0))
    name = "layers.1.mlp.shared_experts.up_proj"
    param = dict(trainer.model.named_parameters())[name]
    param.register_hook(lambda grad: grad * float("inf"))
    snapshot = _snapshot(trainer)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        m = trainer.train_step(_micro_batches())
    assert m.skipped and math.isfinite(m.loss) and not math.isfinite(m.grad_norm)
    assert f"the gradient of parameter {name!r} went non-finite first in the backward" in caplog.text
    _assert_unchanged(trainer, snapshot)


def test_a_non_finite_forward_is_named_by_its_first_module(caplog):
    state = _single()
    trainer = build_trainer(state, config=TrainConfig(lr=1e-2, max_skipped_steps=0))
    module = "layers.2.post_attention_layernorm"
    dict(trainer.model.named_modules())[module].register_forward_hook(lambda mod, inputs, out: out * float("nan"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        m = trainer.train_step(_micro_batches())
    assert m.skipped and not math.isfinite(m.loss)
    assert f"the output of module {module!r} went non-finite first in the forward (rank 0)" in caplog.text


# ----------------------------------------------------------------------------------------------
# fp16 dynamic loss scaling
# ----------------------------------------------------------------------------------------------
def test_loss_scaler_backs_off_on_overflow_and_grows_after_good_steps():
    scaler = DynamicLossScaler(LossScaleConfig(growth_interval=3))
    assert scaler.scale == 2.0 ** 16
    scaler.update(False)
    assert scaler.scale == 2.0 ** 15
    for _ in range(2):
        scaler.update(True)
    assert scaler.scale == 2.0 ** 15
    scaler.update(False)                      # an overflow resets the count of good steps
    for _ in range(2):
        scaler.update(True)
    assert scaler.scale == 2.0 ** 14
    scaler.update(True)
    assert scaler.scale == 2.0 ** 15 and scaler.good_steps == 0
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaleConfig(backoff_factor=1.0)


def test_loss_scale_backs_off_down_to_its_minimum_and_says_whether_it_lowered_it():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale=4.0, min_scale=2.0))
    assert scaler.update(False) and scaler.scale == 2.0           # lowered: calibrating
    assert not scaler.update(False) and scaler.scale == 2.0       # at the minimum: not lowered
    assert not scaler.update(True)
    assert DynamicLossScaler(LossScaleConfig(initial_scale=3.0, min_scale=2.0)).update(False)   # 3 -> 2
    for kwargs, message in (({"initial_scale": 0.5}, r"min_scale must be > 0 and at most initial_scale \(0.5\)"),
                            ({"min_scale": 0.0}, "min_scale must be > 0"),
                            ({"initial_scale": math.inf}, "initial_scale must be a finite number > 0")):
        with pytest.raises(ValueError, match=message):
            LossScaleConfig(**kwargs)


def test_fp16_training_backs_off_from_an_overflowing_scale_then_grows_and_checkpoints_its_scale(tmp_path):
    state, data = _single(), dataset()
    config = TrainConfig(lr=1e-2, autocast="fp16", max_skipped_steps=0,
                         loss_scale=LossScaleConfig(initial_scale=2.0 ** 22, growth_interval=2))
    trainer, sampler = build_trainer(state, config=config), build_sampler(state)
    scales, skipped = [], []
    for _ in range(9):
        snapshot = _snapshot(trainer)
        m = trainer.train_step([(data[i][:, :-1], data[i][:, 1:]) for i in sampler.next_micro_batches()])
        scales.append(m.loss_scale)
        skipped.append(m.skipped)
        if m.skipped:
            _assert_unchanged(trainer, snapshot)
    # Measured (router GEMM in fp32): 2**22 and 2**21 overflow this model's fp16 backward (first in
    # lm_head's gradient), 2**20 sometimes, 2**19 not.
    assert skipped[0] and not all(skipped), (scales, skipped)
    good_in_a_row = 0
    for scale, next_scale, skip in zip(scales, scales[1:], skipped):
        good_in_a_row = 0 if skip else good_in_a_row + 1
        expected = scale / 2 if skip else (scale * 2 if good_in_a_row == 2 else scale)
        good_in_a_row %= 2
        assert next_scale == expected, (scales, skipped)
    assert max(b / a for a, b in zip(scales, scales[1:])) == 2, "the scale grew"

    path = checkpoint_path(tmp_path, trainer.step)
    save_training_checkpoint(path, trainer, sampler_state=sampler.state_dict(), world_group=None)
    resumed = build_trainer(state, config=config)
    load_training_checkpoint(path, resumed, world_group=None)
    assert resumed.loss_scaler.state_dict() == trainer.loss_scaler.state_dict()
    assert (resumed.consecutive_skips, resumed.skipped_steps) == (trainer.consecutive_skips, trainer.skipped_steps)
    assert resumed.skipped_steps == sum(skipped) > 0


def test_fp16_from_megatrons_initial_scale_calibrates_without_stopping_but_divergence_still_stops(caplog):
    """Megatron's default initial scale, 2**32, overflows this model's fp16 backward for more steps than
    max_skipped_steps (10): those skips only lower the scale and do not count. A non-finite loss, or an
    overflow at the minimum scale, still counts."""
    state, data = _single(), dataset()
    config = TrainConfig(lr=1e-2, autocast="fp16", loss_scale=LossScaleConfig(initial_scale=2.0 ** 32))
    trainer, sampler = build_trainer(state, config=config), build_sampler(state)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        metrics = [trainer.train_step([(data[i][:, :-1], data[i][:, 1:]) for i in sampler.next_micro_batches()])
                   for _ in range(16)]
    skipped = [m.skipped for m in metrics]
    calibration = skipped.index(False)
    assert calibration > config.max_skipped_steps and all(skipped[:calibration]), skipped
    assert [m.loss_scale for m in metrics[:calibration + 1]] == [2.0 ** (32 - k) for k in range(calibration + 1)]
    assert all(m.consecutive_skips == 0 for m in metrics) and trainer.skipped_steps == sum(skipped)
    # Measured: 2**32 .. 2**21 overflow (12 skips), 2**20 sometimes; the run then trains.
    assert all(math.isfinite(m.loss) for m in metrics) and trainer.lr_schedule_steps == skipped.count(False) >= 3
    assert "calibrating: not counted toward max_skipped_steps" in caplog.text and "WARNING" not in caplog.text

    # Overflows at the minimum scale count: the scale cannot back off further.
    stuck = build_trainer(state, config=TrainConfig(lr=1e-2, autocast="fp16", max_skipped_steps=3, loss_scale=
                                                    LossScaleConfig(initial_scale=2.0 ** 32, min_scale=2.0 ** 32)))
    with pytest.raises(NonFiniteTrainingError, match="3 consecutive steps"):
        for _ in range(3):
            stuck.train_step(_micro_batches())
    assert stuck.loss_scaler.scale == 2.0 ** 32 and stuck.step == 3

    # A non-finite loss counts at once, far above the minimum scale (the forward does not depend on it).
    poisoned = build_trainer(state, config=TrainConfig(lr=1e-2, autocast="fp16", max_skipped_steps=2))
    _poison(poisoned.model, "layers.2.self_attn.o_proj.weight")
    with pytest.raises(NonFiniteTrainingError, match="2 consecutive steps .* holds NaN or Inf"):
        for _ in range(2):
            poisoned.train_step(_micro_batches())
    assert poisoned.loss_scaler.scale == 2.0 ** 14


def test_fp16_with_loss_scaling_tracks_fp32():
    state = _single()
    curves = {}
    for autocast in (None, "fp16"):
        trainer = build_trainer(state, config=TrainConfig(lr=1e-2, autocast=autocast))
        metrics = [trainer.train_step(_micro_batches()) for _ in range(4)]
        assert not any(m.skipped for m in metrics)
        curves[autocast] = [(m.loss, m.grad_norm) for m in metrics]
        if autocast == "fp16":
            assert [m.loss_scale for m in metrics] == [2.0 ** 16] * 4
            assert all(p.dtype == torch.float32 for p in trainer.model.parameters()), "fp32 master weights"
    assert curves[None][-1][0] < curves[None][0][0]
    for got, want in zip(curves["fp16"], curves[None]):         # losses and (unscaled) gradient norms
        assert all(abs(g - w) <= 2e-2 * abs(w) for g, w in zip(got, want)), (curves["fp16"], curves[None])
