"""``shardflow forget IMAGE... --reason R [--exact] [--models retrain|delete|keep]``
(``python -m flows.forget.orchestration``): remove images, and their near-duplicates, from the
data, the shards, every copy the project made and the models trained on them.

    shardflow forget data/demo/circle/circle_0007.png --reason "erasure request #114"

One recorded step under the workspace lock. The audit record (``data/forgotten.json``) gets
its entry first (``state: started``: the content hashes, who, when, why), so a rerun after a
kill resumes that entry and finishes it; each step below is idempotent and recorded when
done. The file names, which may themselves be personal, are kept only until the end, in
``.shardflow/forget/`` (ignored by git), for the scrub to search for. What it cannot reach
(clones, copies outside the project, git history): docs/erasure.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.runtime.dataset_identity import model_name_for
from tasks.runtime.layout import Layout

if TYPE_CHECKING:
    from tasks.contracts.forgotten import Erasure, ForgottenRecord
    from tasks.erasure.identity import Forgotten
    from tasks.runtime.params import Params

STEPS = (
    "models",
    "sources",
    "index",
    "shards",
    "accept",
    "pipeline",
    "sheets",
    "scrub",
    "objects",
    "tracking",
    "prefect",
)
KILL_ENV = "SHARDFLOW_FORGET_KILL_AT"  # a step's name: the process kills itself before it


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardflow forget",
        description="Remove images and their near-duplicates from the data, the shards, every "
        "copy the project made and the models trained on them (docs/erasure.md).",
    )
    parser.add_argument("images", nargs="*", metavar="IMAGE", help="a path or a sha256")
    parser.add_argument("--reason", help="why (recorded in data/forgotten.json; required)")
    unfinished = parser.add_mutually_exclusive_group()
    unfinished.add_argument(
        "--resume", action="store_true", help="finish the unfinished erasure as it was asked"
    )
    unfinished.add_argument(
        "--abandon",
        action="store_true",
        help="record the unfinished erasure abandoned (what it removed stays removed)",
    )
    parser.add_argument("--exact", action="store_true", help="keep the near-duplicates")
    parser.add_argument(
        "--models",
        choices=("retrain", "delete", "keep"),
        default="retrain",
        help="versions that saw them: retracted and retrained (default), deleted, or "
        "retracted and kept",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="change nothing: list by path every image that would go",
    )
    parser.add_argument("--by", help="who asks (default: git user.name, else login)")
    parser.add_argument("--root", default=".", help="the project root (default: .)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the erasure's whole audit entry (as data/forgotten.json keeps it) instead "
        "of a short account",
    )
    return parser


@dataclass
class Job:
    """One forget: where, what (the audit entry) and its private names (the intent file)."""

    layout: Layout
    params: Params
    record: ForgottenRecord
    erasure: Erasure
    intent: Path
    sources: list[str]  # relative to source_dir
    held_runs: list[str]
    dvc_objects: list[str] = field(default_factory=list)  # removed from the cache and remotes
    images: list[str] = field(default_factory=list)  # as asked (a rerun of them resumes)
    # the shard sets that held the images, and the evaluation pictures' DVC objects when
    # the evaluated set was one of them: both taken when the erasure began (the scrub
    # rewrites the sets, a retrain redraws the pictures)
    held_sets: list[str] = field(default_factory=list)
    picture_objects: list[str] = field(default_factory=list)

    @property
    def source_dir(self) -> Path:
        return self.layout.root / self.params.ingest.source_dir

    @property
    def forgotten(self) -> Forgotten:
        """The images' identities: their content hashes and their paths (never a bare file
        name, which other classes' images share)."""
        from tasks.erasure.identity import Forgotten

        return Forgotten.of(
            self.erasure.sha256, self.sources, source_dir=self.source_dir, root=self.layout.root
        )

    def save(self) -> None:
        from tasks.contracts.forgotten import save_forgotten

        self.intent.parent.mkdir(parents=True, exist_ok=True)
        private = {
            "sources": self.sources,
            "held_runs": self.held_runs,
            "dvc_objects": self.dvc_objects,
            "images": self.images,
            "held_sets": self.held_sets,
            "picture_objects": self.picture_objects,
        }
        self.intent.write_text(json.dumps(private, sort_keys=True))
        save_forgotten(self.layout.forgotten, self.record)

    def done(self, step: str, **removed: list[str]) -> None:
        self.erasure.removed.update(removed)
        self.erasure.steps.append(step)
        self.save()


