"""Label review: where ``evaluate.label_error_confidence`` separates wrong labels from hard images.

``python -m bench.label_review`` (or ``python -m bench --only label_review``) draws the
demo's shapes (:func:`tasks.ingest.demo_data.draw_shape`, 32 px), trains the project's
``small_cnn`` on correctly labelled images, clear ones and hard ones, and has the stage's
review (:func:`tasks.evaluate.label_review.review_labels`, cleanlab) read its probabilities on a
held-out set of three kinds of record:

- clear images with their own label;
- hard images with their own label: a shape blended with another class's at 35-45%, near
  the boundary between the two, where a model is unsure and cleanlab flags correct labels;
- planted errors: clear images given another class's label.

For each threshold it counts what the review calls a likely label error: precision (the
share of those that are planted errors) and recall (the share of planted errors called
so), and how many hard and clear images were called label errors, summed over one set and
one model a seed. ``chosen`` is the lowest threshold at :data:`PRECISION` or more (the
most recall at that precision): the default in params.yaml; docs/training.md gives the
figures. Seeded: the same figures on the same kind of CPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = ("circle", "square", "triangle", "cross")
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
SIZE = 32
HARD_BLEND = (0.35, 0.45)  # the other class's share in a hard image: the label stays right
SEEDS = (7, 8, 9)  # one set and one model each: the figures are their sums
# What "likely label error" must mean: at most one in ten is a correctly labelled image.
PRECISION = 0.9


@dataclass(frozen=True)
class Scale:
    """How many images of each kind, per class, and the training epochs."""

    train: int = 150
    train_hard: int = 30
    clear: int = 60
    hard: int = 20
    planted: int = 8
    epochs: int = 12


@dataclass(frozen=True)
class Threshold:
    """What the review called a likely label error at one ``label_error_confidence``."""

    threshold: float
    called: int  # records called likely label errors
    planted_called: int
    hard_called: int
    clear_called: int
    precision: float | None  # planted_called / called; None when nothing was called
    recall: float  # planted_called / planted


def drawing(rng: np.random.Generator, label: int) -> np.ndarray:
    from tasks.ingest.demo_data import draw_shape

    return np.asarray(draw_shape(rng, CLASSES[label], (SIZE, SIZE)), dtype=np.uint8)


def hard_drawing(rng: np.random.Generator, label: int) -> np.ndarray:
    """``label``'s shape with another class's blended in: still ``label``, but near the edge."""
    other = (label + int(rng.integers(1, len(CLASSES)))) % len(CLASSES)
    share = rng.uniform(*HARD_BLEND)
    mixed = (1 - share) * drawing(rng, label) + share * drawing(rng, other)
    return np.clip(mixed, 0, 255).astype(np.uint8)


def images(rng: np.random.Generator, per_class: int, hard: bool) -> tuple[np.ndarray, np.ndarray]:
    labels = np.repeat(np.arange(len(CLASSES)), per_class)
    draw = hard_drawing if hard else drawing
    return np.stack([draw(rng, int(label)) for label in labels]), labels


def held_out_set(rng: np.random.Generator, scale: Scale) -> dict[str, Any]:
    """The review's records: clear, hard and planted, in one shuffled order, with kinds."""
    clear, clear_labels = images(rng, scale.clear + scale.planted, hard=False)
    hard, hard_labels = images(rng, scale.hard, hard=True)
    given = clear_labels.copy()
    planted = np.concatenate(
        [np.flatnonzero(clear_labels == c)[: scale.planted] for c in range(len(CLASSES))]
    )
    given[planted] = (given[planted] + rng.integers(1, len(CLASSES), len(planted))) % len(CLASSES)
    kinds = np.array(["clear"] * len(clear) + ["hard"] * len(hard), dtype=object)
    kinds[planted] = "planted"
    order = rng.permutation(len(clear) + len(hard))
    pixels = np.concatenate([clear, hard])[order]
    return {
        "pixels": pixels,
        "labels": np.concatenate([given, hard_labels])[order],
        "kinds": kinds[order],
    }


