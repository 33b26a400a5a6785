"""The feeds bench section trains one model an epoch on every feed (its other parts:
tests/unit/bench/test_bench_feeds.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.feeds import FEEDS, FeedSet, measure_model
from bench.gpu_check import Step, main, run_step
from bench.read import write_seed_tfrecord
from bench.train_step import input_params
from tasks.contracts.manifest import load_manifest
from tasks.runtime.params import default_params
from tasks.shard.stage import shard_stage
from tests.unit.bench.test_bench_feeds import BATCH, SIZE

pytestmark = pytest.mark.slow


def test_one_model_trains_an_epoch_on_every_feed_side_by_side(
    tiny_index: Path, tmp_path: Path
) -> None:
    source = tiny_index.parent / "images"  # the folder tiny_index ingested
    shards = {}
    for encoding in ("raw", "jpeg"):
        params = default_params(shard={"image_size": list(SIZE), "encoding": encoding})
        shards[encoding] = tmp_path / encoding
        shard_stage(params.shard.model_copy(update={"workers": 1}), tiny_index, shards[encoding])
    seed_images = write_seed_tfrecord(source, tmp_path / "seed.tfrecord")
    manifest = load_manifest(shards["raw"])
    feeds = FeedSet(
        source,
        shards["raw"],
        shards["jpeg"],
        tmp_path / "seed.tfrecord",
        SIZE,
        len(manifest.classes),
    )
    train = input_params(
        default_params().train, "small_cnn", mixed_precision=None, xla=None, crop=0.0
    )
    result = measure_model(feeds, train.model_copy(update={"batch_size": BATCH}), FEEDS)

    assert list(result["feeds"]) == list(FEEDS) and result["batch_size"] == BATCH
    assert (result["precision_policy"], result["gpus"]) == ("float32", 0)
    # Whole batches of one epoch of each feed's own images: the shards' train split, every
    # file of the folder, the JPEGs the seeds' recipe wrote.
    train_records = manifest.split("train").num_records
    source_files = sum(1 for p in source.rglob("*") if p.suffix in (".png", ".jpg"))
    steps = {name: figures["steps"] for name, figures in result["feeds"].items()}
    assert steps == {
        "raw": train_records // BATCH,
        "jpeg": train_records // BATCH,
        "folder": source_files // BATCH,
        "seed": seed_images // BATCH,
    }
    for figures in result["feeds"].values():
        assert figures["images_per_s"] > 0 and figures["input_bound_ratio"] > 0


def test_a_gpu_check_step_keeps_its_figures_and_a_cut_one_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = run_step(Step("none", ("--only", "no-such-section")), tmp_path, timeout_s=300)
    assert done["outcome"] == "ok"
    assert done["figures"]["config"]["only"] == ["no-such-section"]  # the step's own JSON

    def too_slow(command: list[str], **kwargs: object) -> None:
        raise subprocess.TimeoutExpired(command, 1.0)

    monkeypatch.setattr(subprocess, "run", too_slow)
    cut = run_step(Step("slow", ()), tmp_path / "cut", timeout_s=1)
    assert cut["outcome"] == "stopped after 1 s: the budget ran out" and cut["figures"] == {}


def test_the_gpu_check_writes_every_step_even_those_the_budget_left_out(tmp_path: Path) -> None:
    result = main(["--out", str(tmp_path), "--quick", "--budget-s", "0"])
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written == result and written["devices"]["tensorflow_gpus"] == []
    assert {step["outcome"] for step in written["steps"].values()} == {
        "not run: the budget ran out"
    }
    assert list(written["steps"]) == ["read", "feeds-small_cnn", "input"]
