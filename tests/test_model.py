"""gat.model: shapes, per-seed initialisation, shrinking the batch, saving, and the node classifier."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from gat.config import ModelConfig
from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods, SparseFeatures, receptive_field
from gat.model import GAT, NodeClassifier, model_from_state, model_state
from gat.training import loss_and_accuracy

CONFIG = ModelConfig(hidden_features=4, heads=3, output_heads=2, dropout=0.6, leaky_relu_negative_slope=0.2)
N, F_IN, C = 30, 12, 4


@pytest.fixture(scope="module")
def graph() -> tuple[SparseFeatures, Neighbourhoods]:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(N, F_IN, generator=generator) * (torch.rand(N, F_IN, generator=generator) < 0.3)
    edge_index = torch.randint(0, N, (2, 80), generator=generator)
    return SparseFeatures.from_csr(x), Neighbourhoods.from_edge_index(edge_index, N)


def test_output_shape(graph) -> None:
    x, neighbourhoods = graph
    model = GAT(CONFIG, F_IN, C, seeds=[1, 2, 3])
    assert model.n_replicas == 3
    assert model(x, neighbourhoods).shape == (N, 3, C)
    assert model(x, neighbourhoods, ReplicaDropout([1, 2, 3], 0.6)).shape == (N, 3, C)


def test_the_receptive_field_gives_the_same_logits_as_the_whole_graph(graph) -> None:
    x, neighbourhoods = graph
    model = GAT(CONFIG, F_IN, C, seeds=[1, 2]).eval()
    generator = torch.Generator().manual_seed(8)  # torch's global RNG holds what earlier tests left in it
    with torch.no_grad():
        for p in model.parameters():  # biases too, so every parameter shapes the logits
            p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=generator))
        whole = model(x, neighbourhoods)
        nodes = torch.tensor([17, 3, 25, 3])
        inputs, blocks = receptive_field(neighbourhoods, nodes, model.n_layers)
        assert inputs.numel() < N  # a real cut, or the test proves nothing
        part = model(x.rows(inputs), blocks)
    torch.testing.assert_close(part, whole[nodes.unique()], rtol=1e-5, atol=1e-6)


def test_eval_mode_gives_the_same_logits_with_autograd_on_or_off(graph) -> None:
    """The module's mode picks the layer layout, not torch.no_grad: eval-mode gradients (no dropout) are
    taken through the very pass that `predict` makes."""
    x, neighbourhoods = graph
    model = GAT(CONFIG, F_IN, C, seeds=[1, 2]).eval()
    with torch.no_grad():
        expected = model(x, neighbourhoods)
    logits = model(x, neighbourhoods)
    assert torch.equal(logits.detach(), expected)
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_replica_is_initialised_from_its_seed_alone() -> None:
    batch = GAT(CONFIG, F_IN, C, seeds=[11, 22, 33])
    for r, seed in enumerate([11, 22, 33]):
        single = GAT(CONFIG, F_IN, C, seeds=[seed])
        for (name, p), (_, q) in zip(batch.named_parameters(), single.named_parameters()):
            assert torch.equal(p[r], q[0]), (name, seed)
    assert not torch.equal(batch.hidden.W[0], batch.hidden.W[1])
    # Glorot weights, zero biases.
    assert batch.hidden.W.abs().max() > 0 and torch.all(batch.output.bias == 0)


@pytest.mark.parametrize("attention", ["gat", "gatv2", "constant"])
def test_a_replicas_step_does_not_depend_on_the_batch(graph, attention: str) -> None:
    """Logits, loss and gradients of a replica are bit for bit those of its seed trained alone, in every variant."""
    x, neighbourhoods = graph
    labels, index = torch.arange(N) % C, torch.arange(0, N, 2)
    config = dataclasses.replace(CONFIG, attention=attention)

    def step(seeds: list[int]):
        model = GAT(config, F_IN, C, seeds=seeds).train()
        logits = model(x, neighbourhoods, ReplicaDropout(seeds, CONFIG.dropout))
        loss, _ = loss_and_accuracy(logits, labels, index)
        loss.sum().backward()
        return logits.detach(), loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    single = step([22])
    for seeds in ([11, 22, 33], [22, 44], [5, 6, 7, 22, 8, 9, 10]):
        batch = step(seeds)
        r = seeds.index(22)
        assert torch.equal(batch[0][:, r], single[0][:, 0]) and torch.equal(batch[1][r], single[1][0]), seeds
        for name, gradient in batch[2].items():
            assert torch.equal(gradient[r], single[2][name][0]), (seeds, name)



def test_a_replica_does_not_depend_on_the_batch_at_coras_size() -> None:
    """The same at Cora's size and with the paper's model, where BLAS and MKL pick other code paths than
    on a toy graph: a training step on the training nodes' receptive field, then the validation pass."""
    n, f_in, classes = 2708, 1433, 7
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(n, f_in, generator=generator) * (torch.rand(n, f_in, generator=generator) < 0.013)
    x = SparseFeatures.from_csr(x / x.sum(1, keepdim=True).clamp(min=1e-12))
    edge_index = torch.randint(0, n, (2, 5278), generator=generator)
    neighbourhoods = Neighbourhoods.from_edge_index(torch.cat([edge_index, edge_index.flip(0)], dim=1), n)
    labels = torch.randint(0, classes, (n,), generator=generator)
    paper = ModelConfig(hidden_features=8, heads=8, output_heads=1, dropout=0.6, leaky_relu_negative_slope=0.2)

    def view(nodes: torch.Tensor):
        inputs, blocks = receptive_field(neighbourhoods, nodes, 2)
        return x.rows(inputs), blocks, labels[nodes], torch.arange(nodes.numel())

    train_view, val_view = view(torch.arange(140)), view(torch.arange(200, 700))

    def step_and_evaluate(seeds: list[int]):
        model = GAT(paper, f_in, classes, seeds=seeds).train()
        inputs, blocks, target, rows = train_view
        loss, _ = loss_and_accuracy(model(inputs, blocks, ReplicaDropout(seeds, paper.dropout)), target, rows)
        loss.sum().backward()
        with torch.no_grad():
            inputs, blocks, _, _ = val_view
            validation = model.eval()(inputs, blocks)
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, validation

    single = step_and_evaluate([22])
    for seeds in ([22, 44], [11, 22, 33], [11, 22, 33, 44], [5, 6, 7, 8, 9, 22, 10]):
        loss, gradients, validation = step_and_evaluate(seeds)
        r = seeds.index(22)
        assert torch.equal(loss[r], single[0][0]), seeds
        for name, gradient in gradients.items():
            assert torch.equal(gradient[r], single[1][name][0]), (seeds, name)
        assert torch.equal(validation[:, r], single[2][:, 0]), seeds


