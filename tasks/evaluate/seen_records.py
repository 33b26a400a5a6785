"""The records a model learned from, and the test records neither of two models saw.

A registered version keeps the content hashes of its training and validation records as an
artifact of its training run (:data:`SEEN_ARTIFACT`, named by the version tag
:data:`SEEN_RUN_TAG`): a worker that starts from a fresh clone has no shard folder of the
champion's, only the registry. When the split moves (another ``ingest.seed`` or
``ingest.splits``, another near-duplicate rule, an append, a forget) the current test split
can hold records the champion trained or validated on; a comparison counts only the test
records whose hash neither model's set holds (:func:`unseen_test`, a pure function: hash
sets in, a mask out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from tasks.contracts.manifest import ShardManifest
    from tasks.contracts.shard_store import ShardStore

SEEN_ARTIFACT = "data/seen_records.json"  # on a version's training run
SEEN_RUN_TAG = "data.seen_records_run_id"  # on a version: the run that holds the artifact
LEARNED_SPLITS = ("train", "val")  # trained on, or chose the epoch / stopped on


@dataclass(frozen=True)
class SeenRecords:
    """The content hashes (sha256 hex) of a shard set's training and validation records:
    what a model trained on that set learned from or was tuned on."""

    fingerprint: str
    train: frozenset[str]
    val: frozenset[str]

    @property
    def hashes(self) -> frozenset[str]:
        return self.train | self.val

    def to_dict(self) -> dict[str, Any]:
        """As the artifact holds it (sorted: the same set, the same bytes)."""
        return {
            "fingerprint": self.fingerprint,
            "train": sorted(self.train),
            "val": sorted(self.val),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SeenRecords:
        return cls(str(data["fingerprint"]), frozenset(data["train"]), frozenset(data["val"]))


@dataclass(frozen=True)
class UnseenTest:
    """Which current test records neither model saw (``keep``, in test-record order) and
    why the others were left out: seen by the champion, by the candidate, or by both."""

    keep: np.ndarray
    champion_saw: int
    candidate_saw: int
    both_saw: int

    @property
    def total(self) -> int:
        return len(self.keep)

    @property
    def unseen(self) -> int:
        return int(self.keep.sum())

    @property
    def left_out(self) -> int:
        return self.total - self.unseen

    def in_words(self, champion: str) -> str:
        """How many test records were left out and why, as the record and the run say it."""
        if not self.left_out:
            return f"all {self.total} test records were seen by neither model"
        reasons = [
            f"{count} trained or validated on by {who}"
            for count, who in (
                (self.champion_saw, f"champion v{champion} only"),
                (self.candidate_saw, "the candidate only"),
                (self.both_saw, "both"),
            )
            if count
        ]
        return (
            f"{self.left_out} of {self.total} test records left out ({'; '.join(reasons)}): "
            f"compared on the {self.unseen} neither model saw"
        )

    def to_dict(self, champion: str) -> dict[str, Any]:
        return {
            "test_records": self.total,
            "unseen_records": self.unseen,
            "left_out_records": self.left_out,
            "left_out_champion_saw": self.champion_saw,
            "left_out_candidate_saw": self.candidate_saw,
            "left_out_both_saw": self.both_saw,
            "in_words": self.in_words(champion),
        }


def unseen_test(
    test_hashes: Sequence[str], champion: SeenRecords, candidate: SeenRecords
) -> UnseenTest:
    """The current test records (their hashes, in reading order) that neither the champion
    nor the candidate trained or validated on."""
    by_champion = np.array([h in champion.hashes for h in test_hashes], dtype=bool)
    by_candidate = np.array([h in candidate.hashes for h in test_hashes], dtype=bool)
    return UnseenTest(
        keep=~(by_champion | by_candidate),
        champion_saw=int(np.sum(by_champion & ~by_candidate)),
        candidate_saw=int(np.sum(by_candidate & ~by_champion)),
        both_saw=int(np.sum(by_champion & by_candidate)),
    )


def seen_records_of(
    shards_dir: Path, manifest: ShardManifest, store: ShardStore | None = None
) -> SeenRecords:
    """The training and validation records' hashes of the shard set: from its record lists
    (no image read), or, with a ``store`` and no local lists, from the records themselves."""
    from tasks.contracts.manifest import stream_records

    split_of = {s.file: split for split, info in manifest.splits.items() for s in info.shards}
    local = all((Path(shards_dir) / g.records_file).is_file() for g in manifest.generations)
    found: dict[str, set[str]] = {split: set() for split in LEARNED_SPLITS}
    if manifest.generations and local:
        for file, record in stream_records(shards_dir, manifest):
            if split_of[file] in found:
                found[split_of[file]].add(record["sha256"])
    else:
        for split in LEARNED_SPLITS:
            found[split] = set(split_hashes(shards_dir, split, store))
    return SeenRecords(manifest.fingerprint, frozenset(found["train"]), frozenset(found["val"]))


def split_hashes(shards_dir: Path, split: str, store: ShardStore | None) -> list[str]:
    """Every record's content hash of ``split``, read from the records (TensorFlow)."""
    from tasks.contracts.tf_reader import read_split
    from tasks.schema import HASH_KEY

    if split not in (store.manifest() if store else _manifest(shards_dir)).splits:
        return []
    dataset = read_split(
        shards_dir, split, batch_size=256, training=False, with_metadata=True, store=store
    )
    return [h.decode() for features in dataset for h in features[HASH_KEY].numpy()]


def _manifest(shards_dir: Path) -> ShardManifest:
    from tasks.contracts.manifest import load_manifest

    return load_manifest(shards_dir)


def log_seen_records(
    client: MlflowClient, run_id: str, model_name: str, version: str, seen: SeenRecords
) -> None:
    """Keep the version's seen records with it: an artifact of its training run, named by a
    version tag, so any clone on the same tracking server can compare against it."""
    client.log_dict(run_id, seen.to_dict(), SEEN_ARTIFACT)
    client.set_model_version_tag(model_name, version, SEEN_RUN_TAG, run_id)


def recorded_seen_records(
    client: MlflowClient, model_name: str, version: str
) -> SeenRecords | None:
    """The seen records a version logged (:func:`log_seen_records`); None when it logged
    none (registered before they were kept) or they cannot be read."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from tasks.runtime.tracking import using_store

    run_id = client.get_model_version(model_name, version).tags.get(SEEN_RUN_TAG)
    if not run_id:
        return None
    try:
        with using_store(client.tracking_uri):
            data = mlflow.artifacts.load_dict(f"runs:/{run_id}/{SEEN_ARTIFACT}")
        return SeenRecords.from_dict(data)
    except (MlflowException, OSError, ValueError, KeyError, TypeError):
        return None
