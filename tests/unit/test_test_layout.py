"""The test suite's layout (issue 30 part 5): every test module is in tests/unit/ (in-process) or tests/multirank/
(spawns ranks, runs torchrun or the example scripts end to end); shared builders are in tests/helpers/ and shared
fixtures in conftest.py, so no module under tests/ imports a test module; a unit module spawns no ranks."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "multirank")


def _imported_modules(tree: ast.Module) -> list[str]:
    """Every module an import statement anywhere in ``tree`` names (``from a import b`` names a and a.b)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):              # from . import x
            names += [alias.name for alias in node.names]
    return names


def layout_problems(tests_dir: Path) -> list[str]:
    """What breaks the layout under ``tests_dir``, one line each (empty: none)."""
    problems = []
    for path in sorted(tests_dir.rglob("*.py")):
        relative = path.relative_to(tests_dir)
        if path.name.startswith("test_") and (len(relative.parts) != 2 or relative.parts[0] not in TIERS):
            problems.append(f"{relative}: a test module outside tests/unit/ and tests/multirank/")
        tree = ast.parse(path.read_text(), filename=str(path))
        for module in _imported_modules(tree):
            if module.rsplit(".", 1)[-1].startswith("test_"):
                problems.append(f"{relative}: imports the test module {module} (move what it shares to "
                                "tests/helpers/, or make it a fixture in conftest.py)")
        if relative.parts[0] == "unit" and path.name.startswith("test_") and path != Path(__file__).resolve():
            used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
            used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
            spawns = used & {"run_on_ranks"}
            spawns |= {"torch.distributed.run" for node in ast.walk(tree)
                       if isinstance(node, ast.Constant) and node.value == "torch.distributed.run"}
            if spawns:
                problems.append(f"{relative}: a unit module uses {', '.join(sorted(spawns))} (multi-rank tests "
                                "belong in tests/multirank/)")
    return problems


def test_the_suite_keeps_its_layout():
    assert layout_problems(TESTS) == []


def test_a_misplaced_module_an_import_between_test_modules_and_a_spawning_unit_module_are_named(tmp_path):
    for tier in ("unit", "multirank", "helpers"):
        (tmp_path / tier).mkdir()
    (tmp_path / "test_flat.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "unit" / "test_a.py").write_text("def test_a():\n    from tests.unit.test_b import B\n")
    (tmp_path / "unit" / "test_spawning.py").write_text("from megamoe.spawned_ranks import run_on_ranks\n")
    (tmp_path / "multirank" / "test_c.py").write_text("import test_training\nfrom tests.helpers import tiny\n")
    (tmp_path / "helpers" / "tiny.py").write_text("from tests.multirank import test_c\n")
    assert layout_problems(tmp_path) == [
        "helpers/tiny.py: imports the test module tests.multirank.test_c (move what it shares to tests/helpers/, "
        "or make it a fixture in conftest.py)",
        "multirank/test_c.py: imports the test module test_training (move what it shares to tests/helpers/, "
        "or make it a fixture in conftest.py)",
        "test_flat.py: a test module outside tests/unit/ and tests/multirank/",
        "unit/test_a.py: imports the test module tests.unit.test_b (move what it shares to tests/helpers/, "
        "or make it a fixture in conftest.py)",
        "unit/test_spawning.py: a unit module uses run_on_ranks (multi-rank tests belong in tests/multirank/)",
    ]
