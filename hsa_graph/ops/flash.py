"""The fused CPU attention kernel behind HSA's family softmax, and when it applies."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..structure import _rows_per_chunk
from ..typing import WITH_CPU_FLASH_ATTENTION

__all__ = ["cpu_flash_attention", "cpu_flash_attention_backward"]

_FLASH_DTYPES = (torch.float32, torch.float64)

#: Profiler scope of the one host read of these CPU kernels (whether any row's
#: log-sum-exp gradient needs the extra passes of :func:`cpu_flash_attention_backward`).
CPU_READ = "hsa_graph::cpu_flash_read"

#: Bytes of ``q`` per block of families in :func:`cpu_flash_attention_backward`: small,
#: because the kernel allocates (and zero-fills) each block's three gradients itself, and
#: blocks of 8 MiB came back as fresh pages every block (the heap above glibc's trim
#: threshold is returned): forward + backward of a balanced tree of 262,144 leaves took
#: 3.1-4.2 s with blocks of 8 MiB and 2.1-2.4 s with 512 KiB (2 threads; 0.54 s and
#: 0.51 s at 65,536 leaves).
_BLOCK_BYTES = 512 << 10


def _applies(q: Tensor, v: Tensor) -> bool:
    return (WITH_CPU_FLASH_ATTENTION and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES
            and v.dtype == q.dtype and q.shape[-1] > 0 and v.shape[-1] > 0)


def _widened(t: Tensor, width: int) -> Tensor:
    """``t`` with zero features appended up to ``width`` (the kernels need ``Dv == D``:
    zero query and key features leave the logits unchanged, zero value features give
    zero output features, and their gradients are dropped)."""
    if t.shape[-1] == width:
        return t
    return torch.cat([t, t.new_zeros((*t.shape[:-1], width - t.shape[-1]))], -1)


def _unit_stride(*tensors: Tensor) -> Tuple[Tensor, ...]:
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def cpu_flash_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                        scale: float) -> Optional[Tuple[Tensor, Tensor]]:
    r"""``softmax(s q k^T + bias) v`` and its row log-sum-exp with PyTorch's fused CPU
    kernel, or ``None`` where the kernel does not apply.

    Why this kernel: it is the one SDPA entry point that returns the log-sum-exp
    (:math:`\ell`, HSA's :math:`\eta` and :math:`\lambda` need it) next to the output,
    it reads strided ``[F, H, b, D]`` views of ``q, k, v`` in place and never forms the
    ``[F, H, b, b]`` logits. It is private (``aten::_scaled_dot_product_flash_attention_for_cpu``),
    so its preconditions are checked here, not assumed: a CPU tensor of float32 or
    float64 and a unit-stride feature axis (the kernel reads each row as dense memory
    and returns wrong values for any other stride of the last dimension). The kernel
    needs ``Dv == D``: the narrower side is widened with zero features (e.g. the values
    when positions join the queries and keys as extra features).

    Without it (other devices, half precision, or a PyTorch without the kernel) the
    caller computes the same two results with plain matmuls, which costs the
    ``[F, H, b, b]`` logits in memory.

    Args:
        q, k: ``[F, H, b, D]``; v: ``[F, H, b, Dv]``; bias broadcastable to
            ``[F, H, b, b]`` or ``None``; scale: the logit scale.

    Returns:
        ``(out [F, H, b, Dv], lse [F, H, b])`` or ``None``.
    """
    if not _applies(q, v):
        return None
    dv, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
    q, k, v = _unit_stride(*(_widened(t, width) for t in (q, k, v)))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=bias, scale=scale)
    return (out if dv == width else out[..., :dv]), lse


def cpu_flash_attention_backward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                                 out: Tensor, lse: Tensor, d_out: Tensor,
                                 d_lse: Optional[Tensor], scale: float
                                 ) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    r"""The gradients of :func:`cpu_flash_attention`'s two results, the log-sum-exp's
    included, from PyTorch's fused CPU kernels, or ``None`` where they do not apply
    (then the caller recomputes them with batched matmuls).

    The fused backward forms :math:`dS = P \odot (dO\, v^\top - \delta)` with
    :math:`\delta_i = dO_i \cdot o_i`, and reads the output :math:`o` for
    :math:`\delta` alone. The log-sum-exp's gradient adds :math:`P \odot d\ell` to
    :math:`dS`, that is :math:`\delta_i - d\ell_i` in place of :math:`\delta_i`, so the
    kernel is handed

    .. math::
        o'_i = o_i - \frac{d\ell_i}{\lVert dO_i \rVert^2}\, dO_i,
        \qquad dO_i \cdot o'_i = \delta_i - d\ell_i,

    and one kernel call gives all three gradients (the rounding of
    :math:`dO_i \cdot o'_i` is that of :math:`\delta_i` and :math:`d\ell_i` apart).
    A row whose :math:`dO_i` cannot carry its :math:`d\ell_i` (zero, or so small that
    the quotient would overflow: e.g. a leaf whose output no loss reads) keeps
    :math:`o_i`, and its term comes from two more passes of the fused forward over the
    families holding such rows:

    .. math::
        dq \mathrel{+}= s\, d\ell \odot (P k), \qquad
        dk \mathrel{+}= s\, P^\top (d\ell \odot q),

    :math:`P k` as attention with ``k`` as its values, and :math:`P^\top` as attention
    of the keys over the queries with the additive mask
    :math:`\mathrm{bias}^\top - \ell_i` on query ``i``, whose rows are then not
    normalised (:math:`P^\top_{ji} \le 1`), so their sums come back as
    :math:`e^{\mathrm{lse}}` and are multiplied back in. Families must have an
    unmasked key in every row (every HSA family has two members), where
    :math:`\ell` is finite. The per-head batched matmuls of the alternative run one
    small GEMM per family on the token-major strides and cost several times more.

    Args:
        q, k, v, bias, scale: as for :func:`cpu_flash_attention`.
        out, lse: its two results.
        d_out, d_lse: their gradients, ``[F, H, b, Dv]`` and ``[F, H, b]`` (``d_lse``
            may be ``None``, read as zero).

    Returns:
        ``(dq, dk, dv)`` shaped as ``q, k, v``, or ``None``.
    """
    if not (_applies(q, v) and lse.dtype == q.dtype
            and (bias is None or bias.dtype == q.dtype)):
        return None
    d, dv, width = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
    if d != dv:  # as in the forward: the narrower side widened by zero features
        grads = cpu_flash_attention_backward(
            _widened(q, width), _widened(k, width), _widened(v, width), bias,
            _widened(out, width), lse, _widened(d_out, width), d_lse, scale)
        return grads[0][..., :d], grads[1][..., :d], grads[2][..., :dv]
    q, k, v, out, d_out = _unit_stride(q, k, v, out, d_out)
    f = q.shape[0]
    step = _rows_per_chunk(q, _BLOCK_BYTES)
    if step >= f:
        return _backward_block(q, k, v, bias, out, lse, d_out, d_lse, scale)
    # Blocks of families: every temporary (the kernels' outputs, zero-filled gradients,
    # P k, d_lse * q) is small (see _BLOCK_BYTES; the fold buffer is one for all
    # blocks), memory that the heap hands back block after block, where
    # full-size ones are fresh mappings whose pages fault in on every call; only the
    # three gradients are full-size, written once (empty_like keeps q's token-major
    # strides).
    grads = [torch.empty_like(t) for t in (q, k, v)]
    folded = None if d_lse is None else torch.empty_like(out[:step])
    for lo in range(0, f, step):
        rows = slice(lo, lo + step)
        part = _backward_block(
            q[rows], k[rows], v[rows],
            None if bias is None else bias[rows] if bias.shape[0] == f else bias,
            out[rows], lse[rows], d_out[rows], None if d_lse is None else d_lse[rows], scale,
            None if folded is None else folded[:min(step, f - lo)])
        for full, block in zip(grads, part):
            full[rows].copy_(block)
    return tuple(grads)




def _backward_block(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], out: Tensor,
                    lse: Tensor, d_out: Tensor, d_lse: Optional[Tensor], scale: float,
                    folded: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    rest = None
    if d_lse is not None:
        out, rest = _fold_lse_gradient(out, d_out, d_lse, folded)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale)
    if rest is not None:
        _add_lse_gradient(q, k, bias, lse, rest, scale, dq, dk)
    return dq, dk, dv


def _fold_lse_gradient(out: Tensor, d_out: Tensor, d_lse: Tensor,
                       folded: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """``o'`` of :func:`cpu_flash_attention_backward` (``d_lse`` folded into the output the
    kernel reads; into ``folded``, a buffer shaped as ``out``, if given), and the rows'
    ``d_lse`` that ``d_out`` cannot carry (``None`` if none)."""
    # one reduction, no [F, H, b, D] product (5x faster than (d_out * d_out).sum(-1))
    norm2 = torch.linalg.vector_norm(d_out, dim=-1).square_()               # [F, H, b]
    limit = torch.finfo(out.dtype)
    # |coef * d_out| = |d_lse| / |d_out| must stay far from overflow
    carried = (norm2 >= limit.tiny) & (d_lse.abs() <= norm2.sqrt() * (limit.max * 1e-4))
    coef = torch.where(carried, d_lse, 0.0) / torch.where(carried, norm2, 1.0)
    folded = torch.addcmul(out, coef.unsqueeze(-1), d_out, value=-1.0, out=folded)
    rest = torch.where(carried, 0.0, d_lse)
    # a read of a CPU tensor (these kernels run on the CPU alone), not a device sync;
    # the scope's name lets the no-sync tests tell it apart
    with torch.profiler.record_function(CPU_READ):
        some = bool(rest.ne(0).any())
    return folded, (rest if some else None)


def _add_lse_gradient(q: Tensor, k: Tensor, bias: Optional[Tensor], lse: Tensor,
                      d_lse: Tensor, scale: float, dq: Tensor, dk: Tensor) -> None:
    """``dq += s d_lse (P k)``, ``dk += s P^T (d_lse q)`` over the families where
    ``d_lse`` is not zero (see :func:`cpu_flash_attention_backward`)."""
    families = d_lse.ne(0).flatten(1).any(1).nonzero().squeeze(1)
    if families.numel() < q.shape[0]:
        part_dq, part_dk = torch.zeros_like(q[families]), torch.zeros_like(k[families])
        _add_lse_gradient(q[families], k[families],
                          bias if bias is None or bias.shape[0] == 1 else bias[families],
                          lse[families], d_lse[families], scale, part_dq, part_dk)
        dq.index_add_(0, families, part_dq)
        dk.index_add_(0, families, part_dk)
        return
    d_lse = d_lse.unsqueeze(-1)
    p_k = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, k, attn_mask=bias, scale=scale)[0]
    dq.addcmul_(p_k, d_lse, value=scale)
    # contiguous [F, H, 1, b] broadcasts in the kernel (a strided one is expanded into a
    # copy of [F, H, b, b]); P k's buffer, read, takes d_lse * q
    rows = lse.neg().unsqueeze(-2).contiguous()
    mask = rows if bias is None else bias.transpose(-1, -2) + rows
    col, col_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        k, q, torch.mul(q, d_lse, out=p_k), attn_mask=mask, scale=scale)
    dk.addcmul_(col, col_lse.exp_().unsqueeze(-1), value=scale)
