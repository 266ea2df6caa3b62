r"""Causal Hierarchical Self-Attention: each leaf attends only to leaves at or before it.

**Definition.** Order the leaves by increasing node index (the row order of ``q``,
``k``, ``v``). For a leaf :math:`i` let :math:`T_{\le i}` be the *prefix tree*: the tree
restricted to the leaves :math:`j \le i`, with every internal node that keeps no leaf
removed, and all counts :math:`n(\cdot)` and means :math:`r_q, r_k, r_v` taken over the
remaining leaves. Causal HSA is

.. math::
    y_i = \big[\mathrm{HSA}(T_{\le i})\, v\big]_i ,

row :math:`i` of HSA (:ref:`def-hsa`) on :math:`T_{\le i}`. By construction :math:`y_i` depends on
leaves :math:`\le i` only; on a flat tree it is causal softmax attention.

Restricting each family's softmax to left siblings (the paper's appendix G.1) is not
enough: the stay-inside mass :math:`\lambda` of an ancestor of :math:`i` averages the
:math:`\eta` of all its children, and those sums range over right siblings too. The
prefix tree fixes this: in :math:`T_{\le i}` the siblings of every ancestor :math:`A`
of :math:`i` are exactly its *left* siblings, and the siblings of a completed left
child :math:`C` of :math:`A` are the other completed children plus the partial spine
child.

**KL optimality.** Row :math:`i` is row :math:`i` of the Theorem-3.2 projection on
:math:`T_{\le i}`: of the block-constrained, row-stochastic matrices on the leaves
:math:`\le i`, the one that minimises :math:`\sum_{j \le i} KL(\theta_j \,\|\,
\mathrm{flat}_j)` (:ref:`def-prop-4` on :math:`T_{\le i}`; its flat row :math:`i` is the causal
softmax row :math:`i`). What is *not* claimed: (a) the matrix of all
causal rows is not the projection of causal softmax onto one block structure, since
row :math:`i` comes from its own prefix problem and two rows of one block of :math:`T`
may differ; (b) row :math:`i` alone is not the single-row projection
:math:`\arg\min KL(\theta_i \,\|\, \mathrm{flat}_i)` over block-constant rows
(that is the anchored rule of :mod:`hsa_graph.ops.cross`): Theorem 3.2 ties the rows
of a block together through :math:`\lambda`, and causal HSA keeps that coupling.

**Computation** (all queries at once, no loop over nodes). Every node's leaves must be
a contiguous range in leaf order (checked). For query :math:`i`, nodes fully left of its
spine (ancestors) are complete: their :math:`\lambda`, means and sibling logits are the
full-tree ones from :func:`~hsa_graph.ops.hsa.hsa_statistics`. Only the spine is
partial: one step per depth, vectorised over all queries, computes for the spine node
:math:`A` with spine child :math:`S` at family position :math:`p`

.. math::
    \eta_i(S) &= \log \textstyle\sum_{B < p} n(B)\, e^{z(S_i, B)}, \qquad
    \eta_i(C) = \mathrm{logaddexp}\big(F(C, p),\ \log n_i(S) + z(C, S_i)\big),\\
    \lambda_i(A) &= \tfrac{1}{n_i(A)}\Big(\textstyle\sum_{C < p} n(C)\,
        \mathrm{logaddexp}(\lambda(C), \eta_i(C)) + n_i(S)\,
        \mathrm{logaddexp}(\lambda_i(S), \eta_i(S))\Big),

where :math:`F(C, p) = \log \sum_{B < p, B \ne C} n(B) e^{z(C, B)}` is one exclusive
log-cumsum-exp per family, and the prefix sums of :math:`S_i` come from the step below.
Work :math:`O(N \cdot \mathrm{depth} \cdot b \cdot D)` plus :math:`O(M b^2)` for the
family tables. :class:`~hsa_graph.ops.cache.HSACache` runs the same step
(:func:`spine_step`) for one new token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..structure import TreeStructure
from .hsa import _log_ratio, _logaddexp, hsa_statistics
from .inputs import no_autocast, prepare_attention

__all__ = ["causal_hsa", "spine_step", "combine_spine", "CausalLayout", "causal_layout",
           "family_members"]

NEG_INF = float("-inf")
_FINITE_NEG = -1e30  # stands in for -inf inside logcumsumexp, whose backward NaNs on -inf


@dataclass(frozen=True)
class CausalLayout:
    """Leaf ranges and leaf-ordered families of a :class:`TreeStructure`.

    Unified node indices as in :class:`TreeStructure`, plus a padding row ``M``.

    Attributes:
        first: ``[M + 1]`` first leaf of each node (``N`` for the padding row).
        paths: ``[N, L]`` unified ancestor of each leaf at each depth, ``-1`` below it.
        members: per bucket ``[F, b]`` unified members of each family sorted by first
            leaf (padding ``M`` last).
        perm: per bucket ``[F, b]`` the bucket slot of each sorted member.
        node_bucket / node_family / node_pos: ``[M + 1]`` bucket, family and sorted
            position of every node in its family (``-1`` bucket: no sibling).
    """

    first: Tensor
    paths: Tensor
    members: List[Tensor]
    perm: List[Tensor]
    node_bucket: Tensor
    node_family: Tensor
    node_pos: Tensor


def _leaf_ranges(st: TreeStructure) -> Tuple[Tensor, Tensor]:
    """First and last leaf of every internal row (levels, not nodes)."""
    n, i, ptr = st.num_leaves, st.num_internal, st.level_ptr
    dev = st.device
    leaves = torch.arange(n, device=dev)
    lo = torch.full((i + 1,), n, dtype=torch.long, device=dev)
    hi = torch.full((i + 1,), -1, dtype=torch.long, device=dev)
    lo = lo.scatter_reduce(0, st.leaf_parent, leaves, "amin")
    hi = hi.scatter_reduce(0, st.leaf_parent, leaves, "amax")
    for d in range(st.max_depth, 0, -1):
        a, b = ptr[d], ptr[d + 1]
        lo = lo.scatter_reduce(0, st.internal_parent[a:b], lo[a:b], "amin")
        hi = hi.scatter_reduce(0, st.internal_parent[a:b], hi[a:b], "amax")
    return lo[:i], hi[:i]


def causal_layout(st: TreeStructure) -> CausalLayout:
    """Build the :class:`CausalLayout` of ``st``; raises ``ValueError`` when the leaves
    of some node are not a contiguous range in leaf order (causal HSA needs it)."""
    n = st.num_leaves
    dev = st.device
    lo, hi = _leaf_ranges(st)
    broken = (hi - lo + 1) != st.internal_size.long()
    if bool(broken.any()):
        row = int(broken.nonzero()[0])
        node = int(st.node_of_unified[n + row])
        raise ValueError(
            f"causal HSA needs the leaves of every node to be a contiguous range in leaf "
            f"order (increasing node index), but node {node} holds "
            f"{int(st.internal_size[row])} leaves spread over leaf rows "
            f"{int(lo[row])}..{int(hi[row])}")
    first = torch.cat([torch.arange(n, device=dev), lo, lo.new_full((1,), n)])
    members, perms, node_bucket, node_family, node_pos = family_members(st, first)
    return CausalLayout(first=first, paths=st.leaf_paths(), members=members, perm=perms,
                        node_bucket=node_bucket, node_family=node_family, node_pos=node_pos)


def family_members(st: TreeStructure, order: Optional[Tensor] = None):
    """Unified members of each bucket's families, ``[F, b]`` per bucket (padding ``M``),
    sorted within a family by ``order`` (``[M + 1]``, e.g. the first leaf) when given,
    else in bucket slot order; the slot permutation; and per node ``[M + 1]`` its bucket
    (``-1``: no sibling), family and position."""
    n, m, dev = st.num_leaves, st.num_nodes, st.device
    node_bucket = torch.full((m + 1,), -1, dtype=torch.long, device=dev)
    node_family = torch.zeros(m + 1, dtype=torch.long, device=dev)
    node_pos = torch.zeros(m + 1, dtype=torch.long, device=dev)
    members, perms = [], []
    for index, bucket in enumerate(st.buckets):
        f, b = bucket.num_families, bucket.size
        slot_member = torch.full((f * b,), m, dtype=torch.long, device=dev)
        slot_member[bucket.leaf_slot] = bucket.leaf_src
        slot_member[bucket.internal_slot] = bucket.internal_src + n
        slot_member = slot_member.view(f, b)
        if order is None:
            perm = torch.arange(b, device=dev).expand(f, b)
        else:
            perm = torch.sort(order[slot_member], dim=1, stable=True).indices
        sorted_member = slot_member.gather(1, perm)
        real = sorted_member < m
        fam = torch.arange(f, device=dev)[:, None].expand(f, b)
        pos = torch.arange(b, device=dev)[None, :].expand(f, b)
        node_bucket[sorted_member[real]] = index
        node_family[sorted_member[real]] = fam[real]
        node_pos[sorted_member[real]] = pos[real]
        members.append(sorted_member)
        perms.append(perm)
    return members, perms, node_bucket, node_family, node_pos


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on the inputs of :func:`causal_hsa` that refuses ``create_graph=True``:
    the prefix log-cumsum-exp of the family tables has a NaN second derivative (its
    ``-inf`` entries stand in as ``-1e30``), so a double backward would be silently
    wrong rather than fail."""

    @staticmethod
    def forward(ctx, *tensors: Tensor):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "causal_hsa does not support gradients of gradients (backward with "
                "create_graph=True, e.g. a gradient penalty); hsa, hsa_weights and "
                "cross_hsa do")
        return grads


