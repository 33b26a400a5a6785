"""The shard planner's memory over indexes of a scale no unit test builds: the plan and an
append's scan hold no record, and the plan's order is freed before the data diff (the
planner itself: tests/integration/test_shard_slow.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.contracts.index import iter_records, load_index, write_index
from tasks.shard.planning import plan_shards
from tasks.shard.stage import shard_stage
from tests.shard_helpers import params

pytestmark = pytest.mark.slow


def test_plan_memory_does_not_hold_the_records(tmp_path: Path) -> None:
    """Planning 20k records allocates a few bytes a record, not a Python object per record."""
    import tracemalloc

    from bench.plan_rss import synthetic_index
    from tasks.shard.planning import plan_hash

    index_path = synthetic_index(tmp_path / "index.jsonl", 20_000)
    tracemalloc.start()
    plan = plan_shards(params(target_shard_mb=1.0), index_path)
    plan_hash(plan)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(slot.num_records for slot in plan.slots) == 20_000
    assert peak < 100 * 20_000  # the old in-memory plan held over 1 KB a record


def test_an_appends_scan_keeps_no_order_key_of_the_records_it_leaves_out(tmp_path: Path) -> None:
    """An append leaves out nearly every record (the base's): their packed order keys wait
    on disk until the mask is known, so the scan grows by the split code and the mask (2
    bytes a record), not by 8 more; the kept records come out in the order a scan of every
    record gives them."""
    import tracemalloc

    from bench.plan_rss import synthetic_index
    from tasks.shard.planning import scan_index

    peaks: dict[int, int] = {}
    for n in (10_000, 40_000):
        index_path = synthetic_index(tmp_path / f"index-{n}.jsonl", n)
        new = n // 100

        def leave_out(n: int = n, new: int = new) -> np.ndarray:
            mask = np.ones(n, dtype=bool)  # allocated in the scan, as the data diff's is
            mask[-new:] = False
            return mask

        # tracemalloc counts every thread's allocations, an earlier test's threads in the
        # same worker too: the lower peak of two scans is the scan's own
        for _ in range(2):
            tracemalloc.start()
            scan = scan_index(params(), index_path, exclude=leave_out, spill_dir=tmp_path)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            peaks[n] = min(peaks.get(n, peak), peak)
        everything = scan_index(params(), index_path, offset_bits=scan.offset_bits)
        kept = {offset for offset, _ in list(iter_records(index_path))[-new:]}
        low = (1 << scan.offset_bits) - 1
        for split, order in scan.order.items():
            assert [int(v) & low for v in order] == [
                int(v) & low for v in everything.order[split] if int(v) & low in kept
            ]
        assert sum(len(order) for order in scan.order.values()) == new
    assert not list(tmp_path.glob("tmp*"))  # the waiting keys' file is gone
    assert (peaks[40_000] - peaks[10_000]) / 30_000 < 4  # bytes a record; 11 before


@pytest.mark.parametrize("mode", ["rebuild", "append"])
def test_the_plans_order_is_freed_before_the_data_diff(
    tiny_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The diff, the stage's largest step, runs without the plan's 8 bytes a record: at a
    million records they were the stage's growth over 1.3x its peak at 10k."""
    import gc
    import weakref

    from tasks.shard import planning, stage

    base = load_index(tiny_index)  # an append's base lacks the last 8 records: they are new
    write_index(tmp_path / "base.jsonl", {**base, "records": base["records"][:-8]})
    shard_stage(params(), tmp_path / "base.jsonl" if mode == "append" else tiny_index, tmp_path)
    orders: list[weakref.ref[np.ndarray]] = []
    alive: list[int] = []
    scan_index, diff = planning.scan_index, stage.write_stage_diff

    def scanned(*args: object, **kwargs: object) -> planning.IndexScan:
        scan = scan_index(*args, **kwargs)  # type: ignore[arg-type]
        orders.extend(weakref.ref(order) for order in scan.order.values())
        return scan

    def diffed(*args: object, **kwargs: object) -> dict[str, object]:
        gc.collect()
        alive.append(sum(ref() is not None for ref in orders))
        return diff(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stage, "scan_index", scanned)
    monkeypatch.setattr(stage, "write_stage_diff", diffed)
    run = shard_stage(params(mode=mode), tiny_index, tmp_path, diff_path=tmp_path / "diff.json")
    assert orders and alive == [0]
    assert run.shards == len(run.manifest.generations[-1].shards) > 0 and run.diff is not None
