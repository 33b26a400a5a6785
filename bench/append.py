"""What a small data update costs: append 1% new images to a shard set vs build it again.

Two workspaces share one generated image set (hard links, so no image is stored twice):

- ``full``: every image, from scratch: a full ingest, a ``rebuild`` shard stage, a full
  validation: what a data update costs without append-only generations.
- ``grow``: the base images are ingested, sharded (``rebuild``) and validated untimed, the
  shard folder goes under DVC (``dvc add``, ``dvc push`` to a local remote); then the new
  images arrive and the timed update runs: an incremental ingest (previous verdicts reused),
  the ``append`` shard stage, and validation (new shards read in full, old ones by hash).
  Finally ``dvc add`` + ``dvc push`` again, and the objects that reach the remote are
  matched to the files they hold.

Every stage goes through the code the pipeline runs: :func:`tasks.ingest.stage.run_ingest`,
:func:`flows.shard.run` (the shard flow and its task runner: it needs a Prefect API, which
``make bench`` starts) and :func:`tasks.validate.stage.run_validate` with the data-diff limits.
Bytes written are the sizes of the files in the shard folder that are new or replaced
(size, mtime or inode changed), so a shard rewritten with the same bytes still counts.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tasks.runtime.layout import Layout
from tasks.runtime.params import Params

_IMAGE_INDEX = re.compile(r"_(\d+)\.jpg$")
_PUSHED = re.compile(r"(\d+) files? pushed")

FileState = tuple[int, int, int]  # size, mtime_ns, inode


# -- pure helpers ----------------------------------------------------------------------------


def new_image_count(images: int, fraction: float) -> int:
    """How many images the update adds: ``fraction`` of the base set, at least one."""
    if images < 1:
        raise ValueError(f"--append-images must be at least 1, got {images}")
    if not 0 < fraction <= 1:
        raise ValueError(f"--append-fraction must be in (0, 1], got {fraction}")
    return max(1, round(images * fraction))


def partition_images(names: Iterable[str], base_count: int) -> tuple[list[str], list[str]]:
    """(base, new) bench image names: images numbered below ``base_count`` form the base.

    The generator numbers images globally (``circle/circle_000042.jpg``), so the base is the
    same files whatever the size of the update.
    """
    base: list[str] = []
    new: list[str] = []
    for name in sorted(names):
        match = _IMAGE_INDEX.search(name)
        if match is None:
            raise ValueError(f"{name}: not a bench image name (expected <class>/<class>_N.jpg)")
        (base if int(match.group(1)) < base_count else new).append(name)
    return base, new


def written_files(before: dict[str, FileState], after: dict[str, FileState]) -> dict[str, int]:
    """Files of ``after`` that are new or were replaced since ``before``, with their sizes.

    Shards and metadata are written to a temporary name and renamed into place, so a
    rewrite always shows as a new inode (or size/mtime), even when the bytes are the same.
    """
    return {path: state[0] for path, state in after.items() if before.get(path) != state}


def remote_objects(paths: Iterable[str]) -> set[str]:
    """Object ids in a DVC 3 local remote, from its file paths (``files/md5/ab/cdef...``).

    A directory listing keeps its ``.dir`` suffix, so it never matches a file's md5.
    """
    objects = set()
    for path in paths:
        parts = Path(path).parts
        if len(parts) >= 4 and parts[-4:-2] == ("files", "md5"):
            objects.add(parts[-2] + parts[-1])
    return objects


def classify_push(
    pushed: set[str],
    entries: dict[str, str],
    new_shards: Iterable[str],
    base_shards: Iterable[str],
) -> dict[str, Any]:
    """What one ``dvc push`` sent, by file: new shards, old shards again, everything else.

    ``entries`` maps each path in the pushed folder to its md5 (the ``.dir`` listing);
    ``pushed`` are the object ids that reached the remote. ``shard_mismatch`` counts old
    shards sent again plus new shards not sent: 0 exactly when the push carried every new
    shard file and no existing one.
    """
    new_shards, base_shards = sorted(new_shards), sorted(base_shards)
    sent = sorted(path for path, md5 in entries.items() if md5 in pushed)
    new_sent = [p for p in new_shards if entries.get(p) in pushed]
    old_sent = [p for p in base_shards if entries.get(p) in pushed]
    shards = set(new_shards) | set(base_shards)
    others = [p for p in sent if p not in shards]
    matched = {entries[p] for p in sent}
    return {
        "objects": len(pushed),
        "new_shards": len(new_sent),
        "new_shards_planned": len(new_shards),
        "old_shards": len(old_sent),
        "old_shards_resent": old_sent,
        "new_shards_missing": sorted(set(new_shards) - set(new_sent)),
        "other_files": others,
        "folder_listings": sorted(o for o in pushed - matched if o.endswith(".dir")),
        "unmatched_objects": sorted(o for o in pushed - matched if not o.endswith(".dir")),
        "shard_mismatch": len(old_sent) + len(new_shards) - len(new_sent),
    }


def pushed_count(output: str) -> int | None:
    """The count ``dvc push`` prints ("3 files pushed"); None when it printed none."""
    match = _PUSHED.search(output)
    return int(match.group(1)) if match else None


def append_figures(full: dict[str, float], update: dict[str, float]) -> dict[str, float | None]:
    """The update's costs as fractions of the full run's (keys ingest_s, shard_s, validate_s,
    bytes_written; ``update`` also has set_bytes, the shard set's size after the update)."""
    from bench.stats import ratio

    stages = ("ingest_s", "shard_s", "validate_s")
    full_side = sum(full[k] for k in stages)
    update_side = sum(update[k] for k in stages)
    return {
        "append.ingest_fraction": ratio(update["ingest_s"], full["ingest_s"]),
        "append.shard_time_fraction": ratio(update["shard_s"], full["shard_s"]),
        "append.validate_fraction": ratio(update["validate_s"], full["validate_s"]),
        "append.data_side_s": update_side,
        "append.full_data_side_s": full_side,
        "append.data_side_fraction": ratio(update_side, full_side),
        "append.bytes_written": update["bytes_written"],
        "append.rebuild_bytes_written": full["bytes_written"],
        "append.bytes_written_fraction": ratio(update["bytes_written"], update["set_bytes"]),
    }


# -- file system -----------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, FileState]:
    """(size, mtime_ns, inode) of every file under ``folder``, by relative path."""
    if not folder.exists():
        return {}
    states = {}
    for path in folder.rglob("*"):
        if path.is_file():
            info = path.stat()
            states[path.relative_to(folder).as_posix()] = (
                info.st_size,
                info.st_mtime_ns,
                info.st_ino,
            )
    return states


def link_images(source: Path, dest: Path, names: Iterable[str]) -> int:
    """Hard-link (copy where links fail) ``names`` from ``source`` into ``dest``."""
    count = 0
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / name, target)
        except OSError:
            shutil.copy2(source / name, target)
        count += 1
    return count


