"""Shared by tests/unit/test_generate_script.py and tests/multirank/test_generate_script.py: the builders and
constants of the generate script tests."""

import os
import re

import pytest

from megamoe.checkpoint.format import save_checkpoint
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from parallel_state import ParallelState
from tests.helpers.tiny_model import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "generate.py")
PROMPTS = [[5, 9, 12, 3], [22, 8]]
NEW = 5
# A script frame in a traceback (torchrun's own ChildFailedError summary names only torch files).
OUR_FRAME = re.compile(r'File ".*(examples|megamoe|checkpoint_tools|parallel_state)[/\\]')


def _save_tiny_checkpoint(path, config):
    model = GPTMoEModel(config, ParallelState.single_process())
    initialize_parameters(model, seed=0)
    save_checkpoint(path, sharded_state_dict(model), manifest_fields={"model_config": config.to_dict()})
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny MoE checkpoint saved single-process with the all-gather dispatcher (as the pretraining
    demo saves at tp=1): EP over 2 ranks then needs the all-to-all one. Its rope declares no
    max_position_embeddings (as pretrain_moe.py's): no position limit."""
    return _save_tiny_checkpoint(tmp_path_factory.mktemp("generate") / "ckpt", tiny_config("allgather"))


def _prompt_args():
    return [arg for prompt in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, prompt)))]


def _assert_one_error_line(code, stderr, *expected, torchrun=False):
    """Exit code 1 and one error line holding ``expected``; no traceback (torchrun: none of our code's,
    torchrun's own ChildFailedError summary is a traceback of its launcher, and the line is repeated after it,
    as the last line: megamoe.cli.launch)."""
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert code == 1, stderr[-3000:]
    if torchrun:
        assert len(errors) == 2 and errors[0] == errors[1] == stderr.strip().splitlines()[-1], stderr[-3000:]
        errors = errors[:1]
    assert len(errors) == 1 and errors[0].startswith("generate.py: error: "), stderr[-3000:]
    assert not OUR_FRAME.search(stderr) and (torchrun or "Traceback" not in stderr), stderr[-3000:]
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]
