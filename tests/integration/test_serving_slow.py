"""The served model through MLflow's scoring app and a real `mlflow models serve` process: each
test logs a tiny model and most start a server (the request rules themselves:
tests/unit/serve/test_serving.py)."""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks import predict
from tasks.predict import ServingSpec, log_pyfunc, predict_images
from tests.e2e.conftest import free_port
from tests.unit.pixels.test_images import EPS
from tests.unit.serve.test_predict import png_bytes, spec_for, tiny_keras_model
from tests.unit.serve.test_serving import (
    closed_by_server,
    echo_app,
    jpeg_bytes,
    served,
    split_body,
)

pytestmark = pytest.mark.slow


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def register_tiny_model(tmp_path: Path, mlflow_uri: str, name: str = "served") -> str:
    """A tiny model logged with the project's pyfunc (signature, code, spec) and registered
    as the next version of ``name``, recording its file's sha256; that version."""
    import mlflow
    from mlflow import MlflowClient

    from tasks.contracts.model_versions import MODEL_SHA256_TAG, file_sha256
    from tasks.runtime.tracking import experiment_id, using_store

    model_file = tmp_path / "model.keras"
    tiny_keras_model().save(model_file)  # type: ignore[attr-defined]
    client = MlflowClient(mlflow_uri, mlflow_uri)
    run = client.create_run(experiment_id(client, "serving"))
    uri = log_pyfunc(client, run.info.run_id, model_file, spec_for())
    with using_store(mlflow_uri):
        found = mlflow.register_model(uri, name, tags={MODEL_SHA256_TAG: file_sha256(model_file)})
    return str(found.version)


@pytest.fixture
def logged_model(tmp_path: Path, mlflow_uri: str) -> str:
    """Version 1 of ``served`` (:func:`register_tiny_model`); its models:/ URI."""
    return f"models:/served/{register_tiny_model(tmp_path, mlflow_uri)}"


def good_rows() -> list[str]:
    rng = np.random.default_rng(0)
    return [
        b64(png_bytes(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8))),
        b64(jpeg_bytes(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))),
    ]


@contextmanager
def uvicorn_serving(app: object, http: object) -> Iterator[int]:
    """``app`` under a real uvicorn server in this process, speaking ``http`` (a protocol
    class); its port."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_each_bad_row_gets_its_error_through_the_scoring_app(logged_model: str) -> None:
    """MLflow's own scoring app (the one `mlflow models serve` runs), in process."""
    import mlflow.pyfunc
    from fastapi.testclient import TestClient
    from mlflow.pyfunc import scoring_server

    good_png, good_jpeg = good_rows()
    rows = [good_png, "aGVsbG8", b64(b"plain text"), b64(EPS), good_jpeg]
    app = scoring_server.init(mlflow.pyfunc.load_model(logged_model))
    with TestClient(app) as client:
        answer = client.post(
            "/invocations", content=split_body(rows), headers={"Content-Type": "application/json"}
        )
    assert answer.status_code == 200, answer.text
    predictions = answer.json()["predictions"]
    errors = [row["error"] for row in predictions]
    assert errors[0] == errors[4] == ""
    assert "not base64" in errors[1]
    assert "not an image" in errors[2]
    assert "format EPS is not decoded" in errors[3]
    assert [row["label_index"] for row in predictions][1:4] == [-1, -1, -1]
    assert all(row["label"] in ("blue", "green", "red") for row in (predictions[0], predictions[4]))


