"""The report: machine facts, the terminal table and the bar chart."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

READ_KEYS = (
    "read.folder",
    "read.seed",
    "read.raw",
    "read.raw_buffered",  # read.raw's shards through the reader before the global order
    "read.raw_stock",  # read.raw through stock ops only, as where its C++ op is not built
    "read.bytes_ceiling",  # read.raw's limit: the same files as bare records, never parsed
    "read.s3",  # read.raw's shards from a local S3 server, cold shard cache
    "read.s3_bytes_ceiling",  # read.s3's limit: the server's bare whole-object reads
    "read.jpeg",
    "read.jpeg_buffered",  # read.jpeg's shards through the reader before the global order
    "read.png",
    "read.ceiling",
    "read.ceiling_shard_jpeg",  # extra: the jpeg shards' own bytes decoded from memory
)
WRITE_KEYS = ("write.seed", "write.workers_1", "write.workers_2")
PHOTO_KEYS = (
    "write_photos.seed",
    "write_photos.workers_1",
    "write_photos.workers_all",
    "write_photos.ceiling",
)
RSS_KEYS = (
    "plan_rss.records_10k_mb",
    "plan_rss.records_1m_mb",
    "plan_rss.stage_rebuild_10k_mb",
    "plan_rss.stage_rebuild_1m_mb",
    "plan_rss.stage_append_10k_mb",
    "plan_rss.stage_append_1m_mb",
)
ORCHESTRATION_ROWS = (  # the tax is a median over paired passes; its spread beside it
    ("orchestration_tax", "median of the paired passes"),
    ("orchestration_tax_min", "lowest pass"),
    ("orchestration_tax_max", "highest pass"),
    ("orchestration_tax_iqr", "interquartile range"),
    ("orchestration_passes", "pass pairs (direct, dvc repro)"),
)


def machine_info() -> dict[str, Any]:
    import psutil

    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for package in ("tensorflow", "keras", "prefect", "mlflow", "dvc", "numpy", "pillow"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        **versions,
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


APPEND_ROWS = (
    # (label, figure, unit, digits)
    ("append shard", "append.shard_s", "s", 2),
    ("  rebuild shard", "append.rebuild_shard_s", "s", 2),
    ("append ingest", "append.ingest_s", "s", 2),
    ("  full ingest", "append.full_ingest_s", "s", 2),
    ("append validate", "append.validate_s", "s", 2),
    ("  full validate", "append.full_validate_s", "s", 2),
    ("append data side", "append.data_side_fraction", "x full run", 3),
    ("append bytes written", "append.bytes_written", "B", 0),
    ("  rebuild bytes written", "append.rebuild_bytes_written", "B", 0),
    ("append push objects", "append.push_files", "", 0),
    ("  new shards sent", "append.push_new_shards", "", 0),
    ("  old shards sent", "append.push_old_shards", "", 0),
    ("  other files sent", "append.push_other_files", "", 0),
)


def append_rows(figures: dict[str, Any]) -> list[str]:
    """The append section's rows; none when it did not run."""
    if figures.get("append.shard_s") is None:
        return []
    return [
        f"{label:<24}{_fmt(figures.get(key), digits):>14}  {unit}"
        for label, key, unit, digits in APPEND_ROWS
    ]


