"""`make run` ends with a summary read from the run's outputs (fixture files here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flows.cli.run_summary import stage_outcomes, summary_lines
from flows.cli.shardflow import teed

DVC_OUTPUT = [
    "Running stage 'source':\n",  # always_changed: it runs every time, so it is not reported
    "> python -m tasks.ingest.source_check\n",
    "Stage 'ingest' didn't change, skipping\n",
    "Running stage 'shard':\n",
    "> python -m flows.shard\n",
    "Running stage 'validate':\n",
    "Stage 'train' didn't change, skipping\n",
    "Running stage 'evaluate':\n",
    "Use `dvc push` to send your updates to remote storage.\n",
]


def write(root: Path, name: str, value: object) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def outputs(root: Path, promoted: bool) -> None:
    write(root, "reports/ingest.json", {"files_found": 3007, "quarantined_count": 7})
    write(
        root,
        "reports/validation.json",
        {"passed": True, "num_records": {"train": 2339, "val": 326, "test": 334}},
    )
    write(root, "metrics/eval.json", {"accuracy": 0.9550898, "num_test_records": 334})
    reason = "accuracy 0.9551 beats champion v1 (0.9400)" if promoted else "no gain over v1"
    promotion = {"candidate_version": "2", "promoted": promoted, "reason": reason}
    evaluated = {"promotion": promotion, "run_id": "r1", "test_fingerprint": SHARDS}
    write(root, "reports/eval_summary.json", evaluated)
    write(root, "data/shards/manifest.json", {"fingerprint": SHARDS})
    write(root, "models/run.json", {"run_id": "r1", "fingerprint": SHARDS})


SHARDS = "5" * 64  # the fingerprint of the shards the fixture's model was evaluated on


def test_stages_run_and_skipped_come_from_dvc_in_pipeline_order() -> None:
    assert stage_outcomes(DVC_OUTPUT) == (["shard", "validate", "evaluate"], ["ingest", "train"])
    assert stage_outcomes([]) == ([], [])


def test_the_summary_says_what_the_outputs_hold(tmp_path: Path) -> None:
    outputs(tmp_path, promoted=False)
    text = "\n".join(summary_lines(tmp_path, DVC_OUTPUT))
    assert "stages run: shard, validate, evaluate; skipped as unchanged: ingest, train" in text
    assert "3007 found, 7 quarantined" in text
    assert "records per split: train 2339, val 326, test 334; validation passed" in text
    assert "test accuracy: 0.9551 on 334 records" in text
    assert "champion: v2 not promoted: no gain over v1" in text
    assert "`shardflow ui`" in text and "Prefect UI" in text


def test_a_promotion_and_missing_outputs_are_said_plainly(tmp_path: Path) -> None:
    outputs(tmp_path, promoted=True)
    assert any(
        line.startswith("champion: v2 promoted: accuracy 0.9551 beats")
        for line in summary_lines(tmp_path, DVC_OUTPUT)
    )
    empty = "\n".join(summary_lines(tmp_path / "nothing", []))
    assert "stages run: none" in empty and "test accuracy: - on - records" in empty
    assert "champion: -" in empty and "records per split: -; validation -" in empty


@pytest.mark.parametrize("moved", ["new shards", "new shards and model", "another model"])
def test_a_figure_of_other_shards_or_another_model_is_never_shown_as_this_run_s(
    tmp_path: Path, moved: str
) -> None:
    """`shardflow run validate` with a new split: metrics/eval.json still holds the last
    model's accuracy on the old test split; the summary says the model has not been
    evaluated on these shards yet, and shows neither that figure nor the old decision."""
    outputs(tmp_path, promoted=True)
    new = "6" * 64
    if moved != "another model":
        write(tmp_path, "data/shards/manifest.json", {"fingerprint": new})
    if moved != "new shards":
        fingerprint = new if moved == "new shards and model" else SHARDS
        write(tmp_path, "models/run.json", {"run_id": "r2", "fingerprint": fingerprint})
    text = "\n".join(summary_lines(tmp_path, DVC_OUTPUT))
    assert "test accuracy: the model has not been evaluated on these shards yet" in text
    assert "0.9551" not in text and "334 records" not in text
    assert "champion: - (no decision on these shards yet)" in text


def test_the_summary_names_the_current_dataset_s_model(tmp_path: Path) -> None:
    """After a switch to one's own photos the champion line names their registered model,
    not the demo's."""
    outputs(tmp_path, promoted=True)
    summary = json.loads((tmp_path / "reports/eval_summary.json").read_text())
    summary["promotion"]["model_name"] = "shardflow-photos-1a2b3c"
    write(tmp_path, "reports/eval_summary.json", summary)
    assert any(
        line.startswith("champion: shardflow-photos-1a2b3c v2 promoted: accuracy 0.9551")
        for line in summary_lines(tmp_path, DVC_OUTPUT)
    )


def test_teed_shows_and_keeps_the_output_and_the_exit_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, lines, _ = teed([sys.executable, "-c", "print('a'); print('b'); raise SystemExit(4)"], {})
    assert code == 4 and lines == ["a\n", "b\n"]
    assert capsys.readouterr().out == "a\nb\n"


def test_a_first_baseline_is_said_only_by_the_run_that_recorded_it(tmp_path: Path) -> None:
    outputs(tmp_path, promoted=True)
    first = {"dataset": "data/photos", "fingerprint": "ab12" * 16, "accepted_fingerprint": None}
    write(tmp_path, "reports/data_diff.json", first)
    said = [line for line in summary_lines(tmp_path, DVC_OUTPUT) if "baseline" in line]
    assert said == [
        "data baseline: dataset 'data/photos' had no accepted version; these shards "
        "(ab12ab12ab12) became its baseline (data/accepted.json)"
    ]
    skipped = [line.replace("Running", "Skipped") for line in DVC_OUTPUT]  # validate unrun
    assert not [line for line in summary_lines(tmp_path, skipped) if "baseline" in line]
    write(tmp_path, "reports/data_diff.json", {**first, "accepted_fingerprint": "cd34" * 16})
    assert not [line for line in summary_lines(tmp_path, DVC_OUTPUT) if "baseline" in line]
