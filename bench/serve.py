"""Serving figures: batch prediction throughput and single-image HTTP latency.

A model is trained for one epoch on shards of the bench images, logged and registered as the
image-bytes pyfunc (``tasks.predict.log_pyfunc``, what evaluation registers) in a throwaway
SQLite store, then measured two ways:

- ``predict.images_per_s``: ``tasks.serve.batch_prediction.predict_files`` (the batch flow's core)
  over the bench's source JPEGs, median of the timed passes;
- ``serve.p50_ms`` / ``serve.p95_ms``: one image per POST to ``mlflow models serve`` on
  127.0.0.1, sequential requests after a warm-up.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tasks.runtime.params import Params


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def registered_model(params: Params, shards: Path, work: Path) -> tuple[str, str, int]:
    """Train one epoch, log the pyfunc to a run; (model URI, tracking URI, max bytes)."""
    from mlflow import MlflowClient

    from tasks.contracts.manifest import load_manifest
    from tasks.contracts.tf_reader import read_split
    from tasks.predict import ServingSpec, log_pyfunc
    from tasks.runtime import tracking
    from tasks.train.models import build_model

    work.mkdir(parents=True, exist_ok=True)
    model_file = work / "model.keras"
    manifest = load_manifest(shards)
    # One plain epoch on the train split (the bench ingest puts every image there): the
    # figures measure serving, not accuracy.
    model = build_model(params.train, len(manifest.classes), manifest.record_schema.image_shape)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(read_split(shards, "train", batch_size=32, training=True, seed=0), verbose=0)
    model.save(model_file)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    experiment_id = tracking.experiment_id(client, "bench-serve")
    run_id = client.create_run(experiment_id).info.run_id
    spec = ServingSpec.from_manifest(manifest, params.ingest)
    model_uri = log_pyfunc(client, run_id, model_file, spec)
    client.set_terminated(run_id)
    return model_uri, uri, spec.max_file_bytes


def batch_throughput(
    model_uri: str, tracking_uri: str, files: list[Path], max_bytes: int, *, passes: int
) -> dict[str, Any]:
    import mlflow

    from bench.stats import timed_passes
    from tasks.runtime.tracking import using_store
    from tasks.serve.batch_prediction import predict_files

    with using_store(tracking_uri):
        model = mlflow.pyfunc.load_model(model_uri)
    return timed_passes(lambda: len(predict_files(model, files, max_bytes)), passes=passes)


def http_latency(
    model_uri: str, tracking_uri: str, files: list[Path], *, requests: int, work: Path
) -> dict[str, Any]:
    """p50/p95 of single-image POSTs to `mlflow models serve` (sequential, after warm-up)."""
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    log = work / "serve.log"
    with log.open("w") as handle:
        process = subprocess.Popen(
            [
                *("mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local"),
                *("-h", "127.0.0.1", "-p", str(port)),
            ],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(f"{base}/ping", process, log)
        bodies = [
            json.dumps(
                {
                    "dataframe_split": {
                        "columns": ["image"],
                        "data": [[base64.b64encode(path.read_bytes()).decode()]],
                    }
                }
            ).encode()
            for path in files[: max(1, min(len(files), requests))]
        ]
        post = _poster(f"{base}/invocations")
        for body in bodies[:5]:
            post(body)  # warm-up: first requests trace the model's graph
        times = []
        for i in range(requests):
            start = time.perf_counter()
            post(bodies[i % len(bodies)])
            times.append((time.perf_counter() - start) * 1000)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    return {
        "p50_ms": float(np.percentile(times, 50)),
        "p95_ms": float(np.percentile(times, 95)),
        "requests": requests,
    }


def _poster(url: str) -> Callable[[bytes], dict[str, Any]]:
    def post(body: bytes) -> dict[str, Any]:
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer: dict[str, Any] = json.loads(response.read())
        if answer["predictions"][0]["error"]:
            raise RuntimeError(f"served model refused a bench image: {answer}")
        return answer

    return post


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow models serve exited:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} never answered:\n{log.read_text()[-2000:]}")


def measure_serving(
    params: Params,
    shards: Path,
    images: Path,
    work: Path,
    *,
    passes: int,
    requests: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """All serving figures; keys ``predict.images_per_s``, ``serve.p50_ms``, ``serve.p95_ms``."""
    from tasks.serve.batch_prediction import list_sources

    model_uri, tracking_uri, max_bytes = registered_model(params, shards, work)
    files = list_sources(images)
    log(f"   model {model_uri}; {len(files)} source images")
    batch = batch_throughput(model_uri, tracking_uri, files, max_bytes, passes=passes)
    latency = http_latency(model_uri, tracking_uri, files, requests=requests, work=work)
    return {
        "predict.images_per_s": batch["per_s"],
        "serve.p50_ms": latency["p50_ms"],
        "serve.p95_ms": latency["p95_ms"],
        "details": {"predict": batch, "serve": latency},
    }
