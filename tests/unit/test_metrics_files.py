"""DVC metrics files hold numbers only: the split of a stage record."""

from __future__ import annotations

from tasks.metrics_files import split_numeric


def test_split_keeps_numbers_and_moves_everything_else() -> None:
    record = {
        "accuracy": 0.9,
        "epochs": 3,
        "promoted": True,  # DVC would show a bool as a metric; it is a record
        "images_per_sec": None,
        "run_id": "abc",
        "history": [1, 2],
        "final": {"loss": 0.1, "note": "x"},
        "input_bound": {"ratio": 1.1},
        "promotion": {"reason": "r"},
    }
    numbers, rest = split_numeric(record)
    assert numbers == {
        "accuracy": 0.9,
        "epochs": 3,
        "final": {"loss": 0.1},
        "input_bound": {"ratio": 1.1},
    }
    assert rest == {
        "promoted": True,
        "images_per_sec": None,
        "run_id": "abc",
        "history": [1, 2],
        "final": {"note": "x"},
        "promotion": {"reason": "r"},
    }
