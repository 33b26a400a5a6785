"""The training loop's switches on the CPU: loss scaling under float16, XLA, and the same
model file from a repeated deterministic run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import tasks.train.stage as train_module
from tasks.runtime.layout import Layout
from tasks.train.models import backbone_of
from tests.conftest import tf_op_determinism
from tests.train_helpers import NO_AUGMENT, run, train_params

pytestmark = pytest.mark.slow


class SeeOptimizer(keras.callbacks.Callback):
    """The optimizer the loop trains with, and its step count after each epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer: Any = None
        self.iterations: list[int] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.optimizer = self.model.optimizer
        self.iterations.append(int(self.model.optimizer.iterations.numpy()))


@pytest.fixture
def no_op_determinism() -> Any:
    """Op determinism off for one test: Keras compiles without XLA under it."""
    with tf_op_determinism(False):
        yield


def test_float16_trains_with_loss_scaling(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU policy, forced on the CPU: float16 gradients need the loss scaled up.
    monkeypatch.setattr(train_module, "precision_policy", lambda *a, **k: "mixed_float16")
    scaled: list[object] = []  # the losses the step had the optimizer scale (at trace time)
    scale_loss = keras.optimizers.LossScaleOptimizer.scale_loss

    def spy(self: Any, loss: Any) -> Any:
        scaled.append(loss)
        return scale_loss(self, loss)

    monkeypatch.setattr(keras.optimizers.LossScaleOptimizer, "scale_loss", spy)
    params = train_params(
        epochs=4,
        batch_size=16,
        learning_rate=3e-3,
        early_stopping_patience=0,
        mixed_precision=True,
        augment=NO_AUGMENT,
    )
    seen = SeeOptimizer()
    summary = run(tiny_shards, params, callbacks=[seen])
    assert summary.precision_policy == "mixed_float16"
    assert isinstance(seen.optimizer, keras.optimizers.LossScaleOptimizer)
    assert scaled  # the step scales its loss before taking gradients
    assert seen.iterations[-1] == 4 * (72 // 16)  # every step applied, none skipped
    history = summary.history
    assert history["loss"][-1] < history["loss"][0]  # learns: gradients unscaled right
    assert summary.final["val_accuracy"] >= 0.8  # chance is 1/3


def test_xla_switch_compiles_the_step_and_still_learns(
    tiny_shards: Path, no_op_determinism: None
) -> None:
    params = train_params(
        epochs=4,
        batch_size=16,
        learning_rate=3e-3,
        early_stopping_patience=0,
        xla=True,
        deterministic=False,  # Keras turns XLA off under op determinism
        augment=NO_AUGMENT,
    )
    summary = run(tiny_shards, params)
    assert summary.xla is True  # the step ran compiled, not just asked to
    assert summary.final["val_accuracy"] >= 0.8


def test_float16_and_xla_together_train(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch, no_op_determinism: None
) -> None:
    """The GPU's fast setting, forced on the CPU under the strategy a GPU machine trains
    with (MirroredStrategy): the loss-scale optimizer's update needs a cross-replica step
    (merge_call) that an XLA-compiled replica function cannot hold. Seen on an H200: every
    run with mixed_precision and xla on failed at its first step."""
    import tensorflow as tf
    from tensorflow.python.distribute import mirrored_strategy

    monkeypatch.setattr(train_module, "precision_policy", lambda *a, **k: "mixed_float16")
    # MirroredStrategy takes its GPU-only branch (no merge_call inside an XLA context) when
    # every device is a GPU: this CPU device passes for one.
    monkeypatch.setattr(mirrored_strategy, "_is_gpu_device", lambda device: True)
    params = train_params(
        epochs=3,
        batch_size=16,
        learning_rate=3e-3,
        early_stopping_patience=0,
        mixed_precision=True,
        xla=True,
        deterministic=False,  # Keras turns XLA off under op determinism
        augment={"flip": True, "crop": 0.0, "brightness": 0.1, "contrast": 0.1},
    )
    seen = SeeOptimizer()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    summary = run(tiny_shards, params, callbacks=[seen], strategy=strategy)
    assert isinstance(seen.optimizer, keras.optimizers.LossScaleOptimizer)
    assert summary.xla is True
    assert seen.iterations[-1] == 3 * (72 // 16)
    assert summary.history["loss"][-1] < summary.history["loss"][0]


def test_a_repeated_deterministic_run_ends_with_the_same_weights(tiny_shards: Path) -> None:
    """With tests/integration/test_model_file_slow.py (the same weights give the same bytes):
    the same model file. Compared as weights here: in one process Keras numbers its auto-named
    objects on (adam, adam_1, ...), which a fresh process, as the stage runs, does not."""
    params = train_params(epochs=2, batch_size=16, early_stopping_patience=0)
    model_file = Layout(tiny_shards).model_file
    weights = []
    for _ in range(2):
        run(tiny_shards, params)
        weights.append(keras.saving.load_model(model_file).get_weights())
    assert len(weights[0]) == len(weights[1]) > 0
    for first, second in zip(*weights, strict=True):
        np.testing.assert_array_equal(first, second)


def test_efficientnet_b0_fine_tunes_in_both_phases(tmp_path: Path) -> None:
    """The frozen phase, then the top layers at a tenth of the rate, on the loop."""
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(tmp_path, size=32, per_class={"train": 8, "val": 2, "test": 2})
    params = train_params(
        model="efficientnet_b0",
        weights=None,
        epochs=1,
        fine_tune_layers=5,
        fine_tune_epochs=1,
        batch_size=8,
        learning_rate=0.01,
        lr_schedule="constant",
        early_stopping_patience=0,
        augment=NO_AUGMENT,
    )
    summary = run(tmp_path, params)
    assert summary.epochs_completed == 2
    rates = summary.history["learning_rate"]
    assert rates == [pytest.approx(0.01), pytest.approx(0.01 * train_module.FINE_TUNE_LR_FACTOR)]
    backbone = backbone_of(keras.saving.load_model(Layout(tmp_path).model_file))
    assert backbone is not None
    assert any(layer.trainable and layer.weights for layer in backbone.layers[-5:])
    assert not any(layer.trainable for layer in backbone.layers[:-5] if layer.weights)


def test_several_steps_per_compiled_call_train_the_same_model(tiny_shards: Path) -> None:
    """train.steps_per_execution changes how steps are dispatched, not what they compute:
    3 steps a call and the 4th alone end with the weights of 4 single steps, and the run
    records the setting."""
    weights, counts = [], []
    for per_call in (1, 3):
        seen = SeeOptimizer()
        params = train_params(
            epochs=1, batch_size=16, early_stopping_patience=0, steps_per_execution=per_call
        )
        summary = run(tiny_shards, params, callbacks=[seen])
        assert summary.steps_per_execution == per_call
        counts.append(seen.iterations)
        weights.append(keras.saving.load_model(Layout(tiny_shards).model_file).get_weights())
    assert counts == [[72 // 16]] * 2
    for single, several in zip(*weights, strict=True):
        np.testing.assert_array_equal(single, several)


def test_the_input_probe_times_its_two_feeds_in_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reader-fed and memory-fed steps alternate in rounds, each turn's first step untimed:
    a slow spell of the host (here the second round) falls on both feeds alike."""
    from tasks.train import loop

    clock = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    calls: list[str] = []

    class Done:
        def numpy(self) -> None:
            pass

    def feed(name: str, seconds: float) -> Any:
        def step() -> Done:
            calls.append(name)
            clock[0] += seconds * (4.0 if 7 <= len(calls) <= 12 else 1.0)
            return Done()

        return step

    reader, memory = loop.median_step_seconds_in_turns(
        [feed("reader", 0.03), feed("memory", 0.02)], steps=6, warmup=1, rounds=3
    )
    assert calls == (["reader"] * 3 + ["memory"] * 3) * 3  # 3 rounds, 1 untimed + 2 a turn
    assert (reader, memory) == (pytest.approx(0.03), pytest.approx(0.02))
