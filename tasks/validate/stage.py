"""Validate stage: re-read every shard and check it against the manifest and the ingest index.

Bad data never raises here: each problem becomes a failed, named check in
``reports/validation.json`` (plus a Markdown summary). The flow calls :func:`raise_if_failed`
after the report is written, so the stage exits non-zero with the evidence on disk.

Checks: ``manifest``, ``files``, ``records``, ``tensorflow_parser``, ``coverage`` (two
classes or more, no split empty, every class in train), ``labels``, ``class_counts``,
``leakage`` and, with an index, ``index`` and ``near_duplicates`` (those of the records'
content: :mod:`tasks.validate.checks`), then ``data_diff``. Records are read without
TensorFlow; TensorFlow's parser, the one training reads with, re-reads a sample of them in a
spawned process at the same time and must agree. A shard folder that a kill left between a
rebuild's two renames is put right first (:func:`tasks.contracts.shard_swap.finish_swap`), as the
shard stage would.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from tasks.contracts.manifest import MANIFEST_NAME, SPLITS, ShardManifest, file_sha256, own_files
from tasks.contracts.numpy_reader import (
    OFFSETS_NAME,
    dali_index_file,
    dali_index_files,
    dali_index_problem,
)
from tasks.contracts.shard_blocks import BLOCKS_NAME
from tasks.contracts.shard_swap import finish_swap
from tasks.contracts.tfds_metadata import tfds_files
from tasks.runtime.atomic import write_json, write_text
from tasks.runtime.layout import Layout
from tasks.runtime.params import ValidateParams
from tasks.runtime.processes import ChildResult, run_in_child
from tasks.runtime.refusals import Refused
from tasks.schema import HASH_KEY, IMAGE_KEY, LABEL_KEY, RecordSchema, SchemaError
from tasks.validate import data_gate, tf_cross_check
from tasks.validate.checks import (
    ShardContents,
    check,
    check_class_counts,
    check_coverage,
    check_index,
    check_labels,
    check_leakage,
    check_near_duplicates,
)
from tasks.validate.tf_cross_check import fingerprint, tensorflow_sample

CROSS_CHECK_PER_SHARD = 4  # records per shard that TensorFlow's parser reads too
CROSS_CHECK_TIMEOUT_S = 600


class ValidationFailed(Refused, RuntimeError):
    """The shard set failed validation; the message names the failed checks."""

    fix = "fix the data its checks name (reports/validation.md), then `shardflow run`"


# -- manifest and files ----------------------------------------------------------------------


def load_manifest_lenient(shards_dir: Path) -> tuple[ShardManifest | None, dict[str, Any]]:
    """Parse the manifest even when its fingerprint is off, so the other checks still run."""
    path = shards_dir / MANIFEST_NAME
    if not path.exists():
        return None, check(
            "manifest", [f"{path}: missing"], "", f"{path}: no manifest; run the shard stage"
        )
    try:
        manifest = ShardManifest.model_validate_json(path.read_text())
        manifest.record_schema  # noqa: B018 - raises SchemaError on an unsupported version
    except Exception as exc:  # any parse or schema error is a failed check
        return None, check("manifest", [str(exc)], "", f"{path}: unreadable: {exc}")
    problems: list[str] = []
    if manifest.fingerprint != manifest.compute_fingerprint():
        problems.append(f"{path}: fingerprint does not match its contents (edited by hand?)")
    for name, info in manifest.splits.items():
        total = sum(s.num_records for s in info.shards)
        if not info.num_records == total == sum(info.class_counts.values()):
            problems.append(
                f"{path}: split {name!r} num_records {info.num_records}, shards hold {total}, "
                f"class_counts sum to {sum(info.class_counts.values())}"
            )
    details = {"fingerprint": manifest.fingerprint, "schema": manifest.schema_}
    return manifest, check(
        "manifest", problems, "manifest loads and is consistent", "; ".join(problems), **details
    )


def check_files(manifest: ShardManifest, shards_dir: Path) -> dict[str, Any]:
    """Every shard exists with the manifest's size and sha256; an uncompressed one with the
    DALI index of its framing beside it
    (:func:`tasks.contracts.numpy_reader.dali_index_problem`)."""
    problems: list[dict[str, Any]] = []
    total = 0
    for info in manifest.splits.values():
        for shard in info.shards:
            path = shards_dir / shard.file
            if not path.is_file():
                problems.append({"file": shard.file, "problem": "missing"})
                continue
            size = path.stat().st_size
            total += size
            if size != shard.bytes:
                problems.append(
                    {"file": shard.file, "problem": f"size {size} != manifest {shard.bytes}"}
                )
            elif file_sha256(path) != shard.sha256:
                problems.append({"file": shard.file, "problem": "sha256 differs from manifest"})
            elif manifest.compression == "none":
                index = shards_dir / dali_index_file(shard.file)
                if problem := dali_index_problem(path, index):
                    problems.append(
                        {"file": index.relative_to(shards_dir).as_posix(), "problem": problem}
                    )
    message = "; ".join(f"{p['file']}: {p['problem']}" for p in problems[:5])
    shards = sum(len(i.shards) for i in manifest.splits.values())
    return check(
        "files",
        problems,
        f"{shards} shards match sizes and sha256",
        message,
        shards=shards,
        bytes=total,
    )


def check_extra_files(manifest: ShardManifest, shards_dir: Path) -> dict[str, Any]:
    """Nothing in the shard folder but the set's own files: a shard the manifest does not
    list (left by hand, or copied from another set) is read by any reader that globs for
    shards, and is versioned with the set, while no record of the set accounts for it."""
    expected = own_files(manifest) | {OFFSETS_NAME, BLOCKS_NAME, *tfds_files(manifest)}
    expected |= dali_index_files(manifest)
    extra = sorted(set(folder_entries(shards_dir)) - expected)
    shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
    return check(
        "extra_files",
        extra,
        "no files besides the set's own",
        f"{shards_dir}: {len(extra)} file(s) the manifest does not account for: {shown} "
        "(remove them; the shard stage writes only what its manifest lists)",
    )


def folder_entries(root: Path) -> Iterator[str]:
    """Every file under ``root`` and every link to a folder (never followed), as POSIX paths
    relative to it."""
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        for name in [*names, *(d for d in dirs if (here / d).is_symlink())]:
            yield (here / name).relative_to(root).as_posix()


# -- reading records -------------------------------------------------------------------------


def read_shards(
    manifest: ShardManifest, shards_dir: Path, only: set[str] | None = None
) -> list[ShardContents]:
    """Labels and hashes of every record of every existing shard, in manifest order.

    Read without TensorFlow (``tasks.tfrecord`` checks every CRC, ``RecordSchema.parse``
    decodes every image to its declared shape, raw lengths exact), so the stage starts in a
    second instead of paying a TensorFlow import; :func:`cross_check_with_tensorflow` makes
    sure TensorFlow's own parser reads a sample of the same records identically. A bad record
    stops its file and is reported with its index. ``only`` limits the reading to those files.
    """
    schema = manifest.record_schema
    gzipped = manifest.compression == "gzip"
    targets = [
        ShardContents(split, shard.file)
        for split, info in manifest.splits.items()
        for shard in info.shards
        if (shards_dir / shard.file).is_file() and (only is None or shard.file in only)
    ]
    for target in targets:
        _scan_records(schema, shards_dir / target.file, target, gzipped=gzipped)
    return targets


def _scan_records(
    schema: RecordSchema, path: Path, target: ShardContents, *, gzipped: bool
) -> None:
    """Read one file a record at a time; stop at the first bad record and note its index."""
    from tasks.tfrecord import (
        CorruptRecord,
        decode_example,
        is_canonical,
        open_records,
        read_framed,
    )

    position = 0
    try:
        with open_records(path, gzip_compressed=gzipped) as handle:
            while (serialized := read_framed(handle)) is not None:
                features = schema.parse(serialized)  # decodes the image: shape, length
                if not is_canonical(serialized, decode_example(serialized)):
                    raise SchemaError(
                        "the record is not laid out as the shard writer lays it out (a "
                        "feature repeated, an entry after the last or out of order): "
                        "TensorFlow's parser and the fast raw reader could read it "
                        "differently; rebuild the shard set (`shardflow run`)"
                    )
                target.labels.append(int(features[LABEL_KEY]))
                target.hashes.append(str(features[HASH_KEY]))
                if position < CROSS_CHECK_PER_SHARD:
                    image = decode_example(serialized)[IMAGE_KEY]
                    target.sample.append(fingerprint(bytes(image), features))  # type: ignore[arg-type]
                position += 1
    except (CorruptRecord, SchemaError, ValueError, OSError, EOFError) as exc:
        target.error = _record_error(target.file, position, exc)


# -- the TensorFlow cross-check --------------------------------------------------------------


def start_cross_check(
    manifest: ShardManifest, shards_dir: Path, files: list[str]
) -> ChildResult[dict[str, Any]]:
    """Start TensorFlow's parser over the first records of ``files`` in a spawned process.

    It runs beside the TensorFlow-free read (its import is most of its cost), so the check
    adds little wall time; :func:`cross_check_with_tensorflow` collects and compares. The
    child the stage's entry point prestarted (:func:`tasks.validate.tf_cross_check.prestart`) takes
    the job
    when there is one; otherwise a child starts now.
    """
    args = (
        dict(manifest.schema_),
        manifest.compression_type,
        str(shards_dir),
        files,
        CROSS_CHECK_PER_SHARD,
    )
    child = tf_cross_check.standby()
    if child is not None:
        try:
            return child.run(tensorflow_sample, *args)
        except OSError:  # the prestarted child is gone: start another
            child.close()
    return run_in_child(tensorflow_sample, *args)


def cross_check_with_tensorflow(
    future: ChildResult[dict[str, Any]] | None,
    contents: list[ShardContents],
    asked: Collection[str] | None = None,
) -> dict[str, Any]:
    """TensorFlow's parser (what training reads with) agrees with the TensorFlow-free one.

    ``asked``: the shards TensorFlow was given (default: every shard read in full). Older
    generations read in full only because their record list failed are not among them; the
    ``generations`` check names that failure, this one does not blame those shards."""
    if future is None:
        return check("tensorflow_parser", [], "no shard to cross-check", "")
    try:
        sampled = future.result(timeout=CROSS_CHECK_TIMEOUT_S)
    except Exception as exc:
        problem = {"problem": f"TensorFlow cross-check did not run: {type(exc).__name__}: {exc}"}
        return check("tensorflow_parser", [problem], "", problem["problem"])
    problems: list[dict[str, Any]] = []
    for target in contents:
        if target.error or not target.sample or (asked is not None and target.file not in asked):
            continue  # unreadable (its own check says why), trusted by hash, or not asked
        if target.file not in sampled:  # a sampled shard TensorFlow never reported on
            problems.append({"file": target.file, "problem": "TensorFlow did not read it"})
            continue
        theirs = sampled[target.file]
        if isinstance(theirs, dict):
            problems.append({"file": target.file, "problem": theirs["error"]})
            continue
        for position, (ours, tf_row) in enumerate(zip(target.sample, theirs, strict=False)):
            if ours != tf_row:
                problems.append(
                    {
                        "file": target.file,
                        "record_index": position,
                        "error": f"TensorFlow reads {tf_row[:2]}, the schema reader {ours[:2]}"
                        + (" (image bytes differ)" if ours[2] != tf_row[2] else ""),
                    }
                )
                break
        if len(theirs) != len(target.sample):
            problems.append(
                {"file": target.file, "problem": "TensorFlow read a different number of records"}
            )
    records = sum(len(t.sample) for t in contents if t.file in sampled)
    message = "; ".join(_describe(p) for p in problems[:5])
    ok = f"TensorFlow's parser agrees on {records} sampled records ({len(sampled)} shards)"
    return check("tensorflow_parser", problems, ok, message, records=records)


def _record_error(file: str, position: int, exc: Exception) -> dict[str, Any]:
    """Where a record failed (the shard as the manifest names it: an appended generation's
    ``gen-NNNNN/...`` file, not its bare name, which generation 0 may share) and why,
    without TensorFlow's op-name decorations."""
    message = getattr(exc, "message", None) or str(exc)
    message = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\].*$", "", message.strip())
    error = f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"
    return {"file": file, "record_index": position, "error": error}


