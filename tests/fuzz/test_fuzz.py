"""Property-based fuzzing of every builder, the constructors, hsa and hsa_graph.io
(targets in targets.py; ``benchmarks/fuzz.py`` runs the same ones for longer), and the
big hostile inputs once each: a million leaves, depth-10,000 chains and HTML, a
megabyte of text on one line, all under a lowered recursion limit."""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from targets import TARGETS, Rejected, check_tree

from hsa_graph import NestedSignal, hsa
from hsa_graph.builders import (
    document_tree,
    html_tree,
    image_tree,
    text_tree,
)

CI_EXAMPLES = 25


def make_test(name):
    strategy, run = TARGETS[name].strategy, TARGETS[name].run

    @settings(max_examples=CI_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy())
    def test(case):
        try:
            run(case)
        except Rejected:
            pass
    return test


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_target(name):
    make_test(name)()


@pytest.fixture
def low_recursion_limit():
    """Far below the default (1000): any recursion over the tree's depth fails."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(250)
    yield
    sys.setrecursionlimit(before)


def timed(fn, *args, limit_s: float, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    took = time.perf_counter() - start
    assert took < limit_s, f"{fn.__name__} took {took:.1f} s (limit {limit_s} s)"
    return out


def test_depth_10000_chain(low_recursion_limit):
    parent = [-1] + list(range(9_999)) + [9_999, 9_999]   # two leaves at depth 10,000
    tree = timed(NestedSignal.from_parents, parent, limit_s=30)
    check_tree(tree, parent)
    q = k = v = torch.randn(2, 1, 4, dtype=torch.float64)
    y = timed(hsa, q, k, v, tree, limit_s=60)
    # unary nodes are transparent: the same as the two leaves under one root
    torch.testing.assert_close(y, hsa(q, k, v, NestedSignal.from_parents([-1, 0, 0])))
    nested = [1, 2]
    for _ in range(10_000):
        nested = [nested]
    assert timed(NestedSignal.from_nested, nested, limit_s=30).x.tolist() == [1, 2]
    back = timed(NestedSignal.from_networkx, tree.to_networkx(), order="position", limit_s=30)
    assert back.parent.tolist() == parent


def test_depth_10000_documents_and_html(low_recursion_limit):
    doc = "leaf."
    for _ in range(10_000):
        doc = {"a": doc}
    tree = timed(document_tree, doc, limit_s=30)
    assert tree.num_nodes == 10_000 + 3 + 2 and tree.num_leaves == 2   # + paragraph, sentence
    page = "<div>" * 10_000 + "deep text" + "</div>" * 10_000
    tree = timed(html_tree, page, limit_s=30)
    assert tree.num_leaves == 2 and tree.structure.max_depth < 300   # capped by max_depth
    unclosed = timed(html_tree, "<ul><li>" * 10_000 + "x", limit_s=30)
    assert unclosed.num_leaves == 1


def test_cyclic_python_data_is_refused(low_recursion_limit):
    loop = [1, 2]
    loop.append(loop)
    with pytest.raises(ValueError, match="cycle at root\\[2\\]"):
        NestedSignal.from_nested(loop)
    fields = {"a": "text"}
    fields["b"] = [fields]
    with pytest.raises(ValueError, match="cycle"):
        document_tree(fields)
    shared = [1, 2]                     # shared but acyclic: copied, not refused
    assert NestedSignal.from_nested([shared, shared]).x.tolist() == [1, 2, 1, 2]


def test_a_million_leaves(low_recursion_limit):
    n = 1_000_000                                        # root -> 1000 blocks -> 1000 leaves
    parent = torch.cat([torch.tensor([-1]), torch.zeros(1000, dtype=torch.long),
                        torch.arange(1, 1001).repeat_interleave(1000)])
    tree = timed(NestedSignal.from_parents, parent, limit_s=30)
    assert tree.num_leaves == n and tree.structure.num_families == 1001
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, n, 1, 2, generator=g).unbind(0)
    # q = 0: every logit is 0, the flat softmax is uniform and block-constant, so HSA
    # (its KL projection) is uniform too: every output is the mean of v
    y = timed(hsa, torch.zeros_like(k), k, v, tree, limit_s=60)
    torch.testing.assert_close(y, v.double().mean(0, keepdim=True).float().expand_as(y),
                               rtol=0, atol=1e-5)


def test_a_megabyte_on_one_line(low_recursion_limit):
    text = "word, " * 170_000 + "end"                     # ~1 MB, no line break
    tree = timed(text_tree, text, limit_s=60)
    assert tree.num_leaves == 340_001 and tree.tokens[-1] == "end"
    flood = "<p>" + "&amp;&lt;" * 100_000 + "</p>"          # an entity flood
    tree = timed(html_tree, flood, limit_s=60)
    assert tree.num_leaves == 200_000


@pytest.mark.parametrize("image, match", [
    (np.zeros((0, 7, 3), np.uint8), "empty"),
    (np.zeros((4, 4, 6), np.uint8), "channels"),
    (np.zeros((4, 4, 3), np.int32), "dtype"),
    (np.zeros((2, 2, 2, 3)), "shape"),
])
def test_bad_images_are_named(image, match):
    with pytest.raises((ValueError, TypeError), match=match):
        image_tree(image, 2)


def test_huge_patch_does_not_allocate_the_padding():
    with pytest.raises(ValueError, match="smaller patch_size"):
        image_tree(np.zeros((4, 4, 3), np.uint8), 10**9)
    one = image_tree(np.ones((1, 1, 3), np.uint8), 16)     # small padding is fine
    assert one.x.shape == (1, 768) and float(one.x.sum()) == pytest.approx(3 / 255)
