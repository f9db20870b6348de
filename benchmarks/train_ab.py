"""This checkout's whole training loop against an earlier commit's, as a reproduce worker runs it, taking turns.

    python -m benchmarks.train_ab --against 1074697     # issue 22's starting point: the Python epoch loop

kernel_ab compares two commits' kernels under this checkout's Python; this compares everything a batch of seeds
runs through: each side's own `gat.training.train` with `kernel: fused` and its defaults (this checkout: the native
epoch loop; an older commit: whatever it had), its own kernel built by its own `tools.build_fused`. The older
commit's tree (`git archive`) and its kernel go to a temporary folder; nothing is written in the repository.

Each sample is one fresh process per side (its start-up not timed): a warm-up of 3 epochs, then `--seeds` seeds
for `--epochs` epochs on one thread, patience above the run's length so that no seed stops early, timed in the
process's CPU time (stages.reproduce runs one single-threaded worker per core). The sides take turns `--rounds`
times, the order swapping each round. Prints each side's seed-epochs per CPU second, median [min-max], and the
ratio of the medians; each side's checkpoints are compared too, since both must train the same bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Sequence

from benchmarks.data import default_data_dir
from benchmarks.kernel_ab import REPO_ROOT, turns
from stages.support import interrupts
from stages.support.local_pool import PR_SET_PDEATHSIG
from stages.support.params import StageError

# Run by each side's Python in its own tree: only what both this checkout and issue 22's starting point have.
MEASURE = """
import dataclasses, hashlib, json, sys, time, warnings
from pathlib import Path
import torch
from benchmarks.data import load_graph, protocol
from gat import fused
from gat.config import OptimConfig
from gat.training import GraphTensors, train
warnings.simplefilter("error", fused.FusedFallbackWarning)
seeds, epochs, folder, verify = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "verify"
reason = fused.unavailable_reason()
if reason is not None:
    sys.exit(f"error: the fused kernel is unavailable here ({reason})")
torch.set_num_threads(1)
paper = protocol()
tensors = GraphTensors.from_graph(load_graph(folder, verify=verify))
optim = OptimConfig(paper.optim.lr, paper.optim.weight_decay, max_epochs=epochs, patience=epochs + 1, kernel="fused")
train(tensors, paper.model, dataclasses.replace(optim, max_epochs=3, patience=4), range(seeds))
start = time.process_time()
result = train(tensors, paper.model, optim, range(seeds))
cpu = time.process_time() - start
weights = hashlib.sha256(b"".join(t.numpy().tobytes() for t in result.model.state_dict().values())).hexdigest()
print(json.dumps({"cpu_s": cpu, "weights": weights}))
"""


def unpack_revision(revision: str, folder: Path) -> Path:
    """`revision`'s tree (`git archive`) in `folder`."""
    archive = folder / "tree.tar"
    with archive.open("wb") as out:
        made = subprocess.run(["git", "archive", revision], cwd=REPO_ROOT, stdout=out, stderr=subprocess.PIPE)
    if made.returncode != 0:
        raise StageError(f"git has no commit {revision!r}: pass a commit of this repository (e.g. `--against HEAD~1`)")
    tree = folder / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    archive.unlink()
    return tree


def side_environment(fused_dir: Path | None, one_thread: bool = True) -> dict[str, str]:
    """The environment of a measuring process: one thread (unless not `one_thread`: then the user's settings, as a
    stage gets them), the side's default loop ($GAT_FUSED_LANES unset), and its kernel in `fused_dir` (None: where
    this checkout's `make` put it)."""
    env = {key: value for key, value in os.environ.items() if key != "GAT_FUSED_LANES"}
    if one_thread:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if fused_dir is not None:
        env["GAT_FUSED_DIR"] = str(fused_dir)
    return env


def die_with_this_process() -> None:
    """In a child, before it runs: the kernel kills it (SIGKILL) when the process that started it dies, so that a
    comparison killed outright leaves no training behind. (SIGTERM and Ctrl-C stop it in order: see main.)"""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def build_older_kernel(tree: Path, revision: str) -> Path:
    """The older tree's kernel, built by its own tools.build_fused into `tree`/gat-fused."""
    fused_dir = tree / "gat-fused"
    built = subprocess.run([sys.executable, "-m", "tools.build_fused"], cwd=tree, env=side_environment(fused_dir),
                           capture_output=True, text=True, preexec_fn=die_with_this_process)
    if built.returncode != 0:
        lines = (built.stderr or built.stdout).strip().splitlines() or ["?"]
        raise StageError(f"{revision}'s kernel does not build here: {lines[-1]}")
    return fused_dir


