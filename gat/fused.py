"""The fused CPU kernel: a whole training step, or a validation pass, of R replicas in one native call.

gat/csrc/fused.cpp computes the paper's two-layer GAT (gat.model.GAT) for every replica: both layers
under dropout, the cross-entropy loss, the backward pass of all twelve parameters and torch.optim.Adam's
update with coupled L2, in place on the model's parameters. The torch implementation (gat.layers,
gat.training.train_step) stays the reference; `train.optim.kernel: torch` selects it.

Built by `make` (`python -m tools.build_fused`) with the system C++ compiler (`$CXX`, else g++ or c++) into the
virtual environment (`<sys.prefix>/gat-fused/`, or `$GAT_FUSED_DIR`), one file per source, self-check, flags,
compiler and CPU (library_path: the build key), and compared with the torch path on small random graphs
(gat.fused_check) before it is kept. This module only finds and loads that build, and never writes a file: where
there is none, or its self-check rejected it, `kernel: fused` trains with the torch kernel and says why. Called
through ctypes: plain C functions, no Python or torch headers, so a build needs nothing but the compiler.

Dropout masks are drawn inside the kernel from each replica's numpy PCG64 generator
(gat.dropout.ReplicaDropout) through numpy's C interface, consumed exactly as ReplicaDropout.keep consumes
it: both kernels draw the same masks from the same seed, and the generators end in the same state.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from gat.dropout import ReplicaDropout
from gat.graph import Neighbourhoods, SparseFeatures
from gat.model import GAT

SOURCE = Path(__file__).with_name("csrc") / "fused.cpp"
CHECK_SOURCE = Path(__file__).with_name("fused_check.py")
# What the arithmetic means, in every build: no -ffast-math, no FMA contraction (the kernel keeps torch's order and
# rounding of each operation). These are never overridden. -Wno-psabi: GCC notes that passing a vector wider than
# the target's registers by value (8 doubles, or 16 floats without AVX-512) has another ABI than before GCC 4.6;
# only the file's own internal functions pass them, and GCC 12 ignores `#pragma GCC diagnostic` for that note.
SEMANTIC_FLAGS = ("-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC",
                  "-pthread", "-Wno-psabi")
# How hard to optimise, and for which CPU: $GAT_FUSED_CXXFLAGS replaces these (the build matrix of
# tests/test_fused_builds.py: -march=x86-64-v2/-v3/-v4, sanitizers). -march=native: the library is built on the
# machine that runs it, and the build key holds that machine's CPU, so a shared folder serves no other CPU's build.
# -mprefer-vector-width=512: the loops GCC vectorises itself (the dropout masks, exp, ELU, Adam) in AVX-512's 16
# lanes where the CPU has them. GCC 12 tunes Intel's AVX-512 CPUs for 256 bits (the Intel Xeon here: a native epoch
# 1 to 3.5 % faster with the flag, by the runs in reports/fused-kernel-log.md); for znver3 with AVX-512 (what GCC
# 12.2, which has no znver4, makes of an AMD CPU that has it) and for x86-64-v4 it prefers 512 already, and the
# machine code is the same with or without the flag. Without AVX-512 it does nothing. Vector width changes no
# rounding.
DEFAULT_OPTIMISATION = ("-O3", "-march=native", "-mprefer-vector-width=512")


def cxxflags() -> tuple[str, ...]:
    """The compiler flags of a build: $GAT_FUSED_CXXFLAGS (or DEFAULT_OPTIMISATION), then SEMANTIC_FLAGS."""
    chosen = tuple(shlex.split(os.environ.get("GAT_FUSED_CXXFLAGS", ""))) or DEFAULT_OPTIMISATION
    return (*chosen, *SEMANTIC_FLAGS)


def compile_command(compiler: str, source: Path, output: Path | str, extra_flags: Sequence[str] = ()) -> list[str]:
    """The command that builds `source` into the shared library `output`: cxxflags(), then `extra_flags` (the
    compiler takes the last of two contradicting flags)."""
    return [compiler, *cxxflags(), *extra_flags, str(source), "-o", str(output)]


def cpu_facts() -> tuple[str, frozenset[str]] | None:
    """The CPU's model name and feature flags (what -march=native reads), from /proc/cpuinfo; None without it."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    facts: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags") and key not in facts:
            facts[key] = value.strip()
        if len(facts) == 2:
            break
    return facts.get("model name", "?"), frozenset(facts["flags"].split()) if "flags" in facts else frozenset()


