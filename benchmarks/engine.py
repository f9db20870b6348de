"""Time this engine against PyTorch Geometric's GATConv and the annotated tutorial's dense layer on Cora.

    python -m benchmarks.engine --out reports/benchmark.json      (what `make bench` runs)

Three implementations of the paper's Cora model (8 heads x 8 features concatenated, ELU, one
output head, dropout 0.6, Adam with lr 0.005 and L2 5e-4), each timed for

- a training step: forward, backward and optimiser step, as one epoch of training does it;
- an evaluation pass: a forward pass with dropout off, then the validation loss and accuracy.

The implementations:

- `engine`: `gat.model.GAT`, stepped by `gat.training.train_step`, the step of every epoch of
  `gat.training.train` (the loss on the training nodes' receptive field, `NodeView`), and
  evaluated by `gat.training.evaluate`, the evaluation of every stage (a whole-graph forward
  pass, then the validation and test loss and accuracy). One replica, and, as a second row,
  the cost per seed of a batch of seeds trained in one model (how the reproduce stage runs).
  One intra-op thread, as the pipeline runs it.
- `pyg`: `torch_geometric.nn.GATConv` in the architecture of PyG's `examples/gat.py`, on the
  whole graph with dense row-normalised features; at one and at two intra-op threads. The
  faster of the two is the reference the ratios are taken against.
- `dense`: the tutorial's `GraphAttentionLayer` (gat/dense_reference.py), O(N²·H) memory;
  on the whole graph when its estimated peak fits in the available memory, else on an
  induced subgraph (the output says which).

Timings are wall clock (`time.perf_counter`) per call, after warm-up calls, with the
implementations' repetitions interleaved in one process so that a change in machine load
hits all of them alike; the report gives medians with the 10th and 90th percentiles. Peak
resident set size is per process and only grows, so each implementation's training is run
again in a fresh process of its own (`--peak-of KEY`), and a process that only imports torch
is measured as the baseline.

The raw Cora files come from `--data-dir`; by default from ../shared/datasets/planetoid when
that folder exists, else from data/raw/cora, where `make repro` downloads them. They are checked
against the pinned SHA-256 list (gat/planetoid.sha256) either way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gat import dense_reference, fused
from gat.config import ModelConfig, OptimConfig
from gat.data import Graph, parse_planetoid
from gat.datasets import DATASETS, ChecksumError, verify_raw
from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods
from gat.model import GAT
from gat.training import GraphTensors, NodeView, evaluate, loss_and_accuracy, train, train_step
from stages.support.files import write_json
from stages.support.params import StageError
from stages.support.seed_task import worker_facts

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASET = "cora"
# Where the raw files are looked for without --data-dir, in this order: the machines' shared copy,
# then the download stage's output (`make repro`).
SHARED_DATA_DIR = REPO_ROOT.parent / "shared" / "datasets" / "planetoid"
DOWNLOADED_DATA_DIR = REPO_ROOT / "data" / "raw" / DATASET

# The paper's Cora model and optimiser (params.yaml's `model` and `train` sections hold the same values).
MODEL = ModelConfig(hidden_features=8, heads=8, output_heads=1, dropout=0.6, leaky_relu_negative_slope=0.2)
LR = 0.005
WEIGHT_DECAY = 5e-4

# What the engine is meant to achieve against the same run's PyG figures; reported, never adjusted.
TARGETS = {"train_step_vs_pyg": 0.10, "eval_vs_pyg": 0.25, "peak_rss_mb": 500.0}
# The fused kernel's (issue 12), on its one-seed row: the training step, and as `eval` the validation pass that
# train runs after every step; its seed-epochs per second in `train` (as a reproduce worker runs it) against
# the torch kernel's, measured in the same run.
FUSED_TARGETS = {"train_step_vs_pyg": 0.04, "eval_vs_pyg": 0.10, "peak_rss_mb": 500.0}
FUSED_SPEEDUP_TARGET = 3.0

# torch's intra-op thread count before this module changes it: one per core unless OMP_NUM_THREADS says otherwise.
DEFAULT_THREADS = torch.get_num_threads()

# The dense model runs on the whole graph only if its estimated peak stays under this share of the free memory.
DENSE_MEMORY_SHARE = 0.75

MIB = 2**20


# Loading Cora ------------------------------------------------------------------------------------

# Consecutive timed calls per turn: a training loop runs step after step with its data in cache.
BURST = 5


def default_data_dir() -> Path:
    """SHARED_DATA_DIR when it exists, else DOWNLOADED_DATA_DIR; failing both, say how to get the files."""
    for folder in (SHARED_DATA_DIR, DOWNLOADED_DATA_DIR):
        if folder.is_dir():
            return folder
    raise StageError(f"no Cora files: neither {SHARED_DATA_DIR} nor {DOWNLOADED_DATA_DIR} exists; run `make repro` "
                     "first (it downloads them there) or pass --data-dir FOLDER")


def read_raw(folder: Path, dataset: str = DATASET, verify: bool = True) -> dict[str, bytes]:
    """The eight raw `ind.<dataset>.*` files' bytes, checked against gat/planetoid.sha256 when `verify`."""
    folder = Path(folder)
    names = DATASETS[dataset].file_names
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise StageError(f"{folder} does not hold the Planetoid files {', '.join(missing)}: pass "
                         f"--data-dir FOLDER, a folder with the eight ind.{dataset}.* files")
    raw = {name: (folder / name).read_bytes() for name in names}
    if verify:
        try:
            verify_raw(raw, DATASETS[dataset].checksums(), where=f"{folder}/")
        except ChecksumError as error:
            raise StageError(f"{error} The file was changed or comes from elsewhere: run "
                             f"`dvc repro --force download@{dataset}` to download it again.") from None
    return raw


