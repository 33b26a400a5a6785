"""Pure helpers of the benchmark: statistics, target checks, image generation, subsetting."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.images import CLASSES, draw_image, generate_images, list_images
from bench.scaling import subset_index
from bench.stats import (
    Target,
    alternating_passes,
    evaluate_targets,
    for_at_least,
    linear_fit,
    median,
    ratio,
    scaling_ratios,
    timed_passes,
)
from tasks.contracts.index import load_index, write_index
from tests.s3_server import S3Server

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_median_odd_even_and_empty() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError, match="no values"):
        median([])


@pytest.mark.parametrize(
    ("num", "den", "expected"),
    [
        (10.0, 2.0, 5.0),
        (1.0, 0.0, None),
        (None, 2.0, None),
        (3.0, None, None),
        (float("nan"), 1.0, None),
    ],
)
def test_ratio_handles_missing_and_zero(
    num: float | None, den: float | None, expected: float | None
) -> None:
    assert ratio(num, den) == expected


def test_timed_passes_discards_warmup_and_counts_items() -> None:
    calls: list[int] = []

    def run() -> int:
        calls.append(1)
        return 100

    result = timed_passes(run, passes=3, warmup=2)
    assert len(calls) == 5
    assert len(result["passes"]) == 3
    assert result["items"] == 100
    assert result["per_s"] > 0


def test_alternating_passes_take_turns_after_every_warmup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    # Writes of the runs before reach the disk before each timed pass, not inside it.
    monkeypatch.setattr("bench.stats.os.sync", lambda: calls.append("sync"))

    def counter(name: str, items: int) -> Callable[[], int]:
        def run() -> int:
            calls.append(name)
            return items

        return run

    results = alternating_passes({"a": counter("a", 10), "b": counter("b", 20)}, passes=2)
    # Each warm-up first, then the timed passes in turns: a slow spell hits both figures.
    assert calls == ["a", "b", "sync", "a", "sync", "b", "sync", "a", "sync", "b"]
    assert [len(r["passes"]) for r in results.values()] == [2, 2]
    assert (results["a"]["items"], results["b"]["items"]) == (10, 20)


def test_for_at_least_repeats_until_the_time_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("bench.stats.time.perf_counter", lambda: clock[0])

    def run() -> int:
        clock[0] += 1.0  # each call takes one second of the fake clock
        return 5

    # Whole calls until 2.5 s have gone by: the third call ends at 3 s.
    assert for_at_least(run, 2.5)() == (15, 3.0)


@pytest.mark.parametrize(
    ("op", "threshold", "value", "expected"),
    [
        (">=", 4.0, 4.0, True),
        (">=", 4.0, 3.99, False),
        ("<=", 1.05, 1.06, False),
        ("<", 3.0, 3.0, False),
        ("<", 3.0, 2.9, True),
    ],
)
def test_target_comparisons(op: str, threshold: float, value: float, expected: bool) -> None:
    target = Target("t", "x", None, op, threshold)  # type: ignore[arg-type]
    assert target.evaluate({"x": value})["pass"] is expected


def test_ratio_target_and_missing_figure() -> None:
    target = Target("t", "read.raw", "read.folder", ">=", 4.0)
    assert target.evaluate({"read.raw": 900.0, "read.folder": 200.0}) == {
        "name": "t",
        "measured": 4.5,
        "expression": "read.raw / read.folder >= 4",
        "pass": True,
    }
    missing = target.evaluate({"read.raw": 900.0, "read.folder": None})
    assert missing["pass"] is None and missing["measured"] is None


def test_evaluate_targets_uses_default_encoding_and_scaling_extremes() -> None:
    figures = {
        "read.jpeg": 500.0,
        "read.raw": 5000.0,
        "read.folder": 100.0,
        "read.seed": 100.0,
        "scaling": [
            {"images": 50000, "s_per_image": 0.0011, "peak_rss_mb": 1200.0},
            {"images": 1000, "s_per_image": 0.001, "peak_rss_mb": 1000.0},
        ],
    }
    by_name = {t["name"]: t for t in evaluate_targets(figures, "jpeg")}
    assert by_name["read default encoding vs folder"]["measured"] == 5.0
    assert by_name["read default encoding vs seed recipe"]["pass"] is False
    assert by_name["scaling s/image largest vs smallest"]["measured"] == pytest.approx(1.1)
    assert by_name["scaling peak RSS largest vs smallest"]["pass"] is True
    assert by_name["orchestration tax"]["pass"] is None


def test_the_data_side_is_a_slope_per_photo_and_a_fixed_cost_beside_it() -> None:
    """Runs of 10, 20 and 30 photos costing 2 s plus 25 ms a photo give back both figures,
    and the issue-28 target compares the slope with one 1/8 decode."""
    slope, fixed = linear_fit([10.0, 20.0, 30.0], [2.25, 2.5, 2.75])
    assert slope == pytest.approx(0.025) and fixed == pytest.approx(2.0)
    with pytest.raises(ValueError, match="two different x"):
        linear_fit([10.0, 10.0], [1.0, 2.0])
    figures = {"write_photos.data_side_per_photo_ms": 25.0, "write_photos.decode_floor_ms": 20.0}
    by_name = {t["name"]: t for t in evaluate_targets(figures, "raw")}
    target = by_name["12 MP photos: data side per photo (flows, 1 worker) vs one 1/8 decode"]
    assert target["measured"] == 1.25 and target["pass"] is True


def test_scaling_ratios_need_two_points() -> None:
    assert scaling_ratios([{"images": 1, "s_per_image": 1.0, "peak_rss_mb": 1.0}]) == {
        "scaling.s_per_image_ratio": None,
        "scaling.peak_rss_ratio": None,
    }


def test_draw_image_is_deterministic_and_within_bounds() -> None:
    import io

    from PIL import Image

    shape, data = draw_image(7, seed=3, min_size=40, max_size=60)
    assert (shape, data) == draw_image(7, seed=3, min_size=40, max_size=60)
    assert data != draw_image(7, seed=4, min_size=40, max_size=60)[1]
    assert shape == CLASSES[7 % len(CLASSES)]
    image = Image.open(io.BytesIO(data))
    assert image.format == "JPEG" and image.mode == "RGB"
    assert all(40 <= side <= 60 for side in image.size)


def test_generate_images_reuses_a_matching_folder(tmp_path: Path) -> None:
    out = generate_images(tmp_path / "set", 5, min_size=16, max_size=20, workers=1)
    extra = out / CLASSES[0] / "kept.jpg"
    extra.write_bytes(b"x")
    generate_images(out, 5, min_size=16, max_size=20, workers=1)
    assert extra.exists()  # same recipe: folder reused as is
    generate_images(out, 6, min_size=16, max_size=20, workers=1)
    assert not extra.exists()  # new recipe: regenerated from scratch
    assert len(list_images(out)) == 6


def test_subset_index_keeps_the_first_n_images(tmp_path: Path) -> None:
    records = [{"path": f"circle/circle_{i:06d}.jpg", "split": "train"} for i in range(10)]
    full = tmp_path / "index.json"
    write_index(full, {"source_dir": "x", "classes": ["circle"], "records": records})
    assert subset_index(full, 4, tmp_path / "sub.json") == 4
    sub = load_index(tmp_path / "sub.json")
    assert [r["path"] for r in sub["records"]] == [f"circle/circle_{i:06d}.jpg" for i in range(4)]
    assert sub["classes"] == ["circle"]


def test_format_table_shows_figures_targets_and_errors() -> None:
    from bench.report import format_table

    figures = {"read.raw": 5000.0, "read.folder": 100.0, "errors": {"scaling": "RuntimeError: x"}}
    targets = evaluate_targets(figures, "raw")
    table = format_table(figures, targets)
    assert "read.raw / read.folder >= 4" in table
    assert "PASS" in table and "n/a" in table
    assert "ERROR in scaling: RuntimeError: x" in table


def test_dvc_stages_in_file_order(tmp_path: Path) -> None:
    from bench.orchestration import dvc_stages

    (tmp_path / "dvc.yaml").write_text("stages:\n  b: {cmd: x}\n  a: {cmd: y}\n")
    assert dvc_stages(tmp_path) == ["b", "a"]


def test_stage_seconds_run_from_each_stage_line_to_the_next() -> None:
    from bench.orchestration import DVC_START, stage_seconds

    marks = [
        (0.5, "Verifying data sources\n"),
        (1.0, "Running stage 'ingest':\n"),
        (1.2, "> python -m flows.ingest\n"),
        (3.0, "Updating lock file 'dvc.lock'\n"),
        (3.5, "Running stage 'shard':\n"),
    ]
    assert stage_seconds(marks, end=7.0) == {DVC_START: 1.0, "ingest": 2.5, "shard": 3.5}
    assert stage_seconds([(0.1, "Stage 'x' didn't change, skipping\n")], end=1.0) == {}


def test_the_tax_takes_each_stages_fastest_pass_on_each_side() -> None:
    from bench.orchestration import tax_from_stages

    direct = [
        {"(imports and exit)": 5.0, "ingest": 2.0, "train": 40.0, "total": 47.0},
        {"(imports and exit)": 6.0, "ingest": 1.0, "train": 50.0, "total": 57.0},
    ]
    dvc = [
        {"(dvc start)": 1.0, "ingest": 3.0, "train": 55.0, "total": 59.0},
        {"(dvc start)": 1.5, "ingest": 4.0, "train": 42.0, "total": 47.6},
    ]
    # direct 5 + 1 + 40 = 46; dvc 1 + 3 + 42 = 46
    assert tax_from_stages(direct, dvc) == pytest.approx(0.0)
    dvc[1]["train"] = 49.0  # the dvc side's fastest training is now 49: 1 + 3 + 49 = 53
    assert tax_from_stages(direct, dvc) == pytest.approx(1 - 46 / 53)


def test_the_tax_is_the_median_of_paired_passes_with_its_spread() -> None:
    from bench.orchestration import tax_spread

    # five pairs; pass 3's dvc side hit a slow spell: one outlier moves min/max, not the median
    direct = [{"total": t} for t in (85.0, 90.0, 88.0, 80.0, 86.0)]
    dvc = [{"total": t} for t in (100.0, 100.0, 160.0, 100.0, 100.0)]
    spread = tax_spread(direct, dvc)
    assert spread["per_pass"] == [0.15, 0.1, 0.45, 0.2, 0.14]
    assert spread["median"] == 0.15  # sorted: 0.10 0.14 0.15 0.20 0.45
    assert (spread["min"], spread["max"], spread["passes"]) == (0.1, 0.45, 5)
    assert spread["iqr"] == pytest.approx(0.20 - 0.14)  # numpy's linear quartiles
    assert spread["iqr"] == pytest.approx(
        float(np.percentile(spread["per_pass"], 75) - np.percentile(spread["per_pass"], 25))
    )
    even = tax_spread(direct[:4], dvc[:4])  # an even count: the mean of the middle two
    assert even["median"] == pytest.approx((0.15 + 0.2) / 2)
    with pytest.raises(ValueError, match="pair them"):
        tax_spread(direct, dvc[:4])


def test_the_report_table_shows_the_orchestration_spread() -> None:
    from bench.report import format_table

    table = format_table(
        {
            "orchestration_tax": 0.15,
            "orchestration_tax_min": 0.1,
            "orchestration_tax_max": 0.45,
            "orchestration_tax_iqr": 0.06,
            "orchestration_passes": 5,
        },
        [],
    )
    rows = {r[0]: r[1] for r in map(str.split, table.splitlines()) if len(r) > 1}
    assert rows["orchestration_tax"] == "0.150"
    assert (rows["orchestration_tax_min"], rows["orchestration_tax_max"]) == ("0.100", "0.450")
    assert (rows["orchestration_tax_iqr"], rows["orchestration_passes"]) == ("0.060", "5")


def test_the_stage_memory_run_builds_a_real_set_then_diffs_against_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan_rss.stage_*` measures the production stage: placeholder records in real framing,
    so the manifest, offsets and data diff must come out as for real shards."""
    import json

    from bench.plan_rss import _stage_child, synthetic_index
    from tasks.contracts.manifest import load_manifest
    from tasks.contracts.numpy_reader import SplitReader
    from tasks.runtime.layout import Layout

    index = synthetic_index(tmp_path / "index.jsonl", 300)
    grown = synthetic_index(tmp_path / "grown.jsonl", 303)
    root = tmp_path / "stage"
    for path, mode, want in (
        (index, "rebuild", (300, 0, 300)),
        (index, "rebuild", (300, 300, 0)),
        (grown, "append", (303, 300, 3)),
    ):
        _stage_child(str(path), str(root), mode)
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (result["records"], result["previous_records"], result["added"]) == want
    shards_dir = Layout(root).shards_dir
    manifest = load_manifest(shards_dir)
    readers = [SplitReader(shards_dir, split, manifest=manifest) for split in manifest.splits]
    assert sum(len(found) for reader in readers for found in reader.offsets) == 303
    assert len(manifest.generations) == 2


