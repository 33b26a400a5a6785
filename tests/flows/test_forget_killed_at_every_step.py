"""`shardflow forget` SIGKILLed before each of its steps (every step of ``STEPS``, and once
in the middle of the shard rewrite, one shard file rewritten, its record list not): the same
command run again finishes it whole; a forget of another image refuses, naming it and
changing nothing, and ``--resume`` finishes it. Never half done."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from flows.forget.orchestration import KILL_ENV, STEPS
from tasks.contracts.content import file_sha256
from tasks.contracts.forgotten import load_forgotten
from tasks.contracts.manifest import MEMBERSHIP_NAME, load_manifest
from tasks.contracts.membership import Membership
from tasks.erasure.forget import files_by_path
from tasks.runtime.layout import Layout
from tasks.runtime.params import shipped_params_text
from tasks.runtime.workspace_lock import HOLDER_FILE
from tasks.validate.stage import run_validate
from tests.flows.test_forget_identity import tree_digests
from tests.unit.erasure.test_lineage import layout_project, shard_set

# The result's validation: what it reports, not how it runs its TensorFlow cross-check
# (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tf_cross_check_in_process")]

REPO = Path(__file__).resolve().parents[2]
A, B = "images/red/001.png", "images/green/002.png"
MID_SHARDS = "shards, one shard file rewritten"
KILLS = [*STEPS, MID_SHARDS]
# A second erasure's refusal reads only the unfinished entry and its intent, written alike
# at every step: the first step, the half-rewritten shards and the last stand for the rest
# (every kill point's rerun is the test above).
REFUSAL_KILLS = [STEPS[0], MID_SHARDS, STEPS[-1]]
# the forget, killed right after the shard rewrite has rewritten its first shard file
KILLED_MID_SHARDS = """
import os, signal, sys
import tasks.erasure.forget as erasure
from flows.forget.orchestration import main
rewrite = erasure.filter_shard
def rewrite_then_die(*args, **kwargs):
    rewrite(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
erasure.filter_shard = rewrite_then_die
sys.exit(main(sys.argv[1:]))
"""

# the forget, killed right before or right after it records its entry done (argv[1])
KILLED_AT_DONE = """
import os, signal, sys
import tasks.contracts.forgotten as forgotten
from flows.forget.orchestration import main
save, after = forgotten.save_forgotten, sys.argv.pop(1) == "after"
def die_at_done(path, record):
    done = record.erasures[-1].state == "done"
    if done and not after:
        os.kill(os.getpid(), signal.SIGKILL)
    save(path, record)
    if done:
        os.kill(os.getpid(), signal.SIGKILL)
forgotten.save_forgotten = die_at_done
sys.exit(main(sys.argv[1:]))
"""


@dataclass(frozen=True)
class Before:
    """The project before the forget: the image's hash, the bytes of everything else."""

    sha: str
    records: int
    sources: dict[str, str]  # every other source file
    shards: dict[str, str]  # the shard files that never held the image


def digests(folder: Path, pattern: str) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob(pattern))
        if p.is_file()
    }


def project(root: Path) -> Before:
    """A tiny project whose params, index and shards agree; MLflow in a file beside it."""
    built, layout = layout_project(root)
    shard_set(built, layout)
    params = yaml.safe_load(shipped_params_text())
    params["ingest"]["source_dir"] = "images"
    layout.params.write_text(yaml.safe_dump(params))
    sha = file_sha256(root / A)
    with Membership(layout.shards_dir / MEMBERSHIP_NAME) as membership:
        (held,) = {m.shard_file for m in membership.find(sha)}
    sources = digests(root / "images", "*.png")
    sources.pop(A.removeprefix("images/"))
    shards = {
        f: d for f, d in digests(layout.shards_dir, "*.tfrecord*").items() if held not in f
    }  # the shard files and their offsets files
    return Before(sha, load_manifest(layout.shards_dir).total_records, sources, shards)


def untouched(root: Path) -> dict[str, str]:
    """Every file but the lock's (and its holder's, a killed command's until the next one
    takes the lock) and MLflow's."""
    tree = tree_digests(root)
    tree.pop(HOLDER_FILE.as_posix(), None)
    return tree


