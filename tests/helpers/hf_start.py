"""Shared by tests/unit/test_hf_start.py and tests/multirank/test_hf_start.py (and other tests): the builders and
constants of the hf start tests."""

import functools
import json
import os

import pytest
import torch

from megamoe.data.token_dataset import build_token_file
from megamoe.data.tokenizer import Tokenizer
from tests.helpers.hf_models import V, hf_config, lazy_transformers
ATOL = 1e-4                                 # as the family tests
WORDS = ("the", "a", "cat", "dog", "bird", "fish", "sees", "likes", "eats", "finds", "big", "small", "red",
         "blue", "old", "new", "on", "under", "mat", "tree", "box", "house", "and", "then", ".")


def sentences(count, seed=0):
    """Text with structure to learn: 'the <adj> <noun> <verb> a <noun> on the <place> .'"""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]
    nouns, verbs, adjs, places = WORDS[2:6], WORDS[6:10], WORDS[10:16], WORDS[18:22]
    return [f"the {pick(adjs)} {pick(nouns)} {pick(verbs)} a {pick(nouns)} {pick(('on', 'under'))} the "
            f"{pick(places)} ." for _ in range(count)]


def save_tokenizer(directory, extra_words=()):
    """A WordLevel HF tokenizer trained on WORDS (+ ``extra_words``), eos ``</s>``, in ``directory``."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers
    tok = HFTok(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words = list(WORDS) + list(extra_words)
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"],
                                                                        min_frequency=1))
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)


@functools.cache
def _hf_model_dir(root):
    """A random tiny HF Qwen3-MoE (norms around 1, weights N(0, 0.2^2)) saved with its tokenizer; its logits."""
    t = lazy_transformers()
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(hf_config("qwen3_moe"), attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=g) * 0.2
            tensor.copy_(1.0 + noise if "norm" in name else noise)
        logits = model(input_ids=ids()).logits
    directory = os.path.join(root, "qwen3_moe")
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return directory, logits


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _hf_model_dir(str(tmp_path_factory.mktemp("hf")))


def ids(batch=2, seq=9):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------------------------
# examples/pretrain_moe.py
# ----------------------------------------------------------------------------------------------
SEQ = 16


@pytest.fixture(scope="module")
def token_file(hf_dir, tmp_path_factory):
    """400 sentences tokenized with the HF directory's tokenizer."""
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    build_token_file(sentences(400), Tokenizer.from_path(hf_dir[0]), path)
    return path


def _train_args(tmp_path, data, steps):
    return ["--data", data, "--steps", steps, "--lr", "1e-3", "--seq-len", SEQ, "--global-batch", 4,
            "--micro-batch", 2, "--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt",
            "--save-every", steps, "--sample-tokens", 0, "--expert-backend", "torch"]
