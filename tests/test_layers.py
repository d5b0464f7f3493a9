"""Imports only point down the layers of docs/ARCHITECTURE.md, and no package has an import cycle.

The contracts are [tool.importlinter] in pyproject.toml, checked by import-linter (`lint-imports`,
from the `test` extra). Three tests check that the contracts can fail: they add an upward
import, a trainer module importing the weight transfer, and a cycle, to a copy of the package in a temporary directory (the tree stays untouched).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
        "--no-cache", "--no-logo"]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package and pyproject.toml under `root` (the hpcrl found first on the path)."""
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail("import-linter is not installed: pip install -e '.[test]'")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True, timeout=60)


def assert_broken(root: Path, *expected: str) -> None:
    """`lint-imports` on the tree under `root` fails, and its report holds each of `expected`."""
    done = lint_imports(root)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    for text in expected:
        assert text in done.stdout, done.stdout[-4000:]


@pytest.fixture
def package_copy(tmp_path: Path):
    """hpcrl/ and pyproject.toml copied to a temporary directory, removed afterwards."""
    root = tmp_path / "tree"
    try:
        shutil.copytree(REPO / "hpcrl", root / "hpcrl", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_imports_only_point_down_the_layers_and_no_package_has_a_cycle():
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "3 kept, 0 broken" in done.stdout, done.stdout[-2000:]


def test_an_upward_import_in_a_low_layer_breaks_the_layers_contract(package_copy: Path):
    (package_copy / "hpcrl" / "config" / "_upward_probe.py").write_text("import hpcrl.cli.main\n")
    assert_broken(package_copy, "hpcrl.config is not allowed to import hpcrl.cli",
                  "hpcrl.config._upward_probe -> hpcrl.cli.main")


def test_the_trainer_importing_the_weight_transfer_breaks_the_trainer_apart_contract(package_copy: Path):
    (package_copy / "hpcrl" / "trainer" / "_transfer_probe.py").write_text("import hpcrl.transfer.gloo\n")
    assert_broken(package_copy, "hpcrl.trainer is not allowed to import hpcrl.transfer",
                  "hpcrl.trainer._transfer_probe -> hpcrl.transfer.gloo")


def test_two_modules_importing_each_other_break_the_acyclic_contract(package_copy: Path):
    transfer = package_copy / "hpcrl" / "transfer"
    (transfer / "_probe_a.py").write_text("import hpcrl.transfer._probe_b\n")
    (transfer / "_probe_b.py").write_text("import hpcrl.transfer._probe_a\n")
    assert_broken(package_copy, "No cycles are allowed in hpcrl.transfer", "_probe_")


def test_the_base_modules_import_no_hpcrl_package_only_each_other():
    """errors, fsio, rundir and logs sit under every layer (exhaustive_ignores): anyone imports them,
    so they may import nothing of hpcrl but one another (logs is also imported by vLLM's processes)."""
    import ast
    import tomllib

    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    base = {f"hpcrl.{name}" for name in contract["exhaustive_ignores"] if name != "__main__"}
    assert "hpcrl.logs" in base
    for module in sorted(base):
        tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        outside = sorted(name for name in imported if name.split(".")[0] == "hpcrl" and name not in base)
        assert outside == [], f"{module} imports {outside}: a base module may import only {sorted(base)}"
