"""gat.model.GAT.attention: the α of the eval-mode pass, against PyG's GATConv and GATv2Conv and the softmax's sum."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gat.config import ModelConfig
from gat.graph import Neighbourhoods, SparseFeatures, receptive_field
from gat.model import GAT
from gat.training import GraphTensors, predict
from pyg_support import pyg_gatv2

CONFIG = ModelConfig(hidden_features=5, heads=3, output_heads=2, dropout=0.6, leaky_relu_negative_slope=0.2)
N, F_IN, C = 40, 16, 4


@pytest.fixture(scope="module")
def graph() -> tuple[torch.Tensor, torch.Tensor]:
    """Dense features and an undirected edge list without self-loops or duplicates: [N, F_in], [2, E0]."""
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(N, F_IN, generator=generator) * (torch.rand(N, F_IN, generator=generator) < 0.4)
    pairs = torch.randint(0, N, (2, 120), generator=generator)
    pairs = pairs[:, pairs[0] != pairs[1]]
    edge_index = torch.unique(torch.cat([pairs, pairs.flip(0)], 1), dim=1)
    return x, edge_index


def _trained_like(seeds: list[int]) -> GAT:
    """Every parameter random and non-zero (the attention biases b_1, b_2 included), in eval mode."""
    model = GAT(CONFIG, F_IN, C, seeds=seeds).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def _pyg_layer(layer, replica: int, in_features: int, is_concat: bool):
    """PyG's GATConv with `layer`'s weights for one replica. GATConv has no attention bias b_1 + b_2, so it
    enters as an edge feature: every edge (self-loops included, filled with the mean 1) carries a 1, which
    lin_edge and att_edge turn into b_1 + b_2 of each head."""
    from torch_geometric.nn import GATConv

    H, F_out = layer.n_heads, layer.n_hidden
    conv = GATConv(in_features, F_out, heads=H, concat=is_concat, negative_slope=layer.negative_slope,
                   dropout=0.0, add_self_loops=True, edge_dim=1, fill_value="mean", bias=True).eval()
    with torch.no_grad():
        conv.lin.weight.copy_(layer.W[replica].transpose(1, 2).reshape(H * F_out, in_features))
        conv.att_src.copy_(layer.a_source[replica].view(1, H, F_out))
        conv.att_dst.copy_(layer.a_target[replica].view(1, H, F_out))
        conv.lin_edge.weight.zero_()
        conv.lin_edge.weight.view(H, F_out)[:, 0] = layer.b_target[replica] + layer.b_source[replica]
        conv.att_edge.zero_()
        conv.att_edge[0, :, 0] = 1.0
        # PyG adds one bias after joining the heads; ours adds one per head before (and before ELU).
        conv.bias.copy_(layer.bias[replica].reshape(-1) if is_concat else layer.bias[replica].mean(0))
    return conv


def _in_our_order(edge_index: torch.Tensor, alpha: torch.Tensor, neighbourhoods: Neighbourhoods) -> torch.Tensor:
    """PyG's α [E, H] (edges in its own order, self-loops appended) rearranged to our (target, source) order."""
    n = neighbourhoods.num_nodes
    theirs = edge_index[1] * n + edge_index[0]
    ours = neighbourhoods.target * n + neighbourhoods.source
    assert torch.equal(theirs.sort().values, ours)  # the same edges, each once
    return alpha[theirs.argsort()]


@pytest.mark.parametrize("replica", [0, 1])
def test_attention_equals_pyg_gatconv_with_the_same_weights(graph, replica: int) -> None:
    x, edge_index = graph
    model = _trained_like(seeds=[7, 8])
    neighbourhoods = Neighbourhoods.from_edge_index(edge_index, N)
    first, second = model.attention(SparseFeatures.from_csr(x), neighbourhoods)
    assert first.shape == (neighbourhoods.num_edges, 2, CONFIG.heads)
    assert second.shape == (neighbourhoods.num_edges, 2, CONFIG.output_heads)

    ones = torch.ones(edge_index.shape[1], 1)
    conv1 = _pyg_layer(model.hidden, replica, F_IN, is_concat=True)
    conv2 = _pyg_layer(model.output, replica, CONFIG.heads * CONFIG.hidden_features, is_concat=False)
    with torch.no_grad():
        hidden, (edges1, alpha1) = conv1(x, edge_index, ones, return_attention_weights=True)
        logits, (edges2, alpha2) = conv2(F.elu(hidden), edge_index, ones, return_attention_weights=True)
    torch.testing.assert_close(first[:, replica], _in_our_order(edges1, alpha1, neighbourhoods), rtol=0, atol=1e-6)
    torch.testing.assert_close(second[:, replica], _in_our_order(edges2, alpha2, neighbourhoods), rtol=0, atol=1e-6)
    # The whole pass agrees too, so the α above are the ones the layers aggregate with.
    torch.testing.assert_close(model(SparseFeatures.from_csr(x), neighbourhoods)[:, replica], logits,
                               rtol=1e-5, atol=1e-5)


