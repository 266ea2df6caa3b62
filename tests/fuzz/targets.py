"""Fuzz targets: a hypothesis strategy of random and adversarial inputs per public
entry point, and a check that the entry point either raises a documented error
(``ValueError`` / ``TypeError`` with a message) or returns a correct tree.

Correctness is checked independently of the library: parent arrays are validated in
plain Python, leaves and tokens must come back in order, image pixels must be the
patches, and on small trees ``hsa`` must equal the dense reference of tests/reference.py
and ``causal_hsa`` the prefix-tree reference of tests/causal_reference.py (float64).
The CI tests (test_fuzz.py) and ``benchmarks/fuzz.py`` run the same targets, with few
and with many examples.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import networkx as nx
import numpy as np
import torch
from causal_reference import dense_causal_hsa
from hsa_trees import dfs_relabel, parent_arrays, relabel
from hypothesis import strategies as st
from reference import dense_hsa

import hsa_graph
import hsa_graph.io
from hsa_graph import BatchedHSACache, NestedSignal, Node, hsa, structure
from hsa_graph.builders import (
    document_tree,
    hopping_window_parents,
    html_tree,
    image_tree,
    text_tree,
)
from hsa_graph.ops.cache import parents_of_moves

DOCUMENTED = (ValueError, TypeError)


class Rejected(Exception):
    """The input was refused with a documented error (counted, not a failure)."""


def refuse(error: BaseException) -> None:
    assert isinstance(error, DOCUMENTED), f"undocumented {type(error).__name__}: {error}"
    assert str(error).strip(), f"{type(error).__name__} without a message"
    raise Rejected(type(error).__name__) from error


def call(fn: Callable, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except DOCUMENTED as error:
        refuse(error)


# ----------------------------------------------------------- independent checks
def forest_problem(parent: List[Any]) -> str:
    """Why a parent list is not a forest ('' when it is), in plain Python."""
    m = len(parent)
    if m == 0:
        return "empty"
    for u, p in enumerate(parent):
        if not isinstance(p, int) or not (p == -1 or 0 <= p < m):
            return f"range {u}"
    state = [0] * m  # 0 new, 1 on the current walk, 2 reaches a root
    for start in range(m):
        walk, u = [], start
        while u != -1 and state[u] == 0:
            state[u] = 1
            walk.append(u)
            u = parent[u]
        if u != -1 and state[u] == 1:
            return f"cycle {u}"
        for w in walk:
            state[w] = 2
    return ""


def check_tree(tree: NestedSignal, parent: List[int] = None, n_rows: int = None) -> None:
    """The stored fields agree with each other and with ``parent`` (when given)."""
    got = tree.parent.tolist()
    if parent is not None:
        assert got == list(parent)
    assert forest_problem(got) == ""
    m = len(got)
    has_child = [False] * m
    for p in got:
        if p >= 0:
            has_child[p] = True
    leaves = [u for u in range(m) if not has_child[u]]
    assert tree.leaf_index.tolist() == leaves
    assert tree.num_leaves == len(leaves) == tree.structure.num_leaves
    assert tree.structure.num_trees == got.count(-1)
    assert [g == -1 for g in tree.geometry.tolist()] == [not h for h in has_child]
    assert tree.position.shape == (m, 2) and tree.modality.shape == (m,)
    assert len(tree.key) == m and int(tree.modality.min()) >= 0
    if tree.get("x") is not None:
        assert tree.x.shape[0] == len(leaves)
    if n_rows is not None:
        assert len(leaves) == n_rows


def check_hsa(tree: NestedSignal, seed: int, scale_exp: int = 0, include_self: bool = True,
              with_pos: bool = False) -> None:
    """hsa equals the float64 dense reference, and is finite in float32 at large
    logits (small trees only)."""
    parent = tree.parent.tolist()
    n, m = tree.num_leaves, len(parent)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, n, 2, 3, generator=g, dtype=torch.float64)
    v = torch.randn(n, 2, 2, generator=g, dtype=torch.float64)
    pos = torch.randn(m, 2, 2, generator=g, dtype=torch.float64) if with_pos else None
    q = q * 10.0 ** scale_exp
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    y = hsa(*inputs, tree, include_self=include_self, pos=pos)
    ref = dense_hsa(parent, *ref_inputs, include_self=include_self, pos=pos)
    torch.testing.assert_close(y, ref, rtol=1e-7, atol=1e-9)
    if n:
        # Rows with a zero or tiny output gradient take the fused backward's fallback
        # for the log-sum-exp's gradient; the others fold it into the output.
        weights = torch.randn(y.shape, generator=g, dtype=torch.float64)
        row_scale = torch.tensor([1.0, 0.0, 1e-300, 1e-8])[
            torch.randint(0, 4, (n,), generator=g)].to(torch.float64)
        weights = weights * row_scale.view(-1, 1, 1)
        (y * weights).sum().backward()
        (ref * weights).sum().backward()
        for ours, theirs in zip(inputs, ref_inputs):
            expected = theirs.grad if theirs.grad is not None else torch.zeros_like(ours)
            # logits of size 10^e carry rounding of 10^e ulps into every gradient
            scale = max(1.0, float(expected.abs().max())) * 10.0 ** max(0, scale_exp)
            torch.testing.assert_close(ours.grad, expected, rtol=1e-7, atol=1e-9 * scale)
    # Without autograd hsa takes other paths (scratch reused across buckets, leaf rows
    # written into the output and weighed in place, buckets of leaves a chunk of
    # families at a time): the same reference, with values narrower than the keys and
    # as wide (only then do rows go straight into the output), at the default chunk
    # size or one family per chunk.
    v_wide = torch.randn(n, 2, 3, generator=g, dtype=torch.float64)
    chunk_bytes, structure._CHUNK_BYTES = structure._CHUNK_BYTES, (
        1 if seed % 2 else structure._CHUNK_BYTES)
    try:
        with torch.no_grad():
            for values in (v, v_wide):
                torch.testing.assert_close(
                    hsa(q, k, values, tree, include_self=include_self, pos=pos),
                    dense_hsa(parent, q, k, values, include_self=include_self, pos=pos),
                    rtol=1e-7, atol=1e-9)
    finally:
        structure._CHUNK_BYTES = chunk_bytes
    y32 = hsa(q.float(), k.float(), v.float(), tree, include_self=include_self,
              pos=None if pos is None else pos.float())
    assert bool(torch.isfinite(y32).all())


# ------------------------------------------------------------------ targets
def hostile_parents():
    """Valid forests, and the same with a random corruption: a cycle, a self-loop,
    an index out of range, a float, an empty list."""
    @st.composite
    def draw(draw):
        parent = list(draw(parent_arrays(24)))
        kind = draw(st.sampled_from(["valid"] * 4 + ["cycle", "self", "range", "noise"]))
        m = len(parent)
        if kind == "cycle" and m >= 2:
            a, b = draw(st.integers(0, m - 1)), draw(st.integers(0, m - 1))
            parent[a], parent[b] = b, a
        elif kind == "self":
            u = draw(st.integers(0, m - 1))
            parent[u] = u
        elif kind == "range":
            parent[draw(st.integers(0, m - 1))] = draw(st.sampled_from([m, m + 5, -2, -10**9]))
        elif kind == "noise":
            parent = draw(st.lists(st.integers(-2, m + 1), min_size=0, max_size=m))
        return parent, draw(st.integers(0, 2**31)), draw(st.integers(-3, 4)), \
            draw(st.booleans()), draw(st.booleans())
    return draw()


def run_parents(case) -> None:
    parent, seed, scale_exp, include_self, with_pos = case
    problem = forest_problem(parent)
    try:
        tree = NestedSignal.from_parents(parent)
    except DOCUMENTED as error:
        assert problem, f"a valid forest was refused: {error}"
        refuse(error)
    assert not problem, f"accepted a non-forest ({problem})"
    check_tree(tree, parent)
    check_hsa(tree, seed, scale_exp, include_self, with_pos)


def contiguous_forests():
    """Random forests renumbered depth-first (every node's leaves contiguous in leaf
    order, what causal HSA takes), with a seed, a later-rows change point,
    ``include_self``, positions and gradients on or off."""
    return st.tuples(parent_arrays(24), st.integers(0, 2 ** 31), st.integers(0, 23),
                     st.booleans(), st.booleans(), st.booleans())


def run_causal(case) -> None:
    """causal_hsa equals the dense prefix-tree reference (values and, when drawn,
    gradients, float64), and rows up to i do not change in any bit when the inputs of
    later rows do."""
    parent, seed, cut, include_self, with_pos, with_grad = case
    if forest_problem(parent):
        return
    parent = relabel(parent, dfs_relabel(parent))[0]
    tree = NestedSignal.from_parents(parent)
    n, m = tree.num_leaves, len(parent)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, n, 2, 3, generator=g, dtype=torch.float64)
    v = torch.randn(n, 2, 2, generator=g, dtype=torch.float64)
    pos = torch.randn(m, 2, 2, generator=g, dtype=torch.float64) if with_pos else None
    inputs = [t.clone().requires_grad_(with_grad) for t in (q, k, v)]
    y = hsa_graph.causal_hsa(*inputs, tree, include_self=include_self, pos=pos)
    ref_inputs = [t.clone().requires_grad_(with_grad) for t in (q, k, v)]
    ref = dense_causal_hsa(parent, *ref_inputs, include_self=include_self, pos=pos)
    torch.testing.assert_close(y, ref, rtol=1e-7, atol=1e-9)
    if with_grad and n:
        weights = torch.randn(y.shape, generator=g, dtype=torch.float64)
        (y * weights).sum().backward()
        (ref * weights).sum().backward()
        for ours, theirs in zip(inputs, ref_inputs):
            expected = theirs.grad if theirs.grad is not None else torch.zeros_like(ours)
            torch.testing.assert_close(ours.grad, expected, rtol=1e-7, atol=1e-9)
    i = cut % max(n, 1)
    if n > i + 1:   # the same path both times (with autograd it rounds otherwise)
        before = hsa_graph.causal_hsa(q, k, v, tree, include_self=include_self, pos=pos)
        later = [t.clone() for t in (q, k, v)]
        for t in later:
            t[i + 1:] = torch.randn(t[i + 1:].shape, generator=g, dtype=t.dtype) * 10
        again = hsa_graph.causal_hsa(*later, tree, include_self=include_self, pos=pos)
        assert torch.equal(again[:i + 1], before[:i + 1]), i


def cache_scenarios():
    """A seed for :func:`run_batched_cache`'s scenario, and ``include_self``."""
    return st.tuples(st.integers(0, 2 ** 31), st.booleans())


