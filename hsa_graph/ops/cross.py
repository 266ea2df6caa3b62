r"""Hierarchical cross-attention: outside queries attending over a key tree's leaves.

Each query :math:`x_a` (from a flat sequence, another tree, a decoder...) is *anchored*
at a node :math:`\alpha(a)` of the key tree (default: its root) and joins it as a virtual
leaf of the anchor. Its attention row is constrained to the blocks that HSA gives such
a leaf: the children of the anchor and the siblings of every ancestor-or-self of the
anchor below the root,

.. math::
    \mathcal{P}(a) = \mathrm{chd}(\alpha) \,\cup \bigcup_{A \in \mathrm{path}(\alpha)
        \setminus \{\mathrm{root}\}} \mathrm{sib}(A)

(a leaf anchor contributes itself instead of its children), which partition the leaves
of the anchor's tree. The row is the distribution, constant on every block, closest in
KL to the flat softmax row :math:`p_j \propto e^{s\langle x_a, k_j\rangle}`:

.. math::
    \theta_a = \arg\min_{\theta \text{ constant on } \mathcal{P}(a)}
        KL(\theta \,\|\, p), \qquad
    \theta_{aj} = \frac{w_B}{n(B)}\ (j \in B), \quad
    w_B = \frac{n(B)\, e^{s \langle x_a, r_k(B)\rangle}}
        {\sum_{B'} n(B')\, e^{s \langle x_a, r_k(B')\rangle}},

since :math:`KL = \sum_B w_B \log(w_B / n(B)) - \sum_B w_B\,\overline{\log p}_B` is
minimised by :math:`w_B \propto n(B) \exp \overline{\log p}_B` and the mean of
:math:`\log p` over a block is :math:`s\langle x_a, r_k(B)\rangle - \log Z`. The output
is :math:`y_a = \sum_B w_B\, r_v(B)`. Anchored at the root of a flat key tree this is
plain softmax cross-attention; anchoring deeper gives fine attention near the anchor
and coarse attention far from it, as HSA gives a leaf of the tree. Work
:math:`O(N_q \cdot \mathrm{depth} \cdot b \cdot D)` plus the key tree's means.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..structure import TreeStructure
from .hsa import _logaddexp
from .inputs import no_autocast, prepare_attention

__all__ = ["cross_hsa"]

NEG_INF = float("-inf")


def _anchors(anchor: Optional[Tensor], st: TreeStructure, num_queries: int) -> Tensor:
    """Unified anchor of each query."""
    parent_u = st.parent_unified()
    if anchor is None:
        roots = (parent_u < 0).nonzero().flatten()
        if roots.numel() != 1:
            raise ValueError(f"the key tree is a forest of {roots.numel()} trees: pass "
                             "anchor (a node per query, e.g. the root of its tree)")
        return roots.expand(num_queries)
    if not isinstance(anchor, Tensor) or anchor.dtype not in (torch.int64, torch.int32):
        raise TypeError("anchor must be an integer tensor [Nq] of key-tree node indices")
    anchor = anchor.to(st.device).long().flatten()
    if anchor.numel() == 1:
        anchor = anchor.expand(num_queries)
    if anchor.numel() != num_queries:
        raise ValueError(f"anchor has {anchor.numel()} entries for {num_queries} queries")
    bad = (anchor < 0) | (anchor >= st.num_nodes)
    if bool(bad.any()):
        a = int(bad.nonzero()[0])
        raise ValueError(f"anchor[{a}] = {int(anchor[a])} is not a node of the key tree "
                         f"(0..{st.num_nodes - 1})")
    return st.unified_of_node[anchor]


def cross_hsa(q: Tensor, k: Tensor, v: Tensor, tree, anchor: Optional[Tensor] = None,
              include_self: bool = True, scale: Optional[float] = None,
              pos: Optional[Tensor] = None, *, check_finite: bool = False) -> Tensor:
    r"""Anchored hierarchical cross-attention (see the module docstring).

    Args:
        q: queries ``[Nq, H, D]`` or ``[Nq, D]`` (from any source).
        k: keys ``[N, H, D]`` and v: values ``[N, H, Dv]`` of the key tree's leaves, in
            increasing node index (``[N, D]`` / ``[N, Dv]`` with two-dimensional ``q``).
        tree: the key tree (a :class:`~hsa_graph.NestedSignal`, a PyG ``Batch`` of them
            or a :class:`~hsa_graph.TreeStructure`).
        anchor: ``[Nq]`` (or one) node index of the key tree per query; default its
            root (required when the key tree is a forest).
        include_self: a query anchored at a leaf joins it as a copy of that leaf: with
            ``True`` the leaf is one of its blocks (as a leaf of HSA attends to itself),
            with ``False`` it is left out. No effect for internal anchors.
        scale: logit scale, ``1 / sqrt(D)`` by default.
        pos: optional position embeddings of the key tree's nodes, ``[M, P]`` or
            ``[M, H, P]`` in node index order. Block :math:`B` then scores
            :math:`s\langle x_a, r_k(B)\rangle + \langle\varepsilon(C),
            \varepsilon(B)\rangle`, where :math:`C` is the block's sibling on the
            query's side: the ancestor-or-self of the anchor whose siblings :math:`B`
            are, and the anchor itself for its children (the query sits where its
            anchor is, as HSA's own leaves score their siblings from their position).
        check_finite: as in :func:`~hsa_graph.hsa` (rows of ``q`` are named by index).

    Returns:
        ``[Nq, H, Dv]`` (``[Nq, Dv]`` for two-dimensional inputs) in the inputs' dtype.

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.ops.cross import cross_hsa
        >>> keys = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0, 0])   # flat
        >>> q, k, v = torch.randn(3, 1, 4), torch.randn(4, 1, 4), torch.randn(4, 1, 4)
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention(
        ...     q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
        >>> bool(torch.allclose(cross_hsa(q, k, v, keys), sdpa, atol=1e-6))
        True
    """
    x = prepare_attention(q, k, v, tree, include_self=include_self, scale=scale, pos=pos,
                          check_finite=check_finite, queries_are_leaves=False)
    anchors = _anchors(anchor, x.structure, x.q.shape[0])
    if x.empty:
        return x.empty_result((x.q.shape[0], *x.v.shape[1:]))
    with no_autocast(x.device):
        y = _cross(x.structure, x.q, x.k, x.v, anchors, x.scale, x.include_self, x.pos)
    return x.finish(y)


def _cross(st: TreeStructure, q: Tensor, k: Tensor, v: Tensor, anchors: Tensor,
           scale: float, include_self: bool, pos: Optional[Tensor]) -> Tensor:
    n, m = st.num_leaves, st.num_nodes
    index = st.family_index
    members, node_bucket, node_family = index.members, index.node_bucket, index.node_family
    rk = torch.cat([k, st.subtree_mean(k)])                       # [M + 1, H, D]
    rv = torch.cat([v, st.subtree_mean(v)])
    log_size = st.node_size_as(q.dtype).log()                    # padding: 0
    parent_u = torch.cat([st.parent_unified(), anchors.new_full((1,), -1)])
    node_pos = None
    if pos is not None:                                           # [M + 1, H or 1, P]
        p = st.to_unified(pos)
        p = p.unsqueeze(1) if p.dim() == 2 else p
        node_pos = torch.cat([p, p.new_zeros((1, *p.shape[1:]))])
    nq, h, dv = q.shape[0], q.shape[1], v.shape[2]

    # Running log-normaliser and normalised output per query, merged block group by
    # block group (an online softmax over the groups of each query).
    lse = q.new_full((nq, h), NEG_INF)
    out = v.new_zeros(nq, h, dv)

    def merge(side: Tensor, mem: Tensor, valid: Tensor) -> None:
        """Blocks ``mem`` ``[Nq, b]`` of every query (``valid`` ``[Nq, b]`` says which are
        its blocks), scored from the query's side ``side`` ``[Nq]`` (the node whose
        position stands for the query)."""
        nonlocal lse, out
        logits = (torch.einsum("qhd,qbhd->qhb", q, rk[mem]) * scale
                  + log_size[mem][:, None, :])
        if node_pos is not None:
            logits = logits + torch.einsum("qhp,qbhp->qhb", node_pos[side], node_pos[mem])
        logits = logits.masked_fill(~valid[:, None, :], NEG_INF)
        # a query with no valid block here (a leaf anchor without include_self) gets
        # zero weight from this group, not NaN
        empty = ~valid.any(-1)[:, None, None]
        logits = logits.masked_fill(empty, 0.0)
        g_lse = torch.logsumexp(logits, -1).masked_fill(empty[..., 0], NEG_INF)   # [Q, H]
        g_out = torch.einsum("qhb,qbhd->qhd", torch.softmax(logits, -1), rv[mem])
        old = lse
        new = _logaddexp(old, g_lse)
        # shares of the old and the new part; where new is -inf both parts are empty
        # and the shift by 0 keeps the exponents -inf (not NaN, for the gradients too)
        shift = new.masked_fill(new == NEG_INF, 0.0)
        keep, take = (old - shift).exp(), (g_lse - shift).exp()
        lse, out = new, out * keep.unsqueeze(-1) + g_out * take.unsqueeze(-1)

    # Which depths the anchors sit at: the one host sync of a call; every depth loop
    # below takes its buckets from the structure and masks the queries it does not hold.
    depth_pad = torch.cat([st.depth, st.depth.new_full((1,), -1)])
    anchor_depths = torch.unique(st.depth[anchors]).tolist()

    # 1. the children of the anchor (the anchor itself when it is a leaf, unless
    #    include_self is False; its only child when it has one): all members are blocks.
    is_leaf = anchors < n
    row = (anchors - n).clamp_min(0)
    group = torch.where(is_leaf, -1, index.parent_bucket[row])
    single = (group < 0)[:, None]  # a single block: the leaf anchor, or its only child
    mem = torch.where(is_leaf, anchors, index.only_child[row])[:, None]
    merge(anchors, mem, single & (mem < m) & ~(is_leaf[:, None] & (not include_self)))
    child_buckets = {g for d in anchor_depths if d + 1 < len(st.bucket_depths)
                     for g in st.bucket_depths[d + 1]}
    for g in sorted(child_buckets):
        mem = members[g][torch.where(group == g, index.parent_family[row], 0)]
        merge(anchors, mem, (group == g)[:, None] & (mem < m))

    # 2. the siblings of each ancestor-or-self C of the anchor, deepest C first, scored
    #    from C's side.
    node = anchors
    for d in range(max(anchor_depths, default=0), 0, -1):
        at_d = depth_pad[node] == d
        for g in st.bucket_depths[d]:
            here = at_d & (node_bucket[node] == g)
            mem = members[g][torch.where(here, node_family[node], 0)]
            merge(node, mem, here[:, None] & (mem < m) & (mem != node[:, None]))
        node = torch.where(at_d, parent_u[node], node)
    return out
