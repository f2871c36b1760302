"""Online expert rebalancing (EPLB, megamoe.moe.placement.eplb) end to end.

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_eplb.py."""

import json
from pathlib import Path

import pytest
import torch

from megamoe.inference.generation import GenerationConfig, generate
from megamoe.moe.placement.eplb import EPLBConfig
from megamoe.moe.placement.expert_load_window import ExpertLoadWindow
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.eplb import E, skewed_model, train

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- in-process checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"window": 0}, "window"), ({"interval": 0}, "interval"), ({"interval": 2.5}, "interval"),
    ({"balancedness_threshold": 0.0}, "balancedness_threshold"),
    ({"balancedness_threshold": 1.5}, "balancedness_threshold"),
    ({"max_layers_per_round": 0}, "max_layers_per_round"), ({"num_groups": 2}, "num_groups and num_nodes"),
    ({"num_groups": 0, "num_nodes": 1}, "num_groups")])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"EPLBConfig.{field}"):
        EPLBConfig(**kwargs)


def test_configs_that_do_not_fit_the_model_are_refused():
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = skewed_model(state, "alltoall", E)
    with pytest.raises(ValueError, match="TrainConfig.eplb must be an EPLBConfig"):
        TrainConfig(eplb={"interval": 3})
    with pytest.raises(ValueError, match="num_groups=3, num_nodes=1 do not fit 8 experts"):
        Trainer(model, state, TrainConfig(eplb=EPLBConfig(num_groups=3, num_nodes=1)))
    with pytest.raises(ValueError, match=r"compiled=True\) cannot rebalance experts"):
        generate(model, state, [[1, 2]], GenerationConfig(max_new_tokens=2), compiled=True, eplb=EPLBConfig())


def test_load_window_sums_the_last_window_records_on_the_device():
    window = ExpertLoadWindow(3, num_layers=2, num_experts=4)
    records = [torch.randint(0, 100, (2, 4), generator=torch.Generator().manual_seed(i)) for i in range(5)]
    for count, record in enumerate(records, start=1):
        window.record(record)
        assert torch.equal(window.total(), torch.stack(records[max(0, count - 3):count]).sum(0))
        assert window.filled == min(count, 3)
    assert window.buffer.dtype == torch.int64 and window.buffer.shape == (3, 2, 4)
    with pytest.raises(ValueError, match=r"\[num_layers, num_experts\] = \[2, 4\]"):
        window.record(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer token counts"):
        window.record(torch.zeros(2, 4))
    window.reset()
    assert window.filled == 0 and not window.total().any()


def _step_lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_pretrain_script_rebalances_logs_each_round_and_resumes_with_the_placement(demo, tmp_path, capsys,
                                                                                   monkeypatch):
    from megamoe.cli.launch import run_script
    from megamoe.moe.placement.expert_slots import ExpertPlacement
    from megamoe.training.checkpoint import expert_placements_from_checkpoint, latest_checkpoint
    argv = ["--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt", "--corpus-bytes", "100000",
            "--vocab-size", "512", "--hidden", "32", "--layers", "2", "--sample-tokens", "0", "--steps", "4",
            "--global-batch", "4", "--seq-len", "16", "--num-expert-slots", "12",
            "--save-every", "4", "--eplb-interval", "2", "--eplb-window", "3", "--eplb-threshold", "0.9",
            "--eplb-max-layers", "1"]
    # The first run starts from a placement of its own (as one a rebalance reached on more EP ranks):
    # the resumed run must keep it, not fall back to the default one.
    reached = ExpertPlacement([7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4], 8, 1)
    build_placements = demo.build_placements
    monkeypatch.setattr(demo, "build_placements", lambda config, ep, **kw: {i: reached for i in config.moe_layer_ids})
    assert run_script(demo.main, [str(a) for a in argv], prog=demo.PROG) == 0
    monkeypatch.setattr(demo, "build_placements", build_placements)
    assert run_script(demo.main, [str(a) for a in [*argv, "--steps", "6", "--save-every", "6"]], prog=demo.PROG) == 0
    resumed = expert_placements_from_checkpoint(latest_checkpoint(tmp_path / "ckpt"))
    assert set(resumed.values()) == {reached} and len(resumed) == 1
    lines = _step_lines(tmp_path / "work" / "log.jsonl")
    rounds = [line for line in lines if "eplb_moved_slots" in line]
    assert [line["step"] for line in rounds] == [2, 4, 6]
    for line in rounds:     # one EP rank: always balanced, nothing moves
        assert line["eplb_moved_slots"] == 0 and line["eplb_moved_bytes"] == 0 and line["eplb_layers"] == []
        assert line["balancedness_before"] == line["balancedness_after"] == 1.0
    assert all("eplb" not in line for line in lines if "loss" in line), "a round has its own line"
    bad = [(["--eplb-interval", "0"], "--eplb-interval must be an int >= 1"),
           (["--eplb-interval", "2", "--eplb-threshold", "1.5"], "--eplb-threshold must be a number in (0, 1]"),
           (["--eplb-window", "3"], "--eplb-window need --eplb-interval N")]
    capsys.readouterr()
    for extra, fragment in bad:
        code = run_script(demo.main, [str(a) for a in [*argv[:4], "--work-dir", tmp_path / "w2", *extra]],
                          prog=demo.PROG)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1 and err[0].startswith("pretrain_moe.py: error: ") and fragment in err[0], err
        assert not (tmp_path / "w2").exists(), "the error must come before any work"


def test_a_skipped_step_records_no_load_and_does_not_rebalance():
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = skewed_model(state, "alltoall", E)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2, eplb=EPLBConfig(window=2, interval=1)))
    weight = next(model.parameters())
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(float("nan"))
    skipped = train(trainer, state, 1)[0]
    assert trainer.consecutive_skips == 1 and skipped[2] is None and trainer.rebalancer.window.recorded == 0
    with torch.no_grad():
        weight.copy_(saved)
    report = train(trainer, state, 1)[0][2]
    assert report is not None and report.step == 2 and trainer.rebalancer.window.recorded == 1
