"""``shardflow``: one entry point for what the Makefile runs (``shardflow --help`` lists it).

Each subcommand is a short list of steps, each one command run with this interpreter (so
``dvc``, ``mlflow`` and DVC's ``python -m flows.<stage>`` commands use the same environment),
stopping at the first that fails. The Makefile's targets call this module, so the two never
drift apart. Run it from the repository root: DVC, Prefect (``prefect.toml``) and MLflow
(``mlflow.db``) all resolve their files there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from flows.servers.prefect_server import api_url, free_port
from flows.support.environment import configure_environment
from tasks.runtime import tracking
from tasks.runtime.layout import keep_dvc_site_cache_in_repository
from tasks.runtime.refusals import BLOCK_HEAD, REFUSED_EXIT, refusing
from tasks.runtime.tracking import MLFLOW_UI_URL

DEMO_DIR = "data/demo"
HOST = "127.0.0.1"
# `shardflow serve-model`'s request limits (about 12 MB of image files in base64, and rows
# a batch at a time): larger requests get HTTP 413 before their body is parsed. Four at once
# hold at most 64 MB of bodies, and their parses several times that (docs/performance.md
# has the measured peak); a fifth gets HTTP 503.
SERVE_LIMITS = {
    "--max-request-mb": "16",
    "--max-request-rows": "1024",
    "--max-concurrent-requests": "4",
    "--alias-poll-s": "10",  # the champion alias read this often, its version served
}

Steps = list[list[str]]


def module(name: str, *args: str) -> list[str]:
    """``python -m name args`` with this interpreter."""
    return [sys.executable, "-m", name, *args]


def run_steps(extra: Sequence[str]) -> Steps:
    return [
        module(
            "tasks.runtime.params", "check", "params.yaml"
        ),  # a bad key: refused naming it first
        # the demo set only where params.yaml reads it, and only once
        module("tasks.ingest.demo_data", DEMO_DIR, "--if-missing", "--if-source", "params.yaml"),
        # DVC cannot hash a folder holding a file name that is not UTF-8: say which, first.
        module("tasks.ingest.filenames", "check"),
        module("flows.servers.prefect_server", "ensure"),
        # One writer: the whole repro holds the workspace lock (its stages pass under it).
        module("tasks.runtime.workspace_lock", "--", sys.executable, "-m", "dvc", "repro", *extra),
    ]


def accept_data_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.cli.accept_data", *extra)]


def serve_steps(extra: Sequence[str]) -> Steps:
    return [
        module("flows.servers.prefect_server", "ensure"),
        module("flows.cli.deployments", *extra),
    ]


def predict_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.predict", *extra)]


def bench_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.servers.prefect_server", "ensure"), module("bench", *extra)]


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


def ui_steps(extra: Sequence[str]) -> Steps:
    """The MLflow UI over the project's store (:func:`tasks.runtime.tracking.tracking_uri`, the one
    recipe every entry point uses). A tracking server has a UI of its own: it is named, and
    nothing starts."""
    uri = tracking.tracking_uri()
    if urlsplit(uri).scheme in ("http", "https"):
        print(f"MLflow UI: {tracking.redact(uri)} (the tracking server's own)", flush=True)
        return []
    # MLFLOW_UI_URL's port first: the run links a local store's runs carry open there.
    address, url = listen_address(extra, preferred=urlsplit(MLFLOW_UI_URL).port)
    store = Path(uri.removeprefix(tracking.SQLITE)) if uri.startswith(tracking.SQLITE) else None
    if store is None or store.exists():  # never a new, empty store made just to look
        url = tracking.runs_table_url(url, tracking.client())
    print(f"MLflow UI: {url} (the experiment's runs)", flush=True)
    # The store goes by the environment (main() passes it on), never on the command line,
    # which every user of the machine can read (ps).
    os.environ["MLFLOW_BACKEND_STORE_URI"] = uri
    return [module("mlflow", "ui", *address, *ui_workers(extra), *extra)]


def ui_workers(extra: Sequence[str]) -> list[str]:
    """One server process for the UI unless ``extra`` names a count: one person's browser
    over a local SQLite store needs no more, and `mlflow ui`'s default of 4 started five
    processes each importing MLflow's server (about 15 s of CPU before the UI answered, 5 s
    with one)."""
    named = any(arg in ("-w", "--workers") or arg.startswith("--workers=") for arg in extra)
    return [] if named else ["--workers", "1"]


def serve_model_steps(extra: Sequence[str]) -> Steps:
    """``python -m tasks.serve.server`` (MLflow's scoring app behind request limits) for the
    champion of the current dataset's registered model (``evaluate.model_name``, else named
    after the dataset); a limit given in ``extra`` replaces its default."""
    from tasks.evaluate.store_check import check_store
    from tasks.runtime.dataset_identity import model_name_for
    from tasks.runtime.params import load_params

    # tasks.serve.server reads the store from MLFLOW_TRACKING_URI (main() passes this process's
    # environment on): absolute, so its workers find the same file, and a server's
    # credentials in MLflow's own variables, never in a URI or on a command line.
    os.environ["MLFLOW_TRACKING_URI"] = tracking.tracking_uri()
    model = f"models:/{model_name_for(load_params(), Path.cwd())}@champion"
    # a store that lost the project's runs has no champion: say so, and the one rebuild,
    # before MLflow fails inside the server with its traceback
    check_store(Path.cwd())
    address, _ = listen_address(extra)  # tasks.serve.server prints the address it serves
    limits = [item for limit in SERVE_LIMITS.items() if limit[0] not in extra for item in limit]
    return [module("tasks.serve.server", model, *address, *limits, *extra)]


def stages_steps(extra: Sequence[str]) -> Steps:
    return [module("tasks.runtime.stage_deps", *extra)]


def lineage_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.cli.lineage", *extra)]


def forget_steps(extra: Sequence[str]) -> Steps:
    # its pipeline step runs the stages: the Prefect server they report to, first
    return [
        module("flows.servers.prefect_server", "ensure"),
        module("flows.forget.orchestration", *extra),
    ]


def team_demo_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.demo.team_demo", *extra)]


def team_deploy_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.team", "deploy", *extra)]


def promote_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.cli.promote", *extra)]


def retract_steps(extra: Sequence[str]) -> Steps:
    return [module("flows.cli.retract", *extra)]


def stop_steps(extra: Sequence[str]) -> Steps:
    # what the clone's commands recorded first: a deployment process outliving its Prefect
    # server prints a traceback for each poll it fails
    return [
        module("tasks.runtime.services", "stop"),
        module("flows.servers.prefect_server", "stop", *extra),
    ]


# name -> (help line, steps); the order is the order of `shardflow --help`.
COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], Steps]]] = {
    "run": (
        "params.yaml checked, the demo data if it reads data/demo and that is missing, Prefect "
        "server, then the whole pipeline (dvc repro)",
        run_steps,
    ),
    "accept-data": (
        "accept the shards validation refused as the data baseline: --fingerprint F --reason R",
        accept_data_steps,
    ),
    "lineage": (
        "which shard sets, training runs and model versions used an image: IMAGE... [--json]",
        lineage_steps,
    ),
    "forget": (
        "remove images and their near-duplicates from the data, shards, caches, tracking "
        "store and models: IMAGE... --reason R [--exact] [--models retrain|delete|keep]",
        forget_steps,
    ),
    "serve": ("Prefect server plus a process serving the deployments", serve_steps),
    "predict": ("batch prediction: python -m flows.predict SOURCE [options]", predict_steps),
    "bench": ("benchmarks -> reports/bench.json and bench.png (--quick: a smoke run)", bench_steps),
    "ui": (
        "MLflow UI over the project's tracking store on 127.0.0.1:5000 while that is free, "
        "else a free port; prints the address of the experiment's runs table",
        ui_steps,
    ),
    "serve-model": (
        "the champion over HTTP, within request limits, on a free port; follows the alias "
        "(a promotion or retraction changes the version served)",
        serve_model_steps,
    ),
    "promote": (
        "move the champion alias by hand, recorded: --version N --reason R (same task only)",
        promote_steps,
    ),
    "retract": (
        "retract a version by hand, recorded: --version N --reason R (it loses every alias; "
        "promote and the loaders refuse it)",
        retract_steps,
    ),
    "stop": (
        "stop what this clone's commands started and recorded: serve's deployment process, "
        "serve-model and ui servers, then the Prefect server (never another clone's, nor a "
        "process started by hand)",
        stop_steps,
    ),
    "stages": (
        "write dvc.yaml's source deps from each stage's imports: --write, or --check (exit 1 "
        "where they differ)",
        stages_steps,
    ),
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


# What `shardflow COMMAND --help` shows below the command's line: the options of the module
# the command runs (its own --help, so nothing is written twice), or what the command itself
# takes where it runs another tool.
NO_OPTIONS = "options: none"
OPTIONS: dict[str, list[str] | str] = {
    "run": (
        "options: those of `dvc repro` (`dvc repro --help`), passed on:\n"
        "  -f, --force        rerun every stage, changed or not\n"
        "  STAGE              run only up to that stage (ingest, shard, validate, train, evaluate)"
    ),
    "accept-data": ["flows.cli.accept_data", "--help"],
    "serve": NO_OPTIONS,
    "predict": ["flows.predict", "--help"],
    "bench": ["bench", "--help"],
    "ui": (
        "options: those of `mlflow ui` (`mlflow ui --help`), passed on:\n"
        f"  --port N           listen on N (default {urlsplit(MLFLOW_UI_URL).port} while free, "
        "else a free port)\n"
        "  --workers N        server processes (default 1; `mlflow ui`'s own default is 4)"
    ),
    "serve-model": "options:\n  --port N                     listen on N (default: a free port)\n"
    + "\n".join(
        f"  {flag} N".ljust(31) + f"default {value}" for flag, value in SERVE_LIMITS.items()
    ),
    "stop": NO_OPTIONS,
    "team-deploy": ["flows.team", "deploy", "--help"],
    "team-demo": NO_OPTIONS,
    "lineage": ["flows.cli.lineage", "--help"],
    "forget": ["flows.forget.orchestration", "--help"],
    "promote": ["flows.cli.promote", "--help"],
    "retract": ["flows.cli.retract", "--help"],
    "stages": ["tasks.runtime.stage_deps", "--help"],
}


def show_help(command: str, env: dict[str, str]) -> int:
    """``shardflow COMMAND --help``: what the command does, then its options."""
    print(f"usage: shardflow {command} [options]\n\n{COMMANDS[command][0]}\n")
    options = OPTIONS[command]
    if isinstance(options, str):
        print(options)
        return 0
    print(f"options ({' '.join(['python -m', *options[:-1]])}):", flush=True)
    return subprocess.run(module(*options), env=env).returncode


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
        # -h/--help reaches run_command, which shows the command's options (show_help)
        commands.add_parser(name, help=help_line, description=help_line, add_help=False)
    return parser


def environment() -> dict[str, str]:
    """This process's environment with what every step runs with (the Makefile exports the
    same: :func:`flows.support.environment.configure_environment`, DVC's site cache among the
    libraries' files in the repository), this interpreter's bin first."""
    env = dict(os.environ)
    configure_environment(env)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


# How long a step's processes get to stop after the signal is passed on, before SIGKILL.
STOP_GRACE_S = 10.0


class Stopped(Exception):
    """This process was asked to stop (SIGTERM, SIGINT) while a step ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def stopping_with(process: subprocess.Popen[Any]) -> Iterator[None]:
    """SIGTERM or SIGINT to ``shardflow`` stops ``process`` and every process it started.

    A step runs in a session of its own, so a service manager's, a container's or a CI job's
    SIGTERM to ``shardflow`` alone no longer leaves a server it started answering (Ctrl-C
    reached them through the terminal's process group; a ``kill`` did not). The signal is
    passed on to the step's whole group; what is still there after ``STOP_GRACE_S`` gets
    SIGKILL. Servers a step started detached (this clone's Prefect server) are left up.
    """

    try:
        with stopped_on_signal():
            yield
    except Stopped as stopped:
        end_group(process, stopped.signum)
        raise


