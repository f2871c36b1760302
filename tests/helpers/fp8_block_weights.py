"""Shared by tests/unit/test_fp8_block_weights.py and tests/multirank/test_fp8_block_weights.py: the builders and
constants of the fp8 block weights tests."""

from __future__ import annotations

import dataclasses

from megamoe.hf.adapters import adapter_for
from megamoe.models import GPTMoEModel
from megamoe.models.hf_loading import load_logical_state
from megamoe.moe.experts.fp8 import FP8Config
from megamoe.quantization.block_fp8 import BlockFP8Config, dequantize_block_fp8, quantize_block_fp8, scale_inv_name
from parallel_state import ParallelState
from tests.helpers.hf_models import hf_model
BLOCK = (16, 12)             # partial blocks: 32 = 2 x 12 + 8 columns, 12 / 20 / 56 rows against 16, ...
SOLO = ParallelState.single_process()


def kept_case(family, block=BLOCK, scale_fmt="float", recipe="block", slots_per_expert=1):
    """(kept config, kept logical tensors (e4m3 + scales), the dequantized logical tensors, HF config's
    megamoe config) for the tiny ``family`` model quantized with ``block``."""
    hf, config = hf_model(family)
    logical = adapter_for(family).hf_to_megamoe(hf.state_dict(), config)
    quantization = BlockFP8Config(block_size=block, scale_fmt=scale_fmt)
    kept, dequantized = {}, {}
    for name, tensor in logical.items():
        if quantization.quantizes(name):
            q, scale_inv = quantize_block_fp8(tensor, block, scale_fmt)
            kept[name], kept[scale_inv_name(name)] = q, scale_inv
            dequantized[name] = dequantize_block_fp8(q, scale_inv, block)
        else:
            kept[name] = dequantized[name] = tensor
    fp8 = FP8Config(recipe="block", format="e4m3") if recipe == "block" else None
    moe = dataclasses.replace(config.moe, expert_fp8=fp8, expert_backend="fp8_emulated" if fp8 else "torch",
                              num_expert_slots=slots_per_expert * config.moe.num_experts)
    return dataclasses.replace(config, weight_quantization=quantization, moe=moe), kept, dequantized, config


def kept_model(config, kept, state=SOLO):
    model = GPTMoEModel(config, state).eval()
    unused = load_logical_state(model, kept)       # other ranks' experts and stages, under a layout
    assert state is not SOLO or unused == []
    return model
