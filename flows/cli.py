"""``shardflow``: one entry point for what the Makefile runs (``shardflow --help`` lists it).

Each subcommand is a short list of steps, each one command run with this interpreter (so
``dvc``, ``mlflow`` and DVC's ``python -m flows.<stage>`` commands use the same environment),
stopping at the first that fails. The Makefile's targets call this module, so the two never
drift apart. Run it from the repository root: DVC, Prefect (``prefect.toml``) and MLflow
(``mlflow.db``) all resolve their files there.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from flows.common import configure_environment
from flows.server import api_url, free_port
from tasks.layout import keep_dvc_site_cache_in_repository
from tasks.refusals import Refused
from tasks.tracking import MLFLOW_UI_URL

DEMO_DIR = "data/demo"
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
HOST = "127.0.0.1"
# `shardflow serve-model`'s request limits (about 12 MB of image files in base64, and rows
# a batch at a time): larger requests get HTTP 413 before their body is parsed. Four at once
# hold at most 64 MB of bodies, about 0.5 GB with their parses (+113 MB measured for one of
# 14.6 MB); a fifth gets HTTP 503.
SERVE_LIMITS = {
    "--max-request-mb": "16",
    "--max-request-rows": "1024",
    "--max-concurrent-requests": "4",
}

Steps = list[list[str]]


def module(name: str, *args: str) -> list[str]:
    """``python -m name args`` with this interpreter."""
    return [sys.executable, "-m", name, *args]


def run_steps(extra: Sequence[str]) -> Steps:
    return [
        module("tasks.demo_data", DEMO_DIR, "--if-missing"),
        # DVC cannot hash a folder holding a file name that is not UTF-8: say which, first.
        module("tasks.filenames", "check"),
        module("flows.server", "ensure"),
        # One writer: the whole repro holds the workspace lock (its stages pass under it).
        module("tasks.workspace_lock", "--", sys.executable, "-m", "dvc", "repro", *extra),
    ]


def accept_data_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.accept_data", *extra)]


def serve_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.server", "ensure"), module("flows.deployments", *extra)]


def predict_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.predict", *extra)]


def bench_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.server", "ensure"), module("bench", *extra)]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def listen_address(extra: Sequence[str], preferred: int | None = None) -> tuple[list[str], str]:
    """``--host 127.0.0.1 [--port N]`` and the URL: the ``--port`` given in ``extra``, else
    ``preferred`` while nothing listens there, else a free one (no fixed port: clones share
    machines, and a second UI must not collide)."""
    if "--port" in extra:
        return ["--host", HOST], f"http://{HOST}:{extra[extra.index('--port') + 1]}"
    port = preferred if preferred is not None and port_is_free(preferred) else free_port()
    return ["--host", HOST, "--port", str(port)], f"http://{HOST}:{port}"


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def ui_steps(extra: Sequence[str]) -> Steps:
    # MLFLOW_UI_URL's port first: the run links a local store's runs carry open there.
    address, url = listen_address(extra, preferred=urlsplit(MLFLOW_UI_URL).port)
    print(f"MLflow UI: {url}", flush=True)
    return [module("mlflow", "ui", "--backend-store-uri", tracking_uri(), *address, *extra)]


def serve_model_steps(extra: Sequence[str]) -> Steps:
    """``python -m tasks.serve`` (MLflow's scoring app behind request limits) for the
    champion of ``evaluate.model_name``; a limit given in ``extra`` replaces its default."""
    from tasks.params import load_params
    from tasks.store_check import check_store

    # tasks.serve reads the store from MLFLOW_TRACKING_URI (main() passes this process's
    # environment on), absolute so its workers find the same file.
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path.cwd() / 'mlflow.db'}")
    model = f"models:/{load_params().evaluate.model_name}@champion"
    # a store that lost the project's runs has no champion: say so, and the one rebuild,
    # before MLflow fails inside the server with its traceback
    check_store(Path.cwd())
    address, _ = listen_address(extra)  # tasks.serve prints the address it serves
    limits = [item for limit in SERVE_LIMITS.items() if limit[0] not in extra for item in limit]
    return [module("tasks.serve", model, *address, *limits, *extra)]


def team_demo_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.team_demo", *extra)]


def team_deploy_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.team", "deploy", *extra)]


def stop_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.server", "stop", *extra)]


# name -> (help line, steps); the order is the order of `shardflow --help`.
COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], Steps]]] = {
    "run": ("demo data if missing, Prefect server, then the whole pipeline (dvc repro)", run_steps),
    "accept-data": (
        "accept the shards validation refused as the data baseline: --fingerprint F --reason R",
        accept_data_steps,
    ),
    "serve": ("Prefect server plus a process serving the deployments", serve_steps),
    "predict": ("batch prediction: python -m flows.predict SOURCE [options]", predict_steps),
    "bench": ("benchmarks -> reports/bench.json and bench.png (--quick: a smoke run)", bench_steps),
    "ui": ("MLflow UI on a free 127.0.0.1 port over the project's tracking store", ui_steps),
    "serve-model": (
        "the champion over HTTP, within request limits, on a free port",
        serve_model_steps,
    ),
    "stop": ("stop the Prefect server that this clone's run/serve/bench started", stop_steps),
    "team-deploy": (
        "prefect deploy --all of prefect.yaml's team deployments: --cpu-pool P --gpu-pool P "
        "(default $SHARDFLOW_CPU_POOL / $SHARDFLOW_GPU_POOL, else cpu / gpu)",
        team_deploy_steps,
    ),
    "team-demo": (
        "a whole team on this machine (servers, S3, git remote, cpu+gpu workers): run the "
        "pipeline through it, show what ran where, stop it all",
        team_demo_steps,
    ),
}


def prefect_ui() -> str:
    try:
        return api_url().removesuffix("/api")
    except RuntimeError as error:
        return str(error)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardflow",
        description="Image folders to validated TFRecord shards and tracked Keras models.",
        epilog="Arguments after the subcommand go to the command it runs "
        "(e.g. `shardflow bench --quick`, `shardflow run --force`).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_line, _) in COMMANDS.items():
        commands.add_parser(name, help=help_line, description=help_line)
    return parser


def environment() -> dict[str, str]:
    """This process's environment with what every step runs with (the Makefile exports the
    same: :func:`flows.common.configure_environment`, DVC's site cache among the libraries'
    files in the repository), this interpreter's bin first."""
    env = dict(os.environ)
    configure_environment(env)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def teed(step: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run ``step`` with its standard output shown as it comes and kept (unbuffered, so its
    lines keep their place among the standard error's)."""
    kept: list[str] = []
    with subprocess.Popen(
        step, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            kept.append(line)
    return process.returncode, kept


def refused(command: str, error: Refused) -> int:
    print(f"shardflow {command}: refused: {error}\nfix: {error.fix}", file=sys.stderr)
    return 1


def store_refusal() -> int:
    """1 after saying so when the tracking store lost the runs the reports name (stale
    reports a skipped evaluation would summarise as the champion), else 0."""
    from tasks.store_check import check_store

    try:
        check_store(Path.cwd())
    except Refused as error:
        return refused("run", error)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand's steps in order; the exit code is the first failing step's. ``run``
    ends with a summary read from the outputs (:mod:`flows.run_summary`)."""
    args, extra = build_parser().parse_known_args(argv)
    keep_dvc_site_cache_in_repository(Path.cwd())  # for the `dvc` a user types here, too
    try:
        steps = COMMANDS[args.command][1](extra)
    except Refused as error:  # a check a command makes before it starts (serve-model's store)
        return refused(args.command, error)
    env = environment()
    output: list[str] = []
    for i, step in enumerate(steps):
        if args.command == "run" and i == len(steps) - 1:  # dvc repro: its lines name stages
            code, output = teed(step, env)
        else:
            code = subprocess.run(step, env=env).returncode
        if code != 0:
            print(f"shardflow {args.command}: `{' '.join(step)}` exited {code}", file=sys.stderr)
            return code
    if args.command == "run":
        from flows.run_summary import stage_outcomes, summary_lines

        if "evaluate" not in stage_outcomes(output)[0] and (refusal := store_refusal()):
            return refusal

        print("\nShardflow run done:")
        for line in summary_lines(Path.cwd(), output):
            print(f"  {line}")
        print(f"  Prefect UI: {prefect_ui()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
