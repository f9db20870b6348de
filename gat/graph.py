"""The two structures the attention engine runs on: neighbourhoods and sparse input features."""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


@contextlib.contextmanager
def csr_beta_warning_silenced() -> Iterator[None]:
    """Ignore torch's "Sparse CSR tensor support is in beta" notice inside the block, and only there.

    CSR products are the point of this engine, so the notice would print on every run; a filter
    installed at import would hide it from the rest of the program too.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        yield


@dataclass(frozen=True)
class _Memoising:
    """A graph structure that keeps what is derived from it (the layers' index plans) for as long as it lives.

    On the object, not in a cache keyed by its tensors' addresses: a freed tensor's address is
    reused by the next allocation, and such a cache would hand the stale plan to the new tensor.
    The memo takes no part in equality or repr, and `.to(device)` makes a new object with an empty one.
    """

    _memo: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def memoised(self, key: Hashable, build: Callable[[], T]) -> T:
        """`build()`, called once per key for the lifetime of this object."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


@dataclass(frozen=True)
class Neighbourhoods(_Memoising):
    """The incoming edges of a set of target nodes, self-loops included, sorted by target.

    Sorting by target makes each target's neighbourhood one contiguous segment, so the
    softmax over a neighbourhood is a segment max, an exp and a segment sum, and the
    aggregation is one CSR product.

    Usually sources and targets are the same N nodes. :func:`receptive_field` cuts out the
    edges that a few output nodes depend on: then the sources are a superset of the targets
    (every target is its own neighbour), and `target_in_source` locates each target among them.

    Shapes:
        source: [E] index of the neighbour j of each edge j -> i, in [0, num_sources)
        target: [E] index of the receiving node i, in [0, num_targets), non-decreasing
        target_in_source: [num_targets], or None when sources and targets are the same nodes
    """

    source: Tensor
    target: Tensor
    num_targets: int
    num_sources: int
    target_in_source: Tensor | None = None

    @classmethod
    def from_edge_index(cls, edge_index: Tensor, num_nodes: int) -> "Neighbourhoods":
        """Add one self-loop per node (the paper attends over i's neighbourhood *and* i) and sort.

        Args:
            edge_index: [2, E0] (source, target) pairs; existing self-loops and duplicates are dropped.
        """
        source, target = edge_index
        keep = source != target
        loops = torch.arange(num_nodes, dtype=torch.long, device=edge_index.device)
        source = torch.cat([source[keep], loops])
        target = torch.cat([target[keep], loops])
        # One key per (target, source) pair: sorting it groups neighbourhoods; unique drops duplicates.
        key = torch.unique(target * num_nodes + source)
        return cls(source=key % num_nodes, target=key // num_nodes, num_targets=num_nodes, num_sources=num_nodes)

    @property
    def num_nodes(self) -> int:
        return self.num_targets

    @property
    def num_edges(self) -> int:
        return int(self.source.numel())

    @functools.cached_property
    def degree(self) -> Tensor:
        """Incoming edges per target, self-loop included (the segment lengths): [num_targets]."""
        return torch.bincount(self.target, minlength=self.num_targets)

    @functools.cached_property
    def crow(self) -> Tensor:
        """CSR row pointers of the adjacency with rows = targets, columns = sources: [num_targets + 1]."""
        return torch.cat([self.target.new_zeros(1), self.degree.cumsum(0)])

    def to(self, device: torch.device | str) -> "Neighbourhoods":
        moved = None if self.target_in_source is None else self.target_in_source.to(device)
        return Neighbourhoods(self.source.to(device), self.target.to(device), self.num_targets, self.num_sources, moved)


def receptive_field(graph: Neighbourhoods, nodes: Tensor, layers: int) -> tuple[Tensor, list[Neighbourhoods]]:
    """The part of a square graph that `layers` attention layers read to compute `nodes`' outputs.

    A loss on 140 training nodes of Cora depends on 644 nodes' first-layer outputs and on
    1,664 nodes' features: computing only those is exact and does a third of the work.

    Returns:
        inputs: [N_0] sorted ids of the nodes whose features the first layer reads
        blocks: one per layer, first layer first; block l's targets are block l+1's sources,
            and the last block's targets are `nodes`, sorted.
    """
    targets = torch.unique(nodes)
    blocks = []
    for _ in range(layers):
        lookup = torch.full((graph.num_targets,), -1, dtype=torch.long, device=nodes.device)
        lookup[targets] = torch.arange(targets.numel(), device=nodes.device)
        into = lookup[graph.target] >= 0
        sources = torch.unique(graph.source[into])  # includes the targets: every node has a self-loop
        source_lookup = torch.full_like(lookup, -1)
        source_lookup[sources] = torch.arange(sources.numel(), device=nodes.device)
        blocks.append(Neighbourhoods(source_lookup[graph.source[into]], lookup[graph.target[into]],
                                     targets.numel(), sources.numel(), source_lookup[targets]))
        targets = sources
    return targets, blocks[::-1]


@dataclass(frozen=True)
class SparseFeatures(_Memoising):
    """Row-normalised bag-of-words features kept sparse (Cora: 1.3% non-zero).

    `values` is what input dropout touches: dropping a zero changes nothing, so masking
    the non-zeros alone has the same distribution as dense dropout at a fraction of the cost.

    Shapes:
        crow: [N + 1], col: [nnz], values: [nnz] (CSR of x: [N, F_in])
    """

    crow: Tensor
    col: Tensor
    values: Tensor
    num_features: int

    @classmethod
    def from_csr(cls, x: Tensor) -> "SparseFeatures":
        with csr_beta_warning_silenced():
            x = x.to_sparse_csr()
        return cls(x.crow_indices().long(), x.col_indices().long(), x.values(), x.shape[1])

    @property
    def num_nodes(self) -> int:
        return self.crow.numel() - 1

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    def rows(self, nodes: Tensor) -> "SparseFeatures":
        """The features of `nodes` only, in that order: [len(nodes), F_in]."""
        starts, lengths = self.crow[nodes], self.crow.diff()[nodes]
        crow = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        # The position of every kept entry in the full value array, row after row.
        offsets = torch.arange(int(crow[-1]), device=nodes.device) - torch.repeat_interleave(crow[:-1], lengths)
        index = torch.repeat_interleave(starts, lengths) + offsets
        return SparseFeatures(crow, self.col[index], self.values[index], self.num_features)

    def to_dense(self) -> Tensor:
        """x: [N, F_in]."""
        shape = (self.num_nodes, self.num_features)
        with csr_beta_warning_silenced():
            return torch.sparse_csr_tensor(self.crow, self.col, self.values, shape, check_invariants=False).to_dense()

    def to(self, device: torch.device | str) -> "SparseFeatures":
        return SparseFeatures(self.crow.to(device), self.col.to(device), self.values.to(device), self.num_features)
