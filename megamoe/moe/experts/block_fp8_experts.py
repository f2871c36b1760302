"""Routed experts holding kept block-FP8 weights, and the ``block`` FP8 recipe that runs them.

Storage (see :mod:`megamoe.quantization.kept_weights`): :class:`~megamoe.moe.experts.grouped_experts.GroupedExperts`
keeps its stacked layout, in ``float8_e4m3fn`` (``requires_grad=False``), with the block scales beside it::

    w_gate_up            [S, G * F_shard, H]   rows: gate shard, then up shard
    w_gate_up_scale_inv  [S, G * ceil(F_shard / bo), ceil(H / bi)]   gate's scale rows, then up's
    w_down               [S, H, F_shard]
    w_down_scale_inv     [S, ceil(H / bo), ceil(F_shard / bi)]

Gate and up keep separate scale grids (each half starts on a block boundary of its own), so the FFN size
need not be a multiple of the block: the edge blocks of each half are partial, as in the checkpoint. With
expert tensor parallelism ``F_shard`` must be a multiple of the block (``bo`` for gate / up rows, ``bi``
for down's columns), so that a shard's scales are a slice of the expert's. The logical tensors are the
checkpoint's: ``experts.<e>.gate_proj.weight`` [F, H] e4m3 and ``experts.<e>.gate_proj.weight_scale_inv``
[ceil(F / bo), ceil(H / bi)], etc. Replica slots and expert migration move the scales with the weights
(:meth:`GroupedExperts.slot_parameters` lists them).

The ``block`` recipe (``FP8Config(recipe="block")``), as DeepSeek's inference and TransformerEngine's
``Float8BlockScaling`` do: each GEMM ``Y = X W^T`` uses the weight's stored 2-D block scales as they are,
and quantizes the activation rows at run time per ``1 x bi`` tile along the contraction dim with current
scaling (``scale_inv = amax / fp8_max`` per tile, rounded up to a power of two when the checkpoint's
``scale_fmt`` is ``ue8m0``; an all-zero tile gets 1). Tiles never cross ranks (ETP shards hold whole
tiles), so no amax is reduced and every layout quantizes alike.

Kernels:

- ``emulated`` (``backend="fp8_emulated"``, any device, the reference): per slot, quantize the rows per
  tile and dequantize them in fp32, dequantize the slot's weights in fp32, multiply in fp32; each GEMM's
  output is cast to the activations' dtype (as an FP8 kernel writes it).
- ``scaled_mm`` (``backend="torch"``, CUDA sm90 with cuBLASLt >= 12.9, block 128 x 128): per slot
  ``torch._scaled_mm`` with 1x128 activation and 128x128 weight scales, the weight scales' leading dimension
  padded to a multiple of 4. Guarded by :func:`megamoe.moe.experts.kernel_probes.block_scaled_mm_problem`; NOT verified
  on a GPU here.
- ``dequantized`` (kept weights without an FP8 recipe): the slot's weights dequantized to the activations'
  dtype, ordinary GEMMs (no activation quantization), like the model's dense linears.

Inference only: the weights are frozen, and none of these paths defines a weight gradient.
"""

from __future__ import annotations

import torch

from megamoe.quantization.block_fp8 import (BlockFP8Config, block_scale_shape, dequantize_block_fp8,
                                            quantize_block_fp8)
from megamoe.quantization.kept_weights import kept_parameter
from megamoe.sharding import ShardSpec

__all__ = ["BLOCK_KERNELS", "block_fp8_grouped_mlp", "keep_expert_weights", "kept_forward", "kept_scale_shards",
           "load_kept_expert_weights", "quantize_activation_tiles"]

BLOCK_KERNELS = ("emulated", "scaled_mm", "dequantized")
_SCALE_STRIDE_MULTIPLE = 4      # fp32 elements between scale_b's columns: 16-byte aligned leading dimension


