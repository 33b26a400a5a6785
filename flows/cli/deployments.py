"""Serve the deployments `pipeline/local`, `data/local`, `training/local` and `predict/local`.

``make serve`` runs this next to this clone's Prefect server; then, from the repo root,
``prefect deployment run 'pipeline/local' --watch`` runs the pipeline through it.

A deployment's id is its flow and name, the same in every clone: two clones serving against
one server would share ids, and a run of one clone's `pipeline/local` could run in the
other (writing that clone's params.yaml and dvc.lock). So each deployment carries its
clone's identity as a tag (``clone:host:path``), and this refuses to serve while another
clone serves deployments of the same names on the server, naming that clone. Whether it
serves now: on this host, its serving process (``.prefect/serving.json``) still runs; on
another, Prefect marks the deployment READY (polled in the last minute). A stale tag (the
clone stopped serving) is taken over.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from prefect import serve

from flows.data import data_flow
from flows.pipeline import pipeline
from flows.predict import predict_flow
from flows.servers.prefect_server import api_url, clone_id, require_server
from flows.support.environment import configure_environment
from flows.training import training_flow
from tasks.runtime.layout import shared_root

CLONE_TAG = "clone:"
# How often `make serve` asks its server for runs to start. Prefect's default (10 s) keeps a
# `prefect deployment run` waiting half of it on average before anything runs; each ask is one small
# read on this clone's server. PREFECT_RUNNER_POLL_FREQUENCY, where set, still decides.
POLL_S = 2.0


def clone_tag() -> str:
    return f"{CLONE_TAG}{clone_id()}"


def serving_file(clone: Path) -> Path:
    """Where a clone serving its deployments records its serving process while it runs."""
    return clone / ".prefect" / "serving.json"


def serves_now(owner: str, url: str) -> bool | None:
    """Whether the clone ``host:path`` has a process serving on the server at ``url`` now;
    None when the clone is on another host (this one cannot tell)."""
    host, _, path = owner.partition(":")
    if host != socket.gethostname():
        return None
    try:
        record = json.loads(serving_file(Path(path)).read_text())
        args = Path(f"/proc/{int(record['pid'])}/cmdline").read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return record.get("url") == url and b"flows.cli.deployments" in args


def other_owners(names: list[str]) -> dict[str, tuple[str, bool]]:
    """For each of ``names`` the server holds under another clone's tag (or none): that clone,
    and whether it serves it now: on this host, its serving process still runs; on another,
    a process polls it (Prefect's READY: polled within a minute)."""
    from prefect import get_client
    from prefect.client.schemas.objects import DeploymentStatus
    from prefect.exceptions import ObjectNotFound

    others = {}
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                deployment = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            owners = [t.removeprefix(CLONE_TAG) for t in deployment.tags if t.startswith(CLONE_TAG)]
            if owners == [clone_id()]:
                continue
            owner = owners[0] if owners else "unknown (a process that does not tag its clone)"
            alive = serves_now(owner, api_url()) if owners else None
            if alive is None:
                alive = deployment.status == DeploymentStatus.READY
            others[name] = (owner, alive)
    return others


def deployments() -> list[Any]:
    """The deployments ``make serve`` serves, each tagged with this clone. Each flow types its
    parameters with :mod:`flows.support.parameters` (paths inside the repository, model names and
    references), and ``tests/unit/flows/test_deployment_parameters.py`` checks every parameter of
    every one."""
    tags = [clone_tag()]
    return [
        pipeline.to_deployment(
            name="local",
            description="Data flow then training flow; skips stages DVC finds up to date.",
            parameters={"params_path": "params.yaml", "root": "."},
            tags=tags,
        ),
        data_flow.to_deployment(
            name="local",
            description="ingest -> shard -> validate, recorded in dvc.lock.",
            parameters={"dvc_bookkeeping": True},
            tags=tags,
        ),
        training_flow.to_deployment(
            name="local",
            description="train -> evaluate -> promote, recorded in dvc.lock.",
            parameters={"dvc_bookkeeping": True},
            tags=tags,
        ),
        predict_flow.to_deployment(
            name="local",
            description="Batch prediction with the champion (or `model`): --param source=DIR.",
            tags=tags,
        ),
    ]


def poll_seconds() -> float | None:
    """Seconds between the runner's asks for runs: :data:`POLL_S`, unless the user set
    ``PREFECT_RUNNER_POLL_FREQUENCY`` (environment, profile or ``prefect.toml``; None: the
    runner reads it)."""
    from prefect.settings import get_current_settings

    return None if "poll_frequency" in get_current_settings().runner.model_fields_set else POLL_S


def main() -> None:
    configure_environment()
    require_server()
    served = deployments()
    others = other_owners([d.full_name for d in served])
    if taken := [(name, owner) for name, (owner, serving) in others.items() if serving]:
        listed = "; ".join(f"'{name}' by {owner}" for name, owner in taken)
        raise SystemExit(
            f"refusing to serve: the Prefect server at {api_url()} already serves {listed}. "
            "Deployments of one name share one id, so runs would reach either clone. Serve "
            "from one clone at a time on a shared server, or unset PREFECT_API_URL to use "
            "this clone's own server."
        )
    for name, (owner, _) in others.items():
        print(f"{name}: taking over from {owner}, which no longer serves it", flush=True)
    record = serving_file(shared_root())
    # SIGTERM (a service manager's, `shardflow serve` passing one on) ends this process by
    # SystemExit, so the record goes whenever it comes: Python's default would end it at
    # once, and Prefect's runner catches it only once it has started.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"pid": os.getpid(), "url": api_url()}) + "\n")
    try:
        # One run at a time: runs share the working tree and dvc.lock.
        serve(*served, limit=1, query_seconds=poll_seconds())
    finally:
        record.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
