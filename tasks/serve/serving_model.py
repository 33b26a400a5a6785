"""The registered pyfunc's entry file (MLflow's models-from-code).

MLflow loads a version logged this way by running this file from the version's own copy of
``tasks/`` (its ``code_paths``), never by unpickling an object, so loading a model executes
only reviewed code; logging it raises no CloudPickle warning. Nothing imports this module.
"""

import mlflow

from tasks.predict import ShardflowModel

mlflow.models.set_model(ShardflowModel())
