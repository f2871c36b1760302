"""The ``quantization_config`` of an HF config.json: which methods import-hf reads, and what a block-FP8
release's files must hold.

Methods (:data:`QUANTIZATION_METHODS`, keyed by ``quant_method``): ``fp8`` with ``weight_block_size``
(DeepSeek-V3 / R1, Kimi-K2, MiniMax-M2, the Qwen3 and GLM FP8 releases) is read as block FP8
(:class:`~megamoe.quantization.block_fp8.BlockFP8Config`). Every other method (gptq, awq, bitsandbytes,
compressed-tensors, ...) is refused with an error naming it: their packed formats have no reader here.

A block-FP8 release is checked against its files before anything is written (:func:`resolve_block_fp8`):
``modules_to_not_convert`` / ``ignored_layers`` (HF module names, matched as transformers matches them)
name the linear weights left unquantized; every other linear weight the model would quantize must be
``float8_e4m3fn`` with a ``<key>_scale_inv`` beside it, and no other tensor may be FP8 or have scales.
A quantizable weight stored unquantized without scales and not listed is taken as unquantized too
(the files say so; logged), so a release that forgot to list one still converts.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from megamoe.checkpoint.errors import ConversionError
from megamoe.quantization.block_fp8 import SCALE_INV_SUFFIX, BlockFP8Config

__all__ = ["QUANTIZATION_METHODS", "DequantizedByAdapter", "hf_quantization", "without_quantization", "module_is_listed",
           "resolve_block_fp8"]

logger = logging.getLogger(__name__)

_FIX = "convert from an unquantized (bf16 / fp32) release of the model instead"
_SCALE_DTYPES = {torch.float32: "float", torch.float8_e8m0fnu: "ue8m0"}


def _block_fp8(quantization: Mapping[str, Any], where: str) -> BlockFP8Config:
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConversionError(f"{where}: quantization_config.activation_scheme {scheme!r} is not supported (static "
                              f"activation scales); only 'dynamic' block FP8 is; {_FIX}")
    if quantization.get("modules_to_convert"):
        raise ConversionError(f"{where}: quantization_config.modules_to_convert (FP8 embeddings) is not supported; "
                              f"{_FIX}")
    if quantization.get("expert_dtype", "fp8") != "fp8":
        raise ConversionError(f"{where}: quantization_config.expert_dtype {quantization['expert_dtype']!r} is not "
                              f"supported (experts must be block FP8 like the other weights); {_FIX}")
    for name in ("modules_to_not_convert", "ignored_layers"):
        listed = quantization.get(name)
        if listed is not None and not (isinstance(listed, list) and all(isinstance(m, str) for m in listed)):
            raise ConversionError(f"{where}: quantization_config.{name} must be a list of module names, got "
                                  f"{listed!r}")
    try:
        return BlockFP8Config.from_hf(quantization)
    except ValueError as e:
        raise ConversionError(f"{where}: {e}; {_FIX}") from None


@dataclass(frozen=True)
class DequantizedByAdapter:
    """A method whose packed tensors the family's adapter dequantizes on import (its import-only steps) into
    an ordinary checkpoint, which drops the quantization_config: ``mxfp4``, gpt-oss's experts
    (``*_blocks`` + ``*_scales``, :mod:`megamoe.quantization.mxfp4`)."""

    method: str
    packed_suffixes: tuple[str, ...]          # the integer tensors it packs values into


def _mxfp4(quantization: Mapping[str, Any], where: str) -> DequantizedByAdapter:
    return DequantizedByAdapter("mxfp4", ("_blocks", "_scales"))


# quant_method -> reader of the quantization_config (raises ConversionError naming the field).
QUANTIZATION_METHODS: dict[str, Callable[[Mapping[str, Any], str], Any]] = {
    "fp8": _block_fp8,
    "mxfp4": _mxfp4,
}


def hf_quantization(config: Mapping[str, Any], where: str):
    """What the ``quantization_config`` of the config.json dict ``config`` describes (None: unquantized);
    ConversionError for a method or field import-hf does not read."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    if not isinstance(quantization, dict):
        raise ConversionError(f"{where}: quantization_config must be a JSON object, got {quantization!r}")
    method = quantization.get("quant_method")
    reader = QUANTIZATION_METHODS.get(method)
    if reader is None:
        raise ConversionError(f"{where}: quantization_config.quant_method {method!r} is not supported (supported: "
                              f"{', '.join(sorted(QUANTIZATION_METHODS))}); {_FIX}")
    return reader(quantization, where)


