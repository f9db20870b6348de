"""tools.exps: one line per DVC experiment, its changed params and key metrics, from `dvc exp show --json`'s shape."""

from __future__ import annotations

import copy

from tools.exps import WIDTH, changed, flat, rows, table

PARAMS = {"datasets": ["cora", "citeseer"], "train": {"dataset": "cora", "optim": {"lr": 0.005, "patience": 100}},
          "reproduce": {"seeds": 100}}
METRICS = {"data/eval/metrics.json": {"data": {"test_acc": 0.836, "val_acc": 0.822, "epochs": 688, "best_epoch": 75}},
           "data/analysis/metrics.json": {"data": {"silhouette_tsne": 0.24}},
           "reports/reproduction.json": {"data": {"cora": {"test_acc_mean": 0.83236, "seeds": 100},
                                                  "citeseer": {"test_acc_mean": 0.72378, "seeds": 100}}}}


def _state(rev: str, name: str | None = None, params: dict | None = None, metrics: dict | None = None,
           experiments: list | None = None) -> dict:
    """One ExpState as `dvc exp show --json` writes it (dvc.repo.experiments.serialize)."""
    return {"rev": rev, "name": name, "error": None, "experiments": experiments,
            "data": {"rev": rev, "params": {"params.yaml": {"data": params or PARAMS}},
                     "metrics": metrics if metrics is not None else METRICS, "deps": {}, "outs": {}, "meta": {}}}


def _with(tree: dict, **dotted: object) -> dict:
    tree = copy.deepcopy(tree)
    for key, value in dotted.items():
        *parents, leaf = key.split("__")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    return tree


def _shown() -> list[dict]:
    faster = _with(PARAMS, train__optim__lr=0.01)
    faster_metrics = _with(METRICS, **{"data/eval/metrics.json": {"data": {"test_acc": 0.818, "val_acc": 0.804,
                                                                            "epochs": 412, "best_epoch": 300}}})
    return [_state("workspace"),
            _state("ab41576" + "0" * 33, "main", experiments=[
                {"name": "lr-0.01", "executor": {"state": "success"},
                 "revs": [_state("c" * 40, "lr-0.01", faster, faster_metrics)]},
                {"name": "lr-0.02", "executor": {"state": "queued"},
                 "revs": [_state("d" * 40, "lr-0.02", _with(PARAMS, train__optim__lr=0.02), {})]}])]


def test_flat_names_keys_as_dvc_does() -> None:
    assert flat({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": "x"}) == {"a.b": 1, "a.c.d": [1, 2], "e": "x"}


def test_one_line_per_experiment_with_what_changed_and_what_it_did() -> None:
    lines = table(list(rows(_shown()))).splitlines()
    assert lines[0].split() == ["experiment", "test_acc", "val_acc", "epochs", "citeseer", "mean", "cora", "mean",
                                "changed", "params"]
    assert lines[1].split() == ["workspace", "0.8360", "0.8220", "688", "0.7238", "0.8324"]
    assert lines[2].split() == ["main", "(ab41576)", "0.8360", "0.8220", "688", "0.7238", "0.8324"]
    assert lines[3].split() == ["lr-0.01", "0.8180", "0.8040", "412", "0.7238", "0.8324", "train.optim.lr=0.01"]
    assert lines[4].split() == ["lr-0.02", "(queued)", "-", "-", "-", "-", "-", "train.optim.lr=0.02"]
    assert all(len(line) <= WIDTH for line in lines)


def test_the_workspace_shows_its_uncommitted_params() -> None:
    shown = _shown()
    shown[0] = _state("workspace", params=_with(PARAMS, train__seed=3, datasets=["cora"]))
    workspace = table(list(rows(shown))).splitlines()[1]
    assert workspace.endswith("datasets=[\"cora\"], train.seed=3")


def test_a_param_only_one_side_has_is_a_change() -> None:
    base = next(rows(_shown()))[1]
    other = type(base)("x", {**base.params, "train.new": 1}, {})
    assert changed(other, base) == ["train.new=1"]
    assert changed(base, other) == ["train.new=(none)"]


def test_long_changes_wrap_within_the_width() -> None:
    shown = _shown()
    many = {f"train__optim__key_{i}": 0.001 * i for i in range(12)}
    shown[1]["experiments"][0]["revs"][0] = _state("c" * 40, "lr-0.01", _with(PARAMS, **many))
    lines = table(list(rows(shown))).splitlines()
    assert all(len(line) <= WIDTH for line in lines)
    wrapped = [line for line in lines if line.startswith(" " * 40)]
    assert wrapped and "train.optim.key_11=0.011" in "".join(lines)


def test_no_reproduction_no_dataset_columns() -> None:
    metrics = {"data/eval/metrics.json": METRICS["data/eval/metrics.json"]}
    lines = table(list(rows([_state("workspace", metrics=metrics)]))).splitlines()
    assert "mean" not in lines[0]
    assert lines[1].split() == ["workspace", "0.8360", "0.8220", "688"]
