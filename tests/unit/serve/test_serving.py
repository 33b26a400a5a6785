"""Serving under hostile requests: each bad row fails alone, a body over the limit is
refused before it is parsed, and requests past the limit at once are turned away, while the
server goes on answering."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI, Request
from PIL import Image

from tasks import predict
from tasks.predict import ServingSpec, predict_images
from tasks.serve.server import RequestLimits
from tests.e2e.conftest import free_port
from tests.unit.serve.test_predict import png_bytes, spec_for

ROOT = Path(__file__).parents[3]


def jpeg_bytes(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="JPEG")
    return buffer.getvalue()


def split_body(values: list[str]) -> bytes:
    frame = {"columns": ["image"], "data": [[value] for value in values]}
    return json.dumps({"dataframe_split": frame}).encode()


# -- rows decoded and predicted a batch at a time -------------------------------------------


def test_rows_are_decoded_and_predicted_a_batch_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never more than one batch of decoded pixels waits for the model."""
    from tasks import predict

    waiting = 0
    most_waiting = 0
    real_model_input = predict.model_input

    def counting_model_input(data: bytes, spec: ServingSpec) -> np.ndarray:
        nonlocal waiting, most_waiting
        pixels = real_model_input(data, spec)
        waiting += 1
        most_waiting = max(most_waiting, waiting)
        return pixels

    class Model:  # what tasks.contracts.inference.predict_batch uses of a Keras model
        predict_function = None
        jit_compile = True

        def predict_on_batch(self, batch: np.ndarray) -> np.ndarray:
            nonlocal waiting
            waiting -= len(batch)
            return np.tile([0.2, 0.5, 0.3], (len(batch), 1))

    monkeypatch.setattr(predict, "model_input", counting_model_input)
    good = png_bytes(np.full((20, 20, 3), 90, np.uint8))
    images: list[object] = [good] * 25
    images[7] = b"not an image"
    frame = predict_images(Model(), images, spec_for(), batch_size=4)  # type: ignore[arg-type]
    assert most_waiting <= 4
    assert list(frame["error"] != "") == [row == 7 for row in range(25)]
    assert list(frame["label"]) == ["green" if row != 7 else "" for row in range(25)]


class FixedModel:  # what tasks.contracts.inference.predict_batch uses of a Keras model
    predict_function = None
    jit_compile = True

    def predict_on_batch(self, batch: np.ndarray) -> np.ndarray:
        return np.tile([0.2, 0.5, 0.3], (len(batch), 1))


@pytest.fixture
def served_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[predict.ShardflowModel, list[bytes]]:
    """The served pyfunc over :class:`FixedModel` in the scoring server's environment, and
    the list of the rows it decoded."""
    from tasks import predict

    decoded: list[bytes] = []
    real_model_input = predict.model_input

    def counting_model_input(data: bytes, spec: ServingSpec) -> np.ndarray:
        decoded.append(data)
        return real_model_input(data, spec)

    monkeypatch.setattr(predict, "model_input", counting_model_input)
    monkeypatch.setenv("_MLFLOW_IS_IN_SERVING_ENVIRONMENT", "true")
    served = predict.ShardflowModel()
    served.spec, served.model = spec_for(), FixedModel()
    return served, decoded


