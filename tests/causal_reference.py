"""Dense references for causal HSA and cross-attention, straight from their definitions.

Independent of ``hsa_graph.ops.causal``/``cross``: plain Python loops over queries on
top of ``tests/reference.py`` (the project's dense reference of SPEC HSA).

* causal HSA: row i = row i of SPEC HSA on the prefix tree T_{<=i} (the tree restricted
  to the leaves <= i, internal nodes without a remaining leaf removed);
* anchored cross-attention: the KL projection of the flat softmax row onto the
  distributions that are constant on each block of the anchor's partition, solved in
  closed form from the flat row itself (w_B proportional to n(B) times the geometric
  mean of the flat probabilities over B).
"""
from __future__ import annotations

import math

import torch
from reference import Tree, dense_hsa_weights
from torch import Tensor


def prefix_parent(parent, i: int):
    """Parent array of T_{<=i} and the kept original node indices (in order)."""
    tree = Tree(parent)
    keep = [u for u in range(tree.num_nodes) if min(tree.leaf_rows[u]) <= i]
    new = {u: r for r, u in enumerate(keep)}
    return [new[tree.parent[u]] if tree.parent[u] >= 0 else -1 for u in keep], keep


def dense_causal_weights(parent, q: Tensor, k: Tensor, include_self: bool = True,
                         scale=None, pos=None) -> Tensor:
    """[H, N, N]: row i is the last row of SPEC HSA on T_{<=i} (zero beyond i)."""
    n, h = q.shape[0], q.shape[1]
    out = q.new_zeros(h, n, n)
    rows = []
    for i in range(n):
        sub, keep = prefix_parent(parent, i)
        p = None if pos is None else pos[keep]
        theta = dense_hsa_weights(sub, q[:i + 1], k[:i + 1], include_self=include_self,
                                  scale=scale, pos=p)
        rows.append(torch.cat([theta[:, -1, :], q.new_zeros(h, n - i - 1)], -1))
    out = torch.stack(rows, 1)
    return out


def dense_causal_hsa(parent, q, k, v, include_self=True, scale=None, pos=None) -> Tensor:
    theta = dense_causal_weights(parent, q, k, include_self, scale, pos)
    return torch.einsum("hij,jhd->ihd", theta, v)


def anchor_blocks(parent, anchor: int, include_self: bool = True, sides: bool = False):
    """Blocks (lists of leaf rows) of the partition induced by ``anchor``: the children
    of the anchor (the query is a virtual leaf beside them) and the siblings of each
    ancestor-or-self of the anchor below the root. A leaf anchor is its own block
    (left out with ``include_self=False``). With ``sides``, each block comes as
    ``(rows, node, side)``: the block's node and the node whose position stands for
    the query against it (the anchor for its children, else the ancestor-or-self)."""
    tree = Tree(parent)
    if tree.children[anchor]:
        blocks = [(tree.leaf_rows[c], c, anchor) for c in tree.children[anchor]]
    else:
        blocks = [(tree.leaf_rows[anchor], anchor, anchor)] if include_self else []
    u = anchor
    while tree.parent[u] >= 0:
        blocks += [(tree.leaf_rows[b], b, u) for b in tree.siblings(u)]
        u = tree.parent[u]
    if include_self or tree.children[anchor]:
        assert sorted(r for blk, _, _ in blocks for r in blk) == tree.leaf_rows[u]
    return blocks if sides else [blk for blk, _, _ in blocks]


def dense_cross_weights(parent, q: Tensor, k: Tensor, anchors, scale=None,
                        include_self: bool = True, pos: Tensor = None) -> Tensor:
    """[H, Nq, N]: per query and head, the block-constant row closest in KL to the
    flat softmax row over the leaves of the anchor's tree; with ``pos`` ([M, P] or
    [M, H, P]) the flat row's logit of a leaf in block B adds <pos(side), pos(B)>,
    constant on the block."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    h, n = q.shape[1], k.shape[0]
    if pos is not None and pos.dim() == 2:
        pos = pos.unsqueeze(1)
    rows = []
    for a, anchor in enumerate(anchors):
        blocks = anchor_blocks(parent, int(anchor), include_self, sides=True)
        row = q.new_zeros(h, n)
        if not blocks:
            rows.append(row)
            continue
        leaves = sorted(r for blk, _, _ in blocks for r in blk)
        logits = s * torch.einsum("hd,jhd->hj", q[a], k[leaves])
        where = {r: c for c, r in enumerate(leaves)}
        if pos is not None:
            bias = torch.zeros_like(logits)
            for blk, node, side in blocks:
                dot = (pos[side] * pos[node]).sum(-1).expand(h)        # [H]
                bias[:, [where[r] for r in blk]] = dot[:, None]
            logits = logits + bias
        logp = torch.log_softmax(logits, -1)
        logw = torch.stack([math.log(len(blk)) + logp[:, [where[r] for r in blk]].mean(-1)
                            for blk, _, _ in blocks], -1)
        w = torch.softmax(logw, -1)
        for bi, (blk, _, _) in enumerate(blocks):
            row[:, blk] = (w[:, bi] / len(blk))[:, None].expand(h, len(blk))
        rows.append(row)
    return torch.stack(rows, 1)
