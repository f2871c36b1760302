"""A training run's HF starting and end points: an HF Qwen3-MoE directory loaded in process (1 rank; 2 ranks
with EP 2, replica slots and an expert-load file) gives transformers' logits and reads only each rank's
tensors; --model-config takes an HF config.json or megamoe fields and names the file and field on error;
pretrain_moe.py fine-tunes the HF model on a token file and exports a directory transformers loads, whose
loss on that data has clearly fallen; bad input ends in one error line before any work.
"""

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe.data.token_dataset import TokenDataset, build_token_file
from megamoe.data.tokenizer import Tokenizer
from megamoe.launch import run_script
from megamoe.moe.expert_slots import ExpertPlacement, save_expert_load
from megamoe.testing import run_on_ranks
from megamoe.training.model_config_file import read_model_config_file
from parallel_state import ParallelState
from test_hf_families import V, hf_config, lazy_transformers

REPO = Path(__file__).resolve().parent.parent
ATOL = 1e-4                                 # as the family tests
E = 8                                       # experts of the tiny qwen3_moe (MoE layer 1 only)
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
# In process, one rank
# ----------------------------------------------------------------------------------------------
def test_start_from_hf_gives_transformers_logits_and_keeps_the_provenance(hf_dir):
    from megamoe.training.hf_start import start_from_hf
    directory, expected = hf_dir
    model, start = start_from_hf(directory, ParallelState.single_process(), expert_backend="torch",
                                 num_expert_slots=12)
    with torch.no_grad():
        logits, _ = model.eval()(ids())
    assert (logits - expected).abs().max().item() <= ATOL
    assert model.config.moe.num_expert_slots == 12 and model.config.family == "qwen3_moe"
    assert model.config.moe.router.aux_loss_coeff > 0, "the training config: the family's balancing loss is on"
    with open(os.path.join(directory, "config.json")) as f:
        assert start.provenance.config == json.load(f)
    assert set(start.provenance.files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert Tokenizer.from_path(directory).vocab_size <= model.config.vocab_size


def test_hf_start_errors_name_the_problem(hf_dir, tmp_path):
    from checkpoint_tools.errors import ConversionError
    from megamoe.training.hf_start import check_vocab_fits_tp, hf_start_config, start_from_hf
    directory, _ = hf_dir
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(Path(directory, "config.json").read_text())
    with pytest.raises(ConversionError, match="no safetensors weights"):
        start_from_hf(tmp_path / "empty", ParallelState.single_process())
    with pytest.raises(ConversionError, match=r"config.json: MoEConfig.num_expert_slots \(7\) must be >= num_experts"):
        hf_start_config(directory, num_expert_slots=7)
    config = hf_start_config(directory).config
    with pytest.raises(ConversionError, match=f"vocab_size {V} is not a multiple of the tensor-parallel size 3"):
        check_vocab_fits_tp(config, 3, "here")
    check_vocab_fits_tp(config, 4, "here")


# ----------------------------------------------------------------------------------------------
# In process, two ranks: EP 2 with replica slots from an expert-load file
# ----------------------------------------------------------------------------------------------
LOADS = {1: [50, 1, 1, 1, 1, 1, 1, 30]}      # the only MoE layer of the tiny qwen3_moe


def _ep2_worker(rank, world_size, directory, expert_load, input_ids, expected):
    from checkpoint_tools.hf_checkpoint import HFCheckpoint
    from megamoe.inference.pipeline_forward import pipeline_logits
    from megamoe.training.hf_start import load_hf_weights, start_from_hf
    from parallel_state import destroy_model_parallel, initialize_model_parallel

    state = initialize_model_parallel(ep=2)
    try:
        model, _ = start_from_hf(directory, state, num_expert_slots=10, expert_load=expert_load,
                                 expert_backend="torch", load_weights=False)
        hf = HFCheckpoint.open(directory)
        read = load_hf_weights(model, hf)
        diff = (pipeline_logits(model.eval(), state, input_ids) - expected).abs().max().item()
        placement = model.moe_layers()[1].placement
        experts = sorted({int(placement.slot_to_expert[s]) for s in placement.local_slots(state.ep.rank)})
        return diff, placement.to_dict(), experts, read, hf.total_bytes
    finally:
        destroy_model_parallel()


@pytest.mark.slow
def test_start_from_hf_on_two_ranks_with_ep2_and_replica_slots(hf_dir, tmp_path):
    directory, expected = hf_dir
    save_expert_load(tmp_path / "load.json", LOADS, num_experts=E)
    results = run_on_ranks(_ep2_worker, 2, args=(directory, str(tmp_path / "load.json"), ids(), expected),
                           timeout_s=300)
    balanced = ExpertPlacement.balanced(LOADS[1], 10, 2)
    assert balanced.replica_counts[0] > 1, "the load file must give the hot expert replicas"
    held = []
    for diff, placement, experts, read, total in results:
        assert diff <= ATOL, f"logits differ by {diff:.2e}"
        assert ExpertPlacement.from_dict(placement) == balanced
        assert read < total, "each rank reads only the HF tensors it holds a part of"
        held.append(set(experts))
    assert held[0] | held[1] == set(range(E)) and held[0] != held[1]
