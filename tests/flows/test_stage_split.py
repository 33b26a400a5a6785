"""Each training-side stage runs a module of its own, so its dvc.yaml deps are its code only:
editing evaluation or prediction code never retrains, editing training code re-evaluates."""

from __future__ import annotations

from pathlib import Path

import yaml

from tasks.runtime.stage_deps import code_deps, entry_module

REPO = Path(__file__).resolve().parents[2]
EVALUATION_CODE = {
    "tasks/evaluate/stage.py",
    "tasks/predict.py",
    "tasks/images.py",
    "flows/evaluate.py",
}


def stage(name: str) -> dict[str, object]:
    return dict(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][name])


def test_train_stage_neither_imports_nor_lists_evaluation_code() -> None:
    spec = stage("train")
    assert entry_module(str(spec["cmd"])) == "flows.launch.train"
    assert not set(code_deps(REPO, "flows.launch.train")) & EVALUATION_CODE
    assert not set(map(str, spec["deps"])) & EVALUATION_CODE  # type: ignore[call-overload]


def test_evaluate_stage_runs_its_own_module_with_the_evaluation_code() -> None:
    spec = stage("evaluate")
    assert entry_module(str(spec["cmd"])) == "flows.launch.evaluate"
    deps = set(map(str, spec["deps"]))  # type: ignore[call-overload]
    assert deps >= EVALUATION_CODE and "models/model.keras" in deps
    assert "flows/train.py" not in code_deps(REPO, "flows.launch.evaluate")
