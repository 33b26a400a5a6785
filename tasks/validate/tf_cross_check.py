"""TensorFlow's side of validation's cross-check: what its spawned child runs.

A module of its own so the child imports only this, the record schema and TensorFlow:
unpickling a function of :mod:`tasks.validate.stage` would import pydantic, the manifest and
params too, on the cross-check's critical path (the child's TensorFlow import).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.runtime.tf_imports import tensorflow_without_keras
from tasks.schema import HASH_KEY, IMAGE_KEY, LABEL_KEY, RecordSchema

if TYPE_CHECKING:
    from tasks.runtime.processes import StandbyChild


def fingerprint(image: bytes, features: dict[str, Any]) -> list[Any]:
    """What two parsers must agree on for one record: label, content hash and the digest of
    the image feature's bytes (decoders may differ by a level on JPEG; the bytes may not)."""
    return [int(features[LABEL_KEY]), str(features[HASH_KEY]), hashlib.sha256(image).hexdigest()]


def prestart() -> None:
    """Start the cross-check's child now: it imports TensorFlow while this process goes on.

    ``python -m flows.validate`` calls it first, so the child's import (validation's critical
    path on an append) overlaps the stage's own start-up
    (:func:`tasks.runtime.latency.prestart_child`). The validation that follows sends its job
    with :func:`standby`."""
    from tasks.runtime.latency import prestart_child  # here: the child itself never needs it

    prestart_child(tensorflow_without_keras)


def standby() -> StandbyChild | None:
    """The child :func:`prestart` started, once (None when there is none, or it was taken)."""
    from tasks.runtime.latency import standby_child

    return standby_child(tensorflow_without_keras)


def tensorflow_sample(
    schema_dict: dict[str, Any], compression: str, shards_dir: str, files: list[str], per_file: int
) -> dict[str, Any]:
    """{shard file as the manifest names it (``gen-00001/...`` for an appended generation):
    [[label, hash, pixel digest], ...] or {"error": ...}} via ``parse_single``."""
    tf = tensorflow_without_keras()

    schema = RecordSchema.from_dict(schema_dict)
    out: dict[str, Any] = {}
    for file in files:
        rows: list[list[Any]] = []
        path = str(Path(shards_dir) / file)
        try:
            for serialized in tf.data.TFRecordDataset(path, compression_type=compression).take(
                per_file
            ):
                # The reader's own parse spec, and its decoder (static shape) must succeed.
                parsed = tf.io.parse_single_example(serialized, schema.parse_spec())
                schema.decode_image(parsed[IMAGE_KEY])
                features = {
                    LABEL_KEY: int(parsed[LABEL_KEY].numpy()),
                    HASH_KEY: parsed[HASH_KEY].numpy().decode(),
                }
                rows.append(fingerprint(parsed[IMAGE_KEY].numpy(), features))
            out[file] = rows
        except Exception as exc:
            out[file] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out
