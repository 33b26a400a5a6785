"""Typed view of ``params.yaml``: parsed once, checked before anything runs, passed down.

``params.yaml`` is the one source of defaults: every key is required here, so a missing or
partial file is an error instead of a silent fallback to values the code made up.
"""

from __future__ import annotations

import functools
import importlib
import reprlib
import subprocess
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from ruamel.yaml import YAML, YAMLError

from tasks.runtime.refusals import Refused

DEFAULT_PARAMS_PATH = Path("params.yaml")
REPO_PARAMS_PATH = Path(__file__).resolve().parents[2] / "params.yaml"

# The metrics tasks/evaluate/stage.py computes for the test split; promotion compares one of them.
PromotionMetric = Literal[
    "accuracy", "top_k_accuracy", "macro_precision", "macro_recall", "macro_f1"
]
# The models train.model may name: tasks/train/models.py keys its builders by this table.
ModelName = Literal["small_cnn", "mobilenet_v3_small", "efficientnet_b0", "resnet50"]
MODEL_NAMES: tuple[ModelName, ...] = get_args(ModelName)
# A registered model's name: what a run may name in the registry (no URI, path or spaces).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$"
Side = Annotated[int, Field(ge=8)]  # smaller images carry too little signal to train on
# keras.applications' backbones refuse a smaller input side (small_cnn takes any Side)
BACKBONE_MIN_SIDE = 32
Fraction = Annotated[float, Field(ge=0, lt=1)]
# The largest shard.image_size side: a record of 4096x4096 8-bit RGB is 48 MiB, its float32
# training input four times that; past it a shard worker's record alone needs gigabytes.
MAX_SIDE = 4096
# The largest input batch training may hold (float32 pixels), in bytes.
MAX_BATCH_BYTES = 16 * 2**30
MIB = 2**20


def _bytes(count: float) -> str:
    """``count`` bytes in the unit a person reads (MiB up to a GiB, then GiB)."""
    return f"{count / 2**30:,.1f} GiB" if count >= 2**30 else f"{count / MIB:,.1f} MiB"


def at_most(limit: int, bytes_each: float, what: str) -> AfterValidator:
    """A bound on a size param whose refusal names what the value would need: ``value *
    bytes_each`` bytes of ``what``."""

    def check(value: float) -> float:
        if value > limit:
            raise ValueError(
                f"at most {limit:,}: this value needs {_bytes(value * bytes_each)} of {what} "
                f"({_bytes(limit * bytes_each)} at the bound)"
            )
        return value

    return AfterValidator(check)


def read_yaml(text: str) -> Any:
    """YAML as DVC reads ``params.yaml`` (ruamel.yaml's safe loader, YAML 1.2): ``1e-3`` is a
    number and ``yes``/``on`` are words, so the pipeline sees the values `dvc params diff`
    and `dvc exp show` show. PyYAML (YAML 1.1) read ``1e-3`` as a string and ``flip: yes``
    as true where DVC showed "yes"."""
    return YAML(typ="safe").load(text)  # dvc.utils.serialize's parse_yaml


class ParamsError(Refused, ValueError):
    """A params file that is missing, empty or invalid, or a param a run cannot use as set
    (a ``train.weights`` file that is not there, a batch the train split cannot fill); the
    message names every bad key and what to set. Never retried: a rerun as it is fails alike.
    """

    fix = "edit what it names in params.yaml (every key is listed there), then rerun"


# A params file holds a few hundred values; YAML aliases let a few lines stand for billions
# (an alias bomb: each level repeats the one before), which validating or formatting an error
# would walk for good. The expanded size is counted over shared nodes first, in linear time.
MAX_EXPANDED_VALUES = 100_000


def _value_repr() -> reprlib.Repr:
    """An error message shows at most this much of a bad value."""
    shown = reprlib.Repr()
    shown.maxstring = shown.maxother = 120
    shown.maxlist = shown.maxtuple = shown.maxdict = 8
    shown.maxlevel = 3
    return shown


_VALUE_REPR = _value_repr()


def _expanded_size(node: Any, seen: dict[int, int]) -> int:
    """How many values ``node`` holds once every alias is expanded (shared nodes counted once
    per use, each computed once)."""
    if not isinstance(node, dict | list):
        return 1
    if id(node) not in seen:
        seen[id(node)] = 0  # a recursive alias counts as one value, not forever
        items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        seen[id(node)] = 1 + sum(_expanded_size(item, seen) for item in items)
    return seen[id(node)]


