"""gat.config: params.yaml loads, and every kind of bad value is refused with its dotted key named."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gat.config import ModelConfig, OptimConfig, Params, ParamsError, Setup, flatten
from gat.datasets import DATASETS

PARAMS_YAML = Path(__file__).resolve().parents[1] / "params.yaml"


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(PARAMS_YAML.read_text())


def test_the_repository_params_load(raw) -> None:
    params = Params.from_dict(raw)
    assert set(params.datasets) <= set(DATASETS)
    assert isinstance(params.train.model, ModelConfig) and isinstance(params.train.optim, OptimConfig)
    # A block for each listed dataset, for Pubmed (ready to be listed), and for each example graph of `graphs`.
    assert set(params.reproduce.protocol) == {*params.datasets, "pubmed", *params.graphs}
    assert all(isinstance(setup, Setup) for setup in params.reproduce.protocol.values())
    assert isinstance(params.train.optim.lr, float) and isinstance(params.download.timeout_s, float)  # int -> float
    assert isinstance(params.datasets, tuple)


def _set(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(raw)
    *path, last = dotted.split(".")
    node = changed
    for key in path:
        node = node[key]
    node[last] = value
    return changed


def _delete(raw: dict[str, Any], dotted: str) -> dict[str, Any]:
    changed = copy.deepcopy(raw)
    *path, last = dotted.split(".")
    node = changed
    for key in path:
        node = node[key]
    del node[last]
    return changed


def _refused(raw: dict[str, Any], key: str) -> str:
    with pytest.raises(ParamsError) as error:
        Params.from_dict(raw)
    message = str(error.value)
    assert re.search(f"`{re.escape(key)}`", message), message
    return message


@pytest.mark.parametrize("key", ["train.optim.lr", "train.model.heads", "reproduce.protocol.cora.optim.patience",
                                 "reproduce.protocol.citeseer.model.heads",
                                 "download.base_url", "reproduce.seeds_per_batch"])
def test_a_missing_key_is_named(raw, key: str) -> None:
    assert "missing" in _refused(_delete(raw, key), key)


@pytest.mark.parametrize("key", ["train.momentum", "train.model.layers", "reproduce.protocol.cora.optim.betas",
                                 "reproduce.protocol.cora.schedule", "extra"])
def test_an_unknown_key_is_named(raw, key: str) -> None:
    assert "not a known key" in _refused(_set(raw, key, 1), key)


@pytest.mark.parametrize("key,value", [
    ("train.optim.lr", "0.005"),                # str for float
    ("train.optim.lr", True),                   # bool for float
    ("train.optim.patience", True),             # bool for int
    ("train.optim.max_epochs", 100.0),          # float for int
    ("train.model.heads", 8.5),
    ("reproduce.protocol.citeseer.optim.weight_decay", "5e-4"),
    ("reproduce.protocol.citeseer.model", [8, 8]),
    ("download.base_url", 42),                  # int for str
    ("datasets", "cora"),                       # str for list
])
def test_a_wrong_type_is_named(raw, key: str, value: Any) -> None:
    _refused(_set(raw, key, value), key)


@pytest.mark.parametrize("key,value", [
    ("train.optim.lr", 0.0),
    ("train.optim.lr", -0.005),
    ("train.model.dropout", 1.0),
    ("train.model.dropout", -0.1),
    ("train.optim.patience", 0),
    ("reproduce.protocol.cora.optim.patience", 0),
    ("reproduce.protocol.cora.optim.lr", 0),
    ("reproduce.protocol.citeseer.model.dropout", 1.0),
    ("train.model.hidden_features", 0),
    ("reproduce.seeds", 1),
    ("download.base_url", "ftp://example.org/data"),
    ("preprocess.random_seed", -1),
    ("preprocess.random_seed", 99999999999999999999999),
])
def test_an_out_of_range_value_is_named(raw, key: str, value: Any) -> None:
    _refused(_set(raw, key, value), key)


def test_a_dataset_outside_the_list_is_named(raw) -> None:
    assert "reddit" in _refused(_set(raw, "datasets", ["cora", "reddit"]), "datasets[1]")
    _refused(_set(raw, "train.dataset", "reddit"), "train.dataset")
    # Pubmed is known and has its protocol block, but `datasets` leaves it out by default.
    _refused(_set(raw, "train.dataset", "pubmed"), "train.dataset")
    with_pubmed = Params.from_dict(_set(_set(raw, "datasets", ["cora", "citeseer", "pubmed"]), "train.dataset",
                                        "pubmed"))
    assert with_pubmed.reproduce.protocol["pubmed"].model.output_heads == 8
    # In DATASETS but not in `datasets`: training it would use data that was never prepared.
    only_cora = _set(raw, "datasets", ["cora"])
    _refused(_set(only_cora, "train.dataset", "citeseer"), "train.dataset")
    _refused(_delete(raw, "reproduce.protocol.citeseer"), "reproduce.protocol.citeseer")
    _refused(_set(raw, "reproduce.protocol.pubmeds", raw["reproduce"]["protocol"]["cora"]),
             "reproduce.protocol.pubmeds")


@pytest.mark.parametrize("key,value", [("preprocess.split", "foo"), ("train.device", "tpu"),
                                       ("reproduce.device", "tpu")])
def test_a_bad_choice_is_named(raw, key: str, value: str) -> None:
    message = _refused(_set(raw, key, value), key)
    assert repr(value) in message


def test_flatten_gives_dotted_keys(raw) -> None:
    params = Params.from_dict(raw)
    flat = flatten(params)
    assert flat["train.optim.lr"] == params.train.optim.lr
    assert flat["train.model.heads"] == params.train.model.heads
    assert flat["reproduce.protocol.cora.optim.patience"] == params.reproduce.protocol["cora"].optim.patience
    assert flat["datasets"] == ",".join(params.datasets)
    assert all(not isinstance(value, (dict, list, tuple)) for value in flat.values())
    # One flat key per leaf of params.yaml.
    def leaves(node: Any, prefix: str = "") -> set[str]:
        if isinstance(node, dict):
            return set().union(*(leaves(v, f"{prefix}.{k}" if prefix else k) for k, v in node.items()))
        return {prefix}
    assert set(flat) == leaves({key: value for key, value in raw.items() if not key.startswith("x-")})
    assert flatten(params.train.model, "train.model") == {k: v for k, v in flat.items()
                                                          if k.startswith("train.model.")}


def test_every_dataset_has_one_block_used_by_train_and_reproduce_alike(raw) -> None:
    """One {model, optim} shape for a dataset, wherever it is set: Pubmed's 8 output heads have a place."""
    params = Params.from_dict(raw)
    assert params.train.setup == params.reproduce.protocol[params.train.dataset]  # the committed defaults agree
    pubmed_like = _set(raw, "reproduce.protocol.citeseer.model.output_heads", 8)
    assert Params.from_dict(pubmed_like).reproduce.protocol["citeseer"].model.output_heads == 8


