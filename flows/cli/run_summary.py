"""What `make run` (``shardflow run``) says when it ends: a short summary read from the outputs.

Stages run and skipped (from `dvc repro`'s own lines), records per split, test accuracy and
the champion decision (from ``reports/`` and ``metrics/``), and where to look next. A file
that is missing (a stage that never ran) shows as ``-``, never as an error. The accuracy and
the decision are shown only while they belong to the current shards and model
(:func:`evaluated_here`): after a new split a figure of the last evaluation is not this
run's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tasks.evaluate.store_check import read_report

STAGES = ("ingest", "shard", "validate", "train", "evaluate")
# runs on every `dvc repro` (always_changed: it lists the source folder), so it says nothing
LISTING_STAGE = "source"
RAN = re.compile(r"Running stage '([\w-]+)'")
SKIPPED = re.compile(r"Stage '([\w-]+)' didn't change, skipping")
# Where to look next; each command here must exist
# (tests/integration/test_commands_slow.py runs them).
# No addresses: `shardflow ui` picks a free port and prints it, and each clone's Prefect
# server has its own port (the CLI adds the line naming it).
NEXT_STEPS = (
    "compare runs: `shardflow ui` (the MLflow UI, at the address it prints); flow runs: the "
    "Prefect UI (`python -m flows.servers.prefect_server status` names it)",
    "stop this clone's servers (Prefect, deployments, serve-model, ui): `shardflow stop`",
)


def stage_outcomes(dvc_lines: Iterable[str]) -> tuple[list[str], list[str]]:
    """The stages `dvc repro` ran and those it skipped as unchanged, in pipeline order."""
    ran: set[str] = set()
    skipped: set[str] = set()
    for line in dvc_lines:
        ran.update(RAN.findall(line))
        skipped.update(SKIPPED.findall(line))
    ran.discard(LISTING_STAGE)
    skipped.discard(LISTING_STAGE)
    ordered = [s for s in STAGES if s in ran | skipped] + sorted((ran | skipped) - set(STAGES))
    return [s for s in ordered if s in ran], [s for s in ordered if s in skipped - ran]


def summary_lines(root: Path, dvc_lines: Iterable[str]) -> list[str]:
    """The summary, one line a fact, read from the outputs under ``root``."""
    ran, skipped = stage_outcomes(dvc_lines)
    ingest = read_report(root / "reports" / "ingest.json")
    validation = read_report(root / "reports" / "validation.json")
    evaluation = read_report(root / "metrics" / "eval.json")
    evaluated = read_report(root / "reports" / "eval_summary.json")
    promotion = evaluated.get("promotion") or {}
    splits = validation.get("num_records") or ingest.get("split_counts") or {}
    records = ", ".join(f"{name} {count}" for name, count in splits.items()) or "-"
    passed = validation.get("passed")
    verdict = "-" if passed is None else "passed" if passed else "FAILED"
    return [
        f"stages run: {', '.join(ran) or 'none'}; "
        f"skipped as unchanged: {', '.join(skipped) or 'none'}",
        f"images: {ingest.get('files_found', '-')} found, "
        f"{ingest.get('quarantined_count', '-')} quarantined (reports/ingest.json)",
        *flagged_lines(ingest),
        f"records per split: {records}; validation {verdict} (reports/validation.md)",
        *baseline_lines(root, ran, passed),
        *evaluation_lines(root, evaluation, evaluated, promotion),
        "outputs: data/shards/, models/model.keras, reports/, metrics/, plots/",
        *NEXT_STEPS,
    ]


def evaluated_here(root: Path, evaluated: dict[str, Any]) -> bool:
    """Whether the last evaluation (``reports/eval_summary.json``) measured the current model
    (the training run ``models/run.json`` names) on the current shards (``data/shards``)."""
    shards = read_report(root / "data" / "shards" / "manifest.json").get("fingerprint")
    model = read_report(root / "models" / "run.json")
    return (
        shards is not None
        and evaluated.get("test_fingerprint") == shards
        and model.get("fingerprint") == shards
        and evaluated.get("run_id") is not None
        and evaluated.get("run_id") == model.get("run_id")
    )


def evaluation_lines(
    root: Path, evaluation: dict[str, Any], evaluated: dict[str, Any], promotion: dict[str, Any]
) -> list[str]:
    """The test accuracy and the champion decision, when they belong to the current shards
    and model; else that the model has not been evaluated on these shards yet."""
    accuracy = evaluation.get("accuracy")
    if accuracy is not None and not evaluated_here(root, evaluated):
        return [
            "test accuracy: the model has not been evaluated on these shards yet "
            "(metrics/eval.json holds an earlier evaluation, of other shards or another "
            "model); `shardflow run` trains and evaluates on them",
            "champion: - (no decision on these shards yet)",
        ]
    tested = evaluation.get("num_test_records", "-")
    return [
        f"test accuracy: {_figure(accuracy)} on {tested} records (metrics/eval.json)",
        f"champion: {_decision(promotion)} (reports/eval_summary.json)",
    ]


def flagged_lines(ingest: dict[str, Any]) -> list[str]:
    """One line a near-duplicate group ingest flagged (spanning classes or over 1% of the
    images), with its sheet: the user's to look at before trusting the split."""
    return [
        f"near-duplicate group of {len(group['paths'])} images {group['why']} (one split): "
        f"see {group['sheet'] or 'reports/ingest.json near_duplicates.flagged'}"
        for group in (ingest.get("near_duplicates") or {}).get("flagged", [])
    ]


def baseline_lines(root: Path, ran: list[str], passed: object) -> list[str]:
    """A line when this run's validation made its shards the first baseline of a dataset
    (``reports/data_diff.json``: nothing accepted to compare against); none otherwise."""
    diff = read_report(root / "reports" / "data_diff.json")
    if "validate" not in ran or passed is not True or "accepted_fingerprint" not in diff:
        return []
    if diff["accepted_fingerprint"] is not None:
        return []
    return [
        f"data baseline: dataset {diff.get('dataset', '?')!r} had no accepted version; these "
        f"shards ({str(diff.get('fingerprint'))[:12]}) became its baseline (data/accepted.json)"
    ]


def _figure(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-"


def _decision(promotion: dict[str, Any]) -> str:
    if not promotion:
        return "-"
    version = f"v{promotion.get('candidate_version', '?')}"
    if name := promotion.get("model_name"):  # the current dataset's registered model
        version = f"{name} {version}"
    outcome = "promoted" if promotion.get("promoted") else "not promoted"
    return f"{version} {outcome}: {promotion.get('reason', '')}".rstrip(": ")