def _masked_softmax(x: Tensor, valid: Tensor) -> Tuple[Tensor, Tensor]:
    """Log-normaliser ``[...]`` and softmax weights ``[..., b]`` of the ``valid``
    entries of the last dim; ``-inf`` and zero weights (zero gradients) for rows
    without one."""
    any_valid = valid.any(-1, keepdim=True)
    safe = x.masked_fill(~valid, NEG_INF).masked_fill(~any_valid, 0.0)
    lse = torch.logsumexp(safe, -1, keepdim=True)
    weights = torch.exp(safe - lse).masked_fill(~any_valid, 0.0)
    return lse.squeeze(-1).masked_fill(~any_valid.squeeze(-1), NEG_INF), weights


def spine_step(s_sum: Tuple[Tensor, Tensor, Tensor], s_cnt: Tensor, s_lam: Tensor,
               terms: Optional[dict]):
    r"""One bottom-up step along the spine of a query: from the spine child :math:`S`
    to its parent :math:`A` (see the module docstring).

    Args:
        s_sum: prefix sums of ``q``, ``k``, ``v`` over the leaves of :math:`S` seen so
            far, ``[Q, H, D]`` / ``[Q, H, Dv]``.
        s_cnt: ``[Q]`` their count :math:`n_i(S)` (floating).
        s_lam: ``[Q, H]`` :math:`\lambda_i(S)`.
        terms: ``None`` when :math:`S` has no (left) sibling, else what its completed
            left siblings contribute (from :func:`member_terms` or the family tables):
            ``eta`` :math:`\eta_i(S)` ``[Q, H]``, ``theta_bar`` ``[Q, H, Dv]``,
            ``total`` :math:`\sum_{C<p} n(C)\,\mathrm{logaddexp}(\lambda(C),
            \eta_i(C))` ``[Q, H]``, ``left`` (sums of ``q``, ``k``, ``v`` over them)
            and ``left_cnt`` ``[Q]``.

    Returns:
        ``(a_sum, a_cnt, a_lam, log_mu_s, theta_bar_s)``: prefix sums, count and
        :math:`\lambda_i(A)`; :math:`\log\mu_i(S)` ``[Q, H]`` and the sibling average
        :math:`\bar\theta_i(S)` ``[Q, H, Dv]`` (zero without siblings).
    """
    sq, sk, sv = s_sum
    if terms is None:  # an only child: A is S (unary nodes are transparent)
        return s_sum, s_cnt, s_lam, _log_ratio(s_lam, s_lam), torch.zeros_like(sv)
    cnt = s_cnt.to(sq.dtype)
    total_s = _logaddexp(s_lam, terms["eta"])
    a_cnt = terms["left_cnt"].to(sq.dtype) + cnt
    a_lam = (terms["total"] + cnt[:, None] * total_s) / a_cnt[:, None]
    lq, lk, lv = terms["left"]
    log_mu = _log_ratio(s_lam, total_s)
    return (lq + sq, lk + sk, lv + sv), a_cnt, a_lam, log_mu, terms["theta_bar"]