def cpu_identity() -> str:
    """The CPU a build is for: its model name and its feature flags."""
    facts = cpu_facts()
    if facts is None:
        import platform

        return platform.processor() or platform.machine()
    name, flags = facts
    return f"{name}; flags: {' '.join(sorted(flags)) or '?'}"


MAX_FEATURES = 256  # kMaxFeatures of fused.cpp


def unsupported(hidden: Sequence[int]) -> str | None:
    """Why the kernel can't compute layers of `hidden` features per head (None: it can)."""
    if max(hidden) > MAX_FEATURES:
        return f"the fused kernel takes at most {MAX_FEATURES} features per head, got {max(hidden)}"
    return None


class FusedUnavailable(RuntimeError):
    """The fused kernel cannot be built or loaded here; the message says why and what falls back."""


class FusedFallbackWarning(UserWarning):
    """Training asked for the fused kernel and runs on the torch kernel instead (shown once per process)."""


# The C structures of fused.cpp, field for field.
class _Block(ctypes.Structure):
    _fields_ = [("targets", ctypes.c_int64), ("sources", ctypes.c_int64), ("edges", ctypes.c_int64),
                ("crow", ctypes.c_void_p), ("source", ctypes.c_void_p), ("target_in_source", ctypes.c_void_p)]


class _Problem(ctypes.Structure):
    _fields_ = [("n0", ctypes.c_int64), ("f_in", ctypes.c_int64), ("nnz", ctypes.c_int64),
                ("x_crow", ctypes.c_void_p), ("x_col", ctypes.c_void_p), ("x_val", ctypes.c_void_p),
                ("x_ccol", ctypes.c_void_p), ("x_row", ctypes.c_void_p), ("x_pos", ctypes.c_void_p),
                ("block", _Block * 2), ("heads", ctypes.c_int64 * 2), ("hidden", ctypes.c_int64 * 2),
                ("labels", ctypes.c_void_p), ("negative_slope", ctypes.c_double),
                ("x_cval", ctypes.c_void_p)]


class _Dropout(ctypes.Structure):
    _fields_ = [("next", ctypes.c_void_p), ("states", ctypes.c_void_p), ("threshold_top", ctypes.c_uint8),
                ("threshold_rest", ctypes.c_uint64), ("scale", ctypes.c_float)]


class _Adam(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double), ("step", ctypes.c_double)]


class _LaneRunSpec(ctypes.Structure):
    _fields_ = [("train", ctypes.c_void_p), ("val", ctypes.c_void_p), ("replicas", ctypes.c_int64),
                ("init", ctypes.c_void_p), ("checkpoint", ctypes.c_void_p), ("drop", _Dropout),
                ("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double), ("max_epochs", ctypes.c_int64),
                ("patience", ctypes.c_int64), ("epochs", ctypes.c_void_p), ("best_epoch", ctypes.c_void_p),
                ("best_acc", ctypes.c_void_p), ("best_loss", ctypes.c_void_p)]


def compiler() -> str | None:
    """The C++ compiler a build uses: $CXX, else g++, else c++ (None: none on PATH)."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def library_dir() -> Path:
    """Where built libraries live: $GAT_FUSED_DIR, else the virtual environment (removed by `make clean`)."""
    return Path(os.environ.get("GAT_FUSED_DIR") or Path(sys.prefix) / "gat-fused")


def library_path(compiler: str) -> Path:
    """One file per source, self-check, flags, compiler and CPU: an edited fused.cpp is never served a stale build,
    and a build folder shared between machines never serves code built for another CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), CHECK_SOURCE.read_bytes(), " ".join(cxxflags()).encode(),
                                     version.encode(), cpu_identity().encode()]))
    return library_dir() / f"gat_fused-{key.hexdigest()[:16]}.so"


