"""Shared by tests/unit/test_demo.py and tests/multirank/test_demo.py: the builders and constants of the demo tests."""

import json
import os
import re
from pathlib import Path

from megamoe.training.checkpoint import verify_resume_checkpoint

REPO = Path(__file__).resolve().parents[2]
TINY = ["--corpus-bytes", "200000", "--vocab-size", "512", "--hidden", "32", "--layers", "2", "--sample-tokens", "4"]


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _assert_only_complete_checkpoint_of_step_1(save_dir: Path) -> None:
    """The fault at step 2 left the step-1 checkpoint, intact, and nothing half-written next to it."""
    assert sorted(os.listdir(save_dir)) == ["step_00000001"]
    verify_resume_checkpoint(save_dir / "step_00000001", world_group=None)


# The last line of a job whose rank FAULT (tests/helpers/torchrun_faults.py) hits at step 2 (after step 1's checkpoint).
FAULT_LINES = {
    "kill": "torchrun_faults.py: error: torchrun stopped the job: a rank's process ended without reporting an error "
            "(killed by a signal, e.g. by the out-of-memory killer, or crashed), or the job itself was signalled; "
            "torchrun's report above names the rank and its exit code; the newest intact checkpoint is "
            "{save_dir}/step_00000001",
    "enospc": "torchrun_faults.py: error: checkpoint save failed while writing files: rank 1: cannot write "
              "{save_dir}/step_00000002.tmp-*/rank00001-0000.safetensors: No space left on device (free space on "
              "that disk or save elsewhere); {save_dir}/step_00000002 was not written (what it held before, and "
              "every other checkpoint, is untouched)",
    "erofs": "torchrun_faults.py: error: checkpoint save failed while exchanging metadata: rank 0: cannot write "
             "{save_dir}/step_00000002.tmp-*: Read-only file system (make that directory writable or save "
             "elsewhere); {save_dir}/step_00000002 was not written (what it held before, and every other checkpoint, "
             "is untouched)"}


def _fault_line(fault: str, save_dir: Path) -> re.Pattern:
    return re.compile(".*".join(map(re.escape, FAULT_LINES[fault].format(save_dir=save_dir).split("*"))))
