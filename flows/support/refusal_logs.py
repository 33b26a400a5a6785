"""A refusal in the logs: its block (what, why, fix) in each flow and task run's log instead of a
traceback, and once on the terminal.
"""

from __future__ import annotations

import logging
import sys

from tasks.runtime.code_version import code_version as code_version  # task versions, re-exported
from tasks.runtime.refusals import find_refusal, refusal_block


def refusal_key(refusal: BaseException) -> str:
    """How Prefect's state messages quote a refusal: ``<type>: <message>`` (cut: they are
    repr-escaped later)."""
    return f"{type(refusal).__name__}: {str(refusal)[:24]}"


def run_what(record: logging.LogRecord) -> str:
    """What a Prefect run logger's record is about: ``flow run 'data'``, ``task run 'x'``."""
    for kind in ("task", "flow"):
        if name := getattr(record, f"{kind}_run_name", None):
            return f"{kind} run {name!r}"
    return record.name


class RefusalsAsBlocks(logging.Filter):
    """A record that carries a refusal reads as its block
    (:func:`tasks.runtime.refusals.refusal_block`),
    without the traceback; a run's final-state line that quotes one names the refusal instead
    of repeating its full text, which stays in the run's state message and the report.

    On Prefect's run loggers it shapes what the run's log (the UI, `prefect deployment run
    --watch`) and the terminal both get; on a console handler, what other loggers say
    there. Anything else passes as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        refusal = find_refusal(record.exc_info[1] if record.exc_info else None)
        if refusal is not None:
            record.refusal_key = key = refusal_key(refusal)
            self.seen.append(key)
            record.msg, record.args = refusal_block(run_what(record), refusal), ()
            record.exc_info, record.exc_text = None, None
            record.refusal = "block"
        elif getattr(record, "refusal", None) is None:
            text = record.getMessage()
            if text.startswith("Finished in state") and any(s in text for s in self.seen):
                state = text.split("(", 1)[0]
                record.msg, record.args = f"{state}: refused (the block above says why)", ()
                record.refusal = "state"
        return True


class QuietRefusals(RefusalsAsBlocks):
    """On the terminal, a refusal is said once: the block of the first record that carries
    it (``show_first``: a deployment run's process, where no entry point prints it) or none
    (the entry point prints it, :func:`tasks.runtime.refusals.refusing`); its other records, its
    final-state lines and repeats of its text are dropped. The record Prefect sends to its
    server keeps its block. Anything else passes as it is."""

    def __init__(self, *, show_first: bool = False) -> None:
        super().__init__()
        self.show_first = show_first
        self.shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        super().filter(record)
        kind = getattr(record, "refusal", None)
        if kind == "block":
            self.seen.append(str(record.__dict__["refusal_key"]))  # set with "block"
            show, self.shown = self.show_first and not self.shown, True
            return show
        if kind is not None:
            return False
        text = record.getMessage()
        return not any(seen in text for seen in self.seen)


def refusals_as_blocks(*, show_first: bool) -> None:
    """Refusals read as one short block in the runs' logs (:class:`RefusalsAsBlocks` on
    Prefect's flow- and task-run loggers) and once on the terminal (:class:`QuietRefusals`
    on the root logger's console handlers; ``show_first`` where no entry point prints the
    block, as in a deployment run's process). Called again, it changes nothing."""
    loggers = [logging.getLogger(f"prefect.{kind}_runs") for kind in ("flow", "task")]
    present = [f for f in loggers[0].filters if isinstance(f, RefusalsAsBlocks)]
    shared = present[0] if present else RefusalsAsBlocks()  # one memory for both loggers
    for logger in loggers:
        if shared not in logger.filters:
            logger.addFilter(shared)
    for handler in logging.getLogger().handlers:
        console = isinstance(handler, logging.StreamHandler) and handler.stream in (
            sys.stderr,
            sys.stdout,
        )
        if console and not any(isinstance(f, QuietRefusals) for f in handler.filters):
            handler.addFilter(QuietRefusals(show_first=show_first))