def digest_file(path: Path) -> Path:
    """Where the SHA-256 of a build that passed its self-check is recorded; a library is loaded only if it matches."""
    return path.with_suffix(".sha256")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rejection_file(path: Path) -> Path:
    """Where a build that failed its self-check is recorded (with the difference), so that it isn't rebuilt."""
    return path.with_suffix(".rejected")


def built_library() -> Path:
    """The checked build for the current source, flags, compiler and CPU, as `make` left it. Raises FusedUnavailable
    (why there is none: disabled, no compiler, rejected by its self-check, or not built)."""
    if os.environ.get("GAT_FUSED_DISABLE"):
        raise FusedUnavailable("GAT_FUSED_DISABLE is set")
    found = compiler()
    if found is None:
        raise FusedUnavailable("no C++ compiler ($CXX, g++ or c++) on PATH; install g++ to build it")
    path = library_path(found)
    if rejection_file(path).is_file():
        raise FusedUnavailable(rejection_file(path).read_text().strip())
    if not (path.is_file() and digest_file(path).is_file()):
        raise FusedUnavailable(f"not built: no {path.name} in {path.parent}; `make` builds it "
                               "(python -m tools.build_fused)")
    return verified(path)


def verified(path: Path) -> Path:
    """`path`, if it holds the bytes that passed the self-check (the hash recorded beside it at build time); a
    truncated, damaged or replaced library would crash the process that loads it (SIGBUS, SIGSEGV), or run other
    code. Raises FusedUnavailable."""
    try:
        recorded = digest_file(path).read_text().strip()
        matches = sha256_of(path) == recorded
    except OSError as error:
        raise FusedUnavailable(f"cannot read the built library {path} or its recorded hash ({error.strerror}); "
                               f"delete {path.parent} and run `make`") from None
    if not matches:
        raise FusedUnavailable(f"{path} is not the library that was built and checked (its SHA-256 differs from "
                               "the one recorded at build time: damaged or replaced); delete it and run `make`")
    return path


def load(path: Path, earlier: bool = False) -> Any:
    """The library at `path`, its functions typed. Raises FusedUnavailable.

    `earlier`: a build of an earlier commit's fused.cpp, timed beside this one's (benchmarks.kernel_ab,
    benchmarks.kernel_phases), whose Problem may end before `x_cval`, a field it does not read.
    """
    try:
        lib = ctypes.CDLL(str(path))
        lib.gat_abi_sizes.restype = ctypes.c_int64
        for function in ("gat_train_step_f32", "gat_train_step_f64", "gat_evaluate_f32", "gat_evaluate_f64",
                         "gat_lanes_new", "gat_lanes_tick", "gat_lanes_free"):
            getattr(lib, function)
    except (OSError, AttributeError) as error:
        raise FusedUnavailable(f"cannot load the built library {path.name}: {error}") from None
    for which, structure in ((0, _Problem), (1, _Dropout), (2, _Adam), (3, _LaneRunSpec)):
        size = lib.gat_abi_sizes(which)
        if earlier and structure is _Problem and size == _Problem.x_cval.offset:
            continue  # the layout before x_cval was appended
        if size != ctypes.sizeof(structure):
            raise FusedUnavailable(f"{structure.__name__} of gat/fused.py does not match fused.cpp's layout")
    pointer = ctypes.c_void_p
    lib.gat_train_step_f32.argtypes = [pointer, ctypes.c_int64, *[pointer] * 9, ctypes.c_int]
    lib.gat_train_step_f64.argtypes = [pointer, ctypes.c_int64, *[pointer] * 6, ctypes.c_int]
    lib.gat_evaluate_f32.argtypes = [pointer, ctypes.c_int64, *[pointer] * 4, ctypes.c_int]
    lib.gat_evaluate_f64.argtypes = [pointer, ctypes.c_int64, *[pointer] * 4, ctypes.c_int]
    for function in ("gat_train_step_f32", "gat_train_step_f64", "gat_evaluate_f32", "gat_evaluate_f64"):
        getattr(lib, function).restype = ctypes.c_int
    lib.gat_lanes_new.argtypes = [pointer, ctypes.c_int, ctypes.c_int]
    lib.gat_lanes_new.restype = pointer
    lib.gat_lanes_tick.argtypes = [pointer] * 6
    lib.gat_lanes_tick.restype = ctypes.c_int64
    if hasattr(lib, "gat_lanes_validation_ns"):  # older revisions' libraries (benchmarks.kernel_ab) lack it
        lib.gat_lanes_validation_ns.argtypes = [pointer]
        lib.gat_lanes_validation_ns.restype = ctypes.c_int64
    lib.gat_lanes_free.argtypes = [pointer]
    lib.gat_lanes_free.restype = None
    if hasattr(lib, "gat_seeds_new"):  # older revisions' libraries (benchmarks.kernel_ab) lack these two
        lib.gat_seeds_new.argtypes = [pointer, ctypes.c_int, ctypes.c_int]
        lib.gat_seeds_new.restype = pointer
        lib.gat_first_w_by_feature.argtypes = []
        lib.gat_first_w_by_feature.restype = ctypes.c_int
    return lib


