r"""The one front-end that prepares the inputs of every attention op.

:func:`hsa`, :func:`causal_hsa`, :func:`cross_hsa`, :func:`hsa_weights`, the cache and
the ``nn`` modules all call :func:`prepare_attention`, so that one set of rules holds
for all of them:

* ``q``, ``k`` (and ``v``) are tensors of one floating dtype on one device, all
  ``[rows, D]`` (one head) or all ``[rows, H, D]``; ``k`` and ``v`` have one row per
  leaf of the tree; ``q`` has one row per leaf too, except for cross-attention;
* ``pos`` (optional) is a floating tensor ``[M, P]`` or ``[M, H, P]`` on the same device;
* any strides are accepted: a tensor whose last dimension is not unit-stride (a step
  slice, an ``expand``, a transpose) is copied once, since the fused kernels read the
  feature axis as a dense row;
* half precision is computed in float32 (autocast is switched off around the kernel by
  :func:`no_autocast`) and cast back to the input dtype at the end;
* size-zero axes are answered without a kernel call: zero heads, zero value features
  or zero queries give an empty output; zero query/key features give zero logits (the
  dot product of empty vectors), whatever the scale.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ..structure import TreeStructure

__all__ = ["AttentionInputs", "check_scale", "check_tensors", "compute_dtype", "no_autocast",
           "prepare_attention", "resolve_structure"]


def no_autocast(device: torch.device):
    """A context that turns autocast off on ``device``: HSA computes half-precision
    inputs in float32 on purpose, and autocast would downcast its matmuls again."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False) if enabled else contextlib.nullcontext()


def resolve_structure(tree, device: torch.device) -> TreeStructure:
    """The cached :class:`TreeStructure` of ``tree`` on ``device``."""
    if isinstance(tree, TreeStructure):
        return tree if tree.device == device else tree.to(device)
    structure_for = getattr(tree, "structure_for", None)
    if structure_for is None:
        raise TypeError(
            "tree must be a NestedSignal (or a PyG Batch of them) or a TreeStructure, "
            f"got {type(tree).__name__}")
    return structure_for(device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes in: half precision accumulates in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(frozen=True)
class AttentionInputs:
    """The checked inputs of one op call, ready for a kernel.

    Attributes:
        structure: the tree's :class:`TreeStructure` on the inputs' device.
        q: ``[Nq, H, D]`` in :attr:`dtype`, last dimension unit-stride (``D >= 1``:
            zero-width inputs are replaced by one zero feature).
        k: ``[N, H, D]`` likewise.
        v: ``[N, H, Dv]`` or ``None`` (ops without values).
        pos: ``[M, P]`` / ``[M, H, P]`` in :attr:`dtype`, or ``None``.
        scale: the logit scale (``1 / sqrt(D)`` unless given).
        include_self: whether a leaf attends to itself.
        dtype: the compute dtype; out_dtype: the dtype of the result.
        single_head: the inputs had no head axis (the result drops it again).
        empty: the result has no entries (zero heads, value features or queries).
    """

    structure: TreeStructure
    q: Tensor
    k: Tensor
    v: Optional[Tensor]
    pos: Optional[Tensor]
    scale: float
    include_self: bool
    dtype: torch.dtype
    out_dtype: torch.dtype
    single_head: bool
    empty: bool

    @property
    def device(self) -> torch.device:
        return self.q.device

    def finish(self, y: Tensor, head_dim: int = 1) -> Tensor:
        """Cast ``y`` back to the input dtype and drop the head axis of one-head calls.

        Where no weight reaches the inputs (every leaf alone without ``include_self``,
        or an empty result), ``y`` is still made a function of them, with zero
        gradients, so that ``backward`` runs as it would on any other tree."""
        if torch.is_grad_enabled() and not y.requires_grad:
            inputs = [t for t in (self.q, self.k, self.v, self.pos)
                      if t is not None and t.requires_grad]
            if inputs:
                # where() picks the zero: no NaN from non-finite inputs, zero gradients
                anchor = sum(t.sum() for t in inputs)
                y = y + torch.where(torch.zeros((), dtype=torch.bool, device=y.device),
                                    anchor, 0.0).to(y.dtype)
        y = y.to(self.out_dtype)
        return y.squeeze(head_dim) if self.single_head else y

    def empty_result(self, shape: Tuple[int, ...], head_dim: int = 1) -> Tensor:
        """The zero-size result ``shape`` (head axis included), without a kernel call."""
        return self.finish(self.q.new_zeros(shape), head_dim)


def _heads(name: str, t, two_dim: bool) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in (2, 3):
        raise ValueError(f"{name} must have shape [rows, H, D] or [rows, D], got "
                         f"{tuple(t.shape)}")
    if (t.dim() == 2) != two_dim:
        raise ValueError(
            f"q, k and v must all have a head axis ([rows, H, D]) or none ([rows, D]); "
            f"q has {'none' if two_dim else 'one'} but {name} has shape {tuple(t.shape)}")
    return t.unsqueeze(1) if two_dim else t


def check_tensors(named: Iterable[Tuple[str, Tensor]], device: torch.device) -> None:
    """Raise unless the named tensors are floating, of one dtype and on ``device``."""
    named = list(named)
    for name, t in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if len({t.dtype for _, t in named}) > 1:
        raise TypeError("q, k and v must have one dtype, got "
                        + ", ".join(f"{name} {t.dtype}" for name, t in named))
    for name, t in named:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_scale(scale) -> Optional[float]:
    """``scale`` as a finite float (``None`` stays ``None``)."""
    if scale is None:
        return None
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be one number, got a tensor of shape "
                             f"{tuple(scale.shape)}")
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _nonfinite_rows(rows: Tensor) -> Tensor:
    """``[R]`` whether each row of ``rows`` ``[R, C]`` holds a NaN or inf. A NaN or inf
    makes its row's sum non-finite (so may an overflow of finite values): one
    reduction, and the exact test on the rows it flags only. The sums accumulate in
    float32 at least (in float64 they cost five times as much on the CPU; an overflow
    only sends its row to the exact test)."""
    suspect = ~torch.isfinite(rows.sum(1, dtype=torch.promote_types(rows.dtype,
                                                                    torch.float32)))
    if bool(suspect.any()):
        suspect[suspect.clone()] = ~torch.isfinite(rows[suspect]).all(1)
    return suspect


