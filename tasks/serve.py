"""A registered model over HTTP: MLflow's scoring app behind a request size limit.

``mlflow models serve`` runs MLflow's scoring app under uvicorn, and that app reads and
parses a whole request body before the model sees a row; neither uvicorn nor MLflow has an
option that limits a body's size. So the project's serve command (``make serve-model``)
runs the same app (:func:`mlflow.pyfunc.scoring_server.init`, what ``mlflow models serve``
builds) wrapped in :class:`RequestSizeLimit`: a body over ``--max-request-mb`` is answered
HTTP 413 with the limit in the message before anything parses it, and memory holds at most
the limit (a longer body is read and thrown away, a chunk at a time). Inside the limit the
model decodes and predicts rows a batch at a time (:func:`tasks.predict.predict_images`).

Run: ``python -m tasks.serve MODEL_URI --port PORT --max-request-mb MB`` from the repository
root; like ``mlflow models serve`` it hands over to uvicorn's command line (uvicorn comes with
MLflow), here with :func:`app_from_env` as the app factory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MODEL_URI_ENV = "SHARDFLOW_SERVE_MODEL_URI"
MAX_BYTES_ENV = "SHARDFLOW_SERVE_MAX_REQUEST_BYTES"


class RequestSizeLimit:
    """ASGI middleware: bodies over ``max_bytes`` get HTTP 413 and never reach ``app``.

    A declared ``Content-Length`` over the limit is refused without buffering anything; a
    chunked body is buffered until it passes the limit. Either way the rest of the body is
    drained unkept, so the client reads the answer instead of a reset connection.
    """

    def __init__(self, app: App, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await drain(receive)
            await self.refuse(send, f"{int(declared)} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                more = await drain(receive) if message.get("more_body", False) else 0
                await self.refuse(send, f"{size + more} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # the app waiting for a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def refuse(self, send: Send, size: str) -> None:
        limit_mb = self.max_bytes / 2**20
        message = (
            f"request body of {size} is over this server's limit of {self.max_bytes} bytes "
            f"({limit_mb:g} MB, --max-request-mb; `make serve-model SERVE_MAX_REQUEST_MB=...`): "
            "send fewer or smaller images per request"
        )
        body = json.dumps({"error_code": "REQUEST_TOO_LARGE", "message": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def drain(receive: Receive) -> int:
    """Read the rest of a request body without keeping it; its length in bytes."""
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return size
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return size


def scoring_app(model_uri: str, max_bytes: int) -> RequestSizeLimit:
    """MLflow's scoring app for ``model_uri`` (as ``mlflow models serve`` builds it), limited."""
    import mlflow.pyfunc
    from mlflow.pyfunc import scoring_server

    return RequestSizeLimit(scoring_server.init(mlflow.pyfunc.load_model(model_uri)), max_bytes)


def app_from_env() -> RequestSizeLimit:
    """uvicorn's app factory: the model and limit :func:`main` put in the environment."""
    return scoring_app(os.environ[MODEL_URI_ENV], int(os.environ[MAX_BYTES_ENV]))


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, then become the uvicorn server (as ``mlflow models serve`` runs
    uvicorn's command line, with the model named in the environment)."""
    parser = argparse.ArgumentParser(
        prog="python -m tasks.serve",
        description="Serve a model (models:/NAME@champion, runs:/ID/model) with a request limit.",
    )
    parser.add_argument("model_uri")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--max-request-mb", type=float, required=True, help="larger bodies get HTTP 413"
    )
    args = parser.parse_args(argv)
    if args.max_request_mb <= 0:
        parser.error(f"--max-request-mb must be positive, got {args.max_request_mb}")
    env = {
        **os.environ,
        MODEL_URI_ENV: args.model_uri,
        MAX_BYTES_ENV: str(int(args.max_request_mb * 2**20)),
    }
    print(
        f"serving {args.model_uri} at http://{args.host}:{args.port}/invocations "
        f"(requests up to {args.max_request_mb:g} MB)",
        flush=True,
    )
    command = [sys.executable, "-m", "uvicorn", "--factory", "tasks.serve:app_from_env"]
    command += ["--host", args.host, "--port", str(args.port), "--log-level", "warning"]
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    main()
