"""The stages' garbage-collector pause: off inside, back on after, whatever happens."""

from __future__ import annotations

import gc

import pytest

from tasks.runtime.gc_pause import paused_gc


def test_the_collector_is_paused_inside_and_back_after_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(ValueError), paused_gc():
        assert not gc.isenabled()
        raise ValueError("a stage failed")
    assert gc.isenabled()


def test_a_nested_pause_keeps_the_outer_one_and_the_decorator_form_works() -> None:
    @paused_gc()
    def inner() -> bool:
        return gc.isenabled()

    with paused_gc():
        assert inner() is False
        assert not gc.isenabled()  # the inner pause ended without re-enabling
    assert gc.isenabled() and inner() is False and gc.isenabled()
