"""Typed view of ``params.yaml``: parsed once, passed down to every stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_PARAMS_PATH = Path("params.yaml")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SplitFractions(_Strict):
    train: float = 0.8
    val: float = 0.1
    test: float = 0.1

    @model_validator(mode="after")
    def _sum_to_one(self) -> SplitFractions:
        total = self.train + self.val + self.test
        if abs(total - 1.0) > 1e-6 or min(self.train, self.val, self.test) < 0:
            raise ValueError(f"ingest.splits must be non-negative and sum to 1, got {total}")
        return self


class IngestParams(_Strict):
    source_dir: str = "data/demo"
    labels_csv: str | None = None  # CSV of `path,label` (paths relative to source_dir)
    splits: SplitFractions = SplitFractions()
    seed: int = 1337
    max_pixels: int = 40_000_000  # larger images are quarantined as "absurd dimensions"
    max_file_mb: float = Field(default=64, gt=0)  # larger files are quarantined unread
    min_side: int = 8
    workers: int = 2


class ShardParams(_Strict):
    image_size: tuple[int, int] = (64, 64)  # [height, width]
    # pad: keep aspect, letterbox with black; crop: keep aspect, center-crop; stretch: ignore aspect
    resize: Literal["pad", "crop", "stretch"] = "pad"
    encoding: Literal["raw", "jpeg", "png"] = "raw"
    jpeg_quality: int = Field(default=90, ge=1, le=100)
    target_shard_mb: float = Field(default=16.0, gt=0)
    compression: Literal["none", "gzip"] = "none"
    seed: int = 1337
    workers: int = 2
    runner: Literal["local", "dask"] = "local"
    dask_address: str | None = None
    # rebuild: one generation from the index; append: keep the current shards, add a generation
    mode: Literal["rebuild", "append"] = "rebuild"

    @field_validator("image_size")
    @classmethod
    def _positive(cls, v: tuple[int, int]) -> tuple[int, int]:
        if min(v) < 1:
            raise ValueError(f"shard.image_size must be positive, got {v}")
        return v


class AugmentParams(_Strict):
    flip: bool = True
    crop: float = 0.1  # max fraction of each side cropped away (then resized back)
    brightness: float = 0.1
    contrast: float = 0.1


class TrainParams(_Strict):
    model: str = "small_cnn"  # small_cnn | mobilenet_v3_small | efficientnet_b0
    weights: str | None = None  # None, "imagenet", or a path to a local weights file
    fine_tune_layers: int = 0  # top backbone layers unfrozen after the frozen phase
    fine_tune_epochs: int = 0
    epochs: int = 10
    batch_size: int = 64
    learning_rate: float = 1e-3
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    early_stopping_patience: int = 3  # 0 disables early stopping
    seed: int = 1337
    deterministic: bool = True
    mixed_precision: bool = False
    xla: bool = False
    augment: AugmentParams = AugmentParams()


class EvaluateParams(_Strict):
    top_k: int = 3
    promotion_metric: str = "accuracy"
    promotion_margin: float = 0.0
    model_name: str = "shardflow"


class ValidateParams(_Strict):
    """Limits on how much a data change may move the dataset before validation fails."""

    # largest allowed change of any class's share of all records (0.05 = 5 points)
    max_class_share_shift: float = Field(default=0.1, ge=0, le=1)
    allow_new_classes: bool = False


class Params(_Strict):
    # `validate` would shadow BaseModel.validate: the field is `validate_`, spelled
    # `validate` in params.yaml.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    ingest: IngestParams = IngestParams()
    shard: ShardParams = ShardParams()
    validate_: ValidateParams = Field(default=ValidateParams(), alias="validate")
    train: TrainParams = TrainParams()
    evaluate: EvaluateParams = EvaluateParams()


def load_params(
    path: str | Path = DEFAULT_PARAMS_PATH, overrides: dict[str, Any] | None = None
) -> Params:
    """Parse ``params.yaml`` (plus optional nested overrides) into typed params."""
    path = Path(path)
    raw: dict[str, Any] = yaml.safe_load(path.read_text()) if path.exists() else {}
    if overrides:
        raw = deep_merge(raw or {}, overrides)
    return Params.model_validate(raw or {})


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Return ``base`` with ``update`` merged in, recursively for nested dicts."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def flatten(section: BaseModel, prefix: str) -> dict[str, Any]:
    """Flatten params to ``{"train.augment.flip": True, ...}`` for tracking."""
    out: dict[str, Any] = {}
    for key, value in section.model_dump().items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                out[f"{name}.{sub_key}"] = sub_value
        else:
            out[name] = value
    return out


def _partial(model: type[BaseModel]) -> type[BaseModel]:
    """The same fields as ``model``, each optional (None = keep the params.yaml value)."""
    from pydantic import create_model

    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        annotation: Any = info.annotation
        fields[name] = (annotation | None, None)
    return create_model(
        f"{model.__name__}Override", __config__=ConfigDict(extra="forbid"), **fields
    )


IngestOverride = _partial(IngestParams)
ShardOverride = _partial(ShardParams)
TrainOverride = _partial(TrainParams)
EvaluateOverride = _partial(EvaluateParams)


class ParamOverrides(_Strict):
    """Typed per-run overrides of ``params.yaml`` (what a deployment run's ``--param`` sets)."""

    ingest: IngestOverride | None = None  # type: ignore[valid-type]
    shard: ShardOverride | None = None  # type: ignore[valid-type]
    train: TrainOverride | None = None  # type: ignore[valid-type]
    evaluate: EvaluateOverride | None = None  # type: ignore[valid-type]

    def as_dict(self) -> dict[str, Any]:
        """Only the values that were set, nested like params.yaml."""
        return self.model_dump(mode="json", exclude_none=True)


def apply_overrides(path: str | Path, overrides: dict[str, Any]) -> Params:
    """Write overrides into ``params.yaml`` (comments kept) and return the validated result.

    The file stays the single source of truth, so `dvc status` and `dvc repro` agree with a
    run that was started with overrides.
    """
    from ruamel.yaml import YAML

    path = Path(path)
    merged = load_params(path, overrides)  # validate before touching the file
    if not overrides:
        return merged
    yaml_rt = YAML()
    yaml_rt.preserve_quotes = True
    document = yaml_rt.load(path.read_text()) if path.exists() else {}

    def merge_into(node: Any, update: dict[str, Any]) -> None:
        for key, value in update.items():
            if isinstance(value, dict) and isinstance(node.get(key), dict):
                merge_into(node[key], value)
            else:
                node[key] = value

    merge_into(document, overrides)
    with path.open("w") as handle:
        yaml_rt.dump(document, handle)
    return merged