def test_attention_sums_to_one_over_each_nodes_incoming_edges_self_loop_included(graph) -> None:
    x, edge_index = graph
    neighbourhoods = Neighbourhoods.from_edge_index(edge_index, N)
    isolated = N - torch.unique(edge_index[1]).numel()
    for alpha in _trained_like(seeds=[1, 2]).attention(SparseFeatures.from_csr(x), neighbourhoods):
        totals = torch.zeros(N, *alpha.shape[1:], dtype=torch.float64).index_add_(0, neighbourhoods.target,
                                                                                 alpha.double())
        torch.testing.assert_close(totals, torch.ones_like(totals), rtol=0, atol=1e-6)
        assert (alpha > 0).all() and (alpha <= 1).all()
        # A node with no neighbour attends to itself alone.
        loops = neighbourhoods.source == neighbourhoods.target
        alone = neighbourhoods.degree[neighbourhoods.target] == 1
        assert int((loops & alone).sum()) == isolated
        assert torch.equal(alpha[loops & alone], torch.ones_like(alpha[loops & alone]))


def test_inspect_is_the_pass_that_predict_makes(graph) -> None:
    x, edge_index = graph
    model = _trained_like(seeds=[4])
    labels = torch.zeros(N, dtype=torch.long)
    tensors = GraphTensors(SparseFeatures.from_csr(x), Neighbourhoods.from_edge_index(edge_index, N), labels,
                           torch.arange(3), torch.arange(3, 6), torch.arange(6, 9), C)
    inside = model.inspect(tensors.x, tensors.neighbourhoods)
    assert torch.equal(inside.logits, predict(model, tensors))
    assert torch.equal(inside.hidden, model.hidden(tensors.x, tensors.neighbourhoods))
    assert inside.hidden.shape == (N, 1, CONFIG.heads * CONFIG.hidden_features)


def test_attention_refuses_training_mode_and_receptive_field_blocks(graph) -> None:
    x, edge_index = graph
    model = _trained_like(seeds=[4])
    neighbourhoods = Neighbourhoods.from_edge_index(edge_index, N)
    with pytest.raises(ValueError, match="eval"):
        model.train().attention(SparseFeatures.from_csr(x), neighbourhoods)
    model.eval()
    _inputs, blocks = receptive_field(neighbourhoods, torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match="whole graph"):
        model.attention(SparseFeatures.from_csr(x), blocks[1])


# The variants ------------------------------------------------------------------------------------

def _variant_like(attention: str, seeds: list[int]) -> GAT:
    model = GAT(dataclasses.replace(CONFIG, attention=attention), F_IN, C, seeds=seeds).eval()
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize("replica", [0, 1])
def test_gatv2_attention_equals_pyg_gatv2conv_with_the_same_weights(graph, replica: int) -> None:
    x, edge_index = graph
    model = _variant_like("gatv2", seeds=[7, 8])
    neighbourhoods = Neighbourhoods.from_edge_index(edge_index, N)
    first, second = model.attention(SparseFeatures.from_csr(x), neighbourhoods)
    assert first.shape == (neighbourhoods.num_edges, 2, CONFIG.heads)
    conv1 = pyg_gatv2(model.hidden, replica, F_IN)
    conv2 = pyg_gatv2(model.output, replica, CONFIG.heads * CONFIG.hidden_features)
    with torch.no_grad():
        hidden, (edges1, alpha1) = conv1(x, edge_index, return_attention_weights=True)
        logits, (edges2, alpha2) = conv2(F.elu(hidden), edge_index, return_attention_weights=True)
    torch.testing.assert_close(first[:, replica], _in_our_order(edges1, alpha1, neighbourhoods), rtol=0, atol=1e-6)
    torch.testing.assert_close(second[:, replica], _in_our_order(edges2, alpha2, neighbourhoods), rtol=0, atol=1e-6)
    torch.testing.assert_close(model(SparseFeatures.from_csr(x), neighbourhoods)[:, replica], logits,
                               rtol=1e-5, atol=1e-5)


def test_constant_attention_is_uniform_over_each_neighbourhood(graph) -> None:
    x, edge_index = graph
    neighbourhoods = Neighbourhoods.from_edge_index(edge_index, N)
    model = _variant_like("constant", seeds=[1, 2])
    inside = model.inspect(SparseFeatures.from_csr(x), neighbourhoods)
    uniform = 1.0 / neighbourhoods.degree[neighbourhoods.target].float()  # [E]
    for alpha, heads in zip(inside.attention, (CONFIG.heads, CONFIG.output_heads), strict=True):
        assert torch.equal(alpha, uniform.view(-1, 1, 1).expand(-1, 2, heads))
    with torch.no_grad():
        assert torch.equal(inside.logits, model(SparseFeatures.from_csr(x), neighbourhoods))