def _cat_bytes(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat`` of one-byte tensors as bytes (FP8 dtypes lack kernels on some devices)."""
    dtype = tensors[0].dtype
    if dtype.itemsize != 1:
        return torch.cat(tensors, dim)
    return torch.cat([t.view(torch.uint8) for t in tensors], dim).view(dtype)


def _check_etp(experts, config: BlockFP8Config, name: str) -> None:
    cfg = experts.config
    if cfg.etp_size == 1:
        return
    bo, bi = config.block_size
    for kind, block in (("gate / up rows", bo), ("down columns", bi)):
        if cfg.ffn_shard_size % block:
            raise ValueError(
                f"{name}: expert tensor parallelism splits ffn_hidden_size {cfg.ffn_hidden_size} into {cfg.etp_size} "
                f"shards of {cfg.ffn_shard_size}, not a multiple of the FP8 block ({block} {kind} of block_size "
                f"{tuple(config.block_size)}), so the shards would share block scales; use an ETP size whose shards "
                f"are multiples of {block}, or import the checkpoint dequantized (`import-hf --dtype bf16`)")


@torch.no_grad()
def keep_expert_weights(experts, config: BlockFP8Config, name: str) -> None:
    """Turn ``experts``' stacked weights into kept block-FP8 ones in place (quantizing their current
    values: each expert as a whole tensor would be, since shards hold whole blocks), adding the scales."""
    if experts.backend == "te":
        raise ValueError(f"{name}: kept block-FP8 experts run on backend 'fp8_emulated' or 'torch' (or 'loop' without "
                         "an FP8 recipe); TransformerEngine's GroupedLinear keeps weights of its own, so backend 'te' "
                         "cannot hold the checkpoint's bytes")
    _check_etp(experts, config, name)
    cfg = experts.config
    Fs, G = cfg.ffn_shard_size, 2 if cfg.gated else 1
    w_gate_up, w_down = experts.w_gate_up, experts.w_down
    halves = w_gate_up.detach().split(Fs, dim=1)                    # gate [, up], each [S, Fs, H]
    if w_gate_up.is_meta:
        meta = {"device": w_gate_up.device}
        q_gate_up = torch.empty(w_gate_up.shape, dtype=config.weight_dtype, **meta)
        s_gate_up = torch.empty((cfg.num_local_slots, G * block_scale_shape((Fs, 1), config.block_size)[0],
                                 block_scale_shape((1, cfg.hidden_size), config.block_size)[1]),
                                dtype=config.scale_dtype, **meta)
        q_down = torch.empty(w_down.shape, dtype=config.weight_dtype, **meta)
        s_down = torch.empty(block_scale_shape(w_down.shape, config.block_size), dtype=config.scale_dtype, **meta)
    else:
        quantized = [quantize_block_fp8(h, config.block_size, config.scale_fmt, config.fmt) for h in halves]
        q_gate_up = _cat_bytes([q for q, _ in quantized], 1)
        s_gate_up = _cat_bytes([s for _, s in quantized], 1)
        q_down, s_down = quantize_block_fp8(w_down.detach(), config.block_size, config.scale_fmt, config.fmt)
    for attr, values, like in (("w_gate_up", q_gate_up, w_gate_up), ("w_gate_up_scale_inv", s_gate_up, w_gate_up),
                               ("w_down", q_down, w_down), ("w_down_scale_inv", s_down, w_down)):
        if attr in experts._parameters:
            setattr(experts, attr, kept_parameter(values, ShardSpec(tuple(values.shape)), like=like))
        else:
            experts.register_parameter(attr, kept_parameter(values, ShardSpec(tuple(values.shape)), like=like))
    experts.weight_quantization = config


def _scale_rows(experts) -> int:
    """Scale rows of one half (gate or up) of a slot."""
    return block_scale_shape((experts.config.ffn_shard_size, 1), experts.weight_quantization.block_size)[0]


def kept_scale_shards(experts, local_slot: int) -> dict[str, torch.Tensor]:
    """This rank's scale shards of one slot, views: ``{"gate": [ceil(F_shard / bo), ceil(H / bi)], "up": ...,
    "down": [ceil(H / bo), ceil(F_shard / bi)]}`` (no "up" when not gated)."""
    rows = _scale_rows(experts)
    gate_up = experts.w_gate_up_scale_inv.detach()[local_slot]
    shards = {"gate": gate_up[:rows]}
    if experts.config.gated:
        shards["up"] = gate_up[rows:]
    shards["down"] = experts.w_down_scale_inv.detach()[local_slot]
    return shards


@torch.no_grad()
def load_kept_expert_weights(experts, local_slot: int, gate: torch.Tensor, up: torch.Tensor | None,
                             down: torch.Tensor) -> None:
    """Quantize one expert's FULL high-precision weights (HF layout) by blocks and write this rank's shard
    of the values and scales into ``local_slot`` (what a random initialisation of a kept model does)."""
    config, cfg = experts.weight_quantization, experts.config
    bo, bi = config.block_size
    Fs, r = cfg.ffn_shard_size, cfg.etp_rank
    weights = experts.expert_weight_shards(local_slot)
    scales = kept_scale_shards(experts, local_slot)
    for key, full in (("gate", gate), ("up", up), ("down", down)):
        if full is None:
            continue
        q, s = quantize_block_fp8(full, config.block_size, config.scale_fmt, config.fmt)
        if key == "down":
            q, s = q[:, r * Fs:(r + 1) * Fs], s[:, r * Fs // bi:r * Fs // bi + scales[key].shape[1]]
        else:
            q, s = q[r * Fs:(r + 1) * Fs], s[r * Fs // bo:r * Fs // bo + scales[key].shape[0]]
        weights[key].view(torch.uint8).copy_(q.view(torch.uint8))
        scales[key].copy_(s)


# ---- the block recipe -------------------------------------------------------------------------
def quantize_activation_tiles(x: torch.Tensor, tile: int, scale_fmt: str = "float"):
    """``(q, scale_inv)`` of activation rows ``x`` [N, K] quantized per ``1 x tile`` along K (current
    scaling; ``scale_inv`` [N, ceil(K / tile)] in the format of ``scale_fmt``); see the module docstring."""
    return quantize_block_fp8(x, (1, tile), scale_fmt)


def _dequantized_weights(experts, local_slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [G * F_shard, H], down [H, F_shard]) of one slot, dequantized to ``dtype``."""
    block = experts.weight_quantization.block_size
    weights, scales = experts.expert_weight_shards(local_slot), kept_scale_shards(experts, local_slot)
    parts = [dequantize_block_fp8(weights[k], scales[k], block, dtype) for k in ("gate", "up") if k in weights]
    return torch.cat(parts), dequantize_block_fp8(weights["down"], scales["down"], block, dtype)


