"""params.yaml is the one source of defaults, and every key is checked before anything runs."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tasks.runtime.params import (
    REPO_PARAMS_PATH,
    AugmentParams,
    CheckpointParams,
    EvaluateParams,
    IngestParams,
    Params,
    ParamsError,
    ShardParams,
    SplitFractions,
    TrainParams,
    WorkspaceParams,
    default_params,
    load_params,
    shipped_params_text,
)
from tasks.runtime.run_overrides import ParamOverrides, apply_overrides

REPO_RAW: dict[str, Any] = yaml.safe_load(shipped_params_text())


def dotted_keys(raw: dict[str, Any], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for key, value in raw.items():
        name = f"{prefix}{key}"
        keys += dotted_keys(value, f"{name}.") if isinstance(value, dict) else [name]
    return keys


def with_value(key: str, value: Any) -> dict[str, Any]:
    """The repository's params with one dotted key set (or removed, for ``...``)."""
    raw = copy.deepcopy(REPO_RAW)
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node[part]
    if value is ...:
        del node[leaf]
    else:
        node[leaf] = value
    return raw


def write(tmp_path: Path, raw: Any) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# -- no code defaults ------------------------------------------------------------------------


def test_missing_params_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"params\.yaml: params file not found"):
        load_params(tmp_path / "params.yaml")


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "null\n", "[1, 2]\n"])
def test_empty_params_file_is_an_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError, match=r"params\.yaml: empty or not a mapping"):
        load_params(path)


@pytest.mark.parametrize("key", dotted_keys(REPO_RAW))
def test_every_key_is_required(tmp_path: Path, key: str) -> None:
    path = write(tmp_path, with_value(key, ...))
    with pytest.raises(ParamsError) as error:
        load_params(path)
    assert f"{key}: missing" in str(error.value)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    "model",
    [
        Params,
        IngestParams,
        SplitFractions,
        ShardParams,
        TrainParams,
        AugmentParams,
        EvaluateParams,
        WorkspaceParams,
        CheckpointParams,
    ],
)
def test_code_has_no_defaults(model: type[Params]) -> None:
    with_default = [name for name, f in model.model_fields.items() if not f.is_required()]
    assert with_default == []


def test_repository_params_hold_the_new_keys() -> None:
    params = default_params()
    assert params.ingest.max_file_mb == 64
    assert params.evaluate.allow_incomparable_promotion is False
    assert params.workspace.lock_timeout_s == 600


