r"""One fused CPU kernel for :meth:`~hsa_graph.ops.cache.BatchedHSACache.step`, compiled
with numba where it is installed (``pip install hsa_graph[numba]``).

A generation step at ``B = 1`` moves a few hundred kilobytes: the eager step is about 60
small tensor ops, each of which costs more to dispatch than to compute, so at 4,096
cached tokens it took longer than a flat KV cache's one attention call over all of them.
This kernel does the same arithmetic as the eager step in one call: for each sequence
``b`` and head ``h``,

1. *push*: the open child that completes at level ``attach`` becomes a completed child
   (its means, size and :math:`G`, computed by the step before);
2. *close*: the open nodes between ``attach`` and the previous leaf are emptied;
3. *climb*: the new leaf's spine sums :math:`\mathrm{sum}(S_l) = \mathrm{leaf} +
   \sum_{l' > l} \mathrm{left}_{l'}`, every level's sibling softmax
   (:func:`~hsa_graph.ops.cache.left_siblings`), the recursion of :math:`\lambda` up
   the spine (:func:`~hsa_graph.ops.cache.spine_step`) and the top-down sum
   (:func:`~hsa_graph.ops.cache.top_down`), writing the open children's rows back
   into the state.

Work and state are the eager step's, :math:`O(B \cdot \mathrm{depth} \cdot H \cdot W
(2D + D_v))`; dot products accumulate in float64 whatever the state's dtype. The eager
step stays the path on other devices, for other dtypes, where autograd records, and
without numba (:data:`hsa_graph.typing.WITH_NUMBA`); the tests run both. Importing this module
imports numba; :mod:`hsa_graph.ops.cache` does so at the first step that can use it.
"""
from __future__ import annotations

import functools
import math
from typing import Tuple

import numba
import numpy as np
import torch
from torch import Tensor

__all__ = ["fused_step"]

#: ``[0, 0]`` "no level closes" mask (the kernel's argument types stay fixed)
_NO_CLOSED = np.zeros((0, 0), np.bool_)


@numba.njit(cache=True, inline="always")
def _logaddexp(a, b):
    """``torch.logaddexp`` of two scalars (``-inf`` with ``-inf`` is ``-inf``)."""
    if a != a or b != b:
        return a + b
    high = max(a, b)
    if high == -np.inf or high == np.inf:
        return high
    return high + math.log1p(math.exp(-abs(a - b)))


