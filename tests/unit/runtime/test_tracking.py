"""Tracking setup and what a training run records about its data."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tasks.contracts import run_records
from tasks.contracts.manifest import load_manifest
from tasks.runtime import tracking
from tasks.runtime.params import default_params


def test_tracking_uri_prefers_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking.tracking_uri("/x") == "http://mlflow:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking.tracking_uri("/x") == "sqlite:////x/mlflow.db"


def test_queued_dvc_experiment_logs_to_the_repository_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queued `dvc exp run` runs stages in a copy; DVC names the real repo in DVC_ROOT."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", "/repo")
    assert tracking.tracking_uri("/repo/.dvc/tmp/exps/tmpabc") == "sqlite:////repo/mlflow.db"


def test_dvc_experiment_tags_name_the_experiment() -> None:
    environ = {"DVC_EXP_NAME": "lr-high", "DVC_EXP_BASELINE_REV": "abc123", "DVC_ROOT": "/r"}
    assert run_records.dvc_experiment_tags(environ) == {
        "dvc.experiment": "lr-high",
        "dvc.baseline_rev": "abc123",
    }
    assert run_records.dvc_experiment_tags({}) == {}


def test_run_description_names_what_differs_from_the_champion(
    tiny_shards: Path, mlflow_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = load_manifest(tiny_shards / "data" / "shards")
    client = tracking.client(tiny_shards)
    shards = tiny_shards / "data" / "shards"
    first = run_records.start_train_run(client, default_params(), manifest, shards_dir=shards)
    note = client.get_run(first).data.tags[run_records.NOTE_TAG]
    assert "no champion yet" in note
    name = "shardflow"  # the demo data's registered model (evaluate.model_name: null)
    client.create_registered_model(name)
    version = client.create_model_version(name, f"runs:/{first}/model", run_id=first)
    client.set_registered_model_alias(name, tracking.CHAMPION, version.version)

    monkeypatch.setenv("DVC_EXP_NAME", "lr-high")
    params = default_params(train={"learning_rate": 0.01, "epochs": 3})
    second = run_records.start_train_run(client, params, manifest, shards_dir=shards)
    run = client.get_run(second)
    note = run.data.tags[run_records.NOTE_TAG]
    assert run.data.tags["dvc.experiment"] == "lr-high"
    assert "DVC experiment `lr-high`" in note
    assert f"{name} v{version.version}" in note and first in note
    default_lr = default_params().train.learning_rate
    default_epochs = default_params().train.epochs
    assert f"- `train.learning_rate`: {default_lr} -> 0.01" in note
    assert f"- `train.epochs`: {default_epochs} -> 3" in note
    assert note.count("\n- ") == 2  # nothing else differs: same shard params, same data

    monkeypatch.delenv("DVC_EXP_NAME")
    again = run_records.start_train_run(client, default_params(), manifest, shards_dir=shards)
    assert "nothing changed" in client.get_run(again).data.tags[run_records.NOTE_TAG]


def test_system_metrics_leave_a_sample_even_for_a_short_block(
    tiny_shards: Path, mlflow_store: str
) -> None:
    """The monitor drops the last, partial interval; the block's exit logs it."""
    manifest = load_manifest(tiny_shards / "data" / "shards")
    client = tracking.client(tiny_shards)
    shards = tiny_shards / "data" / "shards"
    run_id = run_records.start_train_run(client, default_params(), manifest, shards_dir=shards)
    assert run_records.SYSTEM_METRICS_INTERVAL_S >= 1  # far longer than the block below
    with run_records.system_metrics(client, run_id, resume=False):
        pass
    metrics = client.get_run(run_id).data.metrics
    assert metrics["system/cpu_utilization_percentage"] >= 0
    assert metrics["system/system_memory_usage_megabytes"] > 0


