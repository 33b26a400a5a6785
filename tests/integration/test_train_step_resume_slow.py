"""A run killed inside an epoch resumes at its last saved step (``checkpoint.every_steps``)
and, on the CPU under ``train.deterministic``, ends with the model file of an uninterrupted
run; SIGTERM saves the step reached and ends training with status 143."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from tasks.contracts.manifest import load_manifest
from tasks.runtime.layout import Layout
from tasks.runtime.params import CheckpointParams, TrainParams
from tasks.train.backup import STEP_NAME, StepState
from tasks.train.loop import read_data
from tests.train_helpers import NO_AUGMENT, run, train_params

pytestmark = pytest.mark.slow

EVERY_STEP = CheckpointParams(every_steps=1)
STEPS = 4  # tiny_shards: 72 train records, batch 16


class Warnings(logging.Handler):
    """The train stage's warnings, attached to its logger itself (Prefect's logging setup
    replaces the root handlers caplog relies on)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def stage_warnings() -> Iterator[Warnings]:
    logger, handler = logging.getLogger("tasks.train.stage"), Warnings()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def params(**changes: Any) -> TrainParams:
    settings = {"epochs": 2, "batch_size": 16, "early_stopping_patience": 0, **changes}
    return train_params(**settings)


# Runs train() with one checkpoint hook: after the save at (epoch, step), the process dies by
# the signal named (SIGKILL: nothing runs after it), or SIGTERM arrives just before that
# boundary (the save then happens because of it). Prints nothing; the exit status tells.
KILL_SCRIPT = """
import os, signal, sys
from tasks.runtime.layout import Layout
from tasks.runtime.params import CheckpointParams, TrainParams
from tasks.train import backup, loop
from tasks.train.cluster import Preempted
from tasks.train.stage import train

root, train_json, every, how, epoch, step = sys.argv[1:]
at = (int(epoch), int(step))
if how == "SIGKILL":
    save_step = backup.save_step
    def save_then_die(model, dirs, state, *statistics):
        save_step(model, dirs, state, *statistics)
        if (state.epoch, state.step) == at:
            os.kill(os.getpid(), signal.SIGKILL)
    backup.save_step = save_then_die
else:
    boundary = loop.call_boundary
    def term_then_boundary(model, dirs, strategy, epoch, saves, step, totals):
        if (epoch, step) == at:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only asks to stop
        boundary(model, dirs, strategy, epoch, saves, step, totals)
    loop.call_boundary = term_then_boundary
try:
    train(TrainParams.model_validate_json(train_json), Layout(root),
          checkpoint=CheckpointParams(every_steps=int(every)))
except Preempted as stopped:
    sys.exit(stopped.exit_status)
"""


def killed_run(
    root: Path, train: TrainParams, every: int, how: str, at: tuple[int, int]
) -> subprocess.CompletedProcess[str]:
    """Train in a process of its own that ``how`` ends at step ``at[1]`` of epoch ``at[0]``."""
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    args = [str(root), train.model_dump_json(), str(every), how, *map(str, at)]
    done = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    return done


def history(layout: Layout) -> list[dict[str, Any]]:
    return json.loads(layout.train_history.read_text())


def batch_hashes(root: Path, train: TrainParams, epoch: int, step: int, count: int) -> list[str]:
    """sha256 of the image bytes of ``count`` batches read from step ``step`` of ``epoch``."""
    layout = Layout(root)
    manifest, strategy = load_manifest(layout.shards_dir), tf.distribute.get_strategy()
    data = read_data(train, manifest, layout.shards_dir, strategy)
    batches = data.batches(epoch, step)
    return [
        hashlib.sha256(np.asarray(next(batches)[0]).tobytes()).hexdigest() for _ in range(count)
    ]


@pytest.mark.parametrize("per_call", [1, 2])
def test_a_sigkill_inside_an_epoch_resumes_at_its_step_with_an_uninterrupted_runs_model(
    tiny_shards: Path,
    tmp_path_factory: pytest.TempPathFactory,
    stage_warnings: Warnings,
    per_call: int,
) -> None:
    """Saved every step, killed after step 2 of epoch 2: one step a call, or two (the save
    then falls after the first call, the rerun's calls where the uninterrupted run's fell)."""
    layout = Layout(tiny_shards)
    # augmented: dropout and augmentation draw from the saved generators
    train = params(steps_per_execution=per_call)
    killed = killed_run(tiny_shards, train, 1, "SIGKILL", (1, 2))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    saved = StepState.from_json(json.loads((layout.backup_dir / "main" / STEP_NAME).read_text()))
    assert (saved.epoch, saved.step) == (1, 2)

    resumed = run(tiny_shards, train, checkpoint=EVERY_STEP)
    assert "resumed at epoch 2, step 2 (of 4)" in "\n".join(stage_warnings.lines)
    assert resumed.resumed_from_epoch == 1
    resumed_model, resumed_rows = layout.model_file.read_bytes(), history(layout)

    whole_root = tmp_path_factory.mktemp("uninterrupted")
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(whole_root)
    run(whole_root, train)
    whole = Layout(whole_root)
    assert resumed_model == whole.model_file.read_bytes()
    for got, want in zip(resumed_rows, history(whole), strict=True):
        assert (got["loss"], got["accuracy"]) == (want["loss"], want["accuracy"])
    # The batches from the saved step on are the ones an uninterrupted epoch read there.
    from_start = batch_hashes(tiny_shards, train, 1, 0, STEPS)
    assert batch_hashes(tiny_shards, train, 1, 2, STEPS - 2) == from_start[2:]
    assert from_start[0] != from_start[2]


def test_sigterm_saves_the_step_reached_and_exits_143_then_the_rerun_resumes_there(
    tiny_shards: Path, stage_warnings: Warnings
) -> None:
    layout = Layout(tiny_shards)
    train = params(epochs=1, augment=NO_AUGMENT)
    stopped = killed_run(tiny_shards, train, 0, "SIGTERM", (0, 3))  # no scheduled saves
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert not layout.model_file.exists()
    saved = StepState.from_json(json.loads((layout.backup_dir / "main" / STEP_NAME).read_text()))
    assert (saved.epoch, saved.step) == (0, 3)
    assert saved.totals[2] == 3 * 16  # the images of the three steps done

    run(tiny_shards, train)
    assert "resumed at epoch 1, step 3 (of 4)" in "\n".join(stage_warnings.lines)
    assert layout.model_file.exists()


def test_the_checkpoint_interval_is_outside_the_backups_identity() -> None:
    """Saving more or less often never discards a backup (nor retrains)."""
    from tasks.runtime.params import default_params
    from tasks.train.models import weights_lineage
    from tasks.train.stage import backup_identity

    often = default_params(checkpoint={"every_steps": 1})
    rarely = default_params(checkpoint={"every_steps": 500})
    lineage, fingerprint = weights_lineage(None), "0" * 64
    assert backup_identity(often.train, fingerprint, lineage) == backup_identity(
        rarely.train, fingerprint, lineage
    )
