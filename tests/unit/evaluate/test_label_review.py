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


def test_a_flag_is_a_likely_label_error_only_where_the_model_judges_both_classes() -> None:
    """A weak model is confidently wrong on correctly labelled images: its confidence in the
    class it suggests is no evidence. A model that knows all three colours calls the
    red-labelled image it sees as green a likely label error; one that calls half the blue
    images green (blue's recall 0.5, green's precision 0.65) makes every flag a confusion,
    its confident (0.96) suggestions included, on the rows and in the counts."""
    red, green, blue = [0.96, 0.02, 0.02], [0.02, 0.96, 0.02], [0.02, 0.02, 0.96]
    labels = np.array([0] * 20 + [1] * 20 + [2] * 20 + [0])  # the last: red, looks green
    knows_all = np.array([red] * 20 + [green] * 20 + [blue] * 20 + [green])
    blue_half_green = knows_all.copy()
    blue_half_green[40:50] = green
    sources = [f"{i:03d}.png" for i in range(len(labels))]

    rows = review_labels([HeldOut("test", sources, labels, knows_all)], CLASSES, 0.8)
    assert {row["path"]: row["kind"] for row in rows} == {"060.png": "likely label error"}

    part = HeldOut("test", sources, labels, blue_half_green)
    rows = review_labels([part], CLASSES, 0.8)
    kinds = {row["path"]: row["kind"] for row in rows}
    assert "060.png" in kinds and any(path < "050.png" for path in kinds)
    assert set(kinds.values()) == {"confusion"}
    summary = review_summary(rows, [part], 0.8)
    assert summary["flagged"] == {"test": 0} and summary["top"] == []
    assert summary["confusions"] == {"test": len(rows)}
    assert summary["min_class_review_accuracy"] == 0.8


# write_tiny_shards(flipped={"test": 4}) flips records 0, 7, 15 and 22 of the test split,
# made class by class, 10 a class: red 0, red 7, green 5, blue 2.
FLIPPED_TEST = (("red", 0), ("red", 7), ("green", 5), ("blue", 2))


def test_the_label_review_bench_counts_flips_and_a_weak_model_s_false_calls() -> None:
    """`python -m bench.label_review` measures the default: on a good model, the precision
    and recall of "likely label error" against the flipped labels; on a weak one, the share
    of correct labels called errors; it chooses the lowest threshold meeting all three
    targets. With no threshold (0.0) the weak model's confident confusions count as errors."""
    from bench.label_review import (
        MAX_FALSE_SHARE,
        PRECISION,
        RECALL,
        HeldOutScores,
        chosen_threshold,
        counted,
    )

    red, green, blue = [0.96, 0.02, 0.02], [0.02, 0.96, 0.02], [0.02, 0.02, 0.96]
    labels = np.array([0] * 20 + [1] * 20 + [2] * 20 + [0])  # the last: a flipped label
    knows_all = np.array([red] * 20 + [green] * 20 + [blue] * 20 + [green])
    blue_half_green = knows_all.copy()
    blue_half_green[40:50] = green
    flipped = np.arange(len(labels)) == 60
    splits = ["val"] * 30 + ["test"] * 31
    sets = [
        {
            "good": HeldOutScores(splits, labels, flipped, knows_all),
            "weak": HeldOutScores(splits, labels, np.zeros(len(labels), bool), blue_half_green),
            "fair": HeldOutScores(splits, labels, flipped, knows_all),
        }
    ]
    judged, unjudged = counted(0.8, sets), counted(0.0, sets)
    assert (judged.called, judged.flipped_called, judged.precision, judged.recall) == (
        1,
        1,
        1.0,
        1.0,
    )
    assert judged.weak_correct_called == 0 and judged.weak_false_share == 0.0
    assert judged.fair_correct_called == 0 and unjudged.fair_correct_called == 0
    assert unjudged.weak_correct_called > 0
    assert unjudged.weak_false_share == round(unjudged.weak_correct_called / 61, 4)
    assert unjudged.weak_false_share > MAX_FALSE_SHARE
    assert chosen_threshold([unjudged, judged]) == 0.8
    assert chosen_threshold([unjudged]) is None
    # the fair model's false calls count as much as the weak one's
    swapped = [{**sets[0], "weak": sets[0]["fair"], "fair": sets[0]["weak"]}]
    assert chosen_threshold([counted(0.0, swapped)]) is None
    assert (PRECISION, RECALL, MAX_FALSE_SHARE) == (0.7, 0.6, 0.02)
