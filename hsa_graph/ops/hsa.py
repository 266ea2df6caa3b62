r"""Hierarchical Self-Attention: the exact operator (SPEC.md section 2).

Two passes over the tree, never forming the ``N x N`` matrix:

1. **bottom-up**: subtree means ``rq, rk, rv`` of every node; the sibling logits of
   every family and their log-sum-exp ``eta``; the internal log-mass ``lam``.
2. **top-down**: the mass ``m`` reaching each node; each family member's
   contribution ``delta(A) = m(pa(A)) (1 - mu(A)) theta_bar(A) (+ m(i) v_i for a leaf)``
   as one weighted matmul per family; the output ``y_i = delta(i) + acc(pa(i))``
   where ``acc`` sums ``delta`` down each path.

All per-node work is vectorised over one depth at a time, and the families of one
padded size (see :class:`~hsa_graph.TreeStructure`) go through one batched matmul.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from ..structure import TreeStructure

__all__ = ["hsa"]

NEG_INF = float("-inf")


def _logaddexp(a: Tensor, b: Tensor) -> Tensor:
    """``log(e^a + e^b)`` that is ``-inf`` with a zero (not NaN) gradient where both are."""
    both = (a == NEG_INF) & (b == NEG_INF)
    out = torch.logaddexp(a.masked_fill(both, 0.0), b.masked_fill(both, 0.0))
    return out.masked_fill(both, NEG_INF)


def _log_ratio(lam: Tensor, total: Tensor) -> Tensor:
    """``log mu = lam - total``, defined as 0 where both are ``-inf`` (SPEC)."""
    both = total == NEG_INF
    return (lam.masked_fill(both, 0.0) - total.masked_fill(both, 0.0))


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous. Gradients of
    reductions arrive expanded (stride 0), and batched matmul backward on such
    strides falls back to one small GEMM per matrix: 20x slower on CPU."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` over the bucket layout ``[F, H, ...]``, with dense gradients."""
    return _DenseGrad.apply(torch.matmul(a, b))


def no_autocast(device: torch.device):
    """A context that turns autocast off on ``device``: HSA computes half-precision
    inputs in float32 on purpose, and autocast would downcast its matmuls again."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False) if enabled else contextlib.nullcontext()


def resolve_structure(tree, device: torch.device) -> TreeStructure:
    """The cached :class:`TreeStructure` of ``tree`` on ``device``."""
    if isinstance(tree, TreeStructure):
        return tree if tree.device == device else tree.to(device)
    structure_for = getattr(tree, "structure_for", None)
    if structure_for is None:
        raise TypeError(
            "tree must be a NestedSignal (or a PyG Batch of them) or a TreeStructure, "
            f"got {type(tree).__name__}")
    return structure_for(device)


def _as_heads(name: str, t: Tensor) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() != 3:
        raise ValueError(f"{name} must have shape [N, H, D] or [N, D], got {tuple(t.shape)}")
    return t


def _check_inputs(q, k, v, st: TreeStructure, pos, need_v: bool = True):
    single_head = isinstance(q, Tensor) and q.dim() == 2
    q, k = _as_heads("q", q), _as_heads("k", k)
    if need_v:
        v = _as_heads("v", v)
    n = st.num_leaves
    for name, t in (("q", q), ("k", k)) + ((("v", v),) if need_v else ()):
        if t.shape[0] != n:
            raise ValueError(
                f"{name} has {t.shape[0]} rows but the tree has {n} leaves "
                "(one row per leaf, in increasing node index)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if need_v and v.shape[1] != q.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but q has {q.shape[1]}")
    if pos is not None:
        if not isinstance(pos, Tensor) or not pos.is_floating_point():
            raise TypeError("pos must be a floating-point tensor [M, P] or [M, H, P]")
        if pos.shape[0] != st.num_nodes or pos.dim() not in (2, 3) or (
                pos.dim() == 3 and pos.shape[1] not in (1, q.shape[1])):
            raise ValueError(
                f"pos must have shape [M, P] or [M, H, P] with M = {st.num_nodes} nodes "
                f"and H = {q.shape[1]} heads, got {tuple(pos.shape)}")
    return q, k, v, single_head


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs accumulate in float32: logits, masses and sums.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class HSAStatistics:
    """Per-node quantities of SPEC section 2 in the layout of :class:`TreeStructure`
    (``[N, H]`` for leaves, ``[I + 1, H]`` for internal rows, null row last), plus
    each bucket's masked sibling logits ``[F, H, b, b]`` and ``eta`` ``[F, H, b]``."""

    rq: Tensor  # internal means [I + 1, H, D]
    rk: Tensor
    total_leaf: Tensor  # logaddexp(lam, eta)
    total_internal: Tensor
    log_m_leaf: Tensor
    log_m_internal: Tensor
    log_mu_leaf: Tensor
    log_mu_internal: Tensor
    bucket_logits: List[Tensor]
    bucket_eta: List[Tensor]


