"""Image bytes in, class out: the MLflow pyfunc model (batch prediction over files is
``tasks.serve.batch_prediction``).

The registered model is an MLflow ``PythonModel`` that carries the Keras model plus the
:class:`ServingSpec` read from the shard manifest (image size, resize policy, encoding,
classes, preprocessing version) and the ingest size limits. It turns raw file bytes into the
model's input with :func:`tasks.images.preprocess_bytes`, the code the shard stage used, and
for ``jpeg``/``png`` shards it repeats the shard round trip (``RecordSchema.encode_image``,
then the reader's TensorFlow decode), so the pixels the model sees at serving time are the
pixels it saw in training: no train/serve skew.

A bad row (malformed base64, not an image, a format not decoded, truncated, too large) gets its
``error`` column filled; the rest of the batch is still answered. Rows are decoded and predicted
a batch at a time. Versions registered before the ``image`` column became a string (MLflow
``binary``) fail a whole request on one malformed base64 row: the scoring server decodes it.

The code under ``tasks/`` is logged with the model (``code_paths``), so a fresh process or
``mlflow models serve`` can import it; when the loading environment's
:func:`tasks.images.preprocessing_version` differs from the recorded one, loading logs a
warning (the model still loads: the bundled code is used, but Pillow or NumPy differ and
pixels may too).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd  # at run time: MLflow resolves predict's type hints (mlflow imports it)
from mlflow.pyfunc import PythonModel

from tasks.contracts.inference import predict_batch
from tasks.contracts.manifest import ShardManifest
from tasks.images import (
    ImageRejected,
    draft_for,
    open_checked,
    preprocess_bytes,
    preprocessing_version,
)
from tasks.runtime.processes import usable_cores
from tasks.runtime.refusals import Refused
from tasks.schema import RecordSchema

if TYPE_CHECKING:
    import keras
    from mlflow import MlflowClient
    from mlflow.models import ModelSignature

    from tasks.runtime.params import IngestParams

log = logging.getLogger(__name__)

IMAGE_COLUMN = "image"
PROB_PREFIX = "p_"  # one probability column per class: p_<class name>
RESULT_COLUMNS = ("label", "label_index", "score", "error")
MODEL_NAME_IN_RUN = "model"  # the run artifact the registered version points at
KERAS_ARTIFACT = "keras_model"
SPEC_ARTIFACT = "serving_spec"
BATCH_SIZE = 64
MAX_DECODE_THREADS = 16  # a request's rows decoded at once, at most
# Pixels one served request may decode in all, counted from each row's header before any is
# decoded: the bound on a request's decode time (the pixel budget below bounds its memory).
# 1024 phone photos drafted for a 224 px model are a fifth of it; a thousand 40 Mpx images,
# each under ingest.max_pixels, are forty times it.
MAX_REQUEST_PIXELS = 1 << 30


class PreprocessingMismatch(UserWarning):
    """The loading environment computes pixels differently from the one that made the shards."""


@dataclass(frozen=True)
class ServingSpec:
    """Everything prediction needs to make the training pixels from a file's bytes."""

    record_schema: dict[str, Any]  # RecordSchema.to_dict() of the shards (size, encoding)
    resize: str
    draft_decode: bool  # reduced-size JPEG decoding, as the shard stage did
    classes: list[str]
    preprocessing_version: str
    max_pixels: int
    min_side: int
    max_file_bytes: int

    @classmethod
    def from_manifest(cls, manifest: ShardManifest, limits: IngestParams) -> ServingSpec:
        """The manifest's preprocessing plus the ingest limits the training images passed."""
        return cls(
            record_schema=manifest.record_schema.to_dict(),
            resize=manifest.resize,
            draft_decode=manifest.draft_decode,
            classes=list(manifest.classes),
            preprocessing_version=manifest.preprocessing_version,
            max_pixels=limits.max_pixels,
            min_side=limits.min_side,
            max_file_bytes=int(limits.max_file_mb * 2**20),
        )

    @property
    def schema(self) -> RecordSchema:
        return RecordSchema.from_dict(self.record_schema)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServingSpec:
        return cls(**data)


# -- image bytes -> model input --------------------------------------------------------------


