"""Which Prefect server a clone uses, without starting one: the recorded port in the clone's
profile, the user's own profiles kept, a queued `dvc exp` copy led back to its clone."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from flows.servers import prefect_server as server

REPO = Path(__file__).resolve().parents[3]
SETTINGS = (
    "from prefect.settings import get_current_settings as s; "
    "print(s().api.url, s().server.api.port)"
)


def settings_in(cwd: Path, **env: str) -> list[str]:
    """PREFECT_API_URL and the server port Prefect resolves in ``cwd`` (no PREFECT_* env)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DVC_"))}
    done = subprocess.run(
        [sys.executable, "-c", f"import flows; {SETTINGS}"],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return done.stdout.split()


@pytest.fixture
def clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "clone"
    root.mkdir()
    shutil.copy2(REPO / "prefect.toml", root / "prefect.toml")
    monkeypatch.chdir(root)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    return root


def test_recording_keeps_the_users_profiles_choice_and_privacy(clone: Path) -> None:
    profiles = clone / ".prefect/profiles.toml"
    profiles.parent.mkdir()
    profiles.write_text(
        'active = "team"\n\n[profiles.team]\nPREFECT_API_URL = "http://team:4200/api"\n'
    )
    server.record("http://127.0.0.1:4321/api")
    written = tomllib.loads(profiles.read_text())
    assert written["active"] == "team"
    assert written["profiles"]["team"] == {"PREFECT_API_URL": "http://team:4200/api"}
    assert written["profiles"]["shardflow"]["PREFECT_API_URL"] == "http://127.0.0.1:4321/api"
    assert settings_in(clone)[0] == "http://team:4200/api"  # the user's choice is used
    assert profiles.stat().st_mode & 0o077 == 0  # owner-only: a profile may hold an API key


def test_a_queued_experiment_copy_uses_its_clones_server(clone: Path) -> None:
    """`dvc exp run --queue` runs stages in a copy under .dvc/tmp/exps with $DVC_ROOT naming
    the clone: the copy holds no record of its own and must not start a server of its own."""
    server.record("http://127.0.0.1:4321/api")
    copy = clone / ".dvc/tmp/exps/tmp123"
    copy.mkdir(parents=True)
    shutil.copy2(clone / "prefect.toml", copy / "prefect.toml")
    assert settings_in(copy, DVC_ROOT=str(clone))[0] == "http://127.0.0.1:4321/api"


def test_stop_leaves_a_server_recorded_by_another_clone(
    clone: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copied clone holds the original's record of the server it started: not its own."""
    (clone / ".prefect").mkdir()
    record = '{"pid": 1, "url": "http://127.0.0.1:4321/api", "clone": "/elsewhere"}'
    server.started_file().write_text(record)
    killed: list[int] = []
    monkeypatch.setattr(server, "is_server_process", lambda pid, url: True)
    monkeypatch.setattr(server.os, "killpg", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(server, "named_url", lambda: None)
    server.stop()
    assert killed == [] and "no Prefect server started by this clone" in capsys.readouterr().out


def test_serving_is_refused_only_where_another_clone_serves_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment of the same name tagged with another clone blocks serving while that
    clone serves on this server: on this host, its serving process runs (a clone that just
    stopped, its deployments still READY for a minute, is taken over); on another host,
    Prefect says READY. Untagged and READY blocks too."""
    import prefect
    from prefect.client.schemas.objects import DeploymentStatus
    from prefect.exceptions import ObjectNotFound

    from flows.cli import deployments

    url = "http://127.0.0.1:4321/api"
    ready, idle = DeploymentStatus.READY, DeploymentStatus.NOT_READY
    here = socket.gethostname()
    serving, stopped, elsewhere = tmp_path / "serving", tmp_path / "stopped", tmp_path / "other"
    found = {
        "pipeline/local": ([server.clone_id()], ready),  # this clone's own
        "a/local": ([f"{here}:{serving}"], idle),  # its process runs: blocks
        "b/local": ([f"{here}:{stopped}"], ready),  # no process any more: taken over
        "c/local": ([f"{here}:{elsewhere}"], ready),  # its process serves another server
        "d/local": (["laptop:/home/bob/shardflow"], ready),  # another host, polled: blocks
        "e/local": (["laptop:/home/bob/shardflow"], idle),  # another host, not polled
        "f/local": ([], ready),  # a serving process that names no clone: blocks
    }

    class Client:
        def __enter__(self) -> Client:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def read_deployment_by_name(self, name: str) -> object:
            if name not in found:
                raise ObjectNotFound(LookupError(name))
            owners, status = found[name]
            tags = [f"clone:{owner}" for owner in owners]
            return type("Deployment", (), {"tags": tags, "status": status})

    monkeypatch.setattr(prefect, "get_client", lambda sync_client: Client())
    monkeypatch.setattr(deployments, "api_url", lambda: url)
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "flows.cli.deployments"]
    )
    cmdline = Path(f"/proc/{process.pid}/cmdline")
    while b"flows.cli.deployments" not in cmdline.read_bytes():  # empty until its exec is done
        time.sleep(0.05)
    try:
        for root, served_url in ((serving, url), (elsewhere, "http://127.0.0.1:9/api")):
            deployments.serving_file(root).parent.mkdir(parents=True)
            record = {"pid": process.pid, "url": served_url}
            deployments.serving_file(root).write_text(json.dumps(record))
        others = deployments.other_owners([*found, "missing/local"])
    finally:
        process.kill()
        process.wait()
    serving_now = {name: owner for name, (owner, serves) in others.items() if serves}
    assert serving_now == {
        "a/local": f"{here}:{serving}",
        "d/local": "laptop:/home/bob/shardflow",
        "f/local": "unknown (a process that does not tag its clone)",
    }
    assert sorted(name for name, (_, serves) in others.items() if not serves) == [
        "b/local",
        "c/local",
        "e/local",
    ]
