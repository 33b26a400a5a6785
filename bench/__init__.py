"""Shardflow benchmark: read, write, input-bound, orchestration and scaling figures.

Run ``python -m bench --help``. Every figure is the median of several timed passes after a
warm-up; the whole run writes ``reports/bench.json`` and ``reports/bench.png``.
"""
