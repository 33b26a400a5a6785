"""Orchestration tax: the pipeline through DVC + Prefect (+ MLflow) vs direct stage calls.

Both runs happen in throw-away copies of the repo (tracked and untracked-but-not-ignored
files), with the benchmark images linked in as the copy's ``data/demo``, which its
``params.yaml`` names whatever the working copy's names: a copy never reads or writes the
folder of images the user's params point at.
``python -m bench.orchestration ROOT STAGE...`` is the direct runner: one interpreter calling
the stage functions in order, as a user without orchestration would.
"""

from __future__ import annotations

import compileall
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from tasks.runtime.layout import Layout
from tasks.runtime.params import Params, deep_merge, load_params


def _source(params: Params, layout: Layout) -> None:
    from tasks.ingest.source_check import write_listing

    write_listing(layout.root, params.ingest.source_dir)


def _ingest(params: Params, layout: Layout) -> None:
    from tasks.contracts.handoff import Target
    from tasks.ingest.stage import run_ingest

    target = Target.of(params.shard)
    run_ingest(
        params.ingest, layout.index, layout.ingest_report, handoff=layout.handoff, target=target
    )


def _shard(params: Params, layout: Layout) -> None:
    from tasks.shard.stage import shard_stage

    shard_stage(params.shard, layout.index, layout.shards_dir, handoff=layout.handoff)


def _validate(params: Params, layout: Layout) -> None:
    from tasks.validate import stage as validate

    report = validate.run_validate(
        layout.shards_dir,
        layout.validation_report,
        layout.validation_summary,
        index_path=layout.index,
    )
    validate.raise_if_failed(report)


def _train(params: Params, layout: Layout) -> None:
    from tasks.train.stage import run_train

    run_train(params, layout)  # MLflow logging is the stage's own work, so it stays in


def _evaluate(params: Params, layout: Layout) -> None:
    from tasks.evaluate.stage import run_evaluate

    run_evaluate(params, layout)


# Stage name (as in dvc.yaml) -> the same work as its flow task, without Prefect or DVC.
DIRECT_STAGES: dict[str, Callable[[Params, Layout], None]] = {
    "source": _source,
    "ingest": _ingest,
    "shard": _shard,
    "validate": _validate,
    "train": _train,
    "evaluate": _evaluate,
}


# Stage inputs inside folders of outputs: the train stage's pretrained weights, and the
# exclusion list the source and ingest stages read (git-tracked).
INPUTS_AMONG_OUTPUTS = ("models/pretrained/", "data/excluded.json")
# Stage outputs and local state: each copy must start from a clean slate.
NOT_COPIED = {
    "data",
    "models",
    "metrics",
    "plots",
    "reports",
    "mlruns",
    "mlartifacts",
    ".shardflow",
    ".prefect",
    "dvc.lock",
    "mlflow.db",
}


def dvc_stages(repo_root: Path) -> list[str]:
    """Stage names of ``dvc.yaml`` in file order."""
    data = yaml.safe_load((repo_root / "dvc.yaml").read_text())
    return list((data or {}).get("stages", {}))


# Where a copy's params.yaml finds its images, inside the copy.
COPY_SOURCE = "data/demo"


def copy_repo(repo_root: Path, dest: Path, *, images: Path, overrides: dict[str, Any]) -> Path:
    """Copy the working tree (no ignored files), link the images in, apply param overrides."""
    shutil.rmtree(dest, ignore_errors=True)
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=repo_root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for rel in filter(None, listed):
        if rel.split("/")[0] in NOT_COPIED and not rel.startswith(INPUTS_AMONG_OUTPUTS):
            continue
        src = repo_root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    params = (
        yaml.safe_load((dest / "params.yaml").read_text())
        if (dest / "params.yaml").exists()
        else {}
    )
    params = deep_merge(params or {}, overrides)
    # The copy's own images: the working copy's source_dir may be absolute (the user's
    # photos), and ``dest / absolute`` is that folder, which the next lines empty.
    params = deep_merge(params, {"ingest": {"source_dir": COPY_SOURCE, "labels_csv": None}})
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    source = dest / load_params(dest / "params.yaml").ingest.source_dir
    if not source.resolve().is_relative_to(dest.resolve()):
        raise RuntimeError(f"{source}: a bench copy's images must lie inside it ({dest})")
    shutil.rmtree(source, ignore_errors=True)
    source.parent.mkdir(parents=True, exist_ok=True)
    try:  # hard links: instant, and DVC hashes the same bytes
        shutil.copytree(images, source, copy_function=os.link)
    except OSError:
        shutil.rmtree(source, ignore_errors=True)
        shutil.copytree(images, source)
    compile_packages(dest)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-qm", "bench snapshot", "--no-verify"], cwd=dest, check=True)
    if not (dest / ".dvc").exists():
        _run([sys.executable, "-m", "dvc", "init", "-q"], dest)
    return dest


