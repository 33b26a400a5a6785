"""The model and data card, from the records the pipeline wrote (a pure function)."""

from __future__ import annotations

from typing import Any

from tasks.contracts.manifest import Generation, SplitInfo, build_manifest
from tasks.evaluate.model_card import model_card
from tasks.schema import RecordSchema

COUNTS = {
    "train": {"cat": 40, "dog": 38},
    "val": {"cat": 5, "dog": 5},
    "test": {"cat": 6, "dog": 4},
}


def manifest() -> Any:
    splits = {
        split: SplitInfo(num_records=sum(counts.values()), class_counts=counts, shards=[])
        for split, counts in COUNTS.items()
    }
    generations = [
        Generation(
            number=number,
            base_fingerprint=None if number == 0 else "f" * 64,
            records_file=f"records-{number}.json",
            records_sha256="0" * 64,
            new_classes=new,
            num_records=added,
            shards=[],
        )
        for number, new, added in (
            (0, ["cat", "dog"], {"train": 70, "val": 8, "test": 8}),
            (1, [], {"train": 8, "val": 2, "test": 2}),
        )
    ]
    return build_manifest(
        RecordSchema(64, 64, "jpeg"),
        ["cat", "dog"],
        "none",
        splits,
        resize="pad",
        draft_decode=True,
        preprocessing_version="abc123",
        generations=generations,
    )


def card(**changes: Any) -> str:
    per_class = [
        {"class": "cat", "precision": 0.8, "recall": 0.667, "f1": 0.727, "support": 6},
        {"class": "dog", "precision": 0.6, "recall": 0.75, "f1": 0.667, "support": 4},
    ]
    settings: dict[str, Any] = {
        "model_name": "shardflow",
        "version": "3",
        "run_ids": {"training": "t" * 32, "evaluation": "e" * 32},
        "manifest": manifest(),
        "metrics": {
            "accuracy": 0.7,
            "top_k": 1,
            "top_k_accuracy": 0.7,
            "macro_f1": 0.697,
            "num_test_records": 10,
            "per_class": per_class,
        },
        "decision": {
            "decision": "kept",
            "metric": "accuracy",
            "definition": "accuracy",
            "reason": "accuracy 0.7000 does not beat champion v2 (0.8000, re-scored ...)",
            "champion_value_how": "re-scored on the current test set 0123456789ab as accuracy",
            "comparable": True,
        },
        "label_review": {
            "reviewed": {"val": 10, "test": 10},
            "flagged": {"val": 0, "test": 1},
            "top": [
                {
                    "split": "test",
                    "path": "cat/x.jpg",
                    "given_label": "cat",
                    "suggested_label": "dog",
                    "score": 0.02,
                }
            ],
        },
        "ingest_report": {
            "files_found": 110,
            "accepted": 108,
            "quarantined_count": 1,
            "duplicate_count": 1,
            "quarantined": [{"path": "bad.jpg", "reason": "truncated"}],
            "near_duplicates": {
                "distance": 6,
                "group_count": 2,
                "images_in_groups": 5,
                "largest_group": 3,
                "label_conflict_count": 1,
                "groups": [],
                "label_conflicts": [],
            },
        },
    }
    return model_card(**{**settings, **changes})


def test_the_card_holds_data_generations_sources_review_metrics_and_comparison() -> None:
    text = card()
    assert text.startswith(
        "Version 3 of the registered model shardflow scored test accuracy 0.7000 on 10 test "
        "images; the champion was kept.\n"
    )
    assert "64x64 jpeg, resize `pad`, preprocessing version `abc123`" in text
    assert "| class | train | val | test |" in text
    assert "| cat | 40 | 5 | 6 |" in text and "| **all** | 78 | 10 | 10 |" in text
    assert "- 0: train 70, val 8, test 8; new classes ['cat', 'dog']" in text
    assert "- 1: train 8, val 2, test 2" in text
    assert "1 quarantined, 1 exact duplicates" in text and "1 x truncated" in text
    assert (
        "- near-duplicates (Hamming distance <= 6): 2 groups of 5 images (largest 3), each "
        "group in one split; 1 suspected label conflicts" in text
    )
    assert "val 0 of 10, test 1 of 10" in text
    assert "test `cat/x.jpg`: labelled cat, looks like dog" in text
    assert "| dog | 0.600 | 0.750 | 0.667 | 4 |" in text
    assert "the champion's figure: re-scored on the current test set 0123456789ab" in text
    assert "10 test images: one image moves accuracy by 0.1000" in text
    assert "fewer than 10 test images in: cat, dog" in text


def test_a_card_without_an_ingest_report_or_a_fair_comparison_says_so() -> None:
    decision = {
        "decision": "not comparable: champion kept",
        "metric": "accuracy",
        "reason": "not comparable: champion kept (...)",
        "comparable": False,
    }
    text = card(ingest_report=None, decision=decision)
    assert "no ingest report beside these shards" in text
    assert "not compared with the champion on the same data" in text


def test_a_card_says_how_the_champion_s_classes_differed() -> None:
    """A champion re-scored by class name: the card names both class lists and what the
    champion was scored with (a class it does not know counts as its error)."""
    from tasks.evaluate.promotion import class_differences

    differences = class_differences(["cat"], ["cat", "dog"])
    decision = {
        "decision": "promoted",
        "metric": "accuracy",
        "reason": "accuracy 0.7000 beats champion v2 (0.6000, re-scored ...)",
        "comparable": True,
        "class_differences": differences,
    }
    text = card(decision=decision)
    assert "- classes differ: the champion's cat; today's cat, dog; scored by class name" in text
    assert "it does not know dog: each test record of it is an error" in text
    assert class_differences(["cat", "dog"], ["cat", "dog"]) is None
    assert "classes differ" not in card()


def test_a_card_gives_the_evidence_the_decision_rests_on() -> None:
    decision = {
        "decision": "inconclusive: champion kept",
        "metric": "accuracy",
        "reason": "accuracy 0.7000 beats champion v2 (0.6000, ...), but within chance",
        "comparable": True,
        "alpha": 0.05,
        "evidence": {
            "method": "exact one-sided McNemar on 3 discordant records (2 won, 1 lost)",
            "p_value": 0.5,
            "difference": 0.1,
            "ci_low": -0.2,
            "ci_high": 0.3,
            "confidence": 0.9,
            "test_records": 10,
        },
    }
    text = card(decision=decision)
    assert text.startswith("Version 3 of the registered model shardflow scored test accuracy")
    assert "decision: inconclusive: champion kept" in text.split("\n")[0]
    assert (
        "- evidence: exact one-sided McNemar on 3 discordant records (2 won, 1 lost); p-value "
        "0.5 (promoted only below evaluate.promotion_alpha 0.05); difference +0.1000, 90% CI "
        "-0.2000 to +0.3000, on 10 test records" in text
    )
