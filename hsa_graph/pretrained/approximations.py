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

and the fixed sparse patterns HSA is compared with at matched budgets, each a boolean
support renormalised with the softmax over it (:func:`sparse_weights`, the
KL-closest matrix on that support): :func:`local_weights` (sliding window),
:func:`fixed_weights` (Child et al. 2019, local + strided summaries),
:func:`bigbird_weights` (local + global + random) and :func:`topk_weights` (the
oracle bound); :func:`sparse_cost` gives their budget (distinct weights per query
row) and FLOPs, :func:`hsa_budget` HSA's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..ops.inputs import resolve_structure
from ..structure import TreeStructure

__all__ = ["SPARSE_PATTERNS", "SparsePattern", "attention_flops", "attention_kl",
           "bigbird_support", "bigbird_weights",
           "block_average_weights", "fixed_support", "fixed_weights", "hsa_budget",
           "local_support", "local_weights", "pooled_softmax_weights", "softmax_weights",
           "sparse_cost", "sparse_weights", "topk_support", "topk_weights"]


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


# ------------------------------------------------------------ sparse attention
# Fixed sparsity patterns (Child et al. 2019; Zaheer et al. 2020) and the top-k oracle,
# each a boolean support renormalised with the softmax over it. Rows of a sequence see
# keys of that sequence only: ``batch`` ([N], PyG's example index per row, sorted)
# splits the rows into sequences, as a forest splits leaves into trees.

def _sequence_positions(batch: Optional[Tensor], num_rows: Optional[int] = None,
                        device: Optional[torch.device] = None) -> Tuple[Tensor, Tensor]:
    """``(batch, position)`` ``[N]``: the example of each row and its rank in it."""
    if batch is None:
        if num_rows is None:
            raise ValueError("batch is None: pass num_rows (one sequence of that length)")
        batch = torch.zeros(num_rows, dtype=torch.long, device=device)
    if not isinstance(batch, Tensor) or batch.dim() != 1 or batch.is_floating_point() \
            or batch.dtype == torch.bool:
        raise TypeError("batch must be a 1-D integer tensor [N] (the example of each row)")
    batch = batch.long()
    if num_rows is not None and batch.numel() != num_rows:
        raise ValueError(f"batch has {batch.numel()} rows but there are {num_rows}")
    if batch.numel() == 0:
        raise ValueError("batch is empty: there are no rows")
    if bool((batch < 0).any()) or bool((batch.diff() < 0).any()):
        raise ValueError("batch must be non-negative and sorted (rows of one example "
                         "contiguous, examples in order)")
    rows = torch.arange(batch.numel(), device=batch.device)
    start = torch.searchsorted(batch, batch)      # first row of each row's example
    return batch, rows - start


def _check_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def local_support(batch: Optional[Tensor], window: int, num_rows: Optional[int] = None
                  ) -> Tensor:
    r"""Sliding-window local attention: row ``i`` sees the keys ``j`` of its sequence
    with :math:`|i - j| \le w`, so ``2 w + 1`` keys away from the ends.

    Args:
        batch: ``[N]`` sorted example index of each row (``None``: one sequence of
            ``num_rows``).
        window: :math:`w \ge 0`, keys on each side.
        num_rows: ``N`` when ``batch`` is ``None``.

    Returns:
        ``[N, N]`` boolean support (block diagonal over the examples).

    Example:
        >>> local_support(None, 1, num_rows=4).long()
        tensor([[1, 1, 0, 0],
                [1, 1, 1, 0],
                [0, 1, 1, 1],
                [0, 0, 1, 1]])
    """
    _check_count("window", window, 0)
    batch, pos = _sequence_positions(batch, num_rows)
    same = batch.unsqueeze(1) == batch.unsqueeze(0)
    return same & ((pos.unsqueeze(1) - pos.unsqueeze(0)).abs() <= window)


