"""Shardflow's plain-Python logic (no Prefect), one package a wing over two ground floors.

``runtime`` and the pixel contract (``images``, ``schema``, ``tfrecord``: the preprocessing
shards and predictions share, kept at these paths because its source is its version) are the
ground floors; ``contracts`` (what crosses a stage boundary) stands on them; the stage wings
``ingest``, ``shard``, ``validate``, ``train`` and ``serve`` stand on ``contracts`` and never
import one another; ``evaluate`` stands above them, and ``erasure`` above all. ``predict`` (the
served pyfunc, which registered models import by that name) stays at the top level too.
"""
