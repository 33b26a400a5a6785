"""This clone's Prefect server (127.0.0.1, SQLite): which one to use, start it, stop it.

Clones share machines, so no port is fixed. Each clone picks a free port the first time it
needs a server and records it in the gitignored ``.prefect/`` (``server.json``, and the
``shardflow`` profile of ``.prefect/profiles.toml``, which ``prefect.toml`` makes the profiles
file of every Prefect command run from the repository root: so ``prefect deployment run
'pipeline/local'`` typed there reaches this clone's server). A port can still answer with
another clone's server (the port was free when that clone picked it), so before a recorded
server is used it must say where it keeps its runs (``GET /api/admin/settings``: its Prefect
home) and that must be this clone's ``.prefect``; otherwise this clone moves to a new free
port and starts its own. The server's home is the identity to check because it is where
the runs land, needs no secret, and a server started by anyone else cannot claim it. Both
halves are needed: a fixed port with only the check would let one clone's server at a time
run, and recorded ports without it would trust a copied clone's record (``cp -r``) or a
port another clone took while this one's server was down.

A server the user names (``PREFECT_API_URL`` in the environment or ``.env``, or a profile's
value other than the recorded one, e.g. ``prefect config set PREFECT_API_URL=...``) is used
as named, started here if it is on this machine and down (tests, a team server; where
another clone serves the same deployments there, ``flows/cli/deployments.py`` refuses to
serve). Prefect reads, highest first: environment, ``.env``, ``prefect.toml``,
``pyproject.toml``, the active profile (``prefect/settings/base.py``); the clone's port sits
in the profile so that everything above it still wins.

``python -m flows.servers.prefect_server ensure`` starts the server unless it is up; ``stop``
stops only the server this clone started; ``status`` says which server the clone uses and
whose it is. Every flow entry point (each `dvc repro` stage included) calls :func:`require_server`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from tasks.runtime.atomic import write_text
from tasks.runtime.layout import shared_root

HOST = "127.0.0.1"
LOCAL_HOSTS = (HOST, "localhost", "::1")
PROFILE = "shardflow"  # the profile in .prefect/profiles.toml that holds this clone's server


def state_dir() -> Path:
    """The clone's ``.prefect/`` (the real repository's under a queued ``dvc exp``)."""
    return shared_root() / ".prefect"


def state_file() -> Path:  # {"url": this clone's server}
    return state_dir() / "server.json"


def started_file() -> Path:  # {"pid", "url", "home", "clone"} of the server this clone started
    return state_dir() / "server.started.json"


def log_file() -> Path:
    return state_dir() / "server.log"


def clone_id() -> str:
    """``host:path`` of this clone: how deployments and messages name it."""
    return f"{socket.gethostname()}:{shared_root()}"


def read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded_url() -> str | None:
    url = read_json(state_file()).get("url")
    return str(url) if url else None


def configured_url() -> str | None:
    """PREFECT_API_URL as Prefect resolves it here (environment > .env > toml > profile)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return str(url).rstrip("/") if url else None


def named_url() -> str | None:
    """The server the user named, if any: a configured URL other than the recorded one."""
    url = configured_url()
    return url if url and url != recorded_url() else None


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def server_home(url: str, attempts: int = 3) -> Path | None:
    """Where the server at ``url`` keeps its runs (its Prefect home, as it says it); None
    if it does not answer (a busy SQLite server can miss one request: asked ``attempts``
    times)."""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(f"{url}/admin/settings", timeout=5) as response:
                home = json.load(response).get("home")
            return Path(home) if isinstance(home, str) else None
        except (OSError, ValueError, AttributeError):
            time.sleep(attempt)
    return None


def owner(home: Path | None) -> str:
    """A server's home in words: a clone's ``.prefect`` names the clone."""
    if home is None:
        return "a server that does not say where it keeps its runs"
    if not home.is_absolute():  # a bare `prefect server start`: relative to where it ran
        return f"a server keeping its runs in {home} of the folder it was started in"
    if home.name == ".prefect" and (home.parent / "dvc.yaml").exists():
        return f"the server of the clone {home.parent} (its runs are in {home})"
    return f"a server keeping its runs in {home}"


