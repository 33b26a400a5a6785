"""Every command the project prints or documents exists: each `shardflow X` and `make X`
named by `make run`'s closing lines, the README and docs/, the CLI and the Makefile runs
with ``--help`` (a make target as a dry run, ``make -n``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import shardflow as cli
from flows.cli.run_summary import NEXT_STEPS

ROOT = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"`(shardflow|make) ([a-z][\w-]*)")


def makefile_targets(makefile: Path = ROOT / "Makefile") -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", makefile.read_text(), flags=re.MULTILINE))


def named_commands(texts: list[str]) -> set[tuple[str, str]]:
    """(tool, command) for every backticked `shardflow X` / `make X` in ``texts``."""
    return {(tool, name) for text in texts for tool, name in COMMAND.findall(text)}


def documents() -> list[str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [page.read_text() for page in pages if page.is_file()]


def every_command() -> set[tuple[str, str]]:
    found = named_commands([*documents(), "\n".join(NEXT_STEPS)])
    found |= {("shardflow", name) for name in cli.COMMANDS}
    found |= {("make", target) for target in makefile_targets()}
    return found


def help_exit_code(tool: str, name: str) -> int:
    """``shardflow NAME --help`` (the console script's function), ``make -n NAME``."""
    if tool == "shardflow":
        command = [
            sys.executable,
            "-c",
            "import sys; from flows.cli.shardflow import main; sys.exit(main())",
        ]
        done = subprocess.run(
            [*command, name, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    else:
        done = subprocess.run(
            ["make", "-n", name], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    return done.returncode


def test_run_prints_commands_and_the_docs_name_them() -> None:
    """The collection is not empty by accident: what `make run` prints is in it."""
    assert ("shardflow", "ui") in every_command() and ("shardflow", "stop") in every_command()
    assert ("make", "run") in named_commands(documents())


@pytest.mark.parametrize(("tool", "name"), [("shardflow", "nosuch"), ("make", "nosuch")])
def test_a_command_that_does_not_exist_fails(tool: str, name: str) -> None:
    assert help_exit_code(tool, name) != 0
