"""Create (or migrate) the MLflow store and its experiments once, before any stage runs.

    python -m tools.init_store

A brand-new SQLite store that parallel processes (`dvc queue start -j 2`) race to create
fails; `make repro` runs this first so the store always exists (`make ui` makes it too, tools.ui).
"""

from stages.support.interrupts import main
from stages.support.params import ArgumentParser
from stages.support.store import EXPERIMENTS, connect, shown_uri


def run() -> None:
    ArgumentParser(description=__doc__).parse_args()
    for name in EXPERIMENTS:
        connect(name)
    print(f"MLflow store ready: {shown_uri()}")


if __name__ == "__main__":
    main(run)
