"""The `shardflow` console script through the processes it starts: its own, `make`, `git`,
`dvc` and Python children (what it runs without them: tests/unit/flows/test_cli.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import shardflow as cli
from tests.unit.flows.test_cli import BETWEEN_STEPS, COMMANDS, REFUSING_REPRO, ROOT, Recorder

pytestmark = pytest.mark.slow


def test_help_lists_every_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = re.findall(r"^    ([\w-]+)(?: |$)", out, flags=re.MULTILINE)
    assert listed == COMMANDS


def test_a_stage_s_refusal_is_shown_once_last_with_the_refusal_s_exit_status(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    refusing = [[sys.executable, "-c", REFUSING_REPRO]]
    monkeypatch.setitem(cli.COMMANDS, "run", ("run", lambda extra: refusing))
    assert cli.main(["run"]) == 2  # the refusal's, not DVC's 255
    out, err = capfd.readouterr()
    shown = (out + err).splitlines()
    assert shown[-3:] == [
        "Refused: train (ShardsNotValidated)",
        "  the shards changed since validation",
        "  fix: dvc repro validate",
    ]
    assert sum(line.startswith("Refused:") for line in shown) == 1
    assert sum("fix:" in line for line in shown) == 1
    assert not any("255" in line for line in shown)


def test_dvc_run_by_shardflow_keeps_its_site_cache_in_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DVC kept its index and file-hash state in /var/tmp/dvc, outside the repository and
    after the run; the commands `shardflow` runs (`dvc repro` among them) keep it in the
    repository's .shardflow/dvc."""
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.delenv("DVC_SITE_CACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    env = cli.environment()
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for args in (["init", "-q"], ["status"]):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=tmp_path, env=env, check=True)
    kept = tmp_path / ".shardflow" / "dvc" / "repo"
    assert kept.is_dir() and any(kept.iterdir())


def test_every_shardflow_command_names_the_site_cache_for_a_dvc_typed_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make install` names it once; a clone moved since, or installed before, gets it from
    the next `shardflow` command (tests/unit/runtime/test_layout.py: what the setting does)."""
    from dvc.config import Config

    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    monkeypatch.setattr(cli, "run_step", Recorder().step)
    assert cli.main(["stop"]) == 0
    local = Config(dvc_dir=str(tmp_path / ".dvc"), validate=False).load_one("local")
    assert local["core"]["site_cache_dir"] == str(tmp_path.resolve() / ".shardflow" / "dvc")


def test_mlflow_servers_started_by_shardflow_run_no_job_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`shardflow ui`'s `mlflow ui` (MLflow 3) would start a job runner and seven huey
    consumers for GenAI jobs nobody submits: its environment turns them off, as MLflow reads
    it (the team's `mlflow server`: tests/e2e/test_team.py)."""
    monkeypatch.delenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", raising=False)
    read = "from mlflow.environment_variables import MLFLOW_SERVER_ENABLE_JOB_EXECUTION as v\n"
    read += "print(v.get())"
    said = subprocess.run(
        [sys.executable, "-c", read], env=cli.environment(), capture_output=True, text=True
    )
    assert said.stdout.strip() == "False", said.stderr[-2000:]


def test_a_bare_make_lists_every_target() -> None:
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY: (.*)$", makefile, flags=re.MULTILINE)
    assert phony is not None
    out = subprocess.run(
        ["make", "-s"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
    ).stdout
    assert re.findall(r"^  make (\S+)", out, flags=re.MULTILINE) == [
        t for t in re.findall(r"^([a-z-]+):.*## ", makefile, flags=re.MULTILINE)
    ]
    assert set(phony.group(1).split()) <= set(re.findall(r"^  make (\S+)", out, flags=re.M))


def test_steps_run_without_mlflows_download_bars_and_info_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`make run` showed MLflow's "Downloading artifacts" bars, system-metrics INFO lines
    and Starlette's deprecation warning, which nobody can act on; MLflow's own warnings and
    errors still show."""
    from mlflow.environment_variables import (
        MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR,
        MLFLOW_LOGGING_LEVEL,
    )

    for name in ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "MLFLOW_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in cli.environment().items():
        monkeypatch.setenv(name, value)
    assert MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() is False
    assert MLFLOW_LOGGING_LEVEL.get() == "WARNING"
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    said = subprocess.run(
        [sys.executable, "-c", "import mlflow.server.fastapi_app"],
        env=cli.environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert said.returncode == 0 and "Warning" not in said.stderr, said.stderr[-2000:]


def test_sigterm_between_two_steps_ends_the_command_as_within_one(tmp_path: Path) -> None:
    """A signal that comes while no step runs is the same stop: exit 128+SIGTERM, no
    further step started (not the signal's default death, -15, that skips the summary)."""
    marker = tmp_path / "steps"
    done = subprocess.run(
        [sys.executable, "-c", BETWEEN_STEPS, str(marker)],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 128 + 15, done.stderr
    assert marker.read_text() == "ran "  # the second step never started
