"""gat.fused: the native training step and validation pass against the torch reference (gat.layers)."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from gat import fused
from gat.config import ModelConfig, OptimConfig
from gat.data import Graph, file_names, parse_planetoid
from gat.dropout import ReplicaDropout
from gat.graph import SparseFeatures, csr_beta_warning_silenced
from gat.model import GAT
from gat.training import GraphTensors, NodeView, loss_and_accuracy, train, train_step
from test_training import assert_same_replica  # one definition of "the same run, bit for bit"

REPO = Path(__file__).resolve().parents[1]
PAPER = ModelConfig(hidden_features=8, heads=8, output_heads=1, dropout=0.6, leaky_relu_negative_slope=0.2)


def random_graph(num_nodes: int, num_features: int, num_classes: int, edges: int, seed: int) -> Graph:
    """Random sparse features (some nodes without any) and random directed edges: nothing to learn, all to check."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_nodes, num_features, generator=generator) * (torch.rand(num_nodes, num_features,
                                                                                generator=generator) < 0.15)
    x[::7] = 0.0  # featureless nodes: empty CSR rows
    edge_index = torch.randint(0, num_nodes, (2, edges), generator=generator)
    labels = torch.randint(0, num_classes, (num_nodes,), generator=generator)
    order = torch.randperm(num_nodes, generator=generator)
    with csr_beta_warning_silenced():
        features = x.to_sparse_csr()
    third = num_nodes // 3
    return Graph(features, edge_index, labels, order[:third].sort().values, order[third:2 * third].sort().values,
                 order[2 * third:].sort().values, num_classes)


@pytest.fixture(scope="module")
def cora_graph(planetoid_folder) -> Graph:
    """Cora from ../shared when present, else the synthetic Cora of conftest."""
    raw = {name: (planetoid_folder.path / name).read_bytes() for name in file_names("cora")}
    return parse_planetoid(raw, "cora")


@pytest.fixture(scope="module")
def cora(cora_graph: Graph) -> GraphTensors:
    return GraphTensors.from_graph(cora_graph)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def torch_step(model: GAT, view: NodeView, noise: ReplicaDropout | None):
    """The reference's loss, accuracy, logits [T, R, C] and gradients, under `noise`'s masks."""
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(view.x, view.blocks, noise)
    loss, accuracy = loss_and_accuracy(logits, view.labels, view.rows)
    loss.sum().backward()
    return loss.detach(), accuracy, logits.detach(), [p.grad for p in model.parameters()]


def assert_close_to_float32_rounding(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    # Sums of hundreds of terms in another order, some nearly cancelling (the bias gradients): the error is
    # float32's relative to the terms, so the bound is relative to the tensor's largest value, not to each.
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale + 1e-12, msg=name)


def test_the_library_builds_here() -> None:
    """Where a compiler exists (these machines, CI) the fused kernel must be available, not silently replaced."""
    reason = fused.unavailable_reason()
    if shutil.which("g++") or shutil.which("c++"):
        assert reason is None, reason
    else:
        assert reason is not None and "compiler" in reason


CASES = {
    # name: (graph, model, seeds)
    "paper layout, dropout": (dict(num_nodes=90, num_features=40, num_classes=5, edges=300, seed=0), PAPER, [0, 1]),
    "no dropout": (dict(num_nodes=70, num_features=30, num_classes=4, edges=200, seed=1),
                   ModelConfig(8, 8, 1, 0.0, 0.2), [5]),
    "other sizes, heads averaged": (dict(num_nodes=60, num_features=25, num_classes=3, edges=150, seed=2),
                                    ModelConfig(5, 3, 2, 0.5, 0.1), [2, 9, 4]),
}


def assert_step_equals_the_torch_path(model: GAT, view: NodeView, noise: ReplicaDropout | None,
                                      fused_noise: ReplicaDropout | None) -> None:
    """The fused forward and backward pass of `view` (drawing from `fused_noise`) against the torch path's (from
    `noise`, a copy of it): logits, loss and gradients to float32 rounding, accuracy exactly."""
    loss, accuracy, logits, grads = torch_step(model, view, noise)
    plan = fused.model_plan(model, view.x, view.blocks, view.labels)
    f_loss, f_accuracy, f_logits, f_grads = fused.forward_backward(model, plan, fused_noise)
    assert_close_to_float32_rounding(f_logits, logits, "logits")
    assert_close_to_float32_rounding(f_loss, loss, "loss")
    assert torch.equal(f_accuracy, accuracy)
    for (parameter, _), grad, f_grad in zip(model.named_parameters(), grads, f_grads):
        assert_close_to_float32_rounding(f_grad, grad, parameter)


@pytest.mark.parametrize("name", CASES)
def test_step_equals_the_torch_path_on_random_graphs(name: str) -> None:
    layout, config, seeds = CASES[name]
    graph = GraphTensors.from_graph(random_graph(**layout))
    view = NodeView.of(graph, graph.train_idx, 2)
    model = GAT(config, graph.x.num_features, graph.num_classes, seeds)
    noise = ReplicaDropout(seeds, config.dropout) if config.dropout > 0 else None
    fused_noise = copy.deepcopy(noise)
    assert_step_equals_the_torch_path(model, view, noise, fused_noise)
    if noise is not None:  # the same masks, drawn from the same streams, which end in the same state
        assert fused_noise is not None
        for a, b in zip(noise.generators, fused_noise.generators):
            assert a.bit_generator.state == b.bit_generator.state


