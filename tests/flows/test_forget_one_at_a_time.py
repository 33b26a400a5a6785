"""One erasure at a time, each its own: while one is unfinished, a forget of other images
refuses, naming it, until it is resumed (``--resume``) or abandoned (``--abandon``, recorded);
it never finishes another erasure's work as its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.forget.orchestration import STEP_RUNS, STEPS, main
from tasks.contracts.content import file_sha256
from tasks.contracts.forgotten import forgotten_at, load_forgotten
from tasks.runtime.layout import Layout
from tests.flows.test_forget_identity import small_project  # noqa: F401  (a fixture)

A, B = "images/red/001.png", "images/green/002.png"


class Killed(Exception):
    """Stands for a kill at a step: the process ends there."""


def killed(_job: object) -> None:
    raise Killed


def forget_killed_at(step: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = STEP_RUNS[step]
    monkeypatch.setitem(STEP_RUNS, step, killed)
    with pytest.raises(Killed):
        main([A, "--reason", "erasure A", "--exact", "--root", str(root)])
    monkeypatch.setitem(STEP_RUNS, step, run)


def test_a_new_erasure_refuses_while_another_is_unfinished_and_never_finishes_it(
    small_project: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, layout = small_project, Layout(small_project)
    sha_a, sha_b = file_sha256(root / A), file_sha256(root / B)
    forget_killed_at("shards", root, monkeypatch)
    (started,) = load_forgotten(layout.forgotten).erasures
    capsys.readouterr()

    assert main([B, "--reason", "erasure B", "--exact", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "'erasure A'" in err and started.at in err and sha_a in err and "--resume" in err
    (erasure,) = load_forgotten(layout.forgotten).erasures
    assert erasure == started  # untouched: neither finished nor joined by B
    assert (root / B).is_file()

    assert main(["--resume", "--root", str(root)]) == 0
    (erasure,) = load_forgotten(layout.forgotten).erasures
    assert (erasure.state, erasure.reason, erasure.steps) == ("done", "erasure A", list(STEPS))
    assert (root / B).is_file()

    assert main([B, "--reason", "erasure B", "--exact", "--root", str(root)]) == 0
    first, second = load_forgotten(layout.forgotten).erasures
    assert (second.reason, second.sha256, second.state) == ("erasure B", [sha_b], "done")
    assert first.sha256 == [sha_a] and not (root / B).exists()


def test_an_abandoned_erasure_is_recorded_and_the_next_one_goes_ahead(
    small_project: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, layout = small_project, Layout(small_project)
    sha_a = file_sha256(root / A)
    forget_killed_at("index", root, monkeypatch)  # the index and shards still agree

    assert main(["--abandon", "--root", str(root)]) == 0
    (erasure,) = load_forgotten(layout.forgotten).erasures
    assert erasure.state == "abandoned" and erasure.abandoned_at is not None
    assert forgotten_at(layout.forgotten, sha_a) is None  # not forgotten: given up
    assert not (root / ".shardflow" / "forget" / "intent.json").exists()
    assert main(["--resume", "--root", str(root)]) == 2  # nothing left to resume

    assert main([B, "--reason", "erasure B", "--exact", "--root", str(root)]) == 0
    assert [e.state for e in load_forgotten(layout.forgotten).erasures] == ["abandoned", "done"]
