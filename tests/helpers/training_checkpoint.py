"""Shared by tests/unit/test_training_checkpoint.py and tests/multirank/test_training_checkpoint.py: the builders
and constants of the training checkpoint tests."""

from tests.helpers.tiny_model import REL_TOL


def _single():
    from parallel_state import ParallelState
    return ParallelState.single_process()


def _assert_close(got, want, what):
    assert len(got) == len(want), what
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= REL_TOL * abs(w), f"{what}: loss {step}: {g} vs {w}"
