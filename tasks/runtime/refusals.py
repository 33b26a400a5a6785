"""What a user's own input or state makes Shardflow refuse, as one type.

An expected refusal (a bad param, a data change waiting to be accepted, a failed validation,
a held workspace lock, a missing champion...) is not a crash: the terminal shows what was
refused, why, and the one command or edit that resolves it, without a traceback. Every such
error derives from :class:`Refused`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable


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


# A refusal's exit status: DVC, `shardflow` and a shell tell it from a crash (1).
REFUSED_EXIT = 2

# What a refusal may take on a terminal: the longest messages (a data gate listing a dozen
# class-share shifts) are cut here, and the full text stays in the report and the Prefect run.
MAX_MESSAGE_LINES = 10
WIDTH = 96


def refusal_block(what: str, error: Refused) -> str:
    """``error`` as one short block: what was refused, why (its lines wrapped, at most
    ``MAX_MESSAGE_LINES``), and the fix on a line of its own; never a traceback."""
    import textwrap

    text = str(error) or type(error).__name__
    why = [part for line in text.splitlines() for part in textwrap.wrap(line, WIDTH - 4)]
    if len(why) > MAX_MESSAGE_LINES:
        cut = "... (the full text is in the report and the run's log)"
        why = [*why[: MAX_MESSAGE_LINES - 1], cut]
    kind = getattr(error, "kind", None) or type(error).__name__
    lines = [f"Refused: {what} ({kind})", *(f"  {line}" for line in why)]
    if error.fix:
        fix = textwrap.wrap(error.fix, WIDTH - 9)
        lines += [f"  fix: {fix[0]}", *(f"       {line}" for line in fix[1:3])]
    return "\n".join(lines)


class RelayedRefusal(Refused):
    """A refusal another process printed as its block (a stage under ``dvc repro`` in a
    team's clone), read back so the flow that ran it refuses the same way: ``what`` and
    ``kind`` are the block's."""

    def __init__(self, message: str, *, fix: str | None, what: str, kind: str) -> None:
        super().__init__(message, fix=fix)
        self.what, self.kind = what, kind


BLOCK_HEAD = re.compile(r"^Refused: (?P<what>.*) \((?P<kind>\w+)\)$")


def read_refusal(output: str) -> RelayedRefusal | None:
    """The last refusal block (:func:`refusal_block`) in a process's ``output``, or None."""
    lines = output.splitlines()
    heads = [i for i, line in enumerate(lines) if BLOCK_HEAD.match(line)]
    if not heads:
        return None
    head = BLOCK_HEAD.match(lines[heads[-1]])
    assert head is not None
    why: list[str] = []
    fix: list[str] = []
    for line in lines[heads[-1] + 1 :]:
        if line.startswith("  fix: "):
            fix.append(line[len("  fix: ") :])
        elif fix and line.startswith("       "):
            fix.append(line.strip())
        elif line.startswith("  ") and not fix:
            why.append(line[2:])
        else:
            break
    return RelayedRefusal(
        "\n".join(why), fix=" ".join(fix) or None, what=head["what"], kind=head["kind"]
    )


def find_refusal(error: BaseException | None) -> Refused | None:
    """The refusal ``error`` is, or was raised from (an orchestrator may wrap it)."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, Refused):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def refusing(main: Callable[[], int | None], what: str) -> int:
    """Run an entry point's ``main``: its exit status, or, when it refuses, the refusal
    printed as :func:`refusal_block` on standard error and :data:`REFUSED_EXIT`. Anything
    else is a bug and propagates with its traceback."""
    try:
        return main() or 0
    except Exception as error:
        refusal = find_refusal(error)
        if refusal is None:
            raise
        print(refusal_block(what, refusal), file=sys.stderr, flush=True)
        return REFUSED_EXIT
