"""Anchored hierarchical cross-attention (hsa_graph.ops.cross) against the dense
reference in tests/causal_reference.py (blocks enumerated per query, KL projection of
the flat softmax row solved from the row itself)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from causal_reference import anchor_blocks, dense_cross_weights
from hsa_trees import leaves_of, parent_arrays
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import Tree

import hsa_graph
from hsa_graph.ops.cross import cross_hsa


def inputs(nq, n, h=2, d=3, dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(nq, h, d, generator=g, dtype=torch.float64),
            torch.randn(n, h, d, generator=g, dtype=torch.float64),
            torch.randn(n, h, dv, generator=g, dtype=torch.float64))


def weights_of(q, k, tree, anchor=None):
    """The attention rows of the fast operator, read off with one-hot values."""
    n, h = k.shape[0], k.shape[1]
    eye = torch.eye(n, dtype=k.dtype)[:, None, :].expand(n, h, n)
    return cross_hsa(q, k, eye, tree, anchor=anchor).permute(1, 0, 2)   # [H, Nq, N]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parent=parent_arrays(max_nodes=16), seed=st.integers(0, 2**16), data=st.data())
def test_equals_dense_reference(parent, seed, data):
    n = len(leaves_of(parent))
    nq = 5
    anchors = data.draw(st.lists(st.integers(0, len(parent) - 1), min_size=nq, max_size=nq))
    q, k, v = inputs(nq, n, seed=seed)
    tree = hsa_graph.NestedSignal.from_parents(parent)
    anchor = torch.tensor(anchors)
    ref_w = dense_cross_weights(parent, q, k, anchors)
    y = cross_hsa(q, k, v, tree, anchor=anchor)
    torch.testing.assert_close(y, torch.einsum("hqj,jhd->qhd", ref_w, v), atol=1e-10,
                               rtol=1e-10)
    torch.testing.assert_close(weights_of(q, k, tree, anchor), ref_w, atol=1e-10, rtol=1e-10)


def test_flat_key_tree_with_root_anchor_is_softmax_cross_attention():
    q, k, v = inputs(7, 9, h=3, d=8, dv=5)
    tree = hsa_graph.NestedSignal.from_parents([-1] + [0] * 9)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(cross_hsa(q, k, v, tree), ref, atol=1e-12, rtol=1e-12)


def test_rows_are_stochastic_and_block_constant():
    parent = [-1, 0, 0, 1, 1, 1, 2, 2, 0, 8, 8, 9, 9]
    tree = hsa_graph.NestedSignal.from_parents(parent)
    ref_tree = Tree(parent)
    n = tree.num_leaves
    anchors = [0, 1, 2, 9, 4, 12]
    q, k, _ = inputs(len(anchors), n)
    w = weights_of(q, k, tree, torch.tensor(anchors))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, len(anchors), dtype=w.dtype))
    for a, anchor in enumerate(anchors):
        blocks = anchor_blocks(parent, anchor)
        assert sorted(r for b in blocks for r in b) == list(range(ref_tree.num_leaves))
        for block in blocks:
            row = w[:, a, block]
            torch.testing.assert_close(row, row[:, :1].expand_as(row))


def test_kl_optimal_under_block_perturbation():
    parent = [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    tree = hsa_graph.NestedSignal.from_parents(parent)
    n = tree.num_leaves
    q, k, _ = inputs(3, n, h=1)
    anchors = [0, 1, 6]
    w = weights_of(q, k, tree, torch.tensor(anchors))
    flat = torch.softmax(torch.einsum("qhd,jhd->hqj", q, k) / 3 ** 0.5, -1)

    def kl(theta):
        return (theta * (theta.log() - flat.log())).sum()

    best = kl(w)
    for a, anchor in enumerate(anchors):
        blocks = anchor_blocks(parent, anchor)
        for eps in (1e-3, -1e-3):
            moved = w.clone()
            moved[:, a, blocks[0]] += eps / len(blocks[0])
            moved[:, a, blocks[-1]] -= eps / len(blocks[-1])
            assert kl(moved) > best


def test_gradcheck():
    parent = [-1, 0, 0, 1, 1, 1, 2, 2]
    tree = hsa_graph.NestedSignal.from_parents(parent)
    q, k, v = inputs(3, 5)
    anchor = torch.tensor([0, 1, 6])
    args = tuple(t.requires_grad_(True) for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: cross_hsa(a, b, c, tree, anchor), args)


def test_queries_from_another_tree_and_forest_key():
    """Queries can come from a tree (rows of its leaves); a forest key needs anchors."""
    keys = [hsa_graph.NestedSignal.from_parents(p) for p in ([-1, 0, 0, 1, 1], [-1, 0, 0])]
    from torch_geometric.data import Batch
    batch = Batch.from_data_list(keys)
    q, k, v = inputs(4, 5)
    with pytest.raises(ValueError, match="forest of 2 trees"):
        cross_hsa(q, k, v, batch)
    roots = torch.tensor([0, 0, 5, 5])      # node 5 is the second tree's root in the batch
    y = cross_hsa(q, k, v, batch, anchor=roots)
    torch.testing.assert_close(y[:2], cross_hsa(q[:2], k[:3], v[:3], keys[0]))
    torch.testing.assert_close(y[2:], cross_hsa(q[2:], k[3:], v[3:], keys[1]))


def test_bad_input_raises():
    tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0])
    q, k, v = inputs(2, 2)
    with pytest.raises(ValueError, match="anchor\\[1\\] = 7 is not a node"):
        cross_hsa(q, k, v, tree, anchor=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="key tree has 2 leaves"):
        cross_hsa(q, k[:1], v[:1], tree)
    with pytest.raises(ValueError, match="agree on heads and features"):
        cross_hsa(q[..., :2], k, v, tree)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parent=parent_arrays(max_nodes=16), seed=st.integers(0, 2**16), data=st.data(),
       include_self=st.booleans(), heads_in_pos=st.booleans())
def test_include_self_and_positions_equal_dense_reference(parent, seed, data, include_self,
                                                          heads_in_pos):
    n = len(leaves_of(parent))
    nq = 5
    anchors = data.draw(st.lists(st.integers(0, len(parent) - 1), min_size=nq, max_size=nq))
    q, k, v = inputs(nq, n, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    pos = torch.randn(len(parent), *((q.shape[1],) if heads_in_pos else ()), 3, generator=g,
                      dtype=torch.float64)
    tree = hsa_graph.NestedSignal.from_parents(parent)
    ref_w = dense_cross_weights(parent, q, k, anchors, include_self=include_self, pos=pos)
    y = cross_hsa(q, k, v, tree, anchor=torch.tensor(anchors), include_self=include_self,
                  pos=pos)
    torch.testing.assert_close(y, torch.einsum("hqj,jhd->qhd", ref_w, v), atol=1e-10,
                               rtol=1e-10)


def test_include_self_only_changes_leaf_anchors():
    parent = [-1, 0, 0, 1, 1, 2, 2, 2]
    tree = hsa_graph.NestedSignal.from_parents(parent)
    q, k, v = inputs(3, len(leaves_of(parent)), seed=4)
    internal, leaf = torch.tensor([1, 2, 0]), torch.tensor([3, 5, 7])
    torch.testing.assert_close(cross_hsa(q, k, v, tree, anchor=internal, include_self=False),
                               cross_hsa(q, k, v, tree, anchor=internal))
    assert not torch.allclose(cross_hsa(q, k, v, tree, anchor=leaf, include_self=False),
                              cross_hsa(q, k, v, tree, anchor=leaf))
    alone = hsa_graph.NestedSignal.from_parents([-1])     # nothing left to attend to
    y = cross_hsa(q[:1], k[:1], v[:1], alone, include_self=False)
    assert torch.equal(y, torch.zeros_like(y))


def test_pos_shapes_are_checked():
    parent = [-1, 0, 0]
    tree = hsa_graph.NestedSignal.from_parents(parent)
    q, k, v = inputs(2, 2, seed=0)
    with pytest.raises(ValueError, match="pos must have shape"):
        cross_hsa(q, k, v, tree, pos=torch.randn(5, 2))


def test_gradients_without_a_self_block_are_finite():
    parent = [-1, 0, 1, 1]                  # the root's only child holds two leaves
    tree = hsa_graph.NestedSignal.from_parents(parent)
    q, k, v = (t.requires_grad_() for t in inputs(3, 2, seed=1))
    y = cross_hsa(q, k, v, tree, anchor=torch.tensor([2, 3, 0]), include_self=False)
    y.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: cross_hsa(q, k, v, tree, anchor=torch.tensor([2, 3, 0]),
                                  include_self=False), (q, k, v))