# -- types, ranges, choices ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("train.epochs", 0, "greater than or equal to 1"),
        ("train.batch_size", 0, "greater than or equal to 1"),
        ("ingest.workers", 0, "greater than or equal to 1"),
        ("shard.workers", -2, "greater than or equal to 1"),
        ("shard.image_size.1", 4, "greater than or equal to 8"),
        ("train.learning_rate", 0.0, "greater than 0"),
        ("shard.target_shard_mb", 0, "greater than 0"),
        ("ingest.splits.test", 0.0, "greater than 0"),
        ("evaluate.promotion_margin", -0.01, "greater than or equal to 0"),
        ("ingest.max_pixels", 0, "greater than or equal to 1"),
        ("ingest.min_side", 0, "greater than or equal to 1"),
        ("ingest.max_file_mb", 0, "greater than 0"),
        ("ingest.seed", 1.5, "valid integer"),
        ("shard.jpeg_quality", 101, "less than or equal to 100"),
        ("evaluate.top_k", 0, "greater than or equal to 1"),
        ("train.early_stopping_patience", -1, "greater than or equal to 0"),
        ("train.fine_tune_layers", -1, "greater than or equal to 0"),
        ("train.fine_tune_epochs", -1, "greater than or equal to 0"),
        # NumPy's seed range: outside it training failed at its first line, the key unnamed
        ("train.seed", -1, "greater than or equal to 0"),
        ("train.seed", 2**32, "less than or equal to 4294967295"),
        # YAML's .inf: ingest failed converting it to bytes, training ran on NaN
        ("ingest.max_file_mb", float("inf"), "finite number"),
        ("ingest.handoff_mb", float("inf"), "finite number"),
        ("train.learning_rate", float("inf"), "finite number"),
        ("train.augment.crop", 1.0, "less than 1"),
        ("train.augment.brightness", -0.1, "greater than or equal to 0"),
        ("workspace.lock_timeout_s", 0, "greater than 0"),
        ("checkpoint.every_steps", -1, "greater than or equal to 0"),
        ("checkpoint.every_steps", 2.5, "valid integer"),
        ("train.model", "resnet9000", "'efficientnet_b0' or 'resnet50'"),
        (
            "evaluate.promotion_metric",
            "f1",
            "'accuracy', 'top_k_accuracy', 'macro_precision', 'macro_recall' or 'macro_f1'",
        ),
        ("shard.encoding", "webp", "'raw', 'jpeg' or 'png'"),
        ("shard.resize", "squash", "'pad', 'crop' or 'stretch'"),
        ("shard.compression", "zstd", "'none' or 'gzip'"),
        ("shard.runner", "ssh", "'local' or 'dask'"),
        ("train.lr_schedule", "step", "'constant' or 'cosine'"),
    ],
)
def test_bad_value_names_key_value_and_what_is_allowed(
    tmp_path: Path, key: str, value: Any, allowed: str
) -> None:
    raw = copy.deepcopy(REPO_RAW)
    if key == "shard.image_size.1":
        raw["shard"]["image_size"] = [64, value]
    else:
        raw = with_value(key, value)
    path = write(tmp_path, raw)
    with pytest.raises(ParamsError) as error:
        load_params(path)
    message = str(error.value)
    assert f"{key} = {value!r}: " in message
    assert allowed in message
    assert message.startswith(f"{path}: 1 invalid param")


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        # lax parsing read each of these as a number or a switch nobody wrote
        ("train.batch_size", True, "valid integer"),
        ("train.batch_size", "3", "valid integer"),
        ("train.epochs", 1.0, "valid integer"),
        ("ingest.workers", "2", "valid integer"),
        ("shard.seed", False, "valid integer"),
        ("train.learning_rate", "0.01", "valid number"),
        ("train.learning_rate", True, "valid number"),
        ("ingest.max_file_mb", "64", "valid number"),
        ("train.augment.flip", 1, "valid boolean"),
        ("train.augment.flip", "yes", "valid boolean"),
        ("train.deterministic", "true", "valid boolean"),
        ("evaluate.allow_incomparable_promotion", 0, "valid boolean"),
        ("train.augment.crop", "0.1", "valid number"),
    ],
)
def test_numbers_and_switches_are_not_coerced_from_other_types(
    tmp_path: Path, key: str, value: Any, allowed: str
) -> None:
    path = write(tmp_path, with_value(key, value))
    with pytest.raises(ParamsError) as error:
        load_params(path)
    assert f"{key} = {value!r}: Input should be a {allowed}" in str(error.value)


@pytest.mark.parametrize("side", [64.0, "64", True])
def test_image_size_is_a_list_of_integers(tmp_path: Path, side: Any) -> None:
    path = write(tmp_path, with_value("shard.image_size", [64, side]))
    with pytest.raises(ParamsError, match=re.escape(f"shard.image_size.1 = {side!r}: ")):
        load_params(path)


def test_numbers_written_the_ways_yaml_and_dvc_write_them_still_load(tmp_path: Path) -> None:
    """An int where a float is meant, a pair as a YAML list, an exponent without a dot
    (YAML 1.2, as DVC reads and `dvc exp run -S` takes it) all mean what they say."""
    text = shipped_params_text()
    text = text.replace("learning_rate: 0.002", "learning_rate: 2e-3")
    text = text.replace("lock_timeout_s: 600", "lock_timeout_s: 6E+2")
    text = text.replace("promotion_margin: 0.0", "promotion_margin: 0")
    path = tmp_path / "params.yaml"
    path.write_text(text)
    params = load_params(path)
    assert params.train.learning_rate == 0.002
    assert params.workspace.lock_timeout_s == 600.0
    assert params.evaluate.promotion_margin == 0.0
    assert params.shard.image_size == (64, 64)
    assert default_params(train={"learning_rate": 1}).train.learning_rate == 1.0
    path.write_text(text.replace("learning_rate: 2e-3", 'learning_rate: "2e-3"'))
    with pytest.raises(ParamsError, match=re.escape("train.learning_rate = '2e-3': ")):
        load_params(path)  # a quoted one is text


