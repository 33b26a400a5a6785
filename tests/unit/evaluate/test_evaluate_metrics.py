"""Evaluation metrics on hand-checkable predictions."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.evaluate.metrics import classification_metrics, top_k_accuracy

CLASSES = ["a", "b", "c"]


def one_hot(predicted: list[int]) -> np.ndarray:
    probs = np.full((len(predicted), 3), 0.1, dtype=np.float32)
    probs[np.arange(len(predicted)), predicted] = 0.8
    return probs


def test_macro_metrics_match_a_hand_count() -> None:
    labels = np.array([0, 0, 1, 1, 2, 2])
    probs = one_hot([0, 1, 1, 1, 0, 2])
    metrics = classification_metrics(labels, probs, CLASSES, top_k=1)
    # a: P=1/2 R=1/2; b: P=2/3 R=1; c: P=1 R=1/2
    assert metrics["accuracy"] == pytest.approx(4 / 6)
    assert metrics["macro_precision"] == pytest.approx((1 / 2 + 2 / 3 + 1) / 3)
    assert metrics["macro_recall"] == pytest.approx((1 / 2 + 1 + 1 / 2) / 3)
    f1 = [0.5, 0.8, 2 / 3]
    assert metrics["macro_f1"] == pytest.approx(sum(f1) / 3)
    assert metrics["confusion_matrix"] == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    assert [row["support"] for row in metrics["per_class"]] == [2, 2, 2]


def test_never_predicted_class_has_zero_precision_not_nan() -> None:
    labels = np.array([0, 1, 2])
    metrics = classification_metrics(labels, one_hot([0, 0, 0]), CLASSES, top_k=1)
    assert metrics["per_class"][1]["precision"] == 0.0
    assert not np.isnan(metrics["macro_f1"])


@pytest.mark.parametrize(("k", "expected"), [(1, 0.5), (2, 1.0), (3, 1.0)])
def test_top_k_accuracy(k: int, expected: float) -> None:
    labels = np.array([0, 1])
    probs = np.array([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]])
    assert top_k_accuracy(labels, probs, k) == expected


def test_top_k_is_capped_at_the_number_of_classes() -> None:
    metrics = classification_metrics(np.array([0]), one_hot([1]), CLASSES, top_k=5)
    assert metrics["top_k"] == 3 and metrics["top_k_accuracy"] == 1.0
