"""gpt-oss's routed experts in HF form (see :mod:`megamoe.hf.adapter` for the layouts): the fused,
gate/up-interleaved, biased tensors of both HF forms, and the import-only MXFP4 form of the releases."""

from __future__ import annotations

from typing import Iterator

import torch

from megamoe.hf.adapter import (DENSE_MLP_KEYS, GQA_LAYER_KEYS, LOGICAL_EXPERT_KEYS, STANDARD_EXPERTS, AdapterError,
                                HFAdapter, KeyTransform, Rename, Tensors)
from megamoe.models.config import GPTMoEConfig
from megamoe.quantization.mxfp4 import dequantize_mxfp4, mxfp4_shapes

__all__ = ["ADAPTER", "expert_steps", "mxfp4_steps", "LOGICAL_EXPERT_BIAS_KEYS"]

_GPT_OSS = "model.layers.{i}.mlp.experts."          # HF; logical names as in LOGICAL_EXPERT_KEYS
LOGICAL_EXPERT_BIAS_KEYS = ("layers.{i}.mlp.experts.{e}.gate_proj.bias", "layers.{i}.mlp.experts.{e}.up_proj.bias",
                            "layers.{i}.mlp.experts.{e}.down_proj.bias")


def _gpt_oss_logical(config: GPTMoEConfig, layer: int, templates) -> list[list[str]]:
    return [[t.format(i=layer, e=e) for e in range(config.moe.num_experts)] for t in templates]


def _interleaved(num_experts: int, transpose: bool):
    """[E, ..., 2F] (gate, up interleaved in the last dim) <-> E gates + E ups, each transposed to [F, H]
    (weights) or as they are [F] (biases)."""
    def to_logical(tensors: Tensors) -> Tensors:
        fused = tensors[0]
        gate, up = fused[..., 0::2], fused[..., 1::2]
        if transpose:
            gate, up = gate.transpose(-1, -2), up.transpose(-1, -2)
        return list(gate.unbind(0)) + list(up.unbind(0))

    def to_hf(tensors: Tensors) -> Tensors:
        gates, ups = torch.stack(list(tensors[:num_experts])), torch.stack(list(tensors[num_experts:]))
        if transpose:
            gates, ups = gates.transpose(-1, -2), ups.transpose(-1, -2)
        return [torch.stack((gates, ups), dim=-1).flatten(-2).contiguous()]
    return to_logical, to_hf


def _per_expert(transpose: bool):
    def to_logical(tensors: Tensors) -> Tensors:
        return [t.transpose(-1, -2) if transpose else t for t in tensors[0].unbind(0)]

    def to_hf(tensors: Tensors) -> Tensors:
        stacked = torch.stack(list(tensors))
        return [stacked.transpose(-1, -2).contiguous() if transpose else stacked]
    return to_logical, to_hf


def expert_steps(config: GPTMoEConfig, layer: int, fused: bool) -> list[KeyTransform]:
    """The HF form (the same in memory and on disk): fused, interleaved gate/up, biases."""
    E, F, H = config.moe.num_experts, config.moe.ffn_hidden_size, config.hidden_size
    gate, up, down = _gpt_oss_logical(config, layer, LOGICAL_EXPERT_KEYS)
    gate_b, up_b, down_b = _gpt_oss_logical(config, layer, LOGICAL_EXPERT_BIAS_KEYS)
    prefix = _GPT_OSS.format(i=layer)
    return [
        KeyTransform((prefix + "gate_up_proj",), ((E, H, 2 * F),), tuple(gate + up), ((F, H),) * (2 * E),
                     *_interleaved(E, transpose=True), what="de-interleave fused gate_up into per-expert gate/up"),
        KeyTransform((prefix + "gate_up_proj_bias",), ((E, 2 * F),), tuple(gate_b + up_b), ((F,),) * (2 * E),
                     *_interleaved(E, transpose=False), what="de-interleave the fused gate_up bias"),
        KeyTransform((prefix + "down_proj",), ((E, F, H),), tuple(down), ((H, F),) * E, *_per_expert(transpose=True),
                     what="split the fused down_proj [E, F, H] into per-expert [H, F]"),
        KeyTransform((prefix + "down_proj_bias",), ((E, H),), tuple(down_b), ((H,),) * E,
                     *_per_expert(transpose=False), what="split the fused down bias"),
    ]


def _import_only(tensors: Tensors) -> Tensors:
    raise AssertionError("an MXFP4 step is import-only: export writes the unquantized form")


def mxfp4_steps(config: GPTMoEConfig, layer: int) -> list[KeyTransform]:
    """The released MXFP4 experts (import only): blocks + scales dequantized to fp32 (exact)."""
    E, F, H = config.moe.num_experts, config.moe.ffn_hidden_size, config.hidden_size
    gate, up, down = _gpt_oss_logical(config, layer, LOGICAL_EXPERT_KEYS)
    prefix = _GPT_OSS.format(i=layer)

    def dequantized(tensors: Tensors, what: str) -> torch.Tensor:
        try:
            return dequantize_mxfp4(tensors[0], tensors[1])
        except ValueError as e:      # e.g. blocks that are not uint8
            raise AdapterError(f"{prefix}{what}_blocks / _scales: {e}") from None

    # Iterators: each expert's rows are dequantized when the conversion consumes them, so one logical
    # tensor (not a layer's fused [E, 2F, H] in fp32) is held at a time.
    def gate_up(tensors: Tensors) -> Iterator[torch.Tensor]:
        blocks, scales = tensors                                     # rows [E, 2F, ...]: gate / up interleaved
        for parity in (0, 1):                                        # every gate, then every up
            for e in range(E):
                yield dequantized((blocks[e, parity::2], scales[e, parity::2]), "gate_up_proj")

    def split_down(tensors: Tensors) -> Iterator[torch.Tensor]:
        for e in range(E):
            yield dequantized((tensors[0][e], tensors[1][e]), "down_proj")      # [H, F]
    try:
        gate_up_shapes, down_shapes = mxfp4_shapes((E, 2 * F, H)), mxfp4_shapes((E, H, F))
    except ValueError:
        return []            # sizes MXFP4 cannot store (not multiples of 32): no such checkpoint exists
    return [
        KeyTransform((prefix + "gate_up_proj_blocks", prefix + "gate_up_proj_scales"), gate_up_shapes,
                     tuple(gate + up), ((F, H),) * (2 * E), gate_up, _import_only,
                     what="dequantize the MXFP4 gate_up_proj"),
        KeyTransform((prefix + "down_proj_blocks", prefix + "down_proj_scales"), down_shapes, tuple(down),
                     ((H, F),) * E, split_down, _import_only, what="dequantize the MXFP4 down_proj"),
    ]


ADAPTER = HFAdapter(
    "gpt_oss", GQA_LAYER_KEYS + (Rename("model.layers.{i}.self_attn.sinks", "layers.{i}.self_attn.sinks",
                                        lambda c: (c.attention.num_attention_heads,)),),
    DENSE_MLP_KEYS,
    moe_keys=(Rename("model.layers.{i}.mlp.router.weight", "layers.{i}.mlp.router.weight",
                     lambda c: (c.moe.num_experts, c.hidden_size)),
              Rename("model.layers.{i}.mlp.router.bias", "layers.{i}.mlp.router.bias", lambda c: (c.moe.num_experts,))),
    experts=STANDARD_EXPERTS, expert_steps=expert_steps, import_only_steps=mxfp4_steps)