def member_terms(rq_s: Tensor, rk_s: Tensor, log_cnt: Tensor, mq: Tensor, mk: Tensor,
                 mv: Tensor, logn: Tensor, lam: Tensor, fixed: Tensor, valid: Tensor,
                 scale: float, dots: Optional[Tensor] = None):
    r"""What the completed left siblings :math:`C` contribute to partial spine children
    :math:`S_i`, for families of ``b`` members and ``L`` queries each (``G`` groups):

    * ``rq_s``, ``rk_s`` ``[G, H, L, D]``: prefix means of :math:`S_i`; ``log_cnt``
      ``[G, 1, L]``: :math:`\log n_i(S)`;
    * ``mq``, ``mk`` ``[G, H, b, D]``, ``mv`` ``[G, H, b, Dv]``, ``logn`` ``[G, 1, 1, b]``,
      ``lam`` ``[G, H, 1, b]``: the members;
    * ``fixed`` ``[G, H, L, b]``: :math:`F(C, p_i)`; ``valid`` ``[G, 1, L, b]``: which
      members are left siblings of :math:`S_i`; ``dots`` ``[G, H, L, b]``: optional
      :math:`\langle\varepsilon(S), \varepsilon(C)\rangle`.

    Returns ``eta`` ``[G, H, L]``, ``theta_bar`` ``[G, H, L, Dv]`` and ``total``
    ``[G, H, L]`` (see :func:`spine_step`). Entries outside ``valid`` are masked out of
    every result, so only left siblings (earlier leaves) are ever read.
    """
    row = torch.matmul(rq_s, mk.transpose(-1, -2)) * scale + logn           # z(S_i, B) + log n(B)
    col = torch.matmul(rk_s, mq.transpose(-1, -2)) * scale + log_cnt.unsqueeze(-1)
    if dots is not None:
        row, col = row + dots, col + dots
    valid = valid.expand_as(row)
    eta, weights = _masked_softmax(row, valid)
    theta_bar = torch.matmul(weights, mv)
    # col is finite everywhere (padding included), so plain logaddexp has no NaN
    # gradient; entries outside ``valid`` are dropped by the final where
    term = _logaddexp(lam, _logaddexp(fixed, col))
    total = torch.where(valid, logn.exp() * term, 0.0).sum(-1)
    return eta, theta_bar, total


