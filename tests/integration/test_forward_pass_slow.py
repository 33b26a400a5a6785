"""Every prediction (evaluation's, the served model's) runs the model as one traced graph.

A Keras model called eagerly runs its layers from Python on every batch; through
``tasks.contracts.inference.predict_batch`` the layers' Python runs only while the graph is
traced (for the first batch's size, then once more for any size), and the probabilities are
those of the eager call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.evaluate import measurement as evaluate
from tasks.predict import model_input, predict_images
from tests.unit.serve.test_predict import png_bytes, spec_for

pytestmark = pytest.mark.slow


def counted_model() -> tuple[Any, list[int]]:
    """A small 16x16 classifier and the list its forward pass appends to each Python run."""
    import keras

    runs: list[int] = []

    class Counted(keras.layers.Layer):  # type: ignore[misc]
        def call(self, inputs: Any) -> Any:
            runs.append(1)
            return inputs

    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            Counted(),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    return model, runs


def test_served_predictions_trace_the_model_at_most_twice_whatever_the_request_sizes() -> None:
    model, runs = counted_model()
    spec = spec_for()
    rng = np.random.default_rng(0)
    images = [png_bytes(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)) for _ in range(11)]
    before = len(runs)
    # batches of 4, 4 and 3, then requests of 2, 5 and 1 rows
    frames = [predict_images(model, images, spec, batch_size=4)]
    frames += [predict_images(model, images[:n], spec) for n in (2, 5, 1)]
    traced = len(runs) - before
    assert traced <= 2  # eagerly: one run per batch, 6
    expected = np.asarray(
        model(np.stack([model_input(image, spec) for image in images]), training=False)
    )
    columns = [f"p_{name}" for name in spec.classes]
    for frame in frames:
        np.testing.assert_allclose(
            frame[columns].to_numpy(), expected[: len(frame)], rtol=1e-5, atol=1e-7
        )


def test_evaluation_traces_the_model_at_most_twice_and_predicts_as_the_eager_call(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, runs = counted_model()
    monkeypatch.setattr(evaluate, "BATCH_SIZE", 4)  # 30 test records: 8 batches
    before = len(runs)
    sources: list[str] = []
    labels, probs, _ = evaluate.predict_split(
        model, tiny_shards / "data" / "shards", sources=sources
    )
    traced = len(runs) - before
    assert traced <= 2  # eagerly: one run per batch, 8
    assert len(labels) == len(probs) == len(sources) == 30
    images = np.concatenate(
        [
            features[evaluate.IMAGE_KEY].numpy()
            for features in evaluate.read_split(
                tiny_shards / "data" / "shards",
                "test",
                batch_size=30,
                training=False,
                with_metadata=True,
            )
        ]
    )
    np.testing.assert_allclose(
        probs, np.asarray(model(images, training=False)), rtol=1e-5, atol=1e-7
    )


def test_evaluation_tells_its_progress_over_the_test_and_val_records(
    tiny_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import keras

    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.save(tmp_path / "model.keras")
    monkeypatch.setattr(evaluate, "BATCH_SIZE", 8)  # test 30 records, val 18
    told: list[tuple[int, int]] = []
    evaluate.evaluate_model(
        tmp_path / "model.keras",
        tiny_shards / "data" / "shards",
        tmp_path / "eval",
        top_k=1,
        label_issues_file=tmp_path / "label_issues.csv",
        min_class_review_accuracy=0.7,
        progress=lambda *at: told.append(at),
    )
    assert told == [(8, 48), (16, 48), (24, 48), (30, 48), (38, 48), (46, 48), (48, 48)]
