"""Optional accelerators, detected once at import (as in PyG's ``torch_geometric/typing.py``).

Every flag has a pure-torch fallback; nothing here is required.

* ``WITH_CPU_FLASH_ATTENTION``: PyTorch's private fused CPU attention kernel
  ``aten::_scaled_dot_product_flash_attention_for_cpu``, the one SDPA entry point that
  also returns the log-sum-exp HSA needs (see :func:`hsa_graph.ops.flash.cpu_flash_attention`).
* ``WITH_NUMBA``: numba, which compiles the fused CPU kernel of a generation step
  (:mod:`hsa_graph.ops.step_kernel`; ``pip install hsa_graph[numba]``). Found here
  without importing it (that costs a third of a second); imported at the first step
  that can use it.
"""
from __future__ import annotations

import importlib.util

import torch

__all__ = ["WITH_CPU_FLASH_ATTENTION", "WITH_NUMBA"]

#: Whether this PyTorch has the fused CPU attention kernel that also returns the
#: log-sum-exp (``aten::_scaled_dot_product_flash_attention_for_cpu``).
WITH_CPU_FLASH_ATTENTION: bool = hasattr(torch.ops.aten,
                                         "_scaled_dot_product_flash_attention_for_cpu")

#: Whether numba is installed (:mod:`hsa_graph.ops.step_kernel` then runs
#: :meth:`~hsa_graph.ops.cache.BatchedHSACache.step` on the CPU in one call).
WITH_NUMBA: bool = importlib.util.find_spec("numba") is not None
