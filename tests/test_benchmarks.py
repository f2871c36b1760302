"""Smoke tests of the benchmark scripts: each runs end to end in its --quick mode and writes its JSON."""

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _benchmark(name, monkeypatch):
    """The script ``benchmarks/<name>.py`` as a module (scripts import their siblings by name)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


@pytest.mark.slow      # ~8 s on an idle machine, 25-50 s while others share the 2 cores
def test_train_step_benchmark_quick(monkeypatch, tmp_path):
    train_step = _benchmark("train_step", monkeypatch)
    out = tmp_path / "train_step.json"
    # --default-allocator: the script's mallopt settings would outlive it in the test process.
    assert train_step.main(["--quick", "--default-allocator", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = {row["name"]: row for row in results["rows"]}
    timed = [name for name, row in rows.items() if "skipped" not in row]
    hf_rows = [name for name in timed if name.startswith("hf/")]
    assert {"megamoe/torch", "megamoe/loop", "hf/eager", "hf/grouped_mm"} <= set(rows)
    assert {"hf/deepgemm", "hf/sonicmoe"} <= {name for name, row in rows.items() if "skipped" in row}
    for name in ("megamoe/torch", "megamoe/loop"):
        row = rows[name]
        assert row["tokens_per_s"] > 0 and row["repeats"] == 1
        assert set(row["ratio_over_hf"]) == set(hf_rows)
    # The loss check ran: every row's first loss is the same (the script asserts it, to 1e-4).
    assert set(results["loss_check"]) == set(timed)
    first_losses = [losses[0] for losses in results["loss_check"].values()]
    assert max(first_losses) - min(first_losses) <= 1e-4
