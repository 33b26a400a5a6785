"""Run refs of the team deployments (flows/team.py) against real git repositories: results go
to ``refs/heads/runs/<run>`` without force, never to the user's branch; refs list and prune."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flows import team


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def remote_and_clone(tmp_path: Path) -> tuple[Path, Path]:
    """A bare remote with one commit on main, and a worker's clone of it."""
    user = tmp_path / "user"
    user.mkdir()
    git(user, "init", "-q", "-b", "main")
    git(user, "config", "user.email", "u@x.invalid")
    git(user, "config", "user.name", "u")
    (user / "dvc.lock").write_text("schema: '2.0'\n")
    (user / "dvc.yaml").write_text(
        "stages:\n  evaluate:\n    cmd: x\n    outs:\n      - models/model.keras\n"
        "      - data/accepted.json:\n          cache: false\n"
        "    metrics:\n      - metrics/eval.json:\n          cache: false\n"
    )
    git(user, "add", "-A")
    git(user, "commit", "-qm", "base")
    bare = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(bare))
    git(user, "push", "-q", str(bare), "main")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--depth", "1", str(bare), str(clone))
    return bare, clone


def test_run_ref_names_the_run_and_refuses_an_empty_name() -> None:
    assert team.run_ref("beryl-lemming") == "refs/heads/runs/beryl-lemming"
    assert team.run_ref("a b/../c") == "refs/heads/runs/a-b-..-c"
    with pytest.raises(ValueError, match="empty ref name"):
        team.run_ref("///")


