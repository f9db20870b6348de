"""Training with the authors' early stopping, for one seed or many seeds batched in one model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import ArrayLike
from torch import Tensor

from gat import fused
from gat.config import ModelConfig, OptimConfig
from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods, SparseFeatures, receptive_field
from gat.model import GAT


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when one is present, else CPU (where training is bit-for-bit deterministic)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device `cuda` was asked for, but torch sees no CUDA device; use `auto` or `cpu`")
    return torch.device(name)


@dataclass(frozen=True)
class GraphTensors:
    """What training and evaluation need of a graph, already on the training device.

    Shapes:
        x: [N, F_in] sparse; labels: [N]; train_idx: [N_train]; val_idx: [N_val]; test_idx: [N_test]
    """

    x: SparseFeatures
    neighbourhoods: Neighbourhoods
    labels: Tensor
    train_idx: Tensor
    val_idx: Tensor
    test_idx: Tensor
    num_classes: int

    @classmethod
    def from_graph(cls, graph, device: torch.device | str = "cpu") -> "GraphTensors":
        """From a :class:`gat.data.Graph`; self-loops are added here, once."""
        n = graph.labels.numel()
        return cls(SparseFeatures.from_csr(graph.features).to(device),
                   Neighbourhoods.from_edge_index(graph.edge_index, n).to(device),
                   graph.labels.to(device), graph.train_idx.to(device), graph.val_idx.to(device),
                   graph.test_idx.to(device), graph.num_classes)


@dataclass(frozen=True)
class NodeView:
    """What the model reads to score some nodes: their receptive field (gat.graph.receptive_field).

    The training loss covers 140 of Cora's 2,708 nodes; computing only what it depends on is
    exact and skips most of the work. Dropout masks are drawn for the view's sizes, so a
    run's random stream differs from a whole-graph forward pass, not its distribution.

    Shapes:
        labels: [M] labels of the nodes, in sorted node order; rows: [M] = 0 .. M-1
    """

    x: SparseFeatures
    blocks: tuple[Neighbourhoods, ...]
    labels: Tensor
    rows: Tensor

    @classmethod
    def of(cls, graph: GraphTensors, nodes: Tensor, layers: int) -> "NodeView":
        inputs, blocks = receptive_field(graph.neighbourhoods, nodes, layers)
        labels = graph.labels.index_select(0, torch.unique(nodes))
        return cls(graph.x.rows(inputs), tuple(blocks), labels, torch.arange(labels.numel(), device=labels.device))

    def loss_and_accuracy(self, model: GAT, noise: ReplicaDropout | None = None) -> tuple[Tensor, Tensor]:
        return loss_and_accuracy(model(self.x, self.blocks, noise), self.labels, self.rows)


@dataclass(frozen=True)
class EpochMetrics:
    """One epoch of the replicas still training; train metrics are under dropout, as the authors log them.

    Shapes: every tensor is [A], A = len(seeds), the replicas still active.
    """

    epoch: int
    seeds: tuple[int, ...]
    train_loss: Tensor
    train_acc: Tensor
    val_loss: Tensor
    val_acc: Tensor


@dataclass(frozen=True)
class TrainResult:
    """The model restored to each replica's checkpoint, and when each replica stopped.

    Shapes: every tensor is [R], in the order of `seeds`.
    """

    model: GAT
    seeds: tuple[int, ...]
    epochs: Tensor       # epochs trained before patience ran out (or max_epochs)
    best_epoch: Tensor   # 1-based epoch whose weights were restored
    best_val_acc: Tensor
    best_val_loss: Tensor
    kernel: str          # the kernel that trained it: "fused", "torch", or "torch (fused unavailable: <why>)"


def loss_and_accuracy(logits: Tensor, labels: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-replica mean cross-entropy and accuracy on the nodes in `index`.

    Shapes:
        logits: [N, R, C], labels: [N], index: [M] -> ([R], [R])
    """
    picked = logits.index_select(0, index)
    M, R, C = picked.shape
    target = labels.index_select(0, index)
    loss = F.cross_entropy(picked.reshape(M * R, C), target.repeat_interleave(R), reduction="none").view(M, R)
    accuracy = (picked.argmax(-1) == target.unsqueeze(1)).sum(0).double() / M
    # Mean along a contiguous row per replica: a mean over dim 0 of [M, R] is vectorised by R, so its
    # rounding, and with it early stopping, would depend on how many replicas share the batch.
    return loss.t().contiguous().mean(-1), accuracy


