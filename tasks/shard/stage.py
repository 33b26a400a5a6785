"""The shard stage: plan (a rebuild or a new generation), prepare, write, finalize.

:func:`shard_stage` is the one orchestration, and the flow in ``flows/shard.py`` hands it a
writer that runs each shard on its Prefect task runner. The finalize step writes the
generation's record list, the manifest (last, atomically) and the data diff. A rebuild does
all of it in a folder of its own, which replaces the shard folder once finished
(:mod:`tasks.contracts.shard_swap`): a rebuild that fails part way loses nothing.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.contracts import handoff as handoff_store
from tasks.contracts import shard_changes as data_diff
from tasks.contracts.content import check_class_names
from tasks.contracts.index import read_header
from tasks.contracts.manifest import (
    MANIFEST_NAME,
    MEMBERSHIP_NAME,
    SPLITS,
    Generation,
    ShardFile,
    ShardManifest,
    SplitInfo,
    build_manifest,
    file_sha256,
    generation_folder,
    load_manifest,
    records_file_name,
    stream_records,
)
from tasks.contracts.membership import write_membership
from tasks.contracts.numpy_reader import write_record_index
from tasks.contracts.shard_blocks import BLOCKS_NAME, write_block_list
from tasks.contracts.shard_swap import discard_rebuild, finish_swap, rebuild_folder, swap_in
from tasks.contracts.tfds_metadata import write_tfds_metadata
from tasks.images import preprocessing_version
from tasks.runtime.atomic import write_text
from tasks.runtime.params import ShardParams
from tasks.shard.append import (
    REBUILD_HINT,
    RebuildNeeded,
    base_table,
    check_compatible,
    check_nothing_removed,
    load_base,
)
from tasks.shard.planning import StagePlan, cut_shards, scan_index, shard_record
from tasks.shard.spec import schema_from_params
from tasks.shard.writing import WriteMany, describe_shard, prepare, write_inline


@dataclass(frozen=True)
class StageRun:
    """What one run of the shard stage did."""

    mode: str  # "rebuild" or "append"
    number: int  # the generation this run wrote
    shards: int  # shards planned
    written: int  # shards written by this run (the others were kept from a killed run)
    manifest: ShardManifest
    diff: dict[str, Any] | None


def shard_stage(
    params: ShardParams,
    index_path: Path,
    shards_dir: Path,
    *,
    write_many: WriteMany = write_inline,
    diff_path: Path | None = None,
    handoff: Path | None = None,
) -> StageRun:
    """The shard stage: plan, prepare, write the missing shards, finalize (and diff).

    The one orchestration there is: the flow (``flows/shard.py``, what `dvc repro` runs)
    calls it with ``write_many`` sending each shard to its Prefect task runner; tests of
    the pure pieces pass the inline writer. Resumes a killed run of the same plan. With
    ``diff_path``, also writes the data diff against the manifest found before (JSON
    there, Markdown next to it). ``handoff``: the hand-off root (``Layout.handoff``) where
    ingest kept its decodes: the writers resize those decoded at the scale they need
    instead of decoding again (same bytes), and a finished run leaves it empty.
    """
    shards_dir = Path(shards_dir)
    finish_swap(shards_dir)  # a rebuild killed between its two renames
    for folder in (shards_dir, rebuild_folder(shards_dir)):
        data_diff.remove_spills(folder)  # a killed run's
    kept = None
    if handoff is not None:
        version = preprocessing_version()
        handoff_store.clear(handoff, keep=version)  # another decoder's: never used
        kept = str(handoff_store.folder_for(handoff, version))
    plan = plan_stage(params, index_path, shards_dir, handoff=kept)
    # A rebuild writes the whole new set beside the one it replaces; an append adds a folder
    # (and a killed rebuild's folder, which it never uses, goes: its disk is not kept for it).
    rebuild = plan.base is None
    if not rebuild:
        discard_rebuild(shards_dir)
    folder = rebuild_folder(shards_dir) if rebuild else shards_dir
    try:
        manifest, written = _write_shards(params, plan, shards_dir, folder, write_many)
        shards = len(plan.specs)
        # The specs' order (8 bytes a record) goes before the diff, which reads the record
        # lists instead: the stage's peak memory does not grow with the order.
        plan.specs = plan.specs.subset(())
        diff = write_stage_diff(plan, manifest, folder, diff_path) if diff_path else None
    finally:
        if plan.previous_records is not None:  # spilled in shards_dir: gone before the swap
            plan.previous_records.close()
    if rebuild:
        swap_in(shards_dir)
    if handoff is not None:  # what no record used (a resumed shard's, a duplicate's)
        handoff_store.clear(handoff)
    return StageRun(plan.mode, plan.number, shards, written, manifest, diff)


def _write_shards(
    params: ShardParams, plan: StagePlan, shards_dir: Path, folder: Path, write_many: WriteMany
) -> tuple[ShardManifest, int]:
    """Prepare ``folder``, write the missing shards there, finalize; (the manifest, shards
    written now). ``folder``: the rebuild's own, or ``shards_dir`` for an append."""
    missing = prepare(plan, shards_dir, folder)
    written = {r.file: r for r in write_many(missing, folder)}
    results = [
        written.get(slot.file) or describe_shard(slot.file, slot.num_records, folder)
        for slot in plan.specs.slots
    ]
    return finalize_manifest(params, plan, results, folder), len(missing)


