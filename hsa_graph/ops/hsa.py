r"""Hierarchical Self-Attention: the exact operator (:ref:`def-hsa`).

Two passes over the tree, never forming the ``N x N`` matrix:

1. **bottom-up**: subtree means ``rq, rk, rv`` of every node (one pass over ``q, k,
   v`` at the leaves, then all three together up the levels); every family's sibling
   softmax, fused with its values, giving each member's output row and log-sum-exp
   (``eta``, or ``logaddexp(lam, eta)`` for a leaf that attends to itself); the
   internal log-mass ``lam``.
2. **top-down**: the mass ``m`` reaching each node; the output
   ``y_i = m(pa(i)) o_i + acc(pa(i))``, where ``o_i`` is leaf ``i``'s family row and
   ``acc`` sums the internal members' weighted rows down each path.

All per-node work is vectorised over one depth at a time, and the families of one
padded size (see :class:`~hsa_graph.TreeStructure`) go through one fused attention
call. Leaf families that are contiguous in leaf order are read in place (a view of
``q, k, v``), so the finest level costs what softmax attention inside those families
alone costs; no tensor of size ``E x H x D`` over sibling pairs is formed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from ..structure import (
    FamilyBucket,
    TreeStructure,
    _rows_per_chunk,
    group_sums,
    records_grad,
)
from .flash import _widened, cpu_flash_attention, cpu_flash_attention_backward
from .inputs import AttentionInputs, no_autocast, prepare_attention
from .native import (
    native_applies,
    native_family_attention,
    native_family_attention_backward,
    native_gathered_family_attention,
)

__all__ = ["hsa"]

NEG_INF = float("-inf")

#: a bucket's per-member rows, ``[F, H, b, ...]``; a leaf_block bucket's in two parts,
#: its leaves' ``[F, H, L, ...]`` and its internal members' ``[F, H, b - L, ...]``
BucketRows = Union[Tensor, Tuple[Tensor, Tensor]]


class _LogAddExp(torch.autograd.Function):
    """``torch.logaddexp`` with a backward written in differentiable ops that stays
    finite at ``-inf``: zero gradients where both inputs are ``-inf`` (torch's are NaN),
    and a double backward that is not NaN where one of them is (torch's is)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return torch.logaddexp(a, b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        # d/da = sigmoid(a - b); NaN only where a - b is (both -inf), and 0 is right there
        da = grad * torch.sigmoid(a - b).nan_to_num(0.0) if ctx.needs_input_grad[0] else None
        db = grad * torch.sigmoid(b - a).nan_to_num(0.0) if ctx.needs_input_grad[1] else None
        return da, db


def _logaddexp(a: Tensor, b: Tensor) -> Tensor:
    """``log(e^a + e^b)``, ``-inf`` with zero gradients where both are ``-inf``, and
    twice differentiable (see :class:`_LogAddExp`). A broadcast operand is expanded
    first: ``torch.logaddexp`` over broadcast strides runs several times slower on CPU
    than a copy and the dense kernel."""
    if a.shape != b.shape:
        shape = torch.broadcast_shapes(a.shape, b.shape)
        a = a if a.shape == shape else a.expand(shape).contiguous()
        b = b if b.shape == shape else b.expand(shape).contiguous()
    if not records_grad(a, b):  # the same forward, without an autograd node per call
        return torch.logaddexp(a, b)   # (a deep tree's bottom-up pass makes one a level)
    return _LogAddExp.apply(a, b)


def _log_ratio(lam: Tensor, total: Tensor) -> Tensor:
    """``log mu = lam - total``, defined as 0 where both are ``-inf`` (:ref:`def-hsa`)."""
    both = total == NEG_INF
    return (lam.masked_fill(both, 0.0) - total.masked_fill(both, 0.0))


#: Largest family (queries or keys) and bucket (bytes of ``q``) that
#: :func:`_small_families` sends through batched matmuls: the logits ``P`` of a family
#: of 16 take a quarter of its queries' bytes at ``D = 64``, and past a few MiB they
#: would be fresh mappings whose pages fault in on every call, where the fused kernel
#: forms no logits at all.
_SMALL_FAMILY = 16
_SMALL_BUCKET_BYTES = 16 << 20
_MIN_BATCHED_FAMILIES = 32
# a bucket's logit mask is kept on the structure up to this many entries (4 MiB in float32)
_KEPT_MASK_ELEMENTS = 1 << 20


def _small_families(q: Tensor, k: Tensor, records: bool) -> bool:
    r"""Whether a bucket's family softmax runs as batched matmuls
    (:func:`_batched_family_attention`) instead of the fused CPU kernel: CPU buckets of
    families of at most :data:`_SMALL_FAMILY` queries and keys and at most
    :data:`_SMALL_BUCKET_BYTES` of queries, where autograd records (the fused backward
    costs about as much for families of 16 as for families of 64), or where the
    forward has more than one thread (the fused forward on families of 16 runs no
    faster at 2 threads than at 1; the matmuls do). Measured on 256 families of 16
    leaves x 4 heads x D = 64, float32, token-major rows, 2 cores, medians of 40
    calls: forward + backward 11.1 ms against 17.3 ms for the fused kernels at 1
    thread, 9.5 against 9.8 at 2; forward 1.3 against 2.1 ms at 2 threads, but 2.2
    against 1.5 at 1 thread, where the fused kernel stays. A forward over fewer than
    :data:`_MIN_BATCHED_FAMILIES` families keeps the fused kernel too: there its one
    call costs no more than the matmuls' calls per head (2 threads, 4 heads, families of
    16: 0.24 against 0.24 ms for 16 families, 0.34 against 0.31 for 32, 0.63 against
    0.47 for 64; with 8 heads 0.17 against 0.30 ms for 8 families), and a call on one
    tree of 64 leaves (4 families) takes 0.69 instead of 0.95 ms."""
    return (q.device.type == "cpu" and max(q.shape[2], k.shape[2]) <= _SMALL_FAMILY
            and q.numel() * q.element_size() <= _SMALL_BUCKET_BYTES
            and (records or (not torch.compiler.is_compiling()       # (a graph break)
                             and torch.get_num_threads() > 1
                             and q.shape[0] >= _MIN_BATCHED_FAMILIES)))


def _batched_family_softmax(q: Tensor, k: Tensor, bias: Optional[Tensor], scale: float
                            ) -> Tuple[Tensor, Tensor]:
    r"""The softmax inside small families as batched matmuls, one head at a time over
    the rows as they lie (``q[:, h]`` is a ``[F, b, D]`` strided batch of matrices,
    which the matmul reads in place: no head-major copy of ``q, k``). Returns
    ``P [H, F, b, c]`` for ``b`` queries and ``c`` keys per family and its log-sum-exp
    ``l [F, H, b]``. A row whose every key is masked gets ``P = 0`` and ``l = -inf``."""
    f, h, b, c = *q.shape[:3], k.shape[2]
    logits = q.new_empty((h, f, b, c))
    # the scale and the bias folded into the matmul (no pass over the logits of their own)
    bias = None if bias is None else bias[(None,) * (4 - bias.dim())].expand(f, h, b, c)
    for i in range(h):
        torch.baddbmm(logits[i] if bias is None else bias[:, i], q[:, i],
                      k[:, i].transpose(1, 2), beta=0.0 if bias is None else 1.0,
                      alpha=scale, out=logits[i])
    # the softmax in place, its log-sum-exp from the row sums (a quarter fewer passes
    # than logsumexp and a softmax after it)
    top = logits.amax(-1, keepdim=True)
    p = logits.sub_(top.masked_fill(top == NEG_INF, 0.0)).exp_()
    total = p.sum(-1, keepdim=True)
    p.div_(total.clamp_min(torch.finfo(p.dtype).tiny))
    lse = total.log_().add_(top)
    return p, lse.squeeze(-1).transpose(0, 1)


def _batched_family_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                              scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    r""":func:`_batched_family_softmax` times the values: ``(o [F, H, b, Dv], l, P)``,
    ``o`` in token-major memory as the fused kernel writes it. The heads' products
    share one scratch of a head's size: the fewer fresh buffers a call takes, the fewer
    pages fault in (:ref:`performance`). A row whose every key is masked gets
    ``o = 0``."""
    p, lse = _batched_family_softmax(q, k, bias, scale)
    f, h, b = q.shape[:3]
    out = q.new_empty((f, b, h, v.shape[-1])).transpose(1, 2)
    scratch = q.new_empty((f, b, v.shape[-1]))
    for i in range(h):
        out[:, i].copy_(torch.bmm(p[i], v[:, i], out=scratch))
    return out, lse, p


def _softmax_grad(p: Tensor, dp: Optional[Tensor], d_lse: Optional[Tensor],
                  inplace: bool = True) -> Tensor:
    r"""The gradient of softmax logits from those of the probabilities ``P [H, F, b,
    c]`` and of the log-sum-exp (``[F, H, b]``; either may be ``None``):
    :math:`dS = P \odot (dP - \mathrm{rowsum}(P \odot dP) + d\ell)`, written into
    ``dp`` with ``inplace``, else in differentiable ops (``create_graph``). Every
    backward of the family softmax goes through it."""
    d_lse = None if d_lse is None else d_lse.transpose(0, 1).unsqueeze(-1)   # [H, F, b, 1]
    if dp is None:
        return p * 0.0 if d_lse is None else p * d_lse
    delta = (dp * p).sum(-1, keepdim=True)
    if d_lse is not None:
        delta = delta.sub_(d_lse) if inplace else delta - d_lse
    return dp.sub_(delta).mul_(p) if inplace else (dp - delta) * p


def _batched_query_key_grads(q: Tensor, k: Tensor, ds: Tensor, scale: float,
                             needs: Tuple[bool, bool],
                             d_sums: Tuple[Optional[Tensor], ...] = (None, None)
                             ) -> List[Optional[Tensor]]:
    r""":math:`dq = s\, dS\, k` and :math:`dk = s\, dS^\top q` from the logits'
    gradient ``dS [H, F, b, c]``, one head at a time, written into gradients with the
    strides of ``q, k`` (``None`` where ``needs`` says so); the scale is folded into
    the matmuls and the heads' products share one scratch. ``d_sums``: the gradients
    of the family sums of ``q, k`` (``[F, H, D]`` or ``None``), added to every member's
    row inside the same matmuls (no pass of their own)."""
    grads = [torch.empty_like(t) if need else None for t, need in zip((q, k), needs)]
    scratch = {t[:, 0].shape: t.new_empty(t[:, 0].shape)
               for t, g in zip((q, k), grads) if g is not None}
    for i in range(q.shape[1]):
        for grad, (left, right), d_sum in zip(
                grads, ((ds[i], k[:, i]), (ds[i].transpose(1, 2), q[:, i])), d_sums):
            if grad is None:
                continue
            part = scratch[grad[:, 0].shape]
            start = part if d_sum is None else d_sum[:, i].unsqueeze(1)
            grad[:, i].copy_(torch.baddbmm(start, left, right, beta=float(d_sum is not None),
                                           alpha=scale, out=part))
    return grads


def _batched_family_attention_backward(q: Tensor, k: Tensor, v: Tensor, p: Tensor,
                                       d_out: Optional[Tensor], d_lse: Optional[Tensor],
                                       scale: float, needs: Tuple[bool, ...],
                                       d_sums: Tuple[Optional[Tensor], ...] = (None,) * 3
                                       ) -> List[Optional[Tensor]]:
    r"""``dq, dk, dv`` of :func:`_batched_family_attention` from its ``P``, one head at
    a time as its forward: :math:`dP = dO\, v^\top`, :math:`dv = P^\top dO`, then
    :func:`_softmax_grad` and :func:`_batched_query_key_grads`; gradients with the
    strides of ``q, k, v`` (``None`` where ``needs`` says so), the family sums'
    gradients ``d_sums`` joined."""
    dv = torch.empty_like(v) if needs[2] and d_out is not None else None
    dp = None
    if d_out is not None:
        dp = torch.empty_like(p)
        scratch = v.new_empty(v[:, 0].shape)
        for i in range(q.shape[1]):
            torch.bmm(d_out[:, i], v[:, i].transpose(1, 2), out=dp[i])
            if dv is not None:
                dv[:, i].copy_(torch.bmm(p[i].transpose(1, 2), d_out[:, i], out=scratch))
    elif needs[2]:
        dv = torch.zeros_like(v)
    if dv is not None and d_sums[2] is not None:
        dv.add_(d_sums[2].unsqueeze(2))
    ds = _softmax_grad(p, dp, d_lse)
    return [*_batched_query_key_grads(q, k, ds, scale, needs[:2], d_sums[:2]), dv]


def _family_attention_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                              scale: float) -> Tuple[Tensor, Tensor]:
    """Softmax attention and its log-sum-exp, through :func:`cpu_flash_attention` where
    it applies, else with plain matmuls (other devices, half precision)."""
    fused = cpu_flash_attention(q, k, v, bias, scale)
    if fused is not None:
        return fused
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.exp(logits - lse.unsqueeze(-1)), v), lse


