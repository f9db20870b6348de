"""The fused kernel's self-check: a build is used only once it computes what the torch path computes.

A compiler can miscompile correct code (GCC 12.2 did, at -O3 with AVX2: the README's "The fused training kernel"), and
optimisation levels, vector widths and CPUs differ between the machine that wrote the kernel and the one that
builds it. So the build (tools.build_fused) runs `disagreement(lib)` on every new build, on the machine that
built it, before the build is kept: small random graphs through both kernels, under dropout and without, compared
on

- the forward pass (logits, loss, accuracy) and the gradients of all twelve parameters in float32, to float32
  rounding, in each code path of the kernel: the paper's layout (8 heads of 8, one output head), another layout
  (5 features, 3 heads averaged over 2 output heads), with and without dropout;
- the same gradients in float64, to 1e-10 relative: the torch path's autograd is the oracle, and float64
  leaves no room for a wrong lane to hide in rounding;
- the validation pass without dropout;
- a few Adam steps with coupled L2, against torch.optim.Adam.

The tests (tests/test_fused.py) use the same graphs and comparisons, so there is one definition of "agrees".
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch import Tensor

from gat import fused
from gat.config import ModelConfig
from gat.data import Graph
from gat.dropout import ReplicaDropout
from gat.graph import SparseFeatures, csr_beta_warning_silenced
from gat.model import GAT
from gat.training import GraphTensors, NodeView, loss_and_accuracy, train_step

PAPER = ModelConfig(hidden_features=8, heads=8, output_heads=1, dropout=0.6, leaky_relu_negative_slope=0.2)

# name: (random_graph's arguments, model, seeds); together they reach every code path of fused.cpp.
CASES: dict[str, tuple[dict[str, int], ModelConfig, list[int]]] = {
    "paper layout, dropout": (dict(num_nodes=90, num_features=40, num_classes=5, edges=300, seed=0), PAPER, [0, 1]),
    "no dropout": (dict(num_nodes=70, num_features=30, num_classes=4, edges=200, seed=1),
                   ModelConfig(8, 8, 1, 0.0, 0.2), [5]),
    "other sizes, heads averaged": (dict(num_nodes=60, num_features=25, num_classes=3, edges=150, seed=2),
                                    ModelConfig(5, 3, 2, 0.5, 0.1), [2, 9, 4]),
}


class Disagreement(AssertionError):
    """A fused result differs from the torch path's by more than rounding allows; the message says which."""


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


def torch_step(model: GAT, view: NodeView, noise: ReplicaDropout | None) -> tuple[Tensor, Tensor, Tensor, list]:
    """The torch path's loss [R], accuracy [R], logits [T, R, C] and gradients, under `noise`'s masks."""
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(view.x, view.blocks, noise)
    loss, accuracy = loss_and_accuracy(logits, view.labels, view.rows)
    loss.sum().backward()
    return loss.detach(), accuracy, logits.detach(), [p.grad for p in model.parameters()]


def assert_close_to_float32_rounding(actual: Tensor, expected: Tensor, name: str) -> None:
    """Sums of hundreds of terms in another order, some nearly cancelling (the bias gradients): the error is
    float32's relative to the terms, so the bound is relative to the tensor's largest value, not to each."""
    _assert_close(actual, expected, name, rtol=1e-4, atol=1e-4 * expected.abs().max().item() + 1e-12)


def _assert_close(actual: Tensor, expected: Tensor, name: str, rtol: float, atol: float) -> None:
    if actual.shape != expected.shape or not torch.isfinite(actual).eq(torch.isfinite(expected)).all():
        raise Disagreement(f"{name}: shape {tuple(actual.shape)} or non-finite values differ from the torch path's")
    excess = (actual - expected).abs() - (atol + rtol * expected.abs())
    if (excess > 0).any():
        worst = (actual - expected).abs().max().item()
        raise Disagreement(f"{name} differs from the torch path's by up to {worst:.3g} "
                           f"({int((excess > 0).sum())} of {expected.numel()} values)")


