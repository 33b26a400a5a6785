"""A clone's Prefect server started for real: Prefect commands at the root reach the recorded one,
and it starts from an interpreter with no prefect script beside it (which server, without
starting one: tests/unit/flows/test_server.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from flows.servers import prefect_server as server
from tests.prefect_database import seed_home
from tests.unit.flows import test_server as unit
from tests.unit.flows.test_server import REPO, settings_in

pytestmark = pytest.mark.slow
clone = unit.clone  # the unit tests' fixture, shared


def test_the_recorded_server_is_what_prefect_commands_at_the_root_reach(clone: Path) -> None:
    """The repository names no server (no fixed port shared by every clone); the recorded
    one is the clone's profile, so `prefect deployment run ...` typed there reaches it."""
    assert "url" not in tomllib.loads((REPO / "prefect.toml").read_text()).get("api", {})
    assert settings_in(clone) == ["None", "4200"]  # nothing recorded: no server named
    server.record("http://127.0.0.1:4321/api")
    assert server.recorded_url() == "http://127.0.0.1:4321/api"
    assert settings_in(clone) == ["http://127.0.0.1:4321/api", "4321"]
    # The environment still names another server (tests, a team server).
    named = settings_in(clone, PREFECT_API_URL="http://10.0.0.9:4200/api")
    assert named[0] == "http://10.0.0.9:4200/api"


def test_the_server_starts_from_an_interpreter_with_no_prefect_script_beside_it(
    tmp_path: Path, prefect_database: Path
) -> None:
    """A bare interpreter that finds Prefect on PYTHONPATH (site packages carried to a
    machine, as for the GPU bench) has no `prefect` script in its folder: the server is
    started as `python -m prefect`, not through that script."""
    import sysconfig

    bare = tmp_path / "bin" / "python"
    bare.parent.mkdir()
    bare.symlink_to(sys._base_executable)  # type: ignore[attr-defined]
    assert not (bare.parent / "prefect").exists()
    port = server.free_port()
    script = (
        "import sys; from pathlib import Path; from flows.servers import prefect_server as server\n"
        f"p = server.start_server('127.0.0.1', {port}, Path(sys.argv[1]))\n"
        f"try: server.wait_healthy('http://127.0.0.1:{port}/api', timeout=120, process=p)\n"
        "finally: server.end(p.pid, 'http://127.0.0.1:%d/api' % " + str(port) + ")\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path.cwd()), sysconfig.get_paths()["purelib"]]),
        "PREFECT_HOME": str(seed_home(tmp_path / "home", prefect_database)),
    }
    result = subprocess.run(
        [str(bare), "-c", script, str(tmp_path / "server.log")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
