"""gat.fused: the native training step and validation pass against the torch reference (gat.layers)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import SYNTHETIC_LAYOUTS, PlanetoidFolder, write_synthetic_planetoid
from test_training import assert_same_replica  # one definition of "the same run, bit for bit"

from gat import fused
from gat.config import ModelConfig, OptimConfig, Setup
from gat.data import Graph, parse_planetoid
from gat.datasets import file_names
from gat.dropout import ReplicaDropout
from gat.fused_check import CASES, check_double_precision, check_step, check_validation, checks, random_graph
from gat.model import GAT
from gat.training import GraphTensors, NodeView, train, train_step
from stages.support.params import StageError
from tools import build_fused

REPO = Path(__file__).resolve().parents[1]


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


def test_the_library_builds_here() -> None:
    """Where a compiler exists (these machines, CI) the fused kernel must be available, not silently replaced."""
    reason = fused.unavailable_reason()
    if shutil.which("g++") or shutil.which("c++"):
        assert reason is None, reason
    else:
        assert reason is not None and "compiler" in reason


@pytest.mark.parametrize("name", CASES)
def test_step_equals_the_torch_path_on_random_graphs(name: str) -> None:
    """The self-check's cases (gat.fused_check): forward, backward and validation pass against the torch path."""
    checks(fused.library())[name]()


def test_step_and_validation_equal_the_torch_path_on_cora(cora: GraphTensors, paper_protocol: Setup) -> None:
    seeds = [0, 1]
    paper = paper_protocol.model
    model = GAT(paper, cora.x.num_features, cora.num_classes, seeds)
    lib = fused.library()
    check_step(lib, model, NodeView.of(cora, cora.train_idx, 2), ReplicaDropout(seeds, paper.dropout), "Cora")
    check_validation(lib, model, NodeView.of(cora, cora.val_idx, 2), "Cora")


def test_double_precision_gradients(paper_protocol: Setup) -> None:
    """In float64 the fused backward pass equals autograd's through the torch layers, and finite differences."""
    model = check_double_precision(fused.library())  # raises Disagreement, naming the parameter
    graph = GraphTensors.from_graph(random_graph(num_nodes=50, num_features=20, num_classes=3, edges=120, seed=3))
    view = NodeView.of(graph, graph.train_idx, 2)
    noise = ReplicaDropout([4, 8], paper_protocol.model.dropout)
    plan = fused.model_plan(model, view.x, view.blocks, view.labels, torch.float64)

    def fused_loss(noise_copy: ReplicaDropout) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss, _, _, grads = fused.forward_backward(model, plan, noise_copy, dtype=torch.float64)
        return loss, grads

    f_grads = fused_loss(copy.deepcopy(noise))[1]
    # Central differences of the summed loss, under the same masks, for some entries of every parameter.
    generator = torch.Generator().manual_seed(2)
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


def test_adam_steps_follow_the_torch_path_on_cora(cora: GraphTensors, paper_protocol: Setup) -> None:
    """Twenty epochs (step and validation pass): the same trajectory, within what float32 rounding lets Adam drift.

    Adam divides each gradient by its own running magnitude, so where the data gradient nearly cancels
    the L2 term (g ≈ -λθ), a last-bit difference moves a weight by up to ~1e-6 per step; the trajectories
    part slowly from there (tens of epochs), as float32 and float64 runs of the torch path do.
    """
    seeds = [0, 1]
    paper, optim = paper_protocol.model, paper_protocol.optim
    reference = GAT(paper, cora.x.num_features, cora.num_classes, seeds)
    model = copy.deepcopy(reference)
    train_view, val_view = (NodeView.of(cora, nodes, 2) for nodes in (cora.train_idx, cora.val_idx))
    optimiser = torch.optim.Adam(reference.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    trainer = fused.FusedTrainer(model, optim.lr, optim.weight_decay, train_view, val_view)
    noise, fused_noise = ReplicaDropout(seeds, paper.dropout), ReplicaDropout(seeds, paper.dropout)
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


def test_pubmed_protocol_eight_output_heads_equal_the_torch_path() -> None:
    """Pubmed's protocol (params.yaml: 8 output heads averaged, lr 0.01, L2 0.001) on a tiny 3-class graph: the fused
    step, validation pass and Adam steps agree with the torch path, so the stage trains Pubmed with the fused kernel."""
    from stages.support.params import load_params

    pubmed = load_params(REPO / "params.yaml").reproduce.protocol["pubmed"]
    model_config, optim = pubmed.model, pubmed.optim
    assert (model_config.output_heads, optim.lr, optim.weight_decay, optim.kernel) == (8, 0.01, 0.001, "fused")
    graph = GraphTensors.from_graph(random_graph(num_nodes=90, num_features=40, num_classes=3, edges=300, seed=5))
    seeds = [0, 1]
    assert fused.unsupported((model_config.hidden_features, graph.num_classes)) is None
    lib = fused.library()
    reference = GAT(model_config, graph.x.num_features, graph.num_classes, seeds)
    train_view, val_view = (NodeView.of(graph, nodes, 2) for nodes in (graph.train_idx, graph.val_idx))
    check_step(lib, reference, train_view, ReplicaDropout(seeds, model_config.dropout), "Pubmed's 8 output heads")
    check_validation(lib, reference, val_view, "Pubmed's 8 output heads")
    model = copy.deepcopy(reference)
    optimiser = torch.optim.Adam(reference.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    trainer = fused.FusedTrainer(model, optim.lr, optim.weight_decay, train_view, val_view)
    noise, fused_noise = ReplicaDropout(seeds, model_config.dropout), ReplicaDropout(seeds, model_config.dropout)
    for _ in range(5):
        loss, _ = train_step(reference, optimiser, train_view, noise)
        torch.testing.assert_close(trainer.step(fused_noise)[0], loss, rtol=0, atol=1e-5)
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
        build_fused.build()
    assert not list((tmp_path / "built").glob("*.so*"))  # no partial library left behind
    done = subprocess.run([sys.executable, "-m", "tools.build_fused"], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "CXX": str(broken), "GAT_FUSED_DIR": str(tmp_path / "built")})
    # A failure make sees (so it leaves no stamp), said in one line: training falls back to the torch kernel.
    assert done.returncode == 1 and "not built" in done.stderr and "torch kernel" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 2 and "Traceback" not in done.stderr  # the command, the reason
    # make's rule runs that command and stamps .venv/.fused only when it succeeds: the next `make` tries again.
    venv = tmp_path / "venv"
    venv.mkdir()
    made = subprocess.run(["make", "--no-print-directory", "-o", f"{venv}/.runtime", f"VENV={venv}",
                           f"BIN={Path(sys.executable).parent}", f"{venv}/.fused"], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "CXX": str(broken), "GAT_FUSED_DIR": str(tmp_path / "built")})
    assert made.returncode == 0 and "not built" in made.stderr, made.stdout + made.stderr
    assert not (venv / ".fused").exists()


