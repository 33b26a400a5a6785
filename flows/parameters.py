"""The types of the parameters a deployment run may set, checked before the flow body runs.

Whoever starts a deployment run (``prefect deployment run 'predict/local' --param ...``)
chooses its parameters. Every flow that :mod:`flows.deployments` serves types its string
parameters with these, so Prefect refuses a bad value when it validates the run's
parameters, before anything is read or written:

- :data:`RepoPath`: in a deployment run, a path that resolves (links followed) inside the
  repository, the directory the deployments are served from. Direct calls (DVC stages,
  ``python -m flows.predict``, tests) name their own paths.
- :data:`ModelName`, :data:`ModelReference`: a registered-model name, and a model by
  alias, version, run id or one of their URIs; checked in every run.

``tests/unit/test_deployment_parameters.py`` builds the served deployments and fails on a
parameter none of these types covers, so a new deployment cannot skip the check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationInfo

from flows.common import in_deployment_run
from tasks.params import MODEL_NAME_PATTERN, inside

CONFINED = "x-confined"  # the mark these types leave in a deployment's parameter schema


def _inside_when_deployed(value: str, info: ValidationInfo) -> str:
    if in_deployment_run():
        inside(info.field_name or "path", value, Path.cwd(), Path.cwd())
    return value


def _model_reference(value: str) -> str:
    # Imported here: the data and training flows type their paths from this module, and
    # need not import prediction (MLflow's pyfunc, the preprocessing) to do so.
    from tasks.predict import check_model_reference

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