def post(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_served_model_refuses_an_oversized_body_and_stays_up(
    logged_model: str, mlflow_uri: str, tmp_path: Path
) -> None:
    limits = ("--max-request-mb", "1", "--max-request-rows", "100")
    with served(
        logged_model, mlflow_uri, tmp_path / "serve.log", *limits, "--max-concurrent-requests", "2"
    ) as url:
        noise = b64(np.random.default_rng(1).bytes(900_000))  # ~1.2 MB of base64
        status, answer = post(f"{url}/invocations", split_body([noise]))
        assert status == 413, answer
        assert "over this server's limit of 1048576 bytes" in str(answer["message"])
        status, answer = post(f"{url}/invocations", split_body([""] * 200))
        assert status == 413, answer
        assert "more than this server's limit of 100 rows" in str(answer["message"])
        status, answer = post(f"{url}/invocations", split_body(good_rows()))
        assert status == 200, answer
        predictions = answer["predictions"]
        assert isinstance(predictions, list)
        assert [row["error"] for row in predictions] == ["", ""]


def held_request(url: str, body: bytes) -> http.client.HTTPConnection:
    """A POST whose headers and first bytes are sent, the rest of ``body`` held back."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=120)
    connection.putrequest("POST", "/invocations")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(len(body)))
    connection.endheaders(message_body=body[:10])
    return connection


def finished(connection: http.client.HTTPConnection, body: bytes) -> http.client.HTTPResponse:
    """The rest of a :func:`held_request`'s body sent; its response."""
    connection.send(body[10:])
    return connection.getresponse()


def test_the_served_model_answers_a_bounded_number_of_requests_at_once(
    logged_model: str, mlflow_uri: str, tmp_path: Path
) -> None:
    """N clients each held a body in memory at once, however many. Past the limit a request
    gets HTTP 503 naming it; those in progress are answered, and so is the next one."""
    body = split_body(good_rows())
    limits = ("--max-request-mb", "1", "--max-request-rows", "100")
    with served(
        logged_model, mlflow_uri, tmp_path / "serve.log", *limits, "--max-concurrent-requests", "2"
    ) as url:
        held = [held_request(url, body), held_request(url, body)]
        try:
            # The server reads what arrived first first: once /ping, asked after both held
            # requests began, is answered, both are being read (and /ping is never counted).
            with urllib.request.urlopen(f"{url}/ping", timeout=60) as ping:
                assert ping.status == 200
            refused = finished(held_request(url, body), body)
            answer = json.loads(refused.read())
            assert refused.status == 503, answer
            assert refused.getheader("Retry-After") == "1"
            assert answer["error_code"] == "TEMPORARILY_UNAVAILABLE"
            assert "answering its limit of 2 requests at once (--max-concurrent-requests" in str(
                answer["message"]
            )
            for connection in held:
                response = finished(connection, body)
                answer = json.loads(response.read())
                assert response.status == 200, answer
                assert [row["error"] for row in answer["predictions"]] == ["", ""]
        finally:
            for connection in held:
                connection.close()
        status, answer = post(f"{url}/invocations", body)
        assert status == 200, answer


def test_bodies_sent_too_slowly_are_refused_and_free_their_places(
    logged_model: str, mlflow_uri: str, tmp_path: Path
) -> None:
    """Clients that never finish their bodies held every place (--max-concurrent-requests)
    for ever: no other request was answered. Past MLflow's request timeout they get 408, and
    a connection that never sent a request is closed (:class:`tasks.serve.server.HeadDeadline`)."""
    body = split_body(good_rows())
    limits = ("--max-request-mb", "1", "--max-request-rows", "100")
    with served(
        logged_model,
        mlflow_uri,
        tmp_path / "serve.log",
        *limits,
        *("--max-concurrent-requests", "2"),
        MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT="2",
    ) as url:
        silent = socket.create_connection(("127.0.0.1", int(url.rpartition(":")[2])))
        held = [held_request(url, body), held_request(url, body)]
        try:
            assert closed_by_server(silent)
            for connection in held:  # the rest of each body never sent
                response = connection.getresponse()
                answer = json.loads(response.read())
                assert response.status == 408, answer
                assert answer["error_code"] == "REQUEST_TIMEOUT"
                assert "request body not received within 2 s" in answer["message"]
        finally:
            silent.close()
            for connection in held:
                connection.close()
        status, answer = post(f"{url}/invocations", body)
        assert status == 200, answer


def test_deeply_nested_json_fails_alone_through_the_scoring_app(logged_model: str) -> None:
    """100,000 levels of `[` were a bare HTTP 500 (RecursionError in MLflow's json.loads),
    and 1 MB that is not UTF-8 a 10 MB answer quoting it, escaped: now a short 400 that says
    what is wrong, found in memory of about the body's size, and the next request is
    answered."""
    import tracemalloc

    from fastapi.testclient import TestClient

    from tasks.serve.server import scoring_app

    app = scoring_app(
        logged_model, max_bytes=1 << 20, max_rows=100, max_concurrent=2, alias_poll_s=10.0
    )
    json_type = {"Content-Type": "application/json"}
    with TestClient(app, raise_server_exceptions=False) as client:
        for hostile, reason in (
            (b"[" * 100_000, "more than 32 levels deep"),
            (b"{" * (1 << 20), "more than 32 levels deep"),
            (b"\xff" * (1 << 20), "utf-8: invalid start byte at byte 0"),  # 10 MB answered
        ):
            tracemalloc.start()
            try:
                refused = client.post("/invocations", content=hostile, headers=json_type)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert refused.status_code == 400, refused.text
            assert reason in refused.json()["message"]
            assert len(refused.content) < 300
            assert peak < 4 * len(hostile) + (1 << 20)
        answer = client.post("/invocations", content=split_body(good_rows()), headers=json_type)
    assert answer.status_code == 200, answer.text
    assert [row["error"] for row in answer.json()["predictions"]] == ["", ""]


def test_the_pyfunc_is_logged_from_code_and_loads_without_unpickling(
    tmp_path: Path, mlflow_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A registered version is its entry file (models from code), never a pickled object:
    loading runs reviewed code only, and MLflow has no CloudPickle warning to give."""
    import logging
    import warnings

    import mlflow.pyfunc
    import yaml

    with (
        caplog.at_level(logging.WARNING, logger="mlflow"),
        warnings.catch_warnings(record=True) as warned,
    ):
        warnings.simplefilter("always")
        uri = logged_model.__wrapped__(tmp_path, mlflow_uri)  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if "CloudPickle" in r.getMessage()]
    # the signature says what a request holds: no "input example" warning on make run's output
    assert not [str(w.message) for w in warned if "input example" in str(w.message)]
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "got")))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor.get("model_code_path", "").endswith("serving_model.py")
    assert not list(local.rglob("python_model.pkl"))
    assert mlflow.pyfunc.load_model(uri).metadata.signature is not None


def answered_by(url: str) -> tuple[int, str, dict[str, object]]:
    """A prediction request's status, the version header and the answer."""
    request = urllib.request.Request(
        f"{url}/invocations",
        data=split_body(good_rows()),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return (
                response.status,
                response.headers["X-Shardflow-Model-Version"],
                json.loads(response.read()),
            )
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["X-Shardflow-Model-Version"], json.loads(exc.read())


def until(url: str, wanted: Callable[[int, str], bool]) -> tuple[int, str, dict[str, object]]:
    """Ask until the answer is ``wanted`` (the alias is read every second), at most 3 min."""
    for _ in range(180):
        answer = answered_by(url)
        if wanted(answer[0], answer[1]):
            return answer
        time.sleep(1)
    raise AssertionError(f"the server never answered as wanted; last: {answer}")


def test_a_server_started_before_a_retraction_follows_the_champion_alias(
    tmp_path: Path, mlflow_uri: str
) -> None:
    """`shardflow serve-model`'s server: v1 champion when it starts; retracted by an erasure
    (what `shardflow forget` does), /invocations gets 503 saying why (/ping 200); v2
    promoted, v2 answers; each answer names its version."""
    from mlflow import MlflowClient

    from tasks.contracts.model_versions import Retraction
    from tasks.erasure.retraction import retract_versions
    from tasks.runtime.tracking import CHAMPION

    client = MlflowClient(mlflow_uri, mlflow_uri)
    for _ in range(2):
        register_tiny_model(tmp_path, mlflow_uri)
    client.set_registered_model_alias("served", CHAMPION, "1")
    limits = ("--max-request-mb", "1", "--max-request-rows", "100", "--alias-poll-s", "1")
    with served(
        "models:/served@champion",
        mlflow_uri,
        tmp_path / "serve.log",
        *limits,
        "--max-concurrent-requests",
        "2",
    ) as url:
        status, version, _ = answered_by(url)
        assert (status, version) == (200, "1")
        # what `shardflow forget` does to the versions that saw a forgotten image
        erasure = Retraction(
            "ana",
            "2026-12-07T09:00:00+00:00",
            "consent withdrawn",
            erasure="2026-12-07T09:00:00+00:00",
            images=3,
        )
        retract_versions(client, "served", ["1"], erasure, delete=False)
        status, version, answer = until(url, lambda status, _: status == 503)
        assert version == "none"
        message = str(answer["message"])
        assert "no version of served holds the alias champion (v1 is retracted" in message
        assert "by the erasure of 2026-12-07T09:00:00+00:00" in message
        with urllib.request.urlopen(f"{url}/ping", timeout=30) as ping:
            assert ping.status == 200
        client.set_registered_model_alias("served", CHAMPION, "2")
        status, version, answer = until(url, lambda status, _: status == 200)
        assert version == "2" and answer["predictions"]


def test_a_batchs_rows_are_decoded_on_threads_and_answered_in_their_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    rng = np.random.default_rng(0)
    images: list[object] = [
        png_bytes(rng.integers(0, 256, (20 + row, 30, 3), dtype=np.uint8)) for row in range(8)
    ]
    images[3] = b"not an image"
    model, spec = tiny_keras_model(), spec_for()
    one_by_one = predict_images(model, images, spec, batch_size=4, threads=1)

    together = threading.Barrier(2, timeout=20)
    real_model_input = predict.model_input

    def paired_model_input(data: bytes, spec: ServingSpec) -> np.ndarray:
        together.wait()  # passes only while another row of the batch is being decoded too
        return real_model_input(data, spec)

    monkeypatch.setattr(predict, "model_input", paired_model_input)
    frame = predict_images(model, images, spec, batch_size=4, threads=2)
    assert list(frame["error"] != "") == [row == 3 for row in range(8)]
    np.testing.assert_array_equal(frame.to_numpy(), one_by_one.to_numpy())


def test_decode_threads_hold_no_more_pixels_at_once_than_the_largest_image_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request of large images decodes them one at a time, however many threads there are:
    its memory stays what one row at a time needed."""
    import dataclasses

    spec = dataclasses.replace(spec_for(), max_pixels=1000)
    sizes = [(20, 30), (20, 20), (25, 40), (10, 30), (20, 30), (20, 20), (25, 40), (20, 50)]
    images = [png_bytes(np.full((h, w, 3), 60, np.uint8)) for h, w in sizes]
    held, most = 0, 0
    lock = threading.Lock()
    real_model_input = predict.model_input

    def watched_model_input(data: bytes, spec: ServingSpec) -> np.ndarray:
        nonlocal held, most
        pixels = int(np.prod(Image.open(io.BytesIO(data)).size))
        with lock:
            held += pixels
            most = max(most, held)
        time.sleep(0.05)  # long enough for the other threads' rows to start meanwhile
        with lock:
            held -= pixels
        return real_model_input(data, spec)

    monkeypatch.setattr(predict, "model_input", watched_model_input)
    frame = predict_images(tiny_keras_model(), images, spec, batch_size=8, threads=4)
    assert list(frame["error"]) == [""] * len(images)
    assert most <= 1000  # four rows at once would hold up to 3,600


def test_connections_that_never_send_a_whole_request_head_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn held a connection that sent nothing, or a head a byte at a time, for good: a
    client could hold every connection the server may open. Past MLflow's request timeout
    each is closed, a kept-alive one's next head too, and the server goes on answering."""
    from tasks.serve.server import HeadDeadline

    monkeypatch.setenv("MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT", "1")
    with uvicorn_serving(echo_app(), HeadDeadline) as port:
        silent = socket.create_connection(("127.0.0.1", port))
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\n")
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        kept.settimeout(30)
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /ping HTTP/1.1\r\n")  # the next head, never finished
        try:
            for connection in (silent, partial, kept):
                assert closed_by_server(connection)
        finally:
            for connection in (silent, partial, kept):
                connection.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=30) as ping:
            assert ping.status == 200