def test_an_experiment_made_before_its_kind_was_tagged_opens_on_the_runs_table(
    mlflow_store: str,
) -> None:
    """Without mlflow.experimentKind MLflow's UI opens an experiment on its GenAI overview."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_store, mlflow_store)
    made = client.create_experiment(tracking.EXPERIMENT_NAME)
    assert "mlflow.experimentKind" not in client.get_experiment(made).tags
    assert tracking.experiment_id(client) == made
    assert client.get_experiment(made).tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_source_names_the_stage_and_what_ran_it() -> None:
    experiment = {"DVC_EXP_NAME": "lr-high", "DVC_STAGE": "train"}
    assert run_records.source_tags("train", experiment)["mlflow.source.name"] == (
        "python -m flows.launch.train (dvc exp run lr-high)"
    )
    repro = run_records.source_tags("evaluate", {"DVC_STAGE": "evaluate", "DVC_ROOT": "/r"})
    assert repro["mlflow.source.name"] == "python -m flows.launch.evaluate (dvc repro)"
    assert run_records.dvc_experiment({"DVC_STAGE": "train", "DVC_ROOT": "/r"}) is None
    assert run_records.dvc_experiment(experiment) == "lr-high"


def test_dvc_hash_comes_from_the_shard_stage_outs(tmp_path: Path) -> None:
    assert run_records.dvc_shards_md5(tmp_path) == "untracked"
    lock = {
        "schema": "2.0",
        "stages": {
            "shard": {
                "outs": [{"path": "data/shards", "md5": "abc123.dir", "size": 10, "nfiles": 3}]
            }
        },
    }
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert run_records.dvc_shards_md5(tmp_path) == "abc123.dir"


def test_train_run_records_params_lineage_and_dataset(tiny_shards: Path, mlflow_store: str) -> None:
    manifest = load_manifest(tiny_shards / "data" / "shards")
    params = default_params(train={"epochs": 4, "batch_size": 8, "learning_rate": 0.01})
    client = tracking.client(tiny_shards)
    run_id = run_records.start_train_run(
        client,
        params,
        manifest,
        shards_dir=tiny_shards / "data" / "shards",
        root=tiny_shards,
        device_tags={"device.type": "cpu"},
    )
    run = client.get_run(run_id)
    assert run.info.run_name == f"small_cnn-e4-bs8-lr0.01-{manifest.fingerprint[:8]}"
    assert run.data.params["train.epochs"] == "4"
    assert run.data.params["train.augment.flip"] == "True"
    assert run.data.params["shard.image_size"] == "(64, 64)"
    assert run.data.params["data.schema.height"] == "16"
    assert run.data.tags["data.fingerprint"] == manifest.fingerprint
    assert run.data.tags["data.dvc_md5"] == "untracked"
    assert run.data.tags["device.type"] == "cpu"
    # counts are tags (and params), never metrics: nothing constant to chart
    assert run.data.tags["data.test_records"] == "30"
    assert not [key for key in run.data.metrics if key.startswith("data.")]
    # the Source and User columns: the entry point, what ran it, and who
    assert run.data.tags["mlflow.source.name"] == "python -m flows.launch.train (python)"
    assert run.data.tags["mlflow.source.type"] == "LOCAL" and run.data.tags["mlflow.user"]
    assert run.inputs is not None
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.name == f"shards@{manifest.fingerprint[:12]}"
    assert manifest.fingerprint.startswith(dataset.dataset.digest)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == tracking.EXPERIMENT_NAME
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert experiment.artifact_location.startswith((tiny_shards / "mlartifacts").as_uri())


def test_the_code_a_run_ran_is_named_beside_its_commit(tiny_shards: Path, tmp_path: Path) -> None:
    """git.commit named HEAD while tasks/ held uncommitted edits: two runs of one commit
    looked alike whatever code they ran. Edits to the pipeline's own records do not count."""
    repo = tmp_path / "repo"
    (repo / "tasks").mkdir(parents=True)
    (repo / "reports").mkdir()
    for name in ("tasks/models.py", "tasks/old name.py", "reports/eval.json"):
        (repo / name).write_text("v1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "code"], check=True)
    manifest = load_manifest(tiny_shards / "data" / "shards")
    assert run_records.lineage_tags(manifest, root=repo)["git.modified_code"] == "none"
    (repo / "reports/eval.json").write_text("v2\n")  # a stage's output, not code
    (repo / "tasks/models.py").write_text("v2\n")
    (repo / "tasks/new.py").write_text("v1\n")
    subprocess.run([*git, "mv", "tasks/old name.py", "tasks/renamed.py"], check=True)
    tags = run_records.lineage_tags(manifest, root=repo)
    assert tags["git.modified_code"] == "tasks/models.py,tasks/new.py,tasks/renamed.py"
    assert (
        tags["git.commit"]
        == subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    assert run_records.modified_code(tmp_path / "nowhere") == "unknown"
    for i in range(400):  # a new package of many files: the tag stays short enough to set
        (repo / "tasks" / f"module_{i:03d}.py").write_text("v1\n")
    many = run_records.modified_code(repo)
    assert len(many) <= run_records.MODIFIED_CODE_CHARS
    shown = many.split(",... ")[0].split(",")
    assert shown[:2] == ["tasks/models.py", "tasks/module_000.py"]
    assert many.endswith(f",... {403 - len(shown)} more")


def test_run_url_links_the_ui_page_of_the_run(tiny_shards: Path, mlflow_store: str) -> None:
    manifest = load_manifest(tiny_shards / "data" / "shards")
    client = tracking.client(tiny_shards)
    run_id = run_records.start_train_run(
        client,
        default_params(),
        manifest,
        shards_dir=tiny_shards / "data" / "shards",
        root=tiny_shards,
    )
    experiment = client.get_run(run_id).info.experiment_id
    url = tracking.run_url(client, run_id, tiny_shards)
    assert url.startswith(f"{tracking.MLFLOW_UI_URL}/#/experiments/{experiment}/runs/{run_id}")
    # Says which store `make ui` must serve, as the repository names it (not the host path).
    assert url.endswith("(`make ui` over sqlite:///mlflow.db)")
    # Outside a Prefect flow there is no flow run to link back to.
    assert client.get_run(run_id).data.tags["prefect.flow_run_url"] == "none"


# -- every tracking URI form users write, and no credential written down --------------------

TOKEN = "PLANTED_TOKEN"


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("sqlite:///mlflow.db", "sqlite:////repo/mlflow.db"),  # MLflow's docs' form
        ("sqlite:///stores/x.db", "sqlite:////repo/stores/x.db"),
        ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        (None, "sqlite:////repo/mlflow.db"),  # unset: the default, the same relative form
    ],
)
def test_every_tracking_uri_form_names_one_store(
    monkeypatch: pytest.MonkeyPatch, uri: str | None, expected: str
) -> None:
    """A relative SQLite path is the repository's file, not the working directory's, also in
    a queued `dvc exp run` (stages in a copy; DVC names the repository in DVC_ROOT)."""
    monkeypatch.delenv("DVC_ROOT", raising=False)
    if uri is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert tracking.tracking_uri("/repo") == expected
    monkeypatch.setenv("DVC_ROOT", "/repo")
    assert tracking.tracking_uri("/repo/.dvc/tmp/exps/tmpabc") == expected


