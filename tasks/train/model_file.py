"""The trained model's file: Keras's ``.keras`` format, written so that the same model gives
the same bytes.

Deterministic training repeats its weights bit for bit, but ``model.save`` does not repeat
its file: three things in the zip change with every save. Each is rewritten here, and
nothing else is touched:

- ``metadata.json`` carries ``date_saved``, the clock at the save. It is dropped (the MLflow
  run and ``dvc.lock`` say when the model was made); ``keras_version`` stays.
- ``config.json`` marks objects that several layers share (a dtype policy, say) with
  ``shared_object_id``, which is the object's ``id()``, a memory address. Keras only matches
  these ids with one another when it loads, so they are renumbered 1, 2, ... in order of
  first appearance: the same sharing, stable numbers.
- Each zip entry carries a modification time; all are set to 1980-01-01, the zip epoch.

With a byte-identical model, a training rerun that changed nothing (a comment in the
training code, say) keeps the model's md5 in ``dvc.lock``, and anyone can check that two runs
made the same model by its hash.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.runtime.atomic import write_bytes

if TYPE_CHECKING:
    import keras

METADATA_ENTRY = "metadata.json"
CONFIG_ENTRY = "config.json"
SHARED_ID_KEY = "shared_object_id"
CLOCK_KEY = "date_saved"
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def save_model(model: keras.Model, path: str | Path) -> None:
    """Save ``model`` to ``path`` in the ``.keras`` format, in canonical bytes, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = path.with_name(f".{path.stem}.saving-{os.getpid()}.keras")  # Keras wants .keras
    try:
        model.save(saved)
        write_bytes(path, canonical_bytes(saved.read_bytes()))
    finally:
        saved.unlink(missing_ok=True)


def canonical_bytes(data: bytes) -> bytes:
    """A ``.keras`` file's bytes with the clock, the memory addresses and the entry times
    made stable (see the module docstring); loading it gives the same model."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        for entry in source.infolist():
            content = source.read(entry)
            if entry.filename == METADATA_ENTRY:
                metadata = json.loads(content)
                metadata.pop(CLOCK_KEY, None)
                content = json.dumps(metadata).encode()
            elif entry.filename == CONFIG_ENTRY:
                content = json.dumps(renumber_shared_ids(json.loads(content))).encode()
            stable = zipfile.ZipInfo(entry.filename, date_time=ZIP_EPOCH)
            stable.compress_type = entry.compress_type
            stable.external_attr = entry.external_attr
            target.writestr(stable, content)
    return out.getvalue()


def renumber_shared_ids(config: Any) -> Any:
    """``config`` with every ``shared_object_id`` replaced by 1, 2, ... in order of first
    appearance (a depth-first walk in the file's key order); equal ids stay equal."""
    numbers: dict[Any, int] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                if key == SHARED_ID_KEY:
                    out[key] = numbers.setdefault(value, len(numbers) + 1)
                else:
                    out[key] = walk(value)
            return out
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    return walk(config)