class _FamilyAttention(torch.autograd.Function):
    r"""Softmax attention inside every family of a bucket, and its log-sum-exp.

    For ``q, k`` ``[F, H, b, D]``, ``v`` ``[F, H, b, Dv]`` (any strides) and an additive
    ``bias`` broadcastable to ``[F, H, b, b]`` (or ``None``):

    .. math::
        S = s\, q k^\top + \mathrm{bias}, \quad
        \ell = \mathrm{logsumexp}_j S, \quad o = \mathrm{softmax}_j(S)\, v.

    Returns ``o`` ``[F, H, b, Dv]`` and ``l`` ``[F, H, b]``; with ``family_sums`` also
    :math:`\sum_j q_j, \sum_j k_j, \sum_j v_j` over each family (``[F, H, D]``), the
    leaf sums that the subtree means start from: their gradients then join ``dq, dk,
    dv`` in place, so that each of ``q, k, v`` receives one full-size gradient from
    this bucket instead of two that autograd adds into a third.

    The backward takes the gradient of :math:`\ell` too:
    :math:`dS = P \odot (dO\, v^\top - \mathrm{rowsum}(dO \odot o) + d\ell)`.
    Small families (:func:`_small_families`) run as batched matmuls and save
    :math:`P` (``b <= 16``: at most a quarter of the queries' bytes at ``D = 64``);
    the others run the fused kernel and recompute :math:`P = e^{S - \ell}` (through
    :func:`~hsa_graph.ops.flash.cpu_flash_attention_backward` where it applies).
    ``records``: whether autograd records the call (inside ``forward`` grad mode is
    off, so the caller says so; :func:`_family_attention` does).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], scale: float,
                family_sums: bool = False, records: bool = False,
                native_self: Optional[bool] = None):
        p = sums = None
        ctx.native_self = None
        rows = None if native_self is None else _token_rows(q, k, v)
        native = None if rows is None else native_family_attention(
            *rows, q.shape[2], native_self, scale)
        if native is not None:
            out, lse, *sums = native
            ctx.native_self = native_self
        elif _small_families(q, k, records):
            out, lse, p = _batched_family_attention(q, k, v, bias, scale)
        else:
            out, lse = _family_attention_forward(q, k, v, bias, scale)
        ctx.save_for_backward(q, k, v, bias, out, lse, p if records else None)
        ctx.scale = scale
        if not family_sums:
            return out, lse
        return (out, lse, *(sums or (_family_sum(t) for t in (q, k, v))))

    @staticmethod
    def backward(ctx, d_out: Optional[Tensor], d_lse: Optional[Tensor], *d_sums):
        q, k, v, bias, out, lse, p = ctx.saved_tensors
        if d_out is not None:
            d_out = d_out.contiguous() if 0 in d_out.stride() else d_out  # stride-0 sums
        needs = ctx.needs_input_grad
        d_sums = d_sums or (None, None, None)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            # create_graph (or tracing): out-of-place, so that this backward can itself
            # be differentiated
            heads = [_family_attention_backward_head(
                ctx.scale, needs, *(None if t is None else _head(t, h) for t in (
                    q, k, v, bias, lse, d_out, d_lse)))
                for h in range(q.shape[1])]
            grads = [None if g[0] is None else torch.stack(g, 2).transpose(1, 2)
                     for g in zip(*heads)]
            grads = [g if g is None or d is None else g + d.unsqueeze(2)
                     for g, d in zip(grads, d_sums)]
            return (*grads, None, None, None, None, None)
        native = None
        f, h, b = q.shape[:3]
        rows = (None if ctx.native_self is None or d_out is None
                else _token_rows(q, k, v, out))
        if rows is not None:
            native = native_family_attention_backward(
                *rows, lse, d_out.transpose(1, 2).reshape(f * b, h, d_out.shape[3]), d_lse,
                d_sums, b, ctx.native_self, ctx.scale)
        if native is not None:  # token-major rows back to [F, H, b, *] views
            grads = [g.view(f, b, *g.shape[1:]).transpose(1, 2) for g in native]
        elif p is not None:
            grads = _batched_family_attention_backward(q, k, v, p, d_out, d_lse, ctx.scale,
                                                       needs, d_sums)
        else:
            grads = _family_attention_grads(q, k, v, bias, out, lse, d_out, d_lse,
                                            ctx.scale, needs)
            grads = [g.add_(d.unsqueeze(2)) if g is not None and d is not None else g
                     for g, d in zip(grads, d_sums)]
        return (*(g if need else None for g, need in zip(grads, needs[:3])),
                None, None, None, None, None)


def _family_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], scale: float,
                      family_sums: bool = False, native_self: Optional[bool] = None
                      ) -> Tuple[Tensor, ...]:
    """:class:`_FamilyAttention`, told whether autograd records the call. ``native_self``:
    for families of leaves alone, every slot a leaf and ``bias`` the mask of
    ``include_self = native_self`` (the bucket of every leaf), the compiled kernel
    (:mod:`hsa_graph.ops.native`) runs forward and backward where it applies."""
    return _FamilyAttention.apply(q, k, v, bias, scale, family_sums, records_grad(q, k, v),
                                  native_self)


def _token_rows(*members: Tensor) -> Optional[Tuple[Tensor, ...]]:
    """``[F, H, b, *]`` family views of consecutive token-major rows as the ``[F * b, H,
    *]`` rows they view (no copy: ``None`` where a member is laid out otherwise, e.g.
    gathered head-major)."""
    rows = []
    for t in members:
        f, h, b = t.shape[:3]
        if t.stride(0) != b * t.stride(2) or t.stride(-1) != 1:
            return None
        rows.append(t.as_strided((f * b, h, t.shape[3]), (t.stride(2), t.stride(1), 1),
                                 t.storage_offset()))
    return tuple(rows)


def _family_attention_grads(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                            out: Tensor, lse: Tensor, d_out: Optional[Tensor],
                            d_lse: Optional[Tensor], scale: float, needs: Tuple[bool, ...]
                            ) -> List[Optional[Tensor]]:
    """``dq, dk, dv`` of :class:`_FamilyAttention` (``[F, H, b, ...]`` operands, any
    strides) where autograd records nothing: the fused CPU kernels where they apply,
    else batched matmuls head by head; ``None`` where ``needs`` says so (a fused
    kernel's extra gradients may be given anyway)."""
    if d_out is not None and 0 in d_out.stride():  # e.g. the expanded gradient of a sum
        d_out = d_out.contiguous()
    grads = None if d_out is None else cpu_flash_attention_backward(
        q, k, v, bias, out, lse, d_out, d_lse, scale)
    if grads is not None:
        return list(grads)
    # Gradients written head by head into tensors with the strides of q, k, v
    # (token-major [F, b, H, D] rows): nothing is stacked or copied afterwards.
    grads = [torch.empty_like(t) if need else None for t, need in zip((q, k, v), needs[:3])]
    for h in range(q.shape[1]):
        _family_attention_backward_head(
            scale, needs, *(None if t is None else _head(t, h) for t in (
                q, k, v, bias, lse, d_out, d_lse)),
            into=[None if g is None else g[:, h] for g in grads])
    return grads


@dataclass(frozen=True)
class FamilySoftmax:
    r"""A bucket of leaves alone whose family softmax is kept as its probabilities
    ``p`` (``P [H, F, b, c]``, see :func:`_batched_family_softmax`) beside its values
    ``v`` (``[F, H, c, Dv]``): the product :math:`P v` is formed only where
    :func:`hsa` weighs it into its output (:func:`_weighted_family_values`), so that
    neither the family output nor its gradient is ever a full-size tensor."""

    p: Tensor
    v: Tensor


class _FamilySoftmax(torch.autograd.Function):
    r""":func:`_batched_family_softmax` of ``q, k`` ``[F, H, b, D]`` (any strides) as
    an autograd node: returns ``P [H, F, b, c]`` and ``l [F, H, b]``, and with
    ``family_sums`` also the sums of ``q, k, v`` over each family (``v`` is read for
    them alone; see :class:`_FamilyAttention`). The backward takes the gradient of
    ``P`` (from :class:`_WeightedFamilyValues`) and of ``l``: :func:`_softmax_grad`,
    then :func:`_batched_query_key_grads`."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Optional[Tensor], bias: Optional[Tensor],
                scale: float, family_sums: bool = False):
        p, lse = _batched_family_softmax(q, k, bias, scale)
        ctx.save_for_backward(q, k, p)
        ctx.scale, ctx.v_shape = scale, None if v is None else v.shape
        if not family_sums:
            return p, lse
        return (p, lse, *(_family_sum(t) for t in (q, k, v)))

    @staticmethod
    def backward(ctx, dp: Optional[Tensor], d_lse: Optional[Tensor], *d_sums):
        q, k, p = ctx.saved_tensors
        needs = ctx.needs_input_grad
        d_sums = d_sums or (None, None, None)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            # create_graph (or tracing): differentiable ops, out of place
            ds = _softmax_grad(p, dp, d_lse, inplace=False)
            grads = [torch.einsum("hfbc,fhcd->fhbd", ds, k) * ctx.scale if needs[0] else None,
                     torch.einsum("hfbc,fhbd->fhcd", ds, q) * ctx.scale if needs[1] else None]
            grads = [g if g is None or d is None else g + d.unsqueeze(2)
                     for g, d in zip(grads, d_sums)]
        else:
            grads = _batched_query_key_grads(q, k, _softmax_grad(p, dp, d_lse), ctx.scale,
                                             needs[:2], d_sums[:2])
        d_v = None
        if needs[2] and d_sums[2] is not None:  # v entered the sums alone
            d_v = d_sums[2].unsqueeze(2).expand(ctx.v_shape)
        return (*grads, d_v, None, None, None)


def _leaf_family_softmax(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                         scale: float, family_sums: bool = False) -> Tuple:
    """:class:`_FamilySoftmax` of a bucket of leaves alone: ``(FamilySoftmax, l)``, and
    the family sums of ``q, k, v`` with ``family_sums``."""
    p, *rest = _FamilySoftmax.apply(q, k, v if family_sums else None, bias, scale,
                                    family_sums)
    return (FamilySoftmax(p, v), *rest)


def _weighted_family_values(above: Tensor, w: Tensor, family: FamilySoftmax) -> Tensor:
    r"""The leaf outputs of a bucket kept as a :class:`FamilySoftmax`,
    :math:`y_i = \mathrm{above} + w\, (P v)_i` for every leaf ``i`` of a family
    (``above`` ``[F, H, Dv]``, ``w`` ``[F, H]``: the family's parent's ``acc`` and
    ``m``), as token-major rows ``[F, b, H, Dv]``: one head at a time through one
    scratch, each row written once. Through :class:`_WeightedFamilyValues` where
    autograd records."""
    if records_grad(above, w, family.p, family.v):
        return _WeightedFamilyValues.apply(above, w, family.p, family.v)
    return _weighted_family_values_forward(above, w, family.p, family.v)


def _weighted_family_values_forward(above: Tensor, w: Tensor, p: Tensor, v: Tensor
                                    ) -> Tensor:
    """:func:`_weighted_family_values` without autograd."""
    h, f, b = p.shape[:3]
    y = v.new_empty((f, b, h, v.shape[-1]))
    scratch, weighted = v.new_empty((f, b, v.shape[-1])), p.new_empty(p.shape[1:])
    for i in range(h):
        torch.mul(p[i], w[:, i, None, None], out=weighted)
        y[:, :, i].copy_(torch.baddbmm(above[:, i].unsqueeze(1), weighted, v[:, i],
                                       out=scratch))
    return y


class _WeightedFamilyValues(torch.autograd.Function):
    r""":func:`_weighted_family_values` as an autograd node. For ``dy`` ``[F, b, H,
    Dv]``, head by head: :math:`G = dy\, v^\top`, ``d above`` :math:`= \sum_i dy_i`,
    :math:`dw = \sum_{ij} P \odot G`, :math:`dP = w\, G`,
    :math:`dv = (w P)^\top dy`: no full-size tensor but ``dv``."""

    @staticmethod
    def forward(ctx, above: Tensor, w: Tensor, p: Tensor, v: Tensor) -> Tensor:
        ctx.save_for_backward(w, p, v)
        return _weighted_family_values_forward(above, w, p, v)

    @staticmethod
    def backward(ctx, dy: Tensor):
        w, p, v = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dy = dy.contiguous() if 0 in dy.stride() else dy  # (the expanded gradient of a sum)
        d_above = None
        if needs[0]:
            f, b = dy.shape[:2]
            d_above = (group_sums(dy.view(f * b, *dy.shape[2:]), b) if dy.is_contiguous()
                       else dy.sum(1))
        weights = w.transpose(0, 1)[..., None, None]                      # [H, F, 1, 1]
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            # create_graph (or tracing): differentiable ops, out of place
            g = torch.einsum("fbhd,fhcd->hfbc", dy, v)
            d_w = (g * p).sum((2, 3)).transpose(0, 1) if needs[1] else None
            d_p = g * weights if needs[2] else None
            d_v = torch.einsum("hfbc,fbhd->fhcd", p * weights, dy) if needs[3] else None
            return d_above, d_w, d_p, d_v
        d_p = torch.empty_like(p) if needs[1] or needs[2] else None
        d_w = w.new_empty(w.shape) if needs[1] else None
        d_v = torch.empty_like(v) if needs[3] else None
        scratch, weighted = v.new_empty(v[:, 0].shape), p.new_empty(p.shape[1:])
        for i in range(p.shape[0]):
            rows = dy[:, :, i]                                           # [F, b, Dv]
            if d_p is not None:
                g = torch.bmm(rows, v[:, i].transpose(1, 2), out=d_p[i])
                if d_w is not None:
                    d_w[:, i] = torch.mul(g, p[i]).sum((1, 2))
                g.mul_(weights[i])
            if d_v is not None:
                torch.mul(p[i], weights[i], out=weighted)
                d_v[:, i].copy_(torch.bmm(weighted.transpose(1, 2), rows, out=scratch))
        return d_above, d_w, d_p if needs[2] else None, d_v


class _LeafGatherFamilies(torch.autograd.Function):
    r"""The family softmax of every bucket of leaves read by index
    (:attr:`~hsa_graph.structure.FamilyBucket.leaf_gather`: ragged families) where
    autograd records, as one node that runs a chunk of families at a time forward and
    backward (:meth:`~hsa_graph.structure.TreeStructure.gather_leaf_chunks`).

    Inputs: the leaf rows of the family softmax's queries, keys and values
    ``[N, H, D]``, ``[N, H, D]``, ``[N, H, Dv]``. Returns, for the buckets ``indices``
    in order, each bucket's ``out`` ``[F, H, b, Dv]`` and ``lse`` ``[F, H, b]`` (as
    :class:`_FamilyAttention`), then with ``num_sums = T`` the :meth:`~hsa_graph.
    structure.TreeStructure.to_internal` sums of the first ``T`` inputs
    (``[I + 1, H, *]``, where the subtree means start).

    The backward gathers each chunk's members again into a reused scratch, copies their
    gradients (:func:`_family_attention_grads`) into one gradient per input and adds the
    sums' gradients into it (:meth:`~hsa_graph.structure.TreeStructure.add_parent_rows_`):
    each input receives one full-size gradient. Recorded op by op, one gather per input
    feeds all buckets, and its split, its scatter and the sums' gather each form another
    full-size tensor per input in the backward, fresh mappings whose pages fault in on
    every call. Under ``create_graph`` (and under ``torch.compile``) the backward
    differentiates :func:`_leaf_gather_families_recorded`, the same results in recorded
    ops, so it differentiates twice.
    """

    @staticmethod
    def forward(ctx, st: TreeStructure, indices: Tuple[int, ...], include_self: bool,
                scale: float, num_sums: int, q: Tensor, k: Tensor, v: Tensor):
        ctx.st, ctx.indices, ctx.include_self = st, indices, include_self
        ctx.scale, ctx.num_sums = scale, num_sums
        results: List[Tensor] = []
        scratch = st.new_leaf_chunk_scratch((q, k, v))
        for index in indices:
            native = _native_bucket(st, index, (q, k, v), None, include_self, scale)
            if native is not None:
                results += native
                continue
            bucket = st.buckets[index]
            f, b = bucket.num_families, bucket.size
            rows = v.new_empty((f * b, *v.shape[1:]))          # token-major slot rows
            results += [rows.view(f, b, *v.shape[1:]).transpose(1, 2),
                        _leaf_bucket_into_rows(st, index, (q, k, v), include_self, scale,
                                               rows, slot_order=True, scratch=scratch)]
        ctx.save_for_backward(q, k, v, *results)
        return (*results, *(st.to_internal(t) for t in (q, k, v)[:num_sums]))

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        st, indices, scale = ctx.st, ctx.indices, ctx.scale
        q, k, v, *results = ctx.saved_tensors
        needs = ctx.needs_input_grad[5:]
        d_results, d_sums = grads[:len(results)], grads[len(results):]
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            inputs = [t for t, need in zip((q, k, v), needs) if need]
            with torch.enable_grad():
                outs = _leaf_gather_families_recorded(st, indices, ctx.include_self, scale,
                                                      ctx.num_sums, q, k, v)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            got = iter(torch.autograd.grad([o for o, _ in pairs], inputs,
                                           [g for _, g in pairs], create_graph=True,
                                           allow_unused=True))
            return (None,) * 5 + tuple(
                (next(got) if need else None) for need in needs)
        n = st.num_leaves
        # one extra row takes the padding slots' gradients (leaf_rows_of_slots)
        d_inputs = [t.new_zeros((n + 1, *t.shape[1:])) if need else None
                    for t, need in zip((q, k, v), needs)]
        scratch = st.new_leaf_chunk_scratch((q, k, v))
        for j, index in enumerate(indices):
            out, lse = results[2 * j], results[2 * j + 1]
            d_out, d_lse = d_results[2 * j], d_results[2 * j + 1]
            if d_out is None and d_lse is None:
                continue
            bucket = st.buckets[index]
            b = bucket.size
            bias = _bucket_bias(st, index, ctx.include_self, q.dtype)
            dest = st.leaf_rows_of_slots(index)
            for lo, hi, members in st.gather_leaf_chunks(bucket, (q, k, v), scratch):
                part = slice(lo, hi)
                chunk = _family_attention_grads(
                    *(t.transpose(1, 2) for t in members),
                    None if bias is None else bias[part], out[part], lse[part],
                    None if d_out is None else d_out[part],
                    None if d_lse is None else d_lse[part], scale, (*needs, False))
                for grad, g in zip(d_inputs, chunk):
                    if grad is not None:
                        grad.index_copy_(0, dest[lo * b:hi * b], _rows(g))
        for grad, d_sum in zip(d_inputs, d_sums):
            if grad is not None and d_sum is not None:
                st.add_parent_rows_(grad[:n], d_sum)
        return (None,) * 5 + tuple(None if g is None else g[:n] for g in d_inputs)


def _leaf_gather_families_recorded(st: TreeStructure, indices: Tuple[int, ...],
                                   include_self: bool, scale: float, num_sums: int,
                                   q: Tensor, k: Tensor, v: Tensor) -> List[Tensor]:
    """:class:`_LeafGatherFamilies`' results in recorded ops (each bucket gathered
    whole, its softmax one :class:`_FamilyAttention` node), for its backward under
    ``create_graph`` and for tracing."""
    results: List[Tensor] = []
    for index in indices:
        bucket = st.buckets[index]
        members = [st.gather_bucket(bucket, t, t).transpose(1, 2) for t in (q, k, v)]
        results += _family_attention(*members, _bucket_bias(st, index, include_self,
                                                                 q.dtype), scale)
    return results + [st.to_internal(t) for t in (q, k, v)[:num_sums]]


def _family_sum(t: Tensor) -> Tensor:
    """``t.sum(2)`` of a ``[F, H, b, D]`` bucket view; over token-major rows (the usual
    layout) the sums of groups of contiguous ``[H, D]`` rows
    (:func:`~hsa_graph.structure.group_sums`), several times faster than reducing the
    strided axis."""
    rows = t.transpose(1, 2)
    if not rows.is_contiguous():
        return t.sum(2)
    f, b, h, d = rows.shape
    return group_sums(rows.view(f * b, h, d), b)


class _WeightedRows(torch.autograd.Function):
    r"""``above + rows * w``, the leaf outputs of a bucket (``above`` ``[F, 1, H, Dv]``,
    ``rows`` ``[F, b, H, Dv]``, ``w`` ``[F, 1 or b, H, 1]``), with a backward that forms
    one full-size tensor (``d rows = dy * w``) where ``addcmul``'s forms three: the
    gradient of ``w``, :math:`\sum_d dy \odot rows`, is a batched dot product."""

    @staticmethod
    def forward(ctx, above: Tensor, rows: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(rows, w)
        return torch.addcmul(above, rows, w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        rows, w = ctx.saved_tensors
        needs = ctx.needs_input_grad
        d_above = dy.sum(1, keepdim=True) if needs[0] else None
        d_rows = dy * w if needs[1] else None
        d_w = None
        if needs[2]:
            d_w = torch.einsum("fbhd,fbhd->fbh", dy, rows).unsqueeze(-1)
            d_w = d_w.sum(1, keepdim=True) if w.shape[1] == 1 else d_w
        return d_above, d_rows, d_w


def _head(t: Tensor, h: int) -> Tensor:
    """Head ``h`` of a ``[F, H, b, ...]`` tensor (or of a bias broadcast over heads)."""
    return t[:, h if t.shape[1] > 1 else 0]


def _family_attention_backward_head(
        scale: float, needs: Tuple[bool, ...], q: Tensor, k: Tensor, v: Tensor,
        bias: Optional[Tensor], lse: Tensor, d_out: Optional[Tensor],
        d_lse: Optional[Tensor], into: Optional[List[Optional[Tensor]]] = None
) -> Tuple[Optional[Tensor], ...]:
    r"""The backward of :class:`_FamilyAttention` for one head: ``[F, b, D]`` operands
    (strided rows of the token-major tensors, which batched matmuls read in place),
    :math:`P = e^{sqk^\top + \mathrm{bias} - \ell}` recomputed,
    :math:`dP = dO\, v^\top`, then :func:`_softmax_grad`; returns
    ``(dq, dk, dv)`` ``[F, b, D]`` (``None`` where not needed), written into ``into``
    when given (then every intermediate is updated in place: no autograd records it)."""
    inplace = into is not None
    mul = Tensor.mul_ if inplace else Tensor.mul
    into = into if inplace else [None, None, None]
    logits = mul(torch.bmm(q, k.transpose(1, 2)), scale)
    if bias is not None:
        logits = logits.add_(bias) if inplace else logits + bias
    logits = logits.sub_(lse.unsqueeze(-1)) if inplace else logits - lse.unsqueeze(-1)
    p = logits.exp_() if inplace else logits.exp()                         # [F, b, b]
    dv = dp = None
    if d_out is not None:
        if needs[2]:
            dv = torch.bmm(p.transpose(1, 2), d_out, out=into[2])
        dp = torch.bmm(d_out, v.transpose(1, 2))[None]
    ds = _softmax_grad(p[None], dp, None if d_lse is None else d_lse[:, None],
                       inplace)[0]                                        # (one head)
    dq = mul(torch.bmm(ds, k, out=into[0]), scale) if needs[0] else None
    dk = mul(torch.bmm(ds.transpose(1, 2), q, out=into[1]), scale) if needs[1] else None
    return dq, dk, dv


def _bucket_bias(st: TreeStructure, index: int, include_self: bool, dtype: torch.dtype
                 ) -> Optional[Tensor]:
    """Additive mask of bucket ``index``'s logits, broadcastable to ``[F, H, b, b]``:
    ``log n(B)`` on key ``B`` (``-inf`` on padding), and ``-inf`` on the diagonal except
    for a leaf attending to itself (``include_self``; ``log n(i) = 0`` there). ``None``
    when all zero (full families of leaves with ``include_self``), so the kernel needs no
    mask. Kept on the structure (:meth:`~hsa_graph.structure.TreeStructure.constant`)
    up to ``_KEPT_MASK_ELEMENTS`` entries; a larger mask is remade per call, where the
    call's own work dwarfs it."""
    bucket = st.buckets[index]
    f, b = bucket.num_families, bucket.size

    def build() -> Optional[Tensor]:
        leaf_only = bucket.internal_slot.numel() == 0
        full = bucket.leaf_slot.numel() + bucket.internal_slot.numel() == f * b
        keys = bucket.log_size.to(dtype)[:, None, None, :]                   # [F, 1, 1, b]
        if leaf_only and include_self:
            return None if full else keys
        bias = keys.expand(f, 1, b, b).clone()
        self_ok = torch.zeros(f * b, dtype=torch.bool, device=keys.device)
        if include_self:
            self_ok[bucket.leaf_slot] = True
        bias.diagonal(dim1=-2, dim2=-1).masked_fill_(~self_ok.view(f, 1, b), NEG_INF)
        return bias

    if f * b * b > _KEPT_MASK_ELEMENTS:
        return build()
    return st.constant(("bucket_bias", index, include_self, dtype), build)