def test_the_papers_protocol_is_written_once_and_merged_everywhere(raw) -> None:
    """params.yaml's `x-paper-protocol` holds the anchors; train and every dataset's protocol merge them."""
    text = PARAMS_YAML.read_text()
    assert text.count("lr: 0.005") == 1 and text.count("hidden_features: 8") == 1
    paper = Setup(ModelConfig(**raw["x-paper-protocol"]["model"]), OptimConfig(**raw["x-paper-protocol"]["optim"]))
    params = Params.from_dict(raw)
    protocol = params.reproduce.protocol
    assert params.train.setup == paper and all(setup == paper for name, setup in protocol.items() if name != "pubmed")
    # Pubmed's, the paper's section 3.3: 8 output heads, lr 0.01, L2 0.001, the rest merged from Cora's.
    assert protocol["pubmed"] == Setup(dataclasses.replace(paper.model, output_heads=8),
                                       dataclasses.replace(paper.optim, lr=0.01, weight_decay=0.001))


def test_dvc_exp_run_set_param_changes_only_the_block_it_names(tmp_path: Path) -> None:
    """`dvc exp run -S` rewrites params.yaml through ruamel, setting every key again: a merged block keeps its own
    value, where a shared alias would let the last block written win."""
    from dvc.utils.hydra import apply_overrides

    from stages.support.params import parse_params_yaml

    copied = tmp_path / "params.yaml"
    copied.write_text(PARAMS_YAML.read_text())
    before = Params.from_dict(parse_params_yaml(copied.read_text()))
    apply_overrides(copied, ["train.optim.lr=0.01", "reproduce.protocol.citeseer.model.heads=4"])
    after = Params.from_dict(parse_params_yaml(copied.read_text()))
    assert after.train.optim.lr == 0.01 and after.reproduce.protocol["citeseer"].model.heads == 4
    replace = dataclasses.replace
    citeseer = before.reproduce.protocol["citeseer"]
    citeseer = replace(citeseer, model=replace(citeseer.model, heads=4))
    expected = replace(before, train=replace(before.train, optim=replace(before.train.optim, lr=0.01)),
                       reproduce=replace(before.reproduce, protocol=before.reproduce.protocol | {"citeseer": citeseer}))
    assert after == expected


def test_top_level_x_keys_hold_anchors_and_are_not_parameters(raw) -> None:
    assert Params.from_dict(raw | {"x-anything": {"lr": 1}}) == Params.from_dict(raw)


@pytest.mark.parametrize("document", [["cora"], "just text", 42])
def test_a_params_file_that_is_not_a_mapping_is_named_properly(document) -> None:
    with pytest.raises(ParamsError) as error:
        Params.from_dict(document)
    assert "``" not in str(error.value) and "top level" in str(error.value)


@pytest.mark.parametrize("key", ["train.model.attention", "reproduce.protocol.citeseer.model.attention"])
def test_an_unknown_attention_variant_is_named_with_the_choices(raw, key: str) -> None:
    message = _refused(_set(raw, key, "transformer"), key)
    assert "'gat', 'gatv2', 'constant'" in message and "\n" not in message, message