def trained_probabilities(
    rng: np.random.Generator, scale: Scale, pixels: np.ndarray, seed: int
) -> np.ndarray:
    """The project's small_cnn, trained on correctly labelled clear and hard images, scoring
    ``pixels`` it never saw."""
    import keras

    from tasks.runtime.params import default_params
    from tasks.train.models import build_model

    clear, clear_labels = images(rng, scale.train, hard=False)
    hard, hard_labels = images(rng, scale.train_hard, hard=True)
    x, y = np.concatenate([clear, hard]), np.concatenate([clear_labels, hard_labels])
    keras.utils.set_random_seed(seed)
    train = default_params().train.model_copy(update={"model": "small_cnn", "seed": seed})
    model = build_model(train, len(CLASSES), (SIZE, SIZE, 3))
    model.compile(
        optimizer=keras.optimizers.Adam(train.learning_rate), loss="sparse_categorical_crossentropy"
    )
    model.fit(x, y, batch_size=train.batch_size, epochs=scale.epochs, shuffle=True, verbose=0)
    return np.asarray(model.predict(pixels, batch_size=256, verbose=0), dtype=np.float64)


def called(threshold: float, labels: np.ndarray, probs: np.ndarray, kinds: np.ndarray) -> list[str]:
    """The kinds of the records the stage's review calls likely label errors at ``threshold``."""
    from tasks.evaluate.label_review import LABEL_ERROR, HeldOut, review_labels

    sources = [f"{i:05d}" for i in range(len(labels))]
    rows = review_labels([HeldOut("test", sources, labels, probs)], CLASSES, threshold)
    return [str(kinds[int(row["path"])]) for row in rows if row["kind"] == LABEL_ERROR]


def counted(threshold: float, sets: list[dict[str, Any]]) -> Threshold:
    """What the review called at ``threshold`` over every set (one model each), by kind."""
    kinds = [
        k for held in sets for k in called(threshold, held["labels"], held["probs"], held["kinds"])
    ]
    planted = sum(int(np.sum(held["kinds"] == "planted")) for held in sets)
    hits = kinds.count("planted")
    return Threshold(
        threshold=threshold,
        called=len(kinds),
        planted_called=hits,
        hard_called=kinds.count("hard"),
        clear_called=kinds.count("clear"),
        precision=round(hits / len(kinds), 3) if kinds else None,
        recall=round(hits / planted, 3) if planted else 0.0,
    )


def chosen_threshold(results: list[Threshold]) -> float:
    """The lowest threshold at which at least :data:`PRECISION` of what is called a label
    error is one (the most recall at that precision); the highest measured when none is."""
    precise = [r.threshold for r in results if (r.precision or 0.0) >= PRECISION]
    return min(precise) if precise else max(r.threshold for r in results)


def measure_label_review(scale: Scale = Scale()) -> dict[str, Any]:
    """Figures for each threshold of :data:`THRESHOLDS`, over one set and model a seed of
    :data:`SEEDS` (see the module)."""
    sets = []
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        held = held_out_set(rng, scale)
        held["probs"] = trained_probabilities(rng, scale, held["pixels"], seed)
        sets.append(held)
    results = [counted(t, sets) for t in THRESHOLDS]
    clear = [(h["probs"].argmax(1) == h["labels"])[h["kinds"] == "clear"] for h in sets]
    return {
        "scale": asdict(scale),
        "seeds": list(SEEDS),
        "records": {
            kind: sum(int(np.sum(h["kinds"] == kind)) for h in sets)
            for kind in ("clear", "hard", "planted")
        },
        "accuracy_on_clear": round(float(np.mean(np.concatenate(clear))), 3),
        "thresholds": [asdict(r) for r in results],
        "chosen": chosen_threshold(results),
    }


def table(result: dict[str, Any]) -> str:
    """The figures as the Markdown table docs/training.md shows."""
    lines = [
        "| label_error_confidence | called label errors | planted among them | hard | clear "
        "| precision | recall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["thresholds"]:
        precision = "n/a" if r["precision"] is None else f"{r['precision']:.2f}"
        lines.append(
            f"| {r['threshold']} | {r['called']} | {r['planted_called']} | {r['hard_called']} "
            f"| {r['clear_called']} | {precision} | {r['recall']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.label_review", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    from flows.common import configure_environment

    configure_environment()
    result = measure_label_review()
    print(table(result))
    print(f"records: {result['records']}; accuracy on clear images {result['accuracy_on_clear']}")
    print(f"seeds: {result['seeds']}")
    print(f"chosen label_error_confidence: {result['chosen']}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