def test_the_benchmark_times_the_fused_kernel_and_compares_the_kernels(cora_graph: Graph) -> None:
    from benchmarks import implementations, report as bench_report, throughput

    runner = implementations.build_fused(cora_graph, seeds=(0, 1))
    before, _ = runner.eval_pass()
    losses = torch.stack([runner.train_step() for _ in range(2)])
    assert losses.shape == (2, 2) and torch.isfinite(losses).all()
    after, accuracy = runner.eval_pass()
    assert (after != before).all() and ((0 <= accuracy) & (accuracy <= 1)).all()

    throughput = throughput.reproduce_throughput(cora_graph, seeds=2, epochs=2, rounds=1)
    rates = throughput["seed_epochs_per_s"]
    assert set(rates) == {"fused", "torch"} and min(rates.values()) > 0
    assert throughput["fused_vs_torch"] == pytest.approx(rates["fused"] / rates["torch"])
    assert throughput["met"] == (throughput["fused_vs_torch"] >= bench_report.FUSED_SPEEDUP_TARGET)
    checks = bench_report.check_targets({"train_step_vs_pyg": 0.03, "eval_vs_pyg": 0.2}, bench_report.FUSED_TARGETS)
    assert checks["train_step_vs_pyg"]["met"] is True and checks["eval_vs_pyg"]["met"] is False
    assert checks["peak_rss_mb"]["met"] is None


def test_a_build_that_disagrees_with_the_torch_path_is_never_used(small_graph: GraphTensors, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """A kernel with a wrong backward pass (LeakyReLU's slope halved in the first layer's softmax backward, as a
    miscompilation might make it) compiles, fails its self-check, is recorded as rejected and never loaded: training
    falls back to the torch kernel and says so in one line that names the check."""
    source = fused.SOURCE.read_text()
    wrong = source.replace("slopes = zero + static_cast<T>(p.negative_slope);\n  std::fill(ws.grad_s_source",
                           "slopes = zero + static_cast<T>(p.negative_slope / 2);\n  std::fill(ws.grad_s_source")
    assert wrong != source, "the mutation no longer applies to fused.cpp"
    (tmp_path / "fused.cpp").write_text(wrong)
    monkeypatch.setattr(fused, "SOURCE", tmp_path / "fused.cpp")
    monkeypatch.setenv("GAT_FUSED_DIR", str(tmp_path / "built"))
    monkeypatch.setenv("GAT_FUSED_CXXFLAGS", "-O1")  # the quickest build: the check, not the speed, is tested
    monkeypatch.setattr(fused, "_LIBRARY", None)
    monkeypatch.setattr(fused, "_UNAVAILABLE", None)
    monkeypatch.setattr(fused, "_FALLBACK_SAID", False)
    with pytest.raises(fused.FusedUnavailable, match="failed its self-check against the torch path: .*∂L/∂hidden"):
        build_fused.build()
    assert [p.suffix for p in (tmp_path / "built").iterdir()] == [".rejected"]  # no library, no partial file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fell_back = train(small_graph, SMALL, FAST, SEEDS[:2])
    said = [str(w.message) for w in caught if issubclass(w.category, fused.FusedFallbackWarning)]
    assert len(said) == 1 and "self-check" in said[0] and "\n" not in said[0], said
    reference = train(small_graph, SMALL, OptimConfig(FAST.lr, FAST.weight_decay, FAST.max_epochs, FAST.patience,
                                                      "torch"), SEEDS[:2])
    for r in range(2):
        assert_same_replica(fell_back, r, reference, r)


def test_the_build_key_holds_the_cpu_and_the_flags(monkeypatch) -> None:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    native = fused.library_path(compiler)
    monkeypatch.setattr(fused, "cpu_identity", lambda: "another CPU; flags: sse2")
    assert fused.library_path(compiler) != native
    monkeypatch.undo()
    monkeypatch.setenv("GAT_FUSED_CXXFLAGS", "-O3 -march=x86-64-v2")
    assert fused.library_path(compiler) != native
    assert fused.cxxflags()[:2] == ("-O3", "-march=x86-64-v2") and "-ffp-contract=off" in fused.cxxflags()
    assert "flags:" in fused.cpu_identity()


def _fresh_library(monkeypatch, folder: Path) -> None:
    """This process's library forgotten, the build folder moved to `folder`: the next use loads from there."""
    monkeypatch.setenv("GAT_FUSED_DIR", str(folder))
    monkeypatch.setattr(fused, "_LIBRARY", None)
    monkeypatch.setattr(fused, "_UNAVAILABLE", None)
    monkeypatch.setattr(fused, "_FALLBACK_SAID", False)


@pytest.mark.parametrize("damage", ["truncated", "flipped bytes", "another library"])
def test_a_damaged_library_is_never_loaded(damage: str, small_graph: GraphTensors, tmp_path: Path,
                                           monkeypatch) -> None:
    """The library's bytes are checked against the hash recorded when it was built and checked: a truncated file
    (SIGBUS once loaded), flipped bytes (SIGSEGV) or another library under its name (AttributeError) are refused
    before they are loaded, and training runs on the torch kernel, said in one line."""
    built = fused.built_library()
    copy_of = tmp_path / built.name
    copy_of.write_bytes(built.read_bytes())
    (tmp_path / built.with_suffix(".sha256").name).write_bytes(built.with_suffix(".sha256").read_bytes())
    _fresh_library(monkeypatch, tmp_path)
    assert fused.unavailable_reason() is None  # an intact copy with its hash loads
    _fresh_library(monkeypatch, tmp_path)
    data = bytearray(copy_of.read_bytes())
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "flipped bytes":
        for offset in range(len(data) // 3, len(data) // 3 + 64):
            data[offset] ^= 0xFF
    else:
        data = bytearray((Path(torch.__file__).parent / "lib" / "libc10.so").read_bytes())  # a real shared library
    # A new file under the name, as a damaged download or another build would be: the intact copy is mapped into
    # this process, and overwriting its pages in place would crash the process (SIGBUS) when it unloads them.
    copy_of.unlink()
    copy_of.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(small_graph, SMALL, OptimConfig(0.2, 5e-4, 3, 5, "fused"), SEEDS[:1])
    said = [str(w.message) for w in caught if issubclass(w.category, fused.FusedFallbackWarning)]
    assert len(said) == 1 and "is not the library that was built and checked" in said[0], said
    assert result.kernel.startswith("torch (fused unavailable: ") and str(copy_of) in result.kernel


def test_an_unwritable_build_folder_is_one_line(small_graph: GraphTensors, tmp_path: Path, monkeypatch) -> None:
    """A build folder that can't be created (root ignores file modes, so: a path under a regular file)."""
    (tmp_path / "a-file").write_text("")
    _fresh_library(monkeypatch, tmp_path / "a-file" / "gat-fused")
    with pytest.raises(fused.FusedUnavailable, match="^cannot write the build into .*GAT_FUSED_DIR"):
        build_fused.build()
    reason = fused.unavailable_reason()  # the library only looks: nothing there, and `make` is what builds it
    assert reason is not None and reason.startswith("not built: ") and "`make` builds it" in reason, reason
    done = subprocess.run([sys.executable, "-m", "tools.build_fused"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "GAT_FUSED_DIR": str(tmp_path / "a-file" / "gat-fused")})
    assert done.returncode == 1 and "Traceback" not in done.stderr and "cannot write the build" in done.stderr


# Run in a process of its own: every file gat's own code opens for writing, creates, moves or deletes, as Python's
# audit events see them (open and os.open, os.mkdir, os.rename/replace, os.remove, ...), printed as `wrote: ...`.
# gat's own: the innermost frame outside the standard library is in gat/ (torch makes its cache folders itself).
NEVER_WRITES = """
import os, sys, sysconfig, warnings

WRITES = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.truncate", "os.symlink", "os.link",
          "os.chmod", "os.utime", "shutil.copyfile", "shutil.rmtree"}
STDLIB = sysconfig.get_paths()["stdlib"]
GAT = os.path.join(os.getcwd(), "gat") + os.sep

def written_by_gat():
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith((STDLIB, "<")):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(GAT)

def audit(event, args):
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1], args[2]
        writes = (mode and any(c in mode for c in "wax+")) or (flags & 0o3 or flags & 0o100)
    else:
        writes = event in WRITES
    if writes and written_by_gat():
        print("wrote:", event, args, flush=True)

sys.addaudithook(audit)
from gat import fused
from gat.config import ModelConfig, OptimConfig
from gat.fused_check import random_graph
from gat.training import GraphTensors, train

graph = GraphTensors.from_graph(random_graph(num_nodes=60, num_features=20, num_classes=3, edges=150, seed=0))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", fused.FusedFallbackWarning)
    result = train(graph, ModelConfig(4, 2, 1, 0.5, 0.2), OptimConfig(0.01, 5e-4, 3, 5, "fused"), [0, 1])
print("kernel:", result.kernel)
"""


def test_the_library_never_writes_a_file(tmp_path: Path) -> None:
    """gat.fused finds and loads what `make` built; it never compiles or writes (tools.build_fused does). Where
    there is no build, training asks for the fused kernel, gets the torch one, and TrainResult says which ran."""
    built = fused.built_library()
    with_library, empty = tmp_path / "built", tmp_path / "empty"
    with_library.mkdir()
    empty.mkdir()
    for path in (built, fused.digest_file(built)):
        (with_library / path.name).write_bytes(path.read_bytes())
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(tmp_path)}
    env.pop("GAT_FUSED_DISABLE", None)
    for folder, kernel in ((with_library, "fused"), (empty, "torch (fused unavailable: not built: ")):
        before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())
        done = subprocess.run([sys.executable, "-c", NEVER_WRITES], cwd=REPO, capture_output=True, text=True,
                              env={**env, "GAT_FUSED_DIR": str(folder)}, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "wrote:" not in done.stdout, done.stdout
        assert done.stdout.splitlines()[-1].startswith(f"kernel: {kernel}"), done.stdout
        assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) == before


