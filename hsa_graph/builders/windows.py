r"""Fixed hierarchies of non-overlapping hopping windows over sequences.

The hierarchy the paper uses for zero-shot replacement of softmax attention in
pre-trained transformers (section 5.3, appendix L): it depends only on the sequence
length, so every input of a given length costs the same.

A bottom-up **branching tuple** ``(b_1, b_2, ..., b_L)`` describes it: the ``T``
tokens (leaves) are cut into consecutive windows of ``b_1`` tokens, those windows
into windows of ``b_2`` windows, and so on. Level ``l`` has
``n_l = ceil(n_{l-1} / b_l)`` nodes (``n_0 = T``) and node ``j`` of level ``l - 1``
belongs to window ``j // b_l`` of level ``l`` at position ``j % b_l``.

Rules at the edges (the same for every length, so batches stay predictable):

* **ragged end**: the last window of a level holds the ``n_{l-1} mod b_l`` nodes
  that are left over (fewer than ``b_l``); a window of one node is a unary node,
  which HSA treats as transparent (:ref:`def-prop-5`).
* **early top**: once a level has a single node, that node is the root and the rest
  of the tuple is not used (no chain of unary nodes above it).
* **root**: when the tuple is used up and the top level still has several nodes, one
  root gathers them (position = their index). A sequence of one token, or an empty
  tuple, gets a root whose children are all the tokens: ``()`` is the flat tree
  (standard softmax attention).
* **branching 1** is accepted: it copies the level below as unary nodes, which
  changes no HSA output but costs nodes. ``0``, negatives and non-integers raise
  ``ValueError``.

Node layout of each tree (what :func:`hopping_window_parents` returns): the ``T``
leaves first, in order, then level 1, level 2, ... and the root last; trees of a
batch follow each other, so the leaves of the forest are the tokens of sequence 0,
then of sequence 1, ... (the rows of ``x[mask]`` for a right-padded batch).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ..signal import NestedSignal

__all__ = [
    "HoppingWindows",
    "hopping_window_forest",
    "hopping_window_parents",
    "hopping_window_tree",
]

Branching = Union[int, Sequence[int]]


class HoppingWindows(NamedTuple):
    """The forest of :func:`hopping_window_parents`, one tree per sequence.

    Attributes:
        parent: ``[M]`` parent of every node (``-1`` for roots).
        position: ``[M]`` index of each node in its window (``-1`` for roots).
        ptr: ``[B + 1]`` node offsets: tree ``b`` is nodes ``ptr[b] : ptr[b + 1]``,
            its leaves the first ``lengths[b]`` of them.
    """

    parent: Tensor
    position: Tensor
    ptr: Tensor


def _check_branching(branching: Branching) -> Tuple[int, ...]:
    """The branching tuple as Python ints; ``ValueError`` for anything but positive
    integers (a bare int ``b`` means ``(b,)``)."""
    if isinstance(branching, (numbers.Integral, np.integer)) and not isinstance(branching, bool):
        branching = (branching,)
    if isinstance(branching, Tensor):
        branching = branching.tolist()
    if isinstance(branching, (str, bytes)) or not isinstance(branching, (Sequence, np.ndarray)):
        raise ValueError(f"branching must be a tuple of positive ints (bottom-up window "
                         f"sizes), got {branching!r}")
    out = []
    for level, b in enumerate(branching, 1):
        if isinstance(b, bool) or not isinstance(b, (numbers.Integral, np.integer)):
            raise ValueError(f"branching[{level - 1}] (level {level}) must be an int, "
                             f"got {b!r}")
        if b < 1:
            raise ValueError(f"branching[{level - 1}] (level {level}) must be >= 1, got {b}")
        # a window wider than any sequence this builder accepts is one window over the
        # whole level: the same tree, and no int64 overflow on a huge size
        out.append(min(int(b), MAX_TOKENS + 1))
    return tuple(out)


# 2**31 tokens already need hundreds of GB for the layout; beyond, refuse up front
# instead of failing inside the allocator.
MAX_TOKENS = 2**31


def _check_lengths(lengths, device) -> Tensor:
    if isinstance(lengths, Tensor):
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
        lengths = lengths.to(device=device, dtype=torch.long)
    else:
        values = list(lengths) if not isinstance(lengths, numbers.Integral) else [lengths]
        for b, t in enumerate(values):
            if isinstance(t, bool) or not isinstance(t, (numbers.Integral, np.integer)):
                raise ValueError(f"lengths[{b}] must be an int, got {t!r}")
            if int(t) > MAX_TOKENS:  # before torch.tensor, which overflows past int64
                raise ValueError(f"lengths[{b}] is {int(t):,} tokens, more than the "
                                 f"{MAX_TOKENS:,} this builder accepts")
        lengths = torch.tensor([int(t) for t in values], dtype=torch.long, device=device)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {tuple(lengths.shape)}")
    if lengths.numel() == 0:
        raise ValueError("no sequences: lengths is empty")
    short = lengths < 1
    if bool(short.any()):
        b = int(short.nonzero()[0])
        raise ValueError(f"sequence {b} has length {int(lengths[b])}; every sequence needs "
                         "at least one token")
    total = int(lengths.sum())
    if total > MAX_TOKENS:
        raise ValueError(f"lengths sum to {total:,} tokens, more than the {MAX_TOKENS:,} this "
                         "builder accepts (its layout needs about 100 "
                         "bytes per token)")
    return lengths


def hopping_window_parents(lengths: Union[Sequence[int], Tensor],
                           branching: Branching = (2, 4, 8, 16), *,
                           device: Optional[Union[torch.device, str]] = None) -> HoppingWindows:
    r"""Parent and position arrays of the hopping-window forest of a batch, built with
    a handful of tensor ops per level (none per node or per sequence): the fast path
    for zero-shot replacement of attention in pre-trained models.

    Args:
        lengths: ``[B]`` number of tokens of each sequence (``>= 1``).
        branching: bottom-up window sizes (see the module docstring).
        device: where to build (default: ``lengths``' device, else CPU).

    Returns:
        :class:`HoppingWindows` ``(parent, position, ptr)``; pass ``parent`` and
        ``position`` to :meth:`NestedSignal.from_parents`, or use
        :func:`hopping_window_forest`.

    Example:
        >>> w = hopping_window_parents([5, 2], (2,))
        >>> w.parent.tolist()   # 5 tokens -> windows [0 1] [2 3] [4] -> root; then 2 tokens
        [5, 5, 6, 6, 7, 8, 8, 8, -1, 11, 11, -1]
        >>> w.position.tolist(), w.ptr.tolist()
        ([0, 1, 0, 1, 0, 0, 1, 2, -1, 0, 1, -1], [0, 9, 12])
    """
    branching = _check_branching(branching)
    if device is None:
        device = lengths.device if isinstance(lengths, Tensor) else torch.device("cpu")
    # The small per-sequence tables live on the CPU (one sync), the big arrays on device.
    lengths = _check_lengths(lengths, "cpu")
    num_seq = lengths.numel()
    levels = len(branching)
    # sizes[:, l]: nodes of level l in each sequence (0 = tokens, 0 where not built);
    # the last column is the extra root (1 where there is one).
    columns = [lengths]
    n = lengths
    for b in branching:
        n = torch.where(n > 1, (n + b - 1) // b, 0)
        columns.append(n)
    sizes = torch.stack(columns, 1)
    top_level = (sizes > 0).sum(1) - 1
    top_size = sizes.gather(1, top_level[:, None]).squeeze(1)
    needs_root = (top_size > 1) | (top_level == 0)
    sizes = torch.cat([sizes, needs_root.long()[:, None]], 1)

    count = sizes.sum(1)
    ptr = torch.zeros(num_seq + 1, dtype=torch.long)
    torch.cumsum(count, 0, out=ptr[1:])
    # level_start[b, l]: node id of the first node of level l in tree b
    level_start = ptr[:-1, None] + torch.cumsum(sizes, 1) - sizes
    root_id = level_start[:, levels + 1]
    total = int(ptr[-1])

    parent = torch.full((total,), -1, dtype=torch.long, device=device)
    position = torch.full((total,), -1, dtype=torch.long, device=device)
    seq_ids = torch.arange(num_seq, device=device)
    for level in range(levels + 1):
        size = sizes[:, level]
        num = int(size.sum())
        if num == 0:
            continue
        size_d = size.to(device)
        # (sequence, index in level) of every node of this level, without a loop
        seq = torch.repeat_interleave(seq_ids, size_d, output_size=num)
        first = torch.cumsum(size_d, 0) - size_d
        j = torch.arange(num, device=device) - first[seq]
        node = level_start[:, level].to(device)[seq] + j
        if level < levels:
            window = branching[level]
            into_window = (sizes[:, level + 1] > 0).to(device)[seq]
            up = level_start[:, level + 1].to(device)[seq] + torch.div(
                j, window, rounding_mode="floor")
            pos = j % window
        else:
            into_window = torch.zeros_like(seq, dtype=torch.bool)
            up, pos = j, j
        # the top level: under the extra root, or (a single node) the root itself
        under_root = ~into_window & needs_root.to(device)[seq]
        parent[node] = torch.where(into_window, up,
                                   torch.where(under_root, root_id.to(device)[seq], -1))
        position[node] = torch.where(into_window, pos, torch.where(under_root, j, -1))
    return HoppingWindows(parent, position, ptr.to(device))


def _lengths_and_x(data, lengths) -> Tuple[Tensor, Optional[Tensor]]:
    """Normalise the accepted inputs to (lengths [B], leaf features or None)."""
    if isinstance(data, np.ndarray):
        if data.dtype == object:
            raise TypeError("a numpy object array cannot be leaf features; pass a list "
                            "of sequences")
        data = torch.from_numpy(np.ascontiguousarray(data))
    if isinstance(data, Tensor):
        if data.dim() == 1:  # lengths
            if lengths is not None:
                raise ValueError("give lengths either as data or as lengths=, not both")
            return _check_lengths(data, "cpu"), None
        if data.dim() == 0:
            raise ValueError("data must be lengths [B], sequences, or a padded batch "
                             "[B, T, ...], got a scalar tensor")
        # a padded batch [B, T_max, ...]: keep the first lengths[b] rows of each
        num_seq, t_max = data.shape[:2]
        if lengths is None:
            lengths = torch.full((num_seq,), t_max, dtype=torch.long)
        lengths = _check_lengths(lengths, "cpu")
        if lengths.numel() != num_seq:
            raise ValueError(f"the padded batch has {num_seq} sequences but lengths has "
                             f"{lengths.numel()}")
        if int(lengths.max()) > t_max:
            b = int(lengths.argmax())
            raise ValueError(f"lengths[{b}] = {int(lengths[b])} exceeds the padded length "
                             f"{t_max}")
        mask = torch.arange(t_max)[None, :] < lengths[:, None]
        return lengths, data[mask.to(data.device)]
    if lengths is not None:
        raise ValueError("lengths= goes with a padded batch tensor; for a list of "
                         "sequences the lengths are read from the sequences")
    if isinstance(data, (numbers.Integral, np.integer)) and not isinstance(data, bool):
        return _check_lengths([data], "cpu"), None
    if not isinstance(data, (list, tuple)):
        raise TypeError(f"data must be lengths, a list of sequences or a padded batch "
                        f"tensor, got {type(data).__name__}")
    if not data:
        raise ValueError("no sequences: data is empty")
    if all(isinstance(t, (numbers.Integral, np.integer)) for t in data):
        return _check_lengths(data, "cpu"), None
    seqs = []
    for b, seq in enumerate(data):
        if isinstance(seq, np.ndarray):
            if seq.dtype == object:
                raise TypeError(f"sequence {b} is a numpy object array")
            seq = torch.from_numpy(np.ascontiguousarray(seq))
        if not isinstance(seq, Tensor):
            raise TypeError(f"sequence {b} is a {type(seq).__name__}; expected a tensor or "
                            "array [T, F] (or [T] token ids), or give lengths (ints)")
        if seq.dim() == 0 or seq.shape[0] == 0:
            raise ValueError(f"sequence {b} has no tokens (shape {tuple(seq.shape)})")
        if seqs and seq.shape[1:] != seqs[0].shape[1:]:
            raise ValueError(f"sequence {b} has rows of shape {tuple(seq.shape[1:])}, "
                             f"sequence 0 has {tuple(seqs[0].shape[1:])}")
        if seqs and seq.dtype != seqs[0].dtype:
            raise ValueError(f"sequence {b} has dtype {seq.dtype}, sequence 0 has "
                             f"{seqs[0].dtype}")
        seqs.append(seq)
    lengths = torch.tensor([seq.shape[0] for seq in seqs], dtype=torch.long)
    return lengths, torch.cat(seqs)


def hopping_window_forest(data, branching: Branching = (2, 4, 8, 16), *,
                          lengths: Optional[Union[Sequence[int], Tensor]] = None,
                          geometry: str = "sequence", modality: int = 0) -> NestedSignal:
    r"""The hopping-window forest of a batch of sequences, one tree per sequence, as
    one :class:`~hsa_graph.NestedSignal` (built with a single
    :meth:`~hsa_graph.NestedSignal.from_parents` call; ``hsa`` never attends across
    its trees, and ``tree.structure.leaf_tree`` gives each leaf's sequence).

    Args:
        data: one of

            * lengths only: a list of ints or a 1-D integer tensor ``[B]`` (``x`` is
              then left unset);
            * a list of sequences, tensors or arrays ``[T_b, F]`` (or ``[T_b]`` token
              ids), with the same trailing shape and dtype: ``x`` is their
              concatenation;
            * a right-padded batch tensor ``[B, T_max, ...]`` with ``lengths=``
              (default: all ``T_max``): ``x`` is the first ``lengths[b]`` rows of each.
        branching: bottom-up window sizes, e.g. ``(2, 4, 8, 16)``; see the module
            docstring for ragged ends, ``1`` and ``()``.
        lengths: the lengths of a padded batch.
        geometry: the geometry of the windows and roots: ``"sequence"`` (positions
            are indices in the window) or ``"set"``.
        modality: the modality tag of every node.

    Raises:
        ValueError: empty input, a sequence of length 0, a bad branching tuple,
            sequences of different widths, lengths longer than the padding.

    Example:
        >>> forest = hopping_window_forest([torch.randn(5, 8), torch.randn(3, 8)], (2, 2))
        >>> forest.num_leaves, forest.structure.num_trees, forest.x.shape
        (8, 2, torch.Size([8, 8]))
    """
    if geometry not in ("sequence", "set"):
        raise ValueError(f"geometry must be 'sequence' or 'set' for hopping windows, got "
                         f"{geometry!r}")
    lengths, x = _lengths_and_x(data, lengths)
    device = x.device if x is not None else None
    windows = hopping_window_parents(lengths, branching, device=device)
    return NestedSignal.from_parents(
        windows.parent, x, geometry=geometry, position=windows.position,
        modality=torch.full_like(windows.parent, int(modality)))


def hopping_window_tree(data: Union[int, Tensor, np.ndarray],
                        branching: Branching = (2, 4, 8, 16), *,
                        geometry: str = "sequence", modality: int = 0) -> NestedSignal:
    r"""The hopping-window tree of one sequence.

    Args:
        data: the length ``T`` (an int; ``x`` is left unset) or the leaf features
            ``[T, F]`` (or token ids ``[T]``).
        branching: bottom-up window sizes (see the module docstring).
        geometry: ``"sequence"`` or ``"set"``, for the windows and the root.
        modality: the modality tag of every node.

    Example:
        >>> tree = hopping_window_tree(6, (2, 2))   # [[0 1] [2 3]] [[4 5]] -> root
        >>> tree.parent.tolist()
        [6, 6, 7, 7, 8, 8, 9, 9, 10, 11, 11, -1]
        >>> hopping_window_tree(torch.randn(512, 64)).num_nodes   # 512+256+64+8+1
        841
    """
    if isinstance(data, (Tensor, np.ndarray)):
        if data.ndim == 0:
            raise ValueError("data must be a length (int) or features [T, F] / token ids [T]")
        return hopping_window_forest([data], branching, geometry=geometry, modality=modality)
    if isinstance(data, bool) or not isinstance(data, (numbers.Integral, np.integer)):
        raise TypeError(f"data must be a length (int) or a tensor [T, F], got "
                        f"{type(data).__name__}")
    return hopping_window_forest([int(data)], branching, geometry=geometry,
                                 modality=modality)
