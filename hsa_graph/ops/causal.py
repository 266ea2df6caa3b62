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
spine (ancestors) are complete: their means and sibling logits are the full-tree ones,
and so is their :math:`\lambda`, which each depth's family scan (below) yields for the
depth above as its last row, so no separate bottom-up softmax pass runs. Only the spine
is partial: one step per depth, vectorised over all queries, computes for the spine node
:math:`A` with spine child :math:`S` at family position :math:`p`

.. math::
    \eta_i(S) &= \log \textstyle\sum_{B < p} n(B)\, e^{z(S_i, B)}, \qquad
    \eta_i(C) = \mathrm{logaddexp}\big(F(C, p),\ \log n_i(S) + z(C, S_i)\big),\\
    \lambda_i(A) &= \tfrac{1}{n_i(A)}\Big(\textstyle\sum_{C < p} n(C)\,
        \mathrm{logaddexp}(\lambda(C), \eta_i(C)) + n_i(S)\,
        \mathrm{logaddexp}(\lambda_i(S), \eta_i(S))\Big),

where :math:`F(C, p) = \log \sum_{B < p, B \ne C} n(B) e^{z(C, B)}`. The terms of
the complete siblings hold no query but for :math:`z(C, S_i)`:
:math:`\mathrm{logaddexp}(\lambda(C), F(C, p))` is one exclusive log-cumsum-exp per
family over the member logits with :math:`\lambda(C)` on the diagonal (a scan in
order on the CPU, by doubling elsewhere; either reads only :math:`B < p`, even in its
rounding). The step runs on the tiles of
:attr:`TreeStructure.causal_plan <hsa_graph.TreeStructure.causal_plan>`: the queries
under one family, cut into runs of consecutive leaf rows, share that family's members,
so each product is one batched matmul ``[T, D] x [D, b]`` per tile. The logits of the
partial :math:`S_i` are linear in its leaves, so they are running sums of per-leaf
logits ``[T, b]`` within each family (restarted at :math:`S`'s first leaf), never
per-query copies of the members. Work :math:`O(N \cdot \mathrm{depth} \cdot b \cdot D)`
plus :math:`O(M b^2 \log b)` for the family tables. The heads run in chunks whose
``[heads, N, b]`` intermediates are a few MiB; without autograd these are updated in
place, and each chunk's rows of ``q, k, v`` and the subtree means are first copied into
one contiguous head-major table per tensor, which every depth's products and gathers
then read from the cache; with autograd each chunk's rows are one contiguous copy per
tensor, whose backward writes all chunks' gradients into one token-major gradient
(:class:`_HeadChunks`).
:class:`~hsa_graph.ops.cache.HSACache` takes the same step for one new token
(:func:`~hsa_graph.ops.cache.spine_step`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Hashable, List, Optional, Tuple

import torch
from torch import Tensor

from ..structure import CausalTiles, TreeStructure
from .hsa import (
    HSAStatistics,
    _log_ratio,
    _logaddexp,
    _row_dots,
    flat_attention,
)
from .inputs import no_autocast, prepare_attention

__all__ = ["causal_hsa"]

NEG_INF = float("-inf")
_FINITE_NEG = -1e30  # a finite floor for lambda, so that masked terms are products


class _HeadChunks(torch.autograd.Function):
    """Token-major ``[N, H, D]`` -> contiguous head-major chunks ``[h, N, D]`` of
    ``sizes`` heads (every product and its backward then one batched matmul), whose
    backward writes the chunks' gradients into one token-major ``[N, H, D]`` gradient.
    A head-major copy, a split of it and autograd's transposed accumulation would make
    three full-size gradients instead, each a fresh mapping that faults in page by page
    (65,536 leaves, 8 heads, D = 64: 134 MB, about 150 ms each on a 2-core machine)."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int]) -> Tuple[Tensor, ...]:
        ctx.sizes, ctx.shape = sizes, x.shape
        return tuple(part.transpose(0, 1).contiguous() for part in torch.split(x, sizes, 1))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        out, lo = grads[0].new_empty(ctx.shape), 0
        for grad in grads:      # (split's views may not be written under create_graph)
            out.narrow(1, lo, grad.shape[0]).copy_(grad.transpose(0, 1))
            lo += grad.shape[0]
        return out, None


class _TokenMajor(torch.autograd.Function):
    """Head chunks ``[h, N, Dv]`` -> one contiguous ``[N, H, Dv]``, whose backward hands
    each chunk a contiguous head-major gradient: the backward of every tile group's
    ``index_add_`` gathers from it, and a gather from a strided gradient copies the
    whole of it first (once per group); an expanded gradient (the one of ``y.sum()``)
    would also make the batched matmuls' backward loop over matrices."""

    @staticmethod
    def forward(ctx, *chunks: Tensor) -> Tensor:
        ctx.sizes = [c.shape[0] for c in chunks]
        out = chunks[0].new_empty((chunks[0].shape[1], sum(ctx.sizes), chunks[0].shape[2]))
        for part, chunk in zip(torch.split(out, ctx.sizes, 1), chunks):
            part.copy_(chunk.transpose(0, 1))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[Tensor, ...]:
        return tuple(part.transpose(0, 1).contiguous()
                     for part in torch.split(grad, ctx.sizes, 1))


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on the inputs of :func:`causal_hsa` that refuses ``create_graph=True``:
    the backward of the family tables' scan (:class:`_LogCumSumExp`) updates buffers
    in place and is first-order only, so a double backward would be silently wrong
    rather than fail."""

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


def _update(x: Tensor, recording: bool, name: str, *args, **kwargs) -> Tensor:
    """``x.name(*args)``, in place (``name_``) unless autograd records: without autograd
    every full-size intermediate is reused instead of allocated anew (a fresh buffer of
    32 MiB or more is a fresh mapping whose pages fault in on first touch); with it,
    an in-place op on a view would make the backward clone the whole base."""
    return getattr(x, name)(*args, **kwargs) if recording else getattr(x, name + "_")(
        *args, **kwargs)


def _softmax(row: Tensor, recording: bool, dim: int = -1) -> Tuple[Tensor, Tensor]:
    """Log-normaliser (``dim`` reduced) and softmax weights over ``dim``; without
    autograd in place on ``row`` (which becomes the weights)."""
    if recording:
        return torch.logsumexp(row, dim), torch.softmax(row, dim)
    top = row.amax(dim, keepdim=True)
    weights = row.sub_(top).exp_()
    total = weights.sum(dim, keepdim=True)
    return (top + total.log()).squeeze(dim), weights.div_(total)


def _logcumsumexp(z: Tensor, recording: bool) -> Tensor:
    r"""Inclusive log-cumsum-exp over dim ``-2``, in which entry ``p`` reads entries
    ``<= p`` only, even in its rounding (a max shift over the whole axis would let later
    leaves change earlier outputs in the last bit), and ``-inf`` entries stay exact;
    ``z`` is never written. On the CPU :func:`_logcumsumexp_in_order`, elsewhere
    :func:`_logcumsumexp_doubling`; with autograd, :class:`_LogCumSumExp` (its backward
    is a scan as well)."""
    if recording:
        return _LogCumSumExp.apply(z)
    if z.device.type == "cpu":
        return _logcumsumexp_in_order(z)
    return _logcumsumexp_doubling(z)


def _logcumsumexp_in_order(z: Tensor) -> Tensor:
    r""":func:`_logcumsumexp` position after position,
    :math:`o_p = \mathrm{logaddexp}(o_{p-1}, z_p)`, on a copy whose scan axis comes
    first (each step one contiguous slice), returned as a view in ``z``'s layout: ``b``
    small kernels and one log-add-exp per entry. torch's CPU log-add-exp costs 2-4 ns
    per entry, which the doubling pays :math:`\lceil \log_2 b \rceil` times (families
    of 16 and 256, 2 threads: 8.6 -> 3.3 ms for ``[1, 4096, 16, 16]``, 75 -> 28 ms for
    ``[1, 64, 256, 256]``)."""
    out = z.movedim(-2, 0).clone(memory_format=torch.contiguous_format)
    for p in range(1, out.shape[0]):
        torch.logaddexp(out[p - 1], out[p], out=out[p])
    return out.movedim(0, -2)


def _logcumsumexp_doubling(z: Tensor) -> Tensor:
    r""":func:`_logcumsumexp` by doubling (Hillis-Steele), as
    :math:`\lceil \log_2 b \rceil` log-add-exps of shifted slices over dim ``-2``
    (each slice whole contiguous rows): on an accelerator, where a kernel per position
    would cost more in launches than these passes do in work."""
    b, step = z.shape[-2], 1
    out, spare = z, None
    while step < b:
        target = torch.empty_like(z) if spare is None or spare is z else spare
        target[..., :step, :] = out[..., :step, :]
        torch.logaddexp(out[..., step:, :], out[..., :-step, :], out=target[..., step:, :])
        out, spare = target, out
        step *= 2
    return out if out is not z else z.clone()


class _LogCumSumExp(torch.autograd.Function):
    r""":func:`_logcumsumexp` with a backward that is a scan too: for
    :math:`o_p = \log\sum_{B \le p} e^{x_B}`,

    .. math::
        \frac{\partial L}{\partial x_B} = e^{x_B - o_B} R_B, \qquad
        R_B = g_B + e^{o_B - o_{B+1}} R_{B+1},

    a reverse linear recurrence whose factors are at most 1 (:math:`o` never falls),
    run by doubling; ``-inf`` entries get zero gradients. (Autograd through the
    forward's slices would zero-fill a full-size gradient for every slice.)"""

    @staticmethod
    def forward(ctx, z: Tensor) -> Tensor:
        out = _logcumsumexp(z, False)
        ctx.save_for_backward(z, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        z, out = ctx.saved_tensors
        b, step = out.shape[-2], 1
        decay = torch.exp(out[..., :-1, :] - out[..., 1:, :]).nan_to_num_(0.0)  # [.., b-1, .]
        run = grad.clone(memory_format=torch.contiguous_format)
        while step < b:
            # R_B += A_B R_{B+s}, A_B *= A_{B+s}: A_B the product of the next s factors
            run[..., :-step, :] += decay[..., :b - step, :] * run[..., step:, :]
            if 2 * step < b:
                decay = decay[..., :b - 2 * step, :] * decay[..., step:b - step, :]
            step *= 2
        return torch.exp(z - out).nan_to_num_(0.0).mul_(run)


def causal_hsa(q: Tensor, k: Tensor, v: Tensor, tree, include_self: bool = True,
               scale: Optional[float] = None, pos: Optional[Tensor] = None, *,
               check_finite: bool = False) -> Tensor:
    r"""Causal HSA: row :math:`i` of HSA (:ref:`def-hsa`) on the prefix tree :math:`T_{\le i}`.

    See the module docstring for the definition, its KL-optimality property and the
    algorithm. Leaves must be in document order (increasing node index) and every
    node's leaves a contiguous range of them (true for the text, window and document
    builders). On forests of flat trees (each a root over its leaves; ``include_self``) this
    is causal softmax attention per tree, computed by ``scaled_dot_product_attention``
    (``is_causal=True`` without ``pos``) over the trees padded to one length.

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
    if x.structure.flat_trees is not None and x.include_self:
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
              pos: Optional[Tensor], heads_first: bool = False) -> Tensor:
    """``lam(i) = s <q_i, k_i> + |eps(i)|^2`` (``-inf`` without self), ``[N, H]`` (from
    ``[N, H, D]`` rows), or ``[H, N]`` from head-major ``[H, N, D]`` tables with
    ``heads_first``."""
    if not include_self:
        return q.new_full(q.shape[:2], NEG_INF)
    own = _row_dots(q, k) * scale
    if pos is not None:
        p = pos.to(q.dtype)[st.node_of_unified[:st.num_leaves]]
        norms = p.pow(2).sum(-1).view(st.num_leaves, -1)                # [N, H or 1]
        own = own + (norms.transpose(0, 1) if heads_first else norms)
    return own


class Buffers:
    """Scratch tensors that a call without autograd reuses from head chunk to head
    chunk, one per key: a fresh buffer above glibc's mmap threshold is a fresh mapping
    whose pages fault in on first touch, which on a 2-core machine costs about as much
    as the gather or product that fills it (ragged tree, 65,536 leaves: 24 gathers of
    96,200 member rows at 12 ms each into fresh buffers, 5 ms into reused ones)."""

    def __init__(self) -> None:
        self._store: Dict[Hashable, Tensor] = {}

    def take(self, key: Hashable, shape: Tuple[int, ...], like: Tensor) -> Tensor:
        """The buffer of ``key``: uninitialised, of ``shape`` and ``like``'s dtype and
        device (the stored one where it fits, else a new one that replaces it). Its
        contents are the caller's until it takes the same key again."""
        buf = self._store.get(key)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or (
                buf.device != like.device):
            buf = self._store[key] = like.new_empty(shape)
        return buf


@dataclass
class NodeTables:
    r"""Head-major per-node quantities of the full tree that the spine steps read, for
    one chunk of heads (:func:`_node_tables`).

    Without autograd the leaf rows are the caller's token-major ``q, k, v`` seen as
    ``[h, N, D]`` and the internal rows its subtree means seen likewise, until
    :meth:`head_major` copies both into reused contiguous tables; with autograd they are
    contiguous copies (:class:`_HeadChunks`) from the start. Gathers read the unified
    tables head by head (:func:`_take`).

    Attributes:
        leaf: ``(q, k, v)`` ``[h, N, D]`` / ``[h, N, Dv]``.
        internal: ``(r_q, r_k, r_v)`` subtree means ``[h, I + 1, ...]`` (null row last,
            zero: what padding members read).
        lam: ``[h, M + 1]`` :math:`\lambda` of every node (padding row last).
        size: ``[M + 1]`` :math:`n(A)`; log_size: its log, ``-inf`` on the padding row.
        pos: ``[h or 1, M + 1, P]`` node positions, or ``None``.
        unified: ``(q, k, v)`` rows of every unified node (``M``: padding),
            head-major and contiguous ``[h, M + 1, .]`` (:meth:`head_major`); gathers
            read them.
        buffers: where the gathers write without autograd (:class:`Buffers`); ``None``
            with autograd (fresh tensors).
    """

    leaf: Tuple[Tensor, Tensor, Tensor]
    internal: Tuple[Tensor, Tensor, Tensor]
    lam: Tensor
    size: Tensor
    log_size: Tensor
    pos: Optional[Tensor]
    unified: Optional[Tuple[Tensor, Tensor, Tensor]] = None
    buffers: Optional[Buffers] = None

    def level_inputs(self, level, recording: bool) -> List[GroupInputs]:
        """The leaf rows at the slots and the member tables of every group of
        ``level``. What is not a view of a table (without autograd: a slice of it) is
        gathered for all groups at once and split: with autograd each gather's backward
        zero-fills a gradient of its whole source, once per level instead of once per
        group (so does a slice: only the small internal tables are sliced then)."""
        n = self.leaf[0].shape[1]

        def sliced(rows: Optional[Tuple[int, int]], lo: int, hi: int,
                   small: bool = False) -> bool:
            return rows == (lo, hi) or (rows is not None and lo <= rows[0] and
                                        rows[1] <= hi and (small or not recording))

        groups = level.groups
        slots: List[Optional[Tuple[Tensor, Tensor]]] = [None] * len(groups)
        # a group whose slots are its members reads the member tables only
        gather = [i for i, g in enumerate(groups)
                  if not (g.slots_are_members or sliced(g.rows, 0, n))]
        if gather:
            index = torch.cat([groups[i].slot_row for i in gather])
            sizes = [groups[i].slot_row.numel() for i in gather]
            parts = [self._gather(index, sizes, j, level.depth) for j in range(2)]
            for i, q_part, k_part in zip(gather, *parts):
                slots[i] = (q_part, k_part)
        members: List[Optional[Tuple[Tensor, ...]]] = [None] * len(groups)
        m = n + self.internal[0].shape[1]
        gather = [i for i, g in enumerate(groups) if not (
            sliced(g.member_rows, 0, n) or sliced(g.member_rows, n, m, small=True))]
        if gather:
            index = torch.cat([groups[i].members.flatten() for i in gather])
            sizes = [groups[i].members.numel() for i in gather]
            parts = [self._gather(index, sizes, j, level.depth, members=True)
                     for j in range(3)]
            for i, *tables in zip(gather, *parts):
                members[i] = tuple(tables)
        out = []
        for g, slot, member in zip(groups, slots, members):
            if slot is None and g.slots_are_members:
                slot = (None, None)
            elif slot is None:
                lo, hi = g.rows
                slot = tuple(t if (lo, hi) == (0, n) else t[:, lo:hi] for t in self.leaf[:2])
            if member is None:
                lo, hi = g.member_rows
                member = tuple((t if (lo, hi) == (0, n) else t[:, lo:hi]) if hi <= n
                               else c[:, lo - n:hi - n]
                               for t, c in zip(self.leaf, self.internal))
            f, b = g.members.shape
            q_slots, k_slots = (None if t is None else t.reshape(
                t.shape[0], g.num_tiles, g.tile, -1) for t in slot)
            out.append(GroupInputs(q_slots=q_slots, k_slots=k_slots, members=tuple(
                t.reshape(t.shape[0], f, b, -1) for t in member)))
        return out

    def _gather(self, index: Tensor, sizes: List[int], which: int, depth: int,
                members: bool = False) -> Tuple[Tensor, ...]:
        """Rows ``index`` (unified ids) of ``q``, ``k`` or ``v`` (``which``) from
        :attr:`unified`, head-major ``[h, K, .]``, split into ``sizes``. Without
        autograd into a buffer of its own per depth and kind: the member values are read
        again by the top-down pass."""
        table = self.unified[which]
        if self.buffers is None:
            return torch.split(_take(table, index), sizes, 1)
        out = self.buffers.take((depth, members, which),
                                (table.shape[0], index.numel(), table.shape[2]), table)
        for head, rows in zip(table, out):
            torch.index_select(head, 0, index, out=rows)
        return torch.split(out, sizes, 1)

    def head_major(self, buffers: Optional[Buffers]) -> NodeTables:
        """These tables with every node's ``q, k, v`` rows in contiguous head-major
        tables ``[h, M + 1, .]`` (:attr:`unified`). Without autograd (``buffers``) the
        leaf and internal rows are copied into tables from ``buffers`` (which the gathers
        then use too), whose slices they become: every depth's products and gathers read
        them, and over the token-major rows, ``H * D`` apart, a product costs about 1.5x
        and a gather 3x or more what it costs over contiguous ones, and a chunk of one
        head (54 MiB at 65,536 leaves, D = 64) stays in the cache from depth to depth.
        With autograd (``None``) the tables are concatenations, and the leaf and
        internal rows stay what they are (a slice's backward would zero-fill a gradient
        of the whole table)."""
        if buffers is None:
            return replace(self, unified=tuple(torch.cat([leaf, internal], 1)
                                               for leaf, internal in zip(self.leaf, self.internal)))
        n = self.leaf[0].shape[1]
        tables = []
        for j, (leaf, internal) in enumerate(zip(self.leaf, self.internal)):
            shape = (leaf.shape[0], n + internal.shape[1], leaf.shape[2])
            table = buffers.take(("unified", j), shape, leaf)
            table[:, :n].copy_(leaf)
            table[:, n:].copy_(internal)
            tables.append(table)
        return replace(self, leaf=tuple(t[:, :n] for t in tables),
                       internal=tuple(t[:, n:] for t in tables),
                       unified=tuple(tables), buffers=buffers)


@dataclass(frozen=True)
class GroupInputs:
    """What a :class:`CausalTiles` group's spine step reads of the inputs: ``q`` and
    ``k`` at its slots ``[H, R, T, D]`` (``None`` where the slots are the members),
    and its members' ``(r_q, r_k, r_v)`` ``[H, F, b, ...]``
    (:meth:`NodeTables.level_inputs`)."""

    q_slots: Optional[Tensor]
    k_slots: Optional[Tensor]
    members: Tuple[Tensor, Tensor, Tensor]


@dataclass(frozen=True)
class SpineStep:
    r"""One depth of the spine recursion for the slots of a :class:`CausalTiles` group:
    :math:`\lambda_i(A)` ``[H, slots]`` (what each query carries up to the next depth),
    :math:`\log\mu_i(S)` ``[H, slots]``, and the softmax of :math:`S_i` over its left
    siblings, ``weights`` ``[H, R, T, b]`` against their ``values`` :math:`r_v`
    ``[H, R, b, Dv]``: :math:`\bar\theta_i(S)` is their product, which the top-down pass
    forms already scaled by the query's share; and ``family_lam`` ``[H, F]``, the
    full-tree :math:`\lambda` of the group's family parents (:func:`_family_lam`)."""

    lam: Tensor
    log_mu: Tensor
    weights: Tensor
    values: Tensor
    family_lam: Tensor


def _node_tables(st: TreeStructure, q: Tensor, k: Tensor, v: Tensor, include_self: bool,
                 scale: float, pos: Optional[Tensor], sizes: List[int], recording: bool,
                 means: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> List[NodeTables]:
    """The :class:`NodeTables` of consecutive chunks of ``sizes`` heads; ``means``: the
    subtree means ``[I + 1, H, .]`` of ``q, k, v`` where the caller has them."""
    size = st.node_size_as(q.dtype)                                  # padding row: 1
    log_size = torch.cat([size[:-1].log(), size.new_full((1,), NEG_INF)])
    node_pos = [None] * len(sizes)
    if pos is not None:
        p = st.to_unified(pos.to(q.dtype))
        p = p.unsqueeze(1) if p.dim() == 2 else p
        p = torch.cat([p, p.new_zeros((1, *p.shape[1:]))]).transpose(0, 1).contiguous()
        node_pos = [p] * len(sizes) if p.shape[0] == 1 else torch.split(p, sizes)
    if recording:
        leaf = [_HeadChunks.apply(t, sizes) for t in (q, k, v)]
        if means is None:
            # each chunk's means from its own copies: their gradient is then
            # chunk-sized and added into the chunk's, not a second full-size one
            per_chunk = [st.subtree_means(*(t.transpose(0, 1) for t in chunk))
                         for chunk in zip(*leaf)]
            internal = [[m.transpose(0, 1).contiguous() for m in chunk_means]
                        for chunk_means in zip(*per_chunk)]
        else:
            internal = [_HeadChunks.apply(t, sizes) for t in means]
        # each chunk's lambda from its own copies: their gradients stay chunk-sized
        leaf_lam = [_leaf_lam(st, lq, lk, include_self, scale, pos, heads_first=True)
                    for lq, lk in zip(leaf[0], leaf[1])]
    else:
        means = st.subtree_means(q, k, v) if means is None else means
        # views: NodeTables.head_major copies each chunk when it runs
        leaf, internal = ([torch.split(t.transpose(0, 1), sizes) for t in tensors]
                          for tensors in ((q, k, v), means))
        leaf_lam = torch.split(_leaf_lam(st, q, k, include_self, scale, pos).transpose(0, 1),
                               sizes)
    out = []
    for i, h in enumerate(sizes):
        # an internal node's lambda comes from its family's scan when its depth runs
        # (:func:`_family_lam`); NaN until then, so that a read before it would show
        internal_lam = q.new_full((h, st.num_internal + 1), float("nan"))
        internal_lam[:, -1] = 0.0                                   # the padding row
        out.append(NodeTables(leaf=tuple(t[i] for t in leaf),
                              internal=tuple(t[i] for t in internal),
                              lam=torch.cat([leaf_lam[i], internal_lam], 1), size=size,
                              log_size=log_size, pos=node_pos[i]))
    return out


def _per_head_bmm(a: Tensor, b: Tensor, recording: bool) -> Tensor:
    """``a @ b`` for ``[H, R, ., .]`` operands of any strides (a head axis of size 1
    broadcasts). Where both merge their two batch axes into one, one batched matmul;
    else one per head, which reads strided rows in place (the token-major leaf rows,
    ``H * D`` apart): ``torch.matmul`` would copy them whole first. Without autograd
    the heads write straight into the result (no stack of per-head copies)."""
    def merges(t: Tensor) -> bool:
        return t.stride(0) == t.shape[1] * t.stride(1) or t.shape[1] == 1
    if a.shape[0] == b.shape[0] and merges(a) and merges(b):
        return torch.matmul(a, b)
    heads = max(a.shape[0], b.shape[0])
    a, b = a.expand(heads, *a.shape[1:]), b.expand(heads, *b.shape[1:])
    if recording:
        return torch.stack([torch.bmm(x, y) for x, y in zip(a, b)])
    out = a.new_empty((heads, a.shape[1], a.shape[2], b.shape[3]))
    for x, y, o in zip(a, b, out):
        torch.bmm(x, y, out=o)
    return out


def _member_logits(mq: Tensor, mk: Tensor, log_n: Tensor, lam_m: Tensor,
                   pos_dots: Optional[Tensor], scale: float, recording: bool) -> Tensor:
    r"""``[H, F, B, C]``: :math:`z(C, B) + \log n(B)` among each family's members
    (:math:`z = s\langle r_q(C), r_k(B)\rangle + \langle\varepsilon(C),
    \varepsilon(B)\rangle`), keys along dim ``-2`` (the scans run over whole rows),
    ``-inf`` on padding keys, and :math:`\lambda(C)` on the diagonal: a scan over
    :math:`B < p` of column :math:`C` then holds :math:`\log(e^{\lambda(C)} +
    \sum_{B < p, B \ne C} n(B) e^{z(C, B)})` wherever :math:`C < p`, and the query
    rows never read the diagonal (their keys are :math:`B < p`)."""
    # in place on the product, which no backward reads
    zt = _per_head_bmm(mk, mq.transpose(-1, -2), recording).mul_(scale).add_(
        log_n[:, :, None])
    if pos_dots is not None:
        zt = zt.add_(pos_dots)                              # symmetric
    if recording:
        eye = torch.eye(zt.shape[-1], dtype=torch.bool, device=zt.device)
        return torch.where(eye, lam_m[..., None, :], zt)
    zt.diagonal(0, -2, -1).copy_(lam_m)
    return zt


def _take(table: Tensor, index: Tensor) -> Tensor:
    """``table.index_select(1, index)`` for ``[heads, rows, ...]`` tables, on the CPU
    head by head along dim 0: there torch's ``index_select`` along dim 1, and the
    ``index_add_`` along dim 1 of its backward, copy element run by element run
    (2 threads, ``[1, 41,940, 30]`` from 41,984 rows: 5.2 ms, its backward 7.0 ms,
    against 1.2 ms for the backward along dim 0)."""
    if table.device.type != "cpu":
        return table.index_select(1, index)
    if table.shape[0] == 1:
        return table.squeeze(0).index_select(0, index).unsqueeze(0)
    return torch.stack([head.index_select(0, index) for head in table.unbind(0)])


def _add_rows(y: Tensor, index: Optional[Tensor], src: Tensor) -> Tensor:
    """``y.index_add_(1, index, src)`` in place (``index`` ``None``: every row, in
    order), on the CPU head by head along dim 0 (see :func:`_take`; ``[1, 65,536, 64]``
    from 41,940 rows: 21 ms along dim 1, 5 ms along dim 0). No autograd
    (:class:`_AddToRows` records it)."""
    if index is None:
        return y.add_(src)
    if y.device.type != "cpu":
        return y.index_add_(1, index, src)
    for head, rows in zip(y, src):
        head.index_add_(0, index, rows)
    return y


class _AddToRows(torch.autograd.Function):
    """``y`` ``[H, N, Dv]`` plus each part ``[H, S, Dv]`` at its leaf rows ``indices[i]``
    ``[S]`` (``None``: every row, in order), in place, as one autograd node. Recorded op
    by op, each scattered part would be an out-of-place ``index_add``: a fresh copy of
    ``y`` per tile group and head chunk (at 65,536 leaves and D = 64, 16 MiB each, which
    fault in page by page on every call). The backward hands ``y`` its gradient and
    each part the gradient's rows (:func:`_take`)."""

    @staticmethod
    def forward(ctx, y: Tensor, indices: Tuple[Optional[Tensor], ...], *parts: Tensor):
        ctx.indices = indices
        ctx.mark_dirty(y)
        for index, part in zip(indices, parts):
            _add_rows(y, index, part)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad, None, *(grad if index is None else _take(grad, index)
                              for index in ctx.indices))


class _TileView:
    """The layouts of one tile group ``g``: node tables ``[H, M + 1, ...]``, family
    tables ``[H, F, b, ...]``, leaf rows ``[H, N, ...]``, tiles ``[H, R, T, ...]``."""

    def __init__(self, g: CausalTiles) -> None:
        self.g = g
        self.f, self.b, self.t, self.r = g.members.shape[0], g.size, g.tile, g.num_tiles

    def member_table(self, table: Tensor) -> Tensor:     # [H, M + 1, ...] -> [H, F, b, ...]
        out = _take(table, self.g.members.flatten())
        return out.view(table.shape[0], self.f, self.b, *table.shape[2:])

    def member_lam(self, lam: Tensor) -> Tensor:         # [H, M + 1] -> [H, F, b]
        out = _take(lam, self.g.member_lam.flatten())
        return out.view(lam.shape[0], self.f, self.b)

    def per_tile(self, table: Tensor) -> Tensor:         # [H, F, ...] -> [H, R, ...]
        return table if self.r == self.f else _take(table, self.g.tile_family)

    def slots(self, table: Tensor) -> Tensor:            # [H, N, ...] -> [H, R, T, ...]
        g = self.g
        if g.rows == (0, table.shape[1]):
            out = table         # no slice: its backward would zero-fill a whole gradient
        elif g.rows is not None:
            out = table[:, g.rows[0]:g.rows[1]]
        else:
            out = _take(table, g.slot_row)
        return out.reshape(table.shape[0], self.r, self.t, *table.shape[2:])

    def per_slot(self, table: Tensor) -> Tensor:         # [H, F, b, ...] -> [H, R, T, ...]
        rows = table.reshape(table.shape[0], self.f * self.b, *table.shape[3:])
        return _take(rows, self.g.slot_index).view(
            table.shape[0], self.r, self.t, *table.shape[3:])

    def flat(self, x: Tensor) -> Tensor:                 # [H, R, T, ...] -> [H, R * T, ...]
        return x.reshape(x.shape[0], self.r * self.t, *x.shape[3:])


@dataclass(frozen=True)
class SlotTables:
    r"""What a :class:`CausalTiles` group's spine step reads that holds no input (the
    same for every head; built once per call, not per head chunk).

    Attributes:
        row_bias: ``[R, T, b]`` :math:`\log n(B)` on the left siblings :math:`B < p`,
            ``-inf`` on the rest, 0 on rows without any (their softmax is unused, its
            share exactly 0), so that no row is all ``-inf``; ``[b, b]`` (keys along
            dim ``-2``) for a group whose slots are its members.
        weight: ``[R, T, b]`` :math:`n(C)` on the left siblings, 0 elsewhere
            (``[p, C]`` for members).
        has_left: ``[R, T]`` whether :math:`p > 0`.
        count, parent_count: ``[R, T]`` :math:`n_i(S)`, :math:`n_i(A)`.
        member_share: ``[F, b]`` :math:`n(C) / n(A)` of every member (0 on padding):
            the weights of the family's :math:`\lambda(A)` (:func:`_family_lam`).
    """

    row_bias: Tensor
    weight: Tensor
    has_left: Tensor
    count: Tensor
    parent_count: Tensor
    member_share: Tensor


def _slot_tables(g: CausalTiles, nodes: NodeTables, dtype: torch.dtype) -> SlotTables:
    b, r, t, dev = g.size, g.num_tiles, g.tile, g.members.device
    has_left = (g.slot_pos > 0).view(r, t)
    parent_count = g.slot_count_parent.to(dtype).view(r, t)
    share = (nodes.size[g.members] / nodes.size[g.family_parent][:, None]).to(dtype)
    share = share.masked_fill_(g.members == nodes.size.numel() - 1, 0.0)   # padding
    if g.slots_are_members:
        left = torch.ones(b, b, dtype=torch.bool, device=dev).tril(-1)       # [p, C]: C < p
        row_bias = torch.zeros(b, b, dtype=dtype, device=dev).masked_fill_(~left.t(),
                                                                             NEG_INF)
        row_bias[:, 0] = 0.0
        return SlotTables(row_bias=row_bias, weight=left.to(dtype), has_left=has_left,
                          count=parent_count.new_ones(()), parent_count=parent_count,
                          member_share=share)
    view = _TileView(g)
    valid = torch.arange(b, device=dev) < g.slot_pos.view(r, t, 1)          # [R, T, b]
    log_n = view.per_tile(nodes.log_size[g.members][None])[0][:, None, :]
    row_bias = torch.where(valid, log_n, NEG_INF).masked_fill_(~has_left[..., None], 0.0)
    size = view.per_tile(nodes.size[g.members][None])[0][:, None, :]
    return SlotTables(row_bias=row_bias, weight=size * valid.to(dtype), has_left=has_left,
                      count=g.slot_count.to(dtype).view(r, t), parent_count=parent_count,
                      member_share=share)


def _spine_step(g: CausalTiles, inputs: GroupInputs, consts: SlotTables, nodes: NodeTables,
                node_lam: Tensor, lam: Tensor, scale: float, recording: bool) -> SpineStep:
    r"""One depth of the spine recursion for every slot of the tile group ``g`` (see the
    module docstring): for query :math:`i` with spine child :math:`S` at position
    :math:`p` of its family,

    .. math::
        z(S_i, B) &= \tfrac{s}{n_i(S)} \langle \Sigma_q(S_i), r_k(B)\rangle
            + \langle\varepsilon(S), \varepsilon(B)\rangle + \log n(B), \\
        \eta_i(S) &= \mathrm{logsumexp}_{B < p}\, z(S_i, B), \qquad
        \bar\theta_i(S) = \mathrm{softmax}_{B < p}(z(S_i, \cdot))\, r_v, \\
        \lambda_i(A) &= \tfrac{1}{n_i(A)}\Big(\textstyle\sum_{C < p} n(C)\,
            \mathrm{logaddexp}\big(K(C, p),\ z(C, S_i) + \log n_i(S)\big)
            + n_i(S)\,\mathrm{logaddexp}(\lambda_i(S), \eta_i(S))\Big),

    where :math:`\Sigma_q(S_i)` sums ``q`` over the leaves of :math:`S` up to :math:`i`
    and :math:`K(C, p) = \mathrm{logaddexp}(\lambda(C), F(C, p))` with
    :math:`F(C, p) = \log\sum_{B < p, B \ne C} n(B) e^{z(C, B)}` is one table per
    family (it holds no query); and :math:`\log\mu_i(S) = \lambda_i(S) -
    \mathrm{logaddexp}(\lambda_i(S), \eta_i(S))`. All queries of a tile share one
    family, so each product is one batched matmul ``[T, D] x [D, b]`` per tile, never a
    per-query gather of members. Without autograd every ``[H, R, T, b]`` intermediate
    after the products is updated in place.
    """
    b = g.size
    view = _TileView(g)
    mq, mk, mv = inputs.members
    log_n = nodes.log_size[g.members]                                       # [F, b]
    pos_dots = None
    if nodes.pos is not None:
        mp = view.member_table(nodes.pos)
        pos_dots = torch.matmul(mp, mp.transpose(-1, -2))                  # [H', F, b, b]
    # lam(C) floored at a finite -1e30 (the same logaddexp wherever the rest is finite,
    # as on every entry that counts) keeps every term finite, so masks are products
    lam_m = view.member_lam(node_lam).clamp_min(_FINITE_NEG)               # [H, F, C]
    zt = _member_logits(mq, mk, log_n, lam_m, pos_dots, scale, recording)  # [H, F, B, C]
    lam_s = view.slots(lam)                                                 # [H, R, T]
    if g.slots_are_members:
        return _member_step(g, consts, zt, lam_s, mv, recording)
    # K(C, p): the exclusive scan over B < p (lam(C) enters as the diagonal B = C < p)
    scan = _logcumsumexp(zt, recording)                                     # [H, F, p, C]
    family_lam = _family_lam(scan, consts)
    kept = scan[..., :-1, :]                                                # [H, F, p-1, C]
    kept = view.per_slot(torch.cat([kept.new_full((*kept.shape[:-2], 1, b), NEG_INF),
                                    kept], -2))                             # [H, R, T, C]
    count = consts.count
    per_count = (scale / count).unsqueeze(-1)                              # [R, T, 1]
    # <Sigma_q(S_i), r_k(B)> is the sum over the leaves j of S up to i of <q_j, r_k(B)>:
    # running sums of [T, b] logits, not of [T, D] vectors
    row = _spine_sums(g, _per_head_bmm(inputs.q_slots, view.per_tile(mk).transpose(
        -1, -2), recording), recording)
    row = _update(_update(row, recording, "mul", per_count), recording, "add",
                  consts.row_bias)
    col = _spine_sums(g, _per_head_bmm(inputs.k_slots, view.per_tile(mq).transpose(
        -1, -2), recording), recording)
    col = _update(_update(col, recording, "mul", per_count), recording, "add",
                  count.log()[..., None])
    if pos_dots is not None:
        dots = view.per_slot(pos_dots)
        row, col = _update(row, recording, "add", dots), _update(col, recording, "add", dots)
    eta_s, weights = _softmax(row, recording)
    eta_s = eta_s.masked_fill(~consts.has_left, NEG_INF)
    term = _logaddexp(kept, col) if recording else torch.logaddexp(kept, col, out=col)
    total = _update(term, recording, "mul", consts.weight).sum(-1)        # [H, R, T]
    total_s = _logaddexp(lam_s, eta_s)
    lam_a = (total + count * total_s) / consts.parent_count
    return SpineStep(lam=view.flat(lam_a), log_mu=view.flat(_log_ratio(lam_s, total_s)),
                     weights=weights, values=view.per_tile(mv), family_lam=family_lam)


def _member_step(g: CausalTiles, consts: SlotTables, zt: Tensor, lam_s: Tensor, mv: Tensor,
                 recording: bool) -> SpineStep:
    r""":func:`_spine_step` where :math:`S_i` is the leaf :math:`i`, member ``p`` of its
    family itself (every tile one family of leaves, its slots its members): ``zt``
    (:func:`_member_logits`) holds both directions, :math:`n_i(S) = 1`, and the term
    of a left sibling :math:`C` is the inclusive scan of column :math:`C` at
    :math:`p`."""
    term = _logcumsumexp(zt, recording)                                    # [H, F, p, C]
    family_lam = _family_lam(term, consts)                 # before term is overwritten
    total = _update(term, recording, "mul", consts.weight).sum(-1)        # [H, F, p]
    # the query's own row, keys B < p along dim -2; softmax weights [H, F, B, p], read
    # transposed
    eta_s, weights = _softmax(_update(zt, recording, "add", consts.row_bias), recording,
                              dim=-2)
    eta_s = eta_s.masked_fill(~consts.has_left, NEG_INF)
    total_s = _logaddexp(lam_s, eta_s)
    lam_a = (total + total_s) / consts.parent_count
    flat = _TileView(g).flat
    return SpineStep(lam=flat(lam_a), log_mu=flat(_log_ratio(lam_s, total_s)),
                     weights=weights.transpose(-1, -2), values=mv, family_lam=family_lam)


def _family_lam(scan: Tensor, consts: SlotTables) -> Tensor:
    r""":math:`\lambda(A) = \sum_C \frac{n(C)}{n(A)} \mathrm{logaddexp}(\lambda(C),
    \eta(C))` of each family's parent ``[H, F]``, from the last row of the inclusive
    member scan ``[H, F, b, C]`` (all keys: the full-tree log-normaliser of column
    :math:`C`). Its terms are finite (:math:`\lambda(C)` floored), so an
    :math:`\lambda(A)` that is :math:`-\infty` comes out a large negative number, which
    only ever enters the floored diagonal of the next depth's scan."""
    return torch.linalg.vecdot(scan[..., -1, :], consts.member_share)


def _spine_sums(g: CausalTiles, x: Tensor, recording: bool) -> Tensor:
    """Per-leaf values ``[H, R, T, b]`` in slot layout -> their sums over the leaves of
    each slot's spine child :math:`S` up to the slot: prefix sums over each run of
    :attr:`~hsa_graph.structure.CausalTiles.slot_run` slots where the spine children
    are such aligned runs (balanced trees), else family prefix sums minus the one just
    before :math:`S`'s first leaf."""
    h, r, t, b = x.shape
    if g.slot_run is not None:
        runs = x.view(h, r * t // g.slot_run, g.slot_run, b)
        return _prefix_sums(runs, None, recording).view(h, r, t, b)
    one_tile_per_family = g.num_tiles == g.members.shape[0]
    run = _prefix_sums(x, None if one_tile_per_family else g.tile_first, recording)
    flat = run.view(h, r * t, b)
    before = _take(flat, g.slot_before)
    has_before = g.slot_has_before.to(x.dtype).view(1, -1, 1)
    return _update(flat, recording, "addcmul", before, has_before, value=-1.0).view(
        h, r, t, b)


_SCAN_BLOCK = 64


def _scan_block(t: int) -> int:
    """Rows per cumulative-sum block of a ``t``-row tile: the largest divisor of ``t``
    from 8 to 64 where ``t > 64`` has one, else ``t``."""
    if t <= _SCAN_BLOCK:
        return t
    return next((c for c in range(_SCAN_BLOCK, 7, -1) if t % c == 0), t)


def _prefix_sums(x: Tensor, tile_first: Optional[Tensor], recording: bool) -> Tensor:
    """``[H, R, T, X]`` per-row values of ``R`` tiles -> their sums over each family's
    rows up to every row (in place on ``x`` without autograd); ``tile_first`` ``[R]``:
    the first tile of each tile's family (``None``: every tile a family of its own).

    A cumulative sum inside blocks of 8 to 64 rows (``torch.cumsum`` over a long middle
    axis is several times slower on CPU than over short blocks), plus one carry per
    block: the totals of the family's earlier blocks, accumulated in float64 and
    shifted rather than subtracted, so a slot's sum reads earlier rows only, even in its
    rounding. Padding slots trail the real ones and never enter a real slot's sum."""
    h, r, t, d = x.shape
    block = _scan_block(t)
    blocks = t // block
    run = _update(x.view(h, r, blocks, block, d), recording, "cumsum", 3)
    if blocks == 1 and tile_first is None:
        return run.view(h, r, t, d)
    total = run[:, :, :, -1].reshape(h, r * blocks, d).to(torch.float64)
    before = torch.cat([total.new_zeros(h, 1, d), torch.cumsum(total, 1)[:, :-1]], 1)
    first = torch.arange(r, device=x.device) if tile_first is None else tile_first
    start = (first * blocks).repeat_interleave(blocks)                 # family's first block
    carry = (before - _take(before, start)).to(x.dtype)
    return _update(run, recording, "add", carry.view(h, r, blocks, 1, d)).view(h, r, t, d)


def _rows_of(level, parts: List[Tensor], old: Optional[Tensor]) -> Tensor:
    """Slot results of a level's groups ``[H, slots, ...]`` -> leaf rows ``[H, N, ...]``;
    rows without a slot keep ``old`` (or get zeros)."""
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    if level.row_slot is not None:
        out = _take(out, level.row_slot)
    if level.active is None:
        return out
    mask = level.active.view(1, -1, *([1] * (out.dim() - 2)))
    return torch.where(mask, out, 0.0 if old is None else old)


def _attention_rows(g: CausalTiles, weights: Tensor, values: Tensor, num_leaves: int,
                    recording: bool) -> Tuple[Optional[Tensor], Tensor]:
    """The share-scaled ``weights @ values`` of ``g``'s slots ``[H, slots, Dv]`` (padding
    slots carry zero weights) and the leaf rows they add to (``None``: every row, in
    order)."""
    theta = _per_head_bmm(weights, values, recording)                      # [H, R, T, Dv]
    theta = theta.view(theta.shape[0], -1, theta.shape[-1])
    return (None if g.rows == (0, num_leaves) else g.slot_row), theta


def _add_attention(y: Tensor, g: CausalTiles, weights: Tensor, values: Tensor) -> Tensor:
    """``y`` ``[H, N, Dv]`` plus :func:`_attention_rows` in place (no autograd); where
    the slots are leaf rows in order, the products land in ``y`` directly (no
    ``[H, N, Dv]`` temporary)."""
    if g.rows is not None:
        lo, hi = g.rows
        for head, (w, x) in enumerate(zip(weights, values)):
            y[head, lo:hi].view(g.num_tiles, g.tile, -1).baddbmm_(w, x)
        return y
    return _add_rows(y, *_attention_rows(g, weights, values, y.shape[1], False))


def _causal_hsa(st: TreeStructure, plan, q: Tensor, k: Tensor, v: Tensor,
                include_self: bool, scale: float, pos: Optional[Tensor],
                stats: Optional[HSAStatistics] = None) -> Tensor:
    """Causal HSA on prepared ``[N, H, D]`` inputs; ``stats``: the bottom-up pass of the
    same inputs when the caller has it already (the cache's prefill)."""
    recording = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, pos))
    # heads run in chunks whose [heads, slots, b] intermediates stay small: those are
    # then reused heap memory, not fresh mappings that fault in page by page
    widest = max((sum(g.num_tiles * g.tile * g.size for g in level.groups)
                  for level in plan.levels), default=1)
    h = q.shape[1]
    per_chunk = max(1, _CHUNK_BYTES // (widest * q.element_size()))
    sizes = [min(per_chunk, h - lo) for lo in range(0, h, per_chunk)]
    parts = _node_tables(st, q, k, v, include_self, scale, pos, sizes, recording,
                         None if stats is None else (stats.rq, stats.rk, stats.rv))
    consts = [[_slot_tables(g, parts[0], q.dtype) for g in level.groups]
              for level in plan.levels]
    if recording:
        return _TokenMajor.apply(*(
            _causal_heads(st, plan, consts, part.head_major(None), include_self, scale,
                          recording) for part in parts))
    y = torch.empty_like(v)
    buffers = Buffers()
    for lo, part in zip(range(0, h, per_chunk), parts):
        part = part.head_major(buffers)
        y[:, lo:lo + part.lam.shape[0]] = _causal_heads(
            st, plan, consts, part, include_self, scale, recording).transpose(0, 1)
    return y


#: the bytes of a head chunk's [heads, slots, b] intermediates. 4 MiB: at 65,536 leaves
#: and b = 16 one head per chunk, whose leaf tables' gradients (16 MiB at D = 64) stay
#: under glibc's largest mmap threshold (32 MiB) and so are reused from the heap;
#: with 8 MiB (two heads, 32 MiB tables) each was mapped fresh and faulted in on every
#: backward (bench_causal at depth 4, forward + backward: 3,182 -> 2,713 ms)
_CHUNK_BYTES = 4 << 20


def _causal_heads(st: TreeStructure, plan, consts: List[List[SlotTables]],
                  nodes: NodeTables, include_self: bool, scale: float,
                  recording: bool) -> Tensor:
    """The spine recursion and the top-down pass for the heads of ``nodes``:
    ``[heads, N, Dv]``, head-major (each head's slots of a tile group are then one
    contiguous block, which batched matmuls accumulate into in place)."""
    n = st.num_leaves
    leaf_v, node_lam = nodes.leaf[2], nodes.lam
    lam = node_lam[:, :n]
    per_level = []
    for level, tables in zip(plan.levels, consts):  # deepest first: bottom-up
        steps = [_spine_step(g, inputs, c, nodes, node_lam, lam, scale, recording)
                 for g, inputs, c in zip(level.groups, nodes.level_inputs(level, recording),
                                         tables)]
        # the full-tree lambda of this depth's family parents, which the next depth's
        # members read
        for g, step in zip(level.groups, steps):
            node_lam = _update(node_lam, recording, "index_copy", 1, g.family_parent,
                               step.family_lam)
        lam = _rows_of(level, [s.lam for s in steps], lam)
        per_level.append((_rows_of(level, [s.log_mu for s in steps], None), steps))
    # top-down: y = m(i) v_i + sum over the spine of m(above) (1 - mu) theta_bar, where
    # m(above) multiplies the mu of the levels above (nearer the root)
    log_m_above, log_m = [], None
    for log_mu, _ in reversed(per_level):
        log_m_above.append(log_m)
        log_m = log_mu if log_m is None else log_m + log_mu
    if not include_self:
        y = leaf_v.new_zeros(leaf_v.shape)
    elif log_m is None:
        y = leaf_v.clone(memory_format=torch.contiguous_format)
    else:
        m = log_m.exp().unsqueeze(-1)
        # without autograd one pass into a head-major buffer (the product alone would
        # take leaf_v's token-major strides); with it, leaf_v is head-major already
        y = leaf_v * m if recording else torch.mul(
            leaf_v, m, out=nodes.buffers.take("output", leaf_v.shape, leaf_v))
    recorded: List[Tuple[Optional[Tensor], Tensor]] = []   # with autograd: one node
    for (log_mu, steps), above, level in zip(per_level, reversed(log_m_above), plan.levels):
        share = -torch.expm1(log_mu) if above is None else above.exp() * -torch.expm1(log_mu)
        for g, step in zip(level.groups, steps):
            if g.rows is not None:
                mine = share[:, g.rows[0]:g.rows[1]]
            else:
                mine = _take(share, g.slot_row) * g.slot_is_real.to(share.dtype)
            weights = _update(step.weights, recording, "mul",
                              mine.view(mine.shape[0], g.num_tiles, g.tile, 1))
            if recording:
                recorded.append(_attention_rows(g, weights, step.values, n, True))
            else:
                y = _add_attention(y, g, weights, step.values)
    if recorded:
        indices, parts = zip(*recorded)
        y = _AddToRows.apply(y, indices, *parts)
    return y