@contextmanager
def stopped_on_signal() -> Iterator[None]:
    """SIGTERM or SIGINT inside raises :class:`Stopped` (the command exits 128+signal), where
    the signal's default would end this process there and then."""

    def stop(signum: int, _: object) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def end_group(process: subprocess.Popen[Any], signum: int) -> None:
    """``signum`` to ``process``'s process group, then SIGKILL to what is left of it after
    ``STOP_GRACE_S``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and group_alive(process):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def group_alive(process: subprocess.Popen[Any]) -> bool:
    """Whether any process of ``process``'s group is left (the leader reaped as it ends)."""
    process.poll()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


# The commands whose steps run until stopped: recorded while they run, so `shardflow stop`
# (`make stop`) stops them (tasks.runtime.services).
SERVICES = ("serve", "ui", "serve-model")


def run_step(step: list[str], env: dict[str, str], service: str | None = None) -> int:
    """Run ``step`` in a session of its own (:func:`stopping_with`); its exit status. A
    ``service`` step is recorded under the clone while it runs (:func:`recorded_while`)."""
    with (
        subprocess.Popen(step, env=env, start_new_session=True) as process,
        stopping_with(process),
        recorded_while(process, service, step),
    ):
        return process.wait()


@contextmanager
def recorded_while(
    process: subprocess.Popen[Any], service: str | None, step: list[str]
) -> Iterator[None]:
    """``process`` (a group leader) recorded as this clone's ``service`` until it ends."""
    from tasks.runtime import services

    if service is None:
        yield
        return
    services.record_started(process.pid, service, step)
    try:
        yield
    finally:
        services.forget_started(process.pid)


