"""gat.layers: the edge-wise attention layer against the dense tutorial layer, autograd and PyG."""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from gat.dense_reference import GraphAttentionLayer as DenseLayer
from gat.dense_reference import adjacency, copy_into, dense_attention
from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods, SparseFeatures, receptive_field
from gat.layers import ConstantAttentionLayer, GATv2Layer, GraphAttentionLayer, segment_softmax
from pyg_support import pyg_gatv2


def random_graph(num_nodes: int, num_edges: int, seed: int, isolated: int = 2) -> Neighbourhoods:
    """Random directed edges among all but the last `isolated` nodes (which get only their self-loop).

    The raw edge list holds duplicates and self-loops on purpose: `from_edge_index` must drop them.
    """
    generator = torch.Generator().manual_seed(seed)
    connected = num_nodes - isolated
    edge_index = torch.randint(0, connected, (2, num_edges), generator=generator)
    edge_index = torch.cat([edge_index, edge_index[:, :3], torch.tensor([[0, 1], [0, 1]])], dim=1)
    return Neighbourhoods.from_edge_index(edge_index, num_nodes)


def random_features(num_nodes: int, num_features: int, seed: int, density: float = 0.3,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense [N, F_in] matrix that is mostly zeros, with one all-zero row."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_nodes, num_features, generator=generator, dtype=dtype)
    x = x * (torch.rand(num_nodes, num_features, generator=generator, dtype=dtype) < density)
    x[1] = 0
    return x


def randomise(layer: GraphAttentionLayer, seed: int, biases: bool = True) -> GraphAttentionLayer:
    """Give every parameter, biases included, random values of order one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if biases or not name.startswith("b"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return layer


def as_input(x: torch.Tensor, sparse: bool) -> torch.Tensor | SparseFeatures:
    return SparseFeatures.from_csr(x) if sparse else x.unsqueeze(1)


# The two layouts: training mode block-major, eval mode node-major (GraphAttentionLayer's docstring).
MODES = pytest.mark.parametrize("mode", ["train", "eval"])


# The tutorial's dense layer ---------------------------------------------------------------------

@MODES
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
@pytest.mark.parametrize("is_concat,heads", [(True, 1), (True, 3), (False, 1), (False, 4)])
def test_matches_the_dense_tutorial_layer(is_concat: bool, heads: int, sparse: bool, mode: str) -> None:
    for seed in range(3):
        n, f_in, f_out = 17 + seed, 11, 5
        neighbourhoods = random_graph(n, 40, seed)
        x = random_features(n, f_in, seed)
        torch.manual_seed(seed)
        reference = DenseLayer(f_in, heads * f_out if is_concat else f_out, heads, is_concat=is_concat,
                               dropout=0.6, leaky_relu_negative_slope=0.2).eval()
        with torch.no_grad():  # a larger attention vector than the default init, so α is far from uniform
            reference.attn.weight.mul_(8)
        layer = GraphAttentionLayer(f_in, heads * f_out if is_concat else f_out, heads, is_concat=is_concat,
                                    dropout=0.6, leaky_relu_negative_slope=0.2).train(mode == "train")
        copy_into(reference, layer)

        expected = reference(x, adjacency(neighbourhoods))
        with torch.no_grad():
            out = layer(as_input(x, sparse), neighbourhoods)
        assert out.shape == (n, 1, heads * f_out if is_concat else f_out)
        torch.testing.assert_close(out[:, 0], expected, rtol=1e-5, atol=1e-5)


def test_isolated_nodes_attend_to_themselves_only() -> None:
    n = 9
    neighbourhoods = random_graph(n, 20, seed=4, isolated=3)
    layer = randomise(GraphAttentionLayer(6, 4, 2, dropout=0.6, leaky_relu_negative_slope=0.2), seed=4, biases=False)
    x = random_features(n, 6, seed=4, density=1.0)
    with torch.no_grad():
        out = layer(x.unsqueeze(1), neighbourhoods)
        g = torch.einsum("nf,hfo->nho", x, layer.W[0]).reshape(n, -1)
    # α_ii = 1 for a node with no other neighbour: its output is its own transformed features.
    torch.testing.assert_close(out[-3:, 0], g[-3:])


# Replicas ---------------------------------------------------------------------------------------

@MODES
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
@pytest.mark.parametrize("is_concat", [True, False], ids=["concat", "mean"])
def test_replica_equals_a_one_replica_layer_with_its_parameters(is_concat: bool, sparse: bool, mode: str) -> None:
    n, f_in, heads, f_out, replicas = 15, 7, 2, 3, 3
    neighbourhoods = random_graph(n, 35, seed=5)
    batch = randomise(GraphAttentionLayer(f_in, heads * f_out if is_concat else f_out, heads, is_concat=is_concat,
                                          n_replicas=replicas,
                                          dropout=0.6, leaky_relu_negative_slope=0.2), seed=5).train(mode == "train")
    if sparse:
        x = SparseFeatures.from_csr(random_features(n, f_in, seed=5))
        inputs = [x] * replicas
    else:  # a different input per replica, as in the second layer
        h = torch.randn(n, replicas, f_in, generator=torch.Generator().manual_seed(5))
        x, inputs = h, [h[:, r:r + 1] for r in range(replicas)]
    with torch.no_grad():
        out = batch(x, neighbourhoods)
    assert out.shape == (n, replicas, heads * f_out if is_concat else f_out)
    for r in range(replicas):
        single = GraphAttentionLayer(f_in, heads * f_out if is_concat else f_out, heads,
                                     is_concat=is_concat,
                                     dropout=0.6, leaky_relu_negative_slope=0.2).train(mode == "train")
        single.load_state_dict({name: p[r:r + 1] for name, p in batch.state_dict().items()})
        with torch.no_grad():
            assert torch.equal(out[:, r:r + 1], single(inputs[r], neighbourhoods)), r
    assert not torch.allclose(out[:, 0], out[:, 1])  # the replicas' parameters do differ


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
@pytest.mark.parametrize("is_concat,heads", [(True, 3), (False, 2)])
def test_inference_layout_equals_the_training_layout(is_concat: bool, heads: int, sparse: bool) -> None:
    """In eval mode the layer runs node-major, in training mode block-major: the same function either way."""
    n, f_in, f_out, replicas = 31, 10, 5, 3
    neighbourhoods = random_graph(n, 90, seed=8)
    layer = randomise(GraphAttentionLayer(f_in, heads * f_out if is_concat else f_out, heads, is_concat=is_concat,
                                          n_replicas=replicas, activation=torch.nn.functional.elu,
                                          dropout=0.6, leaky_relu_negative_slope=0.2), seed=8)
    if sparse:
        x = SparseFeatures.from_csr(random_features(n, f_in, seed=8))
    else:
        x = torch.randn(n, replicas, f_in, generator=torch.Generator().manual_seed(8))
    # The whole graph, and a receptive-field block, whose targets are a subset of its sources.
    inputs, (block,) = receptive_field(neighbourhoods, torch.tensor([17, 0, 3]), 1)
    for h, graph in ((x, neighbourhoods), (x.rows(inputs) if sparse else x[inputs], block)):
        with torch.no_grad():
            inferred = layer.eval()(h, graph)
            trained = layer.train()(h, graph)
        assert inferred.shape == (graph.num_targets, replicas, heads * f_out if is_concat else f_out)
        torch.testing.assert_close(inferred, trained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
def test_the_mode_not_autograd_picks_the_layout(sparse: bool) -> None:
    """In either mode, the same bits with autograd on or off: eval mode under gradients still runs node-major,
    and training mode under no_grad (no noise: no dropout) still runs block-major."""
    n, f_in, replicas = 31, 10, 3
    neighbourhoods = random_graph(n, 90, seed=9)
    layer = randomise(GraphAttentionLayer(f_in, 6, 3, n_replicas=replicas, activation=torch.nn.functional.elu,
                                          dropout=0.6, leaky_relu_negative_slope=0.2), seed=9)
    if sparse:
        x = SparseFeatures.from_csr(random_features(n, f_in, seed=9))
    else:
        x = torch.randn(n, replicas, f_in, generator=torch.Generator().manual_seed(9))
    outputs = {}
    for mode in ("train", "eval"):
        layer.train(mode == "train")
        with torch.no_grad():
            outputs[mode] = layer(x, neighbourhoods)
        with_grad = layer(x, neighbourhoods)
        assert with_grad.requires_grad, mode
        assert torch.equal(with_grad.detach(), outputs[mode]), mode
    # The two layouts round differently: the equalities above could tell one from the other.
    assert not torch.equal(outputs["train"], outputs["eval"])


def test_eval_mode_refuses_dropout_noise() -> None:
    layer = GraphAttentionLayer(4, 4, 2, dropout=0.6, leaky_relu_negative_slope=0.2).eval()
    with pytest.raises(ValueError, match="eval mode"):
        layer(torch.randn(6, 1, 4), random_graph(6, 10, seed=0), ReplicaDropout([0], 0.5))


# Gradients --------------------------------------------------------------------------------------

@MODES
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
@pytest.mark.parametrize("is_concat,heads", [(True, 3), (False, 2)])
def test_gradients_match_autograd_through_the_dense_formulation(is_concat: bool, heads: int, sparse: bool,
                                                                mode: str) -> None:
    """Both layouts are differentiable: eval mode too, for gradients without dropout (of the inputs, say)."""
    n, f_in, f_out = 13, 9, 4
    neighbourhoods = random_graph(n, 30, seed=6)
    x = random_features(n, f_in, seed=6, dtype=torch.float64)
    layer = randomise(GraphAttentionLayer(f_in, heads * f_out if is_concat else f_out, heads,
                                          is_concat=is_concat, leaky_relu_negative_slope=0.2,
                                          dropout=0.6).double(), seed=6)
    layer.train(mode == "train")
    assert layer.b_target.abs().min() > 0 and layer.b_source.abs().min() > 0
    weights = torch.randn(n, heads * f_out if is_concat else f_out, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(7))

    (layer(as_input(x, sparse), neighbourhoods)[:, 0] * weights).sum().backward()

    names = ("W", "a_target", "a_source", "b_target", "b_source", "bias")
    leaves = {name: getattr(layer, name).detach()[0].clone().requires_grad_() for name in names}
    expected = dense_attention(x, adjacency(neighbourhoods).double(), **leaves, negative_slope=0.2,
                               is_concat=is_concat)
    torch.testing.assert_close(layer(as_input(x, sparse), neighbourhoods)[:, 0], expected, rtol=1e-12, atol=1e-12)
    (expected * weights).sum().backward()
    for name in names:
        gradient = getattr(layer, name).grad[0]
        assert gradient.abs().max() > 0, name
        torch.testing.assert_close(gradient, leaves[name].grad, rtol=1e-10, atol=1e-12, msg=name)


@MODES
def test_gradcheck_the_whole_layer_on_sparse_input(mode: str) -> None:
    n, f_in = 7, 5
    neighbourhoods = random_graph(n, 14, seed=8, isolated=1)
    x = SparseFeatures.from_csr(random_features(n, f_in, seed=8, dtype=torch.float64))
    layer = GraphAttentionLayer(f_in, 4, 2, n_replicas=2, dropout=0.6, leaky_relu_negative_slope=0.2)
    layer = randomise(layer.double(), seed=8).train(mode == "train")
    names = [name for name, _ in layer.named_parameters()]

    def run(*parameters: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, dict(zip(names, parameters)), (x, neighbourhoods))

    inputs = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-7)


def test_gradcheck_block_sparse_matmul() -> None:
    from gat.layers import _BlockPlan, _BlockSparseMatmul  # private: its custom backward is what is checked

    blocks, n, f_in, f_out = 3, 5, 4, 2
    x = SparseFeatures.from_csr(random_features(n, f_in, seed=9, density=0.5, dtype=torch.float64))
    plan = _BlockPlan.build(x.crow, x.col, f_in, blocks)
    generator = torch.Generator().manual_seed(9)
    values = torch.rand(blocks * x.nnz, dtype=torch.float64, generator=generator, requires_grad=True)
    dense = torch.randn(blocks * f_in, f_out, dtype=torch.float64, generator=generator, requires_grad=True)

    # Block b is x's pattern holding the b-th slice of `values`, times the b-th slice of `dense`.
    out = _BlockSparseMatmul.apply(values, dense, plan)
    for b in range(blocks):
        x_b = SparseFeatures(x.crow, x.col, values.detach().view(blocks, -1)[b], f_in).to_dense()
        torch.testing.assert_close(out[b * n:(b + 1) * n], x_b @ dense[b * f_in:(b + 1) * f_in])
    assert torch.autograd.gradcheck(lambda v, d: _BlockSparseMatmul.apply(v, d, plan), (values, dense))
    # Input features are data: without requires_grad on the values, only the dense side gets a gradient.
    assert torch.autograd.gradcheck(lambda d: _BlockSparseMatmul.apply(values.detach(), d, plan), (dense,))


# Index plans ------------------------------------------------------------------------------------

@MODES
def test_a_plan_is_never_handed_to_another_structure(mode: str) -> None:
    """Two graphs whose row pointers share one storage, as a freed tensor's reused address would: a cache
    keyed by the address would hand the second graph the first one's plan, and compute on the wrong edges."""
    n, replicas = 20, 2
    first = random_graph(n, 60, seed=16)
    second = Neighbourhoods((first.source + 1) % n, first.target, n, n)  # the same degrees, other neighbours
    second.__dict__["crow"] = first.crow  # where cached_property keeps it: one storage, one data_ptr
    layer = randomise(GraphAttentionLayer(6, 4, 2, n_replicas=replicas,
                                          dropout=0.6, leaky_relu_negative_slope=0.2), seed=16).train(mode == "train")
    x = torch.randn(n, replicas, 6, generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        expected = copy.deepcopy(layer)(x, Neighbourhoods(second.source, second.target, n, n))
        layer(x, first)
        assert torch.equal(layer(x, second), expected)


@MODES
def test_plans_live_on_the_structures_they_index_and_die_with_them(mode: str) -> None:
    n, replicas = 20, 2
    neighbourhoods = random_graph(n, 60, seed=17)
    x = SparseFeatures.from_csr(random_features(n, 6, seed=17))
    layer = randomise(GraphAttentionLayer(6, 4, 2, n_replicas=replicas,
                                          dropout=0.6, leaky_relu_negative_slope=0.2), seed=17).train(mode == "train")
    layer(x, neighbourhoods).sum().backward()
    # Training mode: a block plan of x and one of the neighbourhoods; eval mode: the neighbourhoods' inference plan.
    plans = [*x._memo.values(), *neighbourhoods._memo.values()]
    assert len(plans) == (2 if mode == "train" else 1)
    assert len(x._memo) == (mode == "train") and len(neighbourhoods._memo) == 1
    layer(x, neighbourhoods)
    again = [*x._memo.values(), *neighbourhoods._memo.values()]
    assert len(again) == len(plans) and all(a is b for a, b in zip(again, plans))  # built once, found again
    assert "_memo" not in repr(neighbourhoods) and not neighbourhoods.to("cpu")._memo

    references = [weakref.ref(plan) for plan in plans]
    del plans, again, x, neighbourhoods
    gc.collect()
    assert all(reference() is None for reference in references)  # nothing else, the layer least of all, kept them


# Torch's CSR warning ---------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]

# Torch warns once per process, at the first CSR tensor made: each case runs in a fresh interpreter.
WARNING_CASES = {
    "training-step": """
        import torch
        from gat.config import ModelConfig
        from gat.dropout import ReplicaDropout
        from gat.graph import Neighbourhoods, SparseFeatures
        from gat.model import GAT
        from gat.training import GraphTensors, NodeView, train_step

        n, f_in = 30, 8
        generator = torch.Generator().manual_seed(0)
        x = (torch.rand(n, f_in, generator=generator) < 0.3).float()
        row, col = x.nonzero().t()  # the features' CSR made by hand: the step makes the first CSR tensor
        crow = torch.cat([row.new_zeros(1), torch.bincount(row, minlength=n).cumsum(0)])
        edge_index = torch.randint(0, n, (2, 60), generator=generator)
        labels = torch.randint(0, 3, (n,), generator=generator)
        features = SparseFeatures(crow, col, x[row, col], f_in)
        graph = GraphTensors(features, Neighbourhoods.from_edge_index(edge_index, n), labels,
                             torch.arange(10), torch.arange(10, 20), torch.arange(20, n), 3)
        model = GAT(ModelConfig(4, 2, 1, 0.5, 0.2), f_in, 3, seeds=[0])
        optimiser = torch.optim.Adam(model.parameters())
        train_step(model, optimiser, NodeView.of(graph, graph.train_idx, 2), ReplicaDropout([0], 0.5))
    """,
    "sparse-features": """
        import torch
        from gat.graph import SparseFeatures

        SparseFeatures.from_csr(torch.eye(4)).to_dense()
    """,
    "control": """
        import torch

        torch.eye(4).to_sparse_csr()  # outside gat: the warning is there to be caught
    """,
}


@pytest.mark.parametrize("case", WARNING_CASES)
def test_the_csr_beta_warning_is_silenced_where_gat_makes_csr_tensors_and_nowhere_else(case: str) -> None:
    script = textwrap.dedent("""
        import warnings

        import torch  # which installs filters of its own

        before = list(warnings.filters)
        import gat.layers, gat.training

        assert warnings.filters == before, "importing gat changed the global warning filters"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
    """) + textwrap.indent(textwrap.dedent(WARNING_CASES[case]), " " * 4) + textwrap.dedent("""
        assert warnings.filters == before, "gat left a warning filter behind"
        print(sum("Sparse CSR tensor support is in beta" in str(warning.message) for warning in caught))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == (1 if case == "control" else 0)


# PyTorch Geometric -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cora_sized(planetoid_folder) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [N, F_in] dense, edge_index [2, E]): the real Cora when it is there, else random data of its size."""
    if planetoid_folder.real:
        from gat.data import parse_planetoid
        from gat.datasets import file_names

        folder = Path(planetoid_folder.path)
        graph = parse_planetoid({name: (folder / name).read_bytes() for name in file_names("cora")}, "cora")
        return graph.features.to_dense(), graph.edge_index
    n, f_in = 2708, 1433
    x = random_features(n, f_in, seed=10, density=0.013)
    x = x / x.sum(1, keepdim=True).clamp(min=1e-12)
    edges = torch.randint(0, n, (2, 5278), generator=torch.Generator().manual_seed(10))
    edges = torch.cat([edges, edges.flip(0)], dim=1)
    edges = edges[:, edges[0] != edges[1]].unique(dim=1)  # PyG counts a duplicate edge twice; ours drops it
    return x, edges


@pytest.mark.parametrize("is_concat,heads,f_out", [(True, 8, 8), (False, 1, 7), (False, 3, 7)])
def test_matches_pyg_gatconv(cora_sized, is_concat: bool, heads: int, f_out: int) -> None:
    from torch_geometric.nn import GATConv

    x, edge_index = cora_sized
    n, f_in = x.shape
    torch.manual_seed(11)
    conv = GATConv(f_in, f_out, heads=heads, concat=is_concat, negative_slope=0.2, dropout=0.0,
                   add_self_loops=True, bias=True).eval()
    with torch.no_grad():
        conv.att_src.normal_()
        conv.att_dst.normal_()
        conv.bias.normal_()
    layer = GraphAttentionLayer(f_in, heads * f_out if is_concat else f_out, heads, is_concat=is_concat,
                                leaky_relu_negative_slope=0.2, dropout=0.6).eval()
    with torch.no_grad():
        layer.W[0] = conv.lin.weight.view(heads, f_out, f_in).transpose(1, 2)
        layer.a_source[0] = conv.att_src[0]
        layer.a_target[0] = conv.att_dst[0]
        layer.b_source.zero_()
        layer.b_target.zero_()
        # PyG adds one bias after concatenating ([H·F']) or averaging ([F']) the heads; ours adds one per head.
        assert conv.bias.shape == ((heads * f_out,) if is_concat else (f_out,))
        layer.bias[0] = conv.bias.view(heads, f_out) if is_concat else conv.bias.expand(heads, f_out)

        expected = conv(x, edge_index)
        out = layer(SparseFeatures.from_csr(x), Neighbourhoods.from_edge_index(edge_index, n))
    torch.testing.assert_close(out[:, 0], expected, rtol=1e-5, atol=1e-5)


# segment_softmax --------------------------------------------------------------------------------

def _segments(neighbourhoods: Neighbourhoods, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths, rows) of B blocks of neighbourhoods laid out block after block: segment b·N + i is (b, i)."""
    n, e = neighbourhoods.num_nodes, neighbourhoods.num_edges
    lengths = torch.bincount(neighbourhoods.target, minlength=n).repeat(blocks)
    rows = (neighbourhoods.target + n * torch.arange(blocks)[:, None]).reshape(-1)
    assert rows.numel() == blocks * e
    return lengths, rows


def _dense_softmax(neighbourhoods: Neighbourhoods, e: torch.Tensor) -> torch.Tensor:
    """torch.softmax over j of [B, N, N] scores, -inf off the edges, read back at the edges: [B, E]."""
    n = neighbourhoods.num_nodes
    dense = torch.full((e.shape[0], n, n), float("-inf"), dtype=e.dtype)
    dense[:, neighbourhoods.target, neighbourhoods.source] = e
    return torch.softmax(dense, dim=-1)[:, neighbourhoods.target, neighbourhoods.source]


def test_segment_softmax_sums_to_one_per_target_and_equals_dense_softmax() -> None:
    neighbourhoods, blocks = random_graph(20, 60, seed=12), 5
    lengths, rows = _segments(neighbourhoods, blocks)
    e = torch.randn(blocks, neighbourhoods.num_edges, generator=torch.Generator().manual_seed(12)) * 3
    alpha = segment_softmax(e.reshape(-1), lengths, rows)
    assert alpha.shape == (blocks * neighbourhoods.num_edges,) and (alpha > 0).all()
    sums = torch.zeros(blocks * 20).index_add_(0, rows, alpha)
    torch.testing.assert_close(sums, torch.ones(blocks * 20))
    torch.testing.assert_close(alpha.view(blocks, -1), _dense_softmax(neighbourhoods, e))


def test_segment_softmax_does_not_overflow() -> None:
    neighbourhoods, blocks = random_graph(20, 60, seed=13), 3
    lengths, rows = _segments(neighbourhoods, blocks)
    e = 1e4 + torch.randn(blocks, neighbourhoods.num_edges, generator=torch.Generator().manual_seed(13)) * 1e4
    e.requires_grad_()
    alpha = segment_softmax(e.reshape(-1), lengths, rows)
    assert torch.isfinite(alpha).all()
    sums = torch.zeros(blocks * 20).index_add_(0, rows, alpha.detach())
    torch.testing.assert_close(sums, torch.ones(blocks * 20))
    torch.testing.assert_close(alpha.detach().view(blocks, -1), _dense_softmax(neighbourhoods, e.detach()))
    (alpha * torch.randn(alpha.shape, generator=torch.Generator().manual_seed(15))).sum().backward()
    assert torch.isfinite(e.grad).all()


def test_segment_softmax_gradient() -> None:
    neighbourhoods, blocks = random_graph(6, 10, seed=14, isolated=1), 2
    lengths, rows = _segments(neighbourhoods, blocks)
    e = torch.randn(blocks * neighbourhoods.num_edges, dtype=torch.float64, requires_grad=True,
                    generator=torch.Generator().manual_seed(14))
    assert torch.autograd.gradcheck(lambda scores: segment_softmax(scores, lengths, rows), (e,))


# Dropout ----------------------------------------------------------------------------------------

class RecordingDropout(ReplicaDropout):
    """A ReplicaDropout that keeps every mask it hands out."""

    def __init__(self, seeds, p):
        super().__init__(seeds, p)
        self.masks: list[torch.Tensor] = []

    def keep(self, *shape, device="cpu"):
        mask = super().keep(*shape, device=device)
        self.masks.append(mask)
        return mask


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
def test_dropout_changes_the_output_deterministically(sparse: bool) -> None:
    n, f_in, p = 40, 12, 0.6
    neighbourhoods = random_graph(n, 200, seed=14)
    layer = randomise(GraphAttentionLayer(f_in, 8, 2, dropout=p, n_replicas=2, leaky_relu_negative_slope=0.2), seed=14)
    x = random_features(n, f_in, seed=14, density=0.5)
    x = SparseFeatures.from_csr(x) if sparse else x.unsqueeze(1).expand(n, 2, f_in)
    with torch.no_grad():
        evaluation = layer(x, neighbourhoods)
        first = layer(x, neighbourhoods, RecordingDropout([1, 2], p))
        noise = RecordingDropout([1, 2], p)
        second = layer(x, neighbourhoods, noise)
        other = layer(x, neighbourhoods, RecordingDropout([1, 3], p))
    assert not torch.allclose(first, evaluation)
    assert torch.equal(first, second)
    assert torch.equal(first[:, 0], other[:, 0]) and not torch.allclose(first[:, 1], other[:, 1])
    # Input, W·h and attention: three masks, each keeping about 1 - p of its entries.
    assert len(noise.masks) == 3
    for mask in noise.masks:
        assert mask.shape[0] == 2
        kept = (mask != 0).double().mean().item()
        assert abs(kept - (1 - p)) < 0.05, kept
        assert torch.all((mask == 0) | (mask == np.float32(1 / (1 - p))))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
@pytest.mark.parametrize("f_in", [1, 16])
def test_dropout_hits_the_input_the_transformed_features_and_the_attention(f_in: int, sparse: bool) -> None:
    """On nodes without neighbours α_ii = 1, so each dropout leaves its own trace in the output.

    A head's whole output is zero when its attention coefficient is dropped (p), or when every
    input feature is (p^F_in, per head); single output elements are zero where W·h was dropped (p).
    """
    n, heads, f_out, p = 200, 4, 8, 0.6
    neighbourhoods = Neighbourhoods.from_edge_index(torch.empty(2, 0, dtype=torch.long), n)
    layer = randomise(GraphAttentionLayer(f_in, heads * f_out, heads, dropout=p, n_replicas=2,
                                          leaky_relu_negative_slope=0.2), seed=15, biases=False)
    x = torch.rand(n, f_in, generator=torch.Generator().manual_seed(15)) + 0.5
    with torch.no_grad():
        out = layer(as_input(x, sparse) if sparse else x.unsqueeze(1).expand(n, 2, f_in), neighbourhoods,
                    ReplicaDropout([1, 2], p))
    head_zero = (out.view(n, 2, heads, f_out) == 0).all(-1)
    dropped_input = p ** f_in
    expected = 1 - (1 - p) * (1 - dropped_input) * (1 - p ** f_out)
    assert abs(head_zero.double().mean().item() - expected) < 0.04, (head_zero.double().mean(), expected)
    element_zero = (out.view(n, 2, heads, f_out)[~head_zero] == 0).double().mean().item()
    assert abs(element_zero - p) < 0.04, element_zero


# The variants: GATv2 and constant attention ------------------------------------------------------

def _variant(Layer, f_in: int, heads: int, f_out: int, is_concat: bool, replicas: int = 1):
    return Layer(f_in, heads * f_out if is_concat else f_out, heads, is_concat=is_concat, n_replicas=replicas,
                 dropout=0.6, leaky_relu_negative_slope=0.2)


@MODES
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
@pytest.mark.parametrize("is_concat,heads", [(True, 1), (True, 3), (False, 1), (False, 2)])
def test_gatv2_matches_pyg_gatv2conv_forward_and_gradients(is_concat: bool, heads: int, sparse: bool,
                                                           mode: str) -> None:
    n, f_in, f_out, replicas = 19, 9, 4, 2
    neighbourhoods = random_graph(n, 45, seed=21)
    x = random_features(n, f_in, seed=21, density=0.6)
    layer = randomise(_variant(GATv2Layer, f_in, heads, f_out, is_concat, replicas), seed=21).train(mode == "train")
    edge_index = torch.stack([neighbourhoods.source, neighbourhoods.target])
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]  # PyG adds the self-loops itself
    out = layer(SparseFeatures.from_csr(x) if sparse else x.unsqueeze(1).expand(n, replicas, f_in), neighbourhoods)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(21))
    (out * weights).sum().backward()
    for r in range(replicas):
        conv = pyg_gatv2(layer, r, f_in)
        expected = conv(x, edge_index)
        torch.testing.assert_close(out[:, r].detach(), expected.detach(), rtol=1e-5, atol=1e-5)
        (expected * weights[:, r]).sum().backward()
        H, F_out = heads, layer.n_hidden
        torch.testing.assert_close(layer.W.grad[r], conv.lin_l.weight.grad.view(H, F_out, f_in).transpose(1, 2),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.W_target.grad[r],
                                   conv.lin_r.weight.grad.view(H, F_out, f_in).transpose(1, 2), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.a.grad[r], conv.att.grad.view(H, F_out), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.b_source.grad[r], conv.lin_l.bias.grad.view(H, F_out), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.b_target.grad[r], conv.lin_r.bias.grad.view(H, F_out), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("is_concat,heads,f_out", [(True, 8, 8), (False, 1, 7), (False, 3, 7)])
def test_gatv2_matches_pyg_gatv2conv_at_coras_size(cora_sized, is_concat: bool, heads: int, f_out: int) -> None:
    x, edge_index = cora_sized
    n, f_in = x.shape
    layer = _variant(GATv2Layer, f_in, heads, f_out, is_concat).eval()
    with torch.no_grad():
        for parameter in (layer.a, layer.b_source, layer.b_target, layer.bias):
            parameter.normal_(generator=torch.Generator().manual_seed(12))
        expected = pyg_gatv2(layer, 0, f_in)(x, edge_index)
        out = layer(SparseFeatures.from_csr(x), Neighbourhoods.from_edge_index(edge_index, n))
    torch.testing.assert_close(out[:, 0], expected, rtol=1e-5, atol=1e-5)


@MODES
@pytest.mark.parametrize("is_concat,heads", [(True, 3), (False, 2)])
def test_constant_attention_is_the_neighbourhood_mean_of_the_projections(is_concat: bool, heads: int,
                                                                          mode: str) -> None:
    n, f_in, f_out = 17, 6, 4
    neighbourhoods = random_graph(n, 40, seed=22)
    x = random_features(n, f_in, seed=22, density=0.7)
    layer = randomise(_variant(ConstantAttentionLayer, f_in, heads, f_out, is_concat), seed=22).train(mode == "train")
    assert sorted(name for name, _ in layer.named_parameters()) == ["W", "bias"]  # no attention parameters
    with torch.no_grad():
        out = layer(SparseFeatures.from_csr(x), neighbourhoods)
    # By hand: h'_i = (1/|N(i)|) Σ_{j ∈ N(i)} W h_j + c, each neighbourhood with i itself.
    adjacent = torch.zeros(n, n, dtype=torch.float64)
    adjacent[neighbourhoods.target, neighbourhoods.source] = 1.0
    mean = adjacent / adjacent.sum(1, keepdim=True)
    g = torch.einsum("nf,hfo->hno", x.double(), layer.W[0].double())  # [H, N, F']
    expected = torch.einsum("ij,hjo->iho", mean, g) + layer.bias[0].double()  # [N, H, F']
    expected = expected.reshape(n, -1) if is_concat else expected.mean(1)
    torch.testing.assert_close(out[:, 0].double(), expected, rtol=1e-5, atol=1e-6)


@MODES
@pytest.mark.parametrize("Layer", [GATv2Layer, ConstantAttentionLayer], ids=["gatv2", "constant"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-input", "sparse-input"])
@pytest.mark.parametrize("is_concat", [True, False], ids=["concat", "mean"])
def test_a_variants_replica_equals_a_one_replica_layer_with_its_parameters(Layer, is_concat: bool, sparse: bool,
                                                                          mode: str) -> None:
    n, f_in, heads, f_out, replicas, p = 15, 7, 2, 3, 3, 0.6
    neighbourhoods = random_graph(n, 35, seed=5)
    batch = randomise(_variant(Layer, f_in, heads, f_out, is_concat, replicas), seed=5).train(mode == "train")
    if sparse:
        x = SparseFeatures.from_csr(random_features(n, f_in, seed=5))
        inputs = [x] * replicas
    else:
        h = torch.randn(n, replicas, f_in, generator=torch.Generator().manual_seed(5))
        x, inputs = h, [h[:, r:r + 1] for r in range(replicas)]
    seeds = [3, 4, 5]
    noise = ReplicaDropout(seeds, p) if mode == "train" else None
    out = batch(x, neighbourhoods, noise)
    out.sum().backward()
    for r in range(replicas):
        single = _variant(Layer, f_in, heads, f_out, is_concat).train(mode == "train")
        single.load_state_dict({name: q[r:r + 1] for name, q in batch.state_dict().items()})
        alone = single(inputs[r], neighbourhoods, ReplicaDropout([seeds[r]], p) if mode == "train" else None)
        alone.sum().backward()
        assert torch.equal(out[:, r:r + 1], alone), r
        for (name, q), (_, s) in zip(batch.named_parameters(), single.named_parameters()):
            assert torch.equal(q.grad[r:r + 1], s.grad), (r, name)
    assert not torch.allclose(out[:, 0], out[:, 1])


@pytest.mark.parametrize("Layer", [GATv2Layer, ConstantAttentionLayer], ids=["gatv2", "constant"])
def test_a_variant_draws_the_papers_three_dropout_masks(Layer) -> None:
    """Input (shared by GATv2's two projections), W·h and α: the masks of the paper's layer, in its order."""
    n, f_in, p = 30, 8, 0.6
    neighbourhoods = random_graph(n, 90, seed=23)
    x = SparseFeatures.from_csr(random_features(n, f_in, seed=23, density=0.5))
    shapes = []
    for L in (GraphAttentionLayer, Layer):
        noise = RecordingDropout([1, 2], p)
        with torch.no_grad():
            _variant(L, f_in, 2, 4, True, 2).train()(x, neighbourhoods, noise)
        shapes.append([mask.shape for mask in noise.masks])
    assert shapes[0] == shapes[1] and len(shapes[0]) == 3
