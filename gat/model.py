"""The paper's two-layer GAT for transductive node classification, R replicas at once."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gat.config import ModelConfig
from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods, SparseFeatures
from gat.layers import GraphAttentionLayer, elu


class GAT(nn.Module):
    """K heads of F' features, concatenated, ELU; then `output_heads` heads of C classes, averaged.

    Cora and Citeseer (the paper): K = 8, F' = 8, one output head, dropout 0.6 everywhere.
    Replica r is initialised from `seeds[r]` alone, so it is the same network whether it
    is built alone or in a batch.

    Shapes:
        x: :class:`SparseFeatures` [N, F_in] (or the first block's sources)
        output: logits [N, R, C] (or [N_out, R, C] for the last block's N_out targets)
    """

    def __init__(self, config: ModelConfig, in_features: int, num_classes: int, seeds: Sequence[int]):
        super().__init__()
        self.config = config
        common: dict[str, Any] = dict(dropout=config.dropout, n_replicas=len(seeds),
                                      leaky_relu_negative_slope=config.leaky_relu_negative_slope)
        hidden = config.heads * config.hidden_features
        self.hidden = GraphAttentionLayer(in_features, hidden, config.heads, is_concat=True, activation=elu, **common)
        self.output = GraphAttentionLayer(hidden, num_classes, config.output_heads, is_concat=False, **common)
        self.reset_parameters(seeds)

    def reset_parameters(self, seeds: Sequence[int]) -> None:
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        for layer in (self.hidden, self.output):
            layer.reset_parameters(generators)  # layer by layer, so each replica's stream is consumed in one order

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
    def keep_replicas(self, replicas: Tensor) -> None:
        """Keep only the listed replicas (the others stopped early); the parameters are new objects."""
        # New Parameters rather than a resized `.data`: autograd caches a leaf's shape.
        for module in self.modules():
            for name, parameter in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(parameter.detach()[replicas]))


def model_state(model: GAT, in_features: int, num_classes: int, seeds: Sequence[int]) -> dict:
    """Everything needed to rebuild `model`: its config, sizes, seeds and weights (plain types and tensors)."""
    return {"config": dataclasses.asdict(model.config), "in_features": in_features, "num_classes": num_classes,
            "seeds": [int(s) for s in seeds], "state_dict": model.state_dict()}


def model_from_state(state: dict) -> GAT:
    """Inverse of :func:`model_state`."""
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
