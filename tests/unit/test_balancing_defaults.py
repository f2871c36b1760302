"""config_from_hf gives an imported model the family's load balancing for training (HF configs ship with
output_router_logits False, whose forward adds no balancing loss), logs it at training start, and keeps
HF's forward semantics on request (for_training=False); the logits do not depend on the choice."""

import dataclasses
import logging

import pytest
import torch

from megamoe.models import GPTMoEModel
from megamoe.models.families import config_from_hf
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from parallel_state import ParallelState
from tests.helpers.hf_models import hf_config


def _router(family, **overrides):
    cfg = hf_config(family)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    training = config_from_hf(cfg).moe.router
    as_hf = config_from_hf(cfg, for_training=False).moe.router
    return cfg, training, as_hf


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_switch_families_train_with_the_hf_aux_coefficient(family):
    cfg, training, as_hf = _router(family)
    assert cfg.output_router_logits is False and cfg.router_aux_loss_coef > 0
    assert training.aux_loss_coeff == pytest.approx(cfg.router_aux_loss_coef * cfg.num_experts_per_tok)
    assert as_hf.aux_loss_coeff == 0.0                        # what HF's forward adds: nothing
    _, _, as_hf_with_logits = _router(family, output_router_logits=True)
    assert as_hf_with_logits.aux_loss_coeff == training.aux_loss_coeff


def test_deepseek_balancing():
    _, v3, v3_as_hf = _router("deepseek_v3")
    assert v3.use_expert_bias and v3_as_hf.use_expert_bias    # part of V3's routing either way
    assert (v3.aux_loss_coeff, v3.seq_aux_loss_coeff) == (0.0, 0.0)
    _, v3_alpha, _ = _router("deepseek_v3", aux_loss_alpha=0.0001, seq_aux=True)
    assert (v3_alpha.aux_loss_coeff, v3_alpha.seq_aux_loss_coeff) == (0.0, 0.0001)

    _, v2, v2_as_hf = _router("deepseek_v2")
    assert (v2.seq_aux_loss_coeff, v2.aux_loss_coeff, v2.use_expert_bias) == (0.001, 0.0, False)
    assert (v2_as_hf.seq_aux_loss_coeff, v2_as_hf.aux_loss_coeff) == (0.0, 0.0)
    _, v2_batch_wise, _ = _router("deepseek_v2", aux_loss_alpha=0.003, seq_aux=False)
    assert (v2_batch_wise.aux_loss_coeff, v2_batch_wise.seq_aux_loss_coeff) == (0.003, 0.0)


def test_imported_model_trains_with_its_balancing_logged_and_the_same_logits(caplog):
    cfg = hf_config("qwen3_moe")
    state = ParallelState.single_process()
    models = {}
    for for_training in (True, False):
        config = config_from_hf(cfg, expert_backend="torch", for_training=for_training)
        models[for_training] = GPTMoEModel(config, state)
        initialize_parameters(models[for_training], seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (logits, aux), (hf_logits, hf_aux) = models[True](ids), models[False](ids)
    assert torch.equal(logits, hf_logits)
    assert float(aux) > 0 and float(hf_aux) == 0.0

    with caplog.at_level(logging.INFO, logger="megamoe.training.trainer"):
        Trainer(models[True], state, TrainConfig())
    coeff = cfg.router_aux_loss_coef * cfg.num_experts_per_tok
    assert [r.getMessage() for r in caplog.records] == [
        f"expert load balancing of MoE layers [1]: aux loss coeff {coeff:g}"]
    assert dataclasses.replace(models[True].config.moe.router, aux_loss_coeff=0.0) == models[False].config.moe.router