def plan_stage(
    params: ShardParams, index_path: Path, shards_dir: Path, *, handoff: str | None = None
) -> StagePlan:
    """Plan a rebuild (generation 0 from the index) or an append (a new generation).

    An append reads the index once: the same pass that orders the new records notes every
    record's class, split and path, for the check that nothing in the base was removed and
    for the data diff's duplicates (a pass over the index is the plan's largest cost). The
    diff's "before" is kept as a compact table, not as the record lists. ``handoff``: the
    folder of ingest's kept decodes the specs name (:func:`tasks.shard.planning.cut_shards`).
    """
    shards_dir, index_path = Path(shards_dir), Path(index_path)
    header = read_header(index_path)
    check_class_names(  # before any shard is written, not at the TFDS files
        header["classes"],
        str(index_path),
        "rerun ingest, which quarantines such a class's files (rename its folder or fix its label)",
    )
    if params.mode == "rebuild":
        return plan_rebuild(params, index_path, shards_dir, header, handoff)
    return plan_append(params, index_path, shards_dir, header, handoff)


def plan_rebuild(
    params: ShardParams,
    index_path: Path,
    shards_dir: Path,
    header: dict[str, Any],
    handoff: str | None,
) -> StagePlan:
    """Generation 0 from the whole index; the set it replaces is kept for the data diff."""
    previous, previous_records = _previous(shards_dir)
    scan = scan_index(params, index_path, sample=params.encoding != "raw")
    specs = cut_shards(params, index_path, header, scan, folder="", classes=None, handoff=handoff)
    classes = list(header["classes"])
    return StagePlan(params.mode, 0, specs, classes, index_path, None, previous, previous_records)


