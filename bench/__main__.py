"""``python -m bench``: measure everything, write reports/bench.json and reports/bench.png."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.runtime.params import Params

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICK = {
    "images": 200,
    "passes": 1,
    "read_seconds": 0.0,
    "scaling": [200, 1000],
    "photos": 12,
    "serve_requests": 30,
    "append_images": 500,
    "stage_rss_max": 10_000,
    "near_duplicate_hashes": 2000,
    "placement_images": 20_000,
    "lineage_images": 10_000,
    "lineage_runs": 10,
    "orch_passes": 2,
    "feed_models": ["small_cnn"],
    "feed_batch": 16,
}
SELF_CONTAINED = {
    "append",
    "photos",
    "plan_rss",
    "handoff_entry",
    "near_duplicates",
    "lineage",
    "label_review",
}


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _size_list(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        width, height = part.lower().split("x")
        sizes.append((int(width), int(height)))
    return sizes


# (flag, type, default, help) of the plain options; --quick overrides some (QUICK).
OPTIONS: list[tuple[str, Callable[[str], Any], Any, str]] = [
    ("--images", int, 3000, "images in the read/write set"),
    ("--min-size", int, 200, "smallest source side (px)"),
    ("--max-size", int, 400, "largest source side (px)"),
    ("--size", int, 224, "square training size for read/write"),
    ("--batch", int, 32, "batch size for read figures"),
    ("--passes", int, 3, "timed passes per figure (median)"),
    (
        "--stage-rss-max",
        int,
        1_000_000,
        "largest synthetic index for the stage's peak RSS",
    ),
    (
        "--read-seconds",
        float,
        2.0,
        "least seconds of a timed read pass (whole epochs)",
    ),
    (
        "--s3-mbps",
        float,
        90.0,
        "read.s3 and its ceiling through a link of this many MB/s per connection, as from a "
        "remote store (S3's guidance: one request per 85-90 MB/s); 0: moto directly, on this "
        "machine's own cores",
    ),
    (
        "--scaling",
        _int_list,
        [1000, 10000, 50000],
        "image counts of the scaling run",
    ),
    ("--scaling-min-size", int, 64, "smallest side, scaling/append (px)"),
    ("--scaling-max-size", int, 128, "largest side, scaling/append (px)"),
    (
        "--input-models",
        _name_list,
        None,
        "models of the input section (comma-separated); default: params.yaml's train.model",
    ),
    ("--input-size", int, None, "square shard size of the input section; default: params.yaml's"),
    (
        "--input-crop",
        float,
        None,
        "train.augment.crop of the input section (0: no RandomCrop, which XLA cannot compile); "
        "default: params.yaml's",
    ),
    (
        "--feed-models",
        _name_list,
        ["small_cnn", "efficientnet_b0", "resnet50"],
        "models of the feeds section (comma-separated), one spawned process each",
    ),
    ("--feed-batch", int, 0, "global batch of the feeds section; 0: each model's per GPU"),
    ("--orch-epochs", int, None, "train.epochs of orchestration runs"),
    ("--orch-passes", int, 5, "direct / dvc repro pass pairs of the orchestration tax (median)"),
    (
        "--orch-without",
        _name_list,
        [],
        "latency pieces acting in stage processes (prestart, fast_exit) timed off too: a dvc "
        "repro pass each, every pass",
    ),
    ("--photos", int, 200, "camera photos per size"),
    (
        "--photo-sizes",
        _size_list,
        [(4000, 3000), (1600, 1200)],
        "WxH camera sizes, the first the headline",
    ),
    ("--serve-requests", int, 200, "single-image HTTP requests timed"),
    ("--near-duplicate-hashes", int, 50000, "hashes of the near-duplicate search"),
    (
        "--placement-images",
        int,
        1_000_000,
        "the larger placement of the near-duplicate section's memory (the smaller: 50,000)",
    ),
    ("--lineage-images", int, 1_000_000, "images of the lineage section's generated index"),
    ("--lineage-runs", int, 100, "training runs of the lineage section's tracking store"),
    (
        "--append-images",
        int,
        50000,
        "base set of the append section",
    ),
    (
        "--append-fraction",
        float,
        0.01,
        "new images appended, a fraction of the base",
    ),
    ("--out", Path, REPO_ROOT / "reports" / "bench.json", "the figures (JSON)"),
    ("--plot", Path, None, "the chart; default: --out with .png"),
    (
        "--workdir",
        Path,
        REPO_ROOT / ".shardflow" / "bench",  # this clone's, like every file a run writes
        "images, shards, repo copies (kept)",
    ),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    for flag, kind, default, help_line in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=help_line)
    for flag in ("--mixed-precision", "--xla"):
        parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=None,
            help="for the input and feeds sections; default: params.yaml's train value",
        )
    parser.add_argument(
        "--skip-s3",
        action="store_true",
        help="read section without read.s3 and its ceiling (no S3 test server on this machine)",
    )
    parser.add_argument("--skip-orchestration", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument(
        "--only",
        type=lambda text: text.split(","),
        default=None,
        help=f"comma-separated sections: {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"tiny smoke run: {QUICK}, orchestration at 1 epoch"
    )
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.orch_epochs = args.orch_epochs or 1
    args.plot = args.plot or args.out.with_suffix(".png")
    return args


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Run:
    """Collects figures, details and per-section errors; saves after every section."""

    def __init__(self, args: argparse.Namespace) -> None:
        from bench.report import machine_info

        self.args = args
        self.figures: dict[str, Any] = {
            "read.folder": None,
            "read.seed": None,
            "read.raw": None,
            "read.raw_buffered": None,
            "read.jpeg_buffered": None,
            "read.first_batch_share": None,
            "read.first_batch_share_buffered": None,
            "order.memory_10k_kb": None,
            "order.memory_1m_kb": None,
            "read.raw_stock": None,
            "read.jpeg": None,
            "read.png": None,
            "read.ceiling": None,
            "read.bytes_ceiling": None,
            "read.s3": None,
            "read.s3_bytes_ceiling": None,
            "write.seed": None,
            "write.workers_1": None,
            "write.workers_2": None,
            "write_photos.seed": None,
            "write_photos.workers_1": None,
            "write_photos.workers_all": None,
            "write_photos.ceiling": None,
            "ingest_photos.decode_ratio": None,
            "write_photos.progressive_ratio": None,
            "write_photos.data_side_per_photo_ms": None,
            "write_photos.data_side_fixed_s": None,
            "write_photos.decode_floor_ms": None,
            "input_bound_ratio": None,
            "predict.images_per_s": None,
            "serve.p50_ms": None,
            "serve.p95_ms": None,
            "orchestration_tax": None,
            "orchestration_tax_min": None,
            "orchestration_tax_max": None,
            "orchestration_tax_iqr": None,
            "orchestration_passes": None,
            "dvc_noop_s": None,
            "scaling": None,
            "append.bytes_written_fraction": None,
            "append.data_side_fraction": None,
            "append.push_files": None,
            "append.push_only_new_shards": None,
            "plan_rss.records_10k_mb": None,
            "plan_rss.records_1m_mb": None,
            "plan_rss.stage_10k_mb": None,
            "plan_rss.stage_1m_mb": None,
            "plan_rss.stage_rebuild_10k_mb": None,
            "plan_rss.stage_rebuild_1m_mb": None,
            "plan_rss.stage_append_10k_mb": None,
            "plan_rss.stage_append_1m_mb": None,
            "handoff.entry_ms": None,
            "handoff.break_even_mp": None,
            "near_duplicates.max_light_edit_bits": None,
            "near_duplicates.min_other_bits": None,
            "near_duplicates.search_s": None,
            "near_duplicates.place_s": None,
            "near_duplicates.look_alike_place_s": None,
            "near_duplicates.peak_rss_mb": None,
            "near_duplicates.copies_confirmed": None,
            "near_duplicates.distinct_confirmed": None,
            "near_duplicates.place_rss_ratio_50k": None,
            "near_duplicates.place_rss_ratio_1m": None,
            "label_review.chosen": None,
            "label_review.precision": None,
            "label_review.recall": None,
            "label_review.weak_false_share": None,
            "machine": machine_info(),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "details": {},
            "errors": {},
            "notes": [],
        }

    def section(self, name: str, body: Callable[[], None], *, needed: bool = False) -> None:
        """Run and time ``body`` unless ``--only`` leaves ``name`` out (``needed``: a step
        the named sections cannot do without, such as ``prepare``)."""
        if self.args.only and name not in self.args.only and not needed:
            return
        log(f"== {name}")
        start = time.perf_counter()
        try:
            body()
        except Exception as exc:
            self.figures["errors"][name] = f"{type(exc).__name__}: {exc}"
            log(f"   {name} FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        log(f"   {name} took {time.perf_counter() - start:.1f} s")
        self.save()

    def record(self, key: str, result: dict[str, Any], unit: str = "img/s") -> None:
        self.figures[key] = round(result["per_s"], 2)
        self.figures["details"][key] = result
        log(f"   {key:<22} {result['per_s']:>10,.1f} {unit}  passes={result['passes']}")

    def save(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.figures, indent=2, default=str) + "\n")
        tmp.replace(self.args.out)


@dataclass
class Bench:
    """What every section shares: the options, the params, the read/write image set."""

    args: argparse.Namespace
    run: Run
    base: Params
    work: Path
    cores: int
    index: Path = Path("/nonexistent/bench-index.json")  # set by `prepare`

    @property
    def gpus(self) -> int:
        """GPUs TensorFlow sees here (sections size their batches per GPU)."""
        import tensorflow as tf

        return len(tf.config.list_physical_devices("GPU"))

    @property
    def size(self) -> tuple[int, int]:
        return (self.args.size, self.args.size)

    @property
    def tag(self) -> str:
        return f"{self.args.images}-{self.args.min_size}-{self.args.max_size}"

    @property
    def images(self) -> Path:
        return self.work / f"images-{self.tag}"


def prepare(b: Bench) -> None:
    """The read/write set: generated JPEGs, ingested once."""
    from bench.datasets import ingest_folder
    from bench.images import generate_images

    args = b.args
    log(f"   generating {args.images} JPEGs ({args.min_size}-{args.max_size} px) in {b.images}")
    generate_images(
        b.images, args.images, min_size=args.min_size, max_size=args.max_size, workers=b.cores
    )
    b.index = ingest_folder(b.images, b.work / f"ingest-{b.tag}", workers=b.cores)


def handoff_entry(b: Bench) -> None:
    from bench.handoff_entry import measure_handoff_entry

    entry = measure_handoff_entry(b.work / "handoff-entries", passes=max(3, b.args.passes))
    for key in ("entry_ms", "break_even_mp"):
        b.run.figures[f"handoff.{key}"] = entry[key]
    b.run.figures["details"]["handoff"] = entry["details"]
    log(
        f"   a small image's hand-off entry costs the data side {entry['entry_ms']} ms "
        "(tasks.contracts.handoff holds "
        f"{entry['details']['constant_entry_ms']} ms): entries are "
        f"kept from {entry['break_even_mp']} MP"
    )


def read(b: Bench) -> None:
    from bench import read as r
    from bench.datasets import fresh_shards
    from tasks.contracts import raw_slice
    from tasks.contracts.tf_reader import ReadOrder

    args, size, work, tag = b.args, b.size, b.work, b.tag
    raw_shards = Path()
    # Every pipeline first, then all of them timed in turns (bench.read.measure_reads).
    datasets = {"read.folder": r.folder_dataset(b.images, size=size, batch=args.batch)}
    seed_file = work / f"seed-{tag}.tfrecord"
    r.write_seed_tfrecord(b.images, seed_file)
    datasets["read.seed"] = r.seed_dataset(seed_file, size=size, batch=args.batch)
    for encoding in ("raw", "jpeg", "png"):
        params = b.base.shard.model_copy(update={"image_size": size, "encoding": encoding})
        shards = fresh_shards(params, b.index, work / f"read-{tag}-{encoding}", workers=b.cores)
        datasets[f"read.{encoding}"] = r.shardflow_dataset(shards, batch=args.batch)
        if encoding in ("raw", "jpeg"):  # the reader before the global order, as reference
            datasets[f"read.{encoding}_buffered"] = r.shardflow_dataset(
                shards, batch=args.batch, order="buffered"
            )
        if encoding == "raw":
            # How long an epoch waits for its first batch, in the global and buffered order.
            orders: tuple[tuple[ReadOrder, str], ...] = (
                ("global", "read.first_batch_share"),
                ("buffered", "read.first_batch_share_buffered"),
            )
            for order, key in orders:
                first = r.first_batch_share(shards, batch=args.batch, order=order)
                b.run.figures[key] = first["share"]
                b.run.figures["details"][key] = first
            with raw_slice.stock_ops():  # the same read where the op is not built
                datasets["read.raw_stock"] = r.shardflow_dataset(shards, batch=args.batch)
            # The physical limit: the same files as bare records, never parsed.
            datasets["read.bytes_ceiling"] = r.bytes_dataset(shards, batch=args.batch)
            raw_shards = shards
        if encoding == "jpeg":
            # Stricter ceiling for read.jpeg: the shards' own JPEG bytes, decoded from memory.
            encoded, labels = r.shard_image_bytes(shards)
            datasets["read.ceiling_shard_jpeg"] = r.ceiling_dataset(
                encoded, labels, size=None, batch=args.batch
            )
    encoded, labels = r.source_jpegs(b.images)
    datasets["read.ceiling"] = r.ceiling_dataset(encoded, labels, size=size, batch=args.batch)
    memory = r.order_memory({"order.memory_10k_kb": 10_000, "order.memory_1m_kb": 1_000_000})
    b.run.figures["details"]["order.offsets_bytes_per_record"] = memory.pop(
        "offsets_bytes_per_record"
    )
    b.run.figures.update(memory)
    if args.skip_s3:
        results = r.measure_reads(datasets, passes=args.passes, seconds=args.read_seconds)
    else:
        results = _with_s3_reads(b, datasets, raw_shards)
    for key, result in results.items():
        b.run.record(key, result)


def _with_s3_reads(b: Bench, datasets: dict[str, Any], raw_shards: Path) -> dict[str, Any]:
    """``datasets`` and the raw shards from a local S3 server (moto), timed in turns: a
    cold-cache read as training reads them, and the server's bare whole-object reads as
    its limit."""
    from bench import read as r
    from bench.s3_link import LimitedLink
    from flows.servers.s3_server import start_s3_server, stop_s3_server
    from tasks.contracts.shard_store import publish

    args = b.args
    s3 = start_s3_server(b.work / "moto_server.log")
    link = None
    try:
        os.environ.update(s3.env)
        url = s3.url("bench", "raw")
        publish(raw_shards, url)
        if args.s3_mbps:  # as from a remote store: bound by each connection's bandwidth
            host, port = s3.endpoint_url.removeprefix("http://").split(":")
            link = LimitedLink((host, int(port)), mbps=args.s3_mbps)
            os.environ["AWS_ENDPOINT_URL"] = link.endpoint_url
        s3_root = b.work / f"s3-{b.tag}"
        s3_root.mkdir(exist_ok=True)
        prefetch = b.base.storage.prefetch_shards  # what training would use
        datasets["read.s3"] = r.ColdS3Read(url, s3_root, batch=args.batch, prefetch=prefetch)
        datasets["read.s3_bytes_ceiling"] = r.S3BytesCeiling(url, raw_shards, prefetch=prefetch)
        return r.measure_reads(datasets, passes=args.passes, seconds=args.read_seconds)
    finally:
        if link is not None:
            link.close()
        stop_s3_server(s3)


def write(b: Bench) -> None:
    from bench.stats import timed_passes
    from bench.write import seed_write_measured, shardflow_write_measured

    params = b.base.shard.model_copy(update={"image_size": b.size})
    b.run.figures["details"]["write.encoding"] = params.encoding
    seed_file = b.work / f"write-seed-{b.tag}.tfrecord"
    b.run.record(
        "write.seed",
        timed_passes(
            lambda: seed_write_measured(b.images, seed_file, size=b.size, encoding=params.encoding),
            passes=b.args.passes,
        ),
    )
    for workers in (1, 2):
        shards = b.work / f"write-{b.tag}-w{workers}"

        def shard_once(w: int = workers, out: Path = shards) -> tuple[int, float]:
            return shardflow_write_measured(params, b.index, out, workers=w)

        b.run.record(f"write.workers_{workers}", timed_passes(shard_once, passes=b.args.passes))


def photos(b: Bench) -> None:
    from bench.datasets import ingest_folder
    from bench.photos import measure_photos
    from flows.servers.prefect_server import require_server

    require_server()  # the data side runs the ingest and shard flows
    args = b.args
    results = measure_photos(
        b.base.shard,
        b.work,
        sizes=args.photo_sizes,
        count=args.photos,
        size=args.size,
        ingest=ingest_folder,
        handoff_mb=b.base.ingest.handoff_mb,
        passes=args.passes,
        log=log,
    )
    headline = results[f"{args.photo_sizes[0][0]}x{args.photo_sizes[0][1]}"]
    for key in ("seed", "workers_1", "workers_all", "ceiling"):
        b.run.figures[f"write_photos.{key}"] = round(headline[key], 2)
    b.run.figures["ingest_photos.decode_ratio"] = round(headline["decode"]["ratio"], 4)
    side = headline["data_side"]
    b.run.figures["write_photos.data_side_per_photo_ms"] = round(side["handoff"]["per_photo_ms"], 2)
    b.run.figures["write_photos.data_side_fixed_s"] = round(side["handoff"]["fixed_s"], 3)
    b.run.figures["write_photos.decode_floor_ms"] = round(side["decode_floor_ms"], 2)
    if "progressive" in headline:
        b.run.figures["write_photos.progressive_ratio"] = round(headline["progressive"]["ratio"], 4)
    b.run.figures["details"]["photos"] = results


def input_bound(b: Bench) -> None:
    """Each model's production training probe (reader-fed over memory-fed step), median of
    ``--passes`` runs; the headline ``input_bound_ratio`` is the most input-bound model's."""
    from bench.datasets import fresh_shards, ingest_folder
    from bench.feeds import feed_batch
    from bench.train_step import input_params, measure_input_bound

    args = b.args
    # --input-size is square; by default params.yaml's [height, width], whatever its shape.
    height, width = (args.input_size,) * 2 if args.input_size else b.base.shard.image_size
    shard = b.base.shard.model_copy(update={"image_size": (height, width)})
    # Training needs its val split: the images placed by params.yaml's splits.
    index = ingest_folder(
        b.images, b.work / f"ingest-{b.tag}-splits", workers=b.cores, splits=b.base.ingest.splits
    )
    shards = fresh_shards(shard, index, b.work / f"train-{b.tag}-{height}x{width}", workers=b.cores)
    details: dict[str, Any] = {}
    for model in args.input_models or [b.base.train.model]:
        params = input_params(
            b.base.train,
            model,
            mixed_precision=args.mixed_precision,
            xla=args.xla,
            crop=args.input_crop,
        )
        if model == "resnet50":  # at the published figures' batch, per GPU
            params = params.model_copy(update={"batch_size": feed_batch(model, b.gpus)})
        # One ratio per pass, median across passes: on a small shared machine a single pass
        # swings with the host's load.
        passes = [
            measure_input_bound(shards, params, b.work / f"input-{model}-{run}")
            for run in range(max(1, args.passes))
        ]
        result = sorted(passes, key=lambda r: r["ratio"])[len(passes) // 2]
        result.update(
            pass_ratios=[round(r["ratio"], 4) for r in passes], image_size=[height, width]
        )
        details[model] = result
        b.run.figures[f"input_bound_ratio.{model}"] = round(result["ratio"], 4)
        log(
            f"   {model}: input_bound_ratio {result['ratio']:.3f} (reader-fed "
            f"{result['step_ms_reader']} ms, memory-fed {result['step_ms_in_memory']} ms per "
            f"step of {result['batch_size']} at {height}x{width}, {result['precision_policy']}, "
            f"xla {result['xla']}, on {', '.join(result['devices'])})"
        )
    b.run.figures["input_bound_ratio"] = max(
        b.run.figures[f"input_bound_ratio.{model}"] for model in details
    )
    b.run.figures["details"]["input_bound_ratio"] = details


def feeds(b: Bench) -> None:
    """One epoch of each model fed by read_split (raw, jpeg), image_dataset_from_directory
    and the seeds' recipe, side by side (bench.feeds): images/s and input-bound ratios."""
    from bench import read as r
    from bench.datasets import fresh_shards
    from bench.feeds import FEEDS, FeedSet, feed_batch, measure_model
    from bench.train_step import input_params
    from tasks.contracts.manifest import load_manifest

    args, size, tag = b.args, b.size, b.tag
    shards = {
        encoding: fresh_shards(
            b.base.shard.model_copy(update={"image_size": size, "encoding": encoding}),
            b.index,
            b.work / f"read-{tag}-{encoding}",
            workers=b.cores,
        )
        for encoding in ("raw", "jpeg")
    }
    seed_file = b.work / f"seed-{tag}.tfrecord"
    r.write_seed_tfrecord(b.images, seed_file)
    classes = len(load_manifest(shards["raw"]).classes)
    feed_set = FeedSet(b.images, shards["raw"], shards["jpeg"], seed_file, size, classes)
    details: dict[str, Any] = {}
    for model in args.feed_models:
        params = input_params(
            b.base.train, model, mixed_precision=args.mixed_precision, xla=args.xla, crop=0.0
        )
        batch = args.feed_batch or feed_batch(model, b.gpus)
        params = params.model_copy(update={"batch_size": batch})
        details[model] = result = measure_model(feed_set, params, FEEDS)
        for feed, figures in result["feeds"].items():
            b.run.figures[f"feeds.{model}.{feed}"] = figures["images_per_s"]
            b.run.figures[f"feeds.{model}.{feed}.input_bound_ratio"] = figures["input_bound_ratio"]
            log(
                f"   {model} <- {feed}: {figures['images_per_s']:,.1f} img/s, input-bound "
                f"{figures['input_bound_ratio']:.3f} (batch {batch}, {result['precision_policy']}, "
                f"xla {result['xla']}, {result['gpus']} GPU)"
            )
    b.run.figures["details"]["feeds"] = details


def serve(b: Bench) -> None:
    from bench.datasets import fresh_shards
    from bench.serve import measure_serving

    shards = fresh_shards(b.base.shard, b.index, b.work / f"serve-{b.tag}", workers=b.cores)
    result = measure_serving(
        b.base,
        shards,
        b.images,
        b.work / "serve",
        passes=b.args.passes,
        requests=b.args.serve_requests,
        log=log,
    )
    figures = b.run.figures
    figures["details"]["serve"] = result.pop("details")
    for key, value in result.items():
        figures[key] = round(value, 2)
    log(
        f"   predict.images_per_s {figures['predict.images_per_s']}, serve p50 "
        f"{figures['serve.p50_ms']} ms, p95 {figures['serve.p95_ms']} ms"
    )


def orchestration(b: Bench) -> None:
    from bench.orchestration import measure_orchestration

    epochs = b.args.orch_epochs
    result = measure_orchestration(
        REPO_ROOT,
        b.work / "orchestration",
        images=b.images,
        overrides={"train": {"epochs": epochs}} if epochs else {},
        passes=b.args.orch_passes,
        without=b.args.orch_without,
        log=log,
    )
    figures = b.run.figures
    for piece, saved in result["latency"].items():
        figures[f"latency.{piece}"] = saved["saving"]
        log(
            f"   {piece}: {saved['with_s']} s with, {saved['without_s']} s without "
            f"(dvc repro), saving {100 * saved['saving']:.1f}% (passes {saved['per_pass']})"
        )
    for key in ("orchestration_tax", "dvc_noop_s"):
        value = result.pop(key)
        figures[key] = None if value is None else round(value, 4)
    spread = result.get("orchestration_tax_spread") or {}
    for key in ("min", "max", "iqr"):  # the median's spread over the paired passes
        figures[f"orchestration_tax_{key}"] = spread.get(key)
    figures["orchestration_passes"] = spread.get("passes")
    figures["details"]["orchestration"] = result
    if result.get("note"):
        figures["notes"].append(f"orchestration: {result['note']}")
    if result.get("stages_not_compared"):
        figures["notes"].append(
            "orchestration_tax covers stages "
            + ", ".join(result["stages_compared"])
            + " only (no direct call registered for "
            + ", ".join(result["stages_not_compared"])
            + " in bench/orchestration.py)"
        )
    log(
        f"   orchestration_tax {figures['orchestration_tax']} (median of "
        f"{figures['orchestration_passes']} paired passes, min {figures['orchestration_tax_min']}, "
        f"max {figures['orchestration_tax_max']}, IQR {figures['orchestration_tax_iqr']}), "
        f"dvc_noop_s {figures['dvc_noop_s']}"
    )


def scaling(b: Bench) -> None:
    from bench.datasets import ingest_folder
    from bench.images import generate_images
    from bench.scaling import scaling_run

    args, shard = b.args, b.base.shard
    largest = max(args.scaling)
    stag = f"{largest}-{args.scaling_min_size}-{args.scaling_max_size}"
    scaling_images = b.work / f"scaling-images-{stag}"
    log(f"   generating {largest} JPEGs ({args.scaling_min_size}-{args.scaling_max_size} px)")
    generate_images(
        scaling_images,
        largest,
        min_size=args.scaling_min_size,
        max_size=args.scaling_max_size,
        workers=b.cores,
    )
    full_index = ingest_folder(scaling_images, b.work / f"ingest-scaling-{stag}", workers=b.cores)
    b.run.figures["scaling"] = scaling_run(
        shard, full_index, b.work / "scaling", sorted(args.scaling), workers=shard.workers, log=log
    )
    b.run.figures["notes"].append(
        f"scaling uses {args.scaling_min_size}-{args.scaling_max_size} px source JPEGs and "
        f"the params.yaml shard settings ({shard.image_size}, {shard.encoding}, "
        f"{shard.workers} workers); peak_rss_mb sums the shard process and its workers"
    )


def append(b: Bench) -> None:
    from bench.append import measure_append
    from flows.servers.prefect_server import require_server

    require_server()  # the shard stage runs as its Prefect flow
    args = b.args
    result = measure_append(
        b.base,
        b.work,
        images=args.append_images,
        fraction=args.append_fraction,
        min_size=args.scaling_min_size,
        max_size=args.scaling_max_size,
        workers=b.cores,
        log=log,
    )
    f = b.run.figures
    log(
        f"   append +{result['details']['new_images']} images: bytes written "
        f"{f['append.bytes_written_fraction']} of the set, data side "
        f"{f['append.data_side_fraction']} of a full run, dvc push "
        f"{f['append.push_files']} objects ({f['append.push_new_shards']} new shards, "
        f"{f['append.push_old_shards']} old shards)"
    )


def plan_rss(b: Bench) -> None:
    from bench.plan_rss import measure_plan_rss

    figures = measure_plan_rss(b.work / "plan-rss", stage_up_to=b.args.stage_rss_max, log=log)
    for key, value in figures.items():
        target = b.run.figures if not key.endswith("_details") else b.run.figures["details"]
        target[f"plan_rss.{key}"] = value


def near_duplicates(b: Bench) -> None:
    from bench.near_duplicates import measure_near_duplicates

    result = measure_near_duplicates(
        b.work,
        count=b.args.near_duplicate_hashes,
        distance=b.base.ingest.near_duplicate_distance,
        log=log,
        placements=(min(50_000, b.args.placement_images), b.args.placement_images),
    )
    threshold, search = result["threshold"], result["search"]
    f = b.run.figures
    f["near_duplicates.max_light_edit_bits"] = threshold["max_light_edit_bits"]
    f["near_duplicates.min_other_bits"] = min(
        threshold["min_other_position_bits"], threshold["min_different_photo_bits"]
    )
    f["near_duplicates.search_s"] = search["search_s"]
    f["near_duplicates.place_s"] = search["place_s"]
    f["near_duplicates.look_alike_place_s"] = result["look_alikes"]["place_s"]
    f["near_duplicates.peak_rss_mb"] = search["peak_rss_mb"]
    f["near_duplicates.copies_confirmed"] = result["confirmation"]["copies_confirmed_share"]
    f["near_duplicates.distinct_confirmed"] = result["confirmation"]["distinct_confirmed_share"]
    small, large = result["placement_memory"]
    f["near_duplicates.place_rss_ratio_50k"] = small["peak_rss_ratio"]
    f["near_duplicates.place_rss_ratio_1m"] = large["peak_rss_ratio"]
    f["details"]["near_duplicates"] = result


def lineage(b: Bench) -> None:
    from bench.lineage import measure_lineage

    result = measure_lineage(
        b.work,
        images=b.args.lineage_images,
        runs=b.args.lineage_runs,
        distance=b.base.ingest.near_duplicate_distance,
        log=log,
    )
    b.run.figures["lineage.lookup_s"] = result["lookup_s"]
    b.run.figures["lineage.command_s"] = result["command_s"]
    b.run.figures["details"]["lineage"] = result


def label_review(b: Bench) -> None:
    from bench.label_review import measure_label_review

    result = measure_label_review()
    default = b.base.evaluate.min_class_review_accuracy
    at_default = [r for r in result["thresholds"] if r["threshold"] == default]
    f = b.run.figures
    f["label_review.chosen"] = result["chosen"]
    f["label_review.precision"] = at_default[0]["precision"] if at_default else None
    f["label_review.recall"] = at_default[0]["recall"] if at_default else None
    f["label_review.weak_false_share"] = (
        max(at_default[0]["weak_false_share"], at_default[0]["fair_false_share"])
        if at_default
        else None
    )
    f["details"]["label_review"] = result


# The sections, in the order they run (`--only` names them; `--skip-*` drops two).
SECTIONS: dict[str, Callable[[Bench], None]] = {
    "handoff_entry": handoff_entry,
    "read": read,
    "write": write,
    "photos": photos,
    "input": input_bound,
    "feeds": feeds,
    "serve": serve,
    "orchestration": orchestration,
    "scaling": scaling,
    "append": append,
    "plan_rss": plan_rss,
    "near_duplicates": near_duplicates,
    "lineage": lineage,
    "label_review": label_review,
}


def wanted(args: argparse.Namespace) -> list[str]:
    """The sections this run measures."""
    skipped = {"orchestration"} if args.skip_orchestration else set()
    skipped |= {"scaling"} if args.skip_scaling else set()
    return [
        name for name in SECTIONS if name not in skipped and (not args.only or name in args.only)
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from tasks.runtime.layout import keep_library_files_in

    keep_library_files_in(os.environ, REPO_ROOT)  # the report plots, sections import Keras
    from bench.report import format_table, plot
    from bench.stats import evaluate_targets
    from tasks.runtime.params import load_params

    run = Run(args)
    base = load_params(REPO_ROOT / "params.yaml")
    bench = Bench(args, run, base, args.workdir, os.cpu_count() or 1)
    sections = wanted(args)
    # Sections that generate their own data (images, or a synthetic index) need no read/write set.
    if not set(sections) <= SELF_CONTAINED:
        run.section("prepare", partial(prepare, bench), needed=True)
        if not bench.index.exists():
            run.save()
            raise SystemExit("could not prepare the benchmark images; see errors above")
    for name in sections:
        run.section(name, partial(SECTIONS[name], bench))

    run.figures["targets"] = evaluate_targets(run.figures, base.shard.encoding)
    run.save()
    print(format_table(run.figures, run.figures["targets"]))
    try:
        plot(run.figures, run.figures["targets"], args.plot)
        log(f"wrote {args.out} and {args.plot}")
    except Exception as exc:
        log(f"wrote {args.out}; chart failed: {type(exc).__name__}: {exc}")
    return run.figures


if __name__ == "__main__":
    main()
