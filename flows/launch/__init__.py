"""The stage commands ``dvc.yaml`` runs, one module a stage: ``python -m flows.launch.<stage>``
starts the stage's children first (its TensorFlow child, its shard workers), then imports the
stage's flow module (Prefect, over a second of imports) and runs its ``main()``, so the
children's imports overlap Prefect's. A module of its own for each stage, so a stage's
``dvc.yaml`` deps, read from its command's imports (:mod:`tasks.runtime.stage_deps`), are its
own code alone. Nothing imports these modules: they are entry points.
"""