def start(args: argparse.Namespace, layout: Layout, params: Params) -> Job | None:
    """The unfinished erasure, resumed as it was recorded (``--resume``, or the same images
    and reason asked again) or abandoned (``--abandon``: None); else a new one, planned.
    A new erasure while another is unfinished is refused, naming it."""
    from flows.support.authorship import author
    from tasks.contracts.forgotten import Erasure, load_forgotten
    from tasks.erasure.forget import ForgetRefused, check_agreement, plan_forget

    record = load_forgotten(layout.forgotten)
    intent = layout.root / ".shardflow" / "forget" / "intent.json"
    unfinished = next((e for e in record.erasures if e.state == "started"), None)
    if unfinished is not None:
        kept = json.loads(intent.read_text()) if intent.exists() else {}
        if args.abandon:
            abandon(unfinished, record, layout, intent)
            return None
        asked_again = kept.get("images") == list(args.images) and args.reason == unfinished.reason
        if not (args.resume or asked_again):
            raise ForgetRefused(
                f"{layout.forgotten}: {describe_unfinished(unfinished)} is unfinished; "
                "this forget would finish or undo its work, so it does not start",
                fix="`shardflow forget --resume` finishes it (or `--abandon` records it "
                "abandoned), then rerun this forget",
            )
        print(f"forget: resuming {describe_unfinished(unfinished)}", file=sys.stderr)
        sources, held = kept.get("sources", []), kept.get("held_runs", [])
        objects = kept.get("dvc_objects", [])
        job = Job(layout, params, record, unfinished, intent, sources, held, objects)
        job.images = kept.get("images", [])
        job.held_sets = kept.get("held_sets", [])
        job.picture_objects = kept.get("picture_objects", [])
        return job
    if args.resume or args.abandon:
        raise ForgetRefused(
            f"{layout.forgotten}: no unfinished erasure to resume or abandon",
            fix="shardflow forget IMAGE... --reason R",
        )
    if not args.images or not args.reason:
        raise ForgetRefused(
            "name the images to forget and why", fix="shardflow forget IMAGE... --reason R"
        )
    check_agreement(layout, layout.root / params.ingest.source_dir)  # before any change
    plan = plan_forget(
        args.images,
        layout=layout,
        source_dir=layout.root / params.ingest.source_dir,
        distance=params.ingest.near_duplicate_distance,
        exact=args.exact,
    )
    erasure = Erasure(
        sha256=plan.hashes,
        asked=plan.asked,
        by=author(args.by, layout.root),
        at=now(),
        reason=args.reason,
        models=args.models,
    )
    record.erasures.append(erasure)
    job = Job(layout, params, record, erasure, intent, plan.sources, [])
    job.images = list(args.images)
    record_sheet_sources(job)
    job.save()  # the intent, before anything is removed
    return job


def record_sheet_sources(job: Job) -> None:
    """What the sheets step needs that the later steps change: the shard sets that held the
    images, and (when the evaluated set was one) the evaluation pictures' DVC objects."""
    from tasks.contracts.membership import find_in
    from tasks.erasure.lineage import membership_files
    from tasks.erasure.sheets import evaluated_set, picture_objects

    layout = job.layout
    held = {fp for sha in job.erasure.sha256 for fp in find_in(membership_files(layout), sha)}
    job.held_sets = sorted(held)
    evaluated = evaluated_set(layout.root, layout.shards_dir)
    if evaluated is None or evaluated in held:
        job.picture_objects = picture_objects(layout.root, layout.eval_dir)


@dataclass(frozen=True)
class DryRun:
    """What a forget would remove: one line an image by path, and the sheet of them."""

    lines: list[str]
    sheet: Path


