"""A bf16 training run follows the fp32 loss curve (issue 33, numerics): megamoe.training.loss_band's
band on hand-made curves, and a short bf16 run (bf16 parameters with fp32 master weights and main_grad)
of a shrunken demo model within a bound derived from bf16's rounding. The 200-step band of the demo model
itself is measured by benchmarks/bf16_loss_band.py (docs/bf16.md)."""

import pytest
import torch

from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.loss_band import loss_band, train_losses
from megamoe.training.trainer import TrainConfig
from parallel_state import ParallelState

STEPS, WINDOW, GLOBAL_BATCH, MICRO_BATCH, SEQ, DISTINCT = 12, 4, 4, 2, 16, 3
BF16_UNIT_ROUNDOFF = 2.0 ** -8
# bf16 rounds every GEMM input (weights and activations) to 2^-8 relative; the loss, a mean over many
# tokens, moves by a few of those; training on the same batches then lets the runs drift apart slowly.
# Allow 2 units (0.78%) on window means over STEPS steps: measured 0.05% (max per step 0.08%) on this
# shrunken model; the demo model's 200-step band is benchmarks/bf16_loss_band.py's (docs/bf16.md).
BAND_BOUND = 2 * BF16_UNIT_ROUNDOFF


def test_the_band_is_the_largest_relative_difference_of_window_means():
    reference = [4.0, 4.0, 2.0, 2.0]
    other = [4.0, 4.4, 2.0, 1.8]          # window means: 4.0 / 4.2, 3.0 / 3.2, 2.0 / 1.9
    band = loss_band(reference, other, window=2)
    assert band.steps == 4 and band.window == 2
    assert band.max_rel == pytest.approx(0.2 / 3.0)
    assert band.final_rel == pytest.approx(0.1 / 2.0)
    assert band.max_step_rel == pytest.approx(0.1)


@pytest.mark.parametrize("reference, other, window, message", [
    ([1.0, 2.0], [1.0], 1, "equally long"), ([], [], 1, "non-empty"), ([1.0, 2.0], [1.0, 2.0], 3, "window"),
    ([1.0, float("nan")], [1.0, 2.0], 1, "finite"), ([0.0, 1.0], [1.0, 1.0], 1, "positive")])
def test_bad_curves_are_refused(reference, other, window, message):
    with pytest.raises(ValueError, match=message):
        loss_band(reference, other, window=window)


def test_a_short_bf16_run_of_the_demo_model_follows_fp32(demo):
    args = demo.parse_args(["--hidden", "32", "--layers", "2", "--experts", "4"])
    config = demo.model_config(args, 128)
    generator = torch.Generator().manual_seed(1)
    distinct = torch.randint(0, config.vocab_size, (DISTINCT, GLOBAL_BATCH, SEQ + 1), generator=generator)
    batches = [distinct[step % DISTINCT] for step in range(STEPS)]
    initial, curves = None, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = GPTMoEModel(config, ParallelState.single_process())
        if initial is None:
            initialize_parameters(model, seed=0)
            initial = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(initial)
        model.to(dtype)
        curves[dtype] = train_losses(model, batches, TrainConfig(lr=5e-3), micro_batch=MICRO_BATCH)
        # (a bf16 model holds its routers' and shared experts' gates in fp32: precision.hold_in_compute_dtype_)
        assert all(p.dtype == dtype for n, p in model.named_parameters()
                   if ".router." not in n and not n.endswith("gate_weight"))
    assert curves[torch.float32][-1] < 0.9 * curves[torch.float32][0], "the fp32 run learns"
    assert curves[torch.bfloat16] != curves[torch.float32], "the bf16 run computed in bf16"
    band = loss_band(curves[torch.float32], curves[torch.bfloat16], window=WINDOW)
    assert band.max_rel <= BAND_BOUND, (band, curves)
