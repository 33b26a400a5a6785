"""Model builders (augmentation only in training, float32 outputs, local backbone weights) and
models that train: a transfer model fine-tunes from a local weights file, ResNet-50 trains whole."""

from __future__ import annotations

import random
from pathlib import Path

import keras
import numpy as np
import pytest

from tasks.runtime.params import ParamsError, default_params
from tasks.train.models import backbone_of, build_backbone, build_model, unfreeze_top
from tasks.train.stage import precision_policy

pytestmark = pytest.mark.slow

NO_AUGMENT = {"flip": False, "crop": 0.0, "brightness": 0.0, "contrast": 0.0}
IMAGES = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)


def test_augmentation_is_active_in_training_only() -> None:
    model = build_model(default_params().train, 3, (32, 32, 3))
    inference = [model(IMAGES, training=False).numpy() for _ in range(2)]
    np.testing.assert_array_equal(inference[0], inference[1])
    np.testing.assert_allclose(model.predict(IMAGES, verbose=0), inference[0], rtol=1e-5)
    augmented = model.get_layer("augment")(IMAGES.astype("float32"), training=True)
    assert not np.allclose(augmented, IMAGES)


def test_initial_weights_follow_the_seed_param_not_the_processs_shared_random() -> None:
    """Another thread's draws from Python's ``random`` (a client's retry jitter) between the
    seeding and the last layer gave a repeated deterministic run other weights."""
    params = default_params().train
    weights = []
    for shared_state in (1, 2):
        random.seed(shared_state)  # what other draws leave the shared generator at
        weights.append(build_model(params, 3, (32, 32, 3)).get_weights())
    other_seed = build_model(params.model_copy(update={"seed": params.seed + 1}), 3, (32, 32, 3))
    for first, second in zip(*weights, strict=True):
        np.testing.assert_array_equal(first, second)
    assert not np.array_equal(weights[0][0], other_seed.get_weights()[0])


def test_softmax_stays_float32_under_mixed_precision() -> None:
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = build_model(default_params().train, 3, (32, 32, 3))
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert model.get_layer("conv0").compute_dtype == "bfloat16"
    assert model(IMAGES, training=False).dtype == "float32"


@pytest.mark.parametrize(
    ("mixed", "gpu", "policy"),
    [(False, True, "float32"), (True, True, "mixed_float16"), (True, False, "mixed_bfloat16")],
)
def test_precision_policy(mixed: bool, gpu: bool, policy: str) -> None:
    assert (
        precision_policy(default_params(train={"mixed_precision": mixed}).train, gpu=gpu) == policy
    )


def test_unknown_model_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="small_cnn"):
        build_model(
            default_params().train.model_copy(update={"model": "resnet9000"}), 3, (32, 32, 3)
        )


def test_a_missing_weights_file_is_named_by_its_param(tmp_path: Path) -> None:
    params = default_params(
        train={"model": "mobilenet_v3_small", "weights": str(tmp_path / "backbone.weights.h5")}
    ).train
    with pytest.raises(ParamsError, match=r"train\.weights='.*backbone\.weights\.h5'"):
        build_model(params, 3, (32, 32, 3))


def test_transfer_model_loads_a_local_weights_file_and_fine_tunes_the_top(tmp_path: Path) -> None:
    source = build_backbone("mobilenet_v3_small", None, (32, 32, 3))
    weights = tmp_path / "backbone.weights.h5"
    source.save_weights(weights)
    params = default_params(
        train={"model": "mobilenet_v3_small", "weights": str(weights), "fine_tune_layers": 5}
    ).train
    model = build_model(params, 3, (32, 32, 3))
    backbone = backbone_of(model)
    assert backbone is not None and not backbone.trainable  # frozen phase first
    for loaded, saved in zip(backbone.weights, source.weights, strict=True):
        np.testing.assert_array_equal(loaded.numpy(), saved.numpy())
    head_only = len(model.trainable_weights)
    assert unfreeze_top(model, params.fine_tune_layers) > 0
    assert len(model.trainable_weights) > head_only
    assert not any(
        layer.trainable for layer in backbone.layers[:-5]
    )  # everything below the top stays frozen


def test_resnet50_trains_the_whole_network_and_has_no_frozen_phase() -> None:
    """As the published ResNet-50 figures train it: every layer from the first step, no
    weights downloaded, BatchNorm following the training flag."""
    params = default_params(
        shard={"image_size": [32, 32]}, train={"model": "resnet50", "augment": NO_AUGMENT}
    ).train
    model = build_model(params, 3, (32, 32, 3))
    backbone = backbone_of(model)
    assert backbone is not None and backbone.trainable
    assert all(layer.trainable for layer in backbone.layers)
    # Every weight trains but BatchNorm's moving statistics.
    moving = [v for v in model.weights if v.path.endswith(("moving_mean", "moving_variance"))]
    assert len(model.trainable_weights) == len(model.weights) - len(moving) > 200
    # BatchNorm normalises by the batch in training: outputs differ from inference's.
    assert not np.allclose(model(IMAGES, training=True), model(IMAGES, training=False))
    with pytest.raises(ParamsError, match=r"'resnet50' trains the whole network"):
        default_params(train={"model": "resnet50", "fine_tune_layers": 10, "fine_tune_epochs": 1})
