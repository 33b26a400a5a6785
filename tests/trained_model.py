"""One tiny trained and registered model, made by the real stages from a tiny image folder.

Ingest and shard (``jpeg`` shards, so the served model must repeat the JPEG round trip),
a short ``small_cnn`` training and the evaluate stage (pyfunc registration, champion alias,
``reports/test_predictions.csv``), all in one project root with its own SQLite store.
Built once per session (``trained_project`` in ``tests/conftest.py``) and only read after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import yaml

MODEL_NAME = "tiny"
IMAGE_SIZE = 16


@dataclass(frozen=True)
class TrainedProject:
    root: Path
    source_dir: Path  # the original images (the test split's source files live here)
    tracking_uri: str

    @property
    def test_predictions(self) -> Path:
        from tasks.runtime.layout import Layout

        return Layout(self.root).test_predictions


def build_trained_project(root: Path) -> TrainedProject:
    from tasks.evaluate.stage import run_evaluate
    from tasks.ingest.stage import run_ingest
    from tasks.runtime.layout import Layout
    from tasks.runtime.params import default_params
    from tasks.shard.stage import shard_stage
    from tasks.train.stage import run_train
    from tests.conftest import write_image_folder
    from tests.tiny_shards import write_validation_report

    source = write_image_folder(root / "images")
    settings = {
        "ingest": {
            "source_dir": str(source),
            "splits": {"train": 0.5, "val": 0.25, "test": 0.25},
            "workers": 1,
        },
        "shard": {"image_size": [IMAGE_SIZE, IMAGE_SIZE], "encoding": "jpeg", "workers": 1},
        "train": {
            "epochs": 3,
            "batch_size": 8,
            "learning_rate": 0.003,
            "early_stopping_patience": 0,
        },
        # a tiny test split: a comparison counts as few records as it holds
        "evaluate": {"model_name": MODEL_NAME, "min_unseen_records": 5},
    }
    layout = Layout(root)
    # The repository's params.yaml (every key) with this project's changes.
    params = default_params(**settings)
    layout.params.write_text(yaml.safe_dump(params.model_dump(mode="json", by_alias=True)))
    run_ingest(params.ingest, layout.index, layout.ingest_report)
    manifest = shard_stage(params.shard, layout.index, layout.shards_dir).manifest
    write_validation_report(root, manifest.fingerprint, passed=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with mock.patch.dict(os.environ, {"MLFLOW_TRACKING_URI": uri}):
        run_train(params, layout)
        run_evaluate(params, layout)
    return TrainedProject(root=root, source_dir=source, tracking_uri=uri)
