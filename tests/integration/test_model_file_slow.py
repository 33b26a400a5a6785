"""The trained model's file: the same model saves to the same bytes, and loads back whole; two
processes saving the same weights write the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest

from tasks.runtime.params import default_params
from tasks.train.model_file import CONFIG_ENTRY, METADATA_ENTRY, renumber_shared_ids, save_model
from tasks.train.models import build_model

pytestmark = pytest.mark.slow


def seeded_model(seed: int = 7) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return build_model(default_params().train, 3, (16, 16, 3))


def shared_ids(path: Path) -> list[object]:
    with zipfile.ZipFile(path) as archive:
        text = archive.read(CONFIG_ENTRY).decode()
    found: list[object] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "shared_object_id":
                    found.append(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(text))
    return found


SAVE_IN_A_PROCESS = """
import sys
from tests.integration.test_model_file_slow import seeded_model
from tasks.train.model_file import save_model
model = seeded_model()
model.save(sys.argv[1] + "/plain.keras")
save_model(model, sys.argv[1] + "/model.keras")
"""


def test_other_weights_save_to_other_bytes(tmp_path: Path) -> None:
    save_model(seeded_model(7), tmp_path / "a.keras")
    save_model(seeded_model(8), tmp_path / "b.keras")
    assert (tmp_path / "a.keras").read_bytes() != (tmp_path / "b.keras").read_bytes()


def test_the_canonical_file_loads_to_the_same_model(tmp_path: Path) -> None:
    model = seeded_model()
    save_model(model, tmp_path / "model.keras")
    plain = tmp_path / "plain.keras"
    model.save(plain)
    ids = shared_ids(tmp_path / "model.keras")
    assert ids and set(ids) == set(range(1, len(set(ids)) + 1))  # renumbered 1, 2, ...

    loaded = keras.saving.load_model(tmp_path / "model.keras")
    images = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3)).astype("float32")
    np.testing.assert_array_equal(
        np.asarray(loaded(images, training=False)), np.asarray(model(images, training=False))
    )
    assert loaded.to_json() == keras.saving.load_model(plain).to_json()  # the same model
    for ours, original in zip(loaded.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(original))


def test_renumbering_keeps_which_entries_share_an_id() -> None:
    config = {
        "a": {"shared_object_id": 140_000_123, "x": [{"shared_object_id": 99}]},
        "b": {"shared_object_id": 140_000_123},
        "c": [{"shared_object_id": 99}, {"other": 1}],
    }
    assert renumber_shared_ids(config) == {
        "a": {"shared_object_id": 1, "x": [{"shared_object_id": 2}]},
        "b": {"shared_object_id": 1},
        "c": [{"shared_object_id": 2}, {"other": 1}],
    }


def test_the_same_weights_save_to_the_same_bytes(tmp_path: Path) -> None:
    """Two processes save equal weights, as two deterministic trainings do: Keras's own files
    differ (the clock, memory addresses, entry times); ours do not."""
    repo = Path(__file__).resolve().parents[2]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        subprocess.run(
            [sys.executable, "-c", SAVE_IN_A_PROCESS, str(tmp_path / name)],
            cwd=repo,
            env={**os.environ, "PYTHONPATH": str(repo)},
            check=True,
            timeout=300,
        )
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "plain.keras").read_bytes() != (b / "plain.keras").read_bytes()
    assert (a / "model.keras").read_bytes() == (b / "model.keras").read_bytes()
    assert sorted(p.name for p in a.iterdir()) == ["model.keras", "plain.keras"]  # no temp left
    with zipfile.ZipFile(a / "model.keras") as archive:
        metadata = json.loads(archive.read(METADATA_ENTRY))
        assert metadata == {"keras_version": keras.__version__}
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
