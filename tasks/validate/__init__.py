"""The validate stage: its checks, TensorFlow's cross-check of the records and the data gate
that compares a shard set with its dataset's accepted one.
"""