def compile_packages(root: Path) -> None:
    """Byte-compile the Python packages at the top of ``root``, as a checkout has them after
    its first run. Both sides then import bytecode: where none is written
    (``PYTHONDONTWRITEBYTECODE``), each stage process of a copy would otherwise compile every
    module it imports, again in each of the five, while the direct pass compiles once."""
    for package in sorted(p.parent for p in root.glob("*/__init__.py")):
        if not compileall.compile_dir(package, quiet=1):
            raise RuntimeError(f"{package} does not compile")


def _env(off: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment for a run, with the latency pieces ``off`` turned off
    (:mod:`tasks.runtime.latency`) in it and every process it starts."""
    from tasks.runtime.latency import OFF_ENV

    # `python` in dvc.yaml commands must be this interpreter.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "true"}
    env[OFF_ENV] = ",".join(off)
    return env


STAGE_LINE = re.compile(r"^Running stage '([^']+)'")
DVC_START = "(dvc start)"
DIRECT_START = "(imports and exit)"


def stage_seconds(marks: list[tuple[float, str]], end: float) -> dict[str, float]:
    """Seconds per stage from ``(time, line)`` marks of a ``dvc repro`` output: from its
    ``Running stage`` line to the next one (or the end), so DVC's lock and hashing after a
    stage count with it; what precedes the first stage is :data:`DVC_START`."""
    starts = [(at, m.group(1)) for at, line in marks if (m := STAGE_LINE.match(line))]
    if not starts:
        return {}
    bounds = [at for at, _ in starts[1:]] + [end]
    seconds = {name: round(stop - at, 3) for (at, name), stop in zip(starts, bounds, strict=True)}
    return {DVC_START: round(starts[0][0], 3), **seconds}


def _run_dvc_repro(
    target: str,
    cwd: Path,
    timeout: float = 7200,
    off: Sequence[str] = (),
    transcript: Path | None = None,
) -> dict[str, float]:
    """``dvc repro target``, timing each stage from its output as it streams; killed after
    ``timeout`` seconds, with its stages (reading the stream would otherwise wait on a hung
    run forever: a stage process holds the stream open after DVC itself is gone). Its output,
    each line with the second it arrived at, goes to ``transcript``: a slow pass tells why."""
    os.sync()  # the copy's writes reach the disk before the pass, not inside it
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro", target],
        cwd=cwd,
        env=_env(off),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    marks: list[tuple[float, str]] = []
    tail: deque[str] = deque(maxlen=41)
    deadline = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
    deadline.start()
    try:
        for line in process.stdout:
            marks.append((time.perf_counter() - start, line))
            tail.append(line)
        process.wait()
    finally:
        deadline.cancel()
        if transcript is not None:
            transcript.write_text("".join(f"{at:9.3f} {line}" for at, line in marks))
    end = time.perf_counter() - start
    if end >= timeout:
        raise TimeoutError(f"`dvc repro {target}` in {cwd} ran past {timeout} s and was killed")
    if process.returncode != 0:
        raise RuntimeError(
            f"`dvc repro {target}` in {cwd} failed ({process.returncode}): {''.join(tail)[-3000:]}"
        )
    return {**stage_seconds(marks, end), "total": round(end, 3)}


def _run_direct(root: Path, stages: list[str], off: Sequence[str] = ()) -> dict[str, float]:
    """The direct runner in a fresh interpreter; its own timing of each stage.

    It runs in its copy, so it imports that copy's code, as each stage of a ``dvc repro``
    pass imports its own copy's (not this checkout's, whose bytecode state differs); a
    runner that ran other code than its copy's is an error."""
    os.sync()  # the copy's writes reach the disk before the pass, not inside it
    end, out = _run_with_output(
        [sys.executable, "-m", "bench.orchestration", str(root), *stages], root, off=off
    )
    ran = json.loads(out.strip().splitlines()[-1])
    if Path(ran["code"]).resolve() != root.resolve():
        raise RuntimeError(f"the direct pass ran the code in {ran['code']}, not its copy's {root}")
    seconds: dict[str, float] = ran["seconds"]
    # Its interpreter's start, imports (TensorFlow, Keras, MLflow: once, for every stage)
    # and exit: the direct pipeline's counterpart of each stage process's start-up.
    seconds[DIRECT_START] = round(end - sum(seconds.values()), 3)
    return {**seconds, "total": round(end, 3)}


