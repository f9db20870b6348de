"""gat.analysis and the analyze stage: entropy bounds, example nodes, neighbourhoods, t-SNE, deterministic
pictures, and (end to end, on the tiny pipeline) the PNGs and metrics logged into the training run."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_support import Pipeline

from gat.analysis import (_neighbour_graph, attention_entropy, confusion_counts, neighbourhood, pairwise_distances,
                          pca_init, pick_examples, portable_inspect, row_shares, silhouette, tsne, two_hop_sizes,
                          uniform_entropy)
from gat.config import ModelConfig
from gat.graph import Neighbourhoods, SparseFeatures
from gat.model import GAT
from stages.support.store import TRAIN_EXPERIMENT

N, F_IN, C = 30, 10, 3
CONFIG = ModelConfig(hidden_features=4, heads=3, output_heads=2, dropout=0.6, leaky_relu_negative_slope=0.2)


@pytest.fixture(scope="module")
def graph() -> tuple[SparseFeatures, Neighbourhoods]:
    generator = torch.Generator().manual_seed(2)
    x = torch.rand(N, F_IN, generator=generator) * (torch.rand(N, F_IN, generator=generator) < 0.5)
    pairs = torch.randint(0, N, (2, 50), generator=generator)
    return SparseFeatures.from_csr(x), Neighbourhoods.from_edge_index(torch.cat([pairs, pairs.flip(0)], 1), N)


@pytest.fixture(scope="module")
def attention(graph) -> list[torch.Tensor]:
    model = GAT(CONFIG, F_IN, C, seeds=[0]).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0).add_(0.1)  # sharper than at initialisation: entropies well below uniform
    return model.attention(*graph)


# Entropy ---------------------------------------------------------------------------------------------------------

def test_entropy_lies_between_zero_and_uniform(graph, attention) -> None:
    _x, neighbourhoods = graph
    uniform = uniform_entropy(neighbourhoods)
    assert torch.equal(uniform, neighbourhoods.degree.double().log())
    for alpha in attention:
        entropy = attention_entropy(alpha[:, 0], neighbourhoods)  # [N, H]
        assert entropy.shape == (N, alpha.shape[2])
        assert (entropy >= 0).all()
        assert (entropy <= uniform[:, None] + 1e-9).all()
        assert (entropy < uniform[:, None] - 1e-3).any()  # learned attention is not uniform here


def test_entropy_reaches_its_bounds_at_uniform_and_one_hot_attention(graph) -> None:
    _x, neighbourhoods = graph
    degree = neighbourhoods.degree[neighbourhoods.target].double()
    even = (1.0 / degree)[:, None]  # [E, 1]
    torch.testing.assert_close(attention_entropy(even, neighbourhoods)[:, 0], uniform_entropy(neighbourhoods))
    self_only = (neighbourhoods.source == neighbourhoods.target).double()[:, None]
    assert torch.equal(attention_entropy(self_only, neighbourhoods), torch.zeros(N, 1, dtype=torch.float64))
    # A hand-made case: a node with three neighbours and α = (1/2, 1/4, 1/4) has entropy 1.5 log 2.
    tiny = Neighbourhoods.from_edge_index(torch.tensor([[1, 2], [0, 0]]), 3)  # edges 1 -> 0, 2 -> 0
    alpha = torch.tensor([[0.5], [0.25], [0.25], [1.0], [1.0]])  # node 0: sources 0, 1, 2; then 1 and 2 alone
    assert attention_entropy(alpha, tiny)[:, 0].tolist() == pytest.approx([1.5 * math.log(2), 0.0, 0.0])


# Neighbourhoods and examples ---------------------------------------------------------------------------------------

def test_neighbourhood_holds_two_hops_with_the_alpha_towards_the_centre() -> None:
    # A path 0 - 1 - 2 - 3 - 4 and a branch 1 - 5: around node 2, nodes 1 and 3 are one hop away, 0, 4, 5 two.
    undirected = torch.tensor([[0, 1, 2, 3, 1], [1, 2, 3, 4, 5]])
    neighbourhoods = Neighbourhoods.from_edge_index(torch.cat([undirected, undirected.flip(0)], 1), 6)
    E = neighbourhoods.num_edges
    first = torch.arange(E, dtype=torch.float32).view(E, 1, 1).expand(E, 1, 2).contiguous()  # α = edge id
    second = 100 + torch.arange(E, dtype=torch.float32).view(E, 1, 1)
    view = neighbourhood(neighbourhoods, [first, second], centre=2)
    assert view.nodes.tolist() == [0, 1, 2, 3, 4, 5]
    assert view.hops.tolist() == [2, 1, 0, 1, 2, 2]
    edge_id = {(int(j), int(i)): e for e, (j, i) in enumerate(zip(neighbourhoods.source, neighbourhoods.target))}
    drawn = {tuple(edge): float(a) for edge, a in zip(view.edges.tolist(), view.alpha)}
    # Into the centre: layer 2's α; into a neighbour (from the centre too): layer 1's; never a self-loop.
    assert drawn == {(1, 2): 100 + edge_id[1, 2], (3, 2): 100 + edge_id[3, 2], (0, 1): edge_id[0, 1],
                     (5, 1): edge_id[5, 1], (2, 1): edge_id[2, 1], (2, 3): edge_id[2, 3], (4, 3): edge_id[4, 3]}
    assert two_hop_sizes(neighbourhoods).tolist() == [4, 5, 6, 4, 3, 4]


def test_examples_are_half_wrong_deterministic_and_readable() -> None:
    test_idx = torch.arange(100, 120)
    correct = torch.tensor([True] * 14 + [False] * 6)
    sizes = torch.full((120,), 10)
    sizes[100] = 500  # too large to draw: not picked while others are
    chosen = pick_examples(test_idx, correct, sizes, count=5, max_nodes=40)
    assert chosen == pick_examples(test_idx, correct, sizes, count=5, max_nodes=40)
    assert len(set(chosen)) == 5 and 100 not in chosen
    assert sum(not bool(correct[n - 100]) for n in chosen) == 2
    # Fewer wrong nodes than half: every wrong one, the rest right; fewer right ones: the rest wrong.
    one_wrong = pick_examples(test_idx, torch.arange(20) != 3, sizes, 6, 40)
    assert 103 in one_wrong and len(set(one_wrong)) == 6
    one_right = pick_examples(test_idx, torch.arange(20) == 0, sizes, 8, 40)
    assert 100 in one_right and len(set(one_right)) == 8  # the only right one, too large or not
    with pytest.raises(ValueError, match="only 20"):
        pick_examples(test_idx, correct, sizes, count=21, max_nodes=40)


# The embedding map ---------------------------------------------------------------------------------------------------

def test_tsne_is_reproducible_and_silhouette_sees_separated_classes() -> None:
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(60) % 3
    embedding = torch.randn(60, 8, generator=generator) * 0.3 + 5.0 * torch.eye(8)[labels]
    points = tsne(embedding, perplexity=10.0, max_iter=250)
    assert points.shape == (60, 2) and np.isfinite(points).all()
    assert np.array_equal(points, tsne(embedding, perplexity=10.0, max_iter=250))
    assert silhouette(embedding, labels) > 0.8
    assert silhouette(points, labels) > 0.5
    assert abs(silhouette(embedding, torch.randperm(60, generator=generator) % 3)) < 0.2
    with pytest.raises(ValueError, match="perplexity"):
        tsne(embedding, perplexity=60.0, max_iter=250)


# The same bytes on every CPU ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["gat", "gatv2", "constant"])
def test_portable_inspect_computes_what_the_model_does(graph, variant: str) -> None:
    model = GAT(dataclasses.replace(CONFIG, attention=variant), F_IN, C, seeds=[0]).eval()  # two output heads
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.split(".")[-1].startswith("b"):  # non-zero biases: each enters the formula
                parameter.add_(0.1)
    inside, portable = model.inspect(*graph), portable_inspect(model, *graph)
    assert (portable.hidden < 0).any()  # ELU's negative side is exercised
    np.testing.assert_allclose(portable.hidden, inside.hidden[:, 0].double().numpy(), rtol=1e-5, atol=1e-6)
    for ours, torchs in zip(portable.attention, inside.attention, strict=True):
        torch.testing.assert_close(ours, torchs.double(), rtol=1e-5, atol=1e-6)


def test_distances_and_pca_init_are_exact_and_agree_with_scikit_learn() -> None:
    from scipy.spatial.distance import cdist
    from sklearn.decomposition import PCA

    data = np.random.default_rng(0).normal(size=(50, 6)) * np.arange(6, 0, -1)
    distances = pairwise_distances(data)
    assert np.array_equal(distances, distances.T) and not distances.diagonal().any()
    np.testing.assert_allclose(distances, cdist(data, data), rtol=1e-12, atol=1e-12)
    reference = PCA(2, svd_solver="full").fit_transform(data).astype(np.float32)
    np.testing.assert_allclose(pca_init(data), reference / np.std(reference[:, 0]) * 1e-4, rtol=1e-4, atol=1e-9)


def test_neighbours_come_each_point_first_then_by_distance_and_index() -> None:
    points = np.array([[0.0], [1.0], [0.0], [2.0], [1.0]])  # 0 and 2, 1 and 4 coincide
    graph = _neighbour_graph(pairwise_distances(points), 3)
    assert graph.indices.reshape(5, 4).tolist() == [[0, 2, 1, 4], [1, 4, 0, 2], [2, 0, 1, 4], [3, 1, 4, 0],
                                                    [4, 1, 0, 2]]
    assert graph.data.reshape(5, 4)[:, 0].tolist() == [0.0] * 5


PROBE = """
import hashlib, sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from gat.analysis import attention_entropy, portable_inspect, silhouette, tsne
from gat.config import ModelConfig
from gat.graph import Neighbourhoods, SparseFeatures
from gat.model import GAT
N, F_IN, C = 120, 40, 3
generator = torch.Generator().manual_seed(5)
features = torch.rand(N, F_IN, generator=generator) * (torch.rand(N, F_IN, generator=generator) < 0.3)
pairs = torch.randint(0, N, (2, 400), generator=generator)
x = SparseFeatures.from_csr(features)
neighbourhoods = Neighbourhoods.from_edge_index(torch.cat([pairs, pairs.flip(0)], 1), N)
model = GAT(ModelConfig(hidden_features=8, heads=8, output_heads=1, dropout=0.6, leaky_relu_negative_slope=0.2),
            F_IN, C, seeds=[3]).eval()
