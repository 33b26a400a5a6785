"""Label review: labels flipped on purpose are found near the top of reports/label_issues.csv."""

from __future__ import annotations

import numpy as np

from tasks.evaluate.label_review import LABEL_ISSUE_COLUMNS, HeldOut, review_labels, review_summary

CLASSES = ["red", "green", "blue"]


def flips_in_top(rows: list[dict[str, str]], flipped: set[str], split: str) -> float:
    """The share of ``flipped`` paths among the top 2x-flips rows of ``split``."""
    top = [row["path"] for row in rows if row["split"] == split][: 2 * len(flipped)]
    return len(flipped & set(top)) / len(flipped)


def test_flipped_labels_rank_first_from_a_fitted_models_held_out_probabilities() -> None:
    """Fast: a logistic regression fitted on clean blobs scores held-out points whose labels
    were flipped; the review (cleanlab, through the stage's function) puts them on top."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(7)
    centres = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]])

    def blobs(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.repeat(np.arange(3), n)
        return centres[labels] + rng.normal(scale=1.0, size=(3 * n, 2)), labels

    model = LogisticRegression().fit(*blobs(100))
    parts, flipped = [], set()
    for split, n, flips in (("val", 20, 3), ("test", 40, 12)):
        points, labels = blobs(n)
        chosen = rng.choice(len(labels), flips, replace=False)
        labels[chosen] = (labels[chosen] + rng.integers(1, 3, flips)) % 3
        sources = [f"{split}/{i:03d}.png" for i in range(len(labels))]
        if split == "test":
            flipped = {sources[i] for i in chosen}
        parts.append(HeldOut(split, sources, labels, model.predict_proba(points)))

    rows = review_labels(parts, CLASSES, 0.7)
    assert flips_in_top([{k: str(v) for k, v in r.items()} for r in rows], flipped, "test") >= 0.8
    assert list(rows[0]) == list(LABEL_ISSUE_COLUMNS)
    scores = [row["score"] for row in rows]
    assert scores == sorted(scores)  # most suspect first
    assert {row["split"] for row in rows} <= {"val", "test"}


def test_nothing_to_review_gives_no_rows() -> None:
    empty = HeldOut("test", [], np.zeros(0, np.int64), np.zeros((0, 3)))
    assert review_labels([empty], CLASSES, 0.7) == []
    assert review_labels([], CLASSES, 0.7) == []


def test_only_a_confident_suggestion_is_a_likely_label_error() -> None:
    """On the demo, whose labels are right by construction, all 7 "likely label errors" were
    correctly labelled images the model confused. A planted wrong label on an image the
    model knows (its suggestion at 0.95) is a label error; a hard image it splits between
    two classes (0.55) is a confusion, on the sheet and in the counts."""
    known = np.array([[0.6, 0.3, 0.1]] * 20)  # a model as unsure as the demo's
    known[19] = [0.95, 0.03, 0.02]  # an image it knows as class 0, labelled 1: planted
    hard = np.array([[0.1, 0.65, 0.25], [0.2, 0.62, 0.18]])  # class 0 images, looking like 1
    probs = np.concatenate([known, known[:, [1, 0, 2]], hard])
    probs[39] = [0.3, 0.6, 0.1]
    labels = np.array([0] * 19 + [1] + [1] * 20 + [0, 0])
    part = HeldOut("test", [f"{i:03d}.png" for i in range(42)], labels, probs)
    rows = review_labels([part], CLASSES, 0.7)
    kinds = {row["path"]: row["kind"] for row in rows}
    assert kinds == {
        "019.png": "likely label error",
        "040.png": "confusion",
        "041.png": "confusion",
    }
    summary = review_summary(rows, [part], 0.7)
    assert summary["flagged"] == {"test": 1} and summary["confusions"] == {"test": 2}
    assert [row["path"] for row in summary["top"]] == ["019.png"]


# write_tiny_shards(flipped={"test": 4}) flips records 0, 7, 15 and 22 of the test split,
# made class by class, 10 a class: red 0, red 7, green 5, blue 2.
FLIPPED_TEST = (("red", 0), ("red", 7), ("green", 5), ("blue", 2))


def test_the_label_review_bench_counts_by_kind_and_chooses_the_first_precise_threshold() -> None:
    """`python -m bench.label_review` sets the default: what the review calls a likely
    label error at each threshold, counted as planted, hard or clear, and the lowest
    threshold at which nine in ten of those are planted errors."""
    from bench.label_review import CLASSES, PRECISION, chosen_threshold, counted

    known = [0.8, 0.1, 0.05, 0.05]  # clear images of class 0
    probs = np.array([known] * 36 + [[0.96, 0.02, 0.01, 0.01]] * 4 + [[0.85, 0.15, 0, 0]] * 2)
    probs[:18] = probs[:18][:, [1, 0, 2, 3]]  # ... and of class 1
    labels = np.array([1] * 18 + [0] * 18 + [1] * 4 + [1] * 2)  # planted: 4; hard: 2
    kinds = np.array(["clear"] * 36 + ["planted"] * 4 + ["hard"] * 2, dtype=object)
    held = {"labels": labels, "probs": probs, "kinds": kinds}
    low, high = counted(0.8, [held]), counted(0.9, [held])
    assert (low.planted_called, low.hard_called, low.clear_called) == (4, 2, 0)
    assert low.precision == round(4 / 6, 3) and low.recall == 1.0
    assert (high.called, high.precision, high.recall) == (4, 1.0, 1.0)
    assert chosen_threshold([low, high]) == 0.9 and PRECISION == 0.9 and len(CLASSES) == 4
    assert chosen_threshold([low]) == 0.8  # none precise enough: the highest measured
