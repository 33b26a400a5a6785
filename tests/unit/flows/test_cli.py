"""The `shardflow` console script: its subcommands are what the Makefile runs."""

from __future__ import annotations

import contextlib
import io
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from flows.cli import shardflow as cli
from tasks.runtime.params import shipped_params_text

ROOT = Path(__file__).resolve().parents[3]
COMMANDS = [
    *["run", "accept-data", "lineage", "forget", "serve", "predict", "bench", "ui"],
    *["serve-model", "promote", "retract", "stop", "stages"],
    *["team-deploy", "team-demo"],
]


def test_console_script_points_at_main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["shardflow"] == "flows.cli.shardflow:main"


@pytest.mark.parametrize("target", ["run", "serve", "bench", "ui", "serve-model", "stop"])
def test_makefile_targets_go_through_the_cli(target: str) -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert recipe is not None and f"-m flows.cli {target}" in recipe.group(1)


class Recorder:
    """Stands in for subprocess.run: records each step and fails the ones it is told to."""

    def __init__(self, fail: str | None = None) -> None:
        self.steps: list[list[str]] = []
        self.envs: list[dict[str, str]] = []
        self.services: list[str | None] = []  # what each step was recorded as
        self.fail = fail

    def __call__(self, step: list[str], env: dict[str, str], **_: Any) -> Any:
        self.steps.append(step)
        self.envs.append(env)
        failed = self.fail is not None and self.fail in " ".join(step)
        return subprocess.CompletedProcess(step, 3 if failed else 0)

    def step(self, step: list[str], env: dict[str, str], service: str | None = None) -> int:
        """Stands in for :func:`flows.cli.shardflow.run_step`."""
        self.services.append(service)
        return int(self(step, env).returncode)


def test_stop_and_predict_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    assert cli.main(["stop"]) == 0
    assert cli.main(["predict", "photos", "--model", "3"]) == 0
    assert recorder.steps == [
        [sys.executable, "-m", "tasks.runtime.services", "stop"],  # what the clone recorded
        [sys.executable, "-m", "flows.servers.prefect_server", "stop"],
        [sys.executable, "-m", "flows.predict", "photos", "--model", "3"],
    ]
    assert recorder.services == [None, None, None]  # none of them a service
    env = recorder.envs[0]
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert env["MLFLOW_DISABLE_TELEMETRY"] == "true"


def test_run_stops_at_the_first_failing_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    recorder = Recorder(fail="flows.servers.prefect_server ensure")
    monkeypatch.setattr(cli, "run_step", recorder.step)
    assert cli.main(["run"]) == 3
    assert [step[2] for step in recorder.steps] == [
        "tasks.runtime.params",
        "tasks.ingest.demo_data",
        "tasks.ingest.filenames",
        "flows.servers.prefect_server",
    ]
    assert "flows.servers.prefect_server ensure` exited 3" in capsys.readouterr().err


# `dvc repro` where a stage refused: the stage's block on standard error, then DVC's own line,
# and DVC's exit status 255.
REFUSING_REPRO = """
import sys
print("Running stage 'train':", flush=True)
print("Refused: train (ShardsNotValidated)", file=sys.stderr)
print("  the shards changed since validation", file=sys.stderr)
print("  fix: dvc repro validate", file=sys.stderr, flush=True)
print("ERROR: failed to reproduce 'train': failed to run: python -m flows.train, exited with 2",
      file=sys.stderr)
sys.exit(255)
"""


