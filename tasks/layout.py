"""Where each stage reads and writes, relative to the project root (the DVC repo)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    root: Path = Path(".")

    @property
    def params(self) -> Path:
        return self.root / "params.yaml"

    # data flow
    @property
    def index(self) -> Path:
        return self.root / "data" / "ingest" / "index.json"

    @property
    def ingest_report(self) -> Path:
        return self.root / "reports" / "ingest.json"

    @property
    def shards_dir(self) -> Path:
        return self.root / "data" / "shards"

    @property
    def data_diff(self) -> Path:
        """The shard stage's data diff (JSON; the Markdown summary is its ``.md`` sibling)."""
        return self.root / "reports" / "data_diff.json"

    @property
    def validation_report(self) -> Path:
        return self.root / "reports" / "validation.json"

    @property
    def validation_summary(self) -> Path:
        return self.root / "reports" / "validation.md"

    # training flow
    @property
    def model_dir(self) -> Path:
        return self.root / "models"

    @property
    def model_file(self) -> Path:
        return self.model_dir / "model.keras"

    @property
    def train_run(self) -> Path:
        """Small JSON the train stage leaves for evaluate: MLflow run id and lineage."""
        return self.model_dir / "run.json"

    @property
    def backup_dir(self) -> Path:
        """BackupAndRestore state; outside every DVC out so a killed run can resume."""
        return self.root / ".shardflow" / "train_backup"

    @property
    def train_metrics(self) -> Path:
        return self.root / "metrics" / "train.json"

    @property
    def train_plot(self) -> Path:
        return self.root / "plots" / "train_history.png"

    @property
    def eval_metrics(self) -> Path:
        return self.root / "metrics" / "eval.json"

    @property
    def eval_dir(self) -> Path:
        """Evaluation artifacts: per-class table, confusion matrix, misclassified grid."""
        return self.root / "plots" / "eval"

    @property
    def test_predictions(self) -> Path:
        """Evaluation's prediction per test record: the reference served models must match."""
        return self.root / "reports" / "test_predictions.csv"

    def with_root(self, root: str | Path) -> Layout:
        return replace(self, root=Path(root))
