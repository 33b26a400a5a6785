"""MLflow tracking: where runs go, and what a training run records about its inputs.

Nothing here runs at import time. Entry points (the training flow, tests) call
:func:`experiment_id` to set tracking up, then open runs with :func:`start_train_run`.
Everything goes through an explicit ``MlflowClient`` (no fluent active-run state), so two
runs in one process never step on each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml

from tasks.dataset_identity import model_name_for
from tasks.layout import shared_root
from tasks.manifest import ShardManifest
from tasks.params import Params, flatten

if TYPE_CHECKING:
    from mlflow import MlflowClient

EXPERIMENT_NAME = "shardflow"
DB_NAME = "mlflow.db"
# The store when $MLFLOW_TRACKING_URI is unset; relative, so it means the repository's.
DEFAULT_URI = f"sqlite:///{DB_NAME}"
SQLITE = "sqlite:///"  # then a path: relative (three slashes) or absolute (four)
ARTIFACTS_NAME = "mlartifacts"
UNTRACKED = "untracked"
CODE_DIRS = ("tasks", "flows")  # the code a run runs: its changes since the commit are recorded
MODIFIED_CODE_CHARS = 2000  # git.modified_code's length: the first files, then a count
MLFLOW_UI_URL = "http://127.0.0.1:5000"  # where `make ui` serves the local store while free
CHAMPION = "champion"  # the registry alias of the model in service
CHALLENGER = "challenger"  # the alias of a DVC experiment's version: never served by default
# DVC sets these for the stages of `dvc exp run` (queued or not): the run names its experiment.
DVC_EXP_ENV = {"DVC_EXP_NAME": "dvc.experiment", "DVC_EXP_BASELINE_REV": "dvc.baseline_rev"}
NOTE_TAG = "mlflow.note.content"  # the run description the MLflow UI shows
# The experiment's kind: MLflow's UI opens a custom-model experiment on its runs table (an
# experiment without the tag opens on the GenAI overview of traces).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
# Seconds between system-metric samples (MLflow's MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
# overrides it): a few samples per epoch of the demo, few enough rows for long runs.
SYSTEM_METRICS_INTERVAL_S = 5.0


def tracking_uri(root: str | Path = ".") -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else :data:`DEFAULT_URI`, as an absolute URI.

    A relative SQLite path (``sqlite:///mlflow.db``, the form MLflow's docs use) names a
    file in the repository, :func:`tasks.layout.shared_root`: ``root``, except in a queued
    DVC experiment, whose stages run in a temporary copy but must log to the real store.
    Left relative, MLflow would take it from whatever directory the process runs in, and
    could not place the artifacts beside it. A server's ``user:password@`` moves to the
    environment (:func:`credentials_to_environment`).
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if uri.startswith(SQLITE) and not Path(uri.removeprefix(SQLITE)).is_absolute():
        return f"{SQLITE}{shared_root(root) / uri.removeprefix(SQLITE)}"
    return credentials_to_environment(uri)


def credentials_to_environment(uri: str) -> str:
    """``uri`` without its ``user:password@``, which go to ``MLFLOW_TRACKING_USERNAME`` and
    ``MLFLOW_TRACKING_PASSWORD`` (unless those are set), where MLflow reads them.

    MLflow puts the URI it is given into its own messages (``API request to <uri>/... failed``,
    "View run at <uri>"), which end up in logs; a URI without credentials cannot leak them.
    This process's children inherit the variables. Only for HTTP(S) servers with both parts:
    a database URI needs its password in the URI, and a lone token has no MLflow variable
    of the same meaning; both stay, and :func:`redact` keeps them out of what is recorded.
    """
    parts = urlsplit(uri)
    userinfo, at, host = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    if parts.scheme not in ("http", "https") or not (at and colon and user and password):
        return uri
    os.environ.setdefault("MLFLOW_TRACKING_USERNAME", unquote(user))
    os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", unquote(password))
    return urlunsplit(parts._replace(netloc=host))


# The userinfo of a URI (``scheme://user:secret@host``): up to the last ``@`` before the path.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
# Query values that are secrets by name (``?token=``, ``&sig=`` of a signed URL, ...).
_SECRET_QUERY = re.compile(
    r"(?P<key>[?&][^=&#\s]*(?:token|password|passwd|secret|key|sig|signature|credential)"
    r"[^=&#\s]*=)[^&#\s]*",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with every URI's userinfo removed and secret query values masked.

    Everything the project records or prints that can hold a URI (``models/run.json``, run
    links in logs and Prefect artifacts, MLflow tags and params) goes through here. Users
    pass credentials as ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``
    (or ``MLFLOW_TRACKING_TOKEN``); one in the URI is used, and never written down.
    """
    return _SECRET_QUERY.sub(r"\g<key>***", _USERINFO.sub(r"\g<scheme>", text))


