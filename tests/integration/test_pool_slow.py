"""The stage worker pool: every worker spawned and warmed at once, before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.runtime import latency
from tasks.runtime.latency import dismiss_prestarted, prestart_pool
from tasks.runtime.processes import run_in_child, spawn_pool

pytestmark = pytest.mark.slow

WARM_DIR = "SHARDFLOW_TEST_WARM_DIR"


def _warm() -> None:
    """Record which process warmed, and when (spawned workers inherit the environment)."""
    (Path(os.environ[WARM_DIR]) / str(os.getpid())).write_text(repr(time.monotonic()))


def _work(seconds: float) -> tuple[int, float]:
    time.sleep(seconds)
    return os.getpid(), time.monotonic()


def _boom() -> None:
    raise ValueError("worker failure names itself")


def test_every_worker_starts_and_warms_once_before_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WARM_DIR, str(tmp_path))
    with spawn_pool(2, warm=_warm) as pool:
        # Both workers exist before any work is submitted (a plain pool spawns on demand).
        assert len(pool._processes) == 2  # type: ignore[attr-defined]
        done = list(pool.map(_work, [0.3] * 4))
    warmed = {int(p.name): float(p.read_text()) for p in tmp_path.iterdir()}
    assert len(warmed) == 2  # one warm-up per worker, not per task
    assert {pid for pid, _ in done} <= set(warmed)
    for pid, finished in done:
        assert warmed[pid] < finished


def test_a_prestarted_pool_is_taken_by_the_spawn_pool_of_its_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's entry point starts the workers; its pool later takes them, warm, and
    spawns none of its own; a pool of another shape does not take them."""
    monkeypatch.setenv(WARM_DIR, str(tmp_path))
    prestart_pool(2, warm=_warm)
    try:
        with spawn_pool(1, warm=_warm) as other:  # another shape: a pool of its own
            (other_pid, _) = other.submit(_work, 0).result()
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the prestarted workers warm up without being asked
        warmed = {int(p.name) for p in tmp_path.iterdir()} - {other_pid}
        assert len(warmed) == 2
        with spawn_pool(2, warm=_warm) as pool:
            done = list(pool.map(_work, [0.2] * 4))
        assert {pid for pid, _ in done} <= warmed
        assert len(list(tmp_path.iterdir())) == 3  # nothing spawned or warmed again
        assert not latency._prestarted
    finally:
        dismiss_prestarted()


def test_a_prestarted_pool_nobody_takes_is_dismissed() -> None:
    prestart_pool(2)
    (pool,) = latency._prestarted.values()
    processes = list(pool._processes.values())  # type: ignore[attr-defined]
    dismiss_prestarted()
    assert not latency._prestarted
    for process in processes:
        process.join(30)
        assert not process.is_alive()


def test_a_worker_error_reaches_the_caller() -> None:
    with spawn_pool(1) as pool, pytest.raises(ValueError, match="names itself"):
        pool.submit(_boom).result()


def _square_and_pid(value: int) -> tuple[int, int]:
    return value * value, os.getpid()


def test_run_in_child_returns_the_value_and_the_child_is_gone() -> None:
    child = run_in_child(_square_and_pid, 7)
    value, pid = child.result(timeout=60)
    assert value == 49 and pid != os.getpid()
    assert not child._process.is_alive()  # type: ignore[attr-defined]


def test_run_in_child_raises_the_childs_error() -> None:
    with pytest.raises(ValueError, match="names itself") as raised:
        run_in_child(_boom).result(timeout=60)
    # Where it was raised travels with it: the child's traceback, as a note.
    (note,) = raised.value.__notes__
    assert note.startswith("in the child process") and "in _boom" in note


def test_run_in_child_times_out_and_stops_the_child() -> None:
    child = run_in_child(_work, 30.0)
    with pytest.raises(TimeoutError):
        child.result(timeout=0.5)
    assert not child._process.is_alive()  # type: ignore[attr-defined]


def test_a_cancelled_child_job_stops_and_one_done_is_left_as_it_is() -> None:
    running = run_in_child(_work, 30.0)
    running.cancel()
    assert not running._process.is_alive()  # type: ignore[attr-defined]
    assert running._process.exitcode != 0  # type: ignore[attr-defined]
    done = run_in_child(_work, 0.0)
    assert done.result(timeout=60)[0] > 0
    done.cancel()  # nothing left to stop
    assert done._process.exitcode == 0  # type: ignore[attr-defined]


