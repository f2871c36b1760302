"""Tests marked ``cuda`` (registered in pyproject.toml) need a CUDA GPU: skipped, saying so, without one."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); run scripts/gpu_smoke.sh "
                                   "on a GPU machine")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
