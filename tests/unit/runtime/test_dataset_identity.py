import re
from pathlib import Path

import pytest

from tasks.runtime.dataset_identity import dataset_identity, dataset_slug
from tasks.runtime.refusals import Refused


def test_identity_is_repository_relative_whatever_the_spelling(tmp_path: Path) -> None:
    as_written = dataset_identity("data/photos", None, tmp_path)
    assert as_written == "data/photos"
    assert dataset_identity("./data/photos/", None, tmp_path) == as_written
    assert dataset_identity(str(tmp_path / "data" / "photos"), None, tmp_path) == as_written


def test_identity_of_two_clones_agrees(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    assert dataset_identity("data/demo", None, first) == dataset_identity("data/demo", None, second)


def test_labels_csv_is_part_of_the_identity(tmp_path: Path) -> None:
    plain = dataset_identity("data/photos", None, tmp_path)
    with_csv = dataset_identity("data/photos", "labels.csv", tmp_path)
    assert with_csv != plain and with_csv.endswith("::labels.csv")


def test_outside_the_repository_stays_absolute(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    assert dataset_identity(str(tmp_path / "elsewhere"), None, repo) == str(tmp_path / "elsewhere")


def test_slug_is_a_model_name_and_tells_folders_apart() -> None:
    one, other = dataset_slug("data/Cats & Dogs"), dataset_slug("other/cats-dogs")
    assert one.startswith("cats-dogs-") and other.startswith("cats-dogs-")
    assert one != other
    assert dataset_slug("data/photos::labels.csv").startswith("photos-labels-")


def test_refusal_carries_its_fix() -> None:
    with pytest.raises(Refused) as caught:
        raise Refused("shards not validated", fix="run `make run`")
    assert str(caught.value) == "shards not validated" and caught.value.fix == "run `make run`"
    assert Refused("plain").fix is None


def test_a_new_dataset_gets_a_registered_model_of_its_own(tmp_path: Path) -> None:
    """evaluate.model_name: null names the model after the dataset; the demo's data keeps
    `shardflow` (its champion stays where it was), and a name that is set wins."""
    from tasks.runtime.dataset_identity import registered_model_name
    from tasks.runtime.params import MODEL_NAME_PATTERN

    assert registered_model_name(None, "data/demo", None, tmp_path) == "shardflow"
    assert registered_model_name(None, "./data/demo/", None, tmp_path) == "shardflow"
    photos = registered_model_name(None, "data/photos", None, tmp_path)
    assert photos == f"shardflow-{dataset_slug('data/photos')}"
    with_csv = registered_model_name(None, "data/demo", "labels.csv", tmp_path)
    assert with_csv not in ("shardflow", photos)
    assert re.match(MODEL_NAME_PATTERN, photos) and re.match(MODEL_NAME_PATTERN, with_csv)
    assert registered_model_name("team-model", "data/photos", None, tmp_path) == "team-model"
