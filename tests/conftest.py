"""Shared by the tests: the ``demo``, ``gpu_smoke`` and ``gpu_check`` fixtures (the scripts as modules), ``one_thread``, and the ``cuda``
marker (registered in pyproject.toml): tests that need a CUDA GPU are skipped, saying so, without one; and the
``multirank`` marker on every test under tests/multirank/ (``make test-gpu`` runs them over NCCL). The fixtures that
tests of several modules take (tiny HF checkpoints, tokenizers, data) live in tests/helpers/ and are registered here.
"""

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Fixtures shared by test modules (registered here, so that no test module imports another).
from tests.helpers.checkpoint_integrity import sources  # noqa: F401
from tests.helpers.generate_script import checkpoint  # noqa: F401
from tests.helpers.hf_checkpoints import hf_models  # noqa: F401
from tests.helpers.hf_start import hf_dir, token_file  # noqa: F401
from tests.helpers.mtp import mtp_hf_dir  # noqa: F401
from tests.helpers.pretrain_data import inputs  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
# --autocast auto stays fp32 in every test, and in the scripts and ranks they start, on any machine (oracle
# tests compare fp32 runs; megamoe.matmul_peak.PIN_ENV); tests/test_matmul_peak.py unsets it to measure.
os.environ.setdefault("MEGAMOE_AUTOCAST_AUTO", "none")
# torch.compile's cache (graphs, kernels) in a directory of this run's own, for it and the processes it starts:
# the tests compile cold, as on a fresh CI machine, and never load what another process wrote into the
# machine-wide /tmp/torchinductor_<user> (a graph cached there by a concurrent session aborted pytest with
# "Fatal Python error: Aborted" inside the compiled decode step, twice; the same test passed with a cache of its own).
_INDUCTOR_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="megamoe-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


def pytest_sessionfinish(session, exitstatus):
    if _INDUCTOR_CACHE is not None:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)


def _script_module(monkeypatch, name: str, path: str):
    """The script at ``path`` (from the repo root) as module ``name``, registered in sys.modules for the test."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)     # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_smoke(monkeypatch):
    """scripts/gpu_smoke.py as a module."""
    return _script_module(monkeypatch, "gpu_smoke", "scripts/gpu_smoke.py")


@pytest.fixture
def gpu_check(monkeypatch):
    """scripts/gpu_check.py as a module."""
    return _script_module(monkeypatch, "gpu_check", "scripts/gpu_check.py")


class _TrainCommand:
    """``megamoe train`` as examples/pretrain_moe.py runs it (``PROG``, ``main``, ``parse_args``,
    ``build_parser``: its prog) over the library modules that hold the rest (the checks, the loop): a name
    reads from the first module that has it, and a test's monkeypatch.setattr sets it in each that has it."""

    def __init__(self, script):
        from megamoe.cli import train
        from megamoe.training import pretrain, pretrain_checks
        object.__setattr__(self, "_modules", (train, pretrain, pretrain_checks))
        object.__setattr__(self, "PROG", script.PROG)
        object.__setattr__(self, "main", script.main)
        object.__setattr__(self, "parse_args", lambda argv=None: train.parse_args(argv, prog=script.PROG))
        object.__setattr__(self, "build_parser", lambda: train.build_parser(script.PROG))

    def __getattr__(self, name):
        for module in self._modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(name)

    def __setattr__(self, name, value):
        holders = [module for module in self._modules if hasattr(module, name)]
        if not holders:
            raise AttributeError(name)
        for module in holders:
            setattr(module, name, value)


@pytest.fixture
def demo(monkeypatch):
    """examples/pretrain_moe.py (``megamoe train``) run in this process as one plain ``python`` process."""
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    module = _TrainCommand(_script_module(monkeypatch, "pretrain_moe", "examples/pretrain_moe.py"))
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    # `make test-gpu` runs the multi-rank tests over NCCL: those under tests/multirank/ (the modules that spawn ranks).
    multirank = REPO / "tests" / "multirank"
    for item in items:
        if multirank in item.path.parents:
            item.add_marker(pytest.mark.multirank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); run scripts/gpu_smoke.sh "
                                   "on a GPU machine")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, as the example scripts run: GEMM rounding may depend on the
    thread count where results are compared bitwise (and on a busy 2-core machine two threads make
    tiny steps about ten times slower). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
