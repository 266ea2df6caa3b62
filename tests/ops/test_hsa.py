"""Property tests of the fast HSA operator against the independent dense reference.

The reference (tests/reference.py) is written from shared/SPEC.md section 2 only; the
properties are those of SPEC section 3.  Only the public names of hsa_graph are used:
NestedSignal.from_parents, hsa, hsa_weights, flatten (and PyG's Batch).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hsa_trees import (
    concat_parents,
    dfs_relabel,
    insert_unary,
    parent_arrays,
    random_inputs,
    relabel,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reference import Tree, dense_hsa, dense_hsa_weights, flat_softmax_rows, kl_objective
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph.ops.hsa import _flash_key_width

DT = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-10}  # float64 comparisons

SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


def make_tree(parent):
    return hsa_graph.NestedSignal.from_parents(parent)


# ----------------------------------------------------------------------------------------
# Random cases
# ----------------------------------------------------------------------------------------


@dataclass
class Case:
    parent: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor | None
    include_self: bool
    scale: float | None

    @property
    def kw(self):
        return {"include_self": self.include_self, "scale": self.scale, "pos": self.pos}

    @property
    def ref_tree(self):
        return Tree(self.parent)


@st.composite
def cases(draw, max_nodes: int = 20, with_pos=None, dtype=DT):
    parent = draw(parent_arrays(max_nodes))
    tree = Tree(parent)
    heads = draw(st.integers(1, 3))
    d = draw(st.integers(1, 4))
    dv = draw(st.integers(1, 4))
    dv = 5 if dv == d else dv  # D != Dv
    use_pos = draw(st.booleans()) if with_pos is None else with_pos
    pos_dim = draw(st.integers(1, 3)) if use_pos else 0
    per_head = draw(st.booleans()) if use_pos else False
    q, k, v, pos = random_inputs(tree.num_leaves, tree.num_nodes, heads, d, dv,
                                 seed=draw(st.integers(0, 2**31 - 1)), dtype=dtype,
                                 pos_dim=pos_dim, pos_per_head=per_head)
    return Case(parent, q, k, v, pos, draw(st.booleans()),
                draw(st.sampled_from([None, None, 0.6])))


def masked_attention(q, k, v, mask, scale=None):
    """Softmax attention with a bool mask (True = may attend); rows with nothing to
    attend to give 0.  Built on torch's SDPA."""
    empty = ~mask.any(-1)
    safe = mask | torch.diag(empty)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=safe, scale=scale)
    return out.transpose(0, 1).masked_fill(empty[:, None, None], 0.0)


def same_tree_mask(parent, include_self):
    tid = torch.tensor(Tree(parent).tree_of_leaf)
    mask = tid[:, None] == tid[None, :]
    if not include_self:
        mask &= ~torch.eye(len(tid), dtype=torch.bool)
    return mask


# ----------------------------------------------------------------------------------------
# Agreement with the dense reference
# ----------------------------------------------------------------------------------------


def _single_node_case(include_self):
    q, k, v, _ = random_inputs(1, 1, heads=1, d=2, dv=3, seed=0)
    return Case([-1], q, k, v, None, include_self, None)


@settings(max_examples=80, **SETTINGS)
@given(cases())
@example(_single_node_case(True))
@example(_single_node_case(False))
def test_hsa_matches_reference(c):
    y = hsa_graph.hsa(c.q, c.k, c.v, make_tree(c.parent), **c.kw)
    assert y.shape == c.v.shape and y.dtype == DT
    torch.testing.assert_close(y, dense_hsa(c.parent, c.q, c.k, c.v, **c.kw), **TOL)


