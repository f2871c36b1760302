"""Packed documents (megamoe.data.packing): reset position ids and document ids match a token-by-token
reading of Megatron's rules; with both resets, a packed row gives every document the logits, token
losses and gradients it gets run alone (GQA with and without a sliding window, MLA; one process, TP 2
and PP 2); each reset alone behaves as documented; unpacked forwards keep the ``is_causal`` kernel."""

import argparse

import pytest
import torch
import torch.nn.functional as F

from megamoe.data.packing import (MicroBatch, PackingConfig, add_packing_arguments, document_ids_of,
                                  document_position_ids, packed_micro_batch, packing_config_from_args, packing_inputs)
from megamoe.inference.kv_cache import StaticKVCache
from megamoe.models import LayerSpec
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import Attention
from megamoe.transformer import attention as attention_module
from parallel_state import ParallelState
from tests.helpers.packing import (DOC_LENGTHS, EOS, H, TOL, build_model, documents, model_config, one_by_one_logits,
                                   packed_tokens)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)


# ----------------------------------------------------------------------------------------------
# Position ids and document ids
# ----------------------------------------------------------------------------------------------
def token_by_token(input_ids, eos):
    """Megatron's rules read one token at a time: the reference for the vectorised functions."""
    positions, docs = torch.empty_like(input_ids), torch.empty_like(input_ids)
    for b in range(input_ids.shape[0]):
        doc = pos = 0
        for t in range(input_ids.shape[1]):
            positions[b, t], docs[b, t] = pos, doc
            pos += 1
            if int(input_ids[b, t]) == eos:      # the EOS ends its document; the next token starts one
                doc, pos = doc + 1, 0
    return positions, docs


def test_position_and_document_ids_follow_the_eos_tokens():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 4, (5, 23), generator=g)        # EOS = 0: many documents, some of one token
    ids[0, 0], ids[1, -1], ids[2] = EOS, EOS, 1            # EOS first / last; a row without EOS
    positions, docs = token_by_token(ids, EOS)
    assert torch.equal(document_position_ids(ids, EOS), positions)
    assert torch.equal(document_ids_of(ids, EOS), docs)
    assert torch.equal(document_ids_of(ids[2:3], EOS), torch.zeros(1, 23, dtype=torch.long))

    pos, doc = packing_inputs(ids, PackingConfig(EOS))
    assert torch.equal(pos, positions) and torch.equal(doc, docs)
    pos, doc = packing_inputs(ids, PackingConfig(EOS, reset_position_ids=False))
    assert torch.equal(pos, torch.arange(23).expand(5, 23)) and torch.equal(doc, docs)
    pos, doc = packing_inputs(ids, PackingConfig(EOS, reset_attention_mask=False))
    assert torch.equal(pos, positions) and doc is None


def test_packed_micro_batch_and_its_checks():
    inputs, labels = packed_tokens()
    batch = packed_micro_batch(inputs, labels, PackingConfig(EOS))
    assert isinstance(batch, MicroBatch) and batch.inputs is inputs and torch.equal(batch.labels, labels)
    masked = packed_micro_batch(inputs, labels, PackingConfig(EOS, mask_eod_loss=True)).labels
    assert torch.equal(masked == -100, inputs == EOS) and torch.equal(masked[inputs != EOS], labels[inputs != EOS])
    with pytest.raises(ValueError, match="PackingConfig.eos_id"):
        PackingConfig(-1)
    with pytest.raises(ValueError, match="integer token ids"):
        document_ids_of(inputs.float(), EOS)
    with pytest.raises(ValueError, match="labels .* must have the shape of inputs"):
        packed_micro_batch(inputs, labels[:, 1:], PackingConfig(EOS))


