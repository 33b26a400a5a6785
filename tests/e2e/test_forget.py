"""`shardflow forget` on a real project: after it, no file of the clone, its DVC cache and
remote or its tracking store holds the image's bytes, its record's pixels or its name; the
other records are unchanged; the champion never saw it; `lineage` says only when it went."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tasks.manifest import load_manifest
from tasks.schema import HASH_KEY, IMAGE_KEY
from tasks.tfrecord import open_records, read_framed
from tests.e2e.conftest import Project


def records(shards: Path) -> dict[str, tuple[bytes, bytes]]:
    """content hash -> (the record's bytes, its pixels), over every shard of the set."""
    manifest = load_manifest(shards)
    schema, found = manifest.record_schema, {}
    for info in manifest.splits.values():
        for shard in info.shards:
            with open_records(shards / shard.file) as handle:
                while (data := read_framed(handle)) is not None:
                    features = schema.parse(data)
                    found[features[HASH_KEY]] = (data, features[IMAGE_KEY].tobytes())
    return found


def files_holding(roots: list[Path], marks: list[bytes]) -> list[str]:
    return sorted(
        str(path)
        for root in roots
        for path in root.rglob("*")
        if path.is_file() and not path.is_symlink() and any(m in path.read_bytes() for m in marks)
    )


def shardflow(project: Project, *args: str, check: bool = True) -> str:
    return project.run(sys.executable, "-m", "flows.cli", *args, check=check).stdout


def test_forget_leaves_no_copy_and_a_champion_that_never_saw_it(
    project: Project, tmp_path: Path
) -> None:
    project.dvc("repro")
    project.dvc("push")
    root, shards = project.root, project.root / "data" / "shards"
    index = [json.loads(line) for line in (root / "data/ingest/index.json").open()][1:]
    record = next(r for r in index if isinstance(r, dict) and r.get("split") == "train")
    path, sha = record["path"], record["sha256"]
    source = root / "data" / "demo" / path
    before, source_bytes = records(shards), source.read_bytes()
    seen = json.loads(shardflow(project, "lineage", f"data/demo/{path}", "--json"))[0]
    assert seen["sha256"] == sha and seen["champion_saw_it"] and seen["runs"]

    out = shardflow(project, "forget", f"data/demo/{path}", "--reason", "erasure request")
    erasure = json.loads(out[out.index("{") :])
    assert erasure["state"] == "done" and sha in erasure["sha256"]
    assert erasure["versions"]["retracted"] == ["1"]
    gone = set(erasure["sha256"])
    after = records(shards)
    assert set(after) == set(before) - gone  # the other records, byte for byte:
    assert all(after[h] == before[h] for h in after)
    pixels = [before[h][1] for h in gone]
    names = [path.encode(), Path(path).name.encode()]
    roots = [root, tmp_path / "dvc-remote"]
    assert files_holding(roots, [source_bytes, *pixels, *names]) == []

    forgotten = (root / "data/forgotten.json").read_text()
    assert sha in forgotten and Path(path).stem not in forgotten
    told = json.loads(shardflow(project, "lineage", sha, "--json"))
    assert told == [{"sha256": sha, "forgotten_at": erasure["at"]}]
    from mlflow import MlflowClient

    client = MlflowClient(project.env["MLFLOW_TRACKING_URI"], project.env["MLFLOW_TRACKING_URI"])
    champion = client.get_model_version_by_alias("shardflow", "champion")
    assert str(champion.version) == "2"
    assert (
        client.get_run(champion.run_id).data.tags["data.fingerprint"]
        == load_manifest(shards).fingerprint
    )
    assert "shardflow.retracted" in client.get_model_version("shardflow", "1").tags
