"""The evaluate stage measures the model in its prestarted child while its own process opens
the tracking store: the two heavy imports (TensorFlow there, MLflow here) overlap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flows.common import start_where_warm
from tasks import evaluate, processes, tracking
from tasks.layout import Layout
from tasks.params import load_params
from tasks.processes import prestart_child
from tests.trained_model import build_trained_project

pytestmark = pytest.mark.slow


def test_the_model_is_measured_in_the_child_while_the_store_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the order the stage runs them: the measuring starts in the child, this process
    opens the tracking store, then takes the child's figures; they are those of measuring
    in this process (the first evaluation), and the child is used up."""
    project = build_trained_project(tmp_path / "project")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", project.tracking_uri)
    layout = Layout(project.root)
    params = load_params(layout.params)
    first = json.loads(layout.eval_metrics.read_text())
    predictions = layout.test_predictions.read_text()

    events: list[str] = []
    real_client = tracking.client

    def opening_store(root: str | Path = ".") -> Any:
        events.append("store opened")
        return real_client(root)

    monkeypatch.setattr(tracking, "client", opening_store)

    class Watched:
        def __init__(self, job: Any) -> None:
            self.job = job

        def result(self) -> Any:
            value = self.job.result()
            events.append("measured")
            return value

    def start(fn: Any, *args: Any) -> Watched:
        events.append("measuring started")
        job = start_where_warm(evaluate.warm_up, fn, *args)
        assert isinstance(job, processes.ChildResult)  # the prestarted child took it
        return Watched(job)

    prestart_child(evaluate.warm_up)  # what `python -m flows.evaluate` does first
    result = evaluate.run_evaluate(params, layout, start)

    assert events[:3] == ["measuring started", "store opened", "measured"]
    assert processes.standby_child(evaluate.warm_up) is None
    for key in ("accuracy", "top_k_accuracy", "macro_f1"):
        assert result[key] == first[key]
    assert layout.test_predictions.read_text() == predictions
    assert result["model_version"] == "1"  # the same training run: its version, reused
