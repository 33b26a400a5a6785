"""What crosses a stage boundary: content hashes, the ingest index and hand-off, the shard
manifest and store, the two shard readers (TensorFlow's and NumPy's), the validated-shards
gate, the shard swap, near-duplicates, memberships, exclusions, the erasure record, the shard
changes report, what a training run records and the forward pass every prediction shares.
Imports the pixel contract and the runtime.
"""