def test_the_kernel_that_trained_is_named(small_graph: GraphTensors) -> None:
    """train() reports the kernel that ran; planned_kernel() predicts it before training (reproduce's check)."""
    from gat.training import planned_kernel

    device = torch.device("cpu")
    assert train(small_graph, SMALL, FAST, SEEDS[:1]).kernel == "fused"
    wide = ModelConfig(hidden_features=300, heads=1, output_heads=1, dropout=0.6, leaky_relu_negative_slope=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fused.FusedFallbackWarning)
        result = train(small_graph, wide, OptimConfig(0.2, 5e-4, 2, 5, "fused"), SEEDS[:1])
    assert result.kernel == "torch (fused unavailable: the fused kernel takes at most 256 features per head, got 300)"
    assert planned_kernel(wide, OptimConfig(0.2, 5e-4, 2, 5, "fused"), small_graph.num_classes, device) == \
        result.kernel
    assert planned_kernel(SMALL, FAST, small_graph.num_classes, device) == "fused"
    torch_optim = OptimConfig(0.2, 5e-4, 2, 5, "torch")
    assert train(small_graph, SMALL, torch_optim, SEEDS[:1]).kernel == "torch"


@pytest.mark.parametrize("attention", ["gatv2", "constant"])
def test_a_variant_trains_with_torch_and_its_kernel_says_why(small_graph: GraphTensors, attention: str) -> None:
    """gat/csrc/fused.cpp computes the paper's attention only: `kernel: fused` falls back, and the name says why."""
    from gat.training import planned_kernel

    variant = dataclasses.replace(SMALL, attention=attention)
    fused_optim = dataclasses.replace(FAST, kernel="fused", max_epochs=2)
    expected = f"torch (fused unavailable: it computes the paper's attention only, and model.attention is {attention})"
    assert planned_kernel(variant, fused_optim, small_graph.num_classes, torch.device("cpu")) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fused.FusedFallbackWarning)
        assert train(small_graph, variant, fused_optim, SEEDS[:1]).kernel == expected
    torch_optim = dataclasses.replace(fused_optim, kernel="torch")
    assert train(small_graph, variant, torch_optim, SEEDS[:1]).kernel == "torch"


# Seeds as lanes (gat.fused.SeedLanes) ----------------------------------------------------------------------------

@pytest.mark.parametrize("lanes", fused.LANE_WIDTHS)
def test_seeds_in_lanes_are_the_per_seed_kernels_bytes(lanes: int) -> None:
    """Each layout of the self-check, more seeds than lanes: checkpoints and epochs to the bit (gat.fused_check)."""
    from gat.fused_check import check_lanes

    check_lanes(fused.library(), lanes)


@pytest.mark.parametrize("by_feature", [True, False])
def test_both_layouts_of_the_first_w_give_the_per_seed_kernels_bytes(by_feature: bool) -> None:
    """The per-seed native loop with the paper's first W by input feature (Adam row by row inside ∂L/∂W) and
    transposed in every pass, whichever this CPU's L2 cache picks by default: checkpoints and epochs to the bit."""
    from gat.fused_check import check_lanes

    check_lanes(fused.library(), 1, first_w_by_feature=by_feature)


