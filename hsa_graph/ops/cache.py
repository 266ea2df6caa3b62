r"""Hierarchical caches for generating with causal HSA, one token per sequence per step.

The output of causal HSA at the newest leaf :math:`i` (row :math:`i` of HSA, :ref:`def-hsa`, on the
prefix tree :math:`T_{\le i}`, see :mod:`hsa_graph.ops.causal`) reads only

* the *spine*: the ancestors of :math:`i`, whose statistics are prefix sums;
* the *completed left siblings* of every spine node, each summarised by its means
  :math:`r_q, r_k, r_v`, its size :math:`n`, its :math:`\lambda` and
  :math:`F(C) = \log\sum_{B \ne C} n(B) e^{z(C, B)}` over the other completed siblings.

That is the right-skewed sub-tree of the paper's appendix G.2. :class:`BatchedHSACache`
keeps exactly this for ``B`` sequences at once, as padded tensors ``[B, depth, b, H, D]``
(``b``: the most completed children any open node holds) with per-level counts, and
:meth:`BatchedHSACache.step` takes one new token of every sequence in one call:
:func:`left_siblings` and :func:`spine_step` run once per depth level, vectorised over
the batch. Per token: :math:`O(b \cdot \mathrm{depth} \cdot H D)` time and the same
state. :meth:`BatchedHSACache.prefill` builds that state from whole prompts (with their
trees) in one vectorised pass over :func:`~hsa_graph.ops.hsa.hsa_statistics`, instead of
one step per prompt token. :class:`HSACache` is the one-sequence cache (a batch of one,
plus the parent array of the tree it built).

Where a new leaf hangs is the caller's choice: ``attach`` is the depth of the deepest
open node that the new leaf descends from (nodes below it are closed for good), and
``depth`` the new leaf's depth (new internal nodes fill the gap). For a
document -> paragraph -> sentence -> token tree (leaves at depth 3) ``attach=2`` continues
the sentence, ``attach=1`` opens a sentence and ``attach=0`` a paragraph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .hsa import _log_ratio, _logaddexp, hsa_statistics
from .inputs import (
    check_scale,
    check_tensors,
    compute_dtype,
    no_autocast,
    prepare_attention,
    resolve_structure,
)

__all__ = ["HSACache", "BatchedHSACache", "parents_of_moves"]

NEG_INF = float("-inf")

Placement = Union[None, int, Sequence[Optional[int]], Tensor]

# State tensors of a batched cache: [B, L, W, ...] per completed child, [B, L, ...] per
# open node (L: depth capacity, W: completed-children capacity).
_WIDE = ("rq", "rk", "rv", "size", "lam", "fixed")
_DEEP = ("left_q", "left_k", "left_v", "left_n", "child_q", "child_k", "child_v",
         "child_n", "child_lam")


@dataclass(frozen=True)
class SpineNode:
    r"""The new tokens' spine nodes at one depth, as far as they go: the sums of ``q``,
    ``k``, ``v`` over their leaves so far ``[B, H, D]`` / ``[B, H, Dv]``, their counts
    :math:`n_i(S)` ``[B]`` and :math:`\lambda_i(S)` ``[B, H]``."""

    sums: Tuple[Tensor, Tensor, Tensor]
    count: Tensor
    lam: Tensor


@dataclass(frozen=True)
class LeftSiblings:
    r"""What the completed left siblings :math:`C` of the spine nodes :math:`S`
    contribute (see :func:`left_siblings`): :math:`\eta_i(S)` ``[B, H]``,
    :math:`\bar\theta_i(S)` ``[B, H, Dv]``, ``total`` :math:`= \sum_C n(C)\,
    \mathrm{logaddexp}(\lambda(C), \eta_i(C))` ``[B, H]``, and their sums of ``q``,
    ``k``, ``v`` and leaf counts ``[B]``."""

    eta: Tensor
    theta_bar: Tensor
    total: Tensor
    sums: Tuple[Tensor, Tensor, Tensor]
    count: Tensor


@dataclass(frozen=True)
class SpineStep:
    r"""One step up the spines: the parent :class:`SpineNode` :math:`A`, and
    :math:`\log\mu_i(S)` ``[B, H]`` and :math:`\bar\theta_i(S)` ``[B, H, Dv]`` of the
    child for the top-down sum."""

    parent: SpineNode
    log_mu: Tensor
    theta_bar: Tensor


@dataclass(frozen=True)
class CacheLevel:
    """One open spine node of :class:`HSACache`: ``size`` completed children kept."""

    size: int


def left_siblings(members: Dict[str, Tensor], valid: Tensor, node: SpineNode,
                  left: Tuple[Tuple[Tensor, Tensor, Tensor], Tensor],
                  scale: float) -> LeftSiblings:
    r"""What the completed children :math:`C` of one open node per sequence contribute
    to its open child :math:`S` (= ``node``):

    .. math::
        z(S_i, C) = s \langle r_q(S_i), r_k(C)\rangle + \log n(C), \quad
        \eta_i(S) = \mathrm{logsumexp}_C\, z(S_i, C), \quad
        \bar\theta_i(S) = \mathrm{softmax}_C(z(S_i, \cdot))\, r_v,\\
        \eta_i(C) = \mathrm{logaddexp}\big(F(C),\ s\langle r_q(C), r_k(S_i)\rangle
            + \log n_i(S)\big), \quad
        \mathrm{total} = \textstyle\sum_C n(C)\,
            \mathrm{logaddexp}(\lambda(C), \eta_i(C)),

    with :math:`r(S_i)` the means over :math:`S`'s leaves so far and :math:`F(C)` the
    log-sum over the other completed children.

    Args:
        members: the completed children, padded: ``rq``, ``rk`` ``[B, W, H, D]``, ``rv``
            ``[B, W, H, Dv]``, ``size`` ``[B, W]``, ``lam``, ``fixed`` ``[B, W, H]``.
        valid: ``[B, W]``, which slots hold a completed child.
        node: the open children :math:`S`.
        left: the completed children's sums of ``q, k, v`` and their leaf counts ``[B]``.
        scale: the logit scale :math:`s`.

    Rows without a completed child get :math:`\eta = -\infty`, :math:`\bar\theta = 0`.
    """
    sq, sk, _ = node.sums
    count = node.count[:, None, None]
    row = torch.einsum("bhd,bwhd->bhw", sq / count, members["rk"]) * scale \
        + members["size"].log()[:, None, :]
    row = row.masked_fill(~valid[:, None, :], NEG_INF)
    col = (torch.einsum("bhd,bwhd->bhw", sk / count, members["rq"]) * scale
           + node.count.log()[:, None, None])
    eta = torch.logsumexp(row, -1)
    # exp(row - eta), with eta = 0 where every slot is empty: zeros, not NaN
    weights = torch.exp(row - torch.where(eta == NEG_INF, 0.0, eta).unsqueeze(-1))
    theta_bar = torch.einsum("bhw,bwhd->bhd", weights, members["rv"])
    term = _logaddexp(members["lam"].transpose(1, 2),
                      _logaddexp(members["fixed"].transpose(1, 2), col))
    mask = valid[:, None, :]
    total = torch.where(mask, members["size"][:, None, :] * term, 0.0).sum(-1)
    return LeftSiblings(eta=eta, theta_bar=theta_bar, total=total, sums=left[0],
                        count=left[1])


def spine_step(node: SpineNode, left: LeftSiblings, has_left: Tensor) -> SpineStep:
    r"""From the spine children :math:`S` (``node``) to their parents :math:`A`:

    .. math::
        \lambda_i(A) = \frac{\mathrm{total} + n_i(S)\,
            \mathrm{logaddexp}(\lambda_i(S), \eta_i(S))}{n_i(A)}, \qquad
        \log\mu_i(S) = \lambda_i(S) - \mathrm{logaddexp}(\lambda_i(S), \eta_i(S)),

    where :math:`n_i(A) = n_i(S) +` the left siblings' count; in rows without left
    siblings (``has_left`` ``[B]`` false) :math:`A` is :math:`S` (unary nodes are
    transparent) and :math:`\mu = 1`.
    """
    total_s = _logaddexp(node.lam, left.eta)       # = lam(S) where eta = -inf
    count = left.count + node.count
    lam = (left.total + node.count[:, None] * total_s) / count[:, None]
    has = has_left[:, None]
    lam = torch.where(has, lam, node.lam)
    sums = tuple(torch.where(has[..., None], a + b, b)
                 for a, b in zip(left.sums, node.sums))
    parent = SpineNode(sums=sums, count=torch.where(has_left, count, node.count), lam=lam)
    theta_bar = torch.where(has[..., None], left.theta_bar, 0.0)
    return SpineStep(parent=parent, log_mu=_log_ratio(node.lam, total_s),
                     theta_bar=theta_bar)


def _placement(name: str, value: Placement, batch: int) -> Tuple[Tensor, Tensor]:
    """``attach`` / ``depth`` as given -> CPU long values ``[B]`` and whether each row
    gave one ``[B]``."""
    if value is None:
        return torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.bool)
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, a sequence of B = {batch} ints (or None) "
                        f"or an integer tensor [B], got a bool")
    if isinstance(value, int):
        return (torch.full((batch,), value, dtype=torch.long),
                torch.ones(batch, dtype=torch.bool))
    if isinstance(value, Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"{name} must have one entry per sequence (B = {batch}), got "
                             f"shape {tuple(value.shape)}")
        return value.to("cpu", torch.long), torch.ones(batch, dtype=torch.bool)
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be None, an int, a sequence of ints or an integer "
                        f"tensor, got {type(value).__name__}")
    if len(value) != batch:
        raise ValueError(f"{name} must have one entry per sequence (B = {batch}), got "
                         f"{len(value)}")
    for row, entry in enumerate(value):   # host-side parsing of the caller's list
        if entry is not None and (isinstance(entry, bool) or not isinstance(entry, int)):
            raise TypeError(f"{name}[{row}] must be an int or None, got "
                            f"{type(entry).__name__}")
    given = torch.tensor([entry is not None for entry in value], dtype=torch.bool)
    values = torch.tensor([0 if entry is None else entry for entry in value],
                          dtype=torch.long)
    return values, given


def _first(mask: Tensor) -> int:
    return int(mask.nonzero()[0, 0])


class BatchedHSACache:
    r"""Hierarchical key/value cache for causal HSA generation of ``B`` sequences at once.

    Every sequence grows its own tree: one :meth:`step` call takes the next token of
    every sequence (``q, k`` ``[B, H, D]``, ``v`` ``[B, H, Dv]``) with per-sequence
    placements (``attach``, ``depth``) and returns ``[B, H, Dv]``, row ``b`` equal (to
    rounding) to the newest row of :func:`~hsa_graph.ops.causal.causal_hsa` on sequence
    ``b``'s tree so far. :meth:`prefill` starts sequences from whole prompts,
    :meth:`add` starts empty ones, :meth:`drop` removes finished ones and
    :meth:`extend` moves in the sequences of another cache; the other sequences are
    not touched.

    State: per depth level and sequence the completed children of the open node
    (padded to the widest one in the batch) and the open child's running sums, so
    :math:`O(b \cdot \mathrm{depth} \cdot H D)` numbers per sequence
    (:meth:`state_bytes`), against :math:`O(L \cdot H D)` for a flat KV cache.

    Args:
        batch_size: number of empty sequences to start with (more with :meth:`add`,
            :meth:`prefill`).
        include_self: as in :func:`~hsa_graph.ops.causal.causal_hsa`.
        scale: logit scale, ``1 / sqrt(D)`` by default.
        max_depth: the deepest leaf accepted (each level is state and work per token,
            so an absurd ``depth`` is refused, not run).

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.ops.cache import BatchedHSACache
        >>> from hsa_graph.ops.causal import causal_hsa
        >>> q, k, v = torch.randn(3, 3, 2, 2, 8, dtype=torch.float64)   # [steps, B, H, D]
        >>> cache = BatchedHSACache(batch_size=2)
        >>> y0 = cache.step(q[0], k[0], v[0], depth=[2, 1])   # sequence 1 is flat
        >>> y1 = cache.step(q[1], k[1], v[1], attach=[0, None])   # 0: a new sentence
        >>> y2 = cache.step(q[2], k[2], v[2])                     # same families
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 1, 0, 3, 3])
        >>> ref = causal_hsa(q[:, 0], k[:, 0], v[:, 0], tree)
        >>> bool(torch.allclose(torch.stack([y0[0], y1[0], y2[0]]), ref))
        True
    """

    def __init__(self, batch_size: int = 0, include_self: bool = True,
                 scale: Optional[float] = None, max_depth: int = 4096):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
        if not isinstance(include_self, (bool, int)) or isinstance(include_self, float):
            raise TypeError(f"include_self must be a bool, got {type(include_self).__name__}")
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
        self.include_self = bool(include_self)
        self.scale = check_scale(scale)
        self.max_depth = max_depth
        #: ``(H, D, Dv, dtype, device)`` of the tokens, fixed by the first ones
        self.token_spec: Optional[tuple] = None
        self._state: Optional[Dict[str, Tensor]] = None
        # host-side counters: placements are host values, so capacity and validity
        # decisions never wait on the device
        self._count = torch.zeros(batch_size, 1, dtype=torch.long)   # [B, L] completed
        self._depth = torch.zeros(batch_size, dtype=torch.long)      # newest leaf's depth
        self._tokens = torch.zeros(batch_size, dtype=torch.long)

    # ----------------------------------------------------------------- inspection
    @property
    def batch_size(self) -> int:
        """Number of sequences ``B``."""
        return self._depth.shape[0]

    @property
    def depths(self) -> List[int]:
        """Depth of each sequence's newest leaf (0 for a sequence without tokens)."""
        return self._depth.tolist()

    @property
    def num_tokens(self) -> List[int]:
        """Tokens held by each sequence."""
        return self._tokens.tolist()

    @property
    def completed_per_level(self) -> List[List[int]]:
        """Per sequence, the completed children kept at each open spine node (root
        first)."""
        return [row[:d].tolist() for row, d in zip(self._count, self._depth.tolist())]

    @property
    def capacity(self) -> Tuple[int, int]:
        """``(depth levels, children per level)`` the padded state holds now."""
        if self._state is None:
            return (0, 0)
        return tuple(self._state["rq"].shape[1:3])

    def state_bytes(self, per_sequence: bool = False) -> int:
        """Bytes of the cache state (device tensors and host counters); with
        ``per_sequence`` divided by ``B`` (the state is padded to the widest
        sequence)."""
        total = sum(t.numel() * t.element_size()
                    for t in (self._count, self._depth, self._tokens))
        if self._state is not None:
            total += sum(t.numel() * t.element_size() for t in self._state.values())
        return total // max(1, self.batch_size) if per_sequence else total

    @staticmethod
    def bytes_for(depth: int, width: int, heads: int, dim: int, dim_v: Optional[int] = None,
                  dtype: torch.dtype = torch.float32) -> int:
        """State bytes of one sequence whose open nodes over ``depth`` levels hold at most
        ``width`` completed children each (``heads`` x ``dim`` queries and keys, ``dim_v``
        values, ``dim`` by default), without building it."""
        dim_v = dim if dim_v is None else dim_v
        h = heads
        wide = width * (h * (2 * dim + dim_v) + 1 + 2 * h)
        deep = 2 * h * (2 * dim + dim_v) + 2 + h
        item = torch.empty((), dtype=dtype).element_size()
        return depth * (wide + deep) * item + depth * 8 + 16

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(batch_size={self.batch_size}, "
                f"tokens={self.num_tokens}, depths={self.depths}, "
                f"capacity={self.capacity})")

    # ----------------------------------------------------------------- state layout
    def _device(self) -> torch.device:
        return self.token_spec[4]

    def _empty_state(self, batch: int, depth: int, width: int) -> Dict[str, Tensor]:
        h, d, dv, dtype, device = self.token_spec
        dtype = compute_dtype(dtype)

        def zeros(*shape):
            return torch.zeros(shape, dtype=dtype, device=device)
        return dict(rq=zeros(batch, depth, width, h, d), rk=zeros(batch, depth, width, h, d),
                    rv=zeros(batch, depth, width, h, dv), size=zeros(batch, depth, width),
                    lam=zeros(batch, depth, width, h), fixed=zeros(batch, depth, width, h),
                    left_q=zeros(batch, depth, h, d), left_k=zeros(batch, depth, h, d),
                    left_v=zeros(batch, depth, h, dv), left_n=zeros(batch, depth),
                    child_q=zeros(batch, depth, h, d), child_k=zeros(batch, depth, h, d),
                    child_v=zeros(batch, depth, h, dv), child_n=zeros(batch, depth),
                    child_lam=zeros(batch, depth, h))

    @staticmethod
    def _pad_state(state: Dict[str, Tensor], depth: int, width: int) -> Dict[str, Tensor]:
        out = {}
        for name, t in state.items():
            pad_w = width - t.shape[2] if name in _WIDE else 0
            pad_l = depth - t.shape[1]
            if pad_w == 0 and pad_l == 0:
                out[name] = t
                continue
            shape = list(t.shape)
            shape[1] = depth
            if name in _WIDE:
                shape[2] = width
            new = t.new_zeros(shape)
            if name in _WIDE:
                new[:, :t.shape[1], :t.shape[2]] = t
            else:
                new[:, :t.shape[1]] = t
            out[name] = new
        return out

    def _pad_count(self, depth: int) -> None:
        if self._count.shape[1] < depth:
            self._count = torch.cat([self._count, self._count.new_zeros(
                self._count.shape[0], depth - self._count.shape[1])], 1)

    def _ensure(self, depth: int, width: int) -> None:
        """Grow the padded state to hold ``depth`` levels of ``width`` children (the
        width doubles, so that growing costs amortised O(1) per token)."""
        cur_l, cur_w = self.capacity
        if depth <= cur_l and width <= cur_w:
            return
        new_l = max(cur_l, depth)
        new_w = cur_w if width <= cur_w else max(width, 2 * cur_w)
        self._state = self._pad_state(self._state, new_l, new_w)
        self._pad_count(new_l)

    def _set_spec(self, spec: tuple) -> None:
        """Fix the token spec; a held state must match it (a batch whose sequences hold
        no token yet may change it)."""
        if self.token_spec is not None and self.token_spec != spec:
            if bool((self._tokens > 0).any()):
                held = self.token_spec
                raise ValueError(
                    f"token shapes changed: the cache holds H={held[0]}, D={held[1]}, "
                    f"Dv={held[2]} ({held[3]} on {held[4]}), got H={spec[0]}, D={spec[1]}, "
                    f"Dv={spec[2]} ({spec[3]} on {spec[4]})")
            self._state = None
        self.token_spec = spec
        if self._state is None:
            self._state = self._empty_state(self.batch_size, max(1, self._count.shape[1]), 1)
            self._pad_count(self._state["rq"].shape[1])

    def _scale(self) -> float:
        return (1.0 / math.sqrt(self.token_spec[1]) if self.scale is None
                else float(self.scale))

    # ----------------------------------------------------------------- sequences
    def add(self, count: int = 1) -> List[int]:
        """Start ``count`` empty sequences (their first :meth:`step` opens their root);
        returns their row indices. The other sequences are not touched."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        first = self.batch_size
        self._count = torch.cat([self._count, self._count.new_zeros(count,
                                                                    self._count.shape[1])])
        self._depth = torch.cat([self._depth, self._depth.new_zeros(count)])
        self._tokens = torch.cat([self._tokens, self._tokens.new_zeros(count)])
        if self._state is not None:
            depth, width = self.capacity
            empty = self._empty_state(count, depth, width)
            self._state = {name: torch.cat([t, empty[name]]) for name, t in
                           self._state.items()}
        return list(range(first, first + count))

    def drop(self, indices: Union[int, Sequence[int], Tensor]) -> None:
        """Remove the sequences at rows ``indices``; the others keep their state and
        order (row ``r`` moves down by the number of dropped rows before it).

        Raises:
            ValueError: an index outside ``0 .. B - 1`` or given twice.
            TypeError: a non-integer index.
        """
        b = self.batch_size
        if isinstance(indices, Tensor):
            if indices.dtype == torch.bool or indices.is_floating_point():
                raise TypeError(f"indices must be integers, got a {indices.dtype} tensor")
            rows = indices.to("cpu", torch.long).flatten()
        else:
            if isinstance(indices, int) and not isinstance(indices, bool):
                indices = [indices]
            if not isinstance(indices, (list, tuple)) or any(
                    isinstance(i, bool) or not isinstance(i, int) for i in indices):
                raise TypeError(f"indices must be an int, a sequence of ints or an integer "
                                f"tensor, got {indices!r}")
            rows = torch.tensor(list(indices), dtype=torch.long)
        bad = (rows < 0) | (rows >= b)
        if bool(bad.any()):
            raise ValueError(f"drop index {int(rows[_first(bad)])} is outside 0..{b - 1} "
                             f"(B = {b})")
        if rows.unique().numel() != rows.numel():
            raise ValueError(f"drop indices must be distinct, got {rows.tolist()}")
        keep = torch.ones(b, dtype=torch.bool)
        keep[rows] = False
        kept = keep.nonzero().squeeze(1)
        self._count, self._depth = self._count[kept], self._depth[kept]
        self._tokens = self._tokens[kept]
        if self._state is not None:
            kept = kept.to(self._device())
            self._state = {name: t.index_select(0, kept) for name, t in self._state.items()}

    def extend(self, other: BatchedHSACache) -> List[int]:
        """Move the sequences of ``other`` (same ``include_self``, ``scale`` and token
        shapes) to the end of this batch; returns their new row indices. ``other`` is
        left empty."""
        if not isinstance(other, BatchedHSACache):
            raise TypeError(f"other must be a BatchedHSACache, got {type(other).__name__}")
        if other is self:
            raise ValueError("a cache cannot extend itself")
        if (other.include_self, other.scale) != (self.include_self, self.scale):
            raise ValueError(
                f"other was made with include_self={other.include_self}, "
                f"scale={other.scale} but this cache has include_self={self.include_self}, "
                f"scale={self.scale}")
        first = self.batch_size
        if other.token_spec is not None:
            self._set_spec(other.token_spec)
            depth = max(self.capacity[0], other.capacity[0])
            width = max(self.capacity[1], other.capacity[1])
            self._state = self._pad_state(self._state, depth, width)
            mine = self._pad_state(other._state, depth, width)
            self._state = {name: torch.cat([t, mine[name]]) for name, t in
                           self._state.items()}
            self._pad_count(depth)
            other._pad_count(depth)
        elif self._state is not None:
            other._pad_count(self._count.shape[1])
            other._state = self._empty_state(other.batch_size, *self.capacity)
            self._state = {name: torch.cat([t, other._state[name]]) for name, t in
                           self._state.items()}
        self._pad_count(other._count.shape[1])
        self._count = torch.cat([self._count, other._count])
        self._depth = torch.cat([self._depth, other._depth])
        self._tokens = torch.cat([self._tokens, other._tokens])
        other.drop(list(range(other.batch_size)))
        return list(range(first, self.batch_size))

    # ----------------------------------------------------------------- one step
    def _check_tokens(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        check_tensors((("q", q), ("k", k), ("v", v)),
                      q.device if isinstance(q, Tensor) else torch.device("cpu"))
        b = self.batch_size
        if b == 0:
            raise ValueError("the cache holds no sequences: add() or prefill() them first")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3 or t.shape[0] != b:
                raise ValueError(f"{name} must have shape [B, H, D] with B = {b} sequences "
                                 f"(one token each), got {tuple(t.shape)}")
        if q.shape != k.shape:
            raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and "
                             f"{tuple(k.shape)}")
        if v.shape[1] != q.shape[1]:
            raise ValueError(f"v has {v.shape[1]} heads but q has {q.shape[1]}")
        if 0 in q.shape or v.shape[2] == 0:
            raise ValueError(f"a token needs at least one head and one feature, got q "
                             f"{tuple(q.shape)} and v {tuple(v.shape)}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            bad = ~torch.isfinite(t).flatten(1).all(1)
            if bool(bad.any()):
                raise ValueError(f"{name} holds a NaN or inf in row {_first(bad.cpu())} "
                                 "(that sequence's new token)")
        self._set_spec((q.shape[1], q.shape[2], v.shape[2], q.dtype, q.device))
        dtype = compute_dtype(q.dtype)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def _placements(self, attach: Placement, depth: Placement) -> Tuple[Tensor, Tensor]:
        """Checked per-row ``attach`` (``-1``: a sequence's first token) and ``depth``."""
        b = self.batch_size
        prev = self._depth
        depth_v, depth_given = _placement("depth", depth, b)
        bad = depth_given & (depth_v < 1)
        if bool(bad.any()):
            r = _first(bad)
            raise ValueError(f"depth[{r}] must be an int >= 1 (leaves hang below a root), "
                             f"got {int(depth_v[r])}")
        new_depth = torch.where(depth_given, depth_v, prev.clamp_min(1))
        bad = new_depth > self.max_depth
        if bool(bad.any()):
            r = _first(bad)
            raise ValueError(f"depth[{r}] = {int(new_depth[r])} exceeds max_depth="
                             f"{self.max_depth} of this cache (pass max_depth=... for "
                             "deeper trees)")
        attach_v, attach_given = _placement("attach", attach, b)
        fresh = prev == 0
        bad = fresh & attach_given & (attach_v != -1)
        if bool(bad.any()):
            r = _first(bad)
            raise ValueError(f"attach[{r}]: sequence {r} has no token yet, so its first "
                             f"token opens the root: attach must be None, got "
                             f"{int(attach_v[r])}")
        highest = torch.minimum(prev, new_depth) - 1
        attach_v = torch.where(fresh, -1, torch.where(attach_given, attach_v, highest))
        bad = ~fresh & ((attach_v < 0) | (attach_v > highest))
        if bool(bad.any()):
            r = _first(bad)
            raise ValueError(
                f"attach[{r}] must be a depth in 0..{int(highest[r])} (sequence {r}'s "
                f"previous leaf is at depth {int(prev[r])}, the new one at depth "
                f"{int(new_depth[r])}), got {int(attach_v[r])}")
        return attach_v, new_depth

    def step(self, q: Tensor, k: Tensor, v: Tensor, *, attach: Placement = None,
             depth: Placement = None) -> Tensor:
        r"""Add one leaf to every sequence and return their causal HSA outputs.

        Args:
            q, k: ``[B, H, D]``; v: ``[B, H, Dv]``: the new token of each sequence.
            attach: per sequence (an int for all, a sequence of ``B`` ints or ``None``,
                or an integer tensor ``[B]``): depth of the deepest open node the new
                leaf descends from, in ``0 .. min(previous depth, depth) - 1``; default
                (``None``): the previous leaf's parent (the same family). ``None`` for a
                sequence without tokens (its first token opens its root).
            depth: per sequence likewise: depth of the new leaf (default: the previous
                leaf's; 1 for a first token). New internal nodes open at depths
                ``attach + 1 .. depth - 1``.

        Returns:
            ``[B, H, Dv]`` in the tokens' dtype; row ``b`` equals the newest row of
            :func:`~hsa_graph.ops.causal.causal_hsa` on sequence ``b``'s tree so far.

        Raises:
            ValueError: shapes that do not fit ``B`` or each other, tokens of another
                shape, dtype or device than the cache holds, a NaN or inf in a row, or a
                bad placement (each naming the row).
            TypeError: non-tensors, mixed dtypes, non-integer placements.
        """
        q, k, v = self._check_tokens(q, k, v)
        attach, new_depth = self._placements(attach, depth)
        pushing = (attach >= 0).nonzero().squeeze(1)
        a = attach[pushing]
        width = int(self._count[pushing, a].max()) + 1 if pushing.numel() else 1
        self._ensure(int(new_depth.max()), width)
        with no_autocast(q.device):
            if pushing.numel():
                self._push(pushing, a)
            self._reset_above(attach)
            y = self._climb(q, k, v, new_depth)
        self._depth = new_depth
        self._tokens = self._tokens + 1
        return y.to(self.token_spec[3])

    def _push(self, rows: Tensor, attach: Tensor) -> None:
        """Close the open child at depth ``attach + 1`` of each sequence in ``rows``: it
        joins the completed children of its parent (``F`` of the old ones gains it)."""
        st, dev, scale = self._state, self._device(), self._scale()
        slot = self._count[rows, attach]
        width = int(slot.max()) + 1
        r, a, s = rows.to(dev), attach.to(dev), slot.to(dev)
        n_x = st["child_n"][r, a]                                         # [P]
        sums = (st["child_q"][r, a], st["child_k"][r, a], st["child_v"][r, a])
        rq_x, rk_x, rv_x = (t / n_x[:, None, None] for t in sums)
        lvl_rq, lvl_rk = st["rq"][r, a, :width], st["rk"][r, a, :width]   # [P, W, H, D]
        lvl_size, lvl_fixed = st["size"][r, a, :width], st["fixed"][r, a, :width]
        valid = (torch.arange(width, device=dev) < s[:, None])[..., None]   # [P, W, 1]
        # z(C, X) + log n(X) for the old children C, and z(X, C) + log n(C) for X
        to_new = torch.einsum("pwhd,phd->pwh", lvl_rq, rk_x) * scale + n_x.log()[:, None, None]
        fixed = torch.where(valid, _logaddexp(lvl_fixed, to_new), lvl_fixed)
        from_new = (torch.einsum("phd,pwhd->pwh", rq_x, lvl_rk) * scale
                    + lvl_size.log()[..., None]).masked_fill(~valid, NEG_INF)
        st["fixed"][r, a, :width] = fixed
        st["fixed"][r, a, s] = torch.logsumexp(from_new, 1)
        for name, value in (("rq", rq_x), ("rk", rk_x), ("rv", rv_x), ("size", n_x),
                            ("lam", st["child_lam"][r, a])):
            st[name][r, a, s] = value
        for name, value in zip(("left_q", "left_k", "left_v", "left_n"), (*sums, n_x)):
            st[name][r, a] = st[name][r, a] + value
        self._count[rows, attach] += 1

    def _reset_above(self, attach: Tensor) -> None:
        """Close every node below depth ``attach`` (all of them for a first token)."""
        levels = self._count.shape[1]
        closed = torch.arange(levels)[None, :] > attach[:, None]          # [B, L]
        if not bool(closed.any()):
            return
        self._count = self._count.masked_fill(closed, 0)
        mask = closed.to(self._device())
        for name in ("left_q", "left_k", "left_v", "left_n"):
            t = self._state[name]
            self._state[name] = t.masked_fill(mask.view(*mask.shape, *[1] * (t.dim() - 2)),
                                              0.0)

    def _climb(self, q: Tensor, k: Tensor, v: Tensor, new_depth: Tensor) -> Tensor:
        """The spine steps of the new leaves, deepest level first, then the top-down sum
        ``y = sum over the spine of m(above) (1 - mu) theta_bar (+ m(i) v_i)``."""
        st, dev, scale = self._state, q.device, self._scale()
        b, h = q.shape[:2]
        levels = int(new_depth.max())
        lam = ((q * k).sum(-1) * scale if self.include_self else q.new_full((b, h), NEG_INF))
        node = SpineNode(sums=(q, k, v), count=q.new_ones(b), lam=lam)
        depth_d, count_d = new_depth.to(dev), self._count.to(dev)
        log_mu = q.new_zeros(b, levels, h)
        theta = q.new_zeros(b, levels, h, v.shape[-1])
        for level in range(levels - 1, -1, -1):
            active = depth_d > level                                       # [B]
            a3 = active[:, None, None]
            for name, value in zip(("child_q", "child_k", "child_v"), node.sums):
                st[name][:, level] = torch.where(a3, value, st[name][:, level])
            st["child_n"][:, level] = torch.where(active, node.count, st["child_n"][:, level])
            st["child_lam"][:, level] = torch.where(active[:, None], node.lam,
                                                    st["child_lam"][:, level])
            width = int(self._count[:, level].max())
            if width == 0:     # no sequence has completed children here: unary level
                continue
            has = (count_d[:, level] > 0) & active
            valid = torch.arange(width, device=dev) < count_d[:, level, None]
            members = {name: st[name][:, level, :width] for name in _WIDE}
            left = ((st["left_q"][:, level], st["left_k"][:, level], st["left_v"][:, level]),
                    st["left_n"][:, level])
            step = spine_step(node, left_siblings(members, valid, node, left, scale), has)
            node = SpineNode(
                sums=tuple(torch.where(a3, p, c) for p, c in zip(step.parent.sums, node.sums)),
                count=torch.where(active, step.parent.count, node.count),
                lam=torch.where(active[:, None], step.parent.lam, node.lam))
            log_mu[:, level] = torch.where(active[:, None], step.log_mu, 0.0)
            theta[:, level] = torch.where(a3, step.theta_bar, 0.0)
        # log m above each level: exclusive prefix sums of log mu from the root down
        # (shifted, not subtracted: log mu is -inf for a leaf that skips itself)
        run = torch.cumsum(log_mu, 1)
        log_m = torch.cat([torch.zeros_like(run[:, :1]), run[:, :-1]], 1)
        share = log_m.exp() * -torch.expm1(log_mu)                          # [B, L, H]
        y = (share.unsqueeze(-1) * theta).sum(1)
        if self.include_self:
            y = y + run[:, -1].exp().unsqueeze(-1) * v
        return y

    # ----------------------------------------------------------------- prefill
    def prefill(self, q: Tensor, k: Tensor, v: Tensor, tree,
                return_outputs: bool = True) -> Optional[Tensor]:
        r"""Start one sequence per tree of ``tree`` from its prompt, in one vectorised
        pass, and return the prompt's causal HSA outputs.

        The open nodes after a prompt are the ancestors of its last leaf (the spine),
        and all their other children are complete subtrees of the prompt tree: their
        means, sizes and :math:`\lambda` come from one
        :func:`~hsa_graph.ops.hsa.hsa_statistics` pass over the prompts, and
        :math:`F(C)` over each node's completed children is one logsumexp over them. The
        state equals (to rounding) the one that stepping through the prompt builds.

        Args:
            q, k: ``[N, H, D]``, v: ``[N, H, Dv]``: the prompts' tokens, leaf rows of
                ``tree`` (one tree, a PyG ``Batch`` or forest of them: one new sequence
                per tree, in tree order).
            tree: the prompts' trees (leaves in document order, every node's leaves
                contiguous, every leaf below a root).
            return_outputs: ``False`` skips the prompt's outputs (the state alone).

        Returns:
            ``[N, H, Dv]``: :func:`~hsa_graph.ops.causal.causal_hsa` on the prompts
            (``None`` with ``return_outputs=False``). The new sequences are the last
            rows of the batch.

        Raises:
            ValueError: as :func:`~hsa_graph.ops.causal.causal_hsa` (with the finiteness
                check), a leaf that is a root, a last leaf deeper than ``max_depth``, or
                tokens of another shape than the cache holds.
        """
        from .causal import _internal_lam, _leaf_lam, causal_hsa

        x = prepare_attention(q, k, v, tree, include_self=self.include_self,
                              scale=self.scale, check_finite=True)
        st = x.structure
        st.check_contiguous("prefill")
        if st.num_leaves == 0:
            raise ValueError("prefill needs at least one prompt token")
        if x.single_head:
            raise ValueError(f"q must have shape [N, H, D], got {tuple(q.shape)}")
        dt = x.dtype
        n, nodes, p = st.num_leaves, st.num_nodes, st.num_trees
        leaf_depth = st.depth[:n]
        if bool((leaf_depth == 0).any()):
            raise ValueError(f"prefill needs every leaf below a root, but leaf row "
                             f"{_first((leaf_depth == 0).cpu())} is a tree of its own")
        spec = (x.q.shape[1], x.q.shape[2], x.v.shape[2], q.dtype, q.device)
        # the spine of each prompt: the ancestors of its last leaf
        rows = torch.arange(n, device=x.device)
        last = torch.full((p,), -1, dtype=torch.long, device=x.device).scatter_reduce(
            0, st.leaf_tree, rows, "amax")
        depth = leaf_depth[last]                                          # [P]
        depth_host = depth.cpu()
        too_deep = depth_host > self.max_depth
        if bool(too_deep.any()):
            t = _first(too_deep)
            raise ValueError(f"prompt {t} ends at depth {int(depth_host[t])}, beyond "
                             f"max_depth={self.max_depth} of this cache")
        levels = int(depth_host.max())
        parent_u = st.parent_unified()
        spine = torch.full((p, levels + 1), -1, dtype=torch.long, device=x.device)
        tree_of = torch.arange(p, device=x.device)
        current = last
        for _ in range(levels + 1):                    # one hop per depth level
            alive = current >= 0
            safe = current.clamp_min(0)
            spine[tree_of[alive], st.depth[safe[alive]]] = current[alive]
            current = torch.where(alive, parent_u[safe], current)
        on_spine = torch.zeros(nodes + 1, dtype=torch.bool, device=x.device)
        on_spine[spine.flatten()] = True
        on_spine[-1] = False                           # the -1 padding entries
        # the completed children: off the spine, below a spine node; in leaf order
        par = parent_u
        done = (~on_spine[:nodes]) & (par >= 0) & on_spine[par.clamp_min(0)]
        child = done.nonzero().squeeze(1)
        first_leaf = st.leaf_ranges[0]
        seq = st.leaf_tree[first_leaf[child]]
        level = st.depth[par[child]]
        group = seq * levels + level
        order = torch.argsort(group * (n + 1) + first_leaf[child])
        child, group = child[order], group[order]
        per_group = torch.bincount(group, minlength=p * levels)
        start = torch.cumsum(per_group, 0) - per_group
        slot = torch.arange(child.numel(), device=x.device) - start[group]
        width = max(1, int(per_group.max()) if child.numel() else 1)

        stats = hsa_statistics(st, x.q, x.k, self.include_self, x.scale, None, v=x.v,
                               leaf_mass=False)
        size = torch.cat([st.node_size.to(dt), x.q.new_ones(1)])
        lam = torch.cat([_leaf_lam(st, x.q, x.k, self.include_self, x.scale, None),
                         _internal_lam(st, stats, size)])                 # [M + 1, H]
        means = [torch.cat([leaf, internal]) for leaf, internal in
                 ((x.q, stats.rq), (x.k, stats.rk), (x.v, stats.rv))]      # [M + 1, H, .]
        node_sums = [m * size[:, None, None] for m in means]

        fresh = BatchedHSACache(p, self.include_self, self.scale, self.max_depth)
        fresh.token_spec = spec
        state = fresh._empty_state(p, levels, width)
        g_seq, g_level = group // levels, group % levels
        for name, table in (("rq", means[0]), ("rk", means[1]), ("rv", means[2]),
                            ("size", size), ("lam", lam)):
            state[name][g_seq, g_level, slot] = table[child]
        for name, table in zip(("left_q", "left_k", "left_v", "left_n"), (*node_sums, size)):
            flat = state[name].view(p * levels, *state[name].shape[2:])
            flat.index_add_(0, group, table[child])
        # the open child at each level: the spine node one level down
        below = spine[:, 1:]                                              # [P, levels]
        open_ = below >= 0
        safe = below.clamp_min(0)
        for name, table in zip(("child_q", "child_k", "child_v", "child_n", "child_lam"),
                               (*node_sums, size, lam)):
            value = table[safe]
            mask = open_.view(*open_.shape, *[1] * (value.dim() - 2))
            state[name] = torch.where(mask, value, 0.0)
        state["fixed"] = _fixed_of(state, per_group.view(p, levels), x.scale)
        fresh._state = state
        fresh._count = per_group.view(p, levels).cpu()
        fresh._depth = depth_host.clone()
        fresh._tokens = torch.bincount(st.leaf_tree, minlength=p).cpu()
        self.extend(fresh)
        if not return_outputs:
            return None
        return causal_hsa(q, k, v, tree, include_self=self.include_self, scale=self.scale)


def _fixed_of(state: Dict[str, Tensor], count: Tensor, scale: float,
              block: int = 1 << 22) -> Tensor:
    r""":math:`F(C) = \mathrm{logsumexp}_{B \ne C}\, s\langle r_q(C), r_k(B)\rangle
    + \log n(B)` over the completed children of every open node, ``[P, L, W, H]``,
    in blocks of rows ``C`` so that the ``[.., W, W, H]`` logits stay bounded."""
    rq, rk, size = state["rq"], state["rk"], state["size"]
    p, levels, width, h, _ = rq.shape
    keys = torch.arange(width, device=rq.device)
    valid = keys < count.to(rq.device)[..., None]                          # [P, L, W]
    log_n = size.log().masked_fill(~valid, NEG_INF)
    rows = max(1, block // max(1, p * levels * width * h))
    parts = []
    for lo in range(0, width, rows):
        hi = min(width, lo + rows)
        z = torch.einsum("plwhd,plkhd->plwkh", rq[:, :, lo:hi], rk) * scale \
            + log_n[:, :, None, :, None]
        diagonal = keys[lo:hi, None] == keys[None, :]
        z = z.masked_fill(diagonal[None, None, :, :, None], NEG_INF)
        parts.append(torch.logsumexp(z, 3))
    return torch.cat(parts, 2)


def parents_of_moves(moves: Sequence[Dict[str, Optional[int]]]) -> List[int]:
    """The parent array of the tree that one sequence of placements builds, as
    :class:`HSACache` numbers its nodes (each token adds its new internal nodes, then
    itself; the first token also the root).

    Args:
        moves: one dict per token with optional ``attach`` and ``depth`` (as
            :meth:`HSACache.append` takes them, e.g. from :meth:`HSACache.moves_of`).

    Raises:
        ValueError: an empty list or a bad placement, naming the token.
        TypeError: a move that is not a dict of ints (or None) under those keys.

    Example:
        >>> from hsa_graph.ops.cache import parents_of_moves
        >>> parents_of_moves([dict(depth=2), {}, dict(attach=0), {}])
        [-1, 0, 1, 1, 0, 4, 4]
    """
    if not isinstance(moves, (list, tuple)) or not moves:
        raise ValueError("moves must be a non-empty list of placements (one per token)")
    for row, move in enumerate(moves):   # host-side parsing of the caller's list
        if not isinstance(move, dict) or set(move) - {"attach", "depth"}:
            raise TypeError(f"moves[{row}] must be a dict with keys attach / depth, got "
                            f"{move!r}")
    attach, a_given = _placement("attach", [m.get("attach") for m in moves], len(moves))
    depth, d_given = _placement("depth", [m.get("depth") for m in moves], len(moves))
    n = len(moves)
    rows = torch.arange(n)
    bad = d_given & (depth < 1)
    if bool(bad.any()):
        r = _first(bad)
        raise ValueError(f"moves[{r}]: depth must be an int >= 1, got {int(depth[r])}")
    if bool(a_given[0]) and int(attach[0]) != -1:
        raise ValueError(f"moves[0]: the first token opens the root: attach must be None, "
                         f"got {int(attach[0])}")
    # a missing depth repeats the last given one (1 before any)
    last_given = torch.where(d_given, rows, -1).cummax(0).values
    depth = torch.where(last_given >= 0, depth[last_given.clamp_min(0)], 1)
    prev = torch.cat([depth.new_zeros(1), depth[:-1]])
    highest = torch.minimum(prev, depth) - 1
    attach = torch.where(a_given, attach, highest)
    attach[0] = -1
    bad = (rows > 0) & ((attach < 0) | (attach > highest))
    if bool(bad.any()):
        r = _first(bad)
        raise ValueError(f"moves[{r}]: attach must be a depth in 0..{int(highest[r])} (the "
                         f"previous leaf is at depth {int(prev[r])}, the new one at depth "
                         f"{int(depth[r])}), got {int(attach[r])}")
    # token i adds the nodes at depths attach_i + 1 .. depth_i, numbered consecutively;
    # the first one hangs under the node at depth attach_i that the latest token j < i
    # with attach_j < attach_i opened
    made = depth - attach
    offset = torch.cumsum(made, 0) - made
    latest = torch.zeros(n, dtype=torch.long)
    for e in range(int(attach.max()) + 1):           # one pass per depth level
        opened = torch.where(attach < e, rows, -1).cummax(0).values
        before = torch.cat([opened.new_full((1,), -1), opened[:-1]])
        latest = torch.where(attach == e, before, latest)
    j = latest.clamp_min(0)
    head_parent = torch.where(rows > 0, offset[j] + attach - attach[j] - 1, -1)
    token = torch.repeat_interleave(rows, made)
    node = torch.arange(int(made.sum()))
    parent = torch.where(node == offset[token], head_parent[token], node - 1)
    return parent.tolist()


class HSACache:
    r"""Hierarchical key/value cache for causal HSA generation of one sequence: a
    :class:`BatchedHSACache` of one sequence (:attr:`batched`), taking ``[H, D]``
    tokens, and keeping the parent array of the tree it built (:attr:`parent`).

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
        #: the one-sequence batch that holds the state
        self.batched = BatchedHSACache(1, include_self=include_self, scale=scale,
                                       max_depth=max_depth)
        self.include_self = self.batched.include_self
        self.scale = self.batched.scale
        self.max_depth = max_depth
        #: ``(q shape, v shape, dtype, device)`` of the tokens, fixed by the first one
        self.token_spec: Optional[tuple] = None
        self.parent: List[int] = []
        self.num_tokens = 0
        self._nodes: List[int] = []     # node index of the open node at each depth

    def __repr__(self) -> str:
        sizes = [lvl.size for lvl in self.levels]
        return (f"{self.__class__.__name__}(tokens={self.num_tokens}, depth={len(sizes)}, "
                f"completed_per_level={sizes})")

    @property
    def depth(self) -> int:
        """Depth of the newest leaf (0 before the first token)."""
        return len(self._nodes)

    @property
    def levels(self) -> List[CacheLevel]:
        """The open spine nodes, root first, with the completed children each keeps."""
        return [CacheLevel(size=c) for c in self.batched.completed_per_level[0]]

    def state_bytes(self) -> int:
        """Bytes of the attention state (the parent array not counted)."""
        return self.batched.state_bytes()

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

    def _check(self, q: Tensor, k: Tensor, v: Tensor) -> None:
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
        if self.token_spec is None or not self._nodes:
            self.token_spec = spec
        elif self.token_spec != spec:
            held = self.token_spec
            raise ValueError(
                f"token shapes changed: the cache holds q {held[0]} and v {held[1]} "
                f"({held[2]} on {held[3]}), got {tuple(q.shape)} and {tuple(v.shape)} "
                f"({q.dtype} on {q.device})")

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

        Raises:
            ValueError: bad shapes, tokens of another shape or dtype than the cache
                holds, a bad placement, or a NaN or inf in the token.
            TypeError: non-tensors or mixed dtypes.
        """
        self._check(q, k, v)
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
            attach = None
        else:
            highest = min(prev, depth) - 1
            attach = highest if attach is None else attach
            if (isinstance(attach, bool) or not isinstance(attach, int)
                    or not 0 <= attach <= highest):
                raise ValueError(
                    f"attach must be a depth in 0..{highest} (the previous leaf is at depth "
                    f"{prev}, the new one at depth {depth}), got {attach!r}")
        y = self.batched.step(q[None], k[None], v[None], attach=[attach], depth=[depth])[0]
        # the tree so far, for inspection: the new internal nodes, then the leaf
        if prev == 0:
            self.parent.append(-1)
            self._nodes = []
            top = 0
        else:
            del self._nodes[attach + 1:]
            top = attach + 1
        for d in range(top, depth):
            node = len(self.parent) - 1 if d == 0 else len(self.parent)
            if d > 0:
                self.parent.append(self._nodes[d - 1])
            self._nodes.append(node)
        self.parent.append(self._nodes[depth - 1])
        self.num_tokens += 1
        return y