def check_records(manifest: ShardManifest, contents: list[ShardContents]) -> dict[str, Any]:
    """Every record parses and decodes to the declared shape; counts match the manifest."""
    expected = {s.file: s.num_records for info in manifest.splits.values() for s in info.shards}
    read = {t.file for t in contents}
    problems: list[dict[str, Any]] = [
        {"file": name, "problem": "missing, no records read"}
        for name in expected
        if name not in read
    ]
    for target in contents:
        if target.error:
            problems.append(target.error)
        elif len(target.labels) != expected[target.file]:
            problems.append(
                {
                    "file": target.file,
                    "problem": f"{len(target.labels)} records, manifest: {expected[target.file]}",
                }
            )
    message = "; ".join(_describe(p) for p in problems[:5])
    records = sum(len(t.labels) for t in contents)
    shape = list(manifest.record_schema.image_shape)
    ok = f"{records} records parse and decode to {shape}"
    return check("records", problems, ok, message, records=records, image_shape=shape)


def _describe(problem: dict[str, Any]) -> str:
    if "record_index" in problem:
        return f"{problem['file']} record {problem['record_index']}: {problem['error']}"
    return f"{problem['file']}: {problem['problem']}"


# -- generations and the data diff ----------------------------------------------------------


def read_generations(
    manifest: ShardManifest, shards_dir: Path
) -> tuple[list[ShardContents], dict[str, Any] | None]:
    """The newest generation read in full; older ones from their record lists, by hash.

    An older generation's shards were read in full when they were new, and ``files``
    checks each against the manifest's sha256, which fixes its records; the record list
    (sha256 also in the manifest) says what they hold. The newest generation's records must
    equal its list. Returns the contents and a ``generations`` check (None for a one-
    generation set whose list matches: nothing to report beyond the other checks).
    """
    from tasks.contracts.manifest import load_records

    if not manifest.generations:
        return read_shards(manifest, shards_dir), None
    problems: list[str] = []
    try:
        per_file = load_records(shards_dir, manifest)
    except (OSError, ValueError, KeyError) as exc:
        problems.append(str(exc))
        contents = read_shards(manifest, shards_dir)
        return contents, check("generations", problems, "", "; ".join(problems))
    newest = set(manifest.generations[-1].shards)
    contents = read_shards(manifest, shards_dir, only=newest)
    for target in contents:
        listed = [(e["sha256"], int(e["label_index"])) for e in per_file.get(target.file, [])]
        if not target.error and listed != list(zip(target.hashes, target.labels, strict=True)):
            problems.append(f"{target.file}: records differ from its generation's record list")
    listed_files = {f for g in manifest.generations for f in g.shards}
    old = 0
    for split, info in manifest.splits.items():
        for shard in info.shards:
            if shard.file not in listed_files:
                problems.append(f"{shard.file}: in no generation")
            elif shard.file not in newest and (shards_dir / shard.file).is_file():
                entries = per_file.get(shard.file, [])
                labels = [int(e["label_index"]) for e in entries]
                contents.append(
                    ShardContents(split, shard.file, labels, [e["sha256"] for e in entries])
                )
                old += 1
    if len(manifest.generations) < 2 and not problems:
        return contents, None
    ok = (
        f"{len(manifest.generations)} generations: {len(newest)} new shards read in full, "
        f"{old} older shards checked by sha256 with their record lists"
    )
    return contents, check(
        "generations",
        problems,
        ok,
        "; ".join(problems[:5]),
        generations=len(manifest.generations),
        new_shards=len(newest),
        old_shards=old,
    )


