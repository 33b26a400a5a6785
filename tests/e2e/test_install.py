"""`make install` puts this clone's `shardflow` into its own .venv, editable, and nothing else:
another clone with its own .venv runs its own code, and only `tasks` and `flows` are mapped.

The venvs here borrow this environment's packages (a .pth line) instead of installing the
lock again, and run the Makefile's own editable-install line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--quiet", "--no-input"]


def copy_clone(target: Path) -> Path:
    """The working tree's files git knows of (committed or not, never ignored ones)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def install_line() -> str:
    """The Makefile's command that installs the project itself."""
    lines = [line.strip() for line in (REPO / "Makefile").read_text().splitlines()]
    (line,) = [line for line in lines if "--editable ." in line]
    return line


def borrowing_venv(env_dir: Path) -> str:
    """A venv at ``env_dir`` that sees this environment's packages; its own site folder."""
    venv.create(env_dir, with_pip=False)
    purelib = sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)})
    Path(purelib, "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return purelib


def make_install(clone: Path) -> Path:
    """A venv for ``clone`` seeing this environment's packages, then the Makefile's line."""
    env_dir = clone / ".venv"
    borrowing_venv(env_dir)
    command = install_line().replace("$(BIN)", str(env_dir / "bin"))
    subprocess.run(["bash", "-c", command], cwd=clone, check=True, timeout=600)
    return env_dir / "bin"


def run_in(bin_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True
    )


@pytest.mark.slow
def test_each_clone_runs_its_own_installed_shardflow(tmp_path: Path) -> None:
    clones = [copy_clone(tmp_path / name) for name in ("one", "two")]
    marker = "# clone two's own cli\n"
    (clones[1] / "flows" / "cli" / "shardflow.py").write_text(
        (clones[1] / "flows" / "cli" / "shardflow.py").read_text() + marker
    )
    bins = [make_install(clone) for clone in clones]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for clone, bin_dir in zip(clones, bins, strict=True):
        done = run_in(bin_dir, elsewhere, "shardflow", "ui", "--help")
        assert done.returncode == 0, done.stderr
        assert "MLflow UI" in done.stdout
        where = run_in(
            bin_dir,
            elsewhere,
            "python",
            "-c",
            "import flows.cli.shardflow, tasks; print(flows.cli.shardflow.__file__)",
        )
        assert Path(where.stdout.strip()) == clone / "flows" / "cli" / "shardflow.py", where.stderr
        # Only the project's packages are mapped: the repo root never joins sys.path.
        stray = run_in(bin_dir, elsewhere, "python", "-c", "import bench")
        assert stray.returncode != 0 and "No module named 'bench'" in stray.stderr
    # The editable hook names its own clone only.
    hooks = [p for p in bins[0].parent.rglob("__editable__*") if p.suffix in (".pth", ".py")]
    assert hooks and all(str(clones[1]) not in p.read_text() for p in hooks)
    assert any(re.search(re.escape(str(clones[0])), p.read_text()) for p in hooks)
    assert marker not in (clones[0] / "flows" / "cli" / "shardflow.py").read_text()


def build_wheel(clone: Path, out: Path) -> Path:
    """The wheel ``pip wheel .`` builds from ``clone`` with this environment's setuptools."""
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", ".", "-w", str(out)],
        cwd=clone,
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("shardflow-*.whl")
    return wheel


@pytest.mark.slow
def test_a_wheel_holds_every_module_and_installs(tmp_path: Path) -> None:
    clone = copy_clone(tmp_path / "clone")
    wheel = build_wheel(clone, tmp_path / "dist")
    sources = {
        p.relative_to(clone).as_posix()
        for package in ("tasks", "flows")
        for p in (clone / package).rglob("*.py")
    }
    data_files = {  # what modules read beside them: the reader's op source
        p.relative_to(clone).as_posix()
        for package in ("tasks", "flows")
        for p in (clone / package).rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc")
    }
    with zipfile.ZipFile(wheel) as archive:
        packed = set(archive.namelist())
    assert any(name.startswith("tasks/shard/") for name in sources)  # the scan sees sub-packages
    assert "tasks/contracts/raw_slice.cc" in data_files
    left_out = (sources | data_files) - packed
    assert left_out == set(), f"left out of the wheel: {sorted(left_out)}"

    # A fresh venv borrowing this environment's third-party packages (a .pth line, so no
    # editable hook of this clone's), with the wheel installed into it, not editable.
    env_dir = tmp_path / "venv"
    purelib = borrowing_venv(env_dir)
    subprocess.run(
        [*PIP, "--python", str(env_dir / "bin" / "python"), "install", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bin_dir = env_dir / "bin"
    helped = run_in(bin_dir, elsewhere, "shardflow", "--help")
    assert helped.returncode == 0 and "serve-model" in helped.stdout, helped.stderr
    modules = sorted(name.removesuffix(".py").replace("/", ".") for name in sources)
    modules = [name.removesuffix(".__init__") for name in modules]
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({purelib!r}), module.__file__\n"
        "print(len(sys.modules))\n"
    )
    imported = run_in(bin_dir, elsewhere, "python", "-c", script)
    assert imported.returncode == 0, imported.stderr[-3000:]

    # The default encoding's shards, read by the installed package alone (raw records).
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(elsewhere / "project")
    shards = elsewhere / "project" / "data" / "shards"
    read = (
        "from tasks.contracts.tf_reader import read_split\n"
        "import tasks.contracts.raw_slice as raw_slice\n"
        f"batches = read_split({str(shards)!r}, 'test', batch_size=8, training=False)\n"
        "labels = [int(v) for _, y in batches for v in y.numpy()]\n"
        "print(raw_slice.SOURCE.is_file(), raw_slice.loaded_op() is not None, len(labels))\n"
    )
    done = run_in(bin_dir, elsewhere, "python", "-c", read)
    assert done.returncode == 0, done.stderr[-3000:]
    source_installed, op_loaded, records = done.stdout.split()
    assert source_installed == "True" and records == "30"
    assert op_loaded == str(shutil.which("g++") is not None), done.stderr[-2000:]
