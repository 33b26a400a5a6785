"""TensorFlow and Keras without the optional imports Shardflow never uses, each in a fresh
interpreter (seconds each; the fast tests: tests/unit/runtime/test_tf_imports.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.runtime.test_tf_imports import FIRST_PREDICTION, REPO, probe

pytestmark = pytest.mark.slow


def test_keras_loads_without_sklearn_or_matplotlib_which_stay_importable() -> None:
    # Keras and its layers work; neither was imported with it, yet each can be later.
    assert probe("keras_without_extras", "sklearn") == ["keras", "False", "True"]
    assert probe("keras_without_extras", "matplotlib") == ["keras", "False", "True"]


def test_a_library_imported_before_keras_is_left_as_it_was() -> None:
    code = (
        "import sys, matplotlib as m; from tasks.runtime.tf_imports import keras_without_extras;"
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


def test_a_users_keras_json_changes_nothing_shardflow_computes(tmp_path: Path) -> None:
    """~/.keras/keras.json lies outside the repository: float16, channels_first, another
    epsilon or backend there must not reach training or serving."""
    (tmp_path / ".keras").mkdir()
    user = {"floatx": "float16", "epsilon": 0.1, "backend": "jax"}
    user["image_data_format"] = "channels_first"
    (tmp_path / ".keras" / "keras.json").write_text(json.dumps(user))
    code = (
        "from tasks.runtime.tf_imports import keras_without_extras; "
        "c = keras_without_extras().config;"
        "print(c.backend(), c.floatx(), c.epsilon(), c.image_data_format())"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("KERAS_")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**env, "HOME": str(tmp_path)},
        timeout=300,
    )
    expected = ["tensorflow", "float32", "1e-07", "channels_last"]  # Keras's own defaults
    assert done.stdout.split() == expected, done.stderr[-2000:]


def test_a_first_keras_import_prints_none_of_tensorflows_notices() -> None:
    """TensorFlow's own lines, as this version prints them, are the ones dropped."""
    code = "from tasks.runtime.tf_imports import keras_without_extras; keras_without_extras()"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]


def test_evaluation_starts_importing_cleanlab_before_its_first_prediction() -> None:
    # cleanlab (scikit-learn with it, about 0.75 s) is needed only after the predictions:
    # imported beside them, on another core, it is off the evaluate stage's critical path.
    done = subprocess.run(
        [sys.executable, "-c", FIRST_PREDICTION],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]
