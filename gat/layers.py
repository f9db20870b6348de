"""Graph attention, computed edge by edge, for R independent replicas (seeds) at once."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods, SparseFeatures


# CSR products are the point of this engine; torch's "beta" notice would print on every run.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)


@dataclass(frozen=True)
class _BlockPlan:
    """Index structure of the block-diagonal matrix diag(x ∘ m_1, ..., x ∘ m_B) and of its transpose.

    Block b holds the input features under replica-head b's dropout mask. The structure is
    fixed; only the values change per step, so it is built once per batch size.
    """

    crow: Tensor
    col: Tensor
    shape: tuple[int, int]
    t_crow: Tensor
    t_col: Tensor
    t_perm: Tensor  # values of the transpose = values[t_perm]
    t_shape: tuple[int, int]

    @classmethod
    def build(cls, x: SparseFeatures, blocks: int) -> "_BlockPlan":
        n, f, nnz = x.num_nodes, x.num_features, x.nnz
        row = torch.repeat_interleave(torch.arange(n, device=x.col.device), x.crow.diff())
        order = torch.argsort(x.col * n + row)  # CSR of x^T: entries sorted by (column, row)
        t_crow = torch.zeros(f + 1, dtype=torch.long, device=x.col.device)
        t_crow[1:] = torch.bincount(x.col, minlength=f).cumsum(0)
        offsets = torch.arange(blocks, device=x.col.device)[:, None]

        def stack(pointers: Tensor, step: int) -> Tensor:
            return torch.cat([(pointers[:-1] + offsets * step).reshape(-1), pointers.new_tensor([blocks * step])])

        return cls(
            crow=stack(x.crow, nnz), col=(x.col + offsets * f).reshape(-1), shape=(blocks * n, blocks * f),
            t_crow=stack(t_crow, nnz), t_col=(row[order] + offsets * n).reshape(-1),
            t_perm=(order + offsets * nnz).reshape(-1), t_shape=(blocks * f, blocks * n),
        )


class _BlockSparseMatmul(torch.autograd.Function):
    """diag(x ∘ m_b) @ W with CSR kernels both ways; the gradient goes to W only (x is data).

    The backward uses the precomputed transpose instead of autograd's sparse transpose,
    which rebuilds the structure every step and costs more than the product itself.
    """

    @staticmethod
    def forward(ctx, values: Tensor, weight: Tensor, plan: _BlockPlan) -> Tensor:
        ctx.plan = plan
        ctx.save_for_backward(values)
        return torch.sparse_csr_tensor(plan.crow, plan.col, values, plan.shape, check_invariants=False) @ weight

    @staticmethod
    def backward(ctx, grad: Tensor):
        (values,) = ctx.saved_tensors
        plan = ctx.plan
        transpose = torch.sparse_csr_tensor(plan.t_crow, plan.t_col, values[plan.t_perm], plan.t_shape,
                                            check_invariants=False)
        return None, transpose @ grad, None


def segment_softmax(e: Tensor, target: Tensor, num_nodes: int) -> Tensor:
    """Softmax of edge scores over each target's incoming edges.

    Subtracting each neighbourhood's max keeps exp() from overflowing; it is detached
    because softmax is invariant to the shift, so its gradient would cancel anyway.

    Shapes:
        e: [E, B], target: [E] -> [E, B]
    """
    shift = e.new_full((num_nodes, e.shape[1]), -math.inf)
    shift.scatter_reduce_(0, target.unsqueeze(1).expand_as(e), e.detach(), "amax")
    exp = (e - shift.index_select(0, target)).exp()
    denominator = e.new_zeros(num_nodes, e.shape[1]).index_add_(0, target, exp)
    return exp / denominator.index_select(0, target)


class GraphAttentionLayer(nn.Module):
    r"""Multi-head graph attention (Veličković et al. 2018), edge-wise, for R replicas at once.

    For head k, each node i and each j in its neighbourhood N(i) (i itself included):

    .. math::
        g_i = W^k h_i, \qquad
        e_{ij} = \mathrm{LeakyReLU}\big(a_1^k \cdot g_i + b_1^k + a_2^k \cdot g_j + b_2^k\big),

        \alpha_{ij} = \frac{\exp(e_{ij} - \max_{l \in N(i)} e_{il})}{\sum_{l \in N(i)} \exp(e_{il} - \max_{l} e_{il})},
        \qquad h'_i = \sum_{j \in N(i)} \alpha_{ij} g_j + c^k

    The heads are concatenated (`is_concat`) or averaged. This is the annotated tutorial's
    layer, with the tutorial's constructor, but the score a^T[g_i || g_j] is split into a
    per-node target half and source half that are gathered to edges, so memory is O(E·H),
    not the tutorial's O(N²·H).

    As in the authors' code, a_1 and a_2 carry biases b_1, b_2, each head adds an output bias
    c^k, and `dropout` hits three places: the layer input (a fresh mask per head), the
    transformed features g, and the attention coefficients α.

    Args:
        in_features: F_in.
        out_features: H·F' when `is_concat`, else F' (the tutorial's convention).
        n_heads: H.
        is_concat: concatenate the heads' outputs, or average them.
        dropout: drop probability p.
        leaky_relu_negative_slope: slope of LeakyReLU in e_ij.
        n_replicas: R independent copies of every parameter (one per seed).

    Shapes:
        h: [N, R, F_in] dense, or :class:`SparseFeatures` x: [N, F_in] shared by all replicas
        output: [N, R, H·F'] if `is_concat`, else [N, R, F']
    """

    def __init__(self, in_features: int, out_features: int, n_heads: int, is_concat: bool = True,
                 dropout: float = 0.6, leaky_relu_negative_slope: float = 0.2, n_replicas: int = 1):
        super().__init__()
        if is_concat and out_features % n_heads:
            raise ValueError(f"out_features ({out_features}) must be a multiple of n_heads ({n_heads}) to concatenate")
        self.in_features, self.n_heads, self.is_concat = in_features, n_heads, is_concat
        self.n_hidden = out_features // n_heads if is_concat else out_features
        self.dropout, self.negative_slope = dropout, leaky_relu_negative_slope
        shape = (n_replicas, n_heads)
        self.W = nn.Parameter(torch.empty(*shape, in_features, self.n_hidden))
        self.a_target = nn.Parameter(torch.empty(*shape, self.n_hidden))  # a_1: scores the receiving node i
        self.a_source = nn.Parameter(torch.empty(*shape, self.n_hidden))  # a_2: scores the neighbour j
        # b_1 and b_2 only ever appear summed, but Adam and L2 treat them as two variables, as the authors' code does.
        self.b_target = nn.Parameter(torch.zeros(shape))
        self.b_source = nn.Parameter(torch.zeros(shape))
        self.bias = nn.Parameter(torch.zeros(*shape, self.n_hidden))
        self._plans: dict[tuple, _BlockPlan] = {}
        self.reset_parameters([torch.Generator().manual_seed(r) for r in range(n_replicas)])

    @property
    def n_replicas(self) -> int:
        return self.W.shape[0]

    @torch.no_grad()
    def reset_parameters(self, generators: Sequence[torch.Generator]) -> None:
        """Glorot-uniform weights (1x1 convolutions in the authors' code), zero biases; replica r draws from generators[r]."""

        def glorot(fan_in: int, fan_out: int, *shape: int, generator: torch.Generator) -> Tensor:
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            return (torch.rand(*shape, generator=generator) * 2 - 1) * bound

        for r, generator in enumerate(generators):
            self.W[r] = glorot(self.in_features, self.n_hidden, *self.W.shape[1:], generator=generator)
            self.a_target[r] = glorot(self.n_hidden, 1, *self.a_target.shape[1:], generator=generator)
            self.a_source[r] = glorot(self.n_hidden, 1, *self.a_source.shape[1:], generator=generator)
        for bias in (self.b_target, self.b_source, self.bias):
            bias.zero_()

    def _plan(self, x: SparseFeatures, blocks: int) -> _BlockPlan:
        key = (x.crow.data_ptr(), x.nnz, blocks, str(x.crow.device))
        if key not in self._plans:
            self._plans[key] = _BlockPlan.build(x, blocks)
        return self._plans[key]

    def _transform(self, h: Tensor | SparseFeatures, noise: ReplicaDropout | None) -> Tensor:
        """g = W^k · dropout_k(h) for every replica and head: [N, R·H, F']."""
        R, H, F_out = self.n_replicas, self.n_heads, self.n_hidden
        if isinstance(h, SparseFeatures):
            if noise is None:
                # No dropout: every replica and head sees the same x, so one wide product x @ [W_1 ... W_B].
                wide = self.W.permute(2, 0, 1, 3).reshape(h.num_features, R * H * F_out)
                return _BlockSparseMatmul.apply(h.values, wide, self._plan(h, 1)).view(h.num_nodes, R * H, F_out)
            # Dropout: block b multiplies x under its own mask, diag(x ∘ m_1, ..., x ∘ m_B) @ [W_1; ...; W_B].
            values = h.values * noise.keep(H, h.nnz, device=h.values.device)
            g = _BlockSparseMatmul.apply(values.reshape(-1), self.W.reshape(-1, F_out), self._plan(h, R * H))
            return g.view(R * H, h.num_nodes, F_out).transpose(0, 1).contiguous()
        N = h.shape[0]
        h = h.transpose(0, 1).unsqueeze(1)  # [R, 1, N, F_in]: one input, a mask per head
        if noise is not None:
            h = h * noise.keep(H, N, h.shape[-1], device=h.device)
        return torch.matmul(h, self.W).view(R * H, N, F_out).transpose(0, 1).contiguous()

    def forward(self, h: Tensor | SparseFeatures, neighbourhoods: Neighbourhoods,
                noise: ReplicaDropout | None = None) -> Tensor:
        """`noise` draws the dropout masks; None means evaluation (no dropout)."""
        R, H, F_out = self.n_replicas, self.n_heads, self.n_hidden
        N, source, target = neighbourhoods.num_nodes, neighbourhoods.source, neighbourhoods.target
        g = self._transform(h, noise)  # [N, B, F'], B = R·H; node-major so edges gather whole rows

        # a^T [g_i || g_j] = a_1·g_i + a_2·g_j: score each node once, then gather to edges (O(E), not O(N²)).
        score_target = (g * self.a_target.view(R * H, F_out)).sum(-1) + self.b_target.view(R * H)
        score_source = (g * self.a_source.view(R * H, F_out)).sum(-1) + self.b_source.view(R * H)
        e = F.leaky_relu(score_target.index_select(0, target) + score_source.index_select(0, source),
                         self.negative_slope)  # [E, B]
        alpha = segment_softmax(e, target, N)

        if noise is not None:
            E = alpha.shape[0]
            alpha = alpha * noise.keep(E, H, device=alpha.device).transpose(0, 1).reshape(E, R * H)
            g = g * noise.keep(N, H, F_out, device=g.device).transpose(0, 1).reshape(N, R * H, F_out)

        # h'_i = Σ_j α_ij g_j: weight each neighbour's features on its edge, sum per target.
        messages = alpha.unsqueeze(-1) * g.index_select(0, source)  # [E, B, F']
        out = g.new_zeros(N, R * H, F_out).index_add_(0, target, messages) + self.bias.view(R * H, F_out)
        if self.is_concat:
            return out.view(N, R, H * F_out)
        return out.view(N, R, H, F_out).mean(dim=2)
