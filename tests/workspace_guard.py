"""A pytest plugin that fails the run when a test changes the user's data or the working copy's
outputs: the folder the working copy's ``params.yaml`` names as ``ingest.source_dir`` (the
user's own photos, perhaps) and the outputs the pipeline keeps in the checkout.

Each test's teardown compares a stat listing (path, size, mtime, inode) of every guarded
file with the one taken before it and fails that test, naming what changed; the session
compares content hashes at its end too, which also catches a session fixture's writes. Tests
that ran beside the culprit on another worker are named as well ("changed while it ran"):
a stat listing cannot tell which process wrote.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The checkout's outputs (dvc.yaml's outs, the accepted versions, the tracking store) and its
# own settings: no test writes there, every test works under its own temporary folder.
GUARDED_IN_CHECKOUT = (
    "params.yaml",
    "dvc.lock",
    "data",
    "models",
    "reports",
    "metrics",
    "plots",
    "mlflow.db",
    "mlruns",
    "mlartifacts",
)
Listing = dict[str, tuple[int, int, int]]


def guarded_roots(checkout: Path) -> list[Path]:
    """The folder ``ingest.source_dir`` of the checkout's ``params.yaml`` names, when it reads,
    and the checkout's outputs."""
    roots = [checkout / name for name in GUARDED_IN_CHECKOUT]
    source = source_dir_of(checkout / "params.yaml")
    if source is not None:
        roots.append(source if source.is_absolute() else checkout / source)
    return roots


def source_dir_of(params_file: Path) -> Path | None:
    """``ingest.source_dir`` as the file says it, without checking the rest of the file: a
    guard must hold for a params file the project would refuse."""
    from ruamel.yaml import YAML, YAMLError

    try:
        raw = YAML(typ="safe", pure=True).load(params_file.read_text())
        value = raw["ingest"]["source_dir"]
    except (OSError, YAMLError, KeyError, TypeError):
        return None
    return Path(value) if isinstance(value, str) and value else None


def _folders(roots: list[Path]) -> Iterator[str]:
    for root in roots:
        if root.is_dir():
            yield from (f"{folder}/" for folder, _, _ in os.walk(root))


def _files(roots: list[Path]) -> Iterator[Path]:
    for root in roots:
        if root.is_file():
            yield root
        elif root.is_dir():
            for folder, dirs, names in os.walk(root):
                dirs.sort()
                yield from (Path(folder, name) for name in sorted(names))


def stat_listing(roots: list[Path]) -> Listing:
    """Every file under ``roots`` and its (size, mtime in ns, inode), and every folder (one
    made or removed, empty or not, is a change too)."""
    listing: Listing = dict.fromkeys(_folders(roots), (0, 0, 0))
    for path in _files(roots):
        try:
            status = path.stat()
        except OSError:
            continue
        listing[str(path)] = (status.st_size, status.st_mtime_ns, status.st_ino)
    return listing


def content_listing(roots: list[Path]) -> dict[str, str]:
    """Every file under ``roots`` and its content's sha256, and every folder."""
    hashes: dict[str, str] = dict.fromkeys(_folders(roots), "folder")
    for path in _files(roots):
        digest = hashlib.sha256()
        try:
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        except OSError:
            continue
        hashes[str(path)] = digest.hexdigest()
    return hashes


def changes(before: dict[str, object], after: dict[str, object], *, limit: int = 8) -> list[str]:
    """What differs between two listings, a line each: gone, new or changed paths."""
    lines = [f"gone: {p}" for p in sorted(before.keys() - after.keys())]
    lines += [f"new: {p}" for p in sorted(after.keys() - before.keys())]
    both = sorted(before.keys() & after.keys())
    lines += [f"changed: {p}" for p in both if before[p] != after[p]]
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


CHANGED = "changed the user's data or the checkout's outputs"


@dataclass(eq=False)  # hashed by identity: pluggy keeps its plugins in sets
class WorkspaceGuard:
    """The guarded roots of one checkout, what they held, and the tests that changed them:
    a plugin registered for one run (its hooks are the methods below)."""

    roots: list[Path]
    listing: Listing
    contents: dict[str, str]
    culprits: list[str]

    @classmethod
    def of(cls, checkout: Path) -> WorkspaceGuard:
        roots = guarded_roots(checkout)
        return cls(roots, stat_listing(roots), content_listing(roots), [])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Iterator[None]:
        outcome = yield
        if call.when != "teardown":
            return
        now = stat_listing(self.roots)
        changed = changes(dict(self.listing), dict(now))
        if not changed:
            return
        self.listing = now  # the next test is judged on its own writes
        report = outcome.get_result()
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} {CHANGED} while it ran "
            "(tests write under their own temporary folders only):\n  " + "\n  ".join(changed)
        )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Every test the guard failed, in this process or on a pytest-xdist worker."""
        if report.when == "teardown" and CHANGED in str(report.longrepr or ""):
            self.culprits.append(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        changed = changes(dict(self.contents), dict(content_listing(self.roots)))
        if not changed:
            return
        named = ", ".join(dict.fromkeys(self.culprits)) or "no test: a fixture or a hook"
        message = f"the test run {CHANGED} ({named}):\n  " + "\n  ".join(changed)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(WorkspaceGuard.of(config.rootpath), "workspace-guard")
