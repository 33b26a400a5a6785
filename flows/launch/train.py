"""``python -m flows.launch.train``, the train stage's command: a child starts importing what
training runs (Keras with TensorFlow, MLflow), then :func:`flows.train.main` runs the stage,
whose task trains in that child and reports each epoch back."""

from __future__ import annotations

from flows.support.entry import run_then_exit
from flows.support.environment import configure_environment
from tasks.runtime import latency
from tasks.train import child as train_child
from tasks.train.cluster import config_is_chief, requested_workers


def prestart() -> None:
    """Start the training child, with the offline settings first: it takes this process's
    environment as it is now. None for local workers (the stage spawns them itself) nor for
    another worker of a platform's cluster (it trains without a flow)."""
    if config_is_chief() and requested_workers() == 1:
        configure_environment()
        latency.prestart_child(train_child.warm_up)


def main() -> None:
    """The child first, then the flow module and the stage."""
    prestart()
    from flows import train  # Prefect's import, while the child imports Keras and MLflow

    train.main()


if __name__ == "__main__":
    run_then_exit(main)
