"""``shardflow team-demo``: the team setup of ``prefect.yaml`` on one machine, for a newcomer.

Starts, on 127.0.0.1 and free ports, everything a team has: a Prefect server, an S3 server
(:mod:`flows.servers.s3_server`: moto's standalone server, the one the tests and the bench use),
``mlflow server`` with its artifacts on S3, a bare
git remote, and two process workers (pools ``cpu`` and ``gpu``), each in an empty directory of
its own with credentials in its environment only. It clones this repository's HEAD, adds tiny
demo images under DVC, pushes them, deploys ``prefect.yaml``, runs ``pipeline/team`` through
the workers, prints which flow run ran where and which run ref holds the results, then stops
everything it started. Everything lives under ``.shardflow/team-demo/`` (removed first).

The end-to-end test (tests/e2e/test_team.py) starts the same team with the same functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flows.servers.s3_server import S3Server, start_s3_server, stop_s3_server
from flows.support.environment import OFFLINE_ENV
from flows.team import run_checked as run

POOLS = ("cpu", "gpu")
WORKER_PREFIX = "worker-"  # a worker process is named for its pool: worker-cpu
# How often each demo worker asks the server for runs to start (Prefect's default, 10 s,
# keeps a queued run waiting half of it on average, three times a pipeline run).
WORKER_QUERY_S = "2"
# How often `prefect deployment run --watch` looks at the run it waits for (default 5 s).
WATCH_INTERVAL_S = "1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def machine_env() -> dict[str, str]:
    """What a fresh machine's environment holds: no PYTHONPATH, nothing of the user's clone;
    the installed environment's executables on PATH."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "USER")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **OFFLINE_ENV}


@dataclass
class Team:
    """The started team: its addresses, directories and processes (stopped by ``stop``)."""

    base: Path
    # The demo's own S3 server: a bucket, and throwaway keys made for it that processes get
    # through their environment only (none is written in the repository).
    s3: S3Server | None = None
    tracking_url: str = ""
    prefect_url: str = ""
    bare: Path = Path()
    workers: dict[str, Path] = field(default_factory=dict)
    processes: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
        log = self.base / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.processes.append((name, process, log))

    def wait_http(self, url: str, timeout: float = 180) -> None:
        name, process, log = self.processes[-1]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited; see {log}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code < 500:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{name} did not answer at {url} in {timeout:.0f} s; see {log}")

    @property
    def s3_url(self) -> str:
        return self.s3.endpoint_url if self.s3 else ""

    @property
    def s3_env(self) -> dict[str, str]:
        """The S3 server's keys, endpoint and region, for a process's environment."""
        return self.s3.env if self.s3 else {}

    def stop(self) -> None:
        """Stop every process this team started, each by its own group id: the workers
        together, then the servers newest first, then its S3 server.

        A Prefect worker that has run flows outlasts its grace period after SIGTERM (an idle
        one stops at once), so the workers share one grace period instead of paying one
        each."""
        workers = {name for name, _, _ in self.processes if name.startswith(WORKER_PREFIX)}
        stop_together([p for name, p, _ in self.processes if name in workers], grace_s=30)
        for name, process, _ in reversed(self.processes):
            if name not in workers:
                stop_together([process], grace_s=30)
        self.processes.clear()
        if self.s3 is not None:
            stop_s3_server(self.s3)

    def log_tail(self, name: str, chars: int = 4000) -> str:
        return "\n".join(
            log.read_text(errors="replace")[-chars:] for n, _, log in self.processes if n == name
        )


