"""The source files each ``dvc.yaml`` stage runs, written into its ``deps`` from the imports.

DVC reruns a stage only when a dep changes, so a module a stage runs but does not list is a
code change that silently keeps stale outputs. A stage's code deps are the files of its entry
point (``python -m flows.shard`` -> ``flows.shard``) and of every project module it imports,
transitively, read the way code versions read them (:mod:`tasks.runtime.code_version`).

``python -m tasks.runtime.stage_deps --write`` rewrites them in place, sorted, after the
stage's other deps (data, models, reports: written by hand, kept in their order with their
comments); ``--check`` says whether ``dvc.yaml`` is current. The rest of the file is kept byte
for byte (ruamel.yaml round trip), and a second write changes nothing: after a merge that
adds modules or imports, one write brings every stage up to date.
"""

from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.tokens import CommentToken

from tasks.runtime.code_version import (
    PACKAGES,
    ROOT,
    project_file,
    project_modules,
    with_native_sources,
)

DVC_YAML = "dvc.yaml"
# Modules a module runs by path, never by import (the layers forbid the import): their code
# is the stage's code all the same. tasks/predict.py logs the served pyfunc from its file.
RUN_BY_PATH: dict[str, tuple[str, ...]] = {"tasks.predict": ("tasks.serve.serving_model",)}
RUN_BY_PATH_NOTE = "run by path, not imported (tasks.runtime.stage_deps.RUN_BY_PATH)"


class StageCommandError(ValueError):
    """A stage's ``cmd`` is not ``python -m <module> ...``: its code cannot be read from it."""


def entry_module(cmd: str) -> str:
    """The module a stage command runs: ``python -m flows.shard --x`` -> ``flows.shard``."""
    match = re.match(r"python3?\s+-m\s+([\w.]+)", cmd)
    if not match:
        raise StageCommandError(
            f"{DVC_YAML}: stage cmd {cmd!r} is not `python -m <module> ...`; run the stage's "
            "code as a module so its source deps can be read from its imports"
        )
    return match.group(1)


def stage_modules(root: Path, entry: str) -> dict[str, Path]:
    """``entry``'s project modules (:func:`project_modules`) and those of every module one of
    them runs by path (:data:`RUN_BY_PATH`), transitively."""
    found: dict[str, Path] = {}
    todo = [entry]
    while todo:
        modules = project_modules(root, todo.pop())
        todo.extend(
            ran
            for module in modules.keys() - found.keys()
            for ran in RUN_BY_PATH.get(module, ())
            if ran not in found and project_file(root, ran)
        )
        found.update(modules)
    return found


def code_deps(root: Path, entry: str) -> list[str]:
    """The repository-relative files ``entry`` runs, C++ sources included, sorted."""
    root = root.resolve()
    files = with_native_sources(list(stage_modules(root, entry).values()))
    return sorted(path.relative_to(root).as_posix() for path in files)


def run_by_path(root: Path, entry: str) -> set[str]:
    """The files among ``entry``'s code deps that it runs by path (:data:`RUN_BY_PATH`)."""
    root = root.resolve()
    ran = {ran for module in stage_modules(root, entry) for ran in RUN_BY_PATH.get(module, ())}
    files = [path for path in (project_file(root, module) for module in ran) if path]
    return {path.relative_to(root).as_posix() for path in files}


def is_code(dep: object) -> bool:
    """A dep under a project package (``tasks/``, ``flows/``): this module writes those."""
    return isinstance(dep, str) and PurePosixPath(dep).parts[:1] in {(p,) for p in PACKAGES}


def round_trip() -> YAML:
    """ruamel.yaml as ``dvc.yaml`` is written: its comments, indents and quotes kept."""
    yaml = YAML()
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.width = 4096  # never fold a long line
    yaml.preserve_quotes = True
    return yaml


def written(root: Path) -> str:
    """``root``'s ``dvc.yaml`` with every stage's code deps written from its imports."""
    yaml = round_trip()
    document = yaml.load((root / DVC_YAML).read_text())
    for stage in document.get("stages", {}).values():
        if "cmd" in stage and "deps" in stage:
            entry = entry_module(str(stage["cmd"]))
            rewrite_deps(stage, code_deps(root, entry), run_by_path(root, entry))
    out = io.StringIO()
    yaml.dump(document, out)
    return out.getvalue()


