"""Pooling and read-out: per tree, per node (brute force over networkx descendants),
local pooling into parents, and node features for PyG message passing."""
from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch_geometric.data import Batch
from torch_geometric.nn import SimpleConv

from hsa_graph import NestedSignal, Node, hsa
from hsa_graph.builders.text import text_trees
from hsa_graph.nn import HSAttention, global_leaf_pool, pool_leaves, subtree_pool

PARENT = [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4]
LEAVES = [5, 6, 7, 8, 9, 10, 11]


def leaf_sets(parent):
    """Node -> the rows (leaf order) of the leaves under it, from networkx."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(parent)))
    graph.add_edges_from((p, u) for u, p in enumerate(parent) if p >= 0)
    leaves = [u for u in graph if graph.out_degree(u) == 0]
    row = {u: r for r, u in enumerate(leaves)}
    return {u: sorted(row[w] for w in nx.descendants(graph, u) | {u} if w in row)
            for u in graph}


def test_global_leaf_pool_per_tree_in_graph_order():
    batch = text_trees(["One two. Three.", "Four five six seven.", "Eight."])
    x = torch.randn(batch.num_leaves, 3)
    counts = torch.bincount(batch.batch[batch.leaf_index]).tolist()
    parts = x.split(counts)
    torch.testing.assert_close(global_leaf_pool(x, batch),
                               torch.stack([p.mean(0) for p in parts]))
    torch.testing.assert_close(global_leaf_pool(x, batch, "max"),
                               torch.stack([p.max(0).values for p in parts]))
    torch.testing.assert_close(global_leaf_pool(x, batch, "sum"),
                               torch.stack([p.sum(0) for p in parts]))
    torch.testing.assert_close(global_leaf_pool(x, batch, "first"),
                               torch.stack([p[0] for p in parts]))
    with pytest.raises(ValueError, match="reduce must be one of"):
        global_leaf_pool(x, batch, "median")
    with pytest.raises(ValueError, match="one row per leaf"):
        global_leaf_pool(x[1:], batch)


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_subtree_pool_matches_descendants(reduce):
    trees = [NestedSignal.from_parents(PARENT),
             NestedSignal.from_nested({"a": [torch.randn(2)] * 3,
                                       "b": Node([[torch.randn(2)]], "grid")}),
             NestedSignal.from_parents([-1])]  # a lone leaf that is a root
    batch = Batch.from_data_list(trees)
    x = torch.randn(batch.num_leaves, 4, dtype=torch.float64)
    out = subtree_pool(x, batch, reduce=reduce)
    assert out.shape == (batch.num_nodes, 4)
    for u, rows in leaf_sets(batch.parent.tolist()).items():
        part = x[rows]
        torch.testing.assert_close(out[u], part.mean(0) if reduce == "mean" else part.sum(0))
    index = torch.tensor([0, 4, batch.num_nodes - 1])
    torch.testing.assert_close(subtree_pool(x, batch, index, reduce), out[index])
    with pytest.raises(ValueError, match="out of range"):
        subtree_pool(x, batch, torch.tensor([batch.num_nodes]))


def test_internal_node_features_feed_message_passing():
    """Every node gets a feature from the HSA leaf outputs; a PyG layer then runs on
    the tree's own parent -> child edges."""
    torch.manual_seed(0)
    tree = NestedSignal.from_parents(PARENT, x=torch.randn(len(LEAVES), 6))
    y = HSAttention(6, heads=2)(tree.x, tree)
    nodes = subtree_pool(y, tree)
    out = SimpleConv(aggr="mean")(nodes, tree.edge_index)   # each child receives its parent
    parent = tree.parent
    torch.testing.assert_close(out[1:], nodes[parent[1:]])
    loss = out.sum()
    loss.backward()  # gradients reach the attention through the internal nodes


def test_pool_leaves_merges_leaf_families():
    # 0 -> {1, 2}; 1 -> {3, 4} (leaves); 2 -> {5, 6} where 5 is internal -> {7, 8}
    tree = NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 5, 5], geometry=[
        "keyvalue", "sequence", "set", None, None, "sequence", None, None, None],
        key=[None, "a", "b"] + [None] * 6, modality=[0, 1, 2, 1, 1, 2, 2, 3, 3])
    x = torch.tensor([[1.0], [3.0], [10.0], [4.0], [6.0]])  # leaves 3, 4, 6, 7, 8
    out = pool_leaves(x, tree)
    # 1 and 5 collapse; leaf 6 stays (its family also holds the internal node 5)
    assert out.node.tolist() == [0, 1, 2, 5, 6]
    assert out.tree.parent.tolist() == [-1, 0, 0, 2, 2]
    assert out.tree.geometry_names() == ["keyvalue", None, "set", None, None]
    assert out.tree.key[:3] == [None, "a", "b"]
    assert out.tree.modality.tolist() == [0, 1, 2, 2, 2]
    assert out.x.flatten().tolist() == [2.0, 5.0, 10.0]   # node 1, node 5, leaf 6
    assert out.cluster.tolist() == [0, 0, 2, 1, 1]
    torch.testing.assert_close(out.x[out.cluster][[0, 1]], torch.tensor([[2.0], [2.0]]))
    again = pool_leaves(out.x, out.tree, reduce="max")
    assert again.tree.parent.tolist() == [-1, 0, 0]
    assert again.x.flatten().tolist() == [2.0, 10.0]
    final = pool_leaves(again.x, again.tree)
    assert final.tree.num_nodes == 1 and final.x.flatten().tolist() == [6.0]


def test_pool_leaves_keeps_trees_and_graph_edges_and_gradients():
    graph_tree = NestedSignal.from_nested(Node(
        [[torch.randn(3), torch.randn(3)], [torch.randn(3)], torch.randn(3)], "graph",
        edges=[(0, 1), (1, 2)]))
    batch = Batch.from_data_list([NestedSignal.from_parents(PARENT, x=torch.randn(7, 3)),
                                  graph_tree])
    x = batch.x.clone().requires_grad_()
    out = pool_leaves(x, batch)
    assert out.tree.structure.num_trees == 2
    # the graph node's children 1 -> leaves collapsed; the sibling edges survive
    edges = out.tree.sibling_edge_index
    assert edges.shape[1] == 2
    assert (out.tree.parent[edges[0]] == out.tree.parent[edges[1]]).all()
    # global pooling after coarsening still sees one vector per tree
    assert global_leaf_pool(out.x, out.tree).shape == (2, 3)
    # a coarser tree runs HSA, and gradients flow back to the original leaves
    y = hsa(out.x, out.x, out.x, out.tree)
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_first_leaf_pool_on_a_forest_whose_trees_interleave_node_ids():
    # roots 0 and 2; tree 0's leaves are rows 0 and 2 (nodes 1, 4), tree 1's row 1 (node 3)
    forest = NestedSignal.from_parents([-1, 0, -1, 2, 0])
    x = torch.arange(3.0)[:, None]
    leaf_tree = forest.structure.leaf_tree.tolist()
    expected = [min(r for r in range(3) if leaf_tree[r] == t) for t in range(2)]
    assert global_leaf_pool(x, forest, "first").view(-1).tolist() == expected


def test_pool_leaves_refuses_the_first_leaf_read_out():
    # "first" picks a row per tree; coarsening families needs a reduction
    tree = NestedSignal.from_parents([-1, 0, 0, 0])
    with pytest.raises(ValueError, match="reduce must be one of"):
        pool_leaves(torch.randn(3, 2), tree, "first")
