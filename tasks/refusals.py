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
