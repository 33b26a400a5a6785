"""What a deployment run may change, and only inside the repository.

A deployment run's parameters come from whoever starts it: typed per-run overrides of
``params.yaml`` (:class:`ParamOverrides`, written into the file by :func:`apply_overrides`),
and paths checked to lie inside the repository (:func:`inside`, :func:`resolve_inside`).
"""

from __future__ import annotations

import io
from pathlib import Path, PurePath
from typing import Any

from pydantic import BaseModel, Field, Strict, model_validator

from tasks.runtime import atomic
from tasks.runtime.params import (
    STRICT,
    EvaluateParams,
    IngestParams,
    Params,
    ShardParams,
    StrictModel,
    TrainParams,
    flat_keys,
    load_params,
)

# Where code runs comes from the repository's params.yaml only, never from a run's overrides.
FILE_ONLY_KEYS = ("shard.runner", "shard.dask_address", "shard.staging_url")
# Paths a run's overrides may set, but only to somewhere inside the project.
PATH_KEYS = ("ingest.source_dir", "ingest.labels_csv", "train.weights")


def check_overrides(overrides: dict[str, Any]) -> None:
    """Refuse overrides that would reach outside the project.

    A deployment run's parameters come from whoever starts the run; where code runs
    (a Dask scheduler) and paths outside the project come from the repository's files only.
    """
    flat = flat_keys(overrides, "")
    for key in FILE_ONLY_KEYS:
        if key in flat:
            raise ValueError(
                f"{key} cannot be overridden by a deployment run (got {flat[key]!r}); "
                "edit params.yaml in the repository"
            )
    for key in PATH_KEYS:
        value = flat.get(key)
        if isinstance(value, str) and value != "imagenet" and not _stays_inside(value):
            raise ValueError(
                f"{key}={value!r} is outside the project; a deployment run may only set "
                "relative paths inside the repository"
            )


def _stays_inside(path: str) -> bool:
    parts = PurePath(path)
    return not parts.is_absolute() and ".." not in parts.parts


def inside(name: str, value: str | Path, base: str | Path, repository: str | Path) -> Path:
    """``base/value``, symlinks followed, refused unless it lies inside ``repository``.

    Catches what a look at the string cannot: an absolute path, ``..``, and a link inside the
    repository that leads out of it. ``name`` (the parameter) goes into the error.
    """
    repo = Path(repository).resolve()
    resolved = (Path(base) / value).resolve()
    if not resolved.is_relative_to(repo):
        raise ValueError(
            f"{name}={str(value)!r} resolves to {resolved}, outside the repository {repo}; "
            "deployment runs read and write inside the repository only"
        )
    return resolved


def resolve_inside(root: str | Path, params_path: str | Path, repository: str | Path) -> Path:
    """``root/params_path``, refused unless both lie inside ``repository``.

    A deployment run names its project root and params file as parameters; without this a
    run could read params from, and write outputs and params.yaml into, any directory.
    """
    root_dir = inside("root", root, repository, repository)
    return inside("params_path", params_path, root_dir, repository)


def _partial(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` with every field optional (None = keep the params.yaml value), recursively.

    Nested sections are partial too, so ``{"train": {"augment": {"flip": false}}}`` changes
    that one key and keeps the other augment keys from params.yaml.
    """
    from pydantic import create_model

    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        annotation: Any = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            annotation = _partial(annotation)
        # as strict as the field it overrides (a pair still comes as a JSON list)
        strict = next((m.strict for m in info.metadata if isinstance(m, Strict)), None)
        fields[name] = (annotation | None, Field(None, strict=strict))
    return create_model(f"{model.__name__}Override", __config__=STRICT, **fields)


IngestOverride = _partial(IngestParams)
ShardOverride = _partial(ShardParams)
TrainOverride = _partial(TrainParams)
EvaluateOverride = _partial(EvaluateParams)


class ParamOverrides(StrictModel):
    """Typed per-run overrides of ``params.yaml`` (what a deployment run's ``--param`` sets)."""

    ingest: IngestOverride | None = None  # type: ignore[valid-type]
    shard: ShardOverride | None = None  # type: ignore[valid-type]
    train: TrainOverride | None = None  # type: ignore[valid-type]
    evaluate: EvaluateOverride | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _inside_project(self) -> ParamOverrides:
        check_overrides(self.as_dict())
        return self

    def as_dict(self) -> dict[str, Any]:
        """Only the values that were set, nested like params.yaml."""
        return self.model_dump(mode="json", exclude_none=True)


def apply_overrides(path: str | Path, overrides: dict[str, Any]) -> Params:
    """Write overrides into ``params.yaml`` (comments kept, atomically) and return the result.

    The file stays the single source of truth, so `dvc status` and `dvc repro` agree with a
    run that was started with overrides. Checked before the file is touched, and written
    through a temporary file, so a refused or failed run leaves params.yaml as it was. Only
    the lines of the values set change: ``null`` is written ``null`` (ruamel's round trip
    writes nothing), and a list replaced keeps the flow style (``[64, 64]``) of the one it
    replaces, so ``git diff params.yaml`` shows what the run changed and nothing else.
    """
    from ruamel.yaml import YAML

    path = Path(path)
    check_overrides(overrides)
    merged = load_params(path, overrides)  # validate before touching the file
    if not overrides:
        return merged
    yaml_rt = YAML()
    yaml_rt.preserve_quotes = True
    yaml_rt.representer.add_representer(type(None), _null_as_null)
    document = yaml_rt.load(path.read_text())
    _merge_into(document, overrides)
    text = io.StringIO()
    yaml_rt.dump(document, text)
    atomic.write_text(path, text.getvalue())
    return merged


def _null_as_null(representer: Any, _: None) -> Any:
    return representer.represent_scalar("tag:yaml.org,2002:null", "null")


def _merge_into(node: Any, update: dict[str, Any]) -> None:
    """``update`` into the round-trip ``node``, a replaced list in the style of the old one."""
    from ruamel.yaml.comments import CommentedSeq

    for key, value in update.items():
        old = node.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            _merge_into(old, value)
        elif isinstance(value, list) and isinstance(old, CommentedSeq):
            seq = CommentedSeq(value)
            if old.fa.flow_style():
                seq.fa.set_flow_style()
            node[key] = seq
        else:
            node[key] = value
