"""The paired tests promotion asks for evidence (tasks/evaluate/evidence.py): pure functions on
answers."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.evaluate.evidence import (
    Answers,
    answers_of,
    macro_figures,
    mcnemar,
    paired_bootstrap,
    paired_evidence,
)
from tasks.evaluate.metrics import classification_metrics


def hits(pattern: str) -> np.ndarray:
    return np.array([c == "1" for c in pattern])


def test_mcnemar_counts_only_the_records_the_models_disagree_on() -> None:
    """7 records only the challenger got right, 1 only the champion: p = P(X >= 7), X ~
    Bin(8, 1/2) = 9/256, whatever the records both got right or both missed."""
    challenger = hits("1111111" + "0" + "11111" + "000")
    champion = hits("0000000" + "1" + "11111" + "000")
    evidence = mcnemar(challenger, champion, alpha=0.05)
    assert evidence.p_value == pytest.approx(9 / 256)
    assert evidence.difference == pytest.approx(6 / 16)
    assert evidence.test_records == 16
    assert evidence.ci_low < evidence.difference < evidence.ci_high
    assert "8 discordant records (7 won, 1 lost)" in evidence.method


def test_one_more_record_right_is_within_chance() -> None:
    """The issue's case: a challenger one test image better on 10 images."""
    champion = hits("1111100000")
    challenger = hits("1111110000")
    evidence = mcnemar(challenger, champion, alpha=0.05)
    assert evidence.p_value == pytest.approx(0.5)
    assert mcnemar(champion, champion, alpha=0.05).p_value == 1.0


def test_the_bootstrap_is_seeded_and_tells_a_real_gain_from_none() -> None:
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, 300)
    good = np.where(rng.random(300) < 0.9, labels, (labels + 1) % 3)
    poor = np.where(rng.random(300) < 0.6, labels, (labels + 1) % 3)

    def answers(predicted: np.ndarray) -> Answers:
        return Answers(labels, predicted, predicted == labels, 3)

    gain = paired_bootstrap(answers(good), answers(poor), "macro_f1", alpha=0.05)
    assert gain.p_value < 0.01 and gain.ci_low > 0
    assert gain == paired_bootstrap(answers(good), answers(poor), "macro_f1", alpha=0.05)
    same = paired_bootstrap(answers(poor), answers(poor), "macro_f1", alpha=0.05)
    assert same.p_value == 1.0 and same.difference == 0.0
    assert "10,000 resamples" in gain.method


def test_resampled_macro_figures_are_the_evaluation_s_own() -> None:
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 4, 50)
    probs = rng.random((50, 4))
    reported = classification_metrics(labels, probs, list("abcd"), top_k=2)
    answers = answers_of(labels, probs, 2, 4)
    precision, recall, f1 = macro_figures(labels[None], answers.predicted[None], 4)[0]
    assert precision == pytest.approx(reported["macro_precision"])
    assert recall == pytest.approx(reported["macro_recall"])
    assert f1 == pytest.approx(reported["macro_f1"])
    assert answers.top_k_hit.mean() == pytest.approx(reported["top_k_accuracy"])


def test_each_metric_gets_its_test_and_only_on_the_same_records() -> None:
    labels = np.array([0, 1, 0, 1])
    one = Answers(labels, labels, np.ones(4, bool), 2)
    assert "McNemar" in paired_evidence(one, one, "top_k_accuracy", alpha=0.05).method
    assert "bootstrap" in paired_evidence(one, one, "macro_recall", alpha=0.05).method
    other = Answers(labels[::-1].copy(), labels, np.ones(4, bool), 2)
    with pytest.raises(ValueError, match="same test records"):
        paired_evidence(one, other, "accuracy", alpha=0.05)