def test_ui_finds_the_store_as_every_entry_point_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One recipe (tasks.runtime.tracking.tracking_uri): the store named in the environment, else
    the
    repository's mlflow.db as an absolute URI, given to `mlflow ui` by its environment."""
    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_BACKEND_STORE_URI", "stale")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/elsewhere.db")
    cli.main(["ui"])
    assert recorder.envs[0]["MLFLOW_BACKEND_STORE_URI"] == "sqlite:////tmp/elsewhere.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    cli.main(["ui"])
    assert recorder.envs[1]["MLFLOW_BACKEND_STORE_URI"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert not any("sqlite" in arg for step in recorder.steps for arg in step)


def test_ui_serves_from_one_process_unless_a_count_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`mlflow ui` starts 4 server processes by default, each importing MLflow's server:
    one serves a person's browser; `--workers` / `-w` still choose, given once."""
    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'absent.db'}")
    given = [["--workers", "3"], ["-w", "2"], ["--workers=5"]]
    for extra in ([], *given):
        assert cli.main(["ui", *extra]) == 0
    default, *chosen = recorder.steps
    assert default[default.index("--workers") :][:2] == ["--workers", "1"]
    for step, extra in zip(chosen, given, strict=True):
        assert step[-len(extra) :] == extra and "1" not in step[step.index("ui") :], step


@pytest.mark.parametrize("command", ["ui", "serve-model"])
def test_no_credential_reaches_a_childs_command_line(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server's user:password@ moves to MLflow's variables; the child's argv (readable by
    every user through ps) and what is printed hold neither."""
    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    monkeypatch.chdir(ROOT)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:s3cret@mlflow.example:5000")
    store_holds_the_reports(monkeypatch)
    assert cli.main([command]) == 0
    printed = capsys.readouterr().out
    assert "s3cret" not in printed and "alice" not in printed
    assert all("s3cret" not in arg and "alice" not in arg for s in recorder.steps for arg in s)
    if command == "ui":  # a server has its own UI: named, nothing started
        assert recorder.steps == [] and "https://mlflow.example:5000" in printed
    else:
        (env,) = recorder.envs
        assert env["MLFLOW_TRACKING_URI"] == "https://mlflow.example:5000"
        assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == (
            "alice",
            "s3cret",
        )


def store_holds_the_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve-model's store check passes (the check itself: tests/unit/evaluate/test_store_check.py):
    these tests run in the repository, whose reports name runs of a store not here."""
    monkeypatch.setattr("tasks.evaluate.store_check.check_store", lambda root: None)


def no_tracking_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLFLOW_TRACKING_URI unset, and unset again afterwards even if serve-model sets it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset afterwards")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")


def port_of(step: list[str]) -> int:
    return int(step[step.index("--port") + 1])