def _check_finite(st: TreeStructure, tensors: Iterable[Tuple[str, Optional[Tensor]]],
                  leaf_rows: Tuple[str, ...] = ("q", "k", "v")) -> None:
    """Name the first tensor and row holding a NaN or inf. One host synchronisation per
    tensor, which is why ``check_finite`` is opt-in."""
    for name, t in tensors:
        if t is None or t.numel() == 0:
            continue
        bad = _nonfinite_rows(t.reshape(t.shape[0], -1))
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            if name == "pos":
                where = f"node {row}"
            elif name in leaf_rows:
                where = f"leaf row {row} (node {int(st.node_of_unified[row])})"
            else:
                where = f"row {row}"
            raise ValueError(f"{name} holds a non-finite value (nan or inf) at {where}")


def prepare_attention(q: Tensor, k: Tensor, v: Optional[Tensor], tree, *,
                      include_self: bool = True, scale: Optional[float] = None,
                      pos: Optional[Tensor] = None, check_finite: bool = False,
                      need_v: bool = True, queries_are_leaves: bool = True
                      ) -> AttentionInputs:
    """Check and prepare the inputs of an attention op (see the module docstring).

    Args:
        q, k, v: as the op takes them (``v`` ignored when ``need_v`` is ``False``).
        tree: a :class:`~hsa_graph.NestedSignal`, a PyG ``Batch`` of them or a
            :class:`TreeStructure`.
        include_self, scale, pos, check_finite: the op's arguments.
        queries_are_leaves: ``q`` has one row per leaf (self-attention); ``False`` for
            cross-attention, where ``q`` may have any number of rows.

    Raises:
        TypeError: a non-tensor, a non-floating or mixed dtype, a non-number scale.
        ValueError: shapes that do not fit the tree or each other, tensors on different
            devices, a non-finite scale, or (``check_finite``) a NaN or inf in the inputs.
    """
    device = q.device if isinstance(q, Tensor) else torch.device("cpu")
    st = resolve_structure(tree, device)
    if not isinstance(include_self, (bool, int)) or isinstance(include_self, float):
        raise TypeError(f"include_self must be a bool, got {type(include_self).__name__}")
    two_dim = isinstance(q, Tensor) and q.dim() == 2
    named = [("q", _heads("q", q, two_dim)), ("k", _heads("k", k, two_dim))]
    if need_v:
        named.append(("v", _heads("v", v, two_dim)))
    check_tensors(named, device)
    tensors = dict(named)
    q, k = tensors["q"], tensors["k"]
    v = tensors.get("v")
    n = st.num_leaves
    rows = (("q", q), ("k", k), ("v", v)) if queries_are_leaves else (("k", k), ("v", v))
    for name, t in rows:
        if t is not None and t.shape[0] != n:
            raise ValueError(
                f"{name} has {t.shape[0]} rows but the "
                f"{'tree' if queries_are_leaves else 'key tree'} has {n} leaves "
                "(one row per leaf, in increasing node index)")
    if queries_are_leaves and q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q and k must agree on heads and features, got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    if v is not None and v.shape[1] != q.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but q has {q.shape[1]}")
    heads = q.shape[1]
    if pos is not None:
        if not isinstance(pos, Tensor) or not pos.is_floating_point():
            raise TypeError("pos must be a floating-point tensor [M, P] or [M, H, P]")
        if pos.device != device:
            raise ValueError(f"pos is on {pos.device} but q is on {device}")
        if pos.shape[0] != st.num_nodes or pos.dim() not in (2, 3) or (
                pos.dim() == 3 and pos.shape[1] not in (1, heads)):
            raise ValueError(
                f"pos must have shape [M, P] or [M, H, P] with M = {st.num_nodes} nodes "
                f"and H = {heads} heads, got {tuple(pos.shape)}")
    scale = check_scale(scale)
    if check_finite:
        _check_finite(st, (("q", q), ("k", k), ("v", v), ("pos", pos)),
                      leaf_rows=("q", "k", "v") if queries_are_leaves else ("k", "v"))

    out_dtype = q.dtype
    dtype = compute_dtype(out_dtype)
    empty = heads == 0 or q.shape[0] == 0 or (v is not None and v.shape[2] == 0)
    features = q.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(features) if features else 1.0
    if features == 0:  # empty dot products: every logit is 0 (cat keeps the graph)
        q, k = (torch.cat([t, t.new_zeros((*t.shape[:2], 1))], -1) for t in (q, k))

    def ready(t: Optional[Tensor]) -> Optional[Tensor]:
        if t is None:
            return None
        t = t.to(dtype)
        return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()

    return AttentionInputs(
        structure=st, q=ready(q), k=ready(k), v=ready(v),
        pos=None if pos is None else ready(pos), scale=scale,
        include_self=bool(include_self), dtype=dtype, out_dtype=out_dtype,
        single_head=two_dim, empty=empty)


