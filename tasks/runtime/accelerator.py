"""Which accelerator training uses (``train.accelerator``), and what the run records of it.

TensorFlow finds no GPU when its CUDA libraries are missing (the CPU lock installs
``tensorflow`` without the ``nvidia-*`` wheels of ``tensorflow[and-cuda]``) and then trains on
the CPU without a word. With ``auto`` a machine whose driver lists a GPU (``nvidia-smi -L``)
but whose TensorFlow sees none is refused before training, naming the cause and the fix;
``cpu`` hides every GPU on purpose; ``gpu`` refuses a run that would not get one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tasks.runtime.refusals import Refused

if TYPE_CHECKING:
    import tensorflow as tf

Accelerator = Literal["auto", "cpu", "gpu"]

# `make install` picks the GPU lock where nvidia-smi lists a GPU; forced either way by this.
GPU_INSTALL = "SHARDFLOW_ACCELERATOR=gpu make install"
# The driver's own listing is bounded: a wedged driver must not hang the train stage.
NVIDIA_SMI_TIMEOUT_S = 20


class AcceleratorRefused(Refused):
    """``train.accelerator`` asks for a device this machine's TensorFlow cannot give."""


def listed_gpus() -> list[str]:
    """The GPUs the NVIDIA driver lists (``nvidia-smi -L``'s ``GPU n: ...`` lines); none
    where nvidia-smi is absent or fails."""
    command = shutil.which("nvidia-smi")
    if command is None:
        return []
    try:
        done = subprocess.run(
            [command, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.startswith("GPU ")]


def cuda_wheels_installed() -> bool:
    """Whether the CUDA 12 wheels of ``tensorflow[and-cuda]`` (the GPU lock) are installed."""
    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace package at all
        return False


def hidden_gpu_cause(*, cuda_build: bool, cuda_wheels: bool) -> str:
    """Why TensorFlow sees no GPU on a machine whose driver lists one."""
    if not cuda_build:
        return "this TensorFlow is built without CUDA"
    if not cuda_wheels:
        return (
            "the CPU lock is installed: TensorFlow's CUDA 12 wheels (requirements-gpu.lock, "
            "tensorflow[and-cuda]) are not, and no system CUDA 12 libraries were found"
        )
    return (
        "CUDA libraries not found: the CUDA 12 wheels are installed but TensorFlow could not "
        "load them (an older driver, or LD_LIBRARY_PATH naming other CUDA libraries)"
    )


def check_accelerator(
    choice: Accelerator, *, listed: list[str], visible: int, cause: str = ""
) -> None:
    """Refuse a run whose ``train.accelerator`` this machine cannot honour: ``gpu`` with no
    GPU visible to TensorFlow, ``auto`` where the driver lists GPUs TensorFlow does not see
    (``cause`` says why). ``listed``: :func:`listed_gpus`; ``visible``: TensorFlow's GPUs."""
    if choice == "gpu" and not visible:
        driver = f"the driver lists {len(listed)} ({cause})" if listed else "nvidia-smi lists none"
        raise AcceleratorRefused(
            f"params.yaml train.accelerator is gpu, but TensorFlow sees no GPU; {driver}",
            fix=GPU_INSTALL if listed else "set train.accelerator: cpu (or auto) in params.yaml",
        )
    if choice == "auto" and listed and not visible:
        raise AcceleratorRefused(
            f"nvidia-smi -L lists {len(listed)} GPU(s) ({listed[0]}) but TensorFlow sees none, "
            f"so training would run on the CPU: {cause}; params.yaml train.accelerator: cpu "
            "trains on the CPU on purpose",
            fix=GPU_INSTALL,
        )


def select_accelerator(choice: Accelerator) -> None:
    """Apply ``train.accelerator`` to this process before TensorFlow's runtime starts (before
    any strategy or op): ``cpu`` hides every GPU; ``auto`` and ``gpu`` are checked."""
    import tensorflow as tf

    if choice == "cpu":
        tf.config.set_visible_devices([], "GPU")
        return
    # Each GPU gets its own launch threads, not tf.data's and the ops' shared pool; read
    # when TensorFlow creates the GPU device, so set here, before it does (a user's value
    # stays).
    os.environ.setdefault("TF_GPU_THREAD_MODE", "gpu_private")
    visible = len(tf.config.list_physical_devices("GPU"))
    listed = listed_gpus() if not visible else []
    cause = ""
    if listed or choice == "gpu":
        cuda_build = bool(tf.sysconfig.get_build_info().get("is_cuda_build", False))
        cause = hidden_gpu_cause(cuda_build=cuda_build, cuda_wheels=cuda_wheels_installed())
    check_accelerator(choice, listed=listed, visible=visible, cause=cause)


@dataclass(frozen=True)
class DeviceRecord:
    """The devices a run trains on, as tracked: type, name, how many, and on a GPU the CUDA
    and cuDNN versions TensorFlow was built with."""

    type: str
    name: str
    count: int
    cuda_version: str = ""
    cudnn_version: str = ""

    def tags(self) -> dict[str, str]:
        tags = {"device.type": self.type, "device.name": self.name, "device.count": str(self.count)}
        if self.type == "gpu":
            tags["device.cuda_version"] = self.cuda_version or "unknown"
            tags["device.cudnn_version"] = self.cudnn_version or "unknown"
        return tags


def gpu_devices(strategy: tf.distribute.Strategy) -> list[str]:
    """The GPUs this worker's replicas run on (none: the CPU)."""
    import tensorflow as tf

    try:
        devices = list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy places ops on the default device
        devices = [gpu.name for gpu in tf.config.list_logical_devices("GPU")[:1]]
    return [device for device in devices if "GPU" in device.upper()]


def cpu_name(cpuinfo: str) -> str:
    """The CPU's model name from /proc/cpuinfo's text; "cpu" where it names none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return "cpu"


def device_record(gpu_devices: list[str], cpuinfo: str) -> DeviceRecord:
    """What the run trains on: the GPUs named (TensorFlow device names the strategy places
    replicas on), else the CPU of ``cpuinfo``."""
    import tensorflow as tf

    if not gpu_devices:
        return DeviceRecord("cpu", cpu_name(cpuinfo), 1)
    physical = tf.config.list_physical_devices("GPU")
    names = sorted(
        {
            tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
            for gpu in physical
        }
    )
    build = tf.sysconfig.get_build_info()
    return DeviceRecord(
        "gpu",
        ", ".join(names) or "gpu",
        len(gpu_devices),
        cuda_version=str(build.get("cuda_version", "")),
        cudnn_version=str(build.get("cudnn_version", "")),
    )