def dry_run(args: argparse.Namespace, layout: Layout, params: Params) -> DryRun:
    """What ``shardflow forget IMAGE...`` would remove, one line an image by path (the
    images named, their near-duplicates unless ``--exact``, every file with their content),
    and a sheet of them in the per-clone sheets folder; nothing else is written."""
    from tasks.erasure.forget import check_agreement, files_by_path, plan_forget
    from tasks.erasure.sheets import DRY_RUN_SHEET, SheetImage, write_dry_run_sheet

    source_dir = layout.root / params.ingest.source_dir
    check_agreement(layout, source_dir)
    plan = plan_forget(
        args.images,
        layout=layout,
        source_dir=source_dir,
        distance=params.ingest.near_duplicate_distance,
        exact=args.exact,
    )
    paths = files_by_path(layout.index, plan.hashes)
    asked = set(plan.asked)
    lines = [
        f"{path} ({sha}: {'named' if sha in asked else 'a near-duplicate'})"
        for path, sha in sorted(paths.items())
    ]
    unlisted = sorted(set(plan.hashes) - set(paths.values()))
    lines += [f"(no file in the index) ({sha})" for sha in unlisted]
    tiles = [
        SheetImage(path, sha, f"{'named' if sha in asked else 'a near-duplicate'}\n{path}")
        for path, sha in sorted(paths.items())
    ]
    tiles += [SheetImage(None, sha, f"no file in the index\n{sha[:16]}") for sha in unlisted]
    sheet = write_dry_run_sheet(
        tiles,
        source_dir=source_dir,
        shards_dir=layout.shards_dir,
        out=layout.sheets / DRY_RUN_SHEET,
    )
    return DryRun(lines, sheet)


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe_unfinished(erasure: Erasure) -> str:
    """An unfinished erasure as its record names it (hashes, never file names)."""
    done = ", ".join(erasure.steps) or "none"
    return (
        f"the erasure started at {erasure.at} by {erasure.by} (reason {erasure.reason!r}; "
        f"image(s) {', '.join(erasure.asked)}; steps done: {done})"
    )


def abandon(erasure: Erasure, record: ForgottenRecord, layout: Layout, intent: Path) -> None:
    """Record ``erasure`` abandoned; its private names go with it."""
    from tasks.contracts.forgotten import save_forgotten

    erasure.state, erasure.abandoned_at = "abandoned", now()
    save_forgotten(layout.forgotten, record)
    intent.unlink(missing_ok=True)
    print(
        f"forget: abandoned {describe_unfinished(erasure)}; what its steps removed stays "
        "removed, and its images are not recorded as forgotten (`shardflow run` rebuilds "
        "the index and shards from what is left)",
        file=sys.stderr,
    )


def step_models(job: Job) -> None:
    """Versions that saw the images lose the champion alias at once (tagged, or deleted)."""
    from tasks.contracts.membership import find_in
    from tasks.contracts.model_versions import Retraction
    from tasks.erasure.lineage import TrackedRuns, membership_files
    from tasks.erasure.retraction import retract_versions, runs_that_held
    from tasks.runtime import tracking

    client = tracking.client(job.layout.root)
    model_name = model_name_for(job.params, job.layout.root)
    runs = TrackedRuns.read(client, model_name)
    sets = {fp for sha in job.erasure.sha256 for fp in find_in(membership_files(job.layout), sha)}
    held, versions = runs_that_held(runs, sets)
    job.held_runs = sorted(held)
    erasure = job.erasure  # named by its record: date, reason, image count
    retraction = Retraction(
        erasure.by, erasure.at, erasure.reason, erasure=erasure.at, images=len(erasure.sha256)
    )
    delete = erasure.models == "delete"
    done = retract_versions(client, model_name, versions, retraction, delete=delete)
    job.erasure.versions["deleted" if delete else "retracted"] = done
    gone = len(held & runs.deleted)
    runs_line = f"{len(held)} run(s) used them, {gone} in MLflow's deleted lifecycle (counted)"
    job.done("models", tracked_runs=[runs_line])


