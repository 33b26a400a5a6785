"""TensorFlow and Keras without the optional imports Shardflow never uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from tasks.tf_imports import {helper}
module = {helper}()
print(module.__name__, {blocked!r} in sys.modules, {blocked!r} in sys.modules or
      __import__({blocked!r}) is not None)
"""


def probe(helper: str, blocked: str) -> list[str]:
    """A fresh interpreter (the helpers act on a first import only)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(helper=helper, blocked=blocked)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.split()


def test_keras_loads_without_sklearn_which_stays_importable() -> None:
    # Keras and its layers work; scikit-learn was not imported with it, yet can be later.
    assert probe("keras_without_sklearn", "sklearn") == ["keras", "False", "True"]


def test_tensorflow_loads_without_keras_which_stays_importable() -> None:
    assert probe("tensorflow_without_keras", "keras.src.optimizers") == [
        "tensorflow",
        "False",
        "True",
    ]