def plan_append(
    params: ShardParams,
    index_path: Path,
    shards_dir: Path,
    header: dict[str, Any],
    handoff: str | None,
) -> StagePlan:
    """A new generation of the index's records the base does not hold, once the check that
    nothing of the base was removed passed."""
    sample = params.encoding != "raw"
    base = load_base(shards_dir)
    check_compatible(base, params, shards_dir)
    try:  # the base's records as a table spilled to disk, its lists read a shard at a time
        before = base_table(shards_dir, base)
    except ValueError as error:
        raise RebuildNeeded(f"{error}; {REBUILD_HINT}") from error
    classes = base.classes + sorted(set(header["classes"]) - set(base.classes))
    current = data_diff.SpilledTable(shards_dir)  # every index record, in index order

    def note(r: dict[str, Any]) -> None:
        current.add(r["sha256"], r["path"], r["split"], r["label"], r["width"], r["height"])

    try:
        scan = scan_index(
            params,
            index_path,
            classes=classes,
            exclude=lambda: data_diff.found_mask(current, before),
            sample=sample,
            visit=note,
            spill_dir=shards_dir,
        )
        duplicates = check_nothing_removed(current, base, before, shards_dir, index_path)
    except BaseException:
        before.close()
        raise
    finally:
        current.close()  # the whole index's table is not needed past this point
    number = len(base.generations)
    specs = cut_shards(
        params,
        index_path,
        header,
        scan,
        folder=generation_folder(number),
        classes=classes,
        handoff=handoff,
    )
    return StagePlan(
        params.mode, number, specs, classes, index_path, base, base, before, duplicates
    )


def _previous(shards_dir: Path) -> tuple[ShardManifest | None, data_diff.SpilledTable | None]:
    """The manifest already in ``shards_dir`` and its records, where readable: read before
    a rebuild replaces them, streamed into a table spilled to disk."""
    try:
        previous = load_manifest(shards_dir)
    except (OSError, ValueError):
        return None, None
    try:
        records = data_diff.rows(previous, stream_records(shards_dir, previous))
        return previous, data_diff.SpilledTable.of(
            shards_dir, records, expected=previous.total_records
        )
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return previous, None


def finalize_manifest(
    params: ShardParams, plan: StagePlan, results: list[ShardFile], shards_dir: Path
) -> ShardManifest:
    """Write the generation's record list, then the manifest (last, atomically).

    The manifest lists the base's shards (unchanged) followed by the new generation's, per
    split; the fingerprint covers every generation. An append that adds nothing leaves the
    base manifest as it is. ``results`` are in plan order.
    """
    shards_dir = Path(shards_dir)
    base, specs = plan.base, plan.specs
    if base is not None and not specs:
        if not (shards_dir / MEMBERSHIP_NAME).exists():  # a set written before memberships
            write_membership(base, shards_dir)
        if not (shards_dir / BLOCKS_NAME).exists():  # a set written before block lists
            write_block_list(base, shards_dir)
        return base
    if [r.file for r in results] != specs.files or any(
        r.num_records != slot.num_records for r, slot in zip(results, specs.slots, strict=True)
    ):
        raise ValueError(f"{shards_dir}: the write results do not match the plan's shards")
    splits = {}
    counts_now = write_generation_records(plan, shards_dir)
    for split in SPLITS:
        shards = list(base.splits[split].shards) if base and split in base.splits else []
        counts = (
            Counter(base.splits[split].class_counts) if base and split in base.splits else Counter()
        )
        shards += [r for r, slot in zip(results, specs.slots, strict=True) if slot.split == split]
        counts.update({plan.classes[i]: n for i, n in counts_now[split].items()})
        splits[split] = SplitInfo(
            num_records=sum(s.num_records for s in shards),
            class_counts={name: counts.get(name, 0) for name in plan.classes},
            shards=shards,
        )
    generation = describe_generation(plan, shards_dir)
    manifest = build_manifest(
        schema_from_params(params),
        plan.classes,
        params.compression,
        splits,
        resize=params.resize,
        draft_decode=params.draft_decode,
        preprocessing_version=specs.common["preprocessing_version"]
        if specs
        else preprocessing_version(),
        generations=[*(base.generations if base else []), generation],
    )
    # offsets for readers without TensorFlow; an append reuses the base's (checked)
    write_record_index(manifest, Path(shards_dir), base)
    # each block's sha256, for reads from object storage; an append keeps the base's entries
    write_block_list(manifest, Path(shards_dir), base)
    write_tfds_metadata(manifest, Path(shards_dir))  # tfds.builder_from_directory(shards_dir)
    write_membership(manifest, shards_dir)  # where each image is, for `shardflow lineage`
    write_text(shards_dir / MANIFEST_NAME, manifest.to_json())
    return manifest


