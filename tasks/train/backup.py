"""The train stage's backup: which one a run may resume, and the state each epoch leaves.

A killed run resumes at the last step committed here (:class:`StepState`, every
``checkpoint.every_steps`` steps and on SIGTERM), else at the epoch after the last one
committed: the weights with the
optimizer's state, the random generators' states (dropout, augmentation: Keras saves no seed
generator with the weights), the epoch log (the figures of the epochs run before the kill), early
stopping's wait, best value and best weights, and the frozen phase's end weights once it is
done. A backup is only resumed by the same run: ``identity.json`` records the train params,
the shards' fingerprint and the training code's version it was made with (and the MLflow run
it logs to). Any difference discards the backup, with the reason logged, and the run starts
over in a new MLflow run.

With several workers the chief alone decides (it claims or discards the backup) and keeps
the backup in ``backup_dir``; every worker restores from there (a path every worker sees),
and the other workers write their copies, as TensorFlow requires of every worker, into a
temporary directory of their own (:class:`BackupDirs`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.runtime.atomic import write_json

if TYPE_CHECKING:
    import keras

IDENTITY_NAME = "identity.json"
EPOCH_LOG_NAME = "epochs.jsonl"
EPOCH_NAME = "epoch.json"  # written after the epoch's files, naming them: the epoch's commit
MAIN_PHASE_WEIGHTS = "main_phase.weights.h5"
RANDOM_NAME = "random.npz"  # the seed generators' states, beside the weights they go with
MAIN_PHASE_DONE = "main_phase.json"  # written after the weights: the frozen phase's commit
EARLY_STOPPING_NAME = "early_stopping.json"
STEP_NAME = "step.json"  # written after a mid-epoch state's files, naming them: its commit

# The train stage's log (a flow shows it in its run's log, flows.support.run_story.run_log): a
# discarded backup is the stage's news, wherever the code lives.
log = logging.getLogger("tasks.train.stage")


class BackupUnusable(RuntimeError):
    """A backup that passed the identity check still failed to restore (e.g. another shape)."""


# -- which backup may be resumed ----------------------------------------------------------


def identity_changes(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Why a backup made with ``stored`` cannot be resumed by ``current``; [] when it can."""

    def show(values: dict[str, Any], key: str) -> str:
        return json.dumps(values[key]) if key in values else "(unset)"

    old, new = stored.get("params") or {}, current["params"]
    reasons = [
        f"{key} changed {show(old, key)} -> {show(new, key)}"
        for key in sorted(set(old) | set(new))
        if key not in old or key not in new or old[key] != new[key]
    ]
    if stored.get("fingerprint") != current["fingerprint"]:
        reasons.append(
            f"shards changed: fingerprint {str(stored.get('fingerprint'))[:12]} -> "
            f"{current['fingerprint'][:12]}"
        )
    if stored.get("code_version") != current["code_version"]:
        reasons.append(
            f"training code changed: version {stored.get('code_version')} -> "
            f"{current['code_version']}"
        )
    return reasons


def claim_backup(
    backup_dir: Path, identity: dict[str, Any]
) -> tuple[dict[str, Any] | None, list[str]]:
    """The stored identity of a backup this run may resume, else discard the backup.

    Returns ``(stored identity or None, reasons it was discarded)``. A backup without a
    readable identity (older versions wrote none) is discarded too: nobody can vouch for it.
    """
    if not backup_dir.exists() or not any(backup_dir.iterdir()):
        return None, []
    path = backup_dir / IDENTITY_NAME
    try:
        stored = json.loads(path.read_text())
        reasons = identity_changes(stored, identity)
    except FileNotFoundError:
        reasons = [f"{path} is missing (made by an older version)"]
    except (json.JSONDecodeError, AttributeError, KeyError) as error:
        reasons = [f"{path} is unreadable ({error})"]
    if not reasons:
        return stored, []
    discard_backup(backup_dir, reasons)
    return None, reasons


def discard_backup(backup_dir: Path, reasons: Sequence[str]) -> None:
    """Delete the backup and say why, so a rerun that starts over is never a surprise."""
    log.warning("backup discarded: %s (%s)", "; ".join(reasons), backup_dir)
    shutil.rmtree(backup_dir, ignore_errors=True)


