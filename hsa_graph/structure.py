"""The derived tree layout that every HSA pass reads.

:class:`TreeStructure` is the one place that knows how a forest is laid out in memory.
It is built once per tree (or batch of trees) with vectorised tensor code and cached
on the :class:`~hsa_graph.NestedSignal`, so every layer and head reuses it.

Layout ("unified" node numbering ``u``):

* leaves come first, ``u = 0 .. N-1``, in increasing original node index (the row order
  of ``q``, ``k``, ``v`` and ``x``);
* internal nodes follow, ``u = N .. M-1``, sorted by (depth, parent, node index), so the
  internal nodes of one depth form a contiguous slice and every family (the children
  of one parent) is contiguous inside its depth.

Families with at least two members (the only ones with siblings) are grouped into
buckets of equal padded size ``b``, so a bucket's sibling softmax is one batched
attention of shape ``[F, H, b, b]``. Sizes up to 16 are exact; larger ones round up to
a grid of eight steps per octave (``b = c * 2^e``, ``8 <= c < 16``), so padding wastes
under 1/8 of a bucket while the number of buckets stays logarithmic in the largest
family. Buckets of few families (under ``BUCKET_SLOTS`` = 512 member slots) then share
wider ones where that pads fewer slots than the buckets it saves cost: a bucket has a
fixed cost (its gathers, masks and kernel calls) that a small batch of trees with
families of many sizes would pay dozens of times per call.
"""
from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass, fields
from itertools import groupby
from typing import Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["CausalLevel", "CausalPlan", "CausalTiles", "ChildGroup", "ChildLevel", "FamilyBucket",
           "FamilyIndex", "FlatTrees", "ForestCut", "Groups", "SharedSourceGather",
           "TreeStructure"]


def records_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records operations on ``tensors``: where it does not, the passes
    overwrite their own buffers instead of allocating one per level."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _LinearPass(torch.autograd.Function):
    r"""The linear level passes as one autograd node each: the subtree sum ``U``
    (:meth:`TreeStructure.bottom_up` without ``combine``: ``up=True``) and the top-down
    sum ``T`` (``up=False``), each optionally with ``Z``, the zeroing of the roots' and
    the null row (``masked``): :meth:`TreeStructure.path_sum` is ``T Z``. Recorded op by
    op, every level's slice would cost a zero-filled full-size gradient in the backward
    (quadratic in the depth); but ``U`` and ``T`` are each other's adjoints (the
    gradient of a subtree sum reaches every descendant, that of a path sum every
    ancestor), and so are ``T Z`` and ``Z U``: the backward is the other pass on one
    buffer, and under ``create_graph`` the same node again, so it differentiates
    twice. ``row_scale`` (``[I + 1, 1, ...]``) multiplies the rows of the result (the
    subtree means divide by the leaf counts), and the gradient before the adjoint."""

    @staticmethod
    def forward(ctx, st: TreeStructure, values: Tensor, up: bool, masked: bool,
                row_scale: Optional[Tensor] = None) -> Tensor:
        ctx.st, ctx.up, ctx.masked, ctx.row_scale = st, up, masked, row_scale
        value = _LinearPass.run(st, values.clone(memory_format=torch.contiguous_format),
                                up, masked)
        return value if row_scale is None else value.mul_(row_scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        st, up, masked, row_scale = ctx.st, not ctx.up, ctx.masked, ctx.row_scale
        if torch.is_grad_enabled():  # create_graph: the adjoint as a recorded node
            scaled = grad if row_scale is None else grad * row_scale
            return None, _LinearPass.apply(st, scaled, up, masked), None, None, None
        g = grad.clone(memory_format=torch.contiguous_format)
        g = g if row_scale is None else g.mul_(row_scale)
        return None, _LinearPass.run(st, g, up, masked), None, None, None

    @staticmethod
    def run(st: TreeStructure, value: Tensor, up: bool, masked: bool) -> Tensor:
        """The pass in place on ``value``: ``Z U`` or ``U`` when ``up``, else ``T Z`` or
        ``T``."""
        if up:
            st._sum_up_(value)
        if masked:
            value[:st.level_ptr[1]].zero_()
            value[st.num_internal:].zero_()
        return value if up else st._sum_down_(value)


class _StackedMeans(torch.autograd.Function):
    r"""The subtree means of ``T`` tensors of one shape in one recorded node: their leaf
    parts (``[I + 1, ...]`` each, or, with ``rows = (lo, hi)``, the sums over the
    families of the :attr:`~TreeStructure.whole_leaf_bucket`, ``[hi - lo, ...]``, zero
    elsewhere) are written into one ``[I + 1, T, ...]`` buffer, summed bottom-up in
    place and divided by the leaf counts; returns the ``T`` means as views of it.

    One buffer forward and one backward (the gradients stacked, divided, and summed
    top-down in place: :class:`_LinearPass`'s adjoint), where concatenating each tensor's
    parts, stacking them and passing a copy through :class:`_LinearPass` forms three
    full-size tensors per direction. Under ``create_graph`` the backward is recorded
    (stack, scale and :class:`_LinearPass`), so it differentiates twice."""

    @staticmethod
    def forward(ctx, st: TreeStructure, rows: Optional[Tuple[int, int]], *parts: Tensor):
        ctx.st, ctx.rows = st, rows
        first = parts[0]
        shape = (st.num_internal + 1, len(parts), *first.shape[1:])
        buf = first.new_zeros(shape) if rows is not None else first.new_empty(shape)
        for j, part in enumerate(parts):
            (buf[rows[0]:rows[1], j] if rows is not None else buf[:, j]).copy_(part)
        st._sum_up_(buf)
        buf.mul_(st._inverse_size(buf))
        return buf.unbind(1)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        st, rows = ctx.st, ctx.rows
        like = next(g for g in grads if g is not None)
        grads = [torch.zeros_like(like) if g is None else g for g in grads]
        if torch.is_grad_enabled():
            stacked = torch.stack(grads, 1)
            g = _LinearPass.apply(st, stacked * st._inverse_size(stacked), False, False)
        else:
            g = torch.stack(grads, 1)  # this node's own buffer: divided and summed in place
            g = st._sum_down_(g.mul_(st._inverse_size(g)))
        parts = g.unbind(1) if rows is None else g[rows[0]:rows[1]].unbind(1)
        return (None, None, *parts)


class _lazy_field:
    """A field of the structure built on first use and then stored on the instance
    (``functools.cached_property`` takes a lock on Python 3.11 that ``torch.compile``
    cannot trace)."""

    def __init__(self, build: Callable) -> None:
        self.build, self.name, self.__doc__ = build, build.__name__, build.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner: Optional[type] = None):
        if obj is None:
            return self
        value = self.build(obj)
        obj.__dict__[self.name] = value   # later look-ups find the instance attribute
        return value


@dataclass(frozen=True)
class FamilyBucket:
    r"""Families of one padded size ``b`` (see :class:`TreeStructure`).

    Slots are numbered ``slot = family * b + position``. Member values are gathered
    from two sources, leaves (``leaf_slot`` <- ``leaf_src``, leaf rows) and internal
    nodes (``internal_slot`` <- ``internal_src``, internal rows); padding slots are
    masked by ``log_size = -inf``. :meth:`TreeStructure.gather_bucket` reads a bucket the
    cheapest way its fields allow: ``leaf_range`` / ``internal_range`` (a view),
    ``leaf_block`` (mixed families, leaves in place), ``leaf_gather`` /
    ``internal_gather`` (one ``index_select`` from one source; padding slots repeat
    their family's first member, which the mask hides), else two index copies.
    """

    size: int
    num_families: int
    parent: Tensor  # [F] internal row of each family's parent
    leaf_slot: Tensor
    leaf_src: Tensor
    internal_slot: Tensor
    internal_src: Tensor
    log_size: Tensor  # [F, b] log n(B) of each member, -inf on padding
    #: when the bucket is exactly ``leaves[start : start + F * b]`` (a reshape, no gather)
    leaf_range: Optional[tuple] = None
    #: when the bucket is exactly ``internal[start : start + F * b]``
    internal_range: Optional[tuple] = None
    #: mixed buckets: ``(start, L)`` when the first ``L >= 2`` slots of every family hold
    #: the leaves ``start + family * L + j`` (a view of the leaf rows) and the other slots
    #: the internal members ``internal_src`` (a caterpillar's families, e.g.)
    leaf_block: Optional[tuple] = None
    #: ``[F * b]`` leaf row of every slot, for buckets of leaves only (no range)
    leaf_gather: Optional[Tensor] = None
    #: ``[F * b]`` internal row of every slot, for buckets of internal nodes only (no range)
    internal_gather: Optional[Tensor] = None
    #: ``(start, stop)`` when the parents are the internal rows ``start .. stop - 1`` in
    #: family order (per-family sums are then written straight into those rows)
    parent_range: Optional[tuple] = None

    @property
    def read(self) -> str:
        """How :meth:`TreeStructure.gather_bucket` reads the members, the first that
        applies: ``"leaf_range"`` / ``"internal_range"`` (a view of the source),
        ``"leaf_block"`` (leaves in place, internal members gathered), ``"leaf_gather"``
        / ``"internal_gather"`` (one index copy), else ``"by_index"`` (leaf and internal
        members copied into their slots)."""
        for name in ("leaf_range", "internal_range", "leaf_block", "leaf_gather",
                     "internal_gather"):
            if getattr(self, name) is not None:
                return name
        return "by_index"

    @property
    def is_view(self) -> bool:
        """Whether :meth:`TreeStructure.gather_bucket` reads this bucket as a view of its
        source (``leaf_range`` / ``internal_range``) instead of copying its members."""
        return self.read in ("leaf_range", "internal_range")

    @property
    def copies_by_index(self) -> bool:
        """Whether :meth:`TreeStructure.gather_bucket` reads this bucket by its last
        case, two index copies (leaf and internal members, no block of leaves)."""
        return self.read == "by_index"


@dataclass(frozen=True)
class SharedSourceGather:
    """The buckets that :meth:`TreeStructure.gather_buckets` reads with one gather per
    source where autograd records (see :attr:`TreeStructure.shared_source_gathers`).

    Attributes:
        buckets: indices of the buckets, in order.
        leaf_src, internal_src: their ``leaf_src`` / ``internal_src`` concatenated.
        leaf_lengths, internal_lengths: each bucket's share of them.
    """

    buckets: Tuple[int, ...]
    leaf_src: Tensor
    leaf_lengths: Tuple[int, ...]
    internal_src: Tensor
    internal_lengths: Tuple[int, ...]


@dataclass(frozen=True)
class FamilyIndex:
    """The bucket families by member (see :attr:`TreeStructure.family_index`).

    Attributes:
        members: per bucket ``[F, b]`` unified members in slot order (``M`` on padding).
        node_bucket, node_family, node_pos: ``[M + 1]`` bucket (``-1``: no sibling),
            family and slot position of every unified node (row ``M``: padding).
        parent_bucket, parent_family: ``[I + 1]`` the bucket (``-1``: fewer than two
            children) and family of the children of every internal row.
        only_child: ``[I + 1]`` the unified child of an internal row with one child
            (``M`` otherwise).
    """

    members: List[Tensor]
    node_bucket: Tensor
    node_family: Tensor
    node_pos: Tensor
    parent_bucket: Tensor
    parent_family: Tensor
    only_child: Tensor


@dataclass(frozen=True)
class Groups:
    """Nodes grouped into families (see :meth:`TreeStructure.family_groups`).

    Attributes:
        group: ``[n]`` the family of each node, an id in ``0 .. G - 1``.
        slot: ``[n]`` each node's position in its family, ``0 .. size - 1``.
        sizes: ``[G]`` members per family (0 for an id no node has).
    """

    group: Tensor
    slot: Tensor
    sizes: Tensor

    @staticmethod
    def of_labels(labels: Tensor) -> Groups:
        """Nodes grouped by any integer ``labels [n]`` (slots in node order), for node sets
        that are not a tree's families."""
        _, group = torch.unique(labels, return_inverse=True)
        order = torch.sort(group, stable=True).indices
        sizes = torch.bincount(group)
        start = torch.cumsum(sizes, 0) - sizes
        slot = torch.empty_like(group)
        slot[order] = torch.arange(group.numel(), device=group.device) - start[group[order]]
        return Groups(group=group, slot=slot, sizes=sizes)


@dataclass(frozen=True)
class FlatTrees:
    r"""A forest of flat trees (each a root over its leaves, the trees in leaf order) as
    ``num_trees`` blocks of ``width`` rows: attention inside each tree is attention
    inside each block.

    Attributes:
        num_trees: ``F``.
        width: ``b``, the leaves of the largest tree.
        slots: ``[F b]``, the leaf row behind each block row: a tree's leaves, then its
            last leaf repeated up to ``b`` (rows after all of the tree's own, so a
            causal mask never lets a real row see them; without one they would count),
            or ``None`` where every tree has ``b`` leaves (the blocks are a view of the
            leaf rows).
        rows: ``[N]``, the block row of each leaf row (``None`` likewise).
    """

    num_trees: int
    width: int
    slots: Optional[Tensor]
    rows: Optional[Tensor]