def check_step(lib: Any, model: GAT, view: NodeView, noise: ReplicaDropout | None, case: str) -> None:
    """The fused forward and backward pass of `view` in float32 against the torch path's, under the same masks:
    logits, loss and gradients to float32 rounding, accuracy exactly, the random streams left in the same state."""
    fused_noise = copy.deepcopy(noise)
    loss, accuracy, logits, grads = torch_step(model, view, noise)
    plan = fused.model_plan(model, view.x, view.blocks, view.labels)
    f_loss, f_accuracy, f_logits, f_grads = fused.forward_backward(model, plan, fused_noise, lib=lib)
    assert_close_to_float32_rounding(f_logits, logits, f"{case}: float32 logits")
    assert_close_to_float32_rounding(f_loss, loss, f"{case}: float32 loss")
    if not torch.equal(f_accuracy, accuracy):
        raise Disagreement(f"{case}: accuracy {f_accuracy.tolist()} against the torch path's {accuracy.tolist()}")
    for (name, _), grad, f_grad in zip(model.named_parameters(), grads, f_grads):
        assert_close_to_float32_rounding(f_grad, grad, f"{case}: float32 ∂L/∂{name}")
    if noise is not None and fused_noise is not None:
        for a, b in zip(noise.generators, fused_noise.generators):
            if a.bit_generator.state != b.bit_generator.state:
                raise Disagreement(f"{case}: the dropout streams end in another state than the torch path's")


def check_validation(lib: Any, model: GAT, view: NodeView, case: str) -> None:
    """The validation pass (no dropout) against the torch path's eval mode."""
    model.eval()
    with torch.no_grad():
        logits = model(view.x, view.blocks)
    loss, accuracy = loss_and_accuracy(logits, view.labels, view.rows)
    f_loss, f_accuracy, f_logits = fused.forward(model, fused.model_plan(model, view.x, view.blocks, view.labels),
                                                 lib=lib)
    assert_close_to_float32_rounding(f_logits, logits, f"{case}: validation logits")
    assert_close_to_float32_rounding(f_loss, loss, f"{case}: validation loss")
    if not torch.equal(f_accuracy, accuracy):
        raise Disagreement(f"{case}: validation accuracy differs from the torch path's")


def check_double_precision(lib: Any) -> GAT:
    """Float64 gradients under dropout against autograd's, to 1e-10 relative; returns the model (for tests that
    go on to finite differences). Biases are moved off their initial zeros, so that every term is exercised."""
    graph = GraphTensors.from_graph(random_graph(num_nodes=50, num_features=20, num_classes=3, edges=120, seed=3))
    view = NodeView.of(graph, graph.train_idx, 2)
    seeds = [4, 8]
    model = GAT(PAPER, graph.x.num_features, graph.num_classes, seeds).double()
    generator = torch.Generator().manual_seed(1)
    for layer in (model.hidden, model.output):
        for bias in (layer.b_target, layer.b_source, layer.bias):
            bias.data.uniform_(-0.5, 0.5, generator=generator)
    noise = ReplicaDropout(seeds, PAPER.dropout)
    view64 = NodeView(SparseFeatures(view.x.crow, view.x.col, view.x.values.double(), view.x.num_features),
                      view.blocks, view.labels, view.rows)
    plan = fused.model_plan(model, view.x, view.blocks, view.labels, torch.float64)
    loss, _, _, grads = torch_step(model, view64, copy.deepcopy(noise))
    f_loss, _, _, f_grads = fused.forward_backward(model, plan, copy.deepcopy(noise), dtype=torch.float64, lib=lib)
    _assert_close(f_loss, loss, "float64 loss", rtol=1e-12, atol=0.0)
    for (name, _), grad, f_grad in zip(model.named_parameters(), grads, f_grads):
        _assert_close(f_grad, grad, f"float64 ∂L/∂{name}", rtol=1e-10, atol=1e-14)
    return model


