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
              scale: Optional[float] = None, *, check_finite: bool = False) -> Tensor:
    r"""Anchored hierarchical cross-attention (see the module docstring).

    Args:
        q: queries ``[Nq, H, D]`` or ``[Nq, D]`` (from any source).
        k: keys ``[N, H, D]`` and v: values ``[N, H, Dv]`` of the key tree's leaves, in
            increasing node index (``[N, D]`` / ``[N, Dv]`` with two-dimensional ``q``).
        tree: the key tree (a :class:`~hsa_graph.NestedSignal`, a PyG ``Batch`` of them
            or a :class:`~hsa_graph.TreeStructure`).
        anchor: ``[Nq]`` (or one) node index of the key tree per query; default its
            root (required when the key tree is a forest).
        scale: logit scale, ``1 / sqrt(D)`` by default.
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
    x = prepare_attention(q, k, v, tree, scale=scale, check_finite=check_finite,
                          queries_are_leaves=False)
    anchors = _anchors(anchor, x.structure, x.q.shape[0])
    if x.empty:
        return x.empty_result((x.q.shape[0], *x.v.shape[1:]))
    with no_autocast(x.device):
        y = _cross(x.structure, x.q, x.k, x.v, anchors, x.scale)
    return x.finish(y)


def _cross(st: TreeStructure, q: Tensor, k: Tensor, v: Tensor, anchors: Tensor,
           scale: float) -> Tensor:
    n, m, dev = st.num_leaves, st.num_nodes, q.device
    index = st.family_index
    members, node_bucket, node_family = index.members, index.node_bucket, index.node_family
    rk = torch.cat([k, st.subtree_mean(k)])                       # [M + 1, H, D]
    rv = torch.cat([v, st.subtree_mean(v)])
    size = torch.cat([st.node_size.to(q.dtype), q.new_ones(1)])      # padding row: 1
    parent_u = torch.cat([st.parent_unified(), anchors.new_full((1,), -1)])
    nq, h, dv = q.shape[0], q.shape[1], v.shape[2]

    # Running log-normaliser and normalised output per query, merged block group by
    # block group (an online softmax over the groups of each query).
    lse = q.new_full((nq, h), NEG_INF)
    out = v.new_zeros(nq, h, dv)

    def merge(sel: Tensor, logits: Tensor, valid: Tensor, values: Tensor) -> None:
        nonlocal lse, out
        logits = logits.masked_fill(~valid[:, None, :], NEG_INF)
        g_lse = torch.logsumexp(logits, -1)                            # [Q, H]
        g_out = torch.einsum("qhb,qbhd->qhd", torch.softmax(logits, -1), values)
        old = lse[sel]
        new = _logaddexp(old, g_lse)
        keep = torch.where(old == NEG_INF, 0.0, (old - new).exp())
        mixed = out[sel] * keep.unsqueeze(-1) + g_out * (g_lse - new).exp().unsqueeze(-1)
        lse = lse.index_copy(0, sel, new)
        out = out.index_copy(0, sel, mixed)

    def family_logits(sel: Tensor, mem: Tensor) -> Tensor:
        return (torch.einsum("qhd,qbhd->qhb", q[sel], rk[mem]) * scale
                + size[mem].log()[:, None, :])

    # 1. the children of the anchor (the anchor itself when it is a leaf; its only
    #    child when it has one): all members are blocks.
    fam_of_parent = torch.full((st.num_internal + 1,), -1, dtype=torch.long, device=dev)
    fam_index = torch.zeros_like(fam_of_parent)
    for index, bucket in enumerate(st.buckets):
        fam_of_parent[bucket.parent] = index
        fam_index[bucket.parent] = torch.arange(bucket.num_families, device=dev)
    is_leaf = anchors < n
    row = (anchors - n).clamp_min(0)
    group = torch.where(is_leaf, -1, fam_of_parent[row])
    only_child = torch.full((st.num_internal + 1,), m, dtype=torch.long, device=dev)
    only_child[st.leaf_parent] = torch.arange(n, device=dev)
    only_child[st.internal_parent] = torch.arange(n, m, device=dev)
    for g in torch.unique(group).tolist():
        sel = (group == g).nonzero().flatten()
        if g < 0:  # a single block: the leaf anchor, or the only child of the anchor
            mem = torch.where(is_leaf[sel], anchors[sel], only_child[row[sel]])[:, None]
        else:
            mem = members[g][fam_index[row[sel]]]
        merge(sel, family_logits(sel, mem), mem < m, rv[mem])

    # 2. the siblings of each ancestor-or-self of the anchor, one depth at a time.
    node = anchors
    for _ in range(int(st.depth.max()) + 1):
        alive = (node < m) & (parent_u[node.clamp_max(m)] >= 0)
        if not bool(alive.any()):
            break
        safe = torch.where(alive, node, m)
        bucket_of = torch.where(alive, node_bucket[safe], -1)
        for g in torch.unique(bucket_of).tolist():
            if g < 0:
                continue
            sel = (bucket_of == g).nonzero().flatten()
            mem = members[g][node_family[safe[sel]]]
            valid = (mem < m) & (mem != safe[sel][:, None])
            merge(sel, family_logits(sel, mem), valid, rv[mem])
        node = torch.where(alive, parent_u[safe], m)
    return out
