"""TensorFlow and Keras without the optional imports Shardflow never uses."""

from __future__ import annotations

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
                             min_class_review_accuracy=0.7)
except Stop:
    pass
"""


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
