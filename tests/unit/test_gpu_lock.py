"""The GPU install: requirements-gpu.lock adds TensorFlow's CUDA 12 wheels to the CPU lock,
and `make install` picks it where nvidia-smi lists a GPU (a stand-in plays the driver)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.nvidia_smi import H100, stand_in_nvidia_smi

REPO = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+) \\$", re.MULTILINE)


def pins(lock: str) -> dict[str, str]:
    """Each package a lock pins, by canonical name, with its version."""
    text = (REPO / lock).read_text()
    found = {canonicalize_name(name): version for name, version in PIN.findall(text)}
    assert len(found) == text.count("==") and found, f"{lock}: a line not pinned as `name==v \\`"
    return found


def test_the_gpu_lock_adds_the_cuda_wheels_and_repins_nothing() -> None:
    cpu, gpu = pins("requirements.lock"), pins("requirements-gpu.lock")
    # Compiled with the CPU lock as constraints and emitting only what it lacks: both are
    # installed with --no-deps, so a package in both would be installed at the GPU's pin.
    assert not cpu.keys() & gpu.keys()
    lines = (REPO / "requirements-gpu.in").read_text().splitlines()
    (tensorflow,) = [Requirement(line) for line in lines if line and not line.startswith("#")]
    assert tensorflow.name == "tensorflow" and "and-cuda" in tensorflow.extras
    assert tensorflow.specifier.contains(cpu["tensorflow"])  # the CPU lock's TensorFlow
    # Every CUDA wheel TensorFlow's and-cuda extra asks for, at a version it accepts.
    wanted = [
        Requirement(line)
        for line in importlib.metadata.requires("tensorflow") or []
        if 'extra == "and-cuda"' in line
    ]
    assert wanted
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in gpu, f"requirements-gpu.lock lacks {name}"
        assert requirement.specifier.contains(gpu[name]), f"{name}=={gpu[name]}: {requirement}"
    text = (REPO / "requirements-gpu.lock").read_text()
    assert text.count("--hash=sha256:") >= len(gpu)  # hash-pinned, for --require-hashes
    for lock in ("requirements.lock", "requirements-gpu.lock", "requirements-gpu.in"):
        assert "://" not in (REPO / lock).read_text(), f"{lock} names an index"


def make_install_plan(path: str, **env: str) -> str:
    """What `make install` would run (dry run, as if nothing were installed)."""
    environment = {k: v for k, v in os.environ.items() if k != "SHARDFLOW_ACCELERATOR"}
    environment.update(env, PATH=f"{path}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "install"],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("listing", "forced", "choice", "why"),
    [
        (H100, None, "gpu", "nvidia-smi -L lists a GPU"),
        ("", None, "cpu", "nvidia-smi -L lists no GPU"),
        (H100, "cpu", "cpu", "SHARDFLOW_ACCELERATOR=cpu"),
        ("", "gpu", "gpu", "SHARDFLOW_ACCELERATOR=gpu"),
    ],
)
def test_make_install_picks_the_gpu_lock_where_a_gpu_is_listed(
    tmp_path: Path, listing: str, forced: str | None, choice: str, why: str
) -> None:
    driver = stand_in_nvidia_smi(tmp_path, listing)
    plan = make_install_plan(str(driver), **({"SHARDFLOW_ACCELERATOR": forced} if forced else {}))
    assert f"make install: the {choice} lock ({why})" in plan
    assert "--no-deps -r requirements.lock" in plan  # the CPU lock always, first
    gpu_line = "--require-hashes --no-deps -r requirements-gpu.lock"
    assert (gpu_line in plan) == (choice == "gpu")
    assert ("uninstall" in plan) == (choice == "cpu")  # a CPU install drops the CUDA wheels
    # The stamp names the choice: switching installs again.
    assert re.search(rf"touch \.venv/\.installed-{choice}-[0-9a-f]{{16}}", plan)


def test_an_unknown_forced_accelerator_is_refused_naming_the_variable(tmp_path: Path) -> None:
    environment = {**os.environ, "SHARDFLOW_ACCELERATOR": "tpu"}
    done = subprocess.run(
        ["make", "-n", "install"], cwd=REPO, env=environment, capture_output=True, text=True
    )
    assert done.returncode != 0 and "SHARDFLOW_ACCELERATOR=tpu: set gpu or cpu" in done.stderr
