"""One way to name a project root: ``Layout(root)``, a path or a string."""

from __future__ import annotations

import pickle
from pathlib import Path

from tasks.layout import Layout


def test_a_root_given_as_a_string_or_a_path_is_the_same_layout() -> None:
    assert Layout("project") == Layout(Path("project"))
    assert Layout("project").shards_dir == Path("project") / "data" / "shards"
    assert Layout().root == Path(".")
    assert pickle.loads(pickle.dumps(Layout("project"))) == Layout("project")  # sent to children
