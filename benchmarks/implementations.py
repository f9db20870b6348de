"""The three implementations the benchmark times, built and ready: this engine (torch and fused kernels, and its
attention variants), PyTorch Geometric's GATConv (and GATv2Conv) and the annotated tutorial's dense layer, each in
the paper's Cora setup."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.data import protocol
from gat import dense_reference, fused
from gat.config import Attention, Setup
from gat.data import Graph
from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods
from gat.model import GAT
from gat.training import GraphTensors, NodeView, evaluate, loss_and_accuracy, train_step
from stages.support.params import StageError

# The dense model runs on the whole graph only if its estimated peak stays under this share of the free memory.
DENSE_MEMORY_SHARE = 0.75


@dataclass(frozen=True)
class Runner:
    """One implementation, built and ready: the two calls that are timed.

    train_step() -> training loss [R]; eval_pass() -> (validation loss [R], validation accuracy [R]),
    R = the number of replicas (seeds) trained at once, 1 for the references.

    A native loop runs its validation pass inside the training call (one epoch per call): its eval_pass only
    returns that pass's results, and eval_inside_step() says how many ms of the last train_step() the pass took,
    which the timing moves from the step's time to the eval's.
    """

    train_step: Callable[[], Tensor]
    eval_pass: Callable[[], tuple[Tensor, Tensor]]
    eval_inside_step: Callable[[], float] | None = None


def build_engine(graph: Graph, seeds: Sequence[int] = (0,), per_epoch_validation: bool = False,
                 attention: Attention = "gat") -> Runner:
    """`gat.model.GAT`, one replica per seed: trained by `gat.training.train`'s step, measured by its `evaluate`.

    With `per_epoch_validation`, the eval pass is instead the validation pass that `train` runs after every
    step: eval mode, no autograd, on the validation nodes' receptive field only. `attention` is model.attention.
    """
    paper = protocol()
    tensors = GraphTensors.from_graph(graph)
    config = dataclasses.replace(paper.model, attention=attention)
    model = GAT(config, tensors.x.num_features, tensors.num_classes, seeds)
    noise = ReplicaDropout(seeds, paper.model.dropout)
    optimiser = torch.optim.Adam(model.parameters(), lr=paper.optim.lr, weight_decay=paper.optim.weight_decay)
    train_view = NodeView.of(tensors, tensors.train_idx, model.n_layers)
    val_view = NodeView.of(tensors, tensors.val_idx, model.n_layers)

    def step() -> Tensor:
        loss, _ = train_step(model, optimiser, train_view, noise)
        return loss

    def eval_pass() -> tuple[Tensor, Tensor]:
        if per_epoch_validation:
            model.eval()
            with torch.no_grad():
                return val_view.loss_and_accuracy(model)
        evaluation = evaluate(model, tensors)
        return evaluation.val_loss, evaluation.val_acc

    return Runner(step, eval_pass)


def build_fused(graph: Graph, seeds: Sequence[int] = (0,)) -> Runner:
    """The fused kernel (gat.fused.FusedTrainer), as `gat.training.train` runs it with `kernel: fused`.

    The eval pass is the per-epoch validation pass (validation nodes' receptive field, no dropout):
    the fused kernel does not replace `evaluate`'s whole-graph pass, which runs once per trained model.
    """
    paper = protocol()
    model, train_view, val_view = fused_setup(graph, seeds, paper)
    noise = ReplicaDropout(seeds, paper.model.dropout)
    trainer = fused.FusedTrainer(model, paper.optim.lr, paper.optim.weight_decay, train_view, val_view)
    return Runner(lambda: trainer.step(noise)[0], trainer.validate)


def fused_setup(graph: Graph, seeds: Sequence[int], paper: Setup) -> tuple[GAT, NodeView, NodeView]:
    """`paper`'s model for `seeds` and its two views (training, validation), once the fused kernel is built."""
    reason = fused.unavailable_reason()
    if reason is not None:
        raise StageError(f"the fused kernel is unavailable ({reason}): run `make bench`, which builds it")
    tensors = GraphTensors.from_graph(graph)
    model = GAT(paper.model, tensors.x.num_features, tensors.num_classes, seeds)
    return (model, NodeView.of(tensors, tensors.train_idx, model.n_layers),
            NodeView.of(tensors, tensors.val_idx, model.n_layers))


def build_native_loop(graph: Graph, seeds: Sequence[int]) -> Runner:
    """The fused kernel's native loop (gat.fused.SeedLanes, lanes of 1, one thread), as `reproduce` runs a batch:
    each call is one epoch of every seed, the training step and then the validation pass, timed apart by the
    kernel's own clock (SeedLanes.validation_seconds). Patience and max_epochs are out of reach, so every seed
    trains in every call."""
    paper, endless = protocol(), 2**40
    model, train_view, val_view = fused_setup(graph, seeds, paper)
    run = fused.SeedLanes(model, paper.optim.lr, paper.optim.weight_decay, endless, endless, train_view, val_view,
                          ReplicaDropout(seeds, paper.model.dropout), lanes=1, threads=1)
    validation = [run.validation_seconds]  # the clock's reading after the last call

    def epoch() -> Tensor:
        if run.tick() != len(seeds):
            raise RuntimeError("a seed of the native loop stopped, so a call no longer times every seed")
        return torch.from_numpy(run.train_loss.copy())

    def eval_inside_step() -> float:
        before, validation[0] = validation[0], run.validation_seconds
        return (validation[0] - before) * 1e3

    return Runner(epoch, lambda: (torch.from_numpy(run.val_loss.copy()), torch.from_numpy(run.val_acc.copy())),
                  eval_inside_step)


class PygGAT(nn.Module):
    """PyG's examples/gat.py: dropout, GATConv(F_in, 8, heads=8), ELU, dropout, GATConv(64, C, heads=1).

    `conv` "GATv2Conv" puts PyG's GATv2 layer (its defaults: separate source and target projections) in
    both places, the architecture of this engine's `model.attention: gatv2`.

    Shapes: x: [N, F_in] dense, edge_index: [2, E] without self-loops (GATConv adds them) -> [N, C]
    """

    def __init__(self, in_features: int, num_classes: int, conv: str = "GATConv"):
        super().__init__()
        # Imported here, so that the other implementations' peak-RSS processes do not load PyG.
        import torch_geometric.nn

        Conv = getattr(torch_geometric.nn, conv)
        paper = protocol().model
        self.p = paper.dropout
        self.conv1 = Conv(in_features, paper.hidden_features, heads=paper.heads, dropout=self.p,
                          negative_slope=paper.leaky_relu_negative_slope)
        self.conv2 = Conv(paper.hidden_features * paper.heads, num_classes, heads=paper.output_heads,
                          concat=False, dropout=self.p, negative_slope=paper.leaky_relu_negative_slope)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, p=self.p, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.p, training=self.training)
        return self.conv2(x, edge_index)