def tax_from_stages(direct: list[dict[str, float]], dvc: list[dict[str, float]]) -> float:
    """1 - direct / dvc over each stage's fastest pass on each side (DVC's start and the
    direct interpreter's imports and exit included).

    Training is most of either run and, on 2 cores, varies between passes by more than the
    whole tax; a stage's fastest pass is its least disturbed, so the sum of those is the
    pipeline as each side runs it undisturbed.
    """
    fastest_direct = sum(min(p[s] for p in direct) for s in direct[0] if s != "total")
    fastest_dvc = sum(min(p[s] for p in dvc) for s in dvc[0] if s != "total")
    return 1 - fastest_direct / fastest_dvc


def tax_spread(direct: list[dict[str, float]], dvc: list[dict[str, float]]) -> dict[str, Any]:
    """The tax of each pass (1 - direct / dvc over the whole run, each direct pass paired
    with the ``dvc repro`` pass run right after it) and their median, spread (min, max)
    and interquartile range.

    One pass pair is the unit: both halves run back to back, so a slow spell of the shared
    machine falls on both, and the median of five or more pairs moves less between full
    runs than any single pair of the same code.
    """
    if not direct or len(direct) != len(dvc):
        raise ValueError(f"{len(direct)} direct passes and {len(dvc)} dvc passes: pair them")
    per_pass = [1 - d["total"] / o["total"] for d, o in zip(direct, dvc, strict=True)]
    taxes = sorted(per_pass)
    return {
        "median": round(statistics.median(taxes), 4),
        "min": round(taxes[0], 4),
        "max": round(taxes[-1], 4),
        "iqr": round(_quartile(taxes, 0.75) - _quartile(taxes, 0.25), 4),
        "passes": len(taxes),
        "per_pass": [round(t, 4) for t in per_pass],
    }


def piece_savings(
    direct: list[dict[str, float]],
    dvc: list[dict[str, float]],
    off: dict[str, list[dict[str, float]]],
) -> dict[str, Any]:
    """What each latency piece saves, from paired passes: the ``dvc repro`` pass with it off
    against the pass with all on run just before; ``saving`` is the median of each pair's
    ``1 - with / without``, ``tax_without`` the orchestration tax without it."""
    out: dict[str, Any] = {}
    with_s = [p["total"] for p in dvc]
    for piece, passes in off.items():
        without_s = [p["total"] for p in passes]
        savings = [1 - w / o for w, o in zip(with_s, without_s, strict=True)]
        tax = [1 - d["total"] / p["total"] for d, p in zip(direct, passes, strict=True)]
        out[piece] = {
            "with_s": round(statistics.median(with_s), 3),
            "without_s": round(statistics.median(without_s), 3),
            "saving": round(statistics.median(savings), 4),
            "per_pass": [round(x, 4) for x in savings],
            "tax_without": round(statistics.median(tax), 4),
        }
    return out