def test_a_yaml_11_switch_word_is_text_as_dvc_reads_it(tmp_path: Path) -> None:
    """`flip: yes` is the word "yes" to DVC (YAML 1.2: `dvc params diff` and `dvc exp show`
    show it so); the pipeline reads the file the same way and refuses it naming the key,
    where YAML 1.1 had trained with flipping on."""
    from dvc.utils.serialize import load_yaml

    path = tmp_path / "params.yaml"
    path.write_text(shipped_params_text().replace("flip: true", "flip: yes"))
    assert load_yaml(path)["train"]["augment"]["flip"] == "yes"
    with pytest.raises(ParamsError, match=re.escape("train.augment.flip = 'yes': ")):
        load_params(path)


def test_values_dvc_exp_run_sets_load_and_a_quoted_number_is_refused(params_file: Path) -> None:
    """`dvc exp run -S key=value` writes params.yaml through DVC's own override parser and
    YAML writer: the numbers it writes load as numbers under the strict types."""
    from dvc.utils.hydra import apply_overrides as dvc_set

    settings = ["train.learning_rate=1e-3", "train.batch_size=32", "shard.image_size=[32,48]"]
    dvc_set(str(params_file), [*settings, "train.augment.flip=false", "ingest.max_file_mb=10"])
    params = load_params(params_file)
    assert params.train.learning_rate == 0.001 and params.train.batch_size == 32
    assert params.shard.image_size == (32, 48) and params.train.augment.flip is False
    assert params.ingest.max_file_mb == 10.0
    dvc_set(str(params_file), ["train.batch_size='32'"])  # quoted on the command line: text
    with pytest.raises(ParamsError, match=re.escape("train.batch_size = '32': ")):
        load_params(params_file)


def test_overrides_are_as_strict_as_the_file() -> None:
    with pytest.raises(ValidationError) as error:
        ParamOverrides.model_validate({"train": {"batch_size": "32", "augment": {"flip": 1}}})
    assert {tuple(e["loc"]) for e in error.value.errors()} == {
        ("train", "batch_size"),
        ("train", "augment", "flip"),
    }
    accepted = ParamOverrides.model_validate(
        {"shard": {"image_size": [32, 32]}, "train": {"learning_rate": 1}}
    )
    assert accepted.as_dict() == {
        "shard": {"image_size": [32, 32]},
        "train": {"learning_rate": 1.0},
    }


def test_splits_must_sum_to_one(tmp_path: Path) -> None:
    path = write(tmp_path, with_value("ingest.splits", {"train": 0.8, "val": 0.1, "test": 0.2}))
    with pytest.raises(ParamsError, match=r"ingest\.splits = .*must sum to 1, got 1\.1"):
        load_params(path)


def test_a_backbone_on_images_it_cannot_take_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    raw = with_value("train.model", "mobilenet_v3_small")
    raw["shard"]["image_size"] = [64, 16]
    with pytest.raises(ParamsError) as error:
        load_params(write(tmp_path, raw))
    message = str(error.value)
    assert "train.model 'mobilenet_v3_small' takes images of at least 32 px a side" in message
    assert "shard.image_size is [64, 16]" in message
    assert "source_dir" not in message  # the keys named, not the whole file dumped
    raw["shard"]["image_size"] = [32, 48]
    assert load_params(write(tmp_path, raw)).train.model == "mobilenet_v3_small"
    raw["train"]["model"], raw["shard"]["image_size"] = "small_cnn", [16, 16]
    assert load_params(write(tmp_path, raw)).shard.image_size == (16, 16)


@pytest.mark.parametrize(
    ("train", "named"),
    [
        ({"weights": "imagenet"}, "train.weights='imagenet'"),
        ({"fine_tune_layers": 5, "fine_tune_epochs": 2}, "train.fine_tune_layers=5, train.f"),
        ({"fine_tune_epochs": 3}, "train.fine_tune_epochs=3"),
    ],
)
def test_backbone_options_on_the_small_cnn_are_refused(
    tmp_path: Path, train: dict[str, Any], named: str
) -> None:
    """They were ignored (weights), or trained on at a tenth of the rate unfreezing nothing."""
    raw = copy.deepcopy(REPO_RAW)
    raw["train"].update(model="small_cnn", **train)
    with pytest.raises(ParamsError) as error:
        load_params(write(tmp_path, raw))
    message = str(error.value)
    assert named in message and "'small_cnn' has no pretrained backbone" in message
    assert "learning_rate" not in message  # the keys named, not the section dumped
    raw["train"]["model"] = "mobilenet_v3_small"
    assert load_params(write(tmp_path, raw)).train.model == "mobilenet_v3_small"


