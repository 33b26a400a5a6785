"""The model's forward pass for every prediction: evaluation's and the served model's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras


def predict_batch(model: keras.Model, images: Any) -> np.ndarray:
    """``model(images, training=False)`` as float32 NumPy, run as one traced graph.

    Keras's predict function (``predict_on_batch``), cached on the model and traced at most
    twice (``reduce_retracing``: for the first batch's size, then for any size): called
    eagerly, a Keras model runs layer by layer from Python on every batch, several times
    slower for a small CNN than through the graph. Never XLA: XLA compiles anew for every
    batch size it meets (a serving request of any length), and evaluation and serving then
    run the same kernels.
    Inference mode: the model's augmentation layers do not run.
    """
    if model.predict_function is None:  # not yet traced: decide how it will be
        model.jit_compile = False
    return np.asarray(model.predict_on_batch(images), dtype=np.float32)
