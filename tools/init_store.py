"""Create (or migrate) the MLflow store and its experiments once, before any stage runs.

    python -m tools.init_store [--ui-base http://127.0.0.1:5000]

A brand-new SQLite store that parallel processes (`dvc queue start -j 2`) race to create
fails; `make repro` and `make ui` run this first so the store always exists. With
`--ui-base`, it prints the UI address of each experiment's runs table.
"""

from stages.support.interrupts import main
from stages.support.params import ArgumentParser
from stages.support.store import (COMPARE_EXPERIMENT, DATA_EXPERIMENT, REPRODUCE_EXPERIMENT, TRAIN_EXPERIMENT,
                                  connect, shown_uri, ui_url)


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--ui-base", help="the MLflow UI's address, to print each experiment's page")
    args = parser.parse_args()
    experiments = (TRAIN_EXPERIMENT, REPRODUCE_EXPERIMENT, DATA_EXPERIMENT, COMPARE_EXPERIMENT)
    ids = {name: connect(name) for name in experiments}
    print(f"MLflow store ready: {shown_uri()}")
    if args.ui_base:
        for name, experiment_id in ids.items():
            print(f"  {name}: {ui_url(args.ui_base, experiment_id)}")


if __name__ == "__main__":
    main(run)
