"""Reverse lineage: from an image to every shard set, training run and model version that
used it (``shardflow lineage``, :mod:`flows.cli.lineage`).

The links are all recorded forwards: the ingest index names each accepted file's content
hash, perceptual hash and split; each shard set's membership (:mod:`tasks.contracts.membership`)
where
a hash is; each training run its shard set's fingerprint (the ``data.fingerprint`` tag);
each registered version its training run; each evaluation run the training run it
evaluates. This module walks them backwards. An image forgotten (``data/forgotten.json``,
:mod:`tasks.contracts.forgotten`) is reported as forgotten, and nothing else of it.
"""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.contracts.content import file_sha256
from tasks.contracts.forgotten import forgotten_at
from tasks.contracts.manifest import MEMBERSHIP_NAME
from tasks.contracts.membership import Member, find_in
from tasks.evaluate.tracking import EVALUATES_TAG
from tasks.runtime.layout import Layout
from tasks.runtime.refusals import Refused
from tasks.runtime.tracking import CHAMPION

if TYPE_CHECKING:
    from mlflow import MlflowClient

SHA256 = re.compile(r"[0-9a-f]{64}")
FINGERPRINT_TAG = "data.fingerprint"
ROLES = {"train": "trained on it", "val": "validated on it", "test": "tested on it"}


class UnknownImage(Refused):
    """An image that is neither a content hash nor a file under ``source_dir`` or in the index."""


# An index record line holds its keys sorted, "phash" right before "sha256"
# (tasks.contracts.index.write_index): one scan of the file's bytes finds every pair, each a row of
# _ROW bytes, the perceptual hash first and the content hash at _SHA.
_PAIR = re.compile(rb'"phash":"([0-9a-f]{16}","sha256":"[0-9a-f]{64})"')
_SHA = len('0123456789abcdef","sha256":"')
_ROW = _SHA + 64


class IndexView:
    """What lineage needs of the ingest index: each record's content and perceptual hashes
    (``uint64``, for near-duplicate groups), and any one record's line.

    A regular-expression scan of the memory-mapped file into one table of fixed-size rows,
    not a parse of every record: at a million images a JSON parse of each line takes most
    of the time lineage may take. A record without a perceptual hash (an index from before
    near-duplicate placement) is in no group. A context manager: the map is closed on exit.
    """

    def __init__(self, index_path: Path) -> None:
        self.path = Path(index_path)
        self.map: mmap.mmap | None = None
        self.rows = b""
        self.phashes = np.zeros(0, dtype=np.uint64)
        if not self.path.is_file() or not self.path.stat().st_size:
            return
        with open(self.path, "rb") as handle:
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.rows = b"".join(_PAIR.findall(self.map))
        table = np.frombuffer(self.rows, dtype=np.uint8).reshape(-1, _ROW)
        hexes = table[:, :16].tobytes().decode()
        self.phashes = np.frombuffer(bytes.fromhex(hexes), dtype=">u8").astype(np.uint64)

    def position(self, sha256: str) -> int | None:
        """The row of ``sha256``, if the index has it with a perceptual hash."""
        at = self.rows.find(sha256.encode())
        while at >= 0 and (at - _SHA) % _ROW:
            at = self.rows.find(sha256.encode(), at + 1)
        return None if at < 0 else (at - _SHA) // _ROW

    def sha256_at(self, row: int) -> str:
        return self.rows[row * _ROW + _SHA : (row + 1) * _ROW].decode()

    def __enter__(self) -> IndexView:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.map is not None:
            self.map.close()

    def record(self, key: str, value: str) -> dict[str, Any] | None:
        """The first record whose ``key`` (``sha256`` or ``path``) is ``value``."""
        if self.map is None:
            return None
        at = self.map.find(f'"{key}":{json.dumps(value)}'.encode())
        if at < 0:
            return None
        start = self.map.rfind(b"\n", 0, at) + 1
        line = json.loads(self.map[start : self.map.find(b"\n", at)])
        return line if isinstance(line, dict) and line.get(key) == value else None

    def group(self, sha256: str, distance: int) -> list[str]:
        """The near-duplicate group of ``sha256`` (itself left out): every image linked to it
        by a chain of near pairs, ingest's relation (hashes ``distance`` bits apart or
        closer, confirmed by their thumbnails: :func:`~tasks.contracts.near_duplicates.is_near`)."""
        from tasks.contracts.near_duplicates import group_of

        start = self.position(sha256)
        record = self.record("sha256", sha256)
        if start is None or record is None or "thumb" not in record:
            return []  # an index from before confirmed placement: rerun ingest for groups
        return [self.sha256_at(p) for p in group_of(start, self.phashes, self.thumbs, distance)]

    def thumbs(self, rows: np.ndarray) -> np.ndarray:
        """The thumbnails of the records at ``rows``, read from their lines: only the
        candidates of one group ask, a few beside the index."""
        from tasks.contracts.near_duplicates import thumb_values

        records = [self.record("sha256", self.sha256_at(row)) for row in rows.tolist()]
        return thumb_values([str((r or {})["thumb"]) for r in records])


@dataclass(frozen=True)
class RunUse:
    """A tracked run whose shard set held the image."""

    run_id: str
    run_name: str
    fingerprint: str
    role: str  # "trained on it", "validated on it", "tested on it"
    versions: list[str] = field(default_factory=list)  # versions registered from the run
    deleted: bool = False  # in MLflow's deleted lifecycle (restorable, its versions live on)