def test_packing_flags():
    parser = argparse.ArgumentParser()
    add_packing_arguments(parser)
    assert packing_config_from_args(parser.parse_args([]), EOS) is None
    args = parser.parse_args(["--reset-attention-mask", "--eod-mask-loss"])
    assert packing_config_from_args(args, 7) == PackingConfig(7, reset_position_ids=False, reset_attention_mask=True,
                                                              mask_eod_loss=True)
    with pytest.raises(ValueError, match="the tokenizer has none"):
        packing_config_from_args(args, None)


# ----------------------------------------------------------------------------------------------
# The model, one process
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention,window", [("gqa", None), ("gqa", 4), ("mla", None)])
def test_packed_documents_give_the_logits_and_losses_of_each_document_alone(attention, window):
    model = build_model(model_config(attention, window))
    inputs, labels = packed_tokens()
    position_ids, document_ids = packing_inputs(inputs, PackingConfig(EOS))
    with torch.no_grad():
        packed = model(inputs, position_ids, document_ids=document_ids)[0]
        alone = one_by_one_logits(model, inputs)
        torch.testing.assert_close(packed, alone, rtol=TOL, atol=TOL)
        torch.testing.assert_close(token_losses(packed, labels), token_losses(alone, labels), rtol=TOL, atol=TOL)
        # The model's mean loss is the token-weighted mean of the documents' own mean losses.
        loss = model(inputs, position_ids, labels, document_ids=document_ids)[0]
        per_document = [model(inputs[r:r + 1, s:e], labels=labels[r:r + 1, s:e])[0] * (e - s)
                        for r in range(len(DOC_LENGTHS)) for s, e in documents(r)]
        torch.testing.assert_close(loss, sum(per_document) / inputs.numel(), rtol=TOL, atol=TOL)
        # Without the document mask the same row mixes its documents.
        assert not torch.allclose(model(inputs, position_ids)[0], alone, atol=1e-3)


def test_packed_loss_gradients_are_the_token_weighted_sum_of_the_documents_gradients():
    model = build_model(model_config())
    inputs, labels = packed_tokens()
    position_ids, document_ids = packing_inputs(inputs, PackingConfig(EOS))
    model(inputs, position_ids, labels, document_ids=document_ids)[0].backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    total = sum(model(inputs[r:r + 1, s:e], labels=labels[r:r + 1, s:e])[0] * (e - s) / inputs.numel()
                for r in range(len(DOC_LENGTHS)) for s, e in documents(r))
    total.backward()
    assert sum(bool(g.abs().sum() > 0) for g in packed.values()) == len(packed), "every parameter is trained"
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_each_reset_alone_behaves_as_documented():
    model = build_model(model_config())
    inputs, _ = packed_tokens()
    with torch.no_grad():
        alone = one_by_one_logits(model, inputs)
        # Position ids reset alone: positions restart, but attention spans the row: only each row's
        # first document (which sees nothing before it) is computed as alone.
        position_ids, document_ids = packing_inputs(inputs, PackingConfig(EOS, reset_attention_mask=False))
        assert document_ids is None
        reset_positions = model(inputs, position_ids)[0]
        for row in range(inputs.shape[0]):
            (s0, e0), _, (s2, e2) = documents(row)
            torch.testing.assert_close(reset_positions[row, s0:e0], alone[row, s0:e0], rtol=TOL, atol=TOL)
            assert not torch.allclose(reset_positions[row, s2:e2], alone[row, s2:e2], atol=1e-3)
        # Attention mask reset alone: document-causal over positions that run on through the row:
        # each document is computed as alone at its offset positions.
        position_ids, document_ids = packing_inputs(inputs, PackingConfig(EOS, reset_position_ids=False))
        assert torch.equal(position_ids, torch.arange(inputs.shape[1]).expand_as(inputs))
        torch.testing.assert_close(model(inputs, position_ids, document_ids=document_ids)[0],
                                   one_by_one_logits(model, inputs, offset_positions=True), rtol=TOL, atol=TOL)


