"""Download one dataset's raw files, checksum-verified, into `--out`: a Planetoid dataset's eight files, or the
npz file of a graph of params.yaml's `graphs` (from its URL, or copied from its path) as `graph.npz`.

    python -m stages.download --dataset cora --out data/raw/cora
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow

from stages.support import fetch
from stages.support.files import atomic_dir
from stages.support.interrupts import main
from stages.support.params import ArgumentParser, load_params
from stages.support.redaction import redact
from stages.support.store import DATA_EXPERIMENT
from stages.support.tracking import logged_params, stage_run, standard_tags


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True, help="a Planetoid dataset or a key of params.yaml's `graphs`")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.download
    expected = fetch.expected_files(params, args.dataset)
    graph = params.graph(args.dataset)
    source = fetch.resolve_source(settings.base_url) if graph is None else fetch.graph_source(graph)
    pinned_sizes = fetch.pinned_sizes(args.dataset) if graph is None else {}
    shown_source = redact(str(source))  # a mirror URL may carry a password
    tags = standard_tags(args.dataset, expected, split_seed=None if graph is None else graph.split_seed)

    with stage_run(DATA_EXPERIMENT, f"download-{args.dataset}", tags=tags):
        # `dataset` and `source` (the mirror, when GAT_DATA_MIRROR names one) are not in params.yaml.
        mlflow.log_params({"dataset": args.dataset, "source": shown_source,
                           **logged_params(params, "download", args.dataset)})
        started = time.perf_counter()
        # Any failure removes the staging folder: no partial files, the previous --out untouched.
        with atomic_dir(args.out) as staging:
            if graph is None:
                sizes = fetch.fetch(expected, source, staging, sizes=pinned_sizes,
                                     timeout_s=settings.timeout_s, retries=settings.retries)
            else:
                sizes = {fetch.GRAPH_FILE: fetch.fetch_graph(args.dataset, graph, staging,
                                                             timeout_s=settings.timeout_s, retries=settings.retries)}
        seconds = time.perf_counter() - started
        mlflow.log_metrics({"total_bytes": sum(sizes.values()), "seconds": seconds})
        mlflow.log_dict(expected, "checksums.json")
    print(f"{args.dataset}: {len(sizes)} files, {sum(sizes.values()):,} bytes from {shown_source} "
          f"in {seconds:.1f} s, SHA-256 verified -> {args.out}")


if __name__ == "__main__":
    main(run)
