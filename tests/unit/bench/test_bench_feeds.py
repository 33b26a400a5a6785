"""The feeds bench section (bench/feeds.py) and the prepared GPU run (bench/gpu_check.py)
on the CPU, tiny."""

from __future__ import annotations

from bench.feeds import feed_batch
from bench.gpu_check import MODELS, plan

SIZE = (32, 32)
BATCH = 4


def test_resnet50_runs_at_256_a_gpu() -> None:
    assert [feed_batch("resnet50", gpus) for gpus in (0, 1, 8)] == [256, 256, 2048]
    assert feed_batch("efficientnet_b0", 2) == 128


def test_the_gpu_check_plans_one_bench_process_per_model_that_the_bench_accepts() -> None:
    from bench.__main__ import parse_args

    quick = plan(quick=True, images=200)
    assert [step.name for step in quick] == ["read", "feeds-small_cnn", "input"]
    full = plan(quick=False, images=3000)
    assert [step.name for step in full] == [
        "read",
        "feeds-small_cnn",
        "feeds-efficientnet_b0",
        "feeds-resnet50",
        "input",
    ]
    for step in full:
        args = parse_args(list(step.args))  # every option exists
        assert (args.size, args.images, args.skip_s3, args.quick) == (224, 3000, True, False)
        if step.name.startswith("feeds-"):
            assert args.only == ["feeds"] and args.feed_models == [step.name.removeprefix("feeds-")]
            assert (args.mixed_precision, args.xla) == (True, True)
    assert parse_args(list(full[-1].args)).input_models == list(MODELS)
    assert parse_args(list(quick[0].args)).quick