@torch.no_grad()
def predict(model: GAT, graph: GraphTensors) -> Tensor:
    """Logits with dropout off: [N, R, C]."""
    model.eval()
    return model(graph.x, graph.neighbourhoods)


@dataclass(frozen=True)
class Evaluation:
    """A trained model's figures on the validation and test splits, per replica.

    Shapes: val_loss, val_acc, test_loss, test_acc: [R]; predicted: [N, R] class ids of every node
    """

    val_loss: Tensor
    val_acc: Tensor
    test_loss: Tensor
    test_acc: Tensor
    predicted: Tensor


def evaluate(model: GAT, graph: GraphTensors) -> Evaluation:
    """The one evaluation: every stage and the benchmark measure a trained model through it."""
    logits = predict(model, graph)  # [N, R, C]
    val_loss, val_acc = loss_and_accuracy(logits, graph.labels, graph.val_idx)
    test_loss, test_acc = loss_and_accuracy(logits, graph.labels, graph.test_idx)
    return Evaluation(val_loss, val_acc, test_loss, test_acc, logits.argmax(-1))


def train_step(model: GAT, optimiser: torch.optim.Optimizer, view: NodeView,
               noise: ReplicaDropout | None) -> tuple[Tensor, Tensor]:
    """One optimiser step on the loss of `view`'s nodes, in training mode: one epoch's update in :func:`train`.

    Returns each replica's loss and accuracy before the step, under dropout (as the authors log them).

    Shapes: -> loss: [R], accuracy: [R]
    """
    model.train()
    optimiser.zero_grad(set_to_none=True)
    loss, accuracy = view.loss_and_accuracy(model, noise)
    loss.sum().backward()  # replicas are independent: each gets the gradient of its own loss
    optimiser.step()
    return loss.detach(), accuracy