# -- the stages, as the pipeline runs them -------------------------------------------------


def run_ingest(params: Params, layout: Layout, source: Path) -> dict[str, Any]:
    from tasks.contracts.handoff import Target
    from tasks.ingest.stage import run_ingest as ingest

    settings = params.ingest.model_copy(update={"source_dir": str(source)})
    target = Target.of(params.shard)
    return ingest(
        settings, layout.index, layout.ingest_report, handoff=layout.handoff, target=target
    )


def run_shard(params: Params, layout: Layout, mode: str) -> dict[str, Any]:
    """The shard stage through its Prefect flow and task runner (what `dvc repro` runs)."""
    from flows.run_story import stage_settings
    from flows.shard import run

    with stage_settings():
        return run(params.shard.model_copy(update={"mode": mode}), layout)


def run_validate(params: Params, layout: Layout) -> dict[str, Any]:
    from tasks.runtime.dataset_identity import dataset_identity
    from tasks.validate import stage as validate

    dataset = dataset_identity(params.ingest.source_dir, params.ingest.labels_csv, layout.root)
    report = validate.validate_layout(layout, params.validate_, dataset)
    validate.raise_if_failed(report)  # a failed validation would make the timing meaningless
    return report


def timed(body: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = body()
    return result, time.perf_counter() - start


def data_side(params: Params, layout: Layout, source: Path, mode: str) -> dict[str, Any]:
    """Ingest, shard and validate once, timing each; bytes the shard stage wrote."""
    before = snapshot(layout.shards_dir)
    ingest, ingest_s = timed(lambda: run_ingest(params, layout, source))
    shard, shard_s = timed(lambda: run_shard(params, layout, mode))
    written = written_files(before, snapshot(layout.shards_dir))
    _, validate_s = timed(lambda: run_validate(params, layout))
    return {
        "ingest_s": ingest_s,
        "shard_s": shard_s,
        "validate_s": validate_s,
        "bytes_written": sum(written.values()),
        "files_written": len(written),
        "set_bytes": sum(state[0] for state in snapshot(layout.shards_dir).values()),
        "ingest_reused": ingest["reused_count"],
        "ingest_decoded": ingest["decoded_count"],
        "ingest_stat_trusted": ingest["stat_trusted_count"],
        "shard": shard,
    }


# -- DVC -------------------------------------------------------------------------------------


def dvc(root: Path, *args: str) -> str:
    """Run ``dvc`` in ``root`` as the stages do; its output, or an error naming the command."""
    from flows.dvc_steps import run_dvc

    result = run_dvc(root, *args)
    return result.stdout + result.stderr


def dvc_init(root: Path, remote: Path) -> None:
    """A DVC repo (no Git: what a push sends does not depend on it) with a local remote."""
    shutil.rmtree(remote, ignore_errors=True)
    remote.mkdir(parents=True)
    dvc(root, "init", "--no-scm", "--force")
    # Cache by hard link: at 50k images the shard set is not stored a third time.
    dvc(root, "config", "cache.type", "hardlink")
    dvc(root, "remote", "add", "--default", "--force", "bench", str(remote))


def folder_entries(root: Path, target: str) -> dict[str, str]:
    """relpath -> md5 of the folder ``dvc add`` recorded, from its ``.dir`` listing."""
    import json

    import yaml

    out = yaml.safe_load((root / f"{target}.dvc").read_text())["outs"][0]
    digest = str(out["md5"])
    listing = root / ".dvc" / "cache" / "files" / "md5" / digest[:2] / digest[2:]
    return {entry["relpath"]: entry["md5"] for entry in json.loads(listing.read_text())}


def push(root: Path, remote: Path, target: str) -> tuple[set[str], dict[str, str], int | None]:
    """``dvc add`` + ``dvc push`` of ``target``: objects new on the remote, the folder's
    entries, and the count dvc printed."""
    before = remote_objects(p.relative_to(remote).as_posix() for p in remote.rglob("*"))
    dvc(root, "add", target)
    output = dvc(root, "push")
    after = remote_objects(p.relative_to(remote).as_posix() for p in remote.rglob("*"))
    return after - before, folder_entries(root, target), pushed_count(output)


# -- the measurement -----------------------------------------------------------------------


def measure_append(
    params: Params,
    work: Path,
    *,
    images: int,
    fraction: float,
    min_size: int = 64,
    max_size: int = 128,
    workers: int = 2,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Figures (``append.*``) and details of one append of ``fraction`` new images to a set
    of ``images``, against building the grown set from scratch."""
    from bench.images import generate_images
    from tasks.contracts.manifest import load_manifest

    total = images + new_image_count(images, fraction)
    source = work / f"append-images-{total}-{min_size}-{max_size}"
    log(f"   generating {total} JPEGs ({min_size}-{max_size} px) in {source}")
    generate_images(source, total, min_size=min_size, max_size=max_size, workers=workers)
    names = [p.relative_to(source).as_posix() for p in source.glob("*/*.jpg")]
    base_names, new_names = partition_images(names, images)
    full, grow = stage_workspaces(source, work / "append", base_names, new_names)

    log(f"   base: {len(base_names)} images, ingest + shard (rebuild) + validate, untimed")
    base = data_side(params, grow, grow.root / "images", "rebuild")
    base_manifest = load_manifest(grow.shards_dir)
    remote = grow.root.parent / "remote"
    dvc_init(grow.root, remote)
    base_pushed, _, _ = push(grow.root, remote, "data/shards")

    log(f"   full run: {total} images from scratch")
    from_scratch = data_side(params, full, full.root / "images", "rebuild")

    log(f"   update: +{len(new_names)} images, shard.mode append")
    link_images(source, grow.root / "images", new_names)
    update = data_side(params, grow, grow.root / "images", "append")
    manifest = load_manifest(grow.shards_dir)
    if manifest.fingerprint == base_manifest.fingerprint:
        raise RuntimeError(f"{grow.shards_dir}: the append added no generation")
    base_shards = [s.file for info in base_manifest.splits.values() for s in info.shards]
    new_shards = manifest.generations[-1].shards
    pushed, entries, printed = push(grow.root, remote, "data/shards")
    sent = classify_push(pushed, entries, new_shards, base_shards)
    details = {
        "images": images,
        "new_images": len(new_names),
        "fraction": fraction,
        "image_px": [min_size, max_size],
        "shard_params": params.shard.model_dump(mode="json"),
        "base": _rounded(base),
        "full": _rounded(from_scratch),
        "update": _rounded(update),
        "generations": len(manifest.generations),
        "base_shards": len(base_shards),
        "new_shards": list(new_shards),
        "base_push_objects": len(base_pushed),
        "push": {**sent, "dvc_printed": printed},
        "note": "full run = ingest + rebuild + validate of the grown set from scratch; "
        "bytes = files new or replaced in the shard folder; push objects include the "
        "folder listing (.dir)",
    }
    return {"figures": report_figures(from_scratch, update, sent), "details": details}


def stage_workspaces(
    source: Path, root: Path, base_names: list[str], new_names: list[str]
) -> tuple[Layout, Layout]:
    """The ``full`` workspace (every image) and the ``grow`` one (the base images), linked.

    Both folders are staged first: a hard link moves its file's ctime, so linking the full
    set after the base run would make every base file look rewritten to the update's
    ingest. The pause lets the last links age past ingest's race margin, as a user's files
    have long before their next ingest.
    """
    from tasks.ingest.stage import RACE_MARGIN_NS

    shutil.rmtree(root, ignore_errors=True)
    full, grow = Layout(root / "full"), Layout(root / "grow")
    link_images(source, full.root / "images", [*base_names, *new_names])
    link_images(source, grow.root / "images", base_names)
    time.sleep(RACE_MARGIN_NS / 1e9)
    return full, grow


def report_figures(
    from_scratch: dict[str, Any], update: dict[str, Any], sent: dict[str, Any]
) -> dict[str, Any]:
    """The section's ``append.*`` figures: the update against the full run, and the push."""
    return {
        **append_figures(from_scratch, update),
        "append.shard_s": update["shard_s"],
        "append.rebuild_shard_s": from_scratch["shard_s"],
        "append.ingest_s": update["ingest_s"],
        "append.full_ingest_s": from_scratch["ingest_s"],
        "append.validate_s": update["validate_s"],
        "append.full_validate_s": from_scratch["validate_s"],
        "append.set_bytes": update["set_bytes"],
        "append.push_files": sent["objects"],
        "append.push_new_shards": sent["new_shards"],
        "append.push_old_shards": sent["old_shards"],
        "append.push_other_files": len(sent["other_files"]),
        "append.push_shard_mismatch": sent["shard_mismatch"],
        "append.push_only_new_shards": sent["shard_mismatch"] == 0,
    }


def _rounded(result: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