def as_bytes(value: object) -> bytes:
    """A cell of the ``image`` column as bytes; a string is read as base64 (JSON clients)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=False)
        except (binascii.Error, ValueError):
            raise ImageRejected("a string that is not base64 (send the file's bytes)") from None
    raise ImageRejected(f"expected the file's bytes, got {type(value).__name__}")


def model_input(data: bytes, spec: ServingSpec) -> np.ndarray:
    """File bytes -> the uint8 HxWx3 pixels a shard record of this image decodes to."""
    if len(data) > spec.max_file_bytes:
        raise ImageRejected(
            f"file too large: {len(data)} bytes (limit {spec.max_file_bytes}, ingest.max_file_mb)"
        )
    schema = spec.schema
    pixels = preprocess_bytes(
        data,
        (schema.height, schema.width),
        spec.resize,
        max_pixels=spec.max_pixels,
        min_side=spec.min_side,
        draft=spec.draft_decode,
    )
    return shard_round_trip(pixels, schema)


def shard_round_trip(pixels: np.ndarray, schema: RecordSchema) -> np.ndarray:
    """What the reader yields for these pixels: encode as the shard did, decode as it does.

    ``raw`` is lossless (the identity); ``jpeg`` is not, so the model was trained on
    decoded JPEG pixels and must be served the same.
    """
    if schema.encoding == "raw":
        return pixels
    import tensorflow as tf

    return np.asarray(schema.decode_image(tf.constant(schema.encode_image(pixels))))


def prediction_frame(
    probs: np.ndarray, ok_rows: Sequence[int], errors: dict[int, str], classes: Sequence[str]
) -> pd.DataFrame:
    """One row per input: label, index, score, per-class probabilities, error ('' if fine).

    ``probs`` holds the rows listed in ``ok_rows``, in that order; rows in ``errors`` get an
    empty label, index -1 and zero scores (not NaN: the scoring server answers strict JSON).
    """
    import pandas as pd

    total = len(ok_rows) + len(errors)
    rows = list(ok_rows)
    full = np.zeros((total, len(classes)), dtype=np.float64)
    index = np.full(total, -1, dtype=np.int64)
    score = np.zeros(total, dtype=np.float64)
    if rows:
        full[rows] = probs
        index[rows] = probs.argmax(axis=1)
        score[rows] = probs.max(axis=1)
    return pd.DataFrame(
        {
            "label": [classes[int(i)] if i >= 0 else "" for i in index],
            "label_index": index,
            "score": score,
            **{f"{PROB_PREFIX}{name}": full[:, j] for j, name in enumerate(classes)},
            "error": [errors.get(i, "") for i in range(total)],
        }
    )


def decode_threads() -> int:
    """Threads that decode a request's rows at once: this process's cores (Pillow and
    TensorFlow release the GIL while they decode), at most :data:`MAX_DECODE_THREADS`."""
    return max(1, min(usable_cores(), MAX_DECODE_THREADS))


class PixelBudget:
    """Pixels being decoded at once, at most ``limit`` (the largest image allowed): threads
    decode small images (and JPEGs drafted small) together and the largest alone, so a
    request's decoding never holds more memory than decoding its rows one at a time did."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        pixels = min(pixels, self.limit)
        with self._changed:
            self._changed.wait_for(lambda: self.held + pixels <= self.limit)
            self.held += pixels
        try:
            yield
        finally:
            with self._changed:
                self.held -= pixels
                self._changed.notify_all()


def declared_pixels(data: bytes, spec: ServingSpec) -> int:
    """Width x height of the decode :func:`model_input` makes, from the image's header: a
    JPEG at the DCT-scaled size it is drafted to (:func:`tasks.images.draft_for`, a 12 MP
    photo at 224 px: 1/8 of each side). 0 for bytes refused before any decode
    (:func:`model_input` then refuses them, with the reason)."""
    if len(data) > spec.max_file_bytes:
        return 0
    try:
        with open_checked(data, max_pixels=spec.max_pixels, min_side=spec.min_side) as image:
            if spec.draft_decode:
                draft_for(image, (spec.schema.height, spec.schema.width), spec.resize)
            return int(image.width * image.height)
    except ImageRejected:
        return 0


class RequestTooLarge(Refused):
    """A served request whose rows would decode to more than its pixel budget in all."""


def refuse_past_the_pixel_budget(images: Sequence[object], spec: ServingSpec, budget: int) -> None:
    """Refuse a request whose rows' headers declare more than ``budget`` pixels to decode
    (a JPEG at the size it is drafted to), before a single row is decoded."""
    total = 0
    for row, image in enumerate(images):
        try:
            total += declared_pixels(as_bytes(image), spec)
        except ImageRejected:
            continue  # its row gets its error
        if total > budget:
            raise RequestTooLarge(
                f"request would decode more than {budget:,} pixels (its first {row + 1} rows "
                f"declare {total:,}): the bound on one request's decode time",
                fix="send fewer or smaller images per request",
            )