# -- the stage -------------------------------------------------------------------------------


def validate_layout(layout: Layout, limits: ValidateParams, dataset: str) -> dict[str, Any]:
    """The validate stage's check (:func:`run_validate`) of its workspace's shards, with the
    data gate of ``dataset`` (:func:`tasks.runtime.dataset_identity.dataset_identity`): its reports,
    the ingest index, the accepted data version and the data diff where ``layout`` puts
    them."""
    return run_validate(
        layout.shards_dir,
        layout.validation_report,
        layout.validation_summary,
        index_path=layout.index,
        accepted_path=layout.accepted_data,
        diff_path=layout.data_diff,
        limits=limits,
        dataset=dataset,
    )


def run_validate(
    shards_dir: Path,
    report_path: Path,
    summary_path: Path,
    *,
    index_path: Path | None = None,
    accepted_path: Path | None = None,
    diff_path: Path | None = None,
    limits: ValidateParams | None = None,
    dataset: str = "",
) -> dict[str, Any]:
    """Check a shard set; write the JSON report and Markdown summary; return the report.

    With ``accepted_path``, ``diff_path``, ``limits`` and ``dataset`` (the data gate): the
    change from ``dataset``'s last accepted version, written to ``diff_path``, must stay
    within the ``validate`` limits (:func:`tasks.validate.data_gate.violations`); a set that passes
    every check becomes its accepted version (:func:`tasks.validate.data_gate.record_passed`), the
    first one of a dataset with none its baseline.
    """
    shards_dir = Path(shards_dir)
    finish_swap(shards_dir)  # a rebuild killed between its renames: its set, else the old one
    manifest, manifest_check = load_manifest_lenient(shards_dir)
    checks = [manifest_check]
    contents: list[ShardContents] = []
    gate = gated = None
    if manifest is not None:
        if accepted_path is not None and diff_path is not None and limits is not None:
            if not dataset:
                raise TypeError("the data gate needs the dataset's identity")
            gate = data_gate.GateSetup(Path(accepted_path), Path(diff_path), limits, dataset)
        found, contents, gated = check_shard_set(manifest, shards_dir, index_path, gate)
        checks += found
    report = {
        "passed": all(c["passed"] for c in checks),
        "fingerprint": manifest.fingerprint if manifest else None,
        "shards_dir": str(shards_dir),
        "num_records": {
            s: sum(len(t.labels) for t in contents if t.split == s) for s in _splits(manifest)
        },
        "checks": checks,
    }
    write_json(Path(report_path), report)
    write_text(Path(summary_path), summary_markdown(report))
    if report["passed"] and gate is not None and gated is not None:
        data_gate.record_passed(gate.accepted_path, gated, gate.dataset)
    return report


