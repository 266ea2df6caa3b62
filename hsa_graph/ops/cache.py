r"""A hierarchical cache for generating with causal HSA, one token at a time.

The output of causal HSA at the newest leaf :math:`i` (row :math:`i` of HSA, :ref:`def-hsa`, on the
prefix tree :math:`T_{\le i}`, see :mod:`hsa_graph.ops.causal`) reads only

* the *spine*: the ancestors of :math:`i`, whose statistics are prefix sums;
* the *completed left siblings* of every spine node, each summarised by its means
  :math:`r_q, r_k, r_v`, its size :math:`n`, its :math:`\lambda` and
  :math:`F(C) = \log\sum_{B \ne C} n(B) e^{z(C, B)}` over the other completed siblings.

That is the right-skewed sub-tree of the paper's appendix G.2. :class:`HSACache` keeps
exactly this, one :class:`_Level` per depth, and :meth:`HSACache.append` runs the same
:func:`~hsa_graph.ops.causal.spine_step` as :func:`~hsa_graph.ops.causal.causal_hsa`.
Per token: :math:`O(b \cdot \mathrm{depth} \cdot D)` time, where :math:`b` bounds the
family sizes, and the cache holds :math:`O(b \cdot \mathrm{depth})` summaries (plus the
parent array of the tree so far, one integer per node, for inspection).

Where the new leaf hangs is the caller's choice: ``attach`` is the depth of the deepest
open node that the new leaf descends from (nodes below it are closed for good), and
``depth`` the new leaf's depth (new internal nodes fill the gap). For a
document -> paragraph -> sentence -> token tree (leaves at depth 3) ``attach=2`` continues
the sentence, ``attach=1`` opens a sentence and ``attach=0`` a paragraph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .hsa import _log_ratio, _logaddexp
from .inputs import check_scale, check_tensors, compute_dtype, resolve_structure

__all__ = ["HSACache"]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SpineNode:
    r"""The new token's spine node at one depth, as far as it goes: the sums of ``q``,
    ``k``, ``v`` over its leaves so far ``[H, D]`` / ``[H, Dv]``, their count
    :math:`n_i(S)` and :math:`\lambda_i(S)` ``[H]``."""

    sums: Tuple[Tensor, Tensor, Tensor]
    count: float
    lam: Tensor


@dataclass(frozen=True)
class LeftSiblings:
    r"""What the completed left siblings :math:`C` of a spine node :math:`S` contribute
    (see :func:`left_siblings`): :math:`\eta_i(S)` ``[H]``, :math:`\bar\theta_i(S)`
    ``[H, Dv]``, ``total`` :math:`= \sum_C n(C)\,\mathrm{logaddexp}(\lambda(C),
    \eta_i(C))` ``[H]``, and their sums of ``q``, ``k``, ``v`` and leaf count."""

    eta: Tensor
    theta_bar: Tensor
    total: Tensor
    sums: Tuple[Tensor, Tensor, Tensor]
    count: float


@dataclass(frozen=True)
class SpineStep:
    r"""One step up the spine: the parent :class:`SpineNode` :math:`A`, and
    :math:`\log\mu_i(S)` ``[H]`` and :math:`\bar\theta_i(S)` ``[H, Dv]`` of the child
    for the top-down sum."""

    parent: SpineNode
    log_mu: Tensor
    theta_bar: Tensor


@dataclass
class _Level:
    """The completed children of one open spine node and the state of its open child."""

    rq: Optional[Tensor] = None        # [b, H, D] means of completed children
    rk: Optional[Tensor] = None
    rv: Optional[Tensor] = None        # [b, H, Dv]
    logn: Optional[Tensor] = None      # [b]
    lam: Optional[Tensor] = None       # [b, H]
    fixed: Optional[Tensor] = None     # [b, H] F(C) over the other completed children
    left: Optional[Tuple[Tensor, Tensor, Tensor]] = None   # sums over completed children
    left_cnt: float = 0.0
    child: Optional[SpineNode] = None  # the open child (the new token's spine node)
    node: int = -1                     # node index (in :attr:`HSACache.parent`) of the parent

    @property
    def size(self) -> int:
        return 0 if self.rq is None else self.rq.shape[0]


class HSACache:
    r"""Hierarchical key/value cache for causal HSA generation.

    Args:
        include_self: as in :func:`~hsa_graph.ops.causal.causal_hsa`.
        scale: logit scale, ``1 / sqrt(D)`` by default.
        max_depth: the deepest leaf :meth:`append` accepts (each level of the spine is
            state and work per token, so an absurd ``depth`` is refused, not run).

    :meth:`append` returns the causal HSA output of the new token, equal (to rounding)
    to row ``i`` of :func:`~hsa_graph.ops.causal.causal_hsa` on the tree
    :attr:`parent` built by the calls so far.

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.ops.cache import HSACache
        >>> from hsa_graph.ops.causal import causal_hsa
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> q, k, v = torch.randn(3, 5, 2, 4, dtype=torch.float64)
        >>> cache = HSACache()
        >>> ys = [cache.append(q[0], k[0], v[0], depth=2)]        # doc -> sentence -> token
        >>> ys += [cache.append(q[1], k[1], v[1])]                # same sentence
        >>> ys += [cache.append(q[i], k[i], v[i], attach=0) for i in (2, 3)]  # new sentences
        >>> ys += [cache.append(q[4], k[4], v[4])]
        >>> cache.parent
        [-1, 0, 1, 1, 0, 4, 0, 6, 6]
        >>> tree = hsa_graph.NestedSignal.from_parents(cache.parent)
        >>> bool(torch.allclose(torch.stack(ys), causal_hsa(q, k, v, tree)))
        True
    """

    def __init__(self, include_self: bool = True, scale: Optional[float] = None,
                 max_depth: int = 4096):
        if not isinstance(include_self, (bool, int)) or isinstance(include_self, float):
            raise TypeError(f"include_self must be a bool, got {type(include_self).__name__}")
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
        self.include_self = bool(include_self)
        self.scale = check_scale(scale)
        self.max_depth = max_depth
        #: ``(q shape, v shape, dtype, device)`` of the tokens, fixed by the first one
        self.token_spec: Optional[tuple] = None
        self.levels: List[_Level] = []
        self.parent: List[int] = []
        self.num_tokens = 0

    def __repr__(self) -> str:
        sizes = [lvl.size for lvl in self.levels]
        return (f"{self.__class__.__name__}(tokens={self.num_tokens}, depth={len(sizes)}, "
                f"completed_per_level={sizes})")

    @property
    def depth(self) -> int:
        """Depth of the newest leaf (0 before the first token)."""
        return len(self.levels)

    @staticmethod
    def moves_of(tree) -> List[dict]:
        """The ``append`` placements (``attach``, ``depth``) that rebuild ``tree`` leaf by
        leaf (one tree with contiguous leaves, e.g. a prompt from
        :func:`~hsa_graph.text_tree`): ``attach`` is the depth of the lowest common
        ancestor of consecutive leaves.

        Example:
            >>> import hsa_graph
            >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2])
            >>> HSACache.moves_of(tree)
            [{'depth': 2}, {'attach': 1, 'depth': 2}, {'attach': 0, 'depth': 2}]
        """
        st = resolve_structure(tree, torch.device("cpu"))
        if st.num_trees != 1:
            raise ValueError(f"moves_of needs one tree, got a forest of {st.num_trees}")
        st.check_contiguous("moves_of")
        paths = st.leaf_paths()
        depth = st.depth[:st.num_leaves]
        same = ((paths[1:] == paths[:-1]) & (paths[1:] >= 0)).long().cumprod(1)
        attach = (same.sum(1) - 1).tolist()
        depth = depth.tolist()
        return [dict(depth=depth[0])] + [dict(attach=a, depth=d)
                                         for a, d in zip(attach, depth[1:])]

    def _check(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        check_tensors((("q", q), ("k", k), ("v", v)),
                      q.device if isinstance(q, Tensor) else torch.device("cpu"))
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 2:
                raise ValueError(f"{name} must have shape [H, D] (one token), got "
                                 f"{tuple(t.shape)}")
        if q.shape != k.shape:
            raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and "
                             f"{tuple(k.shape)}")
        if v.shape[0] != q.shape[0]:
            raise ValueError(f"v has {v.shape[0]} heads but q has {q.shape[0]}")
        if 0 in q.shape or v.shape[1] == 0:
            raise ValueError(f"a token needs at least one head and one feature, got q "
                             f"{tuple(q.shape)} and v {tuple(v.shape)}")
        spec = (tuple(q.shape), tuple(v.shape), q.dtype, q.device)
        if self.token_spec is None or not self.levels:
            self.token_spec = spec
        elif self.token_spec != spec:
            held = self.token_spec
            raise ValueError(
                f"token shapes changed: the cache holds q {held[0]} and v {held[1]} "
                f"({held[2]} on {held[3]}), got {tuple(q.shape)} and {tuple(v.shape)} "
                f"({q.dtype} on {q.device})")
        dtype = compute_dtype(q.dtype)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        return q, k, v

    def _push(self, level: _Level, scale: float) -> None:
        """Close the open child of ``level``: it joins the completed children."""
        (sq, sk, sv), cnt, lam = level.child.sums, level.child.count, level.child.lam
        rq, rk, rv = sq / cnt, sk / cnt, sv / cnt
        logn = sq.new_full((1,), math.log(cnt))
        if level.size == 0:
            fixed = lam.new_full((1, lam.shape[0]), NEG_INF)
            level.rq, level.rk, level.rv = rq[None], rk[None], rv[None]
            level.logn, level.lam, level.fixed = logn, lam[None], fixed
            level.left, level.left_cnt = (sq, sk, sv), cnt
            return
        # z(C, X) + log n(X) for the old children C, and z(X, C) + log n(C) for X.
        to_new = torch.einsum("bhd,hd->bh", level.rq, rk) * scale + logn
        from_new = torch.einsum("hd,bhd->bh", rq, level.rk) * scale + level.logn[:, None]
        level.fixed = torch.cat([_logaddexp(level.fixed, to_new),
                                 torch.logsumexp(from_new, 0)[None]])
        level.rq = torch.cat([level.rq, rq[None]])
        level.rk = torch.cat([level.rk, rk[None]])
        level.rv = torch.cat([level.rv, rv[None]])
        level.logn = torch.cat([level.logn, logn])
        level.lam = torch.cat([level.lam, lam[None]])
        level.left = tuple(a + b for a, b in zip(level.left, (sq, sk, sv)))
        level.left_cnt = level.left_cnt + cnt

    def append(self, q: Tensor, k: Tensor, v: Tensor, *, attach: Optional[int] = None,
               depth: Optional[int] = None) -> Tensor:
        r"""Add one leaf and return its causal HSA output ``[H, Dv]``.

        Args:
            q, k: ``[H, D]``; v: ``[H, Dv]`` of the new token.
            attach: depth of the deepest open node the new leaf descends from, in
                ``0 .. min(previous depth, depth) - 1``; default: the previous leaf's
                parent (the same family).
            depth: depth of the new leaf (default: the previous leaf's; 1 for the first
                token). New internal nodes open at depths ``attach + 1 .. depth - 1``.
        """
        q, k, v = self._check(q, k, v)
        scale = 1.0 / math.sqrt(q.shape[-1]) if self.scale is None else float(self.scale)
        prev = self.depth
        if depth is None:
            depth = prev if prev else 1
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (leaves hang below a root), got "
                             f"{depth!r}")
        if depth > self.max_depth:
            raise ValueError(f"depth {depth} exceeds max_depth={self.max_depth} of this "
                             "cache (pass HSACache(max_depth=...) for deeper trees)")
        if prev == 0:
            if attach not in (None, -1):
                raise ValueError(f"the first token opens the root: attach must be None, got "
                                 f"{attach!r}")
            self.parent.append(-1)
            self.levels = []
            top = 0
        else:
            highest = min(prev, depth) - 1
            attach = highest if attach is None else attach
            if (isinstance(attach, bool) or not isinstance(attach, int)
                    or not 0 <= attach <= highest):
                raise ValueError(
                    f"attach must be a depth in 0..{highest} (the previous leaf is at depth "
                    f"{prev}, the new one at depth {depth}), got {attach!r}")
            self._push(self.levels[attach], scale)
            del self.levels[attach + 1:]
            top = attach + 1
        for d in range(top, depth):  # open the new internal nodes (and the leaf)
            node = len(self.parent) - 1 if d == 0 else len(self.parent)
            if d > 0:
                self.parent.append(self.levels[d - 1].node)
            self.levels.append(_Level(node=node))
        self.parent.append(self.levels[depth - 1].node)
        self.num_tokens += 1

        h = q.shape[0]
        lam = ((q * k).sum(-1) * scale if self.include_self else q.new_full((h,), NEG_INF))
        node = SpineNode(sums=(q, k, v), count=1.0, lam=lam)
        steps: List[SpineStep] = []
        for e in range(depth, 0, -1):                      # bottom-up, leaf to root
            level = self.levels[e - 1]
            level.child = node
            step = spine_step(node, left_siblings(level, node, scale) if level.size else None)
            steps.append(step)
            node = step.parent
        # top-down: y = sum over the spine of m(above) (1 - mu) theta_bar, plus m(i) v_i
        y = torch.zeros_like(v)
        log_m = torch.zeros_like(lam)
        for step in reversed(steps):
            y = y + (log_m.exp() * -torch.expm1(step.log_mu)).unsqueeze(-1) * step.theta_bar
            log_m = log_m + step.log_mu
        if self.include_self:
            y = y + log_m.exp().unsqueeze(-1) * v
        return y.to(self.token_spec[2])   # back to the tokens' dtype


def left_siblings(level: _Level, node: SpineNode, scale: float) -> LeftSiblings:
    r"""What the completed children :math:`C` of ``level`` contribute to the open child
    :math:`S` (= ``node``):

    .. math::
        z(S_i, C) = s \langle r_q(S_i), r_k(C)\rangle + \log n(C), \quad
        \eta_i(S) = \mathrm{logsumexp}_C\, z(S_i, C), \quad
        \bar\theta_i(S) = \mathrm{softmax}_C(z(S_i, \cdot))\, r_v,\\
        \eta_i(C) = \mathrm{logaddexp}\big(F(C),\ s\langle r_q(C), r_k(S_i)\rangle
            + \log n_i(S)\big), \quad
        \mathrm{total} = \textstyle\sum_C n(C)\,
            \mathrm{logaddexp}(\lambda(C), \eta_i(C)),

    with :math:`r(S_i)` the means over :math:`S`'s leaves so far and :math:`F(C)` the
    log-sum over the other completed children (``level.fixed``).
    """
    sq, sk, _ = node.sums
    row = torch.einsum("hd,bhd->hb", sq / node.count, level.rk) * scale + level.logn
    col = (torch.einsum("hd,bhd->hb", sk / node.count, level.rq) * scale
           + math.log(node.count))
    eta = torch.logsumexp(row, -1)
    theta_bar = torch.einsum("hb,bhd->hd", torch.softmax(row, -1), level.rv)
    term = _logaddexp(level.lam.t(), _logaddexp(level.fixed.t(), col))
    total = (level.logn.exp() * term).sum(-1)
    return LeftSiblings(eta=eta, theta_bar=theta_bar, total=total, sums=level.left,
                        count=level.left_cnt)


def spine_step(node: SpineNode, left: Optional[LeftSiblings]) -> SpineStep:
    r"""From the spine child :math:`S` (``node``) to its parent :math:`A`:

    .. math::
        \lambda_i(A) = \frac{\mathrm{total} + n_i(S)\,
            \mathrm{logaddexp}(\lambda_i(S), \eta_i(S))}{n_i(A)}, \qquad
        \log\mu_i(S) = \lambda_i(S) - \mathrm{logaddexp}(\lambda_i(S), \eta_i(S)),

    where :math:`n_i(A) = n_i(S) +` the left siblings' count; without left siblings
    :math:`A` is :math:`S` (unary nodes are transparent) and :math:`\mu = 1`.
    """
    if left is None:
        return SpineStep(parent=node, log_mu=_log_ratio(node.lam, node.lam),
                         theta_bar=torch.zeros_like(node.sums[2]))
    total_s = _logaddexp(node.lam, left.eta)
    count = left.count + node.count
    lam = (left.total + node.count * total_s) / count
    sums = tuple(a + b for a, b in zip(left.sums, node.sums))
    return SpineStep(parent=SpineNode(sums=sums, count=count, lam=lam),
                     log_mu=_log_ratio(node.lam, total_s), theta_bar=left.theta_bar)
