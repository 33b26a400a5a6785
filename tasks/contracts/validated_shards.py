"""The validation gate: only shards a passing validation report vouches for reach a model.

Training and evaluation both call :func:`check_validated`; evaluation also calls
:func:`check_model_matches` so a model is never scored on shards it was not trained from.
The gate compares content (sha256), not sizes: a same-size edit after validation is caught.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.contracts.manifest import ShardManifest, file_sha256, load_manifest
from tasks.runtime.refusals import Refused

if TYPE_CHECKING:
    from tasks.contracts.shard_store import ShardStore

FIX = "run the validate stage (`dvc repro validate` or `python -m flows.data validate`)"


class ShardsNotValidated(Refused, RuntimeError):
    """Refused: the shards have no passing validation report that matches them."""

    fix = "shardflow run   (validates these shards before training on them)"


class ModelNotFromTheseShards(ShardsNotValidated):
    """Refused: the model was trained on another shard set than the current one."""

    fix = "dvc repro train   (trains on these shards)"


def check_validated(shards_dir: str | Path, validation_report: str | Path) -> ShardManifest:
    """Return the manifest if a passing validation report vouches for these exact shards.

    Refuses (``ShardsNotValidated``) when the report is missing or failed, when the manifest
    no longer matches its own fingerprint, when the report validated another fingerprint,
    or when a shard file is missing or its size or sha256 differs from the manifest's.
    """
    shards_dir, report_path = Path(shards_dir), Path(validation_report)
    report = passing_report(report_path)
    try:
        manifest = load_manifest(shards_dir)
    except (FileNotFoundError, ValueError) as error:
        raise ShardsNotValidated(f"{error}; {FIX}") from error
    same_fingerprint(
        report, manifest, report_path, f"shards in {shards_dir} changed since validation", FIX
    )
    for info in manifest.splits.values():
        for shard in info.shards:
            problem = shard_problem(shards_dir / shard.file, shard.bytes, shard.sha256)
            if problem:
                raise ShardsNotValidated(
                    f"shards in {shards_dir} changed since validation: {shards_dir / shard.file} "
                    f"{problem}; rerun the shard and validate stages"
                )
    return manifest


def check_validated_store(store: ShardStore, validation_report: str | Path) -> ShardManifest:
    """The gate for shards read from object storage (tasks.contracts.shard_store).

    The report and the store's manifest are checked here as :func:`check_validated` checks
    them; each shard's size and sha256 are checked by the store as it arrives, before any
    of its records are read, instead of the whole set up front.
    """
    from tasks.contracts.shard_store import ShardStoreError

    report_path = Path(validation_report)
    report = passing_report(report_path)
    try:
        manifest = store.manifest()
    except (ShardStoreError, ValueError) as error:
        raise ShardsNotValidated(f"{error}; {FIX}") from error
    same_fingerprint(
        report,
        manifest,
        report_path,
        f"shards at {store.url} are not the validated ones",
        "publish the validated shard set there",
    )
    return manifest


def same_fingerprint(
    report: dict[str, Any], manifest: ShardManifest, report_path: Path, what: str, fix: str
) -> None:
    """Refuse (``ShardsNotValidated``: ``what``, both fingerprints, ``fix``) unless the
    report validated this manifest's fingerprint."""
    if report.get("fingerprint") != manifest.fingerprint:
        raise ShardsNotValidated(
            f"{what}: manifest fingerprint {manifest.fingerprint[:12]} but {report_path} "
            f"validated {str(report.get('fingerprint'))[:12]}; {fix}"
        )


def passing_report(report_path: Path) -> dict[str, Any]:
    """The validation report at ``report_path`` if it exists, parses and passed."""
    if not report_path.exists():
        raise ShardsNotValidated(f"{report_path}: no validation report; {FIX} first")
    try:
        report = json.loads(report_path.read_text())
        report.get("passed")
    except (ValueError, AttributeError) as error:  # torn, emptied or edited by hand
        raise ShardsNotValidated(
            f"{report_path}: not a validation report ({error}); {FIX} first"
        ) from error
    if report.get("passed") is not True:
        failed = [c for c in report.get("checks", []) if not c.get("passed", False)]
        listing = "; ".join(f"{c.get('name')}: {c.get('message', '')}" for c in failed)
        raise ShardsNotValidated(
            f"{report_path}: validation failed ({listing or 'no check details'}); fix the "
            f"data and rerun the data flow first"
        )
    return dict(report)


def shard_problem(path: Path, size: int, sha256: str) -> str | None:
    """How a shard file differs from its manifest entry, or None when it matches.

    The size is checked first only because it is free; the sha256 is what proves the
    bytes are the ones validation read.
    """
    if not path.exists():
        return f"is missing, manifest says {size} bytes"
    actual = path.stat().st_size
    if actual != size:
        return f"has {actual} bytes, manifest says {size} bytes"
    digest = file_sha256(path)
    if digest != sha256:
        return f"has sha256 {digest[:12]}, manifest says {sha256[:12]} (same size)"
    return None


def check_model_matches(train_run: dict[str, Any], manifest: ShardManifest, source: Path) -> None:
    """Refuse a model whose training run recorded another manifest fingerprint."""
    trained_on = train_run.get("fingerprint")
    if trained_on != manifest.fingerprint:
        raise ModelNotFromTheseShards(
            f"{source}: the model was trained on shards {str(trained_on)[:12]}, the current "
            f"manifest is {manifest.fingerprint[:12]}; retrain (`dvc repro train`) before "
            f"evaluating"
        )
