"""``python -m flows.launch.validate``, the validate stage's command: the TensorFlow
cross-check's child starts importing TensorFlow, then :func:`flows.validate.main` runs the
stage. On an append that import is validation's critical path; started here it overlaps the
stage's own imports (Prefect) and set-up."""

from __future__ import annotations

from flows.support.entry import run_then_exit
from flows.support.environment import configure_environment
from tasks.validate import tf_cross_check


def prestart() -> None:
    """Start the cross-check's child, with the offline settings first: it takes this
    process's environment as it is now."""
    configure_environment()
    tf_cross_check.prestart()


def main() -> None:
    """The child first, then the flow module and the stage."""
    prestart()
    from flows import validate  # Prefect's import, while the child imports TensorFlow

    validate.main()


if __name__ == "__main__":
    run_then_exit(main)