def without_quantization(config: Mapping[str, Any]) -> dict:
    """``config`` less its ``quantization_config``: what transformers gets to build the (unquantized) model
    config from, so that it does not set up a quantizer of its own."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def module_is_listed(module: str, patterns) -> bool:
    """Whether the HF module name ``module`` is one of ``patterns`` as transformers reads its skip lists:
    the module name ends with the pattern, or the pattern (a regular expression) matches from the start
    up to a module boundary (``layers.1`` takes in ``layers.1.mlp``, not ``layers.11``; ``mlp.gate`` is
    not ``mlp.gate_proj``)."""
    for pattern in patterns:
        if module.endswith(pattern):
            return True
        try:
            if re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module):
                return True
        except re.error:            # not a regular expression: the suffix test was the only one
            continue
    return False


def resolve_block_fp8(base: BlockFP8Config, quantization: Mapping[str, Any], tensors, quantizable: dict[str, str],
                      ignored: Callable[[str], bool], where: str) -> BlockFP8Config:
    """``base`` with its ``unquantized`` logical names, after checking the files agree with it.

    ``tensors``: HF key -> info with ``dtype`` and ``shape`` (:class:`~megamoe.checkpoint.hf_checkpoint.HFTensorInfo`);
    ``quantizable``: HF key -> logical name of every linear weight a block-FP8 release may quantize;
    ``ignored``: HF keys the model drops (their scales go with them). ``scale_fmt`` follows the stored
    scales' dtype (fp32 scales of a ``ue8m0`` release are fp32 tensors holding powers of two): the kept
    checkpoint then stores them as they are.
    """
    listed = [*(quantization.get("modules_to_not_convert") or ()), *(quantization.get("ignored_layers") or ())]
    unquantized, unlisted, scale_dtypes = [], [], set()
    for key, logical in quantizable.items():
        info = tensors.get(key)
        if info is None:
            continue                    # the adapter's dry run names it
        scale = tensors.get(key + SCALE_INV_SUFFIX)
        is_listed = module_is_listed(key.removesuffix(".weight"), listed)
        if scale is None:
            if info.dtype == base.weight_dtype or info.dtype.itemsize == 1:
                raise ConversionError(f"{where}: {key!r} is {info.dtype} but {key + SCALE_INV_SUFFIX!r} is missing: "
                                      "a block-FP8 weight needs its block scales")
            unquantized.append(logical)
            if not is_listed:
                unlisted.append(key)
            continue
        if is_listed:
            raise ConversionError(f"{where}: quantization_config lists {key.removesuffix('.weight')!r} as not "
                                  f"converted, but {key!r} has block scales ({key + SCALE_INV_SUFFIX!r})")
        if info.dtype != base.weight_dtype:
            raise ConversionError(f"{where}: {key!r} has block scales but is {info.dtype}, not {base.weight_dtype} "
                                  f"(quantization_config.fmt {base.fmt!r})")
        if scale.dtype not in _SCALE_DTYPES:
            raise ConversionError(f"{where}: {key + SCALE_INV_SUFFIX!r} is {scale.dtype}; block scales are float32 "
                                  "or float8_e8m0fnu")
        scale_dtypes.add(scale.dtype)
    for key, info in tensors.items():
        if ignored(key):
            continue
        if key.endswith(SCALE_INV_SUFFIX) and key.removesuffix(SCALE_INV_SUFFIX) not in quantizable:
            weight = key.removesuffix(SCALE_INV_SUFFIX)
            why = "absent" if weight not in tensors else "not a linear weight of attention or an MLP"
            raise ConversionError(f"{where}: {key!r} is a block scale of no weight the model quantizes "
                                  f"({weight!r} is {why})")
        if key not in quantizable and info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ConversionError(f"{where}: {key!r} is {info.dtype}; only the linear weights of attention and the "
                                  "MLPs are read in block FP8")
    if unlisted:
        logger.info("%s: %d linear weights are stored unquantized without being listed in modules_to_not_convert "
                    "(e.g. %s): kept unquantized", where, len(unlisted), unlisted[0])
    if len(scale_dtypes) > 1:
        raise ConversionError(f"{where}: the block scales mix dtypes ({', '.join(sorted(map(str, scale_dtypes)))}); "
                              "one checkpoint stores them in one dtype")
    scale_fmt = _SCALE_DTYPES[scale_dtypes.pop()] if scale_dtypes else base.scale_fmt
    return BlockFP8Config(fmt=base.fmt, block_size=base.block_size, scale_fmt=scale_fmt,
                          unquantized=tuple(unquantized))
