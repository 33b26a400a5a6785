"""Forgetting an image: the plan and its steps, the object-storage scrub, the revisions that
lose their data, retraction of the models trained on it, and lineage.
"""
