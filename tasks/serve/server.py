"""A registered model over HTTP: MLflow's scoring app behind request limits.

``mlflow models serve`` runs MLflow's scoring app under uvicorn, and that app reads and
parses a whole request body before the model sees a row; neither uvicorn nor MLflow has an
option that limits a body's size. So the project's serve command (``make serve-model``)
runs the same app (:func:`mlflow.pyfunc.scoring_server.init`, what ``mlflow models serve``
builds) wrapped in :class:`RequestLimits`: a body over ``--max-request-mb``, or with more
rows than ``--max-request-rows``, is answered HTTP 413 with the limit in the message before
anything parses it, and memory holds at most the byte limit (a longer body is read and thrown
away, a chunk at a time). Only JSON and CSV bodies reach the app (HTTP 415 for any other
type): MLflow's app also parses Parquet, whose compressed columns hold millions of rows in a
few kilobytes that no limit on bytes or separators sees. A JSON body whose arrays and objects
nest deeper than :data:`MAX_JSON_DEPTH` gets HTTP 400 before MLflow parses it (its parser
recurses once a level: 100,000 levels of ``[`` were a bare HTTP 500), and so does a body that
is not JSON or not text (MLflow's answer quoted all of it, escaped: :func:`unparsable`).
Past ``--max-concurrent-requests`` requests being read or answered at once, another gets
HTTP 503 (each holds up to the byte limit, and more once parsed). A connection must send each
request whole within MLflow's request timeout, its head (:class:`HeadDeadline`) and then its
body, or it is closed. Inside the limits the model decodes and predicts rows a batch at a time
(:func:`tasks.predict.predict_images`).

The model is a registered version, loaded by number after the checks every Shardflow loader
makes (:func:`tasks.serve.batch_prediction.load_pyfunc`: never a retracted version, its Keras
file the one registered). Served by alias (``models:/NAME@champion``), the server follows the
alias (:class:`AliasWatch`): every ``--alias-poll-s`` seconds it reads which version holds it,
and when that changes (a promotion, a retraction) loads the new one and answers with it; with
no version to serve, ``/invocations`` answers HTTP 503 saying why while ``/ping`` stays 200. A
request is answered to its end by the model it started with, and every answer names it in
the ``X-Shardflow-Model-Version`` header.

Run: ``python -m tasks.serve.server MODEL_URI --port PORT --max-request-mb MB --max-request-rows N
--max-concurrent-requests N --alias-poll-s S`` from the repository root; like ``mlflow models
serve`` it hands over to uvicorn's command line (uvicorn comes with MLflow), here with
:func:`app_from_env` as the app factory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# What every Shardflow entry point runs with unless the user says otherwise (the Makefile's
# and `shardflow`'s environment): run directly, MLflow's telemetry was on in the server.
NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
MODEL_URI_ENV = "SHARDFLOW_SERVE_MODEL_URI"
MAX_BYTES_ENV = "SHARDFLOW_SERVE_MAX_REQUEST_BYTES"
MAX_ROWS_ENV = "SHARDFLOW_SERVE_MAX_REQUEST_ROWS"
MAX_CONCURRENT_ENV = "SHARDFLOW_SERVE_MAX_CONCURRENT_REQUESTS"
ALIAS_POLL_ENV = "SHARDFLOW_SERVE_ALIAS_POLL_S"
VERSION_HEADER = b"x-shardflow-model-version"
NO_VERSION = b"none"
SERVED_KEY = "shardflow.served"  # in a request's scope: the model answering it
PATHS_WITHOUT_MODEL = ("/ping", "/health")  # answered 200 while no version is served
log = logging.getLogger(__name__)
# Separators a request may have beyond one a row: those between its JSON keys
# ("columns", "data", "params", ...).
ROW_SLACK = 16
# The bodies served, those whose rows can be counted before parsing. MLflow's app parses
# Parquet too, but compressed: 15 KB of it is five million rows (gigabytes once parsed).
JSON_TYPE = b"application/json"
CSV_TYPE = b"text/csv"
# How deep a JSON body's arrays and objects may nest. MLflow parses the body with Python's
# json module, which recurses once a level and raises RecursionError near 1,000 (answered as
# a bare HTTP 500); the layouts served nest 3 deep ({"dataframe_split": {"data": [[...]]}}),
# and "params" a few more.
MAX_JSON_DEPTH = 32
# A JSON string, escapes included: brackets inside one are text, not nesting.
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
# Brackets are counted this many at a time: whatever the depth, the count holds a few MB.
DEPTH_CHUNK = 1 << 18


class HeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline for each request's head: MLflow's request
    timeout (``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT``, 60 s unless set), counted from the
    connection's start and from each answer on a kept-alive connection. A connection without
    a whole head by then is closed.

    uvicorn closes a kept-alive connection that stays silent after an answer
    (``--timeout-keep-alive``), but one that sends nothing at all, or a head a byte at a time
    (each byte restarts that timer), it held for good: a client could hold every connection
    the process may open, and no other request would be answered. The body has its own
    deadline (:class:`RequestLimits`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT

        super().connection_made(transport)
        self.head_timeout_s = float(MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.get())
        self.head_deadline: asyncio.TimerHandle | None = None
        self.awaited_after: object = None  # the request cycle answered before the awaited head
        self.await_head()

    def await_head(self) -> None:
        self.cancel_deadline()
        self.awaited_after = self.cycle
        self.head_deadline = self.loop.call_later(self.head_timeout_s, self.head_too_late)

    def cancel_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self.awaited_after:  # a head arrived: a new request cycle
            self.cancel_deadline()

    def on_response_complete(self) -> None:
        self.await_head()  # before uvicorn reads a pipelined head, which cancels it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_deadline()
        super().connection_lost(exc)

    def head_too_late(self) -> None:
        self.head_deadline = None
        if not self.transport.is_closing():
            with contextlib.suppress(h11.LocalProtocolError):  # as uvicorn's keep-alive timer
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()


class Refusal(NamedTuple):
    """An answer that refuses a request: its message, HTTP status and error code."""

    message: str
    status: int = 413
    code: str = "REQUEST_TOO_LARGE"


class RequestLimits:
    """ASGI middleware: a body over ``max_bytes``, or with more than ``max_rows`` rows, gets
    HTTP 413 and never reaches ``app``; past ``max_concurrent`` requests (POST: those with a
    body) being read or answered at once, another gets HTTP 503.

    A declared ``Content-Length`` over the limit is refused without buffering anything; a
    chunked body is buffered until it passes the limit. Either way the rest of the body is
    drained unkept, so the client reads the answer instead of a reset connection.

    Rows are counted before parsing by their separators, which no base64 cell contains:
    commas in JSON (any of MLflow's layouts puts one between two rows), line ends in CSV
    (``\n``, ``\r\n`` or a lone ``\r``: pandas ends a row at each). The count is an upper
    bound, with :data:`ROW_SLACK` for the separators of the JSON keys. A byte limit alone
    would not do: MLflow parses a body of empty rows into tens of times its size. A body of
    any other content type (or none) gets HTTP 415 unread, and one that MLflow could not parse
    (JSON nested deeper than :data:`MAX_JSON_DEPTH`, not JSON, not text) HTTP 400 saying why.

    Without a bound on requests at once, N clients held N bodies of up to ``max_bytes``, and
    their parses. A request past it is drained unkept like an oversized one; ``/ping`` and
    the other bodiless requests are never counted, so a busy server still answers them.
    (uvicorn's ``--limit-concurrency`` counts connections instead, idle keep-alive ones and
    the asking one included, and answers a plain-text 503 that names no limit.) A body not
    received within ``read_timeout_s`` gets HTTP 408: else clients sending theirs a byte at a
    time would hold every place, and no other request be answered.
    """

    def __init__(
        self,
        app: App,
        *,
        max_bytes: int,
        max_rows: int,
        max_concurrent: int,
        read_timeout_s: float,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_rows = max_rows
        self.max_concurrent = max_concurrent
        self.read_timeout_s = read_timeout_s
        self.in_progress = 0  # POST requests being read, checked or answered now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            await self.limited(scope, receive, send)
            return
        if self.in_progress >= self.max_concurrent:
            await drain(receive)
            await self.refuse(
                send,
                f"this server is answering its limit of {self.max_concurrent} requests at once "
                "(--max-concurrent-requests; "
                "`make serve-model SERVE_MAX_CONCURRENT_REQUESTS=...`): retry shortly",
                status=503,
                code="TEMPORARILY_UNAVAILABLE",
            )
            return
        self.in_progress += 1  # no await before it: counted as the request starts
        try:
            await self.limited(scope, receive, send)
        finally:
            self.in_progress -= 1

    async def limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request under the limits on its type, size, rows and time to arrive, refused
        unless it parses."""
        content_type = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip()
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body = await self.read_body(scope, content_type, receive)
        except TimeoutError:
            body = Refusal(
                f"request body not received within {self.read_timeout_s:g} s "
                "(MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT): send it at once",
                status=408,
                code="REQUEST_TIMEOUT",
            )
        if isinstance(body, Refusal):
            await self.refuse(send, body.message, status=body.status, code=body.code)
            return
        if body is None:  # the client left
            return
        if count_rows(body, content_type) > self.max_rows + ROW_SLACK:
            await self.refuse(
                send,
                f"request has more than this server's limit of {self.max_rows} rows "
                f"(--max-request-rows; `make serve-model SERVE_MAX_REQUEST_ROWS=...`): "
                "send fewer images per request",
            )
            return
        # On a thread: a 16 MB body takes a fraction of a second, which the others' need not wait.
        problem = None
        if scope.get("method") == "POST":  # a JSON or CSV body, by the type check above
            problem = await asyncio.to_thread(unparsable, body, content_type)
        if problem is not None:
            await self.refuse(
                send,
                f"{problem}: send "
                '{"dataframe_split": {"columns": ["image"], "data": [["<base64>"], ...]}}',
                status=400,
                code="BAD_REQUEST",
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # the app waiting for a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def read_body(
        self, scope: Scope, content_type: bytes, receive: Receive
    ) -> bytes | Refusal | None:
        """The body, or why it is refused (the rest of it read and thrown away), or None when
        the client disconnected."""
        if scope.get("method") == "POST" and content_type not in (JSON_TYPE, CSV_TYPE):
            await drain(receive)
            shown = content_type.decode("latin-1") or "none"
            return Refusal(
                f"content type {shown} is not served here: send {JSON_TYPE.decode()} "
                f"(or {CSV_TYPE.decode()}) with a column 'image' of base64 image files",
                status=415,
                code="UNSUPPORTED_MEDIA_TYPE",
            )
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await drain(receive)
            return Refusal(self.too_large(f"{int(declared)} bytes"))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                more = await drain(receive) if message.get("more_body", False) else 0
                return Refusal(self.too_large(f"{size + more} bytes"))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def too_large(self, size: str) -> str:
        return (
            f"request body of {size} is over this server's limit of {self.max_bytes} bytes "
            f"({self.max_bytes / 2**20:g} MB, --max-request-mb; "
            "`make serve-model SERVE_MAX_REQUEST_MB=...`): send fewer or smaller images per request"
        )

    @staticmethod
    async def refuse(
        send: Send, message: str, *, status: int = 413, code: str = "REQUEST_TOO_LARGE"
    ) -> None:
        body = json.dumps({"error_code": code, "message": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def count_rows(body: bytes, content_type: bytes) -> int:
    """An upper bound on the rows MLflow parses from ``body``: its separators (a CSV's line
    ends, each ``\r\n`` once; a JSON body's commas)."""
    if content_type == CSV_TYPE:
        return body.count(b"\n") + body.count(b"\r") - body.count(b"\r\n")
    return body.count(b",")


def unparsable(body: bytes, content_type: bytes) -> str | None:
    """Why MLflow's app could not parse ``body``, said without quoting it; None if it can.

    MLflow's own answer quotes the whole body, and its bytes escaped: invalid UTF-8 makes
    an answer many times the body's size, built at a peak larger still. So the body is
    decoded (a CSV) or parsed (JSON, as MLflow's ``json.loads`` does, after
    :func:`nests_deeper` bounds its recursion) once here first, the parse freed before
    MLflow's."""
    try:
        if content_type == CSV_TYPE:
            body.decode("utf-8")
            return None
        if nests_deeper(body, MAX_JSON_DEPTH):
            return f"request JSON nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
        json.loads(body)
    except UnicodeDecodeError as exc:  # its str() and repr() hold the whole body
        return f"request body is not text ({exc.encoding}: {exc.reason} at byte {exc.start})"
    except json.JSONDecodeError as exc:
        return f"request body is not JSON ({exc})"  # "Expecting value: line 1 column 1 ..."
    return None


def nests_deeper(body: bytes, limit: int) -> bool:
    """Whether the arrays and objects of the JSON ``body`` nest more than ``limit`` deep
    (brackets inside strings are not counted), found without parsing it: in memory, the
    body's text outside its strings, its brackets and a few MB, whatever the depth."""
    import numpy as np

    brackets = np.frombuffer(JSON_STRING.sub(b"", body).translate(None, NOT_BRACKETS), np.uint8)
    depth = 0
    for start in range(0, len(brackets), DEPTH_CHUNK):
        chunk = brackets[start : start + DEPTH_CHUNK]
        opens = (chunk == ord("[")) | (chunk == ord("{"))
        levels = depth + np.cumsum(opens.astype(np.int32) * 2 - 1, dtype=np.int32)
        if levels.max() > limit:
            return True
        depth = int(levels[-1])
    return False


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


@dataclass(frozen=True)
class Served:
    """A loaded version and MLflow's scoring app over it."""

    version: str
    app: App


@dataclass(frozen=True)
class Resolved:
    """Which version the alias names now (None: none to serve), and why not in words."""

    version: str | None
    why_not: str = ""


class AliasWatch:
    """The version an alias names, read again every ``poll_s`` seconds on a thread.

    ``resolve()`` says which version holds the alias (or why none may be served: no version
    holds it, or the one that does is retracted); ``load(version)`` builds the app for one,
    raising a :class:`~tasks.runtime.refusals.Refused` when it must not be served. ``current``
    is swapped whole, so a request that took the old one finishes on it."""

    def __init__(
        self,
        resolve: Callable[[], Resolved],
        load: Callable[[str], App],
        poll_s: float,
    ) -> None:
        self.resolve = resolve
        self.load = load
        self.poll_s = poll_s
        self.current: Served | None = None
        self.why_not = "no version loaded yet"
        self.stopped = threading.Event()

    def poll(self) -> None:
        """Read the alias once; load and swap in the version it names when that changed."""
        from tasks.runtime.refusals import Refused

        found = self.resolve()
        if found.version is None:
            if self.current is not None:
                log.warning("no longer serving v%s: %s", self.current.version, found.why_not)
            self.current, self.why_not = None, found.why_not
            return
        if self.current is not None and self.current.version == found.version:
            return
        try:
            app = self.load(found.version)
        except Refused as refused:
            self.current, self.why_not = None, f"{refused} ({refused.fix})"
            log.warning("not serving v%s: %s", found.version, self.why_not)
            return
        self.current = Served(found.version, app)
        log.warning("serving v%s", found.version)

    def follow(self) -> None:
        """Poll until stopped; a store that does not answer keeps what is served."""
        while not self.stopped.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # the store blipped: keep serving, try again next time
                log.exception("reading the alias failed; serving what was served")

    def start(self) -> None:
        threading.Thread(target=self.follow, name="alias-watch", daemon=True).start()


class FollowAlias:
    """ASGI app: each request is answered by the version :class:`AliasWatch` serves when it
    starts (to its end), under :class:`RequestLimits`, with that version in the
    ``X-Shardflow-Model-Version`` header; with none, ``/invocations`` gets HTTP 503 saying why
    and ``/ping`` 200."""

    def __init__(self, watch: AliasWatch, **limits: Any) -> None:
        self.watch = watch
        self.limits = RequestLimits(self.answer, **limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        served = self.watch.current  # this request's model, whatever the alias does meanwhile
        version = served.version.encode() if served is not None else NO_VERSION

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (VERSION_HEADER, version)]
                message = {**message, "headers": headers}
            await send(message)

        await self.limits({**scope, SERVED_KEY: served}, receive, send_named)

    async def answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        served: Served | None = scope[SERVED_KEY]
        if served is not None:
            await served.app(scope, receive, send)
            return
        if scope.get("path") in PATHS_WITHOUT_MODEL:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"\n"})
            return
        await RequestLimits.refuse(
            send,
            f"no model to serve: {self.watch.why_not}",
            status=503,
            code="MODEL_UNAVAILABLE",
        )


async def lifespan(receive: Receive, send: Send) -> None:
    """uvicorn's start and stop messages, answered (the watch thread needs neither)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def registry_watch(model_uri: str, poll_s: float) -> AliasWatch:
    """The :class:`AliasWatch` for ``models:/NAME@ALIAS`` (polled every ``poll_s``) or a fixed
    ``models:/NAME/N`` (never polled), over the store in ``MLFLOW_TRACKING_URI``."""
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc import scoring_server

    from tasks.contracts.model_versions import retraction_words
    from tasks.runtime.tracking import client
    from tasks.serve.batch_prediction import ModelRef

    store = client()
    name, _, alias = model_uri.removeprefix("models:/").partition("@")
    fixed = None if alias else name.partition("/")[2]
    name = name.partition("/")[0]

    def resolve() -> Resolved:
        if fixed is not None:
            return Resolved(fixed)
        try:
            version = store.get_model_version_by_alias(name, alias)
        except MlflowException:
            return Resolved(
                None,
                f"no version of {name} holds the alias {alias}{last_retraction()}: "
                "shardflow promote --version N --reason R gives it one",
            )
        words = retraction_words(version.tags)
        if words is not None:
            return Resolved(None, f"{name} v{version.version} holds {alias} but is {words}")
        return Resolved(str(version.version))

    def last_retraction() -> str:
        """The latest retracted version and why, the likely reason the alias is gone."""
        versions = store.search_model_versions(f"name = '{name}'")
        retracted = [v for v in versions if retraction_words(v.tags) is not None]
        last = max(retracted, key=lambda v: int(v.version), default=None)
        return "" if last is None else f" (v{last.version} is {retraction_words(last.tags)})"

    def load(version: str) -> App:
        from tasks.serve.batch_prediction import load_pyfunc

        pyfunc, _ = load_pyfunc(store, ModelRef(f"models:/{name}/{version}", name, version, ""))
        return scoring_server.init(pyfunc)  # type: ignore[no-any-return]

    return AliasWatch(resolve, load, poll_s)


def scoring_app(
    model_uri: str, *, max_bytes: int, max_rows: int, max_concurrent: int, alias_poll_s: float
) -> FollowAlias:
    """MLflow's scoring app (as ``mlflow models serve`` builds it) for the version
    ``model_uri`` names, following its alias, limited; a body must arrive within MLflow's own
    request timeout (60 s unless ``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT`` says otherwise),
    which its app then gives the prediction."""
    from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT

    watch = registry_watch(model_uri, alias_poll_s)
    watch.poll()  # the version served from the first request on
    if "@" in model_uri:
        watch.start()
    return FollowAlias(
        watch,
        max_bytes=max_bytes,
        max_rows=max_rows,
        max_concurrent=max_concurrent,
        read_timeout_s=MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.get(),
    )


def app_from_env() -> FollowAlias:
    """uvicorn's app factory: the model and limits :func:`main` put in the environment."""
    return scoring_app(
        os.environ[MODEL_URI_ENV],
        max_bytes=int(os.environ[MAX_BYTES_ENV]),
        max_rows=int(os.environ[MAX_ROWS_ENV]),
        max_concurrent=int(os.environ[MAX_CONCURRENT_ENV]),
        alias_poll_s=float(os.environ[ALIAS_POLL_ENV]),
    )


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, then become the uvicorn server (as ``mlflow models serve`` runs
    uvicorn's command line, with the model named in the environment)."""
    parser = argparse.ArgumentParser(
        prog="python -m tasks.serve.server",
        description="Serve a registered version (models:/NAME@champion, following the alias, or "
        "models:/NAME/N) with request limits.",
    )
    parser.add_argument("model_uri")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--max-request-mb", type=float, required=True, help="larger bodies get HTTP 413"
    )
    parser.add_argument(
        "--max-request-rows", type=int, required=True, help="requests with more get HTTP 413"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        required=True,
        help="requests being read or answered at once; one more gets HTTP 503",
    )
    parser.add_argument(
        "--alias-poll-s",
        type=float,
        required=True,
        help="read which version holds the alias this often (seconds), and serve it",
    )
    args = parser.parse_args(argv)
    if not args.model_uri.startswith("models:/"):
        parser.error("MODEL_URI is a registered version: models:/NAME@ALIAS or models:/NAME/N")
    flags = ("--max-request-mb", "--max-request-rows", "--max-concurrent-requests")
    for flag in (*flags, "--alias-poll-s"):
        if getattr(args, flag[2:].replace("-", "_")) <= 0:
            parser.error(f"{flag} must be positive")
    from tasks.runtime.layout import keep_library_files_in
    from tasks.runtime.tracking import tracking_uri

    # A server's user:password@ goes to MLflow's variables before MLflow sees the URI: MLflow
    # puts the URI in its errors ("API request to <uri>/... failed"), on the server's output.
    uri = tracking_uri()
    env = {
        **NO_TELEMETRY,
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        MODEL_URI_ENV: args.model_uri,
        MAX_BYTES_ENV: str(int(args.max_request_mb * 2**20)),
        MAX_ROWS_ENV: str(args.max_request_rows),
        MAX_CONCURRENT_ENV: str(args.max_concurrent_requests),
        ALIAS_POLL_ENV: str(args.alias_poll_s),
    }
    keep_library_files_in(env)  # the model imports Keras
    print(
        f"serving {args.model_uri} at http://{args.host}:{args.port}/invocations "
        f"(requests up to {args.max_request_mb:g} MB and {args.max_request_rows} rows, "
        f"{args.max_concurrent_requests} at once; the alias read every {args.alias_poll_s:g} s)",
        flush=True,
    )
    command = [sys.executable, "-m", "uvicorn", "--factory", "tasks.serve.server:app_from_env"]
    command += ["--http", "tasks.serve.server:HeadDeadline"]
    command += ["--host", args.host, "--port", str(args.port), "--log-level", "warning"]
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    main()