def combine_spine(log_mu: Tensor, theta_bar: Tensor, v_self: Optional[Tensor],
                  leaf_depth: Tensor) -> Tensor:
    r"""Top-down pass along the spines: ``log_mu`` ``[Q, L, H]`` and ``theta_bar``
    ``[Q, L, H, Dv]`` by depth (index ``e`` for the spine node at depth ``e``; 0 and
    unused depths hold 0), ``v_self`` ``[Q, H, Dv]`` (``None`` without self) ->

    .. math:: y = \sum_e m(\text{depth } e{-}1)\,(1 - \mu_e)\,\bar\theta_e + m(i)\, v_i.
    """
    log_m = torch.cumsum(log_mu, 1)                                        # [Q, L, H]
    above = torch.cat([torch.zeros_like(log_m[:, :1]), log_m[:, :-1]], 1)
    w = above.exp() * -torch.expm1(log_mu)
    y = (w.unsqueeze(-1) * theta_bar).sum(1)
    if v_self is not None:
        m_leaf = log_m.gather(1, leaf_depth.view(-1, 1, 1).expand(-1, 1, log_m.shape[2]))
        y = y + m_leaf.squeeze(1).exp().unsqueeze(-1) * v_self
    return y


def causal_hsa(q: Tensor, k: Tensor, v: Tensor, tree, include_self: bool = True,
               scale: Optional[float] = None, pos: Optional[Tensor] = None, *,
               check_finite: bool = False) -> Tensor:
    r"""Causal HSA: row :math:`i` of HSA (:ref:`def-hsa`) on the prefix tree :math:`T_{\le i}`.

    See the module docstring for the definition, its KL-optimality property and the
    algorithm. Leaves must be in document order (increasing node index) and every
    node's leaves a contiguous range of them (true for the text, window and document
    builders).

    Args:
        q, k: ``[N, H, D]`` (or ``[N, D]``); v: ``[N, H, Dv]`` (or ``[N, Dv]``).
        tree, include_self, scale, pos, check_finite: as in :func:`~hsa_graph.hsa`.

    Returns:
        ``[N, H, Dv]`` (``[N, Dv]`` for two-dimensional inputs); row :math:`i` depends
        only on rows :math:`\le i` of ``q``, ``k``, ``v`` (and on ``pos`` of the nodes
        holding them).

    Raises:
        ValueError: bad shapes (as :func:`~hsa_graph.hsa`), or a node whose leaves are
            not contiguous.

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.ops.causal import causal_hsa
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2])
        >>> q = k = v = torch.randn(4, 2, 8, dtype=torch.float64)
        >>> y = causal_hsa(q, k, v, tree)
        >>> bool(torch.allclose(y[0], v[0]))   # the first leaf sees only itself
        True
        >>> flat = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0, 0])
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention(
        ...     q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        >>> bool(torch.allclose(causal_hsa(q, k, v, flat), sdpa.transpose(0, 1)))
        True
    """
    x = prepare_attention(q, k, v, tree, include_self=include_self, scale=scale, pos=pos,
                          check_finite=check_finite)
    layout = causal_layout(x.structure)
    if x.empty:
        return x.empty_result(x.v.shape)
    q, k, v = _FirstOrderOnly.apply(x.q, x.k, x.v)
    pos = None if x.pos is None else _FirstOrderOnly.apply(x.pos)[0]
    with no_autocast(x.device):
        y = _causal_hsa(x.structure, layout, q, k, v, x.include_self, x.scale, pos)
    return x.finish(y)


