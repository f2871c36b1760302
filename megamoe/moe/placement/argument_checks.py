"""Argument checks shared by expert placements, load counters and the expert-load file."""

from __future__ import annotations

import operator

import torch


def positive_int(value, name: str) -> int:
    # bool is an int subclass; `True` experts is always a mistake.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be >= 1, got {number}")
    return number


def validated_load(expert_load, num_experts: int | None, name: str) -> torch.Tensor:
    """[E] float64 CPU copy of a per-expert load; ValueError for a wrong length, negative or non-finite load."""
    try:
        load = torch.as_tensor(
            expert_load.detach() if isinstance(expert_load, torch.Tensor) else expert_load
        ).to(device="cpu", dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{name} must be a 1-D sequence of numbers: {error}") from None
    if load.dim() != 1 or load.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D vector of per-expert loads, got shape {tuple(load.shape)}")
    if num_experts is not None and load.numel() != num_experts:
        raise ValueError(
            f"{name} has {load.numel()} entries but there are {num_experts} experts; give one load per expert"
        )
    if not torch.isfinite(load).all():
        raise ValueError(f"{name} contains NaN or infinite values; loads must be finite token counts or fractions")
    if (load < 0).any():
        first = int((load < 0).nonzero()[0])
        raise ValueError(f"{name}[{first}] is negative ({load[first].item()}); loads must be >= 0")
    return load


def hierarchy(num_experts: int, ep_size: int, num_groups, num_nodes) -> tuple[int, int]:
    """(num_groups, num_nodes) of a hierarchical placement, validated; (1, 1) for a flat one (both None)."""
    if (num_groups is None) != (num_nodes is None):
        raise ValueError(
            "num_groups and num_nodes go together (hierarchical placement); give both or neither"
        )
    if num_groups is None:
        return 1, 1  # the flat policy is the one-group, one-node case
    num_groups = positive_int(num_groups, "num_groups")
    num_nodes = positive_int(num_nodes, "num_nodes")
    if num_experts % num_groups != 0:
        raise ValueError(f"num_experts ({num_experts}) is not a multiple of num_groups ({num_groups}); "
                         f"expert groups must be equal-sized")
    if num_groups % num_nodes != 0:
        raise ValueError(f"num_groups ({num_groups}) is not a multiple of num_nodes ({num_nodes}); "
                         f"each node must take the same number of whole groups")
    if ep_size % num_nodes != 0:
        raise ValueError(f"ep_size ({ep_size}) is not a multiple of num_nodes ({num_nodes}); "
                         f"each node must hold the same number of EP ranks")
    return num_groups, num_nodes
