"""Stage records split the way DVC reads them: numbers in the metrics file, the rest beside it.

``dvc metrics show/diff`` and ``dvc exp show`` read numbers only (nested dicts of numbers
are fine) and silently drop lists and strings. A stage record therefore goes to two files:
its numeric part to ``metrics/<stage>.json`` and everything else (run ids, fingerprints,
decisions and their reasons) to a summary under ``reports/``; the two merged give the record
again.

Only the figures people compare across experiments go to a metrics file (``dvc exp show``
puts each in a column of its own): the headline counts, training's final and chosen-model
figures and the test figures. Everything else a record holds (per-class and per-format
counts, throughput details, the cluster's shape) stays in its report.
"""

from __future__ import annotations

from typing import Any


def is_number(value: Any) -> bool:
    """A finite-or-not int or float, but not a bool (DVC would show ``True`` as a metric)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


# The ingest report's figures in metrics/ingest.json; per-class and per-format counts and the
# near-duplicate groups stay in reports/ingest.json.
INGEST_FIGURES = (
    "files_found",
    "accepted",
    "quarantined_count",
    "duplicate_count",
    "skipped_count",
    "split_counts.train",
    "split_counts.val",
    "split_counts.test",
    "near_duplicates.label_conflict_count",
)
# The training summary's figures in metrics/train.json; the rest in reports/train_summary.json.
TRAIN_FIGURES = (
    "epochs_completed",
    "model_epoch",
    "final.accuracy",
    "final.loss",
    "final.val_accuracy",
    "final.val_loss",
    "model.val_accuracy",
    "model.val_loss",
    "images_per_sec",
)


def split_figures(
    record: dict[str, Any], figures: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(compared, rest)``: the numbers at the dotted paths ``figures`` (nested as in
    ``record``), and the record without them; merged deeply, the two give the record."""
    compared: dict[str, Any] = {}
    rest = json_copy(record)
    for path in figures:
        *parents, leaf = path.split(".")
        source: Any = rest
        for key in parents:
            source = source.get(key) if isinstance(source, dict) else None
        if not isinstance(source, dict) or not is_number(source.get(leaf)):
            continue
        target = compared
        for key in parents:
            target = target.setdefault(key, {})
        target[leaf] = source.pop(leaf)
    return compared, prune_emptied(rest, record)


def json_copy(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``record`` whose nested dicts are copies too."""
    return {k: json_copy(v) if isinstance(v, dict) else v for k, v in record.items()}


def prune_emptied(rest: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``rest`` without the dicts :func:`split_figures` emptied (an empty one ``record``
    held stays)."""
    pruned = {k: prune_emptied(v, record[k]) if isinstance(v, dict) else v for k, v in rest.items()}
    return {k: v for k, v in pruned.items() if v != {} or record[k] == {}}
