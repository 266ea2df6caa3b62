"""Causal HSA (hsa_graph.ops.causal) against its definition: row i of SPEC HSA on the
prefix tree T_{<=i}, computed by tests/causal_reference.py with the independent dense
reference of SPEC HSA (tests/reference.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from causal_reference import dense_causal_hsa, dense_causal_weights, prefix_parent
from hsa_trees import dfs_relabel, leaves_of, parent_arrays, random_inputs, relabel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import dense_hsa_weights, flat_softmax_rows, kl_objective
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph.ops.causal import causal_hsa


def contiguous(parent: list[int], shuffle: list[int]) -> list[int]:
    """A relabelling of ``parent`` whose leaves are in depth-first order (so every node's
    leaves are contiguous) while internal node ids are shuffled by ``shuffle``."""
    pre, _ = relabel(parent, dfs_relabel(parent))
    m = len(pre)
    leaves = set(leaves_of(pre))
    sigma = list(shuffle)
    leaf_ids = sorted(sigma[u] for u in range(m) if u in leaves)
    it = iter(leaf_ids)
    sigma = [next(it) if u in leaves else sigma[u] for u in range(m)]
    return relabel(pre, sigma)[0]


@st.composite
def contiguous_trees(draw):
    parent = draw(parent_arrays(max_nodes=16))
    return contiguous(parent, draw(st.permutations(range(len(parent)))))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parent=contiguous_trees(), include_self=st.booleans(), use_pos=st.booleans(),
       seed=st.integers(0, 2**16))
def test_equals_dense_reference(parent, include_self, use_pos, seed):
    n = len(leaves_of(parent))
    q, k, v, pos = random_inputs(n, len(parent), 2, 3, 4, seed, pos_dim=2 if use_pos else 0)
    tree = hsa_graph.NestedSignal.from_parents(parent)
    y = causal_hsa(q, k, v, tree, include_self=include_self, pos=pos)
    ref = dense_causal_hsa(parent, q, k, v, include_self=include_self, pos=pos)
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=1e-10)


def text_like(paragraphs: list[list[int]]) -> list[int]:
    """document -> paragraphs -> sentences -> tokens, numbered level by level like
    hsa_graph.text_tree (so internal nodes come before the tokens)."""
    n_par = len(paragraphs)
    sent_par = [p for p, sents in enumerate(paragraphs) for _ in sents]
    sent_len = [s for sents in paragraphs for s in sents]
    parent = [-1] + [0] * n_par + [1 + p for p in sent_par]
    first_sentence = 1 + n_par
    for s, length in enumerate(sent_len):
        parent += [first_sentence + s] * length
    return parent


@pytest.mark.parametrize("parent", [
    text_like([[3, 1, 4], [2], [5, 2]]),
    [-1] + list(range(30)) + [30, 30, 29, 5],          # deep chain with side leaves
    [-1, 0, 0, 1, 1, 2, 2, -1, 7, 7, 8, 8, 8],          # a forest of two trees
])
def test_reference_on_fixed_trees(parent):
    n = len(leaves_of(parent))
    q, k, v, pos = random_inputs(n, len(parent), 3, 4, 2, 7, pos_dim=3, pos_per_head=True)
    tree = hsa_graph.NestedSignal.from_parents(parent)
    for include_self in (True, False):
        ref = dense_causal_hsa(parent, q, k, v, include_self=include_self, pos=pos)
        torch.testing.assert_close(causal_hsa(q, k, v, tree, include_self=include_self,
                                              pos=pos), ref, atol=1e-10, rtol=1e-10)


def test_batch_of_trees_is_a_forest():
    parents = [text_like([[2, 3], [1]]), text_like([[4]]), [-1, 0, 0, 0]]
    trees = [hsa_graph.NestedSignal.from_parents(p) for p in parents]
    batch = Batch.from_data_list(trees)
    sizes = [t.num_leaves for t in trees]
    q, k, v, _ = random_inputs(sum(sizes), 0, 2, 4, 4, 3)
    y = causal_hsa(q, k, v, batch)
    for tree, part in zip(trees, torch.split(torch.arange(sum(sizes)), sizes)):
        torch.testing.assert_close(y[part], causal_hsa(q[part], k[part], v[part], tree))


def test_prefix_invariance_is_bitwise():
    parent = text_like([[3, 4], [2, 5, 1], [3]])
    n = len(leaves_of(parent))
    tree = hsa_graph.NestedSignal.from_parents(parent)
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8) for _ in range(3))
    pos = torch.randn(len(parent), 2, 3)
    y = causal_hsa(q, k, v, tree, pos=pos)
    leaf_rows = torch.tensor(leaves_of(parent))
    for i in (0, 4, 9, n - 2):
        q2, k2, v2, pos2 = q.clone(), k.clone(), v.clone(), pos.clone()
        later = slice(i + 1, None)
        q2[later] += 100 * torch.randn_like(q2[later])
        k2[later] -= 50
        v2[later] = torch.randn_like(v2[later])
        # nodes holding only later leaves (the later tokens themselves and new sentences)
        sub, keep = prefix_parent(parent, i)
        gone = sorted(set(range(len(parent))) - set(keep))
        pos2[gone] += 10.0
        assert set(leaf_rows[i + 1:].tolist()) <= set(gone)
        y2 = causal_hsa(q2, k2, v2, tree, pos=pos2)
        assert torch.equal(y2[:i + 1], y[:i + 1]), i
        assert not torch.equal(y2[i + 1:], y[i + 1:])


@pytest.mark.parametrize("include_self", [True, False])
def test_flat_tree_is_causal_softmax(include_self):
    n = 12
    tree = hsa_graph.NestedSignal.from_parents([-1] + [0] * n)
    q, k, v, _ = random_inputs(n, 0, 3, 8, 5, 11)
    y = causal_hsa(q, k, v, tree, include_self=include_self)
    if include_self:
        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True)
    else:  # strictly earlier tokens; the first row has nothing and is zero
        mask = torch.ones(n, n, dtype=torch.bool).tril(-1)
        mask[0, 0] = True
        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask)
        ref[:, 0] = 0
    torch.testing.assert_close(y, ref.transpose(0, 1), atol=1e-12, rtol=1e-12)


def test_rows_are_the_kl_projection_on_the_prefix_tree():
    """Row i is row i of the KL-optimal block-constrained matrix on T_{<=i}: moving
    mass inside one of its blocks raises the objective (SPEC property 4 on T_{<=i})."""
    parent = text_like([[3, 2], [2, 3]])
    n = len(leaves_of(parent))
    q, k, _, _ = random_inputs(n, 0, 1, 4, 1, 5)
    causal = dense_causal_weights(parent, q, k)
    i = 7
    sub, _ = prefix_parent(parent, i)
    theta = dense_hsa_weights(sub, q[:i + 1], k[:i + 1])
    torch.testing.assert_close(causal[:, i, :i + 1], theta[:, -1])
    flat = flat_softmax_rows(sub, q[:i + 1], k[:i + 1])
    best = kl_objective(theta, flat)
    # Root family of T_{<=7}: paragraph 1 (leaves 0..4) and the partial paragraph 2
    # (leaves 5..7). Rows of paragraph 2 send a share to paragraph 1 and keep the rest;
    # scaling that share (and the kept part to match) stays block-constrained.
    rows, far = torch.arange(5, 8), torch.arange(0, 5)
    for eps in (1e-2, -1e-2):
        moved = theta.clone()
        share = moved[:, rows][:, :, far].sum(-1, keepdim=True)
        block = moved[:, rows]
        scaled = block * (1 - eps * share / (1 - share))
        scaled[:, :, far] = block[:, :, far] * (1 + eps)
        moved[:, rows] = scaled
        torch.testing.assert_close(moved.sum(-1), theta.sum(-1))
        assert kl_objective(moved, flat) > best + 1e-9


def test_gradcheck():
    parent = [-1, 0, 0, 1, 1, 1, 2, 2, 0]
    tree = hsa_graph.NestedSignal.from_parents(parent)
    q, k, v, pos = random_inputs(6, len(parent), 2, 3, 2, 1, pos_dim=2)
    for t in (q, k, v, pos):
        t.requires_grad_(True)
    for include_self in (True, False):
        assert torch.autograd.gradcheck(
            lambda q, k, v, p, inc=include_self: causal_hsa(q, k, v, tree, include_self=inc,
                                                            pos=p),
            (q, k, v, pos))


def test_gradients_equal_dense_reference():
    parent = text_like([[2, 3], [3]])
    tree = hsa_graph.NestedSignal.from_parents(parent)
    q, k, v, _ = random_inputs(8, 0, 2, 4, 3, 2)
    w = torch.randn(8, 2, 3, dtype=torch.float64)
    grads = []
    for fn in (lambda a, b, c: causal_hsa(a, b, c, tree),
               lambda a, b, c: dense_causal_hsa(parent, a, b, c)):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (fn(*inputs) * w).sum().backward()
        grads.append([t.grad for t in inputs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_large_logits_and_half_precision_are_finite():
    parent = text_like([[4, 3], [5]])
    tree = hsa_graph.NestedSignal.from_parents(parent)
    q, k, v, _ = random_inputs(12, 0, 2, 4, 4, 9, dtype=torch.float32)
    y = causal_hsa(q * 100, k * 100, v, tree)
    assert torch.isfinite(y).all()
    y16 = causal_hsa(q.half(), k.half(), v.half(), tree)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), causal_hsa(q, k, v, tree), atol=2e-2, rtol=2e-2)


def test_text_tree_builder():
    text = "A film. Too long!\n\nBut it shines. I liked it."
    tree = hsa_graph.text_tree(text)
    n = tree.num_leaves
    q, k, v, _ = random_inputs(n, 0, 2, 4, 4, 0)
    ref = dense_causal_hsa(tree.parent.tolist(), q, k, v)
    torch.testing.assert_close(causal_hsa(q, k, v, tree), ref, atol=1e-10, rtol=1e-10)


def test_non_contiguous_leaves_raise():
    # node 1 holds leaves 3 and 5 (rows 0 and 2), node 2 holds leaf 4 (row 1)
    tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 2, 1])
    q = torch.randn(3, 1, 2)
    with pytest.raises(ValueError, match="contiguous range in leaf order.*node 1"):
        causal_hsa(q, q, q, tree)


def test_bad_shapes_raise():
    tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0])
    with pytest.raises(ValueError, match="rows but the tree has 2 leaves"):
        causal_hsa(torch.randn(3, 1, 2), torch.randn(3, 1, 2), torch.randn(3, 1, 2), tree)


@pytest.mark.parametrize("with_pos", [False, True])
@pytest.mark.parametrize("sizes", [[5, 5, 5], [2, 7, 4], [1, 6], [1, 1, 1, 1, 9]])
def test_flat_forests_equal_the_dense_reference(sizes, with_pos):
    # flat trees take the fused causal kernel on blocks (views for equal sizes, padded
    # blocks for ragged ones and a one-leaf tree), too much padding ([1, 1, 1, 1, 9]) the
    # tiles: all must be row i of HSA on the prefix tree
    trees = [hsa_graph.NestedSignal.from_parents([-1] + [0] * s) for s in sizes]
    batch = Batch.from_data_list(trees)
    n = sum(sizes)
    q, k, v, pos = random_inputs(n, n + len(sizes), 2, 4, 3, 5, pos_dim=3 if with_pos else 0)
    y = causal_hsa(q, k, v, batch, pos=pos)
    start = node = 0
    for tree, s in zip(trees, sizes):
        p = None if pos is None else pos[node:node + s + 1]
        ref = dense_causal_hsa(tree.parent.tolist(), q[start:start + s], k[start:start + s],
                               v[start:start + s], pos=p)
        torch.testing.assert_close(y[start:start + s], ref, atol=1e-10, rtol=1e-10)
        start, node = start + s, node + s + 1
    assert (batch.structure.flat_families is not None) == (len(set(sizes)) == 1
                                                           and min(sizes) > 1)
    assert (batch.structure.flat_trees is None) == (sizes == [1, 1, 1, 1, 9])


def test_padded_flat_trees_match_the_tiles_with_gradients(monkeypatch):
    """Ragged flat trees in padded blocks give the tiles' values and gradients (the
    padding rows, after every real row of their block, get no gradient)."""
    import hsa_graph.structure as structure_module

    sizes = [3, 8, 5, 6]

    def run(tiles: bool):
        if tiles:   # no padding allowed: the same forest on the general path
            monkeypatch.setattr(structure_module, "FLAT_PADDING", 0)
        trees = [hsa_graph.NestedSignal.from_parents([-1] + [0] * s) for s in sizes]
        batch = Batch.from_data_list(trees)
        assert (batch.structure.flat_trees is None) == tiles
        q, k, v = (t.requires_grad_() for t in random_inputs(sum(sizes), 1, 2, 4, 3, 7)[:3])
        y = causal_hsa(q, k, v, batch)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
        return y.detach(), q.grad, k.grad, v.grad

    for fast, slow in zip(run(False), run(True)):
        torch.testing.assert_close(fast, slow, atol=1e-10, rtol=1e-10)


def test_head_chunks_and_the_autograd_path_agree(monkeypatch):
    """Without autograd every intermediate is updated in place; with it, out of place:
    the same values (float64) in chunks of one head or of all heads, the same gradients
    either way, and the dense reference's values."""
    import hsa_graph.ops.causal as causal_module

    parent = text_like([[150, 3, 12], [5, 2], [80, 1, 1, 9]])   # root tiles of 128 rows
    tree = hsa_graph.NestedSignal.from_parents(parent)
    n = len(leaves_of(parent))
    q, k, v, pos = random_inputs(n, len(parent), 3, 4, 5, 3, pos_dim=2)
    weights = torch.randn(n, 3, 5, dtype=torch.float64)

    def recorded(include_self, p):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        y = causal_hsa(*inputs, tree, include_self=include_self, pos=p)
        (y * weights).sum().backward()
        return y.detach(), [t.grad for t in inputs]

    for include_self, p in ((True, None), (False, pos)):
        whole = causal_hsa(q, k, v, tree, include_self=include_self, pos=p)
        y, grads = recorded(include_self, p)
        with monkeypatch.context() as m:
            m.setattr(causal_module, "_CHUNK_BYTES", 1)             # one head per chunk
            chunked = causal_hsa(q, k, v, tree, include_self=include_self, pos=p)
            y_chunked, grads_chunked = recorded(include_self, p)
        torch.testing.assert_close(chunked, whole, atol=1e-13, rtol=1e-13)
        torch.testing.assert_close(y, whole, atol=1e-13, rtol=1e-13)
        torch.testing.assert_close(y_chunked, whole, atol=1e-13, rtol=1e-13)
        for a, b in zip(grads_chunked, grads):
            torch.testing.assert_close(a, b, atol=1e-13, rtol=1e-13)
        rows = torch.tensor([0, 100, 149, 151, 170, n - 1])
        ref = dense_causal_hsa(parent, q, k, v, include_self=include_self, pos=p)
        torch.testing.assert_close(whole[rows], ref[rows], atol=1e-10, rtol=1e-10)


