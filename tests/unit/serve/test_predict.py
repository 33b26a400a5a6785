"""The prediction core: bytes -> the shard's exact pixels, per-row errors, sources, model refs."""

from __future__ import annotations

import csv
import io
import os
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.images import preprocessing_version
from tasks.predict import (
    ServingSpec,
    prediction_frame,
)
from tasks.runtime.refusals import Refused
from tasks.serve.batch_prediction import (
    list_sources,
    predict_files,
    resolve_model,
    write_predictions_csv,
)

CLASSES = ["blue", "green", "red"]


def png_bytes(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header (valid CRCs) claims ``width x height``; no real pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def spec_for(encoding: str = "raw", *, max_file_bytes: int = 1 << 20) -> ServingSpec:
    from tasks.schema import RecordSchema

    return ServingSpec(
        record_schema=RecordSchema(16, 16, encoding).to_dict(),  # type: ignore[arg-type]
        resize="pad",
        draft_decode=True,
        classes=CLASSES,
        preprocessing_version=preprocessing_version(),
        max_pixels=40_000_000,
        min_side=8,
        max_file_bytes=max_file_bytes,
    )


def test_prediction_frame_places_errors_in_their_rows() -> None:
    probs = np.array([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1]])
    frame = prediction_frame(probs, [0, 2], {1: "not an image"}, CLASSES)
    assert list(frame.columns) == [
        "label",
        "label_index",
        "score",
        "p_blue",
        "p_green",
        "p_red",
        "error",
    ]
    assert list(frame["label"]) == ["green", "", "blue"]
    assert list(frame["label_index"]) == [1, -1, 0]
    assert list(frame["score"]) == [0.7, 0.0, 0.6]
    assert list(frame["error"]) == ["", "not an image", ""]
    assert list(frame.loc[2, ["p_blue", "p_green", "p_red"]]) == [0.6, 0.3, 0.1]


def tiny_keras_model() -> object:
    import keras

    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Conv2D(4, 3),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def test_list_sources_reads_folders_csvs_and_single_files(tmp_path: Path) -> None:
    (tmp_path / "photos" / "sub").mkdir(parents=True)
    for name in ("a.jpg", "sub/b.png", ".hidden.jpg"):
        (tmp_path / "photos" / name).write_bytes(b"x")
    (tmp_path / "photos" / ".cache").mkdir()
    (tmp_path / "photos" / ".cache" / "c.jpg").write_bytes(b"x")
    assert list_sources(tmp_path / "photos") == [
        tmp_path / "photos" / "a.jpg",
        tmp_path / "photos" / "sub" / "b.png",
    ]
    listing = tmp_path / "photos" / "list.csv"
    listing.write_text("path,note\nsub/b.png,x\na.jpg,y\n")
    assert list_sources(listing) == [tmp_path / "photos" / "sub/b.png", tmp_path / "photos/a.jpg"]
    assert list_sources(tmp_path / "photos" / "a.jpg") == [tmp_path / "photos" / "a.jpg"]
    with pytest.raises(FileNotFoundError, match="nope"):
        list_sources(tmp_path / "nope")
    listing.write_text("path,note\na.jpg,y\n\n,blank\n")
    with pytest.raises(ValueError, match=r"list.csv, line 4: empty 'path'"):
        list_sources(listing)
    (tmp_path / "bad.csv").write_text("file\na.jpg\n")
    with pytest.raises(ValueError, match=r"bad.csv: needs a header with columns `path`"):
        list_sources(tmp_path / "bad.csv")


