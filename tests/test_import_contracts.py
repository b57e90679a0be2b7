"""The layering of docs/INTERFACES.md, enforced: `lint-imports` checks the contracts in
pyproject.toml ([tool.importlinter]) and each contract is one test here, so `make test` fails
when an import breaks the design."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]

@pytest.fixture(scope="module")
def lint_output() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.exists(), "lint-imports is missing: pip install -e '.[dev]' (import-linter)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([str(exe), "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert "Contracts:" in proc.stdout, proc.stdout + proc.stderr  # it ran (config valid, package found)
    return proc.stdout


@pytest.mark.parametrize("contract", [pytest.param(c, id=c["id"]) for c in CONTRACTS])
def test_contract_is_kept(contract: dict[str, object], lint_output: str) -> None:
    status = re.search(rf"^{re.escape(str(contract['name']))} (KEPT|BROKEN)$", lint_output, re.M)
    assert status is not None, f"contract {contract['id']} not reported:\n{lint_output}"
    broken = lint_output.split("Broken contracts", 1)[-1]
    assert status.group(1) == "KEPT", broken


def test_every_package_is_in_a_contract() -> None:
    """A new package must be placed in the layers (the layers contract is exhaustive); check the
    contract lists what exists, so that a rename does not silently drop a package."""
    layers = next(c for c in CONTRACTS if c["id"] == "layers")
    named = {part.strip(" ()") for layer in layers["layers"] for part in re.split(r"[:|]", layer)}
    src = ROOT / "src" / "vramplan"
    packages = {p.name for p in src.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in src.glob("*.py") if p.stem != "__init__"}
    assert packages | modules <= named, sorted((packages | modules) - named)