def _oversized_keys(node: dict[Any, Any], prefix: str, seen: dict[int, int]) -> list[str]:
    """The deepest keys whose values alone expand past :data:`MAX_EXPANDED_VALUES`."""
    found: list[str] = []
    for key, value in node.items():
        if _expanded_size(value, seen) > MAX_EXPANDED_VALUES:
            name = f"{prefix}{key}"
            inner = _oversized_keys(value, f"{name}.", seen) if isinstance(value, dict) else []
            found += inner or [name]
    return found


def refuse_alias_bombs(raw: dict[Any, Any], source: str) -> None:
    """Refuse a document whose aliases expand past :data:`MAX_EXPANDED_VALUES`, naming its
    keys, before anything walks the expansion."""
    seen: dict[int, int] = {}
    total = _expanded_size(raw, seen)
    if total <= MAX_EXPANDED_VALUES:
        return
    keys = _oversized_keys(raw, "", seen) or [str(key) for key in raw]
    raise ParamsError(
        f"{source}: {', '.join(keys)} expand(s) to {total:,} values through YAML aliases "
        f"(a params file holds at most {MAX_EXPANDED_VALUES:,})",
        fix=f"write the value(s) of {', '.join(keys)} out in {source} without nested aliases",
    )


# Strict types: lax coercion reads `batch_size: true` as 1, `"3"` as 3 and `1.5` for an int as
# an error but `1.0` as 1, so a typo would train on a value nobody wrote. An int where a float is
# meant (`learning_rate: 1`) still loads; a list where a pair is meant sets `strict=False`
# on that field only (its items stay strict). Every number finite: `.inf` (YAML's infinity)
# overflows where a size becomes bytes (`int(inf * 2**20)` in ingest) and trains on NaN.
STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class StrictModel(BaseModel):
    model_config = STRICT


class SplitFractions(StrictModel):
    train: float = Field(gt=0)
    val: float = Field(gt=0)
    test: float = Field(gt=0)

    @model_validator(mode="after")
    def _sum_to_one(self) -> SplitFractions:
        total = self.train + self.val + self.test
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"the split fractions must sum to 1, got {total:g}")
        return self


class IngestParams(StrictModel):
    source_dir: str = Field(min_length=1)
    labels_csv: str | None  # CSV of `path,label` (paths relative to source_dir)
    splits: SplitFractions
    seed: int
    # larger images are quarantined as "absurd dimensions"
    max_pixels: Annotated[
        int,
        Field(ge=1),
        at_most(200_000_000, 3, "memory per worker to decode one image (8-bit RGB)"),
    ]
    min_side: int = Field(ge=1)
    # larger files are quarantined before they are read
    max_file_mb: Annotated[
        float, Field(gt=0), at_most(1024, MIB, "memory per worker (a file is read whole)")
    ]
    draft_check: bool  # check JPEGs with a 1/8-scale decode (still reads every byte)
    # images whose 64-bit perceptual hashes differ in at most this many bits are
    # near-duplicates and share a split (chosen by `python -m bench --only near_duplicates`)
    near_duplicate_distance: int = Field(ge=0, le=32)
    # reuse a file's content hash while its size, times and inode are unchanged (git, DVC)
    trust_file_stat: bool
    workers: int = Field(ge=1)
    # MiB of decoded images ingest keeps for the shard stage (tasks/contracts/handoff.py); 0: none
    handoff_mb: Annotated[float, Field(ge=0), at_most(65536, MIB, "disk in .shardflow/handoff")]


def _resize_policy(policy: str) -> str:
    """``shard.resize`` is one of the preprocessing's own policies
    (``tasks.images.RESIZE_POLICIES``, the one list of them).

    The module is read by name when a params file is checked, not imported by this one:
    importing it here would load NumPy and Pillow with every params load, and count the
    preprocessing as the code of every stage that reads params (the import contracts keep
    training apart from it; code versions and ``dvc.yaml`` deps would list it). The list is
    only checked against here: changing it changes the preprocessing, which reshards.
    """
    policies: tuple[str, ...] = importlib.import_module("tasks.images").RESIZE_POLICIES
    if policy not in policies:
        *others, last = map(repr, policies)
        raise ValueError(f"Input should be {', '.join(others)} or {last}")  # as for a Literal
    return policy