def _random_moves(rng: random.Random, n: int, max_depth: int) -> List[Dict[str, int]]:
    """``n`` placements of a token sequence's tree (see ``HSACache.append``): a first
    depth, then an attach level and a depth per token, sometimes changing depth. Most
    tokens join the deepest open node, as in text, so that open nodes below the root
    collect completed children (only there do their terms reach the outputs)."""
    depth = rng.randint(1, max_depth)
    moves = [dict(depth=depth)]
    for _ in range(n - 1):
        new_depth = rng.randint(1, max_depth) if rng.random() < 0.3 else depth
        deepest = min(depth, new_depth) - 1
        attach = deepest if rng.random() < 0.6 else rng.randint(0, deepest)
        moves.append(dict(attach=attach, depth=new_depth))
        depth = new_depth
    return moves


def run_batched_cache(case) -> None:
    """BatchedHSACache through a random life: sequences of random trees, some prefilled
    from prompts of random lengths (at the start or into the running batch), some
    started empty, each dropped when its tokens run out; every output, of the prefill
    and of each batched step, equals causal_hsa on that sequence's tree so far
    (float64)."""
    seed, include_self = case
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    count = rng.randint(1, 5)
    moves = [_random_moves(rng, rng.randint(1, 40), rng.randint(1, 4)) for _ in range(count)]
    tokens = [torch.randn(3, len(m), 2, 3, generator=g, dtype=torch.float64) for m in moves]
    expected = [hsa_graph.causal_hsa(*x, NestedSignal.from_parents(parents_of_moves(m)),
                                     include_self=include_self)
                for x, m in zip(tokens, moves)]
    cache = BatchedHSACache(include_self=include_self)
    rows: List[int] = []                  # cache row -> sequence
    done = [0] * count                    # tokens each sequence has taken
    waiting = list(range(count))

    def join(group: List[int]) -> None:
        prompts = [s for s in group if rng.random() < 0.6 and len(moves[s]) > 1]
        empty = [s for s in group if s not in prompts]
        if prompts:
            lengths = {s: rng.randint(1, len(moves[s]) - 1) for s in prompts}
            forest = hsa_graph.collate([NestedSignal.from_parents(
                parents_of_moves(moves[s][:lengths[s]])) for s in prompts])
            q, k, v = (torch.cat([tokens[s][j, :lengths[s]] for s in prompts])
                       for j in range(3))
            y = cache.prefill(q, k, v, forest)
            torch.testing.assert_close(y, torch.cat(
                [expected[s][:lengths[s]] for s in prompts]), rtol=1e-9, atol=1e-10)
            rows.extend(prompts)
            for s in prompts:
                done[s] = lengths[s]
        if empty:
            cache.add(len(empty))
            rows.extend(empty)

    join([waiting.pop(0) for _ in range(rng.randint(1, len(waiting)))])
    while rows:
        finished = [r for r, s in enumerate(rows) if done[s] == len(moves[s])]
        if finished:
            cache.drop(finished)
            for r in reversed(finished):
                del rows[r]
        if waiting and rng.random() < 0.3:
            join([waiting.pop(0)])
        if not rows:
            if waiting:
                join([waiting.pop(0)])
            continue
        y = cache.step(*(torch.stack([tokens[s][j, done[s]] for s in rows])
                         for j in range(3)),
                       attach=[moves[s][done[s]].get("attach") for s in rows],
                       depth=[moves[s][done[s]].get("depth") for s in rows])
        for r, s in enumerate(rows):
            torch.testing.assert_close(y[r], expected[s][done[s]], rtol=1e-9, atol=1e-10)
            done[s] += 1
    assert done == [len(m) for m in moves]