def _fake_quantized(x: torch.Tensor, config: BlockFP8Config) -> torch.Tensor:
    """The activations as the FP8 GEMM sees them: tile-quantized, dequantized in fp32."""
    tile = config.block_size[1]
    q, scale_inv = quantize_activation_tiles(x, tile, config.scale_fmt)
    return dequantize_block_fp8(q, scale_inv, (1, tile), torch.float32)


def _scaled_mm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, config: BlockFP8Config) -> torch.Tensor:
    """``x [M, K] @ deq(w_q [N, K])^T`` with torch's blockwise FP8 GEMM (1x128 x 128x128 scales); bf16 out."""
    x_q, x_scale = quantize_activation_tiles(x, config.block_size[1], config.scale_fmt)
    # torch wants the activation scales outer-dim-major and fp32 (e8m0 values are exact in fp32).
    x_scale = x_scale.float().t().contiguous().t()
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=weight_scales_for_scaled_mm(w_scale),
                            out_dtype=torch.bfloat16)


def weight_scales_for_scaled_mm(w_scale: torch.Tensor) -> torch.Tensor:
    """``w_scale`` [ceil(N / 128), ceil(K / 128)] as ``_scaled_mm``'s ``scale_b`` [ceil(K / 128), ceil(N / 128)]:
    fp32, transposed (column-major), with the stride between its columns padded to a multiple of 4 (16 bytes):
    some cuBLASLt builds reject other leading dimensions of block scales. Same values, same shape."""
    rows, cols = w_scale.shape
    padded = w_scale.new_zeros(rows, -(-cols // _SCALE_STRIDE_MULTIPLE) * _SCALE_STRIDE_MULTIPLE, dtype=torch.float32)
    padded[:, :cols] = w_scale
    return padded[:, :cols].t()


def _slot_mlp(experts, local_slot: int, rows: torch.Tensor, activate, kernel: str) -> torch.Tensor:
    config = experts.weight_quantization
    if kernel == "scaled_mm":
        weights, scales = experts.expert_weight_shards(local_slot), kept_scale_shards(experts, local_slot)
        hidden = torch.cat([_scaled_mm(rows, weights[k], scales[k], config) for k in ("gate", "up") if k in weights],
                           -1).to(rows.dtype)
        act = activate(hidden)
        return _scaled_mm(act, weights["down"], scales["down"], config).to(rows.dtype)
    compute = torch.float32 if kernel == "emulated" else rows.dtype
    w_gate_up, w_down = _dequantized_weights(experts, local_slot, compute)
    x = _fake_quantized(rows, config) if kernel == "emulated" else rows
    hidden = torch.nn.functional.linear(x, w_gate_up).to(rows.dtype)      # as an FP8 kernel writes it
    act = activate(hidden)
    a = _fake_quantized(act, config) if kernel == "emulated" else act
    return torch.nn.functional.linear(a, w_down).to(rows.dtype)


def block_fp8_grouped_mlp(experts, tokens: torch.Tensor, sizes: list[int], activate, kernel: str) -> torch.Tensor:
    """The expert MLP of all slots on kept block-FP8 weights: ``tokens`` [N, H] sorted by slot, ``sizes``
    the host row counts per local slot -> [N, H] in ``tokens``' dtype (a partial sum over ETP). One slot's
    weights are dequantized at a time (``emulated`` / ``dequantized``), so the transient memory is one
    expert's, not the layer's."""
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"kernel must be one of {BLOCK_KERNELS}, got {kernel!r}")
    out = tokens.new_empty(tokens.shape)
    for s, (rows, out_rows) in enumerate(zip(tokens.split(sizes), out.split(sizes))):
        if rows.shape[0]:
            out_rows.copy_(_slot_mlp(experts, s, rows, activate, kernel))
    return out


def kept_forward(experts, tokens: torch.Tensor, sizes: list[int], activate) -> torch.Tensor:
    """:class:`~megamoe.moe.experts.grouped_experts.GroupedExperts`' forward with kept weights (or the
    ``block`` recipe): the recipe's kernel for the backend, or dequantized GEMMs without an FP8 recipe."""
    fp8 = experts.config.fp8
    if experts.weight_quantization is None:
        raise ValueError("FP8Config.recipe='block' uses the block scales of kept block-FP8 weights, but these "
                         "experts hold high-precision weights: import the checkpoint with `--dtype keep` "
                         "(GPTMoEConfig.weight_quantization), or use recipe 'delayed' / 'tensorwise' / 'rowwise'")
    if fp8 is not None and fp8.recipe != "block":
        raise ValueError(f"kept block-FP8 expert weights run FP8Config.recipe='block' (their stored scales), not "
                         f"{fp8.recipe!r}: set recipe='block', or expert_fp8=None to dequantize them at run time")
    kernel = "dequantized" if fp8 is None else ("scaled_mm" if experts.backend == "torch" else "emulated")
    if kernel == "scaled_mm" and tuple(experts.weight_quantization.block_size) != (128, 128):
        raise ValueError(f"backend='torch' runs the block recipe with torch._scaled_mm, whose blockwise kernels take "
                         f"128 x 128 weight blocks, not {tuple(experts.weight_quantization.block_size)}: use "
                         "backend='fp8_emulated', or expert_fp8=None to dequantize at run time")
    return block_fp8_grouped_mlp(experts, tokens, sizes, activate, kernel)
