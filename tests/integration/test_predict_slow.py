"""Batch prediction with a model and shards read back through TensorFlow: the model's input
from source bytes equals the shard pixels, bad rows get their reason, another preprocessing
version warns (the rest: tests/unit/serve/test_predict.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tasks.contracts.manifest import load_manifest
from tasks.images import preprocess_bytes, preprocessing_version
from tasks.predict import (
    PreprocessingMismatch,
    ServingSpec,
    ShardflowModel,
    model_input,
    predict_images,
    version_warning,
)
from tasks.runtime.params import default_params
from tests.unit.serve.test_predict import (
    CLASSES,
    png_bytes,
    png_claiming,
    spec_for,
    tiny_keras_model,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("encoding", "draft"), [("raw", True), ("raw", False), ("jpeg", True), ("png", True)]
)
def test_model_input_from_source_bytes_equals_the_shard_pixels(
    tiny_index: Path, tmp_path: Path, encoding: str, draft: bool
) -> None:
    """Every record of real shards decodes to exactly what prediction makes from its file."""
    from tasks.contracts.tf_reader import read_split
    from tasks.shard.stage import shard_stage

    source_dir = tiny_index.parent / "images"
    params = default_params(
        shard={"image_size": [16, 16], "encoding": encoding, "workers": 1, "draft_decode": draft}
    ).shard
    shards = tmp_path / "shards"
    shard_stage(params, tiny_index, shards)
    manifest = load_manifest(shards)
    spec = ServingSpec.from_manifest(manifest, default_params().ingest)
    assert spec.preprocessing_version == manifest.preprocessing_version == preprocessing_version()
    checked, lossy = 0, 0
    for split in ("train", "val", "test"):
        for batch in read_split(shards, split, batch_size=64, training=False, with_metadata=True):
            for pixels, source in zip(batch["image"].numpy(), batch["source"].numpy(), strict=True):
                data = (source_dir / source.decode()).read_bytes()
                np.testing.assert_array_equal(model_input(data, spec), pixels, err_msg=source)
                plain = preprocess_bytes(data, (16, 16), "pad", max_pixels=1 << 30, draft=draft)
                lossy += int(not np.array_equal(plain, pixels))
                checked += 1
    assert checked == 36
    # The JPEG round trip is what makes jpeg shards exact; raw and png are lossless.
    assert (lossy > 0) == (encoding == "jpeg")


def test_bad_rows_get_their_reason_and_the_rest_is_answered() -> None:
    rng = np.random.default_rng(0)
    good = png_bytes(rng.integers(0, 256, (30, 20, 3), dtype=np.uint8))
    model = tiny_keras_model()
    spec = spec_for(max_file_bytes=len(good) + 10)
    images = [
        good,
        b"plain text, not an image",
        good[: len(good) // 2],  # truncated
        b"",
        png_claiming(7000, 7000),  # 49 Mpx > max_pixels
        png_claiming(4, 200),  # a side under min_side
        good + b"\0" * 20,  # over max_file_bytes
        12345,  # not bytes at all
        bytearray(good),
    ]
    frame = predict_images(model, images, spec)
    assert len(frame) == len(images)
    errors = list(frame["error"])
    assert errors[0] == errors[8] == ""
    assert "not an image" in errors[1]
    assert "truncated or corrupt" in errors[2]
    assert "empty file" in errors[3]
    assert "absurd dimensions 7000x7000" in errors[4]
    assert "absurd dimensions 4x200" in errors[5]
    assert "file too large" in errors[6]
    assert "expected the file's bytes, got int" in errors[7]
    assert all(frame.loc[1:7, "label_index"] == -1) and all(frame.loc[1:7, "label"] == "")
    expected = np.asarray(model(model_input(good, spec)[None], training=False))[0]  # type: ignore[operator]
    np.testing.assert_allclose(frame.loc[0, ["p_blue", "p_green", "p_red"]], expected, rtol=1e-6)
    assert frame.loc[0, "label"] == CLASSES[int(expected.argmax())]
    assert frame.loc[0, "score"] == pytest.approx(float(expected.max()))


def test_a_different_preprocessing_version_warns_on_load(tmp_path: Path) -> None:
    import json

    assert version_warning("abc", "abc") is None
    message = version_warning("abc", "def")
    assert message is not None and "abc" in message and "def" in message
    spec = ServingSpec.from_dict({**spec_for().to_dict(), "preprocessing_version": "old"})
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    model_file = tmp_path / "m.keras"
    tiny_keras_model().save(model_file)  # type: ignore[attr-defined]
    context = SimpleNamespace(
        artifacts={"serving_spec": str(tmp_path / "spec.json"), "keras_model": str(model_file)}
    )
    with pytest.warns(PreprocessingMismatch, match="trained on shards made by preprocessing old"):
        ShardflowModel().load_context(context)