def test_only_a_section_that_needs_the_images_still_prepares_them(tmp_path: Path) -> None:
    """`--only orchestration` runs `prepare` first (it used to be filtered out, and the run
    stopped with "could not prepare the benchmark images"); other sections stay out."""
    from bench.__main__ import Run, parse_args

    args = parse_args(["--only", "orchestration", "--out", str(tmp_path / "bench.json")])
    run = Run(args)
    ran: list[str] = []
    run.section("prepare", lambda: ran.append("prepare"), needed=True)
    run.section("read", lambda: ran.append("read"))
    run.section("orchestration", lambda: ran.append("orchestration"))
    assert ran == ["prepare", "orchestration"]


def test_the_s3_link_paces_each_response_and_gives_no_credit_for_idle_time() -> None:
    from bench.s3_link import Pacer

    now = [0.0]
    pacer = Pacer(rate=1000, clock=lambda: now[0])
    assert pacer.pause_after(500) == pytest.approx(0.5)
    assert pacer.pause_after(500) == pytest.approx(1.0)  # 1000 bytes leave at 1 s, not sooner
    now[0] = 1.0
    assert pacer.pause_after(1000) == pytest.approx(1.0)
    now[0] = 10.0  # idle for 8 s: the next response still goes at the rate, not in a burst
    assert pacer.pause_after(1000) == pytest.approx(1.0)


