"""Model builders: a small CNN for CPU runs and keras.applications backbones for transfer.

Every model takes uint8-range images [B, H, W, 3] and does its own augmentation (active only
in training) and scaling, so the input pipeline and the saved model agree on what they feed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.contracts.content import file_sha256
from tasks.runtime.params import MODEL_NAMES, AugmentParams, ModelName, ParamsError, TrainParams

if TYPE_CHECKING:
    import keras

# A headless keras.applications backbone: (train.weights, image shape) -> a model taking
# [0, 255] inputs.
Backbone = Callable[[str | None, tuple[int, int, int]], "keras.Model"]


def build_model(
    params: TrainParams, num_classes: int, image_shape: tuple[int, int, int]
) -> keras.Model:
    """Uncompiled classifier for ``params.model``: augmentation -> features -> softmax.

    The softmax runs in float32 even under a mixed-precision policy, so losses stay stable.
    Its initial weights follow ``params.seed`` alone (``seeds_of_their_own``).
    """
    if params.model not in BUILDERS:
        raise ValueError(f"train.model={params.model!r} is unknown; choose one of {MODEL_NAMES}")
    with seeds_of_their_own(params.seed):
        return assemble(params, num_classes, image_shape)


@contextmanager
def seeds_of_their_own(seed: int) -> Iterator[None]:
    """Keras objects made inside draw their unset seeds from a generator of their own, seeded
    ``seed``. Keras draws them from Python's shared ``random``, and any thread of the process
    that draws from it too (a client's retry jitter) shifted every initial weight of a run
    between ``keras.utils.set_random_seed`` and the model's last layer: a repeated
    deterministic run ended with other weights.
    """
    from keras.src.random import seed_generator

    shared = seed_generator.python_random
    seed_generator.python_random = random.Random(seed)
    try:
        yield
    finally:
        seed_generator.python_random = shared


def assemble(
    params: TrainParams, num_classes: int, image_shape: tuple[int, int, int]
) -> keras.Model:
    """The layers of ``build_model``'s classifier, drawing seeds as they are made."""
    import keras

    inputs = keras.Input(shape=image_shape, name="image")
    # The functional model casts the uint8 batches to the input's float32 on the way in.
    augment = augmentation(params.augment, seed=params.seed)
    x = augment(inputs) if augment.layers else inputs
    builder = BUILDERS[params.model]
    if builder.backbone is None:
        x = small_cnn_features(x)
    elif builder.whole_network:
        backbone = build_backbone(params.model, params.weights, image_shape)
        x = backbone(x)  # trainable, BatchNorm following the training flag
        x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    else:
        backbone = build_backbone(params.model, params.weights, image_shape)
        backbone.trainable = False
        # training=False keeps BatchNorm in inference mode, also after partial unfreezing.
        x = backbone(x, training=False)
        x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
        x = keras.layers.Dropout(0.2, seed=params.seed, name="head_dropout")(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="probs")(
        x
    )
    return keras.Model(inputs, outputs, name=params.model)


def augmentation(params: AugmentParams, *, seed: int) -> keras.Sequential:
    """Seeded Keras preprocessing layers on [0, 255] floats; identity at inference."""
    import keras

    layers: list[keras.layers.Layer] = []
    if params.flip:
        layers.append(keras.layers.RandomFlip("horizontal", seed=seed, name="flip"))
    if params.crop > 0:
        # A negative zoom factor zooms in: crop up to `crop` of each side, resize back.
        layers.append(
            keras.layers.RandomZoom((-params.crop, 0.0), fill_mode="reflect", seed=seed + 1)
        )
    if params.brightness > 0:
        layers.append(
            keras.layers.RandomBrightness(params.brightness, value_range=(0, 255), seed=seed + 2)
        )
    if params.contrast > 0:
        layers.append(
            keras.layers.RandomContrast(params.contrast, value_range=(0, 255), seed=seed + 3)
        )
    return keras.Sequential(layers, name="augment")


def small_cnn_features(x: keras.KerasTensor) -> keras.KerasTensor:
    """Three conv blocks and global pooling: small enough to train on a CPU in seconds an epoch.

    The first conv has stride 2 (most of the FLOPs sit at full resolution), and BatchNorm
    uses momentum 0.9 so its inference statistics keep up within a few short epochs; with
    the default 0.99, validation accuracy stays at chance for epochs on small data.
    """
    import keras

    x = keras.layers.Rescaling(1.0 / 255, name="rescale")(x)
    for index, filters in enumerate((16, 32, 64)):
        x = keras.layers.Conv2D(
            filters,
            3,
            strides=2 if index == 0 else 1,
            padding="same",
            use_bias=False,
            name=f"conv{index}",
        )(x)
        x = keras.layers.BatchNormalization(momentum=0.9, name=f"bn{index}")(x)
        x = keras.layers.Activation("relu", name=f"relu{index}")(x)
        x = keras.layers.MaxPooling2D(2, padding="same", name=f"pool{index}")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.layers.Dropout(0.2, name="dropout")(x)


def build_backbone(
    name: str, weights: str | None, image_shape: tuple[int, int, int]
) -> keras.Model:
    """A headless keras.applications backbone taking [0, 255] inputs.

    ``weights`` is None (random init), "imagenet" (downloads once, needs network) or the
    path of a local weights file such as one saved with ``backbone.save_weights``.
    """
    builder = BUILDERS.get(name)  # type: ignore[call-overload]
    if builder is None or builder.backbone is None:
        backbones = [model for model, known in BUILDERS.items() if known.backbone]
        raise ValueError(f"unknown backbone {name!r}; choose one of {backbones}")
    check_weights(weights)
    return builder.backbone(weights, image_shape)


def mobilenet_v3_small(weights: str | None, image_shape: tuple[int, int, int]) -> keras.Model:
    """MobileNetV3-Small with its own [0, 255] preprocessing."""
    import keras

    return keras.applications.MobileNetV3Small(
        input_shape=image_shape,
        include_top=False,
        weights=weights,
        include_preprocessing=True,
    )


def efficientnet_b0(weights: str | None, image_shape: tuple[int, int, int]) -> keras.Model:
    """EfficientNet-B0, which scales [0, 255] inputs itself."""
    import keras

    return keras.applications.EfficientNetB0(
        input_shape=image_shape, include_top=False, weights=weights
    )


def resnet50(weights: str | None, image_shape: tuple[int, int, int]) -> keras.Model:
    """keras.applications' ResNet50 expects caffe-style inputs and has no preprocessing of its
    own: [0, 255] is scaled to [-1, 1] here so the saved model takes uint8."""
    import keras

    inputs = keras.Input(shape=image_shape, name="resnet50_input")
    scaled = keras.layers.Rescaling(1.0 / 127.5, offset=-1.0, name="scale")(inputs)
    resnet = keras.applications.ResNet50(
        input_shape=image_shape, include_top=False, weights=weights
    )
    return keras.Model(inputs, resnet(scaled), name="resnet50_backbone")


@dataclass(frozen=True)
class Builder:
    """How :func:`build_model` makes one model's features."""

    backbone: Backbone | None  # None: the small CNN (small_cnn_features), no pretrained part
    # Trained whole, every layer from the first step, BatchNorm in training mode: the setting
    # of the published ResNet-50 training figures (MLPerf, NVIDIA's examples) the bench
    # compares to. Otherwise the backbone stays frozen until fine-tuning unfreezes its top.
    whole_network: bool = False


# Every model train.model may name (tasks.runtime.params.ModelName, the one list) -> its builder.
BUILDERS: dict[ModelName, Builder] = {
    "small_cnn": Builder(backbone=None),
    "mobilenet_v3_small": Builder(backbone=mobilenet_v3_small),
    "efficientnet_b0": Builder(backbone=efficientnet_b0),
    "resnet50": Builder(backbone=resnet50, whole_network=True),
}


def check_weights(weights: str | None) -> None:
    """Refuse a ``train.weights`` file that is not there, naming the param: Keras's own error
    names an argument ``weights`` once the model is being built."""
    if weights is None or weights == "imagenet" or Path(weights).is_file():
        return
    raise ParamsError(
        f"train.weights={weights!r}: no weights file at {Path(weights).resolve()}; name a "
        "file saved with save_weights (relative to the project root), imagenet or null"
    )


PRETRAINED_DIR = "models/pretrained"  # a train stage dep: a weights file there retrains


def weights_lineage(weights: str | None) -> dict[str, str]:
    """What the weights a run starts from are, beside the ``train.weights`` path: the file's
    sha256 (``train.weights_sha256``; "none" for null or imagenet). The path alone let a
    file overwritten with other weights resume a backup and log the same params."""
    if weights is None or weights == "imagenet" or not Path(weights).is_file():
        return {"train.weights_sha256": "none"}
    return {"train.weights_sha256": file_sha256(weights)}


def untracked_weights(weights: str | None) -> str | None:
    """Why DVC cannot see a change to the ``train.weights`` file (None when it can): only
    files under :data:`PRETRAINED_DIR`, a train stage dependency, retrain when they change."""
    if weights is None or weights == "imagenet":
        return None
    if Path(weights).resolve().is_relative_to(Path(PRETRAINED_DIR).resolve()):
        return None
    return (
        f"train.weights={weights!r} is outside {PRETRAINED_DIR}/: the run records its sha256, "
        f"but `dvc repro` retrains for a changed weights file only under {PRETRAINED_DIR}/"
    )


def backbone_of(model: keras.Model) -> keras.Model | None:
    """The nested keras.applications backbone of a transfer model, if it has one."""
    import keras

    nested = [layer for layer in model.layers if isinstance(layer, keras.Model)]
    backbones = [layer for layer in nested if layer.name != "augment"]
    return backbones[0] if backbones else None


def unfreeze_top(model: keras.Model, num_layers: int) -> int:
    """Make the top ``num_layers`` backbone layers trainable (BatchNorm stays frozen).

    Returns how many layers became trainable. Recompile the model afterwards.
    """
    import keras

    backbone = backbone_of(model)
    if backbone is None or num_layers <= 0:
        return 0
    backbone.trainable = True
    unfrozen = 0
    for index, layer in enumerate(backbone.layers):
        in_top = index >= len(backbone.layers) - num_layers
        trainable = in_top and not isinstance(layer, keras.layers.BatchNormalization)
        layer.trainable = trainable
        unfrozen += int(trainable)
    return unfrozen
