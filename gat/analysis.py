"""What a trained GAT learned, in numbers: attention entropy, neighbourhoods, the embedding map and its silhouette.

Pure functions of tensors (the α of :meth:`gat.model.GAT.attention`, the first layer's output of
:meth:`gat.model.GAT.inspect`); the analyze stage draws and logs what they return.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import sparse
from torch import Tensor

from gat.graph import Neighbourhoods


def attention_entropy(alpha: Tensor, neighbourhoods: Neighbourhoods) -> Tensor:
    r"""Entropy of each node's attention distribution over its incoming edges, per head, in nats.

    .. math::
        H_i = -\sum_{j \in N(i)} \alpha_{ij} \log \alpha_{ij}, \qquad 0 \le H_i \le \log |N(i)|

    The upper bound is uniform attention (:func:`uniform_entropy`), reached when every α_ij = 1/|N(i)|.
    Computed in float64 with 0·log 0 = 0.

    Shapes:
        alpha: [E, ...] in the neighbourhoods' edge order -> [N, ...]
    """
    terms = -torch.special.xlogy(alpha.double(), alpha.double())  # [E, ...]
    entropy = terms.new_zeros(neighbourhoods.num_targets, *alpha.shape[1:])
    return entropy.index_add_(0, neighbourhoods.target, terms)


def uniform_entropy(neighbourhoods: Neighbourhoods) -> Tensor:
    """log |N(i)|: the entropy of uniform attention over node i's in-degree, self-loop included: [N] float64."""
    return neighbourhoods.degree.double().log()


def _adjacency(neighbourhoods: Neighbourhoods) -> sparse.csr_matrix:
    """Rows = targets, columns = sources, self-loops included: [N, N] of ones."""
    n = neighbourhoods.num_targets
    ones = np.ones(neighbourhoods.num_edges, dtype=np.float32)
    return sparse.csr_matrix((ones, (neighbourhoods.target.cpu().numpy(), neighbourhoods.source.cpu().numpy())),
                             shape=(n, n))


def two_hop_sizes(neighbourhoods: Neighbourhoods) -> Tensor:
    """Nodes within two hops of each node, itself included: what a two-layer GAT reads for it. [N] int64."""
    adjacency = _adjacency(neighbourhoods)
    reach = adjacency @ adjacency  # row i: the nodes with a path of length 2 into i (self-loops: 0 and 1 too)
    return torch.from_numpy(np.diff(reach.indptr).astype(np.int64))


@dataclass(frozen=True)
class Neighbourhood:
    """The part of the graph a two-layer GAT reads to classify `centre`, with the α it reads it with.

    Each drawn edge j -> i carries information towards the centre: into the centre (layer 2's α)
    or into one of its neighbours (layer 1's α), averaged over the layer's heads. Self-loops are left out.

    Shapes: nodes: [M] sorted ids; hops: [M] 0 (the centre), 1 or 2; edges: [D, 2] (source j, target i); alpha: [D]
    """

    centre: int
    nodes: Tensor
    hops: Tensor
    edges: Tensor
    alpha: Tensor