def test_a_served_request_past_its_time_decodes_no_more_rows(
    served_decodes: tuple[predict.ShardflowModel, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow answers HTTP 504 at its request timeout but cannot stop the thread predicting
    the request: the model stops decoding rows instead of holding the decode threads and
    the cores for every one of them. Batch prediction, outside the server, has no deadline."""
    import pandas as pd

    served, decoded = served_decodes
    rows = pd.DataFrame({"image": [png_bytes(np.full((20, 20, 3), 90, np.uint8))] * 40})
    monkeypatch.setenv("MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT", "0")  # its time is up at once
    with pytest.raises(predict.RequestAbandoned, match="past its time limit"):
        served.predict(None, rows)
    assert not decoded
    monkeypatch.delenv("_MLFLOW_IS_IN_SERVING_ENVIRONMENT")
    assert list(served.predict(None, rows)["label"]) == ["green"] * 40
    assert len(decoded) == 40


def test_a_served_request_declaring_more_pixels_than_its_budget_is_refused_undecoded(
    served_decodes: tuple[predict.ShardflowModel, list[bytes]],
) -> None:
    """A few KB of 1-bit PNG declare 40 Mpx, under ingest.max_pixels: thirty of them decoded
    for minutes. Their headers are counted first, and the request refused, nothing decoded."""
    import pandas as pd

    served, decoded = served_decodes
    big = io.BytesIO()
    Image.new("1", (6320, 6320)).save(big, "PNG")
    assert len(big.getvalue()) < 10_000
    small = png_bytes(np.full((20, 20, 3), 90, np.uint8))
    with pytest.raises(predict.RequestTooLarge, match="more than 1,073,741,824 pixels") as refused:
        served.predict(None, pd.DataFrame({"image": [small] + [big.getvalue()] * 30}))
    assert refused.value.fix == "send fewer or smaller images per request"
    assert not decoded
    assert (
        list(served.predict(None, pd.DataFrame({"image": [small] * 3}))["label"]) == ["green"] * 3
    )


def test_a_jpeg_counts_against_the_budget_at_the_size_it_decodes_to() -> None:
    """A JPEG drafted to 1/8 of each side holds 1/64 of its pixels while it decodes: camera
    photos decode side by side; a PNG, or a JPEG without the draft, at its full size."""
    import dataclasses

    from tasks.predict import declared_pixels

    pixels = np.full((300, 400, 3), 120, np.uint8)
    spec = spec_for()  # 16x16 pad, draft on
    assert declared_pixels(jpeg_bytes(pixels), spec) == 50 * 38  # 400x300 at 1/8
    assert declared_pixels(png_bytes(pixels), spec) == 400 * 300
    undrafted = dataclasses.replace(spec, draft_decode=False)
    assert declared_pixels(jpeg_bytes(pixels), undrafted) == 400 * 300
    assert declared_pixels(b"not an image", spec) == 0


# -- a logged model behind MLflow's scoring app ---------------------------------------------


# -- the request limits ---------------------------------------------------------------------


def echo_app() -> RequestLimits:
    """The limits in front of a tiny app that answers with the body length it read."""
    app = FastAPI()

    @app.post("/invocations")
    async def invocations(request: Request) -> dict[str, int]:
        return {"read": len(await request.body())}

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {}

    return RequestLimits(app, max_bytes=1000, max_rows=20, max_concurrent=2, read_timeout_s=60)


def test_the_server_starts_without_credentials_in_its_uri_or_telemetry(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make serve-model` against a server named with user:password@ printed the password
    in MLflow's error when that server did not answer; they go to MLflow's variables."""
    from tasks.serve import server as serve

    started: list[dict[str, str]] = []
    monkeypatch.setattr(serve.os, "execve", lambda path, argv, env: started.append(env))
    for name in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"):
        monkeypatch.delenv(name, raising=False)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, "")  # recorded, so what main() sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://ana:s3cret@mlflow.internal:5000")
    limits = ["--max-request-mb", "1", "--max-request-rows", "1", "--max-concurrent-requests", "1"]
    limits += ["--alias-poll-s", "10"]
    serve.main(["models:/m@champion", "--port", "1", *limits])
    [env] = started
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.internal:5000"
    assert env["MLFLOW_DISABLE_TELEMETRY"] == env["DO_NOT_TRACK"] == "true"  # run directly too
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == ("ana", "s3cret")
    assert "s3cret" not in capsys.readouterr().out


def test_the_server_keeps_keras_and_matplotlib_files_in_the_repository(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The served model imports Keras (and Keras Matplotlib): keras.json, the font cache
    and matplotlibrc are the repository's, never the user's home's."""
    from tasks.serve import server as serve

    started: list[dict[str, str]] = []
    monkeypatch.setattr(serve.os, "execve", lambda path, argv, env: started.append(env))
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.setenv("KERAS_HOME", "/home/ana/.keras")
    monkeypatch.setenv("MATPLOTLIBRC", "/home/ana/matplotlibrc")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    limits = ["--max-request-mb", "1", "--max-request-rows", "1", "--max-concurrent-requests", "1"]
    limits += ["--alias-poll-s", "10"]
    serve.main(["models:/m@champion", "--port", "1", *limits])
    [env] = started
    assert env["KERAS_HOME"] == str(Path.cwd().resolve() / ".shardflow" / "keras")
    assert env["MPLCONFIGDIR"] == str(Path.cwd().resolve() / ".shardflow" / "matplotlib")
    assert "MATPLOTLIBRC" not in env


def test_a_body_over_the_limit_is_refused_unread_and_the_next_is_answered() -> None:
    from fastapi.testclient import TestClient

    with TestClient(echo_app(), headers={"Content-Type": "application/json"}) as client:
        over = client.post("/invocations", content=b"x" * 1001)
        assert over.status_code == 413
        assert over.json()["error_code"] == "REQUEST_TOO_LARGE"
        assert "1001 bytes is over this server's limit of 1000 bytes" in over.json()["message"]
        chunked = client.post("/invocations", content=iter([b"y" * 600] * 3))  # no length
        assert chunked.status_code == 413 and "1800 bytes" in chunked.json()["message"]
        fits = b'"' + b"z" * 998 + b'"'  # a JSON string of 1000 bytes
        assert client.post("/invocations", content=fits).json() == {"read": 1000}
        chunks = iter([fits[:500], fits[500:]])
        assert client.post("/invocations", content=chunks).json() == {"read": 1000}


def closed_by_server(connection: socket.socket) -> bool:
    """Whether the server closes ``connection`` (else it is still open after 30 s)."""
    connection.settimeout(30)
    try:
        while connection.recv(4096):
            pass  # an answer, before the close
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@contextmanager
def served(
    model_uri: str, mlflow_uri: str, log: Path, *limits: str, **environment: str
) -> Iterator[str]:
    """`python -m tasks.serve.server` (what `make serve-model` runs), a real uvicorn server, with
    ``limits`` (flag, value, ...) and ``environment``; its address once it answers, the
    server still running when the block ends (else the log's tail)."""
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri, **environment}
    command = [sys.executable, "-m", "tasks.serve.server", model_uri, "--port", str(port), *limits]
    command += [] if "--alias-poll-s" in limits else ["--alias-poll-s", "10"]
    with log.open("w") as handle:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        yield url
        assert process.poll() is None, log.read_text()[-4000:]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # uvicorn waits for requests a failed test left open
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)