def write_generation_records(plan: StagePlan, shards_dir: Path) -> dict[str, Counter[int]]:
    """Write what this generation added (per shard, in file order); count labels per split.

    The record lists let an append see the base's records, validation check old shards
    by hash, and the data diff compare versions, all without re-reading a shard. Written
    shard by shard (the bytes :func:`tasks.runtime.atomic.write_json` would write for the whole
    document), so a million records never sit in memory at once.
    """
    counts: dict[str, Counter[int]] = {split: Counter() for split in SPLITS}
    path = shards_dir / records_file_name(plan.number)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    order = sorted(range(len(plan.specs)), key=lambda i: plan.specs.slots[i].file)
    try:
        with open(tmp, "w") as handle:
            handle.write(f'{{\n  "generation": {plan.number},\n  "shards": {{')
            for n, i in enumerate(order):
                slot = plan.specs.slots[i]
                entries = []
                for rec in plan.specs.index_records(slot):
                    label = shard_record(rec, plan.specs.classes).label_index
                    counts[slot.split][label] += 1
                    entries.append(
                        {
                            "sha256": rec["sha256"],
                            "path": rec["path"],
                            "label_index": label,
                            "width": int(rec["width"]),
                            "height": int(rec["height"]),
                        }
                    )
                body = json.dumps(entries, indent=2, sort_keys=True).replace("\n", "\n    ")
                handle.write(f"{',' if n else ''}\n    {json.dumps(slot.file)}: {body}")
            handle.write("\n  }\n}\n" if order else "}\n}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return counts


def describe_generation(plan: StagePlan, shards_dir: Path) -> Generation:
    """The manifest entry of the generation whose record list was just written."""
    name = records_file_name(plan.number)
    old = set(plan.base.classes) if plan.base else set()
    slots = plan.specs.slots
    return Generation(
        number=plan.number,
        base_fingerprint=plan.base.fingerprint if plan.base else None,
        records_file=name,
        records_sha256=file_sha256(shards_dir / name),
        new_classes=[c for c in plan.classes if c not in old],
        num_records={
            split: sum(s.num_records for s in slots if s.split == split) for split in SPLITS
        },
        shards=plan.specs.files,
    )


def write_stage_diff(
    plan: StagePlan, manifest: ShardManifest, shards_dir: Path, diff_path: Path
) -> dict[str, Any]:
    """The data diff of this run (previous manifest -> this one), written as JSON + Markdown.

    The "after" side streams the record lists (each checked by sha256) from ``shards_dir``,
    where this run wrote them (a rebuild's own folder), into a table spilled beside them:
    every generation's after a rebuild; after an append, the base's table (read while
    planning) plus the new generation's list only."""
    base = plan.previous_records if plan.base is not None else None
    if base is not None and manifest.generations[-1].number == plan.number:
        new = stream_records(shards_dir, manifest, manifest.generations[-1:])
        after = base.copy(shards_dir)
        try:
            after.extend(data_diff.rows(manifest, new))
        except BaseException:
            after.close()
            raise
    elif base is not None:
        after = base.copy(shards_dir)  # nothing was appended: the set is the base
    else:
        records = data_diff.rows(manifest, stream_records(shards_dir, manifest))
        after = data_diff.SpilledTable.of(shards_dir, records)
    try:
        if len(after) != manifest.total_records:
            raise ValueError(
                f"{shards_dir}: record lists hold {len(after)} records, the manifest "
                f"{manifest.total_records}"
            )
        diff = data_diff.compute(
            plan.previous,
            plan.previous_records,
            manifest,
            after,
            mode=plan.mode,
            duplicates=plan.duplicates,
        )
    finally:
        after.close()
    data_diff.write(diff, Path(diff_path))
    return diff