def nested_data():
    """Nested lists, tuples, dicts and Nodes with int leaves, sometimes with a
    hostile leaf (a float, a str, a bool, None, an empty list, a huge int)."""
    hostile = st.sampled_from([1.5, "a", True, None, [], {}, 2**70, -1])
    # about one leaf in 60 is hostile, so that most trees are valid
    leaf = st.integers(0, 59).flatmap(lambda r: hostile if r == 0 else st.integers(0, 1000))

    def extend(children):
        return st.one_of(
            st.lists(children, min_size=1, max_size=4),
            st.tuples(children, children),
            st.dictionaries(st.text("abc", min_size=1, max_size=2), children, min_size=1,
                            max_size=3),
            st.lists(children, min_size=1, max_size=4).map(lambda c: Node(c, geometry="set")),
            st.lists(children, min_size=2, max_size=4).map(
                lambda c: Node(c, geometry="graph", edges=[(0, len(c) - 1)])),
        )
    return st.recursive(leaf, extend, max_leaves=25)


def leaves_in_order(data: Any) -> List[Any]:
    out, stack = [], [data]
    while stack:
        item = stack.pop()
        if isinstance(item, Node):
            item = item.children
        if isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def run_nested(data) -> None:
    tree = call(NestedSignal.from_nested, data)
    leaves = leaves_in_order(data)
    assert all(isinstance(x, int) and not isinstance(x, bool) for x in leaves)
    assert tree.x.tolist() == leaves
    check_tree(tree, n_rows=len(leaves))
    back = NestedSignal.from_networkx(tree.to_networkx())
    assert back.parent.tolist() == tree.parent.tolist() and back.key == tree.key
    assert torch.equal(back.sibling_edge_index, tree.sibling_edge_index)