def load_graph(folder: Path, dataset: str = DATASET, verify: bool = True) -> Graph:
    """Cora (or another Planetoid dataset) with the standard split, parsed by the project's own loader."""
    return parse_planetoid(read_raw(folder, dataset, verify), dataset)


# The implementations -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Runner:
    """One implementation, built and ready: the two calls that are timed.

    train_step() -> training loss [R]; eval_pass() -> (validation loss [R], validation accuracy [R]),
    R = the number of replicas (seeds) trained at once, 1 for the references.
    """

    train_step: Callable[[], Tensor]
    eval_pass: Callable[[], tuple[Tensor, Tensor]]


def build_engine(graph: Graph, seeds: Sequence[int] = (0,), per_epoch_validation: bool = False) -> Runner:
    """`gat.model.GAT`, one replica per seed: trained by `gat.training.train`'s step, measured by its `evaluate`.

    With `per_epoch_validation`, the eval pass is instead the validation pass that `train` runs after every
    step: eval mode, no autograd, on the validation nodes' receptive field only.
    """
    tensors = GraphTensors.from_graph(graph)
    model = GAT(MODEL, tensors.x.num_features, tensors.num_classes, seeds)
    noise = ReplicaDropout(seeds, MODEL.dropout)
    optimiser = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
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
    reason = fused.unavailable_reason()
    if reason is not None:
        raise StageError(f"the fused kernel is unavailable ({reason}): run `make bench`, which builds it")
    tensors = GraphTensors.from_graph(graph)
    model = GAT(MODEL, tensors.x.num_features, tensors.num_classes, seeds)
    noise = ReplicaDropout(seeds, MODEL.dropout)
    trainer = fused.FusedTrainer(model, LR, WEIGHT_DECAY, NodeView.of(tensors, tensors.train_idx, model.n_layers),
                                 NodeView.of(tensors, tensors.val_idx, model.n_layers))
    return Runner(lambda: trainer.step(noise)[0], trainer.validate)


class PygGAT(nn.Module):
    """PyG's examples/gat.py: dropout, GATConv(F_in, 8, heads=8), ELU, dropout, GATConv(64, C, heads=1).

    Shapes: x: [N, F_in] dense, edge_index: [2, E] without self-loops (GATConv adds them) -> [N, C]
    """

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        # Imported here, so that the other implementations' peak-RSS processes do not load PyG.
        from torch_geometric.nn import GATConv

        self.p = MODEL.dropout
        self.conv1 = GATConv(in_features, MODEL.hidden_features, heads=MODEL.heads, dropout=self.p,
                             negative_slope=MODEL.leaky_relu_negative_slope)
        self.conv2 = GATConv(MODEL.hidden_features * MODEL.heads, num_classes, heads=MODEL.output_heads,
                             concat=False, dropout=self.p, negative_slope=MODEL.leaky_relu_negative_slope)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, p=self.p, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.p, training=self.training)
        return self.conv2(x, edge_index)