def framing_problem(path: Path, manifest: ShardManifest) -> str | None:
    """Why the record framing of ``path`` does not hold (a header's CRC, a declared length
    past the file's end, bytes after the last record), read without TensorFlow; None when it
    holds."""
    from tasks.tfrecord import CorruptRecord, record_offsets

    try:
        record_offsets(path, gzip_compressed=manifest.compression == "gzip")
    except (CorruptRecord, OSError, EOFError) as error:
        return str(error)
    return None


def check_shard_set(
    manifest: ShardManifest,
    shards_dir: Path,
    index_path: Path | None,
    gate: data_gate.GateSetup | None,
) -> tuple[list[dict[str, Any]], list[ShardContents], data_gate.Gated | None]:
    """Every check of a shard set whose manifest parsed, in report order; the records read,
    and what the data gate found (None without a gate or a readable baseline)."""
    full_read = [
        name
        for name in (
            manifest.generations[-1].shards
            if manifest.generations
            else [s.file for info in manifest.splits.values() for s in info.shards]
        )
        if (shards_dir / name).is_file()
    ]
    # TensorFlow reads only files whose framing checks out: a crafted length (2**40) would
    # crash its reader, so it is refused here first (the records check names it)
    full_read = [name for name in full_read if framing_problem(shards_dir / name, manifest) is None]
    sample = start_cross_check(manifest, shards_dir, full_read) if full_read else None
    contents, generations_check = read_generations(manifest, shards_dir)
    # Every TensorFlow-free check runs while the cross-check's child imports TensorFlow
    # (its critical path); the cross-check is collected last, reported in its place.
    tail = [
        check_coverage(manifest, contents),
        check_labels(manifest, contents),
        check_class_counts(manifest, contents),
        check_leakage(contents),
    ]
    if index_path is not None:
        tail.append(check_index(Path(index_path), manifest, contents))
        tail.append(check_near_duplicates(Path(index_path), contents))
    gated = None
    if gate is not None:
        gate_check, gated = data_gate.check_gate(manifest, gate)
        tail.append(gate_check)
    head = [
        check_files(manifest, shards_dir),
        check_extra_files(manifest, shards_dir),
        check_records(manifest, contents),
    ]
    cross_check = cross_check_with_tensorflow(sample, contents, set(full_read))
    return (
        [*([generations_check] if generations_check else []), *head, cross_check, *tail],
        contents,
        gated,
    )