def _sibling_logits(st: TreeStructure, q: Tensor, k: Tensor, rq: Tensor, rk: Tensor,
                    scale: float, pos_leaf: Optional[Tensor], pos_internal: Optional[Tensor]):
    """Per bucket: ``z(A, B) + log n(B)`` over siblings (``-inf`` on the diagonal and
    padding), ``eta(A)`` (its log-sum-exp) and the diagonal ``z(A, A)`` (``[F, H, b]``)."""
    all_logits, all_eta, all_self = [], [], []
    for bucket in st.buckets:
        # Contiguous [F, H, b, D] operands: batched matmuls (and their backward) on
        # transposed views fall back to a slow per-matrix loop.
        fq = st.gather_bucket(bucket, q, rq).transpose(1, 2).contiguous()
        fk = st.gather_bucket(bucket, k, rk).transpose(1, 2).contiguous()
        logits = _bmm(fq, fk.transpose(-1, -2)) * scale            # [F, H, b, b]
        if pos_leaf is not None:
            fp = st.gather_bucket(bucket, pos_leaf, pos_internal).transpose(1, 2).contiguous()
            logits = logits + _bmm(fp, fp.transpose(-1, -2))
        all_self.append(logits.diagonal(dim1=-2, dim2=-1))
        bias = bucket.log_size.to(logits.dtype)[:, None, None, :]   # log n(B); -inf on padding
        eye = torch.eye(bucket.size, dtype=torch.bool, device=logits.device)
        logits = (logits + bias).masked_fill(eye, NEG_INF)
        all_logits.append(logits)
        all_eta.append(torch.logsumexp(logits, dim=-1))            # [F, H, b]
    return all_logits, all_eta, all_self


