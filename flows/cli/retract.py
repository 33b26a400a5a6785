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
import getpass
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from flows.support.authorship import git_user
from tasks.erasure.retraction import retract_by_hand
from tasks.runtime import tracking
from tasks.runtime.dataset_identity import model_name_for
from tasks.runtime.params import load_params
from tasks.runtime.refusals import Refused


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(prog="shardflow retract", description=__doc__.split("\n\n")[0])
    made.add_argument("--version", required=True, help="the registered version to retract")
    made.add_argument("--reason", required=True, help="why, recorded on the version")
    made.add_argument("--by", help="who retracts it (default: git user.name, else login)")
    made.add_argument("--root", default=".", help="the project root (default: .)")
    made.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return made


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
            by=args.by or git_user(root) or getpass.getuser(),
            at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
    except Refused as refused:
        print(f"retract: {refused}", file=sys.stderr)
        if refused.fix:
            print(f"  fix: {refused.fix}", file=sys.stderr)
        return 2
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
