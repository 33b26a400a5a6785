"""A refusal reads as one short block wherever it is raised; anything else keeps its traceback."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from flows.support.refusal_logs import QuietRefusals
from tasks.contracts.validated_shards import ShardsNotValidated
from tasks.ingest.discovery import SourceNotFound, SourceRefused
from tasks.ingest.refusals import SetWouldBeLost
from tasks.runtime.params import ParamsError, shipped_params_text
from tasks.runtime.refusals import MAX_MESSAGE_LINES, Refused, refusal_block, refusing
from tasks.runtime.workspace_lock import WorkspaceLocked
from tasks.shard.append import RebuildNeeded
from tasks.validate.stage import ValidationFailed, data_gate

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "kind",
    [
        ParamsError,
        ValidationFailed,
        WorkspaceLocked,
        ShardsNotValidated,
        SetWouldBeLost,
        RebuildNeeded,
        data_gate.AcceptedRecordError,
        data_gate.AcceptRefused,
        SourceNotFound,
        SourceRefused,
    ],
)
def test_every_user_caused_error_is_a_refusal_with_a_fix(kind: type[Exception]) -> None:
    error = kind("what and why")
    assert isinstance(error, Refused) and error.fix


def test_a_long_refusal_is_cut_and_keeps_its_fix() -> None:
    """The data gate's refusal was a 1,500-character sentence; the block stays short."""
    shifts = "; ".join(f"class 'c{i}' share moved 0.100 -> 0.300 (+0.200)" for i in range(40))
    error = ValidationFailed(shifts, fix="shardflow accept-data --fingerprint 0123456789ab")
    lines = refusal_block("python -m flows.validate", error).splitlines()
    assert lines[0] == "Refused: python -m flows.validate (ValidationFailed)"
    assert len(lines) <= MAX_MESSAGE_LINES + 2 <= 15
    assert "the full text is in the report" in lines[-2]
    assert lines[-1] == "  fix: shardflow accept-data --fingerprint 0123456789ab"


def test_refusing_prints_a_refusal_and_lets_a_bug_through(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def refuse() -> int:
        raise RebuildNeeded("shard.image_size changed since the last generation")

    assert refusing(refuse, "python -m flows.shard") == 2
    err = capsys.readouterr().err
    assert "Refused: python -m flows.shard (RebuildNeeded)" in err
    assert "fix: set shard.mode: rebuild in params.yaml" in err

    def crash() -> int:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        refusing(crash, "python -m flows.shard")


def record(message: str, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(error), error, None) if error is not None else None
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, "", 0, message, (), exc_info)


def test_the_console_drops_a_refusals_tracebacks_and_repeats_only() -> None:
    """Prefect logged the refusal with its traceback for the task, again for the flow, and
    a third time in the flow's final state; the entry point prints it once instead."""
    quiet = QuietRefusals()
    refusal = ValidationFailed("shard validation failed for data/shards (data_diff: ...)")
    assert not quiet.filter(record("Task run failed with exception", refusal))
    state = (
        "Finished in state Failed('Flow run encountered an exception: ValidationFailed: "
        "shard validation failed for data/shards (data_diff: ...)')"
    )
    assert not quiet.filter(record(state))
    assert quiet.filter(record("Beginning flow run 'validate'"))
    assert quiet.filter(record("Task run failed", RuntimeError("a bug")))


def test_a_params_typo_is_refused_naming_params_yaml(tmp_path: Path) -> None:
    """`make run` on a typo ended in a traceback blaming `tasks.ingest.filenames check`."""
    text = shipped_params_text().replace("\n  epochs: ", "\n  epochs: -", 1)
    (tmp_path / "params.yaml").write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "tasks.runtime.params", "check"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("Refused: params.yaml (ParamsError)")
    assert "train.epochs" in done.stderr and "filenames" not in done.stderr


class Failed:
    """A task run's final state whose result raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self) -> None:
        raise self.error


def test_train_and_evaluate_never_retry_a_refusal() -> None:
    """A refusal fails alike when rerun as it is; a failed write to the store may not."""
    from flows.support.model_runs import retry_unless_refused
    from tasks.serve.batch_prediction import ModelNotFound

    for refusal in (ModelNotFound("no champion"), WorkspaceLocked("held"), ParamsError("x")):
        assert not retry_unless_refused(None, None, Failed(refusal))
    assert retry_unless_refused(None, None, Failed(OSError("the store blipped")))


def test_a_deployment_runs_terminal_shows_the_block_once_and_its_log_keeps_one_per_run() -> None:
    """In a deployment run's process no entry point prints the refusal: the terminal shows
    the first record's block (no traceback) and drops the repeats; each run's log record
    (Prefect's run loggers) becomes the block too, its final-state line a pointer to it."""
    from flows.support.refusal_logs import RefusalsAsBlocks

    refusal = ValidationFailed("shard validation failed for data/shards", fix="shardflow x")
    runs, console = RefusalsAsBlocks(), QuietRefusals(show_first=True)
    task = record("Task run failed with exception", refusal)
    task.task_run_name = "validate-1a2"
    assert runs.filter(task) and console.filter(task)
    assert task.exc_info is None and task.getMessage() == (
        "Refused: task run 'validate-1a2' (ValidationFailed)\n"
        "  shard validation failed for data/shards\n"
        "  fix: shardflow x"
    )
    flow = record("Encountered exception during execution", refusal)
    assert runs.filter(flow) and not console.filter(flow)
    assert flow.exc_info is None and flow.getMessage().startswith("Refused: prefect.flow_runs")
    state = record(
        "Finished in state Failed('Flow run encountered an exception: ValidationFailed: "
        "shard validation failed for data/shards')"
    )
    assert runs.filter(state) and not console.filter(state)
    assert state.getMessage() == "Finished in state Failed: refused (the block above says why)"
    bug = record("Task run failed", RuntimeError("a bug"))
    assert runs.filter(bug) and console.filter(bug) and bug.exc_info is not None


def test_a_block_read_back_from_another_processs_output_is_the_same_refusal() -> None:
    """A team's part runs its stages under ``dvc repro`` in a clone: a stage's refusal reaches
    the flow only as the block in the output, and must read as that block again."""
    from tasks.runtime.refusals import read_refusal

    message = "ingest.source_dir 'data/x' is not a folder\n" + "a long reason " * 20
    refused = SourceNotFound(message, fix="set ingest.source_dir in params.yaml " * 4)
    block = refusal_block("ingest", refused)
    output = f"Running stage 'ingest':\n> python -m flows.ingest\n{block}\nERROR: failed\n"
    relayed = read_refusal(output)
    assert relayed is not None and isinstance(relayed, Refused)
    assert refusal_block(relayed.what, relayed) == block
    assert read_refusal("ERROR: failed to reproduce 'ingest'\nTraceback (most recent ...") is None


def test_a_team_part_refuses_with_its_stages_refusal_and_fails_otherwise(tmp_path: Path) -> None:
    from flows.team import run_checked

    block = refusal_block("shard", RebuildNeeded("the shard layout changed", fix="make compact"))
    printing = f"import sys; print({block!r}, file=sys.stderr); sys.exit(255)"
    with pytest.raises(Refused) as refused:
        run_checked([sys.executable, "-c", printing], tmp_path)
    assert refusal_block("shard", refused.value) == block
    assert "exit 255" in str(refused.value.__cause__)  # the whole output stays the cause
    with pytest.raises(RuntimeError, match="exit 3"):
        run_checked([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path)