@numba.njit(cache=True, fastmath={"reassoc", "contract"})
def _step(q, k, v, members, size, base, left, child, child_gain, child_base,
          push_rows, push_level, push_slots, closed, scale, include_self, floor, tiny, out):
    """The kernel (plain Python; numba compiles it): see the module docstring. Shapes:
    ``q, k`` ``[B, H, D]``, ``v`` ``[B, H, Dv]``, the state's tensors as
    :class:`~hsa_graph.ops.cache.CacheState` (``F = 2D + Dv + 1``), ``push_*`` ``[P]``,
    ``closed`` ``[B, L]`` or ``[0, 0]``, ``out`` ``[B, H, Dv]``."""
    batch, levels, heads, width, fm = members.shape
    dim, dim_v = q.shape[2], v.shape[2]
    last = fm                                   # the count's feature in a sum row
    neg_inf = -np.inf
    # 1. push: the completing children take their slots
    for p in range(push_rows.shape[0]):
        b, lvl, s = push_rows[p], push_level[p], push_slots[p]
        for h in range(heads):
            for w in range(width):
                base[b, lvl, h, w] = child_gain[b, lvl, h, w]
            base[b, lvl, h, s] = child_base[b, lvl, h]
            n_x = child[b, lvl, h, last]
            for f in range(fm):
                members[b, lvl, h, s, f] = child[b, lvl, h, f] / n_x
            for f in range(fm + 1):
                left[b, lvl, h, f] += child[b, lvl, h, f]
        size[b, lvl, s] = child[b, lvl, 0, last]
    # 2. close
    if closed.shape[0]:
        for b in range(batch):
            for lvl in range(levels):
                if closed[b, lvl]:
                    left[b, lvl] = 0.0
                    size[b, lvl] = 0.0
    # 3. climb, per sequence and head
    eta = np.empty(levels)
    offset = np.empty(levels)
    weight = np.empty(levels)
    theta = np.empty((levels, dim_v))
    row = np.empty(width)
    for b in range(batch):
        for h in range(heads):
            # spine sums, deepest level first: S_l = leaf + the left sums below l
            deepest = levels - 1
            for f in range(dim):
                child[b, deepest, h, f] = q[b, h, f]
                child[b, deepest, h, dim + f] = k[b, h, f]
            for f in range(dim_v):
                child[b, deepest, h, 2 * dim + f] = v[b, h, f]
            child[b, deepest, h, last] = 1.0
            for lvl in range(deepest - 1, -1, -1):
                for f in range(fm + 1):
                    child[b, lvl, h, f] = child[b, lvl + 1, h, f] + left[b, lvl + 1, h, f]
            for lvl in range(levels):
                count = child[b, lvl, h, last]
                inverse = 1.0 / count
                log_count = math.log(count)
                peak = neg_inf
                total = 0.0
                for w in range(width):
                    n_c = size[b, lvl, w]
                    row_dot = 0.0
                    col_dot = 0.0
                    for f in range(dim):
                        row_dot += child[b, lvl, h, f] * members[b, lvl, h, w, dim + f]
                        col_dot += child[b, lvl, h, dim + f] * members[b, lvl, h, w, f]
                    if n_c > 0:
                        row[w] = math.log(n_c) + scale * row_dot * inverse
                        if not row[w] <= peak:      # a NaN logit makes the peak NaN
                            peak = row[w]
                    else:
                        row[w] = neg_inf
                    col = log_count + scale * col_dot * inverse
                    gain = _logaddexp(base[b, lvl, h, w], col)
                    child_gain[b, lvl, h, w] = gain
                    if n_c > 0:
                        total += gain * n_c
                if peak < floor:
                    peak = floor
                mass = 0.0
                for w in range(width):
                    row[w] = math.exp(row[w] - peak)
                    mass += row[w]
                # NaN stays NaN here and below, as in the eager step
                eta[lvl] = neg_inf if mass == 0.0 else math.log(mass) + peak
                if mass < tiny:
                    mass = tiny
                for f in range(dim_v):
                    theta[lvl, f] = 0.0
                for w in range(width):
                    if row[w] != 0.0:
                        share = row[w] / mass
                        for f in range(dim_v):
                            theta[lvl, f] += share * members[b, lvl, h, w, 2 * dim + f]
                parent_count = count + left[b, lvl, h, last]
                offset[lvl] = total / parent_count
                weight[lvl] = count / parent_count
            # lambda up the spine, then the output top-down
            if include_self:
                lam = 0.0
                for f in range(dim):
                    lam += q[b, h, f] * k[b, h, f]
                lam *= scale
            else:
                lam = neg_inf
            for lvl in range(levels - 1, -1, -1):
                through = _logaddexp(lam, eta[lvl])
                child_base[b, lvl, h] = through
                # log mu of level lvl, kept in eta's slot (eta is used up)
                log_mu = lam - through
                if not include_self and through == neg_inf:
                    log_mu = 0.0
                eta[lvl] = log_mu
                lam = offset[lvl] + weight[lvl] * through
            for f in range(dim_v):
                out[b, h, f] = 0.0
            log_m = 0.0
            m_above = 1.0
            for lvl in range(levels):
                log_m += eta[lvl]
                m_below = math.exp(log_m)
                share = m_above - m_below
                for f in range(dim_v):
                    out[b, h, f] += share * theta[lvl, f]
                m_above = m_below
            if include_self:
                for f in range(dim_v):
                    out[b, h, f] += m_above * v[b, h, f]


def fused_step(state, plan, q: Tensor, k: Tensor, v: Tensor, scale: float,
               include_self: bool) -> Tensor:
    """Run the kernel on ``state``
    (:class:`~hsa_graph.ops.cache.CacheState`, CPU, float32 or float64, updated in
    place) for the placements of ``plan`` (:class:`~hsa_graph.ops.cache.StepPlan`) and
    the new tokens ``q, k`` ``[B, H, D]``, ``v`` ``[B, H, Dv]`` of the state's dtype;
    returns the outputs ``[B, H, Dv]``."""
    out = v.new_empty(v.shape)
    floor, tiny = _limits(state.members.dtype)
    _step(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(),
          *(t.numpy() for t in state.tensors().values()), plan.rows, plan.level,
          plan.slots,
          _NO_CLOSED if plan.closed is None else plan.closed,
          float(scale), bool(include_self), floor, tiny, out.numpy())
    return out


@functools.cache
def _limits(dtype: torch.dtype) -> Tuple[float, float]:
    """The clamps of the eager step's softmax in ``dtype``: its most negative finite
    value (the floor of the logits' maximum) and its smallest normal (of the sum)."""
    finfo = torch.finfo(dtype)
    return float(finfo.min), float(finfo.tiny)
