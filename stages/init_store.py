"""Create (or migrate) the MLflow store and its experiments once, before any stage runs.

    python -m stages.init_store

A brand-new SQLite store that parallel processes (`dvc queue start -j 2`) race to create
fails; `make repro` and `make ui` run this first so the store always exists.
"""

from stages._common import main
from stages._tracking import DATA_EXPERIMENT, REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT, connect, tracking_uri


def run() -> None:
    for experiment in (DATA_EXPERIMENT, TRAIN_EXPERIMENT, REPRODUCE_EXPERIMENT):
        connect(experiment)
    print(f"MLflow store ready: {tracking_uri()}")


if __name__ == "__main__":
    main(run)