class ShardParams(StrictModel):
    image_size: tuple[Side, Side] = Field(strict=False)  # [height, width], a YAML list
    # pad: keep aspect, letterbox with black; crop: keep aspect, center-crop; stretch: ignore aspect
    resize: Annotated[str, AfterValidator(_resize_policy)]
    draft_decode: bool  # reduced-size JPEG decoding when the target is <= 1/2 the source
    encoding: Literal["raw", "jpeg", "png"]
    jpeg_quality: int = Field(ge=1, le=100)
    # the object-storage cache holds 2 * storage.prefetch_shards + 1 shards at once
    target_shard_mb: Annotated[
        float, Field(gt=0), at_most(4096, 9 * MIB, "shard cache at the default prefetch")
    ]
    compression: Literal["none", "gzip"]
    seed: int
    workers: int = Field(ge=1)
    runner: Literal["local", "dask"]
    dask_address: str | None
    # with runner dask: an s3://bucket/prefix through which workers that share no file system
    # with the stage get source images and hand back shards (tasks/shard/staging.py)
    staging_url: str | None = Field(pattern=r"^s3://[^/]+(/.*)?$")
    # rebuild: one generation from the index; append: keep the current shards, add a generation
    mode: Literal["rebuild", "append"]

    @field_validator("image_size")
    @classmethod
    def _records_fit_in_memory(cls, size: tuple[int, int]) -> tuple[int, int]:
        height, width = size
        if max(height, width) > MAX_SIDE:
            raise ValueError(
                f"at most {MAX_SIDE} px a side: one record of {height}x{width} needs "
                f"{_bytes(height * width * 3)} of memory (8-bit RGB) in each shard worker and "
                f"{_bytes(height * width * 12)} as a float32 training input"
            )
        return size

    @model_validator(mode="after")
    def _dask_needs_address(self) -> ShardParams:
        if self.runner == "dask" and not self.dask_address:
            raise ValueError("runner 'dask' needs shard.dask_address (e.g. tcp://host:8786)")
        return self


class AugmentParams(StrictModel):
    flip: bool
    crop: Fraction  # max fraction of each side cropped away (then resized back)
    brightness: Fraction
    contrast: Fraction


class TrainParams(StrictModel):
    model: ModelName
    # auto: a GPU when TensorFlow sees one, refused where the driver lists one it does not;
    # cpu: the CPU on purpose (GPUs hidden); gpu: refused without a GPU
    # (tasks/runtime/accelerator.py)
    accelerator: Literal["auto", "cpu", "gpu"]
    weights: str | None  # None, "imagenet", or a path to a local weights file
    fine_tune_layers: int = Field(ge=0)  # top backbone layers unfrozen after the frozen phase
    fine_tune_epochs: int = Field(ge=0)
    epochs: int = Field(ge=1)
    batch_size: int = Field(ge=1)  # bounded by the memory it needs: Params._batch_fits
    learning_rate: float = Field(gt=0)
    lr_schedule: Literal["constant", "cosine"]
    early_stopping_patience: int = Field(ge=0)  # 0 disables early stopping
    seed: int = Field(ge=0, le=2**32 - 1)  # NumPy's seed range (keras.utils.set_random_seed)
    deterministic: bool
    mixed_precision: bool
    xla: bool
    # train steps run by one compiled call: fewer host round trips per step on an accelerator
    steps_per_execution: int = Field(ge=1)
    augment: AugmentParams


class EvaluateParams(StrictModel):
    top_k: int = Field(ge=1)
    promotion_metric: PromotionMetric
    promotion_margin: float = Field(ge=0)
    # the one-sided paired test's level: a smaller advantage's p-value keeps the champion
    promotion_alpha: float = Field(gt=0, lt=1)
    # a challenger of another task (sharing fewer of the champion's classes) is never compared
    min_shared_class_share: float = Field(ge=0, le=1)
    # None: named after the dataset (tasks.runtime.dataset_identity.registered_model_name)
    model_name: Annotated[str, Field(pattern=MODEL_NAME_PATTERN)] | None
    # Promote even when the champion was measured on different test data (not comparable).
    allow_incomparable_promotion: bool
    # Fewer current test records that neither model trained or validated on: the champion
    # and the challenger are not comparable (tasks/evaluate/seen_records.py).
    min_unseen_records: int = Field(ge=1)
    # The label review's line between a likely label error and a model confusion: the
    # held-out recall and precision the model must reach on both the given and the suggested
    # class to judge between them (tasks/evaluate/label_review.py).
    min_class_review_accuracy: float = Field(ge=0, le=1)


class WorkspaceParams(StrictModel):
    lock_timeout_s: float = Field(gt=0)  # how long a second writer waits for the lock