def is_ours(url: str) -> bool:
    """Whether the server at ``url`` keeps its runs in this clone's ``.prefect``."""
    home = server_home(url)
    return home is not None and home.is_absolute() and home.resolve() == state_dir().resolve()


def wait_healthy(
    url: str, timeout: float = 90.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_healthy(url):
            return
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"Prefect server exited with {process.returncode}; see {log_file()}")
        time.sleep(0.5)
    raise TimeoutError(
        f"Prefect server at {url} not healthy after {timeout:.0f} s; see {log_file()}"
    )


def start_server(
    host: str, port: int, log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Launch ``prefect server start`` detached, logging to ``log_path``. Its only CORS
    origin is its own UI (same origin anyway: no other web page may call it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": f"http://{host}:{port}",
        **(env or {}),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    # `-m prefect`, not the console script beside the interpreter: an interpreter that
    # finds Prefect on PYTHONPATH (a site folder carried to a machine) has no such script.
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect",
                "server",
                "start",
                "--host",
                host,
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )


def local_address(url: str) -> tuple[str, int] | None:
    """(host, port) the server must listen on to answer at ``url``; None if not this machine."""
    parts = urlsplit(url)
    if parts.hostname not in LOCAL_HOSTS or parts.port is None:
        return None
    return parts.hostname, parts.port


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def record(url: str) -> None:
    """Make ``url`` this clone's server: ``server.json`` and the ``shardflow`` profile
    (other profiles in the file, and which one is active, are the user's and kept)."""
    import tomlkit

    port = urlsplit(url).port
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    write_text(state_file(), json.dumps({"url": url}) + "\n", owner_only=True)
    profiles_path = directory / "profiles.toml"
    document = tomlkit.parse(profiles_path.read_text()) if profiles_path.exists() else None
    document = document or tomlkit.document()
    document.setdefault("active", PROFILE)
    profiles = document.setdefault("profiles", tomlkit.table(is_super_table=True))
    profiles[PROFILE] = {
        "PREFECT_API_URL": url,
        # what a bare `prefect server start` from the repository root binds and allows
        "PREFECT_SERVER_API_PORT": port,
        "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": f"http://{HOST}:{port}",
    }
    # owner-only, as Prefect keeps its profiles (a profile may hold an API key)
    write_text(profiles_path, tomlkit.dumps(document), owner_only=True)


def use(url: str) -> str:
    """Point this process (and what it starts) at ``url``."""
    os.environ["PREFECT_API_URL"] = url
    if "prefect.context" in sys.modules:  # Prefect read its settings when imported
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
    return url


def start(url: str, home: Path) -> str:
    """Start a server answering at ``url`` (on this machine) keeping its runs in ``home``,
    and remember that this clone started it."""
    address = local_address(url)
    if address is None:
        raise SystemExit(
            f"Prefect server at {url} is not reachable, and it is not on this machine, so it "
            "cannot be started here. Start it, or unset PREFECT_API_URL to use this clone's own."
        )
    home = home.expanduser().resolve()
    # the wait below is the longest silent step of a first run: say what it is
    print(f"starting this clone's Prefect server at {url} ...", flush=True)
    process = start_server(*address, log_file(), env={"PREFECT_HOME": str(home)})
    started = {"pid": process.pid, "url": url, "home": str(home), "clone": str(shared_root())}
    write_text(started_file(), json.dumps(started) + "\n", owner_only=True)
    wait_healthy(url, process=process)
    print(
        f"Prefect server started at {url} (UI: {url.removesuffix('/api')}, log: {log_file()}; "
        "`make stop` stops it)"
    )
    return url


def already_up(url: str) -> str:
    if url == recorded_url() and configured_url() is None:
        record(url)  # the profile went missing: `prefect ...` at the root needs it
    named = "" if url == recorded_url() else f" (named by you: {owner(server_home(url))})"
    print(f"Prefect server already up at {url}{named}")
    return url


def ensure() -> str:
    """The server this clone uses, started unless up; one starter at a time (a file lock),
    so stages that find no server at once start one server, not several."""
    if (url := running_url()) is not None:
        return use(already_up(url))
    state_dir().mkdir(parents=True, exist_ok=True)
    with (state_dir() / "server.start.lock").open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released on exit, or when we die
        if (url := running_url()) is not None:  # another process started it while we waited
            return use(already_up(url))
        if (named := named_url()) is not None:
            return use(start(named, Path(os.environ.get("PREFECT_HOME") or state_dir())))
        url = recorded_url()
        if url is not None and is_healthy(url):
            if (home := server_home(url)) is None:  # it may be ours, busy: never start a 2nd
                raise SystemExit(
                    f"{url}, this clone's recorded Prefect server, answers but does not say "
                    "where it keeps its runs (GET /api/admin/settings); stop it, or name a "
                    "server with PREFECT_API_URL"
                )
            print(f"{url} answers with {owner(home)}, not this clone's server")
            url = None
        address = local_address(url) if url else None
        if url is None or address is None or not port_is_free(*address):
            url = f"http://{HOST}:{free_port()}/api"
            print(f"this clone's Prefect server gets a free port: {url} (see {state_file()})")
        record(url)
        return use(start(url, state_dir()))


def running_url() -> str | None:
    """The URL of the server this clone uses if it is up (and, when not named by the user,
    is this clone's), without starting anything."""
    url = named_url()
    if url is not None:
        return url if is_healthy(url) else None
    url = recorded_url()
    return url if url is not None and is_healthy(url) and is_ours(url) else None


def api_url() -> str:
    """The URL this clone's flows report to: the one the user named, else the recorded one."""
    url = named_url() or recorded_url()
    if url is None:
        raise RuntimeError(
            "this clone has no Prefect server yet: "
            "`python -m flows.servers.prefect_server ensure` starts one"
        )
    return url


def is_server_process(pid: int, url: str) -> bool:
    """Whether ``pid`` is still a ``prefect server start`` on ``url``'s port (pids are reused)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    port = str(urlsplit(url).port).encode()
    return b"server" in args and b"start" in args and port in args


def end(pid: int, url: str, timeout: float = 30.0) -> None:
    """SIGTERM the server's process group and wait until it is gone (SIGKILL after
    ``timeout`` s), so that its port is free and nothing answers when `make stop` returns."""
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_server_process(pid, url):
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            break
        time.sleep(0.2)


def stop() -> None:
    """Stop the server this clone started, never one it did not (another clone's runs)."""
    started = read_json(started_file())
    url = str(started.get("url") or "")
    pid = started.get("pid")
    # a copy of a clone (`cp -r`, .prefect/ included) holds the original's record: not ours
    mine = started.get("clone") == str(shared_root())
    if not mine or not isinstance(pid, int) or not is_server_process(pid, url):
        print("no Prefect server started by this clone is running")
        other = named_url() or recorded_url()
        if other is not None and is_healthy(other) and not is_ours(other):
            whose = owner(server_home(other))
            print(f"{other} answers with {whose}: not this clone's, so it is left running")
        started_file().unlink(missing_ok=True)
        return
    end(pid, url)
    started_file().unlink(missing_ok=True)
    print(f"stopped this clone's Prefect server at {url} (pid {pid})")


def require_server() -> None:
    """Make sure flows have a server to report to: this clone's (started if need be) or the
    one the user named; this process and what it starts then report there."""
    url = running_url()
    if url is not None:
        use(url)
    else:
        ensure()


def main() -> None:
    parser = argparse.ArgumentParser(prog="flows.servers.prefect_server", description=__doc__)
    parser.add_argument("action", choices=["ensure", "stop", "status"])
    action = parser.parse_args().action
    if action == "ensure":
        ensure()
    elif action == "stop":
        stop()
    else:
        url = api_url()
        if not is_healthy(url):
            print(f"{url}: down")
        else:
            print(f"{url}: up, {'this clone' if is_ours(url) else owner(server_home(url))}")


if __name__ == "__main__":
    main()