def write_identity(backup_dir: Path, identity: dict[str, Any], run_id: str | None = None) -> None:
    write_json(backup_dir / IDENTITY_NAME, {**identity, "mlflow_run_id": run_id})


# -- where a worker reads and writes its backup ------------------------------------------


@dataclass(frozen=True)
class BackupDirs:
    """Where a worker restores from (the chief's backup) and where it writes its own."""

    read: Path
    write: Path

    @classmethod
    def for_worker(cls, backup_dir: Path, *, chief: bool, worker: str = "worker") -> BackupDirs:
        """The chief writes the backup; every other worker (named ``worker``, e.g.
        ``worker-1``) writes a scratch copy nobody reads, beside the backup and inside the
        repository (never the system's temporary folder), emptied as the worker starts: what
        a killed worker left is gone with its next start, and it never outlives the clone."""
        if chief:
            return cls(backup_dir, backup_dir)
        scratch = backup_dir.with_name(f"{backup_dir.name}-scratch") / worker
        shutil.rmtree(scratch, ignore_errors=True)
        return cls(backup_dir, scratch)

    def phase(self, name: str) -> BackupDirs:
        return BackupDirs(self.read / name, self.write / name)

    @property
    def chief(self) -> bool:
        return self.read == self.write

    def clean_up(self) -> None:
        """The run completed: nothing is left to resume (a worker drops its scratch copy)."""
        shutil.rmtree(self.write, ignore_errors=True)


# -- the state each epoch commits ---------------------------------------------------------


def save_epoch(model: keras.Model, dirs: BackupDirs, epoch: int) -> None:
    """Commit ``epoch``: its weights, optimizer and random state go to files named by the
    epoch, then ``epoch.json`` names them, then the previous epoch's files go.

    The files of the committed epoch are never overwritten: a kill at any point resumes
    with the weights and random state of the epoch ``epoch.json`` names (one shared file
    name let a kill between the weights and the commit resume a finished epoch's weights
    at that epoch, training it twice)."""
    dirs.write.mkdir(parents=True, exist_ok=True)
    names = epoch_files(epoch)
    save_state(model, dirs.write, *names)
    write_json(dirs.write / EPOCH_NAME, {"epoch": epoch, "weights": names[0], "random": names[1]})
    for pattern in ("state-*.weights.h5", "random-*.npz"):
        for stale in dirs.write.glob(pattern):
            if stale.name not in names:
                stale.unlink()
    # The epoch's mid-epoch state is stale now (restore_step ignores it): it goes too.
    (dirs.write / STEP_NAME).unlink(missing_ok=True)
    drop_step_files(dirs.write)


def epoch_files(epoch: int) -> tuple[str, str]:
    """The weights file (Keras 3 saves weights and optimizer only to ``*.weights.h5``) and
    the random state file of ``epoch``'s commit."""
    return f"state-{epoch}.weights.h5", f"random-{epoch}.npz"


def restore_epoch(model: keras.Model, dirs: BackupDirs) -> int:
    """Load the last committed epoch's state into ``model``; the epoch to start at."""
    path = dirs.read / EPOCH_NAME
    if not path.exists():
        return 0
    try:
        committed = json.loads(path.read_text())
        epoch = int(committed["epoch"])
        model.load_weights(dirs.read / committed["weights"])
        load_random_state(model, dirs.read / committed["random"])
    except Exception as error:
        raise BackupUnusable(f"cannot restore {dirs.read}: {error}") from error
    return epoch + 1


def save_state(
    model: keras.Model, folder: Path, weights_name: str, random_name: str = RANDOM_NAME
) -> None:
    """The model's weights (with its optimizer's) as ``weights_name`` and its random
    generators' states as ``random_name`` beside them, each file written whole."""
    tmp = folder / f"tmp-{weights_name}"
    model.save_weights(tmp)
    os.replace(tmp, folder / weights_name)
    states = [np.asarray(v.numpy()) for v in random_state(model)]
    with open(folder / f"tmp-{random_name}", "wb") as handle:
        np.savez(handle, *states)
    os.replace(folder / f"tmp-{random_name}", folder / random_name)


