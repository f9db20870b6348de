"""What the DVC stages share, one job per module (the README's Layout lists them)."""

import os

# The machines here have no internet, and a pipeline should not phone home: no usage telemetry. Set before any
# module of this package imports MLflow, which reads it when it starts.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
