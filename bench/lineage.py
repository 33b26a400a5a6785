"""Reverse lineage at a million images and a hundred training runs.

``python -m bench --only lineage`` generates a project with no pixels in it: an ingest
index of N records (fake content hashes, paths and perceptual hashes), the current shard
set's membership and four older sets' (the last of them without the image looked up), and
a tracking store with R training runs spread over the five sets, each with an evaluation
run and a registered version, the last one the champion. Then it times
:func:`tasks.erasure.lineage.lineages` on one image, named by its path (the scan of the index, the
membership lookups, the run and registry searches), as ``shardflow lineage`` does after its
imports: ``lineage.lookup_s``, the median of three, target under 5 s; and the whole
command in a fresh interpreter (imports included) as ``lineage.command_s``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.contracts.index import write_index
from tasks.contracts.manifest import MEMBERSHIP_NAME
from tasks.contracts.membership import write_membership_file
from tasks.runtime.layout import Layout

CLASSES = ("cat", "dog", "fox")
SETS = 5
REPO_ROOT = Path(__file__).resolve().parents[1]
ENTRY = np.dtype([("sha", "S32"), ("split", "u1"), ("gen", ">u2"), ("file", ">u4"), ("rec", ">u4")])


def sha(i: int) -> str:
    return hashlib.sha256(i.to_bytes(8, "big")).hexdigest()


THUMB = "80" * 256  # a 16x16 grey thumbnail, as ingest writes one per record


def make_index(path: Path, n: int) -> None:
    """An ingest index of ``n`` records, each with a fake content and perceptual hash and a
    thumbnail (one grey picture for all: its bytes in the file are what lineage scans)."""
    rng = np.random.default_rng(0)
    phashes = rng.integers(0, 2**63, size=n, dtype=np.int64)
    splits = ("train",) * 8 + ("val", "test")
    records = [
        {
            "path": f"{CLASSES[i % 3]}/img_{i:08d}.jpg",
            "label": CLASSES[i % 3],
            "label_index": i % 3,
            "sha256": sha(i),
            "split": splits[i % len(splits)],
            "format": "JPEG",
            "width": 640,
            "height": 480,
            "phash": f"{int(phashes[i]):016x}",
            "thumb": THUMB,
        }
        for i in range(n)
    ]
    index = {"source_dir": "images", "classes": list(CLASSES), "records": records}
    write_index(path, {**index, "verdict_key": "synthetic", "verdicts": {}})


def make_membership(path: Path, fingerprint: str, n: int, per_file: int = 2000) -> None:
    """A set's membership of records ``0..n-1``, ``per_file`` a shard file."""
    table = np.zeros(n, dtype=ENTRY)
    table["sha"] = [bytes.fromhex(sha(i)) for i in range(n)]
    table["file"] = np.arange(n) // per_file
    table["rec"] = np.arange(n) % per_file
    table.sort(order="sha")
    files = [f"train.tfrecord-{k:05d}" for k in range((n + per_file - 1) // per_file)]
    write_membership_file(path, fingerprint, files, table.tobytes())


def make_runs(uri: str, fingerprints: list[str], runs: int, model_name: str) -> None:
    """``runs`` training runs over the sets, each evaluated and registered."""
    from mlflow import MlflowClient

    client = MlflowClient(uri, uri)
    client.create_registered_model(model_name)
    for k in range(runs):
        fingerprint = fingerprints[k % len(fingerprints)]
        tags = {"data.fingerprint": fingerprint}
        run_id = client.create_run("0", run_name=f"run-{k}", tags=tags).info.run_id
        evaluates = {"shardflow.evaluates": run_id, "mlflow.parentRunId": run_id}
        client.create_run("0", run_name=f"eval-run-{k}", tags=evaluates)
        client.create_model_version(model_name, f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias(model_name, "champion", str(runs))


def make_project(root: Path, images: int, runs: int, model_name: str) -> str:
    """The generated project (kept between bench runs of the same size); its store's URI."""
    layout = Layout(root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    done = root / ".complete"
    if done.exists():
        return uri
    root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO_ROOT / "params.yaml", layout.params)  # what the command reads
    fingerprints = [hashlib.sha256(f"set-{k}".encode()).hexdigest() for k in range(SETS)]
    make_index(layout.index, images)
    layout.shards_dir.mkdir(parents=True, exist_ok=True)
    make_membership(layout.shards_dir / MEMBERSHIP_NAME, fingerprints[0], images)
    layout.membership_archive.mkdir(parents=True, exist_ok=True)
    for k, fingerprint in enumerate(fingerprints):
        # the oldest set lacks the last tenth: the image looked up is one of those
        held = images - images // 10 if k == SETS - 1 else images
        make_membership(layout.membership_archive / f"{fingerprint}.bin", fingerprint, held)
    make_runs(uri, fingerprints, runs, model_name)
    done.touch()
    return uri


def measure_lineage(
    work: Path, *, images: int, runs: int, distance: int, log: Any = print
) -> dict[str, Any]:
    """Build (or reuse) the project, then time lineage in this process and as a command."""
    from mlflow import MlflowClient

    from tasks.erasure.lineage import lineages
    from tasks.runtime.dataset_identity import model_name_for
    from tasks.runtime.params import load_params

    root = work / f"lineage-{images}-{runs}"
    model_name = model_name_for(load_params(REPO_ROOT / "params.yaml"), REPO_ROOT)
    started = time.perf_counter()
    uri = make_project(root, images, runs, model_name)
    log(f"   lineage project ready in {time.perf_counter() - started:.1f} s")
    layout, path = Layout(root), f"{CLASSES[(images - 1) % 3]}/img_{images - 1:08d}.jpg"
    client = MlflowClient(uri, uri)
    times, found = [], None
    for _ in range(3):
        started = time.perf_counter()
        (found,) = lineages(
            [path],
            layout,
            client,
            source_dir=root / "images",
            model_name=model_name,
            distance=distance,
        )
        times.append(time.perf_counter() - started)
    assert found is not None and len(found.shard_sets) == SETS - 1, found
    command = [sys.executable, "-m", "flows.cli.lineage", "--root", str(root), found.sha256]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True, cwd=REPO_ROOT)
    command_s = time.perf_counter() - started
    log(f"   lineage of 1 image: {statistics.median(times):.2f} s ({command_s:.1f} s as a command)")
    return {
        "images": images,
        "runs": runs,
        "lookup_s": statistics.median(times),
        "lookup_runs_s": times,
        "command_s": command_s,
        "runs_found": len(found.runs),
    }
