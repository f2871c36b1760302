"""The import layers of the library (.importlinter at the repository root) hold: lint-imports keeps every contract
on this tree, and breaks the ones a deliberately bad import violates in a copy of it."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import importlinter  # noqa: F401  (the `test` extra: pip install -e ".[test]")

# The repository root: the first folder above this file holding the contracts (this file may move into a tier).
REPO = next(p for p in Path(__file__).resolve().parents if (p / ".importlinter").is_file())
PACKAGES = ("megamoe", "parallel_state", "checkpoint_tools")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the packages under ``root`` (first on the path, so an installed megamoe is not the one
    analysed), without a cache, which would otherwise be written into the tree."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--config", str(root / ".importlinter"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=240)


def _contract_states(output: str) -> dict[str, str]:
    """contract name -> KEPT / BROKEN, from lint-imports' summary (which wraps long names onto two lines)."""
    summary = " ".join(output.split("Contracts\n")[1].split("\nContracts:")[0].split())
    summary = summary.split("dependencies. ")[-1].lstrip("- ")
    return {name.strip(): state for name, state in
            re.findall(r"(.+?) (KEPT|BROKEN)(?: \(\d+ ignored imports?\))?(?: |$)", summary)}


def test_every_contract_is_kept():
    run = _lint_imports(REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    contracts = _contract_states(run.stdout)
    declared = (REPO / ".importlinter").read_text(encoding="utf-8").count("[importlinter:contract:")
    assert len(contracts) == declared and set(contracts.values()) == {"KEPT"}, run.stdout


def test_a_bad_import_breaks_its_contracts(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    # The checkpoint format reaching up into the trainer (which sits on it: a cycle), and parallel_state, the
    # bottom layer, importing the library.
    with open(tmp_path / "megamoe" / "checkpoint" / "errors.py", "a", encoding="utf-8") as f:
        f.write("\nfrom megamoe.training import trainer  # noqa: E402,F401\n")
    with open(tmp_path / "parallel_state" / "__init__.py", "a", encoding="utf-8") as f:
        f.write("\nimport megamoe.comms  # noqa: E402,F401\n")

    run = _lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    contracts = _contract_states(run.stdout)
    broken = sorted(name for name, state in contracts.items() if state == "BROKEN")
    assert broken == ["Library layers point one way",
                      "No import cycles between the modules or subpackages of any package",
                      "The checkpoint format imports neither HF conversion nor the trainer",
                      "parallel_state imports nothing of ours"], run.stdout
    assert "megamoe.checkpoint.errors -> megamoe.training.trainer" in run.stdout
    assert "parallel_state -> megamoe.comms" in run.stdout
