"""Train one GAT with the paper's protocol; log every epoch to MLflow and to a DVC plots file.

    python -m stages.train --data data/prepared/cora --out data/train

Writes `model.pt` (gat.model.model_state), `history.csv` (one row per epoch) and `run.json`
(the MLflow run that the evaluate stage completes, so a configuration is one row, and when
training stopped). MLflow gets the per-epoch curves as `epoch_*` step metrics and a PNG, and
the model, named `gat-<dataset>`.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
from pathlib import Path
from unittest.mock import patch

import mlflow
import torch

import gat
from gat.config import ModelConfig, training_memory_bytes
from gat.model import NodeClassifier, model_state
from gat.training import EpochMetrics, GraphTensors, train
from stages.support.redaction import redact
from stages.support.figures import curves_figure
from stages.support.files import load_prepared, outputs_together, write_atomic, write_csv, write_json
from stages.support.interrupts import main
from stages.support.params import ArgumentParser, device_for, fail, load_params
from stages.support.progress import Progress
from stages.support.store import NOTE, TRAIN_EXPERIMENT, model_name
from stages.support.tracking import (EpochLogger, describe_run, log_dataset, logged_params, split_seed, stage_run,
                                     standard_tags)

GIB = 2**30
# The logged model's code, which MLflow copies into the model and runs when it loads it.
SERVED_MODEL = str(Path(__file__).with_name("support") / "served_model.py")


def available_memory(device: torch.device) -> int:
    """Bytes this process may still allocate: free GPU memory, or the kernel's MemAvailable within the
    cgroup's limit (a container's memory.max) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        cgroup = Path("/sys/fs/cgroup")
        cgroup_limit = (cgroup / "memory.max").read_text().strip()
        if cgroup_limit != "max":
            available.append(int(cgroup_limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    try:  # `ulimit -v`: the address space left
        import resource

        address_limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if address_limit != resource.RLIM_INFINITY:
            status = Path("/proc/self/status").read_text()
            used = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))
            available.append(address_limit - used)
    except (OSError, ValueError, StopIteration):
        pass
    return max(0, min(available)) if available else 2**62


def memory_problem(config: ModelConfig, key: str, graph_sizes: tuple[int, int, int, int], dataset: str,
                   device: torch.device, replicas: int = 1) -> str:
    """The sentence that says what training needs against what there is (see gat.config.training_memory_bytes).

    graph_sizes: nodes, features, classes and edges (without self-loops).
    """
    nodes, features, classes, edges = graph_sizes
    needed = training_memory_bytes(config, nodes, features, classes, replicas, num_edges=edges)
    return (f"params.yaml: `{key}` ({config.heads} heads x {config.hidden_features} hidden features) needs about "
            f"{needed / GIB:.1f} GiB to train on {dataset} ({nodes:,} nodes, {features:,} features), but "
            f"{'the GPU' if device.type == 'cuda' else 'this machine'} has {available_memory(device) / GIB:.1f} GiB "
            f"available: lower `{key}.hidden_features` or `{key}.heads`")


