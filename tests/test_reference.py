"""Checks of the independent dense reference itself (tests/reference.py).

The reference is what the fast operator is compared against, so it gets its own,
separate evidence: the flat tree equals torch's scaled_dot_product_attention
(SPEC property 1), a tiny tree computed by hand from SPEC section 2, and the KL
optimality of SPEC property 4 checked against a global minimiser found by an
unrelated method (Lagrangian duality).  Nothing here imports hsa_graph.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hsa_trees import insert_unary, random_inputs
from reference import (
    Tree,
    dense_hsa,
    dense_hsa_weights,
    flat_softmax_rows,
    kl_objective,
)

DT = torch.float64


def sdpa(q, k, v, mask=None, scale=None):
    """torch SDPA on [N, H, D] tensors; mask: bool [N, N], True = may attend."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("scale", [None, 0.37])
@pytest.mark.parametrize("n", [2, 3, 17])
def test_reference_flat_tree_is_sdpa(include_self, scale, n):
    q, k, v, _ = random_inputs(n, n + 1, heads=3, d=5, dv=2, seed=n)
    parent = [-1] + [0] * n
    mask = None if include_self else ~torch.eye(n, dtype=torch.bool)
    got = dense_hsa(parent, q, k, v, include_self=include_self, scale=scale)
    torch.testing.assert_close(got, sdpa(q, k, v, mask, scale), rtol=1e-12, atol=1e-12)


def test_reference_flat_forest_is_block_diagonal_sdpa():
    # two flat trees, the root of the second one not first in its id range
    parent = [-1, 0, 0, 0, 5, -1, 5]
    q, k, v, _ = random_inputs(5, 7, heads=2, d=3, dv=4, seed=1)
    tid = torch.tensor([0, 0, 0, 1, 1])
    mask = tid[:, None] == tid[None, :]
    torch.testing.assert_close(dense_hsa(parent, q, k, v), sdpa(q, k, v, mask),
                               rtol=1e-12, atol=1e-12)


