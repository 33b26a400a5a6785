"""Progress artifacts: few enough updates that the work never waits on them, and always 100."""

from __future__ import annotations

import pytest


def test_updates_are_spaced_in_time_and_the_end_is_always_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import prefect.artifacts

    from flows.support import run_story

    sent: list[float] = []
    now = [0.0]
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda *a, **k: "id")
    monkeypatch.setattr(
        prefect.artifacts, "update_progress_artifact", lambda _id, value: sent.append(value)
    )
    monkeypatch.setattr(run_story.time, "monotonic", lambda: now[0])
    progress = run_story.Progress("p", "files", interval_s=1.0)
    for done in range(1, 1001):  # 1,000 items, 10 ms apart: 10 s of work
        now[0] = done / 100
        progress(done, 1000)
    # About one update a second (not one per percent, 100 of them), then the end.
    assert 9 <= len(sent) <= 11 and sent[-1] == 100.0
    assert sent == sorted(sent)
    progress(1000, 1000)  # 100 is sent once
    assert sent.count(100.0) == 1

    quick = run_story.Progress("q", "files", interval_s=1.0)
    sent.clear()
    for done in range(1, 51):  # all within a fraction of a second
        now[0] += 0.001
        quick(done, 50)
    assert sent == [100.0]