def first_true(mask: Union[Tensor, np.ndarray]) -> int:
    """Index of the first ``True`` of a 1-D mask, a tensor (one host sync) or a host
    array; for error messages."""
    if isinstance(mask, Tensor):
        return int(mask.nonzero()[0, 0])
    return int(np.flatnonzero(mask)[0])


def kept_rows(indices, batch_size: int) -> Tensor:
    """The rows ``0 .. batch_size - 1`` a cache keeps when ``indices`` are dropped
    (``[kept]`` long, on the CPU).

    Raises:
        TypeError: an index that is not an integer (or an integer tensor).
        ValueError: an index outside ``0 .. batch_size - 1`` or given twice.
    """
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
    bad = (rows < 0) | (rows >= batch_size)
    if bool(bad.any()):
        raise ValueError(f"drop index {int(rows[first_true(bad)])} is outside "
                         f"0..{batch_size - 1} (B = {batch_size})")
    if rows.unique().numel() != rows.numel():
        raise ValueError(f"drop indices must be distinct, got {rows.tolist()}")
    keep = torch.ones(batch_size, dtype=torch.bool)
    keep[rows] = False
    return keep.nonzero().squeeze(1)


def check_step_tokens(q: Tensor, k: Tensor, v: Tensor, batch_size: Optional[int],
                      check_finite: bool) -> None:
    """The checks of one generation step's tokens, shared by the caches: ``[B, H, D]``
    with ``B = batch_size`` (``None``: one token ``[H, D]``), ``q`` and ``k`` of one
    shape, ``v`` with as many heads, no empty head or feature axis, and with
    ``check_finite`` no NaN or inf (a host sync, so opt-in).

    Raises:
        TypeError: not tensors (as :func:`check_tensors`).
        ValueError: any of the above, naming the tensor (and the row).
    """
    check_tensors((("q", q), ("k", k), ("v", v)),
                  q.device if isinstance(q, Tensor) else torch.device("cpu"))
    if batch_size == 0:
        raise ValueError("the cache holds no sequences: add() or prefill() them first")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if batch_size is None and t.dim() != 2:
            raise ValueError(f"{name} must have shape [H, D] (one token), got "
                             f"{tuple(t.shape)}")
        if batch_size is not None and (t.dim() != 3 or t.shape[0] != batch_size):
            raise ValueError(f"{name} must have shape [B, H, D] with B = {batch_size} "
                             f"sequences (one token each), got {tuple(t.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if v.shape[-2] != q.shape[-2]:
        raise ValueError(f"v has {v.shape[-2]} heads but q has {q.shape[-2]}")
    if 0 in q.shape or v.shape[-1] == 0:
        raise ValueError(f"a token needs at least one head and one feature, got q "
                         f"{tuple(q.shape)} and v {tuple(v.shape)}")
    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            bad = _nonfinite_rows(t.reshape(t.shape[0] if batch_size else 1, -1))
            if bool(bad.any()):
                where = ("(the new token)" if batch_size is None else
                         f"in row {first_true(bad.cpu())} (that sequence's new token)")
                raise ValueError(f"{name} holds a NaN or inf {where}")
