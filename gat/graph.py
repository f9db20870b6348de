"""The two structures the attention engine runs on: neighbourhoods and sparse input features."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Neighbourhoods:
    """Every node's incoming edges, self-loop included, sorted by target.

    Sorting by target makes each node's neighbourhood one contiguous segment, so the
    softmax over a neighbourhood is a segment max, an exp and a segment sum.

    Shapes:
        source: [E] the neighbour j of each edge j -> i
        target: [E] the receiving node i, non-decreasing
        num_nodes: N
    """

    source: Tensor
    target: Tensor
    num_nodes: int

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
        return cls(source=key % num_nodes, target=key // num_nodes, num_nodes=num_nodes)

    @property
    def num_edges(self) -> int:
        return int(self.source.numel())

    def to(self, device: torch.device | str) -> "Neighbourhoods":
        return Neighbourhoods(self.source.to(device), self.target.to(device), self.num_nodes)


@dataclass(frozen=True)
class SparseFeatures:
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
        x = x.to_sparse_csr()
        return cls(x.crow_indices().long(), x.col_indices().long(), x.values(), x.shape[1])

    @property
    def num_nodes(self) -> int:
        return self.crow.numel() - 1

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    def to_dense(self) -> Tensor:
        """x: [N, F_in]."""
        shape = (self.num_nodes, self.num_features)
        return torch.sparse_csr_tensor(self.crow, self.col, self.values, shape).to_dense()

    def to(self, device: torch.device | str) -> "SparseFeatures":
        return SparseFeatures(self.crow.to(device), self.col.to(device), self.values.to(device), self.num_features)
