"""A tracking store that lost the runs the reports name is found, and its rebuild named."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.cli import shardflow as cli
from tasks.evaluate.store_check import REBUILD, StoreLostRuns, check_store
from tasks.runtime.atomic import write_json
from tasks.runtime.params import shipped_params_text
from tasks.runtime.refusals import REFUSED_EXIT


def reports_naming(root: Path, train_run: str, eval_run: str, version: str = "1") -> None:
    write_json(root / "models" / "run.json", {"run_id": train_run})
    summary = {"eval_run_id": eval_run, "model_version": version, "run_id": train_run}
    write_json(
        root / "reports" / "eval_summary.json",
        {**summary, "promotion": {"model_name": "shardflow"}},
    )


def store_with_a_version(uri: str) -> tuple[str, str]:
    """A store holding a training run, its evaluation run and version 1 made from it."""
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("shardflow")
    train = client.create_run(experiment).info.run_id
    evaluation = client.create_run(experiment).info.run_id
    client.create_registered_model("shardflow")
    client.create_model_version("shardflow", f"runs:/{train}/model", run_id=train)
    return train, evaluation


def test_a_lost_or_replaced_store_is_refused_naming_the_rebuild(
    tmp_path: Path, mlflow_uri: str
) -> None:
    train, evaluation = store_with_a_version(mlflow_uri)
    reports_naming(tmp_path, train, evaluation)
    check_store(tmp_path)  # the store holds what the reports name

    # replaced: neither run is in it, and its version 1 is another run's
    reports_naming(tmp_path, "f" * 32, "e" * 32)
    with pytest.raises(StoreLostRuns) as refused:
        check_store(tmp_path)
    assert f"models/run.json: training run {'f' * 32}" in str(refused.value)
    assert f"evaluation run {'e' * 32}" in str(refused.value)
    assert "version 1 of 'shardflow' made from run" in str(refused.value)
    assert refused.value.fix is not None and REBUILD in refused.value.fix

    # lost: the file is gone, and looking does not create it
    Path(mlflow_uri.removeprefix("sqlite:///")).unlink()
    with pytest.raises(StoreLostRuns, match="no such file"):
        check_store(tmp_path)
    assert not Path(mlflow_uri.removeprefix("sqlite:///")).exists()


def test_nothing_recorded_yet_passes(tmp_path: Path, mlflow_uri: str) -> None:
    check_store(tmp_path)
    assert not Path(mlflow_uri.removeprefix("sqlite:///")).exists()


def test_make_run_refuses_a_skipped_evaluation_whose_runs_the_store_lost(
    tmp_path: Path,
    mlflow_uri: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    reports_naming(tmp_path, "f" * 32, "e" * 32)
    monkeypatch.chdir(tmp_path)
    skipped = [
        "Stage 'train' didn't change, skipping\n",
        "Stage 'evaluate' didn't change, skipping\n",
    ]

    monkeypatch.setattr(cli, "run_step", lambda command, env, service=None: 0)
    monkeypatch.setattr(cli, "teed", lambda command, env: (0, skipped, []))
    assert cli.main(["run"]) == REFUSED_EXIT
    out, err = capsys.readouterr()
    assert "Refused: shardflow (StoreLostRuns)" in err and "the tracking store" in err
    assert f"fix: `{REBUILD}`" in err
    assert "Shardflow run done" not in out


def test_predict_and_serve_model_on_a_store_that_lost_the_runs_name_the_rebuild(
    tmp_path: Path,
    mlflow_uri: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from flows.predict import predict_flow
    from tests.conftest import write_image_folder

    reports_naming(tmp_path, "f" * 32, "e" * 32)
    write_image_folder(tmp_path / "photos", per_class=1)
    (tmp_path / "params.yaml").write_text(shipped_params_text())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreLostRuns) as refused:
        predict_flow.fn(source="photos", root=str(tmp_path))
    assert refused.value.fix is not None and REBUILD in refused.value.fix

    started: list[list[str]] = []
    monkeypatch.setattr(cli, "run_step", lambda step, env, service=None: started.append(step) or 0)
    assert cli.main(["serve-model"]) == REFUSED_EXIT
    assert not started  # no server that would fail with MLflow's traceback
    err = capsys.readouterr().err
    assert "Refused: shardflow (StoreLostRuns)" in err and "the tracking store" in err
    assert f"fix: `{REBUILD}`" in err


def test_a_training_run_missing_from_the_store_names_the_one_rebuild() -> None:
    """The evaluate stage's refusal and `make run`'s check name the same command (a bare
    `dvc repro -f train` would also force every stage upstream of train)."""
    from tasks.evaluate.tracking import TrainingRunNotInStore

    assert TrainingRunNotInStore.fix is not None
    assert TrainingRunNotInStore.fix.startswith(REBUILD)