@pytest.mark.parametrize("slots", [0, 10 ** 9])
@settings(max_examples=30, **SETTINGS)
@given(c=cases())
def test_hsa_matches_reference_with_and_without_bucket_merges(slots, c):
    """Values and gradients equal the dense reference whether every grid size keeps its
    bucket (0) or all of them count as small and merge wherever that is cheaper."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("hsa_graph.structure.BUCKET_SLOTS", slots)
        tree = make_tree(c.parent)
        q, k, v = (t.clone().requires_grad_() for t in (c.q, c.k, c.v))
        y = hsa_graph.hsa(q, k, v, tree, **c.kw)
    qr, kr, vr = (t.clone().requires_grad_() for t in (c.q, c.k, c.v))
    ref = dense_hsa(c.parent, qr, kr, vr, **c.kw)
    torch.testing.assert_close(y, ref, **TOL)
    g = torch.randn_like(ref)
    # a tree without siblings reads no query or key (its gradient is None, i.e. zero)
    got = torch.autograd.grad(y, (q, k, v), g, allow_unused=True)
    want = torch.autograd.grad(ref, (qr, kr, vr), g, allow_unused=True)
    for a, b, x in zip(got, want, (q, k, v)):
        torch.testing.assert_close(torch.zeros_like(x) if a is None else a,
                                   torch.zeros_like(x) if b is None else b, **TOL)


def test_one_structure_serves_every_dtype_mode_and_thread_count():
    """The layout's constants (masks, leaf counts in a dtype) are made once and kept on
    the structure: calls alternating dtype, ``include_self``, autograd and the thread
    count (which picks the family kernel) each equal the dense reference, so no call
    writes into what a later one reads."""
    parents = [
        [-1] + [0] * 4 + [1 + i // 4 for i in range(16)],         # leaves-only families
        [-1, 0, 0] + [1] * 17 + [2] * 3 + [0],                     # padding, mixed family
        [-1, 0, 0, 1, 1, 1, 2, 2, -1, 8, 8],                       # a forest, a lonely leaf
    ]
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        for parent in parents:
            st = hsa_graph.NestedSignal.from_parents(parent).structure
            n = st.num_leaves
            q64, k64, v64 = (torch.randn(n, 2, 8, generator=gen, dtype=DT) for _ in range(3))
            refs = {flag: dense_hsa(parent, q64, k64, v64, include_self=flag)
                    for flag in (True, False)}
            for _ in range(2):
                for dtype, tol in ((torch.float32, {"rtol": 1e-4, "atol": 1e-5}), (DT, TOL)):
                    for include_self in (True, False):
                        for grad, num_threads in ((False, 1), (False, 2), (True, 1)):
                            torch.set_num_threads(num_threads)
                            q, k, v = (t.detach().to(dtype).requires_grad_(grad)
                                       for t in (q64, k64, v64))
                            y = hsa_graph.hsa(q, k, v, st, include_self=include_self)
                            where = f"{parent} {dtype} {include_self} {grad} {num_threads}"
                            torch.testing.assert_close(
                                y.double(), refs[include_self], **tol,
                                msg=lambda m, where=where: f"{where}: {m}")
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=50, **SETTINGS)
@given(cases())
def test_hsa_weights_matches_reference(c):
    theta = hsa_graph.hsa_weights(c.q, c.k, make_tree(c.parent), **c.kw)
    n, heads = c.q.shape[:2]
    assert theta.shape == (heads, n, n)
    torch.testing.assert_close(theta, dense_hsa_weights(c.parent, c.q, c.k, **c.kw), **TOL)


@settings(max_examples=30, **SETTINGS)
@given(cases())
def test_hsa_equals_weights_times_v(c):
    tree = make_tree(c.parent)
    y = hsa_graph.hsa(c.q, c.k, c.v, tree, **c.kw)
    theta = hsa_graph.hsa_weights(c.q, c.k, tree, **c.kw)
    torch.testing.assert_close(y, torch.einsum("hij,jhd->ihd", theta, c.v), **TOL)


@pytest.mark.parametrize("include_self", [True, False])
def test_two_dimensional_single_head_inputs(include_self):
    parent = [-1, 0, 0, 0, 1, 1, 3, 3, 3]
    q, k, v, pos = random_inputs(6, 9, heads=1, d=3, dv=2, seed=5, pos_dim=2)
    tree = make_tree(parent)
    kw = {"include_self": include_self, "pos": pos}
    y2 = hsa_graph.hsa(q[:, 0], k[:, 0], v[:, 0], tree, **kw)
    assert y2.shape == (6, 2)
    torch.testing.assert_close(y2, hsa_graph.hsa(q, k, v, tree, **kw)[:, 0], **TOL)
    torch.testing.assert_close(y2, dense_hsa(parent, q, k, v, **kw)[:, 0], **TOL)
    theta2 = hsa_graph.hsa_weights(q[:, 0], k[:, 0], tree, **kw)
    assert theta2.shape == (6, 6)
    torch.testing.assert_close(theta2, dense_hsa_weights(parent, q, k, **kw)[0], **TOL)


def test_parent_given_as_long_tensor():
    parent = [-1, 0, 0, 1, 1]
    q, k, v, _ = random_inputs(3, 5, heads=2, d=2, dv=3, seed=0)
    y = hsa_graph.hsa(q, k, v, make_tree(torch.tensor(parent, dtype=torch.long)))
    torch.testing.assert_close(y, dense_hsa(parent, q, k, v), **TOL)


@pytest.mark.parametrize("include_self", [True, False])
def test_family_of_a_thousand_children(include_self):
    """A root with 1000 children mixing leaves, small subtrees and unary wrappers."""
    parent = [-1]
    for i in range(1000):
        top = len(parent)
        parent.append(0)
        if i % 50 == 0:  # unary node over a leaf
            parent.append(top)
        elif i % 7 == 0:  # a pair of leaves
            parent += [top, top]
    tree = Tree(parent)
    q, k, v, pos = random_inputs(tree.num_leaves, tree.num_nodes, heads=2, d=4, dv=3,
                                 seed=1000, pos_dim=2, pos_scale=0.3)
    kw = {"include_self": include_self, "pos": pos}
    theta_ref = dense_hsa_weights(parent, q, k, **kw)
    sig = make_tree(parent)
    theta = hsa_graph.hsa_weights(q, k, sig, **kw)
    torch.testing.assert_close(theta, theta_ref, **TOL)
    y = hsa_graph.hsa(q, k, v, sig, **kw)
    torch.testing.assert_close(y, torch.einsum("hij,jhd->ihd", theta_ref, v), **TOL)


# ----------------------------------------------------------------------------------------
# Property 1: a flat tree is softmax attention
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("n,heads,root", [(2, 1, 0), (5, 3, 0), (9, 2, 4), (1000, 2, 0)])
def test_flat_tree_is_sdpa(include_self, scale, n, heads, root):
    parent = [root] * (n + 1)
    parent[root] = -1
    q, k, v, _ = random_inputs(n, n + 1, heads=heads, d=4, dv=6, seed=n)
    mask = None if include_self else ~torch.eye(n, dtype=torch.bool)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), attn_mask=mask,
                                              scale=scale).transpose(0, 1)
    tree = make_tree(parent)
    y = hsa_graph.hsa(q, k, v, tree, include_self=include_self, scale=scale)
    torch.testing.assert_close(y, expected, **TOL)
    theta = hsa_graph.hsa_weights(q, k, tree, include_self=include_self, scale=scale)
    s = 1 / math.sqrt(4) if scale is None else scale
    logits = s * torch.einsum("ihd,jhd->hij", q, k)
    if not include_self:
        logits = logits.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf"))
    torch.testing.assert_close(theta, torch.softmax(logits, -1), **TOL)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("pos_dim,per_head", [(0, False), (3, False), (3, True)])
def test_forests_of_flat_trees_take_one_fused_call_and_equal_the_dense_reference(
        include_self, pos_dim, per_head):
    # 4 flat trees of 5 leaves: the fused path; the same trees with a unary node
    # under each root (transparent, property 5) take the general passes
    flat = [-1] + [0] * 5
    unary = [-1, 0] + [1] * 5
    batch = Batch.from_data_list([make_tree(flat) for _ in range(4)])
    deep = Batch.from_data_list([make_tree(unary) for _ in range(4)])
    assert batch.structure.flat_families == (4, 5) and deep.structure.flat_families is None
    q, k, v, pos = random_inputs(20, 24, heads=2, d=4, dv=3, seed=7, pos_dim=pos_dim,
                                 pos_per_head=per_head)
    y = hsa_graph.hsa(q, k, v, batch, include_self=include_self, pos=pos)
    for t in range(4):
        rows = slice(5 * t, 5 * t + 5)
        p = None if pos is None else pos[6 * t:6 * t + 6]
        ref = dense_hsa(flat, q[rows], k[rows], v[rows], include_self=include_self, pos=p)
        torch.testing.assert_close(y[rows], ref, atol=1e-10, rtol=1e-10)
    # the unary copies: the same node positions, none on the unary nodes themselves
    deep_pos = None
    if pos is not None:
        deep_pos = pos.new_zeros((28, *pos.shape[1:]))
        for t in range(4):
            deep_pos[7 * t + 2:7 * t + 7] = pos[6 * t + 1:6 * t + 6]
    torch.testing.assert_close(
        hsa_graph.hsa(q, k, v, deep, include_self=include_self, pos=deep_pos), y,
        atol=1e-10, rtol=1e-10)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: hsa_graph.hsa(a, b, c, batch, include_self=include_self, pos=pos),
        inputs)


@settings(max_examples=25, **SETTINGS)
@given(cases(with_pos=False))
def test_flatten_gives_softmax_attention_per_tree(c):
    tree = make_tree(c.parent)
    flat = hsa_graph.flatten(tree)
    y = hsa_graph.hsa(c.q, c.k, c.v, flat, include_self=c.include_self, scale=c.scale)
    expected = masked_attention(c.q, c.k, c.v, same_tree_mask(c.parent, c.include_self),
                                scale=c.scale)
    torch.testing.assert_close(y, expected, **TOL)


# ----------------------------------------------------------------------------------------
# Property 2: rows are stochastic; property 3: block constraint
# ----------------------------------------------------------------------------------------


def single_leaf_rows(parent):
    tree = Tree(parent)
    counts: dict[int, int] = {}
    for t in tree.tree_of_leaf:
        counts[t] = counts.get(t, 0) + 1
    return torch.tensor([counts[t] == 1 for t in tree.tree_of_leaf], dtype=torch.bool)


@settings(max_examples=40, **SETTINGS)
@given(cases())
def test_rows_are_stochastic(c):
    tree = make_tree(c.parent)
    theta = hsa_graph.hsa_weights(c.q, c.k, tree, **c.kw)
    expected = torch.ones(theta.shape[:2], dtype=DT)
    if not c.include_self:  # the exception: a single-leaf tree without self
        lone = single_leaf_rows(c.parent)
        expected[:, lone] = 0.0
        y = hsa_graph.hsa(c.q, c.k, c.v, tree, **c.kw)
        torch.testing.assert_close(y[lone], torch.zeros_like(y[lone]), **TOL)
    assert (theta >= 0).all()
    torch.testing.assert_close(theta.sum(-1), expected, **TOL)


@pytest.mark.parametrize("parent", [[-1], [-1, 0], [-1, 0, 1, 2, 3], [1, -1]])
def test_single_leaf_tree(parent):
    q, k, v, pos = random_inputs(1, len(parent), heads=2, d=3, dv=2, seed=0, pos_dim=2)
    tree = make_tree(parent)
    for p in (None, pos):
        y = hsa_graph.hsa(q, k, v, tree, include_self=False, pos=p)
        torch.testing.assert_close(y, torch.zeros_like(v), **TOL)
        theta = hsa_graph.hsa_weights(q, k, tree, include_self=False, pos=p)
        torch.testing.assert_close(theta, torch.zeros(2, 1, 1, dtype=DT), **TOL)
        y = hsa_graph.hsa(q, k, v, tree, include_self=True, pos=p)
        torch.testing.assert_close(y, v, **TOL)
        theta = hsa_graph.hsa_weights(q, k, tree, include_self=True, pos=p)
        torch.testing.assert_close(theta, torch.ones(2, 1, 1, dtype=DT), **TOL)


def test_single_leaf_trees_inside_a_forest():
    parent = [-1, -1, 1, 1, -1, 4]  # single node | two leaves | unary root over a leaf
    q, k, v, _ = random_inputs(4, 6, heads=1, d=2, dv=2, seed=3)
    y = hsa_graph.hsa(q, k, v, make_tree(parent), include_self=False)
    expected = torch.zeros_like(v)
    expected[1], expected[2] = v[2], v[1]
    torch.testing.assert_close(y, expected, **TOL)


@settings(max_examples=40, **SETTINGS)
@given(cases())
def test_block_constraint_and_no_attention_across_trees(c):
    theta = hsa_graph.hsa_weights(c.q, c.k, make_tree(c.parent), **c.kw)
    tree = c.ref_tree
    for p in range(tree.num_nodes):
        for a in tree.children[p]:
            for b in tree.children[p]:
                if a != b:
                    block = theta[:, tree.leaf_rows[a]][:, :, tree.leaf_rows[b]]
                    torch.testing.assert_close(block, block[:, :1, :1].expand_as(block),
                                               **TOL)
    tid = torch.tensor(tree.tree_of_leaf)
    across = tid[:, None] != tid[None, :]
    assert (theta[:, across] == 0).all()


# ----------------------------------------------------------------------------------------
# Property 4: KL optimality inside every family
# ----------------------------------------------------------------------------------------


def perturb_family(theta, tree: Tree, p: int, gen, strength: float):
    """A feasible perturbation of theta inside the family of node p.

    For every child A of p and every head, the mass of A's rows inside l(p) is split
    as [inside A, block (A, B) for each sibling B]; that split is moved at random
    (same total, zeros stay zero).  The inside-A block is scaled as a whole and each
    (A, B) block is set to a new constant, so row sums and the block constraint are
    kept."""
    out = theta.clone()
    chd = tree.children[p]
    for a in chd:
        rows = torch.tensor(tree.leaf_rows[a])
        sibs = [b for b in chd if b != a]
        r0 = tree.leaf_rows[a][0]
        for h in range(theta.shape[0]):
            inside = theta[h, r0, rows].sum()
            parts = [inside] + [theta[h, r0, tree.leaf_rows[b]].sum() for b in sibs]
            w = torch.stack(parts)
            total = w.sum()
            if total <= 0:
                continue
            noise = torch.randn(len(w), generator=gen, dtype=theta.dtype)
            w_new = w * torch.exp(strength * noise)
            w_new = w_new / w_new.sum() * total
            if inside > 0:
                out[h, rows[:, None], rows[None, :]] *= w_new[0] / inside
            for b, wb in zip(sibs, w_new[1:]):
                cols = torch.tensor(tree.leaf_rows[b])
                out[h, rows[:, None], cols[None, :]] = wb / len(cols)
    return out


@settings(max_examples=25, **SETTINGS)
@given(cases(max_nodes=14), st.integers(0, 2**31 - 1))
def test_kl_optimality_within_every_family(c, seed):
    theta = hsa_graph.hsa_weights(c.q, c.k, make_tree(c.parent), **c.kw)
    flat = flat_softmax_rows(c.parent, c.q, c.k, c.include_self, c.scale, c.pos)
    kl0 = kl_objective(theta, flat)
    assert torch.isfinite(kl0)
    tree = c.ref_tree
    gen = torch.Generator().manual_seed(seed)
    for p in range(tree.num_nodes):
        if len(tree.children[p]) < 2:
            continue
        for strength in (1e-2, 1e-1, 0.5, 2.0):
            other = perturb_family(theta, tree, p, gen, strength)
            torch.testing.assert_close(other.sum(-1), theta.sum(-1), **TOL)
            kl1 = kl_objective(other, flat)
            assert kl1 >= kl0 - 1e-10 * (1 + kl0), (p, strength, float(kl0), float(kl1))


def test_kl_perturbation_is_not_vacuous():
    """The perturbation used above does raise the KL of the optimum (sanity check)."""
    parent = [-1, 0, 0, 0, 1, 1, 2, 2, 2]
    q, k, _, _ = random_inputs(6, 9, heads=1, d=3, dv=1, seed=2)
    theta = dense_hsa_weights(parent, q, k)
    flat = flat_softmax_rows(parent, q, k)
    kl0 = kl_objective(theta, flat)
    gen = torch.Generator().manual_seed(0)
    for p in (0, 1, 2):
        kl1 = kl_objective(perturb_family(theta, Tree(parent), p, gen, 0.1), flat)
        assert kl1 > kl0 + 1e-6


# ----------------------------------------------------------------------------------------
# Property 5: unary nodes are transparent
# ----------------------------------------------------------------------------------------


@settings(max_examples=40, **SETTINGS)
@given(cases(), st.data())
def test_unary_nodes_are_transparent(c, data):
    u = data.draw(st.integers(0, len(c.parent) - 1), label="insert above node")
    sigma = data.draw(st.permutations(range(len(c.parent) + 1)), label="relabel")
    parent = insert_unary(c.parent, u)
    pos = None if c.pos is None else torch.cat([c.pos, c.pos[u:u + 1]])  # eps(new) = eps(u)
    if data.draw(st.booleans(), label="shuffle ids"):
        parent, perm = relabel(parent, list(sigma))
        inv = torch.empty(len(sigma), dtype=torch.long)
        inv[torch.tensor(sigma)] = torch.arange(len(sigma))
        pos = None if pos is None else pos[inv]
    else:
        perm = list(range(len(c.q)))
    kw = {**c.kw, "pos": pos}
    tree = make_tree(c.parent)
    y = hsa_graph.hsa(c.q, c.k, c.v, tree, **c.kw)
    y_u = hsa_graph.hsa(c.q[perm], c.k[perm], c.v[perm], make_tree(parent), **kw)
    torch.testing.assert_close(y_u, y[perm], **TOL)
    theta = hsa_graph.hsa_weights(c.q, c.k, tree, **c.kw)
    theta_u = hsa_graph.hsa_weights(c.q[perm], c.k[perm], make_tree(parent), **kw)
    torch.testing.assert_close(theta_u, theta[:, perm][:, :, perm], **TOL)


@pytest.mark.parametrize("include_self", [True, False])
def test_deep_unary_chain_equals_direct_parent(include_self):
    parent = [-1, 0, 0, 1, 1]
    chain = [-1] + list(range(0, 49))  # 50 unary nodes, node 49 at the bottom
    deep = chain + [49, 49, 50, 50]  # same shape as `parent` below the chain
    q, k, v, _ = random_inputs(3, 5, heads=2, d=2, dv=3, seed=9)
    expected = hsa_graph.hsa(q, k, v, make_tree(parent), include_self=include_self)
    got = hsa_graph.hsa(q, k, v, make_tree(deep), include_self=include_self)
    torch.testing.assert_close(got, expected, **TOL)


# ----------------------------------------------------------------------------------------
# Property 6: permutation equivariance (set geometry, no positions)
# ----------------------------------------------------------------------------------------


def _relabelled(c: Case, sigma):
    parent, perm = relabel(c.parent, list(sigma))
    pos = None
    if c.pos is not None:
        inv = torch.empty(len(sigma), dtype=torch.long)
        inv[torch.tensor(sigma)] = torch.arange(len(sigma))
        pos = c.pos[inv]  # pos of new node w is pos of old node inv[w]
    return parent, perm, pos


@settings(max_examples=40, **SETTINGS)
@given(cases(), st.data())
def test_node_relabelling_is_equivariant(c, data):
    sigma = data.draw(st.permutations(range(len(c.parent))), label="sigma")
    parent, perm, pos = _relabelled(c, sigma)
    kw = {**c.kw, "pos": pos}
    y = hsa_graph.hsa(c.q, c.k, c.v, make_tree(c.parent), **c.kw)
    y_p = hsa_graph.hsa(c.q[perm], c.k[perm], c.v[perm], make_tree(parent), **kw)
    torch.testing.assert_close(y_p, y[perm], **TOL)


@settings(max_examples=30, **SETTINGS)
@given(cases(with_pos=False), st.data())
def test_permuting_children_of_a_set_node(c, data):
    tree = c.ref_tree
    internal = [p for p in range(tree.num_nodes) if len(tree.children[p]) >= 2]
    if not internal:
        return
    p = data.draw(st.sampled_from(internal), label="node")
    order = data.draw(st.permutations(tree.children[p]), label="children order")
    base = dfs_relabel(c.parent)  # children in id order
    moved = dfs_relabel(c.parent, {p: list(order)})
    parent0, perm0 = relabel(c.parent, base)
    parent1, perm1 = relabel(c.parent, moved)
    y0 = hsa_graph.hsa(c.q[perm0], c.k[perm0], c.v[perm0], make_tree(parent0), **c.kw)
    y1 = hsa_graph.hsa(c.q[perm1], c.k[perm1], c.v[perm1], make_tree(parent1), **c.kw)
    # row r of y1 is original leaf perm1[r]; find it in y0
    where0 = {old: r for r, old in enumerate(perm0)}
    torch.testing.assert_close(y1, y0[[where0[old] for old in perm1]], **TOL)


# ----------------------------------------------------------------------------------------
# Property 7: trees in a batch are independent
# ----------------------------------------------------------------------------------------


@st.composite
def tree_lists(draw):
    n = draw(st.integers(2, 4))
    heads = draw(st.integers(1, 3))
    d, dv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    use_pos = draw(st.booleans())
    items = []
    for _ in range(n):
        parent = draw(parent_arrays(12))
        t = Tree(parent)
        items.append((parent, *random_inputs(t.num_leaves, t.num_nodes, heads, d, dv,
                                             seed=draw(st.integers(0, 2**31 - 1)),
                                             pos_dim=2 if use_pos else 0)))
    return items, draw(st.booleans()), draw(st.permutations(range(n)))


def _run_batch(items, order, include_self):
    chosen = [items[i] for i in order]
    batch = Batch.from_data_list([make_tree(it[0]) for it in chosen])
    cat = [torch.cat([it[j] for it in chosen]) for j in (1, 2, 3)]
    pos = None if chosen[0][4] is None else torch.cat([it[4] for it in chosen])
    y = hsa_graph.hsa(*cat, batch, include_self=include_self, pos=pos)
    theta = hsa_graph.hsa_weights(cat[0], cat[1], batch, include_self=include_self, pos=pos)
    out, off = {}, 0
    for i, it in zip(order, chosen):
        n = len(it[1])
        out[i] = (y[off:off + n], theta[:, off:off + n, off:off + n])
        off += n
    return out, y, theta, cat, pos


@settings(max_examples=25, **SETTINGS)
@given(tree_lists())
def test_trees_in_a_batch_are_independent(arg):
    items, include_self, order = arg
    alone = {}
    for i, (parent, q, k, v, pos) in enumerate(items):
        tree = make_tree(parent)
        alone[i] = (hsa_graph.hsa(q, k, v, tree, include_self=include_self, pos=pos),
                    hsa_graph.hsa_weights(q, k, tree, include_self=include_self, pos=pos))
    for ordering in (list(range(len(items))), list(order), list(order)[1:]):
        parts, y, theta, cat, pos = _run_batch(items, ordering, include_self)
        for i, (y_i, theta_i) in parts.items():
            torch.testing.assert_close(y_i, alone[i][0], **TOL)
            torch.testing.assert_close(theta_i, alone[i][1], **TOL)
        # the batch is exactly the forest of the concatenated parent arrays
        forest = concat_parents([items[i][0] for i in ordering])
        torch.testing.assert_close(
            y, dense_hsa(forest, cat[0], cat[1], cat[2], include_self=include_self,
                         pos=pos), **TOL)
        sizes = [len(items[i][1]) for i in ordering]
        assert (theta.sum(0) * (1 - torch.block_diag(*[torch.ones(s, s) for s in sizes])
                                .to(DT)) == 0).all()


# ----------------------------------------------------------------------------------------
# Property 8: gradients are exact
# ----------------------------------------------------------------------------------------

GRAD_TREES = [
    [-1, 0, 0, 0],
    [-1, 0, 0, 1, 1, 2, 2, 2],
    [-1, 0, 1, 1, 0, 4, 0],  # leaf 6 next to unary 4 over leaf 5
    [-1, 0, 0, 1, 1, -1, 5, 5],  # a forest
    [-1, 0],  # a single leaf under a root
]


GRADCHECK_CASES = [(p, kind) for p in GRAD_TREES for kind in (None, "per_head")] + [
    (GRAD_TREES[1], "shared"), (GRAD_TREES[2], "shared")]


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("parent,pos_kind", GRADCHECK_CASES)
def test_gradcheck(parent, include_self, pos_kind):
    t = Tree(parent)
    q, k, v, pos = random_inputs(t.num_leaves, t.num_nodes, heads=2, d=2, dv=3, seed=11,
                                 pos_dim=2 if pos_kind else 0,
                                 pos_per_head=pos_kind == "per_head")
    tree = make_tree(parent)
    inputs = [x.requires_grad_(True) for x in (q, k, v) + ((pos,) if pos_kind else ())]

    def f(q, k, v, pos=None):
        return hsa_graph.hsa(q, k, v, tree, include_self=include_self, pos=pos)

    def g(q, k, pos=None):
        return hsa_graph.hsa_weights(q, k, tree, include_self=include_self, pos=pos)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)
    # theta has H*N*N outputs: the fast (random projection) mode keeps this quick
    assert torch.autograd.gradcheck(g, inputs[:2] + inputs[3:], eps=1e-6, atol=1e-6,
                                    rtol=1e-5, fast_mode=True)


def _grads(out, inputs):
    """Gradients of a scalar, zeros where it does not depend on an input (a constant
    output, e.g. a single leaf without self, may carry no autograd graph)."""
    if not out.requires_grad:
        return [torch.zeros_like(x) for x in inputs]
    return torch.autograd.grad(out, inputs, allow_unused=True)


@settings(max_examples=40, **SETTINGS)
@given(cases(), st.integers(0, 2**31 - 1))
def test_gradients_match_reference(c, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = [c.q, c.k, c.v] + ([c.pos] if c.pos is not None else [])
    inputs = [x.clone().requires_grad_(True) for x in inputs]
    tree = make_tree(c.parent)
    w = torch.randn(c.v.shape, generator=gen, dtype=DT)
    q, k, v = inputs[:3]
    kw = {**c.kw, "pos": inputs[3] if c.pos is not None else None}
    y = hsa_graph.hsa(q, k, v, tree, **kw)
    y_ref = dense_hsa(c.parent, q, k, v, **kw)
    got, expected = _grads((w * y).sum(), inputs), _grads((w * y_ref).sum(), inputs)
    for name, a, b, x in zip("qkvp", got, expected, inputs):
        a = torch.zeros_like(x) if a is None else a
        b = torch.zeros_like(x) if b is None else b
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"grad {n}: {m}")


# ----------------------------------------------------------------------------------------
# Property 9: numerical stability
# ----------------------------------------------------------------------------------------

STABILITY_TREES = [
    [-1] + [0] * 40,
    [-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 9, 9, 0, 15, 16, 16],
    [-1, 0, 1, 2, 2, 2, 0, 6, 6, -1, 9, 9, 11, 11, 11],
]


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("parent", STABILITY_TREES)
@pytest.mark.parametrize("with_pos", [False, True])
def test_large_logits_float32(parent, include_self, with_pos):
    t = Tree(parent)
    d = 16
    q, k, v, pos = random_inputs(t.num_leaves, t.num_nodes, heads=2, d=d, dv=3, seed=4,
                                 dtype=torch.float32, pos_dim=3 if with_pos else 0,
                                 pos_scale=60.0)
    q, k = 100 * q, 100 * k
    logits = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(d)
    assert logits.abs().max() > 5e3  # logits of magnitude ~1e4
    kw = {"include_self": include_self, "pos": pos}
    tree = make_tree(parent)
    q.requires_grad_(True)
    k.requires_grad_(True)
    y = hsa_graph.hsa(q, k, v, tree, **kw)
    theta = hsa_graph.hsa_weights(q, k, tree, **kw)
    assert y.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(theta).all()
    kw64 = {"include_self": include_self, "pos": None if pos is None else pos.double()}
    q64, k64, v64 = q.detach().double(), k.detach().double(), v.double()
    torch.testing.assert_close(y.detach().double(), dense_hsa(parent, q64, k64, v64, **kw64),
                               rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(theta.detach().double(),
                               dense_hsa_weights(parent, q64, k64, **kw64),
                               rtol=1e-2, atol=1e-2)
    gq, gk = torch.autograd.grad(y.square().sum(), (q, k))
    assert torch.isfinite(gq).all() and torch.isfinite(gk).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("include_self", [True, False])
def test_half_precision_inputs(dtype, tol, include_self):
    parent = STABILITY_TREES[1]
    t = Tree(parent)
    q, k, v, pos = random_inputs(t.num_leaves, t.num_nodes, heads=2, d=8, dv=4, seed=6,
                                 dtype=torch.float32, pos_dim=2)
    q, k, v, pos = (x.to(dtype) for x in (q, k, v, pos))
    tree = make_tree(parent)
    kw = {"include_self": include_self}
    y = hsa_graph.hsa(q, k, v, tree, pos=pos, **kw)
    assert torch.isfinite(y.float()).all()
    y32 = hsa_graph.hsa(q.float(), k.float(), v.float(), tree, pos=pos.float(), **kw)
    torch.testing.assert_close(y.float(), y32, rtol=tol, atol=tol)
    theta = hsa_graph.hsa_weights(q, k, tree, pos=pos, **kw)
    theta32 = hsa_graph.hsa_weights(q.float(), k.float(), tree, pos=pos.float(), **kw)
    torch.testing.assert_close(theta.float(), theta32, rtol=tol, atol=tol)
    # backward works and is finite
    qq = q.clone().requires_grad_(True)
    (gq,) = torch.autograd.grad(hsa_graph.hsa(qq, k, v, tree, pos=pos, **kw).float().sum(),
                                (qq,))
    assert torch.isfinite(gq.float()).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, DT])
def test_output_dtype_follows_input(dtype):
    q, k, v, _ = random_inputs(3, 4, heads=1, d=2, dv=2, seed=0, dtype=dtype)
    tree = make_tree([-1, 0, 0, 0])
    assert hsa_graph.hsa(q, k, v, tree).dtype == dtype
    assert hsa_graph.hsa_weights(q, k, tree).dtype == dtype


# ----------------------------------------------------------------------------------------
# Invalid input
# ----------------------------------------------------------------------------------------

_P = [-1, 0, 0, 0, 1, 1]  # 4 leaves (2, 3, 4, 5), 6 nodes


def _good(heads=2, d=3, dv=5):
    q, k, v, _ = random_inputs(4, 6, heads=heads, d=d, dv=dv, seed=0)
    return q, k, v


@pytest.mark.parametrize("what", [
    "q_rows", "k_rows", "v_rows", "k_heads", "v_heads", "k_dim", "q_2d_k_3d",
    "v_2d", "q_1d",
])
def test_bad_qkv_raise_value_error(what):
    q, k, v = _good()
    bad = {
        "q_rows": lambda: (torch.cat([q, q[:1]]), k, v),
        "k_rows": lambda: (q, k[:3], v),
        "v_rows": lambda: (q, k, torch.cat([v, v[:1]])),
        "k_heads": lambda: (q, torch.cat([k, k[:, :1]], 1), v),
        "v_heads": lambda: (q, k, v[:, :1]),
        "k_dim": lambda: (q, k[..., :2], v),
        "q_2d_k_3d": lambda: (q[:, 0], k, v),
        "v_2d": lambda: (q, k, v[:, 0]),
        "q_1d": lambda: (q[:, 0, 0], k[:, 0, 0], v[:, 0, 0]),
    }[what]
    qq, kk, vv = bad()
    tree = make_tree(_P)
    with pytest.raises(ValueError):
        hsa_graph.hsa(qq, kk, vv, tree)
    if what.startswith(("q", "k")):
        with pytest.raises(ValueError):
            hsa_graph.hsa_weights(qq, kk, tree)


@pytest.mark.parametrize("shape", [
    (5, 2),  # one row short of the node count
    (4, 2),  # one row per leaf instead of per node
    (7, 2),
    (6,),  # 1-D
    (6, 3, 2),  # per-head with the wrong head count (H = 2)
    (6, 2, 2, 2),  # 4-D
])
def test_bad_pos_raises_value_error(shape):
    q, k, v = _good()
    pos = torch.randn(*shape, dtype=DT)
    tree = make_tree(_P)
    with pytest.raises(ValueError):
        hsa_graph.hsa(q, k, v, tree, pos=pos)
    with pytest.raises(ValueError):
        hsa_graph.hsa_weights(q, k, tree, pos=pos)


@pytest.mark.parametrize("parent", [
    [0],  # self loop, no root
    [1, 0],  # a cycle, no root
    [-1, 0, 3, 2],  # a root plus a detached cycle
    [-1, 6],  # parent index out of range
    [-1, -2],  # negative index other than -1
])
def test_bad_parent_arrays_raise_value_error(parent):
    with pytest.raises(ValueError):
        make_tree(parent)


# ----------------------------------------------------------------------------------------
# The fused family kernel (D == Dv), issue 9: exactness, host syncs, caching, NaN
# ----------------------------------------------------------------------------------------

# leaf families contiguous (a reshape), ragged sizes with padding (17 -> 18), mixed
# leaf/internal families, lonely leaves, unary chains and a forest
FUSED_TREES = [
    [-1] + [0] * 4 + [1 + i // 4 for i in range(16)],
    [-1, 0, 0] + [1] * 17 + [2] * 3,
    [-1, 0, 1, 1, 0, 4, 0] + [1] * 3,
    [-1, 0, 0, 1, 1, -1, 5, 5, 5, -1],
    [-1] + [0] * 40 + [1, 1],
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("parent", FUSED_TREES)
def test_fused_path_matches_reference(parent, include_self, dtype):
    # D == Dv takes the fused kernel (the random cases above use D != Dv)
    t = Tree(parent)
    q, k, v, _ = random_inputs(t.num_leaves, t.num_nodes, heads=2, d=4, dv=4, seed=5,
                               dtype=torch.float64)
    ref = dense_hsa(parent, q, k, v, include_self=include_self)
    qc, kc, vc = (x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v))
    y = hsa_graph.hsa(qc, kc, vc, make_tree(parent), include_self=include_self)
    tol = TOL if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(y.double(), ref, **tol)
    # gradients of a random projection against the dense formula's
    w = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y.double() * w).sum().backward()
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    (dense_hsa(parent, qr, kr, vr, include_self=include_self) * w).sum().backward()
    for got, want in ((qc, qr), (kc, kr), (vc, vr)):
        torch.testing.assert_close(got.grad.double(), want.grad, **tol)


@pytest.mark.parametrize("dv", [3, 4])  # fallback and fused kernel
def test_family_attention_gradcheck(dv):
    from hsa_graph.ops.hsa import _FamilyAttention

    gen = torch.Generator().manual_seed(3)
    f, h, b, d = 3, 2, 5, 4
    q, k = (torch.randn(f, b, h, d, generator=gen, dtype=DT).transpose(1, 2)
            .requires_grad_() for _ in range(2))
    v = torch.randn(f, h, b, dv, generator=gen, dtype=DT, requires_grad=True)
    bias = torch.randn(f, 1, b, b, generator=gen, dtype=DT)
    bias[0, 0, :, 4] = float("-inf")  # a padded key
    bias.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))
    out, lse = _FamilyAttention.apply(q, k, v, bias, 0.7)
    logits = q @ k.transpose(-1, -2) * 0.7 + bias  # independent: explicit softmax
    torch.testing.assert_close(lse, logits.logsumexp(-1), **TOL)
    torch.testing.assert_close(out, logits.softmax(-1) @ v, **TOL)
    assert torch.autograd.gradcheck(
        lambda a, b_, c: _FamilyAttention.apply(a, b_, c, bias, 0.7), (q, k, v))


SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::unique",
            "aten::_unique2", "aten::unique_consecutive", "aten::masked_select")


@pytest.mark.parametrize("parent", FUSED_TREES)
def test_forward_and_backward_do_not_synchronise(parent):
    """No op that reads a device value back to the host (``.item()``, ``bool()``,
    ``nonzero`` ...) runs in a call on a built tree; on CUDA the same test runs under
    ``torch.cuda.set_sync_debug_mode`` in tests/ops/test_cuda.py."""
    from torch.profiler import profile

    t = Tree(parent)
    q, k, v, pos = random_inputs(t.num_leaves, t.num_nodes, heads=2, d=4, dv=4, seed=2,
                                 pos_dim=2)
    q.requires_grad_()
    tree = make_tree(parent)
    assert tree.structure is not None  # built (validation syncs) before profiling
    with profile() as prof:
        hsa_graph.hsa(q, k, v, tree).sum().backward()
        hsa_graph.hsa(q, k, v, tree, include_self=False, pos=pos).sum().backward()
    names = {event.name for event in prof.events() if not _in_cpu_read(event)}
    assert "aten::bmm" in names or "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert not names & set(SYNC_OPS), names & set(SYNC_OPS)


def _in_cpu_read(event) -> bool:
    """Whether a profiler event runs inside the CPU kernels' one host read (of a CPU
    tensor, so no device sync: see ``hsa_graph.ops.flash.CPU_READ``)."""
    from hsa_graph.ops.flash import CPU_READ

    while event is not None:
        if event.name == CPU_READ:
            return True
        event = event.cpu_parent
    return False


def test_guard_sees_a_sync():
    """The op list above would catch a host read (the guard is not vacuous)."""
    from torch.profiler import profile

    with profile() as prof:
        bool(torch.ones(3).sum() > 1)
    assert {event.name for event in prof.events()} & set(SYNC_OPS)


def test_second_call_does_not_rebuild_the_structure(monkeypatch):
    builds = []
    build = hsa_graph.TreeStructure.from_parent.__func__

    def counting(cls, parent):
        builds.append(parent.numel())
        return build(cls, parent)

    monkeypatch.setattr(hsa_graph.TreeStructure, "from_parent", classmethod(counting))
    parent = FUSED_TREES[1]
    tree = make_tree(parent)
    t = Tree(parent)
    q, k, v, _ = random_inputs(t.num_leaves, t.num_nodes, heads=2, d=4, dv=4, seed=0)
    assert not builds  # the constructor only validates; the first use builds it
    first = hsa_graph.hsa(q, k, v, tree)
    second = hsa_graph.hsa(q, k, v, tree, include_self=False)
    hsa_graph.hsa_weights(q, k, tree)
    assert len(builds) == 1
    assert tree.structure is tree.structure
    torch.testing.assert_close(first, dense_hsa(parent, q, k, v), **TOL)
    torch.testing.assert_close(second, dense_hsa(parent, q, k, v, include_self=False), **TOL)


@pytest.mark.parametrize("name", ["q", "k", "v", "pos"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_check_finite_names_tensor_and_row(name, bad):
    parent = FUSED_TREES[2]  # leaves are nodes 2, 3, 5, 6, 7, 8, 9 in this order
    t = Tree(parent)
    q, k, v, pos = random_inputs(t.num_leaves, t.num_nodes, heads=2, d=3, dv=3, seed=0,
                                 pos_dim=2)
    tensors = {"q": q, "k": k, "v": v, "pos": pos}
    row = 4  # leaf row 4 is node 7; for pos, node 4
    tensors[name][row, ..., -1] = bad
    tensors[name][row + 2, ..., 0] = bad  # only the first row is named
    tree = make_tree(parent)
    where = "node 4" if name == "pos" else "leaf row 4 (node 7)"
    with pytest.raises(ValueError, match=rf"^{name} holds a non-finite .* at {re.escape(where)}$"):
        hsa_graph.hsa(q, k, v, tree, pos=pos, check_finite=True)
    if name != "v":
        with pytest.raises(ValueError, match=rf"^{name} holds a non-finite"):
            hsa_graph.hsa_weights(q, k, tree, pos=pos, check_finite=True)
    # unchecked, the value propagates (no error), and finite inputs pass the check
    assert not torch.isfinite(hsa_graph.hsa(q, k, v, tree, pos=pos)).all()
    clean = random_inputs(t.num_leaves, t.num_nodes, heads=2, d=3, dv=3, seed=0, pos_dim=2)
    hsa_graph.hsa(*clean[:3], tree, pos=clean[3], check_finite=True)


@pytest.mark.parametrize("dtype, huge", [(torch.float32, 3e38), (torch.float16, 6e4),
                                         (torch.bfloat16, 3e38), (torch.float64, 1.7e308)])
def test_check_finite_passes_rows_whose_sum_overflows(dtype, huge):
    # the check sums each row first: a finite row whose sum overflows is re-tested
    # exactly, not refused; a NaN or inf is still named, in every dtype
    tree = make_tree([-1, 0, 0, 0, 0])
    q, k, v = (torch.zeros(4, 2, 3, dtype=dtype) for _ in range(3))
    v[1] = huge
    hsa_graph.hsa(q, k, v, tree, check_finite=True)
    v[2, 1, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^v holds a non-finite .* at leaf row 2 "):
        hsa_graph.hsa(q, k, v, tree, check_finite=True)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_finite_values_stay_in_their_tree(name):
    parents = [FUSED_TREES[0], FUSED_TREES[2], [-1, 0, 0, 0], [-1]]
    trees = [make_tree(p) for p in parents]
    batch = Batch.from_data_list(trees)
    n = [Tree(p).num_leaves for p in parents]
    q, k, v, _ = random_inputs(sum(n), 1, heads=2, d=4, dv=4, seed=9)
    tensors = {"q": q, "k": k, "v": v}
    clean = hsa_graph.hsa(q, k, v, batch)
    bad_row = n[0] + 1  # a leaf of the second tree
    tensors[name][bad_row, 1, 2] = float("nan")
    y = hsa_graph.hsa(q, k, v, batch)
    lo, hi = n[0], n[0] + n[1]
    assert torch.isnan(y[lo:hi]).any()
    torch.testing.assert_close(y[:lo], clean[:lo], **TOL)
    torch.testing.assert_close(y[hi:], clean[hi:], **TOL)


# ----------------------------------------------------------------------------------------
# Every bucket layout of TreeStructure (reshape, leaf block, index_select gathers with
# padding that repeats a member, two-source mixed buckets) against the reference
# ----------------------------------------------------------------------------------------


def _star(sizes, internal=False):
    """A root whose children are families of the given sizes (leaves, or internal
    nodes with two leaves each when ``internal``)."""
    parent = [-1]
    for size in sizes:
        node = len(parent)
        parent.append(0)
        parent.extend([node] * size)
    if internal:  # each leaf of the families above gets two leaf children
        leaves = [u for u in range(len(parent)) if u not in set(parent)]
        for u in leaves:
            parent.extend([u, u])
    return parent


LAYOUT_TREES = {
    "balanced_reshape": [-1, 0, 0, 0, 0] + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4,
    "caterpillar_leaf_block": [-1, 0, 1, 2] + [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3,
    "ragged_padded_leaves": _star([17, 2, 19, 5, 23, 17]),
    "ragged_padded_internal": _star([17, 2, 19], internal=True),
    "mixed_padded": [-1] + [0] * 17 + [1, 1, 2, 2],
}


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("name", sorted(LAYOUT_TREES))
def test_bucket_layouts_match_reference(name, include_self):
    parent = LAYOUT_TREES[name]
    t = Tree(parent)
    q, k, v, _ = random_inputs(t.num_leaves, t.num_nodes, 2, 3, 4, seed=5)
    inputs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    y = hsa_graph.hsa(*inputs, make_tree(parent), include_self=include_self)
    y_ref = dense_hsa(parent, *inputs, include_self=include_self)
    torch.testing.assert_close(y, y_ref, **TOL)
    with torch.no_grad():  # the gathers share a scratch, the leaf rows scatter in place
        torch.testing.assert_close(hsa_graph.hsa(q, k, v, make_tree(parent),
                                                 include_self=include_self), y_ref, **TOL)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    for a, b, n in zip(_grads((w * y).sum(), inputs), _grads((w * y_ref).sum(), inputs),
                       "qkv"):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=n: f"grad {n}: {m}")


LEAF_BLOCK_TREES = {  # families of L >= 2 leaves in place plus E internal members
    "one_internal": [-1, 0, 1, 2] + [0] * 3 + [1] * 3 + [2] * 3 + [3] * 2,
    "two_internal": [-1, 0, 0] + [0] * 3 + [1] * 3 + [2] * 3,
    "two_leaves": [-1, 0, 1] + [0] * 2 + [1] * 2 + [2] * 2,
    # without autograd on CPU, 15 and 14 leaves read keys in windows of 16, the extra
    # keys (the next family's first leaves) masked
    "window_of_one_more": [-1, 0, 1, 2] + [0] * 15 + [1] * 15 + [2] * 15 + [3] * 15,
    "window_of_two_more": [-1, 0, 1] + [0] * 14 + [1] * 14 + [2] * 14,
}


@pytest.mark.parametrize("with_pos", [False, True])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("name", sorted(LEAF_BLOCK_TREES))
def test_leaf_block_buckets_match_reference(name, include_self, with_pos):
    """A leaf_block bucket attends with its leaves in place, in parts whose
    log-sum-exps combine: output and gradients against the dense reference, with and
    without autograd (the no-grad path updates the fused kernel's output in place)."""
    parent = LEAF_BLOCK_TREES[name]
    tree = make_tree(parent)
    blocks = [b for b in tree.structure.buckets if b.leaf_block is not None]
    assert blocks
    if name.startswith("window"):
        width = _flash_key_width(blocks[0].leaf_block[1])
        assert width == 16 and tree.structure.leaf_block_window(
            blocks[0], torch.zeros(Tree(parent).num_leaves, 1), width) is not None
    t = Tree(parent)
    q, k, v, _ = random_inputs(t.num_leaves, t.num_nodes, 2, 3, 4, seed=8)
    pos = (torch.randn(t.num_nodes, 3, generator=torch.Generator().manual_seed(2),
                       dtype=DT) if with_pos else None)
    inputs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    y = hsa_graph.hsa(*inputs, tree, include_self=include_self, pos=pos)
    y_ref = dense_hsa(parent, *inputs, include_self=include_self, pos=pos)
    torch.testing.assert_close(y, y_ref, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(hsa_graph.hsa(q, k, v, tree, include_self=include_self,
                                                 pos=pos), y_ref, **TOL)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    for a, b, n in zip(_grads((w * y).sum(), inputs), _grads((w * y_ref).sum(), inputs),
                       "qkv"):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=n: f"grad {n}: {m}")


def test_leaf_block_buckets_in_chunks(monkeypatch):
    """Without autograd a leaf_block bucket runs in chunks of families, written into
    the output's rows: one family per chunk gives the same answer."""
    from hsa_graph import structure
    monkeypatch.setattr(structure, "_CHUNK_BYTES", 1)
    # (the second tree: families of leaves in buckets with and without a range, and
    # internal families, each finalised one family per chunk)
    for parent in (LEAF_BLOCK_TREES["window_of_one_more"],
                   [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5, 5, 5]):
        t = Tree(parent)
        q, k, v, _ = random_inputs(t.num_leaves, t.num_nodes, 2, 3, 4, seed=10)
        with torch.no_grad():
            for include_self in (True, False):
                torch.testing.assert_close(
                    hsa_graph.hsa(q, k, v, make_tree(parent), include_self=include_self),
                    dense_hsa(parent, q, k, v, include_self=include_self), **TOL)


def test_leaf_block_buckets_double_backward():
    parent = LEAF_BLOCK_TREES["two_internal"]
    tree, t = make_tree(parent), Tree(parent)
    inputs = [x.requires_grad_(True)
              for x in random_inputs(t.num_leaves, t.num_nodes, 2, 3, 4, seed=9)[:3]]
    for include_self in (True, False):
        def f(q, k, v, include_self=include_self):
            return hsa_graph.hsa(q, k, v, tree, include_self=include_self)
        assert torch.autograd.gradgradcheck(f, inputs)


def _forest(parents):
    """The trees of ``parents`` as one forest, nodes numbered tree after tree."""
    out, offset = [], 0
    for parent in parents:
        out.extend(p if p < 0 else p + offset for p in parent)
        offset += len(parent)
    return out


@pytest.mark.parametrize("grad", [False, True])
def test_every_bucket_kind_in_one_tree(grad):
    """The layout trees as one forest, whose buckets copy their members: without
    autograd those copies share one scratch per operand, which each bucket overwrites
    after the one before it is done."""
    parent = _forest(LAYOUT_TREES[name] for name in sorted(LAYOUT_TREES))
    st = make_tree(parent).structure
    copied = [b for b in st.buckets if not b.is_view]
    assert len(copied) >= 3 and st.copied_slots == max(  # leaf_block buckets: no scratch
        b.num_families * b.size for b in copied if b.leaf_block is None)
    t = Tree(parent)
    q, k, v, _ = random_inputs(t.num_leaves, t.num_nodes, 2, 3, 4, seed=6)
    with torch.set_grad_enabled(grad):
        y = hsa_graph.hsa(*(x.requires_grad_(grad) for x in (q, k, v)), make_tree(parent))
    torch.testing.assert_close(y, dense_hsa(parent, q, k, v), **TOL)


def test_layout_trees_exercise_every_bucket_kind():
    kinds = set()
    for parent in LAYOUT_TREES.values():
        for b in make_tree(parent).structure.buckets:
            kinds.add("range" if b.leaf_range or b.internal_range else
                      "block" if b.leaf_block else
                      "leaf_gather" if b.leaf_gather is not None else
                      "internal_gather" if b.internal_gather is not None else "mixed")
    assert kinds == {"range", "block", "leaf_gather", "internal_gather", "mixed"}


@pytest.mark.parametrize("chunk_bytes", [1, None])
def test_leaf_buckets_read_by_index_in_chunks(monkeypatch, chunk_bytes):
    """Without autograd, buckets of leaves read by index (ragged families) attend a
    chunk of families at a time, their rows written unweighted into the output and
    weighed there in one pass: against the dense reference with padding slots, a lonely
    leaf, a forest (a leaf that is a root), positions and values narrower than the keys
    (which take the whole-bucket path)."""
    from hsa_graph import structure
    if chunk_bytes is not None:
        monkeypatch.setattr(structure, "_CHUNK_BYTES", chunk_bytes)
    ragged = ([-1, 0, 0, 0, 0, 0, 0] + [1] * 2 + [2] * 3 + [3] * 5 + [4] * 3 + [5] * 4
              + [6])
    forest = ragged + [-1, -1, len(ragged) + 1, len(ragged) + 1]  # a leaf that is a root
    for parent in (ragged, forest):
        tree, t = make_tree(parent), Tree(parent)
        assert any(b.leaf_gather is not None for b in tree.structure.buckets)
        q, k, v, _ = random_inputs(t.num_leaves, t.num_nodes, 2, 3, 4, seed=12)
        pos = torch.randn(t.num_nodes, 3, generator=torch.Generator().manual_seed(3),
                          dtype=DT)
        for include_self in (True, False):
            for p, vals in ((None, v), (pos, v), (None, v[..., :2])):
                with torch.no_grad():
                    y = hsa_graph.hsa(q, k, vals, tree, include_self=include_self, pos=p)
                torch.testing.assert_close(
                    y, dense_hsa(parent, q, k, vals, include_self=include_self, pos=p),
                    **TOL)


def _ragged_leaf_families(num_families: int, seed: int) -> list:
    """A root over ``num_families`` families of 2..30 leaves, the leaves shuffled: the
    families are buckets of leaves read by index (``leaf_gather``), with padding."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 31, (num_families,), generator=g)
    owner = torch.repeat_interleave(torch.arange(num_families), sizes)
    owner = owner[torch.randperm(owner.numel(), generator=g)]
    return [-1] + [0] * num_families + (1 + owner).tolist()


# a mixed root family, padded leaf families in one leaf_gather bucket, two lonely leaves
# (an only child, and a tree that is one leaf) and a flat tree
LEAF_GATHER_SMALL = [-1, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 1, 2, 2, 3, -1, -1, 18, 18, 18]


@pytest.mark.parametrize("chunk_bytes", [None, 1])
@pytest.mark.parametrize("with_pos", [False, True])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dv", [3, 2, 5])
@pytest.mark.parametrize("parent", [LEAF_GATHER_SMALL, _ragged_leaf_families(80, 0)],
                         ids=["small", "ragged"])
def test_leaf_gather_buckets_match_reference(parent, dv, include_self, with_pos,
                                             chunk_bytes, monkeypatch):
    """Where autograd records, the buckets of leaves read by index run as one node in
    chunks of families (one family per chunk with ``chunk_bytes = 1``), which also
    gives the subtree means their leaf sums and adds their gradients in place: output
    and gradients against the dense reference, values narrower and wider than the keys
    (no fused sums for the narrower), with positions (no fused sums), and inputs of
    which only some require gradients."""
    from hsa_graph import structure
    if chunk_bytes is not None:
        monkeypatch.setattr(structure, "_CHUNK_BYTES", chunk_bytes)
    tree, t = make_tree(parent), Tree(parent)
    gathered = [b for b in tree.structure.buckets if b.leaf_gather is not None]
    assert gathered and (len(gathered) >= 2 or parent is LEAF_GATHER_SMALL)
    q, k, v, pos = random_inputs(t.num_leaves, t.num_nodes, 2, 3, dv, seed=11,
                                 pos_dim=2 if with_pos else 0)
    w = torch.randn(t.num_leaves, 2, dv, generator=torch.Generator().manual_seed(3), dtype=DT)
    y_ref = None
    for needs in ((True, True, True), (False, False, True), (True, False, False)):
        inputs = [x.clone().requires_grad_(need) for x, need in zip((q, k, v), needs)]
        y = hsa_graph.hsa(*inputs, tree, include_self=include_self, pos=pos)
        ref_inputs = [x.clone().requires_grad_(need) for x, need in zip((q, k, v), needs)]
        y_ref = dense_hsa(parent, *ref_inputs, include_self=include_self, pos=pos)
        torch.testing.assert_close(y, y_ref, **TOL)
        wanted = [x for x, need in zip(inputs, needs) if need]
        ref_wanted = [x for x, need in zip(ref_inputs, needs) if need]
        for a, b in zip(_grads((w * y).sum(), wanted), _grads((w * y_ref).sum(), ref_wanted)):
            torch.testing.assert_close(a, b, **TOL)


def test_leaf_gather_buckets_double_backward():
    tree, t = make_tree(LEAF_GATHER_SMALL), Tree(LEAF_GATHER_SMALL)
    inputs = [x.requires_grad_(True)
              for x in random_inputs(t.num_leaves, t.num_nodes, 2, 3, 3, seed=12)[:3]]
    for include_self in (True, False):
        assert torch.autograd.gradgradcheck(
            lambda q, k, v, s=include_self: hsa_graph.hsa(q, k, v, tree, include_self=s),
            inputs)


def test_leaf_gather_buckets_share_one_chunk_scratch(monkeypatch):
    """The chunks of every bucket of leaves read by index go through one scratch per
    pass (new_leaf_chunk_scratch), not one per bucket: a scratch freed after each bucket
    comes back as fresh pages for the next (the ragged workload made 316,000 page faults
    per forward with one per bucket, 180,000-210,000 with one per call)."""
    from hsa_graph.structure import TreeStructure
    made, seen = [], []
    new_scratch, gather = (TreeStructure.new_leaf_chunk_scratch,
                           TreeStructure.gather_leaf_chunks)

    def counting_scratch(self, leaf_values):
        made.append(new_scratch(self, leaf_values))
        return made[-1]

    def checked_gather(self, bucket, leaf_values, scratch=None):
        seen.append(scratch)
        return gather(self, bucket, leaf_values, scratch)

    monkeypatch.setattr(TreeStructure, "new_leaf_chunk_scratch", counting_scratch)
    monkeypatch.setattr(TreeStructure, "gather_leaf_chunks", checked_gather)
    tree = make_tree(_ragged_leaf_families(400, 2))
    buckets = sum(b.leaf_gather is not None for b in tree.structure.buckets)
    assert buckets >= 5
    n = tree.structure.num_leaves
    q, k, v = (torch.randn(n, 2, 8, dtype=DT) for _ in range(3))
    with torch.no_grad():
        hsa_graph.hsa(q, k, v, tree)
    assert len(made) == 1 and len(seen) == buckets
    assert all(s is made[0] for s in seen)
    for t in (q, k, v):
        t.requires_grad_()
    hsa_graph.hsa(q, k, v, tree).square().sum().backward()   # forward, then backward
    assert len(made) == 3 and len(seen) == 3 * buckets
    assert all(s is made[1] for s in seen[buckets:2 * buckets])
    assert all(s is made[2] for s in seen[2 * buckets:])


def test_leaf_gather_backward_forms_one_full_size_gradient_per_input(monkeypatch):
    """The recorded ragged path allocates each input's gradient once: no shared gather
    of the leaves, no concatenation of the buckets' gradients, no full-size gather of the
    means' gradients. torch.profiler's memory events inside hsa's backward nodes (the
    loss's own ``MulBackward0`` left out), with chunks far smaller than ``q`` as on large
    trees: at most one allocation of the size of ``q`` or more per input, plus one for
    the gradient of the output's rows before they are put in leaf order."""
    from torch.profiler import ProfilerActivity, profile

    from hsa_graph import structure
    monkeypatch.setattr(structure, "_CHUNK_BYTES", 1 << 16)
    parent = _ragged_leaf_families(80, 1)
    tree = make_tree(parent)
    n = Tree(parent).num_leaves
    q, k, v = (torch.randn(n, 4, 16, requires_grad=True) for _ in range(3))
    assert q.numel() * q.element_size() > 4 * structure._CHUNK_BYTES
    y = hsa_graph.hsa(q, k, v, tree)
    loss = (y * torch.randn_like(y)).sum()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    size = q.numel() * q.element_size()

    def in_loss(e) -> bool:
        while e is not None:
            if e.name == "MulBackward0":
                return True
            e = e.cpu_parent
        return False

    big = [e for e in prof.events() if e.cpu_memory_usage >= size and not in_loss(e)
           and not any(c.cpu_memory_usage >= size for c in e.cpu_children)]
    assert 3 <= len(big) <= 4, [(e.name, e.cpu_memory_usage) for e in big]
