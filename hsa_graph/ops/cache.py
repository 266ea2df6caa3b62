r"""Hierarchical caches for generating with causal HSA, one token per sequence per step.

The output of causal HSA at the newest leaf :math:`i` (row :math:`i` of HSA, :ref:`def-hsa`, on the
prefix tree :math:`T_{\le i}`, see :mod:`hsa_graph.ops.causal`) reads only

* the *spine*: the ancestors of :math:`i`, whose statistics are prefix sums;
* the *completed left siblings* of every spine node, each summarised by its means
  :math:`r_q, r_k, r_v`, its size :math:`n` and :math:`G(C) = \mathrm{logaddexp}(\lambda(C),
  F(C))`, :math:`F(C) = \log\sum_{B \ne C} n(B) e^{z(C, B)}` over the other completed
  siblings.

That is the right-skewed sub-tree of the paper's appendix G.2. :class:`BatchedHSACache`
keeps exactly this for ``B`` sequences at once, as one padded :class:`CacheState`
(``[B, depth, H, b, .]``, ``b``: the most completed children any open node holds), and
:meth:`BatchedHSACache.step` takes one new token of every sequence in one call of a fixed
handful of tensor ops: the spine sums of every level in one matmul (:func:`spine_sums`),
the sibling logits of every level in two batched matmuls (:func:`left_siblings`), the
``B``-wide recursion of :math:`\lambda` up the levels (:func:`spine_step`, the only
per-level part: two ops on ``[B, H]``), the top-down sum (:func:`top_down`), and the
gathers and scatters that file each sequence's completing child (its terms were computed
by the step before). Per token: :math:`O(b \cdot \mathrm{depth} \cdot H D)` time and the
same state, no host-device synchronisation. On the CPU, with numba installed, the same
arithmetic runs as one compiled call (:mod:`hsa_graph.ops.step_kernel`): at ``B = 1``
the eager step's sixty-odd small tensor ops cost more to dispatch than to compute.
:meth:`BatchedHSACache.prefill` builds that state from whole prompts (with their trees)
in one vectorised pass over :func:`~hsa_graph.ops.hsa.hsa_statistics`, instead of one
step per prompt token.
:class:`HSACache` is the one-sequence cache (a batch of one, plus the parent array of the
tree it built).

Where a new leaf hangs is the caller's choice: ``attach`` is the depth of the deepest
open node that the new leaf descends from (nodes below it are closed for good), and
``depth`` the new leaf's depth (new internal nodes fill the gap). For a
document -> paragraph -> sentence -> token tree (leaves at depth 3) ``attach=2`` continues
the sentence, ``attach=1`` opens a sentence and ``attach=0`` a paragraph.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, fields
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from .. import typing as accelerators
from ..structure import TreeStructure, records_grad
from .hsa import _logaddexp, hsa_statistics
from .inputs import (
    check_scale,
    check_step_tokens,
    compute_dtype,
    first_true,
    kept_rows,
    no_autocast,
    prepare_attention,
    resolve_structure,
)

__all__ = ["HSACache", "BatchedHSACache", "parents_of_moves"]

NEG_INF = float("-inf")

Placement = Union[None, int, Sequence[Optional[int]], Tensor]

@dataclass
class CacheState:
    r"""The device state of :class:`BatchedHSACache`: ``B`` sequences, ``L`` depth levels
    (level ``l`` is a sequence's open spine node at depth ``l``) and ``W`` slots for the
    completed children :math:`C` of each open node. A *sum* row has ``F = 2D + Dv + 1``
    features: the sums of ``q | k | v`` over a node's leaves and its leaf count (the
    count repeated per head, so that one matmul carries sums and counts together).

    Attributes:
        members: ``[B, L, H, W, 2D + Dv]``, the means :math:`r_q | r_k | r_v` of each
            completed child (heads before slots, so that the logits against them are
            batched matmuls over ``[B, L, H]``).
        size: ``[B, L, W]``, :math:`n(C)`.
        base: ``[B, L, H, W]``, :math:`G(C) = \mathrm{logaddexp}(\lambda(C), F(C))` with
            :math:`F(C) = \log\sum_{B \ne C} n(B)\, e^{z(C, B)}` over the other completed
            children: a query's column term :math:`\mathrm{logaddexp}(\lambda(C),
            \eta_i(C))` is then :math:`\mathrm{logaddexp}(G(C), s\langle r_q(C), r_k(S_i)
            \rangle + \log n_i(S))`. :math:`G` changes only when a sibling completes,
            as :math:`G(C) \leftarrow \mathrm{logaddexp}(G(C), z(C, X) + \log n(X))`.
        left: ``[B, L, H, F]``, the sum row of the completed children together.
        child: ``[B, L, H, F]``, the sum row of the open child (the spine node one level
            down, the newest leaf at the deepest level).
        child_gain: ``[B, L, H, W]``, every completed child's :math:`G(C)` with the
            open child :math:`S` added, :math:`\mathrm{logaddexp}(G(C),
            s\langle r_q(C), r_k(S)\rangle + \log n(S))`, and ``child_base``
            ``[B, L, H]`` :math:`S`'s own :math:`G(S) = \mathrm{logaddexp}(\lambda(S),
            \eta(S))`, both from the newest step: when :math:`S` completes they are its
            parent's new :math:`G` (:meth:`BatchedHSACache._push` computes nothing).

    Invariants the step relies on (instead of masks): ``size`` is 0 in every slot at or
    beyond the level's count of completed children (so :math:`\log n = -\infty` drops
    it from every sum), and ``left`` and ``size`` are 0 at every level at or below a
    sequence's newest leaf (so those levels pass :math:`\lambda` through unchanged).
    """

    members: Tensor
    size: Tensor
    base: Tensor
    left: Tensor
    child: Tensor
    child_gain: Tensor
    child_base: Tensor

    #: the slot dimension of each tensor padded to ``W`` (the level dimension is 1)
    WIDTH_DIM = {"members": 3, "size": 2, "base": 3, "child_gain": 3}

    def __post_init__(self):
        self._views: Optional[StateViews] = None

    def views(self, dim: int) -> StateViews:
        """The views a step reads and writes, made once: ``members``, ``size``,
        ``base`` and ``left`` change in place only (a new layout is a new state)."""
        if self._views is None:
            b, levels, h, width, _ = self.members.shape
            rows = self.members.view(b * levels * h, width, -1)
            self._views = StateViews(
                queries_t=rows[..., :dim].transpose(1, 2),
                keys_t=rows[..., dim:2 * dim].transpose(1, 2), values=rows[..., 2 * dim:],
                size_row=self.size.unsqueeze(2), size_col=self.size.view(b * levels, width, 1),
                left_rows=self.left.view(b, levels, -1), left_count=self.left[..., -1],
                flat_members=self.members.view(b * levels, h, width, -1),
                flat_base=self.base.view(b * levels, h, width), flat_size=self.size.view(-1),
                flat_left=self.left.view(b * levels, h, -1))
        return self._views

    @classmethod
    def empty(cls, batch: int, depth: int, width: int, heads: int, dim: int, dim_v: int,
              dtype: torch.dtype, device: torch.device) -> CacheState:
        """All-zero state (every slot and level empty)."""
        def zeros(*shape):
            return torch.zeros(shape, dtype=dtype, device=device)
        f = 2 * dim + dim_v + 1
        return cls(members=zeros(batch, depth, heads, width, f - 1),
                   size=zeros(batch, depth, width), base=zeros(batch, depth, heads, width),
                   left=zeros(batch, depth, heads, f), child=zeros(batch, depth, heads, f),
                   child_gain=zeros(batch, depth, heads, width),
                   child_base=zeros(batch, depth, heads))

    def tensors(self) -> Dict[str, Tensor]:
        """The state tensors by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def capacity(self) -> Tuple[int, int]:
        """``(L, W)``."""
        return (self.members.shape[1], self.members.shape[3])

    def nbytes(self) -> int:
        """Bytes held by the state tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def padded(self, depth: int, width: int) -> CacheState:
        """The state grown (with zeros: empty) to ``depth`` levels of ``width`` slots."""
        out = {}
        for name, t in self.tensors().items():
            shape = list(t.shape)
            shape[1] = depth
            if name in self.WIDTH_DIM:
                shape[self.WIDTH_DIM[name]] = width
            if list(t.shape) == shape:
                out[name] = t
                continue
            new = t.new_zeros(shape)
            new[tuple(slice(0, n) for n in t.shape)] = t
            out[name] = new
        return CacheState(**out)

    def select(self, rows: Tensor) -> CacheState:
        """The sequences at ``rows`` (a device long tensor), in that order."""
        return CacheState(**{name: t.index_select(0, rows)
                             for name, t in self.tensors().items()})

    def cat(self, other: CacheState) -> CacheState:
        """This batch followed by ``other`` (of the same capacity)."""
        mine, theirs = self.tensors(), other.tensors()
        return CacheState(**{name: torch.cat([t, theirs[name]]) for name, t in mine.items()})


@dataclass(frozen=True)
class StateViews:
    """Views of a :class:`CacheState` (``F`` features of a sum row, ``F' = F - 1``).

    Attributes:
        queries_t, keys_t: ``[B L H, D, W]``, :math:`r_q^T` and :math:`r_k^T` of the
            members (the open nodes' heads as one batch of matrices, for ``bmm``).
        values: ``[B L H, W, Dv]``, their :math:`r_v`.
        size_row, size_col: ``[B, L, 1, W]`` and ``[B L, W, 1]``, :math:`n(C)`.
        left_rows: ``[B, L, H F]``; left_count: ``[B, L, H]``, the left sums' counts.
        flat_members, flat_base, flat_size, flat_left: the open nodes flattened to
            ``B L`` rows (``[B L, H, W, F']``, ``[B L, H, W]``, ``[B L W]``,
            ``[B L, H, F]``), for the per-sequence gathers and scatters.
    """

    queries_t: Tensor
    keys_t: Tensor
    values: Tensor
    size_row: Tensor
    size_col: Tensor
    left_rows: Tensor
    left_count: Tensor
    flat_members: Tensor
    flat_base: Tensor
    flat_size: Tensor
    flat_left: Tensor


@dataclass(frozen=True)
class StepPlan:
    """Where one :meth:`BatchedHSACache.step` puts each sequence's new leaf, as host
    int64 arrays (so that no capacity or validity decision waits on the device).

    Attributes:
        attach: ``[B]``, the depth the new leaf descends from (``-1``: a first token).
        depth: ``[B]``, the new leaf's depth.
        rows: ``[P]``, the sequences whose open child at level ``attach`` completes.
        level: ``[P]``, their ``attach``.
        slots: ``[P]``, the slot it takes (the level's count of completed children).
        closed: ``[B, L]``, levels whose open node closes (between ``attach`` and the
            previous leaf), or ``None`` where no sequence closes one.
    """

    attach: np.ndarray
    depth: np.ndarray
    rows: np.ndarray
    level: np.ndarray
    slots: np.ndarray
    closed: Optional[np.ndarray]


@dataclass(frozen=True)
class LeftSiblings:
    r"""What the completed children :math:`C` of every open node contribute to its
    open child :math:`S` (see :func:`left_siblings`), every level at once ``[B, L, H]``
    (``theta_bar`` ``[B, L, H, Dv]``): :math:`\eta_i(S)`, :math:`\bar\theta_i(S)`, and
    the two coefficients of the parent's :math:`\lambda` (see :func:`spine_step`)
    ``offset`` :math:`= \mathrm{total} / n_i(A)` and ``weight`` :math:`= n_i(S) /
    n_i(A)`, and ``gain`` ``[B, L, H, W]``, each completed child's :math:`G(C)` with
    :math:`S` added (see :class:`CacheState`)."""

    eta: Tensor
    theta_bar: Tensor
    offset: Tensor
    weight: Tensor
    gain: Tensor


@dataclass(frozen=True)
class CacheLevel:
    """One open spine node of :class:`HSACache`: ``size`` completed children kept."""

    size: int


def spine_sums(left_rows: Tensor, leaf: Tensor, upper: Tensor) -> Tensor:
    r"""The sum rows of every level's open child :math:`S_l` (the new leaf's ancestor
    at depth :math:`l + 1`), ``[B, L, H, F]``:
    :math:`\mathrm{sum}(S_l) = \mathrm{leaf} + \sum_{l' > l} \mathrm{left}_{l'}`, one
    matmul with the strictly upper triangular ones ``upper`` ``[L, L]`` (a sum, not a
    difference of prefix sums: no cancellation). Levels at or below the leaf get the
    leaf alone (their ``left`` is 0). ``left_rows``: the left sums ``[B, L, H F]``, ``leaf``
    ``[B, H, F]``."""
    b, levels = left_rows.shape[:2]
    sums = torch.baddbmm(leaf.view(b, 1, -1), upper.expand(b, levels, levels), left_rows)
    return sums.view(b, levels, *leaf.shape[1:])


def left_siblings(state: CacheState, sums: Tensor, dim: int, scale: float,
                  logaddexp: Callable[[Tensor, Tensor], Tensor]) -> LeftSiblings:
    r"""What the completed children :math:`C` of each open node contribute to its open
    child :math:`S` (sum rows ``sums`` ``[B, L, H, F]``, ``dim`` = D), every level in one
    pass of batched matmuls:

    .. math::
        z(S_i, C) = s \langle r_q(S_i), r_k(C)\rangle + \log n(C), \quad
        \eta_i(S) = \mathrm{logsumexp}_C\, z(S_i, C), \quad
        \bar\theta_i(S) = \mathrm{softmax}_C(z(S_i, \cdot))\, r_v,\\
        \mathrm{total} = \textstyle\sum_C n(C)\, \mathrm{logaddexp}\big(G(C),\
            s\langle r_q(C), r_k(S_i)\rangle + \log n_i(S)\big), \quad
        n_i(A) = n_i(S) + \textstyle\sum_C n(C),

    with :math:`r(S_i)` the means over :math:`S`'s leaves so far and :math:`G` as in
    :class:`CacheState`; empty slots drop out through :math:`\log n = -\infty` and
    :math:`n = 0`. Levels without a completed child get :math:`\eta = -\infty`, ``offset``
    0 and ``weight`` 1 (so :math:`\mu = 1` there) and a finite, unused
    :math:`\bar\theta`.
    """
    b, levels, h, f = sums.shape
    count = sums[..., -1]                                               # [B, L, H]
    views = state.views(dim)
    each = sums.view(-1, 1, f)                                          # [B L H, 1, F]
    row_dots = torch.bmm(each[..., :dim], views.keys_t).view(b, levels, h, -1)
    col_dots = torch.bmm(each[..., dim:2 * dim], views.queries_t).view(b, levels, h, -1)
    inverse = count.reciprocal().unsqueeze(-1)                          # sums -> means
    row = torch.addcmul(views.size_row.log(), row_dots, inverse, value=scale)
    col = torch.addcmul(count.log().unsqueeze(-1), col_dots, inverse, value=scale)
    # logsumexp and softmax from one exp (torch.logsumexp is a dozen kernels); a level
    # without completed children (every logit -inf) gets eta = -inf and weights 0
    finfo = torch.finfo(row.dtype)
    peak = row.amax(-1, keepdim=True).clamp_min_(finfo.min)
    weights = (row - peak).exp_()
    total_w = weights.sum(-1, keepdim=True)
    eta = total_w.log().add_(peak).squeeze(-1)
    weights.div_(total_w.clamp_min_(finfo.tiny))
    theta_bar = torch.bmm(weights.view(-1, 1, weights.shape[-1]), views.values)
    gain = logaddexp(state.base, col)
    total = torch.bmm(gain.view(b * levels, h, -1), views.size_col).view(b, levels, h)
    parent_count = count + views.left_count
    return LeftSiblings(eta=eta, theta_bar=theta_bar.view(b, levels, h, -1),
                        offset=total / parent_count, weight=count / parent_count, gain=gain)


def spine_step(lam: Tensor, eta: Tensor, offset: Tensor, weight: Tensor,
               logaddexp: Callable[[Tensor, Tensor], Tensor]) -> Tuple[Tensor, Tensor]:
    r"""One step up the spines, from the open children :math:`S` to their parents
    :math:`A` (all ``[B, H]``):

    .. math::
        \lambda_i(A) = \frac{\mathrm{total} + n_i(S)\,
            \mathrm{logaddexp}(\lambda_i(S), \eta_i(S))}{n_i(A)}
        = \mathrm{offset} + \mathrm{weight} \cdot \mathrm{logaddexp}(\lambda_i(S),
            \eta_i(S)).

    A level without completed children (offset 0, weight 1, :math:`\eta = -\infty`)
    passes :math:`\lambda` through: unary nodes are transparent.

    Returns:
        :math:`\lambda_i(A)` and :math:`\mathrm{logaddexp}(\lambda_i(S), \eta_i(S))`
        (for :math:`\log\mu_i(S) = \lambda_i(S) - ` it).
    """
    through = logaddexp(lam, eta)
    return torch.addcmul(offset, weight, through), through


def top_down(log_mu: Tensor, theta_bar: Tensor, v: Optional[Tensor]) -> Tensor:
    r"""The output from the spine, root first: with :math:`m_l = \prod_{l' < l}
    \mu_{l'}` (``log_mu`` ``[B, L + 1, H]``: a 0, then :math:`\log\mu_l` root first;
    ``theta_bar`` ``[B, L, H, Dv]``),

    .. math::
        y = \sum_l (m_l - m_{l + 1})\, \bar\theta_l \;(+\ m_L\, v_i),

    :math:`m_l - m_{l+1} = m_l (1 - \mu_l)`; ``v`` ``[B, H, Dv]`` is the leaf's own value
    (``None`` without ``include_self``)."""
    # log m: prefix sums behind the 0 (shifted, not subtracted: log mu is -inf for a
    # leaf that skips itself)
    m = torch.cumsum(log_mu, 1).exp_()                                  # [B, L + 1, H]
    share = m[:, :-1] - m[:, 1:]
    y = (share.unsqueeze(-1) * theta_bar).sum(1)
    return y if v is None else torch.addcmul(y, m[:, -1].unsqueeze(-1), v)


_INT64 = np.iinfo(np.int64)


def _in_int64(name: str, value: int) -> int:
    """``value`` where a host int64 array can hold it; else a ValueError naming it (a
    larger int would overflow numpy with an OverflowError)."""
    if not _INT64.min <= value <= _INT64.max:
        raise ValueError(f"{name} = {value} is out of range (a depth fits in 64 bits)")
    return value


def _filled(name: str, value: int, batch: int) -> np.ndarray:
    """``[B]`` copies of the int placement ``value``."""
    return np.full(batch, _in_int64(name, value), np.int64)


def _placement(name: str, value: Placement, batch: int) -> Tuple[np.ndarray, np.ndarray]:
    """``attach`` / ``depth`` as given -> host int64 values ``[B]`` and whether each row
    gave one ``[B]``."""
    if value is None:
        return np.zeros(batch, np.int64), np.zeros(batch, bool)
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, a sequence of B = {batch} ints (or None) "
                        f"or an integer tensor [B], got a bool")
    if isinstance(value, int):
        return _filled(name, value, batch), np.ones(batch, bool)
    if isinstance(value, Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"{name} must have one entry per sequence (B = {batch}), got "
                             f"shape {tuple(value.shape)}")
        return value.to("cpu", torch.long).numpy(), np.ones(batch, bool)
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
    given = np.array([entry is not None for entry in value], bool)
    values = np.array([0 if entry is None else _in_int64(f"{name}[{row}]", entry)
                       for row, entry in enumerate(value)], np.int64)
    return values, given




@functools.cache
def _load_step_kernel() -> Optional[Callable]:
    """:func:`hsa_graph.ops.step_kernel.fused_step`, or ``None`` where numba is
    installed but cannot be imported (said once, in a warning)."""
    try:
        from .step_kernel import fused_step
    except Exception as error:  # e.g. a numba built for another numpy
        warnings.warn(f"numba is installed but cannot be imported ({error}): "
                      "BatchedHSACache.step runs its eager path", RuntimeWarning,
                      stacklevel=3)
        return None
    return fused_step


def _fused_step_kernel(q: Tensor, k: Tensor, v: Tensor) -> Optional[Callable]:
    """The fused step kernel where it applies to these tokens (already of the
    state's dtype): numba installed (:data:`hsa_graph.typing.WITH_NUMBA`), CPU
    tensors of float32 or float64, and no autograd recording (a step writes the state
    in place, so neither path is differentiable; the eager one's graph is kept)."""
    if (not accelerators.WITH_NUMBA or q.device.type != "cpu"
            or q.dtype not in (torch.float32, torch.float64) or records_grad(q, k, v)):
        return None
    return _load_step_kernel()


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
        self._state: Optional[CacheState] = None
        self._upper_ones: Optional[Tensor] = None     # spine_sums' [L, L], per capacity
        # host-side counters (numpy: a step's bookkeeping is a few small-array ops,
        # each a tenth of a torch op's dispatch): placements are host values, so
        # capacity and validity decisions never wait on the device
        self._count = np.zeros((batch_size, 1), np.int64)   # [B, L] completed children
        self._depth = np.zeros(batch_size, np.int64)        # newest leaf's depth
        self._tokens = np.zeros(batch_size, np.int64)
        # host-side facts of the batch, derived lazily (None: to derive again)
        self._started: Optional[bool] = None     # every sequence holds a token
        self._rows: Optional[np.ndarray] = None  # arange(B)

    def _all_started(self) -> bool:
        """Whether every sequence holds a token (no first tokens in this step)."""
        if self._started is None:
            self._started = bool(self.batch_size) and bool((self._tokens > 0).all())
        return self._started

    def _all_rows(self) -> np.ndarray:
        if self._rows is None or self._rows.shape[0] != self.batch_size:
            self._rows = np.arange(self.batch_size)
        return self._rows

    def _membership_changed(self) -> None:
        self._started, self._rows = None, None

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
        return self._state.capacity

    def state_bytes(self, per_sequence: bool = False) -> int:
        """Bytes of the cache state (device tensors and host counters); with
        ``per_sequence`` divided by ``B`` (the state is padded to the widest
        sequence)."""
        total = sum(t.nbytes for t in (self._count, self._depth, self._tokens))
        if self._state is not None:
            total += self._state.nbytes()
        return total // max(1, self.batch_size) if per_sequence else total

    @staticmethod
    def bytes_for(depth: int, width: int, heads: int, dim: int, dim_v: Optional[int] = None,
                  dtype: torch.dtype = torch.float32) -> int:
        """State bytes of one sequence whose open nodes over ``depth`` levels hold at most
        ``width`` completed children each (``heads`` x ``dim`` queries and keys, ``dim_v``
        values, ``dim`` by default), without building it."""
        dim_v = dim if dim_v is None else dim_v
        h = heads
        wide = width * (h * (2 * dim + dim_v) + 1 + 2 * h)    # members, size, base, col
        deep = 2 * h * (2 * dim + dim_v + 1) + h              # left, child, child_base
        item = torch.empty((), dtype=dtype).element_size()
        return depth * (wide + deep) * item + depth * 8 + 16

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(batch_size={self.batch_size}, "
                f"tokens={self.num_tokens}, depths={self.depths}, "
                f"capacity={self.capacity})")

    # ----------------------------------------------------------------- state layout
    def _device(self) -> torch.device:
        return self.token_spec[4]

    def _empty_state(self, batch: int, depth: int, width: int) -> CacheState:
        h, d, dv, dtype, device = self.token_spec
        return CacheState.empty(batch, depth, width, h, d, dv, compute_dtype(dtype), device)

    def _pad_count(self, depth: int) -> None:
        if self._count.shape[1] < depth:
            self._count = np.pad(self._count, ((0, 0), (0, depth - self._count.shape[1])))

    def _ensure(self, depth: int, width: int) -> None:
        """Grow the padded state to hold ``depth`` levels of ``width`` children (the
        width doubles, so that growing costs amortised O(1) per token)."""
        cur_l, cur_w = self.capacity
        if depth <= cur_l and width <= cur_w:
            return
        new_l = max(cur_l, depth)
        new_w = cur_w if width <= cur_w else max(width, 2 * cur_w)
        self._state = self._state.padded(new_l, new_w)
        self._pad_count(new_l)

    def _set_spec(self, spec: tuple) -> None:
        """Fix the token spec; a held state must match it (a batch whose sequences hold
        no token yet may change it)."""
        if self.token_spec == spec and self._state is not None:
            return
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
            self._pad_count(self._state.capacity[0])

    def _scale(self) -> float:
        return (1.0 / math.sqrt(self.token_spec[1]) if self.scale is None
                else float(self.scale))

    def _upper(self, levels: int) -> Tensor:
        """The strictly upper triangular ones ``[L, L]`` of :func:`spine_sums`."""
        held = self._upper_ones
        if held is None or held.shape[0] != levels or held.dtype != self._state.left.dtype:
            held = torch.ones(levels, levels, dtype=self._state.left.dtype,
                              device=self._device()).triu_(1)
            self._upper_ones = held
        return held

    # ----------------------------------------------------------------- sequences
    def add(self, count: int = 1) -> List[int]:
        """Start ``count`` empty sequences (their first :meth:`step` opens their root);
        returns their row indices. The other sequences are not touched."""
        self._membership_changed()
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        first = self.batch_size
        self._count = np.pad(self._count, ((0, count), (0, 0)))
        self._depth = np.pad(self._depth, (0, count))
        self._tokens = np.pad(self._tokens, (0, count))
        if self._state is not None:
            depth, width = self.capacity
            self._state = self._state.cat(self._empty_state(count, depth, width))
        return list(range(first, first + count))

    def drop(self, indices: Union[int, Sequence[int], Tensor]) -> None:
        """Remove the sequences at rows ``indices``; the others keep their state and
        order (row ``r`` moves down by the number of dropped rows before it).

        Raises:
            ValueError: an index outside ``0 .. B - 1`` or given twice.
            TypeError: a non-integer index.
        """
        self._membership_changed()
        b = self.batch_size
        kept = kept_rows(indices, b)
        rows = kept.numpy()
        self._count, self._depth = self._count[rows], self._depth[rows]
        self._tokens = self._tokens[rows]
        if self._state is not None:
            kept = kept.to(self._device())
            self._state = self._state.select(kept)

    def extend(self, other: BatchedHSACache) -> List[int]:
        """Move the sequences of ``other`` (same ``include_self``, ``scale`` and token
        shapes) to the end of this batch; returns their new row indices. ``other`` is
        left empty."""
        self._membership_changed()
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
            self._state = self._state.padded(depth, width).cat(
                other._state.padded(depth, width))
            self._pad_count(depth)
            other._pad_count(depth)
        elif self._state is not None:
            other._pad_count(self._count.shape[1])
            other._state = self._empty_state(other.batch_size, *self.capacity)
            self._state = self._state.cat(other._state)
        self._pad_count(other._count.shape[1])
        self._count = np.concatenate([self._count, other._count])
        self._depth = np.concatenate([self._depth, other._depth])
        self._tokens = np.concatenate([self._tokens, other._tokens])
        other.drop(list(range(other.batch_size)))
        return list(range(first, self.batch_size))

    # ----------------------------------------------------------------- one step
    def _check_tokens(self, q: Tensor, k: Tensor, v: Tensor,
                      check_finite: bool) -> Tuple[Tensor, Tensor, Tensor]:
        check_step_tokens(q, k, v, self.batch_size, check_finite)
        self._set_spec((q.shape[1], q.shape[2], v.shape[2], q.dtype, q.device))
        dtype = compute_dtype(q.dtype)
        if dtype == q.dtype:
            return q, k, v
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def _placements(self, attach: Placement, depth: Placement
                    ) -> Tuple[np.ndarray, np.ndarray]:
        """Checked per-row ``attach`` (``-1``: a sequence's first token) and ``depth``,
        as host arrays ``[B]``: one vectorised test of every rule, and the detailed
        message (:meth:`_refuse`) only for a call that breaks one."""
        b, prev = self.batch_size, self._depth
        started = self._all_started()
        if depth is None:               # the previous depth: nothing to refuse
            new_depth = prev if started else np.maximum(prev, 1)
            bad = None
        else:
            if isinstance(depth, int) and not isinstance(depth, bool):
                new_depth = _filled("depth", depth, b)
            else:
                depth_v, given = _placement("depth", depth, b)
                new_depth = np.where(given, depth_v, np.maximum(prev, 1))
            bad = (new_depth < 1) | (new_depth > self.max_depth)
        # the deepest attach allowed; -1 for a first token (a sequence without tokens)
        highest = prev - 1 if depth is None else np.minimum(prev, new_depth) - 1
        if attach is None:              # the same family: always allowed
            attach_v = highest
        elif started and isinstance(attach, int) and not isinstance(attach, bool):
            if attach < 0 or attach > int(highest.min()):
                self._refuse(attach, depth)
            attach_v = _filled("attach", attach, b)
        else:
            if isinstance(attach, int) and not isinstance(attach, bool):
                attach_v = _filled("attach", attach, b)
            else:
                value, given = _placement("attach", attach, b)
                attach_v = np.where(given, value, highest)
            wrong = (attach_v > highest) | (attach_v < np.minimum(highest, 0))
            bad = wrong if bad is None else bad | wrong
        if bad is not None and bool(bad.any()):
            self._refuse(attach, depth)
        return attach_v, new_depth

    def _refuse(self, attach: Placement, depth: Placement) -> None:
        """Raise the error for the first broken placement rule (rule order, then row)."""
        b = self.batch_size
        prev = self._depth
        depth_v, depth_given = _placement("depth", depth, b)
        bad = depth_given & (depth_v < 1)
        if bool(bad.any()):
            r = first_true(bad)
            raise ValueError(f"depth[{r}] must be an int >= 1 (leaves hang below a root), "
                             f"got {int(depth_v[r])}")
        new_depth = np.where(depth_given, depth_v, np.maximum(prev, 1))
        bad = new_depth > self.max_depth
        if bool(bad.any()):
            r = first_true(bad)
            raise ValueError(f"depth[{r}] = {int(new_depth[r])} exceeds max_depth="
                             f"{self.max_depth} of this cache (pass max_depth=... for "
                             "deeper trees)")
        attach_v, attach_given = _placement("attach", attach, b)
        fresh = prev == 0
        bad = fresh & attach_given & (attach_v != -1)
        if bool(bad.any()):
            r = first_true(bad)
            raise ValueError(f"attach[{r}]: sequence {r} has no token yet, so its first "
                             f"token opens the root: attach must be None, got "
                             f"{int(attach_v[r])}")
        highest = np.minimum(prev, new_depth) - 1
        attach_v = np.where(fresh, -1, np.where(attach_given, attach_v, highest))
        r = first_true(~fresh & ((attach_v < 0) | (attach_v > highest)))
        raise ValueError(
            f"attach[{r}] must be a depth in 0..{int(highest[r])} (sequence {r}'s "
            f"previous leaf is at depth {int(prev[r])}, the new one at depth "
            f"{int(new_depth[r])}), got {int(attach_v[r])}")

    def _plan(self, attach: Placement, depth: Placement) -> StepPlan:
        """The checked placements, the completing children and the closing levels (host
        arrays only); grows the state to hold them."""
        attach_v, new_depth = self._placements(attach, depth)
        if self._all_started():         # every sequence closes a child
            rows, level = self._all_rows(), attach_v
        else:
            rows = np.flatnonzero(attach_v >= 0)
            level = attach_v[rows]
        slots = self._count[rows, level]
        width = int(slots.max()) + 1 if rows.size else 1
        # the previous depth fits the state already
        self._ensure(self.capacity[0] if depth is None else int(new_depth.max()), width)
        # open nodes strictly between attach and the previous leaf close; the levels
        # at or below the previous leaf are empty already (CacheState's invariant)
        closed = None
        if (attach is not None or depth is not None) and bool(
                (attach_v < self._depth - 1).any()):
            levels = np.arange(self._count.shape[1])
            closed = (levels > attach_v[:, None]) & (levels < self._depth[:, None])
        return StepPlan(attach=attach_v, depth=new_depth, rows=rows, level=level,
                        slots=slots, closed=closed)

    def step(self, q: Tensor, k: Tensor, v: Tensor, *, attach: Placement = None,
             depth: Placement = None, check_finite: bool = False) -> Tensor:
        r"""Add one leaf to every sequence and return their causal HSA outputs.

        Per call: a handful of batched matmuls over all ``[B, L]`` open nodes (see
        :func:`left_siblings`), a ``B``-wide recursion of ``L`` steps on ``[B, H]``
        (:func:`spine_step`), and the update of the one level per sequence whose open
        child completes (:meth:`_push`); no host-device synchronisation unless
        ``check_finite``. On the CPU in float32 or float64 with numba installed, and
        where autograd records nothing, all of it is one call of the fused kernel
        (:mod:`hsa_graph.ops.step_kernel`; compiled at the first step of each dtype,
        about 2 s, then cached on disk).

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
            check_finite: when ``True``, a NaN or inf in a token raises (naming the
                row) instead of spreading into that sequence's state; off by default,
                as in :func:`~hsa_graph.ops.causal.causal_hsa`, because the check
                waits on the device.

        Returns:
            ``[B, H, Dv]`` in the tokens' dtype; row ``b`` equals the newest row of
            :func:`~hsa_graph.ops.causal.causal_hsa` on sequence ``b``'s tree so far.

        Raises:
            ValueError: shapes that do not fit ``B`` or each other, tokens of another
                shape, dtype or device than the cache holds, a bad placement (each
                naming the row), or (``check_finite``) a NaN or inf in a row.
            TypeError: non-tensors, mixed dtypes, non-integer placements.
        """
        q, k, v = self._check_tokens(q, k, v, check_finite)
        plan = self._plan(attach, depth)
        kernel = _fused_step_kernel(q, k, v)
        if kernel is not None:          # push, close and climb in one compiled call
            y = kernel(self._state, plan, q, k, v, self._scale(), self.include_self)
        else:
            # the state is updated in place, so a step is not differentiable (as
            # before): torch's logaddexp, not the NaN-free backward of ops.hsa
            with no_autocast(q.device):
                if plan.rows.size:
                    self._push(plan)
                if plan.closed is not None:
                    self._close(plan.closed)
                y = self._climb(q, k, v, torch.logaddexp)
        self._count[plan.rows, plan.level] = plan.slots + 1
        if plan.closed is not None:
            self._count[plan.closed] = 0
        self._depth = plan.depth
        self._tokens += 1
        self._started = True
        return y.to(self.token_spec[3])

    def _push(self, plan: StepPlan) -> None:
        r"""Close the open child :math:`X` at level ``attach`` of each sequence in
        ``plan.rows``: it takes slot ``plan.slots`` of its parent's completed children
        with :math:`G(X) = \mathrm{logaddexp}(\lambda(X), \mathrm{logsumexp}_C\, z(X, C)
        + \log n(C))`, and every old :math:`G(C)` gains :math:`z(C, X) + \log n(X)`.
        The newest step computed both for :math:`X` as the open child
        (``child_base``, ``child_gain``): gathers and scatters only."""
        st, dev, d = self._state, self._device(), self.token_spec[1]
        b, levels, h, f = st.child.shape
        width = st.members.shape[3]
        node = plan.rows * levels + plan.level                             # [P] in B L
        # each head of the node and its slot, [P H] in B L H and in B L H W: flat
        # index_copy_ (a put at [node, :, slot] is advanced indexing's slow path)
        node_head = (node[:, None] * h + np.arange(h)).ravel()
        head_slot = (node_head.reshape(-1, h) * width + plan.slots[:, None]).ravel()
        node_slot = node * width + plan.slots                              # [P] in B L W
        # one host -> device copy for all four
        index = torch.from_numpy(np.concatenate([node, node_slot, node_head, head_slot]))
        node, node_slot, node_head, head_slot = index.to(dev).split(
            [node.size, node.size, node_head.size, node_head.size])
        views = st.views(d)
        child = st.child.view(b * levels, h, f).index_select(0, node)      # [P, H, F]
        size_x = child[..., -1:]                                           # [P, H, 1]
        views.flat_base.index_copy_(
            0, node, st.child_gain.view(b * levels, h, width).index_select(0, node))
        st.base.view(-1).index_copy_(
            0, head_slot, st.child_base.view(-1).index_select(0, node_head))
        means = (child[..., :-1] / size_x).view(-1, f - 1)                 # r_q | r_k | r_v
        st.members.view(-1, f - 1).index_copy_(0, head_slot, means)
        views.flat_size.index_copy_(0, node_slot, size_x[:, 0, 0])
        views.flat_left.index_add_(0, node, child)

    def _close(self, closed: np.ndarray) -> None:
        """Empty the levels ``closed`` ``[B, L]`` (a host mask: their open nodes close
        for good)."""
        mask = torch.from_numpy(closed).to(self._device())
        self._state.left.masked_fill_(mask[..., None, None], 0.0)
        self._state.size.masked_fill_(mask[..., None], 0.0)

    def _climb(self, q: Tensor, k: Tensor, v: Tensor,
               logaddexp: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        r"""The new leaves' spines, every level at once (:func:`spine_sums`,
        :func:`left_siblings`), the recursion of :math:`\lambda` up them
        (:func:`spine_step`, deepest level first), then the top-down sum
        (:func:`top_down`); the open children's rows become the new state."""
        st, scale = self._state, self._scale()
        b, levels, h = st.child_base.shape
        leaf = torch.cat([q, k, v, q.new_ones(b, h, 1)], -1)               # [B, H, F]
        sums = spine_sums(st.views(q.shape[-1]).left_rows, leaf, self._upper(levels))
        sib = left_siblings(st, sums, q.shape[-1], scale, logaddexp)
        lam = (torch.linalg.vecdot(q, k) * scale if self.include_self
               else q.new_full((b, h), NEG_INF))
        lams, throughs = [], []
        for eta, offset, weight in zip(sib.eta.unbind(1)[::-1], sib.offset.unbind(1)[::-1],
                                       sib.weight.unbind(1)[::-1]):
            lams.append(lam)
            lam, through = spine_step(lam, eta, offset, weight, logaddexp)
            throughs.append(through)
        through = torch.stack(throughs[::-1], 1)                           # [B, L, H]
        # top_down's log mu behind a 0 (log m_0: the root's mass is 1)
        log_mu = torch.stack([lam.new_zeros(b, h), *lams[::-1]], 1)
        log_mu[:, 1:].sub_(through)
        if not self.include_self:   # a leaf that skips itself: -inf - -inf is 0 here
            log_mu[:, 1:].masked_fill_(through == NEG_INF, 0.0)
        st.child, st.child_gain, st.child_base = sums, sib.gain, through
        return top_down(log_mu, sib.theta_bar, v if self.include_self else None)

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
        from .causal import _causal_hsa, _leaf_lam

        x = prepare_attention(q, k, v, tree, include_self=self.include_self,
                              scale=self.scale, check_finite=True)
        st = x.structure
        st.check_contiguous("prefill")
        if st.num_leaves == 0:
            raise ValueError("prefill needs at least one prompt token")
        if x.single_head:
            raise ValueError(f"q must have shape [N, H, D], got {tuple(q.shape)}")
        dt = x.dtype
        leaf_depth = st.depth[:st.num_leaves]
        if bool((leaf_depth == 0).any()):
            raise ValueError(f"prefill needs every leaf below a root, but leaf row "
                             f"{first_true((leaf_depth == 0).cpu())} is a tree of its own")
        spec = (x.q.shape[1], x.q.shape[2], x.v.shape[2], q.dtype, q.device)
        depth_host, spine = _prompt_spines(st, self.max_depth)
        p, levels = spine.shape[0], spine.shape[1] - 1
        child, group, slot, per_group = _completed_children(st, spine)
        width = max(1, int(per_group.max()) if child.numel() else 1)

        stats = hsa_statistics(st, x.q, x.k, self.include_self, x.scale, None, v=x.v,
                               leaf_mass=False)
        size = st.node_size_as(dt)
        lam = torch.cat([_leaf_lam(st, x.q, x.k, self.include_self, x.scale, None),
                         stats.lam_internal])                             # [M + 1, H]
        means = ((x.q, stats.rq), (x.k, stats.rk), (x.v, stats.rv))   # leaf, internal

        fresh = BatchedHSACache(p, self.include_self, self.scale, self.max_depth)
        fresh.token_spec = spec
        state = fresh._empty_state(p, levels, width)
        _fill_prompt_state(state, st, means, size, lam, child, group, slot, spine,
                           per_group.view(p, levels), x.scale)
        fresh._state = state
        fresh._count = per_group.view(p, levels).cpu().numpy()
        fresh._depth = depth_host.numpy().copy()
        fresh._tokens = torch.bincount(st.leaf_tree, minlength=p).cpu().numpy()
        self.extend(fresh)
        if not return_outputs:
            return None
        with no_autocast(x.device):  # the statistics above serve the outputs too
            y = _causal_hsa(st, st.causal_plan, x.q, x.k, x.v, self.include_self, x.scale,
                            None, stats=stats)
        return x.finish(y)


def _prompt_spines(st: TreeStructure, max_depth: int) -> Tuple[Tensor, Tensor]:
    """The spine of each prompt tree (the ancestors of its last leaf): the last leaf's
    depth per tree (host) ``[P]`` and the spine's unified nodes by depth
    ``[P, levels + 1]`` (``-1`` below a shorter spine); one hop per depth level."""
    n, p = st.num_leaves, st.num_trees
    rows = torch.arange(n, device=st.device)
    last = torch.full((p,), -1, dtype=torch.long, device=st.device).scatter_reduce(
        0, st.leaf_tree, rows, "amax")
    depth_host = st.depth[last].cpu()
    too_deep = depth_host > max_depth
    if bool(too_deep.any()):
        t = first_true(too_deep)
        raise ValueError(f"prompt {t} ends at depth {int(depth_host[t])}, beyond "
                         f"max_depth={max_depth} of this cache")
    levels = int(depth_host.max())
    parent_u = st.parent_unified()
    spine = torch.full((p, levels + 1), -1, dtype=torch.long, device=st.device)
    tree_of = torch.arange(p, device=st.device)
    current = last
    for _ in range(levels + 1):
        alive = current >= 0
        safe = current.clamp_min(0)
        spine[tree_of[alive], st.depth[safe[alive]]] = current[alive]
        current = torch.where(alive, parent_u[safe], current)
    return depth_host, spine


def _completed_children(st: TreeStructure, spine: Tensor
                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The completed children of every spine node (off the spine, below it), in leaf
    order: their unified ids, group ``tree * levels + parent depth``, slot in the
    group, and the group sizes ``[P * levels]``."""
    p, levels = spine.shape[0], spine.shape[1] - 1
    n, nodes = st.num_leaves, st.num_nodes
    on_spine = torch.zeros(nodes + 1, dtype=torch.bool, device=st.device)
    on_spine[spine.flatten()] = True
    on_spine[-1] = False                           # the -1 padding entries
    par = st.parent_unified()
    done = (~on_spine[:nodes]) & (par >= 0) & on_spine[par.clamp_min(0)]
    child = done.nonzero().squeeze(1)
    first_leaf = st.leaf_ranges[0]
    group = st.leaf_tree[first_leaf[child]] * levels + st.depth[par[child]]
    order = torch.argsort(group * (n + 1) + first_leaf[child])
    child, group = child[order], group[order]
    per_group = torch.bincount(group, minlength=p * levels)
    start = torch.cumsum(per_group, 0) - per_group
    slot = torch.arange(child.numel(), device=st.device) - start[group]
    return child, group, slot, per_group


def _fill_prompt_state(state: CacheState, st: TreeStructure,
                       means: Sequence[Tuple[Tensor, Tensor]], size: Tensor, lam: Tensor,
                       child: Tensor, group: Tensor, slot: Tensor, spine: Tensor,
                       count: Tensor, scale: float) -> None:
    r"""Write the state that stepping through the prompts would leave into the empty
    ``state`` (``P`` prompts, ``L`` levels) of :meth:`BatchedHSACache.prefill`.

    Args:
        st: the prompts' structure (it reads unified node ids).
        means: the per-node means of ``q``, ``k``, ``v`` as ``(leaf rows [N, H, .],
            internal rows [I + 1, H, .])`` (unified id ``M``, the last internal row: a
            padding node of size 1); size: ``[M + 1]``; lam: :math:`\lambda` ``[M + 1,
            H]``.
        child, group, slot: the completed children ``[K]``, their ``prompt * L +
            level`` and their slot.
        spine: ``[P, L + 1]``, each prompt's spine node per depth (``-1`` past its end).
        count: ``[P, L]``, completed children per open node; scale: the logit scale.
    """
    p, levels, h = state.base.shape[:3]
    dim = means[0][0].shape[-1]

    def rows(ids: Tensor) -> List[Tensor]:
        # only those rows are read: tables of every node would copy the whole prompt
        return [st.unified_rows(leaf, internal, ids) for leaf, internal in means]

    def sums(ids: Tensor) -> Tensor:                                   # [K, H, F]
        n_ids = size[ids][:, None, None]
        return torch.cat([*(m * n_ids for m in rows(ids)), n_ids.expand(-1, h, 1)], -1)

    g_seq, g_level = group // levels, group % levels
    mq, mk, mv = rows(child)
    state.members[g_seq, g_level, :, slot] = torch.cat([mq, mk, mv], -1)  # r_q | r_k | r_v
    state.size[g_seq, g_level, slot] = size[child]
    lam_slots = torch.zeros_like(state.base)
    lam_slots[g_seq, g_level, :, slot] = lam[child]
    state.left.view(p * levels, h, -1).index_add_(0, group, sums(child))
    # the open child at each level: the spine node one level down
    below = spine[:, 1:]                                              # [P, levels]
    open_ = below >= 0
    safe = below.clamp_min(0)
    open_sums = sums(safe.flatten()).view(*safe.shape, h, -1)
    state.child = torch.where(open_[..., None, None], open_sums, 0.0)
    fixed = _fixed_of(state.members, state.size, count, dim, scale)
    state.base.copy_(_logaddexp(lam_slots, fixed))     # in place: views of it live on
    # the open children's terms as a step ending at the last leaf leaves them
    # (ones where no node is open, only to keep the means finite)
    sib = left_siblings(state, torch.where(open_[..., None, None], open_sums, 1.0),
                        dim, scale, _logaddexp)
    state.child_gain = torch.where(open_[..., None, None], sib.gain, 0.0)
    state.child_base = torch.where(open_[..., None], _logaddexp(lam[safe], sib.eta), 0.0)


def _fixed_of(members: Tensor, size: Tensor, count: Tensor, dim: int, scale: float,
              block: int = 1 << 22) -> Tensor:
    r""":math:`F(C) = \mathrm{logsumexp}_{B \ne C}\, s\langle r_q(C), r_k(B)\rangle
    + \log n(B)` over the completed children of every open node, ``[P, L, H, W]``
    (``members`` and ``size`` as in :class:`CacheState`, ``count`` ``[P, L]`` children
    per node), in blocks of rows ``C`` so that the ``[.., W, W]`` logits stay
    bounded."""
    p, levels, h, width, _ = members.shape
    rq, rk = members[..., :dim], members[..., dim:2 * dim]
    keys = torch.arange(width, device=members.device)
    valid = keys < count.to(members.device)[..., None]                     # [P, L, W]
    log_n = size.log().masked_fill(~valid, NEG_INF)[:, :, None, None, :]
    rows = max(1, block // max(1, p * levels * width * h))
    parts = []
    for lo in range(0, width, rows):
        hi = min(width, lo + rows)
        z = torch.matmul(rq[..., lo:hi, :], rk.transpose(-1, -2)) * scale + log_n
        diagonal = keys[lo:hi, None] == keys[None, :]
        parts.append(torch.logsumexp(z.masked_fill(diagonal, NEG_INF), -1))
    return torch.cat(parts, 3)


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
    attach, a_given, depth, d_given = (torch.from_numpy(t) for t in (
        *_placement("attach", [m.get("attach") for m in moves], len(moves)),
        *_placement("depth", [m.get("depth") for m in moves], len(moves))))
    n = len(moves)
    rows = torch.arange(n)
    bad = d_given & (depth < 1)
    if bool(bad.any()):
        r = first_true(bad)
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
        r = first_true(bad)
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
        check_step_tokens(q, k, v, None, check_finite=False)
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
               depth: Optional[int] = None, check_finite: bool = False) -> Tensor:
        r"""Add one leaf and return its causal HSA output ``[H, Dv]``.

        Args:
            q, k: ``[H, D]``; v: ``[H, Dv]`` of the new token.
            attach: depth of the deepest open node the new leaf descends from, in
                ``0 .. min(previous depth, depth) - 1``; default: the previous leaf's
                parent (the same family).
            depth: depth of the new leaf (default: the previous leaf's; 1 for the first
                token). New internal nodes open at depths ``attach + 1 .. depth - 1``.
            check_finite: as in :meth:`BatchedHSACache.step` (off by default).

        Raises:
            ValueError: bad shapes, tokens of another shape or dtype than the cache
                holds, a bad placement, or (``check_finite``) a NaN or inf in the token.
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
        y = self.batched.step(q[None], k[None], v[None], attach=[attach], depth=[depth],
                              check_finite=check_finite)[0]
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