class RequestAbandoned(Exception):
    """A served request's time is up: its client got HTTP 504, so no row is decoded more."""


def serving_deadline() -> float | None:
    """When a request the scoring server hands the model now is past its time: MLflow
    answers HTTP 504 after ``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT`` but cannot stop the
    thread predicting it, which went on decoding every row while holding a decode thread
    and the cores. None outside the scoring server (batch prediction has no deadline)."""
    import time

    from mlflow.environment_variables import (
        _MLFLOW_IS_IN_SERVING_ENVIRONMENT,
        MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT,
    )

    if not _MLFLOW_IS_IN_SERVING_ENVIRONMENT.get():
        return None
    return time.monotonic() + float(MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.get())


def predict_images(
    model: keras.Model,
    images: Sequence[object],
    spec: ServingSpec,
    *,
    batch_size: int = BATCH_SIZE,
    threads: int | None = None,
    deadline: float | None = None,
    max_request_pixels: int | None = None,
) -> pd.DataFrame:
    """Predict image files (bytes, or base64 strings); a row that cannot be used gets its error.

    Rows are decoded and predicted ``batch_size`` at a time, so memory holds one batch of
    decoded pixels however many rows a request has; a batch's rows are decoded on
    ``threads`` threads (default :func:`decode_threads`) within a :class:`PixelBudget`, each
    row's pixels the same. Past ``deadline`` (``time.monotonic()``) no row starts decoding:
    :class:`RequestAbandoned` is raised instead. Rows declaring more than
    ``max_request_pixels`` in all are refused before any is decoded.
    """
    import time

    if max_request_pixels is not None:
        refuse_past_the_pixel_budget(images, spec, max_request_pixels)

    probs: list[np.ndarray] = []
    ok_rows: list[int] = []
    errors: dict[int, str] = {}

    threads = min(decode_threads() if threads is None else threads, len(images))
    budget = PixelBudget(spec.max_pixels)

    def decoded(row: int) -> np.ndarray | ImageRejected:
        if deadline is not None and time.monotonic() >= deadline:
            raise RequestAbandoned(f"request past its time limit at row {row} of {len(images)}")
        try:
            data = as_bytes(images[row])
            if threads == 1:
                return model_input(data, spec)
            with budget.hold(declared_pixels(data, spec)):
                return model_input(data, spec)
        except ImageRejected as exc:
            return exc

    with ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
        each = pool.map if pool is not None else map
        for start in range(0, len(images), batch_size):
            rows = range(start, min(start + batch_size, len(images)))
            pixels: list[np.ndarray] = []
            for row, result in zip(rows, each(decoded, rows), strict=True):
                if isinstance(result, ImageRejected):
                    errors[row] = str(result)
                else:
                    pixels.append(result)
                    ok_rows.append(row)
            if pixels:
                # inference mode: the model's augmentation layers must not run at serving time
                probs.append(predict_batch(model, np.stack(pixels)).astype(np.float64))
    stacked = np.concatenate(probs) if probs else np.zeros((0, len(spec.classes)))
    return prediction_frame(stacked, ok_rows, errors, spec.classes)


def version_warning(recorded: str, current: str) -> str | None:
    """The warning to give when this environment's preprocessing is not the recorded one."""
    if recorded == current:
        return None
    return (
        f"preprocessing version mismatch: the model was trained on shards made by "
        f"preprocessing {recorded}, this environment computes {current} (tasks/images.py, "
        f"tasks/schema.py, Pillow or NumPy differ); predictions may not match training pixels"
    )


# -- the MLflow model ------------------------------------------------------------------------