def random_state(model: keras.Model) -> list[Any]:
    """The states of the model's seed generators (dropout and augmentation draw from them),
    in the model's order: a resumed run draws what an uninterrupted one would have."""
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


def load_random_state(model: keras.Model, path: Path) -> None:
    """Set the model's seed generators to the states :func:`save_state` kept in ``path``."""
    variables = random_state(model)
    with np.load(path) as saved:
        states = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    if len(states) != len(variables):
        raise ValueError(
            f"{path} holds {len(states)} generator states, the model has {len(variables)}"
        )
    for variable, state in zip(variables, states, strict=True):
        variable.assign(state)


def commit_main_phase(model: keras.Model, dirs: BackupDirs, epochs_completed: int) -> None:
    """The frozen phase is done: keep its end weights and epoch count, drop its backup."""
    save_state(model, dirs.write, MAIN_PHASE_WEIGHTS)
    write_json(dirs.write / MAIN_PHASE_DONE, {"epochs_completed": epochs_completed})
    shutil.rmtree(dirs.write / "main", ignore_errors=True)


def restore_main_phase(model: keras.Model, dirs: BackupDirs) -> int | None:
    """The frozen phase's end weights loaded into ``model`` and its epoch count, if done."""
    done = dirs.read / MAIN_PHASE_DONE
    if not done.exists():
        return None
    weights = dirs.read / MAIN_PHASE_WEIGHTS
    try:
        with warnings.catch_warnings():
            # The file holds the frozen phase's optimizer too; fine-tuning starts a new one.
            warnings.filterwarnings("ignore", message="Skipping variable loading for optim")
            model.load_weights(weights)
        load_random_state(model, dirs.read / RANDOM_NAME)
    except Exception as error:
        raise BackupUnusable(f"cannot load {weights}: {error}") from error
    return int(json.loads(done.read_text())["epochs_completed"])


# -- the state saved inside an epoch ------------------------------------------------------


