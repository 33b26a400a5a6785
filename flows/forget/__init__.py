"""``shardflow forget`` (:mod:`~flows.forget.orchestration`): each step of removing images from
the data, the shards, every copy the project made and the models trained on them, recorded
and resumable. The pieces it runs are :mod:`tasks.erasure`.
"""
