"""The team deployments' work pools: `cpu` and `gpu` for a plain `prefect deploy --all`,
others through `shardflow team-deploy` without editing a tracked file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from prefect.utilities.templating import apply_values

from flows.team import deployment_file, pool_names

REPO = Path(__file__).resolve().parents[3]
ON_CPU = ["flows/team.py:team_pipeline", "flows/team.py:team_data"]


def pools_of(path: Path, env: dict[str, str]) -> dict[str, str]:
    """Each deployment's pool as `prefect deploy` renders it in ``env``."""
    config = yaml.safe_load(path.read_text())
    return {
        d["entrypoint"]: apply_values(d, env, remove_notset=False)["work_pool"]["name"]
        for d in config["deployments"]
    }


def test_a_plain_prefect_deploy_all_deploys_on_cpu_and_gpu() -> None:
    """It failed with "work pool '{{ $SHARDFLOW_CPU_POOL }}' does not exist" unless the
    project's pool variables were set."""
    pools = pools_of(REPO / "prefect.yaml", {})
    assert pools == {e: "cpu" if e in ON_CPU else "gpu" for e in pools}
    assert len(pools) == 4


def test_team_deploy_names_other_pools_in_an_untracked_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copy(REPO / "prefect.yaml", tmp_path)
    before = (tmp_path / "prefect.yaml").read_bytes()
    for variable in ("SHARDFLOW_CPU_POOL", "SHARDFLOW_GPU_POOL"):
        monkeypatch.delenv(variable, raising=False)
    assert deployment_file(tmp_path, pool_names(None, None)) == tmp_path / "prefect.yaml"
    monkeypatch.setenv("SHARDFLOW_GPU_POOL", "team-gpu")
    chosen = deployment_file(tmp_path, pool_names("team-cpu", None))
    assert chosen == tmp_path / ".shardflow" / "prefect.team.yaml"
    pools = pools_of(chosen, {})
    assert pools == {e: "team-cpu" if e in ON_CPU else "team-gpu" for e in pools}
    assert (tmp_path / "prefect.yaml").read_bytes() == before
