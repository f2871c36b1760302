"""Shared by tests/unit/test_inference.py and tests/multirank/test_inference.py: the builders and constants of the
inference tests."""

import dataclasses
import os

import torch

from megamoe.hf.adapters import adapter_for
from megamoe.inference.generation import GenerationConfig, generate, left_padded_batch
from megamoe.inference.sampling import SamplingConfig
from megamoe.models import GPTMoEModel
from megamoe.models.hf_loading import gather_logical_state, load_logical_state
from megamoe.tensor_parallel import initialize_parameters
from parallel_state import ParallelState
from tests.helpers.hf_models import hf_model

PROMPTS = [[5, 9, 12, 3, 40, 7, 1], [22, 8], [33, 17, 60, 2, 9], [11, 4, 4, 50]]   # different lengths
NEW = 6
SAMPLING = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95, seed=3)
SOLO = ParallelState.single_process()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _our_model(family, state=SOLO, **moe_fields):
    hf, config = hf_model(family)
    return _model_from_logical(config, adapter_for(family).hf_to_megamoe(hf.state_dict(), config), state,
                               **moe_fields)


def _model_from_logical(config, logical, state=SOLO, **moe_fields):
    """Our model of ``config`` (its MoE fields replaced by ``moe_fields``) holding the logical weights ``logical``:
    what a spawned rank builds from its arguments without importing transformers (seconds in each rank)."""
    if moe_fields:
        config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe_fields))
    model = GPTMoEModel(config, state)
    load_logical_state(model, logical)
    return model


def _mtp_model(state=SOLO):
    """The tiny deepseek_v3 with one MTP layer under ``state``: the main weights from transformers' model, the
    MTP layer's its own random ones (seeded, built in one process: the same under every layout)."""
    hf, main = hf_model("deepseek_v3")
    config = dataclasses.replace(main, mtp_num_layers=1)
    solo = GPTMoEModel(config, SOLO)
    initialize_parameters(solo, seed=0)
    logical = gather_logical_state(solo)
    logical.update(adapter_for("deepseek_v3").hf_to_megamoe(hf.state_dict(), main))
    model = solo if state is SOLO else GPTMoEModel(config, state)
    load_logical_state(model, logical)
    return model.eval()


def _hf_generate(hf, prompts, max_new_tokens, stop_id):
    """transformers' greedy generate() on the left-padded batch; each row cut after its stop token."""
    ids, mask = left_padded_batch(prompts)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=stop_id, pad_token_id=0)
    rows = []
    for new in out[:, ids.shape[1]:].tolist():
        rows.append(new[:new.index(stop_id) + 1] if stop_id in new else new)
    return rows


def _stop_token(family):
    """A token the model generates for some prompt at step >= 2 and not before, so stopping at it
    changes the output: (token, that prompt's index, the unstopped generations)."""
    free_run = generate(_our_model(family), SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW)).token_ids
    return next((t, row) for row, ids in enumerate(free_run) for i, t in enumerate(ids)
                if i >= 2 and t not in ids[:i]) + (free_run,)
