"""Shared fixtures: tiny synthetic image folders under ``tmp_path`` (no network, no demo data)."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from PIL import Image

if TYPE_CHECKING:
    from tasks.runtime.params import Params


def _absl_writes_to_the_process_stderr() -> None:
    """absl (TensorFlow's Python logging) makes its handler when first imported, on whatever
    ``sys.stderr`` is then: under pytest, a capture buffer. ``logging.config.dictConfig``
    (Prefect's logging set-up, at its first import) closes every handler ever made, and absl's
    handler closes its stream unless it is ``sys.stderr`` at that moment, which under a
    ``capsys`` test it is not: pytest's own capture buffer was closed under it and the rest of
    the test run failed. Pointed at the process's standard error, it closes nothing of pytest's.
    """
    from absl import logging as absl_logging

    absl_logging.get_absl_handler().python_handler.setStream(sys.__stderr__)


_absl_writes_to_the_process_stderr()

# Fails a test that changes the user's data (the folder the working copy's params.yaml
# names) or the checkout's outputs, and the run when anything changed them.
# pytester: the guard's own test runs a suite in a suite.
pytest_plugins = ["tests.workspace_guard", "pytester"]

TINY_CLASSES = {"blue": (40, 40, 200), "green": (40, 200, 40), "red": (200, 40, 40)}


def write_image_folder(root: Path, *, per_class: int = 12, seed: int = 0) -> Path:
    """Write ``root/<class>/<i>.png|jpg``: noisy solid colours, 20-60 px, every file distinct."""
    rng = np.random.default_rng(seed)
    for name, colour in TINY_CLASSES.items():
        class_dir = root / name
        class_dir.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            height, width = (int(v) for v in rng.integers(20, 61, size=2))
            noise = rng.integers(-40, 41, size=(height, width, 3))
            pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
            suffix = "jpg" if i % 3 == 0 else "png"  # both decoders get exercised
            Image.fromarray(pixels, mode="RGB").save(class_dir / f"{i:03d}.{suffix}")
    return root


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collecting imported (TensorFlow, MLflow, Prefect: millions of objects, alive
    to the end) leaves the garbage collector's generations: a full collection scanned them
    all again, most of a second each, dozens of times a suite."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, each group in collection order: ``make test`` hands the suite to
    its workers (pytest-xdist) a test at a time, and a long end-to-end test started last would
    leave the other workers idle until it ended."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True, scope="session")
def dvc_site_cache_in_the_sessions_folder(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """The DVC commands tests run by hand keep their site caches in the session's temporary
    folder, not /var/tmp/dvc, where hundreds of test repositories' stayed after the suite
    (what `shardflow` runs keeps its own in its repository: tasks.runtime.layout.LIBRARY_HOMES)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path_factory.mktemp("dvc-site-cache")))
    yield
    patch.undo()


@contextmanager
def tf_op_determinism(on: bool) -> Iterator[None]:
    """TensorFlow's op determinism ``on`` or off for the block, then as it was: the setting is
    process-wide, and a deterministic training run earlier in the same process (a test's, or
    a fixture's) leaves it on for every test after."""
    from tensorflow.python.framework import config

    was = config.is_op_determinism_enabled()
    (config.enable_op_determinism if on else config.disable_op_determinism)()
    try:
        yield
    finally:
        (config.enable_op_determinism if was else config.disable_op_determinism)()


class InThisProcess:
    """:func:`tasks.runtime.processes.run_in_child`'s stand-in: ``fn(*args)`` runs in this
    process when its result is asked for, as a child would have run it."""

    def __init__(self, fn: Callable[..., object], *args: object) -> None:
        self._fn, self._args = fn, args

    def result(self, timeout: float | None = None) -> object:
        return self._fn(*self._args)

    def cancel(self) -> None:
        """Nothing runs until :meth:`result` is asked for."""


@pytest.fixture
def tf_cross_check_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation's TensorFlow cross-check (:func:`tasks.validate.stage.start_cross_check`)
    run in the test's process, which has TensorFlow imported already, instead of a spawned
    child importing it again: about 3 s of CPU a validation. For tests of what validation
    reports (the data gate's refusals, a forget's result), not of how it runs the check:
    the child itself is tested by its own entry in tests/data/test_validate.py and
    tests/integration/test_pool_slow.py, tests/integration/test_append_slow.py validates
    through it, and every `dvc repro` of the end-to-end tests runs the stage as users do."""
    import tasks.validate.stage

    monkeypatch.setattr(tasks.validate.stage, "run_in_child", InThisProcess)


@pytest.fixture
def tiny_dataset(tmp_path: Path) -> Path:
    """A 3-class x 12-image folder dataset; returns the source dir."""
    return write_image_folder(tmp_path / "images")


def tiny_params(source: Path, **shard: object) -> Params:
    """The repository's params for a tiny folder at ``source``: splits 0.5/0.25/0.25 (none
    left empty), one ingest worker, 16 px shards of about two records, one shard worker;
    ``shard`` changes shard keys."""
    from tasks.runtime.params import default_params

    return default_params(
        ingest={
            "source_dir": str(source),
            "splits": {"train": 0.5, "val": 0.25, "test": 0.25},
            "workers": 1,
        },
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1, **shard},
    )


@pytest.fixture(scope="session")
def tiny_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ingest index of a tiny dataset (splits 0.5/0.25/0.25, none empty); shared, read-only."""
    from tasks.ingest.stage import run_ingest

    root = tmp_path_factory.mktemp("tiny_index")
    source = write_image_folder(root / "images")
    run_ingest(tiny_params(source).ingest, root / "index.json", root / "ingest.json")
    return root / "index.json"


