r"""Softmax attention, simpler block-constrained approximations of it, and their cost.

Theorem 3.2 of the paper: among all row-stochastic matrices that are *block
constrained* on a tree (``theta[i, j]`` is the same for every ``i`` in ``l(A)`` and
``j`` in ``l(B)`` when ``A, B`` are siblings), HSA's :math:`\theta` minimises
:math:`\sum_i \mathrm{KL}(\theta_i \,\|\, P_i)`, where :math:`P` is softmax attention
over the leaves of each tree. This module builds the competitors the evaluation
measures that claim against, all dense ``[H, N, N]`` (block diagonal over the trees
of a forest, for inspection on modest ``N``):

* :func:`softmax_weights`: :math:`P`, flat softmax attention inside each tree (the
  diagonal included, as in a pre-trained transformer);
* :func:`block_average_weights`: the average mass :math:`P` puts on every sibling
  block :math:`l(A) \times l(B)`, spread evenly over the block and normalised top
  down (moment matching of the blocks);
* :func:`pooled_softmax_weights`: a hierarchical softmax on mean-pooled queries and
  keys *without* HSA's :math:`\lambda` correction: the mass a node keeps is
  :math:`n(A)\,e^{z(A, A)}` (its pooled self logit) instead of
  :math:`e^{\lambda(A)}`;
* :func:`attention_kl`: the row KLs :math:`\mathrm{KL}(\theta_i \| P_i)`;
* :func:`attention_flops`: multiply-adds of flat attention and of HSA per tree.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import Tensor

from ..ops.inputs import resolve_structure
from ..structure import TreeStructure

__all__ = ["attention_flops", "attention_kl", "block_average_weights",
           "pooled_softmax_weights", "softmax_weights"]


def _check_qk(q: Tensor, k: Tensor, st: TreeStructure) -> None:
    if not isinstance(q, Tensor) or not isinstance(k, Tensor):
        raise TypeError("q and k must be tensors [N, H, D]")
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [N, H, D], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.shape[0] != st.num_leaves:
        raise ValueError(f"q has {q.shape[0]} rows but the tree has {st.num_leaves} leaves")


def softmax_weights(q: Tensor, k: Tensor, tree, scale: Optional[float] = None) -> Tensor:
    r"""Flat softmax attention inside each tree of ``tree``, diagonal included:
    :math:`P_{ij} \propto e^{s \langle q_i, k_j \rangle}` for ``j`` in ``i``'s tree,
    ``0`` elsewhere.

    Args:
        q, k: ``[N, H, D]``, one row per leaf.
        tree: a tree or forest (:class:`~hsa_graph.NestedSignal`, ``Batch``,
            :class:`~hsa_graph.TreeStructure`).
        scale: ``1 / sqrt(D)`` by default.

    Returns:
        ``[H, N, N]``, rows summing to 1.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.hopping_window_tree(6, (2,))
        >>> q = k = torch.randn(6, 2, 4, dtype=torch.float64)
        >>> p = softmax_weights(q, k, tree)
        >>> bool(torch.allclose(p, hsa_graph.hsa_weights(q, k, hsa_graph.flatten(tree))))
        True
    """
    st = resolve_structure(tree, q.device)
    _check_qk(q, k, st)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    logits = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * scale      # [H, N, N]
    same_tree = st.leaf_tree.unsqueeze(1) == st.leaf_tree.unsqueeze(0)
    return torch.softmax(logits.masked_fill(~same_tree, float("-inf")), dim=-1)


def block_average_weights(p: Tensor, tree) -> Tensor:
    r"""The block-average approximation of an attention matrix: every sibling block
    keeps the average mass ``p`` puts on it, normalised top down, as HSA's
    :math:`m` and :math:`\mu` are, so the result is block constrained and row
    stochastic (a plain block mean with rows renormalised is neither).

    With :math:`S(X, Y) = \sum_{i \in l(X), j \in l(Y)} p_{ij}` and, for a node
    :math:`A` with parent :math:`P`, :math:`T(A) = S(A, P)` (the mass the rows of
    :math:`A` put inside :math:`P`):

    .. math::
        \mu(A) = \frac{S(A, A)}{T(A)}, \quad m(A) = m(P)\, \mu(A),\ m(\text{root}) = 1,
        \qquad \theta_{ij} = m(\mathrm{LCA})\, \frac{S(A, B)}{T(A)\, n(B)},
        \quad \theta_{ii} = m(i)

    where :math:`A \ni i, B \ni j` are the children of the lowest common ancestor.
    On a one-level tree it gives ``p`` back.

    Args:
        p: ``[H, N, N]`` attention weights, positive inside each tree (e.g.
            :func:`softmax_weights`).
        tree: the tree or forest defining the blocks.

    Returns:
        ``[H, N, N]``, zero between trees.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2])  # (0 1)(2 3)
        >>> p = torch.tensor([[[.4, .3, .2, .1], [.1, .2, .3, .4],
        ...                    [.25, .25, .25, .25], [.1, .1, .1, .7]]])
        >>> # leaves 0, 1 put half their mass on 2, 3: .5 / 2 each; the other half
        >>> # splits as row 0 does inside (0 1): .4 / .7 and .3 / .7
        >>> block_average_weights(p, tree)[0, 0]
        tensor([0.2857, 0.2143, 0.2500, 0.2500])
    """
    st = resolve_structure(tree, p.device)
    n, m = st.num_leaves, st.num_nodes
    if p.dim() != 3 or p.shape[1:] != (n, n):
        raise ValueError(f"p must be [H, {n}, {n}] for a tree of {n} leaves, got "
                         f"{tuple(p.shape)}")
    heads = p.shape[0]
    a, b, lca, pair = st.pair_blocks()
    a, b, lca, values = a[pair], b[pair], lca[pair], p[:, pair]        # one entry per pair
    blocks, block_of = torch.unique(a * m + b, return_inverse=True)
    block_sum = p.new_zeros(heads, blocks.numel()).index_add_(1, block_of, values)
    out = p.new_zeros(heads, m).index_add_(1, a, values).t()           # S(A, sib(A)) [M, H]
    cross = p.new_zeros(heads, m).index_add_(1, lca, values).t()       # pairs split at A
    # S(A, A), bottom up: the diagonal of the leaves, plus the pairs split inside A.
    diag = p.diagonal(dim1=-2, dim2=-1).t()                            # [N, H]
    null = diag.new_zeros(1, heads)
    inner = torch.cat([diag, st.bottom_up(st.to_internal(diag) + torch.cat([cross[n:], null]))
                       [:-1]])
    total = inner + out
    if bool((inner <= 0).any()):
        raise ValueError("p must be positive inside each tree")
    log_mu = inner.log() - total.log()                                 # [M, H]
    log_m_internal = st.path_sum(torch.cat([log_mu[n:], null]))[:-1]
    log_m_leaf = torch.cat([log_m_internal, null])[st.leaf_parent] + log_mu[:n]
    log_m = torch.cat([log_m_leaf, log_m_internal]).t()                # [H, M]
    size = st.node_size.to(p.dtype)
    theta = torch.zeros_like(p)
    theta[:, pair] = (log_m[:, lca].exp() * block_sum[:, block_of]
                      / (total.t()[:, a] * size[b]))
    return theta + torch.diag_embed(log_m_leaf.t().exp())


def pooled_softmax_weights(q: Tensor, k: Tensor, tree, scale: Optional[float] = None
                           ) -> Tensor:
    r"""A hierarchical softmax on mean-pooled queries and keys, without HSA's
    :math:`\lambda` correction.

    With HSA's sibling logits :math:`z(A, B) = s \langle \bar q(A), \bar k(B) \rangle`
    and :math:`\eta(A) = \log \sum_{B \in sib(A)} n(B) e^{z(A, B)}`, the mass a node
    keeps is taken from its own pooled logit, :math:`\lambda'(A) = z(A, A) + \log n(A)`
    (for a leaf, :math:`s \langle q_i, k_i \rangle`), instead of HSA's bottom-up
    :math:`\lambda(A)`:

    .. math::
        \theta'_{ij} = m'(\mathrm{LCA})\, e^{z(A, B) - \mathrm{logaddexp}(\lambda'(A),
        \eta(A))}, \qquad m'(A) = m'(\mathrm{pa}(A))\,
        e^{\lambda'(A) - \mathrm{logaddexp}(\lambda'(A), \eta(A))}

    and :math:`\theta'_{ii} = m'(i)`: block constrained and row stochastic, like HSA.

    Args:
        q, k: ``[N, H, D]``.
        tree: a tree or forest.
        scale: ``1 / sqrt(D)`` by default.

    Returns:
        ``[H, N, N]``.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.hopping_window_tree(8, (2, 2))
        >>> q, k = torch.randn(2, 8, 3, 4, dtype=torch.float64)
        >>> theta = pooled_softmax_weights(q, k, tree)
        >>> bool(torch.allclose(theta.sum(-1), torch.ones(3, 8, dtype=torch.float64)))
        True
        >>> flat = hsa_graph.flatten(tree)   # one level: softmax, as HSA
        >>> bool(torch.allclose(pooled_softmax_weights(q, k, flat), softmax_weights(q, k, flat)))
        True
    """
    st = resolve_structure(tree, q.device)
    _check_qk(q, k, st)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    n, i = st.num_leaves, st.num_internal
    node_q = torch.cat([q, st.subtree_mean(q)[:-1]]).transpose(0, 1)   # [H, M, D], unified
    node_k = torch.cat([k, st.subtree_mean(k)[:-1]]).transpose(0, 1)
    z = torch.matmul(node_q, node_k.transpose(-1, -2)) * scale          # [H, M, M]
    log_n = st.node_size.to(q.dtype).log()
    parent = st.parent_unified()
    sibling = (parent.unsqueeze(1) == parent.unsqueeze(0)) & (parent.unsqueeze(1) >= 0)
    sibling.fill_diagonal_(False)
    eta = torch.logsumexp((z + log_n).masked_fill(~sibling, float("-inf")), -1)   # [H, M]
    lam = z.diagonal(dim1=-2, dim2=-1) + log_n
    total = torch.logaddexp(lam, eta)
    log_mu = (lam - total).t()                                          # [M, H]
    null = log_mu.new_zeros(1, log_mu.shape[1])
    log_m_internal = st.path_sum(torch.cat([log_mu[n:], null]))[:i]     # [I, H]
    log_m_leaf = torch.cat([log_m_internal, null])[st.leaf_parent] + log_mu[:n]
    log_m = torch.cat([log_m_leaf, log_m_internal]).t()                 # [H, M]

    a, b, lca, pair = st.pair_blocks()
    log_theta = log_m[:, lca] + z[:, a, b] - total[:, a]
    theta = torch.exp(log_theta.masked_fill(~pair, float("-inf")))
    return theta + torch.diag_embed(log_m_leaf.t().exp())


def attention_kl(theta: Tensor, p: Tensor) -> Tensor:
    r"""Row KL divergences :math:`\mathrm{KL}(\theta_i \,\|\, P_i) = \sum_j \theta_{ij}
    \log(\theta_{ij} / P_{ij})` (``0 log 0 = 0``).

    Args:
        theta, p: ``[..., N, N]`` row-stochastic; ``p`` must be positive wherever
            ``theta`` is.

    Returns:
        ``[..., N]``.

    Example:
        >>> p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
        >>> attention_kl(torch.tensor([[1.0, 0.0], [0.9, 0.1]]), p)
        tensor([0.6931, 0.0000])
    """
    if theta.shape != p.shape:
        raise ValueError(f"theta and p must have the same shape, got {tuple(theta.shape)} "
                         f"and {tuple(p.shape)}")
    support = theta > 0
    if bool((support & (p <= 0)).any()):
        raise ValueError("p is zero where theta is positive: the KL is infinite")
    log_ratio = torch.where(support, theta.clamp_min(1e-300).log() - p.clamp_min(1e-300).log(),
                            0.0)
    return (theta * log_ratio).sum(-1)


def attention_flops(tree, head_dim: int, heads: int = 1) -> Dict[str, Tensor]:
    r"""Multiply-adds (counted as 2 FLOPs) of one attention layer on each tree of
    ``tree``: flat softmax attention over its :math:`n` leaves versus HSA.

    .. math::
        \mathrm{flat} = 4 n^2 D H, \qquad
        \mathrm{HSA} = H \Big( \sum_{F} 4 b_F^2 D + \sum_{F} 3 b_F D \Big)

    Flat: :math:`QK^\top` and :math:`PV` (:math:`2 n^2 D` each). HSA, per family
    :math:`F` of :math:`b_F \ge 2` siblings: the sibling logits and the weighted sum
    of values (:math:`2 b_F^2 D` each) and the pooling of queries, keys and values
    into the parent (:math:`3 b_F D`); unary nodes cost nothing. Softmax
    exponentials and the scalar passes are left out of both, as in the paper's FL
    column (section 5.3).

    Args:
        tree: a tree or forest.
        head_dim: ``D``, the query/key/value size per head.
        heads: ``H``.

    Returns:
        ``{"flat": [T], "hsa": [T], "leaves": [T]}`` float64 per tree.

    Example:
        >>> import hsa_graph
        >>> f = attention_flops(hsa_graph.hopping_window_tree(8, (2, 4)), head_dim=1)
        >>> f["flat"].tolist(), f["hsa"].tolist()   # 4 * 64; 4 * (4 * 4 + 16) + 3 * (4 * 2 + 4)
        ([256.0], [164.0])
    """
    st = resolve_structure(tree, torch.device("cpu"))
    for name, value in (("head_dim", head_dim), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    num_trees = st.num_trees
    leaf_tree = st.leaf_tree.long()
    leaves = torch.bincount(leaf_tree, minlength=num_trees).double()
    # The tree of each internal node: the mean of its leaves' tree ids (all equal).
    tree_of = torch.cat([leaf_tree.double(),
                         st.subtree_mean(leaf_tree.double())[:-1].round()]).long()
    parent = st.parent_unified()
    size = torch.bincount(parent[parent >= 0], minlength=st.num_nodes).double()
    family = size >= 2
    per_tree = torch.zeros(num_trees, dtype=torch.float64)
    cost = 4 * size.pow(2) * head_dim + 3 * size * head_dim
    per_tree.index_add_(0, tree_of[family], cost[family])
    return {"flat": 4 * leaves.pow(2) * head_dim * heads, "hsa": per_tree * heads,
            "leaves": leaves}
