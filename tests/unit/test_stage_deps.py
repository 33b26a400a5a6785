"""Every project module a stage runs is in its dvc.yaml ``deps``: DVC reruns a stage only
when a dep changes, so a missing module means a code change that silently keeps stale outputs.

A stage's modules are the transitive ``tasks.*``/``flows.*`` imports of its entry point
(``python -m flows.data shard`` -> ``flows.data``), function-level imports included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tasks.runtime.code_version import project_modules, with_native_sources

REPO = Path(__file__).resolve().parents[2]


def project_files(root: Path, entry: str) -> set[str]:
    """Repo-relative files of ``entry`` and every project module it imports, transitively, and
    their C++ sources: read the way code versions read them
    (:func:`tasks.runtime.code_version.project_modules`, ``with_native_sources``)."""
    root = root.resolve()
    files = with_native_sources(list(project_modules(root, entry).values()))
    return {path.relative_to(root).as_posix() for path in files}


def entry_module(cmd: str) -> str:
    match = re.match(r"python3?\s+-m\s+([\w.]+)", cmd)
    assert match, f"stage cmd {cmd!r} is not `python -m <module> ...`"
    return match.group(1)


def stages(root: Path) -> dict[str, dict[str, object]]:
    return dict(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])


@pytest.mark.parametrize("stage", sorted(stages(REPO)))
def test_stage_deps_name_every_module_it_runs(stage: str) -> None:
    spec = stages(REPO)[stage]
    needed = project_files(REPO, entry_module(str(spec["cmd"])))
    listed = {str(dep).rstrip("/") for dep in spec.get("deps", [])}  # type: ignore[attr-defined]
    missing = sorted(needed - listed)
    assert not missing, f"dvc.yaml stage {stage!r} runs {missing} but does not list them in deps"


def test_import_analysis_follows_every_kind_of_import(tmp_path: Path) -> None:
    """Module-level, function-level, from-package submodule and relative imports all count;
    third-party modules and modules that are never imported do not."""
    files = {
        "flows/__init__.py": "",
        "flows/entry.py": "import json\nfrom tasks import a\n\ndef main():\n    import tasks.b\n",
        "tasks/__init__.py": "",
        "tasks/a.py": "from .c import thing\n",
        "tasks/b.py": "from tasks.sub import d\n",
        "tasks/c.py": "thing = 1\n",
        "tasks/sub/__init__.py": "",
        "tasks/sub/d.py": "import numpy\n",
        "tasks/unused.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert project_files(tmp_path, "flows.entry") == set(files) - {"tasks/unused.py"}
    assert entry_module("python -m flows.entry shard --params p.yaml") == "flows.entry"