def run() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, type=Path, help="a preprocess output folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    params = load_params()
    settings = params.train
    device = device_for(settings.device, "train.device")
    graph, meta = load_prepared(args.data, settings.dataset)
    # Before any work and before the run opens: a model too big for the memory ends in a MemoryError (or the
    # OOM killer) minutes later.
    sizes = (graph.num_nodes, graph.num_features, graph.num_classes, graph.edge_index.shape[1])
    if training_memory_bytes(settings.model, *sizes[:3], num_edges=sizes[3]) > available_memory(device):
        fail(f"{memory_problem(settings.model, 'train.model', sizes, settings.dataset, device)}.")
    tensors = GraphTensors.from_graph(graph, device)

    tags = standard_tags(settings.dataset, meta["source_sha256"], split_seed(meta))
    run_name = f"{settings.dataset}-{tags.get('dvc_exp_name', f'seed{settings.seed}')}"
    logged = logged_params(params, "train", settings.dataset)  # every value that shapes this run, the data's too
    tags[NOTE] = describe_run(f"GAT trained on {settings.dataset} with seed {settings.seed} (stages train and "
                              "evaluate): the metrics are the restored checkpoint's; `epoch_*` are the per-epoch "
                              f"curves; the model is `{model_name(settings.dataset)}`.", logged)
    with stage_run(TRAIN_EXPERIMENT, run_name, tags) as active:
        mlflow.log_params(logged)
        graph_source = params.graph(settings.dataset)
        log_dataset(settings.dataset, redact(params.download.base_url if graph_source is None else graph_source.source),
                    meta["source_sha256"], context="training")
        history: list[dict] = []
        with Progress(f"train {settings.dataset}", "epochs") as progress, \
                EpochLogger(active.info.run_id) as logger:
            def on_epoch(m: EpochMetrics) -> None:
                row = {"epoch": m.epoch, "train_loss": m.train_loss.item(), "train_acc": m.train_acc.item(),
                       "val_loss": m.val_loss.item(), "val_acc": m.val_acc.item()}
                history.append(row)
                # epoch_*: the curves never share a key with the restored model's val_acc, which evaluate logs.
                logger.log({("epoch" if key == "epoch" else f"epoch_{key}"): value for key, value in row.items()})
                progress.update(postfix={"val_acc": f"{row['val_acc']:.3f}", "val_loss": f"{row['val_loss']:.3f}"})

            try:
                result = train(tensors, settings.model, settings.optim, [settings.seed], on_epoch)
            except (MemoryError, RuntimeError) as error:  # the estimate was short, or memory went elsewhere
                # torch's CPU allocator raises a RuntimeError ("DefaultCPUAllocator: can't allocate memory"),
                # CUDA's torch.OutOfMemoryError (a RuntimeError too); any other RuntimeError is a bug: re-raised.
                if not (isinstance(error, (MemoryError, torch.OutOfMemoryError))
                        or "can't allocate memory" in str(error)):
                    raise
                fail(f"out of memory while training (the estimate fell short, or other processes took the memory): "
                     f"{memory_problem(settings.model, 'train.model', sizes, settings.dataset, device)}.")

        epochs, best_epoch = int(result.epochs[0]), int(result.best_epoch[0])
        mlflow.log_metrics({"epochs": epochs, "best_epoch": best_epoch})
        # What trained it: `train.optim.kernel` is what was asked for; a fallback to torch (no compiler, a build that
        # failed its self-check, a model too wide for the fused kernel) rounds differently, so the run says so.
        mlflow.set_tag("training_kernel", result.kernel)
        mlflow.log_figure(curves_figure(history, best_epoch, f"{settings.dataset}, seed {settings.seed}"),
                          "training_curves.png")
        model = result.model.cpu()
        classifier = NodeClassifier(model, tensors.x.to("cpu"), tensors.neighbourhoods.to("cpu"))
        example = graph.test_idx[:5].numpy()
        buffer = io.BytesIO()
        torch.save(model_state(model, graph.num_features, graph.num_classes, [settings.seed]), buffer)
        logged_model = log_served_model(buffer.getvalue(), args.data / "graph.pt", settings.dataset, graph.num_nodes,
                                        example, classifier(torch.from_numpy(example)).numpy())

        with outputs_together():
            write_atomic(args.out / "model.pt", buffer.getvalue())
            write_csv(args.out / "history.csv", history)
            write_json(args.out / "run.json", {"run_id": active.info.run_id,
                                              "experiment_id": active.info.experiment_id,
                                              "model": model_name(settings.dataset),
                                              "model_uri": logged_model.model_uri, "epochs": epochs,
                                              "best_epoch": best_epoch})
    print(f"{settings.dataset}: stopped after {epochs} epochs, restored epoch {best_epoch} "
          f"(val acc {float(result.best_val_acc[0]):.4f}) -> {args.out}")


def log_served_model(state: bytes, graph_file: Path, dataset: str, num_nodes: int, example, output):
    """Log `gat-<dataset>` as a models-from-code pyfunc (stages/support/served_model.py) with the weights and the
    graph as tensor files: loading it unpickles no object, and MLflow recommends it over the pytorch flavour's
    pickle (which warns on every save; pt2 export, the other option, cannot trace the sparse CSR features)."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    quiet = logging.getLogger("mlflow.pyfunc")
    level = quiet.level
    no_progress_bar = patch.dict(os.environ, {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"})
    with tempfile.TemporaryDirectory() as folder, no_progress_bar:
        (Path(folder) / "model.pt").write_bytes(state)
        # The dataset's name, for the served model's error messages: a file, not `model_config`, which MLflow also
        # logs as run params (a `dataset` param beside params.yaml's dotted keys).
        (Path(folder) / "dataset.txt").write_text(dataset)
        # No input schema: MLflow's scoring server would cast the JSON to it (1.9 to node 1) before the model
        # sees it; served_model.node_ids checks the ids instead, and the MLmodel's metadata says what they are.
        signature = ModelSignature(inputs=None, outputs=Schema([TensorSpec(output.dtype, (-1, output.shape[1]))]))
        # "INFO Validating input example against model signature", and a progress bar per artifact copied into
        # the model: two lines a clean run has no use for. A warning still shows.
        quiet.setLevel(logging.WARNING)
        try:
            return mlflow.pyfunc.log_model(
                name=model_name(dataset), python_model=SERVED_MODEL, code_paths=[str(Path(gat.__file__).parent)],
                artifacts={"model": str(Path(folder) / "model.pt"), "graph": str(graph_file),
                           "dataset": str(Path(folder) / "dataset.txt")},
                signature=signature, input_example=example,
                metadata={"input": f"node ids: a non-empty list of int64 from 0 to {num_nodes - 1}"},
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"])
        finally:
            quiet.setLevel(level)


if __name__ == "__main__":
    main(run)
