"""``shardflow retract`` (``python -m flows.cli.retract``): retract a registered version by hand.

    shardflow retract --version 3 --reason "trained on mislabelled March photos"

Recorded like a manual promotion: who (``--by``, default the git user, else the login name),
when and why go onto the version's tags and at the head of its description
(:func:`tasks.erasure.retraction.retract_by_hand`). The version loses every alias
(``champion``, ``challenger``...); ``shardflow promote`` refuses it from then on, and
Shardflow's loaders (predict, serve-model) refuse it unless ``--allow-retracted``. The
registered model is the current dataset's (``evaluate.model_name``, else named after
``ingest.source_dir``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from flows.support.authorship import author, print_refused, version_decision_parser
from tasks.erasure.retraction import retract_by_hand
from tasks.runtime import tracking
from tasks.runtime.dataset_identity import model_name_for
from tasks.runtime.params import load_params
from tasks.runtime.refusals import Refused


def parser() -> argparse.ArgumentParser:
    return version_decision_parser("retract", "retracts", __doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = Path(args.root)
    try:
        model_name = model_name_for(load_params(root / args.params), root)
        removed = retract_by_hand(
            tracking.client(root),
            model_name,
            args.version,
            reason=args.reason,
            by=author(args.by, root),
            at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
    except Refused as refused:
        return print_refused("retract", refused)
    lost = ", ".join(removed) or "none"
    print(f"{model_name} v{args.version} is retracted (aliases removed: {lost}): {args.reason}")
    if "champion" in removed:
        print(
            f"{model_name} has no champion now: shardflow promote --version N --reason R names "
            "one (a running serve-model answers 503 until then)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
