r"""Pictures of nested signals and of their attention (matplotlib, no display needed).

* :func:`draw_tree`: the signal hierarchy as a tidy tree (leaves left to right in
  order, parents centred over their children), nodes coloured by geometry or
  modality, edges between siblings of ``graph`` nodes drawn as arcs.
* :func:`plot_attention`: the dense HSA matrix :func:`~hsa_graph.hsa_weights` next to
  flat softmax attention over the same leaves, on one colour scale, with the leaf
  blocks of every subtree outlined.
* :func:`tree_layout`: the coordinates :func:`draw_tree` uses.

Figures are built with :class:`matplotlib.figure.Figure` directly (not ``pyplot``),
so they work on any backend, in threads and without a display, and are freed when
dropped. Both functions return the figure and save a PNG when given a path.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.path import Path
from matplotlib.ticker import MaxNLocator
from torch import Tensor

from .ops.dense import hsa_weights
from .signal import GEOMETRIES

__all__ = ["draw_tree", "flat_attention", "plot_attention", "tree_layout"]

#: Colours of :func:`draw_tree` by geometry; leaves are grey.
GEOMETRY_COLORS = {"sequence": "#1f77b4", "grid": "#ff7f0e", "set": "#2ca02c",
                   "keyvalue": "#9467bd", "graph": "#d62728", "leaf": "#9a9a9a"}
_MODALITY_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")

PathLike = Union[str, "os.PathLike[str]"]


# ----------------------------------------------------------------------- layout
def _layout(tree, gap: int = 1):
    """Leaf offsets, x, depth and leaf counts of every node (CPU tensors, node order).

    ``offset[u]`` is the rank of the first leaf of ``u`` in depth-first order (children
    in node order), plus ``gap`` empty slots between trees."""
    parent = tree.parent.cpu()
    m = parent.numel()
    st = tree.structure_for("cpu")
    depth = st.to_node_order(st.depth)
    size = st.to_node_order(st.node_size).round().long()

    # Exclusive sum of the sizes of earlier siblings (earlier trees, for roots).
    node = torch.arange(m)
    is_root = parent < 0
    width = torch.where(is_root, size + gap, size)
    order = torch.sort(torch.where(is_root, -1, parent) * m + node).indices
    fam = torch.where(is_root, -1, parent)[order]
    running = torch.cumsum(width[order], 0) - width[order]
    first = torch.ones(m, dtype=torch.bool)
    first[1:] = fam[1:] != fam[:-1]
    start = running[torch.cummax(torch.where(first, torch.arange(m), 0), 0).values]
    before = torch.empty(m, dtype=torch.long)
    before[order] = running - start

    # offset(u) = sum of ``before`` over u and its ancestors: pointer jumping, so a deep
    # chain costs O(log depth) vectorised rounds, not a loop over nodes.
    offset, ancestor = before.clone(), parent.clone()
    while bool((ancestor >= 0).any()):
        has = ancestor >= 0
        safe = ancestor.clamp_min(0)
        offset = torch.where(has, offset + offset[safe], offset)
        ancestor = torch.where(has, ancestor[safe], ancestor)

    # x: leaves at their offset; parents centred over their first and last child
    # (children are ordered by node index), one depth at a time from the deepest.
    x = offset.double()
    kids = (~is_root).nonzero().flatten()
    first = torch.full((m,), m, dtype=torch.long).scatter_reduce(0, parent[kids], kids, "amin")
    last = torch.full((m,), -1, dtype=torch.long).scatter_reduce(0, parent[kids], kids, "amax")
    internal = (last >= 0).nonzero().flatten()
    internal = internal[torch.argsort(depth[internal], descending=True, stable=True)]
    levels = torch.unique_consecutive(depth[internal], return_counts=True)[1].tolist()
    for nodes in torch.split(internal, levels):
        x[nodes] = (x[first[nodes]] + x[last[nodes]]) / 2
    return offset, x, depth, size


def tree_layout(tree) -> Tuple[Tensor, Tensor]:
    """Coordinates of a tidy drawing of ``tree`` (a :class:`~hsa_graph.NestedSignal`
    or a ``Batch``): ``x [M]`` (float64) and ``depth [M]`` (long), in node order.

    Leaves sit at ``x = 0, 1, 2, ...`` in depth-first order (children in node order;
    for trees built by the ``from_*`` constructors this is the leaf row order), one
    empty slot between the trees of a forest; each parent is centred between its first
    and last child. Vectorised: pointer jumping for the offsets and one pass per depth
    for the centres.

    Example:
        >>> from hsa_graph import NestedSignal
        >>> x, depth = tree_layout(NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2]))
        >>> x.tolist(), depth.tolist()
        ([1.75, 0.5, 3.0, 0.0, 1.0, 2.0, 3.0, 4.0], [0, 1, 1, 2, 2, 2, 2, 2])
    """
    _, x, depth, _ = _layout(tree)
    return x, depth


# ------------------------------------------------------------------- draw_tree
def draw_tree(tree, path: Optional[PathLike] = None, color_by: str = "geometry",
              labels: Optional[Union[Sequence[Optional[str]], Mapping[int, str]]] = None,
              ax: Optional[Axes] = None, *, modality_names: Optional[Mapping[int, str]] = None,
              title: Optional[str] = None, node_size: Optional[float] = None,
              dpi: int = 150) -> Figure:
    """Draw a nested signal as a tree.

    Args:
        tree: a :class:`~hsa_graph.NestedSignal` or a ``Batch`` (a forest: trees side
            by side).
        path: where to save a PNG (optional).
        color_by: ``'geometry'`` (internal nodes by their geometry, leaves grey) or
            ``'modality'`` (every node by ``tree.modality``).
        labels: text per node: a sequence of length ``M`` (``None`` entries skipped)
            or a mapping ``{node: text}``. Leaf labels are written vertically below
            the leaves, others beside their node.
        ax: draw into these axes (default: a new figure sized to the tree).
        modality_names: legend names for modality tags, e.g. ``{0: 'text', 1: 'image'}``.
        title: axes title (default: a summary of the tree).
        node_size: marker area (default: shrinks with the number of leaves).
        dpi: resolution of the saved PNG.

    Returns:
        The :class:`~matplotlib.figure.Figure`. Its node markers are one collection
        (``gid='nodes'``) with ``M`` points, in node order.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_nested([[1, 2], hsa_graph.Node([3, 4, 5], "set")])
        >>> fig = draw_tree(tree, labels={3: "a", 4: "b"})
        >>> len(fig.axes[0].collections[-1].get_offsets())   # 8 nodes drawn
        8
    """
    if color_by not in ("geometry", "modality"):
        raise ValueError(f"color_by must be 'geometry' or 'modality', got {color_by!r}")
    m = tree.num_nodes
    text = _node_labels(labels, m)
    _, x, depth, _ = _layout(tree)
    parent = tree.parent.cpu()
    is_leaf = tree.is_leaf.cpu()
    num_leaves = int(is_leaf.sum())
    max_depth = int(depth.max())
    x, y = x.numpy(), -depth.double().numpy()
    span = float(x.max()) + 1

    if ax is None:
        leaf_labels = any(text[u] for u in is_leaf.nonzero().flatten().tolist())
        width = float(np.clip(0.16 * span, 6, 30))
        # at least 1:4 so that very wide trees keep readable levels
        height = max(float(np.clip(0.9 * (max_depth + 1), 2.5, 10)), width / 4)
        height += 1.0 if leaf_labels else 0.4
        fig = Figure(figsize=(width, height), layout="constrained")
        ax = fig.add_subplot()
    fig = ax.figure
    # Sizes follow the room per leaf slot, in points.
    slot = 72 * fig.get_figwidth() * ax.get_position().width / (span + 1)
    size = node_size if node_size is not None else float(np.clip((0.55 * slot) ** 2, 6, 80))

    # Edges parent -> child, and arcs between linked siblings of graph nodes.
    child = (parent >= 0).nonzero().flatten().numpy()
    pa = parent.numpy()[child]
    segments = np.stack([np.stack([x[pa], y[pa]], 1), np.stack([x[child], y[child]], 1)], 1)
    ax.add_collection(LineCollection(segments, colors="#b0b0b0",
                                     linewidths=float(np.clip(slot / 12, 0.3, 1.2)), zorder=1))
    sibling = tree.sibling_edge_index.cpu().numpy() if "sibling_edge_index" in tree else None
    if sibling is not None and sibling.size:
        ax.add_collection(_arcs(x, y, sibling))

    colors, legend = _node_colors(tree, color_by, modality_names)
    # internal nodes larger than leaves, so that the hierarchy reads at a glance
    inner_size = max(2.5 * size, 30.0)
    sizes = np.where(is_leaf.numpy(), size, inner_size)
    ax.scatter(x, y, s=sizes, c=colors, edgecolors="white", linewidths=0.3, zorder=3,
               gid="nodes")

    fontsize = float(np.clip(0.8 * slot, 4, 9))
    for u, label in enumerate(text):
        if not label:
            continue
        if is_leaf[u]:  # vertical, hanging below the leaf
            ax.annotate(label, (x[u], y[u]), xytext=(0, -0.5 * size ** 0.5 - 2),
                        textcoords="offset points",
                        rotation=90, ha="center", va="top", fontsize=fontsize, zorder=4)
        else:
            ax.annotate(label, (x[u], y[u]), xytext=(0.5 * inner_size ** 0.5 + 1, 2),
                        textcoords="offset points",
                        ha="left", va="bottom", fontsize=9, zorder=4,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                              "alpha": 0.75})
    ax.set_xlim(-1, span)
    # leaf labels hang below the axes; the constrained layout makes room for them
    ax.set_ylim(-max_depth - 0.35, 0.4)
    ax.set_axis_off()
    handles = [Line2D([], [], marker="o", linestyle="", markersize=7, markerfacecolor=c,
                      markeredgecolor="white", label=name) for name, c in legend]
    if sibling is not None and sibling.size:
        handles.append(Line2D([], [], color=GEOMETRY_COLORS["graph"], linestyle="--",
                              label="graph edge"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
              title=color_by, fontsize=8, title_fontsize=9)
    if title is None:
        trees = tree.structure.num_trees
        title = (f"nested signal: {m} nodes, {num_leaves} leaves, depth {max_depth + 1}"
                 + (f", {trees} trees" if trees > 1 else ""))
    ax.set_title(title, fontsize=11)
    _save(fig, path, dpi)
    return fig


def _node_labels(labels, m: int) -> list:
    if labels is None:
        return [None] * m
    if isinstance(labels, Mapping):
        text = [None] * m
        for u, label in labels.items():
            if not isinstance(u, (int, np.integer)) or not 0 <= int(u) < m:
                raise ValueError(f"labels has key {u!r}, not a node index in [0, {m - 1}]")
            text[int(u)] = None if label is None else str(label)
        return text
    labels = list(labels)
    if len(labels) != m:
        raise ValueError(f"labels must have one entry per node ({m}), got {len(labels)}")
    return [None if label is None else str(label) for label in labels]


def _node_colors(tree, color_by: str, modality_names):
    if color_by == "geometry":
        codes = tree.geometry.cpu().numpy()
        names = np.array(list(GEOMETRIES) + ["leaf"])
        per_node = names[np.where(codes < 0, len(GEOMETRIES), codes)]
        present = [n for n in list(GEOMETRIES) + ["leaf"] if (per_node == n).any()]
        return ([GEOMETRY_COLORS[n] for n in per_node],
                [(n, GEOMETRY_COLORS[n]) for n in present])
    tags = tree.modality.cpu().numpy()
    names = dict(modality_names or {})
    colors = [_MODALITY_COLORS[t % len(_MODALITY_COLORS)] for t in tags]
    legend = [(names.get(int(t), f"modality {int(t)}"), _MODALITY_COLORS[t % 10])
              for t in np.unique(tags)]
    return colors, legend


def _arcs(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> PathCollection:
    """Quadratic Bezier arcs below the (same-depth) siblings they join."""
    a, b = edges
    x0, x1, y0 = x[a], x[b], y[a]
    lift = 0.15 + 0.08 * np.sqrt(np.abs(x1 - x0))
    paths = [Path([(p, h), ((p + q) / 2, h - d), (q, h)],
                  [Path.MOVETO, Path.CURVE3, Path.CURVE3])
             for p, q, h, d in zip(x0, x1, y0, lift)]
    return PathCollection(paths, facecolors="none", edgecolors=GEOMETRY_COLORS["graph"],
                          linestyles="--", linewidths=0.8, zorder=2)


# -------------------------------------------------------------- plot_attention
def plot_attention(q: Tensor, k: Tensor, tree, path: Optional[PathLike] = None,
                   head: int = 0, *, include_self: bool = True, scale: Optional[float] = None,
                   pos: Optional[Tensor] = None, log: bool = True, boundaries: bool = True,
                   title: Optional[str] = None, max_pixels: int = 1024,
                   dpi: int = 150) -> Figure:
    r"""Heat maps of HSA's attention matrix and of flat softmax attention.

    Left: :func:`~hsa_graph.hsa_weights` ``(q, k, tree)`` for one head. Right:
    :func:`flat_attention`, what ``hsa_weights`` gives on
    :func:`~hsa_graph.flatten` ``(tree)``: standard softmax attention of the same
    queries and keys within each tree (without ``pos``). Both
    use one colour scale (logarithmic by default; zeros, e.g. between trees, are
    white) and one colour bar. Rows and columns are the leaves in the depth-first
    order of :func:`tree_layout` (the row order of ``q`` for trees built by the
    ``from_*`` constructors), so every subtree is a contiguous block; with
    ``boundaries`` those diagonal blocks are outlined, thicker for higher subtrees.

    Args:
        q, k: ``[N, H, D]`` (or ``[N, D]``) queries and keys, one row per leaf.
        tree: a :class:`~hsa_graph.NestedSignal` or ``Batch``.
        path: where to save a PNG (optional).
        head: the head to show.
        include_self, scale, pos: as in :func:`~hsa_graph.hsa`.
        log: logarithmic colour scale (else linear from 0).
        boundaries: outline the leaf blocks of subtrees.
        title: figure title.
        max_pixels: larger matrices are shown as means over square blocks of
            ``ceil(N / max_pixels)`` leaves (more cells than pixels cannot be seen;
            this keeps trees of thousands of leaves fast).
        dpi: resolution of the saved PNG.

    Returns:
        The figure; ``fig.axes[0].images[0]`` (HSA) and ``fig.axes[1].images[0]``
        (flat) hold the plotted ``[N, N]`` matrices (block means above
        ``max_pixels``).

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_nested([[1, 2], [3, 4, 5]])
        >>> q = k = torch.randn(5, 2, 4)
        >>> fig = plot_attention(q, k, tree, head=1)
        >>> theta = hsa_graph.hsa_weights(q, k, tree)[1]
        >>> shown = torch.as_tensor(fig.axes[0].images[0].get_array())
        >>> bool(torch.allclose(shown.float(), theta))
        True
    """
    if not isinstance(q, Tensor) or not isinstance(k, Tensor):
        raise TypeError("q and k must be tensors")
    heads = 1 if q.dim() == 2 else q.shape[1]
    if not isinstance(head, int) or not -heads <= head < heads:
        raise ValueError(f"head must be an index in [0, {heads - 1}], got {head!r}")
    if q.dim() == 3:  # only the shown head is computed
        q, k = q[:, head], k[:, head]
        if pos is not None and pos.dim() == 3:
            pos = pos[:, head if pos.shape[1] > 1 else 0]
    q, k = q.detach(), k.detach()
    theta = hsa_weights(q, k, tree, include_self=include_self, scale=scale,
                        pos=None if pos is None else pos.detach())
    flat = flat_attention(q, k, tree, include_self=include_self, scale=scale)

    offset, _, depth, size = _layout(tree, gap=0)
    is_leaf = tree.is_leaf.cpu()
    order = torch.argsort(offset[is_leaf]).to(theta.device)  # leaves in depth-first order
    n = theta.shape[0]
    pool = -(-n // max_pixels)  # shown cells per pixel block: 1 unless N > max_pixels
    theta, flat = (_block_mean(t[order][:, order], pool) for t in (theta, flat))

    vmax = float(max(theta.max(), flat.max()))
    vmax = vmax if vmax > 0 else 1.0  # all zero: a lone leaf without self-attention
    if log:  # down to the smallest weight shown, at most four decades
        positive = np.concatenate([theta[theta > 0], flat[flat > 0]])
        vmin = max(float(positive.min()) if positive.size else 0.0, vmax * 1e-4)
        norm = LogNorm(vmin=min(vmin, vmax / 10), vmax=vmax)
    else:
        norm = Normalize(vmin=0.0, vmax=vmax)

    fig = Figure(figsize=(12.5, 6.8), layout="constrained")
    axes = fig.subplots(1, 2, sharex=True, sharey=True)
    blocks = _blocks(tree, offset, depth, size) if boundaries else None
    cmap = colormaps["magma"].with_extremes(bad="white")  # zeros are "bad" on a log scale
    names = (f"HSA weights (head {head})", "flat softmax attention")
    for ax, matrix, name in zip(axes, (theta, flat), names):
        edge = matrix.shape[0] * pool - 0.5
        image = ax.imshow(matrix, cmap=cmap, norm=norm, extent=(-0.5, edge, edge, -0.5),
                          interpolation="nearest" if n <= 400 else "antialiased")
        ax.set_xlim(-0.5, n - 0.5)
        ax.set_ylim(n - 0.5, -0.5)
        if blocks is not None:
            ax.add_collection(LineCollection(blocks[0], colors="#39c5ff", linewidths=blocks[1],
                                             alpha=0.9))
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("key leaf j (tree order)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel("query leaf i (tree order)")
    bar = fig.colorbar(image, ax=list(axes), shrink=0.85, pad=0.01)
    bar.set_label("attention weight" + (" (log scale)" if log else ""))
    if title is None:
        families = tree.structure.num_families
        title = f"{n} leaves, {families} sibling famil{'y' if families == 1 else 'ies'}"
    fig.suptitle(title, fontsize=12)
    _save(fig, path, dpi)
    return fig


def flat_attention(q: Tensor, k: Tensor, tree, include_self: bool = True,
                   scale: Optional[float] = None) -> Tensor:
    r"""Flat softmax attention of every leaf over the leaves of its own tree:
    ``softmax(scale * q k^T)`` masked to each tree (and off the diagonal without
    ``include_self``), ``[H, N, N]`` (``[N, N]`` for 2-D inputs). Equal to
    ``hsa_weights(q, k, flatten(tree))`` (:ref:`def-prop-1`) in one batched matmul.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_nested([[1, 2], [3, 4, 5]])
        >>> q, k = torch.randn(5, 3), torch.randn(5, 3)
        >>> flat = hsa_graph.hsa_weights(q, k, hsa_graph.flatten(tree))
        >>> bool(torch.allclose(flat_attention(q, k, tree), flat, atol=1e-6))
        True
    """
    single_head = q.dim() == 2
    if single_head:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k = q.transpose(0, 1).to(dtype), k.transpose(0, 1).to(dtype)     # [H, N, D]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    owner = tree.structure_for(q.device).leaf_tree
    allowed = owner[:, None] == owner[None, :]
    if not include_self:
        allowed &= ~torch.eye(owner.numel(), dtype=torch.bool, device=q.device)
    logits = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, -1).nan_to_num(0.0)  # a lone leaf without self: 0
    return weights.squeeze(0) if single_head else weights


def _block_mean(matrix: Tensor, pool: int) -> np.ndarray:
    """``matrix [N, N]`` as float64 numpy, averaged over ``pool x pool`` blocks."""
    matrix = matrix.detach().double()
    if pool > 1:
        matrix = torch.nn.functional.avg_pool2d(matrix[None, None], pool,
                                                ceil_mode=True)[0, 0]
    return matrix.cpu().numpy()


def _blocks(tree, offset: Tensor, depth: Tensor, size: Tensor):
    """Outlines ``[K, 5, 2]`` of the diagonal leaf blocks of every subtree with more
    than one leaf (roots only when there are several trees) and their line widths.
    Blocks under 1/200 of the matrix (below a few pixels) are left out."""
    is_internal = ~tree.is_leaf.cpu()
    several = tree.structure.num_trees > 1
    n = int(tree.is_leaf.sum())
    keep = is_internal & (size > 1) & (size * 200 >= n) & ((depth > 0) | several)
    nodes = keep.nonzero().flatten()
    if nodes.numel() == 0:
        return None
    lo = offset[nodes].double().numpy() - 0.5
    hi = lo + size[nodes].double().numpy()
    d = (depth[nodes] + (0 if several else -1)).numpy()
    corners = np.stack([np.stack([lo, lo], 1), np.stack([hi, lo], 1), np.stack([hi, hi], 1),
                        np.stack([lo, hi], 1), np.stack([lo, lo], 1)], 1)
    return corners, np.clip(1.8 * 0.6 ** d, 0.25, None)


def _save(fig: Figure, path: Optional[PathLike], dpi: int) -> None:
    if path is not None:
        directory = os.path.dirname(os.fspath(path))
        if directory:
            os.makedirs(directory, exist_ok=True)
        fig.savefig(path, dpi=dpi, format="png")
