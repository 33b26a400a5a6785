"""``shardflow lineage IMAGE... [--json]`` (``python -m flows.cli.lineage``): which shard sets,
training runs and model versions used an image, and whether the champion saw it.

    shardflow lineage data/demo/circle/circle_0007.png
    shardflow lineage 3f2a...e1 --json

IMAGE is a path under ``ingest.source_dir`` (or from the repository root) or a content hash
(sha256). It reads, and never writes: the ingest index, the shard sets' memberships, the
tracking store (``MLFLOW_TRACKING_URI``, else ``mlflow.db``) and ``data/forgotten.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tasks.runtime.layout import Layout

if TYPE_CHECKING:
    from tasks.erasure.lineage import ImageLineage


def parser() -> argparse.ArgumentParser:
    """The command's options (``shardflow lineage --help`` shows them too: it imports only
    this module's light top)."""
    parser = argparse.ArgumentParser(
        prog="shardflow lineage",
        description="Which shard sets, training runs and model versions used each image, "
        "and whether the champion saw it.",
    )
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="a path or a sha256")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--root", default=".", help="the project root (default: .)")
    return parser


def lineages(images: Sequence[str], layout: Layout) -> list[ImageLineage]:
    """The lineage of each image named, in the order named."""
    from tasks.erasure import lineage
    from tasks.runtime import tracking
    from tasks.runtime.dataset_identity import model_name_for
    from tasks.runtime.params import load_params

    params = load_params(layout.params)
    return lineage.lineages(
        images,
        layout,
        tracking.client(layout.root),
        source_dir=layout.root / params.ingest.source_dir,
        model_name=model_name_for(params, layout.root),
        distance=params.ingest.near_duplicate_distance,
    )


def describe(lineage: ImageLineage) -> list[str]:
    """A lineage as lines for a person."""
    if lineage.forgotten_at is not None:
        return [f"{lineage.sha256}: forgotten at {lineage.forgotten_at}"]
    lines = [f"{lineage.sha256}: {lineage.path or '(no longer in the ingest index)'}"]
    lines.append(f"  split: {lineage.split or '-'}")
    for member in lineage.members:
        lines.append(
            f"  current shards: generation {member.generation}, {member.shard_file}, "
            f"record {member.record_index}"
        )
    near = [
        f"{lineage.near_duplicate_paths.get(sha) or '(no longer in the ingest index)'} ({sha})"
        for sha in lineage.near_duplicates
    ]
    lines.append(f"  near-duplicates: {', '.join(near) or 'none'}")
    lines.append(f"  shard sets that held it: {', '.join(lineage.shard_sets) or 'none known'}")
    for use in lineage.runs:
        versions = f", versions {', '.join(use.versions)}" if use.versions else ""
        deleted = " (a deleted run: MLflow's deleted lifecycle, still counted)" * use.deleted
        lines.append(f"  run {use.run_name} ({use.run_id}): {use.role}{versions}{deleted}")
    seen = f"yes (version {lineage.champion})" if lineage.champion_saw_it else "no"
    lines.append(f"  the champion saw it: {seen}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from flows.support.authorship import print_refused
    from flows.support.environment import configure_environment
    from tasks.runtime.refusals import Refused

    args = parser().parse_args(argv)
    configure_environment()
    layout = Layout(args.root)
    try:
        found = lineages(args.images, layout)
    except Refused as refusal:
        return print_refused("lineage", refusal)
    if args.json:
        print(json.dumps([lineage.to_json() for lineage in found], indent=2, sort_keys=True))
    else:
        print("\n".join(line for lineage in found for line in describe(lineage)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
