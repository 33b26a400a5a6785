"""Prefect flows that compose the stage tasks."""

import os
from pathlib import Path

from tasks.runtime.layout import shared_root

# A queued `dvc exp run` runs the stages in a temporary copy of the repo ($DVC_ROOT names the
# real one). prefect.toml's `home` and `profiles_path` are relative, so there they would name
# the copy's folder (and the copy has no record of the clone's server: it would start its
# own); Prefect reads its settings when first imported, hence here, before any flow module.
if shared_root() != Path.cwd().resolve():
    os.environ.setdefault("PREFECT_HOME", str(shared_root() / ".prefect"))
    os.environ.setdefault("PREFECT_PROFILES_PATH", str(shared_root() / ".prefect/profiles.toml"))
