"""Serve the deployments `pipeline/local`, `data/local`, `training/local` and `predict/local`.

``make serve`` runs this next to a local Prefect server; then, from the repo root,
``prefect deployment run 'pipeline/local' --watch`` runs the pipeline through it.
"""

from __future__ import annotations

from typing import Any

from prefect import serve

from flows.common import configure_environment
from flows.data import data_flow
from flows.pipeline import pipeline
from flows.predict import predict_flow
from flows.server import require_server
from flows.training import training_flow


def deployments() -> list[Any]:
    """The deployments ``make serve`` serves. Each flow types its parameters with
    :mod:`flows.parameters` (paths inside the repository, model names and references), and
    ``tests/unit/test_deployment_parameters.py`` checks every parameter of every one."""
    return [
        pipeline.to_deployment(
            name="local",
            description="Data flow then training flow; skips stages DVC finds up to date.",
            parameters={"params_path": "params.yaml", "root": "."},
        ),
        data_flow.to_deployment(
            name="local",
            description="ingest -> shard -> validate, recorded in dvc.lock.",
            parameters={"dvc_bookkeeping": True},
        ),
        training_flow.to_deployment(
            name="local",
            description="train -> evaluate -> promote, recorded in dvc.lock.",
            parameters={"dvc_bookkeeping": True},
        ),
        predict_flow.to_deployment(
            name="local",
            description="Batch prediction with the champion (or `model`): --param source=DIR.",
        ),
    ]


def main() -> None:
    configure_environment()
    require_server()
    serve(*deployments(), limit=1)  # one run at a time: runs share the working tree and dvc.lock


if __name__ == "__main__":
    main()