def test_more_rows_than_the_limit_are_refused_before_parsing() -> None:
    """Counted by separators: a JSON comma between rows, a CSV line end."""
    from fastapi.testclient import TestClient

    json_type = {"Content-Type": "application/json"}
    with TestClient(echo_app()) as client:  # 20 rows, and 16 separators for the JSON keys
        many = client.post("/invocations", content=split_body([""] * 40), headers=json_type)
        assert many.status_code == 413
        assert "more than this server's limit of 20 rows" in many.json()["message"]
        csv = client.post(
            "/invocations", content=b"image\n" + b"x\n" * 40, headers={"Content-Type": "text/csv"}
        )
        assert csv.status_code == 413
        fits = split_body(["a"] * 20)
        assert client.post("/invocations", content=fits, headers=json_type).json() == {
            "read": len(fits)
        }
        pretty = json.dumps(json.loads(fits), indent=2).encode()  # line ends are not rows
        assert client.post("/invocations", content=pretty, headers=json_type).status_code == 200


def test_csv_rows_ended_by_a_lone_carriage_return_are_counted() -> None:
    """pandas ends a CSV row at a lone \\r as at \\n: such a body is not one row."""
    from fastapi.testclient import TestClient

    csv_type = {"Content-Type": "text/csv"}
    with TestClient(echo_app()) as client:  # 20 rows, 16 separators of slack
        many = client.post("/invocations", content=b"image\r" + b"x\r" * 40, headers=csv_type)
        assert many.status_code == 413
        assert "more than this server's limit of 20 rows" in many.json()["message"]
        windows = b"image\r\n" + b"x\r\n" * 20  # \r\n is one line end, not two
        assert client.post("/invocations", content=windows, headers=csv_type).status_code == 200