_LIBRARY: Any = None
_UNAVAILABLE: str | None = None


def library() -> Any:
    """The loaded library (the checked build `make` left), once per process. Raises FusedUnavailable."""
    global _LIBRARY, _UNAVAILABLE
    if _LIBRARY is not None:
        return _LIBRARY
    if _UNAVAILABLE is not None:
        raise FusedUnavailable(_UNAVAILABLE)
    try:
        _LIBRARY = load(built_library())
    except FusedUnavailable as error:
        _UNAVAILABLE = str(error)
        raise
    return _LIBRARY


def unavailable_reason() -> str | None:
    """None when the fused kernel can run here, else why not."""
    try:
        library()
    except FusedUnavailable as error:
        return str(error)
    return None


def _address(tensor: Tensor) -> int:
    return tensor.data_ptr()


def _pointers(tensors: Sequence[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[_address(t) for t in tensors])


@dataclass
class Plan:
    """A NodeView (or a whole graph) as the kernel reads it: int64 indices, contiguous, kept alive here.

    Shapes: as gat.graph.Neighbourhoods and SparseFeatures; labels: [T2] of the last block's targets
    """

    problem: _Problem
    keep: tuple[Tensor, ...]
    outputs: int  # T2: the nodes whose loss and accuracy the kernel reports
    classes: int

    @classmethod
    def of(cls, x: SparseFeatures, blocks: Sequence[Neighbourhoods], labels: Tensor, heads: tuple[int, int],
           hidden: tuple[int, int], negative_slope: float, dtype: torch.dtype = torch.float32) -> "Plan":
        if len(blocks) != 2:
            raise ValueError(f"the fused kernel computes the two-layer GAT, got {len(blocks)} blocks")
        if unsupported(hidden):
            raise FusedUnavailable(unsupported(hidden))
        keep: list[Tensor] = []

        def held(t: Tensor, kind: torch.dtype = torch.int64) -> int:
            t = t.detach().to("cpu", kind).contiguous()
            keep.append(t)
            return _address(t)

        c_blocks = []
        for b in blocks:
            into = torch.arange(b.num_targets) if b.target_in_source is None else b.target_in_source
            c_blocks.append(_Block(b.num_targets, b.num_sources, b.num_edges, held(b.crow), held(b.source),
                                   held(into)))
        if blocks[0].num_sources != x.num_nodes or blocks[1].num_sources != blocks[0].num_targets:
            raise ValueError("the blocks do not chain: layer 1's sources must be x's rows, layer 2's its targets")
        if labels.numel() != blocks[1].num_targets:
            raise ValueError(f"{labels.numel()} labels for {blocks[1].num_targets} output nodes")
        # x by column as well (CSC: a stable sort keeps the rows ascending within each column), for ∂L/∂W: each entry's
        # row, CSR position and value.
        rows = torch.repeat_interleave(torch.arange(x.num_nodes, device=x.crow.device), x.crow.diff())  # [nnz]
        by_column = torch.sort(x.col, stable=True).indices  # [nnz]: CSR positions in column order
        ccol = torch.cat([x.col.new_zeros(1), torch.bincount(x.col, minlength=x.num_features).cumsum(0)])
        problem = _Problem(x.num_nodes, x.num_features, x.nnz, held(x.crow), held(x.col), held(x.values, dtype),
                           held(ccol), held(rows[by_column]), held(by_column),
                           (_Block * 2)(*c_blocks), (ctypes.c_int64 * 2)(*heads), (ctypes.c_int64 * 2)(*hidden),
                           held(labels), negative_slope, held(x.values[by_column], dtype))
        return cls(problem, tuple(keep), blocks[1].num_targets, hidden[1])


def _dropout(noise: ReplicaDropout | None) -> tuple[_Dropout, Any]:
    """The kernel's view of ReplicaDropout: numpy's next_uint64 and each replica's generator state."""
    if noise is None:
        return _Dropout(None, None, 0, 0, 1.0), None
    interfaces = [g.bit_generator.ctypes for g in noise.generators]
    states = (ctypes.c_void_p * len(interfaces))(*[i.state_address for i in interfaces])
    next_uint64 = {ctypes.cast(i.next_uint64, ctypes.c_void_p).value for i in interfaces}
    if len(next_uint64) != 1 or any(type(g.bit_generator) is not np.random.PCG64 for g in noise.generators):
        raise FusedUnavailable("the fused kernel draws from PCG64 generators only")
    return (_Dropout(next_uint64.pop(), ctypes.addressof(states), int(noise.threshold_top),
                     int(noise.threshold_rest), float(noise.scale)), states)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"the fused kernel failed in {what} (out of memory?)")