inside = portable_inspect(model, x, neighbourhoods)
hidden = torch.from_numpy(inside.hidden)
points = tsne(hidden, perplexity=10.0, max_iter=250)
labels = torch.arange(N) % C
for value in (inside.hidden, *[a.numpy() for a in inside.attention], points,
              attention_entropy(inside.attention[0][:, 0], neighbourhoods).numpy(),
              np.array([silhouette(hidden, labels), silhouette(points, labels)])):
    print(hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest())
"""


def test_the_analysis_is_the_same_bytes_under_scalar_and_vector_kernels() -> None:
    """torch's scalar and AVX2 kernels, numpy with and without its AVX2/AVX-512 loops, MKL capped at AVX2."""
    import os
    import subprocess
    import sys

    from test_portability import AVX2, SCALAR

    env = {key: value for key, value in os.environ.items() if key not in {*AVX2, *SCALAR}}
    hashes = [subprocess.run([sys.executable, "-c", PROBE, str(Path(__file__).parents[1])], env=env | cpu, check=True,
                             capture_output=True, text=True, timeout=300).stdout.split() for cpu in (AVX2, SCALAR)]
    assert len(hashes[0]) == 6 and hashes[0] == hashes[1]


def test_the_confusion_matrix_is_scikit_learns_to_the_last_bit() -> None:
    """confusion_counts leaves out nodes without a class (-1); row_shares normalises as scikit-learn does, an empty
    row (a class without test nodes) included."""
    from sklearn.metrics import confusion_matrix

    generator = np.random.default_rng(0)
    actual, predicted = generator.integers(-1, 4, size=500), generator.integers(0, 5, size=500)
    counts = confusion_counts(actual, predicted, 5)
    assert counts.dtype == np.int64
    assert counts.tolist() == confusion_matrix(actual, predicted, labels=list(range(5))).tolist()
    assert counts[4].sum() == 0
    expected = confusion_matrix(actual, predicted, labels=list(range(5)), normalize="true")
    assert row_shares(counts).tobytes() == expected.tobytes()


