"""Run one measured job in a fresh interpreter, sampling the RSS of its whole process tree.

A fresh process pays what a user's stage pays (imports, worker start-up) and keeps this
process's warm TensorFlow out of the figure. The child prints one JSON line last.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

SAMPLE_S = 0.05
REPO_ROOT = Path(__file__).resolve().parent.parent


def tree_rss(process: psutil.Process) -> tuple[int, int]:
    """(sum, max) RSS in bytes over a process and all its descendants."""
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = biggest = 0
    for member in family:
        try:
            rss = member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += rss
        biggest = max(biggest, rss)
    return total, biggest


def run_measured(
    module: str, args: list[str], log_path: Path, *, timeout_s: float = 3600
) -> dict[str, Any]:
    """``python -m module *args``; returns its JSON line plus wall time and peak RSS (MB)."""
    cmd = [sys.executable, "-m", module, *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # stderr to a file: a full pipe would block the child while we only poll it.
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT)
        watched = psutil.Process(proc.pid)
        peak_sum = peak_max = 0
        while proc.poll() is None:
            total, biggest = tree_rss(watched)
            peak_sum, peak_max = max(peak_sum, total), max(peak_max, biggest)
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                raise TimeoutError(f"over {timeout_s}s: {' '.join(cmd)}")
            time.sleep(SAMPLE_S)
        out = proc.stdout.read() if proc.stdout else ""
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log_path.read_text()[-2000:]
        raise RuntimeError(
            f"`{' '.join(cmd[:4])} ...` failed ({proc.returncode}); {log_path}: {tail}"
        )
    lines = out.strip().splitlines()
    if not lines:
        raise RuntimeError(f"`{' '.join(cmd[:4])} ...` printed no result; see {log_path}")
    return {
        **json.loads(lines[-1]),
        "wall_s": round(wall, 3),
        "peak_rss_mb": round(peak_sum / 2**20, 1),
        "peak_rss_max_process_mb": round(peak_max / 2**20, 1),
    }


def child_rusage() -> dict[str, float]:
    """Peak RSS (MB) of this process and of its largest waited-for child, from getrusage."""
    import resource

    # ru_maxrss is in KiB on Linux.
    return {
        "maxrss_self_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "maxrss_children_mb": round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1
        ),
    }
