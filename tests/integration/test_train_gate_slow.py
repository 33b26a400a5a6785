"""The validation gate: training (and evaluation) refuse shards no passing report vouches for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.contracts.manifest import load_manifest
from tasks.contracts.validated_shards import ShardsNotValidated, check_validated
from tasks.runtime.layout import Layout
from tasks.runtime.params import ParamsError, default_params
from tasks.train.stage import run_train, train
from tests.tiny_shards import write_tiny_shards, write_validation_report

pytestmark = pytest.mark.slow


def gate(root: Path) -> object:
    layout = Layout(root)
    return check_validated(layout.shards_dir, layout.validation_report)


def test_passing_report_for_these_shards_opens_the_gate(tiny_shards: Path) -> None:
    manifest = gate(tiny_shards)
    assert manifest == load_manifest(tiny_shards / "data" / "shards")


def test_missing_report_is_refused(tiny_shards: Path) -> None:
    (tiny_shards / "reports" / "validation.json").unlink()
    with pytest.raises(ShardsNotValidated, match=r"no validation report.*validate stage"):
        gate(tiny_shards)


def test_failed_report_names_the_failed_checks(tiny_shards: Path) -> None:
    fingerprint = load_manifest(tiny_shards / "data" / "shards").fingerprint
    write_validation_report(tiny_shards, fingerprint, passed=False, failed_check="leakage")
    with pytest.raises(ShardsNotValidated, match=r"validation failed.*leakage") as error:
        gate(tiny_shards)
    assert "record_count" not in str(error.value)  # only failed checks are listed


def test_shards_rewritten_after_validation_are_refused(tiny_shards: Path) -> None:
    report = tiny_shards / "reports" / "validation.json"
    old = report.read_text()
    write_tiny_shards(tiny_shards, seed=7, validated=False)  # new content, new fingerprint
    assert (
        json.loads(old)["fingerprint"] != load_manifest(tiny_shards / "data" / "shards").fingerprint
    )
    with pytest.raises(ShardsNotValidated, match="changed since validation"):
        gate(tiny_shards)


def test_shard_file_edited_behind_the_manifest_is_refused(tiny_shards: Path) -> None:
    shard = next((tiny_shards / "data" / "shards").glob("train.tfrecord-*[0-9]"))
    with shard.open("ab") as handle:
        handle.write(b"extra")
    with pytest.raises(ShardsNotValidated, match=f"changed since validation.*{shard.name}"):
        gate(tiny_shards)


def flip_one_byte(shards_dir: Path) -> Path:
    """Flip a byte in the middle of a train shard: same size, other content."""
    shard = sorted(shards_dir.glob("train.tfrecord-*[0-9]"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def test_same_size_edit_after_validation_is_refused(tiny_shards: Path) -> None:
    shard = flip_one_byte(tiny_shards / "data" / "shards")
    with pytest.raises(
        ShardsNotValidated, match=rf"changed since validation.*{shard.name}.*sha256"
    ):
        gate(tiny_shards)


def test_hand_edited_manifest_is_refused(tiny_shards: Path) -> None:
    path = tiny_shards / "data" / "shards" / "manifest.json"
    data = json.loads(path.read_text())
    data["classes"][0] = "crimson"
    path.write_text(json.dumps(data))
    with pytest.raises(ShardsNotValidated, match="fingerprint does not match"):
        gate(tiny_shards)


def test_run_train_refuses_before_tracking_or_training(tiny_shards: Path, mlflow_uri: str) -> None:
    (tiny_shards / "reports" / "validation.json").unlink()
    layout = Layout(tiny_shards)
    with pytest.raises(ShardsNotValidated):
        run_train(default_params(train={"epochs": 1, "batch_size": 16}), layout)
    assert not layout.model_file.exists()
    assert not (tiny_shards / "mlflow.db").exists()  # no run was opened


@pytest.mark.parametrize("text", ["", '{"passed": tru', "[]"], ids=["empty", "torn", "a list"])
def test_an_unreadable_report_is_refused_naming_it(tiny_shards: Path, text: str) -> None:
    report = tiny_shards / "reports" / "validation.json"
    report.write_text(text)
    with pytest.raises(ShardsNotValidated, match=rf"{report}: not a validation report"):
        gate(tiny_shards)


def test_a_missing_weights_file_is_refused_before_a_run_opens(
    tiny_shards: Path, mlflow_uri: str
) -> None:
    params = default_params(train={"model": "mobilenet_v3_small", "weights": "gone.weights.h5"})
    with pytest.raises(ParamsError, match=r"train\.weights='gone\.weights\.h5'"):
        run_train(params, Layout(tiny_shards))
    assert not (tiny_shards / "mlflow.db").exists()  # no run was opened (and failed)


def test_every_worker_refuses_a_missing_weights_file_before_training_begins(
    tiny_shards: Path,
) -> None:
    """In ``train`` itself, which every worker runs: before its first collective (a worker
    that refused alone would leave the others waiting) and before any backup is claimed."""
    layout = Layout(tiny_shards)
    params = default_params(train={"model": "mobilenet_v3_small", "weights": "gone.weights.h5"})
    with pytest.raises(ParamsError, match=r"train\.weights='gone\.weights\.h5'"):
        train(params.train, layout)
    assert not layout.backup_dir.exists()


def test_a_batch_larger_than_the_train_split_is_refused_before_a_run_opens(
    tiny_shards: Path, mlflow_uri: str
) -> None:
    params = default_params(train={"batch_size": 73})  # the tiny train split holds 72
    with pytest.raises(ParamsError, match=r"train\.batch_size=73 exceeds the 72 train records"):
        run_train(params, Layout(tiny_shards))
    assert not (tiny_shards / "mlflow.db").exists()  # no run was opened (and failed)
