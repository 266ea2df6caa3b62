"""Independent dense reference of Hierarchical Self-Attention (HSA).

Written from ``shared/SPEC.md`` section 2 only; it imports nothing from ``hsa_graph``.
It is deliberately simple: Python loops over nodes and families, every quantity of
the SPEC computed directly from its definition, and the full attention matrix theta
formed explicitly.  Use it on small trees, preferably in float64.

Conventions (same as the public contract of SPEC section 4):

* ``parent[u]`` is the parent of node ``u``; ``-1`` marks a root.  Several roots are
  independent trees: theta between leaves of different trees is 0.
* Leaves are the childless nodes, in increasing node index; row ``i`` of ``q``, ``k``
  and ``v`` belongs to the ``i``-th leaf.
* ``q``, ``k``: ``[N, H, D]``; ``v``: ``[N, H, Dv]`` (2-D ``[N, D]`` inputs are accepted
  and treated as one head; the head dimension is then dropped from the result).
* ``pos``: optional per-node embedding eps, ``[M, P]`` (shared by all heads) or
  ``[M, H, P]`` (per head), rows in node index order, ``M = len(parent)``.

"Minus infinity" is structural in HSA (it depends only on the tree and on
``include_self``, never on the data), so it is represented by ``None`` here.  This
keeps every computed tensor finite and makes autograd through the reference exact
(no ``nan`` from ``logaddexp(-inf, -inf)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "Tree",
    "dense_hsa",
    "dense_hsa_weights",
    "flat_softmax_rows",
    "kl_objective",
]


# --------------------------------------------------------------------------------------
# Tree bookkeeping
# --------------------------------------------------------------------------------------


class Tree:
    """Plain-Python view of a parent array: children, leaves, leaves under each node."""

    def __init__(self, parent: Sequence[int] | Tensor):
        if isinstance(parent, Tensor):
            parent = parent.tolist()
        self.parent: list[int] = [int(p) for p in parent]
        m = len(self.parent)
        self.num_nodes = m
        self.children: list[list[int]] = [[] for _ in range(m)]
        for u, p in enumerate(self.parent):
            if p >= 0:
                self.children[p].append(u)  # increasing node index
        self.roots = [u for u in range(m) if self.parent[u] < 0]
        self.leaves = [u for u in range(m) if not self.children[u]]
        self.leaf_pos = {u: i for i, u in enumerate(self.leaves)}  # node -> leaf row
        self.num_leaves = len(self.leaves)

        # A bottom-up order (children before parents), computed without recursion so
        # that deep unary chains are fine.
        depth = [0] * m
        order: list[int] = []
        stack = list(self.roots)
        while stack:
            u = stack.pop()
            order.append(u)
            for c in self.children[u]:
                depth[c] = depth[u] + 1
                stack.append(c)
        if len(order) != m:
            raise ValueError("parent array is not a forest")
        self.depth = depth
        self.top_down = order  # parents before children
        self.bottom_up = order[::-1]  # children before parents

        # l(A): leaf rows under A (sorted), and n(A) = |l(A)|.
        under: list[list[int]] = [[] for _ in range(m)]
        for u in self.bottom_up:
            if not self.children[u]:
                under[u] = [self.leaf_pos[u]]
            else:
                under[u] = sorted(r for c in self.children[u] for r in under[c])
        self.leaf_rows = under
        self.n = [len(x) for x in under]

        # Tree id of every leaf row (which root it hangs from).
        tree_of_node = [0] * m
        for u in self.top_down:
            p = self.parent[u]
            tree_of_node[u] = self.roots.index(u) if p < 0 else tree_of_node[p]
        self.tree_of_leaf = [tree_of_node[u] for u in self.leaves]

    def siblings(self, a: int) -> list[int]:
        p = self.parent[a]
        if p < 0:
            return []  # roots are separate trees, never siblings
        return [b for b in self.children[p] if b != a]


# --------------------------------------------------------------------------------------
# Small helpers on "log values that may be -inf" (None == -inf)
# --------------------------------------------------------------------------------------


def _lae(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """logaddexp with None standing for -inf."""
    if a is None:
        return b
    if b is None:
        return a
    return torch.logaddexp(a, b)


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """Sum of two logs (product of two masses), None standing for -inf."""
    if a is None or b is None:
        return None
    return a + b


def _prepare(parent, q, k, v=None, pos=None, scale=None):
    tree = Tree(parent)
    squeeze = q.dim() == 2
    if squeeze:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
        v = None if v is None else v.unsqueeze(1)
    n_leaves, n_heads, d = q.shape
    if n_leaves != tree.num_leaves or k.shape[0] != n_leaves:
        raise ValueError("q/k row count must equal the number of leaves")
    if k.shape[1] != n_heads or k.shape[2] != d:
        raise ValueError("q and k shapes differ")
    if v is not None and (v.shape[0] != n_leaves or v.shape[1] != n_heads):
        raise ValueError("v shape does not match q")
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if pos is not None:
        if pos.shape[0] != tree.num_nodes:
            raise ValueError("pos must have one row per node")
        if pos.dim() == 2:
            pos = pos.unsqueeze(1).expand(-1, n_heads, -1)
        elif pos.dim() != 3 or pos.shape[1] != n_heads:
            raise ValueError("pos must be [M, P] or [M, H, P]")
    return tree, q, k, v, pos, s, squeeze


# --------------------------------------------------------------------------------------
# The attention matrix, straight from SPEC section 2
# --------------------------------------------------------------------------------------


def _family_logits(tree: Tree, p: int, rq: Tensor, rk: Tensor, pos: Tensor | None,
                   s: float) -> Tensor:
    """z(A, B) for all ordered pairs of children of p, ``[H, b, b]`` (the diagonal, A = B,
    is not a sibling logit and must not be used)."""
    chd = tree.children[p]
    z = s * torch.einsum("ahd,bhd->hab", rq[chd], rk[chd])
    if pos is not None:
        z = z + torch.einsum("ahp,bhp->hab", pos[chd], pos[chd])
    return z


def _hsa_quantities(tree: Tree, q: Tensor, k: Tensor, pos: Tensor | None, s: float,
                    include_self: bool):
    """All per-node quantities of SPEC section 2.

    Returns (z, eta, lam, log_mu, log_m) with
      z[p]                : [H, b, b] sibling logits of the family under node p
      eta[A], lam[A]      : [H] or None (= -inf)
      log_mu[A], log_m[A] : [H] or None (= -inf, i.e. mass 0)
    """
    m = tree.num_nodes
    # rq(A), rk(A): means of q, k over l(A)   -> [M, H, D]
    rq = torch.stack([q[tree.leaf_rows[a]].mean(0) for a in range(m)])
    rk = torch.stack([k[tree.leaf_rows[a]].mean(0) for a in range(m)])
    zeros_h = q.new_zeros(q.shape[1])

    # z(A, B) = s <rq(A), rk(B)> + <eps(A), eps(B)>, one matrix per family.
    z = {p: _family_logits(tree, p, rq, rk, pos, s) for p in range(m) if tree.children[p]}

    # eta(A) = log sum_{B in sib(A)} n(B) exp z(A, B)      (-inf without siblings)
    eta: list[Tensor | None] = [None] * m
    for p, zp in z.items():
        chd = tree.children[p]
        if len(chd) < 2:
            continue
        log_n = torch.tensor([math.log(tree.n[b]) for b in chd], dtype=q.dtype)
        off_diag = ~torch.eye(len(chd), dtype=torch.bool)
        terms = (zp + log_n).masked_fill(~off_diag, float("-inf"))  # [H, a, b]
        lse = torch.logsumexp(terms, dim=-1)  # [H, a]
        for ia, a in enumerate(chd):
            eta[a] = lse[:, ia]

    # lam(leaf i) = s <q_i, k_i> + <eps(i), eps(i)>  if include_self  else -inf
    # lam(A)      = sum_{C in chd(A)} n(C)/n(A) * logaddexp(lam(C), eta(C))
    lam: list[Tensor | None] = [None] * m
    for a in tree.bottom_up:
        if not tree.children[a]:
            if include_self:
                i = tree.leaf_pos[a]
                lam[a] = s * (q[i] * k[i]).sum(-1)
                if pos is not None:
                    lam[a] = lam[a] + (pos[a] * pos[a]).sum(-1)
            continue
        terms = [_lae(lam[c], eta[c]) for c in tree.children[a]]
        if any(t is None for t in terms):
            lam[a] = None  # a weight n(C)/n(A) > 0 times -inf
        else:
            lam[a] = sum(tree.n[c] / tree.n[a] * t for c, t in zip(tree.children[a], terms))

    # log mu(A) = lam(A) - logaddexp(lam(A), eta(A))   (0 when both are -inf)
    log_mu: list[Tensor | None] = [None] * m
    for a in range(m):
        if lam[a] is None and eta[a] is None:
            log_mu[a] = zeros_h
        elif lam[a] is None:
            log_mu[a] = None  # mu = 0
        else:
            log_mu[a] = lam[a] - _lae(lam[a], eta[a])

    # log m(root) = 0,   log m(A) = log m(pa(A)) + log mu(A)
    log_m: list[Tensor | None] = [None] * m
    for a in tree.top_down:
        p = tree.parent[a]
        log_m[a] = zeros_h if p < 0 else _add(log_m[p], log_mu[a])
    return z, eta, lam, log_mu, log_m


def _spread_family(tree: Tree, p: int, block_values: Tensor) -> tuple[Tensor, Tensor]:
    """Expand a per-family ``[H, b, b]`` matrix of block values to the leaves under p.

    Returns (rows, values): ``values[:, x, y]`` is ``block_values[:, A, B]`` for the
    children A, B of p holding leaf rows ``rows[x]`` and ``rows[y]``."""
    chd = tree.children[p]
    rows: list[int] = []
    which: list[int] = []
    for ia, a in enumerate(chd):
        rows += tree.leaf_rows[a]
        which += [ia] * tree.n[a]
    w = torch.tensor(which)
    return torch.tensor(rows), block_values[:, w[:, None], w[None, :]]


def _scatter_blocks(n_heads: int, n_leaves: int, pieces, like: Tensor) -> Tensor:
    """Sum ``[H, r, r]`` pieces placed at (rows x rows) into an ``[H, N, N]`` matrix
    (one out-of-place index_put, so autograd flows).  Pieces never overlap off the
    diagonal."""
    out = like.new_zeros(n_leaves, n_leaves, n_heads)
    if not pieces:
        return out.permute(2, 0, 1)
    r = torch.cat([rows[:, None].expand(-1, len(rows)).reshape(-1) for rows, _ in pieces])
    c = torch.cat([rows[None, :].expand(len(rows), -1).reshape(-1) for rows, _ in pieces])
    vals = torch.cat([values.permute(1, 2, 0).reshape(-1, n_heads) for _, values in pieces])
    out = out.index_put((r, c), vals, accumulate=True)
    return out.permute(2, 0, 1)


def dense_hsa_weights(parent, q: Tensor, k: Tensor, include_self: bool = True,
                      scale: float | None = None, pos: Tensor | None = None) -> Tensor:
    """The HSA attention matrix theta, ``[H, N, N]`` (``[N, N]`` for 2-D ``q``).

    theta[i, j] = m(pa(A)) * exp(z(A, B) - logaddexp(lam(A), eta(A)))
        with A, B the children of LCA(i, j) holding i and j;
    theta[i, i] = m(i) if include_self else 0;  0 across trees.
    """
    tree, q, k, _, pos, s, squeeze = _prepare(parent, q, k, None, pos, scale)
    z, eta, lam, _, log_m = _hsa_quantities(tree, q, k, pos, s, include_self)
    n_leaves, n_heads = q.shape[0], q.shape[1]

    pieces = []
    for p, zp in z.items():
        chd = tree.children[p]
        if len(chd) < 2 or log_m[p] is None:
            continue  # no sibling pairs, or no mass ever reaches p
        # denominators logaddexp(lam(A), eta(A)); eta(A) is finite (A has siblings)
        denom = torch.stack([_lae(lam[a], eta[a]) for a in chd], dim=-1)  # [H, b]
        # A != B only; masked before exp so that a huge z(A, A) gives no inf * 0 = nan
        # in the backward
        zp = zp.masked_fill(torch.eye(len(chd), dtype=torch.bool), float("-inf"))
        w = torch.exp(log_m[p][:, None, None] + zp - denom[:, :, None])  # [H, A, B]
        pieces.append(_spread_family(tree, p, w))

    if include_self:  # theta[i, i] = m(i)
        for leaf in tree.leaves:
            if log_m[leaf] is not None:
                i = torch.tensor([tree.leaf_pos[leaf]])
                pieces.append((i, torch.exp(log_m[leaf])[:, None, None]))
    theta = _scatter_blocks(n_heads, n_leaves, pieces, q)
    return theta[0] if squeeze else theta


def dense_hsa(parent, q: Tensor, k: Tensor, v: Tensor, include_self: bool = True,
              scale: float | None = None, pos: Tensor | None = None) -> Tensor:
    """y = theta @ v per head: ``[N, H, Dv]`` (``[N, Dv]`` for 2-D inputs)."""
    theta = dense_hsa_weights(parent, q, k, include_self=include_self, scale=scale, pos=pos)
    if q.dim() == 2:
        return theta @ v
    return torch.einsum("hij,jhd->ihd", theta, v)


# --------------------------------------------------------------------------------------
# Property 4 (KL optimality): the flat target rows and the objective
# --------------------------------------------------------------------------------------


def flat_softmax_rows(parent, q: Tensor, k: Tensor, include_self: bool = True,
                      scale: float | None = None, pos: Tensor | None = None) -> Tensor:
    """SPEC property 4 target: flat_i(j) proportional to
    exp(s <q_i, k_j> + <eps(A), eps(B)>), A, B the children of LCA(i, j) holding i, j,
    over the leaves of i's own tree; the diagonal is exp(lam(i)) if include_self, else
    0.  A row with no admissible entry (a single-leaf tree without self) is all zero.
    Shape ``[H, N, N]`` (``[N, N]`` for 2-D ``q``)."""
    tree, q, k, _, pos, s, squeeze = _prepare(parent, q, k, None, pos, scale)
    n_leaves, n_heads = q.shape[0], q.shape[1]
    logits = s * torch.einsum("ihd,jhd->hij", q, k)
    if pos is not None:
        pieces = []
        for p in range(tree.num_nodes):
            chd = tree.children[p]
            if len(chd) >= 2:
                dots = torch.einsum("ahp,bhp->hab", pos[chd], pos[chd])
                dots = dots.masked_fill(torch.eye(len(chd), dtype=torch.bool), 0.0)
                pieces.append(_spread_family(tree, p, dots))
        for leaf in tree.leaves:
            pieces.append((torch.tensor([tree.leaf_pos[leaf]]),
                           (pos[leaf] * pos[leaf]).sum(-1)[:, None, None]))
        logits = logits + _scatter_blocks(n_heads, n_leaves, pieces, q)
    tid = torch.tensor(tree.tree_of_leaf)
    allowed = tid[:, None] == tid[None, :]
    if not include_self:
        allowed = allowed & ~torch.eye(n_leaves, dtype=torch.bool)
    logits = logits.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1)  # rows with nothing to attend to
    logits = logits.masked_fill(empty[:, None], 0.0)
    flat = torch.softmax(logits, dim=-1).masked_fill(empty[:, None], 0.0)
    return flat[0] if squeeze else flat


def kl_objective(theta: Tensor, flat: Tensor) -> Tensor:
    """sum_i KL(theta_i || flat_i), summed over heads too; 0 log 0 = 0, and +inf if
    theta puts mass where flat has none."""
    pos_mass = theta > 0
    if bool((pos_mass & (flat <= 0)).any()):
        return torch.tensor(float("inf"), dtype=theta.dtype)
    t = torch.where(pos_mass, theta, torch.ones_like(theta))
    f = torch.where(pos_mass, flat, torch.ones_like(flat))
    return (torch.where(pos_mass, theta * (t.log() - f.log()), torch.zeros_like(theta))).sum()