def _key_bias(st: TreeStructure, index: int) -> Tensor:
    """``[F, b]`` float32 ``log n(B)`` of bucket ``index``'s members, ``-inf`` on padding:
    the compiled kernel's key bias (it masks the diagonal itself), kept on the structure."""
    bucket = st.buckets[index]
    return st.constant(("key_bias", index),
                       lambda: bucket.log_size.to(torch.float32).contiguous())


def _native_bucket(st: TreeStructure, index: int, leaf_operands: Tuple[Tensor, ...],
                   internal_operands: Optional[Tuple[Tensor, ...]], include_self: bool,
                   scale: float, leaf_rows_out: Optional[Tensor] = None,
                   means_buffer: Optional[Tensor] = None
                   ) -> Optional[Tuple[Optional[Tensor], Tensor]]:
    """The family softmax of bucket ``index`` through the compiled kernel
    (:func:`~hsa_graph.ops.native.native_gathered_family_attention`) where it applies:
    a bucket whose members come from one source, read by index
    (:meth:`~hsa_graph.structure.TreeStructure.source_rows`; an internal member never
    attends to itself). ``(out [F, H, b, Dv], lse [F, H, b])`` as
    :class:`_FamilyAttention` returns them, else ``None``. No autograd. For a bucket of
    leaves: its rows written into ``leaf_rows_out`` where given
    (:meth:`~hsa_graph.structure.TreeStructure.new_leaf_rows`; ``out`` is then
    ``None``), and its families' sums of the operands into their parents' rows of
    ``means_buffer`` where given
    (:meth:`~hsa_graph.structure.TreeStructure.new_means_buffer`)."""
    source = st.source_rows(index)
    if source is None:
        return None
    leaves, rows = source
    operands = leaf_operands if leaves else internal_operands
    if operands is None or not native_applies(*operands, rows.shape[1]):
        return None
    f, b = rows.shape
    into = leaves and leaf_rows_out is not None
    sums = leaves and means_buffer is not None
    native = native_gathered_family_attention(
        *operands, rows, _key_bias(st, index), include_self and leaves, scale,
        out=leaf_rows_out if into else None,
        rows_out=st.leaf_rows_of_slots(index).view(f, b) if into else None,
        sums_into=means_buffer.unbind(0) if sums else None,
        sum_rows=st.buckets[index].parent if sums else None)
    if native is None:
        return None
    out, lse = native
    return (None if into else out.view(f, b, *out.shape[1:]).transpose(1, 2)), lse


