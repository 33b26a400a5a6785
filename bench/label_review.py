"""Label review: where ``evaluate.min_class_review_accuracy`` makes "likely label error" mean it.

``python -m bench.label_review`` (or ``python -m bench --only label_review``) reads real
scans: scikit-learn's ``load_digits`` (1,797 handwritten digits, 8x8 grey, shipped with the
package; nothing downloaded), shown to the project's ``small_cnn`` at 16x16. For each seed
it splits them 80/10/10, gives 5% of the labels of every split another class at random
(training learns from wrong labels too, as it does on a user's data), trains, and has the
stage's review (:func:`tasks.evaluate.label_review.review_labels`, cleanlab) read the model's
probabilities on val and test. Three models a seed:

- ``good``: trained to convergence (the review's intended use);
- ``weak``: trained on a few images of each class, about 65% accurate held out, as users
  meet a first model on their own data: there, calling a correct label an error is the harm;
- ``fair``: a few more images, about 75% accurate: between the two, where a class or two
  reach a threshold that others miss.

For each ``min_class_review_accuracy`` of :data:`THRESHOLDS` it counts, summed over the
seeds: what the good model's review calls a likely label error (precision: the share that
are flipped labels; recall: the share of flipped held-out records called so) and the share
of the weak and the fair model's correctly labelled held-out records called label errors
(the larger of the two must stay within :data:`MAX_FALSE_SHARE`). ``chosen`` is
the lowest threshold meeting :data:`PRECISION`, :data:`RECALL` and :data:`MAX_FALSE_SHARE`
(the most recall at those); docs/performance.md gives the figures. Seeded: the same figures
on the same kind of CPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = tuple(str(digit) for digit in range(10))
THRESHOLDS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
SIZE = 16  # the 8x8 scans, each pixel repeated 2x2
SPLITS = {"train": 0.8, "val": 0.1, "test": 0.1}
FLIPPED_SHARE = 0.05  # of every split's labels, given another class at random
SEEDS = (7, 8, 9)  # one split, one set of flips and two models each: the figures are sums
# What "likely label error" must mean on a good model: at least 7 in 10 called are wrong
# labels, and at least 6 in 10 wrong held-out labels are called so...
PRECISION = 0.7
RECALL = 0.6
# ...and on a weak or fair one: at most 2 in 100 correct labels called wrong.
MAX_FALSE_SHARE = 0.02


@dataclass(frozen=True)
class Scale:
    """Training of the three models: epochs, and the weak and fair models' images per class."""

    epochs: int = 40
    weak_per_class: int = 7
    weak_epochs: int = 20
    fair_per_class: int = 8
    fair_epochs: int = 30


@dataclass(frozen=True)
class Threshold:
    """What the review called a likely label error at one ``min_class_review_accuracy``."""

    threshold: float
    called: int  # the good model's records called likely label errors
    flipped_called: int
    precision: float | None  # flipped_called / called; None when nothing was called
    recall: float  # flipped_called / flipped held-out records
    weak_called: int  # the weak model's records called likely label errors
    weak_correct_called: int  # ... of them correctly labelled
    weak_false_share: float  # weak_correct_called / correctly labelled held-out records
    fair_correct_called: int  # the same for the fair model
    fair_false_share: float


