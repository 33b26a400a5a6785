"""TensorFlow and Keras without the optional imports Shardflow never uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import sys
from tasks.runtime.tf_imports import {helper}
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


def test_the_start_up_notices_are_dropped_and_other_lines_kept(
    capfd: pytest.CaptureFixture[str],
) -> None:
    from tasks.runtime.tf_imports import _native_notices_dropped

    with _native_notices_dropped():
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are ")
        os.write(2, b"written to STDERR\nI0000 00:00:1.5  7378 port.cc:153] oneDNN custom ")
        os.write(2, b"operations are on. You may see...\nI0000 00:00:1.6  7378 ")
        os.write(2, b"cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU\n")
        os.write(2, b"W0000 something real went wrong\n")
        print("a Python warning", file=sys.stderr)
    lines = sorted(capfd.readouterr().err.splitlines())
    assert lines == ["W0000 something real went wrong", "a Python warning"]


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


FIRST_PREDICTION = """
import sys, threading
import keras
import tasks.evaluate.measurement as evaluate

class Stop(Exception):
    pass

def first_prediction(*args, **kwargs):
    importing = any(t.name == "import-cleanlab" for t in threading.enumerate())
    print("cleanlab" in sys.modules or importing)
    raise Stop

keras.saving.load_model = lambda path: None
evaluate.load_manifest = lambda path: None
evaluate.predict_split = first_prediction
print("cleanlab" in sys.modules)
try:
    evaluate.evaluate_model("m.keras", "shards", "out", top_k=1, label_issues_file="issues.csv",
                             label_error_confidence=0.7)
except Stop:
    pass
"""


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


@pytest.mark.parametrize(
    ("env", "gpus", "level"),
    [
        ({}, [], "3"),  # a CPU-only machine: the CUDA probe's failure is not shown
        ({}, ["GPU 0: NVIDIA H100"], None),  # a GPU listed: TensorFlow's log as it is
        ({"TF_CPP_MIN_LOG_LEVEL": "0"}, [], "0"),  # the user's choice stands
    ],
    ids=["no-gpu", "gpu-listed", "user-level"],
)
def test_the_cuda_probe_is_quiet_only_where_no_gpu_is_listed(
    env: dict[str, str], gpus: list[str], level: str | None
) -> None:
    from tasks.runtime.tf_imports import quiet_cuda_probe

    quiet_cuda_probe(env, lambda: gpus)
    assert env.get("TF_CPP_MIN_LOG_LEVEL") == level
