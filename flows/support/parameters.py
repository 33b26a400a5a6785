"""The types of the parameters a deployment run may set, checked before the flow body runs.

Whoever starts a deployment run (``prefect deployment run 'predict/local' --param ...``)
chooses its parameters. Every flow that :mod:`flows.cli.deployments` serves types its string
parameters with these, so Prefect refuses a bad value when it validates the run's
parameters, before anything is read or written:

- :data:`RepoPath`: in a deployment run, a path that resolves (links followed) inside the
  repository, the directory the deployments are served from. Direct calls (DVC stages,
  ``python -m flows.predict``, tests) name their own paths.
- :data:`ModelName`, :data:`ModelReference`: a registered-model name, and a model by
  alias, version, run id or one of their URIs; checked in every run.
- :data:`GitCommit`, :data:`RunRef` (the team deployments of ``prefect.yaml``): a full
  commit id or a branch name, never an option (``--upload-pack=...``) or a refspec; a run
  ref ``refs/heads/runs/<name>``, never a user's branch; checked in every run.

``tests/unit/flows/test_deployment_parameters.py`` builds the served deployments and those of
``prefect.yaml``, and fails on a parameter none of these types covers, so a new deployment
cannot skip the check.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationInfo

from flows.support.run_story import in_deployment_run
from tasks.runtime.params import MODEL_NAME_PATTERN
from tasks.runtime.run_overrides import inside

CONFINED = "x-confined"  # the mark these types leave in a deployment's parameter schema


def _inside_when_deployed(value: str, info: ValidationInfo) -> str:
    if in_deployment_run():
        inside(info.field_name or "path", value, Path.cwd(), Path.cwd())
    return value


# A full commit id (SHA-1 or SHA-256), or a branch name: no option, refspec, revision syntax
# or `..`; slashes only between parts (git's check-ref-format, narrowed).
FULL_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
BRANCH_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")
RUN_REF = re.compile(r"refs/heads/runs/[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _git_commit(value: str) -> str:
    if FULL_COMMIT.fullmatch(value) or (
        BRANCH_NAME.fullmatch(value) and ".." not in value and not value.endswith((".", ".lock"))
    ):
        return value
    raise ValueError(f"commit={value!r} is not a full commit id or a branch name")


def _run_ref(value: str) -> str:
    if RUN_REF.fullmatch(value) and ".." not in value and not value.endswith((".", ".lock")):
        return value
    raise ValueError(f"ref={value!r} is not a run ref (refs/heads/runs/<name>)")


def _model_reference(value: str) -> str:
    # Imported here: the data and training flows type their paths from this module, and
    # need not import prediction (MLflow's pyfunc, the preprocessing) to do so.
    from tasks.serve.batch_prediction import check_model_reference

    return check_model_reference(value)


RepoPath = Annotated[
    str,
    AfterValidator(_inside_when_deployed),
    Field(json_schema_extra={CONFINED: "repository"}),
]
ModelName = Annotated[str, Field(pattern=MODEL_NAME_PATTERN, json_schema_extra={CONFINED: "name"})]
ModelReference = Annotated[
    str,
    AfterValidator(_model_reference),
    Field(json_schema_extra={CONFINED: "model reference"}),
]
GitCommit = Annotated[
    str, AfterValidator(_git_commit), Field(json_schema_extra={CONFINED: "git commit"})
]
RunRef = Annotated[str, AfterValidator(_run_ref), Field(json_schema_extra={CONFINED: "run ref"})]
