"""Camera-size photos: ingest + shard images/s at 224 px, the seeds' way and Shardflow's.

``python -m bench --only photos`` generates photo-like JPEGs at real camera sizes (12 MP
4000x3000 and 2 MP 1600x1200 by default; ``--photo-sizes``) and measures, per size:

- ``seed``: the seeds' recipe, per image ``tf.io.decode_jpeg`` + ``tf.image.resize``, eager,
  in one process (images/s of one worker);
- ``workers_1`` / ``workers_all``: the shard stage as production runs it (the Prefect flow in
  ``flows/shard.py`` and its task runner) at 1 worker and at every core;
- ``ceiling``: the same decode + resize + encode done the fastest correct way available here
  (Pillow's reduced-size JPEG decode, then the resize, then the record encoding), on every
  core at once with no orchestration and no file writing;
- ``decode_ratio``: what a pipeline run pays to decode one photo (ingest's check plus the
  shard stage's decode) over one full decode of it, measured on the same photos;
- ``progressive_ratio`` (the first size only): the data side per photo (ingest's check plus
  the shard stage's decode) on progressive JPEGs, common in web-sourced data, over the same
  on baseline JPEGs of the same pictures and size, taken photo by photo in turns;
- ``data_side``: the ingest and shard flows as `dvc repro` runs them (one worker each, the
  ingest-to-shard decode hand-off on, and off for comparison) on a third, two thirds and all
  of the photos: the per-photo slope (``data_side_per_photo_ms``) and the fixed per-run cost
  (``data_side_fixed_s``), beside ``decode_floor_ms``, one 1/8-scale decode of the same
  photos timed in the same processes.

Every timed run is a fresh interpreter that reports its own clock around the work (imports
and worker start-up excluded, as for a long-running stage).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.measured import run_measured
from bench.stats import linear_fit

PHOTO_CLASSES = ("beach", "forest", "street")
MARKER = ".bench-photos.json"


def draw_photo(
    index: int, width: int, height: int, *, seed: int = 0, progressive: bool = False
) -> tuple[str, bytes]:
    """(class, JPEG bytes): smooth light, a few soft shapes and sensor noise, quality 92;
    ``progressive``: the same picture as a progressive JPEG (Pillow's scan script).

    Noise and soft edges give camera-like JPEG sizes (about 1.5-3 bits per pixel), unlike
    flat drawings, so decode times are those of real photos.
    """
    rng = np.random.default_rng([seed, index, width])
    label = PHOTO_CLASSES[index % len(PHOTO_CLASSES)]
    # Build at 1/4 size and upscale: smooth content costs little to generate at 12 MP.
    small_h, small_w = max(2, height // 4), max(2, width // 4)
    y, x = np.mgrid[0:small_h, 0:small_w].astype(np.float32)
    base = rng.uniform(40, 200, 3).astype(np.float32)
    tilt = rng.uniform(-0.6, 0.6, (2, 3)).astype(np.float32)
    pixels = base + x[..., None] / small_w * tilt[0] * 100 + y[..., None] / small_h * tilt[1] * 100
    for _ in range(6):
        cx, cy = rng.uniform(0, small_w), rng.uniform(0, small_h)
        radius = rng.uniform(0.05, 0.3) * min(small_w, small_h)
        weight = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * radius**2))[..., None]
        pixels = pixels * (1 - weight) + rng.uniform(0, 255, 3).astype(np.float32) * weight
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="RGB")
    image = image.resize((width, height), Image.Resampling.BILINEAR)
    noisy = np.asarray(image, dtype=np.int16) + rng.integers(-6, 7, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(
        buffer, format="JPEG", quality=92, progressive=progressive
    )
    return label, buffer.getvalue()


def _write_photos(
    out_dir: str, indices: list[int], width: int, height: int, progressive: bool = False
) -> int:
    for index in indices:
        label, data = draw_photo(index, width, height, progressive=progressive)
        (Path(out_dir) / label / f"{label}_{index:05d}.jpg").write_bytes(data)
    return len(indices)


def generate_photos(
    out_dir: Path, n: int, width: int, height: int, *, workers: int, progressive: bool = False
) -> Path:
    """``n`` photos of ``width`` x ``height`` in ``out_dir/<class>/``; reused when they match."""
    recipe: dict[str, Any] = {"n": n, "width": width, "height": height, "version": 1}
    if progressive:
        recipe["progressive"] = True
    marker = out_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    for label in PHOTO_CLASSES:
        (out_dir / label).mkdir(parents=True, exist_ok=True)
    chunks = [list(range(i, n, workers)) for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for future in [
            pool.submit(_write_photos, str(out_dir), c, width, height, progressive)
            for c in chunks
            if c
        ]:
            future.result()
    marker.write_text(json.dumps(recipe))
    return out_dir


def photo_files(source_dir: Path) -> list[Path]:
    return sorted(source_dir.glob("*/*.jpg"))


# -- the seeds' recipe -----------------------------------------------------------------------


def seed_decode_resize(files: list[Path], size: int) -> float:
    """Seconds for the seeds' per-image eager TF decode + resize (one process)."""
    import tensorflow as tf

    def one(path: Path) -> None:
        image = tf.io.decode_jpeg(tf.io.read_file(str(path)), channels=3)
        tf.cast(tf.image.resize(image, (size, size)), tf.uint8).numpy()

    one(files[0])  # first call builds the eager kernels: not part of the per-image cost
    start = time.perf_counter()
    for path in files:
        one(path)
    return time.perf_counter() - start


# -- the ceiling: fastest correct decode + resize + encode on every core ---------------------


def _fast_chunk(paths: list[str], size: int) -> int:
    from tasks.images import preprocess_bytes
    from tasks.schema import RecordSchema

    schema = RecordSchema(size, size, "raw")
    for path in paths:
        pixels = preprocess_bytes(Path(path).read_bytes(), (size, size), "pad", max_pixels=10**9)
        schema.encode_image(pixels)
    return len(paths)


def ceiling_decode_resize(files: list[Path], size: int, workers: int) -> float:
    """Seconds to preprocess every file on ``workers`` warm processes (no writing, no plan)."""
    context = multiprocessing.get_context("spawn")
    chunks = [[str(p) for p in files[i::workers]] for i in range(workers)]
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        # Warm every worker (imports) before the clock starts.
        list(pool.map(_fast_chunk, [[str(files[0])]] * workers, [size] * workers))
        start = time.perf_counter()
        done = sum(pool.map(_fast_chunk, chunks, [size] * workers))
        elapsed = time.perf_counter() - start
    assert done == len(files)
    return elapsed


# -- decode cost of one pipeline run per photo -----------------------------------------------


def decode_ratio(files: list[Path], size: int) -> dict[str, float]:
    """(ingest check + shard decode) over one full decode, summed over ``files``; the check
    is ingest's own (:func:`tasks.ingest.inspection.check_image`: the near-duplicate hash
    included)."""
    from tasks.images import decode_rgb, preprocess_bytes
    from tasks.ingest.inspection import check_image

    full = check = shard = 0.0
    if files:  # the hash imports scipy.fftpack on first use: once per process, not per photo
        check_image(files[0].read_bytes(), max_pixels=10**9, min_side=1, draft=True)
    for path in files:
        data = path.read_bytes()
        start = time.perf_counter()
        decode_rgb(data, max_pixels=10**9, min_side=1)
        full += time.perf_counter() - start
        start = time.perf_counter()
        check_image(data, max_pixels=10**9, min_side=1, draft=True)
        check += time.perf_counter() - start
        start = time.perf_counter()
        preprocess_bytes(data, (size, size), "pad", max_pixels=10**9, draft=True)
        shard += time.perf_counter() - start
    return {
        "ratio": (check + shard) / full,
        "full_decode_ms": 1000 * full / len(files),
        "ingest_check_ms": 1000 * check / len(files),
        "shard_decode_ms": 1000 * shard / len(files),
    }


def progressive_data_side(
    baseline: list[Path], progressive: list[Path], size: int
) -> dict[str, float]:
    """The data side per photo (ingest's check + the shard stage's decode, as
    :func:`decode_ratio` times them) on progressive JPEGs over the same on baseline JPEGs
    of the same pictures; the two taken in turns, photo by photo, so a slow spell of the
    machine falls on both."""
    from tasks.images import preprocess_bytes
    from tasks.ingest.inspection import check_image

    if len(baseline) != len(progressive) or not baseline:
        raise ValueError(f"{len(baseline)} baseline and {len(progressive)} progressive photos")
    seconds = {"baseline": 0.0, "progressive": 0.0}
    check_image(baseline[0].read_bytes(), max_pixels=10**9, min_side=1, draft=True)  # warm
    for pair in zip(baseline, progressive, strict=True):
        for kind, path in zip(seconds, pair, strict=True):
            data = path.read_bytes()
            start = time.perf_counter()
            check_image(data, max_pixels=10**9, min_side=1, draft=True)
            preprocess_bytes(data, (size, size), "pad", max_pixels=10**9, draft=True)
            seconds[kind] += time.perf_counter() - start
    return {
        "ratio": seconds["progressive"] / seconds["baseline"],
        "baseline_ms": 1000 * seconds["baseline"] / len(baseline),
        "progressive_ms": 1000 * seconds["progressive"] / len(baseline),
        "photos": len(baseline),
    }


# -- the data side as `dvc repro` runs it: slope per photo and fixed cost --------------------


def decode_floor_seconds(files: list[Path]) -> tuple[float, float]:
    """(CPU, wall) seconds to decode every file once at 1/8 scale (libjpeg's DCT scaling,
    what ingest's check of a photo decodes), bytes already in memory: the least any check
    can cost."""
    blobs = [path.read_bytes() for path in files]
    cpu, wall = time.process_time(), time.perf_counter()
    for data in blobs:
        image = Image.open(io.BytesIO(data))
        image.draft(None, (max(1, image.width // 8), max(1, image.height // 8)))
        image.load()
    return time.process_time() - cpu, time.perf_counter() - wall


def data_side_points(
    files: list[Path],
    work: Path,
    size: int,
    *,
    handoff_mb: float,
    passes: int = 1,
    log: Any = print,
) -> dict[str, Any]:
    """The ingest and shard flows on a third, two thirds and all of ``files``, each run in a
    fresh interpreter and a fresh project root, the hand-off on (``handoff_mb``) and off
    (0) in turns, ``passes`` times over; per setting the least-squares slope (ms a photo)
    and intercept (fixed s a run) of the two stages' time through every run, each pass's
    own slope beside it, and the 1/8-decode floor timed in the same runs.

    One pass's slope rests on three runs and moves between runs of the same code by more
    than the target's margin; the line through every pass's runs is the figure.

    Time is the run's CPU time: with one worker every decode, hash and write of both stages
    happens in the stage process, and other jobs on a shared machine do not lengthen it as
    they do its wall time (the wall-clock slope is kept beside it). The Prefect server's own
    CPU is not in it: it is a fixed cost a run, not a photo's."""
    from bench.append import link_images
    from tasks.ingest.stage import RACE_MARGIN_NS
    from tasks.runtime.params import default_params

    counts = sorted({max(1, len(files) * k // 3) for k in (1, 2, 3)})
    settings = {"handoff": handoff_mb, "no_handoff": 0.0}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for n in counts:
        source = work / f"source-{n}"
        if not source.exists():
            names = [f"{p.parent.name}/{p.name}" for p in files[:n]]
            link_images(files[0].parent.parent, source, names)
    # A link changes its file's ctime: ingest trusts a file's stat only once it is older than
    # a margin (tasks.ingest.stage.RACE_MARGIN_NS), as a user's photos copied a while ago are.
    newest = max(p.stat().st_ctime_ns for p in files)
    time.sleep(max(0.0, (newest + RACE_MARGIN_NS - time.time_ns()) / 1e9 + 0.1))
    for i, (number, n) in enumerate((p, n) for p in range(max(1, passes)) for n in counts):
        source = work / f"source-{n}"
        order = list(settings) if i % 2 == 0 else list(reversed(settings))
        for name in order:
            root = work / f"{name}-{n}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            params = default_params(
                ingest={"source_dir": str(source), "workers": 1, "handoff_mb": settings[name]},
                shard={
                    "image_size": [size, size],
                    "encoding": "raw",
                    "draft_decode": True,
                    "workers": 1,
                },
            )
            (root / "params.yaml").write_text(json.dumps(params.model_dump(mode="json")))
            result = run_measured(
                "bench.photos", ["data-side", str(root)], work / f"{name}-{n}-pass{number}.log"
            )
            runs[name].append({"photos": n, "pass": number, **result})
            log(
                f"     {n} photos, {name}: CPU ingest {result['ingest_cpu_s']:.2f} s + shard "
                f"{result['shard_cpu_s']:.2f} s (wall {result['ingest_s']:.2f} + "
                f"{result['shard_s']:.2f} s); 1/8 decode {result['floor_ms']:.1f} ms/photo"
            )
    figures: dict[str, Any] = {"runs": runs, "workers": 1, "time": "CPU"}

    def line(points: list[dict[str, Any]], clock: str = "_cpu_s") -> tuple[float, float]:
        """(slope, intercept) of both stages' time on ``clock`` against the photos."""
        return linear_fit(
            [float(p["photos"]) for p in points],
            [p["ingest" + clock] + p["shard" + clock] for p in points],
        )

    for name, points in runs.items():
        slope, intercept = line(points)
        wall_slope, wall_intercept = line(points, "_s")
        figures[name] = {
            "per_photo_ms": 1000 * slope,
            "fixed_s": intercept,
            "wall_per_photo_ms": 1000 * wall_slope,
            "wall_fixed_s": wall_intercept,
            "per_pass_ms": [
                1000 * line([p for p in points if p["pass"] == number])[0]
                for number in sorted({p["pass"] for p in points})
            ],
        }
    floors = sorted(p["floor_ms"] for points in runs.values() for p in points)
    figures["decode_floor_ms"] = floors[len(floors) // 2]
    walls = sorted(p["floor_wall_ms"] for points in runs.values() for p in points)
    figures["decode_floor_wall_ms"] = walls[len(walls) // 2]
    figures["ratio"] = figures["handoff"]["per_photo_ms"] / figures["decode_floor_ms"]
    figures["no_handoff_ratio"] = figures["no_handoff"]["per_photo_ms"] / figures["decode_floor_ms"]
    return figures


def _data_side_child(root: str) -> None:
    """One data-side run: the ingest flow, then the shard flow, as their stages run them
    (``root``'s params.yaml); then the 1/8-decode floor of the same photos."""
    from flows.ingest import ingest_flow
    from flows.shard import shard_flow
    from flows.support.environment import configure_environment
    from flows.support.run_story import stage_settings
    from tasks.runtime.params import load_params

    configure_environment()
    params = load_params(Path(root) / "params.yaml")
    with stage_settings():
        start, start_cpu = time.perf_counter(), time.process_time()
        ingest_flow(params_path="params.yaml", root=root)
        ingested, ingested_cpu = time.perf_counter(), time.process_time()
        shard_flow(params_path="params.yaml", root=root)
        done, done_cpu = time.perf_counter(), time.process_time()
    files = photo_files(Path(params.ingest.source_dir))
    floor_cpu, floor_wall = decode_floor_seconds(files)
    handed_off = Path(root, ".shardflow", "handoff")
    print(
        json.dumps(
            {
                "ingest_s": ingested - start,
                "shard_s": done - ingested,
                "ingest_cpu_s": ingested_cpu - start_cpu,
                "shard_cpu_s": done_cpu - ingested_cpu,
                "floor_ms": 1000 * floor_cpu / len(files),
                "floor_wall_ms": 1000 * floor_wall / len(files),
                "handoff_left": handed_off.exists(),
            }
        )
    )


# -- the shard stage as production runs it ---------------------------------------------------


def shard_stage_seconds(
    index_path: Path, root: Path, params_json: str, workers: int
) -> dict[str, Any]:
    """The shard flow (flows/shard.py) in a fresh interpreter; its own timer around the run."""
    args = ["shard", str(index_path), str(root), params_json, str(workers)]
    return run_measured("bench.photos", args, root.with_name(root.name + ".log"))


def _shard_child(index_path: str, root: str, params_json: str, workers: str) -> None:
    from bench.scaling import flow_shard
    from tasks.runtime.params import ShardParams

    params = ShardParams.model_validate_json(params_json).model_copy(
        update={"workers": int(workers)}
    )
    result = flow_shard(params, Path(index_path), Path(root))
    print(json.dumps({"shard_s": result["shard_s"], "shards": result["shards"]}))


def _timed_child(kind: str, files_json: str, size: str, workers: str) -> None:
    files = [Path(p) for p in json.loads(Path(files_json).read_text())]
    if kind == "seed":
        seconds = seed_decode_resize(files, int(size))
    else:
        seconds = ceiling_decode_resize(files, int(size), int(workers))
    print(json.dumps({"seconds": seconds, "images": len(files)}))


def timed(kind: str, files: list[Path], size: int, workers: int, work: Path) -> float:
    """images/s of ``seed`` or ``ceiling`` in a fresh interpreter."""
    listing = work / f"{kind}-files.json"
    listing.write_text(json.dumps([str(p) for p in files]))
    result = run_measured(
        "bench.photos", [kind, str(listing), str(size), str(workers)], work / f"{kind}.log"
    )
    return float(result["images"]) / float(result["seconds"])


def measure_photos(
    base_shard: Any,
    work: Path,
    *,
    sizes: list[tuple[int, int]],
    count: int,
    size: int,
    ingest: Any,
    handoff_mb: float = 0.0,
    passes: int = 1,
    log: Any = print,
) -> dict[str, Any]:
    """Every figure for each photo size; keys ``{W}x{H}`` plus the headline ``write_photos``;
    ``passes``: of the data side (:func:`data_side_points`)."""
    cores = os.cpu_count() or 1
    results: dict[str, Any] = {}
    for width, height in sizes:
        tag = f"{width}x{height}"
        folder = generate_photos(
            work / f"photos-{tag}-{count}", count, width, height, workers=cores
        )
        files = photo_files(folder)
        mean_mb = sum(f.stat().st_size for f in files) / len(files) / 2**20
        log(f"   {len(files)} photos {tag}, {mean_mb:.1f} MB each")
        started = time.perf_counter()
        # From nothing: a cached or incremental ingest would time a lookup, not the checks.
        index = ingest(folder, work / f"ingest-photos-{tag}-{count}", workers=cores, fresh=True)
        ingest_s = time.perf_counter() - started
        params = base_shard.model_copy(
            update={"image_size": (size, size), "encoding": "raw", "draft_decode": True}
        )
        figures: dict[str, Any] = {"ingest_images_per_s": len(files) / ingest_s}
        figures["seed"] = timed("seed", files, size, 1, work)
        for workers, key in ((1, "workers_1"), (cores, "workers_all")):
            root = work / f"photos-shard-{tag}-w{workers}"
            result = shard_stage_seconds(index, root, params.model_dump_json(), workers)
            figures[key] = len(files) / float(result["shard_s"])
        figures["ceiling"] = timed("ceiling", files, size, cores, work)
        figures["decode"] = decode_ratio(files[: min(len(files), 40)], size)
        if not results:  # the headline size: the same pictures again as progressive JPEGs
            progressive = photo_files(
                generate_photos(
                    work / f"photos-{tag}-{count}-progressive",
                    count,
                    width,
                    height,
                    workers=cores,
                    progressive=True,
                )
            )
            figures["progressive"] = progressive_data_side(
                files[: min(len(files), 40)], progressive[: min(len(files), 40)], size
            )
            log(
                f"   {tag} progressive: data side {figures['progressive']['progressive_ms']:.1f} "
                f"ms/photo vs {figures['progressive']['baseline_ms']:.1f} baseline "
                f"({figures['progressive']['ratio']:.2f}x)"
            )
        side = data_side_points(
            files,
            work / f"data-side-{tag}-{count}",
            size,
            handoff_mb=handoff_mb,
            passes=passes,
            log=log,
        )
        figures["data_side"] = side
        log(
            f"   {tag} data side: {side['handoff']['per_photo_ms']:.1f} ms/photo + "
            f"{side['handoff']['fixed_s']:.2f} s a run with the hand-off "
            f"({side['no_handoff']['per_photo_ms']:.1f} ms/photo + "
            f"{side['no_handoff']['fixed_s']:.2f} s without); 1/8 decode "
            f"{side['decode_floor_ms']:.1f} ms/photo: {side['ratio']:.2f}x "
            f"({side['no_handoff_ratio']:.2f}x without); each pass: "
            + ", ".join(f"{ms:.1f}" for ms in side["handoff"]["per_pass_ms"])
            + " ms/photo"
        )
        figures["per_worker_vs_seed"] = figures["workers_1"] / figures["seed"]
        # The most one worker could reach: the decode + resize alone, nothing else paid.
        figures["preprocess_only_vs_seed"] = (
            1000 / figures["decode"]["shard_decode_ms"] / figures["seed"]
        )
        figures["all_vs_ceiling"] = figures["workers_all"] / figures["ceiling"]
        log(
            f"   {tag}: seed {figures['seed']:.1f}, shard w1 {figures['workers_1']:.1f}, "
            f"w{cores} {figures['workers_all']:.1f}, ceiling {figures['ceiling']:.1f} img/s; "
            f"decode ratio {figures['decode']['ratio']:.2f}"
        )
        results[tag] = figures
    return results


if __name__ == "__main__":
    if sys.argv[1] == "shard":
        _shard_child(*sys.argv[2:6])
    elif sys.argv[1] == "data-side":
        _data_side_child(sys.argv[2])
    else:
        _timed_child(*sys.argv[1:5])