def _rows(t: Tensor) -> Tensor:
    """Bucket layout ``[F, H, b, ...]`` -> member rows ``[F * b, H, ...]``."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], *t.shape[3:])


def _leaf_rows(st: TreeStructure, per_bucket: List[Tensor], fill: float, like: Tensor):
    return st.scatter_leaves([_rows(t) if b.leaf_slot.numel() else None
                              for b, t in zip(st.buckets, per_bucket)], fill, like)


def _internal_rows(st: TreeStructure, per_bucket: List[Optional[Tensor]], fill: float,
                   like: Tensor):
    return st.scatter_internal([_rows(t) if b.internal_slot.numel() else None
                                for b, t in zip(st.buckets, per_bucket)], fill, like)


def hsa_statistics(st: TreeStructure, q: Tensor, k: Tensor, include_self: bool,
                   scale: float, pos: Optional[Tensor]) -> HSAStatistics:
    """The bottom-up and top-down passes over per-node scalars shared by
    :func:`hsa` and :func:`~hsa_graph.hsa_weights`."""
    n = st.num_leaves
    rq, rk = st.subtree_mean(q), st.subtree_mean(k)
    pos_leaf = pos_internal = None
    if pos is not None:
        pos_u = pos.to(q.dtype)[st.node_of_unified]
        if pos_u.dim() == 2:
            pos_u = pos_u.unsqueeze(1)
        pos_leaf = pos_u[:n]
        pos_internal = torch.cat([pos_u[n:], pos_u.new_zeros((1, *pos_u.shape[1:]))])

    bucket_logits, bucket_eta, bucket_self = _sibling_logits(
        st, q, k, rq, rk, scale, pos_leaf, pos_internal)
    like = q[:, :, 0]
    eta_leaf = _leaf_rows(st, bucket_eta, NEG_INF, like)
    eta_internal = _internal_rows(st, bucket_eta, NEG_INF, like)

    # lam bottom-up: lam(A) = sum_C n(C)/n(A) * logaddexp(lam(C), eta(C)).
    if include_self:  # z(i, i), read off the family logits' diagonals
        lam_leaf = _leaf_rows(st, bucket_self, 0.0, like)
        lonely = st.lonely_leaf
        if lonely.numel():
            own = (q[lonely] * k[lonely]).sum(-1) * scale
            if pos_leaf is not None:
                own = own + pos_leaf[lonely].pow(2).sum(-1)
            lam_leaf = lam_leaf.index_copy(0, lonely, own)
    else:
        lam_leaf = q.new_full(eta_leaf.shape, NEG_INF)
    total_leaf = _logaddexp(lam_leaf, eta_leaf)
    size = torch.cat([st.internal_size, st.internal_size.new_ones(1)]).to(q.dtype)
    leaf_weight = (1.0 / size)[st.leaf_parent].unsqueeze(-1)
    child_weight = (size[:-1] / size[st.internal_parent]).unsqueeze(-1)

    def weighted_total(lam: Tensor, lo: int, hi: int) -> Tensor:
        return child_weight[lo:hi] * _logaddexp(lam, eta_internal[lo:hi])

    lam_internal = st.bottom_up(st.to_internal(leaf_weight * total_leaf), weighted_total)
    total_internal = _logaddexp(lam_internal, eta_internal)

    # m top-down: log m(A) = log m(pa(A)) + log mu(A), m(root) = 1. The null row
    # (parent of leaves that are roots) has log m = 0, so such a leaf gets m = 1.
    log_mu_leaf = _log_ratio(lam_leaf, total_leaf)
    log_mu_internal = _log_ratio(lam_internal, total_internal)
    log_m_internal = st.path_sum(log_mu_internal)
    log_m_leaf = log_m_internal[st.leaf_parent] + log_mu_leaf
    return HSAStatistics(rq, rk, total_leaf, total_internal, log_m_leaf, log_m_internal,
                         log_mu_leaf, log_mu_internal, bucket_logits, bucket_eta)


def hsa(q: Tensor, k: Tensor, v: Tensor, tree, include_self: bool = True,
        scale: Optional[float] = None, pos: Optional[Tensor] = None) -> Tensor:
    r"""Hierarchical Self-Attention of the leaves of ``tree`` (SPEC.md section 2).

    .. math::
        y_i = \sum_j \theta_{ij} v_j, \qquad
        \theta_{ij} = m(\mathrm{pa}(A))\,
            \frac{e^{z(A, B)}}{e^{\lambda(A)} + e^{\eta(A)}}

    where :math:`A, B` are the siblings holding leaves :math:`i, j` under their
    lowest common ancestor, computed in :math:`O(M b^2)` without forming
    :math:`\theta`.

    Args:
        q: queries ``[N, H, D]`` (or ``[N, D]``), one row per leaf in increasing
            node index.
        k: keys, same shape as ``q``.
        v: values ``[N, H, Dv]`` (or ``[N, Dv]``).
        tree: a :class:`~hsa_graph.NestedSignal`, a PyG ``Batch`` of them (a forest:
            attention never crosses trees) or a :class:`~hsa_graph.TreeStructure`.
        include_self: whether a leaf attends to itself (``True`` reproduces softmax
            attention on a flat tree; the paper uses ``False``).
        scale: logit scale, ``1 / sqrt(D)`` by default.
        pos: optional position embeddings per node, ``[M, P]`` or ``[M, H, P]`` in
            node index order; ``<pos(A), pos(B)>`` is added to sibling logits.

    Returns:
        ``[N, H, Dv]`` (``[N, Dv]`` for two-dimensional inputs), in ``v``'s dtype.

    Example:
        >>> import torch, hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> q = k = v = torch.randn(5, 2, 8)
        >>> hsa_graph.hsa(q, k, v, tree).shape
        torch.Size([5, 2, 8])
    """
    st = resolve_structure(tree, q.device if isinstance(q, Tensor) else torch.device("cpu"))
    q, k, v, single_head = _check_inputs(q, k, v, st, pos)
    out_dtype = v.dtype
    dtype = _compute_dtype(torch.promote_types(q.dtype, v.dtype))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    with no_autocast(q.device):
        y = _hsa(st, q, k, v, include_self, scale, pos)
    y = y.to(out_dtype)
    return y.squeeze(1) if single_head else y


def _hsa(st: TreeStructure, q: Tensor, k: Tensor, v: Tensor, include_self: bool,
         scale: float, pos: Optional[Tensor]) -> Tensor:
    stats = hsa_statistics(st, q, k, include_self, scale, pos)
    rv = st.subtree_mean(v)

    # Mass each node sends to its siblings, w(A) = m(pa(A)) (1 - mu(A)), and keeps on
    # itself, m(i) (leaves, include_self). Row A of a family then contributes
    # delta(A) = w(A) theta_bar(A) + m(A) v_A: one matmul per bucket.
    m_internal = stats.log_m_internal.exp()                       # [I + 1, H], null row 1
    w_leaf = m_internal[st.leaf_parent] * -torch.expm1(stats.log_mu_leaf)
    w_internal = m_internal[st.internal_parent] * -torch.expm1(stats.log_mu_internal[:-1])
    w_internal = torch.cat([w_internal, w_internal.new_zeros(1, w_internal.shape[1])])
    m_leaf = stats.log_m_leaf.exp() if include_self else torch.zeros_like(w_leaf)
    no_self = torch.zeros_like(w_internal)

    weights, values = [], []
    for bucket, logits, eta in zip(st.buckets, stats.bucket_logits, stats.bucket_eta):
        w = st.gather_bucket(bucket, w_leaf, w_internal).transpose(1, 2)    # [F, H, b]
        diag = st.gather_bucket(bucket, m_leaf, no_self).transpose(1, 2)
        weights.append(torch.exp(logits - eta.unsqueeze(-1)) * w.unsqueeze(-1)
                       + torch.diag_embed(diag))
        values.append(st.gather_bucket(bucket, v, rv).transpose(1, 2).contiguous())

    # acc(A): the sum of delta over A's ancestors-or-self, top down. Families with an
    # internal member go first (acc needs their deltas); a leaf's output is then its
    # delta plus its parent's acc, added family-wise, fused into the matmul when the
    # family holds only leaves.
    deltas: List[Optional[Tensor]] = [
        _bmm(p, fv) if bucket.internal_slot.numel() else None
        for bucket, p, fv in zip(st.buckets, weights, values)]
    acc = st.path_sum(_internal_rows(st, deltas, 0.0, v)[:-1])              # [I + 1, H, Dv]
    for i, (bucket, p, fv) in enumerate(zip(st.buckets, weights, values)):
        if not bucket.leaf_slot.numel():
            continue
        above = acc[bucket.parent].unsqueeze(2)                              # [F, H, 1, Dv]
        if deltas[i] is None:
            f, h, b, dv = fv.shape
            deltas[i] = _DenseGrad.apply(torch.baddbmm(
                above.reshape(f * h, 1, dv), p.reshape(f * h, b, b),
                fv.reshape(f * h, b, dv)).view(f, h, b, dv))
        else:
            deltas[i] = deltas[i] + above
    y = _leaf_rows(st, deltas, 0.0, v)
    if st.lonely_leaf.numel():  # leaves without siblings: acc(parent) + m(i) v_i
        lonely = st.lonely_leaf
        own = acc[st.leaf_parent[lonely]] + m_leaf[lonely].unsqueeze(-1) * v[lonely]
        y = y.index_copy(0, lonely, own)
    return y
