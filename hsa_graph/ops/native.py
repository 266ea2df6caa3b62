r"""A compiled CPU kernel for the softmax inside small families of consecutive leaves.

Where the leaves of a batch lie in families of ``b <= 16`` consecutive rows (every
balanced tree, text windows, image patches), HSA's largest cost is the softmax inside
those families, and PyTorch's kernels pay per ``b x b`` block about what they pay for a
block 4x wider: its fused CPU kernel makes two BLAS calls per family and head, and
batched matmuls three full-size passes. ``family_kernel.c`` (beside this file) does a
family's heads in one pass over its rows while they are in cache, and also sums its
``q``, ``k`` and ``v`` rows (the operands of the families above, which would otherwise
be a fourth read of each). Its backward (:func:`native_family_attention_backward`)
recomputes each family's probabilities from ``q``, ``k`` and the saved log-sum-exp and
writes ``dq``, ``dk``, ``dv`` once, in the same pass; ``hsa`` takes it for the bucket of
every leaf where autograd records (forward + backward of hsa on balanced trees of 64
leaves, 64 per batch, 4 heads, D = 64, calls alternated in one process with the same
call through PyTorch's kernels: 0.97-1.02x their time at 1 thread, 0.92-0.94x at 2).

Measured (one family softmax over 256 families of 16 leaves, 4 heads, D = 64, float32,
token-major rows, medians of 200 calls alternated in one process, 2 cores): 2.13 ms at 1
thread against 3.70 for PyTorch's fused kernel (and 5.72 for flat attention over trees
of 64 leaves); 1.10 against 3.24 ms at 2 threads.

The kernel is built on first use with the C compiler found at import
(:data:`hsa_graph.typing.WITH_C_COMPILER`: ``$CC``, else ``cc``, ``gcc`` or ``clang``
on the ``PATH``) for this machine (``-march=native``), in about a third of a second, and
kept in ``$XDG_CACHE_HOME/hsa_graph`` (``~/.cache/hsa_graph``) under a name hashing the
source, the flags, the compiler and the CPU, so that a later process loads it. Where
PyTorch runs on GNU OpenMP (Linux wheels), the kernel is built with OpenMP and splits the
families over ``torch.get_num_threads()`` threads of PyTorch's own OpenMP runtime;
elsewhere it runs on one thread. Where no compiler is found, or the build fails (a
warning says why, once), every call takes the PyTorch kernels: the results agree to
float32 rounding either way.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import typing as hsa_typing
from ..structure import fresh_buffer

__all__ = ["native_applies", "native_family_attention", "native_family_attention_backward",
           "native_gathered_family_attention", "native_kernel_available"]

SOURCE = Path(__file__).with_name("family_kernel.c")
#: Largest family the kernel takes.
MAX_FAMILY = 64
#: Feature widths must be multiples of this (whole vectors), ``D`` at most ``MAX_D``.
LANES = 16
MAX_D = 1024

_lock = threading.Lock()
_kernel = None        # the loaded function, once built
_backward_kernel = None   # its backward, from the same library
_tried = False        # whether this process has tried to build it


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags",
                                                            "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _uses_gnu_openmp() -> bool:
    """Whether this process runs PyTorch on GNU OpenMP (``libgomp`` mapped): a kernel
    built with ``-fopenmp`` then binds to that same runtime and its threads, not a
    second pool competing with PyTorch's for the cores."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return False


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    for path in (Path(base) / "hsa_graph",
                 Path(tempfile.gettempdir()) / f"hsa_graph-{getattr(os, 'getuid', int)()}"):
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise OSError("no writable cache directory")


def _build(compiler: str) -> Tuple[Optional[Path], str]:
    """Compile :data:`SOURCE` (or find it compiled); ``(library, "")`` or ``(None,
    the compiler's complaint)``. The flags fall back from OpenMP and ``-march=native``
    to plain ``-O3`` where the compiler refuses them."""
    source = SOURCE.read_bytes()
    base = ["-O3", "-fno-math-errno", "-shared", "-fPIC"]
    attempts: List[List[str]] = [base + ["-march=native"], base]
    if _uses_gnu_openmp():
        attempts.insert(0, base + ["-march=native", "-fopenmp"])
    errors = ""
    directory = _cache_dir()
    for flags in attempts:
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), compiler.encode(),
                                         _cpu_signature().encode()])).hexdigest()[:24]
        library = directory / f"family_kernel_{key}.so"
        if library.exists():
            return library, ""
        scratch = directory / f"{library.name}.{os.getpid()}.tmp"
        try:
            result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(scratch), "-lm"],
                                    capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as error:
            errors = str(error)
            continue
        if result.returncode == 0:
            os.replace(scratch, library)   # atomic: a concurrent build finds it whole
            return library, ""
        errors = (result.stderr or result.stdout).strip()[-600:]
        scratch.unlink(missing_ok=True)
    return None, errors


