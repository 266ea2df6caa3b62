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
log-cumsum-exp per family. The step runs on the tiles of
:attr:`TreeStructure.causal_plan <hsa_graph.TreeStructure.causal_plan>`: the queries
under one family, cut into runs of consecutive leaf rows, share that family's members,
so each product is one batched matmul ``[T, D] x [D, b]`` per tile. The logits of the
partial :math:`S_i` are linear in its leaves, so they are running sums of per-leaf
logits ``[T, b]`` within each family (restarted at :math:`S`'s first leaf), never
per-query copies of the members. Work :math:`O(N \cdot \mathrm{depth} \cdot b \cdot D)`
plus :math:`O(M b^2)` for the family tables. :class:`~hsa_graph.ops.cache.HSACache`
takes the same step for one new token (:func:`~hsa_graph.ops.cache.spine_step`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..structure import CausalTiles, TreeStructure
from .hsa import HSAStatistics, _log_ratio, _logaddexp, flat_attention, hsa_statistics
from .inputs import no_autocast, prepare_attention

__all__ = ["causal_hsa"]

NEG_INF = float("-inf")
_FINITE_NEG = -1e30  # stands in for -inf inside logcumsumexp, whose backward NaNs on -inf


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
    without one. The mask enters as an additive ``0 / -inf`` bias (boolean
    ``masked_fill`` is several times slower on CPU than an add)."""
    any_valid = valid.any(-1, keepdim=True)
    # rows without a valid entry get a zero bias (a finite logsumexp, no NaN gradient)
    bias = torch.zeros(valid.shape, dtype=x.dtype, device=x.device).masked_fill_(
        ~(valid | ~any_valid), NEG_INF)
    safe = x + bias
    lse = torch.logsumexp(safe, -1, keepdim=True)
    weights = torch.exp(safe - lse) * any_valid.to(x.dtype)
    return lse.squeeze(-1).masked_fill(~any_valid.squeeze(-1), NEG_INF), weights


def causal_hsa(q: Tensor, k: Tensor, v: Tensor, tree, include_self: bool = True,
               scale: Optional[float] = None, pos: Optional[Tensor] = None, *,
               check_finite: bool = False) -> Tensor:
    r"""Causal HSA: row :math:`i` of HSA (:ref:`def-hsa`) on the prefix tree :math:`T_{\le i}`.

    See the module docstring for the definition, its KL-optimality property and the
    algorithm. Leaves must be in document order (increasing node index) and every
    node's leaves a contiguous range of them (true for the text, window and document
    builders). On flat trees (a root over its leaves, equal sizes; ``include_self`` and no
    ``pos``) this is causal softmax attention per tree, computed by
    ``scaled_dot_product_attention(is_causal=True)``.

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
    plan = x.structure.causal_plan      # checks contiguity; built once per structure
    if x.empty:
        return x.empty_result(x.v.shape)
    if x.structure.flat_families is not None and x.include_self:
        # Flat trees: causal HSA is causal softmax attention inside each tree, which
        # PyTorch's fused kernel computes without the tiles.
        with no_autocast(x.device):
            return x.finish(flat_attention(x, causal=True))
    q, k, v = _FirstOrderOnly.apply(x.q, x.k, x.v)
    pos = None if x.pos is None else _FirstOrderOnly.apply(x.pos)[0]
    with no_autocast(x.device):
        y = _causal_hsa(x.structure, plan, q, k, v, x.include_self, x.scale, pos)
    return x.finish(y)


def _leaf_lam(st: TreeStructure, q: Tensor, k: Tensor, include_self: bool, scale: float,
              pos: Optional[Tensor]) -> Tensor:
    """``lam(i) = s <q_i, k_i> + |eps(i)|^2`` (``-inf`` without self), ``[N, H]``."""
    if not include_self:
        return q.new_full(q.shape[:2], NEG_INF)
    own = torch.einsum("nhd,nhd->nh", q, k) * scale  # no [N, H, D] product
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


@dataclass
class NodeTables:
    r"""Head-major per-node quantities of the full tree that the spine steps read.

    Leaf and internal rows are kept apart, each contiguous ``[H, rows, ...]``: a slice
    of either merges its head and tile axes into one batch axis, so batched matmuls
    read it in place. :meth:`members` reads unified node ids (``M``: padding).

    Attributes:
        leaf: ``(q, k, v)`` ``[H, N, D]`` / ``[H, N, Dv]``.
        internal: ``(r_q, r_k, r_v)`` subtree means ``[H, I + 1, ...]`` (null row last,
            zero: what padding members read).
        lam: ``[H, M + 1]`` :math:`\lambda` of every node (padding row last).
        size: ``[M + 1]`` :math:`n(A)`; log_size: its log, ``-inf`` on the padding row.
        pos: ``[H or 1, M + 1, P]`` node positions, or ``None``.
    """

    leaf: Tuple[Tensor, Tensor, Tensor]
    internal: Tuple[Tensor, Tensor, Tensor]
    lam: Tensor
    size: Tensor
    log_size: Tensor
    pos: Optional[Tensor]
    _unified: Optional[Tuple[Tensor, Tensor, Tensor]] = None

    def members(self, which: int, g: CausalTiles) -> Tensor:
        """Table ``which`` (0: q, 1: k, 2: v) of ``g``'s members: ``[H, F, b, ...]``."""
        leaf, internal = self.leaf[which], self.internal[which]
        n = leaf.shape[1]
        f, b = g.members.shape
        if g.member_rows is not None and g.member_rows[1] <= n:
            out = leaf[:, g.member_rows[0]:g.member_rows[1]]
        elif g.member_rows is not None and g.member_rows[0] >= n:
            out = internal[:, g.member_rows[0] - n:g.member_rows[1] - n]
        else:
            if self._unified is None:   # mixed families: one unified table, once per call
                self._unified = tuple(torch.cat([a, c], 1)
                                      for a, c in zip(self.leaf, self.internal))
            out = self._unified[which].index_select(1, g.members.flatten())
        return out.reshape(out.shape[0], f, b, *out.shape[2:])


@dataclass(frozen=True)
class SpineStep:
    r"""One depth of the spine recursion for the slots of a :class:`CausalTiles` group:
    :math:`\lambda_i(A)` ``[H, slots]``, what each query carries up to the next depth,
    and :math:`\log\mu_i(S)` ``[H, slots]`` and :math:`\bar\theta_i(S)`
    ``[H, slots, Dv]`` for the top-down pass."""

    lam: Tensor
    log_mu: Tensor
    theta_bar: Tensor


def _node_tables(st: TreeStructure, stats, q: Tensor, k: Tensor, v: Tensor,
                 include_self: bool, scale: float, pos: Optional[Tensor]) -> NodeTables:
    size = torch.cat([st.node_size.to(q.dtype), q.new_ones(1)])      # padding row: 1
    lam = torch.cat([_leaf_lam(st, q, k, include_self, scale, pos),
                     _internal_lam(st, stats, size)])

    def head_major(t: Tensor) -> Tensor:
        return t.transpose(0, 1).contiguous()

    node_pos = None
    if pos is not None:
        p = st.to_unified(pos.to(q.dtype))
        p = p.unsqueeze(1) if p.dim() == 2 else p
        node_pos = head_major(torch.cat([p, p.new_zeros((1, *p.shape[1:]))]))
    log_size = torch.cat([size[:-1].log(), size.new_full((1,), NEG_INF)])
    return NodeTables(leaf=(head_major(q), head_major(k), head_major(v)),
                      internal=(head_major(stats.rq), head_major(stats.rk),
                                head_major(stats.rv)),
                      lam=head_major(lam), size=size, log_size=log_size, pos=node_pos)


def _family_position_table(t: Tensor) -> Tensor:
    """``[H, F, p, ...]`` per-family, per-position values -> ``[H, F * b, ...]`` rows,
    read per slot with :attr:`CausalTiles.slot_index`."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``[H, R, ., .]`` operands. Slices of the head-major node tables have
    batch axes ``H, R`` that do not merge into one, so ``torch.matmul`` would copy them
    whole; one batched matmul per head reads them in place."""
    def merges(t: Tensor) -> bool:
        return t.stride(0) == t.shape[1] * t.stride(1) or t.shape[1] == 1
    if merges(a) and merges(b):
        return torch.matmul(a, b)
    heads = max(a.shape[0], b.shape[0])
    a, b = a.expand(heads, *a.shape[1:]), b.expand(heads, *b.shape[1:])
    return torch.stack([torch.matmul(x, y) for x, y in zip(a, b)])


def _exclusive_logcumsumexp(z: Tensor) -> Tensor:
    r"""``F[..., C, p] = log sum_{B < p} e^{z[..., C, B]}`` (``-inf`` for an empty sum).
    A scan, so that ``F(C, p)`` reads only ``B < p`` even in its rounding (a row max
    shift would let later leaves change earlier outputs in the last bit)."""
    finite = torch.isfinite(z)
    run = torch.logcumsumexp(z.masked_fill(~finite, _FINITE_NEG), -1)
    run = torch.cat([run.new_full((*run.shape[:-1], 1), _FINITE_NEG), run[..., :-1]], -1)
    return run.masked_fill(run < _FINITE_NEG / 2, NEG_INF)


def _member_logits(mq: Tensor, mk: Tensor, log_n: Tensor, pos_dots: Optional[Tensor],
                   scale: float) -> Tensor:
    r"""``[H, F, b, b]`` :math:`z(C, B) + \log n(B)` among each family's members
    (:math:`z = s\langle r_q(C), r_k(B)\rangle + \langle\varepsilon(C),
    \varepsilon(B)\rangle`), ``-inf`` on the diagonal and on padding keys."""
    # in place on the product, which no backward reads
    z = _matmul(mq, mk.transpose(-1, -2)).mul_(scale).add_(log_n[:, None, :])
    if pos_dots is not None:
        z = z.add_(pos_dots)
    b = z.shape[-1]
    return z.masked_fill_(torch.eye(b, dtype=torch.bool, device=z.device), NEG_INF)


class _TileView:
    """The layouts of one tile group ``g``: node tables ``[H, M + 1, ...]``, family
    tables ``[H, F, b, ...]``, leaf rows ``[H, N, ...]``, tiles ``[H, R, T, ...]``."""

    def __init__(self, g: CausalTiles) -> None:
        self.g = g
        self.f, self.b, self.t, self.r = g.members.shape[0], g.size, g.tile, g.num_tiles

    def member_table(self, table: Tensor) -> Tensor:     # [H, M + 1, ...] -> [H, F, b, ...]
        out = table.index_select(1, self.g.members.flatten())
        return out.view(table.shape[0], self.f, self.b, *table.shape[2:])

    def per_tile(self, table: Tensor) -> Tensor:         # [H, F, ...] -> [H, R, ...]
        return table if self.r == self.f else table.index_select(1, self.g.tile_family)

    def slots(self, table: Tensor) -> Tensor:            # [H, N, ...] -> [H, R, T, ...]
        g = self.g
        out = table[:, g.rows[0]:g.rows[1]] if g.rows is not None else (
            table.index_select(1, g.slot_row))
        return out.reshape(table.shape[0], self.r, self.t, *table.shape[2:])

    def per_slot(self, table: Tensor) -> Tensor:         # [H, F, b, ...] -> [H, R, T, ...]
        rows = table.reshape(table.shape[0], self.f * self.b, *table.shape[3:])
        return rows.index_select(1, self.g.slot_index).view(
            table.shape[0], self.r, self.t, *table.shape[3:])

    def flat(self, x: Tensor) -> Tensor:                 # [H, R, T, ...] -> [H, R * T, ...]
        return x.reshape(x.shape[0], self.r * self.t, *x.shape[3:])


def _spine_step(g: CausalTiles, nodes: NodeTables, lam: Tensor, leaf_q: Tensor,
                leaf_k: Tensor, scale: float) -> SpineStep:
    r"""One depth of the spine recursion for every slot of the tile group ``g`` (see the
    module docstring): for query :math:`i` with spine child :math:`S` at position
    :math:`p` of its family,

    .. math::
        z(S_i, B) &= \tfrac{s}{n_i(S)} \langle \Sigma_q(S_i), r_k(B)\rangle
            + \langle\varepsilon(S), \varepsilon(B)\rangle + \log n(B), \\
        \eta_i(S) &= \mathrm{logsumexp}_{B < p}\, z(S_i, B), \qquad
        \bar\theta_i(S) = \mathrm{softmax}_{B < p}(z(S_i, \cdot))\, r_v, \\
        \eta_i(C) &= \mathrm{logaddexp}\big(F(C, p),\ z(C, S_i) + \log n_i(S)\big),\\
        \lambda_i(A) &= \tfrac{1}{n_i(A)}\Big(\textstyle\sum_{C < p} n(C)\,
            \mathrm{logaddexp}(\lambda(C), \eta_i(C))
            + n_i(S)\,\mathrm{logaddexp}(\lambda_i(S), \eta_i(S))\Big),

    where :math:`\Sigma_q(S_i)` sums ``q`` over the leaves of :math:`S` up to :math:`i`
    and :math:`F(C, p) = \log\sum_{B < p, B \ne C} n(B) e^{z(C, B)}`; and
    :math:`\log\mu_i(S) = \lambda_i(S) - \mathrm{logaddexp}(\lambda_i(S),
    \eta_i(S))`. All queries of a tile share one family, so each product is one
    batched matmul ``[T, D] x [D, b]`` per tile, never a per-query gather of members.
    """
    b, r, t = g.size, g.num_tiles, g.tile
    view = _TileView(g)
    member_table, per_tile, slots, per_slot, flat = (
        view.member_table, view.per_tile, view.slots, view.per_slot, view.flat)
    mq, mk, mv = nodes.members(0, g), nodes.members(1, g), nodes.members(2, g)
    log_n, size_m = nodes.log_size[g.members], nodes.size[g.members]        # [F, b]
    pos_dots = None
    if nodes.pos is not None:
        mp = member_table(nodes.pos)
        pos_dots = torch.matmul(mp, mp.transpose(-1, -2))                  # [H', F, b, b]
    z = _member_logits(mq, mk, log_n, pos_dots, scale)
    fixed = _exclusive_logcumsumexp(z).transpose(-1, -2)                    # [H, F, p, C]
    valid = torch.arange(b, device=z.device) < g.slot_pos.view(r, t, 1)    # [R, T, b]
    lam_s = slots(lam)
    if g.slots_are_members:
        # S_i is the leaf i = member p itself: z already holds both directions
        count = None
        row = z
    else:
        fixed = per_slot(fixed)
        count = g.slot_count.to(mq.dtype).view(r, t)
        per_count = (scale / count).unsqueeze(-1)                           # [R, T, 1]
        # <Sigma_q(S_i), r_k(B)> is the sum over the leaves j of S up to i of
        # <q_j, r_k(B)>: running sums of [T, b] logits, not of [T, D] vectors
        # in place on the running sums, which no backward reads
        row = (_spine_sums(g, _matmul(slots(leaf_q), per_tile(mk).transpose(-1, -2)))
               .mul_(per_count).add_(per_tile(log_n[None])[0][:, None, :]))
        col = (_spine_sums(g, _matmul(slots(leaf_k), per_tile(mq).transpose(-1, -2)))
               .mul_(per_count).add_(count.log()[..., None]))
        if pos_dots is not None:
            dots = per_slot(pos_dots)
            row, col = row.add_(dots), col.add_(dots)
    eta_s, weights = _masked_softmax(row, valid)
    theta_bar = _matmul(weights, per_tile(mv))                             # [H, R, T, Dv]
    # entries outside ``valid`` (the diagonal, right siblings, padding) may be -inf
    # pairs: _logaddexp gives them zero gradients, and the where drops them
    # lam(C) floored at a finite -1e30 (the same logaddexp wherever the rest is finite,
    # as on every valid entry) keeps every term finite, so the mask is a product
    lam_m = per_tile(member_table(nodes.lam)).clamp_min(_FINITE_NEG)
    weight = per_tile(size_m[None])[0][:, None, :] * valid.to(z.dtype)       # [R, T, b]
    if g.slots_are_members:
        # in z's own [C, p] layout (contiguous; the [p, C] views are transposes)
        term = _logaddexp(lam_m[..., None], _logaddexp(fixed.transpose(-1, -2), z))
        total = (term * weight.transpose(-1, -2)).sum(-2)
    else:
        term = _logaddexp(lam_m[:, :, None, :], _logaddexp(fixed, col))
        total = (term * weight).sum(-1)
    total_s = _logaddexp(lam_s, eta_s)
    parent_count = g.slot_count_parent.to(mq.dtype).view(r, t)
    lam_a = (total + total_s) / parent_count if count is None else (
        (total + count * total_s) / parent_count)
    return SpineStep(lam=flat(lam_a), log_mu=flat(_log_ratio(lam_s, total_s)),
                     theta_bar=flat(theta_bar))


def _spine_sums(g: CausalTiles, x: Tensor) -> Tensor:
    """Per-leaf values ``[H, R, T, b]`` in slot layout -> their sums over the leaves of
    each slot's spine child :math:`S` up to the slot: family prefix sums minus the one
    just before :math:`S`'s first leaf."""
    run = _tile_prefix_sums(g, x)
    h, r, t, b = run.shape
    flat = run.reshape(h, r * t, b)
    has_before = g.slot_has_before.to(x.dtype).view(1, -1, 1)
    # in place: nothing saves the prefix sums (cumsum's backward needs no values)
    return flat.addcmul_(flat.index_select(1, g.slot_before), has_before,
                         value=-1.0).view(h, r, t, b)


_SCAN_BLOCK = 64


def _tile_prefix_sums(g: CausalTiles, x: Tensor) -> Tensor:
    """``[H, R, T, X]`` per-row values in slot layout -> their sums over each family's
    rows up to every slot.

    A cumulative sum inside blocks of up to 64 rows (``torch.cumsum`` over a long middle
    axis is several times slower on CPU than over short blocks), plus one carry per
    block: the totals of the family's earlier blocks, accumulated in float64 and
    shifted rather than subtracted, so a slot's sum reads earlier rows only, even in its
    rounding. Padding slots trail the real ones and never enter a real slot's sum."""
    h, r, t, d = x.shape
    block = _SCAN_BLOCK if t > _SCAN_BLOCK and t % _SCAN_BLOCK == 0 else t
    blocks = t // block
    run = torch.cumsum(x.view(h, r, blocks, block, d), 3)              # [H, R, T/B, B, X]
    one_tile_per_family = g.num_tiles == g.members.shape[0]
    if blocks == 1 and one_tile_per_family:
        return run.view(h, r, t, d)
    total = run[:, :, :, -1].reshape(h, r * blocks, d).to(torch.float64)
    before = torch.cat([total.new_zeros(h, 1, d), torch.cumsum(total, 1)[:, :-1]], 1)
    first = torch.arange(r, device=x.device) if one_tile_per_family else g.tile_first
    start = (first * blocks).repeat_interleave(blocks)                 # family's first block
    carry = (before - before.index_select(1, start)).to(x.dtype)
    return run.add_(carry.view(h, r, blocks, 1, d)).view(h, r, t, d)


def _rows_of(level, parts: List[Tensor], old: Optional[Tensor]) -> Tensor:
    """Slot results of a level's groups ``[H, slots, ...]`` -> leaf rows ``[H, N, ...]``;
    rows without a slot keep ``old`` (or get zeros)."""
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    if level.row_slot is not None:
        out = out.index_select(1, level.row_slot)
    if level.active is None:
        return out
    mask = level.active.view(1, -1, *([1] * (out.dim() - 2)))
    return torch.where(mask, out, 0.0 if old is None else old)


def _causal_hsa(st: TreeStructure, plan, q: Tensor, k: Tensor, v: Tensor,
                include_self: bool, scale: float, pos: Optional[Tensor],
                stats: Optional[HSAStatistics] = None) -> Tensor:
    """Causal HSA on prepared ``[N, H, D]`` inputs; ``stats``: the bottom-up pass of the
    same inputs when the caller has it already (the cache's prefill)."""
    if stats is None:
        stats = hsa_statistics(st, q, k, include_self, scale, pos, v=v, leaf_mass=False)
    nodes = _node_tables(st, stats, q, k, v, include_self, scale, pos)
    n = st.num_leaves
    (leaf_q, leaf_k, leaf_v), lam = nodes.leaf, nodes.lam[:, :n]
    per_level = []
    for level in plan.levels:                       # deepest first: bottom-up
        steps = [_spine_step(g, nodes, lam, leaf_q, leaf_k, scale) for g in level.groups]
        lam = _rows_of(level, [s.lam for s in steps], lam)
        per_level.append((_rows_of(level, [s.log_mu for s in steps], None),
                          _rows_of(level, [s.theta_bar for s in steps], None)))
    # top-down: y = sum over the spine of m(above) (1 - mu) theta_bar, plus m(i) v_i
    y = None
    log_m = None
    for log_mu, theta_bar in reversed(per_level):
        share = -torch.expm1(log_mu) if log_m is None else log_m.exp() * -torch.expm1(log_mu)
        # in place after the first level: y is this loop's own tensor and addcmul
        # saves only its factors, so autograd allows it, and no level allocates anew
        y = (share.unsqueeze(-1) * theta_bar if y is None
             else y.addcmul_(share.unsqueeze(-1), theta_bar))
        log_m = log_mu if log_m is None else log_m + log_mu
    v_hm = leaf_v
    if include_self:
        if log_m is None:
            y = v_hm if y is None else y + v_hm
        else:
            y = y.addcmul_(log_m.exp().unsqueeze(-1), v_hm)
    elif y is None:
        y = torch.zeros_like(v_hm)
    return y.transpose(0, 1).contiguous()