def test_the_first_ws_layout_follows_the_l2_cache() -> None:
    """By input feature with an L2 cache of 1.5 MB or more per core (getconf, as the kernel's sysconf reads it),
    else transposed; only the per-seed kernel takes a layout."""
    import subprocess

    reported = subprocess.run(["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True).stdout.strip()
    l2 = int(reported) if reported.isdigit() else 0
    assert fused.library().gat_first_w_by_feature() == (1 if l2 >= 1536 * 1024 else 0)
    with pytest.raises(ValueError, match="needs lanes of 1"):
        fused.SeedLanes(GAT(SMALL, 4, 3, [0]), 0.005, 5e-4, 10, 5, None, None, None, lanes=4, first_w_by_feature=True)


@pytest.mark.parametrize("lanes", fused.LANE_WIDTHS)
def test_train_in_lanes_gives_every_seed_its_bytes(small_graph: GraphTensors, lanes: int, monkeypatch) -> None:
    """train() with $GAT_FUSED_LANES: the same TrainResult as the per-seed loop, seed by seed, whatever the width,
    however many seeds (6 seeds in lanes of 4: two take lanes others left) and on two threads (two lane groups)."""
    seeds = [*SEEDS, 13, 2]
    monkeypatch.setenv(fused.LANES_VARIABLE, str(fused.PYTHON_LOOP))
    per_seed = train(small_graph, SMALL, FAST, seeds)
    metrics: list = []
    monkeypatch.setenv(fused.LANES_VARIABLE, str(lanes))
    in_lanes = train(small_graph, SMALL, FAST, seeds, on_epoch=metrics.append)
    assert in_lanes.kernel == "fused"
    for r in range(len(seeds)):
        assert_same_replica(per_seed, r, in_lanes, r)
    # Every seed reports each of its epochs once, under dropout and then validated, and its last is its stop.
    reported: dict[int, int] = {}
    for m in metrics:
        for seed in m.seeds:
            reported[seed] = reported.get(seed, 0) + 1
    assert reported == {seed: int(per_seed.epochs[r]) for r, seed in enumerate(seeds)}
    torch.set_num_threads(2)
    two_groups = train(small_graph, SMALL, FAST, seeds)
    for r in range(len(seeds)):
        assert_same_replica(per_seed, r, two_groups, r)


@pytest.mark.parametrize("lanes", [None, "1", "4"])
def test_the_lane_metrics_are_the_per_seed_loops(small_graph: GraphTensors, monkeypatch, lanes: str | None) -> None:
    """What on_epoch gets from the native loop (each seed's losses and accuracies per epoch), by default and in
    lanes, is the Python loop's."""
    def history(lanes: str | None) -> dict[tuple[int, int], tuple[float, ...]]:
        if lanes is None:
            monkeypatch.delenv(fused.LANES_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(fused.LANES_VARIABLE, lanes)
        rows: dict[tuple[int, int], tuple[float, ...]] = {}
        epoch_of: dict[int, int] = {}

        def record(m) -> None:
            for i, seed in enumerate(m.seeds):
                epoch_of[seed] = epoch_of.get(seed, 0) + 1
                rows[(seed, epoch_of[seed])] = (m.train_loss[i].item(), m.train_acc[i].item(), m.val_loss[i].item(),
                                                m.val_acc[i].item())
        train(small_graph, SMALL, FAST, SEEDS, on_epoch=record)
        return rows

    assert history(lanes) == history(str(fused.PYTHON_LOOP))


def test_a_lane_run_keeps_its_dropout_generators_alive(small_graph: GraphTensors) -> None:
    """The kernel draws from the generators' states by address: a run whose caller dropped its ReplicaDropout (as
    benchmarks.kernel_ab's loop over kernels does) still draws each seed's masks, as a run whose caller kept it."""
    import gc

    import numpy as np

    from gat.fused_check import lanes_loop

    def started() -> fused.SeedLanes:
        model = GAT(SMALL, small_graph.x.num_features, small_graph.num_classes, SEEDS)
        return fused.SeedLanes(model, 0.005, 5e-4, 30, 5, NodeView.of(small_graph, small_graph.train_idx, 2),
                               NodeView.of(small_graph, small_graph.val_idx, 2),
                               ReplicaDropout(SEEDS, SMALL.dropout), lanes=1)

    run = started()
    gc.collect()
    others = [np.random.Generator(np.random.PCG64(seed)) for seed in range(100, 164)]  # memory freed, used again
    while run.tick():
        pass
    run.close()
    checkpoint, epochs, best_epochs = lanes_loop(fused.library(), small_graph, SMALL, SEEDS, 30, 5, lanes=1)
    assert run.epochs.tolist() == epochs and run.best_epoch.tolist() == best_epochs and len(others) == 64
    for kept, dropped in zip(checkpoint, run.checkpoint):
        assert torch.equal(kept, dropped)


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_native_run_clocks_its_validation_passes_inside_the_ticks(small_graph: GraphTensors, lanes: int) -> None:
    """SeedLanes.validation_seconds (how the benchmark times the validation pass `reproduce` runs): nothing before
    the first tick, then a share of the ticks' wall time that grows with every tick."""
    import time

    model = GAT(SMALL, small_graph.x.num_features, small_graph.num_classes, SEEDS)
    run = fused.SeedLanes(model, 0.005, 5e-4, 30, 30, NodeView.of(small_graph, small_graph.train_idx, 2),
                          NodeView.of(small_graph, small_graph.val_idx, 2), ReplicaDropout(SEEDS, SMALL.dropout),
                          lanes=lanes)
    try:
        assert run.validation_seconds == 0.0
        readings = []
        start = time.perf_counter()
        for _ in range(3):
            run.tick()
            readings.append(run.validation_seconds)
        elapsed = time.perf_counter() - start
        assert 0.0 < readings[0] < readings[1] < readings[2] < elapsed  # one thread: a part of the ticks
    finally:
        run.close()
    with pytest.raises(RuntimeError, match="closed"):
        _ = run.validation_seconds


def _draw_words(drop: object, replica: int, count: int) -> tuple[int, list[int]]:
    """fused.cpp's gat_draw_words (a hook for these tests, not in gat.fused.load's list, which older commits' kernels
    must pass for benchmarks.kernel_ab): whether the words came inline, and the words."""
    import ctypes

    import numpy as np

    draw = fused.library().gat_draw_words
    draw.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    words = np.zeros(count, np.uint64)
    return draw(ctypes.addressof(drop), replica, count, words.ctypes.data), words.tolist()


def exp_lanes_mismatches(lib: object, first: int, count: int) -> int:
    """fused.cpp's gat_exp_lanes_mismatches (a hook for these tests, as gat_draw_words): of the floats whose bits are
    first .. first + count - 1, how many exp_approx in vector lanes (16 or 8) gives other bytes than exp_inplace."""
    import ctypes

    mismatches = lib.gat_exp_lanes_mismatches
    mismatches.argtypes = [ctypes.c_uint32, ctypes.c_int64]
    mismatches.restype = ctypes.c_int64
    return mismatches(first, count)


def sampled_exp_lanes_mismatches(lib: object) -> int:
    """exp_lanes_mismatches on 4096 runs of 4096 consecutive floats, one run every 2^20 bit patterns (16 M floats)."""
    return sum(exp_lanes_mismatches(lib, first, 4096) for first in range(0, 1 << 32, 1 << 20))


def test_exp_in_vector_lanes_gives_exp_inplaces_bytes_on_a_sample_of_floats() -> None:
    """exp_approx in vector lanes (ELU's slope beside its product in the backward pass) takes the scalar's operations:
    4096 runs of 4096 consecutive floats, one run every 2^20 bit patterns (both signs, subnormals, the clamps at about
    -87.3 and 88.4, infinities and NaNs), each float's bytes as exp_inplace's."""
    assert sampled_exp_lanes_mismatches(fused.library()) == 0


@pytest.mark.slow
def test_exp_in_vector_lanes_gives_exp_inplaces_bytes_on_every_float() -> None:
    """All 2^32 bit patterns, in 16 and in 8 lanes (about 20 s)."""
    assert exp_lanes_mismatches(fused.library(), 0, 1 << 32) == 0


@pytest.mark.slow
def test_the_exp_check_finds_lanes_that_round_otherwise(tmp_path: Path) -> None:
    """A kernel whose vector floor (AVX's and AVX-512's) rounds to the nearest integer instead, a slip of one flag,
    compiles, and the check counts the floats it gets wrong: the sample test above can fail."""
    import ctypes

    source = fused.SOURCE.read_text()
    wrong = source.replace("_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC", "_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC")
    assert source.count("_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC") == 2, "the mutation no longer applies to fused.cpp"
    (tmp_path / "fused.cpp").write_text(wrong)
    library = tmp_path / "wrong.so"
    built = subprocess.run(fused.compile_command(fused.compiler(), tmp_path / "fused.cpp", library, ["-O1"]),
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    wrong_lib = ctypes.CDLL(str(library))
    assert sampled_exp_lanes_mismatches(wrong_lib) > 0


# The first word alone; each chain last; the longest run without vector lanes (32), then 16 lanes for one jump with
# no, one and two words after it (33-35, AVX-512 builds); long runs.
@pytest.mark.parametrize("count", [1, 2, 3, 32, 33, 34, 35, 256, 1001])
def test_the_kernel_draws_numpys_pcg64_words_without_a_call_per_word(count: int) -> None:
    """The masks' words come from PCG64 stepped inline (two chains of every other state, or 16 states in vector lanes
    with AVX-512): the same words as numpy's random_raw on a twin generator, the generator left in the same state, the
    other replica's untouched."""
    noise, twin = ReplicaDropout([3, 7], 0.6), ReplicaDropout([3, 7], 0.6)
    drop, _states = fused._dropout(noise)
    inline, words = _draw_words(drop, 1, count)
    assert inline == 1 and words == twin.generators[1].bit_generator.random_raw(count).tolist()
    assert noise.generators[1].bit_generator.state == twin.generators[1].bit_generator.state
    assert noise.generators[0].bit_generator.state == twin.generators[0].bit_generator.state


def test_a_generator_whose_words_the_inline_step_does_not_give_is_called_word_by_word() -> None:
    """A next_uint64 whose first word differs from the inline step's (here a counter behind a PCG64-shaped state)
    gives every word itself: the kernel never draws a stream it has not checked."""
    import ctypes

    import numpy as np

    calls = []

    @ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)
    def counter(_state: int) -> int:
        calls.append(len(calls))
        return 1000 + len(calls)

    integers = np.zeros(4, np.uint64)  # {state, inc} as two 128-bit integers
    integers[2] = 1
    state = (ctypes.c_void_p * 2)(integers.ctypes.data, 0)  # {the integers' address, has_uint32 and uinteger}
    states = (ctypes.c_void_p * 1)(ctypes.addressof(state))
    drop = fused._Dropout(ctypes.cast(counter, ctypes.c_void_p).value, ctypes.addressof(states), 153, 0, 2.5)
    assert _draw_words(drop, 0, 5) == (0, [1001, 1002, 1003, 1004, 1005]) and len(calls) == 5


# Less than one block of 64 bytes; one and a byte more; a chunk of drawn words (8192 bytes) and a byte either side;
# many chunks and a tail, with some 78 ties of the threshold's top byte (1 element in 256).
@pytest.mark.parametrize("count", [1, 7, 63, 64, 65, 8191, 8192, 8193, 20001])
@pytest.mark.parametrize("p", [0.6, 0.5])
def test_the_kernel_draws_replica_dropouts_masks_as_floats_bytes_and_bits(count: int, p: float) -> None:
    """draw_mask's floats, draw_kept_bytes's bytes and draw_kept_bits's bits (vector compares of 64 drawn bytes with
    AVX-512, a word or a byte at a time without), and 8 heads' bits folded into a byte per element (heads_of_bits):
    ReplicaDropout.keep's mask, element for element, ties of the top byte included, and the stream left where keep
    leaves it."""
    import ctypes

    import numpy as np

    draw = fused.library().gat_draw_mask
    draw.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    sizes = {0: (count, np.float32), 1: ((count + 7) // 8 * 8, np.uint8), 2: (count // 64 + 2, np.uint64),
             3: (count, np.uint8)}
    for kind, (size, dtype) in sizes.items():
        noise, twin = ReplicaDropout([11], p), ReplicaDropout([11], p)
        drop, _states = fused._dropout(noise)
        out = np.zeros(size, dtype)
        assert draw(ctypes.addressof(drop), 0, count, kind, out.ctypes.data) == 0
        if kind == 3:
            kept = twin.keep(8, count)[0].numpy() > 0  # [8, count]
            assert np.array_equal(out, (kept * (1 << np.arange(8))[:, None]).sum(0).astype(np.uint8))
        else:
            expected = twin.keep(count)[0].numpy()
            if kind == 0:
                assert np.array_equal(out, expected)
            elif kind == 1:
                assert np.array_equal(out[:count], np.where(expected > 0, 0xFF, 0).astype(np.uint8))
            else:
                bits = np.unpackbits(out.view(np.uint8), bitorder="little")
                assert np.array_equal(bits[:count], expected > 0) and not bits[count:].any()
        assert noise.generators[0].bit_generator.state == twin.generators[0].bit_generator.state
    assert draw(ctypes.addressof(drop), 0, 1, 7, out.ctypes.data) == 1


def test_a_bad_lane_width_is_one_line(monkeypatch) -> None:
    from stages.support.params import StageError, check_lanes_variable

    monkeypatch.setenv(fused.LANES_VARIABLE, "12")
    with pytest.raises(StageError,
                       match="GAT_FUSED_LANES='12' is not a lane width: use one of 0, 1, 4, 8, 16, or unset it"):
        check_lanes_variable()
    with pytest.raises(ValueError):
        fused.SeedLanes(GAT(SMALL, 4, 3, [0]), 0.005, 5e-4, 10, 5, None, None, None, lanes=12)


def test_the_benchmark_draws_the_lane_curve(cora_graph: Graph) -> None:
    from benchmarks import throughput

    curve = throughput.lane_curve(cora_graph, epochs=2, rounds=1, points=((0, 4), (1, 4), (4, 4), (8, 2)))
    assert set(curve["seed_epochs_per_s"]) == {"Python loop, 4 seeds", "native per-seed, 4 seeds",
                                               "lanes of 4, 4 seeds", "lanes of 8, 2 seeds"}
    assert curve["vs_reference"]["Python loop, 4 seeds"] == 1.0 and min(curve["seed_epochs_per_s"].values()) > 0
    best = curve["best"]
    assert not best.startswith("Python")
    assert curve["best_vs_reference"] == pytest.approx(curve["vs_reference"][best])
    assert fused.LANES_VARIABLE not in os.environ


def test_the_native_per_seed_loop_is_the_default(monkeypatch) -> None:
    """Unset, $GAT_FUSED_LANES trains in the native loop with the per-seed kernel; 0 keeps the Python epoch loop."""
    monkeypatch.delenv(fused.LANES_VARIABLE, raising=False)
    assert fused.requested_lanes() == fused.DEFAULT_LANES == 1
    monkeypatch.setenv(fused.LANES_VARIABLE, " 0 ")
    assert fused.requested_lanes() is None
    monkeypatch.setenv(fused.LANES_VARIABLE, "16")
    assert fused.requested_lanes() == 16


# benchmarks.kernel_ab: this checkout's kernel against an earlier commit's ----------------------------------------

def test_the_kernel_comparison_times_both_libraries_in_turn(cora_graph: Graph) -> None:
    from benchmarks import kernel_ab

    lib = fused.library()
    samples = kernel_ab.time_kernels(cora_graph, {"new": lib, "old": lib}, seeds=2, rounds=3, block=1)
    assert set(samples) == {"new", "old"}
    for values in samples.values():
        assert len(values["step"]) == len(values["validation"]) == 3
        assert min(values["step"] + values["validation"]) > 0


def test_the_kernels_take_turns_first_in_alternate_rounds() -> None:
    from benchmarks import kernel_ab

    assert [kernel_ab.turns(["new", "old"], round_) for round_ in range(4)] == [
        ["new", "old"], ["old", "new"], ["new", "old"], ["old", "new"]]


def test_the_native_loop_comparison_times_whole_epochs_of_every_seed(cora_graph: Graph) -> None:
    from benchmarks import kernel_ab

    lib = fused.library()
    samples = kernel_ab.time_native_loops(cora_graph, {"new": lib, "old": lib}, seeds=2, rounds=3, block=2)
    assert set(samples) == {"new", "old"}
    for values in samples.values():
        assert list(values) == ["native loop's epoch"] and len(values["native loop's epoch"]) == 3
        assert min(values["native loop's epoch"]) > 0


def test_the_layout_comparison_runs_each_name_in_its_own_layout_of_the_first_w(cora_graph: Graph,
                                                                                monkeypatch) -> None:
    from benchmarks import kernel_ab

    asked = []

    class RecordingSeedLanes(fused.SeedLanes):
        def __init__(self, *args, **kwargs) -> None:
            asked.append(kwargs["first_w_by_feature"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(fused, "SeedLanes", RecordingSeedLanes)
    lib = fused.library()
    samples = kernel_ab.time_native_loops(cora_graph, {"by": lib, "transposed": lib, "chosen": lib}, seeds=1,
                                          rounds=2, block=1, first_w_by_feature={"by": True, "transposed": False})
    assert asked == [True, False, None]  # None: the kernel's own choice for this CPU
    assert all(len(values["native loop's epoch"]) == 2 for values in samples.values())


def test_the_layout_comparison_refuses_extra_flags(capsys) -> None:
    from benchmarks import kernel_ab

    with pytest.raises(SystemExit) as stop:
        kernel_ab.main(["--first-w-layouts", "--extra-flags=-O2"])
    assert stop.value.code == 2
    assert "--extra-flags changes an older commit's build: use it with --against" in capsys.readouterr().err


def test_a_revision_without_the_kernel_is_one_line(capsys) -> None:
    from benchmarks import kernel_ab

    with pytest.raises(SystemExit) as stop:
        kernel_ab.main(["--against", "no-such-revision"])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error == ("error: git has no gat/csrc/fused.cpp at 'no-such-revision': pass a commit of this repository "
                     "(e.g. `--against HEAD~1`)")


def test_extra_flags_the_compiler_refuses_are_one_line(capsys) -> None:
    from benchmarks import kernel_ab

    with pytest.raises(SystemExit) as stop:
        kernel_ab.main(["--against", "HEAD", "--extra-flags=-fno-such-flag"])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error
    assert error.startswith("error: HEAD's fused.cpp does not compile here with -fno-such-flag: ")
    assert "-fno-such-flag" in error.split(": ", 2)[2]  # the compiler's own words on it


@pytest.mark.slow
def test_an_earlier_commits_kernel_builds_and_computes_the_same_bytes(tmp_path: Path, monkeypatch) -> None:
    """HEAD's fused.cpp, built aside by kernel_ab, gives the fingerprint of the per-seed kernel that `make` built
    (the widths of the lanes before the native per-seed loop: a commit's kernel may predate width 1)."""
    from benchmarks import kernel_ab
    from gat import fused_check

    older = fused.load(kernel_ab.build_revision("HEAD", tmp_path), earlier=True)  # as kernel_ab loads it
    monkeypatch.setattr(fused, "LANE_WIDTHS", (4, 8, 16))
    assert fused_check.fingerprint(older) == fused_check.fingerprint(fused.library())


@pytest.mark.slow
def test_a_kernel_from_before_x_cval_is_loaded_only_as_an_earlier_one(tmp_path: Path, monkeypatch) -> None:
    """A fused.cpp whose Problem ends before x_cval (the last commit without it): `load` refuses it as this
    checkout's library, and takes it as an earlier one beside this (kernel_ab, kernel_phases), where it computes the
    same bytes, reading the fields it knows."""
    from benchmarks import kernel_ab
    from gat import fused_check

    built = kernel_ab.build_revision("cf4fec4", tmp_path)
    with pytest.raises(fused.FusedUnavailable, match=r"^_Problem of gat/fused.py does not match fused.cpp's layout$"):
        fused.load(built)
    monkeypatch.setattr(fused, "LANE_WIDTHS", (4, 8, 16))
    assert fused_check.fingerprint(fused.load(built, earlier=True)) == fused_check.fingerprint(fused.library())


# benchmarks.train_ab: this checkout's whole training loop against an earlier commit's ----------------------------

def test_the_loop_comparison_names_a_missing_revision_in_one_line(capsys) -> None:
    from benchmarks import train_ab

    with pytest.raises(SystemExit) as stop:
        train_ab.main(["--against", "no-such-revision"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: git has no commit 'no-such-revision': pass a commit of this "
                                               "repository (e.g. `--against HEAD~1`)")


@pytest.mark.parametrize("flag", ["--seeds", "--epochs", "--rounds"])
def test_the_loop_comparison_refuses_no_seeds_epochs_or_rounds(flag: str, capsys) -> None:
    from benchmarks import train_ab

    with pytest.raises(SystemExit) as stop:
        train_ab.main(["--against", "HEAD", flag, "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {flag} must be at least 1, not 0"


@pytest.mark.slow
def test_the_loop_comparison_runs_both_trees_in_turn_to_the_same_weights(planetoid_folder) -> None:
    """HEAD's tree, unpacked and built aside, and this checkout each train in fresh processes, taking turns; both
    train the same seeds to the same bytes, and the summary says so."""
    from benchmarks import train_ab

    compared = train_ab.against_revision("HEAD", seeds=1, epochs=2, rounds=2, data_dir=planetoid_folder.path,
                                         verify=planetoid_folder.real)
    samples = compared["seed_epochs_per_s_samples"]
    assert {name: len(rates) for name, rates in samples.items()} == {"this checkout": 2, "HEAD": 2}
    assert all(rate > 0 for rates in samples.values() for rate in rates)
    assert compared["same_weights"] and compared["against"] == "HEAD"
    lines = train_ab.summary(compared)
    assert lines[-1] == "the same weights in every sample", lines
    assert lines[-2] == f"this checkout / HEAD = {compared['speedup']:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_loop_comparison_leaves_nothing_training(signum: int, tmp_path: Path, planetoid_folder) -> None:
    """SIGTERM stops the comparison within seconds, in one line, its temporary tree removed; after SIGKILL too, the
    measuring process does not train on: the kernel kills it with the comparison."""
    import psutil

    command = [sys.executable, "-m", "benchmarks.train_ab", "--against", "HEAD", "--seeds", "1", "--epochs", "1000000",
               "--rounds", "1", "--data-dir", str(planetoid_folder.path)]
    command += [] if planetoid_folder.real else ["--no-verify"]
    comparison = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "TMPDIR": str(tmp_path)})
    measuring: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240  # HEAD's kernel is built first
        while not measuring and time.monotonic() < deadline and comparison.poll() is None:
            try:
                measuring = [child for child in psutil.Process(comparison.pid).children() if "-c" in child.cmdline()]
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.2)
        assert measuring, f"no measuring process started: {comparison.poll()}"
        comparison.send_signal(signum)
        _, stderr = comparison.communicate(timeout=20)
        _, alive = psutil.wait_procs(measuring, timeout=10)
        assert not alive, alive
        if signum == signal.SIGTERM:
            assert comparison.returncode == 128 + signum
            assert stderr.strip().splitlines()[-1] == ("error: interrupted by SIGTERM: stopping; the measuring process "
                                                       "is killed and the temporary tree removed.")
            assert list(tmp_path.glob("gat-train-ab-*")) == []  # torch may leave its own folder there
        else:
            assert comparison.returncode == -signum
    finally:
        for process in [psutil.Process(comparison.pid), *measuring] if comparison.poll() is None else measuring:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        comparison.wait(timeout=10)


# benchmarks.stage_ab: this checkout's whole reproduce stage against an earlier commit's ------------------------------

def test_the_stage_comparison_refuses_no_rounds_or_a_folder_without_a_prepared_dataset(tmp_path: Path, capsys) -> None:
    from benchmarks import stage_ab

    for arguments, line in [
        (["--rounds", "0", "--data", str(tmp_path)], "error: --rounds must be at least 1, not 0"),
        (["--data", str(tmp_path)], f"error: {tmp_path} is not a prepared dataset (no graph.pt): run `make repro` "
                                    "first, or pass the preprocess stage's output folder"),
        (["--raw", str(tmp_path / "missing")], f"error: {tmp_path / 'missing'} is not a folder: pass the folder of the "
                                               "raw Planetoid files (ind.cora.x, ...)"),
    ]:
        with pytest.raises(SystemExit) as stop:
            stage_ab.main(["--against", "HEAD", *arguments])
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip() == line


def test_the_stage_comparison_names_a_missing_revision_in_one_line(tmp_path: Path, capsys) -> None:
    from benchmarks import stage_ab

    (tmp_path / "graph.pt").touch()
    with pytest.raises(SystemExit) as stop:
        stage_ab.main(["--against", "no-such-revision", "--data", str(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: git has no commit 'no-such-revision': pass a commit of this "
                                               "repository (e.g. `--against HEAD~1`)")


def test_the_stage_comparison_prepares_raw_files_with_the_preprocess_stage(tmp_path: Path,
                                                                          planetoid_folder: PlanetoidFolder) -> None:
    """Without --data, the raw files go through this checkout's own preprocess stage, checksums and all: the real
    Cora becomes a prepared folder that the reproduce stage reads; other files stop it in one line naming them."""
    from benchmarks import stage_ab
    from stages.support.files import load_prepared

    if planetoid_folder.real:
        graph, meta = load_prepared(stage_ab.prepare(planetoid_folder.path, "cora", tmp_path), "cora")
        assert (graph.num_nodes, graph.num_features, int(graph.train_idx.numel())) == (2708, 1433, 140)
        assert meta["source_sha256"]["ind.cora.x"] == planetoid_folder.checksums["ind.cora.x"]
    raw = tmp_path / "synthetic"
    write_synthetic_planetoid(raw, "cora", **SYNTHETIC_LAYOUTS["cora"])
    work = tmp_path / "refused"
    work.mkdir()
    with pytest.raises(StageError) as refused:
        stage_ab.prepare(raw, "cora", work)
    assert str(refused.value).startswith(f"preparing cora from {raw} failed: {raw / 'ind.cora.x'}: SHA-256 is ")
    assert "\n" not in str(refused.value) and not (work / "prepared").exists()


@pytest.fixture
def prepared_synthetic_cora(tmp_path: Path) -> Path:
    from conftest import write_prepared_synthetic_cora

    write_prepared_synthetic_cora(tmp_path, {"ind.cora.x": "0" * 64})
    return tmp_path / "data/prepared/cora"


@pytest.mark.slow
def test_the_stage_comparison_runs_both_stages_in_turn_to_the_same_seeds(prepared_synthetic_cora: Path) -> None:
    """HEAD's tree, unpacked with its kernel built aside, and this checkout each run the whole reproduce stage on the
    same prepared data, tracking into their own stores: both write the same seeds.csv, whose epochs are the
    seed-epochs counted, and the repository is left as it was."""
    from benchmarks import stage_ab

    def untracked_and_ignored() -> list[str]:  # but Python's bytecode caches, which imports may add
        listed = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=REPO, capture_output=True, text=True)
        return [line for line in listed.stdout.splitlines() if "__pycache__" not in line]

    before = untracked_and_ignored()
    compared = stage_ab.against_revision("HEAD", "cora", prepared_synthetic_cora, rounds=1)
    assert {name: len(rates) for name, rates in compared["seed_epochs_per_s_samples"].items()} == {
        "this checkout": 1, "HEAD": 1}
    assert all(rate > 0 for rates in compared["seed_epochs_per_s_samples"].values() for rate in rates)
    assert compared["same_seeds"] and len(compared["seed_epochs"]) == 1 and compared["seed_epochs"][0] >= 100
    lines = stage_ab.summary(compared)
    assert lines[-1] == f"the same seeds.csv in every run ({compared['seed_epochs'][0]} seed-epochs)"
    assert lines[-2] == f"this checkout / HEAD = {compared['speedup']:.3f}"
    assert untracked_and_ignored() == before


@pytest.mark.slow
def test_the_stage_comparison_can_track_into_a_team_server(prepared_synthetic_cora: Path, tmp_path: Path,
                                                           team_backend) -> None:
    """`--team`: a side's stage logs into the team server that the clients' settings name (its parent run and a child
    run per seed), and creates no SQLite store."""
    from team_support import server_runs

    from benchmarks import stage_ab
    from stages.support.store import REPRODUCE_EXPERIMENT

    before = {run.info.run_id for run in server_runs(team_backend, REPRODUCE_EXPERIMENT)}
    samples = stage_ab.take_turns({"this checkout": (REPO, None)}, "cora", prepared_synthetic_cora, 1, tmp_path,
                                  team_backend.client_env)
    assert len(samples["this checkout"]) == 1 and not list(tmp_path.rglob("mlflow.db"))
    new = [run for run in server_runs(team_backend, REPRODUCE_EXPERIMENT) if run.info.run_id not in before]
    (parent,) = [run for run in new if "mlflow.parentRunId" not in run.data.tags]
    assert parent.info.status == "FINISHED"
    seeds = len((tmp_path / "round0-side0" / "out" / "seeds.csv").read_text().splitlines()) - 1
    children = [run.data.tags["mlflow.parentRunId"] for run in new if run is not parent]
    assert children == [parent.info.run_id] * seeds


@pytest.mark.slow
def test_a_stopped_stage_comparison_leaves_no_stage_running(tmp_path: Path, prepared_synthetic_cora: Path) -> None:
    """SIGTERM while a stage runs stops the comparison within seconds, in one line, with the stage, its worker
    processes and the temporary folder gone."""
    import psutil

    command = [sys.executable, "-m", "benchmarks.stage_ab", "--against", "HEAD", "--rounds", "1",
               "--data", str(prepared_synthetic_cora)]
    comparison = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "TMPDIR": str(tmp_path)})
    stages: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240  # HEAD's kernel is built first
        while time.monotonic() < deadline and comparison.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                stage = [child for child in psutil.Process(comparison.pid).children()
                         if "stages.reproduce" in child.cmdline()]
                if stage and stage[0].children():  # its workers have started
                    stages = [stage[0], *stage[0].children(recursive=True)]
                    break
            time.sleep(0.2)
        assert stages, f"no stage with workers started: {comparison.poll()}"
        comparison.send_signal(signal.SIGTERM)
        _, stderr = comparison.communicate(timeout=20)
        _, alive = psutil.wait_procs(stages, timeout=10)
        assert not alive, alive
        assert comparison.returncode == 128 + signal.SIGTERM
        assert stderr.strip().splitlines()[-1] == ("error: interrupted by SIGTERM: stopping; the running stage is "
                                                   "killed and the temporary folder removed.")
        assert list(tmp_path.glob("gat-stage-ab-*")) == []
    finally:
        for process in [psutil.Process(comparison.pid), *stages] if comparison.poll() is None else stages:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        comparison.wait(timeout=10)


def test_issue_22s_starting_point_is_a_commit_of_this_repository() -> None:
    """`make bench` compares this checkout with it (benchmarks.throughput.against_issue_22_start)."""
    from benchmarks import throughput

    found = subprocess.run(["git", "cat-file", "-e", f"{throughput.ISSUE_22_START}^{{commit}}"],
                           cwd=REPO, capture_output=True)
    assert found.returncode == 0, found.stderr


# benchmarks.kernel_phases: the kernel built with its phase timers -------------------------------------------------

@pytest.mark.parametrize("flag", ["--seeds", "--epochs", "--rounds"])
def test_the_phase_profile_refuses_no_seeds_epochs_or_rounds(flag: str, capsys) -> None:
    from benchmarks import kernel_phases

    with pytest.raises(SystemExit) as stop:
        kernel_phases.main([flag, "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --seeds, --epochs and --rounds must be at least 1"


@pytest.mark.slow
def test_the_timed_build_times_every_phase_and_computes_the_same_bytes(tmp_path: Path, cora_graph: Graph,
                                                                       monkeypatch) -> None:
    """Every phase of the paper's model takes time, the phases together stay within the wall time, and the timers
    change no result: the timed build gives the fingerprint of the one `make` built."""
    from benchmarks import kernel_phases
    from gat import fused_check

    timed = kernel_phases.build_timed(tmp_path)
    samples = kernel_phases.phase_samples(cora_graph, {"this": timed}, seeds=2, epochs=3, rounds=2)["this"]
    phases = {name: values for name, values in samples.items()
              if name not in (kernel_phases.UNTIMED, kernel_phases.WALL)}
    assert len(phases) == timed.gat_phase_count() == 18
    assert all(len(values) == 2 for values in samples.values()), samples
    assert all(ms > 0 for values in phases.values() for ms in values), phases
    for block in range(2):
        assert sum(values[block] for values in phases.values()) < samples[kernel_phases.WALL][block]
    monkeypatch.setattr(fused, "LANE_WIDTHS", (4, 8, 16))
    assert fused_check.fingerprint(timed) == fused_check.fingerprint(fused.library())


@pytest.mark.slow
def test_the_phase_profile_times_an_earlier_commits_kernel_beside_this_one(tmp_path: Path, cora_graph: Graph) -> None:
    """--against: HEAD's fused.cpp built with the timers as well, both timed in turns with a sample of every phase
    per round; a commit from before the timers is a one-line error."""
    from benchmarks import kernel_phases

    (tmp_path / "head").mkdir()
    libraries = {"this": kernel_phases.build_timed(tmp_path),
                 "HEAD": kernel_phases.build_timed(tmp_path / "head", "HEAD")}
    samples = kernel_phases.phase_samples(cora_graph, libraries, seeds=1, epochs=2, rounds=3)
    assert samples["this"].keys() == samples["HEAD"].keys()
    assert all(len(values) == 3 for timed in samples.values() for values in timed.values())

    (tmp_path / "old").mkdir()
    with pytest.raises(kernel_phases.StageError, match=r"^5a0ad3b~1's fused.cpp has no phase timers: compare with a "
                                                       r"later commit$"):
        kernel_phases.build_timed(tmp_path / "old", "5a0ad3b~1")


# benchmarks.vector_ports: the CPU's vector rates and the kernel's sparse product beside them -----------------------

def test_the_vector_ports_refuse_no_repeats(capsys) -> None:
    from benchmarks import vector_ports

    with pytest.raises(SystemExit) as stop:
        vector_ports.main(["--repeats", "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --repeats must be at least 1"


def test_the_vector_ports_floor_is_a_stored_features_arithmetic_at_the_widest_alternating_rate() -> None:
    """128 float operations (64 multiplies, 64 adds) at the faster of 8 × the 8-lane and 16 × the 16-lane
    alternating rate; without AVX-512 the 16-lane row says it was not built."""
    from benchmarks import vector_ports

    avx512 = vector_ports.Rates(7.5, 7.5, 11.0, 7.0, 7.0, 7.0, 2.0)  # 88 and 112 float operations per ns
    assert vector_ports.floor_ns(avx512) == pytest.approx(128 / 112)
    product = vector_ports.SparseProduct(gathered=2.4, in_l1=1.8, under_dropout=3.2)
    kept = vector_ports.KeptPairs(build=2.0, product=2.8, kept_share=0.64, same_bytes=True)
    lines = vector_ports.report(avx512, product, kept)
    assert lines[1] == "  8 lanes: adds 7.50, multiplies 7.50, alternating 11.00 (88 float operations)"
    assert lines[2] == "  16 lanes: adds 7.00, multiplies 7.00, alternating 7.00 (112 float operations)"
    assert lines[3] == "  one chain of dependent 8-lane adds: 2.00 per ns (latency 0.500 ns)"
    assert lines[5] == "  rows of W from 1,433 features (358 KB): 2.40 (2.10× the floor)"
    assert lines[-2] == ("  the same through per-pair lists of what is kept (64% of the pairs of heads): "
                         "the lists 2.00 + the product 2.80 = 4.80 (1.50× the kernel's), the same bytes")
    assert lines[-1] == "  the floor, 64 multiplies and 64 adds at 112 float operations per ns: 1.14"
    other_bytes = dataclasses.replace(kept, same_bytes=False)
    assert vector_ports.report(avx512, product, other_bytes)[-2].endswith(", other bytes than the kernel")

    avx2 = dataclasses.replace(avx512, wide_adds=0, wide_multiplies=0, wide_alternating=0)
    assert vector_ports.floor_ns(avx2) == pytest.approx(128 / 88)
    not_built = vector_ports.KeptPairs(build=0, product=0, kept_share=0, same_bytes=False)
    lines = vector_ports.report(avx2, product, not_built)
    assert lines[2] == "  16 lanes: not built (no AVX-512 in these flags)"
    assert lines[-2] == "  the same through per-pair lists of what is kept: not built (no AVX-512 in these flags)"


@pytest.mark.slow
def test_the_vector_ports_measure_this_cpu_with_the_kernels_own_product(tmp_path: Path, monkeypatch) -> None:
    """Built with the kernel's default flags and gat/csrc/fused.cpp: every rate and time is a positive figure, the
    16-lane rates exist exactly where -march=native gives AVX-512, one chain of dependent adds is slower than 12
    independent ones, and the product through per-pair lists of what is kept (built exactly where AVX-512 is) gives
    the kernel's bytes."""
    from benchmarks import vector_ports

    monkeypatch.delenv("GAT_FUSED_CXXFLAGS", raising=False)
    lib = vector_ports.build(tmp_path)
    rates = vector_ports.rates(lib, 200_000, 5)
    cpu = fused.cpu_facts()
    assert cpu is not None
    assert (rates.wide_alternating > 0) == ("avx512f" in cpu[1])
    assert all(value > 0 for value in (rates.adds, rates.multiplies, rates.alternating, rates.dependent_adds))
    assert rates.dependent_adds < rates.adds  # 12 chains overlap where one cannot
    product = vector_ports.sparse_product(lib, 200, 2)
    assert all(0 < ns < 1e4 for ns in (product.gathered, product.in_l1, product.under_dropout)), product
    kept = vector_ports.kept_pairs(lib, 2000, 2)
    assert kept.built == ("avx512f" in cpu[1])
    if kept.built:  # skipping what adds +0 keeps every byte; 1 - 0.6² of the pairs are kept at the paper's rates
        assert kept.same_bytes and 0 < kept.build < 1e4 and 0 < kept.product < 1e4, kept
        assert kept.kept_share == pytest.approx(0.64, abs=0.02)
