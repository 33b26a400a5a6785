"""Model builders: augmentation only in training, float32 outputs, local backbone weights."""

from __future__ import annotations

import random
from pathlib import Path

import keras
import numpy as np
import pytest

from tasks.runtime.params import ParamsError, default_params
from tasks.train.models import build_model
from tasks.train.stage import precision_policy

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
