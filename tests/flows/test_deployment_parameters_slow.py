"""A predict deployment run on a Prefect server refuses paths outside the repository before
anything runs (the parameter checks: tests/unit/flows/test_deployment_parameters.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.unit.flows import test_deployment_parameters as unit

pytestmark = pytest.mark.slow
deployed_repo = unit.deployed_repo  # the unit tests' fixture, shared


@pytest.mark.parametrize(
    ("parameters", "refused"),
    [
        ({"output": "OUTSIDE/out.csv"}, "output="),
        ({"output": "../outside/out.csv"}, "output="),
        ({"output": "escape/out.csv"}, "output="),
        ({"output": "params.yaml"}, "a deployment run writes a .csv file"),
        ({"output": ".git/out.csv"}, "a deployment run writes a .csv file"),
        ({"source": "OUTSIDE"}, "source="),
        ({"source": "escape"}, "source="),
        ({"source": "data/photos", "root": "escape"}, "root="),
        ({"params_path": "escape/params.yaml"}, "params_path="),
        ({"source": "data/linked"}, "outside the repository"),
    ],
)
def test_predict_deployment_run_refuses_paths_outside_before_anything_runs(
    prefect_harness: None, deployed_repo: Path, parameters: dict[str, str], refused: str
) -> None:
    from flows.predict import predict_flow

    outside = deployed_repo.parent / "outside"
    (deployed_repo / "data" / "photos").mkdir()
    (deployed_repo / "data" / "photos" / "a.png").write_bytes(b"x")
    (deployed_repo / "data" / "linked").mkdir()
    (deployed_repo / "data" / "linked" / "a.png").symlink_to(outside / "secret.txt")

    def files() -> tuple[list[str], list[Path]]:
        """What is outside, and the project's files (but Prefect's own home, .prefect)."""
        inside = [p for p in deployed_repo.rglob("*") if ".prefect" not in p.parts]
        return sorted(os.listdir(outside)), sorted(inside)

    before = files()
    values = {k: v.replace("OUTSIDE", str(outside)) for k, v in parameters.items()}
    with pytest.raises(Exception, match=re.escape(refused)):
        predict_flow(**{"source": "data/photos", "model_name": "shardflow", **values})
    assert files() == before