def test_unpacked_forwards_keep_the_is_causal_kernel(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    model = build_model(model_config())
    inputs, _ = packed_tokens()
    with torch.no_grad():
        model(inputs)
        assert calls and all(is_causal and mask is None for is_causal, mask in calls)
        calls.clear()
        model(inputs, document_ids=document_ids_of(inputs, EOS))
        assert calls and all(not is_causal and mask is not None for is_causal, mask in calls)


def test_packing_with_a_kv_cache_or_a_wrong_shape_is_refused():
    model = build_model(model_config())
    inputs, _ = packed_tokens()
    document_ids = document_ids_of(inputs, EOS)
    caches = {i: StaticKVCache(32) for i in model.layer_ids}
    with pytest.raises(ValueError, match="cannot be combined with a KV cache"):
        model(inputs, kv_caches=caches, document_ids=document_ids)
    attention = model.layers["0"].self_attn
    hidden = torch.zeros(*inputs.shape, H)
    with pytest.raises(ValueError, match="cannot be combined with a KV cache"):
        attention(hidden, torch.arange(16).expand(2, 16), StaticKVCache(32), document_ids=document_ids)
    with pytest.raises(ValueError, match=r"document_ids must be \[batch, seq\] = \[2, 16\]"):
        model(inputs, document_ids=document_ids[:, :8])


class OldStyleAttention(Attention):
    """A custom attention written before packing: its forward has no ``document_ids`` keyword."""

    def forward(self, hidden, position_ids, kv_cache=None, attention_mask=None, position_embeddings=None):
        return super().forward(hidden, position_ids, kv_cache, attention_mask, position_embeddings)


def test_custom_attention_without_document_ids_works_unpacked_and_refuses_packing():
    inputs, _ = packed_tokens()
    custom = build_model(model_config(), layer_spec=LayerSpec(attention=OldStyleAttention))
    with torch.no_grad():
        assert torch.equal(custom(inputs)[0], build_model(model_config())(inputs)[0])
        with pytest.raises(ValueError, match="OldStyleAttention has no document_ids keyword"):
            custom(inputs, document_ids=document_ids_of(inputs, EOS))


def test_trainer_takes_packed_micro_batches():
    state = ParallelState.single_process()
    inputs, labels = packed_tokens()
    model = build_model(model_config())
    with torch.no_grad():
        documents_loss = float(token_losses(one_by_one_logits(model, inputs), labels).mean())
        row_loss = float(model(inputs, labels=labels)[0])
    packed = Trainer(model, state, TrainConfig(grad_clip=0.0))
    assert packed.train_step([packed_micro_batch(inputs, labels, PackingConfig(EOS))]).loss == pytest.approx(
        documents_loss, rel=TOL)
    # A plain (inputs, labels) pair still trains the whole row as one causal sequence.
    plain = Trainer(build_model(model_config()), state, TrainConfig(grad_clip=0.0))
    assert plain.train_step([(inputs, labels)]).loss == pytest.approx(row_loss, rel=TOL)
    assert abs(row_loss - documents_loss) > 1e-3


def test_evaluate_loss_is_the_mean_loss_without_gradients():
    config = model_config()
    model = build_model(config)
    inputs, labels = packed_tokens()
    pairs = [(inputs[r:r + 1], labels[r:r + 1]) for r in range(2)]
    with torch.no_grad():
        expected = sum(float(model(i, labels=l)[0]) for i, l in pairs) / 2
    state = ParallelState.single_process()
    assert evaluate_loss(model, state, pairs) == pytest.approx(expected, rel=1e-6)
    assert model.training and all(p.grad is None for p in model.parameters())
    # A padding micro-batch (labels all -100, as eval_batches pads the last step) counts for nothing.
    padding = (inputs[:1], torch.full_like(labels[:1], -100))
    assert evaluate_loss(model, state, pairs + [padding]) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        evaluate_loss(model, state, [])
    with pytest.raises(ValueError, match="no labelled token"):
        evaluate_loss(model, state, [padding])