def _native_leaf_buckets(st: TreeStructure, operands: Tuple[Tensor, Tensor, Tensor],
                         include_self: bool, scale: float, sums: bool,
                         leaf_rows_out: Optional[Tensor]
                         ) -> Tuple[Dict[int, Tuple[Optional[Tensor], Tensor]],
                                    Optional[Tensor]]:
    """Without autograd, the buckets of leaves alone through the compiled kernel, where
    it applies, before the subtree means: ``({bucket index: (out, lse)}, buffer)``.
    The bucket of every leaf (:attr:`~hsa_graph.structure.TreeStructure.whole_leaf_bucket`)
    reads its rows in place and writes a new token-major output; the others read by
    index (:func:`_native_bucket`), their rows written into ``leaf_rows_out`` where
    given. With ``sums`` (the caller needs the subtree means of the operands, which are
    ``q, k, v`` themselves) and these buckets holding every family with a leaf
    (:attr:`~hsa_graph.structure.TreeStructure.leaf_family_buckets`), the kernel writes
    each family's sums into its parent's row of a new means buffer, returned for
    :meth:`~hsa_graph.structure.TreeStructure.subtree_means` (else ``None``)."""
    q, k, v = operands
    # (native_applies first: it is False while torch.compile traces, before any
    # layout question that would read a tensor on the host)
    if not native_applies(q, k, v, 1):
        return {}, None
    runs = [i for i in st.leaf_only_buckets if native_applies(q, k, v, st.buckets[i].size)]
    if not runs:
        return {}, None
    covering = st.leaf_family_buckets if sums and k.shape == v.shape else None
    buffer = (st.new_means_buffer(q, k, v)
              if covering is not None and len(runs) == len(covering) else None)
    whole = st.whole_leaf_bucket
    done: Dict[int, Tuple[Optional[Tensor], Tensor]] = {}
    for index in runs:
        if index == whole:
            bucket = st.buckets[index]
            result = native_family_attention(
                q, k, v, bucket.size, include_self, scale,
                sums_into=None if buffer is None else buffer.unbind(0),
                sum_rows=None if buffer is None else bucket.parent)
        else:
            result = _native_bucket(st, index, operands, None, include_self, scale,
                                    leaf_rows_out, buffer)
        if result is None:  # (runs checked that it applies: not expected)
            buffer = None
            continue
        done[index] = result[:2]
    return done, buffer


