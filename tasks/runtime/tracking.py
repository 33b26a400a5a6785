"""MLflow tracking: where runs go, and what a training run records about its inputs.

Nothing here runs at import time. Entry points (the training flow, tests) call
:func:`experiment_id` to set tracking up, then open runs with :func:`start_train_run`.
Everything goes through an explicit ``MlflowClient`` (no fluent active-run state), so two
runs in one process never step on each other.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from tasks.runtime.layout import shared_root

if TYPE_CHECKING:
    from mlflow import MlflowClient

EXPERIMENT_NAME = "shardflow"
DB_NAME = "mlflow.db"
# The store when $MLFLOW_TRACKING_URI is unset; relative, so it means the repository's.
DEFAULT_URI = f"sqlite:///{DB_NAME}"
SQLITE = "sqlite:///"  # then a path: relative (three slashes) or absolute (four)
ARTIFACTS_NAME = "mlartifacts"
UNTRACKED = "untracked"
MLFLOW_UI_URL = "http://127.0.0.1:5000"  # where `make ui` serves the local store while free
CHAMPION = "champion"  # the registry alias of the model in service
CHALLENGER = "challenger"  # the alias of a DVC experiment's version: never served by default
# MLflow 3.17's UI shows an experiment as its per-browser GenAI / Model training switch says
# (GenAI in a fresh browser), whatever the experiment's kind; this query sets the switch, so
# a link opens on the runs table (or the run) rather than the GenAI overview of traces.
RUNS_TABLE_QUERY = "?workflowType=machine_learning"
# The experiment's kind: MLflow's UI opens a custom-model experiment on its runs table (an
# experiment without the tag opens on the GenAI overview of traces).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def tracking_uri(root: str | Path = ".") -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else :data:`DEFAULT_URI`, as an absolute URI.

    A relative SQLite path (``sqlite:///mlflow.db``, the form MLflow's docs use) names a
    file in the repository, :func:`tasks.runtime.layout.shared_root`: ``root``, except in a queued
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


def runs_table_url(ui_url: str, mlflow_client: MlflowClient, name: str = EXPERIMENT_NAME) -> str:
    """The page of the MLflow UI at ``ui_url`` that lists experiment ``name``'s runs (its
    runs table, ``#/experiments/<id>/runs`` in MLflow 3's routes), not the UI's home, which
    opens on GenAI traces; the bare ``ui_url`` while the store has no such experiment."""
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is None:
        return ui_url
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment.experiment_id}/runs{RUNS_TABLE_QUERY}"


def run_url(mlflow_client: MlflowClient, run_id: str, root: str | Path = ".") -> str:
    """A link to the run: the MLflow UI for an HTTP server, else the store URI and run id.

    Redacted: it goes to Prefect logs and artifacts, which keep it.
    """
    uri = mlflow_client.tracking_uri
    run = mlflow_client.get_run(run_id)
    page = f"#/experiments/{run.info.experiment_id}/runs/{run_id}{RUNS_TABLE_QUERY}"
    if uri.startswith(("http://", "https://")):
        return redact(f"{uri.rstrip('/')}/{page}")
    # A local store: link the page `make ui` serves, and name the store it reads.
    return f"{MLFLOW_UI_URL}/{page} (`make ui` over {recorded_uri(uri, root)})"
