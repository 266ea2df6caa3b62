"""Optional accelerators, detected once at import (as in PyG's ``torch_geometric/typing.py``).

Every flag has a pure-torch fallback; nothing here is required.

* ``WITH_CPU_FLASH_ATTENTION``: PyTorch's private fused CPU attention kernel
  ``aten::_scaled_dot_product_flash_attention_for_cpu``, the one SDPA entry point that
  also returns the log-sum-exp HSA needs (see :func:`hsa_graph.ops.flash.cpu_flash_attention`).
"""
from __future__ import annotations

import torch

__all__ = ["WITH_CPU_FLASH_ATTENTION"]

#: Whether this PyTorch has the fused CPU attention kernel that also returns the
#: log-sum-exp (``aten::_scaled_dot_product_flash_attention_for_cpu``).
WITH_CPU_FLASH_ATTENTION: bool = hasattr(torch.ops.aten,
                                         "_scaled_dot_product_flash_attention_for_cpu")