def test_dask_runner_needs_an_address_before_anything_runs(tmp_path: Path) -> None:
    path = write(tmp_path, with_value("shard.runner", "dask"))
    with pytest.raises(ParamsError, match=r"shard = .*runner 'dask' needs shard\.dask_address"):
        load_params(path)


def test_every_bad_key_is_listed_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    raw = with_value("train.epochs", 0)
    raw["shard"]["encoding"] = "webp"
    raw["train"]["epochz"] = 3
    with pytest.raises(ParamsError) as error:
        load_params(write(tmp_path, raw))
    message = str(error.value)
    assert "3 invalid param(s)" in message
    assert "train.epochs = 0" in message and "shard.encoding = 'webp'" in message
    assert "train.epochz = 3: unknown key" in message


def test_overrides_are_checked_like_the_file() -> None:
    with pytest.raises(ParamsError, match=r"train\.batch_size = 0"):
        default_params(train={"batch_size": 0})


# -- overrides written into params.yaml ------------------------------------------------------


@pytest.fixture
def params_file(tmp_path: Path) -> Path:
    path = tmp_path / "params.yaml"
    text = shipped_params_text().replace(
        "augment: {flip: true, crop: 0.1, brightness: 0.1, contrast: 0.1}",
        "augment: {flip: true, crop: 0.3, brightness: 0.2, contrast: 0.05}",
    )
    path.write_text(text)
    return path


def test_nested_partial_override_changes_that_key_only(params_file: Path) -> None:
    overrides = ParamOverrides.model_validate({"train": {"augment": {"flip": False}}})
    assert overrides.as_dict() == {"train": {"augment": {"flip": False}}}
    merged = apply_overrides(params_file, overrides.as_dict())
    expected = AugmentParams(flip=False, crop=0.3, brightness=0.2, contrast=0.05)
    assert merged.train.augment == expected
    assert load_params(params_file).train.augment == expected
    assert "# tf op determinism" in params_file.read_text()  # comments kept


def test_partial_splits_override_is_checked_against_the_file(params_file: Path) -> None:
    before = params_file.read_bytes()
    overrides = ParamOverrides.model_validate({"ingest": {"splits": {"val": 0.2}}})
    with pytest.raises(ParamsError, match="must sum to 1"):
        apply_overrides(params_file, overrides.as_dict())
    assert params_file.read_bytes() == before


def test_params_file_is_replaced_whole_never_rewritten_in_place(params_file: Path) -> None:
    before = params_file.read_text()
    with params_file.open() as reader:  # a reader that opened the file before the write
        apply_overrides(params_file, {"train": {"epochs": 3}})
        assert reader.read() == before  # still the whole old file, never a truncated one
    assert load_params(params_file).train.epochs == 3
    assert [p.name for p in params_file.parent.iterdir()] == ["params.yaml"]  # no temp left


def test_failed_write_leaves_params_file_intact(
    params_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ruamel.yaml import YAML

    real_dump = YAML.dump

    def dump_then_fail(self: YAML, data: Any, stream: Any) -> None:
        real_dump(self, {"ingest": data["ingest"]}, stream)  # part of the document, then...
        raise OSError("disk full")

    monkeypatch.setattr(YAML, "dump", dump_then_fail)
    before = params_file.read_bytes()
    with pytest.raises(OSError, match="disk full"):
        apply_overrides(params_file, {"train": {"epochs": 3}})
    assert params_file.read_bytes() == before
    assert sorted(os.listdir(params_file.parent)) == ["params.yaml"]


@pytest.mark.parametrize("url", ["/mnt/staging", "s3:/bucket", "gs://bucket/prefix", ""])
def test_staging_url_must_name_an_s3_prefix(tmp_path: Path, url: str) -> None:
    path = write(tmp_path, with_value("shard.staging_url", url))
    with pytest.raises(ParamsError, match=re.escape(f"shard.staging_url = {url!r}: ")):
        load_params(path)
    assert load_params(write(tmp_path, with_value("shard.staging_url", "s3://b/p"))).shard


# -- hostile params: alias bombs and sizes past memory ---------------------------------------


# the thread method: the walk that hung runs in pydantic's compiled core, deaf to signals
@pytest.mark.timeout(60, method="thread")
def test_an_alias_bomb_is_refused_at_once_naming_its_keys(tmp_path: Path) -> None:
    # nine levels of nine aliases: under a billion values from ten lines, which validating
    # or formatting the error walked for good
    levels = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 9):
        before, name = chr(ord("a") + level - 1), chr(ord("a") + level)
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{before}"] * 9) + "]")
    text = shipped_params_text().replace("source_dir: data/demo", "source_dir: *i")
    path = tmp_path / "params.yaml"
    path.write_text("lols:\n" + "".join(f"  {line}\n" for line in levels) + text)
    with pytest.raises(ParamsError) as error:
        load_params(path)
    message = str(error.value)
    assert "lols.i" in message and "ingest.source_dir" in message
    expanded = re.search(r"expand\(s\) to ([\d,]+) values", message)
    assert expanded and int(expanded.group(1).replace(",", "")) > 9**9  # the bomb, counted
    assert error.value.fix is not None and "ingest.source_dir" in error.value.fix


