"""The model registry side of evaluation: the pyfunc a version is made from, the version,
and what a killed evaluation left there.

An evaluation logs its model onto the training run as an image-bytes pyfunc while it measures
(:func:`log_due_pyfunc`), then registers a version of it (:func:`register_model`), once per
training run however often the run is evaluated. A pyfunc never registered (its evaluation
was killed in between) is deleted by the next evaluation of the same workspace; the champion
is downloaded from here to be re-scored (:func:`download_registered`).
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.contracts.model_versions import (
    MODEL_SHA256_TAG,
    ModelFileAltered,
    check_model_file,
    file_sha256,
)
from tasks.evaluate.promotion import NotComparable

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from tasks.predict import ServingSpec

# On a pyfunc logged ahead of registering it: the workspace whose evaluation logged it.
WORKSPACE_TAG = "shardflow.workspace"


def register_model(
    client: MlflowClient,
    run_id: str,
    model_file: Path,
    model_name: str,
    spec: ServingSpec,
    logged_uri: str | None = None,
) -> str:
    """Log the model to the run as an image-bytes pyfunc and register a version of it; with
    ``logged_uri``, register that pyfunc, logged already (:func:`log_due_pyfunc`). The
    version records ``model_file``'s sha256, which every loader checks
    (:mod:`tasks.contracts.model_versions`).

    Idempotent per run: a retried or repeated evaluation of the same training run reuses
    the version already registered from it instead of adding a duplicate (and deletes the
    pyfunc at ``logged_uri``, which a concurrent evaluation's version made redundant).
    """
    existing = registered_version(client, model_name, run_id)
    if existing is not None:
        # never the model the version was made from
        if logged_uri and logged_uri != client.get_model_version(model_name, existing).source:
            discard_logged(client, logged_uri)
        return existing
    import mlflow

    from tasks.predict import log_pyfunc
    from tasks.runtime.tracking import using_store

    digest = file_sha256(model_file)  # before logging: the bytes the version is made of
    model_uri = logged_uri or log_pyfunc(client, run_id, model_file, spec)
    with using_store(client.tracking_uri):
        version = mlflow.register_model(model_uri, model_name, tags={MODEL_SHA256_TAG: digest})
    return str(version.version)


def log_due_pyfunc(
    client: MlflowClient,
    run_id: str,
    model_file: Path,
    model_name: str,
    spec: ServingSpec,
    workspace: str,
) -> str | None:
    """The pyfunc logged onto the training run ``run_id`` when no version of ``model_name`` is
    registered from it yet (its URI; else None): what :func:`register_model` would log, logged
    while the measuring runs. Never reused from an earlier attempt: the pyfunc carries the
    ``tasks`` code of the evaluation that logs it.

    ``workspace`` (:func:`workspace_id`, the evaluation holding its workspace lock) is tagged
    on the pyfunc, and the pyfuncs an earlier evaluation of this workspace logged onto the run
    and never registered (it was killed in between) are deleted first: no evaluation of this
    workspace can still be using them, and another workspace's are left alone."""
    versions = client.search_model_versions(f"run_id = '{run_id}'")  # of any model
    if any(v.name == model_name for v in versions):
        return None
    from tasks.predict import log_pyfunc

    for model_id in unregistered_pyfuncs(client, run_id, workspace, version_sources(versions)):
        discard_logged(client, f"models:/{model_id}")
    return log_pyfunc(client, run_id, model_file, spec, tags={WORKSPACE_TAG: workspace})


def workspace_id(root: Path) -> str:
    """The workspace lock's scope, this host's folder ``root``, as a digest (neither the host
    nor the path is written down)."""
    where = f"{socket.gethostname()}\0{Path(root).resolve()}"
    return hashlib.sha256(where.encode()).hexdigest()[:32]


def unregistered_pyfuncs(
    client: MlflowClient, run_id: str, workspace: str, registered: set[str]
) -> list[str]:
    """Ids of the models ``workspace`` logged onto the run ``run_id`` that no version, of any
    registered model, was made from (``registered``: :func:`registered_sources`)."""
    experiment = client.get_run(run_id).info.experiment_id
    logged = client.search_logged_models(
        [experiment],
        filter_string=f"source_run_id = '{run_id}' AND tags.`{WORKSPACE_TAG}` = '{workspace}'",
    )
    return [m.model_id for m in logged if f"models:/{m.model_id}" not in registered]


def registered_sources(client: MlflowClient, run_id: str) -> set[str]:
    """The ``models:/<id>`` URIs the versions registered from the run ``run_id`` were made from."""
    return version_sources(client.search_model_versions(f"run_id = '{run_id}'"))


def version_sources(versions: Iterable[ModelVersion]) -> set[str]:
    """The ``models:/<id>`` URIs (and sources) ``versions`` were made from."""
    versions = list(versions)
    return {str(v.source) for v in versions} | {
        f"models:/{v.model_id}" for v in versions if v.model_id
    }


def discard_logged(client: MlflowClient, model_uri: str) -> None:
    """Delete the logged model behind ``models:/<id>`` (an evaluation that failed before
    registering it leaves none behind); quietly, the error that failed it being the one to
    see."""
    if model_uri.startswith("models:/"):
        with contextlib.suppress(Exception):
            client.delete_logged_model(model_uri.removeprefix("models:/"))


def registered_version(client: MlflowClient, model_name: str, run_id: str) -> str | None:
    """The latest version of ``model_name`` registered from the training run ``run_id``."""
    existing = client.search_model_versions(f"name = '{model_name}' and run_id = '{run_id}'")
    return str(max(int(v.version) for v in existing)) if existing else None


def download_registered(
    client: MlflowClient, model_name: str, version: str, into: Path
) -> tuple[Path, dict[str, Any]]:
    """A registered version's Keras file and serving spec (from its ``MLmodel``); a file
    that is not the one registered (its recorded sha256) cannot be compared."""
    import mlflow
    import yaml
    from mlflow.exceptions import MlflowException

    from tasks.predict import KERAS_ARTIFACT
    from tasks.runtime.tracking import redact, using_store

    where = client.get_model_version_download_uri(model_name, version).rstrip("/")
    try:
        with using_store(client.tracking_uri):
            conf = yaml.safe_load(
                Path(
                    mlflow.artifacts.download_artifacts(f"{where}/MLmodel", dst_path=str(into))
                ).read_text()
            )
            spec = conf["metadata"]["preprocessing"]
            keras_path = conf["flavors"]["python_function"]["artifacts"][KERAS_ARTIFACT]["path"]
            local = mlflow.artifacts.download_artifacts(f"{where}/{keras_path}", dst_path=str(into))
    except (MlflowException, OSError, KeyError, TypeError) as exc:
        # Recorded in tags and the card: no URI's credentials.
        raise NotComparable(
            redact(f"its model could not be loaded from {where} ({type(exc).__name__}: {exc})")
        ) from None
    try:
        check_model_file(
            local, client.get_model_version(model_name, version).tags, model_name, version
        )
    except ModelFileAltered as altered:
        raise NotComparable(f"{altered} ({altered.fix})") from None
    return Path(local), dict(spec)


def registered_spec(client: MlflowClient, model_name: str, version: str) -> dict[str, Any] | None:
    """A registered version's serving spec (its ``MLmodel`` metadata), without its Keras
    file; None when it cannot be read."""
    import tempfile

    import mlflow
    import yaml
    from mlflow.exceptions import MlflowException

    from tasks.runtime.tracking import using_store

    where = client.get_model_version_download_uri(model_name, version).rstrip("/")
    try:
        with tempfile.TemporaryDirectory() as into, using_store(client.tracking_uri):
            local = mlflow.artifacts.download_artifacts(f"{where}/MLmodel", dst_path=into)
            return dict(yaml.safe_load(Path(local).read_text())["metadata"]["preprocessing"])
    except (MlflowException, OSError, KeyError, TypeError):
        return None


def logged_model_id(client: MlflowClient, run_id: str, model_name: str, version: str) -> str:
    """The MLflow 3 logged model behind a registered version.

    A version registered from the model's URI names it; otherwise it is the model the run
    logged (evaluation logs one per training run, see :func:`register_model`).
    """
    model_id = client.get_model_version(model_name, version).model_id
    if model_id:
        return str(model_id)
    experiment = client.get_run(run_id).info.experiment_id
    models = client.search_logged_models(
        [experiment], filter_string=f"source_run_id = '{run_id}'", max_results=1
    )
    if not models:
        raise LookupError(f"MLflow run {run_id} has no logged model for {model_name} v{version}")
    return str(models[0].model_id)