# Pictures --------------------------------------------------------------------------------------------------------

def _pictures(graph, attention) -> dict[str, bytes]:
    from stages.support.figures import entropy_figure, neighbourhood_figure, png_bytes

    _x, neighbourhoods = graph
    entropy = [attention_entropy(alpha[:, 0], neighbourhoods).numpy() for alpha in attention]
    labels = torch.arange(N) % C
    views = [neighbourhood(neighbourhoods, attention, node) for node in (0, 7)]
    return {"entropy": png_bytes(entropy_figure(entropy, uniform_entropy(neighbourhoods).numpy(), "entropy")),
            "views": png_bytes(neighbourhood_figure(views, labels, (labels + 1) % C, ["a", "b", "c"], "views"))}


def test_pictures_are_the_same_bytes_every_time_and_carry_no_version(graph, attention) -> None:
    from PIL import Image

    first, second = _pictures(graph, attention), _pictures(graph, attention)
    assert first == second
    for name, size in (("entropy", (1200, 1000)), ("views", (1500, 1000))):
        image = Image.open(io.BytesIO(first[name]))
        assert image.size == size
        assert "Software" not in image.info
        assert np.asarray(image.convert("L")).std() > 5  # something is drawn


@pytest.mark.parametrize("key, value, says", [("example_nodes", 0, "must be in [1, 12]"),
                                              ("tsne_max_iter", 100, "must be in [250, 100000]"),
                                              ("tsne_perplexity", "high", "must be a number")])
