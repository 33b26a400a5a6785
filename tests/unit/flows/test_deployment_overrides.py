"""A deployment run's parameters cannot reach outside the project, and the local Prefect
server refuses cross-site requests (CSRF on, no wildcard CORS origin)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from flows.support.run_story import run_params_path
from tasks.runtime.params import REPO_PARAMS_PATH, shipped_params_text
from tasks.runtime.run_overrides import (
    ParamOverrides,
    apply_overrides,
    check_overrides,
    resolve_inside,
)

REPO = REPO_PARAMS_PATH.parent
REFUSED = [
    ({"shard": {"runner": "dask"}}, "shard.runner cannot be overridden by a deployment run"),
    (
        {"shard": {"dask_address": "tcp://attacker:8786"}},
        "shard.dask_address cannot be overridden by a deployment run",
    ),
    (
        {"shard": {"staging_url": "s3://attacker/x"}},
        "shard.staging_url cannot be overridden by a deployment run",
    ),
    ({"ingest": {"source_dir": "/etc"}}, "ingest.source_dir='/etc' is outside the project"),
    ({"ingest": {"labels_csv": "../x.csv"}}, "ingest.labels_csv='../x.csv' is outside"),
    ({"train": {"weights": "/root/w.h5"}}, "train.weights='/root/w.h5' is outside"),
]


@pytest.fixture
def repo_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding the repository's params.yaml, as the working directory."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "params.yaml").write_text(shipped_params_text())
    monkeypatch.chdir(root)
    return root


@pytest.mark.parametrize(("overrides", "message"), REFUSED)
def test_overrides_cannot_choose_where_code_runs_or_reach_outside(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_overrides(overrides)
    with pytest.raises(ValidationError, match=re.escape(message)):
        ParamOverrides.model_validate(overrides)


@pytest.mark.parametrize(("overrides", "message"), REFUSED)
def test_refused_overrides_leave_params_yaml_untouched(
    repo_copy: Path, overrides: dict[str, Any], message: str
) -> None:
    before = (repo_copy / "params.yaml").read_bytes()
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_overrides(repo_copy / "params.yaml", overrides)
    assert (repo_copy / "params.yaml").read_bytes() == before


def test_ordinary_overrides_are_accepted(repo_copy: Path) -> None:
    overrides = {
        "ingest": {"source_dir": "data/other"},
        "train": {"model": "mobilenet_v3_small", "weights": "imagenet"},
    }
    merged = apply_overrides(repo_copy / "params.yaml", overrides)
    assert merged.ingest.source_dir == "data/other" and merged.train.weights == "imagenet"


def test_deployment_parameters_are_refused_before_the_run() -> None:
    """What Prefect does with a run's ``--param overrides=...`` before the flow body runs."""
    from prefect.exceptions import ParameterTypeError

    from flows.pipeline import pipeline

    with pytest.raises(ParameterTypeError, match=r"shard\.runner cannot be overridden"):
        pipeline.validate_parameters({"overrides": {"shard": {"runner": "dask"}}})
    accepted = pipeline.validate_parameters({"overrides": {"train": {"epochs": 2}}})
    assert accepted["overrides"].as_dict() == {"train": {"epochs": 2}}


def test_deployment_parameters_are_as_strict_as_params_yaml() -> None:
    """A run's ``--param overrides=...`` arrives as JSON: a quoted number or a 1 for a switch
    is refused naming its key, before the flow body runs; a list for a pair still passes."""
    from prefect.exceptions import ParameterTypeError

    from flows.pipeline import pipeline

    for overrides, key in [
        ({"train": {"batch_size": "32"}}, "train.batch_size"),
        ({"train": {"epochs": True}}, "train.epochs"),
        ({"train": {"augment": {"flip": 1}}}, "train.augment.flip"),
    ]:
        with pytest.raises(ParameterTypeError, match=re.escape(key)):
            pipeline.validate_parameters({"overrides": overrides})
    accepted = pipeline.validate_parameters(
        {"overrides": {"shard": {"image_size": [32, 32]}, "train": {"learning_rate": 1}}}
    )
    assert accepted["overrides"].as_dict() == {
        "shard": {"image_size": [32, 32]},
        "train": {"learning_rate": 1.0},
    }


@pytest.mark.parametrize(
    ("root", "params_path", "refused"),
    [
        ("/tmp", "params.yaml", "root='/tmp' resolves to"),
        ("..", "params.yaml", "root='..' resolves to"),
        (".", "../params.yaml", "params_path='../params.yaml' resolves to"),
        (".", "/etc/passwd", "params_path='/etc/passwd' resolves to"),
    ],
)
def test_root_and_params_path_stay_inside_the_repository(
    tmp_path: Path, root: str, params_path: str, refused: str
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    with pytest.raises(ValueError, match=re.escape(refused) + ".*outside the repository"):
        resolve_inside(root, params_path, repo)
    assert resolve_inside(".", "params.yaml", repo) == repo.resolve() / "params.yaml"
    assert resolve_inside("sub", "p.yaml", repo) == repo.resolve() / "sub" / "p.yaml"


def test_only_deployment_runs_are_confined(
    repo_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = str(tmp_path / "elsewhere")
    # A direct call (DVC stage, test) names its own project root.
    assert run_params_path(elsewhere, "params.yaml") == Path(elsewhere) / "params.yaml"
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "a-deployment")
    with pytest.raises(ValueError, match="outside the repository"):
        run_params_path(elsewhere, "params.yaml")
    assert run_params_path(".", "params.yaml") == repo_copy.resolve() / "params.yaml"


# -- the flows themselves, under a real (temporary) Prefect server ---------------------------


# -- the local Prefect server ------------------------------------------------------------------


def test_local_server_keeps_csrf_on_and_no_wildcard_cors_origin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings Prefect loads in a clone that recorded its server (the repository's
    prefect.toml, the clone's profile, no PREFECT_* env), and the environment the servers
    `flows.servers.prefect_server` starts get: CSRF on, the server's own UI as the only CORS
    origin."""
    import flows.servers.prefect_server

    shutil.copy2(REPO / "prefect.toml", tmp_path / "prefect.toml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    script = (
        "import json, sys; from flows.servers.prefect_server import record; record(sys.argv[1]); "
        "from prefect.settings import get_current_settings as s; a = s().server.api; "
        "print(json.dumps([a.csrf_protection_enabled, a.cors_allowed_origins]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, "http://127.0.0.1:4321/api"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    csrf, origins = json.loads(result.stdout.strip().splitlines()[-1])
    assert csrf is True
    assert [o.strip() for o in origins.split(",")] == ["http://127.0.0.1:4321"]

    started: dict[str, Any] = {}
    monkeypatch.setattr(
        flows.servers.prefect_server.subprocess, "Popen", lambda *a, **kw: started.update(kw)
    )
    flows.servers.prefect_server.start_server("127.0.0.1", 4567, tmp_path / "server.log")
    assert started["env"]["PREFECT_SERVER_CORS_ALLOWED_ORIGINS"] == "http://127.0.0.1:4567"