@dataclass(frozen=True)
class Dep:
    """One item of a stage's ``deps``, with the comment lines above it and on its line."""

    path: Any  # a str, or a mapping where a dep carries options
    above: tuple[str, ...] = ()  # each line stripped: "# ..." or "" for a blank line
    eol: str = ""  # "# ..." or ""


def rewrite_deps(stage: CommentedMap, code: list[str], by_path: set[str]) -> None:
    """``stage``'s deps as its non-code deps, in their order with their comments, then
    ``code``, sorted; ``by_path`` among them say so on their line."""
    deps: CommentedSeq = stage["deps"]
    kept = [dep for dep in read_deps(stage) if not is_code(dep.path)]
    added = [Dep(path, eol=f"# {RUN_BY_PATH_NOTE}" if path in by_path else "") for path in code]
    write_deps(stage, [*kept, *added], tail=_tail(deps))


def read_deps(stage: CommentedMap) -> list[Dep]:
    """``stage``'s deps with their comments. ruamel keeps the lines above the first item with
    the ``deps`` key, and every other comment in the token of the item before it: the item's
    own end-of-line comment, then the lines leading into the next item."""
    deps: CommentedSeq = stage["deps"]
    first = deps.ca.comment[1] if deps.ca.comment and deps.ca.comment[1] else []
    above = ["".join(str(token.value) for token in first)]
    eols = []
    for index in range(len(deps)):
        eol, _, below = _token_text(deps, index).partition("\n")
        eols.append(eol.strip())
        above.append(below)
    return [
        Dep(deps[index], tuple(_lines(above[index])), eols[index]) for index in range(len(deps))
    ]


def write_deps(stage: CommentedMap, deps: list[Dep], tail: str) -> None:
    """Set ``stage``'s deps to ``deps``, each with its comments; ``tail`` (the lines after the
    last item) stays last."""
    items: CommentedSeq = stage["deps"]
    if not deps:  # a stage's own entry point is always one of its deps
        return
    indent = " " * items.lc.col
    items.clear()
    items.ca.items.clear()
    items.extend(dep.path for dep in deps)
    head = [CommentToken(f"{line}\n", CommentMark(items.lc.col), None) for line in deps[0].above]
    items.ca.comment = [None, head] if head else None
    if head:
        stage.ca.items["deps"] = [None, None, None, head]
    else:
        stage.ca.items.pop("deps", None)
    for index, dep in enumerate(deps):
        below = (
            "".join(f"{indent}{line}\n" if line else "\n" for line in deps[index + 1].above)
            if index + 1 < len(deps)
            else tail
        )
        if dep.eol or below:
            # the column of "- <dep>  # ...": two spaces after the dep
            column = items.lc.col + 2 + len(str(dep.path)) + 2
            token = CommentToken(f"{dep.eol}\n{below}", CommentMark(column), None)
            items.ca.items[index] = [token, None, None, None]


def _lines(text: str) -> list[str]:
    """Comment text as stripped lines ("" for a blank one)."""
    return [line.strip() for line in text.splitlines()]


def _tail(deps: CommentedSeq) -> str:
    """The comment lines after the last item of ``deps`` (before the stage's next key)."""
    return _token_text(deps, len(deps) - 1).partition("\n")[2] if len(deps) else ""


def _token_text(deps: CommentedSeq, index: int) -> str:
    """The text of the comment token ruamel keeps after item ``index`` of ``deps``, if any."""
    tokens: Any = deps.ca.items.get(index)
    token = tokens[0] if tokens else None
    return str(token.value) if token is not None else ""


def main(argv: list[str] | None = None) -> int:
    """``shardflow stages --write`` (``python -m tasks.runtime.stage_deps``): write every
    stage's source deps into ``dvc.yaml`` from its imports; ``--check``: exit 1 where
    ``dvc.yaml`` is not current."""
    import argparse

    parser = argparse.ArgumentParser(prog="shardflow stages", description=main.__doc__)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rewrite dvc.yaml in place")
    action.add_argument("--check", action="store_true", help="compare, change nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="default: this checkout")
    args = parser.parse_args(argv)
    path = args.root / DVC_YAML
    text = written(args.root)
    if text == path.read_text():
        print(f"{path}: every stage's source deps are current")
        return 0
    if args.check:
        print(f"{path}: stage source deps differ from the imports; run `shardflow stages --write`")
        return 1
    path.write_text(text)
    print(f"{path}: stage source deps written from the imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