def random_digraphs():
    @st.composite
    def draw(draw):
        m = draw(st.integers(1, 12))
        edges = draw(st.lists(st.tuples(st.integers(0, m - 1), st.integers(0, m - 1)),
                              max_size=2 * m))
        if draw(st.booleans()):  # mostly trees: hang each node under an earlier one
            edges = [(draw(st.integers(0, u - 1)), u) for u in range(1, m)]
        graph = nx.DiGraph()
        graph.add_nodes_from(range(m))
        graph.add_edges_from(edges)
        return graph
    return draw()


def run_networkx(graph) -> None:
    is_forest = all(d <= 1 for _, d in graph.in_degree()) and nx.is_directed_acyclic_graph(graph)
    try:
        tree = NestedSignal.from_networkx(graph)
    except DOCUMENTED as error:
        assert not is_forest, f"a forest was refused: {error}"
        refuse(error)
    assert is_forest, "accepted a graph that is not a forest"
    check_tree(tree)
    assert sorted(tree.to_networkx().edges) == sorted(graph.edges)


ALPHABET = ("abcXYZ  ...!?\n\n\t\r\x00\x01\x1f\x7f\u200b\u200d\u2028\u2029\ufeff"
            "éß你好。مرحبا🙂👨‍👩‍👧'\"()-0123456789")


def texts():
    return st.one_of(st.text(ALPHABET, max_size=80), st.text(max_size=40))


def run_text(text: str) -> None:
    tree = call(text_tree, text)
    check_tree(tree, n_rows=len(tree.tokens))
    span = tree.span.tolist()
    leaves = tree.leaf_index.tolist()
    starts = []
    for token, u in zip(tree.tokens, leaves):
        a, b = span[u]
        assert text[a:b] == token, (token, text[a:b])
        starts.append(a)
    assert starts == sorted(starts)                      # reading order
    assert tree.x.tolist() == hsa_graph.builders.WordTokenizer().token_ids(tree.tokens)
    # every word character of the text is inside some token
    covered = set()
    for u in leaves:
        covered.update(range(*span[u]))
    assert all(i in covered for i, c in enumerate(text) if c.isalnum())


TAGS = ["div", "p", "span", "ul", "li", "table", "tr", "td", "th", "h1", "pre", "br", "img",
        "script", "style", "title", "main", "section", "a", "b", "svg", "template", "body"]


def html_pages():
    piece = st.one_of(
        st.sampled_from(TAGS).map(lambda t: f"<{t}>"),
        st.sampled_from(TAGS).map(lambda t: f"</{t}>"),
        st.sampled_from(['<img alt="a cat">', '<td colspan="99999">', '<td rowspan=-3>',
                         "<!--", "-->", "<![CDATA[x]]>", "&amp;", "&#0;", "&#x110000;",
                         "&nbsp;", "&lt;p&gt;", "<", ">", "<p hidden>", '<a href="x">',
                         "<div aria-hidden=true>", "</", "<br/>"]),
        st.text("ab .!\n\x00é你", min_size=1, max_size=12),
    )
    return st.lists(piece, max_size=40).map("".join)


def run_html(page: str) -> None:
    tree = call(html_tree, page)
    check_tree(tree)
    assert tree.x.dtype == torch.long and tree.x.dim() == 1
    if tree.num_nodes <= 60:
        check_hsa(tree, seed=len(page))


IMAGE_DTYPES = ["uint8", "uint16", "float32", "float64", "float16", "int8", "int64", "bool",
                "complex64"]


def images():
    @st.composite
    def draw(draw):
        h, w = draw(st.integers(0, 12)), draw(st.integers(0, 12))
        c = draw(st.sampled_from([None, 0, 1, 2, 3, 3, 3, 4, 5]))
        dtype = draw(st.sampled_from(IMAGE_DTYPES[:5] * 3 + IMAGE_DTYPES[5:]))
        shape = (h, w) if c is None else (h, w, c)
        rng = np.random.default_rng(draw(st.integers(0, 2**31)))
        array = (rng.random(shape) * 200).astype(dtype)
        if draw(st.booleans()):
            array = torch.from_numpy(array) if dtype != "uint16" else array
        patch = draw(st.one_of(st.integers(1, 6), st.integers(1, 6),
                               st.tuples(st.integers(1, 5), st.integers(1, 5)),
                               st.sampled_from([-1, 0, 2.5, True, 10**6])))
        return array, patch, draw(st.booleans()), draw(st.sampled_from(["pad", "crop"])), \
            draw(st.integers(2, 3)), draw(st.booleans())
    return draw()


