"""train.accelerator: no silent CPU fallback on a machine whose driver lists a GPU, and the
devices every run records. A stand-in ``nvidia-smi`` on PATH plays the driver."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tensorflow as tf

from tasks.runtime.accelerator import (
    GPU_INSTALL,
    AcceleratorRefused,
    DeviceRecord,
    check_accelerator,
    cpu_name,
    device_record,
    hidden_gpu_cause,
    listed_gpus,
    select_accelerator,
)
from tasks.runtime.layout import Layout
from tasks.runtime.params import default_params
from tasks.runtime.refusals import Refused
from tasks.train.stage import device_tags, run_train
from tests.nvidia_smi import H100, stand_in_nvidia_smi

pytestmark = pytest.mark.slow


@pytest.fixture
def driver_lists_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = stand_in_nvidia_smi(tmp_path / "driver", H100)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def test_listed_gpus_reads_the_drivers_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = stand_in_nvidia_smi(tmp_path / "ok", H100)
    monkeypatch.setenv("PATH", str(folder))
    assert listed_gpus() == [H100]
    failing = stand_in_nvidia_smi(tmp_path / "failing", H100, status=6)  # no driver loaded
    monkeypatch.setenv("PATH", str(failing))
    assert listed_gpus() == []
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi at all
    assert listed_gpus() == []


@pytest.mark.usefixtures("driver_lists_a_gpu")
def test_auto_refuses_a_gpu_tensorflow_does_not_see_naming_cause_and_fix() -> None:
    """This machine's TensorFlow sees no GPU and has no CUDA wheels: the CPU lock's state."""
    assert not tf.config.list_physical_devices("GPU")
    with pytest.raises(AcceleratorRefused, match=r"nvidia-smi -L lists 1 GPU.*CPU lock") as error:
        select_accelerator("auto")
    assert isinstance(error.value, Refused) and error.value.fix == GPU_INSTALL
    select_accelerator("cpu")  # on purpose: trains on the CPU, refused by nothing
    with pytest.raises(AcceleratorRefused, match=r"accelerator is gpu.*driver lists 1"):
        select_accelerator("gpu")


def test_without_a_listed_gpu_auto_trains_on_the_cpu_and_gpu_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(stand_in_nvidia_smi(tmp_path, "")))
    monkeypatch.delenv("TF_GPU_THREAD_MODE", raising=False)
    select_accelerator("auto")
    assert os.environ["TF_GPU_THREAD_MODE"] == "gpu_private"  # GPU threads of their own
    with pytest.raises(AcceleratorRefused, match="nvidia-smi lists none"):
        select_accelerator("gpu")


def test_a_visible_gpu_passes_every_choice_but_none_is_hidden_without_reason() -> None:
    for choice in ("auto", "gpu"):
        check_accelerator(choice, listed=[H100], visible=1)  # type: ignore[arg-type]
    with pytest.raises(AcceleratorRefused, match="CUDA libraries not found"):
        check_accelerator(
            "auto",
            listed=[H100],
            visible=0,
            cause=hidden_gpu_cause(cuda_build=True, cuda_wheels=True),
        )


@pytest.mark.parametrize(
    ("cuda_build", "cuda_wheels", "cause"),
    [
        (False, False, "built without CUDA"),
        (True, False, "CPU lock is installed"),
        (True, True, "CUDA libraries not found"),
    ],
)
def test_the_cause_names_what_is_missing(cuda_build: bool, cuda_wheels: bool, cause: str) -> None:
    assert cause in hidden_gpu_cause(cuda_build=cuda_build, cuda_wheels=cuda_wheels)


@pytest.mark.usefixtures("driver_lists_a_gpu")
def test_the_train_stage_refuses_before_a_run_opens(tiny_shards: Path, mlflow_uri: str) -> None:
    with pytest.raises(AcceleratorRefused, match="TensorFlow sees none"):
        run_train(default_params(), Layout(tiny_shards))
    assert not (tiny_shards / "mlflow.db").exists()  # refused before any MLflow run opened


def test_every_run_records_its_devices() -> None:
    tags = device_tags(default_params().train, tf.distribute.get_strategy())
    assert (tags["device.type"], tags["device.count"]) == ("cpu", "1")
    assert tags["device.name"] == cpu_name(Path("/proc/cpuinfo").read_text())
    assert "device.cuda_version" not in tags  # CPU runs name no CUDA
    gpu = DeviceRecord("gpu", "NVIDIA H100", 2, cuda_version="12.5.1", cudnn_version="9")
    assert gpu.tags() == {
        "device.type": "gpu",
        "device.name": "NVIDIA H100",
        "device.count": "2",
        "device.cuda_version": "12.5.1",
        "device.cudnn_version": "9",
    }
    assert device_record([], "model name\t: Example CPU @ 2.0GHz\n").name == "Example CPU @ 2.0GHz"


def test_the_train_task_never_retries_the_refusal() -> None:
    """A rerun as it is would be refused alike: the Prefect task gives up at once."""
    from flows.support.model_runs import retry_unless_refused

    class Failed:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def result(self) -> None:
            raise self.error

    refused = Failed(AcceleratorRefused("no GPU", fix=GPU_INSTALL))
    assert retry_unless_refused(None, None, refused) is False
    assert retry_unless_refused(None, None, Failed(OSError("disk"))) is True