def is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def serve_model_prints(step: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """What `python -m tasks.serve.server` (the step) prints before it becomes the uvicorn
    server."""
    import tasks.serve.server

    def become(*_: Any) -> None:
        raise SystemExit(0)

    monkeypatch.setattr(tasks.serve.server.os, "execve", become)
    output = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stdout(output):
        tasks.serve.server.main(step[3:])
    return output.getvalue()


@pytest.mark.parametrize("command", ["ui", "serve-model"])
def test_ui_and_serve_model_listen_on_a_free_port_they_print(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No fixed port: a second clone's `make ui` / `make serve-model` must not collide with
    the first's. The port is free when chosen, differs from one already taken, and is the
    one printed; `--port` still chooses it."""
    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    monkeypatch.chdir(ROOT)
    no_tracking_uri(monkeypatch)
    store_holds_the_reports(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli.main([command]) == 0
        port = port_of(recorder.steps[0])
        assert port != taken.getsockname()[1] and is_free(port)
    assert cli.main([command, "--port", "6123"]) == 0
    assert recorder.steps[1].count("--port") == 1 and port_of(recorder.steps[1]) == 6123
    if command == "ui":
        printed = capsys.readouterr().out
    else:
        printed = "".join(serve_model_prints(step, monkeypatch) for step in recorder.steps)
    assert f"http://127.0.0.1:{port}" in printed and "http://127.0.0.1:6123" in printed


def test_serve_model_serves_the_champion_of_params_with_its_limits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tasks.runtime.params import load_params

    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    (tmp_path / "params.yaml").write_text(shipped_params_text())
    monkeypatch.chdir(tmp_path)
    no_tracking_uri(monkeypatch)
    store_holds_the_reports(monkeypatch)
    cli.main(["serve-model"])
    cli.main(["serve-model", "--max-request-rows", "8"])
    assert load_params(tmp_path / "params.yaml").evaluate.model_name is None
    name = "shardflow"  # the demo's data keeps the project's name
    first, second = recorder.steps
    assert first[2:4] == ["tasks.serve.server", f"models:/{name}@champion"]
    assert recorder.envs[0]["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    for flag, default in cli.SERVE_LIMITS.items():  # every limit has its default
        assert first.count(flag) == 1 and first[first.index(flag) + 1] == default
    flag = "--max-request-rows"
    assert second.count(flag) == 1 and second[second.index(flag) + 1] == "8"
    assert "--max-request-mb" in second and "--max-concurrent-requests" in second


def test_serve_model_follows_the_current_dataset_s_registered_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """After switching ingest.source_dir to one's own photos, serve-model serves that
    dataset's champion (named after it), never the demo's."""
    from tasks.runtime.dataset_identity import dataset_identity, dataset_slug
    from tasks.runtime.run_overrides import apply_overrides

    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    monkeypatch.chdir(tmp_path)
    no_tracking_uri(monkeypatch)
    (tmp_path / "params.yaml").write_text(shipped_params_text())
    apply_overrides(tmp_path / "params.yaml", {"ingest": {"source_dir": "data/photos"}})
    cli.main(["serve-model"])
    slug = dataset_slug(dataset_identity("data/photos", None, tmp_path))
    assert recorder.steps[0][3] == f"models:/shardflow-{slug}@champion"


def test_unknown_subcommand_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["train"])
    assert exited.value.code == 2
    assert "invalid choice: 'train'" in capsys.readouterr().err


def test_ui_takes_the_port_run_links_open_while_it_is_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A local store's run links (Prefect artifacts, logs) open on MLFLOW_UI_URL's port, so
    `make ui` listens there while nothing else does, and on a free port once it is taken."""
    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    monkeypatch.chdir(ROOT)
    no_tracking_uri(monkeypatch)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        link_port = probe.getsockname()[1]
    monkeypatch.setattr(cli, "MLFLOW_UI_URL", f"http://127.0.0.1:{link_port}")
    assert cli.main(["ui"]) == 0
    assert port_of(recorder.steps[0]) == link_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", link_port))
        taken.listen()
        assert cli.main(["ui"]) == 0
    assert port_of(recorder.steps[1]) != link_port


def test_run_generates_the_demo_set_only_where_params_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardflow run` wrote the 3,007-file demo set whatever ingest.source_dir said, and
    said "data/demo exists; keeping it" on every run."""
    from tasks.ingest import demo_data

    step = next(s for s in cli.run_steps([]) if s[2] == "tasks.ingest.demo_data")
    monkeypatch.chdir(tmp_path)
    text = shipped_params_text()
    (tmp_path / "params.yaml").write_text(text.replace("source_dir: data/demo", "source_dir: mine"))
    demo_data.main([*step[3:], "--per-class", "2"])
    assert not (tmp_path / "data" / "demo").exists()
    (tmp_path / "params.yaml").write_text(
        text.replace("source_dir: data/demo", "source_dir: ./data/demo/")
    )
    demo_data.main([*step[3:], "--per-class", "2"])
    assert (tmp_path / "data" / "demo").is_dir()
    assert "generating the demo dataset into data/demo" in capsys.readouterr().out
    demo_data.main([*step[3:], "--per-class", "2"])
    assert capsys.readouterr().out == ""  # nothing to say when nothing happens


OPTIONS_SHOWN = {
    "run": ["--force"],
    "accept-data": ["--fingerprint", "--reason", "--by"],
    "predict": ["--model", "--output", "source"],
    "ui": ["--port"],
    "serve-model": ["--port", "--max-request-mb", "--max-concurrent-requests"],
    "team-deploy": ["--cpu-pool", "--gpu-pool"],
    "bench": ["--quick"],
    "lineage": ["--json", "IMAGE"],
    "forget": ["--reason", "--exact", "--models"],
    "promote": ["--version", "--reason", "--by", "--params"],
    "retract": ["--version", "--reason", "--by", "--params"],
    "stages": ["--write", "--check"],
    **{name: ["options: none"] for name in ("serve", "stop", "team-demo")},
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommands_help_lists_its_options(
    command: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """`shardflow predict --help` and four others showed only -h, though they take options."""
    assert cli.main([command, "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith(f"usage: shardflow {command}")
    assert all(option in out for option in OPTIONS_SHOWN[command]), out
    assert "Prefect server started" not in out  # help starts nothing


def test_the_readme_command_table_is_true() -> None:
    """It said every make target is also a `shardflow` command; five were not."""
    readme = (ROOT / "README.md").read_text()
    readme = readme[readme.index("The `make` targets and `shardflow` commands") :]
    readme = readme[: readme.index("\n\n", readme.index("| command |"))]
    makefile = (ROOT / "Makefile").read_text()
    targets = re.findall(r"^([a-z-]+):.*## ", makefile, flags=re.MULTILINE)
    rows = [line for line in readme.splitlines() if re.match(r"^\| `(make|shardflow) ", line)]
    in_table = set()
    for row in rows:
        first = row.split("|")[1]
        makes = re.findall(r"`make ([a-z-]+)`", first)
        commands = re.findall(r"`shardflow ([a-z-]+)`", first)
        in_table.update(makes)
        assert all(c in COMMANDS for c in commands), row
        if makes and not commands:
            assert "(make only)" in first, row
        for target in makes if commands else []:
            recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
            assert recipe and f"-m flows.cli {target}" in recipe.group(1), row
    assert set(targets) <= in_table


def test_the_readmes_demo_figures_are_the_demo_runs() -> None:
    """The README said 7 broken files where the demo run keeps 8 out of its shards."""
    import json

    readme = " ".join((ROOT / "README.md").read_text().split())
    report = json.loads((ROOT / "reports" / "ingest.json").read_text())
    kept_out = re.search(r"which keep (\d+) out of the shards: (\d+) quarantined", readme)
    assert kept_out is not None
    assert int(kept_out.group(1)) == report["quarantined_count"] + report["duplicate_count"]
    assert int(kept_out.group(2)) == report["quarantined_count"]


BETWEEN_STEPS = """
import os, signal, sys
from flows.cli import shardflow as cli

marker = sys.argv[1]
step = [sys.executable, "-c", "import sys; open(sys.argv[1], 'a').write('ran ')", marker]
cli.COMMANDS["run"] = ("two steps", lambda extra: [step, step])
real = cli.run_step


def then_sigterm(step, env, service=None):
    code = real(step, env, service)
    os.kill(os.getpid(), signal.SIGTERM)  # after the step, before the next one starts
    return code


cli.run_step = then_sigterm
sys.exit(cli.main(["run"]))
"""


def test_ui_prints_the_address_of_the_experiment_s_runs_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the UI's home, which opens on GenAI traces: the runs of the project's experiment
    (MLflow 3's `#/experiments/<id>/runs`), with the UI's telemetry off. A store not made
    yet is not made by looking: the bare address then."""
    from mlflow import MlflowClient

    from tasks.runtime.tracking import experiment_id

    recorder = Recorder()
    monkeypatch.setattr(cli, "run_step", recorder.step)
    monkeypatch.chdir(tmp_path)
    no_tracking_uri(monkeypatch)
    assert cli.main(["ui", "--port", "6124"]) == 0
    assert "MLflow UI: http://127.0.0.1:6124 (" in capsys.readouterr().out
    assert not (tmp_path / "mlflow.db").exists()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    made = experiment_id(MlflowClient(uri, uri))
    assert cli.main(["ui", "--port", "6124"]) == 0
    assert f"MLflow UI: http://127.0.0.1:6124/#/experiments/{made}/runs?workflowType=" in (
        capsys.readouterr().out
    )
    assert recorder.envs[-1]["MLFLOW_DISABLE_TELEMETRY"] == "true"
