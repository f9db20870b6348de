"""gat.training: the authors' early stopping, determinism, per-seed independence and restoring the checkpoint."""

from __future__ import annotations

import pytest
import torch

from gat.config import ModelConfig, OptimConfig
from gat.data import Graph
from gat.dropout import ReplicaDropout
from gat.graph import csr_beta_warning_silenced
from gat.model import GAT
from gat.training import (EarlyStopping, EpochMetrics, GraphTensors, NodeView, TrainResult, loss_and_accuracy,
                          predict, resolve_device, train, train_step)

CONFIG = ModelConfig(hidden_features=4, heads=2, output_heads=1, dropout=0.6, leaky_relu_negative_slope=0.2)
OPTIM = OptimConfig(lr=0.2, weight_decay=5e-4, max_epochs=30, patience=5)  # a high lr: replicas stop early, apart
SEEDS = [3, 7, 11, 5]


def synthetic_graph(num_nodes: int = 120, num_features: int = 30, num_classes: int = 3, seed: int = 0) -> Graph:
    """A small graph that can be learned: each label marks a block of features, and edges join same-label nodes."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (num_nodes,), generator=generator)
    x = (torch.rand(num_nodes, num_features, generator=generator) < 0.1).float()
    for _ in range(3):
        x[torch.arange(num_nodes), labels * 10 + torch.randint(0, 10, (num_nodes,), generator=generator)] = 1.0
    x = x / x.sum(1, keepdim=True)
    source, target = torch.randint(0, num_nodes, (2, 6 * num_nodes), generator=generator)
    same = labels[source] == labels[target]
    source, target = source[same][:2 * num_nodes], target[same][:2 * num_nodes]
    edge_index = torch.stack([torch.cat([source, target]), torch.cat([target, source])])
    edge_index = edge_index[:, edge_index[0] != edge_index[1]].unique(dim=1)
    order = torch.randperm(num_nodes, generator=generator)
    with csr_beta_warning_silenced():  # CSR features, as gat.data makes them
        features = x.to_sparse_csr()
    return Graph(features, edge_index, labels, order[:30].sort().values, order[30:70].sort().values,
                 order[70:].sort().values, num_classes)


@pytest.fixture(scope="module")
def graph() -> GraphTensors:
    return GraphTensors.from_graph(synthetic_graph())


def assert_same_replica(a: TrainResult, r: int, b: TrainResult, s: int) -> None:
    """Replica r of `a` and replica s of `b` are bit for bit the same run."""
    assert a.seeds[r] == b.seeds[s]
    assert a.epochs[r] == b.epochs[s] and a.best_epoch[r] == b.best_epoch[s]
    assert a.best_val_acc[r] == b.best_val_acc[s] and a.best_val_loss[r] == b.best_val_loss[s]
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p[r], q[s]), (name, (p[r] - q[s]).abs().max().item())


# EarlyStopping ----------------------------------------------------------------------------------

def feed(stopping: EarlyStopping, replicas: list[int], epoch: int, acc: list[float], loss: list[float]):
    save, stop = stopping.update(torch.tensor(replicas), epoch, torch.tensor(acc, dtype=torch.float64),
                                 torch.tensor(loss, dtype=torch.float32))
    return save.tolist(), stop.tolist()


# (val_acc, val_loss) -> (saved?, stopped?) with patience 2; the comments give the rule that applies.
SEQUENCE = [
    ((0.50, 1.00), (True, False)),   # first epoch: both improve on (0, inf)
    ((0.50, 1.00), (True, False)),   # ties count: acc >= best and loss <= best, so it saves again
    ((0.60, 1.20), (False, False)),  # acc better, loss worse: patience resets, no checkpoint
    ((0.55, 0.90), (False, False)),  # loss better, acc worse: resets, no checkpoint (best is now 0.60, 0.90)
    ((0.60, 0.95), (False, False)),  # acc ties the best: resets
    ((0.50, 1.50), (False, False)),  # neither: wait 1
    ((0.60, 0.90), (True, False)),   # both tie the bests (not the last checkpoint's): saves
    ((0.10, 2.00), (False, False)),  # wait 1
    ((0.59, 0.91), (False, True)),   # wait 2 = patience: stop
]


def test_early_stopping_follows_the_authors_rule() -> None:
    stopping = EarlyStopping(1, patience=2)
    for epoch, ((acc, loss), expected) in enumerate(SEQUENCE, start=1):
        save, stop = feed(stopping, [0], epoch, [acc], [loss])
        assert (save[0], stop[0]) == expected, epoch
    assert stopping.checkpoint_epoch.tolist() == [7]
    assert stopping.checkpoint_acc.tolist() == [0.60]
    assert stopping.checkpoint_loss.tolist() == [torch.tensor(0.90, dtype=torch.float32).item()]


def test_early_stopping_patience_counts_epochs_without_a_reset() -> None:
    stopping = EarlyStopping(1, patience=3)
    assert feed(stopping, [0], 1, [0.5], [1.0]) == ([True], [False])
    for epoch in (2, 3):
        assert feed(stopping, [0], epoch, [0.4], [1.1]) == ([False], [False])
    assert feed(stopping, [0], 4, [0.5], [1.2]) == ([False], [False])  # acc tie resets the counter
    for epoch in (5, 6):
        assert feed(stopping, [0], epoch, [0.4], [1.1]) == ([False], [False])
    assert feed(stopping, [0], 7, [0.4], [1.1]) == ([False], [True])


def test_early_stopping_keeps_replicas_apart() -> None:
    stopping = EarlyStopping(2, patience=2)
    # Replica 0 follows SEQUENCE; replica 1 stops at epoch 3 and leaves the batch, as in `train`.
    other = [((0.3, 1.0), (True, False)), ((0.2, 1.1), (False, False)), ((0.2, 1.1), (False, True))]
    active = [0, 1]
    for epoch, ((acc, loss), expected) in enumerate(SEQUENCE, start=1):
        if epoch <= len(other):
            (acc_1, loss_1), expected_1 = other[epoch - 1]
            save, stop = feed(stopping, active, epoch, [acc, acc_1], [loss, loss_1])
            assert (save[1], stop[1]) == expected_1, epoch
        else:
            save, stop = feed(stopping, [0], epoch, [acc], [loss])
        assert (save[0], stop[0]) == expected, epoch
    assert stopping.checkpoint_epoch.tolist() == [7, 1]
    assert stopping.checkpoint_acc.tolist() == [0.60, 0.3]


# train ------------------------------------------------------------------------------------------

def test_train_step_is_an_epoch_of_train(graph) -> None:
    """The benchmark times `train_step` as the step of `train`: one epoch of `train` is one call of it."""
    seeds = [3, 7]
    metrics: list[EpochMetrics] = []
    one_epoch = OptimConfig(OPTIM.lr, OPTIM.weight_decay, max_epochs=1, patience=OPTIM.patience)
    trained = train(graph, CONFIG, one_epoch, seeds, on_epoch=metrics.append)

    model = GAT(CONFIG, graph.x.num_features, graph.num_classes, seeds).eval()
    optimiser = torch.optim.Adam(model.parameters(), lr=OPTIM.lr, weight_decay=OPTIM.weight_decay)
    view = NodeView.of(graph, graph.train_idx, model.n_layers)
    loss, accuracy = train_step(model, optimiser, view, ReplicaDropout(seeds, CONFIG.dropout))
    assert model.training and not loss.requires_grad
    assert torch.equal(loss, metrics[0].train_loss) and torch.equal(accuracy, metrics[0].train_acc)
    # The first epoch always saves its checkpoint: the restored model is the stepped one.
    for (name, p), (_, q) in zip(model.named_parameters(), trained.model.named_parameters()):
        assert torch.equal(p, q), name


def test_training_is_deterministic(graph) -> None:
    first = train(graph, CONFIG, OPTIM, seeds=[3, 7])
    second = train(graph, CONFIG, OPTIM, seeds=[3, 7])
    for r in range(2):
        assert_same_replica(first, r, second, r)
    assert not torch.equal(first.model.hidden.W[0], first.model.hidden.W[1])


@pytest.fixture(scope="module")
def batch_and_singles(graph) -> tuple[TrainResult, dict[int, TrainResult], list[EpochMetrics]]:
    """The seeds trained together in one batch, and each seed trained alone."""
    metrics: list[EpochMetrics] = []
    batch = train(graph, CONFIG, OPTIM, seeds=SEEDS, on_epoch=metrics.append)
    singles = {seed: train(graph, CONFIG, OPTIM, seeds=[seed]) for seed in SEEDS}
    return batch, singles, metrics


def test_replicas_stop_at_different_epochs(batch_and_singles) -> None:
    batch, _, _ = batch_and_singles
    # The premise of the next tests: the batch shrinks while some replicas are still training.
    assert len(set(batch.epochs.tolist())) > 1, batch.epochs
    assert torch.all(batch.best_epoch >= 1) and torch.all(batch.best_epoch <= batch.epochs)


def test_a_seed_trains_bit_for_bit_the_same_alone_or_in_a_batch(batch_and_singles) -> None:
    """Same init, dropout masks, stopping epoch, checkpoint and weights, though the batch shrinks around it.

    This needs every float32 kernel on a replica's path to round its elements independently of the
    batch width R: sums over nodes along contiguous rows (bias gradients, validation loss), and no
    kernel whose vectorised and scalar loops differ (F.elu) on a layout that changes with R.
    """
    batch, singles, _ = batch_and_singles
    for r, seed in enumerate(SEEDS):
        assert_same_replica(batch, r, singles[seed], 0)


def test_on_epoch_reports_every_epoch_of_the_active_seeds(batch_and_singles) -> None:
    batch, _, metrics = batch_and_singles
    assert [m.epoch for m in metrics] == list(range(1, int(batch.epochs.max()) + 1))
    for m in metrics:
        expected = tuple(seed for seed, stopped in zip(batch.seeds, batch.epochs.tolist()) if stopped >= m.epoch)
        assert m.seeds == expected, m.epoch
        for value in (m.train_loss, m.train_acc, m.val_loss, m.val_acc):
            assert value.shape == (len(m.seeds),)
        assert torch.all((m.val_acc >= 0) & (m.val_acc <= 1)) and torch.all(m.train_loss > 0)
    # The best epoch's validation metrics are the ones reported at that epoch.
    for r, seed in enumerate(batch.seeds):
        m = metrics[int(batch.best_epoch[r]) - 1]
        i = m.seeds.index(seed)
        assert m.val_acc[i] == batch.best_val_acc[r] and m.val_loss[i].double() == batch.best_val_loss[r]


def test_restored_model_is_the_best_epochs_checkpoint(graph, batch_and_singles) -> None:
    batch, _, _ = batch_and_singles
    # Its validation metrics are those recorded at the checkpoint, replica by replica...
    loss, accuracy = loss_and_accuracy(predict(batch.model, graph), graph.labels, graph.val_idx)
    assert torch.equal(accuracy, batch.best_val_acc)
    torch.testing.assert_close(loss.double(), batch.best_val_loss, rtol=0, atol=1e-6)
    # ...and training again up to best_epoch alone ends on the same weights. Only a replica that
    # trained past its best epoch tells the checkpoint from the last weights.
    past_best = [r for r in range(len(SEEDS)) if batch.epochs[r] > batch.best_epoch[r]]
    assert past_best, (batch.epochs, batch.best_epoch)
    for r in past_best:
        shorter = OptimConfig(OPTIM.lr, OPTIM.weight_decay, int(batch.best_epoch[r]), OPTIM.patience)
        again = train(graph, CONFIG, shorter, seeds=[SEEDS[r]])
        assert again.best_epoch[0] == batch.best_epoch[r]
        for (name, p), (_, q) in zip(batch.model.named_parameters(), again.model.named_parameters()):
            assert torch.equal(p[r], q[0]), name


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cuda")
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")