def step_sources(job: Job) -> None:
    """The hashes join the exclusion list (an ingest dependency: no rebuild brings them
    back, whatever source_dir or a clone still holds); the files go where the project may
    write."""
    from tasks.contracts.exclusions import add_excluded
    from tasks.erasure.forget import ForgetPlan, remove_sources

    add_excluded(job.layout.excluded, job.erasure.sha256)
    plan = ForgetPlan(job.erasure.asked, job.erasure.sha256, job.sources)
    removed = remove_sources(job.source_dir, plan, root=job.layout.root)
    left = sum((job.source_dir / s).is_file() for s in job.sources)
    job.done(
        "sources",
        source_dir=[f"{len(removed)} file(s) deleted, {left} kept out (the project may not write)"],
        exclusion_list=[os.path.relpath(job.layout.excluded, job.layout.root)],
    )


def step_index(job: Job) -> None:
    """The ingest index and report without them. Where DVC runs the stages, ingest reruns
    here (the stage's own function, the exclusion list applied) and the shards step records
    it with the shard stage in one ``dvc commit``."""
    from tasks.contracts.exclusions import load_excluded
    from tasks.erasure.forget import records_holding, rewrite_index
    from tasks.ingest.source_check import write_listing
    from tasks.ingest.stage import run_ingest
    from tasks.runtime.atomic import write_json
    from tasks.runtime.metrics_files import INGEST_FIGURES, split_figures

    layout = Layout(job.layout.root.resolve())
    hashes = set(job.erasure.sha256)
    # counted before ingest reruns: its new index no longer holds them for rewrite_index
    held = records_holding(layout.index, hashes)
    if is_dvc_project(layout):
        excluded = load_excluded(layout.excluded)
        # the source stage's listing first: it named the images and their hashes
        write_listing(layout.root, job.params.ingest.source_dir)
        with contextlib.chdir(layout.root):  # source_dir is relative to the project root
            report = run_ingest(
                job.params.ingest, layout.index, layout.ingest_report, excluded=excluded
            )
        # the stage's metrics file too, as flows.ingest writes it: dvc commit records both
        write_json(layout.ingest_metrics, split_figures(report, INGEST_FIGURES)[0])
    dropped = rewrite_index(layout.index, hashes)
    job.done("index", ingest_index=[f"{max(held, dropped)} record(s)"])


def step_shards(job: Job) -> None:
    """Only the shard files that held them are rewritten; DVC records the stage as it is."""
    from tasks.erasure.forget import rewrite_shards

    hashes = set(job.erasure.sha256)
    manifest = rewrite_shards(job.layout.shards_dir, hashes, diff_path=job.layout.shard_changes)
    if is_dvc_project(job.layout):
        run_steps(job.layout, [dvc("commit", "-f", "source", "ingest", "shard")])
    job.done("shards", shards=[f"now {manifest.fingerprint}"])


def step_accept(job: Job) -> None:
    """The new set is the accepted baseline, for this reason: the data gate lets it pass."""
    from tasks.contracts.manifest import load_manifest
    from tasks.runtime.dataset_identity import dataset_identity
    from tasks.validate import data_gate

    fingerprint = load_manifest(job.layout.shards_dir).fingerprint
    reason = f"forget (data/forgotten.json, {job.erasure.at}): {job.erasure.reason}"
    ingest = job.params.ingest
    data_gate.accept(
        job.layout.shards_dir,
        job.layout.accepted_data,
        dataset=dataset_identity(ingest.source_dir, ingest.labels_csv, job.layout.root),
        fingerprint=fingerprint,
        reason=reason,
        by=job.erasure.by,
    )
    job.done("accept")


def step_pipeline(job: Job) -> None:
    """Retrain and evaluate (``--models retrain``); else rerun what the removal made stale
    short of training (validation) and record what stays stale."""
    if is_dvc_project(job.layout):
        job.erasure.stale = rerun_stale(job.layout, retrain=job.erasure.models == "retrain")
    job.done("pipeline")


