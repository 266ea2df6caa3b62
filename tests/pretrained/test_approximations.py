import math
import sys
from pathlib import Path

import pytest
import torch

import hsa_graph
from hsa_graph import NestedSignal, hopping_window_tree, hsa_weights
from hsa_graph.pretrained import approximations as ap
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


# ------------------------------------------------------------ sparse patterns
LENGTHS = (7, 12, 1)
BATCH = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))


def _p(heads=3, seed=0, batch=BATCH):
    g = torch.Generator().manual_seed(seed)
    n = batch.numel()
    logits = torch.randn(heads, n, n, generator=g, dtype=torch.float64) * 2
    same = batch.unsqueeze(1) == batch.unsqueeze(0)
    return torch.softmax(logits.masked_fill(~same, float("-inf")), -1)


def _rows():
    """(example, position, length) of every row, for the brute-force references."""
    out = []
    for b, length in enumerate(LENGTHS):
        out += [(b, t, length) for t in range(length)]
    return out


def _brute(rule):
    rows = _rows()
    return torch.tensor([[bi == bj and rule(ti, tj, li) for bj, tj, _ in rows]
                         for bi, ti, li in rows])


@pytest.mark.parametrize("window", [0, 1, 3, 20])
def test_local_support_matches_brute_force(window):
    expected = _brute(lambda i, j, n: abs(i - j) <= window)
    assert torch.equal(ap.local_support(BATCH, window), expected)


