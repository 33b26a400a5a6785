"""A stage process ends without the interpreter's teardown, but loses nothing on the way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from flows.support.entry import run_then_exit

out = Path(sys.argv[1])
atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))

def late_writer():  # a non-daemon thread still finishing its work
    time.sleep(0.3)
    out.with_suffix(".thread").write_text("done")

# A pool kept for the process's life, as MLflow's artifact repositories keep theirs: its idle
# non-daemon workers end only when the interpreter's exit tells them to.
POOL = ThreadPoolExecutor(2)

def main():
    threading.Thread(target=late_writer).start()
    POOL.submit(out.with_suffix(".pool").write_text, "done").result()
    sys.stdout.write("buffered, no newline")
    if sys.argv[2] == "fail":
        raise RuntimeError("stage failed: names the reason")
    if sys.argv[2] == "refuse":
        from tasks.runtime.params import ParamsError
        try:
            raise ParamsError("params.yaml: train.epochs = 0: must be 1 or more\\n  and more")
        except ParamsError as error:  # as an orchestrator wraps it
            raise RuntimeError("flow run failed") from error
    if sys.argv[2] == "preempt":
        from tasks.train.cluster import Preempted
        raise Preempted("stopped by SIGTERM at epoch 2, step 3, its state saved")

run_then_exit(main)
print("never reached")
"""


def run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), mode],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_success_flushes_output_joins_threads_and_runs_exit_handlers(tmp_path: Path) -> None:
    """Also with an idle thread pool alive (MLflow's, after a download): joining its workers
    before telling them to stop hung the evaluate stage after its flow had finished."""
    done = run(tmp_path, "ok")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "buffered, no newline"  # flushed, and nothing after main ran
    assert (tmp_path / "out.thread").read_text() == "done"
    assert (tmp_path / "out.pool").read_text() == "done"
    assert (tmp_path / "out.atexit").read_text() == "ran"


def test_failure_exits_as_python_does(tmp_path: Path) -> None:
    done = run(tmp_path, "fail")
    assert done.returncode == 1
    assert "RuntimeError: stage failed: names the reason" in done.stderr
    assert (tmp_path / "out.atexit").read_text() == "ran"


def test_a_refusal_is_one_short_block_without_a_traceback(tmp_path: Path) -> None:
    """A typo in params.yaml printed three tracebacks; a stage now says what, why and the
    fix, and exits 2 (a refusal, not a crash), still running the exit handlers."""
    done = run(tmp_path, "refuse")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"Refused: {tmp_path / 'stage.py'} (ParamsError)"
    assert "  params.yaml: train.epochs = 0: must be 1 or more" in lines
    assert lines[-1].startswith("  fix: edit what it names in params.yaml")
    assert len(lines) <= 15
    assert (tmp_path / "out.atexit").read_text() == "ran"
