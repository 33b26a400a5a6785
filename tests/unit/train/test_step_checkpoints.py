"""Which steps of an epoch save a mid-epoch state, and what that state's commit holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.train.backup import (
    STEP_NAME,
    BackupDirs,
    BackupUnusable,
    StepState,
    checkpoint_interval,
    checkpoint_steps,
    committed_step,
)


@pytest.mark.parametrize(
    ("every_steps", "per_call", "interval"),
    [
        (0, 1, 0),  # never
        (0, 4, 0),
        (1, 1, 1),
        (5, 1, 5),
        (5, 4, 8),  # rounded up to whole calls: a save waits for its call to end
        (8, 4, 8),
        (1, 4, 4),
    ],
)
def test_the_interval_is_every_steps_rounded_up_to_whole_calls(
    every_steps: int, per_call: int, interval: int
) -> None:
    assert checkpoint_interval(every_steps, per_call) == interval


@pytest.mark.parametrize(
    ("steps", "per_call", "every_steps", "saved_after"),
    [
        (10, 1, 3, [3, 6, 9]),
        (10, 1, 5, [5]),  # never at the epoch's last step: the epoch's commit follows it
        (10, 4, 3, [4, 8]),  # on the boundaries of the 4-step calls
        (10, 1, 0, []),
        (4, 1, 10, []),
    ],
)
def test_saves_fall_every_interval_from_the_epochs_start_and_never_at_its_end(
    steps: int, per_call: int, every_steps: int, saved_after: list[int]
) -> None:
    assert checkpoint_steps(steps, per_call, every_steps) == saved_after


def test_a_step_state_survives_its_json_exactly() -> None:
    # float32 sums: the json's floats must give back the very same float32 values
    state = StepState.named(3, 7, [12.345678901234, 101.0, 112.0])
    again = StepState.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state
    assert (again.weights, again.random) == ("step-3-7.weights.h5", "step-random-3-7.npz")


def test_a_state_of_several_replicas_names_their_statistics_file() -> None:
    """One replica's weights file holds one copy of the BatchNorm moving statistics: with
    several replicas each one's own copy is saved beside it, and named in the commit."""
    state = StepState.named(1, 4, [1.0, 2.0, 3.0], replicas=2)
    assert state.statistics == "step-statistics-1-4.npz"
    assert StepState.from_json(json.loads(json.dumps(state.to_json()))) == state
    assert StepState.named(1, 4, [1.0, 2.0, 3.0]).statistics is None


def test_only_a_state_inside_the_epoch_to_resume_is_used(tmp_path: Path) -> None:
    """A state left from an epoch that has since been committed is stale: ignored."""
    dirs = BackupDirs(tmp_path, tmp_path)
    state = StepState.named(2, 5, [1.0, 2.0, 3.0])
    (tmp_path / STEP_NAME).write_text(json.dumps(state.to_json()))
    assert committed_step(dirs, 2) == state
    assert committed_step(dirs, 3) is None


def test_an_unreadable_step_commit_names_its_file(tmp_path: Path) -> None:
    (tmp_path / STEP_NAME).write_text('{"epoch": 1}')
    with pytest.raises(BackupUnusable, match=STEP_NAME):
        committed_step(BackupDirs(tmp_path, tmp_path), 1)


def test_a_step_state_goes_with_a_backup_of_other_params(tmp_path: Path) -> None:
    """A mid-epoch state never outlives its backup's identity: another run's params
    discard it with the backup, the reason logged."""
    from tasks.train.backup import claim_backup, write_identity

    backup = tmp_path / "train_backup"
    made_with = {"params": {"train.learning_rate": 0.002}, "fingerprint": "a" * 64}
    write_identity(backup, {**made_with, "code_version": "1"})
    (backup / "main").mkdir()
    state = StepState.named(0, 2, [1.0, 2.0, 32.0])
    (backup / "main" / STEP_NAME).write_text(json.dumps(state.to_json()))
    other = {"params": {"train.learning_rate": 0.001}, "fingerprint": "a" * 64, "code_version": "1"}
    stored, reasons = claim_backup(backup, other)
    assert stored is None
    assert reasons == ["train.learning_rate changed 0.002 -> 0.001"]
    assert not (backup / "main" / STEP_NAME).exists()