def environment(root: Path) -> dict[str, str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    env.pop("PREFECT_API_URL", None)
    env.pop(KILL_ENV, None)
    return env


def forget(
    root: Path, *args: str, kill: str | None = None, reason: str = "erasure A"
) -> subprocess.CompletedProcess[str]:
    env = environment(root)
    entry = ["-m", "flows.forget.orchestration"]
    if kill == MID_SHARDS:
        entry = ["-c", KILLED_MID_SHARDS]
    elif kill in ("before done", "after done"):
        entry = ["-c", KILLED_AT_DONE, kill.split()[0]]
    elif kill is not None:
        env[KILL_ENV] = kill
    asked = [*args, "--reason", reason, "--exact"] if args else ["--resume"]
    return subprocess.run(
        [sys.executable, *entry, *asked, "--by", "ana", "--root", str(root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def killed_at(kill: str, root: Path) -> None:
    run = forget(root, A, kill=kill)
    assert run.returncode == -9, run.stderr
    (erasure,) = load_forgotten(Layout(root).forgotten).erasures
    assert erasure.state == "started"
    step = STEPS.index("shards" if kill == MID_SHARDS else kill)
    assert erasure.steps == list(STEPS[:step])


def assert_forgotten_whole(root: Path, before: Before) -> None:
    """The entry done, every step recorded once; the image gone from the sources, index
    and shards, which agree and pass validation; nothing else changed."""
    layout = Layout(root)
    (erasure,) = load_forgotten(layout.forgotten).erasures
    assert (erasure.state, erasure.reason, erasure.steps) == ("done", "erasure A", list(STEPS))
    assert erasure.sha256 == [before.sha]
    assert not (root / A).exists()
    assert files_by_path(layout.index, [before.sha]) == {}
    manifest = load_manifest(layout.shards_dir)
    assert manifest.total_records == before.records - 1
    with Membership(layout.shards_dir / MEMBERSHIP_NAME) as membership:
        assert membership.find(before.sha) == []
        assert membership.fingerprint == manifest.fingerprint
        assert membership.count == manifest.total_records
    for generation in manifest.generations:
        lists = json.loads((layout.shards_dir / generation.records_file).read_text())
        shas = {r["sha256"] for records in lists["shards"].values() for r in records}
        assert before.sha not in shas
    report = run_validate(layout.shards_dir, root / "v.json", root / "v.md")
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    sources = digests(root / "images", "*.png")
    assert sources == before.sources
    shards = digests(layout.shards_dir, "*.tfrecord*")
    assert {f: shards.get(f) for f in before.shards} == before.shards
    assert not (root / ".shardflow" / "forget" / "intent.json").exists()


@pytest.mark.parametrize("kill", KILLS)
def test_a_forget_killed_at_any_step_is_finished_by_the_same_command(
    kill: str, tmp_path: Path
) -> None:
    before = project(tmp_path)
    killed_at(kill, tmp_path)

    done = forget(tmp_path, A)

    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert_forgotten_whole(tmp_path, before)


@pytest.mark.parametrize("kill", REFUSAL_KILLS)
def test_a_forget_killed_at_any_step_refuses_another_image_then_resumes(
    kill: str, tmp_path: Path
) -> None:
    before = project(tmp_path)
    killed_at(kill, tmp_path)
    (started,) = load_forgotten(Layout(tmp_path).forgotten).erasures
    tree = untouched(tmp_path)

    other = forget(tmp_path, B, reason="erasure B")

    assert other.returncode == 2, other.stderr
    assert "Traceback" not in other.stderr
    assert "'erasure A'" in other.stderr and started.at in other.stderr
    assert before.sha in other.stderr and "--resume" in other.stderr
    assert untouched(tmp_path) == tree

    resumed = forget(tmp_path)

    assert resumed.returncode == 0, resumed.stderr
    assert (tmp_path / B).is_file()
    assert_forgotten_whole(tmp_path, before)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_forget_killed_as_its_entry_is_recorded_done_leaves_no_name_behind(
    when: str, tmp_path: Path
) -> None:
    """The private names (the intent file) go before the entry is recorded done: a kill
    right before leaves every step recorded, for ``--resume`` to mark it done; one right
    after leaves the erasure whole, no name behind."""
    before = project(tmp_path)

    run = forget(tmp_path, A, kill=f"{when} done")

    assert run.returncode == -9, run.stderr
    if when == "before":
        (erasure,) = load_forgotten(Layout(tmp_path).forgotten).erasures
        assert (erasure.state, erasure.steps) == ("started", list(STEPS))
        assert forget(tmp_path).returncode == 0
    assert_forgotten_whole(tmp_path, before)