def model_plan(model: GAT, x: SparseFeatures, blocks: Sequence[Neighbourhoods], labels: Tensor,
               dtype: torch.dtype = torch.float32) -> Plan:
    """The plan of `model` (a gat.model.GAT) on one NodeView's structures."""
    hidden_layer, output_layer = model.hidden, model.output
    return Plan.of(x, blocks, labels, (hidden_layer.n_heads, output_layer.n_heads),
                   (hidden_layer.n_hidden, output_layer.n_hidden), hidden_layer.negative_slope, dtype)


def forward_backward(model: GAT, plan: Plan, noise: ReplicaDropout | None, dtype: torch.dtype = torch.float32,
                     threads: int = 1, lib: Any = None) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Loss [R], accuracy [R], logits [T2, R, C] and the gradient of the summed loss for every parameter.

    No optimiser step; the parameters are read in `dtype` (float32, or float64 for the gradient check). `lib`: a
    loaded build (the self-check's candidate), else this process's library().
    """
    lib = lib or library()
    parameters = [p.detach().to(dtype).contiguous() for p in model.parameters()]
    R = parameters[0].shape[0]
    grads = [torch.empty_like(p) for p in parameters]
    loss = torch.empty(R, dtype=dtype)
    accuracy = torch.empty(R, dtype=torch.float64)
    logits = torch.empty(R, plan.outputs, plan.classes, dtype=dtype)
    drop, _states = _dropout(noise)
    args = (ctypes.byref(plan.problem), R, _pointers(parameters))
    if dtype == torch.float32:
        status = lib.gat_train_step_f32(*args, None, None, None, ctypes.byref(drop), _address(loss),
                                        _address(accuracy), _address(logits), _pointers(grads), threads)
    else:
        status = lib.gat_train_step_f64(*args, ctypes.byref(drop), _address(loss), _address(accuracy),
                                        _address(logits), _pointers(grads), threads)
    _check(status, "forward_backward")
    return loss, accuracy, logits.transpose(0, 1), grads


def forward(model: GAT, plan: Plan, dtype: torch.dtype = torch.float32,
            threads: int = 1, lib: Any = None) -> tuple[Tensor, Tensor, Tensor]:
    """Without dropout: loss [R], accuracy [R] and logits [T2, R, C]."""
    lib = lib or library()
    parameters = [p.detach().to(dtype).contiguous() for p in model.parameters()]
    R = parameters[0].shape[0]
    loss = torch.empty(R, dtype=dtype)
    accuracy = torch.empty(R, dtype=torch.float64)
    logits = torch.empty(R, plan.outputs, plan.classes, dtype=dtype)
    run = lib.gat_evaluate_f32 if dtype == torch.float32 else lib.gat_evaluate_f64
    _check(run(ctypes.byref(plan.problem), R, _pointers(parameters), _address(loss), _address(accuracy),
               _address(logits), threads), "forward")
    return loss, accuracy, logits.transpose(0, 1)


class FusedTrainer:
    """Adam (coupled L2) on a GAT's parameters, stepped by the fused kernel; gat.training.train drives it.

    The model's parameters are updated in place, so checkpoints and the restored model work as with the
    torch kernel. The Adam moments live here, one [R, ...] tensor per parameter, as torch.optim.Adam keeps
    them; `keep` shrinks them with the batch. Replicas run on up to torch.get_num_threads() threads, each
    replica whole on one thread: the result does not depend on the thread count.

    Shapes: step() and validate() -> loss [R] float32, accuracy [R] float64
    """

    betas = (0.9, 0.999)
    eps = 1e-8

    def __init__(self, model: GAT, lr: float, weight_decay: float, train_view: Any, val_view: Any, lib: Any = None):
        self.lib = lib or library()
        self.model, self.lr, self.weight_decay = model, lr, weight_decay
        self.train_plan = model_plan(model, train_view.x, train_view.blocks, train_view.labels)
        self.val_plan = model_plan(model, val_view.x, val_view.blocks, val_view.labels)
        for p in model.parameters():
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                raise FusedUnavailable(f"the fused kernel trains contiguous float32 CPU parameters, got "
                                       f"{p.dtype} on {p.device}")
        self.exp_avg = [torch.zeros_like(p) for p in model.parameters()]
        self.exp_avg_sq = [torch.zeros_like(p) for p in model.parameters()]
        self.steps = 0
        # Pointer arrays for the native calls, made once per batch size (rebuilding them in every call cost more
        # than a tenth of the validation pass); `keep` replaces the tensors and clears them.
        self._pointers: tuple[int, Any, Any, Any] | None = None
        self._streams_of: tuple[ReplicaDropout | None, _Dropout, Any] | None = None

    def _tensors(self) -> tuple[int, Any, Any, Any]:
        """R, and the pointers to the parameters and both Adam moments."""
        if self._pointers is None:
            parameters = [p.data for p in self.model.parameters()]
            self._pointers = (parameters[0].shape[0], _pointers(parameters), _pointers(self.exp_avg),
                              _pointers(self.exp_avg_sq))
        return self._pointers

    def _streams(self, noise: ReplicaDropout | None) -> _Dropout:
        if self._streams_of is None or self._streams_of[0] is not noise:
            self._streams_of = (noise, *_dropout(noise))  # the states array is kept alive with the structure
        return self._streams_of[1]

    def step(self, noise: ReplicaDropout | None) -> tuple[Tensor, Tensor]:
        """One training step of every replica: loss and accuracy before it, under dropout."""
        R, parameters, exp_avg, exp_avg_sq = self._tensors()
        drop = self._streams(noise)
        self.steps += 1
        adam = _Adam(self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay, float(self.steps))
        loss, accuracy = torch.empty(R), torch.empty(R, dtype=torch.float64)
        _check(self.lib.gat_train_step_f32(
            ctypes.byref(self.train_plan.problem), R, parameters, exp_avg, exp_avg_sq, ctypes.byref(adam),
            ctypes.byref(drop), _address(loss), _address(accuracy), None, None, torch.get_num_threads()),
            "the training step")
        return loss, accuracy

    def validate(self) -> tuple[Tensor, Tensor]:
        """The validation pass: no dropout, loss and accuracy on the validation nodes."""
        R, parameters, _, _ = self._tensors()
        loss, accuracy = torch.empty(R), torch.empty(R, dtype=torch.float64)
        _check(self.lib.gat_evaluate_f32(ctypes.byref(self.val_plan.problem), R, parameters,
                                         _address(loss), _address(accuracy), None, torch.get_num_threads()),
               "the validation pass")
        return loss, accuracy

    def keep(self, replicas: Tensor, noise: ReplicaDropout | None) -> None:
        """Shrink the batch to the listed replicas: parameters, Adam moments and dropout streams."""
        self.model.keep_replicas(replicas)
        self.exp_avg = [m[replicas].contiguous() for m in self.exp_avg]
        self.exp_avg_sq = [v[replicas].contiguous() for v in self.exp_avg_sq]
        if noise is not None:
            noise.select(replicas)
        self._pointers = self._streams_of = None  # new tensors, fewer streams


LANE_WIDTHS = (1, 4, 8, 16)  # fused.cpp's native runs: 1 is the per-seed kernel (SeedRun), the others LaneRun<L>
PYTHON_LOOP = 0  # the epoch loop in Python around FusedTrainer (before the native loop; kept for comparisons)
DEFAULT_LANES = 1  # `make bench` measured the per-seed kernel in the native loop the fastest on Cora
LANES_VARIABLE = "GAT_FUSED_LANES"


def requested_lanes() -> int | None:
    """The lane width $GAT_FUSED_LANES asks `kernel: fused` to train with in the native loop (SeedLanes): unset,
    DEFAULT_LANES; 0 (PYTHON_LOOP) gives None, the epoch loop in Python (FusedTrainer). All give every seed the
    same bytes."""
    chosen = os.environ.get(LANES_VARIABLE, "").strip()
    if not chosen:
        return DEFAULT_LANES
    if not chosen.isdigit() or int(chosen) not in (PYTHON_LOOP, *LANE_WIDTHS):
        raise ValueError(f"{LANES_VARIABLE}={chosen!r} is not a lane width: use one of "
                         f"{', '.join(map(str, (PYTHON_LOOP, *LANE_WIDTHS)))}, or unset it")
    return None if int(chosen) == PYTHON_LOOP else int(chosen)


class SeedLanes:
    """A batch of seeds trained to the end in the native loop, seeds as the lanes of each vector (or, with `lanes`
    1, one seed at a time in the per-seed kernel).

    One call of tick() runs one epoch of every seed in a lane: the training step under dropout, Adam, the
    validation pass and the authors' early stopping (gat.training.EarlyStopping), saving a seed's checkpoint
    into `checkpoint` when both its validation figures improve. A lane whose seed stopped takes the batch's next
    seed, so up to `lanes` seeds train side by side however many the batch has; groups of lanes run on up to
    `threads` threads. With `lanes` 1 every seed of the batch trains from the first call, the seeds shared among the
    threads. Each lane computes what FusedTrainer computes for its seed, operation by operation: a seed's
    result does not depend on the batch, its lane, the lane width or the thread count.

    With `lanes` 1 the kernel keeps the paper's first W either by input feature (no transpose per pass, its Adam
    update row by row) or transposes it into its workspace in every pass, by this CPU's L2 cache (by feature with
    1.5 MB or more: measured faster on a 2 MB Intel Xeon, slower on a 1 MB AMD EPYC); the same bytes either way.
    `first_w_by_feature` overrides that choice (the tests run both).

    Shapes: checkpoint: the model's parameters [R, ...]; epochs, best_epoch: [R] int64; best_acc, best_loss:
    [R] float64; after each tick, train_loss and val_loss [R] float32, train_acc and val_acc [R] float64, and
    epoch_of [R] int64 (the epoch each seed just trained, 0 for those that did not train in it)
    """

    def __init__(self, model: GAT, lr: float, weight_decay: float, max_epochs: int, patience: int,
                 train_view: Any, val_view: Any, noise: ReplicaDropout | None, lanes: int,
                 threads: int = 1, lib: Any = None, first_w_by_feature: bool | None = None):
        self._run = None
        if lanes not in LANE_WIDTHS:
            raise ValueError(f"lanes must be one of {LANE_WIDTHS}, got {lanes}")
        if first_w_by_feature is not None and lanes != 1:
            raise ValueError("first_w_by_feature chooses the per-seed kernel's layout: it needs lanes of 1")
        self.lib = lib or library()
        self.train_plan = model_plan(model, train_view.x, train_view.blocks, train_view.labels)
        self.val_plan = model_plan(model, val_view.x, val_view.blocks, val_view.labels)
        self.init = [p.detach().contiguous() for p in model.parameters()]
        for p in self.init:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise FusedUnavailable(f"the fused kernel trains float32 CPU parameters, got {p.dtype} on {p.device}")
        self.checkpoint = [p.clone() for p in self.init]  # a seed that never saves keeps its initial weights
        R = self.init[0].shape[0]
        self.epochs = np.full(R, max_epochs, dtype=np.int64)
        self.best_epoch = np.zeros(R, dtype=np.int64)
        self.best_acc, self.best_loss = np.zeros(R), np.zeros(R)
        self.train_loss, self.val_loss = np.zeros(R, dtype=np.float32), np.zeros(R, dtype=np.float32)
        self.train_acc, self.val_acc = np.zeros(R), np.zeros(R)
        self.epoch_of = np.zeros(R, dtype=np.int64)
        self._init_pointers, self._checkpoint_pointers = _pointers(self.init), _pointers(self.checkpoint)
        drop, self._states = _dropout(noise)
        self._noise = noise  # the kernel draws from its generators' states, which must outlive the run
        self._spec = _LaneRunSpec(
            ctypes.addressof(self.train_plan.problem), ctypes.addressof(self.val_plan.problem), R,
            ctypes.addressof(self._init_pointers), ctypes.addressof(self._checkpoint_pointers), drop,
            lr, FusedTrainer.betas[0], FusedTrainer.betas[1], FusedTrainer.eps, weight_decay, max_epochs, patience,
            self.epochs.ctypes.data, self.best_epoch.ctypes.data, self.best_acc.ctypes.data,
            self.best_loss.ctypes.data)
        self.lanes = lanes
        if first_w_by_feature is None:  # the kernel's choice (by this CPU's L2 cache, with lanes of 1)
            self._run = self.lib.gat_lanes_new(ctypes.byref(self._spec), lanes, threads)
        else:
            self._run = self.lib.gat_seeds_new(ctypes.byref(self._spec), int(first_w_by_feature), threads)
        if not self._run:
            raise FusedUnavailable(f"the lane kernel could not start {R} seeds in lanes of {self.lanes}")

    def tick(self) -> int:
        """One epoch of every seed in a lane; returns how many trained (0: every seed has stopped)."""
        if not self._run:
            raise RuntimeError("this SeedLanes run is closed")
        trained = self.lib.gat_lanes_tick(self._run, self.train_loss.ctypes.data, self.train_acc.ctypes.data,
                                          self.val_loss.ctypes.data, self.val_acc.ctypes.data,
                                          self.epoch_of.ctypes.data)
        if trained < 0:
            raise RuntimeError("the fused kernel failed in an epoch of the lanes (out of memory?)")
        return int(trained)

    @property
    def validation_seconds(self) -> float:
        """Time the ticks so far spent in validation passes, summed over threads (the rest is the training steps
        and the early-stopping bookkeeping)."""
        if not self._run:
            raise RuntimeError("this SeedLanes run is closed")
        return self.lib.gat_lanes_validation_ns(self._run) / 1e9

    def close(self) -> None:
        """Free the native run (its lanes' parameters and moments); the checkpoints and results stay."""
        if self._run:
            self.lib.gat_lanes_free(self._run)
            self._run = None

    def __del__(self) -> None:
        self.close()


_FALLBACK_SAID = False


def fallback_warning(reason: str) -> None:
    """Say once per process that training runs on the torch kernel, and why (a FusedFallbackWarning)."""
    global _FALLBACK_SAID
    if not _FALLBACK_SAID:
        _FALLBACK_SAID = True
        # One line wherever it is shown (a stage, a worker): no source line under it (line 0 has none).
        warnings.warn_explicit(f"the fused kernel is unavailable ({reason}); training with the torch kernel instead",
                               FusedFallbackWarning, filename="gat.fused", lineno=0, module="gat.fused")
