"""Measuring a model on the shards: test-split metrics and answers, every test prediction,
the label review of val and test, and the per-class reports and plots.

``evaluate_model`` is the pure core of the evaluate stage (model + shards in, metrics and
report files out; no tracking): :mod:`tasks.evaluate.stage` wires it to the layout, MLflow
and promotion, and re-scores a champion with :func:`predict_split`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.contracts.inference import predict_batch
from tasks.contracts.manifest import load_manifest
from tasks.contracts.tf_reader import read_split
from tasks.evaluate.evidence import answers_of
from tasks.evaluate.label_review import (
    REVIEWED_SPLITS,
    SHEET_ROWS_SHOWN,
    HeldOut,
    import_cleanlab_meanwhile,
    plot_label_sheet,
    review_labels,
    review_summary,
    write_label_issues,
)
from tasks.evaluate.metrics import classification_metrics
from tasks.evaluate.seen_records import seen_records_of
from tasks.evaluate.sheets import plot_image_sheet
from tasks.schema import HASH_KEY, IMAGE_KEY, LABEL_KEY, SOURCE_KEY

if TYPE_CHECKING:
    import keras

    from tasks.contracts.manifest import ShardManifest
    from tasks.contracts.shard_store import ShardStore

MAX_MISCLASSIFIED_SHOWN = 16
BATCH_SIZE = 256
LABEL_SHEET = "label_issues.png"  # the label review's thumbnail sheet, in the eval plots


@dataclass(frozen=True)
class Misclassified:
    """A test record the model got wrong, as the misclassified sheet shows it."""

    image: np.ndarray  # the shard's pixels
    label: int
    predicted: int
    source: str


def predict_split(
    model: keras.Model,
    shards_dir: Path,
    split: str = "test",
    sources: list[str] | None = None,
    store: ShardStore | None = None,
    predicted: Callable[[int], object] | None = None,
    hashes: list[str] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[Misclassified]]:
    """Labels, class probabilities, and the misclassified records (image and source).

    ``sources``, when given, receives every record's source path, in prediction order;
    ``hashes`` every record's content hash.
    With a ``store`` the shards are read from object storage (tasks.contracts.shard_store).
    ``predicted(n)`` is told each batch's record count once it is predicted.
    """
    dataset = read_split(
        shards_dir, split, batch_size=BATCH_SIZE, training=False, with_metadata=True, store=store
    )
    labels: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    wrong: list[Misclassified] = []
    for features in dataset:
        images = features[IMAGE_KEY]
        batch_probs = predict_batch(model, images)  # inference: no augmentation
        batch_labels = features[LABEL_KEY].numpy()
        labels.append(batch_labels)
        probs.append(batch_probs)
        if predicted is not None:
            predicted(len(batch_labels))
        if sources is not None:
            sources.extend(s.decode() for s in features[SOURCE_KEY].numpy())
        if hashes is not None:
            hashes.extend(h.decode() for h in features[HASH_KEY].numpy())
        for i in np.flatnonzero(batch_probs.argmax(axis=1) != batch_labels):
            if len(wrong) < MAX_MISCLASSIFIED_SHOWN:
                wrong.append(
                    Misclassified(
                        image=images[i].numpy(),
                        label=int(batch_labels[i]),
                        predicted=int(batch_probs[i].argmax()),
                        source=features[SOURCE_KEY][i].numpy().decode(),
                    )
                )
    num_classes = model.output_shape[-1]
    if not labels:
        return np.zeros(0, np.int32), np.zeros((0, num_classes), np.float32), wrong
    return np.concatenate(labels), np.concatenate(probs), wrong


def counter(
    manifest: ShardManifest, reviewed: bool, progress: Callable[[int, int], object] | None
) -> Callable[[int], object] | None:
    """What :func:`predict_split` tells, as ``progress(done, total)``: the records of the
    test split, and of the other reviewed splits when the labels are ``reviewed``."""
    if progress is None:
        return None
    splits = REVIEWED_SPLITS if reviewed else ("test",)
    total = sum(manifest.splits[s].num_records for s in splits if s in manifest.splits)
    done = 0

    def predicted(records: int) -> None:
        nonlocal done
        done += records
        progress(done, total)

    return predicted


def evaluate_model(
    model_file: str | Path,
    shards_dir: str | Path,
    out_dir: str | Path,
    *,
    top_k: int,
    predictions_file: str | Path | None = None,
    store: ShardStore | None = None,
    label_issues_file: str | Path | None = None,
    min_class_review_accuracy: float | None = None,
    progress: Callable[[int, int], object] | None = None,
    seen_records: bool = False,
) -> dict[str, Any]:
    """Test-split metrics plus the per-class table (JSON, Markdown) and PNGs in out_dir.

    ``predictions_file`` also gets every test record's prediction (the reference the
    served model must reproduce from the source files); ``label_issues_file`` the label
    review of val and test, at ``min_class_review_accuracy``
    (``evaluate.min_class_review_accuracy``; and out_dir its thumbnail sheet;
    ``label_review`` in the result sums it up). With a
    ``store`` the shards are read from object storage instead of
    ``shards_dir``. ``progress(done, total)`` is told the records predicted so far, of the
    test split and, for the label review, the val split. ``test_hashes`` in the result: each
    test record's content hash, in the answers' order; with ``seen_records``, ``seen``: the
    training and validation records' (:func:`tasks.evaluate.seen_records.seen_records_of`).
    """
    import keras

    from tasks.runtime.tf_imports import keras_without_extras

    keras_without_extras()  # Keras's config held at its defaults, whatever keras.json says
    if label_issues_file is not None:
        import_cleanlab_meanwhile()
    shards_dir, out_dir = Path(shards_dir), Path(out_dir)
    manifest = store.manifest() if store else load_manifest(shards_dir)
    model = keras.saving.load_model(model_file)
    predicted = counter(manifest, label_issues_file is not None, progress)
    sources: list[str] = []
    hashes: list[str] = []
    labels, probs, wrong = predict_split(
        model, shards_dir, sources=sources, store=store, predicted=predicted, hashes=hashes
    )
    if predictions_file is not None:
        write_test_predictions(predictions_file, sources, labels, probs, manifest.classes)
    metrics = classification_metrics(labels, probs, manifest.classes, top_k=top_k)
    metrics["test_fingerprint"] = manifest.fingerprint
    # each record's answers: what a paired comparison with the champion needs
    metrics["answers"] = answers_of(labels, probs, metrics["top_k"], len(manifest.classes))
    metrics["test_hashes"] = tuple(hashes)
    if seen_records:
        metrics["seen"] = seen_records_of(shards_dir, manifest, store)
    out_dir.mkdir(parents=True, exist_ok=True)
    if label_issues_file is not None:
        if min_class_review_accuracy is None:
            raise TypeError("a label review needs evaluate.min_class_review_accuracy")
        test = HeldOut("test", sources, labels, probs)
        metrics["label_review"] = label_review(
            model,
            shards_dir,
            manifest.classes,
            test,
            (Path(label_issues_file), min_class_review_accuracy),
            out_dir,
            store,
            predicted,
        )
    write_reports(metrics, wrong, manifest.classes, out_dir)
    return metrics


def write_reports(
    metrics: dict[str, Any], wrong: list[Misclassified], classes: list[str], out_dir: Path
) -> None:
    """The per-class table (JSON, Markdown), the confusion matrix and the misclassified
    test images in ``out_dir``."""
    (out_dir / "per_class.json").write_text(json.dumps(metrics["per_class"], indent=2) + "\n")
    (out_dir / "per_class.md").write_text(per_class_markdown(metrics["per_class"]))
    plot_confusion(
        np.asarray(metrics["confusion_matrix"]), classes, out_dir / "confusion_matrix.png"
    )
    plot_misclassified(wrong, classes, out_dir / "misclassified.png")


TEST_PREDICTION_COLUMNS = ("source", "label", "predicted", "score")


def write_test_predictions(
    path: str | Path,
    sources: Sequence[str],
    labels: np.ndarray,
    probs: np.ndarray,
    classes: Sequence[str],
) -> Path:
    """``source,label,predicted,score`` per test record, as evaluation computed it: the
    reference the served model must reproduce from the source files."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    predicted = probs.argmax(axis=1) if len(probs) else np.zeros(0, np.int64)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TEST_PREDICTION_COLUMNS)
        for source, label, index, row in zip(sources, labels, predicted, probs, strict=True):
            writer.writerow([source, classes[label], classes[index], repr(float(row[index]))])
    return path