@dataclass(frozen=True)
class HeldOutScores:
    """One model's held-out records: given labels, whether each was flipped, the model's
    probabilities; in the order val then test."""

    splits: list[str]
    labels: np.ndarray
    flipped: np.ndarray
    probs: np.ndarray


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The scans as uint8 RGB at :data:`SIZE` px, and their true labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    grey = np.round(data.images * (255 / 16)).astype(np.uint8)
    big = grey.repeat(SIZE // 8, axis=1).repeat(SIZE // 8, axis=2)
    return np.repeat(big[..., None], 3, axis=3), data.target.astype(np.int64)


def split_and_flip(
    rng: np.random.Generator, labels: np.ndarray
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Record indices of each split (shuffled, :data:`SPLITS`) and the given labels:
    :data:`FLIPPED_SHARE` of each split's moved to another class at random."""
    order = rng.permutation(len(labels))
    cuts = np.cumsum([round(share * len(labels)) for share in SPLITS.values()])[:-1]
    parts = dict(zip(SPLITS, np.split(order, cuts), strict=True))
    given = labels.copy()
    for idx in parts.values():
        chosen = rng.choice(idx, round(FLIPPED_SHARE * len(idx)), replace=False)
        given[chosen] = (given[chosen] + rng.integers(1, len(CLASSES), len(chosen))) % len(CLASSES)
    return parts, given


def trained_probabilities(
    x: np.ndarray, y: np.ndarray, held_out: np.ndarray, seed: int, epochs: int
) -> np.ndarray:
    """The project's small_cnn trained on ``x``/``y``, scoring ``held_out`` it never saw."""
    import keras

    from tasks.runtime.params import default_params
    from tasks.train.models import build_model

    keras.utils.set_random_seed(seed)
    train = default_params().train.model_copy(update={"model": "small_cnn", "seed": seed})
    model = build_model(train, len(CLASSES), (SIZE, SIZE, 3))
    model.compile(
        optimizer=keras.optimizers.Adam(train.learning_rate), loss="sparse_categorical_crossentropy"
    )
    model.fit(x, y, batch_size=train.batch_size, epochs=epochs, shuffle=True, verbose=0)
    return np.asarray(model.predict(held_out, batch_size=256, verbose=0), dtype=np.float64)


def few_per_class(
    rng: np.random.Generator, idx: np.ndarray, given: np.ndarray, n: int
) -> np.ndarray:
    """``n`` training records of each given class: what a weak first model learns from."""
    return np.concatenate([rng.permutation(idx[given[idx] == c])[:n] for c in range(len(CLASSES))])


def scored_sets(seed: int, scale: Scale) -> dict[str, HeldOutScores]:
    """The good, the weak and the fair model's held-out scores for one seed's split and
    flips."""
    pixels, truth = digits()
    rng = np.random.default_rng(seed)
    parts, given = split_and_flip(rng, truth)
    held = np.concatenate([parts["val"], parts["test"]])
    splits = ["val"] * len(parts["val"]) + ["test"] * len(parts["test"])
    train = parts["train"]
    weak = few_per_class(rng, train, given, scale.weak_per_class)
    fair = few_per_class(rng, train, given, scale.fair_per_class)
    models = (
        ("good", train, scale.epochs),
        ("weak", weak, scale.weak_epochs),
        ("fair", fair, scale.fair_epochs),
    )
    found = {}
    for name, idx, epochs in models:
        probs = trained_probabilities(pixels[idx], given[idx], pixels[held], seed, epochs)
        found[name] = HeldOutScores(splits, given[held], given[held] != truth[held], probs)
    return found


def called(threshold: float, scores: HeldOutScores) -> np.ndarray:
    """Per held-out record, whether the stage's review calls it a likely label error at
    ``threshold``."""
    from tasks.evaluate.label_review import LABEL_ERROR, HeldOut, review_labels

    parts = []
    for split in ("val", "test"):
        mine = np.array([s == split for s in scores.splits], dtype=bool)
        where = [f"{i:05d}" for i in np.flatnonzero(mine)]
        parts.append(HeldOut(split, where, scores.labels[mine], scores.probs[mine]))
    rows = review_labels(parts, CLASSES, threshold)
    calls = np.zeros(len(scores.labels), dtype=bool)
    calls[[int(row["path"]) for row in rows if row["kind"] == LABEL_ERROR]] = True
    return calls


def false_calls(
    threshold: float, sets: list[dict[str, HeldOutScores]], name: str
) -> tuple[int, float]:
    """The correctly labelled held-out records model ``name`` calls label errors at
    ``threshold``, over every seed: their count and their share of the correct labels."""
    marked = [(called(threshold, s[name]), s[name].flipped) for s in sets]
    correct = sum(int((~f).sum()) for _, f in marked)
    wrong = sum(int((c & ~f).sum()) for c, f in marked)
    return wrong, round(wrong / correct, 4) if correct else 0.0


def counted(threshold: float, sets: list[dict[str, HeldOutScores]]) -> Threshold:
    """What the review called at ``threshold`` over every seed's three models."""
    good = [(called(threshold, s["good"]), s["good"].flipped) for s in sets]
    weak = [called(threshold, s["weak"]) for s in sets]
    calls = sum(int(c.sum()) for c, _ in good)
    hits = sum(int((c & f).sum()) for c, f in good)
    flipped = sum(int(f.sum()) for _, f in good)
    weak_false, weak_share = false_calls(threshold, sets, "weak")
    fair_false, fair_share = false_calls(threshold, sets, "fair")
    return Threshold(
        threshold=threshold,
        called=calls,
        flipped_called=hits,
        precision=round(hits / calls, 3) if calls else None,
        recall=round(hits / flipped, 3) if flipped else 0.0,
        weak_called=sum(int(c.sum()) for c in weak),
        weak_correct_called=weak_false,
        weak_false_share=weak_share,
        fair_correct_called=fair_false,
        fair_false_share=fair_share,
    )


def meets(result: Threshold) -> bool:
    """Whether a threshold gives "likely label error" the meaning it must have."""
    return (
        (result.precision or 0.0) >= PRECISION
        and result.recall >= RECALL
        and max(result.weak_false_share, result.fair_false_share) <= MAX_FALSE_SHARE
    )


def chosen_threshold(results: list[Threshold]) -> float | None:
    """The lowest threshold that :func:`meets` the targets (the most recall at them);
    None when none does."""
    good = [r.threshold for r in results if meets(r)]
    return min(good) if good else None


def accuracy(sets: list[dict[str, HeldOutScores]], name: str) -> float:
    """A model's held-out accuracy against the labels as given, over every seed."""
    right = [s[name].probs.argmax(1) == s[name].labels for s in sets]
    return round(float(np.mean(np.concatenate(right))), 3)


def measure_label_review(scale: Scale = Scale()) -> dict[str, Any]:
    """Figures for each threshold of :data:`THRESHOLDS`, over the seeds of :data:`SEEDS`
    (see the module)."""
    sets = [scored_sets(seed, scale) for seed in SEEDS]
    results = [counted(t, sets) for t in THRESHOLDS]
    return {
        "scale": asdict(scale),
        "seeds": list(SEEDS),
        "held_out": sum(len(s["good"].labels) for s in sets),
        "flipped_held_out": sum(int(s["good"].flipped.sum()) for s in sets),
        "accuracy": {name: accuracy(sets, name) for name in ("good", "weak", "fair")},
        "thresholds": [asdict(r) for r in results],
        "chosen": chosen_threshold(results),
    }


def table(result: dict[str, Any]) -> str:
    """The figures as the Markdown table docs/performance.md shows."""
    lines = [
        "| min_class_review_accuracy | called (good) | flipped among them | precision | recall "
        "| weak: correct labels called errors | fair: the same |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["thresholds"]:
        precision = "n/a" if r["precision"] is None else f"{r['precision']:.2f}"
        lines.append(
            f"| {r['threshold']} | {r['called']} | {r['flipped_called']} | {precision} "
            f"| {r['recall']:.2f} | {r['weak_correct_called']} ({r['weak_false_share']:.1%}) "
            f"| {r['fair_correct_called']} ({r['fair_false_share']:.1%}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.label_review", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    from flows.support.environment import configure_environment

    configure_environment()
    result = measure_label_review()
    print(table(result))
    print(
        f"held out: {result['held_out']} records, {result['flipped_held_out']} flipped; "
        f"accuracy against the given labels: {result['accuracy']}"
    )
    print(f"seeds: {result['seeds']}")
    print(f"chosen min_class_review_accuracy: {result['chosen']}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
