"""Every command the project prints or documents exists: each one's --help, run in a process
of its own (the fast tests: tests/unit/test_commands.py)."""

from __future__ import annotations

import pytest

from tests.unit.test_commands import every_command, help_exit_code

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("tool", "name"), sorted(every_command()))
def test_every_printed_or_documented_command_exists(tool: str, name: str) -> None:
    assert help_exit_code(tool, name) == 0, f"`{tool} {name}` does not exist"