@dataclass(frozen=True)
class CausalTiles:
    r"""The queries of causal HSA at one depth whose spine children sit in families of
    one padded size: the families, and the queries cut into tiles of ``T`` slots.

    Depth ``d`` is the depth of the families' parent :math:`A`; the spine child
    :math:`S` of query :math:`i` (its ancestor at depth ``d + 1``) is member ``p`` of
    :math:`A`'s family, members sorted by first leaf. Every tile holds consecutive
    leaf rows of one family, so the queries of a tile share their family's members:
    one batched matmul ``[T, D] x [D, b]`` per tile. Padding slots read the tile's
    first row and are never written back.

    Attributes:
        size: ``b``, members per family (padded); tile: ``T``, slots per tile.
        members: ``[F, b]`` unified member ids sorted by first leaf, ``M`` on padding.
        tile_family: ``[R]`` family of each tile.
        slot_row: ``[R * T]`` leaf row of each slot.
        slot_index: ``[R * T]`` ``family * b + p``: the slot's row in per-family,
            per-position tables.
        slot_pos: ``[R * T]`` ``p``, the position of :math:`S` in its family (0 on
            padding, so that no member counts as a left sibling there).
        slot_count: ``[R * T]`` :math:`n_i(S)`, the leaves of :math:`S` up to :math:`i`
            (float64; 1 on padding).
        slot_count_parent: ``[R * T]`` :math:`n_i(A)` likewise.
        slot_before: ``[R * T]`` the slot holding the row just before :math:`S`'s first
            leaf, where that row is in the same family (``slot_has_before``), else 0:
            sums over :math:`S` up to :math:`i` are family prefix sums minus this one.
        slot_is_real: ``[R * T]`` whether a slot holds a leaf row (``False`` on padding).
        slot_run: ``n`` when every tile is whole runs of ``n`` slots, each run the
            leaves of one spine child in order (a balanced tree's levels): sums over
            :math:`S` up to a slot are then prefix sums inside its run; else ``None``.
        rows: ``(lo, hi)`` when the slots are exactly the leaf rows ``lo .. hi - 1`` in
            order (no gather needed), else ``None``.
        member_rows: ``(lo, hi)`` when ``members`` is exactly the unified ids
            ``lo .. hi - 1`` in order (a view of node tables), else ``None``.
        tile_first: ``[R]`` the first tile of each tile's family (prefix sums carry
            across the tiles of one family).
        slots_are_members: every tile is one family whose slots are its members, all
            leaves (the deepest level of a tree whose leaf families are contiguous):
            then :math:`S_i` is the member ``p`` itself.
        family_parent: ``[F]`` the unified id of each family's parent :math:`A`.
        member_lam: ``[F, b]`` the unified id whose :math:`\lambda` each member has:
            the member itself, or for an only child's chain (a node with one child
            has the :math:`\lambda` of that child) the chain's last node, a leaf or a
            node with two or more children (``M`` on padding). Such a node's family
            sits at a greater depth, so its :math:`\lambda` is known when this depth
            runs.
    """

    size: int
    tile: int
    members: Tensor
    tile_family: Tensor
    tile_first: Tensor
    slot_row: Tensor
    slot_index: Tensor
    slot_pos: Tensor
    slot_count: Tensor
    slot_count_parent: Tensor
    slot_before: Tensor
    slot_has_before: Tensor
    slot_is_real: Tensor
    slot_run: Optional[int]
    rows: Optional[Tuple[int, int]]
    member_rows: Optional[Tuple[int, int]]
    slots_are_members: bool
    family_parent: Tensor
    member_lam: Tensor

    @property
    def num_tiles(self) -> int:
        return self.tile_family.numel()


@dataclass(frozen=True)
class CausalLevel:
    """All tiles of one depth, and how their slots map back to leaf rows.

    Attributes:
        depth: the parent depth ``d``.
        groups: one :class:`CausalTiles` per padded family size.
        row_slot: ``[N]`` slot (in the concatenated slots of ``groups``) of each leaf
            row; ``None`` when the slots are the rows ``0 .. N - 1`` in order.
        active: ``[N]`` whether a row has a slot at this depth (``None``: all do);
            the others keep their state (their ancestor at ``d`` is an only child).
    """

    depth: int
    groups: List[CausalTiles]
    row_slot: Optional[Tensor]
    active: Optional[Tensor]


@dataclass(frozen=True)
class CausalPlan:
    """The layout causal HSA reads, built once per structure (see
    :attr:`TreeStructure.causal_plan`): ``levels`` deepest first, and ``first_leaf``
    ``[M]``, the first leaf row under every unified node."""

    levels: List[CausalLevel]
    first_leaf: Tensor


@dataclass(frozen=True)
class ChildGroup:
    """Internal nodes of one depth whose children fill at most ``width`` slots (see
    :attr:`TreeStructure.child_levels`). Each node's children sit in its row in the order
    of their unified index: leaves first, in leaf order, then internal children in row
    order; the remaining slots are padding.

    Attributes:
        width: slots per node, a power of two (padding wastes under half of a group).
        nodes: ``[F]`` the nodes, as offsets among the internal rows of their depth.
        from_leaf: ``[F, width]`` whether a slot holds a leaf.
        leaf_index: ``[F, width]`` the leaf row of a leaf child (0 on other slots).
        internal_index: ``[F, width]`` the offset of an internal child among the internal
            rows one depth below; on other slots the count of those rows (a null row
            appended to them).
        padding: ``[F, width]`` True on padding slots.
    """

    width: int
    nodes: Tensor
    from_leaf: Tensor
    leaf_index: Tensor
    internal_index: Tensor
    padding: Tensor


@dataclass(frozen=True)
class ChildLevel:
    """The internal nodes of one depth and their children, for passes that go up a
    forest one depth at a time reading whole families (see
    :attr:`TreeStructure.child_levels`).

    Attributes:
        depth: the depth of the nodes.
        rows: ``(start, stop)``: the nodes are the internal rows ``start .. stop - 1``.
        groups: the nodes grouped by the padded number of their children.
        order: ``[stop - start]`` the row of each node in the concatenation of the
            groups' rows (so per-group results become node order with one gather).
    """

    depth: int
    rows: Tuple[int, int]
    groups: Tuple[ChildGroup, ...]
    order: Tensor


@dataclass(frozen=True)
class ForestCut:
    """Some nodes of a forest as a forest of their own, in node index order, as
    :meth:`~hsa_graph.NestedSignal.from_parents` takes it (see
    :meth:`TreeStructure.family_forest` and :meth:`TreeStructure.cut_above`).

    Attributes:
        parent: ``[K]`` each kept node's parent, as its position among the kept nodes;
            ``-1`` for a root.
        kept: ``[M]`` mask of the kept nodes (node order), or ``None``: every node.
        roots: node ids of the nodes the cut made roots (roots before it not included).
        leaf_rows: the leaf rows held, increasing (the cut's leaves, in order), or
            ``None``: every leaf.
    """

    parent: Tensor
    kept: Optional[Tensor]
    roots: Tensor
    leaf_rows: Optional[Tensor]


