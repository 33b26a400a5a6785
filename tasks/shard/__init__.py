"""The shard stage: preprocess every indexed image once into TFRecord shards plus a manifest.

One module a job: :mod:`~tasks.shard.spec` (one shard's unit of work and one record's
preprocessing), :mod:`~tasks.shard.planning` (index scan, order keys, cuts),
:mod:`~tasks.shard.writing` (writing and resume), :mod:`~tasks.shard.window` (batches
in flight a window at a time), :mod:`~tasks.shard.append` (what an append
may build on), :mod:`~tasks.shard.workers` (the local worker processes),
:mod:`~tasks.shard.staging` (Dask workers without the stage's file system, through S3) and
:mod:`~tasks.shard.stage` (plan, prepare, write, finalize: manifest, record lists, data diff).
A finished rebuild replaces the shard folder whole through :mod:`tasks.contracts.shard_swap`:
validation finishes a swap a kill cut short without importing the shard stage. Same inputs
and params give byte-identical shards and ``manifest.json`` whatever the number of workers.
"""
