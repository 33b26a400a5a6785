"""The evaluate stage above the stage wings: metrics, the evaluation's MLflow record, evidence
and the promotion decision, the registry and its lock, manual promotion, label review, the
model card and sheets, and the tracking store check.
"""