def run_image(case) -> None:
    array, patch, quadtree, fit, region, mask = case
    tree = call(image_tree, array, patch, quadtree=quadtree, fit=fit, region=region,
                mask_channel=mask)
    pixels = torch.as_tensor(np.asarray(array)).double()
    if pixels.dim() == 2:
        pixels = pixels.unsqueeze(-1)
    if pixels.dtype != torch.float64 or not np.asarray(array).dtype.kind == "f":
        pixels = pixels / (255.0 if np.asarray(array).dtype == np.uint8 else 65535.0)
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    h, w, c = pixels.shape
    rows, cols = (h // ph, w // pw) if fit == "crop" else (-(-h // ph), -(-w // pw))
    check_tree(tree, n_rows=rows * cols)
    full = torch.zeros(rows * ph, cols * pw, c + int(mask), dtype=torch.float64)
    hh, ww = min(h, rows * ph), min(w, cols * pw)
    full[:hh, :ww, :c] = pixels[:hh, :ww]
    if mask:
        full[:hh, :ww, c] = 1
    patches = full.reshape(rows, ph, cols, pw, -1).permute(0, 2, 1, 3, 4).reshape(rows * cols, -1)
    x = tree.x.double()
    tol = 1e-2 if tree.x.dtype in (torch.float16, torch.bfloat16) else 1e-6
    torch.testing.assert_close(x, patches, rtol=tol, atol=tol, equal_nan=True)
    leaf_pos = tree.position[tree.leaf_index]
    if not quadtree:
        expect = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols),
                                            indexing="ij"), -1).reshape(-1, 2)
        assert torch.equal(leaf_pos, expect)


def windows():
    lengths = st.lists(st.integers(-1, 40), min_size=0, max_size=4)
    branching = st.lists(st.integers(-1, 5), min_size=0, max_size=4).map(tuple)
    return st.tuples(lengths, branching)


def run_windows(case) -> None:
    lengths, branching = case
    result = call(hopping_window_parents, lengths, branching)
    parent = result.parent.tolist() if hasattr(result, "parent") else result[0].tolist()
    assert forest_problem(parent) == ""
    tree = NestedSignal.from_parents(parent)
    check_tree(tree, n_rows=sum(lengths))
    assert tree.structure.num_trees == len(lengths)
    # leaves keep each sequence contiguous and in order: tree t's leaves are a block
    leaf_tree = tree.structure.leaf_tree.tolist()
    assert leaf_tree == sorted(leaf_tree)
    counts = np.bincount(leaf_tree, minlength=len(lengths)).tolist()
    roots = [u for u, p in enumerate(parent) if p == -1]
    assert sorted(counts) == sorted(lengths) and len(roots) == len(lengths)
    # below the roots, no window is wider than the widest level
    family = np.bincount([p for p in parent if p >= 0], minlength=len(parent))
    inner = [u for u, p in enumerate(parent) if p >= 0]
    assert int(family[inner].max(initial=0)) <= max(branching + (1,))


def documents():
    value = st.one_of(st.text("ab .\n", min_size=0, max_size=12),
                      st.integers(1, 6).map(lambda s: np.full((s, s, 3), 7, np.uint8)),
                      st.sampled_from([None, 3, b"x", [], {}]))

    def extend(children):
        return st.one_of(st.lists(children, min_size=1, max_size=3),
                         st.dictionaries(st.sampled_from(["t", "b", "i"]), children,
                                         min_size=1, max_size=3),
                         st.lists(children, min_size=1, max_size=3).map(
                             lambda c: Node(c, geometry="set")))
    return st.dictionaries(st.sampled_from(["title", "body", "image"]),
                           st.recursive(value, extend, max_leaves=6), min_size=1, max_size=3)


def run_document(data) -> None:
    same_width = {"text": lambda s: text_tree(s, embed=lambda ids: torch.ones(len(ids), 12)),
                  "image": lambda a: image_tree(a, 2)}
    tree = call(document_tree, data, **same_width)
    check_tree(tree)
    leaves = []
    for item in leaves_in_order(data):
        if isinstance(item, str):
            leaves.append(same_width["text"](item).num_leaves)
        else:
            leaves.append(same_width["image"](item).num_leaves)
    assert tree.num_leaves == sum(leaves)
    assert tree.key[0] is None and set(k for k in tree.key if k) <= {"title", "body", "image",
                                                                       "t", "b", "i"}


def io_trees():
    return nested_data()


def run_io(data) -> None:
    import os
    import tempfile
    tree = call(NestedSignal.from_nested, data)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t.pt")
        hsa_graph.io.save(tree, path)
        back = hsa_graph.io.load(path)
    for name in tree.keys():
        a, b = tree[name], back[name]
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name


# ------------------------------------------------- issue 17: scale and hostile files
def case_size(case: Any) -> int:
    """A rough size of a case (containers, string characters, tensor elements), walked
    iteratively (a 20,000-deep nesting must not recurse): what the time and memory
    budgets of benchmarks/fuzz.py scale with."""
    total, stack, seen = 0, [case], set()
    while stack:
        item = stack.pop()
        total += 1
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, torch.Tensor):
            total += item.numel() if item.layout == torch.strided and not item.is_nested \
                and not item.is_meta else 1
        elif isinstance(item, np.ndarray):
            total += item.size
        elif isinstance(item, (list, tuple, dict, Node)) and id(item) not in seen:
            seen.add(id(item))
            if isinstance(item, Node):
                item = item.children
            stack.extend(item.values() if isinstance(item, dict) else item)
    return total


