"""What the commands a person types share: who a decision is recorded under, the arguments of
a decision on a version, and how a refusal is printed."""

from __future__ import annotations

import getpass
from pathlib import Path

import pytest

from flows.cli import promote, retract
from flows.support import authorship
from tasks.runtime.refusals import REFUSED_EXIT, Refused


def test_a_decision_is_recorded_under_by_then_git_then_the_login(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(authorship, "git_user", lambda root: "Ada")
    assert authorship.author("Grace", tmp_path) == "Grace"
    assert authorship.author(None, tmp_path) == "Ada"
    monkeypatch.setattr(authorship, "git_user", lambda root: None)
    monkeypatch.setattr(getpass, "getuser", lambda: "login")
    assert authorship.author(None, tmp_path) == "login"


def test_a_container_with_no_user_entry_records_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shardflow promote` and `retract` called getpass.getuser() themselves, which raises
    KeyError where the user has no passwd entry and no LOGNAME/USER (a bare container)."""

    def no_entry() -> str:
        raise KeyError("getpwuid(): uid not found: 1234")

    monkeypatch.setattr(authorship, "git_user", lambda root: None)
    monkeypatch.setattr(getpass, "getuser", no_entry)
    assert authorship.author(None, tmp_path) == "unknown"


@pytest.mark.parametrize(("module", "verb"), [(promote, "promote"), (retract, "retract")])
def test_promote_and_retract_take_the_same_arguments(module: object, verb: str) -> None:
    made = module.parser()  # type: ignore[attr-defined]
    args = made.parse_args(["--version", "3", "--reason", "why"])
    assert (args.version, args.reason, args.by, args.root, args.params) == (
        "3",
        "why",
        None,
        ".",
        "params.yaml",
    )
    assert made.prog == f"shardflow {verb}"
    assert f"the registered version to {verb}" in made.format_help()
    with pytest.raises(SystemExit):
        made.parse_args(["--version", "3"])  # a decision always says why


def test_a_refusal_is_printed_with_its_fix_and_the_refusal_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = authorship.print_refused("retract", Refused("v9 is not registered", fix="list them"))
    assert code == REFUSED_EXIT
    assert capsys.readouterr().err == "retract: v9 is not registered\n  fix: list them\n"