def build_pyg(graph: Graph, seed: int = 0) -> Runner:
    """PyG's GAT on the whole graph: the loss on the training nodes, the evaluation a whole-graph forward pass."""
    torch.manual_seed(seed)
    x = graph.features.to_dense()  # already row-normalised, as PyG's NormalizeFeatures makes it
    model = PygGAT(graph.num_features, graph.num_classes)
    return whole_graph_runner(model, (x, graph.edge_index), graph.labels, graph.train_idx, graph.val_idx)


def whole_graph_runner(model: nn.Module, inputs: tuple, labels: Tensor, train_idx: Tensor, val_idx: Tensor) -> Runner:
    """A reference model stepped as its own example script would: whole-graph forward, loss on the training nodes."""
    optimiser = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

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
        common = dict(dropout=MODEL.dropout, leaky_relu_negative_slope=MODEL.leaky_relu_negative_slope)
        hidden = MODEL.hidden_features * MODEL.heads
        self.layer1 = layer(in_features, hidden, MODEL.heads, is_concat=True, **common)
        self.output = layer(hidden, num_classes, MODEL.output_heads, is_concat=False, **common)
        self.dropout = nn.Dropout(MODEL.dropout)

    def forward(self, x: Tensor, adj_mat: Tensor) -> Tensor:
        x = F.elu(self.layer1(self.dropout(x), adj_mat))
        return self.output(self.dropout(x), adj_mat)


def dense_peak_bytes(num_nodes: int, heads: int = MODEL.heads, hidden: int = MODEL.hidden_features) -> int:
    """An estimate of the dense model's peak memory, read off the tutorial layer's shapes (float32).

    The first layer dominates: `repeat` and `repeat_interleave` make two [N, N, H, F'] copies of g
    and `cat` a third of twice that size, 4·N²·H·F' floats at once; its backward holds the saved
    concatenation and its gradient, as much again. Next to them, the [N, N, H] scores, mask,
    softmax, dropout mask and its output, and their gradients: about 8·N²·H floats.
    """
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