def measure(tree: Path, fused_dir: Path | None, seeds: int, epochs: int, data_dir: Path, verify: bool) -> dict:
    """One sample of `tree`'s training loop (MEASURE in a fresh process) on Cora's files in `data_dir`, checked
    against their checksums when `verify`."""
    arguments = [str(seeds), str(epochs), str(data_dir), "verify" if verify else "trust"]
    ran = subprocess.run([sys.executable, "-c", MEASURE, *arguments], cwd=tree,
                         env=side_environment(fused_dir), capture_output=True, text=True,
                         preexec_fn=die_with_this_process)
    if ran.returncode != 0:
        lines = ran.stderr.strip().splitlines() or ["?"]
        raise StageError(f"training in {tree} failed: {lines[-1]}")
    return json.loads(ran.stdout.strip().splitlines()[-1])


def take_turns(sides: dict[str, tuple[Path, Path | None]], seeds: int, epochs: int, rounds: int,
               data_dir: Path, verify: bool = True) -> dict[str, list[dict]]:
    """`rounds` samples of each side (name: (tree, kernel folder)), the order swapping every round."""
    samples: dict[str, list[dict]] = {name: [] for name in sides}
    for round_ in range(rounds):
        for name in turns(list(sides), round_):
            samples[name].append(measure(*sides[name], seeds, epochs, data_dir, verify))
    return samples


def comparison(samples: dict[str, list[dict]], seeds: int, epochs: int) -> dict:
    """Each side's seed-epochs per CPU second (samples and median), the ratio of the first side's median to the
    second's, and whether every sample trained the same weights."""
    rates = {name: [seeds * epochs / sample["cpu_s"] for sample in runs] for name, runs in samples.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    this, older = list(samples)
    return {"seeds_per_batch": seeds, "epochs": epochs, "threads": 1, "clock": "process CPU time",
            "seed_epochs_per_s": medians, "seed_epochs_per_s_samples": rates, "speedup": medians[this] / medians[older],
            "same_weights": len({sample["weights"] for runs in samples.values() for sample in runs}) == 1}


def summary(compared: dict) -> list[str]:
    """Lines: each side's seed-epochs per CPU second, median [min-max], the ratio, and whether the weights agree."""
    rates, medians = compared["seed_epochs_per_s_samples"], compared["seed_epochs_per_s"]
    lines = [f"seed-epochs per CPU second, {name}: {medians[name]:.0f} [{min(values):.0f}-{max(values):.0f}]"
             for name, values in rates.items()]
    this, older = list(rates)
    lines.append(f"{this} / {older} = {compared['speedup']:.3f}")
    lines.append("the same weights in every sample" if compared["same_weights"]
                 else "the weights differ between samples")
    return lines


def against_revision(revision: str, seeds: int, epochs: int, rounds: int, data_dir: Path | None,
                     verify: bool = True) -> dict:
    """This checkout against `revision` (comparison), on Cora's files in `data_dir` (None: the default)."""
    with tempfile.TemporaryDirectory(prefix="gat-train-ab-") as folder:
        tree = unpack_revision(revision, Path(folder))
        data_dir = (data_dir or default_data_dir()).resolve()
        sides = {"this checkout": (REPO_ROOT, None), revision: (tree, build_older_kernel(tree, revision))}
        compared = comparison(take_turns(sides, seeds, epochs, rounds, data_dir, verify), seeds, epochs)
    return {"against": revision, "rounds": rounds, **compared}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the commit whose training loop to compare with")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per batch (reproduce.seeds_per_batch)")
    parser.add_argument("--epochs", type=int, default=300, help="epochs per sample, every seed training in each")
    parser.add_argument("--rounds", type=int, default=5, help="samples per side, taking turns")
    parser.add_argument("--data-dir", type=Path, default=None, help="Cora's raw files (default: the shared copy)")
    parser.add_argument("--no-verify", action="store_true", help="skip the checksum check of the raw files")
    args = parser.parse_args(argv)

    def run() -> None:
        for flag in ("seeds", "epochs", "rounds"):
            if getattr(args, flag) < 1:
                raise StageError(f"--{flag} must be at least 1, not {getattr(args, flag)}")
        compared = against_revision(args.against, args.seeds, args.epochs, args.rounds, args.data_dir,
                                    verify=not args.no_verify)
        print("\n".join(summary(compared)))

    # SIGTERM, Ctrl-C or a dead parent: one line, the measuring process killed, the temporary tree removed.
    interrupts.main(run, stopping="stopping; the measuring process is killed and the temporary tree removed.")


if __name__ == "__main__":
    main()
