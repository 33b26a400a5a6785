"""Every parameter of every deployment ``flows/cli/deployments.py`` serves, and of every team
deployment ``prefect.yaml`` declares, is checked before the run starts: paths resolve inside
the repository, models are named by registry rules, commits and run refs by git's.

The served deployments are built as ``make serve`` builds them and each one's flow is loaded
from its entrypoint, as the serving process loads it; prefect.yaml's flows are loaded from
its entrypoints, as a worker loads them: a new deployment, or a new string parameter,
without a check fails here.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flows.support.parameters import CONFINED
from tasks.serve.batch_prediction import check_model_reference, list_sources

# Object parameters are typed models with their own checks, proven elsewhere.
TYPED_ELSEWHERE = {"overrides": "tests/unit/flows/test_deployment_overrides.py"}
# A parameter with one of these in its name names a file or folder: it must be confined.
PATH_WORDS = re.compile(r"path|root|source|output|dir|file|folder|csv|weights|location|dest")
VALID = {
    "repository": "data/photos",
    "name": "shardflow",
    "model reference": "champion",
    "git commit": "main",
    "run ref": "refs/heads/runs/beryl-lemming",
}
REPO = Path(__file__).resolve().parents[3]
RUN_ID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def deployed_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A repository (the working directory, as for ``make serve``) holding a link that leads
    out of it, in a run a deployment started."""
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    (repo / "data").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("not yours")
    (repo / "escape").symlink_to(outside, target_is_directory=True)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "a-deployment")
    yield repo


def served_parameters() -> Iterator[tuple[str, Any, str, dict[str, Any], list[str]]]:
    """``(deployment, flow, parameter, its schema, required parameters)`` for every served
    deployment, its flow loaded from the entrypoint the serving process runs."""
    from prefect.flows import load_flow_from_entrypoint

    from flows.cli.deployments import deployments

    for deployment in deployments():
        flow = load_flow_from_entrypoint(deployment.entrypoint)
        schema = deployment._parameter_openapi_schema.model_dump()
        for name, entry in schema["properties"].items():
            yield f"{deployment.flow_name}/{deployment.name}", flow, name, entry, schema["required"]
    yield from team_parameters()


def team_parameters() -> Iterator[tuple[str, Any, str, dict[str, Any], list[str]]]:
    """The same for every deployment of prefect.yaml (``prefect deploy --all``)."""
    import yaml
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        path, _, function = deployment["entrypoint"].partition(":")
        flow = load_flow_from_entrypoint(f"{REPO / path}:{function}")
        schema = parameter_schema(flow).model_dump()
        for name, entry in schema["properties"].items():
            yield f"{flow.name}/{deployment['name']}", flow, name, entry, schema["required"]


