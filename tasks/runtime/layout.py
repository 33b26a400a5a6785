"""Where each stage reads and writes, relative to the project root (the DVC repo)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

DVC_ROOT_ENV = "DVC_ROOT"  # set by DVC for every stage command: the repository's root
# Where the libraries Shardflow runs keep files of their own, under the repository (in
# .shardflow/, ignored by git) instead of the user's home or the machine's shared folders:
# Keras writes keras.json into $KERAS_HOME (else ~/.keras) at its first import when none is
# there; Matplotlib keeps its font cache and reads matplotlibrc in $MPLCONFIGDIR (else
# ~/.cache/matplotlib and ~/.config/matplotlib); DVC keeps its index and file-hash state in
# $DVC_SITE_CACHE_DIR (else /var/tmp/dvc, kept after the run); on a GPU the CUDA driver keeps
# the kernels it compiles in $CUDA_CACHE_PATH (else ~/.nv/ComputeCache). $MATPLOTLIBRC, a
# file named anywhere, is dropped.
LIBRARY_HOMES = {
    "KERAS_HOME": ".shardflow/keras",
    "MPLCONFIGDIR": ".shardflow/matplotlib",
    "DVC_SITE_CACHE_DIR": ".shardflow/dvc",
    "CUDA_CACHE_PATH": ".shardflow/cuda",
}
LIBRARY_FILE_ENV = "MATPLOTLIBRC"


def shared_root(root: str | Path = ".") -> Path:
    """The repository whose shared stores (MLflow database, Prefect home) a run uses.

    A queued ``dvc exp run`` runs the stages in a temporary copy under ``.dvc/tmp/exps``;
    DVC then points ``$DVC_ROOT`` at the real repository, so runs land in its ``mlflow.db``
    instead of a copy that is deleted afterwards. Outside DVC it is ``root``.
    """
    dvc_root = os.environ.get(DVC_ROOT_ENV)
    return Path(dvc_root).resolve() if dvc_root else Path(root).resolve()


def keep_library_files_in(env: MutableMapping[str, str], root: str | Path = ".") -> None:
    """Point ``env`` (``os.environ``, or a child's) at :data:`LIBRARY_HOMES` under the
    repository at ``root`` (its :func:`shared_root`): a run neither reads a user's Keras or
    Matplotlib settings nor writes into their home, and DVC keeps its site cache in the
    repository too. Whatever ``env`` said before is replaced; every entry point does this
    before Keras or Matplotlib is imported, and ``shardflow`` before it runs ``dvc``."""
    base = shared_root(root)
    env.update({name: str(base / path) for name, path in LIBRARY_HOMES.items()})
    env.pop(LIBRARY_FILE_ENV, None)


def keep_dvc_site_cache_in_repository(root: str | Path = ".") -> None:
    """Name the repository's DVC site cache (``LIBRARY_HOMES``) in its untracked
    ``.dvc/config.local`` as ``core.site_cache_dir``, so that a ``dvc`` typed by hand, which
    no entry point of ours started, keeps its index there too instead of ``/var/tmp/dvc``.
    DVC takes the setting as it is written, relative to the working directory, so it is the
    absolute path: rewritten when the clone has moved, left alone when it is already right
    (the file's other settings are kept). Nothing is written outside a DVC repository."""
    base = shared_root(root)
    if not (base / ".dvc").is_dir():
        return
    from dvc.config import Config

    wanted = str(base / LIBRARY_HOMES["DVC_SITE_CACHE_DIR"])
    config = Config(dvc_dir=str(base / ".dvc"), validate=False)
    if config.load_one("local").get("core", {}).get("site_cache_dir") == wanted:
        return
    with config.edit("local") as local:
        local["core"]["site_cache_dir"] = wanted


@dataclass(frozen=True, init=False)
class Layout:
    """Every path a stage reads or writes, under ``root`` (a path or a string)."""

    root: Path

    def __init__(self, root: str | Path = ".") -> None:
        object.__setattr__(self, "root", Path(root))

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
    def ingest_metrics(self) -> Path:
        """The ingest report's headline figures
        (:data:`tasks.runtime.metrics_files.INGEST_FIGURES`)."""
        return self.root / "metrics" / "ingest.json"

    @property
    def handoff(self) -> Path:
        """Ingest's decodes of new images, kept for the shard stage (``tasks.contracts.handoff``):
        per-clone state outside every DVC out; the shard stage empties it."""
        return self.root / ".shardflow" / "handoff"

    @property
    def sheets(self) -> Path:
        """Contact sheets of images for a user to look at (per clone, outside every DVC
        out): ingest's flagged near-duplicate groups in ``near-duplicates/``."""
        return self.root / ".shardflow" / "sheets"

    @property
    def shards_dir(self) -> Path:
        return self.root / "data" / "shards"

    @property
    def membership_archive(self) -> Path:
        """Each shard set's membership by fingerprint (``tasks.contracts.membership``): per-clone,
        outside every DVC out, what ``shardflow lineage`` reads for sets no longer current."""
        return self.root / ".shardflow" / "membership"

    @property
    def forgotten(self) -> Path:
        """The audit record of forgotten images (content hashes only), git-tracked."""
        return self.root / "data" / "forgotten.json"

    @property
    def excluded(self) -> Path:
        """Content hashes ingest never admits again (``tasks.contracts.exclusions``),
        git-tracked."""
        return self.root / "data" / "excluded.json"

    @property
    def shard_changes(self) -> Path:
        """What the last shard run changed in the shard folder, record by record (JSON; the
        Markdown summary is its ``.md`` sibling)."""
        return self.root / "reports" / "shard_changes.json"

    @property
    def accepted_data(self) -> Path:
        """The last accepted data version, the data gate's baseline: validate's persisted,
        git-tracked output (``tasks.validate.data_gate``)."""
        return self.root / "data" / "accepted.json"

    @property
    def data_diff(self) -> Path:
        """Validate's diff from the accepted data version (JSON; Markdown beside it)."""
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
        """Training backups (tasks/train/backup.py), outside every DVC out: a killed run resumes."""
        return self.root / ".shardflow" / "train_backup"

    @property
    def train_metrics(self) -> Path:
        return self.root / "metrics" / "train.json"

    @property
    def train_summary(self) -> Path:
        """What ``metrics/train.json`` cannot hold (DVC metrics are numbers): strings."""
        return self.root / "reports" / "train_summary.json"

    @property
    def train_history(self) -> Path:
        """One row per epoch (``epoch`` from 1, losses, accuracies): DVC plot data."""
        return self.root / "plots" / "train_history.json"

    @property
    def train_plot(self) -> Path:
        return self.root / "plots" / "train_history.png"

    @property
    def eval_metrics(self) -> Path:
        return self.root / "metrics" / "eval.json"

    @property
    def eval_summary(self) -> Path:
        """The evaluation record beside the numeric metrics: run, version, promotion."""
        return self.root / "reports" / "eval_summary.json"

    @property
    def eval_dir(self) -> Path:
        """Evaluation artifacts: per-class table, confusion matrix, misclassified grid."""
        return self.root / "plots" / "eval"

    @property
    def test_predictions(self) -> Path:
        """Evaluation's prediction per test record: the reference served models must match."""
        return self.root / "reports" / "test_predictions.csv"

    @property
    def label_issues(self) -> Path:
        """Label review: likely label errors in val and test, most suspect first."""
        return self.root / "reports" / "label_issues.csv"

    @property
    def model_card(self) -> Path:
        """The model and data card of the version evaluation registered (Markdown)."""
        return self.root / "reports" / "model_card.md"