def _load():
    """The kernel's function, built on the first call; ``None`` without a compiler or
    where the build failed (warned once)."""
    global _kernel, _backward_kernel, _tried
    if _kernel is not None or _tried:
        return _kernel
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        compiler = hsa_typing.C_COMPILER
        if compiler is None:
            return None
        try:
            library, errors = _build(compiler)
            if library is not None:
                loaded = ctypes.CDLL(str(library))
                function = loaded.hsa_family_attention_f32
                backward = loaded.hsa_family_attention_backward_f32
        except (OSError, AttributeError) as error:
            library, errors = None, str(error)
        if library is None:
            warnings.warn(f"hsa_graph: building the CPU family kernel with {compiler} "
                          f"failed, PyTorch's kernels run instead: {errors}",
                          RuntimeWarning, stacklevel=3)
            return None
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        function.argtypes = ([pointer] * 12 + [size] * 13
                             + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
        function.restype = None
        backward.argtypes = ([pointer] * 13 + [size] * 15
                             + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
        backward.restype = None
        _kernel, _backward_kernel = function, backward
        return _kernel


def native_kernel_available() -> bool:
    """Whether this process can run the compiled kernel (building it if need be)."""
    return hsa_typing.WITH_C_COMPILER and _load() is not None


def _fits(t: Tensor, rows: int, heads: int) -> bool:
    return (t.dim() == 3 and t.shape[0] == rows and t.shape[1] == heads
            and t.dtype == torch.float32 and t.device.type == "cpu"
            and 0 < t.shape[2] <= MAX_D and t.shape[2] % LANES == 0
            and t.stride(2) == 1)


def _applies(q: Tensor, k: Tensor, v: Tensor, size: int) -> bool:
    n, h = q.shape[0], q.shape[1] if q.dim() == 3 else 0
    return (hsa_typing.WITH_C_COMPILER and not torch.compiler.is_compiling()
            and 1 <= size <= MAX_FAMILY and n > 0
            and _fits(q, n, h) and _fits(k, n, h) and _fits(v, n, h)
            and k.shape[2] == q.shape[2]
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                  or v.requires_grad)))


def _run(kernel, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
         sums: Optional[Tuple[Tensor, Tensor, Tensor]], sum_rows: Optional[Tensor],
         rows_in: Optional[Tensor], rows_out: Optional[Tensor], key_bias: Optional[Tensor],
         families: int, size: int, include_self: bool, scale: float) -> None:
    def pointer(t: Optional[Tensor]) -> Optional[int]:
        return None if t is None else t.data_ptr()

    sum_q, sum_k, sum_v = (None, None, None) if sums is None else sums
    kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
           pointer(sum_q), pointer(sum_k), pointer(sum_v), pointer(rows_in),
           pointer(rows_out), pointer(sum_rows), pointer(key_bias), families, size,
           q.shape[1], q.shape[2], v.shape[2], q.stride(0), q.stride(1), k.stride(0),
           k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
           float(scale), int(include_self), torch.get_num_threads())


def native_applies(q: Tensor, k: Tensor, v: Tensor, size: int) -> bool:
    """Whether the compiled kernel runs on families of ``size`` members of these
    operands (:func:`native_gathered_family_attention`; :func:`native_family_attention`
    where ``size`` also divides ``N``): float32 CPU tensors whose autograd records
    nothing, ``size <= MAX_FAMILY``, feature widths multiples of 16, a compiler at hand
    (the kernel is built if need be)."""
    return _applies(q, k, v, size) and _load() is not None


