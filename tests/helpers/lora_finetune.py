"""The LoRA fine-tuning end-to-end test's inputs: a tiny random HF Qwen3-MoE saved with a ChatML tokenizer, and
chat JSON Lines whose assistant turns follow a rule to learn (each animal has its colour)."""

import json
import os

import torch

from tests.helpers.chat_data import save_chat_tokenizer
from tests.helpers.hf_models import lazy_transformers

ANIMALS = ("cat", "dog", "bird", "fish", "cow", "fox", "owl", "bee")
COLOURS = ("red", "blue", "green", "black", "white", "pink", "gray", "gold")


def chats(count: int, seed: int) -> list[dict]:
    """``{"messages": [system, user, assistant]}`` records: the assistant names the animal's colour."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(count):
        i = int(torch.randint(len(ANIMALS), (1,), generator=g))
        records.append({"messages": [
            {"role": "system", "content": "answer briefly"},
            {"role": "user", "content": f"what colour is the {ANIMALS[i]}?"},
            {"role": "assistant", "content": f"the {ANIMALS[i]} is {COLOURS[i]}."}]})
    return records


def write_chats(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def save_tiny_qwen3_moe(directory) -> str:
    """A random tiny HF Qwen3-MoE (H 32, 2 MoE layers of 8 experts, top-2; norms around 1, weights N(0, 0.2^2))
    with the ChatML tokenizer of
    tests/helpers/chat_data.py (its chat template marks the assistant's generations)."""
    t = lazy_transformers()
    save_chat_tokenizer(directory)
    vocab = t.AutoTokenizer.from_pretrained(directory).__len__()
    config = t.Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                              tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():           # norms around 1, weights N(0, 0.2^2): logits of order 1 (as the family tests)
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=g) * 0.2
            tensor.copy_(1.0 + noise if "norm" in name else noise)
    model.save_pretrained(directory)
    return os.fspath(directory)
