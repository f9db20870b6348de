"""Download one dataset's eight Planetoid files, checksum-verified, into `--out`.

    python -m stages.download --dataset cora --out data/raw/cora
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow

from gat.datasets import DATASETS
from stages.support import fetch
from stages.support.files import atomic_dir
from stages.support.interrupts import main
from stages.support.params import ArgumentParser, load_params
from stages.support.redaction import redact
from stages.support.store import DATA_EXPERIMENT
from stages.support.tracking import logged_params, stage_run, standard_tags


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True, choices=DATASETS)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.download
    expected = fetch.pinned(args.dataset)
    pinned_sizes = fetch.pinned_sizes(args.dataset)
    source = fetch.resolve_source(settings.base_url)
    shown_source = redact(str(source))  # a mirror URL may carry a password

    with stage_run(DATA_EXPERIMENT, f"download-{args.dataset}", tags=standard_tags(args.dataset, expected)):
        # `dataset` and `source` (the mirror, when GAT_DATA_MIRROR names one) are not in params.yaml.
        mlflow.log_params({"dataset": args.dataset, "source": shown_source,
                           **logged_params(params, "download", args.dataset)})
        started = time.perf_counter()
        # Any failure removes the staging folder: no partial files, the previous --out untouched.
        with atomic_dir(args.out) as staging:
            sizes = fetch.fetch(expected, source, staging, sizes=pinned_sizes,
                                 timeout_s=settings.timeout_s, retries=settings.retries)
        seconds = time.perf_counter() - started
        mlflow.log_metrics({"total_bytes": sum(sizes.values()), "seconds": seconds})
        mlflow.log_dict(expected, "checksums.json")
    print(f"{args.dataset}: {len(sizes)} files, {sum(sizes.values()):,} bytes from {shown_source} "
          f"in {seconds:.1f} s, SHA-256 verified -> {args.out}")


if __name__ == "__main__":
    main(run)
