"""The validate stage as a flow; ``python -m flows.launch.validate`` (what `dvc repro` runs)
starts its TensorFlow child, then runs :func:`main`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.support.entry import code_version, run_then_exit, stage_main
from flows.support.run_story import naming, run_parameter, untagged_task_runs
from tasks.contracts import manifest
from tasks.runtime.dataset_identity import dataset_identity
from tasks.runtime.layout import Layout
from tasks.runtime.params import Params, load_params
from tasks.validate import stage as validate


@task(
    name="validate",
    version=code_version(validate),
    cache_policy=NO_CACHE,
)
def validate_task(layout: Layout, params: Params) -> dict[str, Any]:
    dataset = dataset_identity(params.ingest.source_dir, params.ingest.labels_csv, layout.root)
    report = validate.validate_layout(layout, params.validate_, dataset)
    gated = [c for c in report["checks"] if c["name"] == "data_diff"]
    if gated and "diff" in gated[0]["details"]:  # written by this run
        create_markdown_artifact(
            key="data-diff",
            markdown=layout.data_diff.with_suffix(".md").read_text(),
            description="these shards against the last accepted data version",
        )
    create_markdown_artifact(
        key="validation-report",
        markdown=layout.validation_summary.read_text(),
        description=f"shards {(report['fingerprint'] or 'unknown')[:12]}: "
        + ("passed" if report["passed"] else "FAILED"),
    )
    get_run_logger().info(key_figures(report))
    validate.raise_if_failed(report)  # after the report is written, so it can be read
    return {"passed": report["passed"], "fingerprint": report["fingerprint"]}


def key_figures(report: dict[str, Any]) -> str:
    """The validation verdict in one log line: the set, its records, the failed checks."""
    records = ", ".join(f"{split} {n}" for split, n in report["num_records"].items())
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    verdict = f"FAILED ({', '.join(failed)})" if failed else "passed"
    return (
        f"validation of shards {report['fingerprint']} ({records}): "
        f"{len(report['checks'])} checks, {verdict}"
    )


def manifest_details() -> list[object]:
    """What names a validation run: the fingerprint of the shard set it checks."""
    root = Path(run_parameter("root", "."))
    return [manifest.load_manifest(Layout(root).shards_dir).fingerprint[:8]]


@flow(name="validate", log_prints=True, flow_run_name=naming("validate", manifest_details))
def validate_flow(params_path: str = "params.yaml", root: str = ".") -> dict[str, Any]:
    """Re-read every shard and check it against the manifest and the ingest index."""
    params = load_params(Path(root) / params_path)
    with untagged_task_runs():
        return validate_task(Layout(root), params)


def main() -> None:
    """The stage: its cross-check takes the child :mod:`flows.launch.validate` started, else
    starts one."""
    stage_main("validate", ("validate",), lambda _, params: validate_flow(params_path=params))


if __name__ == "__main__":
    run_then_exit(main)