def test_reference_matches_hand_computation():
    """root(0) -> [A(1) -> leaves 2, 3;  leaf 4], one head, SPEC section 2 by hand."""
    parent = [-1, 0, 1, 1, 0]
    q, k, _, _ = random_inputs(3, 5, heads=1, d=2, dv=1, seed=7)
    s = 1 / math.sqrt(2)

    def dot(a, b):
        return float((a * b).sum())

    q0, q1, q2 = q[0, 0], q[1, 0], q[2, 0]
    k0, k1, k2 = k[0, 0], k[1, 0], k[2, 0]

    def lae(a, b):
        hi = max(a, b)
        return hi + math.log(math.exp(a - hi) + math.exp(b - hi))

    # family {2, 3} under A
    z23, z32 = s * dot(q0, k1), s * dot(q1, k0)
    eta2, eta3 = z23, z32
    lam2, lam3 = s * dot(q0, k0), s * dot(q1, k1)
    # family {A, 4} under the root
    z_a4 = s * dot((q0 + q1) / 2, k2)
    z_4a = s * dot(q2, (k0 + k1) / 2)
    eta_a, eta4 = z_a4, math.log(2) + z_4a
    lam4 = s * dot(q2, k2)
    lam_a = 0.5 * (lae(lam2, eta2) + lae(lam3, eta3))
    mu_a = 1 / (1 + math.exp(eta_a - lam_a))
    expected = torch.tensor([
        [mu_a * math.exp(lam2) / (math.exp(lam2) + math.exp(z23)),
         mu_a * math.exp(z23) / (math.exp(lam2) + math.exp(z23)),
         1 - mu_a],
        [mu_a * math.exp(z32) / (math.exp(lam3) + math.exp(z32)),
         mu_a * math.exp(lam3) / (math.exp(lam3) + math.exp(z32)),
         1 - mu_a],
        [math.exp(z_4a) / (math.exp(lam4) + math.exp(eta4)),
         math.exp(z_4a) / (math.exp(lam4) + math.exp(eta4)),
         math.exp(lam4) / (math.exp(lam4) + math.exp(eta4))],
    ], dtype=DT)
    got = dense_hsa_weights(parent, q, k)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)

    # include_self=False: leaves 2 and 3 send everything to each other inside A.
    lam_a = 0.5 * (eta2 + eta3)
    mu_a = 1 / (1 + math.exp(eta_a - lam_a))
    expected = torch.tensor([[0, mu_a, 1 - mu_a], [mu_a, 0, 1 - mu_a], [0.5, 0.5, 0]],
                            dtype=DT)
    got = dense_hsa_weights(parent, q, k, include_self=False)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def kl_minimiser_by_duality(parent, q, k, include_self, pos=None):
    """Global minimiser of sum_i KL(theta_i || flat_i) over block-constrained,
    row-stochastic theta, found from the Lagrangian dual (one multiplier per row),
    independently of the HSA recursion.  Single head ([N, 1, D] inputs)."""
    tree = Tree(parent)
    n = tree.num_leaves
    e = flat_logits = torch.log(flat_softmax_rows(parent, q, k, include_self, None, pos)[0])
    # log flat_i(j) = e_ij - log Z_i; the constant log Z_i does not move the minimiser.
    blocks = []  # (rows, cols, block-mean log flat)
    for p in range(tree.num_nodes):
        for a in tree.children[p]:
            for b in tree.children[p]:
                if a != b:
                    rows, cols = tree.leaf_rows[a], tree.leaf_rows[b]
                    blocks.append((rows, cols, e[rows][:, cols].mean()))
    diag = list(range(n)) if include_self else []

    def primal(lmb):
        theta = torch.zeros(n, n, dtype=DT)
        for rows, cols, eb in blocks:  # argmin of the Lagrangian for fixed multipliers
            t = torch.exp(eb - 1 - lmb[rows].mean())
            theta = theta.index_put((torch.tensor(rows)[:, None], torch.tensor(cols)[None, :]),
                                    t.expand(len(rows), len(cols)))
        for i in diag:
            theta = theta.index_put((torch.tensor([i]), torch.tensor([i])),
                                    torch.exp(flat_logits[i, i] - 1 - lmb[i]).reshape(1))
        return theta

    def neg_dual(lmb):
        theta = primal(lmb)
        pos_mass = theta > 0
        ent = torch.where(pos_mass, theta * (torch.where(pos_mass, theta, 1).log()
                                             - torch.where(pos_mass, e, 0)), 0).sum()
        return -(ent + (lmb * (theta.sum(-1) - 1)).sum())

    lmb = torch.zeros(n, dtype=DT, requires_grad=True)
    opt = torch.optim.LBFGS([lmb], lr=1, max_iter=500, tolerance_grad=1e-14,
                            tolerance_change=1e-16, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = neg_dual(lmb)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    return primal(lmb.detach())


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("parent", [
    [-1, 0, 1, 1, 0],
    [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3],
    [-1, 0, 0, 1, 1, 2, 5, 5, 5, 1],  # a unary node (5) above a family
    [-1, 0, 1, 1, 1, 0, 5, 5, 0, 8, 9, 9],
])
def test_reference_is_the_kl_minimiser(parent, include_self):
    n = Tree(parent).num_leaves
    q, k, _, pos = random_inputs(n, len(parent), heads=1, d=3, dv=1, seed=len(parent),
                                 pos_dim=2)
    for p in (None, pos):
        theta = dense_hsa_weights(parent, q, k, include_self=include_self, pos=p)[0]
        best = kl_minimiser_by_duality(parent, q, k, include_self, p)
        # the dual solver is accurate to ~1e-8, which bounds the comparison
        torch.testing.assert_close(best.sum(-1), torch.ones(n, dtype=DT), atol=1e-7,
                                   rtol=0)
        torch.testing.assert_close(theta, best, atol=1e-6, rtol=1e-6)
        flat = flat_softmax_rows(parent, q, k, include_self, None, p)
        assert kl_objective(theta[None], flat) <= kl_objective(best[None], flat) + 1e-6


@pytest.mark.parametrize("include_self", [True, False])
def test_reference_rows_stochastic_and_unary_transparent(include_self):
    parent = [-1, 0, 0, 0, 1, 1, 2, 6, 6, 3, -1, 10, 10, -1]
    tree = Tree(parent)
    q, k, v, pos = random_inputs(tree.num_leaves, len(parent), heads=2, d=3, dv=2,
                                 seed=3, pos_dim=2, pos_per_head=True)
    theta = dense_hsa_weights(parent, q, k, include_self=include_self, pos=pos)
    expected = torch.ones(2, tree.num_leaves, dtype=DT)
    if not include_self:
        expected[:, -1] = 0  # the last tree is a single leaf
    torch.testing.assert_close(theta.sum(-1), expected, rtol=1e-12, atol=1e-12)
    y = dense_hsa(parent, q, k, v, include_self=include_self, pos=pos)
    for u in range(len(parent)):
        up = insert_unary(parent, u)
        pos_u = torch.cat([pos, pos[u:u + 1]])
        torch.testing.assert_close(
            dense_hsa(up, q, k, v, include_self=include_self, pos=pos_u), y,
            rtol=1e-12, atol=1e-12)


def test_reference_gradients_are_finite_without_self():
    # unary node over a single leaf, include_self=False: -inf is structural, no nan
    parent = [-1, 0, 0, 1, 2, 2]
    q, k, v, pos = random_inputs(3, 6, heads=1, d=2, dv=2, seed=0, pos_dim=2)
    for t in (q, k, v, pos):
        t.requires_grad_(True)
    y = dense_hsa(parent, q, k, v, include_self=False, pos=pos)
    grads = torch.autograd.grad(y.square().sum(), (q, k, v, pos))
    assert all(torch.isfinite(g).all() for g in grads)