def checkpoint_interval(every_steps: int, per_call: int) -> int:
    """Steps between mid-epoch saves: ``every_steps`` rounded up to whole compiled calls of
    ``per_call`` steps (a save waits for its call to end); 0 (never) stays 0."""
    if every_steps <= 0:
        return 0
    return -(-every_steps // per_call) * per_call


def checkpoint_steps(steps: int, per_call: int, every_steps: int) -> list[int]:
    """The steps of an epoch of ``steps`` after which a mid-epoch state is saved: every
    :func:`checkpoint_interval` steps counted from the epoch's start, never its last step
    (the epoch's own commit follows it)."""
    interval = checkpoint_interval(every_steps, per_call)
    return list(range(interval, steps, interval)) if interval else []


@dataclass(frozen=True)
class StepState:
    """Where a run stood inside ``epoch``: ``step`` steps done, their partial ``totals``
    (loss sum, correct, images: the figures the epoch reports are made from), and the
    files holding the weights with the optimizer, the random generators' states and, with
    several replicas, each replica's own BatchNorm moving statistics (``statistics``: each
    keeps its own until the epoch's end averages them; the weights file holds one)."""

    epoch: int
    step: int
    totals: tuple[float, float, float]
    weights: str
    random: str
    statistics: str | None = None

    @classmethod
    def named(
        cls, epoch: int, step: int, totals: Sequence[float], *, replicas: int = 1
    ) -> StepState:
        """The state of ``step`` of ``epoch`` on ``replicas`` replicas, with its files' names."""
        loss_sum, correct, images = (float(x) for x in totals)
        return cls(
            epoch,
            step,
            (loss_sum, correct, images),
            f"step-{epoch}-{step}.weights.h5",
            f"step-random-{epoch}-{step}.npz",
            f"step-statistics-{epoch}-{step}.npz" if replicas > 1 else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "totals": list(self.totals),
            "weights": self.weights,
            "random": self.random,
            "statistics": self.statistics,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepState:
        loss_sum, correct, images = (float(x) for x in data["totals"])
        statistics = data.get("statistics")
        return cls(
            int(data["epoch"]),
            int(data["step"]),
            (loss_sum, correct, images),
            str(data["weights"]),
            str(data["random"]),
            None if statistics is None else str(statistics),
        )


def save_step(
    model: keras.Model,
    dirs: BackupDirs,
    state: StepState,
    statistics: Sequence[np.ndarray] = (),
) -> None:
    """Commit a mid-epoch ``state``: its weights, random state and replicas' moving
    ``statistics`` (where it names a file for them) to files named by the step, then
    ``step.json`` naming them, then the previous step's files go (as :func:`save_epoch`
    commits an epoch: a kill at any point leaves one whole state)."""
    dirs.write.mkdir(parents=True, exist_ok=True)
    save_state(model, dirs.write, state.weights, state.random)
    if state.statistics:
        tmp = dirs.write / f"tmp-{state.statistics}"
        with tmp.open("wb") as handle:
            np.savez(handle, *statistics)
        os.replace(tmp, dirs.write / state.statistics)
    write_json(dirs.write / STEP_NAME, state.to_json())
    drop_step_files(dirs.write, keep=(state.weights, state.random, state.statistics or ""))


def drop_step_files(folder: Path, keep: Sequence[str] = ()) -> None:
    """Delete the mid-epoch states' files in ``folder``, but those named in ``keep``."""
    for stale in folder.glob("step-*"):
        if stale.name not in keep:
            stale.unlink()


def committed_step(dirs: BackupDirs, epoch: int) -> StepState | None:
    """The mid-epoch state committed inside ``epoch`` (the one after the last committed
    epoch), if any: a state of an earlier epoch is stale, that epoch's commit replaced it."""
    path = dirs.read / STEP_NAME
    if not path.exists():
        return None
    try:
        state = StepState.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise BackupUnusable(f"cannot read {path}: {error}") from error
    return state if state.epoch == epoch else None


def restore_step(model: keras.Model, dirs: BackupDirs, epoch: int) -> StepState | None:
    """Load the mid-epoch state committed inside ``epoch`` into ``model``; the state, or
    None where there is none (the epoch starts at its first step)."""
    state = committed_step(dirs, epoch)
    if state is None:
        return None
    try:
        model.load_weights(dirs.read / state.weights)
        load_random_state(model, dirs.read / state.random)
    except Exception as error:
        raise BackupUnusable(f"cannot restore {dirs.read} at step {state.step}: {error}") from error
    return state


# -- the epoch log and early stopping, both surviving a kill -------------------------------


def read_epoch_log(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def early_stopping_state(dirs: BackupDirs, resumed_at: int) -> dict[str, Any] | None:
    """Early stopping's state saved at the end of epoch ``resumed_at - 1``, with its best
    weights as ``best_weights`` (a list of arrays), or None (a fresh start, or a kill between
    the epoch's backup and this state: then it is started afresh, with a warning)."""
    path = dirs.read / EARLY_STOPPING_NAME
    if not resumed_at or not path.exists():
        return None
    state = json.loads(path.read_text())
    if state["epoch"] != resumed_at - 1:
        log.warning(
            "early stopping state is from epoch %s, not %s: starting it afresh",
            state["epoch"] + 1,
            resumed_at,
        )
        return None
    if state.get("best_weights"):
        with np.load(dirs.read / state["best_weights"]) as arrays:
            state["best_weights"] = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    return state


def save_early_stopping(
    dirs: BackupDirs, state: dict[str, Any], best_weights: list[Any] | None
) -> None:
    """Save early stopping's state; its best weights go to a file named by the best epoch."""
    dirs.write.mkdir(parents=True, exist_ok=True)
    weights_name = None
    if best_weights is not None:
        # One file per best epoch, named in the state file: the state never points at
        # weights from another epoch, whenever the process dies.
        weights_name = f"early_stopping_best_{state['best_epoch']}.npz"
        weights_path = dirs.write / weights_name
        if not weights_path.exists():
            tmp = weights_path.with_name(f".{weights_name}.tmp")
            with tmp.open("wb") as handle:
                np.savez(handle, *best_weights)
            os.replace(tmp, weights_path)
    write_json(dirs.write / EARLY_STOPPING_NAME, {**state, "best_weights": weights_name})
    for stale in dirs.write.glob("early_stopping_best_*.npz"):
        if stale.name != weights_name:
            stale.unlink()
