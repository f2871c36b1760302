"""A model holding a block-FP8 checkpoint's weights as stored ("kept"): e4m3 values plus block scales.

With ``GPTMoEConfig.weight_quantization`` set, every weight ``n`` with
``weight_quantization.quantizes(n)`` is a ``float8_e4m3fn`` parameter (``requires_grad=False``) under its
usual logical name, shape and :class:`~megamoe.sharding.ShardSpec`, and its block scales are a second
parameter (``requires_grad=False``, dtype ``scale_dtype``) under ``scale_inv_name(n)``: module attribute
``<attr>_scale_inv`` (``q_proj.weight_scale_inv``, ``shared_experts.gate_proj_scale_inv``). Checkpoints,
``sharded_state_dict`` and the layout planner therefore see both as ordinary logical tensors, and a kept
model saved back holds the very bytes it loaded.

How the linears run: the dense ones (attention and MLA projections, dense MLPs, shared experts) are
**dequantized at run time**: :func:`linear_weight` rebuilds the weight in the activations' dtype for each
call (``q * scale_inv`` per block, in fp32), and the GEMM is the ordinary one, so they run on every
device and add no activation-quantization error (DeepSeek's reference inference does the same with its
default ``gemm_impl="bf16"``). Only a transient copy of one weight exists at a time. The routed experts run
the ``block`` FP8 recipe (:mod:`megamoe.moe.experts.block_fp8_experts`), or, without an FP8 recipe, the same
run-time dequantization.

Sharding: a TP / ETP shard must start and end on block boundaries (or be the whole tensor), so that a
shard's scales are a plain slice of the logical scales and shard with it (:func:`scale_shard_spec`).

The conversion (:func:`megamoe.models.block_fp8_layers.keep_block_fp8_weights`, one weight at a time by
:func:`keep_block_fp8_weight`) runs on each decoder layer right after it is built: its
current values are block-quantized in place (on ``meta`` only the tensors are replaced), so the peak memory
of building a kept model is that of the kept model plus one layer in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.quantization.block_fp8 import (SCALE_INV_SUFFIX, BlockFP8Config, block_scale_shape,
                                            dequantize_block_fp8, quantize_block_fp8)
from megamoe.sharding import ShardSpec, get_shard_spec, set_shard_spec

__all__ = ["keep_block_fp8_weight", "kept_parameter", "linear_weight", "scale_shard_spec", "FP8_DTYPES"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Attributes of a parameter that say how the rest of the library treats it (gradient sync, tags).
_COPIED_TAGS = ("sequence_parallel", "expert_parallel")


def scale_shard_spec(name: str, spec: ShardSpec, block_size: tuple[int, int]) -> ShardSpec:
    """The shard spec of the block scales of a weight sharded by ``spec`` (a 2-D ``[rows, cols]`` weight,
    or stacked ``[..., rows, cols]``). ValueError naming ``name`` when the shard does not start and end on
    block boundaries: its scales would then be shared with the neighbouring shard."""
    scale_shape = block_scale_shape(spec.global_shape, block_size)
    if spec.dim is None or spec.count == 1:
        return ShardSpec(scale_shape) if spec.dim is None else ShardSpec(scale_shape, spec.dim, 0, 1)
    ndim = len(spec.global_shape)
    if spec.dim < ndim - 2:                          # a stacking dim: one scale grid per entry
        return ShardSpec(scale_shape, spec.dim, spec.index, spec.count)
    block = block_size[0] if spec.dim == ndim - 2 else block_size[1]
    local = spec.local_shape[spec.dim]
    if local % block:
        kind = "rows" if spec.dim == ndim - 2 else "columns"
        raise ValueError(
            f"{name}: its {spec.global_shape[spec.dim]} {kind} split into {spec.count} shards of {local}, which is "
            f"not a multiple of the FP8 block ({block} of block_size {tuple(block_size)}), so the shards would share "
            f"block scales; use a layout whose shards are multiples of {block} {kind} (a smaller TP / ETP size), or "
            "import the checkpoint dequantized (`import-hf --dtype bf16`)")
    return ShardSpec(scale_shape, spec.dim, spec.index, spec.count)


def kept_parameter(values: torch.Tensor, spec: ShardSpec, like: torch.Tensor | None = None) -> nn.Parameter:
    """A frozen parameter holding ``values`` with shard spec ``spec`` (and the tags of ``like``)."""
    param = nn.Parameter(values, requires_grad=False)
    set_shard_spec(param, spec)
    for tag in _COPIED_TAGS:
        if like is not None and hasattr(like, tag):
            setattr(param, tag, getattr(like, tag))
    return param


@torch.no_grad()
def keep_block_fp8_weight(owner: nn.Module, attr: str, name: str, config: BlockFP8Config) -> None:
    """Replace ``owner.<attr>`` by its block-quantized e4m3 values and add ``owner.<attr>_scale_inv``."""
    weight = owner._parameters[attr]
    if weight.dim() != 2:
        raise ValueError(f"{name}: a block-FP8 weight is a 2-D matrix, got shape {tuple(weight.shape)}")
    spec = get_shard_spec(weight)
    scale_spec = scale_shard_spec(name, spec, config.block_size)
    if weight.is_meta:
        q = torch.empty(weight.shape, dtype=config.weight_dtype, device=weight.device)
        scale = torch.empty(scale_spec.local_shape, dtype=config.scale_dtype, device=weight.device)
    else:
        # Shards start and end on block boundaries (checked above), so quantizing the local shard gives
        # the slice of the whole tensor's quantization: the same values whatever the layout.
        q, scale = quantize_block_fp8(weight.detach(), config.block_size, config.scale_fmt, config.fmt)
    setattr(owner, attr, kept_parameter(q, spec, like=weight))
    scale_param = kept_parameter(scale, scale_spec, like=weight)
    scale_param.block_fp8 = config               # what linear_weight dequantizes with
    owner.register_parameter(attr + SCALE_INV_SUFFIX, scale_param)


def linear_weight(module: nn.Module, attr: str, dtype: torch.dtype) -> torch.Tensor:
    """``module.<attr>`` as the GEMM uses it: the parameter itself, or for a kept block-FP8 weight its
    dequantization in ``dtype`` (see the module docstring); plus, where :func:`megamoe.lora.apply_lora` gave
    the module adapters (a child ``lora_adapters``), their low-rank update ``scaling * B @ A``."""
    scale = module._parameters.get(attr + SCALE_INV_SUFFIX)
    weight = getattr(module, attr)
    if scale is not None:
        weight = dequantize_block_fp8(weight, scale, scale.block_fp8.block_size, dtype)
    lora = module._modules.get("lora_adapters")
    return weight if lora is None else lora.adapted(attr, weight)