def rerun_stale(layout: Layout, *, retrain: bool) -> list[str]:
    """``dvc repro`` (retrain: none is left stale) or ``dvc repro validate`` and the stages
    still stale after it."""
    if retrain:
        run_steps(layout, [dvc("repro")])
        return []
    run_steps(layout, [dvc("repro", "validate")])
    status = subprocess.run(
        [sys.executable, *dvc("status", "--json")],
        cwd=layout.root,
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return sorted(json.loads(status.stdout or "{}"))
    except ValueError:
        return []


def step_scrub(job: Job) -> None:
    """Every file of the project's caches, DVC cache and remote, and outputs holding them
    by identity; never one the project needs to run (:func:`needed_files`, the objects the
    working tree's ``dvc.lock`` names). Files kept that a byte search still finds a hash or
    path in are only reported."""
    from tasks.contracts.membership import remove_from_membership
    from tasks.erasure.forget import scrub_files
    from tasks.erasure.lost_revisions import current_objects, object_id

    root = job.layout.root
    hashes = set(job.erasure.sha256)
    kept_sets = sorted(job.layout.membership_archive.glob("*.bin"))
    rewritten = [p.stem for p in kept_sets if remove_from_membership(p, hashes)]
    folders = [root / ".dvc" / "cache", root / ".dvc" / "tmp", *local_remotes(job.layout)]
    folders += [root / ".shardflow", root / "reports", root / "plots", root / "metrics"]
    keep = needed_files(job)
    scrubbed = scrub_files(folders, job.forgotten, keep=keep, current=current_objects(root))
    job.dvc_objects = sorted({*job.dvc_objects, *filter(None, map(object_id, scrubbed.removed))})
    job.done(
        "scrub",
        files=[os.path.relpath(p, root) for p in scrubbed.removed if _nameless(p, job)],
        membership=[
            f"{fingerprint}: the hashes removed, the set kept" for fingerprint in rewritten
        ],
        still_mentioning=[
            os.path.relpath(p, root) for p in scrubbed.mentioning if _nameless(p, job)
        ],
    )


def step_sheets(job: Job) -> None:
    """Every sheet drawn from a set that held the images: the per-clone sheets naming one
    of them (or naming no source), the working tree's evaluation pictures when the set they
    were drawn from held them, and the DVC objects of the pictures the evaluation held when
    the erasure began, but those whose bytes the working tree still has."""
    from tasks.erasure.lost_revisions import object_id
    from tasks.erasure.sheets import (
        EVAL_PICTURES,
        clone_sheets_of,
        evaluated_set,
        md5_of,
        remove_objects,
    )

    layout, root = job.layout, job.layout.root
    removed = clone_sheets_of(layout.sheets, job.erasure.sha256)
    evaluated = evaluated_set(root, layout.shards_dir)
    if evaluated is None or evaluated in job.held_sets:
        removed += [layout.eval_dir / n for n in EVAL_PICTURES if (layout.eval_dir / n).is_file()]
    for path in removed:
        path.unlink(missing_ok=True)
    left = {md5_of(layout.eval_dir / n) for n in EVAL_PICTURES if (layout.eval_dir / n).is_file()}
    folders = [root / ".dvc" / "cache", *local_remotes(layout)]
    objects = remove_objects(folders, set(job.picture_objects), keep=left)
    job.dvc_objects = sorted({*job.dvc_objects, *filter(None, map(object_id, map(str, objects)))})
    job.done("sheets", sheets=[os.path.relpath(p, root) for p in [*removed, *objects]])


def needed_files(job: Job) -> set[Path]:
    """The files a scrub never removes, whatever they hold: the locks, the intent, the
    working tree's index, records lists, reports of the shard set and the audit files."""
    from tasks.runtime.workspace_lock import HOLDER_FILE

    root, layout = job.layout.root, job.layout
    named = {job.intent, root / "dvc.lock", root / HOLDER_FILE, layout.index}
    named |= {layout.forgotten, layout.excluded, layout.accepted_data, layout.ingest_report}
    named |= {layout.shard_changes, layout.validation_report, layout.validation_summary}
    locks = {p for p in (root / ".shardflow").glob("*.lock")}
    locks |= {p for p in (root / ".dvc" / "tmp").glob("*") if p.is_file()}
    locks |= set(layout.membership_archive.glob("*.bin"))  # rewritten, never removed
    shards = {p for p in layout.shards_dir.rglob("*") if p.is_file()}
    return named | locks | shards


def step_objects(job: Job) -> None:
    """Objects in S3 that hold or name them: the DVC remotes on S3 (each with its own
    config), Dask staging (``shard.staging_url``) and a published set (SHARDFLOW_SHARDS_URL);
    then the commits and experiments whose data is gone with the DVC objects."""
    from tasks.contracts.shard_store import SHARDS_URL_ENV, s3_client
    from tasks.erasure.lost_revisions import (
        broken_objects,
        current_objects,
        lost_revisions,
        object_id,
    )
    from tasks.erasure.object_scrub import Bucket, dvc_s3_remotes, scrub_bucket

    stores = dvc_s3_remotes(job.layout.root / ".dvc") if is_dvc_project(job.layout) else []
    others = [job.params.shard.staging_url, os.environ.get(SHARDS_URL_ENV)]
    stores += [Bucket(url, s3_client()) for url in others if url and url.startswith("s3://")]
    current = current_objects(job.layout.root)
    removed = {}
    for store in stores:
        gone = scrub_bucket(store, job.forgotten, current=current)
        job.dvc_objects = sorted({*job.dvc_objects, *filter(None, map(object_id, gone))})
        removed[store.url] = len(gone)
    broken = broken_objects(job.dvc_objects, job.layout.root / ".dvc" / "cache")
    lost = lost_revisions(job.layout.root, broken)
    job.erasure.unrecoverable = {"commits": lost.commits, "experiments": lost.experiments}
    job.done("objects", object_storage=[f"{u}: {n} object(s)" for u, n in removed.items()])


def _nameless(path: str, job: Job) -> bool:
    return not job.forgotten.named_in(path) and not any(Path(s).name in path for s in job.sources)


def step_tracking(job: Job) -> None:
    """Tags, descriptions and artifacts that name or show them; the SQLite store compacted."""
    from tasks.erasure.retraction import compact_sqlite, scrub_tracking
    from tasks.runtime import tracking

    client = tracking.client(job.layout.root)
    changed = scrub_tracking(
        client, job.forgotten, set(job.held_runs), model_name_for(job.params, job.layout.root)
    )
    compact_sqlite(tracking.tracking_uri(job.layout.root))
    job.done("tracking", tracking_store=changed)


def step_prefect(job: Job) -> None:
    """The Prefect server's artifacts that name them, and the flow runs whose logs do: the
    project's own server (started if it is down) or the one PREFECT_API_URL names there,
    resolved in the project's root, never the server of the folder this command started in."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.erasure.object_scrub import scrub_prefect

    if is_dvc_project(job.layout):
        run_steps(job.layout, [["-m", "flows.servers.prefect_server", "ensure"]])
    url = project_url(job.layout.root)
    if url is None:  # no server: nothing was logged to one
        job.done("prefect", prefect_flow_runs=["no Prefect server configured"])
        return
    with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        done = scrub_prefect(client, job.forgotten)
    job.done("prefect", prefect_flow_runs=done.flow_runs, prefect_artifacts=done.artifacts)


def project_url(root: Path) -> str | None:
    """PREFECT_API_URL as Prefect resolves it in the project at ``root`` (the environment,
    its ``.env``, ``prefect.toml`` and profile), read by a process started there: this
    process's settings are those of the folder it started in, which may be another
    project's, naming another server."""
    read = "from prefect.settings import PREFECT_API_URL as u; print(u.value() or '')"
    done = subprocess.run(
        [sys.executable, "-c", read], cwd=root, capture_output=True, text=True, check=True
    )
    return done.stdout.strip().rstrip("/") or None


STEP_RUNS: dict[str, Callable[[Job], None]] = {
    "models": step_models,
    "sources": step_sources,
    "index": step_index,
    "shards": step_shards,
    "accept": step_accept,
    "pipeline": step_pipeline,
    "sheets": step_sheets,
    "scrub": step_scrub,
    "objects": step_objects,
    "tracking": step_tracking,
    "prefect": step_prefect,
}


def is_dvc_project(layout: Layout) -> bool:
    return (layout.root / ".dvc").is_dir() and (layout.root / "dvc.yaml").is_file()


def dvc(*args: str) -> list[str]:
    return ["-m", "dvc", *args]


def run_steps(layout: Layout, steps: list[list[str]]) -> None:
    """Each ``python ...`` step in the project root (under this process's workspace lock)."""
    from tasks.runtime.refusals import Refused

    for step in steps:
        done = subprocess.run([sys.executable, *step], cwd=layout.root, check=False)
        if done.returncode != 0:
            raise Refused(
                f"`{' '.join(step)}` exited {done.returncode} (its output is above)",
                fix="resolve what it names, then rerun the same `shardflow forget`",
            )


def local_remotes(layout: Layout) -> list[Path]:
    """The project's DVC remotes that are folders on this machine (an object store's
    objects are out of this command's reach: docs/erasure.md)."""
    if not is_dvc_project(layout):
        return []
    from dvc.config import Config

    remotes = Config(dvc_dir=str(layout.root / ".dvc"), validate=False).get("remote", {})
    urls = [str(remote.get("url", "")) for remote in remotes.values()]
    return [layout.root / url for url in urls if url and "://" not in url]


def forget(job: Job) -> None:
    """Every step not yet done, in order; the entry marked done last."""
    from tasks.contracts.forgotten import save_forgotten

    for step in STEPS:
        if step in job.erasure.steps:
            continue
        if os.environ.get(KILL_ENV) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        STEP_RUNS[step](job)
    # the private names go first: a kill before the entry says done leaves it to `--resume`
    # (every step recorded), one after leaves no name behind
    job.intent.unlink(missing_ok=True)
    job.erasure.state = "done"
    save_forgotten(job.layout.forgotten, job.record)
    if job.erasure.stale:
        print(
            f"forget: --models {job.erasure.models} retrained nothing, so these stages are "
            f"stale: {', '.join(job.erasure.stale)}. `dvc repro` retrains and evaluates on "
            "the data without the images (a new version that never saw them).",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None) -> int:
    from flows.support.authorship import print_refused
    from flows.support.environment import configure_environment
    from tasks.runtime.params import load_params
    from tasks.runtime.refusals import Refused
    from tasks.runtime.workspace_lock import lock_timeout_s, workspace_lock

    args = parser().parse_args(argv)
    configure_environment()
    layout = Layout(args.root)
    try:
        params = load_params(layout.params)
        if args.dry_run:
            gone = dry_run(args, layout, params)
            print(
                f"forget --dry-run: {len(gone.lines)} image(s) would go; nothing was "
                f"changed but their sheet, {os.path.relpath(gone.sheet, layout.root)}"
            )
            print("\n".join(f"  {line}" for line in gone.lines))
            return 0
        # the holder file names the command: not the images, whose names may be personal
        timeout_s = lock_timeout_s(layout.params)
        with workspace_lock(layout.root, timeout_s=timeout_s, command="shardflow forget"):
            job = start(args, layout, params)
            if job is None:
                return 0
            forget(job)
    except Refused as refusal:
        return print_refused("forget", refusal)
    if args.json:
        summary: dict[str, Any] = job.erasure.model_dump(mode="json")
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print("\n".join(account(job.erasure)))
    return 0


def account(erasure: Erasure) -> list[str]:
    """What an erasure did, in a few lines with no image named (the whole audit entry stays
    in ``data/forgotten.json``; ``--json`` prints it)."""
    group = len(erasure.sha256) - len(erasure.asked)
    lines = [
        f"forget: {erasure.state}: {len(erasure.sha256)} image(s) ({len(erasure.asked)} "
        f"named, {group} near-duplicate(s) or copies), {erasure.reason!r}, by {erasure.by} "
        f"at {erasure.at}"
    ]
    for where, what in sorted(erasure.removed.items()):
        lines.append(f"  {where}: {'; '.join(what) if len(what) < 4 else f'{len(what)} item(s)'}")
    for outcome, versions in sorted(erasure.versions.items()):
        lines.append(f"  versions {outcome}: {', '.join(f'v{v}' for v in versions) or 'none'}")
    lost = sum(len(refs) for refs in erasure.unrecoverable.values())
    if lost:
        lines.append(f"  {lost} commit(s) or experiment(s) can no longer be checked out whole")
    if erasure.stale:
        lines.append(f"  stale until `dvc repro`: {', '.join(erasure.stale)}")
    lines.append("  the whole audit: data/forgotten.json (shardflow forget --json prints it)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