def check_adam(lib: Any, steps: int = 5) -> None:
    """A few training steps and validation passes of the fused trainer against torch.optim.Adam (coupled L2)."""
    graph = GraphTensors.from_graph(random_graph(**CASES["paper layout, dropout"][0]))
    seeds = [0, 1]
    reference = GAT(PAPER, graph.x.num_features, graph.num_classes, seeds)
    model = copy.deepcopy(reference)
    train_view, val_view = (NodeView.of(graph, nodes, 2) for nodes in (graph.train_idx, graph.val_idx))
    optimiser = torch.optim.Adam(reference.parameters(), lr=0.005, weight_decay=5e-4)
    trainer = fused.FusedTrainer(model, 0.005, 5e-4, train_view, val_view, lib=lib)
    noise, fused_noise = ReplicaDropout(seeds, PAPER.dropout), ReplicaDropout(seeds, PAPER.dropout)
    for step in range(steps):
        loss, _ = train_step(reference, optimiser, train_view, noise)
        f_loss, _ = trainer.step(fused_noise)
        _assert_close(f_loss, loss, f"Adam step {step + 1}: loss", rtol=0.0, atol=1e-5)
        reference.eval()
        with torch.no_grad():
            val_loss, _ = val_view.loss_and_accuracy(reference)
        _assert_close(trainer.validate()[0], val_loss, f"Adam step {step + 1}: validation loss", rtol=0.0, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        _assert_close(q.detach(), p.detach(), f"{name} after {steps} Adam steps", rtol=0.0, atol=1e-5)


def per_seed_loop(lib: Any, graph: GraphTensors, config: ModelConfig, seeds: list[int], max_epochs: int,
                  patience: int) -> tuple[list[Tensor], list[int], list[int]]:
    """gat.training.train's per-seed loop on the fused kernel (FusedTrainer), reduced to what SeedLanes returns:
    each seed's checkpoint, stopping epoch and checkpoint epoch."""
    from gat.training import EarlyStopping

    model = GAT(config, graph.x.num_features, graph.num_classes, seeds)
    noise = ReplicaDropout(seeds, config.dropout) if config.dropout > 0 else None
    trainer = fused.FusedTrainer(model, 0.005, 5e-4, NodeView.of(graph, graph.train_idx, 2),
                                 NodeView.of(graph, graph.val_idx, 2), lib=lib)
    checkpoint = [p.detach().clone() for p in model.parameters()]
    stopping = EarlyStopping(len(seeds), patience)
    epochs = [max_epochs] * len(seeds)
    active = torch.arange(len(seeds))
    for epoch in range(1, max_epochs + 1):
        trainer.step(noise)
        val_loss, val_acc = trainer.validate()
        save, stop = stopping.update(active.numpy(), epoch, val_acc.numpy(), val_loss.numpy())
        for saved in save.nonzero()[0]:
            for kept, parameter in zip(checkpoint, model.parameters()):
                kept[active[saved]] = parameter.detach()[saved]
        for stopped in stop.nonzero()[0]:
            epochs[int(active[stopped])] = epoch
        if stop.all():
            break
        if stop.any():
            keep = torch.from_numpy((~stop).nonzero()[0])
            active = active[keep]
            trainer.keep(keep, noise)
    return checkpoint, epochs, stopping.checkpoint_epoch.tolist()


def lanes_loop(lib: Any, graph: GraphTensors, config: ModelConfig, seeds: list[int], max_epochs: int, patience: int,
               lanes: int, threads: int = 1,
               first_w_by_feature: bool | None = None) -> tuple[list[Tensor], list[int], list[int]]:
    """The same seeds trained by SeedLanes in lanes of `lanes` (with lanes of 1, the first W's layout
    `first_w_by_feature`, None: the kernel's choice for this CPU)."""
    model = GAT(config, graph.x.num_features, graph.num_classes, seeds)
    noise = ReplicaDropout(seeds, config.dropout) if config.dropout > 0 else None
    run = fused.SeedLanes(model, 0.005, 5e-4, max_epochs, patience, NodeView.of(graph, graph.train_idx, 2),
                          NodeView.of(graph, graph.val_idx, 2), noise, lanes, threads=threads, lib=lib,
                          first_w_by_feature=first_w_by_feature)
    while run.tick():
        pass
    run.close()
    return run.checkpoint, run.epochs.tolist(), run.best_epoch.tolist()


# Seeds as lanes: more seeds than lanes (so that seeds take the lanes others left), in each layout.
LANE_CASES: dict[str, tuple[dict[str, int], ModelConfig, list[int]]] = {
    "paper layout, dropout": (CASES["paper layout, dropout"][0], PAPER, list(range(6))),
    "other sizes, heads averaged": (CASES["other sizes, heads averaged"][0], ModelConfig(5, 3, 2, 0.5, 0.1),
                                    [2, 9, 4, 7, 11]),
    "no dropout": (CASES["no dropout"][0], ModelConfig(8, 8, 1, 0.0, 0.2), [5, 6]),
}


def check_lanes(lib: Any, lanes: int, max_epochs: int = 40, patience: int = 5,
                first_w_by_feature: bool | None = None) -> None:
    """SeedLanes against the per-seed loop, to the bit: every seed's checkpoint, stopping epoch and checkpoint epoch,
    at lane width `lanes` (the per-seed kernel is the one checked against the torch path above); with lanes of 1,
    in the first W's layout `first_w_by_feature` (None: the one the kernel chooses on this CPU)."""
    for name, (layout, config, seeds) in LANE_CASES.items():
        graph = GraphTensors.from_graph(random_graph(**layout))
        expected = per_seed_loop(lib, graph, config, seeds, max_epochs, patience)
        actual = lanes_loop(lib, graph, config, seeds, max_epochs, patience, lanes,
                            first_w_by_feature=first_w_by_feature)
        if actual[1:] != expected[1:]:
            raise Disagreement(f"{name}, lanes of {lanes}: stopping and checkpoint epochs {actual[1:]} against the "
                               f"per-seed kernel's {expected[1:]}")
        for (parameter, _), a, b in zip(GAT(config, graph.x.num_features, graph.num_classes, seeds[:1])
                                        .named_parameters(), actual[0], expected[0]):
            if not torch.equal(a, b):
                raise Disagreement(f"{name}, lanes of {lanes}: the checkpoint of {parameter} differs from the "
                                   f"per-seed kernel's by up to {(a - b).abs().max().item():.3g}")


def checks(lib: Any) -> dict[str, Callable[[], Any]]:
    """Every comparison of the self-check, by name, each a call that raises Disagreement."""
    def case_check(name: str) -> Callable[[], None]:
        def run() -> None:
            layout, config, seeds = CASES[name]
            graph = GraphTensors.from_graph(random_graph(**layout))
            model = GAT(config, graph.x.num_features, graph.num_classes, seeds)
            noise = ReplicaDropout(seeds, config.dropout) if config.dropout > 0 else None
            check_step(lib, model, NodeView.of(graph, graph.train_idx, 2), noise, name)
            check_validation(lib, model, NodeView.of(graph, graph.val_idx, 2), name)
        return run

    return {**{name: case_check(name) for name in CASES},
            "float64 gradients": lambda: check_double_precision(lib),
            "Adam steps": lambda: check_adam(lib),
            **{f"seeds in lanes of {lanes}": functools.partial(check_lanes, lib, lanes) for lanes in fused.LANE_WIDTHS},
            # whichever layout of the first W this CPU's L2 cache picks, the other one is checked too
            **{f"the per-seed native loop, the first W {layout}": functools.partial(check_lanes, lib, 1,
                                                                                 first_w_by_feature=by_feature)
               for layout, by_feature in (("by input feature", True), ("transposed in every pass", False))}}


def disagreement(lib: Any) -> str | None:
    """None when the loaded library `lib` agrees with the torch path in every check, else the first difference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for check in checks(lib).values():
            check()
    except Disagreement as error:
        return str(error)
    finally:
        torch.set_num_threads(threads)
    return None


def fingerprint(lib: Any, steps: int = 10) -> str:
    """SHA-256 of the float32 losses and weights after `steps` fused Adam steps and validation passes under dropout
    (3 seeds, a random graph): with no fast-math and no FMA contraction, every correct build gives the same bytes,
    whatever its optimisation level, vector width or CPU."""
    import hashlib

    graph = GraphTensors.from_graph(random_graph(num_nodes=150, num_features=60, num_classes=4, edges=500, seed=4))
    seeds = [0, 1, 2]
    model = GAT(PAPER, graph.x.num_features, graph.num_classes, seeds)
    trainer = fused.FusedTrainer(model, 0.005, 5e-4, NodeView.of(graph, graph.train_idx, 2),
                                 NodeView.of(graph, graph.val_idx, 2), lib=lib)
    noise = ReplicaDropout(seeds, PAPER.dropout)
    digest = hashlib.sha256()
    for _ in range(steps):
        for values in (*trainer.step(noise), *trainer.validate()):
            digest.update(values.numpy().tobytes())
    for parameter in model.parameters():
        digest.update(parameter.detach().numpy().tobytes())
    for lanes in fused.LANE_WIDTHS:  # each width adds its own run, so a width that rounds differently changes it
        checkpoint, epochs, best = lanes_loop(lib, graph, PAPER, [0, 1, 2, 3, 4], 30, 5, lanes)
        digest.update(str((epochs, best)).encode())
        for tensor in checkpoint:
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()