def test_bodies_whose_rows_cannot_be_counted_are_refused_unread() -> None:
    """Parquet (MLflow's app parses it: 15 KB of it is millions of rows) or no type: 415."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from fastapi.testclient import TestClient

    buffer = io.BytesIO()
    pq.write_table(pa.table({"image": [""] * 100_000}), buffer, compression="zstd")
    assert len(buffer.getvalue()) < 1000  # under the byte limit, 5,000 times the row limit
    with TestClient(echo_app()) as client:
        parquet = client.post(
            "/invocations",
            content=buffer.getvalue(),
            headers={"Content-Type": "application/vnd.apache.parquet"},
        )
        assert parquet.status_code == 415
        assert parquet.json()["error_code"] == "UNSUPPORTED_MEDIA_TYPE"
        assert "application/vnd.apache.parquet is not served here" in parquet.json()["message"]
        untyped = client.post("/invocations", content=b'{"inputs": {"image": []}}')
        assert untyped.status_code == 415 and "content type none" in untyped.json()["message"]
        fits = split_body(["a"])
        assert client.post(
            "/invocations", content=fits, headers={"Content-Type": "application/json"}
        ).json() == {"read": len(fits)}


def test_json_nested_deeper_than_the_limit_is_refused_before_parsing() -> None:
    """Python's json module (MLflow's parser) recurses once a level; brackets inside strings
    are text, escaped quotes included, and do not count."""
    from fastapi.testclient import TestClient

    json_type = {"Content-Type": "application/json"}
    deep = b'{"a":' + b"[" * 31 + b"]" * 31 + b"}"  # 32 levels, the limit
    deeper = b'{"a":' + b"[" * 32 + b"]" * 32 + b"}"
    texts = json.dumps({"a": ["[" * 200, '\\"{{{' * 50, "]" * 10]}).encode()
    with TestClient(echo_app()) as client:
        refused = client.post("/invocations", content=deeper, headers=json_type)
        assert refused.status_code == 400
        assert refused.json()["error_code"] == "BAD_REQUEST"
        assert (
            "request JSON nests arrays and objects more than 32 levels deep"
            in refused.json()["message"]
        )
        for body in (deep, texts):
            assert client.post("/invocations", content=body, headers=json_type).json() == {
                "read": len(body)
            }


def test_bodies_that_do_not_parse_are_refused_saying_why_without_quoting_them() -> None:
    """MLflow's answer to a body it cannot parse quoted all of it, escaped."""
    from fastapi.testclient import TestClient

    json_type = {"Content-Type": "application/json"}
    csv_type = {"Content-Type": "text/csv"}
    with TestClient(echo_app()) as client:
        for content, headers, reason in (
            (b'{"a": 1} ' + b"x" * 900, json_type, "request body is not JSON (Extra data: line 1"),
            (b'{"a": "' + b"\xff" * 900 + b'"}', json_type, "utf-8: invalid start byte at byte 7"),
            (b"image\n" + b"\xff" * 900, csv_type, "utf-8: invalid start byte at byte 6"),
        ):
            refused = client.post("/invocations", content=content, headers=headers)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error_code"] == "BAD_REQUEST"
            assert reason in refused.json()["message"]
            assert len(refused.content) < 300  # the reason, not the body
        fits = b"image\nabc\n"
        assert client.post("/invocations", content=fits, headers=csv_type).json() == {"read": 10}
        assert client.get("/ping").status_code == 200  # no body to parse


# -- following the alias ----------------------------------------------------------------------


def version_app(
    version: str, started: threading.Event | None = None, release: threading.Event | None = None
) -> FastAPI:
    """A scoring app that answers with its version; with ``release``, only once set."""
    app = FastAPI()

    @app.post("/invocations")
    def invocations() -> dict[str, str]:
        if started is not None and release is not None:
            started.set()
            release.wait(30)
        return {"answered_by": version}

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {}

    return app


def test_the_server_follows_its_alias_and_names_the_version_in_every_answer() -> None:
    from fastapi.testclient import TestClient

    from tasks.runtime.refusals import Refused
    from tasks.serve.server import AliasWatch, FollowAlias, Resolved

    holds = {"alias": Resolved("1")}
    started, release = threading.Event(), threading.Event()

    def load(version: str) -> object:
        if version == "3":
            raise Refused("m v3 is retracted by ana: bad labels", fix="use another version")
        return version_app(version, started if version == "1" else None, release)

    watch = AliasWatch(lambda: holds["alias"], load, poll_s=3600)  # type: ignore[arg-type]
    watch.poll()
    app = FollowAlias(watch, max_bytes=1000, max_rows=20, max_concurrent=2, read_timeout_s=60)
    json_type = {"Content-Type": "application/json"}
    body = split_body(["a"])
    with TestClient(app) as client:
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(client.post, "/invocations", content=body, headers=json_type)
            assert started.wait(30)
            holds["alias"] = Resolved("2")  # promoted while v1 answers
            watch.poll()
            release.set()
            first = in_flight.result(30)
        assert first.json() == {"answered_by": "1"}  # finished on the model it started with
        assert first.headers["x-shardflow-model-version"] == "1"
        second = client.post("/invocations", content=body, headers=json_type)
        assert second.json() == {"answered_by": "2"}
        assert second.headers["x-shardflow-model-version"] == "2"
        too_large = client.post("/invocations", content=b"[" * 2000, headers=json_type)
        assert (
            too_large.status_code == 413 and too_large.headers["x-shardflow-model-version"] == "2"
        )

        holds["alias"] = Resolved(None, "no version of m holds the alias champion")
        watch.poll()
        none = client.post("/invocations", content=body, headers=json_type)
        assert none.status_code == 503 and "no version of m holds" in none.json()["message"]
        assert none.headers["x-shardflow-model-version"] == "none"
        assert client.get("/ping").status_code == 200

        holds["alias"] = Resolved("3")  # the alias on a version that must not be served
        watch.poll()
        refused = client.post("/invocations", content=body, headers=json_type)
        assert refused.status_code == 503 and "m v3 is retracted" in refused.json()["message"]
