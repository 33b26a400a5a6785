"""A stand-in ``nvidia-smi`` for tests of what a machine with an NVIDIA driver gets."""

from __future__ import annotations

import stat
from pathlib import Path

H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000)"


def stand_in_nvidia_smi(folder: Path, listing: str, *, status: int = 0) -> Path:
    """A folder holding an ``nvidia-smi`` that prints ``listing`` for ``-L`` and exits
    ``status``, to put first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(
        f"#!/bin/sh\n[ \"$1\" = -L ] || exit 9\nprintf '%s\\n' '{listing}'\nexit {status}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder
