"""The training core on tiny shards: learns, repeats exactly, resumes after a kill."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from tasks.evaluate.measurement import evaluate_model
from tasks.runtime.layout import Layout
from tasks.train.stage import cpu_isa, read_epoch_log
from tests.train_helpers import NO_AUGMENT, KillAfterEpoch, run, train_params

pytestmark = pytest.mark.slow


def all_numbers(record: dict[str, Any]) -> bool:
    """Every leaf an int or float (no bool, string, list or null): what DVC shows."""
    return all(
        all_numbers(value)
        if isinstance(value, dict)
        else isinstance(value, int | float) and not isinstance(value, bool)
        for value in record.values()
    )


def test_learnable_data_beats_chance_clearly(tiny_shards: Path) -> None:
    params = train_params(epochs=5, batch_size=16, learning_rate=3e-3, early_stopping_patience=0)
    summary = run(tiny_shards, params)
    layout = Layout(tiny_shards)
    metrics = evaluate_model(
        layout.model_file, layout.shards_dir, tmp := tiny_shards / "eval", top_k=5
    )
    assert metrics["accuracy"] >= 0.8  # chance is 1/3
    assert metrics["top_k"] == 3  # capped at the number of classes
    assert metrics["top_k_accuracy"] == 1.0
    assert summary.epochs_completed == 5
    assert summary.images_per_sec > 0
    # DVC metrics are numbers only; the strings sit in the summary, the epochs in plot rows.
    saved = json.loads(layout.train_metrics.read_text())
    assert saved["epochs_completed"] == 5 and saved["final"]["val_loss"] > 0
    assert all_numbers(saved) and "input_bound" not in saved and "num_replicas" not in saved
    assert json.loads(layout.train_summary.read_text())["precision_policy"] == "float32"
    rows = json.loads(layout.train_history.read_text())
    assert [row["epoch"] for row in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["val_loss"] == summary.final["val_loss"]
    assert layout.train_plot.stat().st_size > 0
    assert {p.name for p in tmp.iterdir()} >= {
        "confusion_matrix.png",
        "misclassified.png",
        "per_class.json",
        "per_class.md",
    }
    assert not layout.backup_dir.exists()  # completed runs leave nothing to resume


def test_the_figures_reported_for_the_model_are_its_own_epochs(tiny_shards: Path) -> None:
    """Early stopping puts the best epoch's weights back at the end (here a later epoch
    does worse): the run reports that epoch's figures, not the last one's."""
    from tasks.contracts.tf_reader import read_split

    params = train_params(
        epochs=5, batch_size=8, learning_rate=0.1, lr_schedule="constant",
        early_stopping_patience=5, augment=NO_AUGMENT,
    )  # fmt: skip
    summary = run(tiny_shards, params)
    losses = summary.history["val_loss"]
    best = losses.index(min(losses))
    assert best < len(losses) - 1  # the last epoch is not the model's
    assert summary.model_epoch == best + 1
    assert summary.model["val_loss"] == losses[best] != summary.final["val_loss"]
    layout = Layout(tiny_shards)
    assert json.loads(layout.train_metrics.read_text())["model"] == summary.model
    model = keras.saving.load_model(layout.model_file)
    val = read_split(layout.shards_dir, "val", batch_size=64, training=False)
    correct = [
        np.argmax(model(images, training=False), -1) == labels.numpy() for images, labels in val
    ]
    assert np.concatenate(correct).mean() == pytest.approx(summary.model["val_accuracy"])


def test_deterministic_runs_repeat_exactly(tiny_shards: Path, tmp_path_factory: Any) -> None:
    params = train_params(epochs=1, batch_size=16, early_stopping_patience=0)
    first = run(tiny_shards, params)
    second = run(tiny_shards, params)
    assert first.final["loss"] == second.final["loss"]
    assert first.final["val_loss"] == second.final["val_loss"]


def test_killed_run_resumes_where_it_stopped(tiny_shards: Path) -> None:
    layout = Layout(tiny_shards)
    params = train_params(epochs=3, batch_size=16, early_stopping_patience=0, augment=NO_AUGMENT)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_shards, params, callbacks=[KillAfterEpoch(0)])
    assert not layout.model_file.exists()
    before = read_epoch_log(layout.backup_dir / "epochs.jsonl")
    assert [row["epoch"] for row in before] == [0]

    summary = run(tiny_shards, params)
    assert summary.resumed_from_epoch == 1  # did not start over
    assert summary.epochs_completed == 3
    rows = json.loads(layout.train_history.read_text())
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    assert rows[0]["loss"] == before[0]["loss"]  # epoch 1 kept from the killed run


def test_a_resumed_run_ends_with_the_model_of_an_uninterrupted_one(tiny_shards: Path) -> None:
    """The rerun after a kill read the first epoch's shuffle again (the reader's reshuffle
    counts iterators, and a new process starts at the first), so a resumed run trained
    another model than an uninterrupted one: another md5 in dvc.lock for the same inputs."""
    layout = Layout(tiny_shards)
    params = train_params(epochs=3, batch_size=16, early_stopping_patience=0)  # augmented
    run(tiny_shards, params)
    whole = layout.model_file.read_bytes()
    layout.model_file.unlink()
    with pytest.raises(KeyboardInterrupt):
        run(tiny_shards, params, callbacks=[KillAfterEpoch(1)])
    assert run(tiny_shards, params).resumed_from_epoch == 2
    assert layout.model_file.read_bytes() == whole


def test_saved_model_predicts_class_probabilities(tiny_shards: Path) -> None:
    params = train_params(epochs=1, batch_size=16, early_stopping_patience=0)
    run(tiny_shards, params)
    model = keras.saving.load_model(Layout(tiny_shards).model_file)
    images = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    probs = model.predict(images, verbose=0)
    assert probs.shape == (5, 3)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)


def test_training_writes_nothing_outside_its_project(
    tiny_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No file lands in the temporary folder: AutoGraph writes each function it converts
    there and never removes it (five files a training run piled up in /tmp)."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    run(tiny_shards, train_params(epochs=1, batch_size=16, early_stopping_patience=0))
    assert Layout(tiny_shards).model_file.exists()
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_the_cpu_kernel_instruction_sets_are_named_with_their_cap() -> None:
    """A CPU-trained model's last bits follow the instruction sets its kernels use: the run
    names the ones the CPU has (from /proc/cpuinfo's first flags line) and the cap
    ``ONEDNN_MAX_CPU_ISA`` puts on them."""
    cpuinfo = (
        "processor\t: 0\nflags\t\t: fpu sse4_1 avx avx2 avx512f avx512_bf16 sha_ni\n"
        "processor\t: 1\nflags\t\t: fpu avx\n"
    )
    machine = platform.machine()
    assert cpu_isa(cpuinfo, cap="") == f"{machine}: avx avx2 avx512f avx512_bf16"
    assert cpu_isa(cpuinfo, cap="AVX2") == (
        f"{machine}: avx avx2 avx512f avx512_bf16 (ONEDNN_MAX_CPU_ISA=AVX2)"
    )
    assert cpu_isa("", cap="") == f"{machine}: flags unknown"
