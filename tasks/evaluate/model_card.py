"""The model and data card of a registered version, in Markdown.

Everything a reader needs to decide whether to trust the version, from records the pipeline
already wrote: the shard manifest (generations, counts per class and split, preprocessing),
the ingest report when present (quarantine, duplicates, near-duplicates), the label review,
the test metrics per class, and the champion comparison with how it was made. Evaluation
logs it as an MLflow artifact and sets it as the version's description; a retraction puts
:func:`retraction_paragraph` at its head.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.contracts.manifest import ShardManifest
    from tasks.contracts.model_versions import Retraction

SPLIT_ORDER = ("train", "val", "test")
SMALL_CLASS_SUPPORT = 10  # fewer test records than this: the class's figures are anecdotal
RETRACTION_HEADING = "## RETRACTED"


def model_card(
    *,
    model_name: str,
    version: str,
    run_ids: Mapping[str, str],
    manifest: ShardManifest,
    metrics: Mapping[str, Any],
    decision: Mapping[str, Any],
    label_review: Mapping[str, Any],
    ingest_report: Mapping[str, Any] | None,
) -> str:
    """The card as Markdown: a paragraph in prose (what the registry shows first, as the
    version's description), then sections: model, data, evaluation, comparison, limits."""
    sections = [
        [summary_paragraph(model_name, version, metrics, decision)],
        model_section(run_ids, metrics),
        data_section(manifest),
        source_section(ingest_report),
        label_section(label_review),
        metrics_section(metrics),
        comparison_section(decision),
        limits_section(manifest, metrics, decision, label_review),
    ]
    return "\n".join(line for section in sections for line in [*section, ""]).rstrip() + "\n"


def summary_paragraph(
    model_name: str, version: str, metrics: Mapping[str, Any], decision: Mapping[str, Any]
) -> str:
    """One paragraph: which version, how good on how many test images, and the decision."""
    outcome = {
        "promoted": f"it became the {decision.get('model_name', model_name)} champion",
        "kept": "the champion was kept",
    }.get(str(decision["decision"]), f"decision: {decision['decision']}")
    return (
        f"Version {version} of the registered model {model_name} scored test accuracy "
        f"{metrics['accuracy']:.4f} on {metrics['num_test_records']} test images; {outcome}."
    )


def model_section(run_ids: Mapping[str, str], metrics: Mapping[str, Any]) -> list[str]:
    return [
        "## Model",
        f"- training run: `{run_ids['training']}`; evaluation run: `{run_ids['evaluation']}`",
        f"- test accuracy {metrics['accuracy']:.4f}, top-{metrics['top_k']} accuracy "
        f"{metrics['top_k_accuracy']:.4f}, macro F1 {metrics['macro_f1']:.4f} "
        f"on {metrics['num_test_records']} test images",
    ]


def data_section(manifest: ShardManifest) -> list[str]:
    schema = manifest.record_schema
    splits = [s for s in SPLIT_ORDER if s in manifest.splits]
    splits += sorted(set(manifest.splits) - set(SPLIT_ORDER))
    lines = [
        "## Data",
        f"- shard set `{manifest.fingerprint[:12]}`: {schema.height}x{schema.width} "
        f"{schema.encoding}, resize `{manifest.resize}`, preprocessing version "
        f"`{manifest.preprocessing_version}`",
        "",
        "| class | " + " | ".join(splits) + " |",
        "|---|" + "---:|" * len(splits),
    ]
    for name in manifest.classes:
        counts = [str(manifest.splits[split].class_counts.get(name, 0)) for split in splits]
        lines.append(f"| {name} | " + " | ".join(counts) + " |")
    totals = [str(manifest.splits[split].num_records) for split in splits]
    lines += ["| **all** | " + " | ".join(totals) + " |", "", "Generations:"]
    for generation in manifest.generations:
        added = ", ".join(f"{split} {n}" for split, n in generation.num_records.items())
        new = f"; new classes {generation.new_classes}" if generation.new_classes else ""
        lines.append(f"- {generation.number}: {added}{new}")
    if not manifest.generations:
        lines.append("- none recorded")
    return lines


def source_section(report: Mapping[str, Any] | None) -> list[str]:
    """Quarantine, exact and near duplicates, from the ingest report when there is one."""
    if report is None:
        return ["## Source files", "- no ingest report beside these shards"]
    reasons = Counter(str(item.get("reason", "?")) for item in report.get("quarantined", []))
    lines = [
        "## Source files",
        f"- {report.get('files_found', '?')} found, {report.get('accepted', '?')} accepted, "
        f"{report.get('quarantined_count', 0)} quarantined, "
        f"{report.get('duplicate_count', 0)} exact duplicates",
    ]
    lines += [f"  - quarantined: {count} x {reason}" for reason, count in reasons.most_common(5)]
    near = report.get("near_duplicates")
    if isinstance(near, dict):  # ingest's near-duplicate summary (a set built before has none)
        lines.append(
            f"- near-duplicates (Hamming distance <= {near.get('distance', '?')}): "
            f"{near.get('group_count', 0)} groups of {near.get('images_in_groups', 0)} images "
            f"(largest {near.get('largest_group', 0)}), each group in one split; "
            f"{near.get('label_conflict_count', 0)} suspected label conflicts"
        )
    return lines


def label_section(review: Mapping[str, Any]) -> list[str]:
    flagged, reviewed = review.get("flagged", {}), review.get("reviewed", {})
    confusions = review.get("confusions", {})
    at = review.get("min_class_review_accuracy")
    lines = [
        "## Label review",
        "- likely label errors (cleanlab, from this model's held-out probabilities"
        + (
            f", the model at held-out recall and precision >= {at:g} on both the given and "
            "the suggested class"
            if at is not None
            else ""
        )
        + "): "
        + ", ".join(f"{split} {flagged.get(split, 0)} of {n}" for split, n in reviewed.items()),
        "- confusions (flagged, the model not good enough on the given or the suggested class "
        "to judge): " + ", ".join(f"{split} {confusions.get(split, 0)}" for split in reviewed),
        "- the full list is `reports/label_issues.csv`; the sheet `plots/eval/label_issues.png`",
    ]
    lines += [
        f"  - {row['split']} `{row['path']}`: labelled {row['given_label']}, looks like "
        f"{row['suggested_label']} (score {row['score']:.3f})"
        for row in review.get("top", [])
    ]
    return lines


def metrics_section(metrics: Mapping[str, Any]) -> list[str]:
    lines = [
        "## Test metrics per class",
        "| class | precision | recall | f1 | support |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['class']} | {r['precision']:.3f} | {r['recall']:.3f} | {r['f1']:.3f} "
        f"| {r['support']} |"
        for r in metrics["per_class"]
    ]
    return lines


def comparison_section(decision: Mapping[str, Any]) -> list[str]:
    """The decision, the champion's figure and how it was obtained (re-scored by class name
    when its classes differ from today's)."""
    lines = [
        "## Comparison with the champion",
        f"- decision: **{decision['decision']}** on {decision['metric']} "
        f"(`{decision.get('definition', decision['metric'])}`)",
        f"- {decision['reason']}",
    ]
    if decision.get("champion_value_how"):
        lines.append(f"- the champion's figure: {decision['champion_value_how']}")
    evidence = decision.get("evidence")
    if evidence:
        lines.append(
            f"- evidence: {evidence['method']}; p-value {evidence['p_value']:.4g} (promoted "
            f"only below evaluate.promotion_alpha {decision.get('alpha')}); difference "
            f"{evidence['difference']:+.4f}, {evidence['confidence']:.0%} CI "
            f"{evidence['ci_low']:+.4f} to {evidence['ci_high']:+.4f}, on "
            f"{evidence['test_records']} test records"
        )
    if decision.get("experiment"):
        lines.append(
            f"- made by the DVC experiment `{decision['experiment']}`: a challenger, never "
            "the champion (`shardflow promote` moves the champion by hand)"
        )
    classes = decision.get("class_differences")
    if classes:
        lines.append(
            f"- classes differ: the champion's {', '.join(classes['champion_classes'])}; "
            f"today's {', '.join(classes['current_classes'])}; scored by class name: "
            f"{classes['in_words']}"
        )
    return lines


def limits_section(
    manifest: ShardManifest,
    metrics: Mapping[str, Any],
    decision: Mapping[str, Any],
    review: Mapping[str, Any],
) -> list[str]:
    """What the figures above cannot tell, from the data itself."""
    n = metrics["num_test_records"]
    lines = ["## Known limits"]
    if n:
        lines.append(
            f"- {n} test images: one image moves accuracy by {1 / n:.4f}; differences that "
            "small are noise"
        )
    small = [r["class"] for r in metrics["per_class"] if r["support"] < SMALL_CLASS_SUPPORT]
    if small:
        lines.append(f"- fewer than {SMALL_CLASS_SUPPORT} test images in: {', '.join(small)}")
    if sum(review.get("flagged", {}).values()):
        lines.append("- held-out labels the review flags are counted as given in every figure")
    if not decision.get("comparable", True):
        lines.append("- not compared with the champion on the same data (see above)")
    lines.append(
        f"- serves only {manifest.record_schema.height}x{manifest.record_schema.width} "
        f"inputs preprocessed as the shards were (`{manifest.resize}`); images unlike the "
        f"classes {', '.join(manifest.classes)} get one of them anyway"
    )
    return lines


def retraction_paragraph(retraction: Retraction) -> str:
    """The head of a retracted version's card: who or which erasure retracted it and why.
    An erasure is named by its ``data/forgotten.json`` entry (its date, reason and image
    count), never by an image's hash or file name: erasure treats those as marks to erase."""
    if retraction.erasure is not None:
        count = retraction.images
        what = (
            f"by the erasure of {retraction.erasure} recorded in data/forgotten.json (reason: "
            f"{retraction.reason}; {count} image{'s' if count != 1 else ''} forgotten), whose "
            "images it was trained, validated or tested on"
        )
    else:
        what = f"by {retraction.by}: {retraction.reason}"
    return (
        f"{RETRACTION_HEADING}\n"
        f"Retracted {retraction.at} {what}. It holds no alias, `shardflow promote` refuses "
        "it, and Shardflow's loaders (predict, serve-model) refuse it unless "
        "`--allow-retracted`."
    )