def test_the_s3_link_passes_requests_and_objects_unchanged(s3_server: S3Server) -> None:
    import boto3

    from bench.s3_link import LimitedLink

    host, port = s3_server.endpoint_url.removeprefix("http://").split(":")
    link = LimitedLink((host, int(port)), mbps=64)
    try:
        client = boto3.client("s3", endpoint_url=link.endpoint_url)
        data = np.random.default_rng(0).bytes(3 * 2**20 + 17)
        client.put_object(Bucket=s3_server.bucket, Key="object", Body=data)
        for _ in range(2):  # one kept-alive connection, two responses
            body = client.get_object(Bucket=s3_server.bucket, Key="object")["Body"]
            assert body.read() == data
    finally:
        link.close()


def test_every_option_quick_overrides_exists_without_quick() -> None:
    """A full run reads the same options a --quick run does (a section once failed only in
    full runs: its option existed only among the quick overrides)."""
    from bench.__main__ import QUICK, parse_args

    full = vars(parse_args([]))
    assert [key for key in QUICK if key not in full] == []


def test_the_bench_keeps_what_it_generates_in_its_own_clone() -> None:
    """Its images, shards and repository copies (gigabytes, kept for the next run) went to
    $TMPDIR/shardflow-bench: outside the repository, and shared by every clone's bench."""
    from bench.__main__ import parse_args

    workdir = parse_args([]).workdir
    assert workdir.is_relative_to(REPO_ROOT / ".shardflow")
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(workdir / "images")], cwd=REPO_ROOT, check=False
    )
    assert ignored.returncode == 0  # never committed