@pytest.mark.parametrize("block,summary", [(1, 1), (3, 1), (4, 2), (5, 5)])
def test_fixed_support_matches_brute_force(block, summary):
    expected = _brute(lambda i, j, n: i // block == j // block or j % block >= block - summary)
    assert torch.equal(ap.fixed_support(BATCH, block, summary), expected)


@pytest.mark.parametrize("window,num_global,num_random", [(0, 0, 0), (1, 2, 2), (2, 1, 3),
                                                         (0, 0, 50)])
def test_bigbird_support_is_local_global_and_random(window, num_global, num_random):
    s = ap.bigbird_support(BATCH, window, num_global, num_random, seed=3)
    fixed = _brute(lambda i, j, n: abs(i - j) <= window or i < num_global or j < num_global)
    assert bool((s >= fixed).all())                      # local + global always kept
    extra = (s & ~fixed).sum(1)
    missing = (_brute(lambda i, j, n: True) & ~fixed).sum(1)
    assert torch.equal(extra, missing.clamp(max=num_random))   # exactly r more, or all
    same = BATCH.unsqueeze(1) == BATCH.unsqueeze(0)
    assert not bool((s & ~same).any())
    assert torch.equal(s, ap.bigbird_support(BATCH, window, num_global, num_random, seed=3))
    if 0 < num_random < 5:            # a few of many free keys: the seed matters
        assert not torch.equal(s, ap.bigbird_support(BATCH, window, num_global, num_random,
                                                     seed=4))


def _patterns(p):
    return {
        "local": ap.local_support(BATCH, 2),
        "fixed": ap.fixed_support(BATCH, 3),
        "bigbird": ap.bigbird_support(BATCH, 1, 1, 2),
        "topk": ap.topk_support(p, 4),
    }


def test_weights_are_row_stochastic_on_their_support():
    p = _p()
    functions = {
        "local": ap.local_weights(p, BATCH, 2),
        "fixed": ap.fixed_weights(p, BATCH, 3),
        "bigbird": ap.bigbird_weights(p, BATCH, 1, 1, 2),
        "topk": ap.topk_weights(p, 4),
    }
    for name, support in _patterns(p).items():
        theta = functions[name]
        assert torch.allclose(theta.sum(-1), torch.ones(3, BATCH.numel(),
                                                        dtype=torch.float64)), name
        assert torch.equal(theta > 0, support.expand_as(theta)), name
        # masked attention: the softmax of the logits restricted to the support
        logits = p.log()
        masked = torch.softmax(logits.masked_fill(~support, float("-inf")), -1)
        assert torch.allclose(theta, masked, atol=1e-12), name
        # renormalised p is the KL-closest on its support: KL = -log P(S)
        kl = ap.attention_kl(theta, p)
        assert torch.allclose(kl, -(p * support).sum(-1).log(), atol=1e-10), name


def test_support_sizes_are_the_budget():
    p = _p()
    for name, support in _patterns(p).items():
        cost = ap.sparse_cost(support, head_dim=8, heads=3, batch=BATCH)
        sizes = support.sum(-1).double()
        per_row = sizes if support.dim() == 2 else sizes.mean(0)
        assert torch.equal(cost["budget"], per_row), name
        per_example = torch.zeros(len(LENGTHS), dtype=torch.float64).index_add_(
            0, BATCH, sizes.sum(0) if support.dim() == 3 else 3 * sizes)
        assert torch.equal(cost["flops"], 4 * 8 * per_example), name
    # the nominal budgets, away from the sequence ends
    local = ap.local_support(BATCH, 2).sum(1)
    assert local[2:5].tolist() == [5, 5, 5]                   # 2 w + 1
    topk = ap.topk_support(p, 4).sum(-1)
    assert torch.equal(topk, torch.tensor(LENGTHS).clamp(max=4).repeat_interleave(
        torch.tensor(LENGTHS)).expand(3, -1))
    fixed = ap.fixed_support(BATCH, 3).sum(1)                 # l + (blocks - 1) c
    assert fixed[7:19].tolist() == [3 + 3] * 12


def test_full_support_costs_flat_attention():
    tree = hsa_graph.hopping_window_forest(torch.tensor(LENGTHS), (2, 3))
    same = BATCH.unsqueeze(1) == BATCH.unsqueeze(0)
    cost = ap.sparse_cost(same, head_dim=4, heads=2, batch=BATCH)
    assert torch.equal(cost["flops"], ap.attention_flops(tree, 4, 2)["flat"])
    assert torch.equal(ap.hsa_budget(hsa_graph.flatten(tree)),
                       torch.tensor(LENGTHS, dtype=torch.float64).repeat_interleave(
                           torch.tensor(LENGTHS)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_is_the_kl_best_support_of_its_size(seed):
    p = _p(seed=seed)
    for name, support in _patterns(p).items():
        sizes = support.expand_as(p).sum(-1)
        kl = ap.attention_kl(ap.sparse_weights(p, support), p)
        best = torch.full_like(kl, math.inf)
        for k in sizes.unique().tolist():
            top = ap.attention_kl(ap.topk_weights(p, int(k)), p)
            best = torch.where(sizes == k, top, best)
        assert bool((best <= kl + 1e-12).all()), name
        if name != "topk":
            assert bool((best < kl - 1e-9).any()), name


def test_hsa_budget_counts_the_blocks_a_row_sees():
    parents = [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 6, 6, 6, 7, 7]
    for tree in (NestedSignal.from_parents(parents), hopping_window_tree(11, (2, 3)),
                 hsa_graph.hopping_window_forest(torch.tensor(LENGTHS), (2, 4))):
        n = tree.num_leaves
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(2, n, 1, 3, generator=g, dtype=torch.float64)
        theta = hsa_weights(q, k, tree)[0]
        distinct = torch.tensor([float(torch.unique(row[row > 0].round(decimals=12)).numel())
                                 for row in theta])
        assert torch.equal(ap.hsa_budget(tree), distinct)
    assert ap.hsa_budget(hopping_window_tree(16, (2, 4, 2))).tolist() == [1 + 1 + 3 + 1] * 16


def test_bad_input():
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        ap.local_support(BATCH, -1)
    with pytest.raises(ValueError, match="window must be an int"):
        ap.local_support(BATCH, True)
    with pytest.raises(ValueError, match="sorted"):
        ap.local_support(BATCH.flip(0), 1)
    with pytest.raises(TypeError, match="1-D integer"):
        ap.fixed_support(BATCH.double(), 2)
    with pytest.raises(ValueError, match="num_rows"):
        ap.fixed_support(None, 2)
    with pytest.raises(ValueError, match="summary must be <= block"):
        ap.fixed_support(BATCH, 2, 3)
    with pytest.raises(ValueError, match="k must be"):
        ap.topk_support(_p(), 0)
    with pytest.raises(TypeError, match="boolean"):
        ap.sparse_weights(_p(), ap.local_support(BATCH, 1).long())
    with pytest.raises(ValueError, match="holds no mass"):
        ap.sparse_weights(_p(), torch.zeros(BATCH.numel(), BATCH.numel(), dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        ap.sparse_weights(_p(), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch has 20 rows but there are 5"):
        ap.sparse_cost(torch.ones(5, 5, dtype=torch.bool), 4, batch=BATCH)
    with pytest.raises(TypeError, match="seed"):
        ap.bigbird_support(BATCH, 1, seed=1.5)
