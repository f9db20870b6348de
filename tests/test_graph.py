"""gat/graph.py: neighbourhoods, receptive fields and sparse feature rows."""

from __future__ import annotations

import gc
import weakref

import torch

from gat.config import ModelConfig
from gat.graph import Neighbourhoods, SparseFeatures, receptive_field
from gat.model import GAT


def random_graph(num_nodes: int = 60, num_edges: int = 150, seed: int = 0) -> Neighbourhoods:
    generator = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=generator)
    return Neighbourhoods.from_edge_index(edge_index, num_nodes)


def random_features(num_nodes: int = 60, num_features: int = 30, seed: int = 1) -> SparseFeatures:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_nodes, num_features, generator=generator)
    return SparseFeatures.from_csr(x * (x < 0.2))


def test_self_loops_added_once_duplicates_dropped_sorted_by_target() -> None:
    edge_index = torch.tensor([[0, 0, 1, 2, 2], [1, 1, 1, 0, 2]])  # a duplicate and two self-loops
    graph = Neighbourhoods.from_edge_index(edge_index, 3)
    pairs = list(zip(graph.target.tolist(), graph.source.tolist()))
    assert pairs == [(0, 0), (0, 2), (1, 0), (1, 1), (2, 2)]
    assert graph.degree.tolist() == [2, 2, 1]
    assert graph.crow.tolist() == [0, 2, 4, 5]


def test_feature_rows_pick_exactly_those_rows() -> None:
    x = random_features()
    nodes = torch.tensor([5, 0, 17, 59])
    assert torch.equal(x.rows(nodes).to_dense(), x.to_dense()[nodes])


def test_receptive_field_blocks_chain_and_end_at_the_nodes() -> None:
    graph = random_graph()
    nodes = torch.tensor([7, 3, 40])
    inputs, (first, second) = receptive_field(graph, nodes, layers=2)
    assert second.num_targets == 3 and first.num_targets == second.num_sources
    assert first.num_sources == inputs.numel() < graph.num_nodes
    # Every target is its own neighbour, so it is found among the sources.
    assert torch.all(first.target_in_source >= 0) and torch.all(second.target_in_source >= 0)


def test_model_on_a_receptive_field_equals_the_whole_graph_rows() -> None:
    graph, x = random_graph(), random_features()
    model = GAT(ModelConfig(4, 3, 2, 0.5, 0.2), x.num_features, 5, seeds=[0, 1]).eval()
    for nodes in (torch.tensor([2, 9, 33]), torch.arange(60)):
        inputs, blocks = receptive_field(graph, nodes, layers=2)
        with torch.no_grad():
            whole = model(x, graph)[torch.unique(nodes)]
            part = model(x.rows(inputs), blocks)
        torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-6)


class Plan:
    """Something derived from a structure (the layers memoise their index plans); weakref-able."""


def test_memoised_builds_once_per_key_for_the_lifetime_of_the_structure() -> None:
    graph, x = random_graph(), random_features()
    built: list[Plan] = []

    def build() -> Plan:
        built.append(Plan())
        return built[-1]

    for structure in (graph, x):
        plan = structure.memoised(("plan", 3), build)
        assert structure.memoised(("plan", 3), build) is plan and len(built) == 1
        assert structure.memoised(("plan", 4), build) is not plan and len(built) == 2
        # A moved copy is another object, with its own (empty) memo; the memo is no part of the repr.
        assert structure.to("cpu").memoised(("plan", 3), build) is not plan and len(built) == 3
        assert "_memo" not in repr(structure)
        built.clear()
    del structure, plan

    references = [weakref.ref(plan) for plan in (graph.memoised("a", Plan), x.memoised("b", Plan))]
    del graph, x
    gc.collect()
    assert all(reference() is None for reference in references)


def test_the_memo_is_no_part_of_equality() -> None:
    edge_index = torch.tensor([[0, 1], [1, 2]])
    first, second = Neighbourhoods.from_edge_index(edge_index, 3), Neighbourhoods.from_edge_index(edge_index, 3)
    first.memoised("plan", Plan)
    # Dataclass equality compares the tensors (elementwise, ambiguous); the memo must not even enter it.
    assert [f.name for f in first.__dataclass_fields__.values() if f.compare] == [
        "source", "target", "num_targets", "num_sources", "target_in_source"]
    assert second._memo == {}
