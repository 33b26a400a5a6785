"""MirroredStrategy over two logical CPUs: the multi-replica path without a GPU.

Runs in a subprocess: logical devices must be configured before TensorFlow initialises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tasks.runtime.layout import Layout
from tasks.runtime.params import default_params
from tasks.train.stage import train
layout = Layout(sys.argv[1])
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
summary = train(default_params(train={"epochs": 1, "batch_size": 16}).train, layout,
                strategy=strategy)
print("SUMMARY " + json.dumps(summary.to_json()))
"""


def test_two_cpu_replicas_train_one_epoch(tiny_shards: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_shards)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("SUMMARY "))
    summary = json.loads(line.removeprefix("SUMMARY "))
    assert summary["num_replicas"] == 2
    assert summary["strategy"] == "MirroredStrategy"
    assert summary["epochs_completed"] == 1
    assert summary["final"]["loss"] == summary["final"]["loss"]  # not NaN
    assert (tiny_shards / "models" / "model.keras").exists()