def test_aliases_within_the_bound_still_load(tmp_path: Path) -> None:
    text = shipped_params_text().replace("seed: 1337", "seed: &s 7", 1)
    text = text.replace("seed: 1337", "seed: *s", 1)
    path = tmp_path / "params.yaml"
    path.write_text(text)
    params = load_params(path)
    assert params.ingest.seed == params.shard.seed == 7


def test_a_long_bad_value_is_shown_shortened(tmp_path: Path) -> None:
    path = write(tmp_path, with_value("shard.resize", "x" * 100_000))
    with pytest.raises(ParamsError) as error:
        load_params(path)
    assert "shard.resize = 'xxx" in str(error.value)
    assert len(str(error.value)) < 1_000


@pytest.mark.parametrize(
    ("key", "value", "memory"),
    [
        ("shard.image_size", [100000, 100000], "27.9 GiB of memory (8-bit RGB) in each shard"),
        ("ingest.max_pixels", 10**12, "2,794.0 GiB of memory per worker to decode one image"),
        ("ingest.max_file_mb", 1e6, "976.6 GiB of memory per worker (a file is read whole)"),
        ("ingest.handoff_mb", 1e9, "976,562.5 GiB of disk in .shardflow/handoff"),
        ("shard.target_shard_mb", 1e6, "8,789.1 GiB of shard cache"),
        ("storage.cache_mb", 1e9, "976,562.5 GiB of disk in .shardflow/shard_cache"),
        ("storage.prefetch_shards", 1000, "7.8 GiB of shard cache"),
        ("train.batch_size", 10**6, "45.8 GiB of memory for one float32 input batch"),
    ],
)
def test_every_size_param_has_a_bound_naming_what_it_would_need(
    tmp_path: Path, key: str, value: Any, memory: str
) -> None:
    path = write(tmp_path, with_value(key, value))
    with pytest.raises(ParamsError) as error:
        load_params(path)
    message = str(error.value)
    assert key in message and memory in message


def test_the_resize_policies_are_the_preprocessings_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shard.resize`` takes what ``tasks.images.RESIZE_POLICIES`` lists, a second list of
    them nowhere: a policy added there is a valid param, one not there is refused naming those
    that are."""
    import tasks.images

    path = write(tmp_path, with_value("shard.resize", "fit"))
    with pytest.raises(ParamsError, match=r"shard\.resize = 'fit': .*'pad', 'crop' or 'stretch'"):
        load_params(path)
    monkeypatch.setattr(tasks.images, "RESIZE_POLICIES", (*tasks.images.RESIZE_POLICIES, "fit"))
    assert load_params(path).shard.resize == "fit"


# -- settings no stage depends on ------------------------------------------------------------


def stage_param_values(dvc_yaml: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """What DVC hashes as each stage's params: the value of every key its ``params:`` names
    (a section or a dotted key of params.yaml), by stage."""

    def value(key: str) -> Any:
        node: Any = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    values: dict[str, Any] = {}
    for name, stage in dvc_yaml["stages"].items():
        keys = [key for key in stage.get("params", []) if isinstance(key, str)]
        values[name] = {key: value(key) for key in keys}
    return values


def test_the_checkpoint_interval_is_no_stages_param() -> None:
    """Saving more or less often inside an epoch never reruns a stage (nor retrains)."""
    dvc_yaml = yaml.safe_load((REPO_PARAMS_PATH.parent / "dvc.yaml").read_text())
    often, rarely = (
        with_value("checkpoint.every_steps", 1),
        with_value("checkpoint.every_steps", 500),
    )
    assert stage_param_values(dvc_yaml, often) == stage_param_values(dvc_yaml, rarely)
    assert Params.model_validate(often).train == Params.model_validate(rarely).train