def recorded_uri(uri: str, root: str | Path = ".") -> str:
    """``uri`` as a git-tracked file may hold it: redacted, and a SQLite store in the
    repository as a path relative to it (``sqlite:///mlflow.db``), never the host's path.

    A store outside the repository is named by its file name only: where it lives is this
    machine's business, not the commit's.
    """
    if not uri.startswith(SQLITE):
        return redact(uri)
    path = Path(uri.removeprefix(SQLITE))
    repo = shared_root(root)
    resolved = path if path.is_absolute() else repo / path
    if resolved.resolve().is_relative_to(repo):
        return f"{SQLITE}{resolved.resolve().relative_to(repo).as_posix()}"
    return f"{SQLITE}<outside the repository>/{path.name}"


def client(root: str | Path = ".") -> MlflowClient:
    """A client for the tracking store and the model registry (the same store)."""
    from mlflow import MlflowClient

    uri = tracking_uri(root)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@contextmanager
def using_store(uri: str) -> Iterator[None]:
    """MLflow's fluent API (``log_model``, ``register_model``, ``pyfunc.load_model``) on the
    store ``uri`` for this block only, as tracking and registry store.

    ``mlflow.set_tracking_uri`` and ``set_registry_uri`` are process-wide, and they also
    export ``MLFLOW_TRACKING_URI`` and ``MLFLOW_REGISTRY_URI`` to every child the process
    starts later. Left set, a registration for one project made a later
    ``models:/name@champion`` in a child resolve in that project's registry instead of the
    child's own store: the wrong model, served without an error. The block's end puts
    both URIs and both variables back as they were.
    """
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    names = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    saved_env = {name: os.environ.get(name) for name in names}
    saved_tracking = tracking_utils._tracking_uri
    saved_registry = registry_utils._registry_uri
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        # None (unset) is accepted at run time; it also resets MLflow's tracer to it.
        mlflow.set_tracking_uri(saved_tracking)  # type: ignore[arg-type]
        registry_utils._registry_uri = saved_registry
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def experiment_id(mlflow_client: MlflowClient, name: str = EXPERIMENT_NAME) -> str:
    """Id of experiment ``name``, created on first use (artifacts beside a SQLite store)."""
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        for key, value in EXPERIMENT_KIND.items():
            if experiment.tags.get(key) != value:  # an experiment made before the tag was set
                mlflow_client.set_experiment_tag(experiment.experiment_id, key, value)
        return str(experiment.experiment_id)
    uri = mlflow_client.tracking_uri
    location = None
    if uri.startswith(SQLITE):
        # Keep artifacts next to the database, not in whatever directory the process runs in
        # (a relative path would be that directory's: make it absolute, as tracking_uri does).
        database = Path(uri.removeprefix(SQLITE)).resolve()
        location = (database.parent / ARTIFACTS_NAME).as_uri()
    return str(
        mlflow_client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    )


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
    sha256, :func:`tasks.models.weights_lineage`)."""
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
        "mlflow.source.name": f"python -m flows.{stage} ({runner})",
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


def champion_version(mlflow_client: MlflowClient, model_name: str) -> str | None:
    """The version holding the ``champion`` alias, or None when there is none yet."""
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow_client.get_model_version_by_alias(model_name, CHAMPION).version)
    except MlflowException:
        return None


def champion_run(mlflow_client: MlflowClient, model_name: str) -> dict[str, Any] | None:
    """The champion's training run: ``{"label", "params", "fingerprint"}``, or None."""
    from mlflow.exceptions import MlflowException

    version = champion_version(mlflow_client, model_name)
    if version is None:
        return None
    run_id = mlflow_client.get_model_version(model_name, version).run_id
    try:
        run = mlflow_client.get_run(str(run_id))
    except MlflowException:  # the run was deleted since: nothing to compare with
        return None
    return {
        "label": f"{model_name} v{version}, run {run.info.run_name} ({run_id})",
        "params": dict(run.data.params),
        "fingerprint": run.data.tags.get("data.fingerprint", "unknown"),
    }


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


def run_url(mlflow_client: MlflowClient, run_id: str, root: str | Path = ".") -> str:
    """A link to the run: the MLflow UI for an HTTP server, else the store URI and run id.

    Redacted: it goes to Prefect logs and artifacts, which keep it.
    """
    uri = mlflow_client.tracking_uri
    run = mlflow_client.get_run(run_id)
    page = f"#/experiments/{run.info.experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return redact(f"{uri.rstrip('/')}/{page}")
    # A local store: link the page `make ui` serves, and name the store it reads.
    return f"{MLFLOW_UI_URL}/{page} (`make ui` over {recorded_uri(uri, root)})"
