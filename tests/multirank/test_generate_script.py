"""examples/generate.py as a user meets it.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_generate_script.py."""

import json
import os
import subprocess
import sys

import pytest

from megamoe.checkpoint.model_loading import build_model_from_checkpoint
from megamoe.inference.generation import GenerationConfig, generate
from parallel_state import ParallelState
from tests.helpers.generate_script import NEW, PROMPTS, REPO, SCRIPT, _assert_one_error_line, _prompt_args


# ----------------------------------------------------------------------------------------------
# Two ranks (torchrun)
# ----------------------------------------------------------------------------------------------
def _torchrun(args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT,
                           *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow      # two ranks under torchrun, ~20 s
@pytest.mark.timeout(1200)
def test_default_dispatcher_fits_the_layout(checkpoint, tmp_path):
    """``torchrun --nproc-per-node 2 generate.py CKPT --ep 2`` on an all-gather checkpoint at tp 1: the
    all-to-all dispatcher is chosen (and logged), and the tokens are the single-process ones."""
    solo = build_model_from_checkpoint(checkpoint, ParallelState.single_process()).eval()
    expected = generate(solo, ParallelState.single_process(), PROMPTS, GenerationConfig(max_new_tokens=NEW)).token_ids
    run = _torchrun([checkpoint, *_prompt_args(), "--ep", 2, "--max-new-tokens", NEW, "--output-json", "out.json"],
                    tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the checkpoint's dispatcher allgather does not fit this layout" in run.stderr, run.stderr[-3000:]
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["layout"]["dispatcher"] == "alltoall" and document["layout"]["ep"] == 2
    assert document["layout"]["etp"] == 1
    assert [r["ids"] for r in document["requests"]] == expected


@pytest.mark.slow      # two ranks under torchrun, ~15 s
@pytest.mark.timeout(1200)
def test_world_size_that_does_not_fit_is_one_line_from_rank_0(checkpoint, tmp_path):
    """Both ranks find the mistake before joining a process group; rank 0 alone says so."""
    run = _torchrun([checkpoint, *_prompt_args(), "--tp", 2, "--pp", 2], tmp_path)
    _assert_one_error_line(run.returncode, run.stderr, "--tp 2 --pp 2", "do not fit 2 rank(s)", torchrun=True)