def neighbourhood(neighbourhoods: Neighbourhoods, attention: list[Tensor] | tuple[Tensor, ...],
                  centre: int) -> Neighbourhood:
    """The 2-hop neighbourhood of `centre` and the attention on its edges, for a one-replica model.

    Shapes: attention: [[E, 1, K], [E, 1, H_out]] as :meth:`gat.model.GAT.attention` returns them
    """
    if len(attention) != 2 or any(alpha.shape[1] != 1 for alpha in attention):
        raise ValueError("neighbourhood() reads the two layers' α of a one-replica model")
    source, target = neighbourhoods.source, neighbourhoods.target
    into_centre = (target == centre) & (source != centre)
    first = torch.unique(source[into_centre])
    is_first = torch.zeros(neighbourhoods.num_targets, dtype=torch.bool)
    is_first[first] = True
    into_first = is_first[target] & (source != target)
    hops = torch.full((neighbourhoods.num_targets,), -1, dtype=torch.long)
    hops[source[into_first]] = 2
    hops[first] = 1
    hops[centre] = 0
    nodes = torch.nonzero(hops >= 0).view(-1)
    alpha_second = attention[1][:, 0].double().mean(-1)  # [E]: layer 2, heads averaged
    alpha_first = attention[0][:, 0].double().mean(-1)  # [E]: layer 1, heads averaged
    return Neighbourhood(centre=int(centre), nodes=nodes, hops=hops[nodes],
                         edges=torch.cat([torch.stack([source[into_centre], target[into_centre]], 1),
                                          torch.stack([source[into_first], target[into_first]], 1)]),
                         alpha=torch.cat([alpha_second[into_centre], alpha_first[into_first]]))


def pick_examples(test_idx: Tensor, correct: Tensor, sizes: Tensor, count: int, max_nodes: int) -> list[int]:
    """`count` test nodes to draw: half classified wrong (rounded down) and the rest right, or as near as the
    test set allows; wrong ones first.

    Preferred are nodes whose 2-hop neighbourhood (`sizes`) has 3 to `max_nodes` nodes, so that a drawing
    shows a structure and stays readable; within each group they are spread evenly over the sorted ids, so
    the choice is deterministic. Raises ValueError when the test set has fewer than `count` nodes.

    Shapes: test_idx: [T] node ids; correct: [T] bool; sizes: [N] -> list of `count` node ids
    """
    if count > test_idx.numel():
        raise ValueError(f"{count} example nodes were asked for, but the test set has only {test_idx.numel()}")
    right, wrong = test_idx[correct].sort().values, test_idx[~correct].sort().values
    wanted_right = min(count - min(count // 2, wrong.numel()), right.numel())
    chosen: list[int] = []
    for group, wanted in ((wrong, count - wanted_right), (right, wanted_right)):
        readable = (sizes[group] >= 3) & (sizes[group] <= max_nodes)
        preferred, others = group[readable], group[~readable]
        take = min(wanted, preferred.numel())
        chosen += _spread(preferred, take) + _spread(others, wanted - take)
    return chosen


def _spread(ids: Tensor, count: int) -> list[int]:
    """`count` of the sorted `ids`, evenly spaced from the first to the last."""
    if count == 0:
        return []
    return ids[torch.linspace(0, ids.numel() - 1, count).round().long()].tolist()


def tsne(embedding: Tensor, perplexity: float, seed: int, max_iter: int) -> np.ndarray:
    """A 2-D t-SNE map of the rows of `embedding` (scikit-learn, PCA initialisation, exact seed).

    Deterministic for a given seed and thread count; the analyze stage runs it on one thread.
    Raises ValueError when the perplexity is not below the number of points.

    Shapes: embedding: [N, D] -> [N, 2] float32
    """
    from sklearn.manifold import TSNE

    if not perplexity < embedding.shape[0]:
        raise ValueError(f"the t-SNE perplexity ({perplexity}) must be below the number of nodes "
                         f"({embedding.shape[0]})")
    points = TSNE(n_components=2, perplexity=perplexity, random_state=seed, max_iter=max_iter, init="pca",
                  learning_rate="auto").fit_transform(embedding.double().cpu().numpy())
    return points.astype(np.float32)


def silhouette(points: Tensor | np.ndarray, labels: Tensor) -> float:
    """Mean silhouette of the classes among the points (Euclidean), in [-1, 1]; 0 for overlapping classes.

    Shapes: points: [N, D]; labels: [N]
    """
    from sklearn.metrics import silhouette_score

    data = points.double().cpu().numpy() if isinstance(points, Tensor) else np.asarray(points, dtype=np.float64)
    return float(silhouette_score(data, labels.cpu().numpy(), metric="euclidean"))
