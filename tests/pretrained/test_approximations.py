import sys
from pathlib import Path

import pytest
import torch

import hsa_graph
from hsa_graph import NestedSignal, hopping_window_tree, hsa_weights
from hsa_graph.pretrained import (
    attention_flops,
    attention_kl,
    block_average_weights,
    pooled_softmax_weights,
    softmax_weights,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference import flat_softmax_rows, kl_objective  # noqa: E402

# a forest with a ragged hopping-window tree, a deeper mixed tree and a lonely leaf
PARENTS = [
    hopping_window_tree(11, (2, 3)).parent.tolist(),
    [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 6, 6, 6, 7, 7],
    [-1],
]


def _forest():
    parent, offset = [], 0
    for tree in PARENTS:
        parent += [p + offset if p >= 0 else -1 for p in tree]
        offset += len(tree)
    return NestedSignal.from_parents(parent)


def _qk(n, heads=3, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, dim, generator=g, dtype=torch.float64) * 1.5,
            torch.randn(n, heads, dim, generator=g, dtype=torch.float64) * 1.5)


def _blocks(tree):
    """(rows, cols) leaf index sets of every sibling block, by brute force."""
    parent = tree.parent.tolist()
    leaves = tree.leaf_index.tolist()
    row = {u: i for i, u in enumerate(leaves)}

    def under(u):
        out, stack = [], [u]
        while stack:
            x = stack.pop()
            kids = [c for c, p in enumerate(parent) if p == x]
            out += [row[x]] if not kids else []
            stack += kids
        return out

    fams = {}
    for c, p in enumerate(parent):
        if p >= 0:
            fams.setdefault(p, []).append(c)
    return [(under(a), under(b)) for kids in fams.values() for a in kids for b in kids
            if a != b]


def test_softmax_weights_match_the_reference():
    tree = _forest()
    q, k = _qk(tree.num_leaves)
    expected = flat_softmax_rows(tree.parent, q, k)
    assert torch.allclose(softmax_weights(q, k, tree), expected, atol=1e-12)


@pytest.mark.parametrize("method", ["block_average", "pooled_softmax"])
def test_competitors_are_block_constrained_and_stochastic(method):
    tree = _forest()
    q, k = _qk(tree.num_leaves, seed=1)
    p = softmax_weights(q, k, tree)
    theta = (block_average_weights(p, tree) if method == "block_average"
             else pooled_softmax_weights(q, k, tree))
    assert torch.allclose(theta.sum(-1), torch.ones_like(theta[..., 0]), atol=1e-12)
    assert bool((theta >= 0).all())
    assert bool((theta[p == 0] == 0).all())             # nothing across trees
    for rows, cols in _blocks(tree):
        block = theta[:, rows][:, :, cols]
        assert torch.allclose(block, block[:, :1, :1].expand_as(block), atol=1e-12)


def test_block_average_keeps_block_masses():
    """Under the root (m = 1) every sibling block keeps exactly the softmax's mass."""
    tree = hopping_window_tree(12, (3, 2))           # root over two windows of 6
    q, k = _qk(12, seed=2)
    p = softmax_weights(q, k, tree)
    theta = block_average_weights(p, tree)
    rows, cols = list(range(6)), list(range(6, 12))
    for r, c in ((rows, cols), (cols, rows)):
        assert torch.allclose(theta[:, r][:, :, c].sum((-1, -2)), p[:, r][:, :, c].sum((-1, -2)),
                              atol=1e-12)
    flat = hsa_graph.flatten(tree)
    assert torch.allclose(block_average_weights(p, flat), p, atol=1e-12)


def test_one_level_tree_gives_softmax():
    tree = hsa_graph.flatten(_forest())
    q, k = _qk(tree.num_leaves, seed=3)
    p = softmax_weights(q, k, tree)
    assert torch.allclose(pooled_softmax_weights(q, k, tree), p, atol=1e-12)
    kl = attention_kl(hsa_weights(q, k, tree), p)
    assert torch.allclose(kl, torch.zeros_like(kl), atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_hsa_has_the_lowest_kl(seed):
    """Theorem 3.2 on the competitors, per head, against the reference objective."""
    tree = _forest()
    q, k = _qk(tree.num_leaves, seed=seed)
    p = softmax_weights(q, k, tree)
    hsa = attention_kl(hsa_weights(q, k, tree), p).sum(-1)
    for theta in (block_average_weights(p, tree), pooled_softmax_weights(q, k, tree)):
        other = attention_kl(theta, p).sum(-1)
        assert bool((hsa <= other + 1e-9).all())
        assert float(other.sum() - hsa.sum()) > 1e-6
    assert torch.allclose(hsa.sum(), kl_objective(hsa_weights(q, k, tree), p))


def test_kl_values_and_errors():
    p = torch.tensor([[0.25, 0.75]])
    theta = torch.tensor([[0.5, 0.5]])
    expected = 0.5 * torch.log(torch.tensor(2.0)) + 0.5 * torch.log(torch.tensor(2 / 3))
    assert torch.allclose(attention_kl(theta, p), expected.view(1))
    with pytest.raises(ValueError, match="infinite"):
        attention_kl(theta, torch.tensor([[1.0, 0.0]]))
    with pytest.raises(ValueError, match="same shape"):
        attention_kl(theta, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"p must be \[H, 3, 3\]"):
        block_average_weights(torch.ones(1, 2, 2), hopping_window_tree(3, (2,)))


def test_flops_count_families():
    tree = _forest()
    f = attention_flops(tree, head_dim=4, heads=2)
    # independent count: families with >= 2 members, per tree
    sizes_per_tree = []
    for parent in PARENTS:
        counts = torch.bincount(torch.tensor([p for p in parent if p >= 0], dtype=torch.long),
                                minlength=len(parent))
        fam = counts[counts >= 2].double()
        sizes_per_tree.append(float((4 * fam ** 2 * 4 + 3 * fam * 4).sum() * 2))
    assert f["hsa"].tolist() == sizes_per_tree
    assert f["leaves"].tolist() == [11.0, 9.0, 1.0]
    assert f["flat"].tolist() == [4 * n * n * 4 * 2 for n in (11, 9, 1)]
    # 512 tokens under (2, 4, 8, 16): far fewer than flat
    big = attention_flops(hopping_window_tree(512, (2, 4, 8, 16)), head_dim=32, heads=12)
    assert float(big["flat"][0] / big["hsa"][0]) > 50
    with pytest.raises(ValueError, match="head_dim"):
        attention_flops(tree, head_dim=0)
