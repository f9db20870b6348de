"""What a trained GAT learned, in numbers: attention entropy, neighbourhoods, the embedding map and its silhouette.

Pure functions of tensors (the α and the first layer's output of :func:`portable_inspect`); the analyze stage
draws and logs what they return.

Every output here is the same bytes on any x86-64 CPU, because the arithmetic avoids everything whose rounding
is chosen by the CPU at run time: BLAS and LAPACK (OpenBLAS and MKL pick a kernel and its blocking by CPU
model and cache size, which changes the order of a dot product's additions), numpy's and torch's vectorised
exp/log (numpy has its own AVX-512 exp and log; torch's `ATEN_CPU_CAPABILITY` picks between Sleef and the C
library) and torch's reductions (their order follows the vector width). What is left: +, -, ×, ÷ and √ one
element at a time, which IEEE 754 rounds exactly whatever the vector width; sums in an order fixed by the code
(numpy's pairwise and axis sums, scipy.sparse's row loops, np.bincount), which no library reorders by CPU; and
exp, expm1 and log from Python's `math`, one scalar C library call each, as scikit-learn's t-SNE itself
calls them. t-SNE amplifies any difference in its input's last bit into a different map, so it gets nothing
that went through one of the CPU-dependent paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from scipy import sparse
from torch import Tensor

from gat.graph import Neighbourhoods, SparseFeatures
from gat.layers import GraphAttentionLayer, elu
from gat.model import GAT


def _elementwise(function: Callable[[float], float], values: np.ndarray) -> np.ndarray:
    """`function` (exp, expm1 or log from Python's math) on every element, as float64.

    One scalar call of the C library per element: numpy's own exp/log are vectorised per CPU (AVX-512 or
    not) and round differently from it; this costs about 0.1 µs an element.
    """
    flat = np.asarray(values, dtype=np.float64).ravel()
    return np.fromiter(map(function, flat.tolist()), dtype=np.float64, count=flat.size).reshape(np.shape(values))


def _segment_sum(values: np.ndarray, segment: np.ndarray, count: int) -> np.ndarray:
    """Σ of the rows of `values` [S, ...] with the same `segment` id: [count, ...] float64, in row order.

    np.bincount adds its weights one by one in the given order, on every CPU.
    """
    flat = values.reshape(values.shape[0], -1)
    columns = [np.bincount(segment, weights=flat[:, k], minlength=count) for k in range(flat.shape[1])]
    return np.stack(columns, axis=1).reshape(count, *values.shape[1:])


@dataclass(frozen=True)
class PortableInspection:
    """:meth:`gat.model.GAT.inspect`'s first-layer output and α, recomputed in float64 the same on every CPU.

    Shapes: hidden: [N, K·F'] float64; attention: ([E, 1, K], [E, 1, H_out]) float64, in the neighbourhoods'
    edge order
    """

    hidden: np.ndarray
    attention: tuple[Tensor, Tensor]


def _portable_layer(layer: GraphAttentionLayer, inputs: sparse.csr_matrix, neighbourhoods: Neighbourhoods
                    ) -> tuple[np.ndarray, np.ndarray]:
    """One layer of a one-replica model in eval mode: (output [N, K·F'] or [N, F'], α [E, K]) in float64.

    The same formula as the layer's eval pass, for each variant (gat.layers.LAYERS); every product sums in the
    CSR's stored order (scipy.sparse's row loops), every exp is the C library's.
    """
    H, F_out = layer.n_heads, layer.n_hidden
    parameters = {name: value.detach()[0].double().cpu().numpy() for name, value in layer.named_parameters()}
    def project(W: np.ndarray) -> np.ndarray:
        wide = W.transpose(1, 0, 2).reshape(-1, H * F_out)  # [F_in, H·F'], column h·F' + f
        return np.asarray(inputs @ wide).reshape(-1, H, F_out)  # [N, H, F']

    def leaky_relu(x: np.ndarray) -> np.ndarray:
        return np.where(x > 0, x, x * layer.negative_slope)

    g = project(parameters["W"])
    source, target = neighbourhoods.source.cpu().numpy(), neighbourhoods.target.cpu().numpy()
    n = neighbourhoods.num_targets
    if layer.variant == "constant":
        alpha = np.repeat(1.0 / np.bincount(target, minlength=n)[target][:, None], H, axis=1)  # [E, H]
    else:
        if layer.variant == "gatv2":
            g = g + parameters["b_source"]
            t = project(parameters["W_target"]) + parameters["b_target"]
            e = (leaky_relu(t[target] + g[source]) * parameters["a"]).sum(-1)  # [E, H]
        else:
            score_target = (g * parameters["a_target"]).sum(-1) + (parameters["b_target"] + parameters["b_source"])
            score_source = (g * parameters["a_source"]).sum(-1)  # [N, H]
            e = leaky_relu(score_target[target] + score_source[source])  # [E, H]
        shift = np.full((n, H), -np.inf)
        np.maximum.at(shift, target, e)  # the max is exact in any order
        exp = _elementwise(math.exp, e - shift[target])
        alpha = exp / _segment_sum(exp, target, n)[target]
    crow = neighbourhoods.crow.cpu().numpy()
    out = np.stack([sparse.csr_matrix((alpha[:, h], source, crow), shape=(n, g.shape[0])) @ g[:, h]
                    for h in range(H)], axis=1) + parameters["bias"]  # [N, H, F']
    if layer.activation is not None:
        if layer.activation is not elu:
            raise ValueError(f"portable_inspect() knows ELU, not {layer.activation}")
        negative = out < 0
        out[negative] = _elementwise(math.expm1, out[negative])
    if layer.is_concat:
        return out.reshape(n, H * F_out), alpha
    return out.sum(axis=1) / H, alpha


def portable_inspect(model: GAT, x: SparseFeatures, neighbourhoods: Neighbourhoods) -> PortableInspection:
    """What :meth:`gat.model.GAT.inspect` computes, in float64 and the same bytes on every CPU (see the module).

    torch's own pass rounds by CPU: under `ATEN_CPU_CAPABILITY=default` its ELU gives other last bits than
    under avx2 or avx512, and MKL's products depend on the CPU model. It agrees with this one to float32's
    precision (tests/test_analysis.py). One replica, whole-graph neighbourhoods.
    """
    if model.n_replicas != 1:
        raise ValueError("portable_inspect() reads a one-replica model")
    if neighbourhoods.target_in_source is not None:
        raise ValueError("portable_inspect() takes the whole graph's Neighbourhoods, not receptive-field blocks")
    features = sparse.csr_matrix((x.values.double().cpu().numpy(), x.col.cpu().numpy(), x.crow.cpu().numpy()),
                                 shape=(x.num_nodes, x.num_features))
    hidden, alpha_hidden = _portable_layer(model.hidden, features, neighbourhoods)
    _logits, alpha_output = _portable_layer(model.output, sparse.csr_matrix(hidden), neighbourhoods)
    return PortableInspection(hidden=hidden, attention=(torch.from_numpy(alpha_hidden)[:, None],
                                                        torch.from_numpy(alpha_output)[:, None]))


def attention_entropy(alpha: Tensor, neighbourhoods: Neighbourhoods) -> Tensor:
    r"""Entropy of each node's attention distribution over its incoming edges, per head, in nats.

    .. math::
        H_i = -\sum_{j \in N(i)} \alpha_{ij} \log \alpha_{ij}, \qquad 0 \le H_i \le \log |N(i)|

    The upper bound is uniform attention (:func:`uniform_entropy`), reached when every α_ij = 1/|N(i)|.
    Computed in float64 with 0·log 0 = 0, the same on every CPU (the C library's log, sums in edge order).

    Shapes:
        alpha: [E, ...] in the neighbourhoods' edge order -> [N, ...]
    """
    values = alpha.double().cpu().numpy()
    terms = -values * _elementwise(math.log, np.where(values > 0, values, 1.0))  # [E, ...]
    return torch.from_numpy(_segment_sum(terms, neighbourhoods.target.cpu().numpy(), neighbourhoods.num_targets))


def uniform_entropy(neighbourhoods: Neighbourhoods) -> Tensor:
    """log |N(i)|: the entropy of uniform attention over node i's in-degree, self-loop included: [N] float64."""
    return torch.from_numpy(_elementwise(math.log, neighbourhoods.degree.cpu().numpy()))


def confusion_counts(actual: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """Nodes by actual class (rows) and predicted class (columns): [C, C] int64. Nodes without a class
    (label -1, Citeseer's padded test nodes) are left out."""
    labelled = actual >= 0
    cells = actual[labelled].astype(np.int64) * num_classes + predicted[labelled].astype(np.int64)
    return np.bincount(cells, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def row_shares(counts: np.ndarray) -> np.ndarray:
    """Each row of a confusion matrix divided by its sum (the recall on the diagonal), 0 for an empty row:
    [C, C] float64, as scikit-learn's confusion_matrix(normalize="true") computes it."""
    with np.errstate(all="ignore"):
        shares = counts / counts.sum(axis=1, keepdims=True)
    return np.nan_to_num(shares)


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
    # Heads averaged in numpy, whose sum is in a fixed order (torch's follows the CPU's vector width).
    alpha_second = torch.from_numpy(attention[1][:, 0].double().cpu().numpy().mean(-1))  # [E]: layer 2
    alpha_first = torch.from_numpy(attention[0][:, 0].double().cpu().numpy().mean(-1))  # [E]: layer 1
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


def pairwise_distances(points: Tensor | np.ndarray) -> np.ndarray:
    """Euclidean distances between the rows, in float64, the same bytes on every CPU: [N, N].

    Σ_k (x_ik - x_jk)² coordinate by coordinate, k ascending, one numpy operation per step: each rounds
    exactly, so the result is symmetric bit for bit, 0 on the diagonal, and free of the CPU-chosen
    summation order of a BLAS product (scikit-learn's |x|² - 2x·y + |y|²). About 2 s for Cora's 2,708 × 64.

    Shapes: points: [N, D] -> [N, N]
    """
    data = _float64(points)
    columns = np.ascontiguousarray(data.T)  # [D, N]
    n = data.shape[0]
    distances = np.empty((n, n))
    for start in range(0, n, 512):
        rows = columns[:, start:start + 512]
        total = np.zeros((rows.shape[1], n))
        for k in range(columns.shape[0]):
            difference = np.subtract.outer(rows[k], columns[k])
            total += np.multiply(difference, difference, out=difference)
        distances[start:start + rows.shape[1]] = np.sqrt(total, out=total)
    return distances


def _float64(points: Tensor | np.ndarray) -> np.ndarray:
    return points.double().cpu().numpy() if isinstance(points, Tensor) else np.asarray(points, dtype=np.float64)


def _neighbour_graph(distances: np.ndarray, neighbours: int) -> sparse.csr_matrix:
    """Each point's `neighbours` nearest others, as scikit-learn's precomputed sparse graph: [N, N] CSR.

    Row i holds i itself first (distance 0), then the others by distance, ties by index: a stable sort, whose
    result is unique, where np.argpartition's vectorised selection may order equal distances by CPU.
    """
    n = distances.shape[0]
    keys = distances.copy()
    keys[np.arange(n), np.arange(n)] = -1.0  # a point is its own first neighbour, even among duplicates
    order = np.argsort(keys, axis=1, kind="stable")[:, :neighbours + 1]
    values = np.take_along_axis(distances, order, axis=1)
    return sparse.csr_matrix((values.ravel(), order.ravel(), np.arange(0, order.size + 1, neighbours + 1)),
                             shape=(n, n))


def _symmetric_eigen(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues and eigenvectors (columns) of a symmetric matrix by cyclic Jacobi rotations.

    LAPACK's eigensolvers run on BLAS, whose kernels round by CPU; these rotations are scalar arithmetic
    and elementwise numpy, exact to the last bit everywhere. Quadratic convergence: a handful of sweeps.
    """
    a, d = matrix.astype(np.float64, copy=True), matrix.shape[0]
    vectors = np.eye(d)
    threshold = 1e-17 * math.sqrt(float((a * a).sum()))
    for _sweep in range(100):
        rotated = False
        for p in range(d - 1):
            for q in range(p + 1, d):
                apq = float(a[p, q])
                if abs(apq) <= threshold:
                    continue
                rotated = True
                theta = (float(a[q, q]) - float(a[p, p])) / (2.0 * apq)
                t = 1.0 / (2.0 * theta) if abs(theta) > 1e150 else \
                    math.copysign(1.0, theta) / (abs(theta) + math.sqrt(theta * theta + 1.0))
                c = 1.0 / math.sqrt(t * t + 1.0)
                s = t * c
                for view in (a.T, a, vectors.T):  # columns p, q of a; then its rows; then the eigenvectors
                    vp, vq = view[p].copy(), view[q].copy()
                    view[p], view[q] = c * vp - s * vq, s * vp + c * vq
                a[p, q] = a[q, p] = 0.0
        if not rotated:
            break
    return np.diagonal(a).copy(), vectors


def pca_init(points: Tensor | np.ndarray) -> np.ndarray:
    """t-SNE's PCA initialisation as scikit-learn makes it, the same bytes on every CPU: [N, 2] float32.

    The two leading principal components (sign: the largest loading positive, as scikit-learn's svd_flip),
    scaled so that the first has standard deviation 1e-4. The covariance sums in row order and the
    eigenvectors come from Jacobi rotations, not from a BLAS product and LAPACK.
    """
    data = _float64(points)
    centred = data - data.mean(axis=0)
    covariance = np.stack([(centred * centred[:, j:j + 1]).sum(axis=0) for j in range(data.shape[1])])
    values, vectors = _symmetric_eigen(covariance)
    components = vectors[:, np.argsort(-values, kind="stable")[:2]].T  # [2, D]
    components *= np.where(components[np.arange(2), np.abs(components).argmax(1)] < 0, -1.0, 1.0)[:, None]
    projected = np.stack([(centred * component).sum(axis=1) for component in components], axis=1).astype(np.float32)
    return projected / np.std(projected[:, 0]) * np.float32(1e-4)


def tsne(embedding: Tensor, perplexity: float, max_iter: int) -> np.ndarray:
    """A 2-D t-SNE map of the rows of `embedding` (scikit-learn's Barnes-Hut, PCA initialisation).

    The same bytes on every CPU: scikit-learn gets exact distances (:func:`pairwise_distances`) as a
    precomputed neighbour graph with ties broken by index, and a PCA initialisation made without BLAS
    (:func:`pca_init`); the rest of its t-SNE is compiled code without CPU dispatch. `min_grad_norm=0`
    keeps the one BLAS call left (the gradient's norm, for stopping) from deciding anything. With the PCA
    initialisation nothing random is left: no seed to set.
    Raises ValueError when the perplexity is not below the number of points.

    Shapes: embedding: [N, D] -> [N, 2] float32
    """
    from sklearn.manifold import TSNE

    if not perplexity < embedding.shape[0]:
        raise ValueError(f"the t-SNE perplexity ({perplexity}) must be below the number of nodes "
                         f"({embedding.shape[0]})")
    distances = pairwise_distances(embedding)
    graph = _neighbour_graph(distances, min(distances.shape[0] - 1, int(3.0 * perplexity + 1)))
    # random_state: only a random initialisation would draw from it; fixed, so nothing reads global state.
    points = TSNE(n_components=2, perplexity=perplexity, random_state=0, max_iter=max_iter,
                  init=pca_init(embedding), metric="precomputed", method="barnes_hut", learning_rate="auto",
                  min_grad_norm=0.0).fit_transform(graph)
    return points.astype(np.float32)


def silhouette(points: Tensor | np.ndarray, labels: Tensor, distances: np.ndarray | None = None) -> float:
    """Mean silhouette of the classes among the points (Euclidean), in [-1, 1]; 0 for overlapping classes.

    From :func:`pairwise_distances` (or `distances`, theirs for these points), so the same on every CPU:
    scikit-learn sums them per class with np.bincount.

    Shapes: points: [N, D]; labels: [N]; distances: [N, N]
    """
    from sklearn.metrics import silhouette_score

    matrix = pairwise_distances(points) if distances is None else distances
    return float(silhouette_score(matrix, labels.cpu().numpy(), metric="precomputed"))