def _block_diagonal(x: Tensor) -> Tensor:
    """``[F, A, B, H]`` -> ``[F, H * A, H * B]``, head ``h``'s ``[A, B]`` block on the
    diagonal: one batched matmul then serves every head of a token-major ``[F, n, H, A]``
    operand without a head-major copy of it."""
    f, a, b, h = x.shape
    return torch.diag_embed(x, dim1=1, dim2=3).reshape(f, h * a, h * b)


def _flash_key_width(num_keys: int) -> int:
    """The key-block width at which the CPU flash kernel runs a family of ``num_keys``
    keys fastest: one or two keys short of a multiple of 16, the kernel's tail costs a
    quarter more than the full block (families of 63 leaves: 470 ms against 375 ms for
    64 keys, the 64th masked, at 4,095 x 8 heads x D = 64, 2 threads; 31 -> 32 and
    15 -> 16 alike, while 7 -> 8, 17 -> 32 or 100 -> 112 gain nothing or lose)."""
    width = -(-num_keys // 16) * 16
    return width if num_keys >= 14 and width - num_keys <= 2 else num_keys


def _leaf_block_attention(bucket: FamilyBucket, leaf_members: Tuple[Tensor, ...],
                          internal_members: Tuple[Tensor, ...], include_self: bool,
                          scale: float, leaf_windows: Optional[Tuple[Tensor, Tensor]] = None,
                          into: Optional[Tensor] = None) -> Tuple[BucketRows, BucketRows]:
    r"""The family softmax of a :attr:`~hsa_graph.structure.FamilyBucket.leaf_block`
    bucket (``L`` leaves in place and ``E`` internal members per family) without
    copying the leaves: the ``(out [F, H, b, Dv], lse [F, H, b])`` of
    :class:`_FamilyAttention` over the gathered members, each in two parts (the leaves'
    rows, the internal members'; see :data:`BucketRows`), computed in parts whose
    log-sum-exps combine, :math:`\ell = \log(e^{\ell_1} + e^{\ell_2})`,
    :math:`o = e^{\ell_1 - \ell} o_1 + e^{\ell_2 - \ell} o_2`:

    * leaf queries over the leaf keys: the fused kernel on views of the leaf rows;
    * leaf queries over the internal keys: ``[F, L, H, E]`` logits from one batched
      matmul against the keys laid out block-diagonally by head (so the leaf rows are
      read as they lie, token-major; the operand costs ``H`` times the internal
      members' bytes), and their values added the same way into the output;
    * internal queries over the leaf keys (fused kernel) and over the other internal
      members (fused kernel, ``-inf`` on the diagonal; none when ``E = 1``).

    Inputs are ``[F, L, H, D]`` and ``[F, E, H, D]`` (queries, keys, values).
    ``leaf_windows``: the leaf keys and values as wider blocks ``[F, W, H, D]``
    (:meth:`~hsa_graph.structure.TreeStructure.leaf_block_window`, see
    :func:`_flash_key_width`), read in their place, the ``W - L`` extra keys masked.
    Where autograd records nothing the leaf rows run in heap-sized chunks of families
    and are written into ``into`` (``[F * L, H, Dv]``, e.g. the rows of the call's
    output, :meth:`~hsa_graph.structure.TreeStructure.leaf_rows_in`) or a new buffer:
    at full size the fused kernel's output and the block-diagonal operands would be
    fresh mappings whose pages fault in on every call, on top of the output's.
    """
    (q_l, k_l, v_l), (q_e, k_e, v_e) = leaf_members, internal_members
    f, n_l, h = q_l.shape[:3]
    n_e, dv = q_e.shape[1], v_l.shape[-1]
    log_n = bucket.log_size[:, n_l:].to(q_l.dtype)                          # [F, E]
    inplace = not records_grad(q_l, k_l, v_l, q_e, k_e, v_e)

    def heads(t: Tensor) -> Tensor:
        return t.transpose(1, 2)

    k_w, v_w = (k_l, v_l) if leaf_windows is None else leaf_windows
    width = k_w.shape[1]
    extra = None  # -inf on the extra keys (and on the diagonal without self-attention)
    if width > n_l:
        extra = q_l.new_zeros((1, 1, max(n_l, n_e), width))
        extra[..., n_l:] = NEG_INF
    mask = None if extra is None else extra[..., :n_l, :]
    if not include_self:
        mask = (q_l.new_zeros((1, 1, n_l, width)) if mask is None else mask.clone())
        mask.diagonal(dim1=-2, dim2=-1).fill_(NEG_INF)

    def leaf_queries(part: slice) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """For the families ``part``: the leaf rows over the leaf keys (token-major
        ``[n, L, H, Dv]``), their log-sum-exp over every member, the share the former
        keeps, and the shares and values of the internal members, as the batched
        matmul takes them."""
        q, n = q_l[part], q_l[part].shape[0]
        out, own = _family_attention(heads(q), heads(k_w[part]), heads(v_w[part]),
                                          mask, scale)
        out, own = heads(out), heads(own)
        logits = torch.bmm(q.reshape(n, n_l, -1), _block_diagonal(k_e[part].permute(0, 3, 1, 2)))
        logits = logits.view(n, n_l, h, n_e) * scale + log_n[part, None, None, :]
        lse = _logaddexp(own, torch.logsumexp(logits, -1))                 # [n, L, H]
        share = torch.exp(logits - lse.unsqueeze(-1)).view(n, n_l, h * n_e)
        values = _block_diagonal(v_e[part].permute(0, 1, 3, 2))            # [n, HE, HDv]
        return out, lse, torch.exp(own - lse).unsqueeze(-1), share, values

    out_e, lse_e = _family_attention(heads(q_e), heads(k_w), heads(v_w),
                                          None if extra is None else extra[..., :n_e, :],
                                          scale)
    if n_e > 1:
        bias = log_n[:, None, None, :].expand(f, 1, n_e, n_e).clone()
        bias.diagonal(dim1=-2, dim2=-1).fill_(NEG_INF)
        out_ee, lse_ee = _family_attention(heads(q_e), heads(k_e), heads(v_e), bias,
                                                scale)
        both = _logaddexp(lse_e, lse_ee)
        out_e = (torch.exp(lse_e - both).unsqueeze(-1) * out_e
                 + torch.exp(lse_ee - both).unsqueeze(-1) * out_ee)
        lse_e = both
    if inplace:
        rows = (q_l.new_empty((f, n_l, h, dv)) if into is None
                else into.view(f, n_l, h, dv))
        lse_l = q_l.new_empty((f, n_l, h))
        step = _rows_per_chunk(q_l)
        for lo in range(0, f, step):
            part = slice(lo, lo + step)
            out, lse_l[part], keep, share, values = leaf_queries(part)
            torch.mul(out, keep, out=rows[part])
            rows[part].view(-1, n_l, h * dv).baddbmm_(share, values)
    else:
        out, lse_l, keep, share, values = leaf_queries(slice(None))
        rows = torch.baddbmm((out * keep).reshape(f, n_l, h * dv), share, values)
    return ((heads(rows.view(f, n_l, h, dv)), out_e), (heads(lse_l), lse_e))


class _RowDots(torch.autograd.Function):
    """``<q_i, k_i>`` per row and head, ``[n, H]``, without an ``[n, H, D]`` product:
    one batched matmul forward, and a backward of two scaled copies (the einsum's own
    backward is one tiny matmul per row, about 2x slower). Twice differentiable."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor) -> Tensor:
        ctx.save_for_backward(q, k)
        return torch.einsum("nhd,nhd->nh", q, k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k = ctx.saved_tensors
        g = grad.unsqueeze(-1)
        return (g * k if ctx.needs_input_grad[0] else None,
                g * q if ctx.needs_input_grad[1] else None)


def _row_dots(q: Tensor, k: Tensor) -> Tensor:
    """``<q_i, k_i>`` per row and head of ``[n, H, D]`` inputs: ``[n, H]``."""
    return _RowDots.apply(q, k)


def _self_logit(q: Tensor, k: Tensor, scale: float, pos: Optional[Tensor]) -> Tensor:
    """``z(i, i) = s <q_i, k_i> + <pos_i, pos_i>``: ``[n, H]``."""
    own = _row_dots(q, k) * scale
    return own if pos is None else own + pos.pow(2).sum(-1)


@dataclass(frozen=True)
class HSAStatistics:
    r"""The per-node quantities of both passes (see :ref:`def-hsa`), in the layout of
    :class:`TreeStructure`: ``[N, H]`` for leaves, ``[I + 1, H]`` for internal rows
    (null row last).

    Attributes:
        rq, rk: internal subtree means ``[I + 1, H, D]``; rv: ``[I + 1, H, Dv]`` when
            values were given, else ``None`` (all three ``None`` when computed with
            ``means=False`` on a tree whose families hold only leaves).
        total_leaf, total_internal: :math:`\mathrm{logaddexp}(\lambda, \eta)`, the
            log-normaliser of each node's row (a leaf's includes its own diagonal).
        log_m_leaf, log_m_internal: :math:`\log m`, the mass reaching each node
            (leaves: ``None`` when computed with ``leaf_mass=False``).
        log_mu_leaf, log_mu_internal: :math:`\log \mu = \lambda - \mathrm{total}`,
            the share a node keeps inside (leaves: ``None`` likewise).
        lam_internal: :math:`\lambda` of each internal row, from its children alone (the
            null row sums the terms of leaves that are roots: 0 when every leaf has a
            parent); ``log_mu + total`` would round it with :math:`\eta`, which reads the
            right siblings too.
        bucket_lse: per bucket ``[F, H, b]``, each member row's log-sum-exp
            (``total`` for a leaf member, :math:`\eta` for an internal one).
        bucket_out: per bucket ``[F, H, b, Dv]``, the matching softmax times the values
            (``None`` without values).
            A :attr:`~hsa_graph.structure.FamilyBucket.leaf_block` bucket's entries
            are in two parts, its ``L`` leaves' rows and its internal members' rows
            (``[F, H, L, ...]``, ``[F, H, b - L, ...]``), as the scatters take them;
            a bucket whose values product is deferred (``defer_leaf_values``) holds a
            :class:`FamilySoftmax`.
    """

    rq: Optional[Tensor]
    rk: Optional[Tensor]
    rv: Optional[Tensor]
    total_leaf: Tensor
    total_internal: Tensor
    log_m_leaf: Optional[Tensor]
    log_m_internal: Tensor
    log_mu_leaf: Optional[Tensor]
    log_mu_internal: Tensor
    lam_internal: Tensor
    bucket_lse: List[BucketRows]
    bucket_out: List[Optional[Union[BucketRows, FamilySoftmax]]]


def _rows(t: Tensor) -> Tensor:
    """Bucket layout ``[F, H, b, ...]`` -> member rows ``[F * b, H, ...]``."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], *t.shape[3:])


