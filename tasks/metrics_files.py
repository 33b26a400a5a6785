"""Stage records split the way DVC reads them: numbers in the metrics file, the rest beside it.

``dvc metrics show/diff`` and ``dvc exp show`` read numbers only (nested dicts of numbers
are fine) and silently drop lists and strings. A stage record therefore goes to two files:
its numeric part to ``metrics/<stage>.json`` and everything else (run ids, fingerprints,
decisions and their reasons) to a summary under ``reports/``; the two merged give the record
again.
"""

from __future__ import annotations

from typing import Any


def is_number(value: Any) -> bool:
    """A finite-or-not int or float, but not a bool (DVC would show ``True`` as a metric)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def split_numeric(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(numbers, rest)``: nested dicts are split the same way, key by key.

    A dict holding only numbers (after the split) lands whole in ``numbers``; its other
    entries land under the same key in ``rest``. Lists and strings always go to ``rest``.
    """
    numbers: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in record.items():
        if is_number(value):
            numbers[key] = value
        elif isinstance(value, dict):
            inner_numbers, inner_rest = split_numeric(value)
            if inner_numbers:
                numbers[key] = inner_numbers
            if inner_rest:
                rest[key] = inner_rest
        else:
            rest[key] = value
    return numbers, rest
