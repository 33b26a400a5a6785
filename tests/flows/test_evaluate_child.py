"""The evaluate stage measures the model in its prestarted child while its own process opens
the tracking store: the two heavy imports (TensorFlow there, MLflow here) overlap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlflow.entities import Param

from tasks import predict
from tasks.contracts.manifest import load_manifest
from tasks.evaluate import registry
from tasks.evaluate import stage as evaluate
from tasks.runtime import latency, processes, tf_imports, tracking
from tasks.runtime.latency import prestart_child, start_where_warm
from tasks.runtime.layout import Layout
from tasks.runtime.params import load_params
from tests.trained_model import build_trained_project

pytestmark = pytest.mark.slow


def retrained(layout: Layout) -> str:
    """A new training run of the same model (the record of ``models/run.json`` pointed at a
    copy of its run): one no version is registered from yet."""
    record = json.loads(layout.train_run.read_text())
    client = tracking.client(layout.root)
    trained = client.get_run(record["run_id"])
    run = client.create_run(trained.info.experiment_id, tags=dict(trained.data.tags))
    params = [Param(key, value) for key, value in trained.data.params.items()]
    client.log_batch(run.info.run_id, params=params)
    client.set_terminated(run.info.run_id, "FINISHED")
    layout.train_run.write_text(json.dumps({**record, "run_id": run.info.run_id}))
    return run.info.run_id


def test_the_model_is_measured_in_the_child_while_the_store_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the order the stage runs them: the measuring starts in the child, this process
    opens the tracking store (and logs the pyfunc when a version is due), then takes the
    child's figures; they are those of measuring in this process (the first evaluation), and
    the child is used up. Registering a new version imports no Keras here (MLflow's check of
    the logged pyfunc loads it: off). A measuring that fails leaves no logged pyfunc behind.
    Where the store cannot be opened, the child still measuring is stopped: it writes no
    more reports."""
    project = build_trained_project(tmp_path / "project")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", project.tracking_uri)
    layout = Layout(project.root)
    params = load_params(layout.params)
    first = json.loads(layout.eval_metrics.read_text())
    predictions = layout.test_predictions.read_text()

    events: list[str] = []
    real_client, real_keras = tracking.client, tf_imports.keras_without_extras
    real_log = predict.log_pyfunc

    def opening_store(root: str | Path = ".") -> Any:
        events.append("store opened")
        return real_client(root)

    def importing_keras() -> Any:
        events.append("keras imported")
        return real_keras()

    def logging_pyfunc(*args: Any, **kwargs: Any) -> str:
        events.append("pyfunc logged")
        return real_log(*args, **kwargs)

    monkeypatch.setattr(tracking, "client", opening_store)
    monkeypatch.setattr(predict, "log_pyfunc", logging_pyfunc)
    monkeypatch.setattr(tf_imports, "keras_without_extras", importing_keras)

    class Watched:
        def __init__(self, job: Any) -> None:
            self.job = job

        def result(self) -> Any:
            value = self.job.result()
            events.append("measured")
            return value

        def cancel(self) -> None:
            self.job.cancel()

    told: list[tuple[int, int]] = []

    def start(fn: Any, *args: Any) -> Watched:
        events.append("measuring started")
        job = start_where_warm(evaluate.warm_up, fn, *args, report=lambda *at: told.append(at))
        assert isinstance(job, processes.ChildResult)  # the prestarted child took it
        return Watched(job)

    prestart_child(evaluate.warm_up)  # what `python -m flows.launch.evaluate` does first
    result = evaluate.run_evaluate(params, layout, start)

    assert events == ["measuring started", "store opened", "measured"]  # v1 registered before
    assert latency.standby_child(evaluate.warm_up) is None
    for key in ("accuracy", "top_k_accuracy", "macro_f1"):
        assert result[key] == first[key]
    assert layout.test_predictions.read_text() == predictions
    assert result["model_version"] == "1"  # the same training run: its version, reused
    # The child told its progress, each batch's records, test then val, as they were predicted.
    splits = load_manifest(layout.shards_dir).splits
    records = splits["test"].num_records + splits["val"].num_records
    assert told and told[-1] == (records, records)
    assert [done for done, _ in told] == sorted({done for done, _ in told})

    retrained(layout)
    events.clear()
    prestart_child(evaluate.warm_up)
    result = evaluate.run_evaluate(params, layout, start)
    # The pyfunc is logged while the child measures, and nothing loads it (Keras) to
    # register it, before or after the measuring.
    assert events == ["measuring started", "store opened", "pyfunc logged", "measured"]
    assert result["model_version"] == "2"
    # v1, measured the same way on the same test set, is compared through the answers its
    # evaluation recorded: evidence without loading its model
    decision = result["promotion"]
    assert decision["champion_value_source"] == "recorded" and decision["evidence"]
    assert "eval/answers.json" in decision["champion_value_how"]

    class Failing(Watched):
        def result(self) -> Any:
            self.job.result()
            raise RuntimeError("the measuring failed")

    failed_run = retrained(layout)
    events.clear()
    prestart_child(evaluate.warm_up)
    with pytest.raises(RuntimeError, match="measuring failed"):
        evaluate.run_evaluate(params, layout, lambda fn, *args: Failing(start(fn, *args).job))
    assert events == ["measuring started", "store opened", "pyfunc logged"]
    client = real_client(layout.root)
    experiment = client.get_run(failed_run).info.experiment_id
    left = client.search_logged_models([experiment], f"source_run_id = '{failed_run}'")
    assert list(left) == []  # logged, then deleted: nothing registered, nothing left
    assert registry.registered_version(client, params.evaluate.model_name, failed_run) is None

    jobs: list[Any] = []

    def kept(fn: Any, *args: Any) -> Any:
        jobs.append(start_where_warm(evaluate.warm_up, fn, *args))
        return jobs[-1]

    def store_down(root: str | Path = ".") -> Any:
        raise ConnectionError("the tracking store is down")

    monkeypatch.setattr(tracking, "client", store_down)
    prestart_child(evaluate.warm_up)
    with pytest.raises(ConnectionError, match="store is down"):
        evaluate.run_evaluate(params, layout, kept)
    (job,) = jobs
    assert isinstance(job, processes.ChildResult)
    assert not job._process.is_alive()  # type: ignore[attr-defined]