def test_bench_drawings_are_rarely_near_duplicates_of_each_other() -> None:
    """The scaling and append sets go through ingest's near-duplicate placement like real
    photos: drawings on a flat ground were near-duplicates of most of their class (49,253 of
    50,000 in two groups, one split), which made every append pay a quadratic grouping."""
    import io

    import imagehash
    import numpy as np
    from PIL import Image

    from bench.images import draw_image
    from tasks.runtime.params import default_params

    distance = default_params().ingest.near_duplicate_distance
    hashes = np.array(
        [
            int(
                str(
                    imagehash.phash(
                        Image.open(io.BytesIO(draw_image(i, seed=0, min_size=64, max_size=128)[1]))
                    )
                ),
                16,
            )
            for i in range(400)
        ],
        dtype=np.uint64,
    )
    pairs = sum(
        int((np.bitwise_count(hashes[i + 1 :] ^ hashes[i]) <= distance).sum())
        for i in range(len(hashes))
    )
    assert pairs <= 4  # flat grounds: hundreds


def test_the_input_section_trains_params_yaml_with_only_what_it_was_asked_to_change() -> None:
    """The input figure is the production run's probe: params.yaml's training params, one
    epoch from scratch, with the asked model, precision and XLA; asking for XLA turns op
    determinism off (Keras would silently compile without XLA under it)."""
    from bench.__main__ import parse_args
    from bench.train_step import input_params
    from tasks.runtime.params import default_params

    base = default_params().train.model_copy(update={"deterministic": True, "xla": False})
    plain = input_params(base, "small_cnn", mixed_precision=None, xla=None)
    assert (plain.mixed_precision, plain.xla, plain.deterministic) == (
        base.mixed_precision,
        False,
        True,
    )
    assert (plain.epochs, plain.fine_tune_epochs, plain.weights) == (1, 0, None)
    assert plain.batch_size == base.batch_size and plain.augment == base.augment

    gpu = input_params(base, "efficientnet_b0", mixed_precision=True, xla=True)
    assert (gpu.model, gpu.mixed_precision, gpu.xla, gpu.deterministic) == (
        "efficientnet_b0",
        True,
        True,
        False,
    )
    args = parse_args(
        ["--input-models", "small_cnn,efficientnet_b0", "--xla", "--no-mixed-precision"]
    )
    assert (args.input_models, args.xla, args.mixed_precision) == (
        ["small_cnn", "efficientnet_b0"],
        True,
        False,
    )
    assert (parse_args([]).xla, parse_args([]).input_models) == (None, None)


