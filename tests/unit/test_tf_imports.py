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


def test_keras_loads_without_sklearn_or_matplotlib_which_stay_importable() -> None:
    # Keras and its layers work; neither was imported with it, yet each can be later.
    assert probe("keras_without_extras", "sklearn") == ["keras", "False", "True"]
    assert probe("keras_without_extras", "matplotlib") == ["keras", "False", "True"]


def test_a_library_imported_before_keras_is_left_as_it_was() -> None:
    code = (
        "import sys, matplotlib as m; from tasks.tf_imports import keras_without_extras;"
        "keras_without_extras(); print(sys.modules.get('matplotlib') is m, 'keras' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.stdout.split() == ["True", "True"], done.stderr[-2000:]


def test_tensorflow_loads_without_keras_which_stays_importable() -> None:
    assert probe("tensorflow_without_keras", "keras.src.optimizers") == [
        "tensorflow",
        "False",
        "True",
    ]