def format_table(figures: dict[str, Any], targets: list[dict[str, Any]]) -> str:
    """Figures and targets as plain text for the terminal."""
    lines = ["", f"{'figure':<24}{'value':>14}", "-" * 38]
    for key in (*READ_KEYS, *WRITE_KEYS):
        lines.append(f"{key:<24}{_fmt(figures.get(key)):>14}  img/s")
    lines.append(f"{'input_bound_ratio':<24}{_fmt(figures.get('input_bound_ratio'), 3):>14}  x")
    for key in sorted(k for k in figures if k.startswith("input_bound_ratio.")):
        lines.append(f"{key:<24}{_fmt(figures[key], 3):>14}  x")
    for key, what in ORCHESTRATION_ROWS:
        digits = 0 if key == "orchestration_passes" else 3
        lines.append(f"{key:<24}{_fmt(figures.get(key), digits):>14}  {what}")
    lines.append(f"{'dvc_noop_s':<24}{_fmt(figures.get('dvc_noop_s'), 3):>14}  s")
    for key, unit in (
        ("predict.images_per_s", "img/s"),
        ("serve.p50_ms", "ms"),
        ("serve.p95_ms", "ms"),
    ):
        lines.append(f"{key:<24}{_fmt(figures.get(key)):>14}  {unit}")
    for key in RSS_KEYS:
        lines.append(f"{key:<24}{_fmt(figures.get(key)):>14}  MB peak RSS")
    for key, unit in (
        ("handoff.entry_ms", "ms a small image's hand-off entry costs ingest + shard"),
        ("handoff.break_even_mp", "MP from which ingest keeps a decode for the shard stage"),
    ):
        lines.append(f"{key:<24}{_fmt(figures.get(key), 3):>14}  {unit}")
    for point in figures.get("scaling") or []:
        lines.append(
            f"{'scaling ' + str(point['images']):<24}{point['s_per_image'] * 1000:>14.3f}  ms/img"
            f"  peak RSS {point['peak_rss_mb']:.0f} MB"
        )
    lines += append_rows(figures)
    for key, unit in (
        ("near_duplicates.max_light_edit_bits", "bits (light edits, at most)"),
        ("near_duplicates.min_other_bits", "bits (other parts and photos, at least)"),
        ("near_duplicates.search_s", "s neighbour search"),
        ("near_duplicates.place_s", "s search + groups + splits"),
        ("near_duplicates.look_alike_place_s", "s the same for as many look-alikes"),
        ("near_duplicates.peak_rss_mb", "MB peak RSS"),
        ("near_duplicates.copies_confirmed", "of planted copies near (real images)"),
        ("near_duplicates.distinct_confirmed", "of distinct hash candidates near"),
        ("near_duplicates.place_rss_ratio_50k", "x peak RSS, confirmed / hash-only at 50k"),
        ("near_duplicates.place_rss_ratio_1m", "x the same at 1M images"),
        ("label_review.chosen", "min_class_review_accuracy the bench would choose"),
        ("label_review.precision", "precision of likely label errors at the default"),
        ("label_review.recall", "recall of flipped held-out labels at the default"),
        (
            "label_review.weak_false_share",
            "weak / fair models: share of correct labels called errors",
        ),
    ):
        lines.append(f"{key:<24}{_fmt(figures.get(key), 3):>14}  {unit}")
    lines += ["", f"{'target':<40}{'measured':>10}  {'rule':<48}result", "-" * 108]
    for t in targets:
        result = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        lines.append(f"{t['name']:<40}{_fmt(t['measured'], 3):>10}  {t['expression']:<48}{result}")
    errors = figures.get("errors") or {}
    for section, message in errors.items():
        lines.append(f"ERROR in {section}: {message.splitlines()[0][:200]}")
    return "\n".join(lines)


def orchestration_panel(ax: Any, figures: dict[str, Any]) -> None:
    """Each paired pass's orchestration tax as a dot, the median as a line, the target
    dashed: a reader sees the spread, not only one number."""
    spread = ((figures.get("details") or {}).get("orchestration") or {}).get(
        "orchestration_tax_spread"
    ) or {}
    taxes = [100 * t for t in spread.get("per_pass") or []]
    ax.set_title("orchestration tax per pass pair (%)", fontsize=10)
    if not taxes:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        return
    ax.plot(range(1, len(taxes) + 1), taxes, "o", color="#1f77b4", label="pass pair")
    ax.axhline(100 * spread["median"], color="#1f77b4", label=f"median {spread['median']:.1%}")
    ax.axhline(15, color="#d62728", linestyle="--", label="target 15%")
    ax.set_xlabel("pass pair (direct, then dvc repro)", fontsize=8)
    ax.set_xticks(range(1, len(taxes) + 1))
    ax.legend(fontsize=7)


def plot(figures: dict[str, Any], targets: list[dict[str, Any]], path: Path) -> Path:
    """Bars of read, write and 12 MP photo images/s and of peak RSS, with the target ratios
    written beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(17, 10), gridspec_kw={"width_ratios": [3, 1.6, 2.4]})
    (ax_read, ax_write, ax_text), (ax_photos, ax_rss, ax_orch) = axes
    orchestration_panel(ax_orch, figures)
    for ax, keys, title, unit in (
        (ax_read, READ_KEYS, "read (images/s, 224x224, batch 32)", ""),
        (ax_write, WRITE_KEYS, "write (images/s, to 224x224 records)", ""),
        (ax_photos, PHOTO_KEYS, "12 MP photos to 224x224 (images/s)", ""),
        (ax_rss, RSS_KEYS, "peak RSS (MB): planning / whole shard stage", " MB"),
    ):
        values = [figures.get(k) or 0.0 for k in keys]
        colours = ["#999999" if k.endswith(("folder", "seed")) else "#1f77b4" for k in keys]
        colours = [
            "#2ca02c" if k.endswith("ceiling") else c for k, c in zip(keys, colours, strict=True)
        ]
        labels = [
            k.split(".", 1)[1]
            .removesuffix("_mb")
            .replace("records_", "planning ")
            .replace("_", " ")
            for k in keys
        ]
        bars = ax.bar(labels, values, color=colours)
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(
                f"{value:,.0f}{unit}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    ax_text.axis("off")
    rows = [
        f"{'PASS' if t['pass'] else ('n/a ' if t['pass'] is None else 'FAIL')}  "
        f"{t['expression']}  ->  {_fmt(t['measured'], 2)}"
        for t in targets
    ]
    ax_text.text(
        0, 1, "targets (same run)\n\n" + "\n".join(rows), va="top", family="monospace", fontsize=7
    )
    machine = figures.get("machine") or {}
    fig.suptitle(
        f"Shardflow bench: {machine.get('cores')} cores, {machine.get('cpu_model', '')}, "
        f"tf {machine.get('tensorflow')}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
