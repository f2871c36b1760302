"""MoE parallel folding (megamoe.models.moe_folding).

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_moe_folding.py."""

import dataclasses
from types import SimpleNamespace

import pytest

from megamoe.parallel_plan import check_moe_layout
from megamoe.models.moe_folding import uses_folding
from tests.helpers.moe_folding import config

pytestmark = pytest.mark.usefixtures("one_thread")


def _view(tp: int, ep: int, etp: int):
    ranks = list(range(tp))
    return SimpleNamespace(rank=0, tp=SimpleNamespace(size=tp, ranks=ranks), ep=SimpleNamespace(size=ep, ranks=[0]),
                           etp=SimpleNamespace(size=etp, ranks=[0]), ep_etp=SimpleNamespace(size=ep * etp, ranks=[0]))


def test_layout_check_allows_etp_dividing_tp():
    cfg = config()
    for tp, etp in ((2, 1), (4, 2), (4, 1), (2, 2)):
        check_moe_layout(cfg, _view(tp, 2, etp))
    with pytest.raises(ValueError, match=r"etp=3 tp=4"):
        check_moe_layout(cfg, _view(4, 1, 3))
    assert uses_folding(cfg, 2, 1) and not uses_folding(cfg, 2, 2)
    assert not uses_folding(dataclasses.replace(cfg, sequence_parallel=True), 2, 1)


def test_script_accepts_folding_and_refuses_etp_not_dividing_tp(demo, tmp_path):
    base = ["--work-dir", str(tmp_path / "work"), "--save-dir", str(tmp_path / "ckpt"), "--dispatcher", "alltoall"]
    demo.check_arguments(demo.parse_args([*base, "--tp", "2", "--etp", "1", "--ep", "4"]), world_size=4)
    demo.check_arguments(demo.parse_args([*base, "--tp", "2", "--etp", "1", "--ep", "2"]), world_size=4)
    with pytest.raises(demo.UsageError, match=r"etp dividing tp.*etp=4 tp=2"):
        demo.check_arguments(demo.parse_args([*base, "--tp", "2", "--etp", "4", "--ep", "1"]), world_size=4)