def test_step_and_validation_equal_the_torch_path_on_cora(cora: GraphTensors) -> None:
    seeds = [0, 1]
    model = GAT(PAPER, cora.x.num_features, cora.num_classes, seeds)
    train_view, val_view = (NodeView.of(cora, nodes, 2) for nodes in (cora.train_idx, cora.val_idx))
    noise = ReplicaDropout(seeds, PAPER.dropout)
    assert_step_equals_the_torch_path(model, train_view, noise, copy.deepcopy(noise))

    # The validation pass: the torch path's eval mode (node-major, no dropout) against the fused forward pass.
    model.eval()
    with torch.no_grad():
        val_logits = model(val_view.x, val_view.blocks)
    val_loss, val_accuracy = loss_and_accuracy(val_logits, val_view.labels, val_view.rows)
    v_loss, v_accuracy, v_logits = fused.forward(model, fused.model_plan(model, val_view.x, val_view.blocks,
                                                                         val_view.labels))
    assert_close_to_float32_rounding(v_logits, val_logits, "validation logits")
    assert_close_to_float32_rounding(v_loss, val_loss, "validation loss")
    assert torch.equal(v_accuracy, val_accuracy)


def test_double_precision_gradients() -> None:
    """In float64 the fused backward pass equals autograd's through the torch layers, and finite differences."""
    graph = GraphTensors.from_graph(random_graph(num_nodes=50, num_features=20, num_classes=3, edges=120, seed=3))
    view = NodeView.of(graph, graph.train_idx, 2)
    seeds = [4, 8]
    model = GAT(PAPER, graph.x.num_features, graph.num_classes, seeds).double()
    # Biases away from their initial zeros: a featureless node's scores are then b_1 + b_2 = 0, exactly on
    # LeakyReLU's kink, where a finite difference takes the mean of both slopes and autograd the left one.
    generator = torch.Generator().manual_seed(1)
    for layer in (model.hidden, model.output):
        for bias in (layer.b_target, layer.b_source, layer.bias):
            bias.data.uniform_(-0.5, 0.5, generator=generator)
    noise = ReplicaDropout(seeds, PAPER.dropout)
    view64 = NodeView(SparseFeatures(view.x.crow, view.x.col, view.x.values.double(), view.x.num_features),
                      view.blocks, view.labels, view.rows)
    plan = fused.model_plan(model, view.x, view.blocks, view.labels, torch.float64)

    def fused_loss(noise_copy: ReplicaDropout) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss, _, _, grads = fused.forward_backward(model, plan, noise_copy, dtype=torch.float64)
        return loss, grads

    loss, accuracy, logits, grads = torch_step(model, view64, copy.deepcopy(noise))
    f_loss, f_grads = fused_loss(copy.deepcopy(noise))
    torch.testing.assert_close(f_loss, loss, rtol=1e-12, atol=0)
    for (name, _), grad, f_grad in zip(model.named_parameters(), grads, f_grads):
        torch.testing.assert_close(f_grad, grad, rtol=1e-10, atol=1e-14, msg=name)

    # Central differences of the summed loss, under the same masks, for some entries of every parameter.
    h = 1e-6
    for (name, parameter), f_grad in zip(model.named_parameters(), f_grads):
        flat = parameter.data.view(-1)
        for i in torch.randint(0, flat.numel(), (3,), generator=generator).tolist():
            original = flat[i].item()
            flat[i] = original + h
            up = fused_loss(copy.deepcopy(noise))[0].sum().item()
            flat[i] = original - h
            down = fused_loss(copy.deepcopy(noise))[0].sum().item()
            flat[i] = original
            numeric = (up - down) / (2 * h)
            assert abs(numeric - f_grad.view(-1)[i].item()) <= 1e-6 * max(1.0, abs(numeric)), (name, i)


def test_adam_steps_follow_the_torch_path_on_cora(cora: GraphTensors) -> None:
    """Twenty epochs (step and validation pass): the same trajectory, within what float32 rounding lets Adam drift.

    Adam divides each gradient by its own running magnitude, so where the data gradient nearly cancels
    the L2 term (g ≈ -λθ), a last-bit difference moves a weight by up to ~1e-6 per step; the trajectories
    part slowly from there (tens of epochs), as float32 and float64 runs of the torch path do.
    """
    seeds = [0, 1]
    reference = GAT(PAPER, cora.x.num_features, cora.num_classes, seeds)
    model = copy.deepcopy(reference)
    train_view, val_view = (NodeView.of(cora, nodes, 2) for nodes in (cora.train_idx, cora.val_idx))
    optimiser = torch.optim.Adam(reference.parameters(), lr=0.005, weight_decay=5e-4)
    trainer = fused.FusedTrainer(model, 0.005, 5e-4, train_view, val_view)
    noise, fused_noise = ReplicaDropout(seeds, PAPER.dropout), ReplicaDropout(seeds, PAPER.dropout)
    for _ in range(20):
        loss, _ = train_step(reference, optimiser, train_view, noise)
        f_loss, _ = trainer.step(fused_noise)
        torch.testing.assert_close(f_loss, loss, rtol=0, atol=1e-5)
        reference.eval()
        with torch.no_grad():
            val_loss, val_accuracy = val_view.loss_and_accuracy(reference)
        f_val_loss, f_val_accuracy = trainer.validate()
        torch.testing.assert_close(f_val_loss, val_loss, rtol=0, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p.detach(), rtol=0, atol=1e-5, msg=name)