def _family_tables(st: TreeStructure, layout: CausalLayout, stats, node: dict):
    """Per bucket, in leaf order: ``F(C, p)`` ``[F, H, b, b]`` (the exclusive
    log-cumsum-exp of each family's sibling logits, column ``p``) and the exclusive
    cumulative sums of ``q``, ``k``, ``v`` sums and counts over family positions."""
    tables = []
    for bucket, perm, mem, logits in zip(st.buckets, layout.perm, layout.members,
                                         stats.bucket_logits):
        f, h, b = logits.shape[0], logits.shape[1], bucket.size
        rows = perm[:, None, :, None].expand(f, h, b, b)
        cols = perm[:, None, None, :].expand(f, h, b, b)
        z = logits.gather(2, rows).gather(3, cols)           # z(C, B) + log n(B), leaf order
        finite = torch.isfinite(z)
        run = torch.logcumsumexp(z.masked_fill(~finite, _FINITE_NEG), -1)
        run = torch.cat([run.new_full((f, h, b, 1), _FINITE_NEG), run[..., :-1]], -1)
        fixed = run.masked_fill(run < _FINITE_NEG / 2, NEG_INF)

        def excl(t: Tensor) -> Tensor:
            c = torch.cumsum(t, 1)
            return torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], 1)

        table = dict(fixed=fixed, sq=excl(node["sq"][mem]), sk=excl(node["sk"][mem]),
                     sv=excl(node["sv"][mem]), cnt=excl(node["cnt"][mem]))
        if bucket.leaf_slot.numel():
            table.update(_complete_terms(z, run, node["lam"][mem], node["logn"][mem],
                                         node["rv"][mem]))
        tables.append(table)
    return tables


def _complete_terms(z: Tensor, run: Tensor, lam: Tensor, logn: Tensor, rv: Tensor) -> dict:
    """For a complete spine child ``S`` at every position ``p`` of its family (leaf
    order), what :func:`spine_step` needs, as ``[F, H, b]`` family-level matrix ops:
    ``eta(S)`` and ``theta_bar(S)`` over ``B < p``, and ``sum_{C < p} n(C)
    logaddexp(lam(C), eta(C))`` where ``eta(C)`` sums over ``B <= p, B != C``."""
    b = z.shape[-1]
    left = torch.ones(b, b, dtype=torch.bool, device=z.device).tril(-1)   # [S, B]: B < S
    eta, weights = _masked_softmax(z, left.expand_as(z))
    theta_bar = torch.matmul(weights, rv.transpose(1, 2))                  # [F, H, b, Dv]
    # inclusive log-cumsum-exp: column p of row C sums B <= p (the diagonal is -inf)
    inclusive = _logaddexp(run, z.masked_fill(~torch.isfinite(z), _FINITE_NEG))
    term = _logaddexp(lam.transpose(1, 2).unsqueeze(-1), inclusive)         # [F, H, C, p]
    before = left.t().expand_as(z)                                          # C < p
    size = logn.exp().to(z.dtype)[:, None, :, None]
    total = torch.where(before, size * term.masked_fill(~before, 0.0), 0.0).sum(-2)
    return dict(eta=eta, theta_bar=theta_bar, total=total)