def deep_nestings():
    """Chains up to 20,000 deep, wide lists up to 20,000 long, and combs (each level
    a leaf and the next level), with int or vector leaves and dict or Node levels."""
    @st.composite
    def draw(draw):
        shape = draw(st.sampled_from(["chain", "wide", "comb", "dict-chain", "node-chain"]))
        n = draw(st.one_of(st.integers(1, 50), st.integers(1, 2_000), st.integers(1, 20_000)))
        leaf = draw(st.sampled_from(["int", "vector"]))
        make = (lambda i: i) if leaf == "int" else (lambda i: np.full(2, float(i)))
        if shape == "wide":
            return shape, n, [make(i) for i in range(n)]
        data: Any = [make(0)]
        for i in range(1, n):
            if shape == "comb":
                data = [make(i), data]
            elif shape == "dict-chain":
                data = {"k": data}
            elif shape == "node-chain":
                data = Node([data], geometry="set")
            else:
                data = [data]
        return shape, n, data
    return draw()


def run_deep_nesting(case) -> None:
    shape, n, data = case
    tree = call(NestedSignal.from_nested, data)
    leaves = {"wide": n, "comb": n}.get(shape, 1)
    assert tree.num_leaves == leaves
    depth = tree.structure.max_depth
    assert depth == (0 if shape == "wide" else n - 1)   # one internal node per level
    assert tree.x.shape[0] == leaves


def normalising_tokenizers():
    """Texts with a tokenizer whose tokens are normalised (case-folded, NFKD, accents
    dropped, prefixed) or invented, so that many are not substrings of the text."""
    import unicodedata

    def fold(word: str) -> str:
        return "".join(c for c in unicodedata.normalize("NFKD", word.casefold())
                       if not unicodedata.combining(c))

    kinds = {"casefold": lambda s: [w.casefold() for w in s.split()],
             "nfkd": lambda s: [fold(w) for w in s.split()],
             "prefix": lambda s: ["##" + w for w in s.split()],
             "invented": lambda s: [f"<{len(w)}>" for w in s.split()],
             "upper": lambda s: [w.upper() for w in s.split()]}
    words = st.text(ALPHABET.replace("\n", ""), min_size=1, max_size=8)
    return st.tuples(st.sampled_from(sorted(kinds)),
                     st.one_of(st.lists(words, max_size=40), st.integers(1, 60_000)
                               .map(lambda n: [f"Wörd{i % 97}" for i in range(n)]))
                     ).map(lambda c: (c[0], kinds[c[0]], " ".join(c[1])))


def run_normalising(case) -> None:
    _, tokenizer, text = case
    tree = call(text_tree, text, tokenizer=tokenizer)
    leaves = tree.leaf_index.tolist()
    assert len(tree.tokens) == len(leaves)
    span = tree.span.tolist()
    last = -1
    for token, u in zip(tree.tokens, leaves):
        a, b = span[u]
        if a < 0:
            continue
        assert a >= last, "located tokens go forward"
        last = a
        found = text[a:b].lower()
        needle = token[2:] if token.startswith("##") and len(token) > 2 else token
        assert found == needle.lower() or text[a:b] == needle, (token, text[a:b])


def _saved_tree_bytes() -> Tuple[bytes, NestedSignal]:
    import io as bytes_io
    tree = text_tree("Hostile files. Loaded safely!")
    buffer = bytes_io.BytesIO()
    hsa_graph.io.save(tree, buffer)
    return buffer.getvalue(), tree


def hostile_files():
    """A saved tree, forged: header fields replaced (deep lists, huge ints, wrong
    types), content tensors swapped for expanded, sparse, meta, nested, shared or
    wrongly typed ones, reserved or odd extra names, bits flipped, bytes cut."""
    deep = st.integers(1, 3_000).map(_deep_list)
    odd = st.one_of(deep, st.integers(-2**70, 2**70), st.text(max_size=5), st.none(),
                    st.just({"a": 1}), st.floats(allow_nan=True))
    field = st.sampled_from(["format", "version", "kind", "sha256", "content"])
    tensor_kind = st.sampled_from(["expanded", "sparse", "meta", "nested", "shared",
                                   "float parent", "uint8 parent", "huge position"])
    slot = st.sampled_from(["parent", "x", "geometry", "position", "modality",
                            "sibling_edge_index", "extra"])
    name = st.sampled_from(["structure", "batch", "ptr", "to", "_x", "a b", "edge_index",
                            "num_nodes", "parent", "tokens2", "y"])
    return st.one_of(
        st.tuples(st.just("header"), field, odd),
        st.tuples(st.just("tensor"), tensor_kind, slot),
        st.tuples(st.just("extra"), name, st.sampled_from([1, "s", [1, 2]])),
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
        st.tuples(st.just("cut"), st.floats(0, 1), st.just(None)))


def _deep_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _hostile_tensor(kind: str, like: torch.Tensor) -> torch.Tensor:
    if kind == "expanded":
        return torch.zeros(1, dtype=like.dtype).expand(2 ** 36)
    if kind == "sparse":
        return torch.ones(2, 2).to_sparse()
    if kind == "meta":
        return torch.empty(3, device="meta")
    if kind == "nested":
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    if kind == "float parent":
        return like.double()
    if kind == "uint8 parent":
        return like.to(torch.uint8)
    if kind == "huge position":
        return torch.full_like(like, 2 ** 62)
    return like  # "shared": the caller aliases it


