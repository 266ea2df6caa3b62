"""Optional accelerators, detected once at import (as in PyG's ``torch_geometric/typing.py``).

Every flag has a pure-torch fallback; nothing here is required.

* ``WITH_CPU_FLASH_ATTENTION``: PyTorch's private fused CPU attention kernel
  ``aten::_scaled_dot_product_flash_attention_for_cpu``, the one SDPA entry point that
  also returns the log-sum-exp HSA needs (see :func:`hsa_graph.ops.flash.cpu_flash_attention`).
* ``WITH_NUMBA``: numba, which compiles the fused CPU kernel of a generation step
  (:mod:`hsa_graph.ops.step_kernel`; ``pip install hsa_graph[numba]``). Found here
  without importing it (that costs a third of a second); imported at the first step
  that can use it.
* ``WITH_C_COMPILER``: a C compiler, which builds the CPU kernel of the softmax inside
  small families of consecutive leaves (:mod:`hsa_graph.ops.native`) at its first use
  and keeps it on disk.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Optional

import torch

__all__ = ["WITH_CPU_FLASH_ATTENTION", "WITH_NUMBA", "WITH_C_COMPILER", "C_COMPILER"]

#: Whether this PyTorch has the fused CPU attention kernel that also returns the
#: log-sum-exp (``aten::_scaled_dot_product_flash_attention_for_cpu``).
WITH_CPU_FLASH_ATTENTION: bool = hasattr(torch.ops.aten,
                                         "_scaled_dot_product_flash_attention_for_cpu")

#: Whether numba is installed (:mod:`hsa_graph.ops.step_kernel` then runs
#: :meth:`~hsa_graph.ops.cache.BatchedHSACache.step` on the CPU in one call).
WITH_NUMBA: bool = importlib.util.find_spec("numba") is not None


def _c_compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path is not None:
            return path
    return None


#: The C compiler :mod:`hsa_graph.ops.native` builds its CPU family kernel with, at the
#: first call that can use it (``$CC``, else ``cc``, ``gcc`` or ``clang`` on the
#: ``PATH``); ``None`` where there is none.
C_COMPILER: Optional[str] = _c_compiler()

#: Whether a C compiler was found (:data:`C_COMPILER`); set it to ``False`` to keep every
#: call on PyTorch's kernels.
WITH_C_COMPILER: bool = C_COMPILER is not None