FAST = OptimConfig(lr=0.2, weight_decay=5e-4, max_epochs=30, patience=5, kernel="fused")  # replicas stop apart
SMALL = ModelConfig(hidden_features=8, heads=8, output_heads=1, dropout=0.6, leaky_relu_negative_slope=0.2)
SEEDS = [3, 7, 11, 5]


@pytest.fixture(scope="module")
def small_graph() -> GraphTensors:
    return GraphTensors.from_graph(random_graph(num_nodes=150, num_features=60, num_classes=4, edges=500, seed=4))


def test_fused_seeds_are_independent_of_their_batch_and_of_threads(small_graph: GraphTensors) -> None:
    batch = train(small_graph, SMALL, FAST, SEEDS)
    assert len(set(batch.epochs.tolist())) > 1, batch.epochs  # the batch shrinks while others train on
    for r, seed in enumerate(SEEDS):
        alone = train(small_graph, SMALL, FAST, [seed])
        assert_same_replica(batch, r, alone, 0)
    again = train(small_graph, SMALL, FAST, SEEDS)
    for r in range(len(SEEDS)):
        assert_same_replica(batch, r, again, r)
    torch.set_num_threads(2)  # replicas on two threads, each replica whole on one
    two_threads = train(small_graph, SMALL, FAST, SEEDS)
    for r in range(len(SEEDS)):
        assert_same_replica(batch, r, two_threads, r)


def test_fallback_to_torch_is_said_once_and_trains_as_torch(small_graph: GraphTensors, monkeypatch) -> None:
    monkeypatch.setenv("GAT_FUSED_DISABLE", "1")
    monkeypatch.setattr(fused, "_LIBRARY", None)
    monkeypatch.setattr(fused, "_UNAVAILABLE", None)
    monkeypatch.setattr(fused, "_FALLBACK_SAID", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fell_back = train(small_graph, SMALL, FAST, SEEDS[:2])
        train(small_graph, SMALL, FAST, SEEDS[:1])
    said = [w for w in caught if issubclass(w.category, fused.FusedFallbackWarning)]
    assert len(said) == 1 and "GAT_FUSED_DISABLE" in str(said[0].message), [str(w.message) for w in caught]
    reference = train(small_graph, SMALL, OptimConfig(FAST.lr, FAST.weight_decay, FAST.max_epochs, FAST.patience,
                                                      "torch"), SEEDS[:2])
    for r in range(2):
        assert_same_replica(fell_back, r, reference, r)


def test_a_failed_build_says_why(tmp_path: Path, monkeypatch) -> None:
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'fatal: no such compiler feature' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv("GAT_FUSED_DIR", str(tmp_path / "built"))
    with pytest.raises(fused.FusedUnavailable, match="exit 3"):
        fused.build()
    assert not list((tmp_path / "built").glob("*.so*"))  # no partial library left behind
    done = subprocess.run([sys.executable, "-m", "gat.fused", "--build"], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "CXX": str(broken), "GAT_FUSED_DIR": str(tmp_path / "built")})
    assert done.returncode == 0 and "not built" in done.stderr and "torch kernel" in done.stderr, done.stderr


def test_the_benchmark_times_the_fused_kernel_and_compares_the_kernels(cora_graph: Graph) -> None:
    from benchmarks import engine as bench

    runner = bench.build_fused(cora_graph, seeds=(0, 1))
    before, _ = runner.eval_pass()
    losses = torch.stack([runner.train_step() for _ in range(2)])
    assert losses.shape == (2, 2) and torch.isfinite(losses).all()
    after, accuracy = runner.eval_pass()
    assert (after != before).all() and ((0 <= accuracy) & (accuracy <= 1)).all()

    throughput = bench.reproduce_throughput(cora_graph, seeds=2, epochs=2, rounds=1)
    rates = throughput["seed_epochs_per_s"]
    assert set(rates) == {"fused", "torch"} and min(rates.values()) > 0
    assert throughput["fused_vs_torch"] == pytest.approx(rates["fused"] / rates["torch"])
    assert throughput["met"] == (throughput["fused_vs_torch"] >= bench.FUSED_SPEEDUP_TARGET)
    checks = bench.check_targets({"train_step_vs_pyg": 0.03, "eval_vs_pyg": 0.2}, bench.FUSED_TARGETS)
    assert checks["train_step_vs_pyg"]["met"] is True and checks["eval_vs_pyg"]["met"] is False
    assert checks["peak_rss_mb"]["met"] is None