MAIN_MODULE = """
import sys
import heavy_marker  # stands for Prefect: what a stage's flow module imports
from probe import loaded
from tasks.runtime.processes import run_in_child, spawn_pool

if __name__ == "__main__":
    with spawn_pool(1) as pool:
        print(pool.submit(loaded).result(), run_in_child(loaded).result(60))
"""


def test_children_do_not_import_the_parents_main_module(tmp_path: Path) -> None:
    """`python -m flows.shard` must not make every worker import the flow module (Prefect)."""
    (tmp_path / "heavy_marker.py").write_text("")
    (tmp_path / "probe.py").write_text(
        "import sys\ndef loaded():\n    return 'heavy_marker' in sys.modules\n"
    )
    (tmp_path / "stage_main.py").write_text(MAIN_MODULE)
    done = run_main_module(tmp_path, "stage_main")
    assert done.stdout.split() == ["False", "False"]


def run_main_module(folder: Path, module: str) -> subprocess.CompletedProcess[str]:
    """``python -m module`` from ``folder`` (importable, with the repo), as a stage runs."""
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-m", module],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{repo}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done


def _warm_then_record(path: str) -> None:
    time.sleep(0.2)
    Path(path).write_text(repr(time.monotonic()))


def _failing_warm() -> None:
    raise ImportError("no such library")


def test_a_standby_child_warms_first_then_runs_the_job_sent_later(tmp_path: Path) -> None:
    import functools

    from tasks.runtime.processes import StandbyChild

    marker = tmp_path / "warmed"
    child = StandbyChild(functools.partial(_warm_then_record, str(marker)))
    value, pid = child.run(_square_and_pid, 6).result(timeout=60)
    assert value == 36 and pid != os.getpid() and marker.exists()  # warmed before the job
    assert not child._process.is_alive()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="one job"):
        child.run(_square_and_pid, 1)


def _count_aloud(n: int) -> int:
    from tasks.runtime.processes import report

    for i in range(n):
        report(("step", i, os.getpid()))
    return n * 10


def test_a_childs_job_reports_to_the_parent_while_it_runs() -> None:
    """Messages a job sends with report() reach on_report in order, before its value."""
    from tasks.runtime.processes import StandbyChild

    seen: list[object] = []
    value = StandbyChild(_started_noop).run(_count_aloud, 3).result(60, on_report=seen.append)
    assert value == 30
    assert [step for _, step, _ in seen] == [0, 1, 2]  # type: ignore[misc]
    assert {pid for _, _, pid in seen} != {os.getpid()}  # type: ignore[misc]
    assert run_in_child(_count_aloud, 2).result(60) == 20  # no handler: reports are dropped


def test_a_failing_report_handler_does_not_stop_the_job() -> None:
    def broken(message: object) -> None:
        raise ValueError("the handler's own problem")

    assert run_in_child(_count_aloud, 2).result(60, on_report=broken) == 20


def test_report_outside_a_childs_job_says_so() -> None:
    from tasks.runtime.processes import report

    with pytest.raises(RuntimeError, match="job running in a child"):
        report("hello")


def test_a_standby_childs_failed_warm_up_is_reported_on_its_job() -> None:
    from tasks.runtime.processes import StandbyChild

    with pytest.raises(RuntimeError, match="warm-up failed: ImportError: no such library"):
        StandbyChild(_failing_warm).run(_square_and_pid, 2).result(timeout=60)


def test_a_standby_child_that_gets_no_job_ends() -> None:
    from tasks.runtime.processes import StandbyChild

    child = StandbyChild(_started_noop)
    child.close()
    child._process.join(60)  # type: ignore[attr-defined]
    assert child._process.exitcode == 0  # type: ignore[attr-defined]


def _started_noop() -> None:
    """A warm-up with nothing to do."""


LOCK_HOLDER = """
import multiprocessing
def hold_lock():
    global LOCK
    LOCK = multiprocessing.RLock()  # as tqdm's write lock does for MLflow's download bars
    return "ok"
"""

LOCK_MAIN = """
import time
from lock_holder import hold_lock
from tasks.runtime.processes import StandbyChild, run_in_child
if __name__ == "__main__":
    print(StandbyChild(time.time).run(hold_lock).result(60), run_in_child(hold_lock).result(60))
"""


def test_a_childs_semaphores_are_released_when_it_ends(tmp_path: Path) -> None:
    """One-job children end at once, yet clean up after themselves: a job that made a
    lock must not leave its stage ending on a "leaked semaphore objects" warning."""
    (tmp_path / "lock_holder.py").write_text(LOCK_HOLDER)
    (tmp_path / "lock_main.py").write_text(LOCK_MAIN)
    done = run_main_module(tmp_path, "lock_main")
    assert done.stdout.split() == ["ok", "ok"]
    assert "leaked semaphore" not in done.stderr, done.stderr


