"""Who a decision taken by hand is recorded under (an accepted data change, a promotion, a
retraction, a forget): ``--by``, else the git user, else the login name."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_user(root: Path) -> str | None:
    """``git config user.name`` in ``root``, when git and the setting are there."""
    try:
        result = subprocess.run(
            ["git", "config", "user.name"], cwd=root, capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return result.stdout.strip() or None
