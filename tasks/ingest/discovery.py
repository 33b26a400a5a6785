"""Discovery, the first step of ingest: every file under the source folder (one sub-folder
per class) or listed in a ``path,label`` CSV, as a candidate with its label; nothing dropped
silently (hidden entries, files outside the classes and files a CSV leaves out are listed as
skipped, with their reason)."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tasks.contracts.content import class_label, class_name_problem, csv_rows, display_name
from tasks.runtime.refusals import Refused


class SourceNotFound(Refused, FileNotFoundError):
    """``ingest.source_dir`` (or ``ingest.labels_csv``) names nothing ingest can read."""

    fix = "set ingest.source_dir in params.yaml to a folder of class folders (or: make demo-data)"


class SourceRefused(Refused, ValueError):
    """The source names no file, or its labels CSV cannot say which class each file is."""

    fix = "correct the folder or the CSV named (ingest.source_dir, ingest.labels_csv)"


@dataclass(frozen=True)
class Candidate:
    path: str  # relative to the source folder (or as written in the CSV)
    label: str


@dataclass(frozen=True)
class Discovered:
    """What a scan of the source found: files to inspect, and entries deliberately skipped."""

    candidates: list[Candidate]
    # {"path", "reason"}: hidden files, files outside classes, files a labels CSV leaves out
    skipped: list[dict[str, str]]
    labels: list[str]  # every class the source names: its folders, or the CSV's labels


def discover(source_dir: Path, labels_csv: Path | None = None) -> Discovered:
    """Files to ingest: one sub-folder per class, or the rows of a ``path,label`` CSV.

    Nothing is dropped silently: hidden entries, files outside the class sub-folders and files
    a CSV does not list are listed as skipped; FIFOs, sockets, symlinks and the like become
    candidates, so inspection quarantines them with a reason.
    """
    if labels_csv is not None:
        if not labels_csv.exists():
            raise SourceNotFound(f"{labels_csv}: labels CSV not found (ingest.labels_csv)")
        if not labels_csv.resolve().is_relative_to(source_dir.resolve()):
            # dvc.yaml tracks the CSV through the ingest stage's source_dir dependency: a
            # CSV elsewhere could change without DVC noticing, so labels would go stale.
            raise SourceRefused(
                f"ingest.labels_csv={labels_csv} is outside ingest.source_dir={source_dir}: "
                "move the CSV into the source folder (DVC tracks it there, so editing a "
                "label reruns ingest)"
            )
        rows = read_labels_csv(labels_csv)
        named = sorted({r.label for r in rows})
        return Discovered(
            sorted(rows, key=lambda c: c.path), _not_listed(source_dir, labels_csv, rows), named
        )
    if not source_dir.is_dir():
        what = "not a folder" if source_dir.exists() else "source folder not found"
        raise SourceNotFound(
            f"{source_dir}: {what} (ingest.source_dir names the folder of class folders); "
            "for the demo dataset run `make demo-data`"
        )
    found: list[Candidate] = []
    skipped: list[dict[str, str]] = []
    labels: list[str] = []
    for entry in sorted(source_dir.iterdir()):
        name = display_name(entry.relative_to(source_dir).as_posix())
        if entry.name.startswith("."):
            skipped.append({"path": name, "reason": "hidden"})
        elif entry.is_symlink() and entry.is_dir():  # its files would count twice, or leave
            reason = "a link to a folder: a class is a real folder (links are not followed)"
            skipped.append({"path": name + "/", "reason": reason})
        elif not entry.is_dir():
            skipped.append({"path": name, "reason": "not in a class sub-folder"})
        else:
            labels.append(class_label(entry.name))
            found.extend(_class_files(source_dir, entry, skipped))
    if not found:
        raise SourceRefused(f"{source_dir}: no files found in class sub-folders")
    return Discovered(found, skipped, labels)


def read_labels_csv(labels_csv: Path) -> list[Candidate]:
    """The ``path,label`` rows of a UTF-8 CSV (a byte-order mark, as spreadsheets save it,
    is allowed); an error names the file and the line as an editor counts it: an empty cell,
    a label that cannot be a class name, a path listed twice, a CSV that lists nothing."""
    rows = []
    lines: dict[str, int] = {}
    for line, row in csv_rows(labels_csv, ("path", "label"), "ingest.labels_csv"):
        listed, label = row["path"], class_label(row["label"])
        if not listed or not label:
            raise SourceRefused(f"{labels_csv}, line {line}: empty `path` or `label`")
        if problem := class_name_problem(label):
            raise SourceRefused(f"{labels_csv}, line {line}: label {label!r}: {problem}")
        path = _inside_path(listed)
        if path in lines:
            spelled = f"{listed!r}" + (f" ({path!r})" if path != listed else "")
            raise SourceRefused(
                f"{labels_csv}, line {line}: {spelled} is listed already on line {lines[path]}; "
                "list each file once, with its one label"
            )
        lines[path] = line
        rows.append(Candidate(path, label))
    if not rows:
        raise SourceRefused(f"{labels_csv}: lists no files (ingest.labels_csv)")
    return rows


def _inside_path(listed: str) -> str:
    """A CSV row's path as the one spelling of its file: ``imgs/../imgs/x.png`` and
    ``./imgs/x.png`` are ``imgs/x.png`` (one record path, one file listed once). A path
    that leaves ``source_dir`` however it is spelled stays as listed, for :class:`Locator`
    to refuse by the name the CSV gives it."""
    path = posixpath.normpath(listed)
    leaves = path == ".." or path.startswith(("../", "/"))
    return listed if leaves or path == "." else path


def _class_files(
    source_dir: Path, class_dir: Path, skipped: list[dict[str, str]]
) -> list[Candidate]:
    """Every non-hidden entry under one class folder that is not a real folder, sorted."""
    rel = class_dir.relative_to(source_dir).as_posix()
    label = class_label(class_dir.name)
    return [Candidate(path, label) for path in _files_under(class_dir, rel, skipped)]


def _files_under(folder: Path, folder_rel: str, skipped: list[dict[str, str]]) -> list[str]:
    """The paths (``folder_rel/...``; ``folder_rel`` "" for the source folder itself) of every
    non-hidden entry under ``folder`` that is not a real folder, sorted; hidden entries and
    folders that cannot be listed go to ``skipped``, sorted.

    Symlinks are never followed (a link, even to a folder, is a candidate, vetted by
    :class:`Locator`); ``os.scandir`` gives each entry's type without a ``stat`` per file.
    """
    found: list[str] = []
    own_skipped: list[dict[str, str]] = []
    folders = [(os.fspath(folder), folder_rel)]
    while folders:
        here, here_rel = folders.pop()
        try:
            with os.scandir(here) as entries:
                listed = [(entry, entry.is_dir(follow_symlinks=False)) for entry in entries]
        except OSError as error:  # the run goes on; the report names what it could not list
            reason = f"unreadable folder, its files not listed: {error.strerror or error}"
            own_skipped.append({"path": display_name(here_rel) + "/", "reason": reason})
            continue
        for entry, is_folder in listed:
            rel = f"{here_rel}/{entry.name}" if here_rel else entry.name
            if entry.name.startswith("."):
                reason = "hidden folder" if is_folder else "hidden"
                own_skipped.append({"path": display_name(rel), "reason": reason})
            elif is_folder:
                folders.append((entry.path, rel))
            else:
                found.append(rel)
    skipped.extend(sorted(own_skipped, key=lambda s: os.fsencode(s["path"])))
    return sorted(found, key=os.fsencode)


def _not_listed(source_dir: Path, labels_csv: Path, rows: list[Candidate]) -> list[dict[str, str]]:
    """What a ``labels_csv`` leaves out of ``source_dir``, as skipped entries: every file the
    CSV does not list (the CSV itself aside), and hidden entries that hold no listed file.
    Every file in the folder is accounted for, listed or not."""
    listed = {row.path for row in rows}  # each spelled one way (_inside_path)
    listed.add(PurePosixPath(labels_csv.resolve().relative_to(source_dir.resolve())).as_posix())
    holding = {str(parent) for path in listed for parent in PurePosixPath(path).parents}
    covered = listed | holding
    walked: list[dict[str, str]] = []
    files = _files_under(source_dir, "", walked)
    skipped = [s for s in walked if s["path"].rstrip("/") not in covered]
    reason = "not listed in ingest.labels_csv"
    skipped += [{"path": display_name(f), "reason": reason} for f in files if f not in listed]
    return sorted(skipped, key=lambda s: os.fsencode(s["path"]))
