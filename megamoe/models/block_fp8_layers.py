"""Keeping a built decoder layer's weights in block FP8 (see :mod:`megamoe.quantization.kept_weights`).

The walk lives here, above both the MoE layer and the quantization package: it must know a
:class:`~megamoe.moe.moe_layer.MoELayer` (whose routed experts convert themselves), and the MoE layer's
experts sit on :mod:`megamoe.quantization.kept_weights`, so the walk there would close an import cycle.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.moe.moe_layer import MoELayer
from megamoe.quantization.block_fp8 import BlockFP8Config
from megamoe.quantization.kept_weights import keep_block_fp8_weight

__all__ = ["keep_block_fp8_weights"]


@torch.no_grad()
def keep_block_fp8_weights(module: nn.Module, prefix: str, config: BlockFP8Config) -> None:
    """Make every weight of ``module`` whose logical name (``prefix`` + its qualified name) ``config``
    quantizes a kept block-FP8 weight (see :mod:`megamoe.quantization.kept_weights`), in place. The routed
    experts of a MoE layer convert themselves (``keep_block_fp8``: stacked per-slot weights with per-expert
    logical names)."""
    for module_name, owner in module.named_modules():
        if isinstance(owner, MoELayer):
            keep = getattr(owner.experts, "keep_block_fp8", None)
            if keep is None:
                raise ValueError(f"{prefix}{module_name}: the experts module {type(owner.experts).__name__} cannot "
                                 "hold kept block-FP8 weights (no keep_block_fp8); import with `--dtype bf16`")
            keep(config, f"{prefix}{module_name}.experts" if module_name else f"{prefix}experts")
        for attr in list(owner._parameters):
            name = f"{prefix}{module_name}.{attr}" if module_name else f"{prefix}{attr}"
            if owner._parameters[attr] is not None and config.quantizes(name):
                keep_block_fp8_weight(owner, attr, name, config)
