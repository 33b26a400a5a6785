"""What a training run records about its inputs: its name, tags (source, DVC experiment,
lineage), description, dataset inputs, system metrics, and the code and data versions it ran
on. Where runs go (the store, its client, the experiment) is ``tasks.runtime.tracking``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tasks.contracts.manifest import ShardManifest
from tasks.runtime.dataset_identity import model_name_for
from tasks.runtime.params import Params, flatten
from tasks.runtime.tracking import UNTRACKED, champion_run, experiment_id, redact

if TYPE_CHECKING:
    from mlflow import MlflowClient


CODE_DIRS = ("tasks", "flows")  # the code a run runs: its changes since the commit are recorded
MODIFIED_CODE_CHARS = 2000  # git.modified_code's length: the first files, then a count
# DVC sets these for the stages of `dvc exp run` (queued or not): the run names its experiment.
DVC_EXP_ENV = {"DVC_EXP_NAME": "dvc.experiment", "DVC_EXP_BASELINE_REV": "dvc.baseline_rev"}
NOTE_TAG = "mlflow.note.content"  # the run description the MLflow UI shows
# Seconds between system-metric samples (MLflow's MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
# overrides it): a few samples per epoch of the demo, few enough rows for long runs.
SYSTEM_METRICS_INTERVAL_S = 5.0


def run_name(params: Params, fingerprint: str) -> str:
    """A run name that says what changed: model, epochs, batch size, lr and data version."""
    train = params.train
    return (
        f"{train.model}-e{train.epochs}-bs{train.batch_size}-lr{train.learning_rate:g}"
        f"-{fingerprint[:8]}"
    )


def start_train_run(
    mlflow_client: MlflowClient,
    params: Params,
    manifest: ShardManifest,
    *,
    shards_dir: str | Path,
    root: str | Path = ".",
    device_tags: dict[str, str] | None = None,
    run_tags: dict[str, str] | None = None,
    inputs: dict[str, str] | None = None,
) -> str:
    """Create a training run with params, data lineage and device tags; return its id.

    ``run_tags`` name the orchestrator's run (the flow passes its Prefect flow run's);
    ``inputs``, logged beside the params, what else it starts from (the weights file's
    sha256, :func:`tasks.train.models.weights_lineage`)."""
    from mlflow.entities import Param, RunTag

    logged = {
        **flatten(params.train, "train"),
        **(inputs or {}),
        **flatten(params.shard, "shard"),
        **{f"data.schema.{k}": v for k, v in manifest.schema_.items() if k != "features"},
        "data.classes": ",".join(manifest.classes),
    }
    tags = {
        **lineage_tags(manifest, root=root),
        **(device_tags or {}),
        **dvc_experiment_tags(),
        **source_tags("train"),
        "prefect.flow_run_id": "none",
        "prefect.flow_run_url": "none",
        **(run_tags or {}),
    }
    tags[NOTE_TAG] = run_description(
        {key: str(value) for key, value in logged.items()},
        manifest.fingerprint,
        champion_run(mlflow_client, model_name_for(params, root)),
        experiment=tags.get(DVC_EXP_ENV["DVC_EXP_NAME"]),
    )
    tags = {key: redact(value) for key, value in tags.items()}
    run = mlflow_client.create_run(
        experiment_id(mlflow_client),
        run_name=run_name(params, manifest.fingerprint),
        tags=tags,
    )
    run_id = str(run.info.run_id)
    # The record counts are tags (lineage_tags), not metrics: a constant plotted as a
    # metric fills the compare view's charts with nothing to compare.
    mlflow_client.log_batch(
        run_id,
        params=[Param(key, redact(str(value))) for key, value in logged.items()],
        tags=[RunTag(key, value) for key, value in tags.items()],
    )
    log_dataset(mlflow_client, run_id, manifest, shards_dir=shards_dir)
    log_generations(mlflow_client, run_id, manifest)
    return run_id


def dvc_experiment_tags(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The DVC experiment this run belongs to (``dvc exp run`` sets DVC_EXP_NAME), if any."""
    environ = os.environ if environ is None else environ
    return {tag: environ[var] for var, tag in DVC_EXP_ENV.items() if environ.get(var)}


