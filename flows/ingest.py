"""The ingest stage as a flow: ``python -m flows.ingest`` (what `dvc repro` runs).

Imports only what ingest runs, so the stage's ``dvc.yaml`` deps are exactly its code.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.support.entry import code_version, run_then_exit, stage_main
from flows.support.run_story import (
    Progress,
    naming,
    rename_flow_run,
    run_log,
    run_name,
    run_parameter,
    run_params_path,
    untagged_task_runs,
)
from tasks.contracts import handoff
from tasks.contracts.exclusions import load_excluded
from tasks.ingest import stage as ingest
from tasks.runtime.atomic import write_json
from tasks.runtime.layout import Layout
from tasks.runtime.metrics_files import INGEST_FIGURES, split_figures
from tasks.runtime.params import IngestParams, load_params


@task(name="ingest", version=code_version(ingest), cache_policy=NO_CACHE)
def ingest_task(
    params: IngestParams, layout: Layout, target: handoff.Target | None = None
) -> dict[str, Any]:
    """Ingest; ``target``: what the shard stage makes of an image (its params), for which
    ingest keeps the pixels of the photos it decodes (:mod:`tasks.contracts.handoff`)."""
    progress = Progress("ingest-progress", f"files inspected in {params.source_dir}")
    with run_log():  # ingest's own warnings (workers capped at the cores) in this run's log
        report = ingest.run_ingest(
            params,
            layout.index,
            layout.ingest_report,
            progress=progress,
            handoff=layout.handoff,
            target=target,
            excluded=load_excluded(layout.excluded),
            sheets=layout.sheets / "near-duplicates",
        )
    progress(1, 1)  # an empty folder inspects nothing and is done too
    write_json(layout.ingest_metrics, split_figures(report, INGEST_FIGURES)[0])
    logger = get_run_logger()
    logger.info(key_figures(report))
    for dropped in report["classes_dropped"]:
        logger.warning("class %r dropped: %s", dropped["class"], dropped["reason"])
    if conflict_line := label_conflicts_line(report):
        logger.warning(conflict_line)
    for line in flagged_group_lines(report):
        logger.warning(line)
    create_table_artifact(
        key="ingest-summary",
        table=ingest.summary_rows(report),
        description=(
            f"{report['files_found']} files found: {report['accepted']} accepted, "
            f"{report['quarantined_count']} quarantined, {report['duplicate_count']} duplicates, "
            f"{report['skipped_count']} skipped. "
            + "; ".join(f"{q['path']}: {q['reason']}" for q in report["quarantined"][:20])
        ),
    )
    keys = ("files_found", "accepted", "quarantined_count", "duplicate_count", "skipped_count")
    return {k: report[k] for k in keys}


def label_conflicts_line(report: dict[str, Any]) -> str | None:
    """Near-duplicates filed under two labels, in one line pointing at the report (one
    warning a group filled the terminal); None when there are none."""
    conflicts = report["near_duplicates"]["label_conflicts"]
    if not conflicts:
        return None
    return (
        f"{len(conflicts)} group(s) of near-duplicate images carry different labels "
        "(suspected label errors, each group kept in one split): "
        "reports/ingest.json, near_duplicates.label_conflicts"
    )


def flagged_group_lines(report: dict[str, Any]) -> list[str]:
    """One line a flagged near-duplicate group (spanning classes, or over 1% of the
    images): why, its sheet and what to do; none when no group is flagged."""
    return [
        f"near-duplicate group of {len(group['paths'])} images {group['why']}, kept in one "
        f"split ({group['split']}); {group['inspect']}"
        for group in report["near_duplicates"].get("flagged", [])
    ]


def key_figures(report: dict[str, Any]) -> str:
    """The ingest report in one log line: every file accounted for, and where they went."""
    splits = ", ".join(f"{name} {count}" for name, count in report["split_counts"].items())
    return (
        f"ingest {report['source_dir']}: {report['files_found']} files found: "
        f"{report['accepted']} accepted ({splits}) in {len(report['classes'])} classes, "
        f"{report['quarantined_count']} quarantined, {report['duplicate_count']} duplicates, "
        f"{report['skipped_count']} skipped, {report['excluded_count']} excluded "
        "(data/excluded.json); "
        f"{report['near_duplicates']['images_in_groups']} near-duplicates in "
        f"{report['near_duplicates']['group_count']} groups (largest "
        f"{report['near_duplicates']['largest_group']}), each in one split; "
        f"{report['decoded_count']} decoded, "
        f"{report['reused_count']} verdicts reused ({report['stat_trusted_count']} files "
        "unchanged by stat, not read)"
    )


def source_details() -> list[object]:
    """What names an ingest run before it starts: the folder it reads."""
    root = run_parameter("root", ".")
    params = load_params(run_params_path(root, run_parameter("params_path", "params.yaml")))
    return [params.ingest.source_dir]


@flow(name="ingest", log_prints=True, flow_run_name=naming("ingest", source_details))
def ingest_flow(params_path: str = "params.yaml", root: str = ".") -> dict[str, Any]:
    """Find every input image, check it, assign splits; quarantine the rest."""
    params = load_params(run_params_path(root, params_path))
    with untagged_task_runs():
        result = ingest_task(params.ingest, Layout(root), handoff.Target.of(params.shard))
    accepted = f"{result['accepted']} of {result['files_found']} files accepted"
    rename_flow_run(run_name("ingest", params.ingest.source_dir, accepted))
    return result


def main() -> None:
    stage_main("ingest", ("ingest",), lambda _, params: ingest_flow(params_path=params))


if __name__ == "__main__":
    run_then_exit(main)
