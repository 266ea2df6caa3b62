"""Tests of hsa_graph/builders/windows.py: fixed hopping-window hierarchies (exact parent
arrays, ragged ends, batching, edge cases) and their HSA."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference import dense_hsa

from hsa_graph import NestedSignal, hsa
from hsa_graph.builders.windows import (
    hopping_window_forest,
    hopping_window_parents,
    hopping_window_tree,
)

TOL = dict(rtol=1e-5, atol=1e-6)


def reference_windows(T: int, branching) -> tuple[list[int], list[int]]:
    """An independent, per-node construction of the documented rules: levels bottom-up,
    stop at a single node, one extra root over a top level of several nodes (or over a
    lone token). Returns (parent, position) with leaves first, then each level."""
    levels = [list(range(T))]  # node ids per level
    next_id = T
    parent: dict[int, int] = {}
    position: dict[int, int] = {}
    for b in branching:
        below = levels[-1]
        if len(below) == 1:
            break
        level = []
        for start in range(0, len(below), b):
            node = next_id
            next_id += 1
            level.append(node)
            for offset, child in enumerate(below[start:start + b]):
                parent[child] = node
                position[child] = offset
        levels.append(level)
    top = levels[-1]
    if len(top) > 1 or len(levels) == 1:
        root = next_id
        next_id += 1
        for offset, child in enumerate(top):
            parent[child] = root
            position[child] = offset
    return ([parent.get(u, -1) for u in range(next_id)],
            [position.get(u, -1) for u in range(next_id)])


def qkv(n, heads=2, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, heads, d, generator=g, dtype=dtype) for _ in range(3)]


# ------------------------------------------------------------------- exact arrays
def test_exact_parent_arrays_small_cases():
    # 7 tokens, windows of 2 then 3: [0 1] [2 3] [4 5] [6] -> [7 8 9] [10] -> root 13
    w = hopping_window_parents([7], (2, 3))
    assert w.parent.tolist() == [7, 7, 8, 8, 9, 9, 10, 11, 11, 11, 12, 13, 13, -1]
    assert w.position.tolist() == [0, 1, 0, 1, 0, 1, 0, 0, 1, 2, 0, 0, 1, -1]
    assert w.ptr.tolist() == [0, 14]
    # 8 tokens, (2, 4): [0 1] .. [6 7] -> one window of the 4 windows = the root
    w = hopping_window_parents([8], (2, 4))
    assert w.parent.tolist() == [8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 12, 12, -1]


@pytest.mark.parametrize("branching", [(2,), (2, 2), (2, 4, 8, 16), (3, 5), (7, 7, 7, 7),
                                       (8, 4, 2), (4, 1, 2), (1,), ()])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 9, 16, 17, 31, 100, 513])
def test_matches_per_node_reference(T, branching):
    parent, position = reference_windows(T, branching)
    w = hopping_window_parents([T], branching)
    assert w.parent.tolist() == parent
    assert w.position.tolist() == position
    tree = hopping_window_tree(T, branching)
    assert tree.parent.tolist() == parent
    assert tree.position[:, 0].tolist() == position
    assert tree.num_leaves == T
    assert tree.leaf_index.tolist() == list(range(T))  # leaves first, in order


def test_paper_hierarchy_sizes():
    # 512 tokens under (2, 4, 8, 16): 256, 64, 8 windows, then one window of 8 = root
    tree = hopping_window_tree(512, (2, 4, 8, 16))
    assert tree.num_nodes == 512 + 256 + 64 + 8 + 1
    assert tree.structure.max_depth == 3  # internal levels 0..3, leaves one deeper
    # 2048 tokens: the tuple is used up with 2 nodes left: an extra root over them
    tree = hopping_window_tree(2048, (2, 4, 8, 16))
    assert tree.num_nodes == 2048 + 1024 + 256 + 32 + 2 + 1
    assert tree.parent[-3:].tolist() == [tree.num_nodes - 1] * 2 + [-1]


def test_edge_lengths():
    assert hopping_window_tree(1, (2, 4)).parent.tolist() == [1, -1]  # root over 1 token
    assert hopping_window_tree(3, (4, 8)).parent.tolist() == [3, 3, 3, -1]  # T < window
    assert hopping_window_tree(4, ()).parent.tolist() == [4, 4, 4, 4, -1]  # flat
    assert hopping_window_tree(5, 2).parent.tolist() == [5, 5, 6, 6, 7, 8, 8, 8, -1]


@pytest.mark.parametrize("bad", [(0,), (2, -1), (2.5,), ("2",), (True,), (None,), "24",
                                 2.0, None, (2, 0, 4)])
def test_invalid_branching(bad):
    with pytest.raises(ValueError, match="branching"):
        hopping_window_parents([4], bad)


def test_branching_accepts_numpy_and_tensor_ints():
    expected = hopping_window_parents([9], (2, 3)).parent
    assert torch.equal(hopping_window_parents([9], np.array([2, 3])).parent, expected)
    assert torch.equal(hopping_window_parents([9], torch.tensor([2, 3])).parent, expected)


@pytest.mark.parametrize("bad, error", [([], ValueError), ([3, 0], ValueError),
                                        ([-2], ValueError), ([2.0], ValueError),
                                        (torch.tensor([1.5]), ValueError),
                                        (torch.tensor([[2, 3]]), ValueError)])
def test_invalid_lengths(bad, error):
    with pytest.raises(error):
        hopping_window_parents(bad, (2,))


# ----------------------------------------------------------------------- batching
def test_forest_is_the_concatenation_of_trees():
    lengths = [1, 2, 5, 17, 64, 3]
    branching = (2, 4, 8)
    w = hopping_window_parents(lengths, branching)
    expected, pos, ptr = [], [], [0]
    for T in lengths:
        p, q = reference_windows(T, branching)
        off = len(expected)
        expected += [u + off if u >= 0 else -1 for u in p]
        pos += q
        ptr.append(len(expected))
    assert w.parent.tolist() == expected
    assert w.position.tolist() == pos
    assert w.ptr.tolist() == ptr
    forest = hopping_window_forest(lengths, branching)
    assert forest.structure.num_trees == len(lengths)
    assert forest.get("x") is None
    # leaves in order: tokens of sequence 0, then 1, ...
    assert forest.structure.leaf_tree.tolist() == sum(
        ([b] * T for b, T in enumerate(lengths)), [])


def test_forest_inputs_sequences_padded_and_lengths():
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(T, 6, generator=g) for T in (4, 1, 9)]
    forest = hopping_window_forest(seqs, (2, 2))
    assert torch.equal(forest.x, torch.cat(seqs))
    padded = torch.zeros(3, 9, 6)
    for b, s in enumerate(seqs):
        padded[b, :len(s)] = s
    from_padded = hopping_window_forest(padded, (2, 2), lengths=torch.tensor([4, 1, 9]))
    assert torch.equal(from_padded.x, forest.x)
    assert torch.equal(from_padded.parent, forest.parent)
    # token ids [T] and numpy sequences
    ids = hopping_window_forest([np.arange(5), np.arange(3)], (2,))
    assert ids.x.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # lengths as a tensor; the padded batch without lengths is all full
    assert torch.equal(hopping_window_forest(torch.tensor([4, 1, 9]), (2, 2)).parent,
                       forest.parent)
    assert hopping_window_forest(torch.zeros(2, 5, 3), (2,)).num_leaves == 10


@pytest.mark.parametrize("data, kwargs, error, match", [
    ([], {}, ValueError, "empty"),
    ([torch.zeros(0, 3)], {}, ValueError, "sequence 0 has no tokens"),
    ([torch.zeros(2, 3), torch.zeros(2, 4)], {}, ValueError, "sequence 1 has rows"),
    ([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)], {}, ValueError, "dtype"),
    (torch.zeros(2, 5, 3), {"lengths": [2, 6]}, ValueError, "exceeds"),
    (torch.zeros(2, 5, 3), {"lengths": [2]}, ValueError, "lengths has 1"),
    ([3, 4], {"lengths": [3, 4]}, ValueError, "lengths="),
    (["abc"], {}, TypeError, "sequence 0"),
    ("abc", {}, TypeError, "data must be"),
    (torch.tensor(3), {}, ValueError, "scalar"),
])
def test_forest_bad_input(data, kwargs, error, match):
    with pytest.raises(error, match=match):
        hopping_window_forest(data, (2,), **kwargs)


def test_tree_bad_input():
    with pytest.raises(TypeError):
        hopping_window_tree("ten", (2,))
    with pytest.raises(ValueError):
        hopping_window_tree(0, (2,))
    with pytest.raises(ValueError):
        hopping_window_tree(torch.tensor(5), (2,))


def test_geometry_and_modality():
    tree = hopping_window_tree(torch.randn(6, 4), (2,), geometry="set", modality=3)
    assert set(tree.geometry_names()) == {None, "set"}
    assert tree.modality.tolist() == [3] * tree.num_nodes
    assert set(hopping_window_tree(6, (2,)).geometry_names()) == {None, "sequence"}
    for bad in ["grid", "keyvalue", "tree"]:
        with pytest.raises(ValueError, match="geometry must be"):
            hopping_window_tree(6, (2,), geometry=bad)


def test_parents_fast_for_a_transformer_batch():
    """The zero-shot path: 64 sequences of up to 512 tokens in milliseconds."""
    lengths = torch.randint(1, 513, (64,), generator=torch.Generator().manual_seed(0))
    lengths[0] = 512
    threads = torch.get_num_threads()
    # one thread: measure the code, not OpenMP start-up on a busy 2-core machine
    torch.set_num_threads(1)
    try:
        hopping_window_parents(lengths, (2, 4, 8, 16))  # warm-up
        best = min(_timed(lambda: hopping_window_parents(lengths, (2, 4, 8, 16)))
                   for _ in range(5))
    finally:
        torch.set_num_threads(threads)
    assert best < 0.05, f"hopping_window_parents took {best * 1e3:.1f} ms"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------- HSA
@pytest.mark.parametrize("branching", [(), (16,), (64, 2)])
@pytest.mark.parametrize("include_self", [True, False])
def test_single_level_tree_is_softmax_attention(branching, include_self):
    q, k, v = qkv(11, seed=3)
    tree = hopping_window_tree(11, branching)
    assert tree.structure.max_depth == 0  # one level: a root over the tokens
    mask = None if include_self else ~torch.eye(11, dtype=torch.bool)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), attn_mask=mask)
    y = hsa(q, k, v, tree, include_self=include_self)
    torch.testing.assert_close(y, expected.transpose(0, 1), **TOL)


@pytest.mark.parametrize("branching", [(2, 4, 8, 16), (3, 3), (2, 2, 2, 2)])
def test_hsa_on_windows_matches_dense_reference(branching):
    q, k, v = qkv(37, seed=5)
    tree = hopping_window_tree(37, branching)
    y = hsa(q, k, v, tree, include_self=False)
    torch.testing.assert_close(y, dense_hsa(tree.parent, q, k, v, include_self=False), **TOL)
    # and it is not flat attention (the hierarchy matters)
    flat = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1)).transpose(0, 1)
    assert not torch.allclose(hsa(q, k, v, tree), flat, atol=1e-3)


def test_branching_one_is_transparent():
    q, k, v = qkv(13, seed=7)
    with_unary = hopping_window_tree(13, (1, 2, 1, 3))
    without = hopping_window_tree(13, (2, 3))
    assert with_unary.num_nodes > without.num_nodes
    torch.testing.assert_close(hsa(q, k, v, with_unary), hsa(q, k, v, without), **TOL)


def test_forest_hsa_equals_per_sequence_hsa():
    lengths = [5, 1, 12, 33]
    q, k, v = qkv(sum(lengths), seed=11)
    forest = hopping_window_forest(lengths, (2, 4))
    y = hsa(q, k, v, forest)
    start = 0
    for T in lengths:
        rows = slice(start, start + T)
        alone = hsa(q[rows], k[rows], v[rows], hopping_window_tree(T, (2, 4)))
        torch.testing.assert_close(y[rows], alone, **TOL)
        start += T


def test_forest_from_parents_roundtrip():
    w = hopping_window_parents([6, 3], (2,))
    tree = NestedSignal.from_parents(w.parent, position=w.position)
    assert tree.structure.num_trees == 2
    assert torch.equal(tree.position[:, 0], w.position)


def test_absurd_length_is_refused_before_allocating():
    with pytest.raises(ValueError, match="1,099,511,627,776 tokens"):
        hopping_window_parents([2**40])
