"""``python -m flows.launch.evaluate``, the evaluate stage's command: a child starts importing
what measuring the model needs (Keras with TensorFlow, Matplotlib), then
:func:`flows.evaluate.main` runs the stage, whose task measures the model in that child while
this process opens the tracking store (MLflow's import)."""

from __future__ import annotations

from flows.support.entry import run_then_exit
from flows.support.environment import configure_environment
from tasks.evaluate import stage as evaluate
from tasks.runtime import latency


def prestart() -> None:
    """Start the measuring child, with the offline settings first: it takes this process's
    environment as it is now."""
    configure_environment()
    latency.prestart_child(evaluate.warm_up)


def main() -> None:
    """The child first, then the flow module and the stage."""
    prestart()
    from flows import evaluate as stage  # Prefect's import, while the child imports Keras

    stage.main()


if __name__ == "__main__":
    run_then_exit(main)
