"""Prefect flows that compose the stage tasks."""

import os
from pathlib import Path

from tasks.layout import shared_root

# A queued `dvc exp run` runs the stages in a temporary copy of the repo ($DVC_ROOT names the
# real one). prefect.toml's `home = ".prefect"` is relative, so there it would name the copy's
# folder; Prefect reads its settings when first imported, hence here, before any flow module.
if shared_root() != Path.cwd().resolve():
    os.environ.setdefault("PREFECT_HOME", str(shared_root() / ".prefect"))