def stop_together(processes: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM each process's group, wait for them all within one ``grace_s``, then SIGKILL
    the groups of those still running."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def start_prefect(team: Team) -> None:
    port = free_port()
    team.prefect_url = f"http://127.0.0.1:{port}/api"
    env = {**machine_env(), "PREFECT_HOME": str(team.base / "prefect-server")}
    prefect = str(Path(sys.executable).with_name("prefect"))
    cmd = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    team.start("prefect-server", cmd, team.base, env)
    team.wait_http(f"{team.prefect_url}/health")


def start_storage_and_tracking(team: Team) -> None:
    """The S3 server (:func:`flows.servers.s3_server.start_s3_server`: a bucket, fresh keys), then
    ``mlflow server`` with artifacts on S3."""
    team.s3 = start_s3_server(team.base / "s3.log")
    port = free_port()
    team.tracking_url = f"http://127.0.0.1:{port}"
    env = {**machine_env(), **team.s3_env, "MLFLOW_S3_ENDPOINT_URL": team.s3_url}
    cmd = [
        *[sys.executable, "-m", "mlflow", "server"],
        *["--backend-store-uri", f"sqlite:///{team.base / 'tracking.db'}"],
        *["--artifacts-destination", team.s3.url("mlartifacts")],
        *["--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
    ]
    team.start("mlflow", cmd, team.base, env)
    team.wait_http(f"{team.tracking_url}/health")


def user_env(team: Team, root: Path) -> dict[str, str]:
    """The user's shell in their clone: the servers, and the S3 credentials for DVC."""
    return {
        **machine_env(),
        **team.s3_env,
        "PYTHONPATH": str(root),
        "PREFECT_API_URL": team.prefect_url,
        "PREFECT_HOME": str(team.base / "prefect-user"),
        "MLFLOW_TRACKING_URI": team.tracking_url,
    }


def publish(team: Team, root: Path, env: dict[str, str]) -> None:
    """In the user's clone: raw images under DVC with an S3 remote, pushed; the repository
    pushed to a new bare git remote; work pools created and ``prefect.yaml`` deployed on them
    (``python -m flows.team deploy``)."""
    python = [sys.executable, "-m"]
    ignore = root / ".gitignore"
    ignore.write_text(ignore.read_text().replace("/data/demo/\n", ""))  # DVC tracks it now
    assert team.s3 is not None, "start_storage_and_tracking first"
    run([*python, "dvc", "remote", "add", "-f", "-d", "team", team.s3.url("dvc")], root, env)
    run([*python, "dvc", "remote", "modify", "team", "endpointurl", team.s3_url], root, env)
    run([*python, "dvc", "add", "data/demo"], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "team: raw images under DVC, DVC remote on S3"], root, env)
    run([*python, "dvc", "push"], root, env)
    team.bare = team.base / "remote.git"
    run(["git", "init", "-q", "--bare", "-b", "main", str(team.bare)], team.base, env)
    run(["git", "remote", "add", "team", str(team.bare)], root, env)
    run(["git", "push", "-q", "team", "HEAD:refs/heads/main"], root, env)
    for pool in POOLS:
        create = ["work-pool", "create", pool, "--type", "process", "--overwrite"]
        run([*python, "prefect", *create], root, env)
    cpu, gpu = POOLS
    run([*python, "flows.team", "deploy", "--cpu-pool", cpu, "--gpu-pool", gpu], root, env)


def start_workers(team: Team) -> None:
    """One process worker per pool, each in its own empty directory; its runs' clones go
    under it (TMPDIR); the git remote, S3 and tracking credentials are in its environment."""
    for pool in POOLS:
        home = team.base / f"{WORKER_PREFIX}{pool}"
        (home / "tmp").mkdir(parents=True)
        env = {
            **machine_env(),
            **team.s3_env,
            "HOME": str(home),
            "TMPDIR": str(home / "tmp"),
            "PREFECT_HOME": str(home / ".prefect"),
            "PREFECT_API_URL": team.prefect_url,
            "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_S,
            "MLFLOW_TRACKING_URI": team.tracking_url,
            "SHARDFLOW_GIT_REMOTE": str(team.bare),
            "SHARDFLOW_GIT_BRANCH": "main",
        }
        prefect = [sys.executable, "-m", "prefect"]
        cmd = [*prefect, "worker", "start", "--pool", pool, "--type", "process"]
        team.start(f"{WORKER_PREFIX}{pool}", cmd, home, env)
        team.workers[pool] = home


@contextlib.contextmanager
def started_team(base: Path, prefect_url: str | None = None) -> Iterator[Team]:
    """Storage, tracking and (unless ``prefect_url`` names one) a Prefect server; stopped
    on exit. Call ``publish`` and ``start_workers`` next."""
    base.mkdir(parents=True, exist_ok=True)
    team = Team(base=base)
    try:
        if prefect_url:
            team.prefect_url = prefect_url
        else:
            start_prefect(team)
        start_storage_and_tracking(team)
        yield team
    finally:
        team.stop()


def where_it_ran(api_url: str) -> list[Any]:
    """Every flow run on the server (name, state, work pool), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(limit=100)
    return sorted(runs, key=lambda r: str(r.start_time or r.expected_start_time))


def main() -> int:
    repo = Path.cwd()
    base = repo / ".shardflow" / "team-demo"
    shutil.rmtree(base, ignore_errors=True)
    with started_team(base) as team:
        clone = base / "user"
        env = user_env(team, clone)
        head = run(["git", "rev-parse", "HEAD"], repo, env).strip()
        run(["git", "clone", "-q", str(repo), str(clone)], base, env)
        run(
            ["git", "checkout", "-q", "-B", "main", head], clone, env
        )  # the commit, not uncommitted edits
        shutil.copy2(repo / "prefect.yaml", clone / "prefect.yaml")  # also when not committed
        run(
            [sys.executable, "-m", "tasks.ingest.demo_data", "data/demo", "--per-class", "30"],
            clone,
            env,
        )
        publish(team, clone, env)
        start_workers(team)
        where = ", ".join(map(str, team.workers.values()))
        print(f"Prefect {team.prefect_url}, S3 {team.s3_url}, MLflow {team.tracking_url}")
        print(f"git remote {team.bare}; workers in {where}", flush=True)
        overrides = {"train": {"epochs": 1}, "shard": {"image_size": [32, 32]}}
        cmd = [sys.executable, "-m", "prefect", "deployment", "run", "pipeline/team", "--watch"]
        cmd += ["--watch-interval", WATCH_INTERVAL_S]
        params = json.dumps({"overrides": overrides})
        result = subprocess.run([*cmd, "--params", params], cwd=clone, env=env, check=False)
        for flow_run in where_it_ran(team.prefect_url):
            pool = flow_run.work_pool_name or "-"
            worker = team.workers.get(pool, "-")
            print(f"{flow_run.name:<40} {flow_run.state_name:<10} pool {pool:<4} {worker}")
        print(run([sys.executable, "-m", "flows.team", "refs", "--remote", "team"], clone, env))
        if result.returncode != 0:
            for pool in POOLS:
                print(team.log_tail(f"{WORKER_PREFIX}{pool}"), file=sys.stderr)
        return result.returncode


if __name__ == "__main__":
    sys.exit(main())
