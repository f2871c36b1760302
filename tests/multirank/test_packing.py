"""Packed documents (megamoe.data.packing): reset position ids and document ids match a token-by-token
reading of Megatron's rules; with both resets, a packed row gives every document the logits, token
losses and gradients it gets run alone (GQA with and without a sliding window, MLA; one process, TP 2
and PP 2); with labels on some tokens only, the per-token loss (chat SFT) is the mean over them under TP 2,
PP 2, CP 2 and DP 2; each reset alone behaves as documented; unpacked forwards keep the ``is_causal`` kernel.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_packing.py."""

import pytest
import torch
import torch.distributed as dist

from megamoe.data.packing import MicroBatch, PackingConfig, packed_micro_batch
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.packing import (DOC_LENGTHS, EOS, TOL, build_model, documents, model_config, one_by_one_logits,
                                   packed_tokens)


# ----------------------------------------------------------------------------------------------
# TP 2 and PP 2
# ----------------------------------------------------------------------------------------------
def _one_by_one_reference(config, inputs, labels):
    """Per-document logits, and the mean loss and gradient norm of the packed loss computed as the
    token-weighted sum of the documents run one by one (one process)."""
    model = build_model(config)
    with torch.no_grad():
        logits = one_by_one_logits(model, inputs)
    loss = sum(model(inputs[r:r + 1, s:e], labels=labels[r:r + 1, s:e])[0] * (e - s) / inputs.numel()
               for r in range(len(DOC_LENGTHS)) for s, e in documents(r))
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return logits, float(loss), float(grad_norm)


def _packed_under_layouts(rank, world_size):
    from megamoe.inference.pipeline_forward import pipeline_logits
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    config = model_config()
    inputs, labels = packed_tokens()
    ref_logits, ref_loss, ref_grad_norm = _one_by_one_reference(config, inputs, labels)
    batch = packed_micro_batch(inputs, labels, PackingConfig(EOS))
    for layout in ({"tp": 2}, {"pp": 2}):
        state = initialize_model_parallel(**layout)
        model = build_model(config, state)
        logits = pipeline_logits(model, state, inputs, position_ids=batch.position_ids,
                                 document_ids=batch.document_ids)
        torch.testing.assert_close(logits, ref_logits, rtol=TOL, atol=TOL, msg=str(layout))
        rows = [MicroBatch(*(t[row:row + 1] for t in batch)) for row in range(2)]
        # The forward-only schedule carries each micro-batch's packing ids to every stage, like training.
        assert evaluate_loss(model, state, rows, world_group=dist.group.WORLD) == pytest.approx(ref_loss, rel=TOL)
        trainer = Trainer(model, state, TrainConfig(grad_clip=0.0), world_group=dist.group.WORLD)
        # One row per micro-batch (rows of equal length: the mean over micro-batches is the token mean),
        # so that the 1F1B schedule must pair each micro-batch with its own position and document ids.
        metrics = trainer.train_step([MicroBatch(*(t[row:row + 1] for t in batch)) for row in range(2)])
        assert metrics.loss == pytest.approx(ref_loss, rel=TOL), layout
        assert metrics.grad_norm == pytest.approx(ref_grad_norm, rel=1e-4), layout
        destroy_model_parallel()
    # DP 2: each rank evaluates one row; the reported loss is the mean over both ranks.
    state = initialize_model_parallel()
    model = build_model(config, state)
    mine = [MicroBatch(*(t[rank:rank + 1] for t in batch))]
    assert evaluate_loss(model, state, mine, world_group=dist.group.WORLD) == pytest.approx(ref_loss, rel=TOL)
    destroy_model_parallel()
    _per_token_loss_under_layouts(rank, config, batch)


def _per_token_loss_under_layouts(rank, config, batch):
    """TrainConfig.per_token_loss (chat SFT: labels on assistant tokens only): rows holding 3 and 11 labelled
    tokens give the mean over all 14, and its gradient, as the documents run one by one, under TP 2, PP 2,
    CP 2 and DP 2 (a mean of the two rows' means would differ)."""
    from megamoe.data.eval_split import IGNORE_INDEX
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    keep = torch.zeros_like(batch.labels, dtype=torch.bool)
    keep[0, 2:5] = keep[1, 1:12] = True
    batch = batch._replace(labels=batch.labels.masked_fill(~keep, IGNORE_INDEX))
    model = build_model(config)
    loss = sum(model(batch.inputs[r:r + 1, s:e], labels=batch.labels[r:r + 1, s:e])[0] * keep[r, s:e].sum()
               for r in range(len(DOC_LENGTHS)) for s, e in documents(r)) / keep.sum()
    loss.backward()
    ref_grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    rows = [MicroBatch(*(t[row:row + 1] for t in batch)) for row in range(2)]
    for layout, mine in (({"tp": 2}, rows), ({"pp": 2}, rows), ({"cp": 2}, rows), ({}, rows[rank:rank + 1])):
        state = initialize_model_parallel(**layout)
        trainer = Trainer(build_model(config, state), state, TrainConfig(grad_clip=0.0, per_token_loss=True),
                          world_group=dist.group.WORLD)
        metrics = trainer.train_step(mine)
        assert metrics.loss == pytest.approx(float(loss), rel=TOL), layout or "dp 2"
        assert metrics.grad_norm == pytest.approx(ref_grad_norm, rel=1e-4), layout or "dp 2"
        destroy_model_parallel()


@pytest.mark.slow
def test_packed_documents_under_tp2_and_pp2():
    run_on_ranks(_packed_under_layouts, world_size=2, timeout_s=240)