@pytest.mark.parametrize(
    ("option", "expected"), [([], (48, 80)), (["--input-size", "96"], (96, 96))]
)
def test_the_input_section_shards_at_params_yamls_shape_unless_asked_for_a_square(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: list[str], expected: tuple[int, int]
) -> None:
    """params.yaml's [height, width] as it is (the section once took the height for both)."""
    import bench.datasets
    import bench.train_step
    from bench.__main__ import Bench, Run, input_bound, parse_args
    from tasks.runtime.params import default_params

    sharded: list[tuple[int, int]] = []
    monkeypatch.setattr(bench.datasets, "ingest_folder", lambda *a, **k: tmp_path / "index")

    def fresh_shards(params: Any, *args: Any, **kwargs: Any) -> Path:
        sharded.append(tuple(params.image_size))
        return tmp_path / "shards"

    monkeypatch.setattr(bench.datasets, "fresh_shards", fresh_shards)
    probe = {"ratio": 1.0, "step_ms_reader": 1.0, "step_ms_in_memory": 1.0, "batch_size": 64}
    probe |= {"precision_policy": "float32", "xla": False, "devices": ["cpu"]}
    monkeypatch.setattr(bench.train_step, "measure_input_bound", lambda *a: dict(probe))
    args = parse_args([*option, "--passes", "1", "--out", str(tmp_path / "bench.json")])
    base = default_params(shard={"image_size": [48, 80]})
    bench_run = Bench(args, Run(args), base, tmp_path, 2)

    input_bound(bench_run)

    assert sharded == [expected]
    details = bench_run.run.figures["details"]["input_bound_ratio"][base.train.model]
    assert details["image_size"] == list(expected)


