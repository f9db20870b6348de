"""What each DVC experiment changed, and what it did: one line per experiment, within 120 columns.

    python -m tools.exps [any `dvc exp show` option: -A, -n 3, --rev ...]     (`make exps`)

`dvc exp show` puts every param and every metric side by side, wider than a terminal, so what an experiment
changed and what came of it scroll off the screen. This reads the same data
(`dvc exp show --json`) and prints, for the workspace, each baseline commit and each of its experiments, the
key metrics (the single training run's test_acc, val_acc and epochs; each reproduced dataset's mean test
accuracy) and the params that differ from the baseline's (here after `dvc exp run -S train.optim.lr=0.01 -n lr-0.01`):

    experiment              test_acc  val_acc  epochs  citeseer mean  cora mean  changed params
    workspace                 0.8270   0.8220     940         0.7238     0.8324  train.optim.lr=0.01
    main (7260536)            0.8360   0.8220     688         0.7238     0.8324
      lr-0.01                 0.8270   0.8220     940         0.7238     0.8324  train.optim.lr=0.01
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from stages.support.interrupts import main
from stages.support.params import fail

WIDTH = 120
NAME_WIDTH = 22
# (metrics file, dotted key, column header): the single training run's results, from evaluate.
TRAIN_METRICS = (("data/eval/metrics.json", "test_acc", "test_acc"),
                 ("data/eval/metrics.json", "val_acc", "val_acc"),
                 ("data/eval/metrics.json", "epochs", "epochs"))
# Each reproduced dataset's mean test accuracy, a column per dataset found (report's metrics file).
REPRODUCTION = "reports/reproduction.json"


@dataclass(frozen=True)
class Row:
    """One line: a name, the flat params (params.yaml's dotted keys) and the flat metrics of each metrics file."""

    name: str
    params: dict[str, Any]
    metrics: dict[str, dict[str, Any]]
    baseline: bool = False


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: params.yaml's and metrics files' dotted keys, as DVC names them."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out |= flat(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def _row(state: dict, name: str, baseline: bool = False) -> Row:
    data = state.get("data") or {}
    files = lambda kind: {path: flat((found or {}).get("data") or {})  # noqa: E731
                          for path, found in (data.get(kind) or {}).items()}
    params = {key: value for values in files("params").values() for key, value in values.items()}
    return Row(name, params, files("metrics"), baseline)


def rows(shown: list[dict]) -> Iterator[tuple[Row, Row]]:
    """(row, its baseline) for every line of `dvc exp show --json`'s output, in its order: the workspace (against
    the first baseline), then each baseline commit (against itself) followed by its experiments."""
    baselines = [state for state in shown if state.get("rev") != "workspace"]
    first = _row(baselines[0], "") if baselines else None
    for state in shown:
        if state.get("rev") == "workspace":
            here = _row(state, "workspace")
            yield here, first or here
            continue
        base = _row(state, f"{state.get('name') or 'commit'} ({state['rev'][:7]})", baseline=True)
        yield base, base
        for experiment in state.get("experiments") or []:
            executor = (experiment.get("executor") or {}).get("state", "success")
            for revision in experiment.get("revs") or []:
                name = experiment.get("name") or revision.get("name") or revision["rev"][:7]
                if executor != "success":
                    name = f"{name} ({executor})"
                yield _row(revision, f"  {name}"), base


def changed(row: Row, baseline: Row) -> list[str]:
    """`key=value` for each param whose value differs from the baseline's (or that only one of them has)."""
    keys = sorted(set(row.params) | set(baseline.params))
    return [f"{key}={_value(row.params.get(key, '(none)'))}" for key in keys
            if row.params.get(key) != baseline.params.get(key)]


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def columns(all_rows: Sequence[Row]) -> list[tuple[str, str, str]]:
    """The metric columns: training's, then a mean test accuracy per dataset any row reproduced."""
    datasets = sorted({key.split(".")[0] for row in all_rows for key in row.metrics.get(REPRODUCTION, {})})
    return [*TRAIN_METRICS, *((REPRODUCTION, f"{name}.test_acc_mean", f"{name} mean") for name in datasets)]


def _cell(value: Any, header: str) -> str:
    if value is None:
        return "-".rjust(len(header))
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4f}".rjust(len(header))
    return str(int(value) if isinstance(value, float) else value).rjust(len(header))


def table(pairs: Sequence[tuple[Row, Row]], width: int = WIDTH) -> str:
    """The lines: a header, then one per row; the changed params wrap onto lines of their own past `width`."""
    metric_columns = columns([row for row, _ in pairs])
    headers = [header.rjust(6) for _, _, header in metric_columns]  # room for 0.8360
    left = NAME_WIDTH + sum(len(header) + 2 for header in headers)
    room = max(width - left, 20)
    lines = [f"{'experiment':<{NAME_WIDTH}}" + "".join(f"  {header}" for header in headers) + "  changed params"]
    for row, baseline in pairs:
        name = row.name if len(row.name) <= NAME_WIDTH else row.name[:NAME_WIDTH - 1] + "…"
        cells = "".join(f"  {_cell(row.metrics.get(path, {}).get(key), header)}"
                        for (path, key, _), header in zip(metric_columns, headers))
        wrapped = _wrap([] if row.baseline else changed(row, baseline), room)
        lines.append(f"{name:<{NAME_WIDTH}}{cells}  {wrapped[0]}".rstrip())
        lines.extend(" " * left + "  " + more for more in wrapped[1:])
    return "\n".join(lines) + "\n"


def _wrap(items: list[str], room: int) -> list[str]:
    """`items` joined by ", " into lines of at most `room` characters (an item longer than that has a line)."""
    lines = [""]
    for item in items:
        candidate = f"{lines[-1]}, {item}" if lines[-1] else item
        if len(candidate) <= room or not lines[-1]:
            lines[-1] = candidate
        else:
            lines[-1] += ","
            lines.append(item)
    return lines


def run() -> None:
    options = sys.argv[1:]
    if any(option in ("-h", "--help") for option in options):
        print(__doc__)
        return
    done = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json", *options],
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        fail(f"`{' '.join(['dvc exp show --json', *options])}` failed: {last} (run it in the repository; the "
             "options are `dvc exp show`'s: see `dvc exp show --help`)")
    try:
        shown = json.loads(done.stdout)
    except json.JSONDecodeError:
        fail(f"`dvc exp show --json` printed no JSON: {done.stdout[:200]!r}")
    sys.stdout.write(table(list(rows(shown))))


if __name__ == "__main__":
    main(run)
