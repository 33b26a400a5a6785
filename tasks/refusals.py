"""What a user's own input or state makes Shardflow refuse, as one type.

An expected refusal (a bad param, a data change waiting to be accepted, a failed validation,
a held workspace lock, a missing champion...) is not a crash: the terminal shows what was
refused, why, and the one command or edit that resolves it, without a traceback. Every such
error derives from :class:`Refused`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class Refused(Exception):
    """A refusal the user caused and can resolve.

    ``str(error)`` says what was refused and why; ``fix`` (optional) is the one command or
    edit that resolves it, shown on a line of its own.
    """

    fix: str | None = None

    def __init__(self, message: str = "", *, fix: str | None = None) -> None:
        super().__init__(message)
        if fix is not None:
            self.fix = fix


# What a refusal may take on a terminal: the longest messages (a data gate listing a dozen
# class-share shifts) are cut here, and the full text stays in the report and the Prefect run.
MAX_MESSAGE_LINES = 10
WIDTH = 96


def refusal_block(what: str, error: Refused) -> str:
    """``error`` as one short block: what was refused, why (wrapped, at most
    ``MAX_MESSAGE_LINES`` lines), and the fix on a line of its own; never a traceback."""
    import textwrap

    why = textwrap.wrap(str(error) or type(error).__name__, WIDTH - 4)
    if len(why) > MAX_MESSAGE_LINES:
        why = [*why[: MAX_MESSAGE_LINES - 1], "... (the full text is in the report and the run's log)"]
    lines = [f"Refused: {what} ({type(error).__name__})", *(f"  {line}" for line in why)]
    if error.fix:
        fix = textwrap.wrap(error.fix, WIDTH - 9)
        lines += [f"  fix: {fix[0]}", *(f"       {line}" for line in fix[1:3])]
    return "\n".join(lines)


def find_refusal(error: BaseException | None) -> Refused | None:
    """The refusal ``error`` is, or was raised from (an orchestrator may wrap it)."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, Refused):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None
