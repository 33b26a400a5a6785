"""TensorFlow and Keras imported without the optional parts Shardflow never uses.

Importing is a large share of a short stage: in a stage process, TensorFlow and Keras are
imported after Prefect, on the critical path. Each helper blocks one optional import for
the moment of the first import (the library ignores an ImportError there) and unblocks it
right after, so anything asking for that module later gets it as usual. Where the library
is loaded already, each is a plain import.

The first import is also where TensorFlow's two native libraries print their start-up
notices (oneDNN is on, no CUDA driver here, absl's "before InitializeLog" line), once each:
from static initialisers, before any setting is read, so neither ``TF_CPP_MIN_LOG_LEVEL``
nor absl's flags reach them. :func:`_native_notices_dropped` drops exactly those lines;
anything else the import writes to standard error (a real warning) still shows.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from types import ModuleType

# TensorFlow's start-up notices, printed on every import on a CPU-only machine.
NATIVE_NOTICES = re.compile(
    rb"All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|port\.cc:\d+\] oneDNN custom operations are on"
    rb"|cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
)

# TensorFlow's ``__init__`` imports this eagerly (to register optimizers for SavedModel);
# importing it imports all of Keras, and Keras imports scikit-learn and matplotlib.
KERAS_EAGER_IMPORT = "keras.src.optimizers"
# Keras imports these, if installed, for parts Shardflow never uses: scikit-learn (MLflow
# installs it) for its scikit-learn wrappers, Matplotlib (Shardflow's plots use it) for its
# image and bounding-box galleries.
KERAS_OPTIONAL_IMPORTS = ("sklearn", "matplotlib")
# What Keras takes from ~/.keras/keras.json ($KERAS_HOME) at its first import, held at its
# defaults: a user's file (float16, channels_first, another epsilon or backend) would change
# what training computes and what the served model predicts, from outside the repository.
KERAS_CONFIG = {"floatx": "float32", "epsilon": 1e-7, "image_data_format": "channels_last"}


@contextmanager
def _blocked(*modules: str) -> Iterator[None]:
    """Imports of ``modules`` fail (ImportError) inside; one already imported is left as is."""
    blocked = [module for module in modules if module not in sys.modules]
    for module in blocked:
        sys.modules[module] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for module in blocked:
            if sys.modules.get(module, False) is None:
                del sys.modules[module]


@contextmanager
def _native_notices_dropped() -> Iterator[None]:
    """Standard error (the file descriptor: native code writes there) goes to a temporary
    file inside; on the way out its lines come back, minus :data:`NATIVE_NOTICES`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().splitlines(keepends=True):
                if not NATIVE_NOTICES.search(line):
                    os.write(2, line)


def quiet_cuda_probe(
    env: MutableMapping[str, str] = os.environ,
    gpus: Callable[[], list[str]] | None = None,
) -> None:
    """Where the NVIDIA driver lists no GPU (``gpus``, default ``nvidia-smi -L``), TensorFlow's
    CUDA probe can only fail, and says so on every run ("failed call to cuInit"): its C++ log
    keeps to fatal errors (``TF_CPP_MIN_LOG_LEVEL=3``) unless the user chose a level. Called
    before TensorFlow loads, which reads the level once; with a GPU listed nothing changes."""
    if "TF_CPP_MIN_LOG_LEVEL" in env:
        return
    if gpus is None:
        from tasks.runtime.accelerator import listed_gpus

        gpus = listed_gpus
    if not gpus():
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"


def tensorflow_without_keras() -> ModuleType:
    """``import tensorflow``, minus the Keras import that its ``__init__`` makes eagerly.

    Validation's cross-check needs ``tf.data`` and ``tf.io`` only; Keras is a large part of
    TensorFlow's import, and that import is the cross-check's whole critical path.
    """
    if "tensorflow" in sys.modules or KERAS_EAGER_IMPORT in sys.modules:
        import tensorflow as tf

        return tf
    quiet_cuda_probe()
    with _blocked(KERAS_EAGER_IMPORT), _native_notices_dropped():
        import tensorflow as tf
    return tf


def keras_without_extras() -> ModuleType:
    """``import keras`` (TensorFlow with it), minus scikit-learn and Matplotlib, a third of
    its import time (docs/performance.md).

    Called where a process first imports Keras (the train stage, evaluation, the serving
    model); Keras's scikit-learn wrappers and plotting galleries then say their library is
    missing, in that process. Both import as usual afterwards (Shardflow's plots use
    Matplotlib).
    """
    if "keras" in sys.modules:
        import keras

        return _configured(keras)
    os.environ["KERAS_BACKEND"] = "tensorflow"  # over keras.json's "backend"
    quiet_cuda_probe()
    with _blocked(*KERAS_OPTIONAL_IMPORTS), _native_notices_dropped():
        import keras
    return _configured(keras)


def _configured(keras: ModuleType) -> ModuleType:
    """``keras`` with :data:`KERAS_CONFIG` set, whatever the user's keras.json said."""
    if keras.config.backend() != "tensorflow":
        raise RuntimeError(
            f"Keras runs on {keras.config.backend()!r} here (KERAS_BACKEND or the 'backend' of "
            f"{keras.config.keras_home()}/keras.json, read before Shardflow imported Keras); "
            "Shardflow trains and serves on 'tensorflow' only"
        )
    keras.config.set_floatx(KERAS_CONFIG["floatx"])
    keras.config.set_epsilon(KERAS_CONFIG["epsilon"])
    keras.config.set_image_data_format(KERAS_CONFIG["image_data_format"])
    return keras
