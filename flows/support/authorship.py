"""What the commands a person types share: who a decision taken by hand is recorded under (an
accepted data change, a promotion, a retraction, a forget: ``--by``, else the git user, else
the login name), the arguments of a decision on a registered version, and how a command
prints its refusal."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tasks.runtime.refusals import REFUSED_EXIT, Refused


def git_user(root: Path) -> str | None:
    """``git config user.name`` in ``root``, when git and the setting are there."""
    try:
        result = subprocess.run(
            ["git", "config", "user.name"], cwd=root, capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return result.stdout.strip() or None


def author(by: str | None, root: Path) -> str:
    """Who a decision is recorded under: ``by`` as given, else the git user, else the login
    (``unknown`` in a container with no user entry, where ``getpass`` raises)."""
    from tasks.validate.data_gate import current_user

    return by or git_user(root) or current_user()


def version_decision_parser(command: str, verb: str, description: str) -> argparse.ArgumentParser:
    """The arguments of a decision on a registered version taken by hand (``shardflow
    promote``, ``shardflow retract``): the version, why, who, and the project."""
    made = argparse.ArgumentParser(prog=f"shardflow {command}", description=description)
    made.add_argument("--version", required=True, help=f"the registered version to {command}")
    made.add_argument("--reason", required=True, help="why, recorded on the version")
    made.add_argument("--by", help=f"who {verb} it (default: git user.name, else login)")
    made.add_argument("--root", default=".", help="the project root (default: .)")
    made.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return made


def print_refused(command: str, error: Refused) -> int:
    """``error`` on standard error as a command's refusal (``COMMAND: why``, then its fix on a
    line of its own); the refusal's exit status, for the command to return."""
    print(f"{command}: {error}", file=sys.stderr)
    if error.fix:
        print(f"  fix: {error.fix}", file=sys.stderr)
    return REFUSED_EXIT