def run_hostile_file(case) -> None:
    import io as bytes_io

    from hsa_graph.io import _digest, _tree_content
    what, a, b = case
    data, tree = _saved_tree_bytes()
    if what in ("flip", "cut"):
        raw = bytearray(data)
        if what == "flip":
            raw[a % len(raw)] ^= 1 << b
        else:
            raw = raw[:int(len(raw) * a)]
        blob = bytes(raw)
    else:
        content = _tree_content(tree, "the tree")
        payload = {"format": hsa_graph.io.FORMAT, "version": hsa_graph.io.VERSION,
                   "kind": "tree", "content": content}
        if what == "header":
            payload[a] = b
        elif what == "tensor":
            key = "parent" if a == "shared" else b
            target = content["extras"] if key == "extra" else content
            name = "forged" if key == "extra" else key
            like = content["parent"] if key == "extra" else (content[key] if content.get(key)
                                                             is not None else content["parent"])
            target[name] = content["x"] if a == "shared" and key != "x" else \
                _hostile_tensor(a, like)
        else:
            content["extras"][a] = b
        try:
            payload.setdefault("sha256", _digest("tree", content))
        except (TypeError, ValueError, RecursionError):
            payload["sha256"] = "0" * 64  # a forger need not match it
        if payload.get("sha256") is None:
            payload["sha256"] = "0"
        buffer = bytes_io.BytesIO()
        import sys
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(20_000)  # pickling the forged deep header recurses
        try:
            torch.save(payload, buffer)
        finally:
            sys.setrecursionlimit(limit)
        blob = buffer.getvalue()
    try:
        back = hsa_graph.io.load(bytes_io.BytesIO(blob))
    except ValueError as error:
        refuse(error)
    # accepted: exactly the saved tree (a harmless flip), or a consistent valid one
    check_tree(back)
    assert back.validate()


_GENUINE_STATE: Dict[str, Any] = {}


