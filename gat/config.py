"""Typed, validated configuration: one frozen dataclass per `params.yaml` section.

Nothing here has a default for a value that `params.yaml` sets: a missing key is an
error, not a silent fallback. `Params.from_dict` checks the whole file before any stage
does work, and every error names the dotted key (`train.lr`) and what would fix it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from gat.datasets import DATASETS


class ParamsError(ValueError):
    """A value in params.yaml is missing, unknown, mistyped or out of range."""


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ParamsError(f"params.yaml: `{key}` {message}")


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check `value` against a field annotation, converting only int -> float and list -> tuple."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        _check(value in choices, key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(annotation)
        _check(isinstance(value, list), key, f"must be a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(item, item_type, f"{key}[{i}]") for i, item in enumerate(value))
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return _from_mapping(annotation, value, key)
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        _check(isinstance(value, dict), key, f"must be a mapping, got {type(value).__name__}")
        return {_coerce(k, key_type, key): _coerce(v, value_type, f"{key}.{k}") for k, v in value.items()}
    # bool is a subclass of int: `lr: true` must not pass as 1.
    if annotation is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key,
               f"must be a number, got {type(value).__name__} {value!r}")
        return float(value)
    if annotation is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key,
               f"must be an integer, got {type(value).__name__} {value!r}")
        return value
    _check(isinstance(value, annotation), key,
           f"must be a {annotation.__name__}, got {type(value).__name__} {value!r}")
    return value


def _from_mapping(cls: type, raw: Any, prefix: str) -> Any:
    _check(isinstance(raw, dict), prefix, f"must be a mapping of keys to values, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        _check(key in names, f"{prefix}.{key}" if prefix else str(key),
               f"is not a known key; the keys of `{prefix or 'params.yaml'}` are: {', '.join(names)}")
    values = {}
    for name in names:
        key = f"{prefix}.{name}" if prefix else name
        _check(name in raw, key, "is missing; add it (see params.yaml's comments and the README's "
               "\"Changing parameters and rerunning\")")
        values[name] = _coerce(raw[name], hints[name], key)
    instance = cls(**values)
    instance.validate(prefix)
    return instance


def _in_range(value: float, key: str, low: float, high: float, low_open: bool = False) -> None:
    ok = (low < value if low_open else low <= value) and value <= high
    bracket = "(" if low_open else "["
    _check(ok, key, f"must be in {bracket}{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class DownloadParams:
    """Where the Planetoid files come from. `GAT_DATA_MIRROR` overrides `base_url` at run time."""

    base_url: str
    timeout_s: float
    retries: int

    def validate(self, p: str) -> None:
        _check(self.base_url.startswith(("http://", "https://")), f"{p}.base_url",
               f"must be an http(s) URL, got {self.base_url!r}")
        _in_range(self.timeout_s, f"{p}.timeout_s", 0, 3600, low_open=True)
        _in_range(self.retries, f"{p}.retries", 0, 20)


# A graph's name becomes a folder (data/raw/<name>) and a DVC stage name (download@<name>).
_GRAPH_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class GraphSource:
    """One npz graph of `graphs:` (the format of Shchur et al.'s "Pitfalls of GNN Evaluation"): where it is, the
    SHA-256 of its bytes (required for a local path too, so that a changed file is noticed and DVC reruns), and
    the seed of its split (20 training and 30 validation nodes per class, the rest test; see gat.npz)."""

    source: str
    sha256: str
    split_seed: int

    @property
    def is_url(self) -> bool:
        return self.source.startswith(("http://", "https://"))

    def validate(self, p: str) -> None:
        _check(bool(self.source.strip()), f"{p}.source", "must be an http(s) URL or a file path, got ''")
        _check(self.is_url or "://" not in self.source, f"{p}.source",
               f"must be an http(s) URL or a file path, got {self.source!r}")
        _check(re.fullmatch(r"[0-9a-f]{64}", self.sha256) is not None, f"{p}.sha256",
               f"must be 64 lowercase hex digits (`sha256sum <file>` prints them), got {self.sha256!r}")
        _in_range(self.split_seed, f"{p}.split_seed", 0, 2**32 - 1)  # numpy's default_rng takes any; kept printable


@dataclass(frozen=True)
class PreprocessParams:
    """`standard` is the Planetoid split of the paper; `random` the annotated tutorial's seeded one."""

    split: Literal["standard", "random"]
    random_seed: int
    random_train_size: int
    random_val_size: int
    random_test_size: int

    def validate(self, p: str) -> None:
        _in_range(self.random_seed, f"{p}.random_seed", 0, 2**63 - 1)  # torch.Generator's seed
        for name in ("random_train_size", "random_val_size", "random_test_size"):
            _in_range(getattr(self, name), f"{p}.{name}", 1, 1_000_000)


Attention = Literal["gat", "gatv2", "constant"]  # model.attention's values (gat.layers.LAYERS implements each)


@dataclass(frozen=True)
class ModelConfig:
    """The paper's two-layer GAT: `heads` x `hidden_features`, concatenated, then `output_heads` averaged."""

    hidden_features: int
    heads: int
    output_heads: int
    dropout: float
    leaky_relu_negative_slope: float
    # How a node weighs its neighbours: `gat`, the paper's e_ij = LeakyReLU(a^T [W h_i || W h_j]); `gatv2`, Brody et
    # al. 2022's dynamic e_ij = a^T LeakyReLU(W_t h_i + W_s h_j); `constant`, every neighbour equally (the ablation's
    # control). params.yaml must set it; code that builds a ModelConfig itself, or loads a checkpoint older than the
    # key, gets the paper's.
    attention: Attention = "gat"

    def validate(self, p: str) -> None:
        _in_range(self.hidden_features, f"{p}.hidden_features", 1, 4096)
        _in_range(self.heads, f"{p}.heads", 1, 64)
        _in_range(self.output_heads, f"{p}.output_heads", 1, 64)
        # p = 1 would zero every input and divide by zero in the rescaling.
        _check(0.0 <= self.dropout < 1.0, f"{p}.dropout", f"must be in [0, 1), got {self.dropout!r}")
        _in_range(self.leaky_relu_negative_slope, f"{p}.leaky_relu_negative_slope", 0.0, 1.0)


# Bytes of memory that training takes, measured (peak RSS of 3 epochs, both kernels, one thread) on Cora and
# Citeseer at heads x hidden_features = 4,096 to 32,768 and fitted: per first-layer weight about 4.2 float32
# (the weight, its gradient, Adam's two moments; the checkpoint copy is freed in between) and per node and
# hidden feature about 3.1 (the projection, the aggregate, ELU and the dropout mask), plus the interpreter,
# torch and the graph (250 to 650 MB). The estimate rounds all three up (10 to 20 % above the measured peaks),
# so it errs towards refusing a run that would just fit.
MEMORY_PER_WEIGHT = 5 * 4
MEMORY_PER_ACTIVATION = 3.5 * 4
MEMORY_BASE = 500 * 2**20


def training_memory_bytes(config: ModelConfig, num_nodes: int, num_features: int, num_classes: int,
                          replicas: int = 1, *, num_edges: int = 0) -> int:
    """About how much memory training `replicas` GATs of `config` on a graph of these sizes needs, at its peak.

    The first layer dominates: heads x hidden_features columns of `num_features` weights and of `num_nodes`
    activations, per replica; the output layer adds heads x hidden_features x classes x output_heads weights.
    `gatv2` has a second projection W_t of each layer's size, and a tensor of every edge's features (the
    LeakyReLU of t_i + g_j) where the others have a score per node: `num_edges` (E without the self-loops,
    which are added here) sizes it, and only gatv2's estimate reads it. `constant` is counted as `gat`
    (it has no attention vectors, a few hundred weights).
    """
    hidden = config.heads * config.hidden_features
    outputs = config.output_heads * num_classes
    weights = hidden * (num_features + 2) + outputs * (hidden + 2)
    activations = num_nodes * (hidden + outputs)
    if config.attention == "gatv2":
        weights += hidden * num_features + outputs * hidden
        activations += (num_edges + num_nodes) * (hidden + outputs)
    return int(MEMORY_BASE + replicas * (MEMORY_PER_WEIGHT * weights + MEMORY_PER_ACTIVATION * activations))


@dataclass(frozen=True)
class OptimConfig:
    """Adam with coupled L2 and the authors' early stopping; shared by the train and reproduce stages.

    `kernel` computes each step: `fused`, gat.fused's native training step and validation pass (CPU), or
    `torch`, the reference implementation in gat.layers (and the fallback where fused cannot be built or on
    CUDA). They agree to float32 rounding. params.yaml must set it; code that builds an OptimConfig itself
    gets the reference.
    """

    lr: float
    weight_decay: float
    max_epochs: int
    patience: int
    kernel: Literal["fused", "torch"] = "torch"

    def validate(self, p: str) -> None:
        _in_range(self.lr, f"{p}.lr", 0.0, 10.0, low_open=True)
        _in_range(self.weight_decay, f"{p}.weight_decay", 0.0, 1.0)
        _in_range(self.max_epochs, f"{p}.max_epochs", 1, 1_000_000)
        _in_range(self.patience, f"{p}.patience", 1, 1_000_000)


@dataclass(frozen=True)
class Setup:
    """One dataset's model and optimiser, the shape train and reproduce both run (Pubmed's: 8 output heads)."""

    model: ModelConfig
    optim: OptimConfig

    def validate(self, p: str) -> None:
        """Nothing ties the halves together; each validated itself while it was read."""


@dataclass(frozen=True)
class TrainParams:
    """One training run: a dataset, a seed, and its own model and optimiser (a copy of the dataset's protocol).

    Its own block, so that an experiment on `train.optim.lr` reruns train and evaluate, not 100 seeds.
    """

    dataset: str
    seed: int
    device: Literal["auto", "cpu", "cuda"]
    model: ModelConfig
    optim: OptimConfig

    def validate(self, p: str) -> None:
        _in_range(self.seed, f"{p}.seed", 0, 2**63 - 1)

    @property
    def setup(self) -> Setup:
        return Setup(self.model, self.optim)


@dataclass(frozen=True)
class ReproduceParams:
    """`seeds` independent runs per dataset, `seeds_per_batch` per batched model, on `workers` processes
    (0: one per core) of the `executor`: `local` processes, or `dask`, a Dask cluster (the one that
    DASK_SCHEDULER_ADDRESS names, else a LocalCluster of `workers` processes). `protocol` holds each
    dataset's setup, as the paper runs it. Only `seeds`, `first_seed` and `protocol` change a result.
    """

    seeds: int
    first_seed: int
    seeds_per_batch: int
    workers: int
    executor: Literal["local", "dask"]
    device: Literal["auto", "cpu", "cuda"]
    protocol: dict[str, Setup]

    def validate(self, p: str) -> None:
        _in_range(self.seeds, f"{p}.seeds", 2, 100_000)
        _in_range(self.first_seed, f"{p}.first_seed", 0, 2**62)
        _in_range(self.seeds_per_batch, f"{p}.seeds_per_batch", 1, 1024)
        _in_range(self.workers, f"{p}.workers", 0, 1024)


# The attention the ablation compares every variant with: the paper's.
BASELINE_ATTENTION = "gat"


@dataclass(frozen=True)
class AblationParams:
    """The attention ablation (`python -m stages.ablation`, not a DVC stage): `seeds` seeds from `first_seed` of each
    of `variants` on each of `datasets`, each with that dataset's `reproduce.protocol` block and its
    `model.attention` replaced; the batches run as the reproduce stage's do (`reproduce.executor`, `workers`,
    `seeds_per_batch`, `device`). Every variant is compared with `gat` on the same seeds, so `gat` must be run.
    """

    datasets: tuple[str, ...]
    variants: tuple[Literal["gat", "gatv2", "constant"], ...]
    seeds: int
    first_seed: int

    def validate(self, p: str) -> None:
        _check(len(self.datasets) > 0, f"{p}.datasets", "must list at least one dataset")
        # Each must have a `reproduce.protocol` block, which Params.validate checks (a Planetoid dataset or a graph).
        _check(len(set(self.datasets)) == len(self.datasets), f"{p}.datasets", "lists a dataset twice")
        _check(BASELINE_ATTENTION in self.variants, f"{p}.variants",
               f"must include `{BASELINE_ATTENTION}`, the baseline every variant is compared with, got "
               f"{list(self.variants)}")
        _check(len(set(self.variants)) == len(self.variants), f"{p}.variants", "lists a variant twice")
        _in_range(self.seeds, f"{p}.seeds", 2, 100_000)  # a spread needs two
        _in_range(self.first_seed, f"{p}.first_seed", 0, 2**62)


@dataclass(frozen=True)
class AnalyzeParams:
    """The analyze stage's pictures of the trained model: which test nodes to draw, and the t-SNE map's settings."""

    example_nodes: int
    max_drawn_nodes: int
    tsne_perplexity: float
    tsne_max_iter: int

    def validate(self, p: str) -> None:
        _in_range(self.example_nodes, f"{p}.example_nodes", 1, 12)  # one panel each, in one picture
        _in_range(self.max_drawn_nodes, f"{p}.max_drawn_nodes", 3, 1000)
        _in_range(self.tsne_perplexity, f"{p}.tsne_perplexity", 1.0, 1000.0)
        _in_range(self.tsne_max_iter, f"{p}.tsne_max_iter", 250, 100_000)  # scikit-learn's minimum


@dataclass(frozen=True)
class Params:
    """The whole of params.yaml."""

    datasets: tuple[str, ...]
    graphs: dict[str, GraphSource]
    download: DownloadParams
    preprocess: PreprocessParams
    train: TrainParams
    reproduce: ReproduceParams
    analyze: AnalyzeParams
    ablation: AblationParams

    def validate(self, p: str) -> None:
        _check(len(self.datasets) > 0, "datasets", "must list at least one dataset")
        for name in self.graphs:
            _check(name not in DATASETS, f"graphs.{name}",
                   f"is also a Planetoid dataset ({', '.join(DATASETS)}); give the npz graph another name")
            _check(_GRAPH_NAME.fullmatch(str(name)) is not None, f"graphs.{name}",
                   "must be a name of lowercase letters, digits, `_` and `-` (it names data/raw/<name>)")
        known = [*DATASETS, *self.graphs]
        for i, name in enumerate(self.datasets):
            _check(name in known, f"datasets[{i}]",
                   f"must be a Planetoid dataset or a key of `graphs` ({', '.join(known)}), got {name!r}")
        _check(len(set(self.datasets)) == len(self.datasets), "datasets", "lists a dataset twice")
        _check(self.train.dataset in self.datasets, "train.dataset",
               f"must be one of `datasets` ({', '.join(self.datasets)}), got {self.train.dataset!r}")
        for name in self.datasets:
            _check(name in self.reproduce.protocol, f"reproduce.protocol.{name}",
                   "is missing: every dataset in `datasets` needs its {model, optim} block")
        for i, name in enumerate(self.ablation.datasets):
            _check(name in self.reproduce.protocol, f"ablation.datasets[{i}]",
                   f"is {name!r}, which has no `reproduce.protocol.{name}` block: the ablation runs each dataset's "
                   "protocol; add the block, or drop the dataset")
        for name in self.reproduce.protocol:
            _check(name in known, f"reproduce.protocol.{name}",
                   f"is not a dataset; the datasets are Planetoid's and the keys of `graphs`: {', '.join(known)}")

    def graph(self, name: str) -> GraphSource | None:
        """The npz graph `name` of `graphs:`, or None for a Planetoid dataset."""
        return self.graphs.get(name)

    @classmethod
    def from_dict(cls, raw: Any) -> "Params":
        if not isinstance(raw, Mapping):
            raise ParamsError(f"params.yaml must be a mapping of sections (datasets, download, ...) at the top "
                              f"level, got a {type(raw).__name__}: see the README's "
                              "\"Changing parameters and rerunning\"")
        # Top-level `x-` keys only hold YAML anchors that the sections merge (the paper's protocol).
        return _from_mapping(cls, {key: value for key, value in raw.items() if not str(key).startswith("x-")}, "")


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys, as in params.yaml (`train.lr`), for logging every value as a flat param."""
    is_instance = dataclasses.is_dataclass(config) and not isinstance(config, type)
    items = dataclasses.asdict(config) if is_instance else dict(config)
    flat: dict[str, Any] = {}
    for key, value in items.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) or dataclasses.is_dataclass(value):
            flat.update(flatten(value, dotted))
        elif isinstance(value, tuple):
            flat[dotted] = ",".join(map(str, value))
        else:
            flat[dotted] = value
    return flat