def _sums(q: Tensor, v: Tensor, families: int, sums_into: Optional[Tuple[Tensor, ...]],
          sum_rows: Optional[Tensor], caller: str) -> Tuple[Tensor, Tensor, Tensor]:
    """The three tensors the kernel writes the families' sums into, checked (a new
    ``[F, H, *]`` each without ``sums_into``)."""
    h, d, dv = q.shape[1], q.shape[2], v.shape[2]
    if sums_into is None:
        if sum_rows is not None:
            raise ValueError(f"{caller}: sum_rows without sums_into")
        return (q.new_empty((families, h, d)), q.new_empty((families, h, d)),
                v.new_empty((families, h, dv)))
    sums = tuple(sums_into)
    rows = families if sum_rows is None else None
    if (len(sums) != 3 or any(
            t.dim() != 3 or t.shape[1:] != (h, width) or t.dtype != torch.float32
            or t.device.type != "cpu" or not t.is_contiguous()
            or (rows is not None and t.shape[0] < rows) or t.shape[0] != sums[0].shape[0]
            for t, width in zip(sums, (d, d, dv)))):
        raise ValueError(f"{caller}: sums_into must be three dense float32 CPU tensors "
                         f"[R, {h}, {d}], [R, {h}, {d}], [R, {h}, {dv}] (R >= {families} "
                         "without sum_rows)")
    if sum_rows is not None and (sum_rows.shape != (families,) or sum_rows.dtype != torch.long
                                 or not sum_rows.is_contiguous()
                                 or sum_rows.device.type != "cpu"):
        raise ValueError(f"{caller}: sum_rows must be a dense int64 CPU tensor of shape "
                         f"({families},)")
    return sums


def native_family_attention(q: Tensor, k: Tensor, v: Tensor, size: int, include_self: bool,
                            scale: float, sums_into: Optional[Tuple[Tensor, ...]] = None,
                            sum_rows: Optional[Tensor] = None
                            ) -> Optional[Tuple[Tensor, ...]]:
    r"""Softmax attention inside the families of ``size`` consecutive rows of
    ``q, k`` ``[N, H, D]`` and ``v`` ``[N, H, Dv]`` (family ``f``: rows ``f * size`` to
    ``f * size + size - 1``), with the families' sums, through the compiled kernel:
    ``(out [F, H, b, Dv], lse [F, H, b], sum_q, sum_k, sum_v)``, the layout of the fused
    family kernel with ``family_sums`` (``out`` a view of token-major ``[N, H, Dv]``
    rows), for

    .. math::
        \ell_i = \log \sum_j e^{s \langle q_i, k_j \rangle}, \qquad
        o_i = \sum_j e^{s \langle q_i, k_j \rangle - \ell_i} v_j

    over the family's rows ``j`` (``j != i`` without ``include_self``; a row with no
    key gets :math:`\ell = -\infty` and :math:`o = 0`). ``None`` where the kernel does
    not apply: no compiler or a failed build, autograd recording, ``torch.compile``
    tracing, other than float32 CPU tensors, ``size`` above :data:`MAX_FAMILY` or not
    dividing ``N``, ``D`` or ``Dv`` not a multiple of 16 (or ``D > 1024``), or a
    feature axis that is not dense. Rows and heads may have any strides (e.g. ``q, k,
    v`` as views of one ``[N, 3, H, D]`` projection).

    The sums are new ``[F, H, D]``, ``[F, H, D]``, ``[F, H, Dv]`` tensors, or written
    into ``sums_into``: three dense ``[R, H, D]``, ``[R, H, D]``, ``[R, H, Dv]`` float32
    tensors (e.g. the subtree means' buffer,
    :meth:`~hsa_graph.TreeStructure.new_means_buffer`), family ``f``'s at row
    ``sum_rows[f]`` (``[F]`` int64; rows ``0 .. F - 1`` without it), and then returned
    as given. The rows are the caller's structure's and are not checked here."""
    if not _applies(q, k, v, size) or q.shape[0] % size:
        return None
    kernel = _load()
    if kernel is None:
        return None
    n, h, dv = q.shape[0], q.shape[1], v.shape[2]
    f = n // size
    sums = _sums(q, v, f, sums_into, sum_rows, "native_family_attention")
    out = fresh_buffer(v, (n, h, dv))
    lse = q.new_empty((f, h, size))
    _run(kernel, q, k, v, out, lse, sums, sum_rows, None, None, None, f, size, include_self,
         scale)
    return (out.view(f, size, h, dv).transpose(1, 2), lse, *sums)