def test_scans_and_their_backward():
    """The family tables' log-cumsum-exp (dim -2; in order on the CPU, by doubling on
    accelerators) equals torch's, keeps -inf entries exact, never writes or returns its
    input, leaves entry p unchanged in every bit when later entries change, and its
    hand-written backward passes gradcheck with zero gradients on -inf entries."""
    from hsa_graph.ops.causal import (
        _logcumsumexp,
        _logcumsumexp_doubling,
        _logcumsumexp_in_order,
    )

    torch.manual_seed(0)
    z = torch.randn(2, 3, 13, 4, dtype=torch.float64)
    z[0, 1, :3] = float("-inf")                     # a column that starts empty
    z[1, 2, 5] = float("-inf")
    expected = torch.logcumsumexp(z, -2)
    for scan in (_logcumsumexp_in_order, _logcumsumexp_doubling):
        before = z.clone()
        out = scan(z)
        torch.testing.assert_close(out, expected, atol=1e-13, rtol=1e-13)
        assert torch.equal(z, before)
        later = z.clone()
        later[..., 7:, :] = torch.randn_like(later[..., 7:, :]) * 10
        assert torch.equal(scan(later)[..., :7, :], out[..., :7, :])
        one = z[..., :1, :]                             # b = 1: a copy, not z itself
        assert torch.equal(scan(one), one) and scan(one).data_ptr() != one.data_ptr()
    torch.testing.assert_close(_logcumsumexp(z, False), expected, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(_logcumsumexp(z, True), expected, atol=1e-13, rtol=1e-13)
    assert torch.autograd.gradcheck(lambda t: _logcumsumexp(t, True),
                                    (torch.randn(2, 7, 3, dtype=torch.float64,
                                                 requires_grad=True),))
    # with -inf entries (outputs of -inf defeat finite differences): torch's gradients,
    # zero on the -inf entries
    finite = torch.isfinite(z)
    x = torch.where(finite, z, 0.0).requires_grad_(True)
    weights = torch.randn_like(z)
    ours, = torch.autograd.grad((_logcumsumexp(torch.where(finite, x, float("-inf")), True)
                                 * weights).sum(), x)
    theirs, = torch.autograd.grad((torch.logcumsumexp(torch.where(finite, x, float("-inf")),
                                                      -2) * weights).sum(), x)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    assert (ours[~finite] == 0).all()


@pytest.mark.parametrize("parent", [
    text_like([[3, 1, 4], [2], [5, 2]]),
    [-1, 0, 0, 1, 1, 2, 2, -1, 7, 7, 8, 8, 8],          # a forest of two trees
    [-1] + [0] * 7,                                       # flat: causal SDPA
])
def test_forward_and_backward_do_not_synchronise(parent):
    """No op that reads a device value back to the host runs in a call on a built tree
    (the layout's numbers are host-side, derived once with the structure), with and
    without autograd and positions: a decoder stack pays the layout once per batch."""
    from test_hsa import SYNC_OPS, _in_cpu_read
    from torch.profiler import profile

    tree = hsa_graph.NestedSignal.from_parents(parent)
    n = len(leaves_of(parent))
    q, k, v, pos = random_inputs(n, len(parent), 2, 4, 3, 5, pos_dim=2)
    causal_hsa(q, k, v, tree)                         # builds and validates the layout
    q.requires_grad_()
    with profile() as prof:
        causal_hsa(q, k, v, tree).sum().backward()
        causal_hsa(q, k, v, tree, include_self=False, pos=pos).sum().backward()
        with torch.no_grad():
            causal_hsa(q, k, v, tree, pos=pos)
    names = {event.name for event in prof.events() if not _in_cpu_read(event)}
    assert "aten::bmm" in names or any("scaled_dot_product" in n for n in names)
    assert not names & set(SYNC_OPS), names & set(SYNC_OPS)
