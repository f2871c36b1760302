"""Layout-invariant, seeded parameter initialisation.

Each parallel layer draws its *full logical* weight from a generator and keeps its own chunk (see
:class:`megamoe.sharding.ShardSpec`). Two consequences the tests rely on:

- Building a layer after ``torch.manual_seed(s)`` gives the same logical weight for every TP size
  (every rank draws the same full tensor and slices it).
- :func:`initialize_parameters` seeds each module from ``(seed, module name)``, so a model gives the
  same weights under any pipeline split too, as long as module names are layout-invariant (models
  name layers by their global index).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Callable

import torch
from torch import nn

from megamoe.sharding import get_shard_spec

__all__ = ["InitMethod", "normal_init", "zeros_init", "init_sharded_", "seeded_generator", "initialize_parameters"]

InitMethod = Callable[[torch.Tensor, "torch.Generator | None"], None]


def normal_init(std: float = 0.02) -> InitMethod:
    """N(0, std^2), the Megatron / HF default for linear and embedding weights."""
    def init(tensor: torch.Tensor, generator: torch.Generator | None) -> None:
        tensor.normal_(0.0, std, generator=generator)
    return init


def zeros_init(tensor: torch.Tensor, generator: torch.Generator | None = None) -> None:
    tensor.zero_()


@torch.no_grad()
def init_sharded_(param: torch.Tensor, init_method: InitMethod, generator: torch.Generator | None = None) -> None:
    """Draw the full logical tensor on CPU in fp32 and copy this rank's chunk into ``param``."""
    if param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError("a kept block-FP8 weight (GPTMoEConfig.weight_quantization) holds a checkpoint's values and "
                         "cannot be initialised: load the checkpoint into it, or build the model without "
                         "weight_quantization to initialise it")
    spec = get_shard_spec(param)
    full = torch.empty(spec.global_shape, dtype=torch.float32)
    init_method(full, generator)
    real = spec.logical_part(param)
    if real.shape != param.shape:       # a padded vocabulary (see ShardSpec): the padding rows are zero
        param.zero_()
    real.copy_(spec.slice_of(full))


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator whose state depends only on ``seed`` and ``name`` (stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def initialize_parameters(model: nn.Module, seed: int) -> None:
    """Call ``reset_parameters(generator=...)`` on every submodule that accepts a generator, seeding
    each from ``(seed, qualified module name)``."""
    for name, module in model.named_modules():
        reset = getattr(module, "reset_parameters", None)
        if reset is not None and "generator" in inspect.signature(reset).parameters:
            reset(generator=seeded_generator(seed, name))