def source_tags(stage: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the MLflow UI's Source and User columns show: the stage's entry point and what
    ran it (``dvc exp run NAME``, ``dvc repro`` or a direct call), and the user."""
    import getpass

    environ = os.environ if environ is None else environ
    if experiment := dvc_experiment(environ):
        runner = f"dvc exp run {experiment}"
    else:
        runner = "dvc repro" if environ.get("DVC_STAGE") else "python"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry nor USER in a bare container
        user = "unknown"
    return {
        "mlflow.source.name": f"python -m flows.launch.{stage} ({runner})",
        "mlflow.source.type": "LOCAL",
        "mlflow.user": user,
    }


def dvc_experiment(environ: Mapping[str, str] | None = None) -> str | None:
    """The name of the DVC experiment this process runs in, None on the main line.

    DVC sets ``DVC_EXP_NAME`` (with ``DVC_EXP_BASELINE_REV``) in the environment of every
    stage of ``dvc exp run``, in the workspace or queued (dvc/repo/experiments/queue/base.py
    packs them into each run's ``run_env``); ``dvc repro`` sets neither (only ``DVC_ROOT``
    and ``DVC_STAGE``, which every stage gets). A run elsewhere is on the main line."""
    environ = os.environ if environ is None else environ
    return environ.get("DVC_EXP_NAME") or None


def run_description(
    params: Mapping[str, str],
    fingerprint: str,
    champion: Mapping[str, Any] | None,
    *,
    experiment: str | None = None,
) -> str:
    """What the run is for, in Markdown: the params (and data) that differ from the champion's.

    Shown as the run's description in the MLflow UI, so a list of runs reads as a list of
    questions ("does a lower learning rate beat the champion?").
    """
    lines = [f"DVC experiment `{experiment}`." if experiment else ""]
    if champion is None:
        lines.append("First candidate: there is no champion yet to compare with.")
        return "\n".join(line for line in lines if line) + "\n"
    theirs: Mapping[str, str] = champion["params"]
    changes = [
        f"- `{key}`: {theirs.get(key, '(unset)')} -> {params.get(key, '(unset)')}"
        for key in sorted(set(params) | set(theirs))
        if params.get(key) != theirs.get(key)
    ]
    if champion["fingerprint"] != fingerprint:
        changes.append(f"- data: shards {champion['fingerprint'][:12]} -> {fingerprint[:12]}")
    if changes:
        lines += [f"Candidate against the champion ({champion['label']}), changing:", *changes]
    else:
        lines.append(
            f"Rerun of the champion's params and data ({champion['label']}): nothing changed."
        )
    return "\n".join(line for line in lines if line) + "\n"


def log_generations(mlflow_client: MlflowClient, run_id: str, manifest: ShardManifest) -> None:
    """The shard set's generation list (number, base, records added per split) as a run file."""
    generations = [g.model_dump(mode="json") for g in manifest.generations]
    mlflow_client.log_dict(run_id, {"generations": generations}, "data/generations.json")


def lineage_tags(manifest: ShardManifest, *, root: str | Path = ".") -> dict[str, str]:
    """Which data and code a run saw: manifest fingerprint, DVC hash and git commit."""
    return {
        "data.fingerprint": manifest.fingerprint,
        "data.dvc_md5": dvc_shards_md5(root),
        "data.num_classes": str(len(manifest.classes)),
        **{
            f"data.{split}_records": str(info.num_records)
            for split, info in manifest.splits.items()
        },
        "git.commit": git_commit(root),
        "git.modified_code": modified_code(root),
    }


def dataset_ref(manifest: ShardManifest, split: str | None = None) -> tuple[str, str]:
    """``(name, digest)`` of the shard set, or of one split of it, as MLflow records them.

    The whole set is named by its fingerprint; a split by its shard files' sha256, so the
    test metrics name exactly the records they were measured on. MLflow stores digests in a
    36-character column (the full fingerprint is a run tag).
    """
    if split is None:
        return f"shards@{manifest.fingerprint[:12]}", manifest.fingerprint[:36]
    files = [[shard.file, shard.sha256] for shard in manifest.split(split).shards]
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
    return f"shards/{split}@{manifest.fingerprint[:12]}", digest[:36]


def log_dataset(
    mlflow_client: MlflowClient,
    run_id: str,
    manifest: ShardManifest,
    *,
    shards_dir: str | Path,
    split: str | None = None,
    context: str = "train",
) -> tuple[str, str]:
    """Log the shard set (or one split) as a run input by reference: name, source, digest.

    Returns ``(name, digest)``, which metrics measured on it pass to MLflow to name it.
    """
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():
        # MLflow registers the local source class twice and warns that a path is ambiguous.
        warnings.filterwarnings("ignore", message=".*interpreted in multiple ways.*")
        # an s3:// URL when the run read its shards from object storage, else the folder
        where = str(shards_dir)
        source = resolve_dataset_source(where if "://" in where else str(Path(where).resolve()))
    name, digest = dataset_ref(manifest, split)
    dataset = MetaDataset(  # type: ignore[abstract]  # profile is optional at runtime
        source=source, name=name, digest=digest
    )
    tag = InputTag(key="mlflow.data.context", value=context)
    mlflow_client.log_inputs(run_id, [DatasetInput(dataset._to_mlflow_entity(), [tag])])
    return name, digest


@contextmanager
def system_metrics(mlflow_client: MlflowClient, run_id: str, *, resume: bool) -> Iterator[None]:
    """Sample CPU, memory, disk, network and GPU use (where MLflow finds one) into the run.

    MLflow's monitor logs ``system/*`` metrics every ``SYSTEM_METRICS_INTERVAL_S`` from a
    thread; a resumed run continues its steps. On exit the samples of the last, partial
    interval are logged too (the monitor drops them), so even a block shorter than one
    interval leaves a point.
    """
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id,
        sampling_interval=SYSTEM_METRICS_INTERVAL_S,
        resume_logging=resume,
        tracking_uri=mlflow_client.tracking_uri,
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()
        last = monitor.aggregate_metrics()
        if last:
            monitor.publish_metrics(last)
            monitor.mlflow_logger.flush()


def dvc_shards_md5(root: str | Path = ".", out_path: str = "data/shards") -> str:
    """The DVC hash of the shard directory from ``dvc.lock``, or "untracked"."""
    lock = Path(root) / "dvc.lock"
    if not lock.exists():
        return UNTRACKED
    data: dict[str, Any] = yaml.safe_load(lock.read_text()) or {}
    outs = data.get("stages", {}).get("shard", {}).get("outs", [])
    for out in outs:
        if str(out.get("path", "")).rstrip("/") == out_path:
            return str(out.get("md5", UNTRACKED))
    return UNTRACKED


def git_commit(root: str | Path = ".") -> str:
    """``git rev-parse HEAD`` in ``root``, or "unknown" outside a git checkout."""
    return (_git(root, "rev-parse", "HEAD") or b"").decode().strip() or "unknown"


def modified_code(root: str | Path = ".") -> str:
    """The files under ``tasks/`` and ``flows/`` that differ from ``git rev-parse HEAD``
    (changed, added, deleted or untracked), comma-separated; "none" when the run's code is the
    commit's, "unknown" outside a git checkout. ``git.commit`` alone named a commit whose code
    the run did not run."""
    out = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--", *CODE_DIRS)
    if out is None:
        return "unknown"
    paths = []
    entries = iter(out.split(b"\0"))
    for entry in entries:  # "XY path"
        if entry:
            paths.append(os.fsdecode(entry[3:]))
            if entry[:1] in (b"R", b"C"):
                next(entries, None)  # a rename's or copy's source, an entry of its own
    return listed(sorted(paths), MODIFIED_CODE_CHARS) or "none"


def listed(names: list[str], limit: int) -> str:
    """``names`` comma-separated in at most ``limit`` characters: those that fit, then how
    many more (an MLflow tag holds 8,000 characters; setting a longer one fails the run)."""
    text = ",".join(names)
    if len(text) <= limit:
        return text
    shown: list[str] = []
    length = 0  # of ",".join(shown), kept as names are added rather than joined for each
    for name in names:
        more = f",... {len(names) - len(shown) - 1} more"
        with_name = length + bool(shown) + len(name)  # the comma before it, if any
        if with_name + len(more) > limit:
            break
        shown.append(name)
        length = with_name
    return ",".join(shown) + f",... {len(names) - len(shown)} more"


def _git(root: str | Path, *args: str) -> bytes | None:
    """``git *args`` run in ``root``: its output, or None where git or a checkout is missing."""
    try:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def timestamp_ms() -> int:
    import time

    return int(time.time() * 1000)
