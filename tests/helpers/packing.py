"""Shared by tests/unit/test_packing.py and tests/multirank/test_packing.py: the builders and constants of the
packing tests."""

import torch

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.transformer import AttentionConfig, MLAConfig, MLPConfig, RopeConfig
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


def one_by_one_logits(model, inputs, *, offset_positions=False) -> torch.Tensor:
    """[B, S, V]: every document run alone, as a batch of one (positions from 0, or from its offset
    in the row with ``offset_positions``)."""
    out = torch.empty(*inputs.shape, V)
    for row in range(inputs.shape[0]):
        for start, end in documents(row):
            positions = torch.arange(start, end)[None] if offset_positions else None
            out[row, start:end] = model(inputs[row:row + 1, start:end], positions)[0][0]
    return out