@dataclass(frozen=True)
class ImageLineage:
    """Everything the project knows of one image (or, once forgotten, that and when)."""

    sha256: str
    forgotten_at: str | None = None
    path: str | None = None
    split: str | None = None
    near_duplicates: list[str] = field(default_factory=list)  # the group's other hashes
    # each of them by its path in the ingest index (None: no longer there)
    near_duplicate_paths: dict[str, str | None] = field(default_factory=dict)
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
    or from the repository root) hashed, else an index record's path; refused as an unknown
    image unless the project has seen it (:func:`known`)."""
    sha = _content_hash(image, layout, source_dir, index)
    if sha is None or not known(sha, layout, index):
        shown = image if len(image) <= 80 else f"{image[:77]}..."
        raise UnknownImage(
            f"unknown image: {shown} is not an image this project has seen (no record, "
            f"verdict or shard set of {layout.index} or its shard sets holds it)",
            fix="name an image by its path under ingest.source_dir or by its sha256 as "
            "`shardflow lineage` shows it",
        )
    return sha


def _content_hash(image: str, layout: Layout, source_dir: Path, index: IndexView) -> str | None:
    if SHA256.fullmatch(image.lower()):
        return image.lower()
    for candidate in (Path(image), source_dir / image, layout.root / image):
        try:
            if candidate.is_file():
                return file_sha256(candidate)
        except (OSError, ValueError):  # a name too long, or one no file system takes
            continue
    for relative in (image, Path(image).as_posix().removeprefix(f"{source_dir.as_posix()}/")):
        record = index.record("path", relative)
        if record is not None:
            return str(record["sha256"])
    return None


def known(sha256: str, layout: Layout, index: IndexView) -> bool:
    """Whether the project has seen this content: a record or a verdict of the index, a
    record of a shard set (current or kept), or an image already forgotten."""
    if index.map is not None and index.map.find(f'"{sha256}"'.encode()) >= 0:
        return True
    if find_in(membership_files(layout), sha256):
        return True
    return forgotten_at(layout.forgotten, sha256) is not None


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
    record = index.record("sha256", sha256) or {}
    group = index.group(sha256, distance)
    uses = [use for fp, members in held.items() for use in runs.uses(fp, members[0].split)]
    saw = runs.champion is not None and any(runs.champion in u.versions for u in uses)
    return ImageLineage(
        sha256,
        path=record.get("path"),
        split=current[0].split if current else record.get("split"),
        near_duplicates=group,
        near_duplicate_paths={sha: index_path(index, sha) for sha in group},
        members=current,
        shard_sets=sorted(held),
        runs=uses,
        champion=runs.champion if saw else None,
        champion_saw_it=saw,
    )


def lineages(
    images: Sequence[str],
    layout: Layout,
    client: MlflowClient,
    *,
    source_dir: Path,
    model_name: str,
    distance: int,
) -> list[ImageLineage]:
    """The lineage of each image named (a path or a content hash), in the order named."""
    with IndexView(layout.index) as index:
        hashes = [resolve(image, layout, source_dir, index) for image in images]
        runs = TrackedRuns.read(client, model_name)
        return [image_lineage(h, layout, index, runs, distance=distance) for h in hashes]


def index_path(index: IndexView, sha256: str) -> str | None:
    """The path under ``source_dir`` the index gives the record of ``sha256``, if any."""
    record = index.record("sha256", sha256)
    return None if record is None else str(record.get("path"))


def _current_fingerprint(layout: Layout) -> str:
    from tasks.contracts.membership import Membership

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
    deleted: set[str] = field(default_factory=set)  # run ids in MLflow's deleted lifecycle

    def uses(self, fingerprint: str, split: str) -> list[RunUse]:
        found = []
        for run_id, name in self.training.get(fingerprint, []):
            versions = self.versions.get(run_id, [])
            if split == "test":  # training never reads test: its evaluations do
                found += [
                    RunUse(e_id, e_name, fingerprint, ROLES["test"], versions, e_id in self.deleted)
                    for e_id, e_name in self.evaluations.get(run_id, [])
                ]
            else:
                role = ROLES[split]
                found.append(
                    RunUse(run_id, name, fingerprint, role, versions, run_id in self.deleted)
                )
        return found

    @classmethod
    def read(cls, client: MlflowClient, model_name: str) -> TrackedRuns:
        from mlflow.entities import ViewType
        from mlflow.exceptions import MlflowException

        training: dict[str, list[tuple[str, str]]] = {}
        evaluations: dict[str, list[tuple[str, str]]] = {}
        deleted: set[str] = set()
        # deleted runs and experiments too: a soft-deleted run can be restored, and the
        # versions registered from it serve whatever its lifecycle says
        found = client.search_experiments(view_type=ViewType.ALL)
        experiments = [e.experiment_id for e in found]
        for run in _all_runs(client, experiments):
            tags = run.data.tags
            if run.info.lifecycle_stage == "deleted":
                deleted.add(run.info.run_id)
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
        return cls(training, evaluations, versions, champion, deleted)


def _all_runs(client: MlflowClient, experiments: list[str]) -> list[Any]:
    """Every run of the experiments, deleted ones too, page by page."""
    from mlflow.entities import ViewType

    runs: list[Any] = []
    token = None
    while experiments:
        page = client.search_runs(
            experiments, run_view_type=ViewType.ALL, max_results=5000, page_token=token
        )
        runs += list(page)
        token = page.token
        if not token:
            break
    return runs