def build_pyg(graph: Graph, seed: int = 0, conv: str = "GATConv") -> Runner:
    """PyG's GAT (`conv`: GATConv or GATv2Conv) on the whole graph: the loss on the training nodes, the evaluation
    a whole-graph forward pass."""
    torch.manual_seed(seed)
    x = graph.features.to_dense()  # already row-normalised, as PyG's NormalizeFeatures makes it
    model = PygGAT(graph.num_features, graph.num_classes, conv)
    return whole_graph_runner(model, (x, graph.edge_index), graph.labels, graph.train_idx, graph.val_idx)


def whole_graph_runner(model: nn.Module, inputs: tuple, labels: Tensor, train_idx: Tensor, val_idx: Tensor) -> Runner:
    """A reference model stepped as its own example script would: whole-graph forward, loss on the training nodes."""
    optim = protocol().optim
    optimiser = torch.optim.Adam(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)

    def step() -> Tensor:
        model.train()
        optimiser.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(*inputs)[train_idx], labels[train_idx])
        loss.backward()
        optimiser.step()
        return loss.detach().view(1)

    def eval_pass() -> tuple[Tensor, Tensor]:
        model.eval()
        with torch.no_grad():
            logits = model(*inputs).unsqueeze(1)  # [N, 1, C]: one replica, as loss_and_accuracy takes them
            return loss_and_accuracy(logits, labels, val_idx)

    return Runner(step, eval_pass)


