"""Every project module a stage runs is in its dvc.yaml ``deps``: DVC reruns a stage only
when a dep changes, so a missing module means a code change that silently keeps stale outputs.

``python -m tasks.runtime.stage_deps --write`` writes them from the imports of each stage's
entry point (``python -m flows.shard`` -> ``flows.shard``), function-level imports included;
the committed dvc.yaml is byte for byte what it writes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from tasks.runtime.stage_deps import (
    RUN_BY_PATH_NOTE,
    StageCommandError,
    code_deps,
    entry_module,
    main,
    written,
)

REPO = Path(__file__).resolve().parents[2]


def stages(root: Path) -> dict[str, dict[str, object]]:
    return dict(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])


def test_dvc_yaml_is_what_the_stage_deps_command_writes() -> None:
    assert (REPO / "dvc.yaml").read_text() == written(REPO), (
        "dvc.yaml's stage deps are not the modules the stages import: "
        "run `shardflow stages --write`"
    )


@pytest.mark.parametrize("stage", sorted(stages(REPO)))
def test_stage_deps_name_every_module_it_runs(stage: str) -> None:
    spec = stages(REPO)[stage]
    needed = set(code_deps(REPO, entry_module(str(spec["cmd"]))))
    listed = {str(dep).rstrip("/") for dep in spec.get("deps", [])}  # type: ignore[attr-defined]
    missing = sorted(needed - listed)
    assert not missing, f"dvc.yaml stage {stage!r} runs {missing} but does not list them in deps"


@pytest.mark.parametrize(
    "stage", sorted(s for s, spec in stages(REPO).items() if "flows." in str(spec["cmd"]))
)
def test_a_stages_command_runs_its_own_flow_and_no_other_stages(stage: str) -> None:
    """A stage's command (``flows.launch.validate``, which starts the stage's children before
    Prefect's import, or the flow module itself) runs its own flow module and no other stage's
    flow or command: an edit to one stage reruns no other."""
    names = [s for s in stages(REPO) if s != stage]
    others = {f"flows/{s}.py" for s in names} | {f"flows/launch/{s}.py" for s in names}
    deps = set(code_deps(REPO, entry_module(str(stages(REPO)[stage]["cmd"]))))
    assert f"flows/{stage}.py" in deps
    assert sorted(deps & others) == []


def test_the_served_pyfunc_logged_by_path_is_evaluations_code_not_trainings() -> None:
    assert "tasks/serve/serving_model.py" in code_deps(REPO, "flows.evaluate")
    assert "tasks/serve/serving_model.py" not in code_deps(REPO, "flows.train")


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


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
    write_tree(tmp_path, files)
    assert code_deps(tmp_path, "flows.entry") == sorted(set(files) - {"tasks/unused.py"})
    assert entry_module("python -m flows.entry shard --params p.yaml") == "flows.entry"


PROJECT = {
    "flows/__init__.py": "",
    "flows/stage.py": "from tasks import b\n",
    "tasks/__init__.py": "",
    "tasks/a.py": "",
    "tasks/b.py": "import tasks.a\n",
    "tasks/gone_since.py": "",
}
STALE = """\
# the file's own comment stays
stages:
  stage:
    cmd: python -m flows.stage --fast
    deps:
      # above a code dep: goes with it
      - tasks/gone_since.py
      # the data it reads
      - data/in.json  # its own line's comment
      - tasks/b.py
      # a folder too
      - models/pretrained
    params:
      - stage
    outs:
      - out.json:
          cache: false

  other:
    cmd: echo no deps
"""
CURRENT = """\
# the file's own comment stays
stages:
  stage:
    cmd: python -m flows.stage --fast
    deps:
      # the data it reads
      - data/in.json  # its own line's comment
      # a folder too
      - models/pretrained
      - flows/__init__.py
      - flows/stage.py
      - tasks/__init__.py
      - tasks/a.py
      - tasks/b.py
    params:
      - stage
    outs:
      - out.json:
          cache: false

  other:
    cmd: echo no deps
"""


def test_writing_keeps_other_deps_and_comments_and_a_second_write_changes_nothing(
    tmp_path: Path,
) -> None:
    """Stale code deps go, missing ones come, sorted after the deps written by hand, which
    keep their order and comments; the rest of the file is kept byte for byte."""
    write_tree(tmp_path, {**PROJECT, "dvc.yaml": STALE})
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert (tmp_path / "dvc.yaml").read_text() == STALE  # --check changes nothing
    assert main(["--write", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "dvc.yaml").read_text() == CURRENT
    assert written(tmp_path) == CURRENT
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_a_module_run_by_path_is_listed_and_says_so(tmp_path: Path) -> None:
    files = {
        **PROJECT,
        "flows/stage.py": "import tasks.predict\n",
        "tasks/predict.py": "",
        "tasks/serve/__init__.py": "",
        "tasks/serve/serving_model.py": "from tasks import a\n",
        "dvc.yaml": "stages:\n  stage:\n    cmd: python -m flows.stage\n    deps:\n      - x\n",
    }
    write_tree(tmp_path, files)
    text = written(tmp_path)
    assert f"      - tasks/serve/serving_model.py  # {RUN_BY_PATH_NOTE}\n" in text
    assert "      - tasks/a.py\n" in text  # what the module run by path imports


def test_a_stage_whose_command_names_no_module_is_refused_with_its_command(
    tmp_path: Path,
) -> None:
    stale = textwrap.dedent(
        """\
        stages:
          stage:
            cmd: bash run.sh
            deps:
              - tasks/a.py
        """
    )
    write_tree(tmp_path, {**PROJECT, "dvc.yaml": stale})
    with pytest.raises(StageCommandError, match=r"'bash run\.sh'.*python -m"):
        written(tmp_path)
