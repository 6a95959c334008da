"""The import contracts of pyproject.toml ([tool.importlinter]), checked by import-linter on the installed packages:
the runtime never imports the operator; the controller neither imports the local tools nor torch."""

import subprocess
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_import_contracts_hold():
    run = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=PYPROJECT.parent,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in run.stdout


def test_every_operator_module_is_either_a_controller_module_the_contracts_name_or_a_local_tool():
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    controller = set(next(c for c in contracts if "local tools" in c["name"])["source_modules"])
    package = PYPROJECT.parent / "operator" / "specserve_operator"
    modules = {f"specserve_operator.{path.stem}" for path in package.glob("*.py") if path.stem != "__init__"}
    modules |= {f"specserve_operator.{path.parent.name}" for path in package.glob("*/__init__.py") if path.parent.name != "local"}
    assert modules == controller, modules ^ controller
    assert (package / "local" / "canary.py").is_file()