class StorageParams(StrictModel):
    """How training and evaluation read shards from object storage (``SHARDFLOW_SHARDS_URL``).

    Where shards are read from never changes what is computed, so no stage depends on these.
    """

    # the local shard cache's bound (.shardflow/shard_cache)
    cache_mb: Annotated[
        float, Field(gt=0), at_most(1_048_576, MIB, "disk in .shardflow/shard_cache")
    ]
    # shards downloaded in parallel ahead of the reader; the cache holds twice as many plus one
    prefetch_shards: Annotated[
        int, Field(ge=1), at_most(64, 2 * 4 * MIB, "shard cache at the default shard size")
    ]


class ClusterParams(StrictModel):
    """How the workers of a multi-worker training run (``SHARDFLOW_TRAIN_WORKERS``, a
    platform's ``TF_CONFIG``) wait for one another. Where training runs never changes what
    is computed, so no stage depends on these."""

    # how long a worker waits for the others to join the cluster, then for all to reach
    # training (the chief gates the shards and opens its MLflow run first); past it, it fails
    # naming why instead of waiting for a chief that failed or never started
    join_timeout_s: float = Field(gt=0)


class CheckpointParams(StrictModel):
    """How often training saves where it stands inside an epoch (``tasks.train.backup``).
    A save changes when a killed run resumes, never what it computes, so no stage and no
    backup's identity depends on these: changing them never retrains."""

    # steps between mid-epoch saves, counted from the epoch's start and rounded up to whole
    # compiled calls (train.steps_per_execution); 0: only at epoch ends and on SIGTERM
    every_steps: int = Field(ge=0)


class ValidateParams(StrictModel):
    """Limits on how much a data change may move the dataset before validation fails."""

    # largest allowed change of any class's share of all records (0.05 = 5 points)
    max_class_share_shift: float = Field(ge=0, le=1)
    # largest allowed loss of records, as a share of the accepted version's (0.25 = a quarter)
    max_record_drop: float = Field(ge=0, le=1)
    allow_new_classes: bool


class Params(StrictModel):
    # `validate` would shadow BaseModel.validate: the field is `validate_`, spelled
    # `validate` in params.yaml.
    model_config = ConfigDict(**STRICT, populate_by_name=True)

    ingest: IngestParams
    shard: ShardParams
    validate_: ValidateParams = Field(alias="validate")
    train: TrainParams
    evaluate: EvaluateParams
    workspace: WorkspaceParams
    storage: StorageParams
    cluster: ClusterParams
    checkpoint: CheckpointParams

    @model_validator(mode="after")
    def _backbone_options_need_a_backbone(self) -> Params:
        """small_cnn has no backbone: weights it would ignore and a fine-tuning phase that
        unfreezes nothing (it trained on at a tenth of the rate) are refused."""
        if self.train.model != "small_cnn":
            return self
        options = {
            "train.weights": self.train.weights,
            "train.fine_tune_layers": self.train.fine_tune_layers or None,
            "train.fine_tune_epochs": self.train.fine_tune_epochs or None,
        }
        given = [f"{key}={value!r}" for key, value in options.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: train.model 'small_cnn' has no pretrained backbone to "
                "load or fine-tune; set a transfer model (mobilenet_v3_small, efficientnet_b0) "
                "or weights null and both fine_tune keys 0"
            )
        return self

    @model_validator(mode="after")
    def _whole_network_models_have_no_frozen_phase(self) -> Params:
        """resnet50 trains every layer from the start: a fine-tuning phase has nothing
        frozen to unfreeze."""
        train = self.train
        if train.model == "resnet50" and (train.fine_tune_layers or train.fine_tune_epochs):
            raise ValueError(
                f"train.fine_tune_layers={train.fine_tune_layers}, train.fine_tune_epochs="
                f"{train.fine_tune_epochs}: train.model 'resnet50' trains the whole network "
                "from the first epoch; set both fine_tune keys 0"
            )
        return self

    @model_validator(mode="after")
    def _batch_fits(self) -> Params:
        """A batch of float32 inputs past :data:`MAX_BATCH_BYTES` is refused naming the bytes
        it needs, before a run allocates it and is killed for memory."""
        height, width = self.shard.image_size
        needed = self.train.batch_size * height * width * 3 * 4
        if needed > MAX_BATCH_BYTES:
            raise ValueError(
                f"train.batch_size {self.train.batch_size} of shard.image_size [{height}, "
                f"{width}] needs {_bytes(needed)} of memory for one float32 input batch (at "
                f"most {_bytes(MAX_BATCH_BYTES)}): lower train.batch_size or shard.image_size"
            )
        return self

    @model_validator(mode="after")
    def _backbone_fits_the_images(self) -> Params:
        """A backbone model on shards it cannot take failed in Keras, naming no param, only
        once ingest, shard and validate had run."""
        height, width = self.shard.image_size
        if self.train.model != "small_cnn" and min(height, width) < BACKBONE_MIN_SIDE:
            raise ValueError(
                f"train.model {self.train.model!r} takes images of at least "
                f"{BACKBONE_MIN_SIDE} px a side, and shard.image_size is [{height}, {width}]: "
                "raise shard.image_size (the shards are rebuilt) or set train.model small_cnn"
            )
        return self