def test_keep_replicas(graph) -> None:
    x, neighbourhoods = graph
    model = GAT(CONFIG, F_IN, C, seeds=[11, 22, 33]).eval()
    before = model(x, neighbourhoods)
    old = list(model.parameters())
    model.keep_replicas(torch.tensor([2, 0]))
    assert model.n_replicas == 2
    assert all(new is not previous for new, previous in zip(model.parameters(), old))
    expected = GAT(CONFIG, F_IN, C, seeds=[33, 11])
    for (name, p), (_, q) in zip(model.named_parameters(), expected.named_parameters()):
        assert torch.equal(p, q), name
    after = model(x, neighbourhoods)
    torch.testing.assert_close(after, before[:, [2, 0]], rtol=0, atol=1e-6)
    # A shrunk model still trains: gradients reach the new parameters.
    model.train()
    model(x, neighbourhoods, ReplicaDropout([33, 11], 0.6)).sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_model_state_round_trip(graph) -> None:
    x, neighbourhoods = graph
    model = GAT(CONFIG, F_IN, C, seeds=[5, 6])
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():  # move away from the seeded init, so a rebuilt-from-seeds model would not pass
        for p in model.parameters():
            p.add_(torch.randn(p.shape, dtype=p.dtype, generator=generator) * 0.1)
    state = model_state(model, F_IN, C, [5, 6])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # plain types and tensors only
    restored = model_from_state(loaded)
    assert restored.config == CONFIG and not restored.training
    model.eval()
    assert torch.equal(restored(x, neighbourhoods), model(x, neighbourhoods))


def test_node_classifier_returns_log_probabilities(graph) -> None:
    x, neighbourhoods = graph
    model = GAT(CONFIG, F_IN, C, seeds=[7])
    classifier = NodeClassifier(model, x, neighbourhoods)
    nodes = torch.tensor([3, 0, 29, 3])
    out = classifier(nodes)
    assert out.shape == (4, C) and out.dtype == torch.float32
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(4))
    expected = torch.log_softmax(model.eval()(x, neighbourhoods)[:, 0], dim=-1)[nodes]
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[0], out[3])
    with pytest.raises(ValueError, match="one replica"):
        NodeClassifier(GAT(CONFIG, F_IN, C, seeds=[1, 2]), x, neighbourhoods)


# The attention variants -------------------------------------------------------------------------

def test_a_seeds_weights_are_the_same_in_every_variant() -> None:
    """gatv2 and constant consume the paper's model's draws first: W of both layers is the paper's, and gatv2's a
    is the paper's a_1, so a comparison paired by seed differs in the attention alone."""
    models = {attention: GAT(dataclasses.replace(CONFIG, attention=attention), F_IN, C, seeds=[3, 4])
              for attention in ("gat", "gatv2", "constant")}
    for attention in ("gatv2", "constant"):
        for layer in ("hidden", "output"):
            assert torch.equal(getattr(models[attention], layer).W, getattr(models["gat"], layer).W), attention
    assert torch.equal(models["gatv2"].hidden.a, models["gat"].hidden.a_target)
    assert not torch.equal(models["gatv2"].hidden.W_target, models["gatv2"].hidden.W)
    assert [name for name, _ in models["constant"].named_parameters()] == \
        ["hidden.W", "hidden.bias", "output.W", "output.bias"]


def test_an_unknown_attention_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="^model.attention must be one of gat, gatv2, constant, got 'gatv3'$"):
        GAT(dataclasses.replace(CONFIG, attention="gatv3"), F_IN, C, seeds=[1])  # type: ignore[arg-type]


@pytest.mark.parametrize("attention", ["gatv2", "constant"])
def test_a_variants_state_round_trip(graph, attention: str) -> None:
    x, neighbourhoods = graph
    config = dataclasses.replace(CONFIG, attention=attention)
    model = GAT(config, F_IN, C, seeds=[5, 6]).eval()
    buffer = io.BytesIO()
    torch.save(model_state(model, F_IN, C, [5, 6]), buffer)
    buffer.seek(0)
    restored = model_from_state(torch.load(buffer, weights_only=True))
    assert restored.config == config and type(restored.hidden) is type(model.hidden)
    with torch.no_grad():
        assert torch.equal(restored(x, neighbourhoods), model(x, neighbourhoods))


def test_a_state_saved_before_the_attention_key_loads_as_the_papers_model(graph) -> None:
    x, neighbourhoods = graph
    model = GAT(CONFIG, F_IN, C, seeds=[5]).eval()
    state = model_state(model, F_IN, C, [5])
    del state["config"]["attention"]
    restored = model_from_state(state)
    assert restored.config.attention == "gat"
    assert torch.equal(restored(x, neighbourhoods), model(x, neighbourhoods))
