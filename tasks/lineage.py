"""Reverse lineage: from an image to every shard set, training run and model version that
used it (``shardflow lineage``, :mod:`flows.lineage`).

The links are all recorded forwards: the ingest index names each accepted file's content
hash, perceptual hash and split; each shard set's membership (:mod:`tasks.membership`) where
a hash is; each training run its shard set's fingerprint (the ``data.fingerprint`` tag);
each registered version its training run; each evaluation run the training run it
evaluates. This module walks them backwards. An image forgotten (``data/forgotten.json``,
:mod:`tasks.forgotten`) is reported as forgotten, and nothing else of it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.content import file_sha256
from tasks.eval_tracking import EVALUATES_TAG
from tasks.forgotten import forgotten_at
from tasks.index import iter_records
from tasks.layout import Layout
from tasks.manifest import MEMBERSHIP_NAME
from tasks.membership import Member, find_in
from tasks.refusals import Refused
from tasks.tracking import CHAMPION

if TYPE_CHECKING:
    from mlflow import MlflowClient

SHA256 = re.compile(r"[0-9a-f]{64}")
FINGERPRINT_TAG = "data.fingerprint"
ROLES = {"train": "trained on it", "val": "validated on it", "test": "tested on it"}


class UnknownImage(Refused):
    """An image that is neither a content hash nor a file under ``source_dir`` or in the index."""


@dataclass(frozen=True)
class IndexView:
    """What lineage needs of the ingest index: each record's content hash, path, split and
    perceptual hash (as ``uint64``, for near-duplicate groups)."""

    sha256: list[str]
    paths: list[str]
    splits: list[str]
    phashes: np.ndarray

    @classmethod
    def read(cls, index_path: Path) -> IndexView:
        if not Path(index_path).exists():
            return cls([], [], [], np.zeros(0, dtype=np.uint64))
        sha, paths, splits, phashes = [], [], [], []
        for _, record in iter_records(index_path):
            sha.append(record["sha256"])
            paths.append(record["path"])
            splits.append(record["split"])
            phashes.append(int(record.get("phash") or "0", 16))
        return cls(sha, paths, splits, np.array(phashes, dtype=np.uint64))

    def position(self, sha256: str) -> int | None:
        try:
            return self.sha256.index(sha256)
        except ValueError:
            return None

    def group(self, position: int, distance: int) -> list[int]:
        """The positions of the near-duplicate group of ``position``: every image linked to
        it by hashes ``distance`` bits apart or closer (ingest's rule, one split a group)."""
        members, frontier = {position}, [position]
        while frontier:
            near = np.zeros(len(self.phashes), dtype=bool)
            for p in frontier:
                near |= np.bitwise_count(self.phashes ^ self.phashes[p]) <= distance
            frontier = [int(p) for p in np.flatnonzero(near) if int(p) not in members]
            members.update(frontier)
        return sorted(members)


@dataclass(frozen=True)
class RunUse:
    """A tracked run whose shard set held the image."""

    run_id: str
    run_name: str
    fingerprint: str
    role: str  # "trained on it", "validated on it", "tested on it"
    versions: list[str] = field(default_factory=list)  # versions registered from the run


@dataclass(frozen=True)
class ImageLineage:
    """Everything the project knows of one image (or, once forgotten, that and when)."""

    sha256: str
    forgotten_at: str | None = None
    path: str | None = None
    split: str | None = None
    near_duplicates: list[str] = field(default_factory=list)  # the group's other hashes
    members: list[Member] = field(default_factory=list)  # in the current shard set
    shard_sets: list[str] = field(default_factory=list)  # fingerprints that held it
    runs: list[RunUse] = field(default_factory=list)
    champion: str | None = None  # the champion version, when it saw the image
    champion_saw_it: bool = False

    def to_json(self) -> dict[str, Any]:
        if self.forgotten_at is not None:
            return {"sha256": self.sha256, "forgotten_at": self.forgotten_at}
        return asdict(self)


def resolve(image: str, layout: Layout, source_dir: Path, index: IndexView) -> str:
    """The content hash ``image`` names: a hash as given, else a file (under ``source_dir``,
    or from the repository root) hashed, else an index record's path."""
    if SHA256.fullmatch(image.lower()):
        return image.lower()
    for candidate in (Path(image), source_dir / image, layout.root / image):
        if candidate.is_file():
            return file_sha256(candidate)
    for relative in {image, Path(image).as_posix().removeprefix(f"{source_dir.as_posix()}/")}:
        if relative in index.paths:
            return index.sha256[index.paths.index(relative)]
    raise UnknownImage(
        f"{image}: neither a content hash (64 hex digits) nor a file under {source_dir} or a "
        f"path in {layout.index}",
        fix="name the image by its path under ingest.source_dir or by its sha256",
    )


def membership_files(layout: Layout) -> list[Path]:
    """The current set's membership and every kept one (one per fingerprint)."""
    current = layout.shards_dir / MEMBERSHIP_NAME
    kept = sorted(layout.membership_archive.glob("*.bin"))
    return ([current] if current.is_file() else []) + kept


def image_lineage(
    sha256: str,
    layout: Layout,
    index: IndexView,
    runs: TrackedRuns,
    *,
    distance: int,
) -> ImageLineage:
    """The lineage of one content hash."""
    when = forgotten_at(layout.forgotten, sha256)
    if when is not None:
        return ImageLineage(sha256, forgotten_at=when)
    held = find_in(membership_files(layout), sha256)
    current = held.get(_current_fingerprint(layout), [])
    position = index.position(sha256)
    group = [] if position is None else index.group(position, distance)
    split = index.splits[position] if position is not None else None
    uses = [use for fp, members in held.items() for use in runs.uses(fp, members[0].split)]
    saw = runs.champion is not None and any(runs.champion in u.versions for u in uses)
    return ImageLineage(
        sha256,
        path=None if position is None else index.paths[position],
        split=current[0].split if current else split,
        near_duplicates=[index.sha256[p] for p in group if p != position],
        members=current,
        shard_sets=sorted(held),
        runs=uses,
        champion=runs.champion if saw else None,
        champion_saw_it=saw,
    )


def _current_fingerprint(layout: Layout) -> str:
    from tasks.membership import Membership

    path = layout.shards_dir / MEMBERSHIP_NAME
    if not path.is_file():
        return ""
    with Membership(path) as membership:
        return membership.fingerprint


@dataclass
class TrackedRuns:
    """Training runs by shard-set fingerprint, their evaluation runs, the versions registered
    from them and the champion: read from MLflow once, by a few searches."""

    training: dict[str, list[tuple[str, str]]]  # fingerprint -> [(run id, run name)]
    evaluations: dict[str, list[tuple[str, str]]]  # training run id -> its evaluation runs
    versions: dict[str, list[str]]  # training run id -> versions registered from it
    champion: str | None

    def uses(self, fingerprint: str, split: str) -> list[RunUse]:
        found = []
        for run_id, name in self.training.get(fingerprint, []):
            versions = self.versions.get(run_id, [])
            if split == "test":  # training never reads test: its evaluations do
                found += [
                    RunUse(e_id, e_name, fingerprint, ROLES["test"], versions)
                    for e_id, e_name in self.evaluations.get(run_id, [])
                ]
            else:
                found.append(RunUse(run_id, name, fingerprint, ROLES[split], versions))
        return found

    @classmethod
    def read(cls, client: MlflowClient, model_name: str) -> TrackedRuns:
        from mlflow.exceptions import MlflowException

        training: dict[str, list[tuple[str, str]]] = {}
        evaluations: dict[str, list[tuple[str, str]]] = {}
        experiments = [e.experiment_id for e in client.search_experiments()]
        for run in _all_runs(client, experiments):
            tags = run.data.tags
            if EVALUATES_TAG in tags:
                evaluations.setdefault(tags[EVALUATES_TAG], []).append(
                    (run.info.run_id, run.info.run_name)
                )
            elif FINGERPRINT_TAG in tags:
                training.setdefault(tags[FINGERPRINT_TAG], []).append(
                    (run.info.run_id, run.info.run_name)
                )
        versions: dict[str, list[str]] = {}
        champion = None
        try:
            for version in client.search_model_versions(f"name = '{model_name}'"):
                versions.setdefault(str(version.run_id), []).append(str(version.version))
            champion = str(client.get_model_version_by_alias(model_name, CHAMPION).version)
        except MlflowException:  # no registered model, or no champion yet
            pass
        return cls(training, evaluations, versions, champion)


def _all_runs(client: MlflowClient, experiments: list[str]) -> list[Any]:
    """Every run of the experiments, page by page."""
    runs: list[Any] = []
    token = None
    while experiments:
        page = client.search_runs(experiments, max_results=5000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            break
    return runs