def native_gathered_family_attention(q: Tensor, k: Tensor, v: Tensor, rows_in: Tensor,
                                     key_bias: Tensor, include_self: bool, scale: float,
                                     out: Optional[Tensor] = None,
                                     rows_out: Optional[Tensor] = None,
                                     sums_into: Optional[Tuple[Tensor, ...]] = None,
                                     sum_rows: Optional[Tensor] = None
                                     ) -> Optional[Tuple[Tensor, Tensor]]:
    r""":func:`native_family_attention` over families whose members are read by index:
    family ``f``'s slot ``j`` is the row ``rows_in[f, j]`` of ``q, k, v``, with key bias
    ``key_bias[f, j]`` added to its logits (``-inf`` on padding slots: never attended
    to, nor summed), ``rows_in`` ``[F, b]`` int64 and ``key_bias`` ``[F, b]`` float32,
    both dense. Writes the output row of slot ``(f, j)`` into ``out`` ``[R, H, Dv]`` in
    place, at row ``rows_out[f, j]`` (``[F, b]`` int64; padding slots are not written:
    they may share a spare row), or at row ``f * b + j`` without ``rows_out`` (slot
    order; without ``out`` a new ``[F * b, H, Dv]`` buffer). The families' sums only
    into ``sums_into`` where given (as in :func:`native_family_attention`). The indices
    are the caller's structure's and are not checked here. Returns ``(out, lse [F, H,
    b])``, or ``None`` where the kernel does not apply (then nothing is written)."""
    f, b = rows_in.shape
    h, dv = q.shape[1], v.shape[2]
    if (not _applies(q, k, v, b) or f == 0
            or (out is not None and (not _fits(out, out.shape[0], h) or out.shape[2] != dv
                                     or (rows_out is None and out.shape[0] < f * b)))
            or (rows_out is not None and out is None)
            or any(t.shape != (f, b) or not t.is_contiguous() or t.device.type != "cpu"
                   for t in (rows_in, key_bias) + ((rows_out,) if rows_out is not None
                                                   else ()))
            or key_bias.dtype != torch.float32
            or any(t.dtype != torch.long for t in (rows_in, rows_out) if t is not None)):
        return None
    kernel = _load()
    if kernel is None:
        return None
    sums = (None if sums_into is None and sum_rows is None else
            _sums(q, v, f, sums_into, sum_rows, "native_gathered_family_attention"))
    if out is None:
        out = fresh_buffer(v, (f * b, h, dv))
    lse = q.new_empty((f, h, b))
    _run(kernel, q, k, v, out, lse, sums, sum_rows, rows_in, rows_out, key_bias, f, b,
         include_self, scale)
    return out, lse


def native_family_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                     lse: Tensor, d_out: Tensor, d_lse: Optional[Tensor],
                                     d_sums: Tuple[Optional[Tensor], ...], size: int,
                                     include_self: bool, scale: float
                                     ) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    r"""The gradients of :func:`native_family_attention` (families of ``size``
    consecutive rows of ``q, k`` ``[N, H, D]``, ``v`` ``[N, H, Dv]``), through the
    compiled kernel: from ``out`` and ``d_out`` ``[N, H, Dv]`` (the output and its
    gradient), ``lse`` and ``d_lse`` ``[F, H, b]`` (``d_lse`` ``None``: zero) and the
    gradients of the families' sums ``d_sums`` (three ``[F, H, *]`` or ``None``), with
    :math:`P = e^{S - \ell}` recomputed from ``q, k``:

    .. math::
        dS_{ij} = P_{ij} (\langle dO_i, v_j \rangle - \langle dO_i, o_i \rangle
        + d\ell_i), \quad dq_i = s \sum_j dS_{ij} k_j, \quad
        dk_j = s \sum_i dS_{ij} q_i, \quad dv_j = \sum_i P_{ij}\, dO_i

    plus each family's sums' gradient on every row of it. Returns new dense ``dq, dk,
    dv``, each written once, or ``None`` where :func:`native_family_attention` would
    not apply (rows and heads of the inputs may have any strides, features dense)."""
    if not (_applies(q, k, v, size) and q.shape[0] % size == 0 and _fits(out, *v.shape[:2])
            and _fits(d_out, *v.shape[:2]) and out.shape == v.shape == d_out.shape):
        return None
    if _load() is None:
        return None
    n, h, d, dv = *q.shape, v.shape[2]
    f = n // size
    lse = lse.contiguous()
    d_lse = None if d_lse is None else d_lse.contiguous()
    if lse.shape != (f, h, size) or (d_lse is not None and d_lse.shape != lse.shape):
        return None
    sums = tuple(None if g is None else g.contiguous() for g in d_sums)
    if any(g is not None and g.shape != (f, h, w) for g, w in zip(sums, (d, d, dv))):
        return None
    grads = (fresh_buffer(q, (n, h, d)), fresh_buffer(k, (n, h, d)), fresh_buffer(v, (n, h, dv)))

    def pointer(t: Optional[Tensor]) -> Optional[int]:
        return None if t is None else t.data_ptr()

    _backward_kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), d_out.data_ptr(),
        lse.data_ptr(), pointer(d_lse), *(pointer(g) for g in sums),
        *(g.data_ptr() for g in grads), f, size, h, d, dv, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        d_out.stride(0), d_out.stride(1), float(scale), int(include_self),
        torch.get_num_threads())
    return grads