def test_analyze_params_are_validated_with_their_dotted_key(key: str, value: object, says: str) -> None:
    import yaml

    from gat.config import Params, ParamsError

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    raw["analyze"][key] = value
    with pytest.raises(ParamsError, match=re.escape(f"`analyze.{key}` {says}")):
        Params.from_dict(raw)


# The stage, end to end -----------------------------------------------------------------------------------------------

PICTURES = {"attention_entropy.png": (1200, 1000), "embedding_tsne.png": (1000, 800),
            "neighbourhoods.png": (1500, 1000), "training_curves.png": (1100, 400),
            "confusion_matrix.png": (750, 650)}
METRICS = {"attention_entropy_layer1", "attention_entropy_layer2", "attention_entropy_uniform", "silhouette_layer1",
           "silhouette_tsne"}


def test_analyze_writes_pictures_and_metrics_into_the_training_run(pipeline: Pipeline, tmp_path: Path) -> None:
    from PIL import Image

    folder = pipeline.root / "data/analysis"
    assert sorted(path.name for path in folder.iterdir()) == sorted([*PICTURES, "metrics.json"])
    for name, size in PICTURES.items():
        with Image.open(folder / name) as image:
            image.verify()  # a valid PNG
        with Image.open(folder / name) as image:
            assert image.format == "PNG" and image.size == size
            assert np.asarray(image.convert("L")).std() > 10, f"{name} is blank"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert set(metrics) == METRICS
    for layer in (1, 2):
        assert 0 <= metrics[f"attention_entropy_layer{layer}"] <= metrics["attention_entropy_uniform"] + 1e-9
    assert -1 <= metrics["silhouette_layer1"] <= 1 and -1 <= metrics["silhouette_tsne"] <= 1

    (row,) = pipeline.runs(TRAIN_EXPERIMENT)  # the training run, no row of its own
    assert row.info.status == "FINISHED"
    assert {key: row.data.metrics[key] for key in METRICS} == pytest.approx(metrics)
    logged = {item.path for item in pipeline.client.list_artifacts(row.info.run_id, "analysis")}
    assert logged == {f"analysis/{name}" for name in [*PICTURES, "metrics.json"]}
    local = pipeline.client.download_artifacts(row.info.run_id, "analysis/neighbourhoods.png", str(tmp_path))
    assert Path(local).read_bytes() == (folder / "neighbourhoods.png").read_bytes()
    plots = json.loads(pipeline.dvc("plots", "show", "--json").stdout)
    assert {f"data/analysis/{name}" for name in PICTURES} <= set(plots["data"])


def test_analyze_again_gives_the_same_bytes(pipeline_copy: Pipeline, tmp_path: Path) -> None:
    before = [run.info.run_id for run in pipeline_copy.all_runs()]
    pipeline_copy.python("-m", "stages.analyze", "--data", "data/prepared/cora", "--train", "data/train",
                         "--eval", "data/eval", "--out", str(tmp_path / "again"))
    for path in sorted((pipeline_copy.root / "data/analysis").iterdir()):
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes(), path.name
    assert [run.info.run_id for run in pipeline_copy.all_runs()] == before


@pytest.mark.parametrize("change, says", [
    ({"analyze.example_nodes": 12, "__test_set__": 5}, "`analyze.example_nodes` is 12, but the test set"),
    ({"train.dataset": "citeseer"}, "it is another dataset's model"),
])
def test_bad_input_is_one_line_and_leaves_nothing(pipeline_copy: Pipeline, tmp_path: Path, change: dict,
                                                  says: str) -> None:
    change = dict(change)
    if change.pop("__test_set__", None):
        # A test set smaller than the example count: a prepared graph whose split keeps only five test nodes.
        graph = torch.load(pipeline_copy.root / "data/prepared/cora/graph.pt", weights_only=True)
        graph["test_idx"] = graph["test_idx"][:5]
        torch.save(graph, pipeline_copy.root / "data/prepared/cora/graph.pt")
    pipeline_copy.set_params(**change)
    dataset = change.get("train.dataset", "cora")
    (row,) = pipeline_copy.runs(TRAIN_EXPERIMENT)
    failed = pipeline_copy.python("-m", "stages.analyze", "--data", f"data/prepared/{dataset}", "--train",
                                  "data/train", "--eval", "data/eval", "--out", str(tmp_path / "out"), check=False)
    assert failed.returncode == 2
    assert failed.stderr.strip().splitlines() == [failed.stderr.strip()] and says in failed.stderr
    assert not (tmp_path / "out").exists()
    (after,) = pipeline_copy.runs(TRAIN_EXPERIMENT)
    assert after.info.run_id == row.info.run_id and after.info.status == "FINISHED"
