"""One list of models: ``tasks.runtime.params.ModelName`` names them, the builders are keyed
by it, and ``train.model`` takes exactly its names."""

from __future__ import annotations

from typing import get_args

import pytest

from tasks.runtime.params import MODEL_NAMES, ModelName, ParamsError, TrainParams, default_params
from tasks.train.models import BUILDERS


def test_every_model_name_has_a_builder_and_every_builder_a_name() -> None:
    assert list(BUILDERS) == list(MODEL_NAMES) == list(get_args(ModelName))


def test_train_model_takes_the_names_of_the_table() -> None:
    assert get_args(TrainParams.model_fields["model"].annotation) == MODEL_NAMES
    for name in MODEL_NAMES:
        assert default_params(train={"model": name}).train.model == name
    with pytest.raises(ParamsError, match=r"train\.model = 'resnet9000'.*'small_cnn'"):
        default_params(train={"model": "resnet9000"})
