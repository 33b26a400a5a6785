"""What `shardflow forget` prints when it is done: a short account naming no image, the whole
audit entry only with --json (it stays in data/forgotten.json)."""

from __future__ import annotations

from flows.forget.orchestration import account, parser
from tasks.contracts.forgotten import Erasure

ASKED = "a" * 64
COPY = "b" * 64


def test_the_account_is_short_and_names_no_image() -> None:
    """forget printed its whole audit entry (every hash, every step's details) as JSON."""
    erasure = Erasure(
        sha256=[ASKED, COPY],
        asked=[ASKED],
        by="ana",
        at="2026-12-07T09:00:00+00:00",
        reason="erasure request",
        models="keep",
        state="done",
        steps=["models", "sources"],
        removed={"source_dir": ["1 file(s) deleted, 0 kept out"], "shards": ["now f00d"]},
        versions={"retracted": ["1", "3"]},
        unrecoverable={"commits": ["c1", "c2"]},
        stale=["train", "evaluate"],
    )
    lines = account(erasure)
    assert lines[0] == (
        "forget: done: 2 image(s) (1 named, 1 near-duplicate(s) or copies), "
        "'erasure request', by ana at 2026-12-07T09:00:00+00:00"
    )
    assert "  source_dir: 1 file(s) deleted, 0 kept out" in lines
    assert "  versions retracted: v1, v3" in lines
    assert "  2 commit(s) or experiment(s) can no longer be checked out whole" in lines
    assert "  stale until `dvc repro`: train, evaluate" in lines
    assert lines[-1].endswith("data/forgotten.json (shardflow forget --json prints it)")
    assert not any(ASKED in line or COPY in line for line in lines)
    assert len(lines) < 10


def test_json_asks_for_the_whole_entry() -> None:
    assert parser().parse_args(["x", "--reason", "r", "--json"]).json
    assert not parser().parse_args(["x", "--reason", "r"]).json
