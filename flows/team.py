"""Team deployments (``prefect.yaml``): the same stages, run by Prefect workers that share
nothing with the user's clone but the servers and the git remote.

Each flow run of ``data/team`` or ``training/team`` starts in a fresh clone made by the
deployment's pull steps (``git clone`` of ``$SHARDFLOW_GIT_REMOTE``). It then

1. checks out the run's commit (``commit``; the branch head when the run starts if empty);
2. writes the run's ``overrides`` into ``params.yaml`` (data runs; training runs find them in
   the commit the data run pushed);
3. ``dvc pull``\\s only what its stages need from the DVC remote;
4. runs the stages with ``dvc repro`` under the workspace lock (the same ``python -m
   flows.<stage>`` commands as ``make run``, from the checked-out commit's code);
5. ``dvc push``\\es the outputs and commits ``dvc.lock``, ``params.yaml`` and the small
   git-tracked outputs (metrics, plots, reports) on ``refs/heads/runs/<run>``, pushed without
   force: a run ref only ever moves forward, and no user branch is written.

``pipeline/team`` runs ``data/team`` (work pool ``cpu``) then ``training/team`` (work pool
``gpu``) on one run ref; its deployment's concurrency limit of 1 queues a second pipeline run
until the first has finished, so runs never share a ``dvc.lock``. (Promotions are one at a
time however runs start: evaluation holds the registry's lock, :mod:`tasks.evaluate.promotion`.)
Credentials (git, S3, tracking server) come from the worker's environment only.

``python -m flows.team deploy [--cpu-pool P] [--gpu-pool P]`` (``shardflow team-deploy``)
registers the deployments of ``prefect.yaml`` on the pools named (else by
``$SHARDFLOW_CPU_POOL`` / ``$SHARDFLOW_GPU_POOL``, else ``cpu`` / ``gpu``);
``python -m flows.team refs [--prune]`` lists (or deletes) the run refs on the git remote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.support.parameters import GitCommit, ModelName, ModelReference, RepoPath, RunRef
from flows.support.refusal_logs import refusals_as_blocks
from tasks.runtime.run_overrides import ParamOverrides
from tasks.runtime.tracking import CHAMPION

REMOTE_ENV = "SHARDFLOW_GIT_REMOTE"  # the git remote workers clone and push to
BRANCH_ENV = "SHARDFLOW_GIT_BRANCH"  # the branch an empty ``commit`` resolves to
DVC_REMOTE_ENV = "SHARDFLOW_DVC_REMOTE"  # the DVC remote name; DVC's default when unset
RUN_REF_PREFIX = "refs/heads/runs/"
# The variables prefect.yaml's `work_pool.name`s are rendered from, and their defaults.
POOL_ENV = {"cpu": "SHARDFLOW_CPU_POOL", "gpu": "SHARDFLOW_GPU_POOL"}
# How often a pipeline run asks whether its part's run has ended: Prefect's default (5 s) lets
# each of the two parts end up to that late; one small read a second is nothing to a server.
PART_POLL_S = 1.0
DATA_STAGES = ("source", "ingest", "shard", "validate")  # the listing pushed too: clones pull it
TRAINING_STAGES = ("train", "evaluate")
# What each part pulls before it runs: the data part its sources and the persisted outputs
# its stages resume from (``--with-deps``); the training part the shards and the models only.
PULLS = {
    "data": ["--with-deps", "validate"],
    "training": ["shard", "validate", "train", "evaluate"],
}
# A remote named with ``user:token@``: where this process keeps them for its git commands
# (read by :data:`CREDENTIAL_HELPER`), once they are out of the clone's ``.git/config``.
GIT_USERNAME_ENV = "SHARDFLOW_GIT_USERNAME"
GIT_PASSWORD_ENV = "SHARDFLOW_GIT_PASSWORD"
CREDENTIAL_HELPER = (
    '!f() { test "$1" = get || exit 0; echo "username=$SHARDFLOW_GIT_USERNAME"; '
    'test -z "$SHARDFLOW_GIT_PASSWORD" || echo "password=$SHARDFLOW_GIT_PASSWORD"; }; f'
)


def git_outputs(root: Path) -> list[str]:
    """What a run commits: dvc.lock, params.yaml and every ``cache: false`` output dvc.yaml
    declares (metrics, plots, reports, models/run.json, data/accepted.json, ...): the files
    DVC leaves to git."""
    import yaml

    paths = ["dvc.lock", "params.yaml"]
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind, []) or []:
                if isinstance(entry, dict):
                    for path, options in entry.items():
                        if (options or {}).get("cache") is False and "${" not in path:
                            paths.append(path)
    return [p for p in dict.fromkeys(paths) if (root / p).exists()]


def run_checked(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """``cmd``'s output; a failure raises with the command, folder and the output's tail, and
    a stage's refusal (its block in the output) as that refusal, whose full record stays in
    the stage's report and the error's cause."""
    from tasks.runtime.refusals import read_refusal

    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        failed = RuntimeError(
            f"`{' '.join(cmd)}` failed in {cwd} (exit {result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        refusal = read_refusal(result.stdout + "\n" + result.stderr)
        if refusal is not None:
            raise refusal from failed
        raise failed
    return result.stdout


def git(root: Path, *args: str) -> str:
    return run_checked(["git", *args], root).strip()


def stage_env(root: Path) -> dict[str, str]:
    """The stages import the checked-out commit's code: the clone first on ``sys.path``; the
    git credentials this process keeps are not theirs to have."""
    kept = {k: v for k, v in os.environ.items() if k not in (GIT_USERNAME_ENV, GIT_PASSWORD_ENV)}
    return {**kept, "PYTHONPATH": str(root)}


def dvc(root: Path, *args: str) -> str:
    return run_checked([sys.executable, "-m", "dvc", *args], root, stage_env(root))


def dvc_remote_args() -> list[str]:
    name = os.environ.get(DVC_REMOTE_ENV)
    return ["--remote", name] if name else []


def run_ref(name: str) -> str:
    """The git ref a run's results go to: ``refs/heads/runs/<name>`` (a safe ref name)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.")
    if not safe:
        raise ValueError(f"run name {name!r} gives an empty ref name")
    return RUN_REF_PREFIX + safe