def _leaf_lam(st: TreeStructure, q: Tensor, k: Tensor, include_self: bool, scale: float,
              pos: Optional[Tensor]) -> Tensor:
    """``lam(i) = s <q_i, k_i> + |eps(i)|^2`` (``-inf`` without self), ``[N, H]``."""
    if not include_self:
        return q.new_full(q.shape[:2], NEG_INF)
    own = (q * k).sum(-1) * scale
    if pos is not None:
        p = pos.to(q.dtype)[st.node_of_unified[:st.num_leaves]]
        own = own + p.pow(2).sum(-1).view(own.shape[0], -1)
    return own


def _internal_lam(st: TreeStructure, stats, size: Tensor) -> Tensor:
    """``lam(A) = sum_C n(C)/n(A) logaddexp(lam(C), eta(C))`` from the totals of the
    children, ``[I + 1, H]``: recovering it as ``log_mu + total`` would round with
    ``eta(A)``, which reads right siblings (and so later leaves)."""
    n, i = st.num_leaves, st.num_internal
    total = torch.cat([stats.total_leaf, stats.total_internal[:-1]])
    parent = torch.cat([st.leaf_parent, st.internal_parent])
    weight = (size[:n + i] / size[n:][parent]).unsqueeze(-1)
    terms = torch.where(total == NEG_INF, total, weight * total.masked_fill(
        total == NEG_INF, 0.0))
    lam = total.new_zeros((i + 1, total.shape[1])).index_add(0, parent, terms)
    return lam


def _grouped_member_terms(members: Tensor, fixed: Tensor, fam: Tensor, p: Tensor,
                          s_sum: Tuple[Tensor, Tensor], s_cnt: Tensor,
                          s_pos: Optional[Tensor], node: dict,
                          node_pos: Optional[Tensor], scale: float) -> dict:
    """:func:`member_terms` for queries whose partial spine children sit in families
    ``fam`` at positions ``p``: queries are padded per family (``[G, L]``) so that each
    family's members are gathered once, not once per query."""
    dev = fam.device
    fams, group = torch.unique(fam, return_inverse=True)
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=fams.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(group)
    rank[order] = torch.arange(group.numel(), device=dev) - starts[group[order]]
    g, width = fams.numel(), int(counts.max())
    slot = group * width + rank

    def pad(t: Tensor) -> Tensor:          # [Q, ...] -> [G, L, ...]
        out = t.new_zeros((g * width, *t.shape[1:]))
        return out.index_copy(0, slot, t).view(g, width, *t.shape[1:])

    def unpad(t: Tensor) -> Tensor:        # [G, H, L, ...] -> [Q, H, ...]
        t = t.transpose(1, 2)
        return t.reshape(g * width, *t.shape[2:])[slot]

    mem = members[fams]                                                    # [G, b]
    b = mem.shape[1]
    cnt = s_cnt.to(s_sum[0].dtype)
    rq_s = pad(s_sum[0] / cnt[:, None, None]).transpose(1, 2)              # [G, H, L, D]
    rk_s = pad(s_sum[1] / cnt[:, None, None]).transpose(1, 2)
    log_cnt = pad(cnt.log()).unsqueeze(1)                                  # [G, 1, L]
    p_pad = pad(p)                                                         # [G, L]; 0 on padding
    valid = (torch.arange(b, device=dev) < p_pad.unsqueeze(-1)).unsqueeze(1)
    h = rq_s.shape[1]
    cols = fixed[fams]                                                     # [G, H, b, b]
    fixed_q = cols.gather(3, p_pad[:, None, None, :].expand(g, h, b, width)).transpose(-1, -2)

    def members_of(name: str) -> Tensor:
        return node[name][mem].transpose(1, 2)                             # [G, H, b, ...]

    dots = None
    if s_pos is not None:
        dots = torch.matmul(pad(s_pos).transpose(1, 2), members_of_pos(node_pos, mem))
    eta, theta_bar, total = member_terms(
        rq_s, rk_s, log_cnt, members_of("rq"), members_of("rk"), members_of("rv"),
        node["logn"][mem][:, None, None, :], node["lam"][mem].transpose(1, 2).unsqueeze(2),
        fixed_q, valid, scale, dots)
    return dict(eta=unpad(eta), theta_bar=unpad(theta_bar), total=unpad(total))


def members_of_pos(node_pos: Tensor, mem: Tensor) -> Tensor:
    """``[G, h, P, b]`` position embeddings of the members ``mem`` ``[G, b]``."""
    return node_pos[mem].permute(0, 2, 3, 1)