def teed(step: list[str], env: dict[str, str]) -> tuple[int, list[str], list[str]]:
    """Run ``step`` as :func:`run_step` does, with its output (standard error merged, so
    the lines keep their order) shown as it comes and kept; a refusal block a stage printed
    (:func:`tasks.runtime.refusals.refusal_block`) is held back instead of shown, and
    returned, so that it can be shown last, after DVC's own lines about the failure."""
    kept: list[str] = []
    block: list[str] = []
    with subprocess.Popen(
        step,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as process:
        assert process.stdout is not None
        with stopping_with(process):
            holding = False
            for line in process.stdout:
                kept.append(line)
                if BLOCK_HEAD.match(line.rstrip("\n")):
                    holding, block = True, [line]
                    continue
                if holding and line.startswith("  "):
                    block.append(line)
                    continue
                holding = False
                sys.stdout.write(line)
                sys.stdout.flush()
            process.wait()
    return process.returncode, kept, block


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand's steps in order; the exit code is the first failing step's. ``run``
    ends with a summary read from the outputs (:mod:`flows.cli.run_summary`). A refusal here
    (params.yaml read to build a step) is one short block, as in the steps."""
    try:
        with stopped_on_signal():  # between two steps too, not only within one
            return refusing(lambda: run_command(argv), "shardflow")
    except Stopped as stopped:  # its steps stopped with it (stopping_with)
        return 128 + stopped.signum


def run_command(argv: Sequence[str] | None) -> int:
    """:func:`main`'s work."""
    args, extra = build_parser().parse_known_args(argv)
    if {"-h", "--help"} & set(extra):
        return show_help(args.command, environment())
    keep_dvc_site_cache_in_repository(Path.cwd())  # for the `dvc` a user types here, too
    steps = COMMANDS[args.command][1](extra)  # a refusal here is main()'s block too
    env = environment()
    output: list[str] = []
    for i, step in enumerate(steps):
        refusal: list[str] = []
        if args.command == "run" and i == len(steps) - 1:  # dvc repro: its lines name stages
            code, output, refusal = teed(step, env)
        else:
            code = run_step(step, env, args.command if args.command in SERVICES else None)
        if code != 0 and refusal:
            # a stage refused: its block last, with the refusal's exit status (DVC's own is
            # 255 whatever the stage's was)
            sys.stderr.write("".join(refusal))
            return REFUSED_EXIT
        if code != 0:
            if code != REFUSED_EXIT:  # a refusal said what, why and the fix itself
                print(
                    f"shardflow {args.command}: `{' '.join(step)}` exited {code}", file=sys.stderr
                )
            return code
    if args.command == "run":
        from flows.cli.run_summary import stage_outcomes, summary_lines
        from tasks.evaluate.store_check import check_store

        if "evaluate" not in stage_outcomes(output)[0]:
            # stale reports would summarise a champion the store no longer holds
            check_store(Path.cwd())

        print("\nShardflow run done:")
        for line in summary_lines(Path.cwd(), output):
            print(f"  {line}")
        print(f"  Prefect UI: {prefect_ui()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
