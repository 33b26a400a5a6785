"""``python -m bench``: measure everything, write reports/bench.json and reports/bench.png."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICK = {
    "images": 200,
    "passes": 1,
    "read_seconds": 0.0,
    "scaling": [200, 1000],
    "steps": 10,
    "warmup_steps": 3,
    "photos": 12,
    "serve_requests": 30,
    "append_images": 500,
    "stage_rss_max": 10_000,
    "near_duplicate_hashes": 2000,
    "orch_passes": 2,
}
SELF_CONTAINED = {"append", "photos", "plan_rss", "near_duplicates"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--images", type=int, default=3000, help="images in the read/write set")
    parser.add_argument("--min-size", type=int, default=200, help="smallest source side (px)")
    parser.add_argument("--max-size", type=int, default=400, help="largest source side (px)")
    parser.add_argument("--size", type=int, default=224, help="square training size for read/write")
    parser.add_argument("--batch", type=int, default=32, help="batch size for read figures")
    parser.add_argument("--passes", type=int, default=3, help="timed passes per figure (median)")
    parser.add_argument(
        "--stage-rss-max",
        type=int,
        default=1_000_000,
        help="largest synthetic index the whole shard stage's peak RSS is measured on",
    )
    parser.add_argument(
        "--read-seconds",
        type=float,
        default=2.0,
        help="least seconds of each timed read pass (whole epochs, repeated)",
    )
    parser.add_argument(
        "--scaling",
        type=_int_list,
        default=[1000, 10000, 50000],
        help="comma-separated image counts for the shard scaling run",
    )
    parser.add_argument("--scaling-min-size", type=int, default=64)
    parser.add_argument("--scaling-max-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="timed train steps (input-bound)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument(
        "--orch-epochs",
        type=int,
        default=None,
        help="override train.epochs in the orchestration copies",
    )
    parser.add_argument(
        "--orch-passes",
        type=int,
        default=5,
        help="direct / dvc repro pass pairs of the orchestration figure (median and spread)",
    )
    parser.add_argument("--photos", type=int, default=200, help="camera photos per size")
    parser.add_argument(
        "--photo-sizes",
        type=_size_list,
        default=[(4000, 3000), (1600, 1200)],
        help="comma-separated WxH camera sizes (the first is the headline), e.g. 4000x3000",
    )
    parser.add_argument(
        "--serve-requests", type=int, default=200, help="single-image HTTP requests timed"
    )
    parser.add_argument(
        "--append-images",
        type=int,
        default=50000,
        help="base set of the append section (64-128 px JPEGs: --scaling-min/max-size)",
    )
    parser.add_argument(
        "--append-fraction",
        type=float,
        default=0.01,
        help="new images the append section adds, as a fraction of --append-images",
    )
    parser.add_argument(
        "--near-duplicate-hashes",
        type=int,
        default=50000,
        help="perceptual hashes the near_duplicates section searches and places",
    )
    parser.add_argument("--skip-orchestration", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=None,
        help="comma-separated sections: read,write,photos,input,serve,orchestration,scaling,"
        "append,plan_rss,near_duplicates",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"tiny smoke run: {QUICK}, orchestration at 1 epoch"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "bench.json")
    parser.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "shardflow-bench",
        help="generated images, shards and repo copies (reused between runs)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.orch_epochs = args.orch_epochs or 1
    args.plot = args.plot or args.out.with_suffix(".png")
    return args


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _size_list(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        width, height = part.lower().split("x")
        sizes.append((int(width), int(height)))
    return sizes


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
            "read.jpeg": None,
            "read.png": None,
            "read.ceiling": None,
            "read.bytes_ceiling": None,
            "write.seed": None,
            "write.workers_1": None,
            "write.workers_2": None,
            "write_photos.seed": None,
            "write_photos.workers_1": None,
            "write_photos.workers_all": None,
            "write_photos.ceiling": None,
            "ingest_photos.decode_ratio": None,
            "write_photos.progressive_ratio": None,
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
            "near_duplicates.max_light_edit_bits": None,
            "near_duplicates.min_other_bits": None,
            "near_duplicates.search_s": None,
            "near_duplicates.place_s": None,
            "near_duplicates.peak_rss_mb": None,
            "machine": machine_info(),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "details": {},
            "errors": {},
            "notes": [],
        }

    def section(self, name: str, body: Callable[[], None]) -> None:
        if self.args.only and name not in self.args.only:
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from bench.datasets import fresh_shards, ingest_folder
    from bench.images import generate_images
    from bench.report import format_table, plot
    from bench.stats import evaluate_targets
    from tasks.params import load_params

    run = Run(args)
    work: Path = args.workdir
    cores = os.cpu_count() or 1
    base = load_params(REPO_ROOT / "params.yaml")
    size = (args.size, args.size)
    tag = f"{args.images}-{args.min_size}-{args.max_size}"
    images = work / f"images-{tag}"
    state: dict[str, Any] = {}

    def prepare() -> None:
        log(f"   generating {args.images} JPEGs ({args.min_size}-{args.max_size} px) in {images}")
        generate_images(
            images, args.images, min_size=args.min_size, max_size=args.max_size, workers=cores
        )
        state["index"] = ingest_folder(images, work / f"ingest-{tag}", workers=cores)

    # Sections that generate their own data (images, or a synthetic index) need no read/write set.
    if not args.only or not set(args.only) <= SELF_CONTAINED:
        run.section("prepare", prepare)
        if "index" not in state:
            run.save()
            raise SystemExit("could not prepare the benchmark images; see errors above")
    # The read/write set's index; sections that use it never run without `prepare`.
    index: Path = state.get("index") or Path("/nonexistent/bench-index.json")

    def read() -> None:
        from bench import read as r

        # Every pipeline first, then all of them timed in turns (bench.read.measure_reads).
        datasets = {"read.folder": r.folder_dataset(images, size=size, batch=args.batch)}
        seed_file = work / f"seed-{tag}.tfrecord"
        r.write_seed_tfrecord(images, seed_file)
        datasets["read.seed"] = r.seed_dataset(seed_file, size=size, batch=args.batch)
        for encoding in ("raw", "jpeg", "png"):
            params = base.shard.model_copy(update={"image_size": size, "encoding": encoding})
            shards = fresh_shards(params, index, work / f"read-{tag}-{encoding}", workers=cores)
            datasets[f"read.{encoding}"] = r.shardflow_dataset(shards, batch=args.batch)
            if encoding == "raw":
                # The physical limit: the same files as bare records, never parsed.
                datasets["read.bytes_ceiling"] = r.bytes_dataset(shards, batch=args.batch)
            if encoding == "jpeg":
                # Stricter ceiling for read.jpeg: the shards' own JPEG bytes, decoded from memory.
                encoded, labels = r.shard_image_bytes(shards)
                datasets["read.ceiling_shard_jpeg"] = r.ceiling_dataset(
                    encoded, labels, size=None, batch=args.batch
                )
        encoded, labels = r.source_jpegs(images)
        datasets["read.ceiling"] = r.ceiling_dataset(encoded, labels, size=size, batch=args.batch)
        results = r.measure_reads(datasets, passes=args.passes, seconds=args.read_seconds)
        for key, result in results.items():
            run.record(key, result)

    def write() -> None:
        from bench.stats import timed_passes
        from bench.write import seed_write_measured, shardflow_write_measured

        params = base.shard.model_copy(update={"image_size": size})
        run.figures["details"]["write.encoding"] = params.encoding
        seed_file = work / f"write-seed-{tag}.tfrecord"
        run.record(
            "write.seed",
            timed_passes(
                lambda: seed_write_measured(images, seed_file, size=size, encoding=params.encoding),
                passes=args.passes,
            ),
        )
        for workers in (1, 2):
            shards = work / f"write-{tag}-w{workers}"

            def shard_once(w: int = workers, out: Path = shards) -> tuple[int, float]:
                return shardflow_write_measured(params, index, out, workers=w)

            run.record(f"write.workers_{workers}", timed_passes(shard_once, passes=args.passes))

    def photos() -> None:
        from bench.photos import measure_photos

        results = measure_photos(
            base.shard,
            work,
            sizes=args.photo_sizes,
            count=args.photos,
            size=args.size,
            ingest=ingest_folder,
            log=log,
        )
        headline = results[f"{args.photo_sizes[0][0]}x{args.photo_sizes[0][1]}"]
        for key in ("seed", "workers_1", "workers_all", "ceiling"):
            run.figures[f"write_photos.{key}"] = round(headline[key], 2)
        run.figures["ingest_photos.decode_ratio"] = round(headline["decode"]["ratio"], 4)
        if "progressive" in headline:
            run.figures["write_photos.progressive_ratio"] = round(
                headline["progressive"]["ratio"], 4
            )
        run.figures["details"]["photos"] = results

    def input_bound() -> None:
        from bench.train_step import input_bound_ratio

        shards = fresh_shards(base.shard, index, work / f"train-{tag}", workers=cores)
        # One ratio per pass (each synthetic / real / synthetic), median across passes: on a
        # 2-core VM a single pass swings by +-10% with the host's load.
        passes = [
            input_bound_ratio(shards, base.train, steps=args.steps, warmup=args.warmup_steps)
            for _ in range(max(1, args.passes))
        ]
        result = sorted(passes, key=lambda r: r["ratio"])[len(passes) // 2]
        result["pass_ratios"] = [round(r["ratio"], 4) for r in passes]
        run.figures["input_bound_ratio"] = round(result["ratio"], 4)
        run.figures["details"]["input_bound_ratio"] = result
        if "stand-in" in result["model"]:
            run.figures["notes"].append(f"input_bound_ratio: {result['model']}")
        log(
            f"   input_bound_ratio {result['ratio']:.3f} (real {result['real_step_ms']} ms, "
            f"synthetic {result['synthetic_step_ms']} ms per step, {result['model']})"
        )

    def serve() -> None:
        from bench.serve import measure_serving

        shards = fresh_shards(base.shard, index, work / f"serve-{tag}", workers=cores)
        result = measure_serving(
            base,
            shards,
            images,
            work / "serve",
            passes=args.passes,
            requests=args.serve_requests,
            log=log,
        )
        run.figures["details"]["serve"] = result.pop("details")
        for key, value in result.items():
            run.figures[key] = round(value, 2)
        log(
            f"   predict.images_per_s {run.figures['predict.images_per_s']}, serve p50 "
            f"{run.figures['serve.p50_ms']} ms, p95 {run.figures['serve.p95_ms']} ms"
        )

    def orchestration() -> None:
        from bench.orchestration import measure_orchestration

        overrides = {"train": {"epochs": args.orch_epochs}} if args.orch_epochs else {}
        result = measure_orchestration(
            REPO_ROOT,
            work / "orchestration",
            images=images,
            overrides=overrides,
            passes=args.orch_passes,
            log=log,
        )
        for key in ("orchestration_tax", "dvc_noop_s"):
            value = result.pop(key)
            run.figures[key] = None if value is None else round(value, 4)
        spread = result.get("orchestration_tax_spread") or {}
        for key in ("min", "max", "iqr"):  # the median's spread over the paired passes
            run.figures[f"orchestration_tax_{key}"] = spread.get(key)
        run.figures["orchestration_passes"] = spread.get("passes")
        run.figures["details"]["orchestration"] = result
        if result.get("note"):
            run.figures["notes"].append(f"orchestration: {result['note']}")
        if result.get("stages_not_compared"):
            run.figures["notes"].append(
                "orchestration_tax covers stages "
                + ", ".join(result["stages_compared"])
                + " only (no direct call registered for "
                + ", ".join(result["stages_not_compared"])
                + " in bench/orchestration.py)"
            )
        log(
            f"   orchestration_tax {run.figures['orchestration_tax']} (median of "
            f"{run.figures['orchestration_passes']} paired passes, min "
            f"{run.figures['orchestration_tax_min']}, max {run.figures['orchestration_tax_max']}, "
            f"IQR {run.figures['orchestration_tax_iqr']}), dvc_noop_s {run.figures['dvc_noop_s']}"
        )

    def scaling() -> None:
        from bench.scaling import scaling_run

        largest = max(args.scaling)
        stag = f"{largest}-{args.scaling_min_size}-{args.scaling_max_size}"
        scaling_images = work / f"scaling-images-{stag}"
        log(f"   generating {largest} JPEGs ({args.scaling_min_size}-{args.scaling_max_size} px)")
        generate_images(
            scaling_images,
            largest,
            min_size=args.scaling_min_size,
            max_size=args.scaling_max_size,
            workers=cores,
        )
        full_index = ingest_folder(scaling_images, work / f"ingest-scaling-{stag}", workers=cores)
        run.figures["scaling"] = scaling_run(
            base.shard,
            full_index,
            work / "scaling",
            sorted(args.scaling),
            workers=base.shard.workers,
            log=log,
        )
        run.figures["notes"].append(
            f"scaling uses {args.scaling_min_size}-{args.scaling_max_size} px source JPEGs and "
            f"the params.yaml shard settings ({base.shard.image_size}, {base.shard.encoding}, "
            f"{base.shard.workers} workers); peak_rss_mb sums the shard process and its workers"
        )

    def append() -> None:
        from bench.append import measure_append
        from flows.server import require_server

        require_server()  # the shard stage runs as its Prefect flow
        result = measure_append(
            base,
            work,
            images=args.append_images,
            fraction=args.append_fraction,
            min_size=args.scaling_min_size,
            max_size=args.scaling_max_size,
            workers=cores,
            log=log,
        )
        for key, value in result["figures"].items():
            run.figures[key] = round(value, 4) if isinstance(value, float) else value
        run.figures["details"]["append"] = result["details"]
        f = run.figures
        log(
            f"   append +{result['details']['new_images']} images: bytes written "
            f"{f['append.bytes_written_fraction']} of the set, data side "
            f"{f['append.data_side_fraction']} of a full run, dvc push "
            f"{f['append.push_files']} objects ({f['append.push_new_shards']} new shards, "
            f"{f['append.push_old_shards']} old shards)"
        )

    def plan_rss() -> None:
        from bench.plan_rss import measure_plan_rss

        figures = measure_plan_rss(work / "plan-rss", stage_up_to=args.stage_rss_max, log=log)
        for key, value in figures.items():
            target = run.figures if not key.endswith("_details") else run.figures["details"]
            target[f"plan_rss.{key}"] = value

    def near_duplicates() -> None:
        from bench.near_duplicates import measure_near_duplicates

        result = measure_near_duplicates(
            work,
            count=args.near_duplicate_hashes,
            distance=base.ingest.near_duplicate_distance,
            log=log,
        )
        threshold, search = result["threshold"], result["search"]
        f = run.figures
        f["near_duplicates.max_light_edit_bits"] = threshold["max_light_edit_bits"]
        f["near_duplicates.min_other_bits"] = min(
            threshold["min_other_position_bits"], threshold["min_different_photo_bits"]
        )
        f["near_duplicates.search_s"] = search["search_s"]
        f["near_duplicates.place_s"] = search["place_s"]
        f["near_duplicates.peak_rss_mb"] = search["peak_rss_mb"]
        f["details"]["near_duplicates"] = result

    run.section("read", read)
    run.section("write", write)
    run.section("photos", photos)
    run.section("input", input_bound)
    run.section("serve", serve)
    if not args.skip_orchestration:
        run.section("orchestration", orchestration)
    if not args.skip_scaling:
        run.section("scaling", scaling)
    run.section("append", append)
    run.section("plan_rss", plan_rss)
    run.section("near_duplicates", near_duplicates)

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
