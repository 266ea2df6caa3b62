"""hsa_graph.induce: trees built from the leaf vectors (contiguous merging, clustering)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from causal_reference import dense_causal_hsa
from reference import dense_hsa

import hsa_graph
from hsa_graph.induce import cluster_tree, contiguous_tree

BUILDERS = {"contiguous": contiguous_tree, "cluster": cluster_tree}


def _leaf_sets(parent, n):
    """Leaf rows under every internal node, as sorted tuples (a canonical form)."""
    parent = parent.tolist()
    rows = {u: [] for u in range(len(parent))}
    for leaf in range(n):
        u = leaf
        while u >= 0:
            rows[u].append(leaf)
            u = parent[u]
    return sorted(tuple(sorted(r)) for u, r in rows.items() if u >= n)


def _batch(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _family_sizes(tree):
    parent = tree.parent
    return torch.bincount(parent[parent >= 0], minlength=tree.num_nodes)


CASES = [(lengths, m) for lengths in ([1], [2], [7], [1, 1, 5], [33, 1, 64, 2, 17])
         for m in (2, 3, 4, 7)]


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("lengths,m", CASES)
def test_leaves_families_and_trees(kind, lengths, m):
    torch.manual_seed(sum(lengths) + m)
    batch = _batch(lengths)
    x = torch.randn(batch.numel(), 5)
    tree = BUILDERS[kind](x, batch, max_children=m)
    n = x.shape[0]
    # leaf i = row i: the first n nodes are the leaves, features untouched
    assert tree.is_leaf[:n].all() and not tree.is_leaf[n:].any()
    assert tree.x is x
    st = tree.structure
    assert st.num_trees == len(lengths)
    assert torch.equal(st.leaf_tree, batch)
    sizes = _family_sizes(tree)[n:]
    assert int(sizes.max()) <= m
    # no unary nodes, except the root over a lone leaf
    unary = (sizes == 1).nonzero().flatten() + n
    assert all(tree.parent[u] < 0 and st.node_size[st.unified_of_node[u]] == 1
               for u in unary.tolist())
    assert unary.numel() == sum(t == 1 for t in lengths)
    if kind == "contiguous":
        st.check_contiguous()
        assert tree.geometry_names()[n:] == ["sequence"] * (tree.num_nodes - n)
        # positions run 0, 1, ... along the leaf order inside every family
        lo = st.leaf_ranges[0][st.unified_of_node]
        for p in range(n, tree.num_nodes):
            kids = (tree.parent == p).nonzero().flatten()
            kids = kids[torch.argsort(lo[kids])]
            assert tree.position[kids, 0].tolist() == list(range(kids.numel()))


@pytest.mark.parametrize("kind", BUILDERS)
def test_batch_separation_and_determinism(kind):
    torch.manual_seed(1)
    lengths = [20, 3, 41]
    xs = [torch.randn(t, 6) for t in lengths]
    build = BUILDERS[kind]
    together = build(torch.cat(xs), _batch(lengths), max_children=3)
    again = build(torch.cat(xs), _batch(lengths), max_children=3)
    assert torch.equal(together.parent, again.parent)
    assert torch.equal(together.position, again.position)
    # each sequence gets the tree it gets alone
    sets = _leaf_sets(together.parent, sum(lengths))
    offset, alone = 0, []
    for x in xs:
        alone += [tuple(r + offset for r in s)
                  for s in _leaf_sets(build(x, max_children=3).parent, x.shape[0])]
        offset += x.shape[0]
    assert sets == sorted(alone)


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("include_self", [True, False])
def test_hsa_on_induced_tree_is_exact(kind, include_self):
    torch.manual_seed(2)
    lengths = [9, 1, 14]
    n = sum(lengths)
    q, k, v = (torch.randn(n, 2, 3, dtype=torch.float64) for _ in range(3))
    tree = BUILDERS[kind](k.flatten(1), _batch(lengths), max_children=3)
    y = hsa_graph.hsa(q, k, v, tree, include_self=include_self)
    torch.testing.assert_close(y, dense_hsa(tree.parent.tolist(), q, k, v,
                                            include_self=include_self))


def test_causal_hsa_and_cache_on_contiguous_tree():
    torch.manual_seed(3)
    n = 13
    q, k, v = (torch.randn(n, 2, 4, dtype=torch.float64) for _ in range(3))
    tree = contiguous_tree(k.flatten(1), max_children=3)
    y = hsa_graph.causal_hsa(q, k, v, tree)
    torch.testing.assert_close(y, dense_causal_hsa(tree.parent.tolist(), q, k, v))
    cache = hsa_graph.HSACache()
    steps = [cache.append(q[i], k[i], v[i], **move)
             for i, move in enumerate(hsa_graph.HSACache.moves_of(tree))]
    torch.testing.assert_close(torch.stack(steps), y)


def test_planted_segments_are_found():
    # four runs of near-identical vectors in four directions: each run is one node
    torch.manual_seed(4)
    directions = torch.eye(8)[[0, 3, 5, 1]]
    lengths = [4, 3, 4, 2]
    x = torch.cat([d.expand(t, 8) for d, t in zip(directions, lengths)])
    x = x + 0.01 * torch.randn_like(x)
    tree = contiguous_tree(x, max_children=4)
    sets = _leaf_sets(tree.parent, x.shape[0])
    start = np.cumsum([0] + lengths)
    for a, b in zip(start[:-1], start[1:]):
        assert tuple(range(a, b)) in sets
    # windows of 4 cut through the runs of 3 and 2
    windows = _leaf_sets(hsa_graph.hopping_window_tree(x.shape[0], (4, 4)).parent, 13)
    assert (4, 5, 6) not in windows


def test_planted_clusters_are_found():
    torch.manual_seed(5)
    centres = 10 * torch.randn(4, 6)
    label = torch.arange(16) % 4                      # the clusters interleave in row order
    x = centres[label] + 0.1 * torch.randn(16, 6)
    tree = cluster_tree(x, max_children=4)
    sets = _leaf_sets(tree.parent, 16)
    for c in range(4):
        assert tuple((label == c).nonzero().flatten().tolist()) in sets
    assert tree.geometry_names()[16:] == ["set"] * 5


@pytest.mark.parametrize("kind", BUILDERS)
def test_depth_stays_logarithmic(kind):
    # a monotone drift and constant rows (all gaps tie): still O(log N) levels
    n = 2000
    t = torch.linspace(0, 1, n)
    for x in (torch.stack([torch.cos(t), torch.sin(t)], 1), torch.ones(n, 3)):
        for m in (2, 4):
            tree = BUILDERS[kind](x, max_children=m)
            assert tree.structure.max_depth <= math.log(n) / math.log(4 / 3) + 2
            assert int(_family_sizes(tree).max()) <= m


@pytest.mark.parametrize("kind", BUILDERS)
def test_scale_invariant_and_no_overflow(kind):
    torch.manual_seed(6)
    x = torch.randn(40, 4, dtype=torch.float64)
    base = BUILDERS[kind](x).parent
    for factor in (1e-300, 1e300):
        assert torch.equal(BUILDERS[kind](x * factor).parent, base)
    big = torch.full((30, 2), 3e38)  # float32 sums of these would overflow
    assert BUILDERS[kind](big).num_leaves == 30


@pytest.mark.parametrize("kind", BUILDERS)
def test_no_gradient_and_half_precision(kind):
    x = torch.randn(12, 4, requires_grad=True)
    tree = BUILDERS[kind](x)
    assert not tree.parent.requires_grad
    half = BUILDERS[kind](x.detach().to(torch.bfloat16))
    assert half.num_leaves == 12


def test_euclidean_similarity():
    x = torch.tensor([[0.0], [0.1], [5.0], [5.1], [9.0]])
    sets = _leaf_sets(contiguous_tree(x, max_children=2, similarity="euclidean").parent, 5)
    assert (0, 1) in sets and (2, 3) in sets
    with pytest.raises(ValueError, match="similarity must be one of"):
        contiguous_tree(x, similarity="dot")


BAD = [
    (lambda: torch.randn(0, 3), None, 4, ValueError, "no rows"),
    (lambda: torch.randn(4, 0), None, 4, ValueError, "width 0"),
    (lambda: torch.randn(5), None, 4, ValueError, r"shape \[N, D\]"),
    (lambda: torch.randn(2, 3, 4), None, 4, ValueError, r"shape \[N, D\]"),
    (lambda: torch.tensor([[1.0], [math.nan]]), None, 4, ValueError, "row 1 is not finite"),
    (lambda: torch.tensor([[1.0], [math.inf]]), None, 4, ValueError, "row 1 is not finite"),
    (lambda: torch.ones(3, 2, dtype=torch.long), None, 4, TypeError, "floating point"),
    (lambda: np.ones((3, 2)), None, 4, TypeError, "numpy"),
    (lambda: [[1.0, 2.0]], None, 4, TypeError, "torch.Tensor"),
    (lambda: torch.randn(3, 2), torch.tensor([0, 0]), 4, ValueError, r"shape \[3\]"),
    (lambda: torch.randn(3, 2), torch.tensor([0.0, 0, 1]), 4, TypeError, "integer"),
    (lambda: torch.randn(3, 2), [0, 0, 1], 4, TypeError, "1-D integer tensor"),
    (lambda: torch.randn(3, 2), torch.tensor([0, -1, 1]), 4, ValueError, r"batch\[1\] = -1"),
    (lambda: torch.randn(3, 2), torch.tensor([0, 2, 2]), 4, ValueError, "sequence id 1"),
    (lambda: torch.randn(3, 2), torch.tensor([0, 0, 10**15]), 4, ValueError,
     "ids up to 1000000000000000 but only 3 rows"),
    (lambda: torch.randn(3, 2), None, 1, ValueError, "max_children must be >= 2"),
    (lambda: torch.randn(3, 2), None, 0, ValueError, "max_children must be >= 2"),
    (lambda: torch.randn(3, 2), None, True, TypeError, "max_children must be an int"),
    (lambda: torch.randn(3, 2), None, 2.0, TypeError, "max_children must be an int"),
    (lambda: torch.randn(3, 2), None, "4", TypeError, "max_children must be an int"),
]


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("make_x,batch,m,error,match", BAD)
def test_bad_input(kind, make_x, batch, m, error, match):
    with pytest.raises(error, match=match):
        BUILDERS[kind](make_x(), batch, max_children=m)


def test_unsorted_batch():
    x, batch = torch.randn(4, 2), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"batch must be sorted.*batch\[2\] = 0"):
        contiguous_tree(x, batch)
    # sets have no order: clustering takes the rows of each set wherever they are
    tree = cluster_tree(x, batch)
    assert torch.equal(tree.structure.leaf_tree, batch)


def test_large_max_children_is_flat():
    x = torch.randn(50, 3)
    for build in BUILDERS.values():
        tree = build(x, max_children=10**30)
        assert tree.num_nodes == 51 and tree.structure.num_trees == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", BUILDERS)
def test_cuda_matches_cpu(kind):
    torch.manual_seed(7)
    x, batch = torch.randn(300, 8), _batch([100, 1, 199])
    cpu = BUILDERS[kind](x, batch)
    cuda = BUILDERS[kind](x.cuda(), batch.cuda())
    assert cuda.parent.device.type == "cuda"
    assert torch.equal(cuda.parent.cpu(), cpu.parent)
