"""Shared by tests/unit/test_vocab_padding.py and tests/multirank/test_vocab_padding.py: the builders and constants
of the vocab padding tests."""

import torch

from megamoe.checkpoint_state import sharded_state_dict
from megamoe.inference.generation import GenerationConfig, generate
from megamoe.inference.pipeline_forward import pipeline_logits
from megamoe.inference.sampling import SamplingConfig
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.models.hf_loading import gather_logical_state
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.sharding import get_shard_spec
from megamoe.tensor_parallel import initialize_parameters
from megamoe.transformer import AttentionConfig, RopeConfig
from megamoe.transformer.mlp import MLPConfig
from parallel_state import ParallelState

H, S, B = 32, 8, 2
SOLO = ParallelState.single_process()
PROMPTS = [[5, 9, 12, 3, 40], [22, 8], [33, 17, 60]]
NEW = 4
SAMPLING = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95, seed=3)
REL_TOL = 2e-6          # fp32: another summation order only


def config(vocab: int, *, tie: bool, divisible_by: int = 1, sp: bool = False) -> GPTMoEConfig:
    """Two layers (dense, MoE), weights N(0, 0.5^2) so that the logits spread (a padding logit of 0
    would win a real one often if it were not masked)."""
    return GPTMoEConfig(
        family="custom", vocab_size=vocab, hidden_size=H, num_layers=2,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8)),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=4, top_k=2), ffn_hidden_size=16,
                      dispatcher="allgather", expert_backend="torch"),
        moe_layer_ids=(1,), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=32), tie_word_embeddings=tie,
        init_std=0.5, sequence_parallel=sp, make_vocab_size_divisible_by=divisible_by)


def batch(vocab: int):
    ids = torch.randint(0, vocab, (B, S + 1), generator=torch.Generator().manual_seed(vocab))
    return ids[:, :-1], ids[:, 1:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _grad_chunks(model) -> list:
    """(logical name, offsets, gradient) of every chunk the model holds: its gradients cut exactly like its
    weights (the parameters' data swapped with their gradients while the chunks are listed)."""
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        p.data, p.grad = p.grad, p.data
    try:
        return [(c.name, c.offsets, c.tensor.clone()) for c in sharded_state_dict(model)]
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


def _padding_grads_are_zero(model) -> bool:
    """Whether the padding rows of the embedding / output layer have exactly zero gradient."""
    for module in (getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)):
        if module is not None and module.weight.grad is not None:
            real = get_shard_spec(module.weight).logical_shape[0]
            if module.weight.grad[real:].count_nonzero():
                return False
    return True


def _generated(model, state) -> tuple[list, list]:
    greedy = generate(model, state, PROMPTS, GenerationConfig(max_new_tokens=NEW)).token_ids
    sampled = generate(model, state, PROMPTS, GenerationConfig(max_new_tokens=NEW, sampling=SAMPLING)).token_ids
    return greedy, sampled


def reference(vocab: int, *, tie: bool) -> dict:
    """One process, no padding: logits, loss, logical gradients, generated tokens, and the weights."""
    model = GPTMoEModel(config(vocab, tie=tie), SOLO)
    initialize_parameters(model, seed=vocab)
    inputs, labels = batch(vocab)
    with torch.no_grad():
        logits = pipeline_logits(model, SOLO, inputs)
    loss, _ = model(inputs, labels=labels)
    loss.backward()
    grads = {name: grad for name, _, grad in _grad_chunks(model)}
    return dict(logical=gather_logical_state(model), logits=logits, loss=loss.detach(), grads=grads,
                generated=_generated(model, SOLO))
