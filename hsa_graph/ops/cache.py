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

from .causal import combine_spine, member_terms, spine_step
from .hsa import _logaddexp
from .inputs import check_scale, check_tensors, compute_dtype, resolve_structure

__all__ = ["HSACache"]

NEG_INF = float("-inf")


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
    child: Optional[tuple] = None      # (sums, count, lam) of the open child
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
        (sq, sk, sv), cnt, lam = level.child
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
        state = ((q[None], k[None], v[None]), q.new_ones(1), lam[None])
        log_mu = [q.new_zeros(1, h) for _ in range(depth + 1)]
        bars = [v.new_zeros(1, *v.shape) for _ in range(depth + 1)]
        for e in range(depth, 0, -1):
            level = self.levels[e - 1]
            s_sum, s_cnt, s_lam = state
            level.child = (tuple(t[0] for t in s_sum), float(s_cnt[0]), s_lam[0])
            terms = None
            if level.size:
                (sq, sk, _), cnt = s_sum, s_cnt
                eta, bar, total = member_terms(
                    (sq / cnt)[:, :, None], (sk / cnt)[:, :, None], cnt.log()[None, None],
                    level.rq.transpose(0, 1)[None], level.rk.transpose(0, 1)[None],
                    level.rv.transpose(0, 1)[None], level.logn[None, None, None],
                    level.lam.t()[None, :, None], level.fixed.t()[None, :, None],
                    torch.ones(1, 1, 1, level.size, dtype=torch.bool, device=q.device), scale)
                terms = dict(eta=eta[..., 0], theta_bar=bar[:, :, 0], total=total[..., 0],
                             left=tuple(t[None] for t in level.left),
                             left_cnt=s_cnt.new_full((1,), level.left_cnt))
            a_sum, a_cnt, a_lam, log_mu[e], bars[e] = spine_step(s_sum, s_cnt, s_lam, terms)
            state = (a_sum, a_cnt, a_lam)
        y = combine_spine(torch.stack(log_mu, 1), torch.stack(bars, 1),
                          v[None] if self.include_self else None,
                          torch.full((1,), depth, dtype=torch.long, device=q.device))
        return y[0].to(self.token_spec[2])   # back to the tokens' dtype
