"""What the flows are built from: how an entry point starts and exits
(:mod:`~flows.support.entry`), the offline environment (:mod:`~flows.support.environment`),
DVC's bookkeeping and the workspace lock (:mod:`~flows.support.dvc_steps`), what the Prefect
UI shows of a run (:mod:`~flows.support.run_story`), refusals in the logs
(:mod:`~flows.support.refusal_logs`), the MLflow runs of train and evaluate
(:mod:`~flows.support.model_runs`), deployment parameter types
(:mod:`~flows.support.parameters`) and who a decision taken by hand is recorded under
(:mod:`~flows.support.authorship`). Imports no flow.
"""
