"""``make gpu-check OUT=folder``: the GPU bench sections as one prepared run, within a budget.

Run by ``bench/gpu_check.sh`` once the project is installed. Each step is one ``python -m
bench`` process (one per model for the side-by-side ``feeds`` section, where a model's
precision policy and XLA are process-wide), bounded by what is left of the budget, its
figures written to ``OUT/<step>.json``; ``OUT/gpu_check.json`` gathers them after every step,
with the devices, so a run cut short still leaves what it measured. ``--quick`` runs the
same steps tiny, on any machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS = ("small_cnn", "efficientnet_b0", "resnet50")
# The steps' budget after the install: a short time on a GPU machine still ends with every
# step that finished written, and a step the budget cuts short says so.
BUDGET_S = 540.0
SIZE = 224


@dataclass(frozen=True)
class Step:
    """One bench process: its name (its JSON's) and its ``python -m bench`` arguments."""

    name: str
    args: tuple[str, ...]


def plan(*, quick: bool, images: int) -> list[Step]:
    """The steps in the order they run: read_split's own images/s (raw, jpeg), then each
    model fed four ways, then the training probe of every model (mixed precision, XLA)."""
    common: tuple[str, ...] = ("--skip-s3", "--images", str(images), "--size", str(SIZE))
    common += ("--quick",) if quick else ("--passes", "3")
    gpu = ("--mixed-precision", "--xla")
    models = MODELS[:1] if quick else MODELS
    steps = [Step("read", ("--only", "read", *common))]
    steps += [
        Step(f"feeds-{m}", ("--only", "feeds", "--feed-models", m, *common, *gpu)) for m in models
    ]
    probe = ("--input-models", ",".join(models), "--input-size", str(SIZE), "--input-crop", "0")
    steps.append(Step("input", ("--only", "input", *probe, *common, *gpu)))
    return steps


def run_step(step: Step, out: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``step`` into ``out/<name>.json``; its figures, or why it has none."""
    report = out / f"{step.name}.json"
    command = [sys.executable, "-m", "bench", *step.args, "--out", str(report)]
    start = time.monotonic()
    try:
        done = subprocess.run(command, timeout=max(timeout_s, 1.0), check=False)
    except subprocess.TimeoutExpired:
        outcome = f"stopped after {timeout_s:.0f} s: the budget ran out"
    else:
        outcome = "ok" if done.returncode == 0 else f"exit status {done.returncode}"
    figures = json.loads(report.read_text()) if report.is_file() else {}
    return {"outcome": outcome, "seconds": round(time.monotonic() - start, 1), "figures": figures}


def devices() -> dict[str, Any]:
    """The GPUs the driver lists and those TensorFlow sees, with its CUDA build."""
    import tensorflow as tf

    from tasks.runtime.accelerator import listed_gpus

    build = tf.sysconfig.get_build_info()
    return {
        "nvidia_smi": listed_gpus(),
        "tensorflow": tf.__version__,
        "tensorflow_gpus": [
            tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
            for gpu in tf.config.list_physical_devices("GPU")
        ],
        "cuda_build": {key: str(build.get(key, "")) for key in ("cuda_version", "cudnn_version")},
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument("--quick", action="store_true", help="tiny steps, one model (any machine)")
    parser.add_argument("--images", type=int, default=3000, help="images of the bench set")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all steps")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    images = min(args.images, 200) if args.quick else args.images
    result: dict[str, Any] = {"devices": devices(), "budget_s": args.budget_s, "steps": {}}
    deadline = time.monotonic() + args.budget_s
    for step in plan(quick=args.quick, images=images):
        left = deadline - time.monotonic()
        if left < 1:
            result["steps"][step.name] = {"outcome": "not run: the budget ran out"}
            continue
        print(f"gpu-check: {step.name} ({left:.0f} s left)", flush=True)
        result["steps"][step.name] = run_step(step, args.out, left)
        (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
