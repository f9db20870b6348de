"""The dense graph attention layer of the annotated tutorial, kept as the reference formulation.

`GraphAttentionLayer` below is the layer of labml.ai's "Annotated Deep Learning Paper
Implementations" (`labml_nn/graphs/gat`, MIT licence, © Varuna Jayasiri), reproduced with
its constructor and its forward pass: one shared `attn` projection scores every pair
[g_i || g_j] of a dense [N, N, heads, 2F'] tensor built with `repeat` / `repeat_interleave`,
the scores of non-edges are masked to -inf, and the softmax runs over the neighbours j.
It costs O(N²·H) memory: the tests use it on small graphs, and `benchmarks.engine` times it
as the dense baseline (on a subgraph of Cora when the whole graph would not fit in memory).
It lives here, beside the benchmark, so that the benchmark and the tests import it alike;
nothing imports from tests/.

`dense_attention` is the same formulation written as a function of explicit per-head
parameters, including what the tutorial leaves out and the authors' code has: the biases
b_target / b_source of the attention projections and each head's output bias. In double
precision it is the autograd reference for the gradients of `gat.layers.GraphAttentionLayer`.

The helpers convert between the two worlds: `adjacency` builds the tutorial's `adj_mat`
from a `gat.graph.Neighbourhoods`, and `copy_into` loads a tutorial layer's weights into a
one-replica `gat.layers.GraphAttentionLayer`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gat.graph import Neighbourhoods
from gat.layers import GraphAttentionLayer as EdgeWiseLayer


class GraphAttentionLayer(nn.Module):
    """The tutorial's dense multi-head graph attention layer.

    Shapes:
        h: [N, F_in]; adj_mat: [N, N, 1] (or [N, N, H]), adj_mat[i, j] = 1 when i attends to j
        output: [N, H·F'] if `is_concat`, else [N, F']
    """

    def __init__(self, in_features: int, out_features: int, n_heads: int, is_concat: bool = True,
                 dropout: float = 0.6, leaky_relu_negative_slope: float = 0.2):
        super().__init__()
        self.is_concat = is_concat
        self.n_heads = n_heads
        if is_concat:
            assert out_features % n_heads == 0
            self.n_hidden = out_features // n_heads
        else:
            self.n_hidden = out_features
        self.linear = nn.Linear(in_features, self.n_hidden * n_heads, bias=False)
        self.attn = nn.Linear(self.n_hidden * 2, 1, bias=False)
        self.activation = nn.LeakyReLU(negative_slope=leaky_relu_negative_slope)
        self.softmax = nn.Softmax(dim=1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: Tensor, adj_mat: Tensor) -> Tensor:
        n_nodes = h.shape[0]
        g = self.linear(h).view(n_nodes, self.n_heads, self.n_hidden)
        # g_concat[i, j] = [g_i || g_j]
        g_repeat = g.repeat(n_nodes, 1, 1)
        g_repeat_interleave = g.repeat_interleave(n_nodes, dim=0)
        g_concat = torch.cat([g_repeat_interleave, g_repeat], dim=-1)
        g_concat = g_concat.view(n_nodes, n_nodes, self.n_heads, 2 * self.n_hidden)
        e = self.activation(self.attn(g_concat))
        e = e.squeeze(-1)
        assert adj_mat.shape[0] == 1 or adj_mat.shape[0] == n_nodes
        assert adj_mat.shape[1] == 1 or adj_mat.shape[1] == n_nodes
        assert adj_mat.shape[2] == 1 or adj_mat.shape[2] == self.n_heads
        e = e.masked_fill(adj_mat == 0, float("-inf"))
        a = self.softmax(e)
        a = self.dropout(a)
        attn_res = torch.einsum("ijh,jhf->ihf", a, g)
        if self.is_concat:
            return attn_res.reshape(n_nodes, self.n_heads * self.n_hidden)
        return attn_res.mean(dim=1)


def dense_attention(h: Tensor, adj_mat: Tensor, W: Tensor, a_target: Tensor, a_source: Tensor,
                    b_target: Tensor, b_source: Tensor, bias: Tensor, negative_slope: float,
                    is_concat: bool) -> Tensor:
    """The tutorial's dense formulation with per-head parameters and all of the authors' biases, no dropout.

    e_ij^k = LeakyReLU([a_target^k || a_source^k] · [g_i^k || g_j^k] + b_target^k + b_source^k),
    α = softmax over j of the masked scores, h'_i^k = Σ_j α_ij^k g_j^k + bias^k.

    Shapes:
        h: [N, F_in]; adj_mat: [N, N, 1]; W: [H, F_in, F']; a_target, a_source: [H, F'];
        b_target, b_source: [H]; bias: [H, F'] -> [N, H·F'] if `is_concat`, else [N, F']
    """
    n_nodes = h.shape[0]
    n_heads, _, n_hidden = W.shape
    g = torch.einsum("nf,hfo->nho", h, W)  # [N, H, F']
    g_concat = torch.cat([g.repeat_interleave(n_nodes, dim=0), g.repeat(n_nodes, 1, 1)], dim=-1)
    g_concat = g_concat.view(n_nodes, n_nodes, n_heads, 2 * n_hidden)
    attn = torch.cat([a_target, a_source], dim=-1)  # [H, 2F']
    e = (g_concat * attn).sum(-1) + b_target + b_source  # [N, N, H]
    e = torch.nn.functional.leaky_relu(e, negative_slope)
    e = e.masked_fill(adj_mat == 0, float("-inf"))
    a = torch.softmax(e, dim=1)
    out = torch.einsum("ijh,jhf->ihf", a, g) + bias  # [N, H, F']
    if is_concat:
        return out.reshape(n_nodes, n_heads * n_hidden)
    return out.mean(dim=1)


def adjacency(neighbourhoods: Neighbourhoods) -> Tensor:
    """The tutorial's `adj_mat`: [N, N, 1], 1 at [i, j] for every edge j -> i (self-loops included)."""
    n = neighbourhoods.num_nodes
    adj = torch.zeros(n, n, 1)
    adj[neighbourhoods.target, neighbourhoods.source] = 1.0
    return adj


@torch.no_grad()
def copy_into(reference: GraphAttentionLayer, layer: EdgeWiseLayer) -> EdgeWiseLayer:
    """Load the tutorial layer's weights into a one-replica edge-wise layer; its biases become zero.

    W[0, k] is head k's block of `linear.weight`, transposed; `attn` is shared by the heads, its
    first half scoring g_i (the target) and its second half g_j (the source).
    """
    assert layer.n_replicas == 1 and layer.n_heads == reference.n_heads and layer.n_hidden == reference.n_hidden
    f = reference.n_hidden
    for k in range(reference.n_heads):
        layer.W[0, k] = reference.linear.weight[k * f:(k + 1) * f].T
        layer.a_target[0, k] = reference.attn.weight[0, :f]
        layer.a_source[0, k] = reference.attn.weight[0, f:]
    for bias in (layer.b_target, layer.b_source, layer.bias):
        bias.zero_()
    return layer