def load_params(
    path: str | Path = DEFAULT_PARAMS_PATH, overrides: dict[str, Any] | None = None
) -> Params:
    """Parse ``params.yaml`` (plus optional nested overrides) into checked, typed params."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(
            f"{path}: params file not found (params.yaml holds every setting)",
            fix=f"git checkout -- {path.name}   (run from the repository root)",
        )
    return parse_params(path.read_text(), source=str(path), overrides=overrides)


def parse_params(text: str, *, source: str, overrides: dict[str, Any] | None = None) -> Params:
    """Checked, typed params from the text of a ``params.yaml`` (``source`` names it)."""
    try:
        raw = read_yaml(text)  # a safe loader: no Python objects
    except YAMLError as error:
        raise ParamsError(f"{source}: not valid YAML: {error}") from error
    if not raw or not isinstance(raw, dict):
        raise ParamsError(f"{source}: empty or not a mapping of sections (ingest, shard, ...)")
    refuse_alias_bombs(raw, source)
    if overrides:
        raw = deep_merge(raw, overrides)
    return validate_params(raw, source=source)


@functools.cache
def shipped_params_text() -> str:
    """The project's ``params.yaml`` as committed at the checkout's HEAD: the defaults as
    shipped, whatever the working copy's file says now (a user's own source_dir, model or
    sizes). Where the checkout has no history (an unpacked archive), the file itself."""
    try:
        return subprocess.run(
            ["git", "show", f"HEAD:{REPO_PARAMS_PATH.name}"],
            cwd=REPO_PARAMS_PATH.parent,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return REPO_PARAMS_PATH.read_text()


def default_params(**sections: dict[str, Any]) -> Params:
    """The shipped ``params.yaml`` (:func:`shipped_params_text`) with some keys changed:
    defaults for tests and bench, never the working copy's edits."""
    return parse_params(
        shipped_params_text(), source=f"{REPO_PARAMS_PATH} at HEAD", overrides=sections or None
    )


def validate_params(raw: dict[str, Any], *, source: str) -> Params:
    """``Params`` from a mapping, or a :class:`ParamsError` listing every bad key of it."""
    try:
        return Params.model_validate(raw)
    except ValidationError as error:
        problems = [_describe(problem) for problem in error.errors()]
        raise ParamsError(
            f"{source}: {len(problems)} invalid param(s):\n  " + "\n  ".join(problems)
        ) from None


def _describe(problem: Any) -> str:
    """One pydantic error as ``train.epochs = 0: Input should be greater than ...``."""
    key = ".".join(str(part) for part in problem["loc"])
    message = str(problem["msg"]).removeprefix("Value error, ")
    if not key:  # a check across sections names its keys itself
        return message
    if problem["type"] == "missing":
        return f"{key}: missing (every key must be set in the params file)"
    value = _VALUE_REPR.repr(problem["input"])
    if problem["type"] == "extra_forbidden":
        return f"{key} = {value}: unknown key"
    return f"{key} = {value}: {message}"


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
    return flat_keys(section.model_dump(), prefix)


def flat_keys(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flat_keys(value, name))
        else:
            out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tasks.runtime.params check [FILE]``: load the params file (default params.yaml)
    as every stage does; a bad key is refused naming the file, the key and the fix."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tasks.runtime.params", description=main.__doc__
    )
    parser.add_argument("command", choices=("check",))
    parser.add_argument("file", nargs="?", default=DEFAULT_PARAMS_PATH, help="default: params.yaml")
    args = parser.parse_args(argv)
    load_params(args.file)
    return 0


if __name__ == "__main__":
    import sys

    from tasks.runtime.refusals import refusing

    sys.exit(refusing(main, "params.yaml"))