def credentials_out_of_the_clone(root: Path) -> None:
    """A remote named with ``user:token@`` in ``$SHARDFLOW_GIT_REMOTE`` (an HTTPS URL) was
    written, token and all, into the clone's ``.git/config`` by the pull step's ``git clone``.
    The remote's URL there is made the URL without them, and this process's git commands get
    them from its environment instead: a credential helper in ``GIT_CONFIG_*`` variables
    (which git reads and writes nowhere) answering from :data:`GIT_USERNAME_ENV` and
    :data:`GIT_PASSWORD_ENV`. A URL without them is left as it is."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    url = git(root, "remote", "get-url", "origin")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return
    host = parts.netloc.rpartition("@")[2]
    git(root, "remote", "set-url", "origin", urlunsplit(parts._replace(netloc=host)))
    os.environ[GIT_USERNAME_ENV] = unquote(parts.username or "")
    os.environ[GIT_PASSWORD_ENV] = unquote(parts.password or "")
    count = int(os.environ.get("GIT_CONFIG_COUNT") or 0)  # the worker's own come first
    os.environ[f"GIT_CONFIG_KEY_{count}"] = "credential.helper"
    os.environ[f"GIT_CONFIG_VALUE_{count}"] = CREDENTIAL_HELPER
    os.environ["GIT_CONFIG_COUNT"] = str(count + 1)


def resolve_commit(root: Path, commit: str | None) -> str:
    """The full commit id a run builds: ``commit`` as given, else the head of
    ``$SHARDFLOW_GIT_BRANCH`` (or the remote's default branch) on the remote now."""
    if commit:
        try:
            git(root, "fetch", "--quiet", "origin", commit)
        except RuntimeError as error:
            raise ValueError(
                f"commit {commit!r} not found on the git remote (give a full commit id or a "
                "branch name)"
            ) from error
        return git(root, "rev-parse", "--verify", "FETCH_HEAD^{commit}")
    branch = os.environ.get(BRANCH_ENV) or "HEAD"
    listing = git(root, "ls-remote", "origin", branch).split()
    if not listing:
        raise ValueError(f"branch {branch!r} not found on the git remote")
    git(root, "fetch", "--quiet", "origin", listing[0])
    return listing[0]


def commit_results(root: Path, ref: str, message: str) -> str:
    """Commit dvc.lock, params.yaml and the small outputs, and push them to ``ref`` without
    force (refused if the ref moved elsewhere). Returns the pushed commit."""
    git(root, "add", "--", *git_outputs(root))
    identity = ["-c", "user.name=shardflow worker", "-c", "user.email=worker@shardflow.invalid"]
    has_identity = os.environ.get("GIT_AUTHOR_NAME") and os.environ.get("GIT_AUTHOR_EMAIL")
    git(
        root,
        *([] if has_identity else identity),
        "commit",
        "--quiet",
        "--allow-empty",
        "-m",
        message,
    )
    git(root, "push", "--quiet", "origin", f"HEAD:{ref}")
    return git(root, "rev-parse", "HEAD")


def run_part(
    part: str,
    stages: tuple[str, ...],
    commit: str | None,
    ref: str | None,
    overrides: dict[str, Any] | None,
) -> dict[str, Any]:
    """One team part in this flow run's clone (the working directory the pull steps set)."""
    refusals_as_blocks(show_first=True)  # a stage's refusal, relayed, reads as its block
    logger = get_run_logger()
    root, sha = check_out(commit)
    ref = ref or run_ref(flow_run.get_name() or "run")
    if overrides:
        _apply_overrides(root, overrides)
    import tasks.runtime.params

    # Where the code this run executes comes from (the e2e test checks it is this clone).
    logger.info(
        "code from %s and %s",
        Path(__file__).resolve(),
        Path(tasks.runtime.params.__file__).resolve(),
    )
    sources = source_outputs(root) if part == "data" else []
    dvc(root, "pull", "--allow-missing", *dvc_remote_args(), *PULLS[part], *sources)
    repro = ["repro", *(["--single-item"] if part == "training" else []), *stages]
    run_checked(
        [
            sys.executable,
            "-m",
            "tasks.runtime.workspace_lock",
            "--",
            sys.executable,
            "-m",
            "dvc",
            *repro,
        ],
        root,
        stage_env(root),
    )
    dvc(root, "push", *dvc_remote_args(), *stages)
    pushed = commit_results(root, ref, f"{part} run {flow_run.get_name()} at {sha[:12]}")
    logger.info(
        "%s ran %s from commit %s in %s; results on %s at %s",
        part,
        ", ".join(stages),
        sha[:12],
        root,
        ref,
        pushed[:12],
    )
    return {"part": part, "commit": sha, "ref": ref, "pushed": pushed, "clone": str(root)}


def source_outputs(root: Path) -> list[str]:
    """The DVC outputs that hold ``ingest.source_dir`` (the folder, one it lies in, or ones
    inside it), as paths from ``root``: the data part pulls them itself, since ingest depends
    on the folder's listing, not on the folder, and ``--with-deps`` stops at the listing."""
    from dvc.exceptions import OutputNotFoundError
    from dvc.repo import Repo

    from tasks.runtime.params import load_params

    source = root / load_params(root / "params.yaml").ingest.source_dir
    with Repo(str(root)) as repo:
        try:
            outs = repo.find_outs_by_path(str(source), strict=False, recursive=True)
        except OutputNotFoundError:
            return []
    return sorted({os.path.relpath(out.fs_path, root) for out in outs})


def check_out(commit: str | None) -> tuple[Path, str]:
    """This flow run's clone (the working directory the pull steps set) at ``commit``, its
    code first on ``sys.path`` (never an installed project's), Keras's and Matplotlib's
    files in it (``predict/team`` loads the model in this process, the worker's, which no
    entry point of ours started), no git credentials in its files
    (:func:`credentials_out_of_the_clone`); the clone and the commit."""
    from tasks.runtime.layout import keep_library_files_in

    root = Path.cwd()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    keep_library_files_in(os.environ, root)
    credentials_out_of_the_clone(root)
    sha = resolve_commit(root, commit)
    git(root, "checkout", "--quiet", "--detach", sha)
    return root, sha


def _apply_overrides(root: Path, overrides: dict[str, Any]) -> None:
    """Write the overrides into the clone's params.yaml (refusing unknown keys): with the
    checked-out commit's own params code, imported after the checkout."""
    from tasks.runtime.run_overrides import apply_overrides

    apply_overrides(root / "params.yaml", overrides)


def _as_dict(overrides: ParamOverrides | None) -> dict[str, Any] | None:
    return overrides.as_dict() if overrides else None


@flow(name="data", log_prints=True)
def team_data(
    commit: GitCommit | None = None,
    ref: RunRef | None = None,
    overrides: ParamOverrides | None = None,
) -> dict[str, Any]:
    """ingest -> shard -> validate in this run's clone; results pushed to the run ref."""
    return run_part("data", DATA_STAGES, commit, ref, _as_dict(overrides))


@flow(name="training", log_prints=True)
def team_training(commit: GitCommit | None = None, ref: RunRef | None = None) -> dict[str, Any]:
    """train -> evaluate (promotion included) on the shards of ``commit``'s dvc.lock."""
    return run_part("training", TRAINING_STAGES, commit, ref, None)


@flow(name="pipeline", log_prints=True)
def team_pipeline(
    commit: GitCommit | None = None, overrides: ParamOverrides | None = None
) -> dict[str, Any]:
    """``data/team`` on the cpu pool, then ``training/team`` on the gpu pool, one run ref."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment

    logger = get_run_logger()
    root = Path.cwd()
    sha = resolve_commit(root, commit)
    ref = run_ref(flow_run.get_name() or "run")
    logger.info("pipeline run of commit %s; results go to %s", sha, ref)
    parts: dict[str, Any] = {}
    parameters: dict[str, Any] = {"commit": sha, "ref": ref, "overrides": _as_dict(overrides)}
    for part in ("data", "training"):
        child = run_deployment(
            f"{part}/team", parameters=parameters, timeout=None, poll_interval=PART_POLL_S
        )
        assert isinstance(child, FlowRun)  # called from a sync flow: already awaited
        state = child.state
        if state is None or not state.is_completed():
            raise RuntimeError(f"{part}/team run {child.name} ended {state and state.name}")
        head = git(root, "ls-remote", "origin", ref).split()
        parts[part] = {"flow_run": child.name, "pushed": head[0] if head else None}
        logger.info("%s/team run %s pushed %s", part, child.name, parts[part]["pushed"])
        parameters = {"commit": parts[part]["pushed"], "ref": ref}
    return {"commit": sha, "ref": ref, **parts}


@flow(name="predict", log_prints=True)
def team_predict(
    source: RepoPath,
    output: RepoPath = "reports/predictions.csv",
    model: ModelReference = CHAMPION,
    model_name: ModelName | None = None,
    commit: GitCommit | None = None,
) -> dict[str, Any]:
    """Batch prediction (:func:`flows.predict.predict_flow`) in this run's clone at
    ``commit``: ``source`` as the clone holds it or, when DVC tracks it, pulled from the DVC
    remote; ``model`` (the champion) loaded from the tracking server, which also keeps the
    CSV as the prediction run's artifact. Paths are confined to the clone."""
    root, sha = check_out(commit)
    if not (root / source).exists():
        dvc(root, "pull", *dvc_remote_args(), source)
    get_run_logger().info("predicting %s at commit %s in %s", source, sha[:12], root)
    from flows.predict import predict_flow

    return predict_flow(source=source, output=output, model=model, model_name=model_name)


def list_run_refs(remote: str = "origin", cwd: Path | None = None) -> list[str]:
    """The run refs on the git remote (``refs/heads/runs/*``)."""
    listing = git(cwd or Path.cwd(), "ls-remote", remote, RUN_REF_PREFIX + "*")
    return [line.split()[1] for line in listing.splitlines() if line.strip()]


def pool_names(cpu: str | None, gpu: str | None) -> dict[str, str]:
    """``cpu`` and ``gpu`` (the pools prefect.yaml names) -> the pools to deploy on: each the
    one given, else its variable's value, else the same name."""
    given = {"cpu": cpu, "gpu": gpu}
    return {kind: given[kind] or os.environ.get(var) or kind for kind, var in POOL_ENV.items()}


def deployment_file(root: Path, pools: dict[str, str]) -> Path:
    """``prefect.yaml`` itself when ``pools`` are its own names; else a copy of it whose
    deployments name ``pools`` instead, under ``.shardflow`` (untracked: choosing pools edits
    no tracked file)."""
    import yaml

    source = root / "prefect.yaml"
    if all(kind == name for kind, name in pools.items()):
        return source
    config = yaml.safe_load(source.read_text())
    for deployment in config["deployments"]:
        deployment["work_pool"]["name"] = pools[deployment["work_pool"]["name"]]
    copy = root / ".shardflow" / "prefect.team.yaml"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(yaml.safe_dump(config, sort_keys=False))
    return copy


def deploy(cpu: str | None, gpu: str | None, prefect_args: list[str]) -> int:
    """``prefect deploy --all`` from the working directory on the pools named."""
    pools = pool_names(cpu, gpu)
    file = deployment_file(Path.cwd(), pools)
    print(
        f"deploying {file.name}: cpu pool {pools['cpu']!r}, gpu pool {pools['gpu']!r}", flush=True
    )
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"]
    cmd += ["--prefect-file", str(file), *prefect_args]
    return subprocess.run(cmd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.team deploy [--cpu-pool P] [--gpu-pool P] [prefect deploy args]``,
    ``python -m flows.team refs [--remote R] [--prune REF ...|--prune-all]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flows.team")
    sub = parser.add_subparsers(dest="command", required=True)
    deploying = sub.add_parser("deploy", help="prefect deploy --all, on the pools named")
    deploying.add_argument("--cpu-pool", help=f"default ${POOL_ENV['cpu']}, else cpu")
    deploying.add_argument("--gpu-pool", help=f"default ${POOL_ENV['gpu']}, else gpu")
    refs = sub.add_parser("refs", help="list (or prune) the run refs on the git remote")
    refs.add_argument("--remote", default="origin")
    refs.add_argument("--prune", nargs="+", default=[], metavar="REF")
    refs.add_argument("--prune-all", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.command == "deploy":
        return deploy(args.cpu_pool, args.gpu_pool, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    existing = list_run_refs(args.remote)
    wanted = (
        existing
        if args.prune_all
        else [ref if ref.startswith(RUN_REF_PREFIX) else run_ref(ref) for ref in args.prune]
    )
    unknown = sorted(set(wanted) - set(existing))
    if unknown:
        print(f"not a run ref on {args.remote}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    for ref in wanted:
        git(Path.cwd(), "push", "--quiet", args.remote, "--delete", ref)
        print(f"pruned {ref}")
    for ref in existing:
        if ref not in wanted:
            print(ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