def test_resolve_model_accepts_alias_version_run_and_uris(
    tmp_path: Path, new_mlflow_store: Callable[[Path], str]
) -> None:
    from mlflow import MlflowClient

    uri = new_mlflow_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    runs = [client.create_run(experiment).info.run_id for _ in range(3)]
    client.create_registered_model("m")
    for run_id in runs[:2]:
        client.create_model_version("m", f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias("m", "champion", "1")

    champion = resolve_model(client, "champion", "m")
    assert (champion.uri, champion.version, champion.run_id) == ("models:/m/1", "1", runs[0])
    assert resolve_model(client, "2", "m").run_id == runs[1]
    assert resolve_model(client, "models:/m/2", "other").uri == "models:/m/2"
    assert resolve_model(client, "models:/m@champion", "other").uri == "models:/m/1"
    by_run = resolve_model(client, runs[1], "m")
    assert (by_run.uri, by_run.version) == (f"runs:/{runs[1]}/model", "2")
    unregistered = resolve_model(client, f"runs:/{runs[2]}/model", "m")
    assert (unregistered.version, unregistered.run_id) == ("", runs[2])
    with pytest.raises(LookupError, match=r"'staging'.*registered model 'm'") as missing:
        resolve_model(client, "staging", "m")
    assert isinstance(missing.value, Refused) and "shardflow run" in str(missing.value.fix)


def test_predictions_csv_has_the_documented_columns(tmp_path: Path) -> None:
    rows = [
        {"path": "a.jpg", "label": "red", "label_index": 2, "score": 0.9, "error": "", "p_red": 1},
        {"path": "b.txt", "label": "", "label_index": -1, "score": 0.0, "error": "not an image"},
    ]
    path = write_predictions_csv(tmp_path / "out" / "p.csv", rows)
    with path.open() as handle:
        read = list(csv.reader(handle))
    assert read == [
        ["path", "label", "label_index", "score", "error"],
        ["a.jpg", "red", "2", "0.9", ""],
        ["b.txt", "", "-1", "0.0", "not an image"],
    ]


def test_batch_prediction_tells_its_progress_after_each_chunk(tmp_path: Path) -> None:
    paths = []
    for index in range(7):
        paths.append(tmp_path / f"{index}.png")
        paths[-1].write_bytes(png_bytes(np.full((16, 16, 3), 30 * index, np.uint8)))

    class Pyfunc:  # what predict_files uses of a loaded MLflow pyfunc
        def predict(self, frame: object) -> object:
            import pandas as pd

            rows = len(frame)  # type: ignore[arg-type]
            return pd.DataFrame(
                {"label": ["red"] * rows, "label_index": [2] * rows, "score": [0.9] * rows}
                | {"error": [""] * rows}
            )

    told: list[tuple[int, int]] = []
    rows = predict_files(Pyfunc(), paths, 1 << 20, chunk=3, progress=lambda *at: told.append(at))
    assert [row["path"] for row in rows] == [str(path) for path in paths]
    assert told == [(3, 7), (6, 7), (7, 7)]


def test_batch_prediction_holds_a_bounded_number_of_file_bytes(tmp_path: Path) -> None:
    """256 files a chunk held 256 x ingest.max_file_mb (16 GB) of file bytes at once, and an
    oversized file was read to its limit to be refused, under a size it did not have."""
    paths = []
    for index in range(7):
        paths.append(tmp_path / f"{index}.tif")
        paths[-1].write_bytes(bytes(1000))
    with (tmp_path / "huge.tif").open("wb") as handle:
        handle.truncate(5000)  # sparse: reading it would cost memory, not disk
    paths.insert(3, tmp_path / "huge.tif")
    held: list[int] = []

    class Pyfunc(RedPyfunc):
        def predict(self, frame: object) -> object:
            held.append(sum(map(len, frame["image"])))  # type: ignore[index]
            return super().predict(frame)

    rows = predict_files(Pyfunc(), paths, 4000, chunk=256, chunk_bytes=2500)
    assert held == [2000, 2000, 2000, 1000]  # three files' bytes never wait together
    assert [row["path"] for row in rows] == [str(path) for path in paths]
    assert (
        rows[3]["error"]
        == "cannot read: file too large: 5000 bytes (limit 4000, ingest.max_file_mb)"
    )
    assert [row["label"] for row in rows if row is not rows[3]] == ["red"] * 7


class RedPyfunc:
    """What predict_files uses of a loaded MLflow pyfunc: every image is red."""

    def predict(self, frame: object) -> object:
        import pandas as pd

        rows = len(frame)  # type: ignore[arg-type]
        return pd.DataFrame(
            {"label": ["red"] * rows, "label_index": [2] * rows, "score": [0.9] * rows}
            | {"error": [""] * rows}
        )


def test_files_a_batch_cannot_read_get_a_row_saying_why(tmp_path: Path) -> None:
    """A FIFO blocked the batch forever (a folder's was dropped unsaid), a name that is not
    UTF-8 crashed it after part of the CSV was written, a spreadsheet's CSV was refused."""
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "ok.png").write_bytes(png_bytes(np.full((16, 16, 3), 90, np.uint8)))
    os.mkfifo(folder / "pipe.jpg")
    with open(os.fsencode(folder) + b"/caf\xe9.png", "wb") as handle:
        handle.write(png_bytes(np.full((16, 16, 3), 30, np.uint8)))
    listing = tmp_path / "list.csv"
    listing.write_bytes("\ufeffpath\nphotos/ok.png\nphotos/pipe.jpg\n".encode())
    assert list_sources(listing) == [tmp_path / "photos/ok.png", tmp_path / "photos/pipe.jpg"]
    listing.write_bytes("path\nphotos/caf\xe9.png\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"list\.csv: not UTF-8 .*the CSV of images to predict"):
        list_sources(listing)

    sources = list_sources(folder)
    assert len(sources) == 3  # the FIFO listed too
    done: list[list[dict[str, object]]] = []
    reading = threading.Thread(
        target=lambda: done.append(predict_files(RedPyfunc(), sources, 1 << 20)), daemon=True
    )
    reading.start()
    reading.join(60)  # a hang guard, never a time measured
    assert done, "predict_files blocked on the FIFO"
    rows = {str(row["path"]): row for row in done[0]}
    assert rows[str(folder / "pipe.jpg")]["error"] == "cannot read: not a regular file (a FIFO)"
    assert rows[str(folder / "ok.png")]["error"] == ""
    assert rows[f"{folder}/caf\\xe9.png"]["label"] == "red"
    out = write_predictions_csv(tmp_path / "out" / "p.csv", done[0])
    with out.open(encoding="utf-8") as handle:
        assert len(list(csv.DictReader(handle))) == 3


def test_a_link_to_a_folder_gets_a_row_saying_it_was_not_followed(tmp_path: Path) -> None:
    """A folder's link to a folder was dropped unsaid: its photos missing from the CSV."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "inside.png").write_bytes(png_bytes(np.full((16, 16, 3), 90, np.uint8)))
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "ok.png").write_bytes(png_bytes(np.full((16, 16, 3), 90, np.uint8)))
    (folder / "linked").symlink_to(elsewhere)
    sources = list_sources(folder)
    assert sources == [folder / "linked", folder / "ok.png"]
    rows = {str(row["path"]): row for row in predict_files(RedPyfunc(), sources, 1 << 20)}
    assert rows[str(folder / "linked")]["error"] == (
        "cannot read: a link to a folder, not followed (predict the folder it names)"
    )
    assert rows[str(folder / "ok.png")]["label"] == "red"
    with pytest.raises(ValueError, match=r"lists .*linked, which resolves to .*outside"):
        list_sources(folder, within=folder)  # a deployment run: the link leads out


def test_a_predictions_csv_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    out = tmp_path / "p.csv"
    out.write_text("path,label\nlast.jpg,red\n")
    good = {"path": "a.jpg", "label": "red", "label_index": 2, "score": 0.9, "error": ""}
    with pytest.raises(ValueError):
        write_predictions_csv(out, [good, {**good, "score": "not a number"}])
    assert out.read_text() == "path,label\nlast.jpg,red\n"