class ShardflowModel(PythonModel):
    """Raw image bytes (column ``image``) -> label, label_index, score, p_<class>, error."""

    def load_context(self, context: Any) -> None:
        from tasks.runtime.tf_imports import keras_without_extras

        keras = keras_without_extras()
        self.spec = ServingSpec.from_dict(
            json.loads(Path(context.artifacts[SPEC_ARTIFACT]).read_text())
        )
        self.model = keras.saving.load_model(context.artifacts[KERAS_ARTIFACT], compile=False)
        message = version_warning(self.spec.preprocessing_version, preprocessing_version())
        if message:
            log.warning(message)
            warnings.warn(message, PreprocessingMismatch, stacklevel=2)

    # Typed with the DataFrame MLflow passes: its hints are then read as "no conversion"
    # (the signature below validates the input), and MLflow has nothing to warn about.
    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        if IMAGE_COLUMN not in model_input:
            raise ValueError(
                f"input has columns {list(model_input.columns)}; send a column "
                f"{IMAGE_COLUMN!r} of image file bytes"
            )
        rows = list(model_input[IMAGE_COLUMN])
        deadline = serving_deadline()
        budget = MAX_REQUEST_PIXELS if deadline is not None else None  # batch runs: none
        return predict_images(
            self.model, rows, self.spec, deadline=deadline, max_request_pixels=budget
        )


def signature(classes: Sequence[str]) -> ModelSignature:
    """Input: one string column ``image``; output: the prediction columns.

    A string, not MLflow's ``binary``: for a binary column the scoring server decodes the
    base64 of every row before the model runs, and one malformed row fails the whole request
    (HTTP 400 "Incorrect padding"). As a string the model decodes each row itself
    (:func:`as_bytes`), so a bad row gets its own ``error``. Python callers may still pass
    the file bytes: MLflow lets any object through a string column.
    """
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema, TensorSpec

    outputs: list[ColSpec | TensorSpec] = [
        ColSpec(DataType.string, "label"),
        ColSpec(DataType.long, "label_index"),
        ColSpec(DataType.double, "score"),
        *(ColSpec(DataType.double, f"{PROB_PREFIX}{name}") for name in classes),
        ColSpec(DataType.string, "error"),
    ]
    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string, IMAGE_COLUMN)]), outputs=Schema(outputs)
    )


def log_pyfunc(
    client: MlflowClient,
    run_id: str,
    model_file: str | Path,
    spec: ServingSpec,
    tags: dict[str, str] | None = None,
) -> str:
    """Log the pyfunc (Keras model + spec + the ``tasks`` code) to a run, with the logged
    model's ``tags``; return its URI.

    The run keeps the status it had: MLflow logs a model only onto its active run, and its
    ``with start_run()`` would mark the run FINISHED on the way out, while evaluation is still
    logging to it (a crash after that left a finished-looking run with half its results).

    No input example goes with it, only the signature: MLflow checks an example by loading
    the logged model, TensorFlow and Keras with it, to predict it, and on failure only logs
    a warning. The evaluate stage's process would pay that import (seconds of CPU, beside
    its child measuring) for no gate; what it checked, a logged version loading and
    predicting in a fresh process, is tested on the real thing: the registered version
    reproducing every test prediction from the source files
    (``tests/flows/test_predict_flow.py``, ``tests/e2e/test_serve_model.py``).
    """
    from importlib.metadata import version

    import mlflow

    import tasks
    from tasks.runtime.tracking import using_store

    status = client.get_run(run_id).info.status
    with tempfile.TemporaryDirectory() as tmp, using_store(client.tracking_uri):
        spec_file = Path(tmp) / "serving_spec.json"
        spec_file.write_text(json.dumps(spec.to_dict(), indent=2, sort_keys=True))
        mlflow.start_run(run_id=run_id)
        try:
            with warnings.catch_warnings():
                # the signature says what a request holds; an input example would be an image
                warnings.filterwarnings(
                    "ignore", ".*An input example was not provided", UserWarning
                )
                info = mlflow.pyfunc.log_model(
                    name=MODEL_NAME_IN_RUN,
                    # The model from code (tasks/serve/serving_model.py), not a pickled object.
                    python_model=str(Path(tasks.__file__).parent / "serve" / "serving_model.py"),
                    artifacts={KERAS_ARTIFACT: str(model_file), SPEC_ARTIFACT: str(spec_file)},
                    code_paths=[str(Path(tasks.__file__).parent)],
                    signature=signature(spec.classes),
                    metadata={"preprocessing": spec.to_dict()},
                    tags=tags,
                    # Pinned here (versions from the installed metadata) so logging never shells
                    # out to infer requirements.
                    pip_requirements=[
                        *(f"{name}=={version(name)}" for name in ("tensorflow", "keras", "pillow")),
                        f"numpy=={np.__version__}",
                        "pydantic>=2.7",
                    ],
                )
        finally:
            mlflow.end_run(status=status)  # no longer active here; its status as it was
    return str(info.model_uri)
