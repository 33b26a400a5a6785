"""The classification figures evaluation reports and promotion compares: accuracy, top-k,
macro precision/recall/F1, the per-class table and the confusion matrix, from labels and
predicted probabilities (NumPy only, no model and no I/O); :func:`metrics_by_name` scores a
model whose classes are named differently from the records' (the champion on today's data).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts [true, predicted]."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def top_k_accuracy(
    labels: np.ndarray, probs: np.ndarray, k: int, columns: np.ndarray | None = None
) -> float:
    """The share of records whose label is among the ``k`` most probable columns;
    ``columns[j]``: the label column ``j`` stands for (default ``j``)."""
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    top = top if columns is None else columns[top]
    return float(np.mean(np.any(top == labels[:, None], axis=1))) if len(labels) else 0.0


def classification_metrics(
    labels: np.ndarray,
    probs: np.ndarray,
    classes: list[str],
    *,
    top_k: int,
    columns: np.ndarray | None = None,
) -> dict[str, Any]:
    """Accuracy, top-k, macro precision/recall/F1 and a per-class table.

    A class never predicted has precision 0; a class absent from the test set counts in the
    macro averages with recall 0 (its row shows ``support: 0``). ``columns``: as
    :func:`top_k_accuracy`'s; ``len(classes)`` stands for a class ``classes`` lacks, a
    prediction that is wrong on every record (:func:`metrics_by_name`).
    """
    k = max(1, min(top_k, len(classes)))
    predicted = probs.argmax(axis=1) if columns is None else columns[probs.argmax(axis=1)]
    # One column more: predictions of a class not in ``classes`` (none without ``columns``).
    matrix = confusion_matrix(labels, predicted, len(classes) + 1)[: len(classes)]
    true_pos = np.diag(matrix).astype(float)
    support, predicted_count = matrix.sum(axis=1), matrix[:, :-1].sum(axis=0)
    precision = np.divide(
        true_pos, predicted_count, out=np.zeros_like(true_pos), where=predicted_count > 0
    )
    recall = np.divide(true_pos, support, out=np.zeros_like(true_pos), where=support > 0)
    denominator = precision + recall
    f1 = np.divide(
        2 * precision * recall, denominator, out=np.zeros_like(true_pos), where=denominator > 0
    )
    per_class = [
        {
            "class": name,
            "precision": float(precision[i]),
            "recall": float(recall[i]),
            "f1": float(f1[i]),
            "support": int(support[i]),
        }
        for i, name in enumerate(classes)
    ]
    return {
        "accuracy": float(np.mean(predicted == labels)) if len(labels) else 0.0,
        "top_k": k,
        "top_k_accuracy": top_k_accuracy(labels, probs, k, columns),
        "macro_precision": float(precision.mean()),
        "macro_recall": float(recall.mean()),
        "macro_f1": float(f1.mean()),
        "num_test_records": len(labels),
        "per_class": per_class,
        "confusion_matrix": matrix[:, :-1].tolist(),
    }


def metrics_by_name(
    labels: np.ndarray,
    probs: np.ndarray,
    model_classes: list[str],
    classes: list[str],
    *,
    top_k: int,
) -> dict[str, Any]:
    """:func:`classification_metrics` of a model whose outputs are ``model_classes`` (the
    champion's) on records labelled with ``classes`` (today's), matched by class name.

    The prediction and the top k are the model's own ranking of all its classes, never
    re-ranked after dropping one: predicting a class ``classes`` lacks is an error, and so is
    every record of a class the model does not know. The macro figures are over ``classes``.
    """
    columns = class_columns(model_classes, classes)
    return classification_metrics(labels, probs, classes, top_k=top_k, columns=columns)


def class_columns(model_classes: list[str], classes: list[str]) -> np.ndarray:
    """For each output of a model of ``model_classes``, the index of its class in
    ``classes`` (``len(classes)``: a class ``classes`` lacks)."""
    position = {name: index for index, name in enumerate(classes)}
    return np.array([position.get(name, len(classes)) for name in model_classes], np.int64)