# -- training side (tiny validated shards, offline tracking) ---------------------------------

# No telemetry or analytics calls from tests (offline CI); set before mlflow/prefect import.
for _name, _value in {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def prefect_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty Prefect server database (tests/prefect_database.py), made once for
    the session and its xdist workers: copy it into a test server's home before the server
    starts (:func:`tests.prefect_database.seed_home`); never write to it."""
    from tests.prefect_database import migrated_database

    base = tmp_path_factory.getbasetemp()
    # each xdist worker's base is a folder of the session's own (pytest-N/popen-gwK)
    return migrated_database(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(scope="session")
def prefect_harness(prefect_database: Path) -> Iterator[None]:
    """A temporary Prefect server for the whole session (started once, ~10-20 s): flows
    run here as `dvc repro` runs them, through their task runners. Every module that runs
    flows in this process uses it: a harness per module cost a server start (about 10 s of
    CPU) per module and worker, ten of them a suite. Its database starts as a copy of the
    migrated one, in the temporary folder Prefect's harness makes (and removes) for it."""
    import tempfile

    import prefect.testing.utilities
    from prefect.testing.utilities import prefect_test_harness

    def seeded_folder() -> str:
        folder = tempfile.mkdtemp()
        shutil.copyfile(prefect_database, Path(folder) / "prefect-test.db")
        return folder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefect.testing.utilities, "mkdtemp", seeded_folder)
        with prefect_test_harness(server_startup_timeout=120):
            patch.undo()
            yield


@pytest.fixture
def every_decode_handed_off() -> Iterator[None]:
    """Ingest keeps every decode for the shard stage, small images too: tests of the hand-off
    itself use images far smaller than the photos it pays for
    (:func:`tasks.contracts.handoff.worth_handing_off`). The bench's alternative
    (:func:`bench.handoff_entry.every_decode_kept`), in this process only: ingest must run
    without spawned workers."""
    from bench.handoff_entry import every_decode_kept

    with every_decode_kept():
        yield


@pytest.fixture
def tiny_shards(tmp_path: Path) -> Path:
    """A project root with validated 3-class 16x16 shards (train 72, val 18, test 30)."""
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def blank_mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store, made once: creating one runs MLflow's schema migrations
    (most of a second of CPU), copying one costs nothing. Copy it; never write to it."""
    from mlflow import MlflowClient

    database = tmp_path_factory.mktemp("blank_mlflow_store") / "mlflow.db"
    MlflowClient(f"sqlite:///{database}").search_experiments()
    return database


def copy_blank_store(blank: Path, database: Path) -> str:
    """A fresh store at ``database`` (its URI), as MLflow makes one, from ``blank``: its
    Default experiment keeps artifacts beside ``database``, not beside the blank store."""
    import shutil
    import sqlite3

    database.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(blank, database)
    with contextlib.closing(sqlite3.connect(database)) as connection, connection:
        connection.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
            (str(database.parent / "mlruns" / "0"),),
        )
    return f"sqlite:///{database}"


@pytest.fixture
def new_mlflow_store(blank_mlflow_store: Path) -> Callable[[Path], str]:
    """Makes a fresh MLflow SQLite store at a path and returns its URI."""
    return partial(copy_blank_store, blank_mlflow_store)


@pytest.fixture
def mlflow_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point MLflow at a SQLite store under ``tmp_path``, not made yet: whatever opens it
    first makes it (tests that check a refusal opens no store rely on that)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def mlflow_store(mlflow_uri: str, new_mlflow_store: Callable[[Path], str]) -> str:
    """:func:`mlflow_uri` with its store made already, for tests that register or log."""
    return new_mlflow_store(Path(mlflow_uri.removeprefix("sqlite:///")))


@pytest.fixture(scope="session")
def trained_project(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A tiny model trained and registered (``tiny@champion``) by the real stages; read-only."""
    from tests.trained_model import build_trained_project

    return build_trained_project(tmp_path_factory.mktemp("trained_project"))


# -- object storage: a real moto S3 server on a free loopback port (tests/s3_server.py) -----
from tests.s3_server import s3_server, s3_server_session  # noqa: E402, F401


@pytest.fixture(autouse=True)
def project_code_stays_this_checkouts() -> Iterator[None]:
    """Loading a logged model puts its copy of ``tasks/`` first on ``sys.path`` and imports
    from it (MLflow's ``code_paths``), in a test or a session fixture: after every test, only
    this checkout's code stays, or later tests (and the processes they spawn, which inherit
    ``sys.path``) run a model's copy."""
    yield
    sys.path[:] = [entry for entry in sys.path if not foreign_code(entry)]
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None) or ""
        if name.split(".")[0] in ("tasks", "flows") and not where.startswith(str(CHECKOUT)):
            del sys.modules[name]


CHECKOUT = Path(__file__).resolve().parents[1]


def foreign_code(entry: str) -> bool:
    """A ``sys.path`` entry holding another copy of the project's ``tasks`` package."""
    folder = Path(entry or ".").resolve()
    return folder != CHECKOUT and (folder / "tasks" / "__init__.py").is_file()