def test_a_relative_sqlite_uri_creates_its_experiment_in_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MLFLOW_TRACKING_URI=sqlite:///mlflow.db python -m flows.predict ...` failed here:
    "relative path can't be expressed as a file URI"."""
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    client = tracking.client(repo)
    experiment = client.get_experiment(tracking.experiment_id(client, "shardflow-predict"))
    assert experiment.artifact_location == (repo / tracking.ARTIFACTS_NAME).as_uri()
    assert (repo / "mlflow.db").is_file() and not list(elsewhere.iterdir())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"http://alice:{TOKEN}@127.0.0.1:5000", "http://127.0.0.1:5000"),
        (f"https://{TOKEN}@mlflow.example.com/#/runs/1", "https://mlflow.example.com/#/runs/1"),
        (f"postgresql://u:{TOKEN}@db:5432/mlflow", "postgresql://db:5432/mlflow"),
        (f"http://alice:p@ss{TOKEN}@host/x", "http://host/x"),  # '@' in the password
        (
            f"run at http://a:{TOKEN}@h:1/#/r (see http://b:{TOKEN}@g/)",
            "run at http://h:1/#/r (see http://g/)",
        ),
        (f"https://h/x?sv=1&sig={TOKEN}&se=2", "https://h/x?sv=1&sig=***&se=2"),
        (f"https://h/?access_token={TOKEN}", "https://h/?access_token=***"),
        ("sqlite:////repo/mlflow.db", "sqlite:////repo/mlflow.db"),
        ("mail alice@example.com", "mail alice@example.com"),
    ],
)
def test_redact_removes_credentials_from_any_uri_in_a_text(text: str, expected: str) -> None:
    assert tracking.redact(text) == expected


def test_recorded_store_is_repository_relative_and_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DVC_ROOT", raising=False)
    repo = tmp_path / "repo"
    (repo / "stores").mkdir(parents=True)
    assert tracking.recorded_uri(f"sqlite:///{repo}/mlflow.db", repo) == "sqlite:///mlflow.db"
    assert tracking.recorded_uri(f"sqlite:///{repo}/stores/a.db", repo) == "sqlite:///stores/a.db"
    outside = tracking.recorded_uri(f"sqlite:///{tmp_path}/other/m.db", repo)
    assert outside == "sqlite:///<outside the repository>/m.db"
    assert str(tmp_path) not in outside
    assert tracking.recorded_uri(f"http://alice:{TOKEN}@h:5000", repo) == "http://h:5000"


def test_train_run_params_and_tags_are_redacted(tiny_shards: Path, mlflow_store: str) -> None:
    manifest = load_manifest(tiny_shards / "data" / "shards")
    params = default_params(shard={"dask_address": f"tcp://alice:{TOKEN}@scheduler:8786"})
    client = tracking.client(tiny_shards)
    run_id = run_records.start_train_run(
        client, params, manifest, shards_dir=tiny_shards / "data" / "shards"
    )
    run = client.get_run(run_id)
    assert run.data.params["shard.dask_address"] == "tcp://scheduler:8786"
    assert TOKEN not in repr(run.data.params) + repr(run.data.tags)


def test_run_link_to_a_tracking_server_carries_no_credentials() -> None:
    from types import SimpleNamespace

    run = SimpleNamespace(info=SimpleNamespace(experiment_id="7"))
    client = SimpleNamespace(
        tracking_uri=f"http://alice:{TOKEN}@127.0.0.1:5000/", get_run=lambda run_id: run
    )
    url = tracking.run_url(client, "abc")  # type: ignore[arg-type]
    assert url == f"http://127.0.0.1:5000/#/experiments/7/runs/abc{tracking.RUNS_TABLE_QUERY}"


def test_server_credentials_in_the_uri_move_to_mlflows_variables() -> None:
    """MLflow never holds a URI with credentials, so none of its messages can carry them."""
    import os
    from unittest import mock

    uri = f"https://alice:{TOKEN}%2F@mlflow.example.com:8443/base"
    with mock.patch.dict(os.environ, {"MLFLOW_TRACKING_URI": uri}):
        os.environ.pop("MLFLOW_TRACKING_USERNAME", None)
        os.environ.pop("MLFLOW_TRACKING_PASSWORD", None)
        client = tracking.client("/repo")
        creds = client._tracking_client.store.get_host_creds()
        assert client.tracking_uri == creds.host == "https://mlflow.example.com:8443/base"
        assert (creds.username, creds.password) == ("alice", f"{TOKEN}/")
    # Variables already set win; a lone token, or a database's password, stays (redacted
    # wherever it is recorded).
    explicit = {"MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": "pw"}
    with mock.patch.dict(os.environ, {"MLFLOW_TRACKING_URI": uri, **explicit}):
        assert tracking.tracking_uri() == "https://mlflow.example.com:8443/base"
        assert os.environ["MLFLOW_TRACKING_USERNAME"] == "bob"
    for kept in (f"https://{TOKEN}@h", f"postgresql://u:{TOKEN}@db/mlflow"):
        with mock.patch.dict(os.environ, {"MLFLOW_TRACKING_URI": kept}):
            assert tracking.tracking_uri() == kept
