r"""Pooling and read-out of leaf outputs: per tree, per node, and into parents.

HSA layers produce one vector per leaf. The paper (appendix F) reads a nested signal
out in three ways, all here:

* **global pooling** (:func:`global_leaf_pool`): one vector per tree, e.g. the mean
  over its leaves;
* **any node** (:func:`subtree_pool`): a node's vector is the mean (or sum) of the
  leaf outputs under it, a leaf's its own output. This gives every node of the tree,
  internal ones included, a feature ``[M, C]`` in node index order, ready for
  message-passing layers over ``tree.edge_index``;
* **local pooling / coarsening** (:func:`pool_leaves`): families made only of leaves
  are pooled into their parents, which become leaves: a coarser nested signal on
  which further HSA layers can run.

All three use the cached :class:`~hsa_graph.TreeStructure` of the tree and work on a
single tree or a PyG ``Batch`` (a forest) alike.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch
from torch import Tensor
from torch_geometric.utils import scatter

from ..signal import NestedSignal

__all__ = ["PooledTree", "global_leaf_pool", "pool_leaves", "subtree_pool"]

_SCATTER_REDUCE = ("mean", "sum", "max", "min")
_GLOBAL_REDUCE = _SCATTER_REDUCE + ("first",)   # "first": a row per tree, not a reduction
_SUBTREE_REDUCE = ("mean", "sum")


def _check_leaf_rows(x: Tensor, structure, name: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[0] != structure.num_leaves:
        raise ValueError(f"{name} must have one row per leaf ({structure.num_leaves}), got "
                         f"shape {tuple(x.shape)}")


def _structure(tree, device: torch.device):
    structure_for = getattr(tree, "structure_for", None)
    if structure_for is None:
        raise TypeError(f"tree must be a NestedSignal or a PyG Batch of them, got "
                        f"{type(tree).__name__}")
    return structure_for(device)


def global_leaf_pool(x: Tensor, tree, reduce: str = "mean") -> Tensor:
    r"""One vector per tree: the ``reduce`` (mean, sum, max or min) of its leaf rows,
    or (``"first"``) the row of its first leaf, as a CLS token is read out.

    Trees are numbered by their roots in increasing node index (so, in a PyG
    ``Batch`` of single-rooted trees, in graph order), as
    ``tree.structure.leaf_tree``.

    Args:
        x: ``[N, ...]`` leaf rows.
        tree: a :class:`~hsa_graph.NestedSignal` or ``Batch`` with ``N`` leaves.
        reduce: ``"mean"``, ``"sum"``, ``"max"``, ``"min"`` or ``"first"``.

    Returns:
        ``[T, ...]`` for the ``T`` trees.

    Example:
        >>> import hsa_graph
        >>> forest = hsa_graph.NestedSignal.from_parents([-1, 0, 0, -1, 3, 3, 3])
        >>> global_leaf_pool(torch.tensor([[1.], [3.], [0.], [3.], [6.]]), forest)
        tensor([[2.],
                [3.]])
    """
    if reduce not in _GLOBAL_REDUCE:
        raise ValueError(f"reduce must be one of {_GLOBAL_REDUCE}, got {reduce!r}")
    structure = _structure(tree, x.device if isinstance(x, Tensor) else torch.device("cpu"))
    _check_leaf_rows(x, structure)
    if reduce == "first":
        return x[structure.tree_first_leaf]
    return scatter(x, structure.leaf_tree, dim=0, dim_size=structure.num_trees, reduce=reduce)


def subtree_pool(x: Tensor, tree, index: Optional[Tensor] = None,
                 reduce: str = "mean") -> Tensor:
    r"""Read out nodes: a leaf's row of ``x``, an internal node's mean (or sum) of the
    rows of the leaves under it.

    With ``index=None`` every node, in node index order: features ``[M, ...]`` for
    message passing over ``tree.edge_index`` (parent -> child), e.g. a
    :class:`~torch_geometric.nn.GCNConv` on the tree itself.

    Args:
        x: ``[N, ...]`` leaf rows.
        tree: a :class:`~hsa_graph.NestedSignal` or ``Batch`` with ``N`` leaves.
        index: optional node indices ``[K]`` to read out.
        reduce: ``"mean"`` or ``"sum"``.

    Returns:
        ``[M, ...]``, or ``[K, ...]`` with ``index``.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> x = torch.tensor([[1.], [3.], [0.], [3.], [6.]])     # leaves 3 .. 7
        >>> subtree_pool(x, tree).flatten()            # nodes 0 .. 7
        tensor([2.6000, 2.0000, 3.0000, 1.0000, 3.0000, 0.0000, 3.0000, 6.0000])
        >>> subtree_pool(x, tree, torch.tensor([2, 6]), reduce="sum").flatten().tolist()
        [9.0, 3.0]
    """
    if reduce not in _SUBTREE_REDUCE:
        raise ValueError(f"reduce must be one of {_SUBTREE_REDUCE}, got {reduce!r}")
    structure = _structure(tree, x.device if isinstance(x, Tensor) else torch.device("cpu"))
    _check_leaf_rows(x, structure)
    inner = structure.subtree_mean(x) if reduce == "mean" else structure.subtree_sum(x)
    # unified order (leaves, then internal rows; drop the null row) -> node order
    unified = torch.cat([x, inner[:-1]])
    if index is None:
        return unified[structure.unified_of_node]
    index = torch.as_tensor(index, device=x.device)
    if index.is_floating_point() or index.dim() != 1:
        raise ValueError(f"index must be a 1-D integer tensor of node indices, got "
                         f"{tuple(index.shape)} {index.dtype}")
    m = structure.num_nodes
    if index.numel() and bool(((index < 0) | (index >= m)).any()):
        bad = int(index[((index < 0) | (index >= m)).nonzero()[0]])
        raise ValueError(f"node index {bad} is out of range [0, {m - 1}]")
    return unified[structure.unified_of_node[index]]


class PooledTree(NamedTuple):
    """The result of :func:`pool_leaves`."""

    #: ``[N', ...]`` rows of the new leaves, in increasing new node index.
    x: Tensor
    #: the coarser :class:`~hsa_graph.NestedSignal` (a forest for a batch).
    tree: NestedSignal
    #: ``[N]``: for each old leaf, the row of the new leaf that holds it (so
    #: ``x_new[cluster]`` unpools).
    cluster: Tensor
    #: ``[M']``: the old node index of each new node.
    node: Tensor


def pool_leaves(x: Tensor, tree, reduce: str = "mean") -> PooledTree:
    r"""Local pooling: merge every family made only of leaves into its parent.

    An internal node all of whose children are leaves becomes a leaf whose row is the
    ``reduce`` (mean, sum, max, min) of its children's rows; leaves under any other
    parent stay as they are (so do roots that are leaves). Nodes keep their geometry,
    position, modality, field name and graph edges; other attributes (``tokens``,
    ``span``, ...) are not carried over. Applying it repeatedly coarsens every tree
    down to its root; the number of trees and their order never change.

    Args:
        x: ``[N, ...]`` leaf rows.
        tree: a :class:`~hsa_graph.NestedSignal` or a PyG ``Batch`` of them.
        reduce: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.

    Returns:
        A :class:`PooledTree` ``(x, tree, cluster, node)``; the new tree is a
        :class:`~hsa_graph.NestedSignal` (a forest for a batch).

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> out = pool_leaves(torch.tensor([[1.], [3.], [0.], [3.], [6.]]), tree)
        >>> out.tree.parent.tolist(), out.x.flatten().tolist(), out.cluster.tolist()
        ([-1, 0, 0], [2.0, 3.0], [0, 0, 1, 1, 1])
    """
    if reduce not in _SCATTER_REDUCE:
        raise ValueError(f"reduce must be one of {_SCATTER_REDUCE}, got {reduce!r}")
    device = x.device if isinstance(x, Tensor) else torch.device("cpu")
    structure = _structure(tree, device)
    _check_leaf_rows(x, structure)
    parent = tree.parent.to(device)
    geometry = tree.geometry.to(device)
    m = parent.numel()
    is_leaf = geometry < 0
    has_parent = parent >= 0
    child_count = torch.bincount(parent[has_parent], minlength=m)
    leaf_child_count = torch.bincount(parent[has_parent & is_leaf], minlength=m)
    collapsed = (child_count > 0) & (child_count == leaf_child_count)
    removed = is_leaf & has_parent & collapsed[parent.clamp_min(0)]
    keep = ~removed
    node = keep.nonzero().flatten()
    new_id = torch.cumsum(keep.long(), 0) - 1
    new_parent = torch.where(parent[node] >= 0, new_id[parent[node].clamp_min(0)], -1)
    new_geometry = torch.where(collapsed[node], -1, geometry[node])

    # Each old leaf's new node: itself, or the parent it was pooled into.
    leaves = structure.node_of_unified[:structure.num_leaves]   # node index of each row
    target = torch.where(removed[leaves], new_id[parent[leaves].clamp_min(0)], new_id[leaves])
    new_is_leaf = new_geometry < 0
    row_of_new = torch.cumsum(new_is_leaf.long(), 0) - 1
    cluster = row_of_new[target]
    new_x = scatter(x, cluster, dim=0, dim_size=int(new_is_leaf.sum()), reduce=reduce)

    sibling = getattr(tree, "sibling_edge_index", None)
    if sibling is not None and sibling.numel():
        sibling = sibling.to(device)
        both = keep[sibling].all(0)
        sibling = new_id[sibling[:, both]]
    else:
        sibling = None
    keys = _flat_keys(tree, m)
    kept_keys = None
    if keys is not None:
        kept_keys = [keys[u] for u in node.tolist()]
    modality = getattr(tree, "modality", None)
    pooled = NestedSignal.from_parents(
        new_parent, new_x, geometry=new_geometry, position=tree.position.to(device)[node],
        modality=None if modality is None else modality.to(device)[node], key=kept_keys,
        sibling_edge_index=sibling)
    return PooledTree(new_x, pooled, cluster, node)


def _flat_keys(tree, m: int) -> Optional[List[Optional[str]]]:
    """``tree.key`` as one list over all nodes (a ``Batch`` stores one list per tree),
    or ``None`` when no node has a field name."""
    keys = tree.key if "key" in tree else None
    if keys is None:
        return None
    if keys and isinstance(keys[0], (list, tuple)):
        keys = [key for per_tree in keys for key in per_tree]
    keys = list(keys)
    if len(keys) != m:
        raise ValueError(f"tree.key has {len(keys)} entries for {m} nodes")
    return keys if any(key is not None for key in keys) else None
