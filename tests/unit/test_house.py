"""The house in wings (docs/architecture.md): one package a wing whose face is its docstring,
and only the pixel contract and the served pyfunc at the top of ``tasks/``; the import-linter
``layers`` contract (``make lint``) holds the floors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parents[2] / "tasks"
# What stays at the top: the preprocessing's version reads images.py and schema.py by path
# and token, and registered models import tasks.predict.ShardflowModel by that name.
TOP_LEVEL = {"__init__.py", "images.py", "schema.py", "tfrecord.py", "predict.py"}


@pytest.mark.parametrize("face", sorted(TASKS.rglob("__init__.py")), ids=lambda p: p.parent.name)
def test_a_packages_face_is_its_docstring_alone(face: Path) -> None:
    """No definitions and no re-exports: importing one module of a wing runs no other."""
    body = ast.parse(face.read_text()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{face}: more than a docstring"
    assert isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)


def test_the_top_of_tasks_holds_the_pixel_contract_and_the_pyfunc_only() -> None:
    files = {p.name for p in TASKS.glob("*.py")}
    assert files == TOP_LEVEL
    wings = {p.name for p in TASKS.iterdir() if (p / "__init__.py").is_file()}
    assert wings == {
        "runtime",
        "contracts",
        "ingest",
        "shard",
        "validate",
        "train",
        "serve",
        "evaluate",
        "erasure",
    }
