"""Whether a challenger's advantage over the champion is larger than chance, on the same records.

Both models are scored on the same test records (the champion is re-scored on them), so the
comparison is paired: each record says which of the two got it right. For accuracy and top-k
accuracy the records on which they disagree decide it: under "no better", a challenger wins
each of those with probability 1/2 at most, which is an exact one-sided McNemar test (a
binomial test on the discordant records). The macro figures are not sums over records; their
difference is resampled with the records (a paired bootstrap, seeded, so the same answers
always give the same decision). NumPy and SciPy only: no model, no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
# One seed for every decision: the same two models on the same records decide alike each time.
BOOTSTRAP_SEED = 20_240_601
RESAMPLES_PER_BATCH = 250  # resamples drawn at once: bounds memory at 250 x records indices
MACRO_METRICS = ("macro_precision", "macro_recall", "macro_f1")


@dataclass(frozen=True)
class Answers:
    """One model's answers on the test records, in record order: the true label, the class
    predicted (an index of today's classes; ``num_classes`` for a class today lacks) and
    whether the label was among its top ``k``."""

    labels: np.ndarray
    predicted: np.ndarray
    top_k_hit: np.ndarray
    num_classes: int

    def to_dict(self) -> dict[str, Any]:
        """As JSON holds it (an evaluation run's ``eval/answers.json``)."""
        return {
            "labels": self.labels.tolist(),
            "predicted": self.predicted.tolist(),
            "top_k_hit": self.top_k_hit.astype(int).tolist(),
            "num_classes": self.num_classes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Answers:
        return cls(
            np.asarray(data["labels"], np.int64),
            np.asarray(data["predicted"], np.int64),
            np.asarray(data["top_k_hit"], bool),
            int(data["num_classes"]),
        )

    def hits(self, metric: str) -> np.ndarray:
        """Per record, whether it counts as right for ``metric`` (accuracy or top-k)."""
        return self.top_k_hit if metric == "top_k_accuracy" else self.predicted == self.labels

    def subset(self, keep: np.ndarray) -> Answers:
        """The answers on the records ``keep`` (a mask in record order) selects."""
        return Answers(
            self.labels[keep], self.predicted[keep], self.top_k_hit[keep], self.num_classes
        )

    def value(self, metric: str) -> float:
        """``metric`` over these records, as :func:`tasks.evaluate.metrics.classification_metrics`
        computes it from probabilities (0.0 on no records)."""
        if not len(self.labels):
            return 0.0
        if metric in MACRO_METRICS:
            row = macro_figures(self.labels[None], self.predicted[None], self.num_classes)[0]
            return float(row[MACRO_METRICS.index(metric)])
        return float(np.mean(self.hits(metric)))


def answers_of(
    labels: np.ndarray,
    probs: np.ndarray,
    k: int,
    num_classes: int,
    columns: np.ndarray | None = None,
) -> Answers:
    """The :class:`Answers` of a model's probabilities on records of today's ``num_classes``
    classes; ``columns[j]``: the class of today's that its output ``j`` stands for
    (``num_classes``: one today lacks), as :func:`tasks.evaluate.metrics.metrics_by_name`
    matches them."""
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    top = top if columns is None else columns[top]
    return Answers(
        labels=np.asarray(labels, np.int64),
        predicted=top[:, 0].astype(np.int64) if len(top) else np.zeros(0, np.int64),
        top_k_hit=np.any(top == labels[:, None], axis=1),
        num_classes=num_classes,
    )


@dataclass(frozen=True)
class Evidence:
    """A paired one-sided test of "the challenger is better": its method in words, the
    p-value, the observed difference (challenger minus champion) and a two-sided interval
    of it at ``confidence`` (``1 - 2 alpha``: its low end is above 0 about when p < alpha),
    on ``test_records`` records."""

    method: str
    p_value: float
    difference: float
    ci_low: float
    ci_high: float
    confidence: float
    test_records: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def in_words(self) -> str:
        return (
            f"{self.method}: p = {self.p_value:.4g}, difference {self.difference:+.4f} "
            f"({self.confidence:.0%} CI {self.ci_low:+.4f} to {self.ci_high:+.4f}) "
            f"on {self.test_records} test records"
        )


def mcnemar(challenger: np.ndarray, champion: np.ndarray, *, alpha: float) -> Evidence:
    """The exact one-sided McNemar test on per-record hits: of the records exactly one model
    got right, is the challenger's share above 1/2? The interval is the exact (Clopper-Pearson)
    one of that share, as a difference of the two figures."""
    from scipy.stats import binomtest

    n = len(challenger)
    wins = int(np.sum(challenger & ~champion))
    losses = int(np.sum(~challenger & champion))
    discordant = wins + losses
    method = (
        f"exact one-sided McNemar on {discordant} discordant records ({wins} won, {losses} lost)"
    )
    if discordant == 0:
        return Evidence(method, 1.0, 0.0, 0.0, 0.0, 1 - 2 * alpha, n)
    test = binomtest(wins, discordant, 0.5, alternative="greater")
    interval = binomtest(wins, discordant, 0.5).proportion_ci(confidence_level=1 - 2 * alpha)
    scale = discordant / n
    return Evidence(
        method,
        float(test.pvalue),
        (wins - losses) / n,
        scale * (2 * interval.low - 1),
        scale * (2 * interval.high - 1),
        1 - 2 * alpha,
        n,
    )


def macro_figures(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """``[precision, recall, f1]`` macro-averaged over today's ``num_classes``, for each row
    of ``labels``/``predicted`` (resamples x records), as
    :func:`tasks.evaluate.metrics.classification_metrics` computes them for one."""
    rows, width = labels.shape[0], num_classes + 1  # one column for a class today lacks
    offset = (np.arange(rows) * width)[:, None]

    def counts(values: np.ndarray) -> np.ndarray:
        flat = (values + offset).ravel()
        return np.bincount(flat, minlength=rows * width).reshape(rows, width)[:, :num_classes]

    support, predicted_count = counts(labels), counts(predicted)
    true_pos = counts(np.where(labels == predicted, labels, num_classes))
    precision = np.divide(
        true_pos, predicted_count, out=np.zeros(true_pos.shape), where=predicted_count > 0
    )
    recall = np.divide(true_pos, support, out=np.zeros(true_pos.shape), where=support > 0)
    total = precision + recall
    f1 = np.divide(2 * precision * recall, total, out=np.zeros(true_pos.shape), where=total > 0)
    return np.stack([precision.mean(axis=1), recall.mean(axis=1), f1.mean(axis=1)], axis=1)


def paired_bootstrap(
    challenger: Answers,
    champion: Answers,
    metric: str,
    *,
    alpha: float,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Evidence:
    """The one-sided p-value of "the challenger's macro figure is higher" by resampling the
    records (the same draw for both models): the share of resamples, counted with the
    observed one, whose difference is 0 or less; the interval is the resamples' percentiles."""
    column = MACRO_METRICS.index(metric)
    labels, n = challenger.labels, len(challenger.labels)
    classes = challenger.num_classes

    def figure(answers: Answers, idx: np.ndarray) -> np.ndarray:
        return macro_figures(labels[idx], answers.predicted[idx], classes)[:, column]

    observed = figure(challenger, np.arange(n)[None]) - figure(champion, np.arange(n)[None])
    rng = np.random.default_rng(seed)
    differences = []
    for start in range(0, resamples, RESAMPLES_PER_BATCH):
        idx = rng.integers(0, n, size=(min(RESAMPLES_PER_BATCH, resamples - start), n))
        differences.append(figure(challenger, idx) - figure(champion, idx))
    drawn = np.concatenate(differences)
    p_value = (1 + int(np.sum(drawn <= 0))) / (1 + resamples)
    low, high = np.quantile(drawn, [alpha, 1 - alpha])
    method = f"paired bootstrap of the records ({resamples:,} resamples, seed {seed})"
    return Evidence(method, p_value, float(observed[0]), float(low), float(high), 1 - 2 * alpha, n)


def paired_evidence(
    challenger: Answers, champion: Answers, metric: str, *, alpha: float
) -> Evidence:
    """The paired test :mod:`tasks.evaluate.evidence` uses for ``metric``; the two models' answers
    must be on the same records (the same labels, in the same order)."""
    if not np.array_equal(challenger.labels, champion.labels):
        raise ValueError("paired evidence needs both models' answers on the same test records")
    if metric in MACRO_METRICS:
        return paired_bootstrap(challenger, champion, metric, alpha=alpha)
    return mcnemar(challenger.hits(metric), champion.hits(metric), alpha=alpha)
