"""HSACache (hsa_graph.ops.cache): token-by-token outputs equal causal_hsa on the tree the
appends built, which equals the dense prefix-tree reference."""
from __future__ import annotations

import random

import pytest
import torch
from causal_reference import dense_causal_hsa

import hsa_graph
from hsa_graph.ops.cache import HSACache
from hsa_graph.ops.causal import causal_hsa


def run_cache(q, k, v, moves, include_self=True):
    cache = HSACache(include_self=include_self)
    ys = [cache.append(q[i], k[i], v[i], **moves[i]) for i in range(q.shape[0])]
    return cache, torch.stack(ys)


def random_moves(n: int, seed: int, max_depth: int = 4):
    rng = random.Random(seed)
    depth = rng.randint(1, max_depth)
    moves = [dict(depth=depth)]
    for _ in range(n - 1):
        new_depth = rng.randint(1, max_depth) if rng.random() < 0.2 else depth
        attach = rng.randint(0, min(depth, new_depth) - 1)
        moves.append(dict(attach=attach, depth=new_depth))
        depth = new_depth
    return moves


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("include_self", [True, False])
def test_cache_equals_full_recomputation(seed, include_self):
    n = 40
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cache, ys = run_cache(q, k, v, random_moves(n, seed), include_self)
    tree = hsa_graph.NestedSignal.from_parents(cache.parent)
    assert tree.num_leaves == n
    full = causal_hsa(q, k, v, tree, include_self=include_self)
    torch.testing.assert_close(ys, full, atol=1e-12, rtol=1e-10)


def test_cache_equals_dense_reference_on_text_moves():
    # doc -> paragraph -> sentence -> token: 2 = same sentence, 1 = new sentence,
    # 0 = new paragraph
    attach = [None, 2, 2, 1, 2, 0, 2, 2, 1, 1, 2]
    moves = [dict(depth=3)] + [dict(attach=a) for a in attach[1:]]
    n = len(moves)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    cache, ys = run_cache(q, k, v, moves)
    assert cache.depth == 3
    ref = dense_causal_hsa(cache.parent, q, k, v)
    torch.testing.assert_close(ys, ref, atol=1e-12, rtol=1e-10)


def test_cache_on_flat_tree_is_causal_softmax():
    n = 30
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    _, ys = run_cache(q, k, v, [{}] * n)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(ys, ref.transpose(0, 1), atol=1e-12, rtol=1e-10)


def test_cache_keeps_only_the_right_spine():
    cache = HSACache()
    x = torch.randn(1, 4)
    cache.append(x, x, x, depth=3)
    for i in range(60):  # sentences of 5 tokens, paragraphs of 4 sentences
        attach = 0 if i % 20 == 19 else 1 if i % 5 == 4 else 2
        cache.append(x, x, x, attach=attach)
    # completed children kept: paragraphs under the root, sentences of the open
    # paragraph, tokens of the open sentence; never the closed sentences' tokens
    assert [lvl.size for lvl in cache.levels] == [3, 0, 0]
    assert cache.num_tokens == 61


def test_bad_appends_raise():
    cache = HSACache()
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="attach must be None"):
        cache.append(x, x, x, attach=0)
    cache.append(x, x, x, depth=2)
    with pytest.raises(ValueError, match=r"attach must be a depth in 0..1"):
        cache.append(x, x, x, attach=2)
    with pytest.raises(ValueError, match="one token"):
        cache.append(x[None], x[None], x[None])
    with pytest.raises(ValueError, match="token shapes changed"):
        cache.append(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        cache.append(x, x, x, depth=0)


def test_absurd_depth_is_refused_at_once():
    # an absurd depth once ran for minutes, opening one level per unit of depth
    import time

    cache = HSACache()
    q = torch.randn(2, 4)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="max_depth"):
        cache.append(q, q, q, depth=10**9)
    assert time.perf_counter() - start < 1.0
    deep = HSACache(max_depth=10**9)   # a deeper cache is one argument away
    assert deep.max_depth == 10**9
    with pytest.raises(ValueError, match="max_depth"):
        HSACache(max_depth=0)


def test_mixed_dtypes_across_appends_are_refused():
    cache = HSACache()
    q = torch.randn(2, 4)
    cache.append(q, q, q, depth=2)
    with pytest.raises(ValueError, match="float64"):
        cache.append(q.double(), q.double(), q.double())