def fixed_support(batch: Optional[Tensor], block: int, summary: int = 1,
                  num_rows: Optional[int] = None) -> Tensor:
    r"""The *fixed* pattern of Child et al. (2019), bidirectional: row ``i`` sees its
    own block of ``l`` positions (:math:`\lfloor i / l \rfloor = \lfloor j / l
    \rfloor`) and the last ``c`` positions of every block (:math:`j \bmod l \ge l -
    c`), which carry the summary strides between blocks.

    Args:
        batch: ``[N]`` sorted example index of each row (``None``: one sequence).
        block: :math:`l \ge 1`.
        summary: :math:`1 \le c \le l`.
        num_rows: ``N`` when ``batch`` is ``None``.

    Returns:
        ``[N, N]`` boolean support.

    Example:
        >>> fixed_support(None, 2, num_rows=5).long()[0]   # block (0 1), summaries 1 3
        tensor([1, 1, 0, 1, 0])
    """
    _check_count("block", block, 1)
    _check_count("summary", summary, 1)
    if summary > block:
        raise ValueError(f"summary must be <= block, got summary={summary}, block={block}")
    batch, pos = _sequence_positions(batch, num_rows)
    same = batch.unsqueeze(1) == batch.unsqueeze(0)
    own = (pos // block).unsqueeze(1) == (pos // block).unsqueeze(0)
    stride = (pos % block >= block - summary).unsqueeze(0)
    return same & (own | stride)


def bigbird_support(batch: Optional[Tensor], window: int, num_global: int = 2,
                    num_random: int = 2, seed: int = 0, num_rows: Optional[int] = None
                    ) -> Tensor:
    r"""BigBird-style attention (Zaheer et al. 2020), at token level: local
    :math:`|i - j| \le w`, the first ``g`` positions of each sequence global (they see
    every key and every row sees them), and ``r`` random further keys per row, drawn
    without replacement among the keys it does not already see (seeded: the same
    ``seed`` and rows give the same pattern).

    Args:
        batch: ``[N]`` sorted example index of each row (``None``: one sequence).
        window: :math:`w \ge 0`.
        num_global: :math:`g \ge 0`.
        num_random: :math:`r \ge 0` (fewer where the sequence has fewer keys left).
        seed: the random keys' seed.
        num_rows: ``N`` when ``batch`` is ``None``.

    Returns:
        ``[N, N]`` boolean support.

    Example:
        >>> s = bigbird_support(None, 1, num_global=1, num_random=1, num_rows=6)
        >>> s.sum(1).tolist()   # row 0 is global; the others: local + global + 1 random
        [6, 4, 5, 5, 5, 4]
    """
    _check_count("window", window, 0)
    _check_count("num_global", num_global, 0)
    _check_count("num_random", num_random, 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    batch, pos = _sequence_positions(batch, num_rows)
    same = batch.unsqueeze(1) == batch.unsqueeze(0)
    glob = pos < num_global
    support = same & (((pos.unsqueeze(1) - pos.unsqueeze(0)).abs() <= window)
                      | glob.unsqueeze(1) | glob.unsqueeze(0))
    if num_random:
        # Random keys: the r highest of uniform scores among the keys a row misses.
        n = batch.numel()
        generator = torch.Generator().manual_seed(seed)
        score = torch.rand(n, n, generator=generator, dtype=torch.float64).to(batch.device)
        free = same & ~support
        score = score.masked_fill(~free, -1.0)
        r = min(num_random, n)
        top, index = score.topk(r, dim=1)
        support = support | torch.zeros_like(support).scatter(1, index, top >= 0)
    return support


def topk_support(p: Tensor, k: int) -> Tensor:
    r"""The ``k`` largest weights of every row of ``p`` (all of them where a row has
    fewer than ``k`` positive ones): the best support of ``k`` keys for KL to ``p``
    (renormalised over a support :math:`S`, :math:`\mathrm{KL} = -\log P(S)`), so an
    oracle bound for every pattern of ``k`` keys, not a method (it needs ``p``).

    Args:
        p: ``[..., N, N]`` attention weights (e.g. :func:`softmax_weights`).
        k: :math:`k \ge 1`.

    Returns:
        ``[..., N, N]`` boolean support.

    Example:
        >>> topk_support(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.5, 0.0]]), 2).long()
        tensor([[0, 1, 1],
                [1, 1, 0]])
    """
    _check_count("k", k, 1)
    if not isinstance(p, Tensor) or p.dim() < 2:
        raise ValueError("p must be a tensor [..., N, N] (rows of attention weights)")
    top, index = p.topk(min(k, p.shape[-1]), dim=-1)
    return torch.zeros_like(p, dtype=torch.bool).scatter(-1, index, top > 0)


def sparse_weights(p: Tensor, support: Tensor) -> Tensor:
    r"""``p`` renormalised over a support, :math:`\theta_{ij} = P_{ij} [j \in S_i] /
    \sum_{l \in S_i} P_{il}`: the softmax of the logits restricted to :math:`S_i`
    (what masked attention computes), and the KL-closest matrix to ``p`` with that
    support, at :math:`\mathrm{KL}(\theta_i \| P_i) = -\log P_i(S_i)`.

    Args:
        p: ``[..., N, N]`` row-stochastic.
        support: boolean, broadcastable to ``p`` (``[N, N]`` for every head).

    Returns:
        ``p``'s shape, rows summing to 1.

    Raises:
        ValueError: a row whose support holds no mass of ``p``.

    Example:
        >>> p = torch.tensor([[0.5, 0.3, 0.2]])
        >>> sparse_weights(p, torch.tensor([[True, False, True]]))
        tensor([[0.7143, 0.0000, 0.2857]])
    """
    if not isinstance(support, Tensor) or support.dtype != torch.bool:
        raise TypeError("support must be a boolean tensor")
    try:
        kept = torch.where(support, p, 0.0)
    except RuntimeError as error:
        raise ValueError(f"support {tuple(support.shape)} does not broadcast to p "
                         f"{tuple(p.shape)}") from error
    if kept.shape != p.shape:
        raise ValueError(f"support {tuple(support.shape)} would enlarge p {tuple(p.shape)}")
    mass = kept.sum(-1, keepdim=True)
    if bool((mass <= 0).any()):
        row = (mass[..., 0] <= 0).nonzero()[0].tolist()
        raise ValueError(f"row {row} of the support holds no mass of p")
    return kept / mass


def local_weights(p: Tensor, batch: Optional[Tensor], window: int) -> Tensor:
    """:func:`local_support` renormalised (:func:`sparse_weights`); ``p``: ``[..., N, N]``.

    Example:
        >>> p = torch.softmax(torch.randn(2, 5, 5), -1)   # [H, N, N]
        >>> bool(torch.allclose(local_weights(p, None, 1).sum(-1), torch.ones(2, 5)))
        True
    """
    return sparse_weights(p, local_support(batch, window, num_rows=p.shape[-1]))


def fixed_weights(p: Tensor, batch: Optional[Tensor], block: int, summary: int = 1) -> Tensor:
    """:func:`fixed_support` renormalised (:func:`sparse_weights`); ``p``: ``[..., N, N]``.

    Example:
        >>> p = torch.full((4, 4), 0.25)
        >>> fixed_weights(p, None, 2)[0].tolist()   # own block (0 1) and summary 3
        [0.3333333432674408, 0.3333333432674408, 0.0, 0.3333333432674408]
    """
    return sparse_weights(p, fixed_support(batch, block, summary, num_rows=p.shape[-1]))


def bigbird_weights(p: Tensor, batch: Optional[Tensor], window: int, num_global: int = 2,
                    num_random: int = 2, seed: int = 0) -> Tensor:
    """:func:`bigbird_support` renormalised (:func:`sparse_weights`); ``p``: ``[..., N, N]``.

    Example:
        >>> p = torch.full((6, 6), 1 / 6)
        >>> bool(torch.allclose(bigbird_weights(p, None, 1).sum(-1), torch.ones(6)))
        True
    """
    return sparse_weights(p, bigbird_support(batch, window, num_global, num_random, seed,
                                             num_rows=p.shape[-1]))


def topk_weights(p: Tensor, k: int) -> Tensor:
    """:func:`topk_support` renormalised (:func:`sparse_weights`): the oracle bound.

    Example:
        >>> topk_weights(torch.tensor([[0.1, 0.6, 0.3]]), 2)
        tensor([[0.0000, 0.6667, 0.3333]])
    """
    return sparse_weights(p, topk_support(p, k))


def sparse_cost(support: Tensor, head_dim: int, heads: int = 1,
                batch: Optional[Tensor] = None) -> Dict[str, Tensor]:
    r"""Budget and multiply-adds of attention restricted to a support.

    The budget of a query row is the number of distinct weights it gets, here its
    support size :math:`|S_i|`; FLOPs count :math:`QK^\top` and :math:`PV` on the
    support only, :math:`4 D \sum_i |S_i|` per head (flat attention's :math:`4 n^2 D`
    when :math:`S_i` is the whole sequence), comparable with
    :func:`attention_flops` and :func:`hsa_budget`.

    Args:
        support: ``[N, N]`` (one pattern for every head) or ``[H, N, N]`` (per head,
            e.g. :func:`topk_support`).
        head_dim: ``D``.
        heads: ``H`` (for an ``[N, N]`` support; a per-head support counts its own).
        batch: ``[N]`` example of each row (``None``: one sequence).

    Returns:
        ``{"budget": [N] (mean over heads for a per-head support), "flops": [T]``
        float64 per example}.

    Example:
        >>> cost = sparse_cost(local_support(None, 1, num_rows=4), head_dim=1)
        >>> cost["budget"].tolist(), cost["flops"].tolist()   # 4 * (2 + 3 + 3 + 2)
        ([2.0, 3.0, 3.0, 2.0], [40.0])
    """
    for name, value in (("head_dim", head_dim), ("heads", heads)):
        _check_count(name, value, 1)
    if not isinstance(support, Tensor) or support.dtype != torch.bool or \
            support.dim() not in (2, 3) or support.shape[-1] != support.shape[-2]:
        raise ValueError("support must be a boolean [N, N] or [H, N, N] tensor")
    n = support.shape[-1]
    batch, _ = _sequence_positions(batch, n, support.device)
    per_head = support.sum(-1).double()
    if support.dim() == 2:
        per_head = per_head.unsqueeze(0).expand(heads, n)
    num_examples = int(batch.max()) + 1
    flops = per_head.new_zeros(num_examples).index_add_(0, batch, per_head.sum(0))
    return {"budget": per_head.mean(0), "flops": 4 * head_dim * flops}


def hsa_budget(tree) -> Tensor:
    r"""Distinct weights per query row of HSA on ``tree`` (self included): the number
    of blocks leaf ``i`` sees, :math:`1 + \sum_{A \ni i} (|ch(A)| - 1)` over its
    internal ancestors (flat attention on ``n`` leaves: ``n``), the HSA counterpart
    of :func:`sparse_cost`'s budget.

    Args:
        tree: a tree or forest.

    Returns:
        ``[N]`` float64.

    Example:
        >>> import hsa_graph
        >>> hsa_budget(hsa_graph.hopping_window_tree(8, (2, 4))).tolist()  # 1 + 1 + 3
        [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    """
    st = resolve_structure(tree, torch.device("cpu"))
    i = st.num_internal
    children = torch.bincount(torch.cat([st.leaf_parent, st.internal_parent]),
                              minlength=i + 1).double()
    children[i] = 1.0                      # the null row: roots have no siblings
    # Each node's siblings; summed down from the root, every ancestor's family counts.
    siblings = torch.cat([children[st.internal_parent] - 1, children.new_zeros(1)])
    above = st.path_sum(siblings)          # [I + 1]
    return 1.0 + children[st.leaf_parent] - 1 + above[st.leaf_parent]


#: The sparse patterns :class:`SparsePattern` names, and what its ``size`` sets.
SPARSE_PATTERNS = {"local": "window w (keys on each side)", "fixed": "block l (summary c = 1)",
                   "bigbird": "window w (2 global, w random keys)", "topk": "k (the oracle)"}


@dataclass(frozen=True)
class SparsePattern:
    r"""A sparse attention pattern by name and size, for masked attention in a patched
    layer (:func:`~hsa_graph.pretrained.patch_hsa` with ``hierarchy=SparsePattern(...)``)
    and for the budget sweeps of the zero-shot evaluation.

    ``kind`` / ``size``: ``"local"`` / window ``w`` (:func:`local_support`);
    ``"fixed"`` / block ``l`` with one summary position (:func:`fixed_support`);
    ``"bigbird"`` / window ``w`` with 2 global positions and ``w`` random keys
    (:func:`bigbird_support`, seeded by ``seed``); ``"topk"`` / ``k``
    (:func:`topk_support`: needs the weights, an oracle bound).

    Example:
        >>> SparsePattern("local", 1).support(torch.tensor([0, 0, 0, 1])).sum(1).tolist()
        [2, 3, 2, 1]
    """

    kind: str
    size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SPARSE_PATTERNS:
            raise ValueError(f"sparse pattern {self.kind!r}: expected one of "
                             f"{', '.join(SPARSE_PATTERNS)}")
        _check_count(f"{self.kind} size", self.size, 0 if self.kind in ("local", "bigbird")
                     else 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")

    @property
    def name(self) -> str:
        """``"kind:size"``, as the command line spells it."""
        return f"{self.kind}:{self.size}"

    def support(self, batch: Tensor, p: Optional[Tensor] = None) -> Tensor:
        """The boolean support ``[N, N]`` (``[..., N, N]`` for top-k, from ``p``) of the
        rows of ``batch`` (``[N]``, sorted example index)."""
        if self.kind == "topk":
            if p is None:
                raise ValueError("the top-k pattern needs the attention weights p")
            return topk_support(p, self.size)
        if self.kind == "local":
            return local_support(batch, self.size)
        if self.kind == "fixed":
            return fixed_support(batch, self.size, 1)
        return bigbird_support(batch, self.size, 2, self.size, self.seed)
