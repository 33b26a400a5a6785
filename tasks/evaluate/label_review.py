"""Label review: likely label errors in the held-out splits, ranked for a person to check.

The model never trained on val or test, so its predicted probabilities there are
out-of-sample, which is what confident learning needs: cleanlab's ``find_label_issues``
flags the records whose given label the model's probabilities contradict (after estimating
how noisy each class is), and ``get_label_quality_scores`` ranks them (self-confidence:
the probability of the given label; lowest first). A flagged record is a likely label error
only when the model is good enough on both classes to judge between them: its held-out
recall and precision of the given class and of the class it suggests instead are each at
least ``evaluate.min_class_review_accuracy`` (:func:`judged_classes`). Otherwise it is a
confusion of the model's, and the rows and the sheet say so. A model's confidence in its
top class is no such evidence: a weak model is confidently wrong on correctly labelled
images. The thumbnail sheet shows the shard pixels of the top rows, the pixels the model
saw: no source image is read.
"""

from __future__ import annotations

import csv
import importlib
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.evaluate.sheets import plot_image_sheet

LABEL_ISSUE_COLUMNS = (
    "split",
    "path",
    "given_label",
    "suggested_label",
    "score",
    "suggested_score",
    "kind",
)
LABEL_ERROR = "likely label error"
CONFUSION = "confusion"
SHEET_ROWS_SHOWN = 16
REVIEWED_SPLITS = ("val", "test")
CLEANLAB_MODULES = ("cleanlab.filter", "cleanlab.rank")


@dataclass(frozen=True)
class HeldOut:
    """One held-out split's records as the model scored them, in reading order."""

    split: str
    sources: list[str]
    labels: np.ndarray
    probs: np.ndarray


def import_cleanlab_meanwhile() -> threading.Thread:
    """Start importing cleanlab (scikit-learn with it, slow to import) in
    a thread, for a caller that predicts before it ranks: TensorFlow's kernels release the
    GIL, so the import runs on another core instead of after the predictions. The import in
    :func:`rank_label_issues` then finds the modules loaded, or waits for this one (Python's
    per-module import locks); a failing import is left to raise there."""

    def load() -> None:
        for name in CLEANLAB_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                return

    thread = threading.Thread(target=load, name="import-cleanlab", daemon=True)
    thread.start()
    return thread


def rank_label_issues(labels: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(flagged, scores)``: the indices cleanlab flags as label issues, most suspect first,
    and every record's label-quality score (0..1, low = the label looks wrong)."""
    if len(labels) == 0 or probs.shape[1] < 2:
        return np.zeros(0, np.int64), np.zeros(len(labels))
    from cleanlab.filter import find_label_issues
    from cleanlab.rank import get_label_quality_scores

    scores = get_label_quality_scores(labels, probs, method="self_confidence")
    with warnings.catch_warnings():
        # A class with few held-out records is expected on small data; the rows say enough.
        warnings.filterwarnings("ignore", message=".*too few examples.*")
        flagged = find_label_issues(
            labels, probs, return_indices_ranked_by="self_confidence", n_jobs=1
        )
    return np.asarray(flagged, dtype=np.int64), np.asarray(scores, dtype=float)


def class_figures(
    labels: np.ndarray, probs: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each class's held-out recall and precision of the model's top class against the
    given labels (0 for a class with no record given or predicted)."""
    predicted = probs.argmax(axis=1)
    support = np.bincount(labels, minlength=num_classes)
    called = np.bincount(predicted, minlength=num_classes)
    right = np.bincount(labels[predicted == labels], minlength=num_classes)
    recall = np.divide(right, support, out=np.zeros(num_classes), where=support > 0)
    precision = np.divide(right, called, out=np.zeros(num_classes), where=called > 0)
    return recall, precision


def judged_classes(labels: np.ndarray, probs: np.ndarray, minimum: float) -> np.ndarray:
    """Per class, whether the model is good enough on it to judge a label: held-out recall
    and precision both at least ``minimum`` (``evaluate.min_class_review_accuracy``)."""
    recall, precision = class_figures(labels, probs, probs.shape[1])
    return (recall >= minimum) & (precision >= minimum)


def review_labels(
    held_out: Sequence[HeldOut], classes: Sequence[str], min_class_review_accuracy: float
) -> list[dict[str, Any]]:
    """The flagged records of all held-out splits, ranked together (most suspect first),
    each a likely label error when the model suggests another class and is good enough on
    both that class and the given one (:func:`judged_classes` at
    ``min_class_review_accuracy``), else a confusion.

    Ranked together so the noise estimate sees every held-out record; each row names its
    split. Ties keep reading order (val before test), so the file is deterministic.
    """
    if not held_out:
        return []
    labels = np.concatenate([part.labels for part in held_out])
    probs = np.concatenate([part.probs for part in held_out])
    where = [(part.split, source) for part in held_out for source in part.sources]
    flagged, scores = rank_label_issues(labels, probs)
    judged = judged_classes(labels, probs, min_class_review_accuracy)
    order = sorted(flagged.tolist(), key=lambda i: (scores[i], i))

    def kind(i: int) -> str:
        given, suggested = int(labels[i]), int(probs[i].argmax())
        return LABEL_ERROR if given != suggested and judged[[given, suggested]].all() else CONFUSION

    return [
        {
            "split": where[i][0],
            "path": where[i][1],
            "given_label": classes[int(labels[i])],
            "suggested_label": classes[int(probs[i].argmax())],
            "score": round(float(scores[i]), 6),
            "suggested_score": round(float(probs[i].max()), 6),
            "kind": kind(i),
        }
        for i in order
    ]


def write_label_issues(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=LABEL_ISSUE_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def review_summary(
    rows: Sequence[dict[str, Any]],
    held_out: Sequence[HeldOut],
    min_class_review_accuracy: float,
) -> dict[str, Any]:
    """Counts for the card and the evaluation record: ``flagged`` the likely label errors,
    ``confusions`` the rest cleanlab flagged."""

    def count(kind: str, split: str) -> int:
        return sum(1 for row in rows if row["split"] == split and row["kind"] == kind)

    return {
        "reviewed": {part.split: len(part.labels) for part in held_out},
        "flagged": {part.split: count(LABEL_ERROR, part.split) for part in held_out},
        "confusions": {part.split: count(CONFUSION, part.split) for part in held_out},
        "min_class_review_accuracy": min_class_review_accuracy,
        "top": [dict(row) for row in rows if row["kind"] == LABEL_ERROR][:5],
    }


def plot_label_sheet(
    rows: Sequence[dict[str, Any]], images: dict[tuple[str, str], np.ndarray], path: Path
) -> None:
    """A grid of the most suspect records' shard pixels, titled given -> suggested."""
    tiles = [
        (
            images[(row["split"], row["path"])],
            f"{row['kind']}: {row['given_label']} -> {row['suggested_label']} "
            f"({row['suggested_score']:.2f})\n{row['split']}: {Path(row['path']).name}",
        )
        for row in rows[:SHEET_ROWS_SHOWN]
        if (row["split"], row["path"]) in images
    ]
    plot_image_sheet(tiles, "no likely label errors or confusions found", path)