def test_the_data_side_fits_one_line_through_every_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two passes over the three photo counts, each setting in turns: the figure is the line
    through all six runs of a setting, each pass's slope is kept beside it."""
    import bench.photos as photos

    folder = tmp_path / "photos" / "cat"
    folder.mkdir(parents=True)
    files = []
    for i in range(6):
        (folder / f"{i}.jpg").write_bytes(b"x")
        files.append(folder / f"{i}.jpg")
    calls: list[tuple[str, int]] = []

    def measured(module: str, args: list[str], log: Path) -> dict[str, float]:
        name, n = Path(args[1]).name.rsplit("-", 1)
        calls.append((name, int(n)))
        per_photo = 0.020 if len(calls) <= 6 else 0.030  # the second pass runs slower
        cpu = 1.0 + per_photo * int(n) * (1.0 if name == "handoff" else 2.0)
        return {
            "ingest_cpu_s": cpu / 2,
            "shard_cpu_s": cpu / 2,
            "ingest_s": cpu / 2,
            "shard_s": cpu / 2,
            "floor_ms": 20.0,
            "floor_wall_ms": 20.0,
        }

    monkeypatch.setattr(photos, "run_measured", measured)
    monkeypatch.setattr(photos.time, "sleep", lambda seconds: None)
    side = photos.data_side_points(files, tmp_path / "side", 32, handoff_mb=8, passes=2, log=str)
    assert sorted(calls) == sorted(
        [(name, n) for name in ("handoff", "no_handoff") for n in (2, 4, 6)] * 2
    )
    assert side["handoff"]["per_pass_ms"] == pytest.approx([20.0, 30.0])
    assert side["handoff"]["per_photo_ms"] == pytest.approx(25.0)
    assert side["no_handoff"]["per_photo_ms"] == pytest.approx(50.0)
    assert side["ratio"] == pytest.approx(25.0 / 20.0)


def test_the_hand_off_bench_keeps_every_decode_only_inside_its_alternative() -> None:
    """The bench's alternative keeps a small image's decode, and the cost model decides
    again as it ships once the bench leaves it."""
    from bench.handoff_entry import every_decode_kept
    from tasks.contracts.handoff import worth_handing_off

    assert not worth_handing_off(300 * 200, 300 * 200 * 3)
    with every_decode_kept():
        assert worth_handing_off(300 * 200, 300 * 200 * 3)
    assert not worth_handing_off(300 * 200, 300 * 200 * 3)


def test_a_latency_pieces_saving_is_the_median_of_its_pairs() -> None:
    """Each ``dvc repro`` pass without a piece is paired with the pass with all on before it;
    a slow spell on one pair moves the median less than it moves the ratio of totals."""
    from bench.orchestration import piece_savings

    direct = [{"total": 50.0}, {"total": 50.0}, {"total": 50.0}]
    dvc = [{"total": 60.0}, {"total": 120.0}, {"total": 60.0}]
    off = {"prestart": [{"total": 66.0}, {"total": 60.0}, {"total": 64.0}]}
    saved = piece_savings(direct, dvc, off)["prestart"]
    assert saved["per_pass"] == [round(1 - 60 / 66, 4), -1.0, round(1 - 60 / 64, 4)]
    assert saved["saving"] == round(1 - 60 / 64, 4)
    assert saved["tax_without"] == round(1 - 50 / 64, 4)