def _genuine_checkpoint() -> Dict[str, Any]:
    """A real ``last.pt`` state of a one-epoch :func:`fit` (made once per process)."""
    if not _GENUINE_STATE:
        import tempfile

        from torch_geometric.nn import global_mean_pool

        from hsa_graph.experiments.train import TrainConfig, fit, load_checkpoint

        class MeanClassifier(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(2, 2)

            def forward(self, batch):
                leaves = batch.leaf_index
                return self.linear(global_mean_pool(batch.x, batch.batch[leaves]))

        trees = []
        for i in range(8):
            tree = NestedSignal.from_nested([torch.tensor([float(i % 2), 1.0])] * 2)
            tree.y = torch.tensor([i % 2])
            trees.append(tree)
        with tempfile.TemporaryDirectory() as folder:
            fit(MeanClassifier(), trees[:6], trees[6:],
                TrainConfig(epochs=2, batch_size=2, checkpoint_dir=folder))
            _GENUINE_STATE.update(load_checkpoint(f"{folder}/last.pt"))
    return _GENUINE_STATE


def checkpoint_edits():
    """Edits of a real last.pt by hand: keys dropped, values replaced by negative,
    boolean, float, huge, deep or wrongly typed ones, history and RNG states damaged."""
    key = st.sampled_from(["epoch", "model", "optimizer", "history", "best_epoch", "best",
                           "best_model", "rng", "config"])
    value = st.one_of(st.integers(-5, 5), st.integers(-2**70, 2**70), st.booleans(),
                      st.floats(allow_nan=True), st.none(), st.text(max_size=4),
                      st.lists(st.integers(-3, 3), max_size=3),
                      st.integers(1, 2_000).map(_deep_list),
                      st.just({"epoch": 1}), st.just(torch.zeros(3, dtype=torch.uint8)))
    edit = st.one_of(st.tuples(st.just("drop"), key, st.none()),
                     st.tuples(st.just("set"), key, value),
                     st.tuples(st.just("history"), st.integers(0, 3), value),
                     st.tuples(st.just("rng"), st.sampled_from(["torch", "python", "cuda"]),
                               value))
    return st.lists(edit, min_size=1, max_size=3)


def run_checkpoint_edit(edits) -> None:
    import copy
    from pathlib import Path

    from hsa_graph.experiments.train import TrainConfig, _check_resume_state, _set_rng_state
    state = copy.deepcopy(_genuine_checkpoint())
    for kind, key, value in edits:
        if kind == "drop":
            state.pop(key, None)
        elif kind == "set":
            state[key] = value
        elif kind == "history" and isinstance(state.get("history"), list) and state["history"]:
            entry = state["history"][key % len(state["history"])]
            if isinstance(entry, dict):
                entry["epoch" if key % 2 else "val_loss"] = value
        elif kind == "rng" and isinstance(state.get("rng"), list) and state["rng"]:
            if isinstance(state["rng"][0], dict):
                state["rng"][0][key] = value
    config = TrainConfig(epochs=4, batch_size=2)
    try:
        _check_resume_state(state, Path("last.pt"), config)
    except ValueError as error:
        refuse(error)
    # accepted: a state fit can really resume from
    assert 1 <= state["epoch"] and len(state["history"]) == state["epoch"]
    assert 1 <= state["best_epoch"] <= state["epoch"]
    before = torch.get_rng_state()
    try:
        _set_rng_state(state["rng"][0])
    finally:
        torch.set_rng_state(before)


# ------------------------------------------------- issue 17: every op on any input
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TOLERANCE = {torch.float16: 3e-2, torch.bfloat16: 1e-1, torch.float32: 1e-4,
              torch.float64: 1e-9}
_LAYOUTS = ("contiguous", "step", "transposed-last", "transposed-rows", "expand-features",
            "expand-heads", "expand-rows")


def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The values of ``t`` (constant along the expanded axis, for expands) with other
    strides."""
    if kind == "step":
        return torch.stack([t, torch.full_like(t, 5.0)], -1)[..., 0]
    if kind == "transposed-last" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "transposed-rows" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == "expand-features" and t.shape[-1]:
        return t[..., :1].expand(t.shape)
    if kind == "expand-heads" and t.dim() == 3 and t.shape[1]:
        return t[:, :1].expand(t.shape)
    if kind == "expand-rows" and t.shape[0]:
        return t[:1].expand(t.shape)
    return t


def op_inputs():
    """A small tree, an op, head and feature sizes 0..5, a dtype, a stride layout per
    tensor, and now and then a mixed dtype or a wrong row count."""
    return st.tuples(
        parent_arrays(14), st.sampled_from(("hsa", "hsa-no-self", "hsa_weights", "causal_hsa",
                                             "cross_hsa", "cache")),
        st.integers(0, 3), st.integers(0, 5), st.integers(0, 4),
        st.sampled_from(_DTYPES), st.lists(st.sampled_from(_LAYOUTS), min_size=3, max_size=3),
        st.sampled_from(("none", "none", "none", "none", "dtype", "rows", "head-axis")),
        st.integers(0, 2 ** 16))


def _op(name: str, tree: NestedSignal):
    if name == "hsa":
        return lambda q, k, v: hsa(q, k, v, tree)
    if name == "hsa-no-self":
        return lambda q, k, v: hsa(q, k, v, tree, include_self=False)
    if name == "hsa_weights":
        return lambda q, k, v: hsa_graph.hsa_weights(q, k, tree)
    if name == "causal_hsa":
        return lambda q, k, v: hsa_graph.causal_hsa(q, k, v, tree)
    if name == "cross_hsa":
        anchor = torch.arange(tree.num_nodes) % tree.num_nodes
        return lambda q, k, v: hsa_graph.cross_hsa(q, k, v, tree, anchor=anchor[:q.shape[0]])

    def cache(q, k, v):
        moves = hsa_graph.HSACache.moves_of(tree)
        c = hsa_graph.HSACache()
        return torch.stack([c.append(q[i], k[i], v[i], **moves[i]) for i in range(q.shape[0])])
    return cache


def run_op_inputs(case) -> None:
    parent, name, heads, d, dv, dtype, layouts, twist, seed = case
    if forest_problem(parent):
        return
    tree = NestedSignal.from_parents(parent)
    n = tree.num_leaves
    if name in ("cache", "cross_hsa") and tree.structure.num_trees != 1:
        return
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, heads, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=g, dtype=torch.float64)
    if name == "cross_hsa":
        q = q[: min(n, 3)]
    q, k, v = (_layout(t.to(dtype), kind) for t, kind in zip((q, k, v), layouts))
    if twist == "dtype":
        k = k.double() if dtype != torch.float64 else k.float()
    elif twist == "rows" and name != "cache":   # the cache takes one token at a time
        k = k[:-1]
    elif twist == "head-axis" and heads == 1:
        q = q[:, 0]
    else:
        twist = "none"
    op = _op(name, tree)
    got = call(op, q, k, v)
    assert twist == "none", f"{twist} was not refused"
    want = op(*(t.contiguous().double() for t in (q, k, v)))
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    tol = _TOLERANCE[dtype] * max(1.0, float(want.abs().max()) if want.numel() else 1.0)
    err = float((got.double() - want).abs().max()) if want.numel() else 0.0
    assert err <= tol, f"{name} {dtype} {layouts}: off by {err}"
    if name == "hsa" and heads and d and dv:
        ref = dense_hsa(parent, *(t.contiguous().double() for t in (q, k, v)))
        torch.testing.assert_close(want, ref, rtol=1e-7, atol=1e-9)


class Target(NamedTuple):
    """A fuzz target: ``strategy()`` draws cases, ``run(case)`` checks one, and
    ``size(case)`` is what benchmarks/fuzz.py scales its per-case time and memory
    budgets with (so super-linear behaviour fails)."""

    strategy: Callable[[], Any]
    run: Callable[[Any], None]
    size: Callable[[Any], int] = case_size


TARGETS: Dict[str, Target] = {name: Target(*spec) for name, spec in {
    "from_parents+hsa": (hostile_parents, run_parents),
    "causal_hsa": (contiguous_forests, run_causal),
    "batched_cache": (cache_scenarios, run_batched_cache),
    "from_nested": (nested_data, run_nested),
    "from_networkx": (random_digraphs, run_networkx),
    "text_tree": (texts, run_text),
    "html_tree": (html_pages, run_html),
    "image_tree": (images, run_image),
    "hopping_windows": (windows, run_windows),
    "document_tree": (documents, run_document),
    "io": (io_trees, run_io),
    "deep_nesting": (deep_nestings, run_deep_nesting),
    "normalising_tokenizer": (normalising_tokenizers, run_normalising),
    "hostile_files": (hostile_files, run_hostile_file),
    "checkpoint_edits": (checkpoint_edits, run_checkpoint_edit),
    "op_inputs": (op_inputs, run_op_inputs),
}.items()}