class EarlyStopping:
    """The rule of the authors' `execute_cora.py`, vectorised over replicas.

    After each training step, one validation pass. If val_acc >= best_acc or val_loss <= best_loss,
    the patience counter resets; the checkpoint is saved only when *both* hold; both bests are
    updated. After `patience` epochs in a row without a reset, the replica stops.

    A handful of numbers per epoch: kept in numpy on the CPU, where each operation costs a microsecond
    rather than a torch dispatch (with the fused kernel, torch's bookkeeping was a tenth of an epoch).
    """

    def __init__(self, replicas: int, patience: int):
        self.patience = patience
        self.best_acc = np.zeros(replicas)
        self.best_loss = np.full(replicas, np.inf)
        self.checkpoint_acc = np.zeros(replicas)
        self.checkpoint_loss = np.zeros(replicas)
        self.checkpoint_epoch = np.zeros(replicas, dtype=np.int64)
        self.wait = np.zeros(replicas, dtype=np.int64)

    def update(self, replicas: ArrayLike, epoch: int, val_acc: ArrayLike,
               val_loss: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Record one epoch of `replicas` (indices); return (save, stop) boolean masks over them."""
        replicas = np.asarray(replicas)
        val_acc, val_loss = np.asarray(val_acc, dtype=np.float64), np.asarray(val_loss, dtype=np.float64)
        better_acc = val_acc >= self.best_acc[replicas]
        better_loss = val_loss <= self.best_loss[replicas]
        save = better_acc & better_loss
        saved = replicas[save]
        self.checkpoint_acc[saved] = val_acc[save]
        self.checkpoint_loss[saved] = val_loss[save]
        self.checkpoint_epoch[saved] = epoch
        self.best_acc[replicas] = np.maximum(self.best_acc[replicas], val_acc)
        self.best_loss[replicas] = np.minimum(self.best_loss[replicas], val_loss)
        self.wait[replicas] = np.where(better_acc | better_loss, 0, self.wait[replicas] + 1)
        return save, self.wait[replicas] >= self.patience


class TorchKernel:
    """The reference kernel: gat.layers' autograd graph and torch.optim.Adam, one epoch's step and validation.

    gat.fused.FusedTrainer has the same three methods and computes the same, natively.
    """

    def __init__(self, model: GAT, optim: OptimConfig, train_view: NodeView, val_view: NodeView):
        self.model, self.train_view, self.val_view = model, train_view, val_view
        # L2 as the authors add it, λ·Σ½‖v‖² over all variables: Adam's coupled weight_decay, not AdamW.
        self.optimiser = torch.optim.Adam(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)

    def step(self, noise: ReplicaDropout | None) -> tuple[Tensor, Tensor]:
        return train_step(self.model, self.optimiser, self.train_view, noise)

    @torch.no_grad()
    def validate(self) -> tuple[Tensor, Tensor]:
        self.model.eval()
        return self.val_view.loss_and_accuracy(self.model)

    def keep(self, replicas: Tensor, noise: ReplicaDropout | None) -> None:
        self.optimiser = _keep_replicas(self.model, self.optimiser, noise, replicas)


def fused_unavailable(config: ModelConfig, num_classes: int, device: torch.device) -> str | None:
    """Why the fused kernel can't train this model here (None: it can): its attention, device, sizes, or the library."""
    if config.attention != "gat":  # gat/csrc/fused.cpp computes the paper's e_ij alone
        return f"it computes the paper's attention only, and model.attention is {config.attention}"
    if device.type != "cpu":
        return f"it runs on the CPU, and this model is on {device}"
    return fused.unsupported((config.hidden_features, num_classes)) or fused.unavailable_reason()


def kernel_name(optim: OptimConfig, reason: str | None) -> str:
    """How a run names the kernel that trained it: what `optim.kernel` asked for, or the fallback and its reason."""
    return f"torch (fused unavailable: {reason})" if optim.kernel == "fused" and reason else optim.kernel


def planned_kernel(config: ModelConfig, optim: OptimConfig, num_classes: int, device: torch.device) -> str:
    """The kernel_name that :func:`train` will report for this model on this machine, before training."""
    return kernel_name(optim, fused_unavailable(config, num_classes, device) if optim.kernel == "fused" else None)


def select_training_kernel(model: GAT, optim: OptimConfig, train_view: NodeView,
                           val_view: NodeView) -> tuple[TorchKernel | fused.FusedTrainer, str]:
    """The implementation that will train, and its kernel_name (what TrainResult.kernel and the `training_kernel` tag
    record): `optim.kernel`'s, or the torch kernel where the fused one cannot run, said once per process."""
    reason = None
    if optim.kernel == "fused":
        device = next(model.parameters()).device
        reason = fused_unavailable(model.config, model.output.n_hidden, device)
        if reason is None:
            try:
                return fused.FusedTrainer(model, optim.lr, optim.weight_decay, train_view, val_view), "fused"
            except fused.FusedUnavailable as error:
                reason = str(error)
        fused.fallback_warning(reason)
    return TorchKernel(model, optim, train_view, val_view), kernel_name(optim, reason)


def train(graph: GraphTensors, config: ModelConfig, optim: OptimConfig, seeds: Sequence[int],
          on_epoch: Callable[[EpochMetrics], None] | None = None) -> TrainResult:
    """Train one replica per seed with Adam (coupled L2, biases included) and the authors' early stopping.

    Replicas share nothing but the batch: each has its own init, dropout stream, optimiser
    state and stopping epoch. A replica that stops is removed from the batch, so the rest
    run faster; the result of a seed is the same alone or among others. `optim.kernel` picks
    the implementation of each epoch's step and validation pass (:func:`select_training_kernel`).
    """
    seeds = tuple(int(s) for s in seeds)
    device = graph.labels.device
    model = GAT(config, graph.x.num_features, graph.num_classes, seeds).to(device)
    noise = ReplicaDropout(seeds, config.dropout) if config.dropout > 0 else None
    train_view, val_view = (NodeView.of(graph, nodes, model.n_layers) for nodes in (graph.train_idx, graph.val_idx))
    lanes = fused.requested_lanes() if optim.kernel == "fused" else None
    if lanes is not None and fused_unavailable(config, graph.num_classes, device) is None:
        return _train_in_lanes(model, optim, seeds, noise, train_view, val_view, lanes, on_epoch)

    kernel, kernel_used = select_training_kernel(model, optim, train_view, val_view)
    checkpoint = {name: p.detach().clone() for name, p in model.named_parameters()}
    stopping = EarlyStopping(len(seeds), optim.patience)
    epochs = torch.full((len(seeds),), optim.max_epochs, dtype=torch.long)
    active = np.arange(len(seeds))  # the replicas still training, by their index in `seeds`
    for epoch in range(1, optim.max_epochs + 1):
        train_loss, train_acc = kernel.step(noise)

        with torch.no_grad():
            val_loss, val_acc = kernel.validate()
            save, stop = stopping.update(active, epoch, val_acc.cpu().numpy(), val_loss.cpu().numpy())
            if save.any():
                rows = torch.from_numpy(np.flatnonzero(save)).to(device)
                into = torch.from_numpy(active[save]).to(device)
                for name, parameter in model.named_parameters():
                    checkpoint[name][into] = parameter[rows]
        if on_epoch is not None:
            on_epoch(EpochMetrics(epoch, tuple(seeds[r] for r in active), train_loss, train_acc,
                                  val_loss, val_acc))
        if stop.any():
            epochs[torch.from_numpy(active[stop])] = epoch
            keep = np.flatnonzero(~stop)
            active = active[keep]
            if active.size == 0:
                break
            kernel.keep(torch.from_numpy(keep).to(device), noise)

    restored = GAT(config, graph.x.num_features, graph.num_classes, seeds).to(device)
    restored.load_state_dict(checkpoint)
    return TrainResult(restored.eval(), seeds, epochs, torch.from_numpy(stopping.checkpoint_epoch),
                       torch.from_numpy(stopping.checkpoint_acc), torch.from_numpy(stopping.checkpoint_loss),
                       kernel_used)


def _train_in_lanes(model: GAT, optim: OptimConfig, seeds: tuple[int, ...], noise: ReplicaDropout | None,
                    train_view: NodeView, val_view: NodeView, lanes: int,
                    on_epoch: Callable[[EpochMetrics], None] | None) -> TrainResult:
    """:func:`train`'s loop in the fused kernel's native one (gat.fused.SeedLanes): seeds as vector lanes, the
    validation pass, early stopping and checkpoints in each native call, Python once per epoch for `on_epoch`.

    Every seed gets the bytes the per-seed loop gives it. A seed that takes a lane another one left starts at its own
    epoch 1, so EpochMetrics.epoch counts the calls: the epoch of every seed that started with the batch.
    """
    run = fused.SeedLanes(model, optim.lr, optim.weight_decay, optim.max_epochs, optim.patience, train_view,
                          val_view, noise, lanes, threads=torch.get_num_threads())
    try:
        calls = 0
        while run.tick():
            calls += 1
            if on_epoch is not None:
                trained = np.flatnonzero(run.epoch_of)
                metrics = (torch.from_numpy(values[trained])
                           for values in (run.train_loss, run.train_acc, run.val_loss, run.val_acc))
                on_epoch(EpochMetrics(calls, tuple(seeds[r] for r in trained), *metrics))
    finally:
        run.close()
    restored = GAT(model.config, model.hidden.in_features, model.output.n_hidden, seeds)
    restored.load_state_dict({name: value for (name, _), value in zip(model.named_parameters(), run.checkpoint)})
    return TrainResult(restored.eval(), seeds, torch.from_numpy(run.epochs), torch.from_numpy(run.best_epoch),
                       torch.from_numpy(run.best_acc), torch.from_numpy(run.best_loss), "fused")


def _keep_replicas(model: GAT, optimiser: torch.optim.Adam, noise: ReplicaDropout | None,
                   keep: Tensor) -> torch.optim.Adam:
    """Shrink the batch to the replicas in `keep`: parameters, Adam moments and dropout streams."""
    old_states = [optimiser.state[p] for p in model.parameters()]
    model.keep_replicas(keep)
    shrunk = torch.optim.Adam(model.parameters(), **optimiser.defaults)
    for parameter, state in zip(model.parameters(), old_states):
        shrunk.state[parameter] = {"step": state["step"], "exp_avg": state["exp_avg"][keep],
                                   "exp_avg_sq": state["exp_avg_sq"][keep]}
    if noise is not None:
        noise.select(keep)
    return shrunk