def _causal_hsa(st: TreeStructure, layout: CausalLayout, q: Tensor, k: Tensor, v: Tensor,
                include_self: bool, scale: float, pos: Optional[Tensor]) -> Tensor:
    n = st.num_leaves
    stats = hsa_statistics(st, q, k, include_self, scale, pos)
    rv = st.subtree_mean(v)
    # Unified node tables (leaves, internal rows, padding row M = the null row).
    size = torch.cat([q.new_ones(n), st.internal_size.to(q.dtype), q.new_ones(1)])
    lam = torch.cat([_leaf_lam(st, q, k, include_self, scale, pos),
                     _internal_lam(st, stats, size)])
    node = dict(rq=torch.cat([q, stats.rq]), rk=torch.cat([k, stats.rk]),
                rv=torch.cat([v, rv]), lam=lam, cnt=size, logn=size.log())
    node["sq"] = node["rq"] * size[:, None, None]
    node["sk"] = node["rk"] * size[:, None, None]
    node["sv"] = node["rv"] * size[:, None, None]
    node_pos = None
    if pos is not None:
        node_pos = pos.to(q.dtype)[st.node_of_unified]
        node_pos = node_pos.unsqueeze(1) if node_pos.dim() == 2 else node_pos
        node_pos = torch.cat([node_pos, node_pos.new_zeros((1, *node_pos.shape[1:]))])
    tables = _family_tables(st, layout, stats, node)

    paths = layout.paths
    depth_count = paths.shape[1]
    h, dv = v.shape[1], v.shape[2]
    # Spine state per query, starting at the leaf itself.
    s_sum = (q, k, v)
    s_cnt = q.new_ones(n)
    s_lam = lam[:n]
    log_mu_levels = [q.new_zeros(n, h) for _ in range(depth_count)]
    bar_levels = [v.new_zeros(n, h, dv) for _ in range(depth_count)]
    for d in range(depth_count - 2, -1, -1):
        child = paths[:, d + 1]
        active = (child >= 0).nonzero().flatten()
        if active.numel() == 0:
            continue
        # groups: the bucket of the spine child's family, complete (leaf) children apart
        s_all = child[active]
        groups = layout.node_bucket[s_all] * 2 + (s_all >= n).long()
        new_sum = list(s_sum)
        new_cnt, new_lam = s_cnt, s_lam
        lvl_mu, lvl_bar = log_mu_levels[d + 1], bar_levels[d + 1]
        for key in torch.unique(groups).tolist():
            sel = active[groups == key]
            g = key // 2 if key >= 0 else -1
            s_node = child[sel]
            terms = None
            if g >= 0:
                fam, p = layout.node_family[s_node], layout.node_pos[s_node]
                table = tables[g]
                terms = dict(left=(table["sq"][fam, p], table["sk"][fam, p],
                                   table["sv"][fam, p]), left_cnt=table["cnt"][fam, p])
                if key % 2 == 0:  # complete (leaf) children: read the family tables
                    terms.update(eta=table["eta"][fam, :, p],
                                 theta_bar=table["theta_bar"][fam, :, p],
                                 total=table["total"][fam, :, p])
                else:
                    terms.update(_grouped_member_terms(
                        layout.members[g], table["fixed"], fam, p,
                        tuple(t[sel] for t in s_sum[:2]), s_cnt[sel],
                        None if node_pos is None else node_pos[s_node], node, node_pos,
                        scale))
            out = spine_step(tuple(t[sel] for t in s_sum), s_cnt[sel], s_lam[sel], terms)
            a_sum, a_cnt, a_lam, log_mu, bar = out
            new_sum = [t.index_copy(0, sel, a) for t, a in zip(new_sum, a_sum)]
            new_cnt = new_cnt.index_copy(0, sel, a_cnt)
            new_lam = new_lam.index_copy(0, sel, a_lam)
            lvl_mu = lvl_mu.index_copy(0, sel, log_mu)
            lvl_bar = lvl_bar.index_copy(0, sel, bar)
        log_mu_levels[d + 1], bar_levels[d + 1] = lvl_mu, lvl_bar
        s_sum, s_cnt, s_lam = tuple(new_sum), new_cnt, new_lam
    leaf_depth = st.depth[:n]
    return combine_spine(torch.stack(log_mu_levels, 1), torch.stack(bar_levels, 1),
                         v if include_self else None, leaf_depth)