# What is measured -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One row of the table: an implementation at a thread count.

    `replicas` seeds train in one model; the row reports the time per seed (per call / replicas).
    """

    key: str
    label: str
    build: Callable[[Graph], Runner]
    threads: int
    graph: str
    eval_scope: str
    warmup: int
    repeats: int
    replicas: int = 1
    burst: int = 1   # timed calls in a row at each turn, as in a training loop, after `rewarm` untimed ones
    rewarm: int = 0  # untimed calls at each turn: the other implementations ran in between and evicted the caches
    reference: bool = False  # a PyG case: the faster one sets the ratios
    full_graph: bool = True  # False: a subgraph, whose times are not comparable with the reference's


def cases(graph: Graph, *, repeats: int, warmup: int, dense_repeats: int, dense_warmup: int,
          batched_seeds: int, dense_nodes: int) -> list[Case]:
    """Everything timed, in table order."""
    seeds = tuple(range(batched_seeds))
    val = f"validation loss and accuracy on the {graph.val_idx.numel()} validation nodes"
    fast: dict[str, Any] = dict(warmup=warmup, repeats=repeats, burst=BURST, rewarm=1)
    engine_eval = f"gat.training.evaluate: whole-graph forward pass, then {val} (and the test split's)"
    listed = [
        Case("engine", "this engine (1 seed)", build_engine, 1, "full Cora (training nodes' receptive field)",
             engine_eval, **fast),
        Case("engine_batched", f"this engine, per seed of {batched_seeds} batched",
             lambda g: build_engine(g, seeds), 1, "full Cora (training nodes' receptive field)",
             engine_eval, replicas=batched_seeds, **fast),
        Case("engine_epoch_validation", "this engine (1 seed), eval = train's per-epoch validation pass",
             lambda g: build_engine(g, per_epoch_validation=True), 1, "full Cora (training nodes' receptive field)",
             f"gat.training.NodeView: the validation nodes' receptive field only, then {val}", **fast),
        Case("fused", "fused kernel (1 seed), eval = train's per-epoch validation pass", build_fused, 1,
             "full Cora (training nodes' receptive field)",
             f"gat.fused: the validation nodes' receptive field only, then {val}", **fast),
        Case("fused_batched", f"fused kernel, per seed of {batched_seeds} batched, eval = per-epoch validation",
             lambda g: build_fused(g, seeds), 1, "full Cora (training nodes' receptive field)",
             f"gat.fused: the validation nodes' receptive field only, then {val}", replicas=batched_seeds, **fast),
    ]
    for threads in sorted({1, DEFAULT_THREADS}):
        listed.append(Case(f"pyg_{threads}t", f"PyG GATConv ({threads} thread{'s' * (threads > 1)})", build_pyg,
                           threads, "full Cora", f"whole-graph forward pass, then {val}", reference=True, **fast))
    listed.append(Case("dense", "dense tutorial layer", lambda g: build_dense(g, dense_nodes), DEFAULT_THREADS,
                       describe_dense_graph(graph, dense_nodes), f"forward pass on that graph, then the {val} in it",
                       warmup=dense_warmup, repeats=dense_repeats, full_graph=dense_nodes == graph.num_nodes))
    return listed


# Timing ------------------------------------------------------------------------------------------

def interleaved_schedule(repeats: Mapping[str, int]) -> list[str]:
    """The order of the timed calls: each key's repetitions spread evenly over the rounds of the most-repeated.

    A key with n of R rounds runs in the rounds where floor(i·n/R) steps up, so it gets exactly n slots.
    """
    rounds = max(repeats.values())
    return [key for i in range(rounds) for key, n in repeats.items() if (i + 1) * n // rounds > i * n // rounds]


@dataclass
class Samples:
    """Per-call wall times (ms) of one case, and its last losses (to show that it really trained)."""

    train_ms: list[float] = field(default_factory=list)
    eval_ms: list[float] = field(default_factory=list)
    train_loss: float = float("nan")
    val_loss: float = float("nan")


def run_once(runner: Runner, samples: Samples | None = None) -> None:
    """One training step and one evaluation pass, timed into `samples` when given.

    CPU ops are synchronous, so a call's return is the end of its work.
    """
    start = time.perf_counter()
    train_loss = runner.train_step()
    middle = time.perf_counter()
    val_loss, _ = runner.eval_pass()
    end = time.perf_counter()
    if samples is not None:
        samples.train_ms.append((middle - start) * 1e3)
        samples.eval_ms.append((end - middle) * 1e3)
        samples.train_loss, samples.val_loss = float(train_loss.mean()), float(val_loss.mean())


def busy_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, including time the hypervisor stole; this process's)."""
    machine_times = psutil.cpu_times()
    busy = sum(getattr(machine_times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return busy, own.user + own.system


def other_cpu_share(before: tuple[float, float], after: tuple[float, float], wall_s: float) -> float:
    """The share of the machine's capacity (cores x wall time) that others used meanwhile: 0 = otherwise idle."""
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / (wall_s * (os.cpu_count() or 1))


def measure(graph: Graph, listed: Sequence[Case],
            log: Callable[[str], None] = print) -> tuple[dict[str, Samples], float]:
    """Build every case, warm each up, then time them interleaved; each call runs at its case's thread count.

    Returns the samples per case and the share of the CPUs other processes used during the timed calls
    (a busy neighbour slows the two-thread cases most: OpenMP waits for its slowest thread).
    """
    runners, samples = {}, {}
    for case in listed:
        torch.set_num_threads(case.threads)
        log(f"building and warming up {case.label} ({case.threads} thread(s), {case.warmup} warm-up calls)")
        runners[case.key] = case.build(graph)
        for _ in range(case.warmup):
            run_once(runners[case.key])
        samples[case.key] = Samples()
    by_key = {case.key: case for case in listed}
    schedule = interleaved_schedule({case.key: -(-case.repeats // case.burst) for case in listed})
    log(f"timing {len(schedule)} interleaved turns of consecutive (training step, evaluation pass) pairs")
    before, start = busy_cpu_seconds(), time.perf_counter()
    for key in schedule:
        case = by_key[key]
        torch.set_num_threads(case.threads)
        for call in range(case.rewarm + case.burst):
            run_once(runners[key], samples[key] if call >= case.rewarm else None)
    share = other_cpu_share(before, busy_cpu_seconds(), time.perf_counter() - start)
    torch.set_num_threads(DEFAULT_THREADS)
    return samples, share


# Peak memory -------------------------------------------------------------------------------------

def own_peak_rss_mb() -> float:
    """This process's peak resident set size so far: VmHWM of /proc/self/status.

    Not ru_maxrss: Linux carries into it the high-water mark of the memory a process had before
    `execve`, and a child starts out with its parent's memory (fork or vfork), so every peak process
    would report at least the (large) benchmark parent's peak. VmHWM belongs to the new image alone.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError("/proc/self/status has no VmHWM line: peak RSS needs Linux")


def peak_of(case: Case, graph: Graph, epochs: int) -> dict:
    """What a `--peak-of` process reports: its peak RSS after building `case` and training it `epochs` epochs."""
    torch.set_num_threads(case.threads)
    runner = case.build(graph)
    for _ in range(epochs):
        run_once(runner)
    return {"peak_rss_mb": own_peak_rss_mb(), "epochs": epochs, "threads": case.threads}


# A fresh interpreter that imports torch and reports its VmHWM (see own_peak_rss_mb) in MB.
BASELINE_SNIPPET = ("import re, torch; from pathlib import Path; "
                    "print(int(re.search(r'VmHWM:\\s+(\\d+)', Path('/proc/self/status').read_text())[1]) / 1024)")


def baseline_rss_mb() -> float:
    """Peak RSS of a fresh Python that imported torch and nothing else."""
    out = subprocess.run([sys.executable, "-c", BASELINE_SNIPPET], check=True, capture_output=True, text=True)
    return float(out.stdout.strip())


def peak_in_subprocess(key: str, args: argparse.Namespace) -> dict:
    """Run `--peak-of key` in a fresh interpreter: a process's peak RSS covers all it did, and never decreases."""
    command = [sys.executable, "-m", "benchmarks.engine", "--peak-of", key, "--data-dir", str(args.data_dir.resolve()),
               "--peak-epochs", str(args.peak_epochs), "--dense-nodes", str(args.dense_nodes),
               "--batched-seeds", str(args.batched_seeds)]
    out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the peak-RSS process for {key} failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# Report ------------------------------------------------------------------------------------------

def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def summarise(case: Case, samples: Samples, peak: dict | None) -> dict:
    """One implementation's entry of the JSON report: per-seed medians, spread, repeats, threads, graph."""
    per_seed = 1.0 / case.replicas
    entry = {
        "label": case.label,
        "train_step_ms": _percentile(samples.train_ms, 50) * per_seed,
        "eval_ms": _percentile(samples.eval_ms, 50) * per_seed,
        "train_step_ms_p10": _percentile(samples.train_ms, 10) * per_seed,
        "train_step_ms_p90": _percentile(samples.train_ms, 90) * per_seed,
        "eval_ms_p10": _percentile(samples.eval_ms, 10) * per_seed,
        "eval_ms_p90": _percentile(samples.eval_ms, 90) * per_seed,
        "train_step_samples_ms": samples.train_ms,
        "eval_samples_ms": samples.eval_ms,
        "peak_rss_mb": None if peak is None else peak["peak_rss_mb"],
        "peak_rss_epochs": None if peak is None else peak["epochs"],
        "threads": case.threads,
        "replicas": case.replicas,
        "per_seed": case.replicas > 1,
        "warmup": case.warmup,
        "repeats": len(samples.train_ms),
        "graph": case.graph,
        "eval_scope": case.eval_scope,
        "last_train_loss": samples.train_loss,
        "last_val_loss": samples.val_loss,
    }
    if case.replicas > 1:
        entry["train_step_ms_whole_batch"] = _percentile(samples.train_ms, 50)
        entry["eval_ms_whole_batch"] = _percentile(samples.eval_ms, 50)
    return entry


def add_ratios(entries: dict[str, dict], listed: Sequence[Case]) -> str:
    """Ratios of every entry to the faster PyG case's medians (in place); returns that case's key.

    "Faster" is judged on the training step; entries on another graph than the reference's get no ratio.
    """
    references = [case for case in listed if case.reference]
    best = min(references, key=lambda case: entries[case.key]["train_step_ms"])
    reference = entries[best.key]
    for case in listed:
        entry = entries[case.key]
        for name in ("train_step", "eval"):
            ratio = _ratio(entry[f"{name}_ms"], reference[f"{name}_ms"])
            entry[f"{name}_vs_pyg"] = ratio if case.full_graph else None
    return best.key


def check_targets(engine: dict, targets: Mapping[str, float] = TARGETS) -> dict:
    """An entry's figures against `targets`: value, target and whether it is met (None when not measured)."""
    checks = {}
    for name, target in targets.items():
        value = engine.get(name)
        checks[name] = {"value": value, "target": target, "met": None if value is None else bool(value <= target)}
    return checks


def reproduce_throughput(graph: Graph, seeds: int, epochs: int, rounds: int) -> dict:
    """Seed-epochs per second of `gat.training.train` with each kernel, as a reproduce worker runs a batch.

    One intra-op thread (stages.reproduce runs one worker per core), `seeds` seeds in one model, `epochs`
    epochs each (patience above max_epochs, so no seed stops early): the training steps, the per-epoch
    validation passes, early-stopping bookkeeping and checkpoints. The kernels take turns, `rounds` times.
    Seconds are this process's CPU time, the wall time of a worker that has its core to itself: on a
    machine whose cores other processes share, wall time would measure their load as much as the kernels
    (it is reported too).
    """
    reason = fused.unavailable_reason()
    if reason is not None:
        raise StageError(f"the fused kernel is unavailable ({reason}): run `make bench`, which builds it")
    tensors = GraphTensors.from_graph(graph)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu: dict[str, list[float]] = {"fused": [], "torch": []}
    wall: dict[str, list[float]] = {"fused": [], "torch": []}
    try:
        for _ in range(rounds):
            for kernel in cpu:
                optim = OptimConfig(LR, WEIGHT_DECAY, max_epochs=epochs, patience=epochs + 1,
                                    kernel=kernel)  # type: ignore[arg-type]
                start, start_cpu = time.perf_counter(), time.process_time()
                train(tensors, MODEL, optim, range(seeds))
                cpu[kernel].append(time.process_time() - start_cpu)
                wall[kernel].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)

    def rates(seconds: dict[str, list[float]]) -> dict[str, list[float]]:
        return {kernel: [seeds * epochs / s for s in samples] for kernel, samples in seconds.items()}

    median = {kernel: _percentile(values, 50) for kernel, values in rates(cpu).items()}
    median_wall = {kernel: _percentile(values, 50) for kernel, values in rates(wall).items()}
    speedup = median["fused"] / median["torch"]
    return {"seeds_per_batch": seeds, "epochs": epochs, "threads": 1, "rounds": rounds, "clock": "process CPU time",
            "seed_epochs_per_s": median, "seed_epochs_per_s_samples": rates(cpu),
            "seed_epochs_per_wall_s": median_wall, "seed_epochs_per_wall_s_samples": rates(wall),
            "fused_vs_torch": speedup, "fused_vs_torch_wall": median_wall["fused"] / median_wall["torch"],
            "target": FUSED_SPEEDUP_TARGET, "met": bool(speedup >= FUSED_SPEEDUP_TARGET)}


def machine() -> dict:
    """Where the numbers come from."""
    import torch_geometric

    return {
        "cpu_model": worker_facts()["cpu_model"],
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gb": psutil.virtual_memory().total / 2**30,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_geometric": torch_geometric.__version__,
        "default_threads": DEFAULT_THREADS,
    }


def build_report(entries: dict[str, dict], reference_key: str, environment: dict, graph: Graph,
                 baseline_mb: float | None, extra: dict | None = None) -> dict:
    """The whole JSON document; `entries` are `summarise` outputs with ratios, keyed by case."""
    engine = entries.get("engine", {})
    return {
        "dataset": {"name": DATASET, "nodes": graph.num_nodes, "features": graph.num_features,
                    "directed_edges_without_self_loops": int(graph.edge_index.shape[1]),
                    "classes": graph.num_classes, "train_nodes": int(graph.train_idx.numel()),
                    "val_nodes": int(graph.val_idx.numel())},
        "model": {"hidden_features": MODEL.hidden_features, "heads": MODEL.heads, "output_heads": MODEL.output_heads,
                  "dropout": MODEL.dropout, "leaky_relu_negative_slope": MODEL.leaky_relu_negative_slope,
                  "optimiser": f"Adam(lr={LR}, weight_decay={WEIGHT_DECAY})"},
        "environment": environment,
        "method": {
            "clock": "time.perf_counter, per call, in milliseconds",
            "statistic": "median over the repeats; p10 and p90 alongside",
            "order": (f"warm-up calls per implementation, then the implementations take turns in one process; at each "
                      f"turn the engine and PyG make 1 untimed call (the others evicted their caches) and {BURST} "
                      "timed calls in a row, as a training loop does; the dense model makes 1 timed call"),
            "train_step": "model.train(), zero_grad, forward, loss, backward, optimiser step",
            "eval_pass": "model.eval(), forward without autograd, validation loss and accuracy",
            "per_seed": "rows with replicas > 1 report the time of one call divided by the replicas; "
                        "their peak RSS is the whole batch's process",
            "peak_rss": "VmHWM (peak resident set size) of a separate, fresh process per implementation "
                        "that loads Cora, builds the model and trains it peak_rss_epochs epochs "
                        "(training step + evaluation pass); MB = 2^20 bytes",
            "ratios": f"to the same run's {entries[reference_key]['label']}, the faster PyG case "
                      "on the training step; null where the graph differs",
        },
        "baseline_torch_import_rss_mb": baseline_mb,
        "engine_rss_above_baseline_mb": (None if baseline_mb is None or engine.get("peak_rss_mb") is None
                                         else engine["peak_rss_mb"] - baseline_mb),
        "reference": reference_key,
        "targets": check_targets(engine),
        "implementations": entries,
        **(extra or {}),
    }


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def format_table(report: dict) -> str:
    """The Markdown table and the lines that say where the numbers come from."""
    env = report["environment"]
    lines = [
        f"Device: {env['cpu_model']}, {env['logical_cores']} logical cores; torch {env['torch']}, "
        f"PyG {env['torch_geometric']}; load average {report.get('load_average_before')} before, "
        f"{report.get('load_average_after')} after; other processes used "
        f"{_fmt(report.get('other_processes_cpu_share_during_timing'), '.1%')} of the CPUs during the timed calls",
        "",
        "| implementation | threads | graph | train step ms | eval ms | peak RSS MB "
        "| train step vs PyG | eval vs PyG |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["implementations"].values():
        lines.append(
            f"| {entry['label']} | {entry['threads']} | {entry['graph']} | {_fmt(entry['train_step_ms'], '.2f')} "
            f"| {_fmt(entry['eval_ms'], '.2f')} | {_fmt(entry['peak_rss_mb'], '.0f')} "
            f"| {_fmt(entry['train_step_vs_pyg'], '.3f')} | {_fmt(entry['eval_vs_pyg'], '.3f')} |")
    lines += ["", f"Ratios are to {report['implementations'][report['reference']]['label']} (the faster PyG case). "
              f"Peak RSS: a fresh process per implementation; a process that only imports torch peaks at "
              f"{_fmt(report['baseline_torch_import_rss_mb'], '.0f')} MB."]
    for who, targets in (("engine", report["targets"]), ("fused kernel", report.get("fused_targets", {}))):
        for name, check in targets.items():
            verdict = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
            lines.append(f"Target {who} {name} <= {check['target']}: {_fmt(check['value'], '.3f')} ({verdict})")
    throughput = report.get("reproduce_throughput")
    if throughput:
        rate = throughput["seed_epochs_per_s"]
        lines.append(f"Seed-epochs per CPU second of train ({throughput['seeds_per_batch']} seeds per batch, "
                     f"1 thread): fused {rate['fused']:.0f}, torch {rate['torch']:.0f}: "
                     f"{throughput['fused_vs_torch']:.2f}x "
                     f"({throughput['fused_vs_torch_wall']:.2f}x in wall time); target >= {throughput['target']}x "
                     f"({'met' if throughput['met'] else 'NOT met'})")
    return "\n".join(lines)


# Command line ------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "benchmark.json")
    parser.add_argument("--data-dir", type=Path,
                        help=f"folder with the raw ind.cora.* files (default: {SHARED_DATA_DIR} if it exists, "
                             f"else {DOWNLOADED_DATA_DIR}, from `make repro`)")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls of the engine and PyG cases")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    parser.add_argument("--dense-repeats", type=int, default=3, help="timed calls of the dense model (seconds each)")
    parser.add_argument("--dense-warmup", type=int, default=1)
    parser.add_argument("--batched-seeds", type=int, default=4, help="seeds per model in the batched engine row")
    parser.add_argument("--dense-nodes", type=int, default=0,
                        help="nodes of the dense model's graph; 0: all of Cora if it fits in memory, else fewer")
    parser.add_argument("--peak-epochs", type=int, default=20,
                        help="epochs each peak-RSS process trains (the dense model: 1, each costs seconds)")
    parser.add_argument("--no-peak", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--throughput-epochs", type=int, default=200,
                        help="epochs of each train() run that compares the kernels' seed-epochs/s; 0: skip it")
    parser.add_argument("--throughput-rounds", type=int, default=3)
    parser.add_argument("--no-verify", action="store_true", help="skip the checksum check of the raw files")
    parser.add_argument("--peak-of", help=argparse.SUPPRESS)  # internal: one fresh process per implementation
    return parser.parse_args(argv)


def run_peak_child(args: argparse.Namespace) -> None:
    """`--peak-of KEY`: train one case and print its peak RSS as the last line of JSON."""
    graph = load_graph(args.data_dir, verify=False)  # the parent verified the files
    listed = {case.key: case for case in cases(graph, repeats=1, warmup=0, dense_repeats=1, dense_warmup=0,
                                                batched_seeds=args.batched_seeds, dense_nodes=args.dense_nodes)}
    epochs = 1 if args.peak_of == "dense" else args.peak_epochs
    print(json.dumps(peak_of(listed[args.peak_of], graph, epochs)))


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark: time, measure peaks, write the JSON, print the table."""
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    graph = load_graph(args.data_dir, verify=not args.no_verify)
    if args.dense_nodes <= 0:
        # Decided once, here, and passed on, so the dense model's timings and peak use the same graph.
        args.dense_nodes = dense_node_count(graph.num_nodes, psutil.virtual_memory().available)
    listed = cases(graph, repeats=args.repeats, warmup=args.warmup, dense_repeats=args.dense_repeats,
                   dense_warmup=args.dense_warmup, batched_seeds=args.batched_seeds, dense_nodes=args.dense_nodes)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731 - progress on stderr
    samples, others = measure(graph, listed, log)
    if others > 0.1:
        log(f"warning: other processes used {others:.0%} of the CPUs while the calls were timed")

    peaks, baseline = {}, None
    if not args.no_peak:
        baseline = baseline_rss_mb()
        for case in listed:
            log(f"peak RSS of {case.label} in a fresh process")
            peaks[case.key] = peak_in_subprocess(case.key, args)

    entries = {case.key: summarise(case, samples[case.key], peaks.get(case.key)) for case in listed}
    reference_key = add_ratios(entries, listed)
    throughput = None
    if args.throughput_epochs > 0:
        log(f"seed-epochs per second of train, fused and torch kernels, {args.throughput_rounds} rounds")
        throughput = reproduce_throughput(graph, args.batched_seeds, args.throughput_epochs, args.throughput_rounds)
    extra = {"command": " ".join(["python", "-m", "benchmarks.engine", *args.argv]),
             "fused_targets": check_targets(entries["fused"], FUSED_TARGETS),
             "fused_batched_targets": check_targets(entries["fused_batched"], FUSED_TARGETS),
             "reproduce_throughput": throughput,
             "other_processes_cpu_share_during_timing": others,
             "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
             "dense_estimated_peak_gb": dense_peak_bytes(args.dense_nodes) / 2**30,
             "total_wall_s": time.perf_counter() - started}
    report = build_report(entries, reference_key, machine(), graph, baseline, extra)
    write_json(args.out, report)  # atomically: a crash never leaves half a report
    print(format_table(report))
    print(f"\nwritten: {args.out}")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the report's `command`
    try:
        if args.data_dir is None:
            args.data_dir = default_data_dir()
        run_peak_child(args) if args.peak_of else run(args)
    except StageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