def label_review(
    model: keras.Model,
    shards_dir: Path,
    classes: list[str],
    test: HeldOut,
    review: tuple[Path, float],
    out_dir: Path,
    store: ShardStore | None = None,
    predicted: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    """Rank likely label errors and confusions in val and test; write the CSV and the
    thumbnail sheet. ``review``: the CSV's path and ``evaluate.min_class_review_accuracy``;
    ``predicted``: as :func:`predict_split`'s."""
    csv_path, min_class_review_accuracy = review
    held_out = []
    for split in REVIEWED_SPLITS:
        if split == test.split:
            held_out.append(test)
            continue
        sources: list[str] = []
        labels, probs, _ = predict_split(
            model, shards_dir, split, sources=sources, store=store, predicted=predicted
        )
        held_out.append(HeldOut(split, sources, labels, probs))
    rows = review_labels(held_out, classes, min_class_review_accuracy)
    write_label_issues(csv_path, rows)
    shown = {(row["split"], row["path"]) for row in rows[:SHEET_ROWS_SHOWN]}
    plot_label_sheet(rows, shard_images(shards_dir, shown, store), out_dir / LABEL_SHEET)
    return review_summary(rows, held_out, min_class_review_accuracy)


def shard_images(
    shards_dir: Path, wanted: set[tuple[str, str]], store: ShardStore | None = None
) -> dict[tuple[str, str], Any]:
    """The decoded shard pixels of the ``(split, source)`` records in ``wanted``."""
    found: dict[tuple[str, str], Any] = {}
    for split in sorted({split for split, _ in wanted}):
        dataset = read_split(
            shards_dir,
            split,
            batch_size=BATCH_SIZE,
            training=False,
            with_metadata=True,
            store=store,
        )
        for features in dataset:
            for image, source in zip(features[IMAGE_KEY], features[SOURCE_KEY], strict=True):
                key = (split, source.numpy().decode())
                if key in wanted:
                    found[key] = image.numpy()
    return found


def per_class_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| class | precision | recall | f1 | support |", "|---|---:|---:|---:|---:|"]
    lines += [
        f"| {r['class']} | {r['precision']:.3f} | {r['recall']:.3f} | {r['f1']:.3f} "
        f"| {r['support']} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def plot_confusion(matrix: np.ndarray, classes: list[str], path: Path) -> None:
    from matplotlib.figure import Figure

    size = max(4.0, 0.5 * len(classes) + 2)
    figure = Figure(figsize=(size, size))
    axis = figure.subplots()
    image = axis.imshow(matrix, cmap="Blues")
    figure.colorbar(image, ax=axis)
    axis.set_xticks(range(len(classes)), classes, rotation=90)
    axis.set_yticks(range(len(classes)), classes)
    axis.set_xlabel("predicted")
    axis.set_ylabel("true")
    if len(classes) <= 20:  # counts stop being legible beyond that
        for (row, col), count in np.ndenumerate(matrix):
            axis.text(col, row, str(count), ha="center", va="center", fontsize=8)
    figure.savefig(path, dpi=100, bbox_inches="tight")


def plot_misclassified(wrong: list[Misclassified], classes: list[str], path: Path) -> None:
    """A grid of misclassified test images, titled true -> predicted (or a 'none' note)."""
    tiles = [
        (
            item.image,
            f"{classes[item.label]} -> {classes[item.predicted]}\n{Path(item.source).name}",
        )
        for item in wrong
    ]
    plot_image_sheet(tiles, "no misclassified test images", path)
