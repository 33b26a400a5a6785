"""Models that train: a transfer model fine-tunes from a local weights file, ResNet-50 trains whole
(the model builders: tests/unit/train/test_train_models.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.runtime.params import ParamsError, default_params
from tasks.train.models import backbone_of, build_backbone, build_model, unfreeze_top
from tests.unit.train.test_train_models import IMAGES, NO_AUGMENT

pytestmark = pytest.mark.slow


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