@dataclass(frozen=True)
class TreeStructure:
    r"""Levels, families, leaf counts and sibling slots of a forest.

    Build it with :meth:`from_parent` (or let :attr:`NestedSignal.structure` do it).
    All tensors live on one device; the integers are Python ints so that passes over
    levels never synchronise with the device.

    Attributes:
        num_nodes: ``M``, all nodes of the forest.
        num_leaves: ``N``, childless nodes.
        num_trees: number of roots.
        node_of_unified: ``[M]`` original node index of each unified index.
        unified_of_node: ``[M]`` the inverse permutation.
        leaf_parent: ``[N]`` internal row (``u - N``) of each leaf's parent, or
            ``num_internal`` (a null row) for a leaf that is a root.
        internal_parent: ``[I]`` internal row of each internal node's parent, or
            ``num_internal`` for roots.
        internal_size: ``[I]`` leaf counts ``n(A)`` (float64, cast on use); see
            :attr:`node_size` for every node.
        depth: ``[M]`` depth of each unified node, roots at 0.
        leaf_tree: ``[N]`` tree (root rank) of each leaf.
        level_ptr: internal rows of depth ``d`` are ``level_ptr[d] : level_ptr[d+1]``.
        level_parent: ``level_parent[d]`` is the parent of each internal row of depth
            ``d`` as an offset into depth ``d - 1`` (empty for ``d = 0``).
        buckets: the sibling families, grouped by padded size.
        lonely_leaf: leaves without siblings (only child, or a root), in no bucket.
        leaf_out_index: ``[N]`` row of each leaf in the concatenated rows that
            :meth:`scatter_leaves` takes from the buckets holding leaves (in bucket
            order), one past the end for a lonely leaf: it is then one gather.
        flat_trees: the forest's blocks (:class:`FlatTrees`) when every tree is a root
            over its leaves (and padding them to one length at most doubles the rows),
            else ``None``: attention there is attention inside blocks.
    """

    num_nodes: int
    num_leaves: int
    num_trees: int
    node_of_unified: Tensor
    unified_of_node: Tensor
    leaf_parent: Tensor
    internal_parent: Tensor
    internal_size: Tensor
    depth: Tensor
    leaf_tree: Tensor
    level_ptr: List[int]
    level_parent: List[Tensor]
    buckets: List[FamilyBucket]
    lonely_leaf: Tensor
    leaf_out_index: Tensor
    flat_trees: Optional[FlatTrees]

    @property
    def num_internal(self) -> int:
        return self.num_nodes - self.num_leaves

    @property
    def device(self) -> torch.device:
        return self.node_of_unified.device

    @property
    def max_depth(self) -> int:
        """Depth of the deepest internal node (-1 when there is none); leaves may sit
        one level deeper."""
        return len(self.level_ptr) - 3

    @property
    def num_families(self) -> int:
        """Families with at least two members (the ones HSA runs a softmax over)."""
        return sum(b.num_families for b in self.buckets)

    @property
    def num_attention_weights(self) -> int:
        """Sibling logits HSA evaluates: the sum over families of (size^2 - size)."""
        return int(self._family_sizes.pow(2).sub(self._family_sizes).sum())

    @property
    def _family_sizes(self) -> Tensor:
        counts = torch.bincount(
            torch.cat([self.leaf_parent, self.internal_parent]),
            minlength=self.num_internal + 1,
        )[: self.num_internal]
        return counts[counts >= 2].long()

    def leaf_paths(self) -> Tensor:
        """``[N, max_depth + 2]`` unified ancestors of each leaf by depth (itself at
        its own depth), ``-1`` below it. Dense; for small trees (inspection, tests)."""
        n = self.num_leaves
        depth_all = self.depth
        paths = torch.full((n, self.max_depth + 2), -1, dtype=torch.long, device=self.device)
        rows = torch.arange(n, device=self.device)
        parent_u = self.parent_unified()
        current = torch.arange(n, device=self.device)
        for _ in range(self.max_depth + 2):
            alive = current >= 0
            safe = current.clamp_min(0)
            paths[rows[alive], depth_all[safe[alive]]] = current[alive]
            current = torch.where(alive, parent_u[safe], current)
        return paths

    def pair_blocks(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        r"""For every pair of leaves ``(i, j)``: the unified ids of the children ``A``
        (holding ``i``) and ``B`` (holding ``j``) of their lowest common ancestor, the
        ancestor itself, and whether ``i != j`` share a tree (``[N, N]`` each). Dense,
        :math:`O(N^2 \cdot depth)`: for the dense matrices of small trees."""
        paths = self.leaf_paths()                                    # [N, depth + 2]
        same = (paths.unsqueeze(1) == paths.unsqueeze(0)) & (paths.unsqueeze(1) >= 0)
        lca_depth = same.long().cumprod(-1).sum(-1) - 1              # -1 across trees
        split = (lca_depth + 1).clamp(max=paths.shape[1] - 1)
        a = paths.gather(1, split).clamp_min(0)
        b = paths.t().gather(0, split).clamp_min(0)
        lca = paths.gather(1, lca_depth.clamp_min(0)).clamp_min(0)
        n = self.num_leaves
        pair = (lca_depth >= 0) & ~torch.eye(n, dtype=torch.bool, device=paths.device)
        return a, b, lca, pair

    def parent_unified(self) -> Tensor:
        """``[M]`` unified index of each unified node's parent, ``-1`` for roots."""
        n, i = self.num_leaves, self.num_internal
        both = torch.cat([self.leaf_parent, self.internal_parent])
        return torch.where(both == i, -1, both + n)

    def family_forest(self, leaf_rows: Tensor) -> ForestCut:
        """The families of leaf rows ``leaf_rows`` (``[n]``, long), each its parent over
        that parent's leaf children alone (the internal children dropped), as one
        forest; a row whose leaf is a root is a tree of its own. Attention over it is
        attention among each family's leaves, at the cost of those leaves alone."""
        n, i = self.num_leaves, self.num_internal
        is_root = torch.zeros(i + 1, dtype=torch.bool, device=self.device)
        is_root[self.leaf_parent[leaf_rows]] = True
        is_root[i] = False                               # the null row: no family
        held = is_root[self.leaf_parent]
        held[leaf_rows] = True
        kept = torch.cat([held, is_root[:i]])            # unified order
        return self._forest_cut(kept, torch.cat([held.new_zeros(n), is_root[:i]]),
                                held.nonzero().view(-1))

    def cut_above(self, leaf_rows: Tensor, what: str = "the cut") -> ForestCut:
        """Every node, with the parents of leaf rows ``leaf_rows`` (``[n]``, long) made
        roots: attention over it confines those rows to their parents' subtrees.

        Raises:
            ValueError: naming ``what`` and the node, where a node would lose every
                child (all of them parents of ``leaf_rows``) and become a leaf.
        """
        n, m = self.num_leaves, self.num_nodes
        parent = self.parent_unified()
        is_root = torch.zeros(m + 1, dtype=torch.bool, device=self.device)
        is_root[parent[leaf_rows]] = True                # -1 (a root leaf): the spare
        is_root = is_root[:m]
        has_child = torch.zeros(m + 1, dtype=torch.bool, device=self.device)
        has_child[parent.masked_fill(is_root, -1)] = True
        orphaned = self.to_node_order(~has_child[:m] & (torch.arange(
            m, device=self.device) >= n))
        if bool(orphaned.any()):
            node = int(orphaned.nonzero()[0])
            raise ValueError(f"{what} cuts node {node} off every one of its children "
                             f"(they are all parents of its rows): it would become a leaf")
        return self._forest_cut(None, is_root, None)

    @_lazy_field
    def node_parent(self) -> Tensor:
        """``[M]`` each node's parent as a node id (``-1`` for roots), in node order: the
        parent list the forest was built from (the cuts of :class:`ForestCut` start
        from it)."""
        parent = self.parent_unified()
        return self.to_node_order(torch.where(
            parent < 0, -1, self.node_of_unified[parent.clamp_min(0)]))

    def _forest_cut(self, kept: Optional[Tensor], roots: Tensor,
                    leaf_rows: Optional[Tensor]) -> ForestCut:
        """The :class:`ForestCut` of the nodes ``kept`` (a unified mask; ``None``: all)
        with the nodes ``roots`` (a unified mask) made roots."""
        node_parent, roots = self.node_parent, self.to_node_order(roots)
        if kept is not None:
            kept = self.to_node_order(kept)
            new_id = kept.cumsum(0) - 1                  # position among the kept nodes
        else:
            new_id = torch.arange(self.num_nodes, device=self.device)
        cut = torch.where(roots | (node_parent < 0), -1, new_id[node_parent.clamp_min(0)])
        return ForestCut(parent=cut if kept is None else cut[kept], kept=kept,
                         roots=roots.nonzero().view(-1), leaf_rows=leaf_rows)

    def to_unified(self, values: Tensor) -> Tensor:
        """Rows in node index order ``[M, ...]`` (e.g. positions) -> unified order."""
        return values.index_select(0, self.node_of_unified)

    def unified_rows(self, leaf_values: Tensor, internal_values: Tensor,
                     ids: Tensor) -> Tensor:
        """Rows ``ids`` (unified ids: leaf rows ``0 .. N - 1``, then internal rows; ``M``
        the null row, last of ``internal_values`` ``[I + 1, ...]``) of the node table
        that stacks ``leaf_values`` ``[N, ...]`` and ``internal_values``, read without
        forming that table: ``[len(ids), ...]``."""
        n = self.num_leaves
        is_leaf = (ids < n).view(-1, *([1] * (leaf_values.dim() - 1)))
        if n == 0:
            return internal_values.index_select(0, ids - n)
        return torch.where(is_leaf, leaf_values.index_select(0, ids.clamp_max(n - 1)),
                           internal_values.index_select(0, (ids - n).clamp_min(0)))

    def to_node_order(self, values: Tensor) -> Tensor:
        """Rows in unified order ``[M, ...]`` (e.g. :attr:`depth`) -> node index order."""
        return values.index_select(0, self.unified_of_node)

    @_lazy_field
    def node_size(self) -> Tensor:
        r"""``[M]`` leaf count :math:`n(\cdot)` of every unified node (1 for a leaf),
        float64; ``node_size.log()`` is the ``log n`` of the sibling logits."""
        return torch.cat([self.internal_size.new_ones(self.num_leaves), self.internal_size])

    @_lazy_field
    def _constants(self) -> Dict[tuple, Optional[Tensor]]:
        """The tensors :meth:`constant` made, by key."""
        return {}

    def constant(self, key: tuple, build: Callable[[], Optional[Tensor]]
                 ) -> Optional[Tensor]:
        """``build()``, a tensor derived from the layout alone (leaf counts in a dtype, a
        bucket's logit mask), made on the first call with ``key`` and kept on the
        structure: on small trees remaking such tensors is a large share of a call.
        Callers never write into the result. Made afresh while ``torch.compile`` traces
        (the graph holds it as a constant)."""
        if torch.compiler.is_compiling():
            return build()
        constants = self._constants
        if key not in constants:
            constants[key] = build()
        return constants[key]

    def node_size_as(self, dtype: torch.dtype) -> Tensor:
        r"""``[M + 1]`` :attr:`node_size` in ``dtype`` with a last row of 1 (the null /
        padding row), made once per dtype: ``node_size_as(dtype)[N:]`` are the internal
        rows' :math:`n(A)` and the null row's 1."""
        return self.constant(("node_size", dtype), lambda: torch.cat(
            [self.node_size, self.node_size.new_ones(1)]).to(dtype))

    @property
    def leaf_size(self) -> Tensor:
        """``[N]`` ones: a leaf counts one leaf (the leaf rows of :attr:`node_size`)."""
        return self.node_size[:self.num_leaves]

    @_lazy_field
    def leaf_ranges(self) -> Tuple[Tensor, Tensor]:
        """``[M]`` first and last leaf row under every unified node (a leaf: itself),
        built once per structure, one pass per depth."""
        n, i, ptr = self.num_leaves, self.num_internal, self.level_ptr
        leaves = torch.arange(n, device=self.device)
        lo = torch.full((i + 1,), n, dtype=torch.long, device=self.device)
        hi = torch.full((i + 1,), -1, dtype=torch.long, device=self.device)
        lo = lo.scatter_reduce(0, self.leaf_parent, leaves, "amin")
        hi = hi.scatter_reduce(0, self.leaf_parent, leaves, "amax")
        for d in range(self.max_depth, 0, -1):
            a, b = ptr[d], ptr[d + 1]
            lo = lo.scatter_reduce(0, self.internal_parent[a:b], lo[a:b], "amin")
            hi = hi.scatter_reduce(0, self.internal_parent[a:b], hi[a:b], "amax")
        return torch.cat([leaves, lo[:i]]), torch.cat([leaves, hi[:i]])

    def check_contiguous(self, what: str = "causal HSA") -> None:
        """Raise ``ValueError`` unless the leaves of every node are a contiguous range of
        leaf rows (document order), naming the first node that breaks it."""
        n = self.num_leaves
        lo, hi = (t[n:] for t in self.leaf_ranges)
        broken = (hi - lo + 1) != self.internal_size.long()
        if bool(broken.any()):
            row = int(broken.nonzero()[0])
            node = int(self.node_of_unified[n + row])
            raise ValueError(
                f"{what} needs the leaves of every node to be a contiguous range in leaf "
                f"order (increasing node index), but node {node} holds "
                f"{int(self.internal_size[row])} leaves spread over leaf rows "
                f"{int(lo[row])}..{int(hi[row])}")

    @_lazy_field
    def causal_plan(self) -> CausalPlan:
        """The tiles causal HSA runs on (:class:`CausalPlan`), built on first use and
        cached, so a decoder stack pays for it once per batch. Raises ``ValueError``
        when some node's leaves are not contiguous."""
        self.check_contiguous()
        return _causal_plan(self)

    @_lazy_field
    def family_index(self) -> FamilyIndex:
        """Every bucket's families as unified member ids, and each node's bucket, family
        and slot position (:class:`FamilyIndex`), built once per structure."""
        n, m, dev = self.num_leaves, self.num_nodes, self.device
        node_bucket = torch.full((m + 1,), -1, dtype=torch.long, device=dev)
        node_family = torch.zeros(m + 1, dtype=torch.long, device=dev)
        node_pos = torch.zeros(m + 1, dtype=torch.long, device=dev)
        members = []
        for index, bucket in enumerate(self.buckets):
            f, b = bucket.num_families, bucket.size
            slot_member = torch.full((f * b,), m, dtype=torch.long, device=dev)
            slot_member[bucket.leaf_slot] = bucket.leaf_src
            slot_member[bucket.internal_slot] = bucket.internal_src + n
            slots = torch.cat([bucket.leaf_slot, bucket.internal_slot])
            real = slot_member[slots]
            node_bucket[real] = index
            node_family[real] = slots.div(b, rounding_mode="floor")
            node_pos[real] = slots % b
            members.append(slot_member.view(f, b))
        i = self.num_internal
        parent_bucket = torch.full((i + 1,), -1, dtype=torch.long, device=dev)
        parent_family = torch.zeros(i + 1, dtype=torch.long, device=dev)
        for index, bucket in enumerate(self.buckets):
            parent_bucket[bucket.parent] = index
            parent_family[bucket.parent] = torch.arange(bucket.num_families, device=dev)
        return FamilyIndex(members=members, node_bucket=node_bucket, node_family=node_family,
                           node_pos=node_pos, parent_bucket=parent_bucket,
                           parent_family=parent_family, only_child=self.only_child)

    @_lazy_field
    def only_child(self) -> Tensor:
        """``[I + 1]`` the unified id of the child of every internal row that has exactly
        one child, ``M`` for the others (and for the null row)."""
        i, m, dev = self.num_internal, self.num_nodes, self.device
        parent_row = torch.cat([self.leaf_parent, self.internal_parent])   # by unified id
        count = torch.bincount(parent_row, minlength=i + 1)
        alone = (count[parent_row] == 1) & (parent_row < i)
        out = torch.full((i + 1,), m, dtype=torch.long, device=dev)
        out[parent_row[alone]] = torch.arange(m, device=dev)[alone]
        return out

    @property
    def flat_families(self) -> Optional[Tuple[int, int]]:
        """``(F, b)`` when the forest is ``F`` flat trees of ``b >= 2`` leaves each (a root
        over its leaves, trees in leaf order): HSA is then softmax attention inside
        ``[F, b]`` blocks of the leaf rows (a view: :attr:`flat_trees` unpadded); else
        ``None``."""
        flat = self.flat_trees
        if flat is None or flat.slots is not None or flat.width < 2:
            return None
        return flat.num_trees, flat.width

    @_lazy_field
    def chain_runs(self) -> Tuple[Tuple[int, int], ...]:
        """Maximal runs ``(lo, hi)``, ``lo < hi``, of internal levels that hold one node
        each (a chain: a caterpillar's spine, unary nodes): their rows are consecutive,
        so a pass over them is one cumulative sum instead of one step per level. Python
        ints from :attr:`level_ptr`."""
        ptr, runs, lo = self.level_ptr, [], None
        for d in range(self.max_depth + 2):
            single = d <= self.max_depth and ptr[d + 1] - ptr[d] == 1
            if single and lo is None:
                lo = d
            elif not single and lo is not None:
                if d - 1 > lo:
                    runs.append((lo, d - 1))
                lo = None
        return tuple(runs)

    @_lazy_field
    def tree_first_leaf(self) -> Tensor:
        """``[T]`` the leaf row of each tree's first leaf in leaf order (for a parse tree
        or a token sequence: its first token, the read-out slot of a CLS token)."""
        n = self.num_leaves
        rows = torch.arange(n, device=self.leaf_tree.device)
        first = self.leaf_tree.new_full((self.num_trees,), n)
        return first.scatter_reduce_(0, self.leaf_tree, rows, "amin")

    @_lazy_field
    def tree_root(self) -> Tensor:
        """``[T]`` the unified index of each tree's root, trees in the order of
        :attr:`leaf_tree` (their roots' node index: graph order in a PyG batch)."""
        roots = (self.parent_unified() < 0).nonzero().flatten()
        return roots[torch.argsort(self.node_of_unified[roots])]

    @_lazy_field
    def child_levels(self) -> Tuple[ChildLevel, ...]:
        """Every depth's internal nodes with their children (:class:`ChildLevel`), the
        deepest first: a recursive pass reads the leaves and the depth below to compute a
        depth. Built once per structure; it reads the group sizes from the device once,
        not once per depth."""
        return _child_levels(self)

    @_lazy_field
    def bucket_depths(self) -> List[Tuple[int, ...]]:
        """For each depth ``0 .. max_depth + 1``, the buckets with a member at that depth
        (Python ints, so passes that go depth by depth never ask the device)."""
        depth_pad = torch.cat([self.depth, self.depth.new_full((1,), -1)])
        out: List[List[int]] = [[] for _ in range(self.max_depth + 2)]
        for g, members in enumerate(self.family_index.members):
            for d in torch.unique(depth_pad[members]).tolist():
                if d >= 0:
                    out[d].append(g)
        return [tuple(b) for b in out]

    def leaf_rows_of(self, nodes: Tensor, what: str = "nodes") -> Tensor:
        """The leaf rows (leaf order, as ``x``) of the leaves ``nodes`` ``[n]`` (node
        ids, long).

        Raises:
            ValueError: naming ``what``, for ids that are not long, out of range or
                internal nodes.
        """
        if not isinstance(nodes, Tensor) or nodes.dtype != torch.long or nodes.dim() != 1:
            raise ValueError(f"{what} must be a 1-D long tensor of node ids, got "
                             f"{getattr(nodes, 'dtype', type(nodes).__name__)} "
                             f"{tuple(getattr(nodes, 'shape', ()))}")
        nodes = nodes.to(self.device)
        m = self.unified_of_node.numel()
        if nodes.numel() and bool(((nodes < 0) | (nodes >= m)).any()):
            raise ValueError(f"{what} holds node ids outside [0, {m})")
        rows = self.unified_of_node[nodes]
        if rows.numel() and bool((rows >= self.num_leaves).any()):
            raise ValueError(f"{what} must name leaves; node "
                             f"{int(nodes[rows >= self.num_leaves][0])} is internal")
        return rows

    def family_groups(self, nodes: Tensor) -> Groups:
        """The sibling families of ``nodes`` ``[n]`` (original node ids), read from
        :attr:`family_index`: nodes are grouped by parent, an only child or a root is a
        family of one."""
        index = self.family_index
        u = self.unified_of_node[nodes]
        counts = [b.num_families for b in self.buckets]
        offset = torch.tensor([0] + counts, device=self.device).cumsum(0)
        bucket = index.node_bucket[u]
        alone = bucket < 0
        group = torch.where(alone, sum(counts) + alone.long().cumsum(0) - 1,
                            offset[bucket.clamp_min(0)] + index.node_family[u])
        slot = torch.where(alone, 0, index.node_pos[u])
        sizes = torch.bincount(group, minlength=sum(counts))
        return Groups(group=group, slot=slot, sizes=sizes)

    # ------------------------------------------------------------------ passes
    # Every pass below is vectorised over the nodes of one depth and loops only over
    # depths: the operator, pooling and the dense matrix all go through them.

    def to_internal(self, leaf_values: Tensor, out: Optional[Tensor] = None,
                    family_sums: Optional[Tensor] = None) -> Tensor:
        """Sum leaf rows ``[N, ...]`` into their parents: ``[I + 1, ...]`` (null row last,
        zero). ``out``: a zero-filled ``[I + 1, ...]`` buffer (e.g. a slice of a wider
        one) to add into, in place, instead of a new tensor. ``family_sums``: those sums
        already formed over the families of the :attr:`whole_leaf_bucket` (``[F, ...]``),
        placed instead of summing ``leaf_values``. Rows are read in order and added into
        their parents (:func:`sums_rows_by_index`), except narrow rows of a
        :attr:`whole_leaf_bucket`, which one reduction over ``[F, b, ...]`` sums."""
        fresh = out is None
        if fresh:
            out = leaf_values.new_zeros((self.num_internal + 1, *leaf_values.shape[1:]))
        whole = self.whole_leaf_bucket
        if family_sums is not None and whole is None:
            raise ValueError("to_internal: family_sums needs a bucket holding every leaf "
                             "in leaf order (whole_leaf_bucket is None)")
        if whole is not None:  # leaves are contiguous families: a reshape and a sum
            whole = self.buckets[whole]
            rows = whole.parent_range
            if family_sums is not None:
                if rows is None:
                    return out.index_copy_(0, whole.parent, family_sums)
                if fresh and records_grad(family_sums):  # a cat's backward is views
                    return torch.cat([out[:rows[0]], family_sums, out[rows[1]:]])
                out[rows[0]:rows[1]].copy_(family_sums)
                return out
            recorded = records_grad(leaf_values, out)
            if recorded or not sums_rows_by_index(leaf_values):
                # trailing dims flattened: the reduction runs over long contiguous rows
                families = leaf_values.reshape(whole.num_families, whole.size, -1)
                if rows is not None and out.is_contiguous() and not recorded:
                    into = out[rows[0]:rows[1]].view(whole.num_families, 1, -1)
                    torch.sum(families, 1, keepdim=True, out=into)
                    return out
                sums = families.sum(1).view(-1, *leaf_values.shape[1:])
                return out.index_copy_(0, whole.parent, sums)
        out.index_add_(0, self.leaf_parent, leaf_values)
        if self.lonely_leaf.numel():  # leaves that are roots added into the null row
            out[-1:].zero_()
        return out

    def add_parent_rows_(self, leaf_rows: Tensor, internal_rows: Tensor) -> Tensor:
        """``leaf_rows[i] += internal_rows[leaf_parent(i)]`` in place, for ``[N, ...]``
        leaf rows and ``[I + 1, ...]`` internal rows: the adjoint of :meth:`to_internal`
        (a leaf that is a root takes nothing: the null row it would read is zero there).
        A chunk of rows at a time, each chunk's gathered rows in one reused scratch: a
        whole ``[N, ...]`` gather would be a fresh mapping faulted in on every call.
        Returns ``leaf_rows``."""
        parents = self.leaf_parent
        if self.lonely_leaf.numel():  # a leaf that is a root reads the null row: zero it
            internal_rows = torch.cat([internal_rows[:-1], internal_rows.new_zeros(
                (1, *internal_rows.shape[1:]))])
        step = _rows_per_chunk(leaf_rows)
        scratch = internal_rows.new_empty((min(step, leaf_rows.shape[0]), *internal_rows.shape[1:]))
        for lo in range(0, leaf_rows.shape[0], step):
            rows = parents[lo:lo + step]
            leaf_rows[lo:lo + step].add_(torch.index_select(internal_rows, 0, rows,
                                                             out=scratch[:rows.numel()]))
        return leaf_rows

    @property
    def whole_leaf_bucket(self) -> Optional[int]:
        """Index of the bucket holding every leaf in leaf order, when there is one."""
        for index, bucket in enumerate(self.buckets):
            if bucket.leaf_range == (0, self.num_leaves):
                return index
        return None

    def bottom_up(self, leaf_part: Tensor,
                  combine: Optional[Callable[[Tensor, int, int], Tensor]] = None,
                  inplace: bool = False) -> Tensor:
        r"""Accumulate children into parents, deepest level first.

        ``value(A) = leaf_part(A) + sum_{C internal child of A} combine(value(C))``,
        where ``combine(values, lo, hi)`` maps the values of internal rows ``lo:hi``
        (identity when ``None``). ``leaf_part``: ``[I + 1, ...]`` (e.g. from
        :meth:`to_internal`); returns ``[I + 1, ...]`` with the null row of
        ``leaf_part`` kept last. ``inplace`` (for a buffer made for this call, when
        autograd records nothing: see :func:`records_grad`) writes the result into
        ``leaf_part``.
        """
        ptr = self.level_ptr
        if combine is None and not inplace and records_grad(leaf_part):
            return _LinearPass.apply(self, leaf_part, True, False)
        if inplace:  # level by level: no level is copied and nothing concatenated
            return self._sum_up_(leaf_part, combine)
        # Recorded: new tensors per level (autograd saves what the levels above read).
        levels: List[Tensor] = []
        below: Optional[Tensor] = None
        for d in range(self.max_depth, -1, -1):
            value = leaf_part[ptr[d]:ptr[d + 1]]
            if below is not None and below.shape[0] > 0:
                if combine is not None:
                    below = combine(below, ptr[d + 1], ptr[d + 2])
                value = value.index_add(0, self.level_parent[d + 1], below)
            levels.append(value)
            below = value
        levels.reverse()
        return torch.cat(levels + [leaf_part[self.num_internal:]])

    def subtree_sum(self, leaf_values: Tensor) -> Tensor:
        """Sum of ``leaf_values [N, ...]`` over the leaves under each internal node:
        ``[I + 1, ...]`` (null row last, zero)."""
        return self.bottom_up(self.to_internal(leaf_values))

    def subtree_mean(self, leaf_values: Tensor) -> Tensor:
        """Mean of ``leaf_values`` over ``l(A)`` for each internal ``A``: ``[I + 1, ...]``."""
        return self.subtree_mean_of_sums(self.subtree_sum(leaf_values))

    def new_means_buffer(self, *leaf_values: Tensor) -> Tensor:
        """An uninitialised ``[T, I + 1, ...]`` buffer for :meth:`subtree_means` of the
        ``T`` tensors ``leaf_values`` (equal row shapes): each tensor's sums, then its
        means, contiguous (:func:`fresh_buffer`)."""
        first = leaf_values[0]
        return fresh_buffer(first, (len(leaf_values), self.num_internal + 1, *first.shape[1:]))

    @_lazy_field
    def leaf_only_buckets(self) -> Tuple[int, ...]:
        """The buckets of leaves alone whose members come from one source
        (:meth:`source_rows`: the bucket of every leaf, a range, or leaves read by
        index): those a kernel that reads its members by index can run whole."""
        return tuple(i for i, b in enumerate(self.buckets)
                     if b.leaf_slot.numel() and not b.internal_slot.numel()
                     and self.source_rows(i) is not None)

    @_lazy_field
    def leaf_family_buckets(self) -> Optional[Tuple[int, ...]]:
        """The buckets holding leaves, where every family with a leaf holds leaves alone
        and each such bucket reads its members from one source (all of them
        :attr:`leaf_only_buckets`): a caller that runs them itself can
        write every family's sums into its parent's row of a :meth:`new_means_buffer`
        and hand it to :meth:`subtree_means`, which then reads no leaf. ``None``
        otherwise (families mixing leaves and internal members, leaves that are an only
        child)."""
        indices = self.leaf_only_buckets
        if len(indices) != sum(1 for b in self.buckets if b.leaf_slot.numel()):
            return None   # a bucket mixes leaves and internal members, or reads two sources
        # an only child is in no family, but its parent's sums hold it
        only_child = self.leaf_parent[self.lonely_leaf] < self.num_internal
        return None if bool(only_child.any()) else indices

    @_lazy_field
    def rows_without_leaf_family(self) -> Tensor:
        """``[R]`` the internal rows (null row included) that are not the parent of a
        family of :attr:`leaf_family_buckets`: the rows of a :meth:`new_means_buffer`
        that no family's sums fill."""
        filled = torch.zeros(self.num_internal + 1, dtype=torch.bool,
                             device=self.leaf_parent.device)
        for index in self.leaf_family_buckets or ():
            filled[self.buckets[index].parent] = True
        return (~filled).nonzero().view(-1)

    def subtree_means(self, *leaf_values: Tensor,
                      family_sums: Optional[Sequence[Tensor]] = None,
                      leaf_sums: Optional[Sequence[Tensor]] = None,
                      buffer: Optional[Tensor] = None) -> tuple:
        """:meth:`subtree_mean` of several ``[N, H, *]`` tensors (e.g. ``q, k, v``) in one
        bottom-up pass (each tensor's means contiguous where autograd records nothing,
        computed in place then). ``family_sums``: per tensor, its sums over the families
        of the :attr:`whole_leaf_bucket` (``[F, H, *]``, already computed by the caller),
        used instead of summing the leaves again (see :meth:`to_internal`).
        ``leaf_sums``: where autograd records, per tensor its :meth:`to_internal` sums
        (``[I + 1, H, *]``), already computed by the caller (e.g. in one recorded node
        with the leaves' family softmax, whose backward adds their gradients into the
        leaves' in place), used instead of ``leaf_values``' own. ``buffer``: where
        autograd records nothing, a :meth:`new_means_buffer` of ``leaf_values`` in which
        every family of :attr:`leaf_family_buckets` holds its sums in its parent's row
        (written there by the caller, e.g. by the compiled kernel that ran those
        families): the other rows are zeroed, the leaves are not read again, and the
        means are computed in the buffer."""
        inplace = not records_grad(*leaf_values, *(leaf_sums or ()))
        if buffer is not None and (not inplace or family_sums is not None
                                   or leaf_sums is not None
                                   or self.leaf_family_buckets is None
                                   or buffer.shape[:2] != (len(leaf_values),
                                                           self.num_internal + 1)
                                   or len({t.shape[1:] for t in leaf_values}) > 1):
            raise ValueError("subtree_means: buffer is a new_means_buffer of leaf_values "
                             "holding the sums of the leaf_family_buckets' families, "
                             "given alone, where autograd records nothing")
        sums_of = list(family_sums) if family_sums is not None else [None] * len(leaf_values)
        if leaf_sums is not None and (inplace or family_sums is not None
                                      or len(leaf_sums) != len(leaf_values)):
            raise ValueError("subtree_means: leaf_sums are recorded sums, one per tensor, "
                             "given without family_sums")
        if not inplace:
            # recorded: one autograd node for the pass and the division, over one buffer
            # (_StackedMeans), the family sums written straight into their rows
            whole = self.whole_leaf_bucket
            rows = None if whole is None else self.buckets[whole].parent_range
            same_shape = len({t.shape[1:] for t in leaf_values}) == 1
            if same_shape and family_sums is not None and rows is not None:
                return _StackedMeans.apply(self, rows, *sums_of)
            parts = (list(leaf_sums) if leaf_sums is not None else
                     [self.to_internal(t, family_sums=f) for t, f in zip(leaf_values, sums_of)])
            if not same_shape:  # e.g. Dv != D
                return tuple(_LinearPass.apply(self, p, True, False, self._inverse_size(p))
                             for p in parts)
            return _StackedMeans.apply(self, None, *parts)
        if len({t.shape[1:] for t in leaf_values}) > 1:  # e.g. Dv != D: one pass each
            return tuple(self.subtree_mean_of_sums(
                self.bottom_up(self.to_internal(t, family_sums=f), inplace=True),
                inplace=True) for t, f in zip(leaf_values, sums_of))
        # one buffer [T, I + 1, ...]: each tensor's means contiguous (the families'
        # gathers are views), and one bottom-up pass over its internal rows (dim 1)
        if buffer is not None:  # the families' sums already in their rows: zero the others
            sums = buffer.index_fill_(1, self.rows_without_leaf_family, 0.0)
        else:
            sums = self.new_means_buffer(*leaf_values).zero_()
            for j, (t, f) in enumerate(zip(leaf_values, sums_of)):
                self.to_internal(t, out=sums[j], family_sums=f)
        self._sum_up_(sums, dim=1)
        # the division over the contiguous buffer ([I + 1, 1, ...] broadcast), not a
        # strided view of it
        sums.mul_(self._inverse_size(sums[0]))
        return tuple(sums.unbind(0))

    def _inverse_size(self, like: Tensor) -> Tensor:
        """``1 / n(A)`` per internal row (null row 1), shaped to scale ``like``'s rows."""
        inverse = self.constant(("inverse_size", like.dtype), lambda: torch.cat(
            [self.internal_size, self.internal_size.new_ones(1)]).reciprocal().to(like.dtype))
        return inverse.view(-1, *([1] * (like.dim() - 1)))

    def bottom_up_weights(self, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        r"""The ratios of the bottom-up pass of log-sum-exps in ``dtype``, made once per
        dtype: ``[N, 1]`` :math:`1 / n(\mathrm{pa}(i))` per leaf (1 for a leaf that is a
        root) and ``[I, 1]`` :math:`n(A) / n(\mathrm{pa}(A))` per internal row (``n(A)``
        for a root)."""
        def build() -> Tensor:
            size = self.node_size_as(dtype)[self.num_leaves:]              # [I + 1]
            return torch.cat([(1.0 / size)[self.leaf_parent],
                              size[:-1] / size[self.internal_parent]]).unsqueeze(-1)
        weights = self.constant(("bottom_up_weights", dtype), build)
        return weights[:self.num_leaves], weights[self.num_leaves:]

    def subtree_mean_of_sums(self, sums: Tensor, inplace: bool = False) -> Tensor:
        """Divide per-node sums ``[I + 1, ...]`` by the leaf counts ``n(A)`` (into
        ``sums`` itself with ``inplace``)."""
        inverse = self._inverse_size(sums)
        return sums.mul_(inverse) if inplace else sums * inverse

    def path_sum(self, delta: Tensor, inplace: bool = False) -> Tensor:
        r"""Top-down accumulation ``value(A) = value(pa(A)) + delta(A)``, with
        ``value(root) = 0``. ``delta``: ``[I + 1, ...]``; returns ``[I + 1, ...]``
        (null row zero), so ``value[leaf_parent]`` is each leaf's parent's value.
        ``inplace``: write into ``delta`` (a buffer the caller made for this)."""
        if records_grad(delta):
            return _LinearPass.apply(self, delta, False, True)
        return _LinearPass.run(self, delta if inplace else delta.clone(), False, True)

    def _sum_down_(self, value: Tensor) -> Tensor:
        """``value(A) += value(pa(A))``, top-down, in place over ``[I + 1, ...]`` rows
        (a chain of one-node levels in one cumulative sum)."""
        ptr, chain_end = self.level_ptr, dict(self.chain_runs)
        d = 1
        while d <= self.max_depth:
            hi = chain_end.get(d - 1)
            if hi is not None:  # levels d - 1 .. hi: one node each, rows consecutive
                run = value[ptr[d - 1]:ptr[hi + 1]]
                run.copy_(run.cumsum(0))
                d = hi + 1
                continue
            parents, children = value[ptr[d - 1]:ptr[d]], value[ptr[d]:ptr[d + 1]]
            # in chunks of rows: each gathered chunk is heap memory reused chunk after
            # chunk, where one gather of a large level is a fresh mapping faulted in on
            # every call
            step = _rows_per_chunk(value)
            for lo in range(0, children.shape[0], step):
                part = self.level_parent[d][lo:lo + step]
                children[lo:lo + step].add_(parents.index_select(0, part))
            d += 1
        return value

    def _sum_up_(self, value: Tensor,
                 combine: Optional[Callable[[Tensor, int, int], Tensor]] = None,
                 dim: int = 0) -> Tensor:
        """``value(A) += sum of combine(value(C))`` over internal children, bottom-up,
        in place (see :meth:`bottom_up`), the internal rows along ``dim`` (e.g. 1 of a
        ``[T, I + 1, ...]`` buffer: ``index_add_`` along a dimension that is not the
        outermost of the memory takes a several times slower scatter path)."""
        ptr = self.level_ptr

        def rows(lo: int, hi: int) -> Tensor:
            return value.narrow(dim, lo, hi - lo)

        chain_start = {} if combine is not None else {hi: lo for lo, hi in self.chain_runs}
        d = self.max_depth - 1
        while d >= 0:
            lo = chain_start.get(d + 1)
            if lo is not None:  # levels lo .. d + 1: one node each, a reversed cumsum
                run = rows(ptr[lo], ptr[d + 2])
                run.copy_(run.flip(dim).cumsum(dim).flip(dim))
                d = lo - 1
                continue
            below = rows(ptr[d + 1], ptr[d + 2])
            if below.shape[dim]:
                if combine is not None:
                    below = combine(below, ptr[d + 1], ptr[d + 2])
                rows(ptr[d], ptr[d + 1]).index_add_(dim, self.level_parent[d + 1], below)
            d -= 1
        return value

    def source_rows(self, index: int) -> Optional[Tuple[bool, Tensor]]:
        """For bucket ``index`` when its members all come from one source (read as
        ``leaf_range`` / ``internal_range`` / ``leaf_gather`` / ``internal_gather``):
        ``(leaves, rows)``, ``leaves`` whether that source is the leaf rows and ``rows``
        ``[F, b]`` int64 the source row of every slot (padding slots repeat a member of
        their family), kept on the structure; else ``None``. For kernels that read the
        members by index themselves instead of :meth:`gather_bucket`'s copy."""
        bucket = self.buckets[index]
        read = bucket.read
        if read not in ("leaf_range", "internal_range", "leaf_gather", "internal_gather"):
            return None
        leaves = read.startswith("leaf")
        shape = (bucket.num_families, bucket.size)
        if read.endswith("gather"):
            rows = bucket.leaf_gather if leaves else bucket.internal_gather
            return leaves, rows.view(shape)
        span = bucket.leaf_range if leaves else bucket.internal_range
        return leaves, self.constant(("source_rows", index), lambda: torch.arange(
            *span, device=bucket.parent.device).view(shape))

    def gather_bucket(self, bucket: FamilyBucket, leaf_values: Tensor,
                      internal_values: Tensor, scratch: Optional[Tensor] = None,
                      sources: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        """Member values of a bucket's families: ``[F, b, ...]``. Padding slots hold
        zeros or a copy of a member of their family: consumers mask them with
        ``log_size = -inf`` and never read their rows back. ``scratch``: rows
        ``[>= F * b, ...]`` that a copy is written into instead of a fresh tensor (views
        of the inputs copy nothing). ``sources``: for a bucket of leaf and internal
        members read by index, its ``leaf_src`` and ``internal_src`` rows already
        gathered (:meth:`gather_buckets` gathers them for all such buckets at once)."""
        rest = leaf_values.shape[1:]
        f, b = bucket.num_families, bucket.size

        def into(shape: Tuple[int, ...]) -> Optional[Tensor]:   # None: the op allocates
            return None if scratch is None else scratch[:f * b].view(shape)
        # a range that is the whole tensor is not sliced: a slice's backward zero-fills
        # and copies a full-size gradient
        read = bucket.read
        if read == "leaf_range":
            lo, hi = bucket.leaf_range
            rows = leaf_values if (lo, hi) == (0, leaf_values.shape[0]) else leaf_values[lo:hi]
            return rows.view(f, b, *rest)
        if read == "internal_range":
            lo, hi = bucket.internal_range
            rows = (internal_values if (lo, hi) == (0, internal_values.shape[0])
                    else internal_values[lo:hi])
            return rows.reshape(f, b, *rest)
        if read == "leaf_block":  # leaves in place, internal members appended
            return torch.cat(self.leaf_block_members(bucket, leaf_values, internal_values),
                             1, out=into((f, b, *rest)))
        # index_select copies whole rows; advanced indexing (values[index]) runs the
        # generic element-wise kernel, several times slower on [N, H, D] rows
        if read == "leaf_gather":
            return torch.index_select(leaf_values, 0, bucket.leaf_gather,
                                      out=into((f * b, *rest))).view(f, b, *rest)
        if read == "internal_gather":
            return torch.index_select(internal_values, 0, bucket.internal_gather,
                                      out=into((f * b, *rest))).view(f, b, *rest)
        full = bucket.leaf_slot.numel() + bucket.internal_slot.numel() == f * b
        out = into((f * b, *rest))
        if out is None:
            out = (leaf_values.new_empty if full else leaf_values.new_zeros)((f * b, *rest))
        elif not full:
            out.zero_()
        if sources is None:
            sources = (leaf_values.index_select(0, bucket.leaf_src),
                       internal_values.index_select(0, bucket.internal_src))
        # in place: ``out`` is fresh, so autograd can record the copies without the
        # full-buffer copy an out-of-place index_copy makes
        out.index_copy_(0, bucket.leaf_slot, sources[0])
        out.index_copy_(0, bucket.internal_slot, sources[1])
        return out.view(f, b, *rest)

    def leaf_block_members(self, bucket: FamilyBucket, leaf_values: Tensor,
                           internal_values: Tensor) -> Tuple[Tensor, Tensor]:
        """The two parts of a :attr:`~FamilyBucket.leaf_block` bucket's members: its
        leaves ``[F, L, ...]``, a view of the leaf rows, and its internal members
        ``[F, b - L, ...]``, gathered. Attention over such a bucket reads the leaves in
        place instead of copying every member into one ``[F, b, ...]`` block."""
        lo, per_family = bucket.leaf_block
        f, rest = bucket.num_families, leaf_values.shape[1:]
        leaves = leaf_values[lo:lo + f * per_family].view(f, per_family, *rest)
        inner = internal_values.index_select(0, bucket.internal_src)
        return leaves, inner.view(f, bucket.size - per_family, *rest)

    def leaf_block_window(self, bucket: FamilyBucket, leaf_values: Tensor, width: int
                          ) -> Optional[Tensor]:
        """A :attr:`~FamilyBucket.leaf_block` bucket's leaves, each family's followed by
        the next ``width - L`` leaf rows (the next family's first leaves, not its
        members): an overlapping ``[F, width, ...]`` view, read-only, for kernels that
        run faster over a wider key block whose extra keys the caller masks. ``None``
        where the last family's window would run past ``leaf_values``."""
        lo, per_family = bucket.leaf_block
        f = bucket.num_families
        if width < per_family or lo + f * per_family + width - per_family > leaf_values.shape[0]:
            return None
        rows = leaf_values[lo:]
        return rows.as_strided((f, width, *rows.shape[1:]),
                               (per_family * rows.stride(0), *rows.stride()))

    @_lazy_field
    def shared_gathers(self) -> Tuple[Tuple[str, Tuple[int, ...], Tensor, Tuple[int, ...]], ...]:
        """For leaf and for internal values, when two or more buckets read their members
        by index (``leaf_gather`` / ``internal_gather``): ``(kind, bucket indices, their
        indices concatenated, their lengths)``, so that :meth:`gather_buckets` reads them
        in one gather."""
        shared = []
        for kind in ("leaf", "internal"):
            members = [(i, getattr(b, f"{kind}_gather")) for i, b in enumerate(self.buckets)
                       if getattr(b, f"{kind}_gather") is not None]
            if len(members) >= 2:
                shared.append((kind, tuple(i for i, _ in members),
                               torch.cat([g for _, g in members]),
                               tuple(g.numel() for _, g in members)))
        return tuple(shared)

    @_lazy_field
    def shared_source_gathers(self) -> Optional[SharedSourceGather]:
        """When two or more buckets are read by two index copies
        (:attr:`FamilyBucket.copies_by_index`, e.g. the families of a parse tree, which
        mix leaves and internal members): their sources, so that :meth:`gather_buckets`
        reads each source once for all of them; else ``None``."""
        mixed = tuple(i for i, b in enumerate(self.buckets) if b.copies_by_index)
        if len(mixed) < 2:
            return None
        buckets = [self.buckets[i] for i in mixed]
        return SharedSourceGather(
            mixed, torch.cat([b.leaf_src for b in buckets]),
            tuple(b.leaf_src.numel() for b in buckets),
            torch.cat([b.internal_src for b in buckets]),
            tuple(b.internal_src.numel() for b in buckets))

    @_lazy_field
    def leaf_of_slot(self) -> List[Optional[Tensor]]:
        """Per bucket, ``[F * b]`` the leaf row of every slot and ``N`` for slots that
        hold an internal member or padding, where the bucket's leaves are neither in
        place nor every slot (else ``None``): :meth:`scatter_leaves` then writes a
        bucket's rows in one ``index_copy_`` into ``N + 1`` rows, instead of first
        gathering its leaf slots into a fresh copy."""
        out: List[Optional[Tensor]] = []
        for b in self.buckets:
            slots = b.num_families * b.size
            if (not b.leaf_slot.numel() or b.leaf_range is not None
                    or b.leaf_block is not None or b.leaf_slot.numel() == slots):
                out.append(None)
                continue
            rows = b.leaf_src.new_full((slots,), self.num_leaves)
            out.append(rows.index_copy_(0, b.leaf_slot, b.leaf_src))
        return out

    @_lazy_field
    def internal_of_slot(self) -> List[Optional[Tensor]]:
        """Per bucket, ``[F * b]`` the internal row of every slot and ``I`` (the null
        row) for slots that hold a leaf or padding, where the bucket has internal members
        and is not a :attr:`~FamilyBucket.leaf_block` bucket (else ``None``): where
        autograd records nothing, :meth:`scatter_internal` writes a bucket's rows in one
        ``index_copy_``, instead of first gathering its internal slots into a copy."""
        out: List[Optional[Tensor]] = []
        for b in self.buckets:
            if not b.internal_slot.numel() or b.leaf_block is not None:
                out.append(None)
                continue
            rows = b.internal_src.new_full((b.num_families * b.size,), self.num_internal)
            out.append(rows.index_copy_(0, b.internal_slot, b.internal_src))
        return out

    @_lazy_field
    def copied_slots(self) -> int:
        """The most slots ``F * b`` of a bucket that :meth:`gather_bucket` copies into a
        scratch (not a view of the inputs, nor a :attr:`~FamilyBucket.leaf_block`
        bucket, which :meth:`gather_buckets` yields in two parts); 0 when there is
        none."""
        return self._copied_slots(())

    def _copied_slots(self, skip: Collection[int]) -> int:
        return max([b.num_families * b.size for i, b in enumerate(self.buckets)
                    if i not in skip and not b.is_view and b.leaf_block is None], default=0)

    def gather_buckets(self, leaf_values: Tensor, internal_values: Tensor,
                       reuse: bool = False, skip: Collection[int] = ()
                       ) -> Iterator[Optional[Union[Tensor, Tuple[Tensor, Tensor]]]]:
        """:meth:`gather_bucket` of every bucket, in bucket order, one at a time (a
        generator). With ``reuse`` (the caller's promise that it keeps no yielded tensor
        past the next, and that no autograd graph saves one) every copied bucket is
        written into one scratch tensor of :attr:`copied_slots` rows, so each yielded
        tensor holds until the next is taken: one buffer whose pages fault in once per call,
        where a fresh copy per bucket (above glibc's mmap threshold, 32 MiB) is a fresh
        mapping that faults in every time (ragged families at N = 262,144, 2 threads:
        39 ms into a fresh 61 MB copy, 12.5 ms into a reused one).
        Where autograd records, the buckets that read by index (ragged families, and
        families mixing leaves and internal members, :attr:`shared_source_gathers`)
        share one gather per source: the backward of a gather zero-fills a gradient of
        the whole source, once for all those buckets instead of once per bucket.
        A :attr:`~FamilyBucket.leaf_block` bucket is yielded in two parts,
        :meth:`leaf_block_members` (leaves in place, internal members gathered).
        ``skip``: indices of buckets the caller reads otherwise (e.g.
        :meth:`gather_leaf_chunks`), yielded as ``None`` and left out of the scratch."""
        shared: Dict[int, Tensor] = {}
        gathered: Dict[int, Tuple[Tensor, Tensor]] = {}  # a mixed bucket's source rows
        scratch = None
        slots = self._copied_slots(skip)
        if records_grad(leaf_values, internal_values):
            for kind, indices, index, lengths in self.shared_gathers:
                if any(i in skip for i in indices):  # the others gathered one by one
                    continue
                values = leaf_values if kind == "leaf" else internal_values
                parts = values.index_select(0, index).split(lengths)
                for i, part in zip(indices, parts):
                    bucket = self.buckets[i]
                    shared[i] = part.view(bucket.num_families, bucket.size, *values.shape[1:])
            mixed = self.shared_source_gathers
            if mixed is not None and not any(i in skip for i in mixed.buckets):
                sources = zip(
                    leaf_values.index_select(0, mixed.leaf_src).split(mixed.leaf_lengths),
                    internal_values.index_select(0, mixed.internal_src)
                    .split(mixed.internal_lengths))
                gathered = dict(zip(mixed.buckets, sources))
        reuse = reuse and not records_grad(leaf_values, internal_values)
        for i, bucket in enumerate(self.buckets):
            if i in skip:
                yield None
                continue
            if i in shared:
                yield shared[i]
                continue
            if i in gathered:
                yield self.gather_bucket(bucket, leaf_values, internal_values,
                                         sources=gathered.pop(i))
                continue
            if bucket.leaf_block is not None:
                yield self.leaf_block_members(bucket, leaf_values, internal_values)
                continue
            if reuse and not bucket.is_view and scratch is None:
                scratch = leaf_values.new_empty((slots, *leaf_values.shape[1:]))
            yield self.gather_bucket(bucket, leaf_values, internal_values, scratch)

    def _leaf_chunk_families(self, bucket: FamilyBucket, leaf_values: Sequence[Tensor]
                             ) -> int:
        """Families per chunk of :meth:`gather_leaf_chunks` (about :data:`_CHUNK_BYTES`
        of the widest of ``leaf_values``; at least one family)."""
        rows = min(_rows_per_chunk(t[:1]) for t in leaf_values)
        return min(bucket.num_families, max(1, rows // bucket.size))

    def new_leaf_chunk_scratch(self, leaf_values: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """Uninitialised buffers, one per tensor of ``leaf_values``, that hold a chunk of
        :meth:`gather_leaf_chunks` of every :attr:`~FamilyBucket.leaf_gather` bucket:
        one scratch for all the buckets of a call. A scratch per bucket is freed after
        its bucket, glibc hands the top of the heap back, and the next bucket's scratch
        faults its pages in again (ragged families at N = 262,144: 34 buckets, about
        140,000 page faults per forward)."""
        rows = max([self._leaf_chunk_families(b, leaf_values) * b.size
                    for b in self.buckets if b.leaf_gather is not None], default=0)
        return tuple(t.new_empty((rows, *t.shape[1:])) for t in leaf_values)

    def gather_leaf_chunks(self, bucket: FamilyBucket, leaf_values: Sequence[Tensor],
                           scratch: Optional[Sequence[Tensor]] = None
                           ) -> Iterator[Tuple[int, int, Tuple[Tensor, ...]]]:
        """The members of a :attr:`~FamilyBucket.leaf_gather` bucket, a few families at
        a time: ``(lo, hi, members)`` with ``members[t]`` ``[hi - lo, b, ...]`` the
        families ``lo .. hi - 1`` of ``leaf_values[t]``, each tensor's chunks gathered
        into one scratch of about :data:`_CHUNK_BYTES` (a yielded chunk holds until the
        next is taken; autograd must record nothing). Where a whole bucket's copy is a
        fresh mapping whose pages fault in at every call (ragged families at
        N = 262,144: hundreds of MiB per operand), the chunks are heap memory reused
        chunk after chunk and still in cache when their consumer reads them.
        ``scratch``: the buffers to gather into (:meth:`new_leaf_chunk_scratch`, shared
        by the buckets of a call); without it, new ones for this call."""
        if bucket.leaf_gather is None:
            raise ValueError("gather_leaf_chunks reads buckets of leaves by index "
                             "(FamilyBucket.leaf_gather); this bucket has none")
        if records_grad(*leaf_values):
            raise ValueError("gather_leaf_chunks reuses its scratch: it cannot run "
                             "where autograd records")
        f, b = bucket.num_families, bucket.size
        step = self._leaf_chunk_families(bucket, leaf_values)
        if scratch is None:
            scratch = self.new_leaf_chunk_scratch(leaf_values)
        elif len(scratch) != len(leaf_values) or any(
                rows.shape[0] < step * b or rows.shape[1:] != t.shape[1:]
                or rows.dtype != t.dtype or rows.device != t.device
                for rows, t in zip(scratch, leaf_values)):
            raise ValueError("gather_leaf_chunks: scratch must hold, per tensor of "
                             f"leaf_values, {step * b} rows of its row shape, dtype and "
                             "device (see new_leaf_chunk_scratch)")
        for lo in range(0, f, step):
            hi = min(lo + step, f)
            index = bucket.leaf_gather[lo * b:hi * b]
            yield lo, hi, tuple(
                torch.index_select(t, 0, index, out=rows[:index.numel()])
                .view(hi - lo, b, *t.shape[1:]) for t, rows in zip(leaf_values, scratch))

    def leaf_rows_of_slots(self, index: int) -> Tensor:
        """``[F * b]`` the row of :meth:`new_leaf_rows` that each slot of bucket
        ``index`` (a bucket of leaves only) writes to: its leaf, ``N`` (the spare row)
        for padding slots."""
        bucket = self.buckets[index]
        if bucket.internal_slot.numel() or bucket.leaf_block is not None:
            raise ValueError(f"bucket {index} holds internal members: its slots are not "
                             "all leaf rows")
        rows = self.leaf_of_slot[index]
        return bucket.leaf_src if rows is None else rows

    def new_leaf_rows(self, like: Tensor) -> Tensor:
        """An uninitialised ``[N + 1, ...]`` buffer (the last row spare) for the ``out``
        of :meth:`scatter_leaves`, where :meth:`leaf_rows_in` shows its callers where to
        write the buckets whose leaves lie in one block."""
        return fresh_buffer(like, (self.num_leaves + 1, *like.shape[1:]))

    def leaf_rows_in(self, out: Tensor, bucket: FamilyBucket) -> Optional[Tensor]:
        """The rows of ``out`` (from :meth:`new_leaf_rows`) that hold ``bucket``'s leaf
        rows as :meth:`scatter_leaves` takes them, where they lie in one block
        (:attr:`~FamilyBucket.leaf_range`: ``[F * b, ...]``,
        :attr:`~FamilyBucket.leaf_block`: ``[F * L, ...]``); ``None`` otherwise. Rows
        written there are not copied again."""
        if bucket.leaf_range is not None:
            return out[bucket.leaf_range[0]:bucket.leaf_range[1]]
        if bucket.leaf_block is not None:
            lo, per_family = bucket.leaf_block
            return out[lo:lo + bucket.num_families * per_family]
        return None

    def scatter_leaves(self, per_bucket: List[Optional[Tensor]], fill: float,
                       like: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """Inverse of :meth:`gather_bucket` for the leaves: per-slot rows
        ``[F * b, ...]`` of each bucket (``None`` or ignored for buckets without
        leaves) -> ``[N, ...]``, ``fill`` for leaves in no family. A
        :attr:`~FamilyBucket.leaf_block` bucket gives the rows of its leaves alone,
        ``[F * L, ...]`` (the first part of :meth:`leaf_block_members`). ``out``: the
        buffer to fill where autograd records nothing (:meth:`new_leaf_rows`; rows
        already in their place in it, :meth:`leaf_rows_in`, are not copied; a bucket
        given as ``None`` there has written its rows into it already)."""
        whole = self.whole_leaf_bucket
        if whole is not None and out is None:  # every leaf in order in one bucket
            return per_bucket[whole]
        if not records_grad(*per_bucket):
            # each bucket's leaf rows written once into the output, as views where the
            # leaves are in place (the gather below copies every row twice); a last
            # row takes the slots that hold no leaf (see leaf_of_slot)
            out = self.new_leaf_rows(like) if out is None else out
            if self.lonely_leaf.numel():
                out.index_fill_(0, self.lonely_leaf, fill)
            for bucket, rows, slot_rows in zip(self.buckets, per_bucket, self.leaf_of_slot):
                if not bucket.leaf_slot.numel() or rows is None:  # None: written already
                    continue
                block = self.leaf_rows_in(out, bucket)
                if block is not None:
                    if not _same_view(block, rows):
                        block.copy_(rows)
                elif rows.shape[0] == bucket.leaf_slot.numel():  # every slot a leaf, in order
                    out.index_copy_(0, bucket.leaf_src, rows)
                else:
                    out.index_copy_(0, slot_rows, rows)
            return out[:-1]
        # recorded: one gather from the concatenated slots (its backward is one scatter;
        # in-place writes would cost a full-size gradient copy per bucket)
        parts = [rows for bucket, rows in zip(self.buckets, per_bucket)
                 if bucket.leaf_slot.numel()]
        parts.append(like.new_full((1, *like.shape[1:]), fill))
        return torch.cat(parts).index_select(0, self.leaf_out_index)

    def scatter_internal(self, per_bucket: List[Optional[Tensor]], fill: float,
                         like: Tensor, row_scale: Optional[List[Optional[Tensor]]] = None
                         ) -> Tensor:
        """As :meth:`scatter_leaves`, for internal members: ``[I + 1, ...]`` (a
        :attr:`~FamilyBucket.leaf_block` bucket gives the rows of its internal members
        alone, ``[F * (b - L), ...]``). ``row_scale``: per bucket factors of the same
        rows (leading dims), applied to the internal members' rows only (not to every
        slot first)."""
        scales = row_scale if row_scale is not None else [None] * len(per_bucket)
        out = like.new_full((self.num_internal + 1, *like.shape[1:]), fill)
        if not records_grad(*per_bucket, *scales):
            # each bucket's rows written once, straight from its slots (the others land
            # in the null row, reset after), and the factors applied to the result in
            # place: no copy of the members' rows, scaled rows or their concatenation
            factor = None
            for bucket, rows, scale, dest in zip(self.buckets, per_bucket, scales,
                                                 self.internal_of_slot):
                if not bucket.internal_slot.numel():
                    continue
                index = bucket.internal_src if dest is None else dest
                out.index_copy_(0, index, rows)
                if scale is not None:
                    if factor is None:
                        factor = scale.new_ones((self.num_internal + 1, *scale.shape[1:]))
                    factor.index_copy_(0, index, scale)
            if factor is not None:
                out.mul_(factor.view(*factor.shape, *([1] * (out.dim() - factor.dim()))))
            out[-1] = fill
            return out
        sources, values = [], []
        for bucket, rows, scale in zip(self.buckets, per_bucket, scales):
            if bucket.internal_slot.numel():
                sources.append(bucket.internal_src)
                if bucket.leaf_block is None:  # every slot given: pick the members
                    rows = rows.index_select(0, bucket.internal_slot)
                    if scale is not None:
                        scale = scale.index_select(0, bucket.internal_slot)
                if scale is not None:
                    rows = rows * scale.view(*scale.shape, *([1] * (rows.dim() - scale.dim())))
                values.append(rows)
        return _scatter_rows(out, sources, values)

    def to(self, device: torch.device | str) -> TreeStructure:
        """A copy on ``device``."""
        def move(value):
            if isinstance(value, Tensor):
                return value.to(device)
            if isinstance(value, (FamilyBucket, FlatTrees)):
                return type(value)(**{k: move(v) for k, v in vars(value).items()})
            if isinstance(value, list):
                return [move(v) for v in value]
            return value
        return TreeStructure(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    @classmethod
    def from_parent(cls, parent: Tensor) -> TreeStructure:
        """Validate a parent array (``parent[u]`` = parent of ``u``, ``-1`` = root)
        and derive the layout. Raises ``ValueError`` naming the offending node."""
        return _build(parent)

    @staticmethod
    def check_parent(parent: Tensor) -> None:
        """The checks of :meth:`from_parent` (indices in range, no cycles) without
        deriving the layout, for constructors that build it only when it is used.
        Raises ``ValueError`` (``TypeError`` for a non-integer array) naming the node."""
        _check_parent(parent)
        _depth_by_pointer_jumping(parent.long())


#: Bytes per chunk of the passes' gathered temporaries (the fused backward's blocks of
#: families have their own, smaller size, ``ops.flash._BLOCK_BYTES``): well below glibc's
#: largest mmap threshold (32 MiB), so that chunk after chunk reuses heap memory instead
#: of mapping (and faulting in) fresh pages.
_CHUNK_BYTES = 8 << 20


#: Rows of at least this many bytes are summed into their groups by ``index_add_``, which
#: reads them in order; a reduction over the middle axis of ``[G, b, W]`` streams them 1.2
#: to 2.3x slower (groups of 2 to 1,024 rows of 64 to 512 float32, 1 and 2 threads), and
#: is faster only on narrow rows (16 to 32 float32), where ``index_add_``'s cost per row
#: dominates.
WIDE_ROW_BYTES = 256


def sums_rows_by_index(rows: Tensor) -> bool:
    """Whether sums of groups of ``rows`` (``[R, ...]``) are faster by ``index_add_``
    than by a reduction over ``[G, b, ...]`` (see :data:`WIDE_ROW_BYTES`)."""
    return rows.dim() > 0 and rows[0].numel() * rows.element_size() >= WIDE_ROW_BYTES


def group_sums(rows: Tensor, size: int) -> Tensor:
    """Sums of consecutive groups of ``size`` rows of a contiguous ``[G * size, ...]``
    tensor: ``[G, ...]``. Wide rows (:func:`sums_rows_by_index`) are read in order and
    added into their group by ``index_add_``, narrow ones summed by one reduction over
    ``[G, size, W]``. For tensors autograd does not record (e.g. inside an autograd
    function's forward or backward)."""
    g = rows.shape[0] // size
    flat = rows.view(rows.shape[0], -1)
    if not sums_rows_by_index(flat):
        return flat.view(g, size, -1).sum(1).view(g, *rows.shape[1:])
    group = torch.arange(rows.shape[0], device=rows.device).div_(size, rounding_mode="floor")
    return flat.new_zeros((g, flat.shape[1])).index_add_(0, group, flat).view(
        g, *rows.shape[1:])


#: Buffers a call makes for itself of at least this many bytes (glibc's largest mmap
#: threshold: each is a fresh mapping, every call) are hinted as transparent huge pages
#: before their first touch (:func:`fresh_buffer`).
HUGE_PAGE_BYTES = 32 << 20
_MADV_HUGEPAGE = 14
_madvise = None


def _madvise_function():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).madvise
                function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                function.restype = ctypes.c_int
                _madvise = function
            except (OSError, AttributeError):
                pass
    return _madvise


def fresh_buffer(like: Tensor, shape: Sequence[int], zero: bool = False) -> Tensor:
    """A new buffer in ``like``'s dtype and device (zero-filled with ``zero``) for a
    call's own use or output. On Linux CPUs, one of :data:`HUGE_PAGE_BYTES` or more gets
    ``madvise(MADV_HUGEPAGE)`` on its page-aligned span before anything touches it: it
    is a fresh mapping whose pages fault in on the first write, and with 2 MiB pages
    (where the system's transparent huge pages allow them on request, ``madvise`` mode,
    the common default) a 512 MiB buffer faults 256 times instead of 131,072 (made and
    filled in 31-39 against 117-145 ms at 2 threads). The hint applies to this buffer's
    pages alone, which go back to the system when it is freed; nothing about the
    process's allocator changes."""
    t = like.new_empty(shape)
    size = t.numel() * t.element_size()
    if (size >= HUGE_PAGE_BYTES and t.device.type == "cpu"
            and not torch.compiler.is_compiling()):
        madvise = _madvise_function()
        if madvise:
            start = -(-t.data_ptr() // 4096) * 4096
            end = (t.data_ptr() + size) // 4096 * 4096
            madvise(start, end - start, _MADV_HUGEPAGE)   # a hint: failure changes nothing
    return t.zero_() if zero else t


def _rows_per_chunk(value: Tensor, chunk_bytes: Optional[int] = None) -> int:
    """Rows of ``value`` per chunk of ``chunk_bytes`` (default :data:`_CHUNK_BYTES`)."""
    row = max(1, value[:1].numel() * value.element_size())
    return max(1, (_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // row)


def _scatter_rows(out: Tensor, sources: List[Tensor], values: List[Tensor]) -> Tensor:
    """A fresh ``out`` with rows ``sources[i]`` set to ``values[i]``, in one in-place
    index_copy: an out-of-place index_copy per bucket would copy all of ``out`` once per
    bucket, which dominated on ragged trees with dozens of buckets."""
    if len(sources) == 1:
        out.index_copy_(0, sources[0], values[0])
    elif sources:
        out.index_copy_(0, torch.cat(sources), torch.cat(values))
    return out


def _check_parent(parent: Tensor) -> None:
    if not isinstance(parent, Tensor):
        raise TypeError(f"parent must be a LongTensor, got {type(parent).__name__}")
    if parent.dim() != 1:
        raise ValueError(f"parent must be one-dimensional, got shape {tuple(parent.shape)}")
    if parent.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"parent must hold integers, got dtype {parent.dtype}")
    m = parent.numel()
    if m == 0:
        raise ValueError("the tree is empty: parent has no nodes")
    bad = (parent < -1) | (parent >= m)
    if bool(bad.any()):
        u = int(bad.nonzero()[0])
        raise ValueError(
            f"parent index out of range at node {u}: parent[{u}] = {int(parent[u])}, "
            f"expected -1 (root) or a node in [0, {m - 1}]")
    loops = parent == torch.arange(m, device=parent.device)
    if bool(loops.any()):
        u = int(loops.nonzero()[0])
        raise ValueError(f"cycle: node {u} is its own parent")


def _depth_by_pointer_jumping(parent: Tensor) -> Tensor:
    """Depth of every node in O(M log M) without a loop over nodes; raises on cycles."""
    m = parent.numel()
    is_root = parent < 0
    ancestor = torch.where(is_root, torch.arange(m, device=parent.device), parent)
    depth = (~is_root).long()
    # After k rounds, ancestor[u] is the 2^k-th ancestor of u (clamped at the root).
    for _ in range(max(1, m.bit_length()) + 1):
        reached = is_root[ancestor]
        if bool(reached.all()):
            break
        depth = depth + torch.where(reached, 0, depth[ancestor])
        ancestor = ancestor[ancestor]
    if not bool(is_root[ancestor].all()):
        on_cycle = int(ancestor[~is_root[ancestor]][0])
        raise ValueError(
            f"cycle: node {on_cycle} is its own ancestor (the parent links do not "
            f"lead to a root)")
    return depth


def _child_levels(st: TreeStructure) -> Tuple[ChildLevel, ...]:
    n, i, dev = st.num_leaves, st.num_internal, st.device
    if i == 0:
        return ()
    parent_row = torch.cat([st.leaf_parent, st.internal_parent])    # by unified id
    # children of every internal row, contiguous and in unified order (a stable sort)
    children = torch.sort(parent_row, stable=True).indices
    count = torch.bincount(parent_row, minlength=i + 1)[:i]
    start = count.cumsum(0) - count
    width = torch.pow(2, torch.ceil(torch.log2(count.double()))).long()
    # nodes sorted by (depth, width): every group is one slice
    max_width = int(width.max()) + 1
    key = st.depth[n:] * max_width + width
    by_key = torch.sort(key, stable=True).indices
    keys, sizes = torch.unique_consecutive(key[by_key], return_counts=True)
    groups: Dict[int, List[ChildGroup]] = {}
    lo = 0
    for k, size in zip(keys.tolist(), sizes.tolist()):
        d, w = divmod(k, max_width)
        rows = by_key[lo:lo + size]
        lo += size
        slot = torch.arange(w, device=dev)
        padding = slot >= count[rows, None]
        member = children[(start[rows, None] + slot).clamp_max(children.numel() - 1)]
        from_leaf = (member < n) & ~padding
        below, stop = st.level_ptr[d + 1], st.level_ptr[d + 2]
        internal = (member >= n) & ~padding
        groups.setdefault(d, []).append(ChildGroup(
            width=w, nodes=rows - st.level_ptr[d], from_leaf=from_leaf,
            leaf_index=torch.where(from_leaf, member, 0),
            internal_index=torch.where(internal, member - n - below, stop - below),
            padding=padding))
    levels = []
    for d in sorted(groups, reverse=True):
        nodes = torch.cat([g.nodes for g in groups[d]])
        order = torch.empty_like(nodes)
        order[nodes] = torch.arange(nodes.numel(), device=dev)
        levels.append(ChildLevel(depth=d, rows=(st.level_ptr[d], st.level_ptr[d + 1]),
                                 groups=tuple(groups[d]), order=order))
    return tuple(levels)


def _padded_size(x: Tensor) -> Tensor:
    """Round family sizes up to ``c * 2^e`` with ``8 <= c < 16`` (exact up to 16)."""
    step = torch.pow(2, (torch.floor(torch.log2(x.double())) - 3).clamp_min(0)).long()
    return (x + step - 1).div(step, rounding_mode="floor") * step


def _build(parent: Tensor) -> TreeStructure:
    _check_parent(parent)
    parent = parent.long()
    device = parent.device
    m = parent.numel()
    depth = _depth_by_pointer_jumping(parent)

    has_parent = parent >= 0
    child_count = torch.bincount(parent[has_parent], minlength=m)
    is_leaf = child_count == 0
    leaves = is_leaf.nonzero().flatten()
    internal = (~is_leaf).nonzero().flatten()
    n, i = leaves.numel(), internal.numel()

    # Internal nodes sorted by (depth, parent, index): levels and families contiguous.
    key = depth[internal] * (m + 1) + (parent[internal] + 1)
    internal = internal[torch.sort(key, stable=True).indices]
    node_of_unified = torch.cat([leaves, internal])
    unified_of_node = torch.empty_like(node_of_unified)
    unified_of_node[node_of_unified] = torch.arange(m, device=device)

    # Parents as internal rows; the null row ``i`` stands for "no parent".
    parent_row = torch.full((m,), i, dtype=torch.long, device=device)
    parent_row[has_parent] = unified_of_node[parent[has_parent]] - n
    parent_row = parent_row[node_of_unified]
    leaf_parent, internal_parent = parent_row[:n], parent_row[n:]
    depth_u = depth[node_of_unified]

    internal_depth = depth_u[n:]
    max_depth = int(internal_depth.max()) if i else -1
    level_counts = torch.bincount(internal_depth, minlength=max_depth + 1)
    level_ptr = [0] + torch.cumsum(level_counts, 0).tolist()
    # one past the deepest internal level hosts only leaves
    level_ptr.append(level_ptr[-1])

    # Leaf counts n(A), bottom-up one level at a time (levels, not nodes).
    size = torch.zeros(i + 1, dtype=torch.float64, device=device)
    size.index_add_(0, leaf_parent, torch.ones(n, dtype=torch.float64, device=device))
    for d in range(max_depth, 0, -1):
        lo, hi = level_ptr[d], level_ptr[d + 1]
        size.index_add_(0, internal_parent[lo:hi], size[lo:hi].clone())
    internal_size = size[:i]

    # Trees are numbered by their roots' original index (= graph order in a PyG batch).
    roots_u = (parent_row == i).nonzero().flatten()
    root_rank = torch.argsort(torch.argsort(node_of_unified[roots_u]))
    tree_of_root = torch.empty(m, dtype=torch.long, device=device)
    tree_of_root[roots_u] = root_rank
    # Each internal level inherits its parents' tree id; leaves read their parent's.
    tree_int = torch.zeros(i + 1, dtype=torch.long, device=device)
    internal_roots = roots_u[roots_u >= n]
    tree_int[internal_roots - n] = tree_of_root[internal_roots]
    for d in range(1, max_depth + 1):
        lo, hi = level_ptr[d], level_ptr[d + 1]
        tree_int[lo:hi] = tree_int[internal_parent[lo:hi]]
    leaf_tree = tree_int[leaf_parent]
    leaf_roots = roots_u[roots_u < n]
    leaf_tree[leaf_roots] = tree_of_root[leaf_roots]

    level_parent = [internal_parent[:0]] + [
        internal_parent[level_ptr[d]:level_ptr[d + 1]] - level_ptr[d - 1]
        for d in range(1, max_depth + 1)]
    buckets = _family_buckets(parent_row, size, n, i, device)
    family_size = torch.bincount(parent_row, minlength=i + 1)
    lonely_leaf = (family_size[leaf_parent] < 2).logical_or(leaf_parent == i).nonzero().flatten()
    # each leaf's row in the rows scatter_leaves takes from the leaf-holding buckets
    # (every slot; a leaf_block bucket's leaves alone), concatenated in bucket order;
    # lonely leaves read the fill row after the last bucket (one loop per bucket)
    leaf_out_index = torch.empty(n, dtype=torch.long, device=device)
    offset = 0
    for bucket in buckets:
        if bucket.leaf_block is not None:
            lo, per_family = bucket.leaf_block
            rows = bucket.num_families * per_family
            leaf_out_index[lo:lo + rows] = torch.arange(offset, offset + rows, device=device)
            offset += rows
        elif bucket.leaf_slot.numel():
            leaf_out_index[bucket.leaf_src] = bucket.leaf_slot + offset
            offset += bucket.num_families * bucket.size
    leaf_out_index[lonely_leaf] = offset
    return TreeStructure(
        num_nodes=m, num_leaves=n, num_trees=int(roots_u.numel()),
        node_of_unified=node_of_unified, unified_of_node=unified_of_node,
        leaf_parent=leaf_parent, internal_parent=internal_parent,
        internal_size=internal_size, depth=depth_u, leaf_tree=leaf_tree,
        level_ptr=level_ptr, level_parent=level_parent, buckets=buckets,
        lonely_leaf=lonely_leaf,
        leaf_out_index=leaf_out_index,
        flat_trees=_flat_trees(depth_u[:n], leaf_tree, int(roots_u.numel()), m - n),
    )


#: blocks of padded flat trees may hold at most this many times the leaves (one long
#: tree among many short ones stays on the general path)
FLAT_PADDING = 2

#: What one bucket costs beyond its member slots (its gathers, masks and kernel calls,
#: forward and backward), counted in slots: buckets of fewer slots share a wider one
#: where the padding costs less than the buckets it saves (:func:`_merged_bucket_keys`).
BUCKET_SLOTS = 512

#: What one group of the causal plan costs beyond its work (its gathers and kernel
#: calls per level and head chunk), counted in query-member pairs (leaf rows x width):
#: groups of one depth share a wider one where the padding costs less
#: (:func:`_causal_widths`).
CAUSAL_GROUP_PAIRS = 1 << 17


def _merged_widths(widths: List[int], weights: List[int], overhead: int) -> List[int]:
    """The width each of ``widths`` (ascending) is padded to when runs of consecutive
    widths share one group, padded to its widest: the runs minimise ``sum(overhead +
    weight x width)`` over the groups (``weights``: what one unit of width costs each, e.g.
    its families), a dynamic program over the widths."""
    k = len(widths)
    best, cut = [0] + [None] * k, [0] * (k + 1)
    for end in range(1, k + 1):                    # the last run: widths[start:end]
        weight = 0
        for start in range(end - 1, -1, -1):
            weight += weights[start]
            cost = best[start] + overhead + weight * widths[end - 1]
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    out, end = list(widths), k
    while end:
        out[cut[end]:end] = [widths[end - 1]] * (end - cut[end])
        end = cut[end]
    return out


def _merged_bucket_keys(keys: List[int], families: List[int], overhead: int) -> List[int]:
    """The bucket key (``2 * width + leaf_only``) each grid bucket of ``keys``
    (ascending, ``families`` each) takes: per kind (leaf-only or not), the small buckets
    (fewer than ``overhead`` slots) merged by :func:`_merged_widths`; larger buckets keep
    their width (they may be views of ``q, k, v``, which padding would turn into
    copies)."""
    out = list(keys)
    for kind in (0, 1):
        small = [j for j, (key, f) in enumerate(zip(keys, families))
                 if key % 2 == kind and f * (key // 2) < overhead]
        widths = _merged_widths([keys[j] // 2 for j in small], [families[j] for j in small],
                                overhead)
        for j, width in zip(small, widths):
            out[j] = 2 * width + kind
    return out


def _causal_widths(depth: Tensor, width: Tensor, leaves: Tensor) -> Tensor:
    """The width of each family ``[F]`` in the causal plan: per depth, the grid widths
    merged by :func:`_merged_widths`, weighed by the leaf rows under their families (a
    level's work is its rows times the width)."""
    span = int(width.max()) + 1
    keys, inverse = torch.unique(depth * span + width, return_inverse=True)
    rows = torch.zeros_like(keys).index_add_(0, inverse, leaves)
    out: List[int] = []
    for _, run in groupby(zip(keys.tolist(), rows.tolist()), key=lambda kr: kr[0] // span):
        run = list(run)
        out += _merged_widths([key % span for key, _ in run], [r for _, r in run],
                              CAUSAL_GROUP_PAIRS)
    return torch.tensor(out, dtype=width.dtype, device=width.device)[inverse]


def _flat_trees(leaf_depth: Tensor, leaf_tree: Tensor, num_trees: int,
                num_internal: int) -> Optional[FlatTrees]:
    """The forest as :class:`FlatTrees` when every tree is a root over its leaves, the
    trees in leaf order, and the blocks padded to the largest tree hold at most
    :data:`FLAT_PADDING` times the leaves; else ``None`` (host syncs: at build time)."""
    n, f = leaf_tree.numel(), num_trees
    if n == 0 or num_internal != f or bool((leaf_depth != 1).any()):
        return None
    if n > 1 and bool((leaf_tree[1:] < leaf_tree[:-1]).any()):
        return None
    sizes = torch.bincount(leaf_tree, minlength=f)
    width = int(sizes.max())
    if width * f == n:
        return FlatTrees(num_trees=f, width=width, slots=None, rows=None)
    if width * f > FLAT_PADDING * n:
        return None
    start = torch.cumsum(sizes, 0) - sizes
    place = torch.arange(width, device=leaf_tree.device)
    slots = (start[:, None] + torch.minimum(place, sizes[:, None] - 1)).flatten()
    rows = leaf_tree * width + torch.arange(n, device=leaf_tree.device) - start[leaf_tree]
    return FlatTrees(num_trees=f, width=width, slots=slots, rows=rows)


def _family_buckets(parent_row: Tensor, size: Tensor, n: int, i: int,
                    device: torch.device) -> List[FamilyBucket]:
    m = parent_row.numel()
    unified = torch.arange(m, device=device)
    counts = torch.bincount(parent_row, minlength=i + 1)
    counts[i] = 0  # roots are not a family
    member = counts[parent_row] >= 2
    members = unified[member]
    fam = parent_row[member]
    # Members sorted by (family, unified index): a family's members are contiguous.
    order = torch.sort(fam * m + members).indices
    members, fam = members[order], fam[order]
    fam_sizes = counts[fam]
    first = torch.ones_like(fam, dtype=torch.bool)
    first[1:] = fam[1:] != fam[:-1]
    start = torch.cummax(torch.where(first, torch.arange(fam.numel(), device=device), 0), 0).values
    position = torch.arange(fam.numel(), device=device) - start
    # Families made only of leaves get buckets of their own: in the common layout
    # (leaf families contiguous in leaf order) such a bucket is a reshape of q, k, v.
    internal_members = torch.zeros(i + 1, dtype=torch.long, device=device).index_add_(
        0, fam, (members >= n).long())
    grid_key = _padded_size(fam_sizes) * 2 + (internal_members[fam] == 0).long()
    keys, families = torch.unique(grid_key[first], return_counts=True)
    merged = torch.tensor(_merged_bucket_keys(keys.tolist(), families.tolist(), BUCKET_SLOTS),
                          dtype=torch.long, device=device)
    bucket_key = merged[torch.searchsorted(keys, grid_key)]

    node_size = torch.cat([torch.ones(n, dtype=torch.float64, device=device), size[:i]])
    # Members grouped by bucket (a stable sort keeps (family, index) order inside each):
    # every bucket is a slice, not a mask over all members
    by_bucket = torch.sort(bucket_key, stable=True)
    members, fam, position = (t[by_bucket.indices] for t in (members, fam, position))
    keys, lengths = torch.unique_consecutive(by_bucket.values, return_counts=True)
    buckets = []
    lo = 0
    for key, length in zip(keys.tolist(), lengths.tolist()):
        b = key // 2
        b_members, b_fam, b_pos = (t[lo:lo + length] for t in (members, fam, position))
        lo += length
        # families of this bucket, in order of their first member
        fam_ids, fam_rank = torch.unique_consecutive(b_fam, return_inverse=True)
        num_fam = fam_ids.numel()
        slot = fam_rank * b + b_pos
        log_size = torch.full((num_fam * b,), float("-inf"), dtype=torch.float64, device=device)
        log_size[slot] = node_size[b_members].log()
        is_leaf = b_members < n
        only_leaves, only_internal = bool(is_leaf.all()), not bool(is_leaf.any())
        if only_leaves:  # the common buckets need no masks
            leaf_slot, leaf_src = slot, b_members
            internal_slot, internal_src = slot[:0], b_members[:0]
        elif only_internal:
            leaf_slot, leaf_src = slot[:0], b_members[:0]
            internal_slot, internal_src = slot, b_members - n
        else:
            leaf_slot, leaf_src = slot[is_leaf], b_members[is_leaf]
            internal_slot, internal_src = slot[~is_leaf], b_members[~is_leaf] - n
        full = b_members.numel() == num_fam * b
        leaf_range = internal_range = leaf_block = leaf_gather = internal_gather = None
        if full and only_leaves and _is_arange(leaf_src, leaf_slot):
            leaf_range = (int(leaf_src[0]), int(leaf_src[0]) + num_fam * b)
        elif full and only_internal and _is_arange(internal_src, internal_slot):
            internal_range = (int(internal_src[0]), int(internal_src[0]) + num_fam * b)
        elif only_leaves or only_internal:
            rows = b_members if only_leaves else b_members - n
            # padding slots repeat their family's first member (masked by log_size)
            gather = rows[b_pos == 0].repeat_interleave(b)
            gather[slot] = rows
            leaf_gather, internal_gather = (gather, None) if only_leaves else (None, gather)
        elif full:
            leaf_block = _leaf_block(leaf_src, leaf_slot, num_fam, b)
        parent_range = None
        if bool((fam_ids[1:] - fam_ids[:-1] == 1).all()):
            parent_range = (int(fam_ids[0]), int(fam_ids[0]) + num_fam)
        buckets.append(FamilyBucket(
            size=b, num_families=num_fam, parent=fam_ids, parent_range=parent_range,
            leaf_slot=leaf_slot, leaf_src=leaf_src,
            internal_slot=internal_slot, internal_src=internal_src,
            log_size=log_size.view(num_fam, b),
            leaf_range=leaf_range, internal_range=internal_range,
            leaf_block=leaf_block, leaf_gather=leaf_gather, internal_gather=internal_gather,
        ))
    return buckets


def _same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` is ``a``'s memory read the same way (rows already written there)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and (a.numel() <= 1 or a.stride() == b.stride()))


def _leaf_block(src: Tensor, slot: Tensor, num_fam: int, size: int) -> Optional[tuple]:
    """``(start, L)`` when the leaves of a full mixed bucket fill the first ``L`` slots of
    every family with consecutive leaf rows (see :attr:`FamilyBucket.leaf_block`)."""
    per_family, rem = divmod(src.numel(), num_fam)
    if rem or per_family < 2:  # one leaf: nothing to gain, and no leaf-only softmax
        return None
    device = src.device
    expected_slot = (torch.arange(num_fam, device=device)[:, None] * size
                     + torch.arange(per_family, device=device)).view(-1)
    if bool((slot == expected_slot).all()) and bool(
            (src == src[0] + torch.arange(src.numel(), device=device)).all()):
        return int(src[0]), per_family
    return None


def _is_arange(src: Tensor, slot: Tensor) -> bool:
    """Whether ``src[slot order]`` is one contiguous run starting at ``src.min()``."""
    if src.numel() == 0:
        return False
    return bool((src - src[0] == slot - slot[0]).all()) and bool((slot == torch.arange(
        slot.numel(), device=slot.device)).all())


def _causal_plan(st: TreeStructure) -> CausalPlan:
    """Build the :class:`CausalPlan` of ``st`` (leaves contiguous under every node):
    every family of two or more members at once, grouped by (depth, padded size), the
    sizes of one depth merged where padding costs less than a group
    (:func:`_causal_widths`); the per-group integers come back in one host
    synchronisation (the merge's in one more), then a loop over groups (a handful per
    depth), never over nodes. Built once per structure."""
    n, m, dev = st.num_leaves, st.num_nodes, st.device
    first, last = st.leaf_ranges
    parent_u = st.parent_unified()
    child = (parent_u >= 0).nonzero().flatten()
    par = parent_u[child]
    keep = torch.bincount(par, minlength=m)[par] >= 2            # members with siblings
    if not bool(keep.any()):
        return CausalPlan(levels=[], first_leaf=first)
    has_one = (st.only_child[:-1] < m).nonzero().flatten()        # internal rows
    lam_source = _only_child_chains(st.only_child[has_one], has_one + n, m, st.max_depth)
    child, par = child[keep], par[keep]
    order = torch.sort(par * (n + 1) + first[child]).indices    # by family, then document
    child, par = child[order], par[order]
    fam_ids, fam_of_member, fam_count = torch.unique_consecutive(
        par, return_inverse=True, return_counts=True)
    pos = torch.arange(child.numel(), device=dev) - (fam_count.cumsum(0) - fam_count)[fam_of_member]
    fam_first, fam_leaves = first[fam_ids], last[fam_ids] - first[fam_ids] + 1
    fam_size = _causal_widths(st.depth[fam_ids], _padded_size(fam_count), fam_leaves)
    key = st.depth[fam_ids] * (2 * m + 2) + fam_size
    group_key, fam_group = torch.unique(key, return_inverse=True)
    num_groups = group_key.numel()

    def per_group(values: Tensor, reduce: str = "sum") -> Tensor:
        init = {"sum": 0, "amin": n + 1, "amax": -1}[reduce]
        out = torch.full((num_groups,), init, dtype=values.dtype, device=dev)
        return out.scatter_reduce(0, fam_group, values, reduce)

    group_fams = per_group(torch.ones_like(fam_group))
    group_leaves = per_group(fam_leaves)
    size_of_group = group_key % (2 * m + 2)
    # T: a power of two near half the mean rows per family, and at least b, so that a
    # tile's member tables ([b, D]) stay small next to its query rows ([T, D])
    half_mean = (group_leaves.double() / group_fams / 2).clamp_min(1)
    tile = torch.maximum(size_of_group, torch.pow(2, torch.floor(torch.log2(half_mean))).long())
    # families of one row count (balanced levels): one tile each, no padding slots
    most = per_group(fam_leaves, "amax")
    tile = torch.where(per_group(fam_leaves, "amin") == most, most, tile)
    fam_tiles = (fam_leaves + tile[fam_group] - 1).div(tile[fam_group], rounding_mode="floor")
    group_tiles = per_group(fam_tiles)
    in_order = ((per_group(last[fam_ids], "amax") - per_group(fam_first, "amin") + 1
                 == group_leaves) & (group_tiles * tile == group_leaves))
    info = torch.stack([group_key // (2 * m + 2), size_of_group, tile, group_fams,
                        group_tiles, group_leaves, in_order.long(),
                        per_group(fam_first, "amin")], 1).tolist()     # the one sync

    # families sorted by (group, first leaf); their rank inside their group
    fam_order = torch.sort(fam_group * (n + 1) + fam_first).indices
    group_start = group_fams.cumsum(0) - group_fams
    fam_local = torch.empty_like(fam_group)
    fam_local[fam_order] = (torch.arange(fam_order.numel(), device=dev)
                            - group_start[fam_group[fam_order]])
    by_depth: dict = {}
    offset = 0
    for g, (depth, b, t, num_fam, num_tiles, leaves, ordered, lo) in enumerate(info):
        fams = fam_order[offset:offset + num_fam]
        offset += num_fam
        mine = fam_group[fam_of_member] == g
        members = torch.full((num_fam * b,), m, dtype=torch.long, device=dev)
        members[fam_local[fam_of_member[mine]] * b + pos[mine]] = child[mine]
        group, real = _tile_group(members.view(num_fam, b), first, last, fam_first[fams],
                                  last[fam_ids[fams]], fam_tiles[fams], t, num_tiles,
                                  (lo, lo + leaves) if ordered else None, fam_ids[fams],
                                  lam_source)
        by_depth.setdefault(depth, []).append((group, real.flatten(), leaves))

    levels = [_causal_level(depth, by_depth[depth], n, dev)
              for depth in sorted(by_depth, reverse=True)]
    return CausalPlan(levels=levels, first_leaf=first)


def _tile_group(members: Tensor, first: Tensor, last: Tensor, fam_first: Tensor,
                fam_last: Tensor, fam_tiles: Tensor, t: int, num_tiles: int,
                rows: Optional[Tuple[int, int]], fam_parent: Tensor,
                lam_source: Tensor) -> Tuple[CausalTiles, Tensor]:
    """The :class:`CausalTiles` of one group: families ``members`` ``[F, b]`` (padding
    ``M``) of the parents ``fam_parent`` whose leaf rows ``fam_first .. fam_last`` are
    cut into ``fam_tiles`` tiles of ``t`` slots each (``lam_source``: see
    :func:`_only_child_chains`); also ``[R * T]`` which slots hold a real row."""
    m, dev = first.numel(), members.device
    num_fam, b = members.shape
    tile_start = fam_tiles.cumsum(0) - fam_tiles                          # per family
    tile_family = torch.repeat_interleave(
        torch.arange(num_fam, device=dev), fam_tiles, output_size=num_tiles)
    within = torch.arange(num_tiles, device=dev) - tile_start[tile_family]
    row0 = fam_first[tile_family] + within * t                              # [R]
    slot_row = row0[:, None] + torch.arange(t, device=dev)                  # [R, T]
    real = slot_row <= fam_last[tile_family][:, None]
    slot_row = torch.where(real, slot_row, row0[:, None])  # padding reads the tile's first row
    member_first = torch.where(members < m, first[members.clamp_max(m - 1)], m + 1)
    p = (member_first[tile_family][:, None, :] <= slot_row[..., None]).sum(-1) - 1
    p = torch.where(real, p, 0)
    spine = members[tile_family[:, None], p]
    parent_first = fam_first[tile_family][:, None]
    count = torch.where(real, slot_row - first[spine] + 1, 1).double()
    count_parent = torch.where(real, slot_row - parent_first + 1, 1).double()
    # the slot of row first(S) - 1 (the slots of a family are its rows, in order)
    before = (tile_start * t)[tile_family][:, None] + first[spine] - 1 - parent_first
    has_before = real & (first[spine] > parent_first)
    flat_members = members.flatten()
    member_rows = None
    if bool((flat_members < m).all()) and _is_arange(flat_members, torch.arange(
            flat_members.numel(), device=dev)):
        member_rows = (int(flat_members[0]), int(flat_members[0]) + flat_members.numel())
    slots_are_members = (num_tiles == num_fam and t == b and bool(
        ((members == slot_row) | (members == m)).all()))
    slot_run = None
    if bool(real.all()) and t > 1:
        sizes = last[spine] - first[spine] + 1                  # [R, T] leaves of S
        n_s = int(sizes[0, 0])
        within = torch.arange(1, n_s + 1, device=dev, dtype=count.dtype)
        if t % n_s == 0 and bool((sizes == n_s).all()) and bool(
                (count.view(num_tiles, t // n_s, n_s) == within).all()):
            slot_run = n_s
    group = CausalTiles(
        size=b, tile=t, members=members, tile_family=tile_family,
        tile_first=tile_start[tile_family], slot_row=slot_row.flatten(),
        slot_index=(tile_family[:, None] * b + p).flatten(), slot_pos=p.flatten(),
        slot_count=count.flatten(), slot_count_parent=count_parent.flatten(),
        slot_before=torch.where(has_before, before, 0).flatten(),
        slot_has_before=has_before.flatten(), slot_is_real=real.flatten(),
        slot_run=slot_run, rows=rows,
        member_rows=member_rows, slots_are_members=slots_are_members,
        family_parent=fam_parent, member_lam=lam_source[members])
    return group, real.flatten()


def _only_child_chains(only_child: Tensor, its_parent: Tensor, m: int,
                       max_depth: int) -> Tensor:
    r"""``[M + 1]``: for every unified node the last node of its chain of only
    children (itself unless it has exactly one child; ``M`` maps to ``M``), from the
    unified ids of the only children and of their parents, by pointer jumping:
    :math:`\lceil \log_2(\mathrm{depth} + 1) \rceil` gathers, no loop over nodes."""
    hop = torch.arange(m + 1, device=only_child.device)
    hop[its_parent] = only_child
    for _ in range(max(1, math.ceil(math.log2(max_depth + 1)))):
        hop = hop[hop]
    return hop


def _causal_level(depth: int, entries: List[Tuple[CausalTiles, Tensor, int]], n: int,
                  dev: torch.device) -> CausalLevel:
    """The :class:`CausalLevel` of the groups ``(tiles, real slots, rows)`` of one depth."""
    groups = [group for group, _, _ in entries]
    if len(groups) == 1 and groups[0].rows == (0, n):
        return CausalLevel(depth, groups, None, None)
    slot_ids, rows, start = [], [], 0
    for group, real, _ in entries:
        slot_ids.append(torch.arange(start, start + real.numel(), device=dev)[real])
        rows.append(group.slot_row[real])
        start += real.numel()
    rows = torch.cat(rows)
    row_slot = torch.zeros(n, dtype=torch.long, device=dev).index_copy(
        0, rows, torch.cat(slot_ids))
    covered = sum(leaves for _, _, leaves in entries) == n
    active = None if covered else torch.zeros(n, dtype=torch.bool, device=dev).index_fill(
        0, rows, True)
    return CausalLevel(depth, groups, row_slot, active)
