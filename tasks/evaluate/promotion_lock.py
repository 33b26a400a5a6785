"""The registry's promotion lock: one process at a time moves a registered model's alias.

The lock is the registered model ``<model_name>.promotion-lock``: creating a registered model
whose name exists fails in every MLflow store (a unique key in SQL, the tracking server's error
over REST), so whoever creates it holds the lock, whatever process, clone or Prefect server it
runs under. :func:`tasks.evaluate.promotion.promote` and ``shardflow promote`` hold it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient


LOCK_SUFFIX = ".promotion-lock"  # the lock is a registered model of this name, while held
TAKEOVER_SUFFIX = ".takeover"  # held while one process deletes a lock a dead process left
LOCK_WAIT_S = 1800.0  # a promotion re-scores at most one champion; waiting longer means trouble


def lock_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _holder_is_gone(holder: str) -> bool:
    """Whether ``host:pid`` names a process on this host that no longer runs (a crash left
    the lock); a holder on another host is never judged from here."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextmanager
def promotion_lock(
    client: MlflowClient, model_name: str, *, wait_s: float = LOCK_WAIT_S, poll_s: float = 0.2
) -> Iterator[None]:
    """Hold the registry's promotion lock of ``model_name`` for the block.

    The lock is the registered model ``<model_name>.promotion-lock``: creating a registered
    model whose name exists fails in every MLflow store (a unique key in SQL, the tracking
    server's error over REST), so whoever creates it holds the lock, whatever process, clone
    or Prefect server it runs under. It is deleted on exit; one left by a crashed process on
    this host is taken over (by one process at a time: :func:`_take_over`), one held
    elsewhere is waited for up to ``wait_s`` seconds.
    """
    from mlflow.exceptions import MlflowException

    name, holder = f"{model_name}{LOCK_SUFFIX}", lock_holder()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            description = f"held by {holder} while it promotes {model_name}"
            client.create_registered_model(name, tags={"holder": holder}, description=description)
            break
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        held_by = _lock_holder_tag(client, name)
        if held_by is not None and _holder_is_gone(held_by):
            _take_over(client, name, held_by)
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the promotion lock {name!r} (a registered model) was held by {held_by} for "
                f"over {wait_s:.0f} s; if that process is gone, delete the registered model "
                f"{name!r} and evaluate again"
            )
        time.sleep(poll_s)
    try:
        yield
    finally:
        _delete_lock(client, name)


def _take_over(client: MlflowClient, name: str, dead_holder: str) -> None:
    """Delete the lock ``name`` that ``dead_holder`` left, unless another process has taken it
    over since. Takeovers go one at a time, under a second registered model
    (``<name>.takeover``): two processes that both found the dead holder would otherwise both
    delete, and the second would delete the lock the first had just taken."""
    from mlflow.exceptions import MlflowException

    guard = f"{name}{TAKEOVER_SUFFIX}"
    try:
        client.create_registered_model(guard, tags={"holder": lock_holder()})
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        guard_holder = _lock_holder_tag(client, guard)
        if guard_holder is not None and _holder_is_gone(guard_holder):
            _delete_lock(client, guard)  # a takeover that died halfway (a moment's window)
        return  # another process is taking over: the caller looks again
    try:
        if _lock_holder_tag(client, name) == dead_holder:  # still the dead one's
            _delete_lock(client, name)
    finally:
        _delete_lock(client, guard)


def _lock_holder_tag(client: MlflowClient, name: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name).tags.get("holder")
    except MlflowException:
        return None  # released meanwhile


def _delete_lock(client: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.delete_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
