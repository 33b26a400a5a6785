"""``python -m flows.launch.shard [shard|compact] [--params FILE]``, the shard stage's command:
a rebuild's workers spawn and warm up, then :func:`flows.shard.main` runs the stage, whose
pool takes them."""

from __future__ import annotations

from flows.support.entry import parse_stage_args, run_then_exit
from flows.support.environment import configure_environment
from tasks.runtime.params import load_params
from tasks.shard import workers as shard_workers


def prestart() -> None:
    """Start a rebuild's workers, with the offline settings first: they take this process's
    environment as it is now. Params that do not load start none: the run reports them."""
    configure_environment()
    stages, params_path = parse_stage_args(shard_workers.STAGES, "flows.shard")
    try:
        params = load_params(params_path).shard
    except Exception:  # the run reports bad params, with the stage's context
        return
    shard_workers.prestart_stage_workers(params, compact=stages == ["compact"])


def main() -> None:
    """The workers first, then the flow module and the stage."""
    prestart()
    from flows import shard  # Prefect's import, while the workers spawn

    shard.main()


if __name__ == "__main__":
    run_then_exit(main)