KILLED_PARENT = """
import sys, time
from tasks.runtime.latency import prestart_pool, _prestarted
from tasks.runtime.processes import StandbyChild, run_in_child
job = run_in_child(time.sleep, 120)
standby = StandbyChild(time.time)
standby.run(time.sleep, 120)
prestart_pool(1)
(pool,) = _prestarted.values()
pool.submit(time.sleep, 120)
time.sleep(2)  # every child is up and in its sleep
pids = [job._process.pid, standby._process.pid, *pool._processes]
print(" ".join(map(str, pids)), flush=True)
time.sleep(120)
"""


def test_children_end_when_their_parent_is_killed(tmp_path: Path) -> None:
    """A stage killed outright leaves no child working on: run_in_child's, a standby
    child's and a pool's workers all end within a second or so of their parent."""
    import signal

    import psutil

    script = tmp_path / "parent.py"
    script.write_text(KILLED_PARENT)
    repo = Path(__file__).resolve().parents[3]
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert parent.stdout is not None
    pids = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(pids) == 3 and all(psutil.pid_exists(pid) for pid in pids)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if _running(pid)]
    assert alive == []


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("stage", ["flows.launch.evaluate", "flows.launch.validate"])
def test_a_stages_prestarted_child_starts_with_the_offline_settings(
    stage: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The child is spawned before the stage's own set-up: it must already see the offline
    environment (MLflow's telemetry off), as the stage process does."""
    import importlib
    import runpy

    from flows.support import entry as common

    seen: list[str | None] = []
    monkeypatch.chdir(tmp_path)  # whatever runs, nothing lands in the checkout
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setattr(
        latency,
        "prestart_child",
        lambda warm: seen.append(os.environ.get("MLFLOW_DISABLE_TELEMETRY")),
    )
    # The stage itself does not run (no server, no flow): its flow module's main() is
    # replaced where the command calls it, whenever that module was first imported.
    flow = importlib.import_module(stage.replace(".launch", ""))
    monkeypatch.setattr(flow, "main", lambda: seen.append("stage"))
    monkeypatch.setattr(common, "run_then_exit", lambda main: main())
    runpy.run_module(stage, run_name="__main__")
    assert seen == ["true", "stage"]


# A stage's command run as `python -m` runs it, with the start of its children, the stage's
# run and the exit replaced by notes of what happened, in order, each with whether Prefect
# was imported by then: no server, no flow, no child.
COMMAND_ORDER = """
import json, runpy, sys
from flows.support import entry
from tasks.runtime import latency, processes
from tasks.shard import workers

events = []

def note(what):
    return lambda *args, **kwargs: events.append([what, "prefect" in sys.modules])

processes.usable_cores = lambda: 2  # a rebuild's 2 workers, on any machine
latency.prestart_child = note("child")
workers.prestart_pool = note("workers")
entry.stage_main = lambda *args: events.append(["stage", "prefect" in sys.modules])
entry.run_then_exit = lambda main: main()
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
print(json.dumps(events))
"""


@pytest.mark.parametrize(
    ("stage", "children"),
    [("shard", "workers"), ("validate", "child"), ("train", "child"), ("evaluate", "child")],
)
def test_a_stages_command_starts_its_children_before_prefect_is_imported(
    stage: str, children: str, tmp_path: Path
) -> None:
    """The command dvc.yaml runs for a stage starts the stage's children (a TensorFlow child,
    a rebuild's shard workers) before the stage imports Prefect (over a second of imports),
    so those imports overlap; then the stage runs, its flow module imported."""
    import yaml

    from tasks.runtime.stage_deps import entry_module

    repo = Path(__file__).resolve().parents[2]
    cmd = str(yaml.safe_load((repo / "dvc.yaml").read_text())["stages"][stage]["cmd"])
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["shard"].update(workers=2, mode="rebuild", runner="local")  # workers from the start
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {k: v for k, v in os.environ.items() if k not in {"TF_CONFIG", "SHARDFLOW_TRAIN_WORKERS"}}
    command = [sys.executable, "-c", COMMAND_ORDER, entry_module(cmd)]
    ran = subprocess.run(
        [*command, "--params", str(tmp_path / "params.yaml")],
        cwd=repo,
        env={**env, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.splitlines()[-1]) == [[children, False], ["stage", True]]
