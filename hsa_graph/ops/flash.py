"""The fused CPU attention kernel behind HSA's family softmax, and when it applies."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..typing import WITH_CPU_FLASH_ATTENTION

__all__ = ["cpu_flash_attention"]

_FLASH_DTYPES = (torch.float32, torch.float64)


def cpu_flash_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                        scale: float) -> Optional[Tuple[Tensor, Tensor]]:
    r"""``softmax(s q k^T + bias) v`` and its row log-sum-exp with PyTorch's fused CPU
    kernel, or ``None`` where the kernel does not apply.

    Why this kernel: it is the one SDPA entry point that returns the log-sum-exp
    (:math:`\ell`, HSA's :math:`\eta` and :math:`\lambda` need it) next to the output,
    it reads strided ``[F, H, b, D]`` views of ``q, k, v`` in place and never forms the
    ``[F, H, b, b]`` logits. It is private (``aten::_scaled_dot_product_flash_attention_for_cpu``),
    so its preconditions are checked here, not assumed: a CPU tensor of float32 or
    float64, ``Dv == D``, and a unit-stride feature axis (the kernel reads each row as
    dense memory and returns wrong values for any other stride of the last dimension).

    Without it (other devices, half precision, ``Dv != D``, or a PyTorch without the
    kernel) the caller computes the same two results with plain matmuls, which costs the
    ``[F, H, b, b]`` logits in memory.

    Args:
        q, k: ``[F, H, b, D]``; v: ``[F, H, b, Dv]``; bias broadcastable to
            ``[F, H, b, b]`` or ``None``; scale: the logit scale.

    Returns:
        ``(out [F, H, b, Dv], lse [F, H, b])`` or ``None``.
    """
    if not (WITH_CPU_FLASH_ATTENTION and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES
            and q.shape[-1] == v.shape[-1] and q.shape[-1] > 0):
        return None
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=bias, scale=scale)