def kinds(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives of a parameter's schema (``X | None`` is ``anyOf``), None left out."""
    return [kind for kind in entry.get("anyOf", [entry]) if kind.get("type") != "null"]


def is_text(kind: dict[str, Any]) -> bool:
    """A string, or a list of strings: what can carry a path or a URI."""
    return kind.get("type") == "string" or kind.get("items", {}).get("type") == "string"


def hostile_values(outside: Path, mark: str | None) -> list[str]:
    """Values that reach outside: an absolute path, ``..``, a link out (as a path only:
    ``escape`` is a fine model name); for git, an option, a refspec and a user's branch
    (``escape/secret.txt`` is a fine branch name)."""
    hostile = [str(outside / "secret.txt"), "../outside/secret.txt"]
    if mark == "git commit":
        return [*hostile, "--upload-pack=touch pwned", "HEAD:refs/heads/main", "main..x"]
    if mark == "run ref":
        return [*hostile, "escape/secret.txt", "refs/heads/main", "refs/heads/runs/../main"]
    hostile.append("escape/secret.txt")
    return [*hostile, "escape"] if mark == "repository" else hostile


def test_every_text_parameter_of_every_deployment_is_checked(deployed_repo: Path) -> None:
    from prefect.exceptions import ParameterTypeError

    seen, problems = set(), []
    outside = deployed_repo.parent / "outside"
    for deployment, flow, name, entry, required in served_parameters():
        seen.add(deployment)
        where = f"{deployment} parameter {name!r}"
        texts = [kind for kind in kinds(entry) if is_text(kind)]
        if not texts:
            if "$ref" in str(entry) and name not in TYPED_ELSEWHERE:
                problems.append(f"{where}: an object parameter no test checks")
            continue
        marks = {kind.get(CONFINED) for kind in texts}
        enumerated = all("enum" in kind.get("items", kind) for kind in texts)
        if PATH_WORDS.search(name) and marks != {"repository"}:
            problems.append(f"{where} names a path but is not a flows.support.parameters.RepoPath")
            continue
        if not enumerated and (None in marks or len(marks) != 1):
            problems.append(f"{where}: text with no check (type it with flows.support.parameters)")
            continue
        # Another required parameter gets a valid value (one with no check is reported alone).
        base = {key: VALID.get(entry_mark(flow, key), "x") for key in required if key != name}
        listed = texts[0].get("type") == "array"
        for value in hostile_values(outside, next(iter(marks))):
            try:
                flow.validate_parameters({**base, name: [value] if listed else value})
            except ParameterTypeError:
                continue
            problems.append(f"{where} accepted {value!r}")
        if marks == {"repository"}:
            accepted = flow.validate_parameters({**base, name: "data/photos"})
            assert accepted[name] == "data/photos"
    served = {"pipeline/local", "data/local", "training/local", "predict/local"}
    assert seen == served | {"pipeline/team", "data/team", "training/team", "predict/team"}
    assert not problems, "\n".join(problems)


def entry_mark(flow: Any, name: str) -> str | None:
    """The check a required parameter of ``flow`` carries, to give it a valid value."""
    from prefect.utilities.callables import parameter_schema

    entry = parameter_schema(flow.fn).model_dump()["properties"][name]
    return next((str(kind[CONFINED]) for kind in kinds(entry) if CONFINED in kind), None)


def test_direct_calls_name_their_own_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DVC stages, ``python -m flows.predict`` and tests are not deployment runs."""
    from flows.predict import predict_flow

    monkeypatch.delenv("PREFECT__RUNTIME__DEPLOYMENT__ID", raising=False)
    elsewhere = str(tmp_path / "photos")
    assert predict_flow.validate_parameters({"source": elsewhere})["source"] == elsewhere


@pytest.mark.parametrize(
    "model",
    [
        "champion",
        "candidate_2",
        "3",
        RUN_ID,
        "models:/shardflow@champion",
        "models:/a.b-c/12",
        f"runs:/{RUN_ID}/model",
        f"runs:/{RUN_ID}/model/sub",
    ],
)
def test_model_references_in_the_documented_forms_are_accepted(model: str) -> None:
    from flows.predict import predict_flow

    assert check_model_reference(model) == model
    assert predict_flow.validate_parameters({"source": "x", "model": model})["model"] == model


@pytest.mark.parametrize(
    "model",
    [
        "file:///etc/passwd",
        "/etc/passwd",
        "s3://bucket/model",
        "models:/shardflow/Production",  # a stage name, not a version
        "models:/../x@champion",
        "models:/shardflow@latest",
        f"runs:/{RUN_ID}/../../x",
        f"runs:/{RUN_ID}//etc",
        "runs:/not-a-run/model",
        "0",
        "champion; rm -rf /",
        "",
    ],
)
def test_other_model_references_are_refused_before_the_run(model: str) -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.predict import predict_flow

    with pytest.raises(ValueError, match=re.escape(f"model={model!r} is not a model reference")):
        check_model_reference(model)
    with pytest.raises(ParameterTypeError, match="is not a model reference"):
        predict_flow.validate_parameters({"source": "x", "model": model})


@pytest.mark.parametrize("model_name", ["../x", "a b", "models:/x", "", "x/y", "-x"])
def test_model_names_follow_the_registry_rule(model_name: str) -> None:
    from prefect.exceptions import ParameterTypeError
    from pydantic import ValidationError

    from flows.predict import predict_flow
    from tasks.runtime.params import EvaluateParams

    with pytest.raises(ParameterTypeError, match="model_name"):
        predict_flow.validate_parameters({"source": "x", "model_name": model_name})
    with pytest.raises(ValidationError, match="model_name"):
        EvaluateParams.model_validate(
            {
                "top_k": 1,
                "promotion_metric": "accuracy",
                "promotion_margin": 0.0,
                "model_name": model_name,
                "allow_incomparable_promotion": False,
            }
        )


def test_a_listed_file_that_leads_out_refuses_the_batch(deployed_repo: Path) -> None:
    """``source`` inside the repository, but a file it lists outside: by a link in a folder,
    or by a CSV row (absolute, ``..`` or through a link)."""
    photos = deployed_repo / "data" / "photos"
    photos.mkdir()
    (photos / "ok.png").write_bytes(b"x")
    (photos / "leak.png").symlink_to(deployed_repo.parent / "outside" / "secret.txt")
    with pytest.raises(ValueError, match=r"lists .*leak\.png.*outside the repository"):
        list_sources(photos, within=deployed_repo)
    (photos / "leak.png").unlink()
    assert list_sources(photos, within=deployed_repo) == [photos / "ok.png"]
    for row in (str(deployed_repo.parent / "outside" / "secret.txt"), "../../../outside/x"):
        listing = deployed_repo / "data" / "list.csv"
        with listing.open("w", newline="") as handle:
            csv.writer(handle).writerows([["path"], ["photos/ok.png"], [row]])
        with pytest.raises(ValueError, match="outside the repository"):
            list_sources(listing, within=deployed_repo)
    assert len(list_sources(listing)) == 2  # a direct call reads what it is given


# -- the flow itself, under a real (temporary) Prefect server ---------------------------------


def test_the_docs_name_every_served_deployment() -> None:
    """docs/orchestration.md said "three deployments" where `make serve` serves four."""
    from flows.cli.deployments import deployments

    served = [f"{d.flow_name}/{d.name}" for d in deployments()]
    text = (Path(__file__).resolve().parents[3] / "docs" / "orchestration.md").read_text()
    sentence = re.search(r"a serving process for (\w+) deployments: ([^.]*?)\. Leave", text, re.S)
    assert sentence is not None
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    assert sentence.group(1) == words[len(served)]
    assert sorted(re.findall(r"`([\w-]+/[\w-]+)`", sentence.group(2))) == sorted(served)
