"""``flows/`` holds the flows: every module directly in it defines a Prefect flow, and every
sub-package (the commands, forget, the demo, the flows' support, the servers) has its place
in the layers contract of ``pyproject.toml``, so ``lint-imports`` holds it there."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FLOWS = ROOT / "flows"


def is_flow_decorator(node: ast.expr) -> bool:
    """``@flow``, ``@flow(...)``, ``@prefect.flow`` or ``@prefect.flow(...)``."""
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr == "flow"
    return isinstance(target, ast.Name) and target.id == "flow"


def defines_flow(path: Path) -> bool:
    """Whether a function at the top of the module at ``path`` is decorated as a flow."""
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(is_flow_decorator(d) for d in node.decorator_list)
        for node in ast.parse(path.read_text()).body
    )


def test_every_module_directly_in_flows_defines_a_flow() -> None:
    modules = [p for p in sorted(FLOWS.glob("*.py")) if p.name != "__init__.py"]
    assert modules, "flows/ holds no module"
    without = [p.name for p in modules if not defines_flow(p)]
    assert without == [], (
        f"flows/{{{', '.join(without)}}} define no Prefect flow: move them into a sub-package "
        "of flows/ by their role (cli/, servers/, support/...) and place it in pyproject.toml's "
        "flows/ layers contract"
    )


def test_the_check_tells_a_flow_module_from_a_helper(tmp_path: Path) -> None:
    flow_module = tmp_path / "stage.py"
    flow_module.write_text(
        "from prefect import flow\n\n@flow(name='x')\ndef run() -> None:\n    pass\n"
    )
    helper = tmp_path / "helper.py"
    helper.write_text(
        "def flow() -> None:\n    pass\n\n@staticmethod\ndef run() -> None:\n    pass\n"
    )
    assert defines_flow(flow_module)
    assert not defines_flow(helper)


def test_every_sub_package_of_flows_has_a_layer() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(
        c["layers"]
        for c in contracts["contracts"]
        if c["type"] == "layers" and c.get("containers") == ["flows"]
    )
    placed = {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}
    packages = {p.parent.name for p in FLOWS.glob("*/__init__.py")}
    assert packages == placed, (
        f"pyproject.toml's flows/ layers contract places {sorted(placed)}; flows/ has the "
        f"sub-packages {sorted(packages)}: give each a layer"
    )
