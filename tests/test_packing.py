"""Packed documents (megamoe.data.packing): reset position ids and document ids match a token-by-token
reading of Megatron's rules; with both resets, a packed row gives every document the logits, token
losses and gradients it gets run alone (GQA with and without a sliding window, MLA; one process, TP 2
and PP 2); each reset alone behaves as documented; unpacked forwards keep the ``is_causal`` kernel."""

import argparse

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.data.packing import (MicroBatch, PackingConfig, add_packing_arguments, document_ids_of,
                                  document_position_ids, packed_micro_batch, packing_config_from_args, packing_inputs)
from megamoe.inference.kv_cache import StaticKVCache
from megamoe.models import GPTMoEConfig, GPTMoEModel, LayerSpec
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import Attention, AttentionConfig, MLAConfig, MLPConfig, RopeConfig
from megamoe.transformer import attention as attention_module
from parallel_state import ParallelState

H, V, EOS = 32, 64, 0
# Two rows of three EOS-terminated documents each (lengths), 16 tokens per row.
DOC_LENGTHS = [(5, 7, 4), (3, 9, 4)]
TOL = 1e-5


def model_config(attention: str = "gqa", sliding_window: int | None = None) -> GPTMoEConfig:
    """Layer 0 dense, layers 1-2 MoE (dropless, no balancing loss: a token's output depends only on
    the tokens it attends to, so packed and one-by-one runs are comparable token for token)."""
    if attention == "gqa":
        attn = AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               rope=RopeConfig(dim=8), qk_norm="per_head", sliding_window=sliding_window)
    else:   # DeepSeek-V3 style: q LoRA, interleaved YaRN rotary on a part of the head
        attn = MLAConfig(hidden_size=H, num_attention_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8,
                         rope=RopeConfig(dim=4, rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                         mscale=1.0, mscale_all_dim=1.0, layout="interleaved"))
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=3, attention=attn,
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=4, top_k=2), ffn_hidden_size=16,
                      dispatcher="allgather", expert_backend="torch"),
        moe_layer_ids=(1, 2), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=48))


def build_model(config: GPTMoEConfig, state=None, layer_spec=None) -> GPTMoEModel:
    model = GPTMoEModel(config, state or ParallelState.single_process(), layer_spec=layer_spec)
    initialize_parameters(model, seed=0)
    return model


def packed_tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [2, 16], next-token labels [2, 16]) of :data:`DOC_LENGTHS`: documents of random non-EOS
    tokens, each ending with EOS; the label after a row's last EOS is one more random token."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in DOC_LENGTHS:
        docs = [torch.cat([torch.randint(1, V, (n - 1,), generator=g), torch.tensor([EOS])]) for n in lengths]
        rows.append(torch.cat(docs + [torch.randint(1, V, (1,), generator=g)]))
    tokens = torch.stack(rows)
    return tokens[:, :-1], tokens[:, 1:]


def documents(row: int):
    """(start, end) of each document of ``row``."""
    bounds, start = [], 0
    for n in DOC_LENGTHS[row]:
        bounds.append((start, start + n))
        start += n
    return bounds


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)


def one_by_one_logits(model, inputs, *, offset_positions=False) -> torch.Tensor:
    """[B, S, V]: every document run alone, as a batch of one (positions from 0, or from its offset
    in the row with ``offset_positions``)."""
    out = torch.empty(*inputs.shape, V)
    for row in range(inputs.shape[0]):
        for start, end in documents(row):
            positions = torch.arange(start, end)[None] if offset_positions else None
            out[row, start:end] = model(inputs[row:row + 1, start:end], positions)[0][0]
    return out


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


@pytest.mark.slow
def test_packed_documents_under_tp2_and_pp2():
    run_on_ranks(_packed_under_layouts, world_size=2, timeout_s=240)