def _quartile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile of sorted ``values`` (numpy's default method)."""
    at = q * (len(values) - 1)
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def _run_with_output(
    cmd: list[str], cwd: Path, timeout: float = 7200, off: Sequence[str] = ()
) -> tuple[float, str]:
    """Run a command (the latency pieces ``off`` turned off); return its wall seconds and
    standard output; raise with its output tail when it fails."""
    start = time.perf_counter()
    done = subprocess.run(
        cmd, cwd=cwd, env=_env(off), capture_output=True, text=True, timeout=timeout
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip()[-3000:]
        raise RuntimeError(f"`{' '.join(cmd)}` in {cwd} failed ({done.returncode}): {tail}")
    return elapsed, done.stdout


def _run(cmd: list[str], cwd: Path, timeout: float = 7200) -> float:
    """Run a command; return its wall seconds; raise with its output tail when it fails."""
    return _run_with_output(cmd, cwd, timeout)[0]


def measure_orchestration(
    repo_root: Path,
    work_dir: Path,
    *,
    images: Path,
    overrides: dict[str, Any] | None = None,
    passes: int = 5,
    without: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time ``dvc repro`` vs direct calls over the stages both can run, then a no-op repro.

    ``without``: latency pieces (:data:`tasks.runtime.latency.PIECES`); each pass adds a
    ``dvc repro`` pass with each one off, right after the pass with all on. Their figures are
    ``latency`` (:func:`piece_savings`).

    Each pass runs both from fresh copies, alternating (direct, dvc, direct, dvc, ...),
    timing every stage on each side. Training is most of either run and, on a small shared
    machine, varies between passes by more than the tax itself, so the figure is the median
    of the ``passes`` paired taxes with their spread (:func:`tax_spread`). Returns
    ``orchestration_tax`` (that median: the share of the orchestrated wall time that is
    overhead), ``orchestration_tax_spread`` (median, min, max, IQR, per pass),
    ``dvc_noop_s`` and the details: every pass's seconds per stage, ``fastest_stage_tax``
    over each stage's fastest pass (:func:`tax_from_stages`) and ``whole_run_tax`` from
    the fastest whole runs.
    """
    repo_root = repo_root.resolve()
    if not (repo_root / "dvc.yaml").exists():
        return {
            "orchestration_tax": None,
            "dvc_noop_s": None,
            "note": f"{repo_root / 'dvc.yaml'} does not exist yet",
        }
    _require_prefect_server(repo_root)
    overrides = overrides or {}
    stages = dvc_stages(repo_root)
    covered = []
    for stage in stages:  # the longest prefix of the pipeline with a known direct call
        if stage not in DIRECT_STAGES:
            break
        covered.append(stage)
    if not covered:
        raise RuntimeError(f"no direct call known for the first dvc stage {stages[0]!r}")
    skipped = [s for s in stages if s not in covered]

    direct_passes, dvc_passes = [], []
    off_passes: dict[str, list[dict[str, float]]] = {piece: [] for piece in without}
    for number in range(1, max(1, passes) + 1):
        direct_root = copy_repo(repo_root, work_dir / "direct", images=images, overrides=overrides)
        log(f"  pass {number}: direct: {', '.join(covered)}")
        direct_passes.append(_run_direct(direct_root, covered))
        dvc_root = copy_repo(repo_root, work_dir / "dvc", images=images, overrides=overrides)
        log(f"  pass {number}: dvc repro {covered[-1]} (runs {', '.join(covered)})")
        transcript = work_dir / f"dvc-repro-pass-{number}.log"
        dvc_passes.append(_run_dvc_repro(covered[-1], dvc_root, transcript=transcript))
        log(f"    direct {direct_passes[-1]}; dvc repro {dvc_passes[-1]}")
        for piece in without:
            root = copy_repo(repo_root, work_dir / "dvc-off", images=images, overrides=overrides)
            off_passes[piece].append(_run_dvc_repro(covered[-1], root, off=[piece]))
            log(f"    dvc repro without {piece}: {off_passes[piece][-1]}")
    direct_s = min(p["total"] for p in direct_passes)
    dvc_s = min(p["total"] for p in dvc_passes)
    full_s = None
    if skipped:
        log(f"  dvc repro (the rest: {', '.join(skipped)})")
        full_s = _run([sys.executable, "-m", "dvc", "repro"], cwd=dvc_root)
    log("  dvc repro (no-op)")
    noop = [_run([sys.executable, "-m", "dvc", "repro"], cwd=dvc_root) for _ in range(3)]
    spread = tax_spread(direct_passes, dvc_passes)
    return {
        "orchestration_tax": spread["median"],
        "orchestration_tax_spread": spread,
        "fastest_stage_tax": round(tax_from_stages(direct_passes, dvc_passes), 4),
        "dvc_noop_s": sorted(noop)[1],
        "whole_run_tax": round(1 - direct_s / dvc_s, 4),
        "dvc_s": round(dvc_s, 3),
        "direct_s": round(direct_s, 3),
        "dvc_passes": dvc_passes,
        "direct_passes": direct_passes,
        "stages_compared": covered,
        "stages_not_compared": skipped,
        "dvc_rest_s": None if full_s is None else round(full_s, 3),
        "dvc_noop_passes": [round(s, 3) for s in noop],
        "overrides": overrides,
        "latency": piece_savings(direct_passes, dvc_passes, off_passes),
    }


def _require_prefect_server(repo_root: Path) -> None:
    """The flows refuse to run without their Prefect server; say so before copying anything.
    The copies are other directories, with no record of this clone's server: name it to
    them (PREFECT_API_URL), or each would start a server of its own."""
    check = "from flows.servers.prefect_server import running_url; print(running_url() or '')"
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=repo_root, env=_env(), capture_output=True, text=True
    )
    url = done.stdout.strip()
    if done.returncode != 0 or not url:
        raise RuntimeError(
            "this clone's Prefect server is not up, and the flows that `dvc repro` runs need "
            "it: start one with `make serve` (or "
            "`python -m flows.servers.prefect_server ensure`), or pass "
            f"--skip-orchestration. {done.stderr.strip()[-300:]}"
        )
    os.environ["PREFECT_API_URL"] = url


def _direct(root: str, *stages: str) -> None:
    """One interpreter, the stage functions in order: the pipeline without orchestration.
    Prints the seconds of each stage and the checkout whose code it ran."""
    import tasks
    from tasks.runtime.tf_imports import keras_without_extras

    keras_without_extras()  # Keras imported as the stages import it: not orchestration
    os.chdir(root)
    layout = Layout(".")
    params = load_params(layout.params)
    seconds = {}
    for stage in stages:
        start = time.perf_counter()
        DIRECT_STAGES[stage](params, layout)
        seconds[stage] = round(time.perf_counter() - start, 3)
    print(json.dumps({"seconds": seconds, "code": str(Path(tasks.__file__).parent.parent)}))


if __name__ == "__main__":
    _direct(*sys.argv[1:])
