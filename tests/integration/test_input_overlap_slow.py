"""The train input built to overlap the step: batches fetched to the device ahead of it, a
thread budget that leaves cores to a GPU's runtime, records out of order only where training
is not deterministic, and no more steps per compiled call than an epoch holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

from tasks.contracts.manifest import load_manifest
from tasks.contracts.tf_reader import read_options, read_split
from tasks.runtime.layout import Layout
from tasks.runtime.params import ParamsError, default_params
from tasks.train.loop import (
    InputTuning,
    TrainInput,
    input_threads,
    read_data,
    steps_per_epoch,
)

pytestmark = pytest.mark.slow


def determinism_flags(ds: tf.data.Dataset) -> set[bytes]:
    """The ``deterministic`` attribute of every parallel op in ``ds``'s graph."""
    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return {n.attr["deterministic"].s for n in nodes if n.op.startswith("Parallel")}


def test_unordered_reading_only_when_training_is_not_deterministic(tiny_shards: Path) -> None:
    shards = Layout(tiny_shards).shards_dir

    def read(**kwargs: Any) -> tf.data.Dataset:
        return read_split(shards, "train", batch_size=8, **kwargs)

    assert determinism_flags(read(training=True, seed=1)) == {b"true"}
    assert determinism_flags(read(training=True, seed=1, ordered=False)) == {b"false"}
    # Evaluation and validation keep the manifest's order whatever is asked.
    assert determinism_flags(read(training=False, ordered=False)) == {b"true"}


def test_every_read_runs_without_tf_data_s_autotuner(tiny_shards: Path) -> None:
    """Training's endless input, each order of an epoch and an evaluation read keep tf.data's
    autotuner off (their maps run on the pool's threads): deleting an iterator with it on
    waited for the autotuner's thread, up to a second after an epoch read from a store."""
    shards = Layout(tiny_shards).shards_dir
    reads = [
        read_split(shards, "train", batch_size=8, training=True, seed=1),
        read_split(shards, "train", batch_size=8, training=True, seed=1, order="buffered"),
        read_split(shards, "test", batch_size=8, training=False, with_metadata=True),
        train_input(shards).epochs(0, 0, tf.distribute.InputContext()),
    ]
    assert [ds.options().autotune.enabled for ds in reads] == [False] * len(reads)


def test_batches_go_to_the_device_two_ahead(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(tiny_shards)
    strategy = tf.distribute.get_strategy()
    seen: list[tf.distribute.InputOptions] = []
    distribute = strategy.distribute_datasets_from_function

    def spy(dataset_fn: Any, options: tf.distribute.InputOptions | None = None) -> Any:
        assert options is not None
        seen.append(options)
        return distribute(dataset_fn, options)

    monkeypatch.setattr(strategy, "distribute_datasets_from_function", spy)
    params = default_params(train={"batch_size": 16}).train
    data = read_data(params, load_manifest(layout.shards_dir), layout.shards_dir, strategy)
    images, labels = next(data.batches(0))
    assert images.shape == (16, 16, 16, 3) and labels.shape == (16,)
    (options,) = seen
    assert options.experimental_fetch_to_device
    assert options.experimental_per_replica_buffer_size >= 2


@pytest.mark.parametrize(
    ("cores", "gpus", "threads"),
    [(16, 1, 14), (16, 8, 8), (2, 1, 1), (16, 0, None)],
)
def test_the_reader_leaves_cores_to_the_gpu_runtime(
    cores: int, gpus: int, threads: int | None
) -> None:
    assert input_threads(cores, gpus, InputTuning()) == threads
    assert input_threads(cores, gpus, InputTuning(cores_per_gpu=0)) is None  # switched off
    options = read_options(threads)
    assert options.threading.private_threadpool_size == threads


def test_more_steps_per_call_than_an_epoch_holds_is_refused(tiny_shards: Path) -> None:
    shards = Layout(tiny_shards).shards_dir
    manifest = load_manifest(shards)
    params = default_params(train={"batch_size": 16, "steps_per_execution": 4}).train
    assert steps_per_epoch(params, manifest, shards) == 4  # 72 records
    too_many = params.model_copy(update={"steps_per_execution": 5})
    with pytest.raises(ParamsError, match=r"train\.steps_per_execution=5 exceeds the 4 steps"):
        steps_per_epoch(too_many, manifest, shards)


def train_input(shards: Path, **train: Any) -> TrainInput:
    params = default_params(train={"batch_size": 8, **train}).train
    manifest = load_manifest(shards)
    strategy = tf.distribute.get_strategy()
    steps = steps_per_epoch(params, manifest, shards)
    return TrainInput(params, manifest, shards, strategy, None, steps, None, InputTuning())


def test_the_train_input_is_every_epochs_batches_in_order(tiny_shards: Path) -> None:
    """The one iterator over every epoch gives batch for batch the reader's epochs, one after
    the other (so a resumed run reads what an uninterrupted one read, and deterministic
    training gives the same model file)."""
    reads = train_input(Layout(tiny_shards).shards_dir, deterministic=True)
    context = tf.distribute.InputContext()

    def rows(batches: tf.data.Dataset) -> list[tuple[int, list[int]]]:
        return [(int(tf.reduce_sum(tf.cast(x, tf.int64))), y.numpy().tolist()) for x, y in batches]

    want = [row for n in range(3) for row in rows(reads.epoch(context, tf.constant(n, tf.int64)))]
    assert rows(reads.epochs(0, 0, context).take(3 * reads.steps)) == want
    assert len({str(row) for row in want}) > reads.steps  # the epochs are shuffled apart