def test_empty_commit_resolves_to_the_branch_head_on_the_remote(
    remote_and_clone: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    bare, clone = remote_and_clone
    monkeypatch.setenv(team.BRANCH_ENV, "main")
    head = git(bare, "rev-parse", "main")
    assert team.resolve_commit(clone, None) == head
    assert team.resolve_commit(clone, head) == head
    assert team.resolve_commit(clone, "main") == head  # a branch name is fetched too
    with pytest.raises(ValueError, match="full commit id"):
        team.resolve_commit(clone, head[:10])
    monkeypatch.setenv(team.BRANCH_ENV, "no-such-branch")
    with pytest.raises(ValueError, match="no-such-branch"):
        team.resolve_commit(clone, None)


def test_results_go_to_the_run_ref_only_and_never_by_force(
    remote_and_clone: tuple[Path, Path], tmp_path: Path
) -> None:
    bare, clone = remote_and_clone
    main_before = git(bare, "rev-parse", "main")
    (clone / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    (clone / "metrics").mkdir()
    (clone / "metrics" / "eval.json").write_text("{}\n")
    (clone / "stray.txt").write_text("not a result\n")
    (clone / "data").mkdir()
    (clone / "data" / "accepted.json").write_text("{}\n")
    (clone / "models").mkdir()
    (clone / "models" / "model.keras").write_text("cached by DVC, not git\n")
    ref = team.run_ref("one")
    pushed = team.commit_results(clone, ref, "data run one")
    assert git(bare, "rev-parse", ref) == pushed
    assert git(bare, "rev-parse", "main") == main_before  # the user's branch is untouched
    files = git(bare, "ls-tree", "-r", "--name-only", ref).split()
    # the results DVC leaves to git, not a stray file nor a DVC-cached output
    assert files == ["data/accepted.json", "dvc.lock", "dvc.yaml", "metrics/eval.json"]
    # Another clone that did not start from the ref's head cannot move it (no force).
    other = tmp_path / "other"
    git(tmp_path, "clone", "-q", str(bare), str(other))
    (other / "dvc.lock").write_text("schema: '2.0'\nstages: {x: {}}\n")
    with pytest.raises(RuntimeError, match="push"):
        team.commit_results(other, ref, "a diverged run")
    assert git(bare, "rev-parse", ref) == pushed


def test_refs_command_lists_and_prunes_run_refs_only(
    remote_and_clone: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bare, clone = remote_and_clone
    for name in ("one", "two"):
        team.commit_results(clone, team.run_ref(name), f"run {name}")
    monkeypatch.chdir(clone)
    assert team.main(["refs"]) == 0
    assert capsys.readouterr().out.split() == ["refs/heads/runs/one", "refs/heads/runs/two"]
    assert team.main(["refs", "--prune", "one", "main"]) == 2  # main is no run ref
    assert "refs/heads/runs/main" in capsys.readouterr().err
    assert team.list_run_refs() == ["refs/heads/runs/one", "refs/heads/runs/two"]
    assert team.main(["refs", "--prune", "one"]) == 0
    assert team.list_run_refs() == ["refs/heads/runs/two"]
    assert team.main(["refs", "--prune-all"]) == 0
    assert team.list_run_refs() == []
    assert git(bare, "rev-parse", "main")  # the user's branch stays


def test_a_pipeline_run_chains_its_parts_and_looks_for_each_end_every_second(
    remote_and_clone: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pipeline/team`` runs ``data/team`` then ``training/team`` on the commit the data part
    pushed, and asks after each part's run every :data:`team.PART_POLL_S` seconds: Prefect's
    default, 5 s, let each part end up to 5 s late."""
    import logging

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Completed

    bare, clone = remote_and_clone
    monkeypatch.chdir(clone)
    monkeypatch.setattr(team, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(team.flow_run, "get_name", lambda: "quick-run")
    calls: list[tuple[str, dict[str, object], float]] = []

    def run_deployment(name: str, *, parameters: dict[str, object], **options: object) -> FlowRun:
        calls.append((name, parameters, options.get("poll_interval", 5.0)))  # type: ignore[arg-type]
        (clone / "dvc.lock").write_text(f"schema: '2.0'\nstages: {{{name.split('/')[0]}: {{}}}}\n")
        team.commit_results(clone, str(parameters["ref"]), f"{name} results")
        return FlowRun(flow_id=uuid.uuid4(), name=f"{name}-run", state=Completed())

    monkeypatch.setattr("prefect.deployments.run_deployment", run_deployment)
    head = git(bare, "rev-parse", "main")
    result = team.team_pipeline.fn(commit=head)

    ref = team.run_ref("quick-run")
    assert [name for name, _, _ in calls] == ["data/team", "training/team"]
    assert calls[0][1] == {"commit": head, "ref": ref, "overrides": None}
    assert calls[1][1] == {"commit": result["data"]["pushed"], "ref": ref}
    assert result["training"]["pushed"] == git(bare, "rev-parse", ref)
    assert all(poll <= 1.0 for _, _, poll in calls), calls


def test_the_demo_workers_look_for_runs_more_often_than_prefects_default(tmp_path: Path) -> None:
    """``shardflow team-demo``'s workers ask for runs every few seconds: at Prefect's default
    (10 s) a queued run waited 5 s on average, three times a pipeline run."""
    from prefect.settings import PREFECT_WORKER_QUERY_SECONDS

    from flows.demo.team_demo import POOLS, Team, start_workers

    started: dict[str, dict[str, str]] = {}
    demo = Team(base=tmp_path, prefect_url="http://127.0.0.1:9/api")
    demo.start = lambda name, cmd, cwd, env: started.update({name: env})  # type: ignore[method-assign]
    start_workers(demo)
    assert set(started) == {f"worker-{pool}" for pool in POOLS}
    default = PREFECT_WORKER_QUERY_SECONDS.value()
    for env in started.values():
        assert float(env["PREFECT_WORKER_QUERY_SECONDS"]) < default / 2, env


def test_a_team_runs_clone_keeps_keras_and_matplotlib_files_in_it(
    remote_and_clone: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`predict/team` loads the model (Keras) in the worker's own process, which no entry
    point of ours started: Keras wrote the worker's ~/.keras/keras.json."""
    _, clone = remote_and_clone
    monkeypatch.chdir(clone)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    for name in ("KERAS_HOME", "MPLCONFIGDIR", "MATPLOTLIBRC"):
        monkeypatch.setenv(name, "/home/worker/elsewhere")  # restored after the test
    monkeypatch.setattr(sys, "path", list(sys.path))
    root, _ = team.check_out(None)
    assert os.environ["KERAS_HOME"] == str(root.resolve() / ".shardflow" / "keras")
    assert os.environ["MPLCONFIGDIR"] == str(root.resolve() / ".shardflow" / "matplotlib")
    assert "MATPLOTLIBRC" not in os.environ


def test_a_remote_named_with_a_token_leaves_it_in_no_file_of_the_clone(
    remote_and_clone: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`SHARDFLOW_GIT_REMOTE=https://ana:TOKEN@host/repo.git`: the pull step's `git clone`
    wrote the token into the clone's .git/config. The URL there loses it, and the run's git
    commands get it from the process's environment (a credential helper git reads from
    GIT_CONFIG_* variables), after the worker's own git settings."""
    _, clone = remote_and_clone
    for name in (team.GIT_USERNAME_ENV, team.GIT_PASSWORD_ENV, "GIT_CONFIG_KEY_1"):
        monkeypatch.setenv(name, "")  # recorded, so what the check-out sets is undone after
        monkeypatch.delenv(name)
    monkeypatch.setenv("GIT_CONFIG_VALUE_1", "")
    monkeypatch.delenv("GIT_CONFIG_VALUE_1")
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")  # the worker's own setting, kept
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "user.name")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "worker")
    git(clone, "remote", "set-url", "origin", "https://ana:s%40cret-42@git.example.invalid/o/r.git")
    team.credentials_out_of_the_clone(clone)
    config = (clone / ".git" / "config").read_text()
    assert "s%40cret-42" not in config and "ana:" not in config
    assert git(clone, "remote", "get-url", "origin") == "https://git.example.invalid/o/r.git"
    asked = subprocess.run(
        ["git", "credential", "fill"],
        cwd=clone,
        input="protocol=https\nhost=git.example.invalid\npath=o/r.git\n\n",
        env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert "username=ana" in asked and "password=s@cret-42" in asked
    assert git(clone, "config", "user.name") == "worker"
    assert "s@cret-42" not in team.stage_env(clone).values()  # the stages never need it
    # A remote without credentials (a path, SSH, or HTTPS without user) is left as it is.
    git(clone, "remote", "set-url", "origin", "git@git.example.invalid:o/r.git")
    team.credentials_out_of_the_clone(clone)
    assert git(clone, "remote", "get-url", "origin") == "git@git.example.invalid:o/r.git"
