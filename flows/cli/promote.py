"""``shardflow promote`` (``python -m flows.cli.promote``): move the champion alias by hand.

    shardflow promote --version 7 --reason "v7 holds up on the new photos; agreed by Ana"

The one recorded manual step: who (``--by``, default the git user, else the login name),
when and why go onto the version's tags (:func:`tasks.evaluate.manual_promotion.promote_by_hand`).
The
registered model is the current dataset's (``evaluate.model_name``, else named after
``ingest.source_dir``); a version of another task than the current shards' (classes, image
size, preprocessing) is refused, champion or not, and so is a retracted version.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.support.authorship import author, print_refused, version_decision_parser
from tasks.contracts.manifest import load_manifest
from tasks.evaluate.manual_promotion import Task, promote_by_hand
from tasks.evaluate.registry import registered_spec
from tasks.runtime import tracking
from tasks.runtime.dataset_identity import model_name_for
from tasks.runtime.layout import Layout
from tasks.runtime.params import load_params
from tasks.runtime.refusals import Refused

if TYPE_CHECKING:
    from mlflow import MlflowClient


def parser() -> argparse.ArgumentParser:
    return version_decision_parser("promote", "promotes", __doc__.split("\n\n")[0])


def current_task(root: Path) -> Task | None:
    """The current shards' task (their manifest's classes and serving spec); None when no
    shards are built."""
    try:
        manifest = load_manifest(Layout(root).shards_dir)
    except FileNotFoundError:
        return None
    spec = {
        "record_schema": manifest.record_schema.to_dict(),
        "resize": manifest.resize,
        "draft_decode": manifest.draft_decode,
        "preprocessing_version": manifest.preprocessing_version,
    }
    return Task(tuple(manifest.classes), spec, f"the current shards ({manifest.fingerprint[:12]})")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = Path(args.root)
    try:
        params = load_params(root / args.params)
        model_name = model_name_for(params, root)
        client = tracking.client(root)
        done = promote_by_hand(
            client,
            model_name,
            args.version,
            reason=args.reason,
            by=author(args.by, root),
            min_shared_class_share=params.evaluate.min_shared_class_share,
            task=current_task(root),
            version_spec=version_spec(client, model_name, args.version),
        )
    except Refused as refused:
        return print_refused("promote", refused)
    print(
        f"{done.model_name}@champion is v{done.version} (was "
        f"{'v' + done.previous if done.previous else 'none'}), by {done.by} at {done.at}: "
        f"{done.reason}"
    )
    return 0


def version_spec(client: MlflowClient, model_name: str, version: str) -> dict[str, Any] | None:
    """The version's serving spec, or None (no such version: refused by name later)."""
    from mlflow.exceptions import MlflowException

    try:
        return registered_spec(client, model_name, version)
    except MlflowException:
        return None


if __name__ == "__main__":
    sys.exit(main())
