r"""Hierarchies the data chooses: trees built over leaves that come without one.

HSA needs a tree; the paper names not learning it as its main limitation (appendix M).
The builders here choose one from the leaf vectors themselves (token embeddings,
hidden states, a layer's keys), without gradient, in a handful of tensor ops per level
(never a Python loop per node), with at most ``max_children`` children per node:

* :func:`contiguous_tree`: ordered data (text, time series). Neighbouring segments are
  merged bottom-up where their mean vectors are similar, so every node's leaves are a
  contiguous run: :func:`~hsa_graph.causal_hsa` and :class:`~hsa_graph.HSACache` work
  on the result.
* :func:`cluster_tree`: unordered data (sets, point clouds). Recursive balanced
  clustering by principal-axis bisection, top-down.

Both take ``x [N, D]`` and an optional PyG-style ``batch [N]`` (one tree per sequence
or set) and return a :class:`~hsa_graph.NestedSignal` whose leaves are the rows of
``x`` in the same order (leaf ``i`` is row ``i``, nodes ``0 .. N-1``), so the attention
ops' leaf outputs line up with ``x``; ``tree.structure.leaf_tree`` equals ``batch``.
Both are deterministic (no atomically accumulated float sums), and run on ``x``'s
device.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .signal import NestedSignal

__all__ = ["SIMILARITIES", "cluster_tree", "contiguous_tree"]

#: Similarities :func:`contiguous_tree` scores neighbouring segments with.
SIMILARITIES = ("cosine", "euclidean")

# power iterations per principal-axis bisection in cluster_tree
_POWER_ITERATIONS = 8


# ------------------------------------------------------------------ input checks
def _check_x(x, name: str = "x") -> Tensor:
    """``x`` as a 2-D floating tensor in the working precision (float32, float64 for
    float64 input), scaled into ``[-1, 1]`` so that sums of up to ``2**31`` rows cannot
    overflow (scaling changes neither cosines nor the order of distances)."""
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor, got a numpy array (use "
                        f"torch.from_numpy)")
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [N, D], got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point (vectors of the leaves), got "
                        f"{x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [N, D] (one vector per leaf), got shape "
                         f"{tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} has no rows: a tree needs at least one leaf")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has rows of width 0 (shape {tuple(x.shape)}): nothing to "
                         "compare the leaves by")
    bad = ~torch.isfinite(x).all(1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"{name} row {row} is not finite (NaN or inf): leaf vectors must be "
                         "finite")
    work = x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    peak = work.abs().max()
    return work / peak if bool(peak > 0) else work


def _check_batch(batch, n: int, device: torch.device, need_sorted: bool) -> Tuple[Tensor, int]:
    """``batch`` as a long tensor on ``device`` and the number of sequences."""
    if batch is None:
        return torch.zeros(n, dtype=torch.long, device=device), 1
    if not isinstance(batch, Tensor):
        raise TypeError(f"batch must be a 1-D integer tensor [N] (or None), got "
                        f"{type(batch).__name__}")
    if batch.is_floating_point() or batch.is_complex() or batch.dtype == torch.bool:
        raise TypeError(f"batch must hold integer sequence ids, got dtype {batch.dtype}")
    if batch.dim() != 1 or batch.numel() != n:
        raise ValueError(f"batch must have shape [{n}] (one sequence id per row of x), got "
                         f"shape {tuple(batch.shape)}")
    batch = batch.to(device=device, dtype=torch.long)
    if int(batch.min()) < 0:
        row = int((batch < 0).nonzero()[0])
        raise ValueError(f"batch[{row}] = {int(batch[row])}: sequence ids must be >= 0")
    if need_sorted and n > 1:
        down = batch[1:] < batch[:-1]
        if bool(down.any()):
            row = int(down.nonzero()[0]) + 1
            raise ValueError(
                f"batch must be sorted (rows of each sequence together, in order, as in a "
                f"PyG batch), but batch[{row}] = {int(batch[row])} follows batch[{row - 1}] "
                f"= {int(batch[row - 1])}")
    num_seq = int(batch.max()) + 1
    count = torch.bincount(batch, minlength=num_seq)
    if bool((count == 0).any()):
        missing = int((count == 0).nonzero()[0])
        raise ValueError(f"batch has no row with sequence id {missing} (ids run to "
                         f"{num_seq - 1}): every sequence needs at least one leaf")
    return batch, num_seq


def _check_max_children(max_children) -> int:
    if isinstance(max_children, bool) or not isinstance(max_children,
                                                        (numbers.Integral, np.integer)):
        raise TypeError(f"max_children must be an int, got {type(max_children).__name__} "
                        f"{max_children!r}")
    if max_children < 2:
        raise ValueError(f"max_children must be >= 2 (a family of one is no grouping), got "
                         f"{int(max_children)}")
    return int(max_children)


# ------------------------------------------------------------------ shared helpers
def _segment_sum(values: Tensor, lengths: Tensor) -> Tensor:
    """Sums of consecutive row runs of ``values`` (lengths ``>= 1``), in a fixed order
    on every device (``index_add_`` on CUDA accumulates atomically, in any order)."""
    return torch.segment_reduce(values, "sum", lengths=lengths, axis=0)


def _run_starts(flag_new: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """For a ``[S]`` mask marking the first row of each run (``flag_new[0]`` true):
    run id of every row, start row and length of every run."""
    run = torch.cumsum(flag_new.long(), 0) - 1
    start = flag_new.nonzero().flatten()
    end = torch.cat([start[1:], start.new_tensor([flag_new.numel()])])
    return run, start, end - start


def _window_argmin(g: Tensor, radius: int) -> Tensor:
    r"""``out[j]``: index of the smallest ``g`` in ``[j - radius, j + radius]`` (ties: the
    lowest index), for every ``j``; ``O(L log radius)`` by doubling (sparse-table), no
    ``L x radius`` tensor."""
    length = g.numel()
    width = 2 * radius + 1
    span = 1 << (width.bit_length() - 1)  # largest power of two <= width
    pad = torch.full((radius,), math.inf, dtype=g.dtype, device=g.device)
    # after the padding, window j is [j, j + width - 1]; one spare span of +inf at the end
    value = torch.cat([pad, g, pad, torch.full((span,), math.inf, dtype=g.dtype,
                                               device=g.device)])
    best = torch.arange(value.numel(), device=g.device)

    def better(a: Tensor, b: Tensor) -> Tensor:
        va, vb = value[a], value[b]
        return torch.where((va < vb) | ((va == vb) & (a < b)), a, b)

    step = 1
    while step < span:  # best[i] = argmin over [i, i + 2 * step - 1]
        shifted = torch.cat([best[step:], best[-1:].expand(step)])
        best = better(best, shifted)
        step *= 2
    j = torch.arange(length, device=g.device)
    out = better(best[j], best[j + width - span])
    return out - radius


def _relabel_by_sequence(parent: Tensor, node_seq: Tensor, n: int
                         ) -> Tuple[Tensor, Tensor]:
    """Renumber the internal nodes (ids ``>= n``) stably by sequence, so that tree ``b``
    has root rank ``b`` (:attr:`TreeStructure.leaf_tree` then equals ``batch``); returns
    the new parent array and the new id of every old node."""
    order = torch.sort(node_seq, stable=True).indices
    new_id = torch.empty_like(order)
    new_id[order] = torch.arange(order.numel(), device=order.device)
    new_id = torch.cat([torch.arange(n, device=parent.device), n + new_id])
    relabelled = torch.full_like(parent, -1)
    relabelled[new_id] = torch.where(parent >= 0, new_id[parent.clamp_min(0)], -1)
    return relabelled, new_id


# ------------------------------------------------------------------ contiguous
@torch.no_grad()
def contiguous_tree(x: Tensor, batch: Optional[Tensor] = None, *, max_children: int = 4,
                    similarity: str = "cosine") -> NestedSignal:
    r"""A tree over ordered leaves that merges similar neighbours bottom-up, every
    node's leaves a contiguous run (so causal HSA and :class:`~hsa_graph.HSACache` work
    on it), every family of at most ``max_children``.

    **Rule.** Start with one segment per leaf. At each level, within each sequence,
    score every gap between neighbouring segments by the similarity of their mean
    vectors (``"cosine"``, or ``"euclidean"``: minus the squared distance), with the
    sequence's two ends as gaps of score :math:`-\infty`. Cut at every gap whose score
    is the lowest within ``r = max(1, (max_children - 1) // 2)`` gaps on either side
    (ties: the leftmost); a run between cuts longer than ``max_children`` is cut again
    into ``ceil(L / max_children)`` runs of equal size (to one segment). Each run of two
    or more segments becomes a new node (its members in order: ``position`` is the
    index in the run, geometry ``"sequence"``); a run of one is carried up unchanged
    (no unary nodes). Repeat until each sequence is one segment; a sequence of a single
    leaf gets a root over it (as :func:`~hsa_graph.hopping_window_tree`).

    Every run has at least ``min(S_b, r + 1) >= 2`` segments (no cut lies within
    ``r`` of another or of an end), so each level leaves at most ``2/3`` of a
    sequence's segments: at most ``log_{1.5} N + 1`` levels. Families have
    ``r + 1 .. max_children`` members where the data allow (the first and last runs,
    and the ragged pieces of a long run, may be smaller).

    **Cost.** Per level, with ``S`` segments: ``O(S D)`` for the scores and segment
    sums and ``O(S log r)`` for the windowed minima, so ``O(N D)`` over all levels
    (``S`` shrinks geometrically), with ``O(log N)`` passes; one ``from_parents`` at
    the end. The HSA call it serves costs ``O(N D max_children)`` per head.

    Args:
        x: ``[N, D]`` leaf vectors in order (rows of several sequences one after
            another when ``batch`` is given). Read only, no gradient flows.
        batch: ``[N]`` sorted sequence ids ``0 .. B-1`` (PyG style), one tree per
            sequence; ``None`` for one sequence.
        max_children: the largest family (``>= 2``).
        similarity: ``"cosine"`` (default) or ``"euclidean"``.

    Returns:
        A :class:`~hsa_graph.NestedSignal` with ``x`` as leaf features: nodes
        ``0 .. N-1`` are the leaves (row ``i`` = leaf ``i``), the internal nodes follow,
        those of sequence 0 first.

    Raises:
        TypeError: ``x`` not a floating tensor, ``batch`` not integer,
            ``max_children`` not an int.
        ValueError: ``x`` not ``[N, D]``, empty or not finite; ``batch`` of the wrong
            length, unsorted, negative or skipping an id; ``max_children < 2``; an
            unknown ``similarity``.

    Example:
        >>> x = torch.tensor([[1., 0], [1, .1], [0, 1], [.1, 1], [1, 0]])
        >>> tree = contiguous_tree(x, max_children=2)
        >>> tree.parent.tolist()   # [0 1] -> 5, [2 3] -> 6, [5 6] -> 7, [7 4] -> root 8
        [5, 5, 6, 6, 8, 7, 7, 8, -1]
    """
    work = _check_x(x)
    max_children = _check_max_children(max_children)
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    device = work.device
    n = work.shape[0]
    batch, _ = _check_batch(batch, n, device, need_sorted=True)
    radius = max(1, (max_children - 1) // 2)

    seg_node = torch.arange(n, device=device)
    seg_sum, seg_count, seg_seq = work, torch.ones(n, dtype=work.dtype, device=device), batch
    children: List[Tensor] = []
    parents: List[Tensor] = []
    positions: List[Tensor] = []
    node_seq: List[Tensor] = []
    next_id = n
    while True:
        s = seg_node.numel()
        same = seg_seq[1:] == seg_seq[:-1]
        if not bool(same.any()):
            break
        mean = seg_sum / seg_count[:, None]
        if similarity == "cosine":
            unit = mean / mean.norm(dim=1, keepdim=True).clamp_min(1e-30)
            score = (unit[1:] * unit[:-1]).sum(1)
        else:
            score = -(mean[1:] - mean[:-1]).pow(2).sum(1)
        score = torch.where(same, score, -math.inf)
        ends = torch.full((1,), -math.inf, dtype=score.dtype, device=device)
        gaps = torch.cat([ends, score, ends])  # gaps[j] lies before segment j
        cut = (_window_argmin(gaps, min(radius, s)) == torch.arange(s + 1, device=device))
        cut |= torch.isinf(gaps)
        run, run_start, run_len = _run_starts(cut[:s])
        # long runs: ceil(L / m) pieces of equal size, pieces never exceed m
        pieces = torch.div(run_len + max_children - 1, max_children, rounding_mode="floor")
        offset = torch.arange(s, device=device) - run_start[run]
        piece = torch.div(offset * pieces[run], run_len[run], rounding_mode="floor")
        new_group = torch.ones(s, dtype=torch.bool, device=device)
        new_group[1:] = (run[1:] != run[:-1]) | (piece[1:] != piece[:-1])
        group, group_start, group_len = _run_starts(new_group)
        merged = group_len >= 2
        group_id = torch.where(merged, next_id + torch.cumsum(merged.long(), 0) - 1,
                               seg_node[group_start])
        member = merged[group]
        children.append(seg_node[member])
        parents.append(group_id[group][member])
        positions.append((torch.arange(s, device=device) - group_start[group])[member])
        node_seq.append(seg_seq[group_start][merged])
        next_id += int(merged.sum())
        seg_node = group_id
        seg_sum = _segment_sum(seg_sum, group_len)
        seg_count = _segment_sum(seg_count, group_len)
        seg_seq = seg_seq[group_start]
    # a sequence of one leaf: a root above it, as the hopping-window builders do
    lone = seg_node < n
    if bool(lone.any()):
        count = int(lone.sum())
        children.append(seg_node[lone])
        parents.append(torch.arange(next_id, next_id + count, device=device))
        positions.append(torch.zeros(count, dtype=torch.long, device=device))
        node_seq.append(seg_seq[lone])
        next_id += count
    parent = torch.full((next_id,), -1, dtype=torch.long, device=device)
    position = torch.full((next_id,), -1, dtype=torch.long, device=device)
    child = torch.cat(children)
    parent[child] = torch.cat(parents)
    position[child] = torch.cat(positions)
    parent, new_id = _relabel_by_sequence(parent, torch.cat(node_seq), n)
    relabelled_position = torch.empty_like(position)
    relabelled_position[new_id] = position
    return NestedSignal.from_parents(parent, x, geometry="sequence",
                                     position=relabelled_position)


# ------------------------------------------------------------------ clustering
def _principal_split(points: Tensor, order: Tensor, sub_len: Tensor, target: Tensor
                     ) -> Tuple[Tensor, Tensor, Tensor]:
    """One bisection step of every sub-cluster with ``target >= 2`` parts along its
    principal axis. ``order`` lists the points sub-cluster after sub-cluster
    (lengths ``sub_len``). Returns the new ``order``, sub-cluster lengths and targets."""
    device = points.device
    num_sub = sub_len.numel()
    sub = torch.repeat_interleave(torch.arange(num_sub, device=device), sub_len)
    xs = points[order]
    mean = _segment_sum(xs, sub_len) / sub_len[:, None].to(xs.dtype)
    centred = xs - mean[sub]
    # start at each sub-cluster's farthest point from its mean (first on ties)
    norm = centred.pow(2).sum(1)
    peak = torch.full((num_sub,), -1.0, dtype=norm.dtype, device=device).scatter_reduce(
        0, sub, norm, "amax")
    rows = torch.arange(sub.numel(), device=device)
    first = torch.full((num_sub,), sub.numel(), dtype=torch.long, device=device)
    first = first.scatter_reduce(0, sub, torch.where(norm == peak[sub], rows, sub.numel()),
                                 "amin")
    axis = centred[first]
    for _ in range(_POWER_ITERATIONS):
        axis = axis / axis.norm(dim=1, keepdim=True).clamp_min(1e-30)
        axis = _segment_sum(centred * (centred * axis[sub]).sum(1, keepdim=True), sub_len)
    projection = (centred * axis[sub]).sum(1)
    # sort by projection inside each sub-cluster (stable: ties keep the old order)
    by_projection = torch.sort(projection, stable=True).indices
    regroup = by_projection[torch.sort(sub[by_projection], stable=True).indices]
    order = order[regroup]
    left_target = torch.div(target + 1, 2, rounding_mode="floor")
    left_len = torch.where(target >= 2, torch.div(sub_len * left_target, target.clamp_min(1),
                                                  rounding_mode="floor"), sub_len)
    right_len = sub_len - left_len
    new_len = torch.stack([left_len, right_len], 1).flatten()
    new_target = torch.stack([torch.where(target >= 2, left_target, target),
                              target - left_target], 1).flatten()
    keep = new_len > 0
    return order, new_len[keep], new_target[keep]


@torch.no_grad()
def cluster_tree(x: Tensor, batch: Optional[Tensor] = None, *,
                 max_children: int = 4) -> NestedSignal:
    r"""A tree over unordered leaves by recursive balanced clustering (geometry
    ``"set"``), every family of at most ``max_children``.

    **Rule.** Top-down, one level at a time: each set (one per ``batch`` id) is the
    root cluster. A cluster of at most ``max_children`` points takes them as its leaf
    children. A larger one is cut into ``max_children`` parts of near-equal size by
    ``ceil(log2(max_children))`` rounds of bisection: each round splits every part
    along its own principal axis (``8`` power iterations of its covariance, started at
    its point farthest from the mean), at the rank that keeps the sizes in proportion
    to the parts still to make. A part of one point is a leaf child; larger parts are
    child clusters, split again at the next level. The tree is balanced: depth
    ``ceil(log_m N)`` up to rounding.

    **Cost.** Per level ``O(N D log m)`` for the power iterations (times 8) and
    ``O(N log N log m)`` for the sorts, over ``O(log_m N)`` levels; one
    ``from_parents`` at the end.

    Args:
        x: ``[N, D]`` leaf vectors (no order assumed).
        batch: ``[N]`` set ids ``0 .. B-1`` (need not be sorted), one tree per set;
            ``None`` for one set.
        max_children: the largest family (``>= 2``).

    Returns:
        A :class:`~hsa_graph.NestedSignal` with ``x`` as leaf features, nodes
        ``0 .. N-1`` the leaves (row ``i`` = leaf ``i``), internal nodes after them
        (those of set 0 first), geometry ``"set"``.

    Raises:
        TypeError, ValueError: as :func:`contiguous_tree` (``batch`` need not be
            sorted here).

    Example:
        >>> x = torch.tensor([[0., 0], [5, 5], [0, 1], [5, 6]])
        >>> cluster_tree(x, max_children=2).parent.tolist()   # root 4 -> {1, 3}, {0, 2}
        [6, 5, 6, 5, -1, 4, 4]
    """
    work = _check_x(x)
    max_children = _check_max_children(max_children)
    device = work.device
    n = work.shape[0]
    batch, num_seq = _check_batch(batch, n, device, need_sorted=False)

    # active clusters: their points listed cluster after cluster in ``order``
    order = torch.sort(batch, stable=True).indices
    cluster_len = torch.bincount(batch, minlength=num_seq)
    cluster_node = torch.arange(n, n + num_seq, device=device)
    node_seq_parts: List[Tensor] = [torch.arange(num_seq, device=device)]
    cluster_seq = torch.arange(num_seq, device=device)
    parent = torch.full((n + num_seq,), -1, dtype=torch.long, device=device)
    parent_parts: List[Tensor] = [parent]
    next_id = n + num_seq
    leaf_parent = torch.full((n,), -1, dtype=torch.long, device=device)
    while cluster_len.numel():
        small = cluster_len <= max_children
        point_cluster = torch.repeat_interleave(
            torch.arange(cluster_len.numel(), device=device), cluster_len)
        in_small = small[point_cluster]
        leaf_parent[order[in_small]] = cluster_node[point_cluster[in_small]]
        big = ~small
        if not bool(big.any()):
            break
        order = order[~in_small]
        big_len, big_node, big_seq = cluster_len[big], cluster_node[big], cluster_seq[big]
        part_len, part_target = big_len, torch.full_like(big_len, max_children)
        for _ in range((max_children - 1).bit_length()):  # ceil(log2 m) bisections
            order, part_len, part_target = _principal_split(work, order, part_len,
                                                            part_target)
        # parts stay in their clusters' order: a part's owner is its first point's
        first_point = torch.cumsum(part_len, 0) - part_len
        owner = torch.repeat_interleave(torch.arange(big_len.numel(), device=device),
                                        big_len)[first_point]
        part_point_owner = torch.repeat_interleave(owner, part_len)
        single = part_len == 1
        single_point = single.repeat_interleave(part_len)
        leaf_parent[order[single_point]] = big_node[part_point_owner[single_point]]
        grown = ~single
        count = int(grown.sum())
        new_node = torch.arange(next_id, next_id + count, device=device)
        parent_parts.append(big_node[owner[grown]])
        node_seq_parts.append(big_seq[owner[grown]])
        next_id += count
        order = order[~single_point]
        cluster_len, cluster_node = part_len[grown], new_node
        cluster_seq = big_seq[owner[grown]]
    parent = torch.cat(parent_parts)
    parent[:n] = leaf_parent
    parent, _ = _relabel_by_sequence(parent, torch.cat(node_seq_parts), n)
    return NestedSignal.from_parents(parent, x, geometry="set")