class TutorialGAT(nn.Module):
    """The tutorial's two-layer GAT around its dense layer: dropout, 8 heads concatenated, ELU, dropout, 1 head.

    Shapes: x: [N, F_in] dense, adj_mat: [N, N, 1] -> [N, C]
    """

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        layer = dense_reference.GraphAttentionLayer
        paper = protocol().model
        common = dict(dropout=paper.dropout, leaky_relu_negative_slope=paper.leaky_relu_negative_slope)
        hidden = paper.hidden_features * paper.heads
        self.layer1 = layer(in_features, hidden, paper.heads, is_concat=True, **common)
        self.output = layer(hidden, num_classes, paper.output_heads, is_concat=False, **common)
        self.dropout = nn.Dropout(paper.dropout)

    def forward(self, x: Tensor, adj_mat: Tensor) -> Tensor:
        x = F.elu(self.layer1(self.dropout(x), adj_mat))
        return self.output(self.dropout(x), adj_mat)


def dense_peak_bytes(num_nodes: int, heads: int | None = None, hidden: int | None = None) -> int:
    """An estimate of the dense model's peak memory, read off the tutorial layer's shapes (float32).

    The first layer dominates: `repeat` and `repeat_interleave` make two [N, N, H, F'] copies of g
    and `cat` a third of twice that size, 4·N²·H·F' floats at once; its backward holds the saved
    concatenation and its gradient, as much again. Next to them, the [N, N, H] scores, mask,
    softmax, dropout mask and its output, and their gradients: about 8·N²·H floats.
    """
    model = protocol().model
    heads, hidden = heads or model.heads, hidden or model.hidden_features
    pairs = num_nodes * num_nodes
    return 4 * (4 * pairs * heads * hidden + 8 * pairs * heads)


def dense_node_count(num_nodes: int, available_bytes: int, share: float = DENSE_MEMORY_SHARE) -> int:
    """The whole graph if its estimated peak fits in `share` of the available memory, else the most nodes that do."""
    budget = share * available_bytes
    if dense_peak_bytes(num_nodes) <= budget:
        return num_nodes
    # The estimate grows as N², so the largest fitting size is a square root away.
    return max(1, math.floor(num_nodes * math.sqrt(budget / dense_peak_bytes(num_nodes))))


@dataclass(frozen=True)
class DenseInputs:
    """The induced subgraph of the first `n` nodes (the whole graph when n = N), as the tutorial's model reads it.

    Shapes: x: [n, F_in] dense; adj_mat: [n, n, 1]; labels: [n]; train_idx, val_idx: the split's nodes below n
    """

    x: Tensor
    adj_mat: Tensor
    labels: Tensor
    train_idx: Tensor
    val_idx: Tensor


def dense_inputs(graph: Graph, n: int) -> DenseInputs:
    """The first n nodes hold Planetoid's training and then validation nodes, so a prefix keeps both splits."""
    source, target = graph.edge_index
    inside = (source < n) & (target < n)
    neighbourhoods = Neighbourhoods.from_edge_index(graph.edge_index[:, inside], n)  # adds the self-loops
    adjacency = dense_reference.adjacency(neighbourhoods)
    return DenseInputs(graph.features.to_dense()[:n], adjacency, graph.labels[:n],
                       graph.train_idx[graph.train_idx < n], graph.val_idx[graph.val_idx < n])


def describe_dense_graph(graph: Graph, n: int) -> str:
    if n == graph.num_nodes:
        return "full Cora"
    return (f"subgraph of {n} nodes (the first {n} of {graph.num_nodes}: "
            f"{int((graph.train_idx < n).sum())} training, {int((graph.val_idx < n).sum())} validation)")


def build_dense(graph: Graph, n: int | None = None, seed: int = 0) -> Runner:
    """The tutorial's dense GAT on the induced subgraph of the first `n` nodes (all of them by default)."""
    torch.manual_seed(seed)
    inputs = dense_inputs(graph, graph.num_nodes if n is None else n)
    model = TutorialGAT(graph.num_features, graph.num_classes)
    return whole_graph_runner(model, (inputs.x, inputs.adj_mat), inputs.labels, inputs.train_idx, inputs.val_idx)
