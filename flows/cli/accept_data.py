"""``shardflow accept-data`` (``python -m flows.cli.accept_data``): accept the shard set in
``data/shards`` as the data gate's baseline of the dataset ``params.yaml`` names, the one step
for a deliberate change the limits refuse (a dataset seen for the first time needs none: its
first validated shard set becomes its baseline).

    shardflow accept-data --fingerprint 3f2a9c1b7d4e --reason "new class blob, labelled by Ana"

The fingerprint is the one the validation error names; who (``--by``, default the git user,
else the login name), when and why are recorded in ``data/accepted.json``
(:func:`tasks.validate.data_gate.accept`). The limits in ``params.yaml`` stay as they are. Commit
``data/accepted.json`` with ``dvc.lock`` after the run that follows.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flows.support.authorship import git_user
from flows.support.dvc_steps import hold_workspace
from tasks.runtime.dataset_identity import dataset_identity
from tasks.runtime.layout import Layout
from tasks.runtime.params import load_params
from tasks.runtime.refusals import Refused, refusal_block
from tasks.validate import data_gate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shardflow accept-data", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--fingerprint", required=True, help="the shard set's fingerprint (8+ characters)"
    )
    parser.add_argument("--reason", required=True, help="why the change is accepted")
    parser.add_argument("--by", help="who accepts it (default: git user.name, else login)")
    parser.add_argument("--root", default=".", help="the project root (default: .)")
    args = parser.parse_args(argv)
    layout = Layout(args.root)
    try:
        ingest = load_params(layout.root / "params.yaml").ingest
        dataset = dataset_identity(ingest.source_dir, ingest.labels_csv, layout.root)
        with hold_workspace(layout.root):  # no stage rewrites the shards meanwhile
            accepted = data_gate.accept(
                layout.shards_dir,
                layout.accepted_data,
                dataset=dataset,
                fingerprint=args.fingerprint,
                reason=args.reason,
                by=args.by or git_user(layout.root),
            )
    except Refused as exc:
        print(refusal_block("accept-data", exc), file=sys.stderr)
        return 2
    was = accepted.acceptance.previous_fingerprint
    print(
        f"accepted shards {accepted.fingerprint[:12]} as the data baseline "
        f"of dataset {dataset!r} (was {was[:12] if was else 'none'}) in {layout.accepted_data}, by "
        f"{accepted.acceptance.by}: {accepted.acceptance.reason}\n"
        "Run the pipeline again (`shardflow run`) to validate and train on it, then commit "
        f"{layout.accepted_data} with dvc.lock."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())  # its refusals are printed as a block by main itself
