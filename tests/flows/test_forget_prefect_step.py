"""forget's Prefect step scrubs the server of the project it erases in (``--root``), resolved
there, never the one the folder it started in names: that folder's profile may name another
project's server, or one that is down."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.forget.orchestration import project_url, step_prefect
from tasks.runtime.layout import Layout

# A server nothing answers on: reaching for it fails the step.
ELSEWHERE = "http://127.0.0.1:9/api"


@pytest.fixture
def no_user_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No PREFECT_API_URL in the environment and an empty Prefect home: a project folder
    without settings of its own resolves no server, whatever the machine's user has."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    home = tmp_path / "prefect-home"
    home.mkdir()
    monkeypatch.setenv("PREFECT_HOME", str(home))
    monkeypatch.setenv("PREFECT_PROFILES_PATH", str(home / "profiles.toml"))


def test_a_projects_server_is_resolved_in_its_root(tmp_path: Path, no_user_profile: None) -> None:
    named, bare = tmp_path / "named", tmp_path / "bare"
    named.mkdir()
    bare.mkdir()
    (named / "prefect.toml").write_text('[api]\nurl = "http://127.0.0.1:4321/api/"\n')

    assert project_url(named) == "http://127.0.0.1:4321/api"
    assert project_url(bare) is None


def test_the_step_never_reaches_the_server_of_the_folder_it_started_in(
    tmp_path: Path, no_user_profile: None
) -> None:
    """The settings this process loaded (from the folder it started in) name a server that is
    down; the project at ``--root`` names none: nothing was logged to one, and the step says
    so instead of failing on the other server."""
    said: dict[str, Any] = {}
    job = SimpleNamespace(
        layout=Layout(tmp_path), done=lambda step, **found: said.update(step=step, **found)
    )

    with temporary_settings(updates={PREFECT_API_URL: ELSEWHERE}):
        step_prefect(job)  # type: ignore[arg-type]

    assert said == {"step": "prefect", "prefect_flow_runs": ["no Prefect server configured"]}
