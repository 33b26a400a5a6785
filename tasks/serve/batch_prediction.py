"""Batch prediction: a folder or file list through a loaded pyfunc (``tasks.predict``), read a
bounded chunk at a time, into a predictions CSV; the model references ``--model`` takes, and
the one checked way a version is loaded (:func:`load_pyfunc`: by number, never retracted
unless asked, its Keras file the one registered).
"""

from __future__ import annotations

import csv
import io
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.contracts.content import csv_rows, display_name, file_kind
from tasks.contracts.model_versions import check_model_file, refuse_retracted
from tasks.predict import IMAGE_COLUMN, KERAS_ARTIFACT, MODEL_NAME_IN_RUN, RESULT_COLUMNS
from tasks.runtime.atomic import write_text
from tasks.runtime.params import MODEL_NAME_PATTERN
from tasks.runtime.refusals import Refused

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.pyfunc import PyFuncModel


BATCH_COLUMNS = ("path", "label", "label_index", "score", "error")
PREDICT_EXPERIMENT = "shardflow-predict"
DEFAULT_MODEL = "champion"
READ_CHUNK = 256  # files read and predicted at a time: memory stays flat on big folders
# File bytes read ahead of the model, at most (a file over it goes alone): 256 files of up
# to ingest.max_file_mb each could hold 16 GB, 40 scans of 60 MB 2.4 GB.
READ_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: the URI to load, and the registry version and run it came from.

    An alias is resolved once, here: ``uri`` names the version by number, so moving the
    alias after this cannot change which model is loaded (``alias`` keeps what was asked)."""

    uri: str
    name: str
    version: str  # "" for a run's model that was never registered
    run_id: str
    alias: str = ""  # the alias resolved to ``version``, if one was asked for


_NAME = MODEL_NAME_PATTERN.strip("^$")
_ALIAS = r"(?!v\d+$)(?!latest$)[A-Za-z_][A-Za-z0-9_-]{0,254}"  # MLflow's alias rule
_VERSION = r"[1-9][0-9]{0,9}"
_RUN_ID = r"[0-9a-f]{32}"
# A relative artifact path: segments that never start with "." (no "..", no leading "/").
_ARTIFACT = r"[A-Za-z0-9_-][A-Za-z0-9._-]*(?:/[A-Za-z0-9_-][A-Za-z0-9._-]*)*"
# What ``--model`` may name: an alias, a version, a run id, or a registry or run URI of those.
MODEL_REFERENCE = re.compile(
    rf"{_ALIAS}|{_VERSION}|{_RUN_ID}|models:/{_NAME}(?:@{_ALIAS}|/{_VERSION})"
    rf"|runs:/{_RUN_ID}/{_ARTIFACT}"
)


def check_model_reference(model: str) -> str:
    """``model`` unchanged if it is a reference :func:`resolve_model` takes, else a
    ValueError naming the forms it takes (no other URI scheme, path or stage name)."""
    if not MODEL_REFERENCE.fullmatch(model):
        raise ValueError(
            f"model={model!r} is not a model reference: give an alias (champion), a version "
            "number, a run id, models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID/PATH"
        )
    return model


def resolve_model(client: MlflowClient, model: str, model_name: str) -> ModelRef:
    """``champion`` (or any alias), a version number, a run id, or a models:/ / runs:/ URI."""
    from mlflow.exceptions import MlflowException

    model = model.strip()
    try:
        if model.startswith("runs:/") or _is_run_id(model):
            run_id = model.removeprefix("runs:/").split("/")[0]
            uri = model if model.startswith("runs:/") else f"runs:/{run_id}/{MODEL_NAME_IN_RUN}"
            client.get_run(run_id)  # fails clearly when the run does not exist
            versions = client.search_model_versions(f"run_id = '{run_id}'")
            latest = max(versions, key=lambda v: int(v.version), default=None)
            if latest is None:
                return ModelRef(uri, "", "", run_id)
            return ModelRef(uri, str(latest.name), str(latest.version), run_id)
        if model.startswith("models:/"):
            body = model.removeprefix("models:/")
            model_name, _, rest = body.partition("@") if "@" in body else body.partition("/")
            model = rest
        alias = ""
        if model.isdigit():
            found = client.get_model_version(model_name, model)
        else:
            found = client.get_model_version_by_alias(model_name, model)
            alias = model
    except MlflowException as exc:
        from tasks.runtime.tracking import redact

        raise ModelNotFound(
            f"model {model!r} (registered model {model_name!r}) not found in "
            f"{redact(client.tracking_uri)}: {redact(exc.message)}; run the training flow "
            "first, or pass a version, a run id or a models:/ URI"
        ) from None
    uri = f"models:/{found.name}/{found.version}"  # by number: the alias is resolved once
    return ModelRef(uri, str(found.name), str(found.version), str(found.run_id), alias)


def retraction_of(client: MlflowClient, ref: ModelRef, *, allow: bool) -> str | None:
    """The retraction of ``ref``'s version in words (None: not retracted, or unregistered);
    refused unless ``allow`` (:func:`tasks.contracts.model_versions.refuse_retracted`)."""
    if not ref.version:
        return None
    tags = client.get_model_version(ref.name, ref.version).tags
    return refuse_retracted(ref.name, ref.version, tags, allow=allow)


def load_pyfunc(
    client: MlflowClient, ref: ModelRef, *, allow_retracted: bool = False
) -> tuple[PyFuncModel, str | None]:
    """The pyfunc ``ref`` names and its retraction in words (None: not retracted), loaded
    from the store ``client`` reads: a retracted version is refused unless
    ``allow_retracted``, and a registered version's Keras file is checked against the
    sha256 recorded at registration (:mod:`tasks.contracts.model_versions`) before Keras
    reads it."""
    import tempfile

    import mlflow
    import yaml

    from tasks.runtime.tracking import using_store

    tags: dict[str, str] = {}
    retracted = None
    if ref.version:
        tags = dict(client.get_model_version(ref.name, ref.version).tags)
        retracted = refuse_retracted(ref.name, ref.version, tags, allow=allow_retracted)
    # kept for the process's life, as MLflow keeps the copies it downloads itself
    local = Path(tempfile.mkdtemp(prefix="shardflow-model-"))
    with using_store(client.tracking_uri):
        where = Path(mlflow.artifacts.download_artifacts(ref.uri, dst_path=str(local)))
        if ref.version and ref.uri.startswith("models:/"):
            conf = yaml.safe_load((where / "MLmodel").read_text())
            keras = conf["flavors"]["python_function"]["artifacts"][KERAS_ARTIFACT]["path"]
            check_model_file(where / keras, tags, ref.name, ref.version)
        return mlflow.pyfunc.load_model(str(where)), retracted


class ModelNotFound(Refused, LookupError):
    """No model answers the reference (no champion yet, or a version the registry lacks)."""

    fix = "shardflow run   (trains, evaluates and promotes a champion), or --model VERSION"


def _is_run_id(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def list_sources(source: str | Path, *, within: str | Path | None = None) -> list[Path]:
    """The files to predict: a folder (recursive, hidden entries skipped), a CSV with a
    ``path`` column (paths relative to the CSV's folder), or one file.

    With ``within`` (a deployment run's repository) every file must lie inside it, links
    followed: a folder's link or a CSV row that leads out refuses the whole batch, by name.
    """
    paths = _list_sources(Path(source))
    if within is not None:
        repository = Path(within).resolve()
        for path in paths:
            if not path.resolve().is_relative_to(repository):
                raise ValueError(
                    f"{source} lists {path}, which resolves to {path.resolve()}, outside the "
                    f"repository {repository}; deployment runs read inside the repository only"
                )
    return paths


def _list_sources(source: Path) -> list[Path]:
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such file or folder to predict")
    if source.is_dir():
        return sorted(
            path
            for path in source.rglob("*")
            # a FIFO, a broken link or a link to a folder (never followed) gets its row,
            # saying what it is
            if (not path.is_dir() or path.is_symlink())
            and not any(part.startswith(".") for part in path.relative_to(source).parts)
        )
    if source.suffix.lower() == ".csv":
        paths = []
        for line, row in csv_rows(source, ("path",), "the CSV of images to predict"):
            if not row["path"]:  # a row in, a row out: never dropped
                raise ValueError(f"{source}, line {line}: empty 'path'")
            paths.append(source.parent / row["path"])
        return paths
    return [source]


def read_limited(path: Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes (enough for the model to refuse a file that grew while
    read) of a regular file; a larger file (by its size, unread), or anything else (a FIFO,
    a device, a folder), is an ``OSError`` naming what it is, never a read that blocks or
    never ends."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_size > limit:
        os.close(fd)  # before open(): it refuses a folder as "Is a directory"
        if stat.S_ISREG(status.st_mode):
            raise OSError(
                f"file too large: {status.st_size} bytes (limit {limit}, ingest.max_file_mb)"
            )
        if stat.S_ISDIR(status.st_mode) and path.is_symlink():
            raise OSError("a link to a folder, not followed (predict the folder it names)")
        raise OSError(f"not a regular file ({file_kind(status.st_mode)})")
    with open(fd, "rb") as handle:
        return handle.read(limit + 1)


def predict_files(
    model: Any,
    paths: Sequence[Path],
    max_file_bytes: int,
    *,
    chunk: int = READ_CHUNK,
    chunk_bytes: int = READ_BYTES,
    progress: Callable[[int, int], object] | None = None,
) -> list[dict[str, Any]]:
    """Predict files with a loaded pyfunc; one row per path, an ``error`` for unusable ones.

    Files are read and predicted ``chunk`` at a time, fewer where their bytes would pass
    ``chunk_bytes`` (a larger file goes alone); ``progress(done, total)`` is told after each
    chunk."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    part: list[Path] = []
    data: list[bytes] = []
    held = 0  # the bytes in ``data``, kept as files are read rather than summed for each
    unreadable: dict[int, str] = {}

    def predict_part() -> None:
        nonlocal held
        frame = model.predict(pd.DataFrame({IMAGE_COLUMN: data}))
        for i, (path, result) in enumerate(zip(part, frame.to_dict("records"), strict=True)):
            row = {"path": display_name(str(path))}  # always writable, whatever the bytes
            row.update({key: result[key] for key in RESULT_COLUMNS})
            row["error"] = unreadable.get(i, row["error"])
            rows.append(row)
        part.clear()
        data.clear()
        held = 0
        unreadable.clear()
        if progress is not None:
            progress(len(rows), len(paths))

    for path in paths:
        error = None
        try:
            content = read_limited(path, max_file_bytes)
        except OSError as exc:
            content, error = b"", f"cannot read: {exc.strerror or exc}"
        if part and held + len(content) > chunk_bytes:
            predict_part()  # the files read so far, before this one would pass the bound
        if error is not None:
            unreadable[len(part)] = error
        part.append(path)
        data.append(content)
        held += len(content)
        if len(part) == chunk:
            predict_part()
    if part:
        predict_part()
    return rows


def write_predictions_csv(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """``path,label,label_index,score,error`` per file, written whole or not at all."""
    path = Path(path)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=BATCH_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({**row, "score": repr(float(row["score"]))})
    write_text(path, text.getvalue())
    return path
