"""The paper's two-layer GAT for transductive node classification, R replicas at once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gat.config import ModelConfig
from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods, SparseFeatures
from gat.layers import LAYERS, elu


class GAT(nn.Module):
    """K heads of F' features, concatenated, ELU; then `output_heads` heads of C classes, averaged.

    `config.attention` picks the layers: the paper's (gat.layers.GraphAttentionLayer), GATv2Layer or
    ConstantAttentionLayer.

    Cora and Citeseer (the paper): K = 8, F' = 8, one output head, dropout 0.6 everywhere.
    Replica r is initialised from `seeds[r]` alone, so it is the same network whether it
    is built alone or in a batch.

    Shapes:
        x: :class:`SparseFeatures` [N, F_in] (or the first block's sources)
        output: logits [N, R, C] (or [N_out, R, C] for the last block's N_out targets)
    """

    def __init__(self, config: ModelConfig, in_features: int, num_classes: int, seeds: Sequence[int]):
        super().__init__()
        if config.attention not in LAYERS:
            raise ValueError(f"model.attention must be one of {', '.join(LAYERS)}, got {config.attention!r}")
        self.config = config
        Layer = LAYERS[config.attention]
        common: dict[str, Any] = dict(dropout=config.dropout, n_replicas=len(seeds),
                                      leaky_relu_negative_slope=config.leaky_relu_negative_slope)
        hidden = config.heads * config.hidden_features
        self.hidden = Layer(in_features, hidden, config.heads, is_concat=True, activation=elu, **common)
        self.output = Layer(hidden, num_classes, config.output_heads, is_concat=False, **common)
        self.reset_parameters(seeds)

    def reset_parameters(self, seeds: Sequence[int]) -> None:
        """Replica r from seeds[r]'s stream alone: every layer's shared draws, then the variant's own.

        Layer by layer, so each replica's stream is consumed in one order; the paper's layer's draws first, so
        that `gat`, `gatv2` and `constant` start from the same W for a seed, and a comparison paired by seed
        differs in the attention only (gat.layers.GraphAttentionLayer.reset_parameters).
        """
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        for layer in (self.hidden, self.output):
            layer.reset_shared(generators)
        for layer in (self.hidden, self.output):
            layer.reset_extra(generators)

    @property
    def n_replicas(self) -> int:
        return self.hidden.n_replicas

    n_layers = 2

    def forward(self, x: SparseFeatures, neighbourhoods: Neighbourhoods | Sequence[Neighbourhoods],
                noise: ReplicaDropout | None = None) -> Tensor:
        """Logits of every node, or of the last block's targets given one block per layer (receptive_field).

        Dropout (`noise`) needs training mode; eval mode has none.
        """
        first, second = [neighbourhoods] * 2 if isinstance(neighbourhoods, Neighbourhoods) else neighbourhoods
        h = self.hidden(x, first, noise)
        return self.output(h, second, noise)

    @torch.no_grad()
    def inspect(self, x: SparseFeatures, neighbourhoods: Neighbourhoods) -> "Inspection":
        """The whole-graph pass that `predict` makes (eval mode, no dropout), with what it computes on the way:
        the first layer's output and every layer's attention coefficients α.

        Raises ValueError in training mode, whose dropout would make α a random draw: call eval() first.
        """
        if self.training:
            raise ValueError("the attention coefficients are read in eval mode (no dropout): call eval() first")
        if not isinstance(neighbourhoods, Neighbourhoods) or neighbourhoods.target_in_source is not None:
            raise ValueError("inspect() takes the whole graph's Neighbourhoods, not receptive-field blocks")
        attention: list[Tensor] = []
        hidden = self.hidden._infer(x, neighbourhoods, attention)
        logits = self.output._infer(hidden, neighbourhoods, attention)
        return Inspection(hidden=hidden, logits=logits, attention=tuple(attention))

    def attention(self, x: SparseFeatures, neighbourhoods: Neighbourhoods) -> list[Tensor]:
        r"""Each layer's attention coefficients :math:`\alpha_{ij}` for every edge and head, first layer first.

        Row e of each tensor is the edge `neighbourhoods.source[e]` (j) -> `neighbourhoods.target[e]` (i):
        edges sorted by target, then source, with every node's self-loop (as
        :meth:`Neighbourhoods.from_edge_index` builds them). Over each node's incoming edges, the
        self-loop included, the α of a head sum to 1.

        Shapes:
            x: :class:`SparseFeatures` [N, F_in]; neighbourhoods: the whole graph, E edges
            output: [[E, R, K], [E, R, output_heads]] (R replicas; [:, 0] is a one-seed model's [E, H])
        """
        return list(self.inspect(x, neighbourhoods).attention)

    @torch.no_grad()
    def keep_replicas(self, replicas: Tensor) -> None:
        """Keep only the listed replicas (the others stopped early); the parameters are new objects."""
        # New Parameters rather than a resized `.data`: autograd caches a leaf's shape.
        for module in self.modules():
            for name, parameter in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(parameter.detach()[replicas]))


@dataclass(frozen=True)
class Inspection:
    """What a model computes on the whole graph in eval mode (:meth:`GAT.inspect`).

    Shapes:
        hidden: [N, R, K·F'] the first layer's output (ELU, heads concatenated): each node's embedding
        logits: [N, R, C], equal to `predict`'s
        attention: one α per layer, [E, R, K] then [E, R, output_heads], in the edge order of :meth:`GAT.attention`
    """

    hidden: Tensor
    logits: Tensor
    attention: tuple[Tensor, ...]


def model_state(model: GAT, in_features: int, num_classes: int, seeds: Sequence[int]) -> dict:
    """Everything needed to rebuild `model`: its config, sizes, seeds and weights (plain types and tensors)."""
    return {"config": dataclasses.asdict(model.config), "in_features": in_features, "num_classes": num_classes,
            "seeds": [int(s) for s in seeds], "state_dict": model.state_dict()}


def model_from_state(state: dict) -> GAT:
    """Inverse of :func:`model_state`. A state saved before `attention` was a key of the config is the paper's."""
    model = GAT(ModelConfig(**state["config"]), state["in_features"], state["num_classes"], state["seeds"])
    model.load_state_dict(state["state_dict"])
    return model.eval()


class NodeClassifier(nn.Module):
    """A trained one-replica GAT bound to its graph: node ids in, class log-probabilities out.

    This is the form a user (or MLflow's pyfunc) can call without building the graph:
    the features and neighbourhoods travel with the model.

    Shapes:
        nodes: [B] int64 -> [B, C] float32
    """

    def __init__(self, model: GAT, x: SparseFeatures, neighbourhoods: Neighbourhoods):
        super().__init__()
        if model.n_replicas != 1:
            raise ValueError(f"NodeClassifier wraps one replica, got {model.n_replicas}")
        self.model, self.x, self.neighbourhoods = model.eval(), x, neighbourhoods

    @torch.no_grad()
    def forward(self, nodes: Tensor) -> Tensor:
        logits = self.model(self.x, self.neighbourhoods)[:, 0]  # [N, C]
        return F.log_softmax(logits.index_select(0, nodes.long()), dim=-1)