def _leaf_part(t: BucketRows) -> Tensor:
    """The rows of a bucket that hold its leaves: every slot, or a leaf_block bucket's
    first part."""
    return t[0] if isinstance(t, tuple) else t


def _internal_part(t: BucketRows) -> Tensor:
    """As :func:`_leaf_part`, for the internal members."""
    return t[1] if isinstance(t, tuple) else t


def _leaf_rows(st: TreeStructure, per_bucket: List[BucketRows], fill: float, like: Tensor):
    return st.scatter_leaves([_rows(_leaf_part(t)) if b.leaf_slot.numel() else None
                              for b, t in zip(st.buckets, per_bucket)], fill, like)


def _internal_rows(st: TreeStructure, per_bucket: List[Optional[BucketRows]], fill: float,
                   like: Tensor, row_scale: Optional[List[BucketRows]] = None):
    def rows(tensors):
        return [_rows(_internal_part(t)) if b.internal_slot.numel() else None
                for b, t in zip(st.buckets, tensors)]
    return st.scatter_internal(rows(per_bucket), fill, like,
                               None if row_scale is None else rows(row_scale))


def _positions_by_row(st: TreeStructure, pos: Optional[Tensor], dtype: torch.dtype
                      ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Node positions ``[M, (H,) P]`` -> leaf rows ``[N, H or 1, P]`` and internal rows
    ``[I + 1, H or 1, P]`` (null row zero), or ``(None, None)``."""
    if pos is None:
        return None, None
    pos_u = st.to_unified(pos.to(dtype))
    if pos_u.dim() == 2:
        pos_u = pos_u.unsqueeze(1)
    n = st.num_leaves
    return pos_u[:n], torch.cat([pos_u[n:], pos_u.new_zeros((1, *pos_u.shape[1:]))])


def _leaf_operands(q: Tensor, k: Tensor, v: Optional[Tensor], pos_leaf: Optional[Tensor],
                   scale: float) -> Tuple[Tuple[Tensor, Tensor, Tensor], float]:
    r"""Queries, keys and values of the family softmax for leaf rows, and its scale.
    Positions join as extra features, so that
    :math:`\langle q s \oplus p, k \oplus p\rangle = s\langle q, k\rangle +
    \langle p, p\rangle` is one dot product (scale 1); without values the keys stand
    in (same width, so the fused kernel applies); values narrower than the keys get
    zero features (see :func:`_internal_operands`)."""
    fq, fk = q, k
    if pos_leaf is not None:
        pl = pos_leaf.expand(-1, q.shape[1], -1)
        fq, fk, scale = torch.cat([q * scale, pl], -1), torch.cat([k, pl], -1), 1.0
    fv = fk if v is None else v
    if v is not None and v.shape[-1] < fq.shape[-1]:
        # the fused kernels need the values as wide as the keys: zero features added
        # once here (the outputs' are sliced off), not in every bucket and its backward
        fv = _widened(v, fq.shape[-1])
    return (fq, fk, fv), scale


def _internal_operands(means: Tuple, pos_internal: Optional[Tensor], scale: float,
                       leaf_operands: Tuple[Tensor, Tensor, Tensor], values: bool
                       ) -> Tuple[Optional[Tensor], ...]:
    """As :func:`_leaf_operands`, for the internal rows (the subtree means ``rq, rk,
    rv``, any ``None`` when not computed), laid out like ``leaf_operands``."""
    rq, rk, rv = means
    fq, fk = rq, rk
    if pos_internal is not None and rq is not None:
        pi = pos_internal.expand(-1, rq.shape[1], -1)
        fq, fk = torch.cat([rq * scale, pi], -1), torch.cat([rk, pi], -1)
    fv = rv if values else fk
    width = leaf_operands[2].shape[-1]
    if values and rv is not None and rv.shape[-1] < width:
        fv = _widened(rv, width)
    return fq, fk, fv


def _leaf_bucket_into_rows(st: TreeStructure, index: int, operands: Tuple[Tensor, ...],
                           include_self: bool, scale: float, rows_out: Tensor,
                           slot_order: bool = False,
                           scratch: Optional[Tuple[Tensor, ...]] = None) -> Tensor:
    """The family softmax of bucket ``index`` (leaves only, read by index), a chunk of
    families at a time (:meth:`~hsa_graph.structure.TreeStructure.gather_leaf_chunks`),
    each chunk's output rows copied into ``rows_out`` (``[N + 1, H, Dv]``, padding slots
    into its spare row; with ``slot_order``, ``[F * b, H, Dv]`` rows in slot order)
    while they are in cache; ``scratch``: the chunks' buffers, shared by the buckets of
    a call (:meth:`~hsa_graph.structure.TreeStructure.new_leaf_chunk_scratch`).
    Returns the log-sum-exp ``[F, H, b]``. No autograd. (Where the compiled kernel
    applies, :func:`_native_bucket` runs instead: it reads the members by index
    itself.)"""
    bucket = st.buckets[index]
    f, b = bucket.num_families, bucket.size
    dest = None if slot_order else st.leaf_rows_of_slots(index)
    bias = _bucket_bias(st, index, include_self, operands[0].dtype)
    lse = operands[0].new_empty((f, operands[0].shape[1], b))
    for lo, hi, (cq, ck, cv) in st.gather_leaf_chunks(bucket, operands, scratch):
        out, lse[lo:hi] = _family_attention_forward(
            cq.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2),
            None if bias is None else bias[lo:hi], scale)
        if slot_order:
            rows_out[lo * b:hi * b].view(hi - lo, b, *rows_out.shape[1:]).copy_(
                out.transpose(1, 2))
        else:
            rows_out.index_copy_(0, dest[lo * b:hi * b], _rows(out))
    return lse


def hsa_statistics(st: TreeStructure, q: Tensor, k: Tensor, include_self: bool,
                   scale: float, pos: Optional[Tensor], v: Optional[Tensor] = None,
                   leaf_mass: bool = True, means: bool = True,
                   leaf_rows_out: Optional[Tensor] = None,
                   defer_leaf_values: bool = False) -> HSAStatistics:
    """The bottom-up and top-down passes over per-node scalars shared by
    :func:`hsa` and :func:`~hsa_graph.hsa_weights`.

    Every family's softmax runs once, fused with its values when ``v`` is given (then
    ``bucket_out`` and ``rv`` are filled). ``leaf_mass=False`` skips ``log_mu_leaf`` and
    ``log_m_leaf`` (a pass over ``q * k`` that :func:`hsa` does not need);
    ``means=False`` computes the subtree means only when some family has an internal
    member (they are the family softmax's operands there, and nowhere else in
    :func:`hsa`): ``rq, rk, rv`` are then ``None`` on trees whose families hold leaves
    only, e.g. one family per tree. ``leaf_rows_out``: the caller's output buffer
    (:meth:`~hsa_graph.structure.TreeStructure.new_leaf_rows`, ``[N + 1, H, Dv]``),
    into which the leaf rows of ``bucket_out`` are written, unweighted, where autograd
    records nothing: where they lie in one block (their entries are then views of it),
    and for buckets of leaves read by index (their entries are then ``None``: see
    :func:`_leaf_bucket_into_rows`). ``defer_leaf_values``: buckets of leaves alone whose
    families are small (:func:`_small_families`) keep their softmax as probabilities,
    their ``bucket_out`` entry a :class:`FamilySoftmax` whose product with the values
    the caller forms where it weighs the leaf rows (:func:`_weighted_family_values`).
    """
    need_means = means or any(b.internal_slot.numel() for b in st.buckets)
    # Where autograd records and there are no positions, the bucket holding every leaf
    # (it reads q, k, v themselves, as views) runs first and hands the subtree means
    # their leaf sums, whose gradients then join its own (see _FamilyAttention); without
    # autograd it runs first where the compiled kernel applies (hsa_graph.ops.native),
    # which sums the rows as well, and elsewhere the means sum the leaves into their buffer
    whole = st.whole_leaf_bucket if pos is None and v is not None else None
    first = {}
    family_sums = means_buffer = None
    if whole is not None and records_grad(q, k, v):
        if need_means:
            bucket = st.buckets[whole]
            members = tuple(st.gather_bucket(bucket, t, t).transpose(1, 2)
                            for t in (q, k, v))
            bias = _bucket_bias(st, whole, include_self, q.dtype)
            if native_applies(q.detach(), k.detach(), v.detach(), bucket.size):
                # the compiled kernel forward and backward (the family outputs full-size)
                first[whole] = _family_attention(*members, bias, scale, True, include_self)
            else:
                softmax = (_leaf_family_softmax if defer_leaf_values
                           and _small_families(*members[:2], True) else _family_attention)
                first[whole] = softmax(*members, bias, scale, True)
            family_sums = first[whole][2:]
    pos_leaf, pos_internal = _positions_by_row(st, pos, q.dtype)
    leaf_operands, fscale = _leaf_operands(q, k, v, pos_leaf, scale)
    if v is not None and not records_grad(*leaf_operands):
        # (without positions the kernel reads q, k, v themselves: values of any width)
        raw = pos is None
        operands = (q, k, v) if raw else leaf_operands
        first, means_buffer = _native_leaf_buckets(
            st, operands, include_self, scale if raw else fscale, need_means and raw,
            leaf_rows_out if operands[2].shape[-1] == v.shape[-1] else None)
    # Where autograd records, the buckets of leaves read by index run as one node, in
    # chunks (see _LeafGatherFamilies); where its operands are q, k, v themselves it
    # also hands the subtree means their leaf sums
    gathered = {}
    leaf_sums = None
    indices = tuple(i for i, b in enumerate(st.buckets) if b.leaf_gather is not None)
    if indices and records_grad(*leaf_operands) and not torch.compiler.is_compiling():
        sources = (q, k) if v is None else (q, k, v)
        num_sums = len(sources) if need_means and all(
            a is b for a, b in zip(leaf_operands, sources)) else 0
        results = _LeafGatherFamilies.apply(st, indices, include_self, fscale, num_sums,
                                            *leaf_operands)
        gathered = {i: results[2 * j:2 * j + 2] for j, i in enumerate(indices)}
        leaf_sums = results[2 * len(indices):] or None
    rq = rk = rv = None
    if need_means:
        rq, rk, *rest = st.subtree_means(q, k, *([] if v is None else [v]),
                                         family_sums=family_sums, buffer=means_buffer,
                                         leaf_sums=leaf_sums)
        rv = rest[0] if rest else None
    fq_leaf, fk_leaf, fv_leaf = leaf_operands
    fq_internal, fk_internal, fv_internal = _internal_operands(
        (rq, rk, rv), pos_internal, scale, leaf_operands, v is not None)

    bucket_out: List[Optional[BucketRows]] = []
    bucket_lse: List[BucketRows] = []
    # one bucket's members at a time; where no graph saves them, each operand's copies
    # share one scratch
    operands = ((fq_leaf, fq_internal), (fk_leaf, fk_internal), (fv_leaf, fv_internal))
    reuse = not records_grad(*(t for pair in operands for t in pair))
    # without autograd, rows of leaves go straight into the caller's buffer: those of
    # buckets read by index a chunk of families at a time (a whole bucket's gathered
    # copies and output would be fresh mappings, hundreds of MiB on ragged trees)
    direct = (reuse and leaf_rows_out is not None and v is not None
              and fv_leaf.shape[-1] == v.shape[-1])
    streamed = {i for i, b in enumerate(st.buckets)
                if direct and b.leaf_gather is not None and i not in first}
    scratch = (st.new_leaf_chunk_scratch((fq_leaf, fk_leaf, fv_leaf)) if streamed
               else None)
    # without autograd, buckets of leaves alone or of internal members alone go through
    # the compiled kernel where it applies, which reads their rows by index itself
    native = {}
    for index, bucket in enumerate(st.buckets):
        if (reuse and bucket.leaf_block is None
                and index not in first and index not in gathered and index not in streamed):
            result = _native_bucket(st, index, (fq_leaf, fk_leaf, fv_leaf),
                                    (fq_internal, fk_internal, fv_internal), include_self,
                                    fscale)
            if result is not None:
                native[index] = result
    members = zip(*(st.gather_buckets(leaf, internal, reuse=reuse,
                                      skip=streamed | set(first) | set(gathered) | set(native))
                    for leaf, internal in operands))
    for index, (bucket, (bq, bk, bv)) in enumerate(zip(st.buckets, members)):
        if index in first:
            out, lse = first[index][:2]
        elif index in gathered:
            out, lse = gathered[index]
        elif index in native:
            out, lse = native[index]
        elif index in streamed:
            out, lse = None, _leaf_bucket_into_rows(
                st, index, (fq_leaf, fk_leaf, fv_leaf), include_self, fscale,
                leaf_rows_out, scratch=scratch)
        elif bucket.leaf_block is not None:  # (leaves, internal members) per operand
            windows = None
            width = _flash_key_width(bucket.leaf_block[1])
            if reuse and width > bucket.leaf_block[1] and q.device.type == "cpu":
                # (not where autograd records: the overlapping view's backward would
                # build a gradient of the whole storage)
                windows = tuple(st.leaf_block_window(bucket, t, width)
                                for t in (fk_leaf, fv_leaf))
                windows = None if any(w is None for w in windows) else windows
            into = st.leaf_rows_in(leaf_rows_out, bucket) if direct else None
            out, lse = _leaf_block_attention(bucket, (bq[0], bk[0], bv[0]),
                                             (bq[1], bk[1], bv[1]), include_self, fscale,
                                             windows, into)
        else:  # [F, b, H, D] -> [F, H, b, D] views: no copy for contiguous families
            members = (bq.transpose(1, 2), bk.transpose(1, 2), bv.transpose(1, 2))
            softmax = _family_attention
            if (defer_leaf_values and v is not None and fv_leaf.shape[-1] == v.shape[-1]
                    and not bucket.internal_slot.numel()
                    and _small_families(*members[:2], records_grad(*members))):
                softmax = _leaf_family_softmax
            out, lse = softmax(*members, _bucket_bias(st, index, include_self, q.dtype),
                                fscale)
        if v is None or out is None:
            out = None
        elif isinstance(out, FamilySoftmax):
            pass
        else:  # without the zero features of widened values
            out = (tuple(t[..., :v.shape[-1]] for t in out) if isinstance(out, tuple)
                   else out[..., :v.shape[-1]])
        bucket_out.append(out)
        bucket_lse.append(lse)

    like = q[:, :, 0]
    total_leaf = _leaf_rows(st, bucket_lse, NEG_INF, like)
    eta_internal = _internal_rows(st, bucket_lse, NEG_INF, like)
    lonely = st.lonely_leaf
    if include_self and lonely.numel():  # no siblings: total = lam = z(i, i)
        total_leaf = total_leaf.index_copy(0, lonely, _self_logit(
            q[lonely], k[lonely], scale, None if pos_leaf is None else pos_leaf[lonely]))

    # lam bottom-up: lam(A) = sum_C n(C)/n(A) * logaddexp(lam(C), eta(C)).
    leaf_weight, child_weight = st.bottom_up_weights(q.dtype)

    def weighted_total(lam: Tensor, lo: int, hi: int) -> Tensor:
        return child_weight[lo:hi] * _logaddexp(lam, eta_internal[lo:hi])

    lam_internal = st.bottom_up(st.to_internal(leaf_weight * total_leaf), weighted_total,
                                inplace=not records_grad(q, k, v, pos))
    total_internal = _logaddexp(lam_internal, eta_internal)

    # m top-down: log m(A) = log m(pa(A)) + log mu(A), m(root) = 1. The null row
    # (parent of leaves that are roots) has log m = 0, so such a leaf gets m = 1.
    log_mu_internal = _log_ratio(lam_internal, total_internal)
    log_m_internal = st.path_sum(log_mu_internal)
    log_mu_leaf = log_m_leaf = None
    if leaf_mass:
        lam_leaf = (_self_logit(q, k, scale, pos_leaf) if include_self
                    else q.new_full(total_leaf.shape, NEG_INF))
        log_mu_leaf = _log_ratio(lam_leaf, total_leaf)
        log_m_leaf = log_m_internal[st.leaf_parent] + log_mu_leaf
    return HSAStatistics(rq=rq, rk=rk, rv=rv, total_leaf=total_leaf,
                         total_internal=total_internal, log_m_leaf=log_m_leaf,
                         log_m_internal=log_m_internal, log_mu_leaf=log_mu_leaf,
                         log_mu_internal=log_mu_internal, lam_internal=lam_internal,
                         bucket_lse=bucket_lse,
                         bucket_out=bucket_out)


def hsa(q: Tensor, k: Tensor, v: Tensor, tree, include_self: bool = True,
        scale: Optional[float] = None, pos: Optional[Tensor] = None, *,
        check_finite: bool = False) -> Tensor:
    r"""Hierarchical Self-Attention of the leaves of ``tree`` (:ref:`def-hsa`).

    .. math::
        y_i = \sum_j \theta_{ij} v_j, \qquad
        \theta_{ij} = m(\mathrm{pa}(A))\,
            \frac{e^{z(A, B)}}{e^{\lambda(A)} + e^{\eta(A)}}

    where :math:`A, B` are the siblings holding leaves :math:`i, j` under their
    lowest common ancestor, computed in :math:`O(M b^2)` without forming
    :math:`\theta`.

    Each family's sibling softmax is one fused attention call per bucket of equal-size
    families (on the CPU, PyTorch's flash kernel reading ``q, k, v`` in place, or, for
    families of at most 64 leaves where autograd records nothing, the compiled kernel of
    :mod:`hsa_graph.ops.native`); for a
    leaf :math:`i` the row of its family already includes its own diagonal, so
    :math:`y_i = m(\mathrm{pa}(i))\, o_i + \mathrm{acc}(\mathrm{pa}(i))`, where
    :math:`o_i` is the family attention output and :math:`\mathrm{acc}` sums the
    internal nodes' contributions down each path. The structure is read from the
    tree's cache; the call never synchronises with the device.

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
        check_finite: when ``True``, a NaN or inf in ``q``, ``k``, ``v`` or ``pos``
            raises ``ValueError`` naming the tensor and its first offending leaf row
            (node row for ``pos``); this costs a host synchronisation. When ``False``
            (default) nothing is checked, and a non-finite input spreads only within
            the tree that holds it: the other trees of a batch keep finite outputs.

    Returns:
        ``[N, H, Dv]`` (``[N, Dv]`` for two-dimensional inputs), in ``v``'s dtype.

    Example:
        >>> import torch, hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> q = k = v = torch.randn(5, 2, 8)
        >>> hsa_graph.hsa(q, k, v, tree).shape
        torch.Size([5, 2, 8])
    """
    x = prepare_attention(q, k, v, tree, include_self=include_self, scale=scale, pos=pos,
                          check_finite=check_finite)
    if x.empty:
        return x.empty_result(x.v.shape)
    with no_autocast(x.device):
        y = _hsa(x) if x.structure.flat_families is None else flat_attention(x)
    return x.finish(y)


def flat_attention(x: AttentionInputs, causal: bool = False) -> Tensor:
    r"""HSA on a forest of flat trees (:attr:`TreeStructure.flat_trees`: ``F`` roots over
    their leaves), which is softmax attention inside each tree:

    .. math::
        y_i = \sum_{j} \mathrm{softmax}_j\big(s \langle q_i, k_j \rangle
              + \langle \epsilon_i, \epsilon_j \rangle\big)\, v_j

    over the leaves ``j`` of ``i``'s tree (``j != i`` without ``include_self``; ``j <= i``
    with ``causal``, which needs ``include_self``). One fused
    ``scaled_dot_product_attention`` call over ``[F, H, b, D]`` blocks of the leaf rows
    (views where the trees have equal sizes; else the rows gathered into blocks padded
    at the end, which only ``causal`` allows: no real row sees a padding row; ragged
    forests without it take :func:`hsa`'s general passes), so forward and backward
    cost what flat attention costs; positions enter as its additive mask. Equal trees of
    at most 16 leaves without positions, where autograd records nothing, take the
    compiled kernel of :mod:`hsa_graph.ops.native` instead (about half the time of the
    fused call at 16 leaves). Returns ``[N, H, Dv]``.
    """
    flat = x.structure.flat_trees
    f, b = flat.num_trees, flat.width
    if flat.slots is not None and not causal:
        raise ValueError("padded flat trees need the causal mask (padding rows would "
                         "count as keys)")

    def blocks(t: Tensor) -> Tensor:                  # [N, H, D] -> [F, H, b, D]
        if flat.slots is not None:
            t = t.index_select(0, flat.slots)
        return t.view(f, b, *t.shape[1:]).transpose(1, 2)

    if causal and not x.include_self:
        raise ValueError("causal flat attention needs include_self (the first leaf of a "
                         "tree would see nothing)")
    if not causal and x.pos is None and flat.slots is None:
        # trees of at most 16 leaves without autograd: the compiled kernel, where it applies
        native = native_family_attention(x.q, x.k, x.v, b, x.include_self, x.scale)
        if native is not None:
            return native[0].transpose(1, 2).reshape(f * b, *x.v.shape[1:])
    mask = None
    if x.pos is not None:
        leaf_pos = blocks(_positions_by_row(x.structure, x.pos, x.q.dtype)[0])
        mask = leaf_pos @ leaf_pos.transpose(-1, -2)  # <eps(i), eps(j)>, [F, H or 1, b, b]
    if causal:
        order = torch.ones(b, b, dtype=torch.bool, device=x.device).tril()
        mask = order if mask is None else mask.masked_fill(~order, float("-inf"))
    elif not x.include_self:
        others = ~torch.eye(b, dtype=torch.bool, device=x.device)
        mask = others if mask is None else mask.masked_fill(~others, float("-inf"))
    y = scaled_dot_product_attention(blocks(x.q), blocks(x.k), blocks(x.v), attn_mask=mask,
                                     is_causal=causal and mask is None, scale=x.scale)
    y = y.transpose(1, 2).reshape(f * b, *x.v.shape[1:])
    return y if flat.rows is None else y.index_select(0, flat.rows)


def _weigh_leaf_rows_(rows: Tensor, parent: Tensor, acc: Tensor, m_internal: Tensor
                      ) -> None:
    r"""``y_i <- acc(pa(i)) + m(pa(i)) y_i`` in place, for leaf rows grouped under
    their parents: ``rows`` ``[G, b, H, Dv]`` (any strides), group ``g``'s parent row
    ``parent[g]`` (a family's leaf rows weigh :math:`m(\mathrm{pa})` alone, whatever
    their bucket). In chunks of groups whose gathered ``acc`` rows are heap memory
    reused chunk after chunk, not one fresh ``[G, H, Dv]`` mapping faulted in."""
    step = _rows_per_chunk(acc[:1])
    for lo in range(0, rows.shape[0], step):
        above = parent[lo:lo + step]
        torch.addcmul(acc.index_select(0, above).unsqueeze(1), rows[lo:lo + step],
                      m_internal.index_select(0, above)[:, None, :, None],
                      out=rows[lo:lo + step])


def _hsa(x: AttentionInputs) -> Tensor:
    st, v, include_self = x.structure, x.v, x.include_self
    inplace = not records_grad(x.q, x.k, v, x.pos)
    # without autograd, the rows of buckets whose leaves lie in one block are written
    # straight into the output (where one bucket holds every leaf, its family output
    # is already the output)
    y_rows = st.new_leaf_rows(v) if inplace and st.whole_leaf_bucket is None else None
    stats = hsa_statistics(st, x.q, x.k, include_self, x.scale, x.pos, v=v, leaf_mass=False,
                           means=False, leaf_rows_out=y_rows,
                           defer_leaf_values=y_rows is None)

    # A member A of a family sends w(A) = m(pa(A)) (1 - mu(A)) of its mass through the
    # family softmax. A leaf's softmax row already holds its own diagonal, so a leaf
    # weighs its row by m(pa(i)) alone: m(pa) (1 - mu) shares to siblings plus
    # m(i) = m(pa) mu to itself.
    m_internal = stats.log_m_internal.exp()                       # [I + 1, H], null row 1
    sends = -torch.expm1(stats.log_mu_internal)                   # 1 - mu(A)
    ones = m_internal.new_ones(1).expand(st.num_leaves, m_internal.shape[1])
    weights = []
    for bucket in st.buckets:
        w = m_internal.index_select(0, bucket.parent).unsqueeze(-1)   # [F, H, 1]
        if bucket.leaf_block is not None:  # its leaves weigh m(pa) alone
            sent = st.leaf_block_members(bucket, ones, sends)[1]
            w = (w, w * sent.transpose(1, 2))
        elif bucket.internal_slot.numel():
            w = w * st.gather_bucket(bucket, ones, sends).transpose(1, 2)   # [F, H, b]
        weights.append(w)

    # acc(A): the sum of the internal contributions over A's ancestors-or-self, top down.
    # (the weights multiply the internal members' rows only, not every slot)
    acc = st.path_sum(_internal_rows(st, stats.bucket_out, 0.0, v, row_scale=weights),
                      inplace=True)                                          # [I + 1, H, Dv]

    # A leaf's output: its weighted family row plus its parent's acc, in one pass.
    if y_rows is not None:  # the unweighted rows into the output, then weighed in place
        y = st.scatter_leaves([None if out is None or not bucket.leaf_slot.numel()
                               else _rows(_leaf_part(out))
                               for bucket, out in zip(st.buckets, stats.bucket_out)],
                              0.0, v, out=y_rows)
        _weigh_leaf_rows_(y[:st.num_leaves].unsqueeze(1), st.leaf_parent, acc, m_internal)
    else:
        rows: List[Optional[Tensor]] = []
        for bucket, out, w in zip(st.buckets, stats.bucket_out, weights):
            if not bucket.leaf_slot.numel():
                rows.append(None)
                continue
            if isinstance(out, FamilySoftmax):  # P v formed here, weighed as written
                parent = bucket.parent
                y = _weighted_family_values(acc.index_select(0, parent),
                                            m_internal.index_select(0, parent), out)
                rows.append(y.view(-1, *y.shape[2:]))
                continue
            out = _leaf_part(out).transpose(1, 2)                    # [F, b, H, Dv]
            if inplace:  # into the family output (this call's own)
                _weigh_leaf_rows_(out, bucket.parent, acc, m_internal)
                y = out
            else:
                above = acc.index_select(0, bucket.parent).unsqueeze(1)  # [F, 1, H, Dv]
                y = _WeightedRows.apply(above, out, _leaf_part(w).transpose(1, 2).unsqueeze(-1))
            rows.append(y.reshape(-1, *y.shape[2:]))
        y = st.scatter_leaves(rows, 0.0, v)
    lonely = st.lonely_leaf
    if lonely.numel():  # leaves without siblings: acc(parent) + m(i) v_i
        parent = st.leaf_parent[lonely]
        own = acc.index_select(0, parent)
        if include_self:  # mu(i) = 1: no sibling takes any share
            own = own + m_internal[parent].unsqueeze(-1) * v[lonely]
        y = y.index_copy_(0, lonely, own) if inplace else y.index_copy(0, lonely, own)
    return y