def raise_if_failed(report: dict[str, Any]) -> None:
    """Raise :class:`ValidationFailed` naming each failed check and its message."""
    failed = [c for c in report["checks"] if not c["passed"]]
    if failed:
        reasons = "; ".join(f"{c['name']}: {c['message']}" for c in failed)
        # the data gate's own message says how to accept a deliberate change
        gate_only = [c["name"] for c in failed] == ["data_diff"]
        advice = "" if gate_only else "; then fix the data or rerun the shard stage"
        fix = (
            f"{data_gate.accept_command(str(report.get('fingerprint')))}   (if the change is "
            "deliberate; else restore the data)"
            if gate_only and report.get("fingerprint")
            else None
        )
        raise ValidationFailed(
            f"shard validation failed for {report.get('shards_dir')} ({reasons}); "
            f"see reports/validation.json{advice}",
            fix=fix,
        )


def summary_markdown(report: dict[str, Any]) -> str:
    """Human-readable summary: verdict, records per split, one table row per check."""
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [
        f"# Shard validation: {verdict}",
        "",
        f"- shards: `{report['shards_dir']}`",
        f"- fingerprint: `{report['fingerprint']}`",
        "- records: " + ", ".join(f"{s} {n}" for s, n in report["num_records"].items()),
        "",
        "| check | result | message | figures |",
        "|---|---|---|---|",
    ]
    for c in report["checks"]:
        figures = ", ".join(
            f"{k}={v}"
            for k, v in c["details"].items()
            if isinstance(v, int | float | str) and k != "fingerprint"
        )
        message = str(c["message"]).replace("|", "\\|")
        lines.append(
            f"| {c['name']} | {'pass' if c['passed'] else '**FAIL**'} | {message} | {figures} |"
        )
    return "\n".join(lines) + "\n"


def _splits(manifest: ShardManifest | None) -> list[str]:
    if manifest is None:
        return []
    return [s for s in SPLITS if s in manifest.splits] + [
        s for s in manifest.splits if s not in SPLITS
    ]
