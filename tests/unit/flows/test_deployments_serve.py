"""What ``make serve`` (``python -m flows.cli.deployments``) hands Prefect's runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import flows.cli.deployments


def served_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Run ``main()`` with the runner, the server check and the ownership lookup replaced;
    return the keyword arguments ``serve`` got."""
    got: dict[str, Any] = {}
    monkeypatch.setattr(flows.cli.deployments, "require_server", lambda: None)
    monkeypatch.setattr(flows.cli.deployments, "api_url", lambda: "http://127.0.0.1:9/api")
    monkeypatch.setattr(flows.cli.deployments, "other_owners", lambda names: {})
    monkeypatch.setattr(flows.cli.deployments, "serving_file", lambda root: tmp_path / "serving")
    monkeypatch.setattr(
        flows.cli.deployments, "serve", lambda *served, **options: got.update(options)
    )
    flows.cli.deployments.main()
    return got


def test_the_runner_asks_for_runs_every_2_s_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """At Prefect's default (10 s) a `prefect deployment run` waited 5 s on average before
    anything ran; a poll frequency the user sets still decides."""
    from prefect.settings import PREFECT_RUNNER_POLL_FREQUENCY, temporary_settings

    options = served_with(monkeypatch, tmp_path)
    assert options["limit"] == 1  # runs share the working tree
    assert options["query_seconds"] == 2.0 < PREFECT_RUNNER_POLL_FREQUENCY.value() / 2
    with temporary_settings(updates={PREFECT_RUNNER_POLL_FREQUENCY: 30}):
        assert served_with(monkeypatch, tmp_path)["query_seconds"] is None  # the setting's 30 s
