"""Nested signals: trees whose leaves carry vectors, stored as PyG graphs."""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import networkx as nx
import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import Batch, Data

from .structure import TreeStructure

__all__ = ["GEOMETRIES", "NestedSignal", "Node", "collate", "flatten"]

#: Geometries of internal nodes; ``NestedSignal.geometry`` stores their index, and
#: ``-1`` for leaves.
GEOMETRIES = ("sequence", "grid", "set", "keyvalue", "graph")
LEAF = -1
_CODE = {name: code for code, name in enumerate(GEOMETRIES)}


def _geometry_code(value: Any, where: str) -> int:
    if isinstance(value, str) and value in _CODE:
        return _CODE[value]
    if (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
            and -1 <= int(value) < len(GEOMETRIES)):
        return int(value)
    raise ValueError(f"unknown geometry {value!r:.60} at {where}; expected one of {GEOMETRIES} "
                     "or its index")


def _is_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool (``True`` is no position or tag)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _int_arg(value: Any, what: str) -> int:
    """``value`` as an int; floats (even integral or infinite ones) are refused rather
    than truncated."""
    if not _is_int(value):
        raise TypeError(f"{what} must be an int, got the {type(value).__name__} {value!r:.40}")
    return int(value)


def _modality_arg(value: Any, what: str) -> int:
    """A modality tag: a non-negative int (it indexes per-modality weights)."""
    tag = _int_arg(value, what)
    if not 0 <= tag < 2 ** 63:
        raise ValueError(f"{what} must be a non-negative int64, got {tag}")
    return tag


def _edge_pairs(edges: Any, what: str) -> List[tuple]:
    """``edges`` as a list of ``(i, j)`` int pairs (each named by its index on error)."""
    if isinstance(edges, (Tensor, np.ndarray)):
        edges = edges.tolist()
    if isinstance(edges, (str, bytes)) or not isinstance(edges, Iterable):
        raise TypeError(f"{what} must be a list of (i, j) pairs, got the "
                        f"{type(edges).__name__} {edges!r:.40}")
    pairs = []
    for e, edge in enumerate(edges):
        try:
            pair = tuple(edge)
        except TypeError:
            pair = None
        if pair is None or len(pair) != 2 or not all(_is_int(v) for v in pair):
            raise ValueError(f"{what}: edge {e} is {edge!r:.40}; each edge is a pair (i, j) "
                             "of ints")
        pairs.append((int(pair[0]), int(pair[1])))
    return pairs


class NestedSignal(Data):
    r"""A forest of nested signals as one PyG graph.

    Nodes are numbered ``0 .. M-1``; leaves are the childless nodes, and their rows
    (in increasing node index) are the rows of ``x`` and of HSA's ``q``, ``k``, ``v``.

    Stored attributes (all batch correctly with :class:`torch_geometric.data.Batch`):

    * ``x`` ``[N, F]`` (or ``[N]`` token ids): leaf features, optional.
    * ``edge_index`` ``[2, M - R]``: parent -> child edges, so any PyG layer can run
      on the same object (``R`` = number of roots).
    * ``geometry`` ``[M]``: index into :data:`GEOMETRIES` for internal nodes, ``-1``
      for leaves.
    * ``position`` ``[M, 2]``: each node's position in its parent's geometry: the
      child index for ``sequence``/``set``/``keyvalue``/``graph``, ``(row, col)`` for
      ``grid``; ``(-1, -1)`` for roots.
    * ``modality`` ``[M]``: an integer tag per node (e.g. 0 = text, 1 = image);
      zeros unless given.
    * ``key``: the field name of each child of a ``keyvalue`` node (``None``
      elsewhere), a list of length ``M`` (in a batch: one such list per tree).
    * ``sibling_edge_index`` ``[2, E]``: edges between siblings of ``graph`` nodes
      (empty unless given).

    Derived (not stored, computed once and cached): :attr:`parent`, :attr:`is_leaf`,
    :attr:`structure`.

    Batching (``Batch.from_data_list``) is PyG's collate, which needs every tree to
    carry the same attributes: ``x`` on all trees or on none, of one rank and
    trailing shape (token ids ``[N]`` and vectors ``[N, F]`` do not mix; torch then
    reports "Tensors must have same number of dimensions"), and the same builder
    extras (a ``text_tree`` with ``tokens`` and ``span`` does not batch with an
    ``image_tree``: PyG raises ``KeyError: 'tokens'``). :func:`collate` (usable as
    a ``DataLoader``'s ``collate_fn``) checks this first and names the two trees and
    the attribute. Compose such trees with :meth:`join` or
    :func:`~hsa_graph.builders.document_tree` instead, or delete the extras first.

    Example:
        >>> tree = NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2], x=torch.randn(5, 4))
        >>> tree.num_leaves, tree.parent.tolist()
        (5, [-1, 0, 0, 1, 1, 2, 2, 2])
    """

    # ----------------------------------------------------------- derived fields
    @property
    def parent(self) -> Tensor:
        """``[M]`` parent of every node, ``-1`` for roots."""
        m = self.num_nodes
        parent = torch.full((m,), -1, dtype=torch.long, device=self.edge_index.device)
        parent[self.edge_index[1]] = self.edge_index[0]
        return parent

    @property
    def is_leaf(self) -> Tensor:
        """``[M]`` whether each node is a leaf (has no children)."""
        return self.geometry == LEAF

    @property
    def leaf_index(self) -> Tensor:
        """Node indices of the leaves, in row order of ``x`` / ``q``."""
        return self.is_leaf.nonzero().flatten()

    @property
    def num_leaves(self) -> int:
        """``N``: the number of leaves."""
        return int(self.is_leaf.sum())

    @property
    def structure(self) -> TreeStructure:
        """The cached :class:`TreeStructure` on the device of ``edge_index``."""
        return self.structure_for(self.edge_index.device)

    def structure_for(self, device: Union[torch.device, str]) -> TreeStructure:
        """The cached :class:`TreeStructure` on ``device`` (built once per tree and
        device).

        The cache belongs to the ``edge_index`` tensor it was built from (a weak
        reference to that very object, its storage and PyTorch's version counter) and
        to ``num_nodes``: assigning another ``edge_index`` (even one that reuses the
        freed memory of the old one), editing it in place with tensor operations or
        changing ``num_nodes`` rebuilds it; the check is O(1) per call. Writes that
        bypass the version counter (through ``.numpy()`` or ``.data``) cannot be seen:
        call :meth:`validate` (or :meth:`clear_structure`) after those.
        """
        device = torch.device(device)
        edge_index = self.edge_index
        cache = self.__dict__.get("_structure_cache")
        if not isinstance(cache, _StructureCache) or not cache.matches(edge_index,
                                                                       self.num_nodes):
            cache = _StructureCache(edge_index, self.num_nodes)
            self.__dict__["_structure_cache"] = cache
        by_device = cache.by_device
        if device not in by_device:
            base = next(iter(by_device.values()), None)
            by_device[device] = (base.to(device) if base is not None
                                 else TreeStructure.from_parent(self.parent.to(device)))
        return by_device[device]

    def clear_structure(self) -> None:
        """Drop the cached :class:`TreeStructure` (the next use rebuilds it)."""
        self.__dict__.pop("_structure_cache", None)

    def validate(self, raise_on_error: bool = True) -> bool:
        """Check the tree as PyG's ``Data.validate`` does, and also as a nested signal:
        ``edge_index`` gives each node at most one parent and forms a forest with
        ``num_nodes`` nodes, the geometries mark exactly the childless nodes as leaves,
        ``x`` has one row per leaf and the per-node fields have one entry per node.

        It also drops the cached :attr:`structure`, so that an edit the cheap cache
        check cannot see (a write through ``.numpy()``) is picked up afterwards.

        Args:
            raise_on_error: raise instead of warning and returning ``False``.

        Returns:
            Whether the tree is valid.

        Raises:
            ValueError: the first problem found, when ``raise_on_error``.
        """
        status = super().validate(raise_on_error)
        self.clear_structure()
        problem = _tree_problem(self)
        if problem:
            if raise_on_error:
                raise ValueError(f"invalid {type(self).__name__}: {problem}")
            warnings.warn(f"invalid {type(self).__name__}: {problem}", stacklevel=2)
            return False
        return status

    def geometry_names(self) -> List[Optional[str]]:
        """The geometry of every node as a string (``None`` for leaves)."""
        return [GEOMETRIES[g] if g >= 0 else None for g in self.geometry.tolist()]

    def __inc__(self, key: str, value: Any, *args, **kwargs) -> Any:
        if key == "key":
            return 0
        return super().__inc__(key, value, *args, **kwargs)

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_parents(
        cls,
        parent: Union[Sequence[int], Tensor, np.ndarray],
        x: Optional[Tensor] = None,
        *,
        geometry: Union[str, Sequence[Optional[str]], Tensor] = "sequence",
        position: Optional[Union[Tensor, Sequence]] = None,
        modality: Optional[Union[Tensor, Sequence[int]]] = None,
        key: Optional[Sequence[Optional[str]]] = None,
        sibling_edge_index: Optional[Tensor] = None,
        **attrs: Any,
    ) -> NestedSignal:
        r"""Build a forest from a parent array.

        Args:
            parent: ``parent[u]`` is the parent of node ``u``; ``-1`` marks a root
                (several roots = independent trees). Leaves are the childless nodes.
            x: leaf features ``[N, F]`` or token ids ``[N]``, rows in increasing
                node index.
            geometry: one geometry name for every internal node, or one entry per
                node (``None`` for leaves), or integer codes.
            position: ``[M]`` or ``[M, 2]`` positions in the parent's geometry. By
                default, each node's index among its siblings (in node order);
                required for children of ``grid`` nodes.
            modality: optional ``[M]`` integer tag per node.
            key: field names of the children of ``keyvalue`` nodes (length ``M``).
            sibling_edge_index: ``[2, E]`` edges between siblings of ``graph`` nodes.
            **attrs: any further PyG attributes to store.

        Raises:
            ValueError: naming the node, for parents out of range, cycles, missing or
                misplaced geometries, positions or features of the wrong shape.
        """
        parent = _as_long_tensor(parent, "parent")
        # the layout is derived on first use (a batch derives its own)
        TreeStructure.check_parent(parent)
        m = parent.numel()
        device = parent.device
        has_parent = parent >= 0
        child_count = torch.bincount(parent[has_parent], minlength=m)
        is_leaf = child_count == 0

        geometry = _geometry_codes(geometry, is_leaf)
        # Children in node order; the stable sort keeps each family in node order.
        children = has_parent.nonzero().flatten()
        children = children[torch.sort(parent[children], stable=True).indices]
        edge_index = torch.stack([parent[children], children])
        position = _positions(position, parent, geometry, children, m, device)
        if x is not None:
            x = _as_features(x)
            n = int(is_leaf.sum())
            if x.dim() == 0 or x.shape[0] != n:
                raise ValueError(
                    f"x must have one row per leaf: the tree has {n} leaves, x has shape "
                    f"{tuple(x.shape)}")
        if modality is not None:
            modality = _as_long_tensor(modality, "modality")
            if modality.shape != (m,):
                raise ValueError(f"modality must have shape [{m}], got {tuple(modality.shape)}")
            if modality.numel() and int(modality.min()) < 0:
                u = int((modality < 0).nonzero()[0])
                raise ValueError(f"node {u} has modality {int(modality[u])}; modality tags "
                                 "are non-negative ints (they index per-modality weights)")
        if key is not None:
            if isinstance(key, (str, bytes)) or not isinstance(key, Iterable):
                # list("title") would split it silently
                raise TypeError(f"key must be a sequence of one str or None per node, "
                                f"got the {type(key).__name__} {key!r:.40}")
            key = list(key)
            if len(key) != m:
                raise ValueError(f"key must have one entry per node ({m}), got {len(key)}")
            bad = [u for u, k in enumerate(key) if k is not None and not isinstance(k, str)]
            if bad:  # keys must survive batching, to_networkx and hsa_graph.io as text
                raise TypeError(f"key of node {bad[0]} is a {type(key[bad[0]]).__name__} "
                                f"({key[bad[0]]!r:.40}); keys are str or None")
            parent_geometry = torch.where(has_parent, geometry[parent.clamp_min(0)], LEAF)
            for u in (parent_geometry == _CODE["keyvalue"]).nonzero().flatten().tolist():
                if not isinstance(key[u], str):
                    raise ValueError(f"node {u} is a field of keyvalue node "
                                     f"{int(parent[u])} but has no string key")
        elif bool((geometry == _CODE["keyvalue"]).any()):
            u = int((geometry == _CODE["keyvalue"]).nonzero()[0])
            raise ValueError(f"node {u} has geometry 'keyvalue' but no field names "
                             "(key=...) were given for its children")
        if sibling_edge_index is not None:
            sibling_edge_index = _check_sibling_edges(sibling_edge_index, parent, geometry)
        _check_attr_names(attrs)
        # Optional fields are always present so that any trees can share a batch.
        if modality is None:
            modality = torch.zeros(m, dtype=torch.long, device=device)
        if key is None:
            key = [None] * m
        if sibling_edge_index is None:
            sibling_edge_index = torch.zeros((2, 0), dtype=torch.long, device=device)
        data = cls(x=x, edge_index=edge_index, geometry=geometry, position=position,
                   modality=modality, key=key, sibling_edge_index=sibling_edge_index,
                   num_nodes=m, **attrs)
        return data

    @classmethod
    def from_networkx(cls, graph: nx.Graph, root: Any = None, *, x: str = "x",
                      geometry: str = "geometry", position: str = "position",
                      modality: str = "modality", key: str = "key",
                      default_geometry: str = "sequence", order: str = "graph",
                      ) -> NestedSignal:
        """Build from a networkx tree or forest.

        Args:
            graph: an ``nx.DiGraph`` with parent -> child edges (a tree or a forest), or
                an undirected ``nx.Graph`` tree with ``root`` given.
            root: the root of an undirected tree.
            x, geometry, position, modality, key: the names of the node attributes
                holding the leaf features (a vector or a token id), the internal
                node's geometry (default ``default_geometry``), the position in the
                parent's geometry (an int or a ``(row, col)`` pair), the modality tag
                and the field name under a ``keyvalue`` parent. Edges between siblings
                of a ``graph`` node are read from the graph attribute ``sibling_edges``
                (pairs of node labels).
            order: how nodes are numbered, which fixes the row order of the leaves:
                ``"graph"`` keeps the graph's node order (so ``to_networkx`` round
                trips exactly); ``"position"`` numbers nodes depth-first with each
                node's children sorted by their ``position`` attribute (children
                without one keep insertion order, after those with one), i.e. leaves
                in document order.

        Example:
            >>> G = nx.DiGraph([("doc", "s1"), ("doc", "s2"), ("s1", "a"), ("s1", "b")])
            >>> nx.set_node_attributes(G, {"a": 7, "b": 8, "s2": 9}, "x")
            >>> NestedSignal.from_networkx(G).x.tolist()
            [9, 7, 8]
            >>> NestedSignal.from_networkx(G, order="position").x.tolist()
            [7, 8, 9]
        """
        if not isinstance(graph, nx.Graph):
            raise TypeError(f"expected a networkx graph, got {type(graph).__name__}")
        if graph.is_multigraph():
            raise TypeError("a multigraph is not a tree (a tree has at most one edge between "
                            "two nodes): convert it with nx.DiGraph(G) first")
        if order not in ("graph", "position"):
            raise ValueError(f"order must be 'graph' or 'position', got {order!r}")
        if graph.number_of_nodes() == 0:
            raise ValueError("the graph has no nodes")
        if not graph.is_directed():
            if root is None:
                raise ValueError("an undirected tree needs a root: from_networkx(G, root=...)")
            if root not in graph:
                raise ValueError(f"root {root!r} is not a node of the graph")
            if not nx.is_tree(graph):
                raise ValueError("the undirected graph is not a tree (it has a cycle or "
                                 "is disconnected)")
            oriented = nx.DiGraph(**graph.graph)  # keeps the graph's node order
            oriented.add_nodes_from(graph.nodes(data=True))
            oriented.add_edges_from(nx.bfs_edges(graph, root))
            graph = oriented
        labels = list(graph.nodes)
        index = {label: u for u, label in enumerate(labels)}
        parent = [-1] * len(labels)
        for a, b in graph.edges:
            if a == b:
                raise ValueError(f"self-loop at node {a!r}")
            u = index[b]
            if parent[u] != -1:
                raise ValueError(f"node {b!r} has two parents: {labels[parent[u]]!r} and {a!r}")
            parent[u] = index[a]
        if order == "position":
            labels = _depth_first_by_position(labels, parent, graph.nodes, position)
            index = {label: u for u, label in enumerate(labels)}
            parent = [-1] * len(labels)
            for a, b in graph.edges:
                parent[index[b]] = index[a]
        attrs = graph.nodes
        is_leaf = [graph.out_degree(label) == 0 for label in labels]
        geometries = [None if leaf else attrs[label].get(geometry, default_geometry)
                      for label, leaf in zip(labels, is_leaf)]
        positions = None
        if any(position in attrs[label] for label in labels):
            positions = [_position_pair(attrs[label].get(position), label) for label in labels]
        modalities = None
        if any(modality in attrs[label] for label in labels):
            modalities = [_modality_arg(attrs[label].get(modality, 0),
                                        f"node {label!r}: modality") for label in labels]
        keys = None
        if any(key in attrs[label] for label in labels):
            keys = [attrs[label].get(key) for label in labels]
        features = None
        leaf_labels = [label for label, leaf in zip(labels, is_leaf) if leaf]
        leaf_x = [attrs[label].get(x) for label in leaf_labels]
        if any(value is not None for value in leaf_x):
            missing = [label for label, value in zip(leaf_labels, leaf_x) if value is None]
            if missing:
                raise ValueError(f"leaf {missing[0]!r} has no {x!r} while other leaves do")
            features = _stack_leaves(leaf_x, leaf_labels)
        sibling_edge_index = None
        if graph.graph.get("sibling_edges"):
            given = graph.graph["sibling_edges"]
            if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
                raise TypeError("the graph attribute 'sibling_edges' must be a list of "
                                f"(label, label) pairs, got the {type(given).__name__}")
            for e, edge in enumerate(given):
                if not isinstance(edge, (tuple, list)) or len(edge) != 2:
                    raise ValueError(f"sibling edge {e} is {edge!r:.40}; each sibling edge is "
                                     "a pair of node labels")
            unknown = [e for e in given if e[0] not in index or e[1] not in index]
            if unknown:
                raise ValueError(f"sibling edge {unknown[0]!r} names a node not in the graph")
            pairs = [(index[a], index[b]) for a, b in given]
            sibling_edge_index = torch.tensor(pairs, dtype=torch.long).t()
        return cls.from_parents(parent, features, geometry=geometries, position=positions,
                                modality=modalities, key=keys,
                                sibling_edge_index=sibling_edge_index)

    def to_networkx(self) -> nx.DiGraph:
        """A ``nx.DiGraph`` (parent -> child) with every attribute on its nodes;
        :meth:`from_networkx` of it gives back an equal :class:`NestedSignal`."""
        graph = nx.DiGraph()
        m = self.num_nodes
        leaf = self.is_leaf.tolist()
        names = self.geometry_names()
        position = self.position.tolist()
        modality = self.modality.tolist()
        key = self.key
        if key and isinstance(key[0], (list, tuple)):  # a Batch: one list per tree
            key = [k for per_tree in key for k in per_tree]
        x_rows = iter(self.x.unbind(0)) if self.get("x") is not None else None
        for u in range(m):
            attrs: Dict[str, Any] = {"position": tuple(position[u])}
            if not leaf[u]:
                attrs["geometry"] = names[u]
            elif x_rows is not None:
                attrs["x"] = next(x_rows)
            if modality[u]:
                attrs["modality"] = modality[u]
            if key[u] is not None:
                attrs["key"] = key[u]
            graph.add_node(u, **attrs)
        graph.add_edges_from(self.edge_index.t().tolist())
        if self.sibling_edge_index.numel():
            graph.graph["sibling_edges"] = [tuple(e) for e in self.sibling_edge_index.t().tolist()]
        return graph

    @classmethod
    def from_nested(cls, data: Any, *, modality: Optional[int] = None) -> NestedSignal:
        """Build one tree from nested Python data.

        * a ``list`` or ``tuple`` is a ``sequence`` of its items;
        * a ``dict`` is a ``keyvalue`` node, one field per key (the key is the field
          name, stored in ``key``);
        * :class:`Node` sets the geometry (``set``, ``grid``, ``graph``...) and
          modality explicitly;
        * a leaf is a 1-D tensor/array (a vector; all leaves the same length) or an
          ``int`` (a token id; all leaves then ints).

        Example:
            >>> tree = NestedSignal.from_nested([[1, 2, 3], [4, 5]])   # two sentences
            >>> tree.num_leaves, tree.geometry_names()[0]
            (5, 'sequence')
        """
        builder = _NestedBuilder(modality)
        builder.walk(data)
        return builder.build(cls)


    @classmethod
    def join(cls, children: Sequence[NestedSignal], geometry: str = "sequence", *,
             keys: Optional[Sequence[str]] = None,
             positions: Optional[Sequence[Any]] = None,
             sibling_edges: Optional[Sequence[tuple]] = None,
             modality: Optional[int] = None) -> NestedSignal:
        """A new tree whose root (node 0, of ``geometry``) has the roots of
        ``children`` as its children, in order; each child tree keeps its nodes,
        attributes and leaf order (offset after the nodes before it).

        Builders compose with it: a document is ``join([title, body, image],
        "keyvalue", keys=["title", "body", "image"])``.

        Args:
            children: single-rooted trees; their ``x`` must all be given with the same
                trailing shape and dtype, or all be missing.
            geometry: the root's geometry.
            keys: field names, required for ``keyvalue``.
            positions: the children's positions (default: their index, or for
                ``grid`` required ``(row, col)`` pairs).
            sibling_edges: for ``graph``: pairs ``(i, j)`` of child indices.
            modality: the root's modality tag (default 0).

        Builder attributes that every child carries are kept: per-node ones
        (a tensor or list with one entry per node, e.g. ``span``) get a filler entry
        for the new root (``-1`` for integer tensors, ``0`` for floating ones, ``None``
        in lists); per-leaf ones (one entry per leaf, e.g. ``tokens``) are
        concatenated. Attributes missing from some child, or of another size, are
        dropped. When every child is a single node (so per-node and per-leaf sizes
        agree), tensors are taken as per-node and lists as per-leaf.

        Example:
            >>> from hsa_graph.builders import text_tree
            >>> doc = NestedSignal.join([text_tree("A b."), text_tree("C.")])
            >>> doc.tokens, doc.span[:2].tolist()   # spans stay offsets into each text
            (['A', 'b', '.', 'C', '.'], [[-1, -1], [0, 4]])
        """
        children = _tree_list(children, "join", "child tree", "child", batches=True)
        for i, child in enumerate(children):
            if child.structure.num_trees != 1:
                raise ValueError(f"child {i} is a forest of {child.structure.num_trees} "
                                 "trees; join takes single-rooted trees")
        code = _geometry_code(geometry, "the joined root")
        if code == LEAF:
            raise ValueError("the joined root has children, so its geometry cannot be the "
                             "leaf code -1")
        geometry = GEOMETRIES[code]  # an integer code names the same geometry
        if keys is not None:
            keys = _one_per_child(keys, "keys", "str", len(children))
            bad = [i for i, k in enumerate(keys) if not isinstance(k, str)]
            if bad:
                raise TypeError(f"key {bad[0]} is a {type(keys[bad[0]]).__name__} "
                                f"({keys[bad[0]]!r:.40}); keys are str")
        if geometry == "keyvalue" and keys is None:
            raise ValueError("a keyvalue root needs one key per child (keys=...)")
        if positions is not None:
            positions = _one_per_child(positions, "positions", "position", len(children))
        if geometry == "grid" and positions is None:
            raise ValueError("a grid root needs (row, col) positions for its children")
        if sibling_edges is not None:
            sibling_edges = _edge_pairs(sibling_edges, "sibling_edges")
            if geometry != "graph" and sibling_edges:
                raise ValueError(f"sibling_edges were given but the joined root's geometry is "
                                 f"{geometry!r}, not 'graph'")
        root_tag = None if modality is None else _modality_arg(modality, "modality")
        has_x = [child.get("x") is not None for child in children]
        if any(has_x) and not all(has_x):
            raise ValueError(f"child {has_x.index(False)} has no x while others do")
        if all(has_x):
            first = children[0].x
            for i, child in enumerate(children):
                if child.x.shape[1:] != first.shape[1:] or child.x.dtype != first.dtype:
                    raise ValueError(
                        f"child {i} has x of shape {tuple(child.x.shape)} ({child.x.dtype}); "
                        f"child 0 has {tuple(first.shape)} ({first.dtype})")

        offsets = [1]
        for child in children[:-1]:
            offsets.append(offsets[-1] + child.num_nodes)
        parents, geometries, position_rows, modalities, key_list, sib = [], [], [], [], [], []
        root_position = torch.full((1, 2), -1, dtype=torch.long)
        for i, (child, offset) in enumerate(zip(children, offsets)):
            parent = child.parent.cpu()
            parents.append(torch.where(parent >= 0, parent + offset, 0))
            geometries.append(child.geometry.cpu())
            rows = child.position.cpu().clone()
            root = int((parent < 0).nonzero()[0])
            if positions is not None:
                rows[root] = torch.as_tensor(_position_pair(positions[i], f"child {i}"))
            else:
                rows[root] = torch.tensor([i, 0])
            position_rows.append(rows)
            modalities.append(child.modality.cpu())
            child_keys = list(child.key)
            child_keys[root] = None if keys is None else keys[i]
            key_list.extend(child_keys)
            sib.append(child.sibling_edge_index.cpu() + offset)
        root_modality = torch.tensor([0 if root_tag is None else root_tag])
        parent = torch.cat([torch.tensor([-1])] + parents)
        code = torch.tensor([_CODE[geometry]])
        root_ids = torch.tensor(offsets) + torch.cat(
            [(c.parent.cpu() < 0).nonzero()[0] for c in children])
        for i, j in (sibling_edges or []):
            if not (0 <= i < len(children) and 0 <= j < len(children)):
                raise ValueError(f"graph edge ({i}, {j}) is out of range "
                                 f"({len(children)} children)")
            sib.append(torch.stack([root_ids[i], root_ids[j]]).view(2, 1))
        x = torch.cat([child.x for child in children]) if all(has_x) else None
        return cls.from_parents(
            parent, x, geometry=torch.cat([code] + geometries),
            position=torch.cat([root_position] + position_rows),
            modality=torch.cat([root_modality] + modalities),
            key=[None] + key_list,
            sibling_edge_index=torch.cat(sib, 1) if sib else None,
            **_joined_extras(children))


class _StructureCache:
    """The structures built for one ``edge_index`` tensor, per device.

    It holds the tensor weakly (the cache never keeps a replaced ``edge_index``
    alive) and is dropped by ``copy.deepcopy`` and ``pickle`` (the copy rebuilds its
    own), since a weak reference cannot travel."""

    __slots__ = ("ref", "ptr", "version", "shape", "num_nodes", "by_device")

    def __init__(self, edge_index: Tensor, num_nodes: Optional[int]):
        self.ref = weakref.ref(edge_index)
        self.ptr = edge_index.data_ptr()
        self.version = edge_index._version
        self.shape = tuple(edge_index.shape)
        self.num_nodes = num_nodes
        self.by_device: Dict[torch.device, TreeStructure] = {}

    def matches(self, edge_index: Tensor, num_nodes: Optional[int]) -> bool:
        return (self.ref() is edge_index and self.ptr == edge_index.data_ptr()
                and self.version == edge_index._version
                and self.shape == tuple(edge_index.shape) and self.num_nodes == num_nodes)

    def __reduce__(self):
        return (_no_cache, ())

    def __deepcopy__(self, memo: dict) -> None:
        return None


def _no_cache() -> None:
    """What a pickled structure cache loads as: nothing (the tree rebuilds it)."""
    return None


_RESERVED: Optional[frozenset] = None


def _check_attr_names(attrs: Dict[str, Any]) -> None:
    """Refuse extra attribute names that would shadow or break the tree: methods and
    read-only properties of ``NestedSignal`` and ``Batch`` (``parent``, ``structure``,
    ``to``...), the stored core fields, PyG's batch vectors, and private names."""
    global _RESERVED
    if _RESERVED is None:
        import inspect
        names = set(dir(NestedSignal)) | set(dir(Batch))
        settable = {n for n in names
                    if isinstance(inspect.getattr_static(NestedSignal, n, None), property)
                    and inspect.getattr_static(NestedSignal, n).fset is not None}
        _RESERVED = frozenset((names - settable) | _CORE_ATTRS | {"batch", "ptr", "parent"})
    for name in attrs:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"attribute name {name!r:.60} is not a public identifier; extra "
                             "attributes need names like 'tokens' or 'span'")
        if name in _RESERVED:
            raise ValueError(f"attribute name {name!r} is reserved (a field, method or "
                             "property of NestedSignal or of a PyG Batch): storing it would "
                             "break the tree; rename it")


def _tree_problem(tree: NestedSignal) -> str:
    """What makes ``tree`` not a valid nested signal ('' when nothing does)."""
    m = tree.num_nodes
    edge_index = tree.get("edge_index")
    if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
        return "edge_index must be a [2, E] tensor of parent -> child edges"
    if edge_index.is_floating_point() or edge_index.is_complex() or \
            edge_index.dtype == torch.bool:
        return f"edge_index must hold integers, got dtype {edge_index.dtype}"
    if edge_index.numel() and bool(((edge_index < 0) | (edge_index >= m)).any()):
        return f"edge_index has nodes outside [0, {m - 1}]"
    edge_index = edge_index.long()
    children = edge_index[1]
    if children.numel():
        seen = torch.bincount(children, minlength=m)
        if int(seen.max()) > 1:
            u = int((seen > 1).nonzero()[0])
            return f"node {u} has {int(seen[u])} parents in edge_index"
    try:
        TreeStructure.from_parent(tree.parent)  # ranges and cycles, naming the node
    except ValueError as error:
        return str(error)
    for name, shape in (("geometry", (m,)), ("modality", (m,)), ("position", (m, 2))):
        value = tree.get(name)
        if not isinstance(value, Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            return f"{name} must have shape {list(shape)}, got {got}"
    has_child = torch.zeros(m, dtype=torch.bool, device=edge_index.device)
    has_child[edge_index[0]] = True
    wrong = has_child == (tree.geometry == LEAF)
    if bool(wrong.any()):
        u = int(wrong.nonzero()[0])
        return (f"node {u} {'has children' if bool(has_child[u]) else 'is a leaf'} but its "
                f"geometry code is {int(tree.geometry[u])}")
    x = tree.get("x")
    n = int((~has_child).sum())
    if x is not None and (not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != n):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        return f"x must have one row per leaf ({n}), got {got}"
    key = tree.get("key")
    if key and isinstance(key[0], (list, tuple)):  # a Batch: one list per tree
        key = [k for per_tree in key for k in per_tree]
    if key is not None and len(key) != m:
        return f"key must have one entry per node ({m}), got {len(key)}"
    return ""


def collate(trees: Sequence[NestedSignal]) -> Batch:
    """Batch nested signals like ``Batch.from_data_list``, after checking that they
    can share a batch; use it as a ``DataLoader``'s ``collate_fn``.

    PyG's collate needs every tree to carry the same attributes, with tensors of the
    same rank and trailing shape; otherwise torch reports a bare "Tensors must have
    same number of dimensions" or a ``KeyError``. Here the first mismatch is named
    instead, with the two trees. Token-id trees (``text_tree``: ``x`` ``[N]``) and
    vector trees (``image_tree``: ``x`` ``[N, F]``) do not mix: embed the text to the
    image's width (``text_tree(..., embed=...)``) and drop the extras the other tree
    lacks, or compose the trees into one with :meth:`NestedSignal.join` or
    :func:`~hsa_graph.builders.document_tree`.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> trees = [NestedSignal.from_nested([[1, 2], [3]]), NestedSignal.from_nested([4, 5])]
        >>> next(iter(DataLoader(trees, batch_size=2, collate_fn=collate))).num_graphs
        2

    Args:
        trees: the trees (at least one).

    Returns:
        The :class:`~torch_geometric.data.Batch`.

    Raises:
        TypeError: an item is not a :class:`NestedSignal`.
        ValueError: the list is empty, or two trees cannot share a batch (naming both,
            the attribute and how they differ).
    """
    trees = _tree_list(trees, "collate", "tree", "item", batches=False)
    first = trees[0]
    names = set(first.keys())
    for i, tree in enumerate(trees[1:], 1):
        other = set(tree.keys())
        if other != names:
            side = (f"tree 0 has {sorted(names - other)}, which tree {i} lacks"
                    if names - other else f"tree {i} has {sorted(other - names)}, which "
                    "tree 0 lacks")
            raise ValueError(f"trees 0 and {i} cannot share a batch: {side} (PyG batches "
                             "only trees with the same attributes: delete the extras, or "
                             "join the trees into one)")
        for name in sorted(names):
            problem = _batch_mismatch(first, name, first[name], tree[name])
            if problem:
                hint = (" (token ids [N] and feature vectors [N, F] do not mix: embed the "
                        "text to the other tree's width, or join the trees into one)"
                        if name == "x" else "")
                raise ValueError(f"trees 0 and {i} cannot share a batch: {name!r} is "
                                 f"{_describe(first[name])} in tree 0 and "
                                 f"{_describe(tree[name])} in tree {i}{hint}")
    return Batch.from_data_list(trees)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {list(value.shape)} {str(value.dtype).replace('torch.', '')} tensor"
    return f"a {type(value).__name__}"


def _batch_mismatch(first: NestedSignal, name: str, a: Any, b: Any) -> bool:
    """Whether PyG cannot concatenate ``a`` and ``b`` (attribute ``name``)."""
    if isinstance(a, Tensor) != isinstance(b, Tensor):
        return True
    if not isinstance(a, Tensor):
        return False
    if name == "x" and a.is_floating_point() != b.is_floating_point():
        return True  # torch would silently promote token ids to floats
    cat = first.__cat_dim__(name, a)
    if cat is None:
        return a.shape != b.shape
    if a.dim() != b.dim():
        return True
    cat = cat % max(a.dim(), 1)
    return any(a.shape[d] != b.shape[d] for d in range(a.dim()) if d != cat)


#: Attributes every NestedSignal has; :meth:`NestedSignal.join` rebuilds these itself.
_CORE_ATTRS = frozenset({"x", "edge_index", "geometry", "position", "modality", "key",
                         "sibling_edge_index", "num_nodes"})


def _joined_extras(children: List[NestedSignal]) -> Dict[str, Any]:
    """The builder attributes (``tokens``, ``span``...) of ``children`` laid out for
    the tree :meth:`NestedSignal.join` builds (its new root is node 0)."""
    names = set(children[0].keys()) - _CORE_ATTRS
    for child in children[1:]:
        names &= set(child.keys())
    out: Dict[str, Any] = {}
    for name in sorted(names):
        values = [child[name] for child in children]
        is_tensor = all(isinstance(v, Tensor) and v.dim() >= 1 for v in values)
        is_list = all(isinstance(v, list) for v in values)
        if not (is_tensor or is_list):
            continue
        if is_tensor and any(v.shape[1:] != values[0].shape[1:] or v.dtype != values[0].dtype
                             for v in values):
            continue
        sizes = [len(v) for v in values]
        per_node = sizes == [c.num_nodes for c in children]
        per_leaf = sizes == [c.num_leaves for c in children]
        if per_node and per_leaf:  # single-node children: see join's docstring
            per_node = is_tensor
        if per_node and is_tensor:
            first = values[0]
            fill = 0 if first.is_floating_point() or first.dtype == torch.bool else -1
            root = torch.full((1, *first.shape[1:]), fill, dtype=first.dtype,
                              device=first.device)
            out[name] = torch.cat([root] + [v.to(first.device) for v in values])
        elif per_node:
            out[name] = [None] + [item for v in values for item in v]
        elif per_leaf and is_tensor:
            out[name] = torch.cat([v.to(values[0].device) for v in values])
        elif per_leaf:
            out[name] = [item for v in values for item in v]
    return out


@dataclass
class Node:
    """An explicit node for :meth:`NestedSignal.from_nested`.

    Args:
        children: the items (a list, or a dict for ``keyvalue``), or, for
            ``grid``, a list of rows (each a list of items).
        geometry: one of :data:`GEOMETRIES`.
        modality: optional integer tag for this node and its subtree.
        edges: for ``graph``: pairs ``(i, j)`` of child indices.
    """

    children: Any
    geometry: str = "sequence"
    modality: Optional[int] = None
    edges: Sequence = field(default_factory=list)


class _NestedBuilder:
    """Walks nested Python data iteratively (no recursion limit).

    Memory is linear in the number of nodes whatever the depth: each node stores only
    its own step below its parent (``[2]``, ``[0][1]``, ``.name``), and the full path
    (``root[0].title[2]``) is rebuilt by walking up only when an error names it."""

    def __init__(self, modality: Optional[int]):
        self.parent: List[int] = []
        self.step: List[str] = []
        self.geometry: List[Optional[str]] = []
        self.position: List[tuple] = []
        self.key: List[Optional[str]] = []
        self.modality: List[int] = []
        self.leaves: List[Any] = []
        self.leaf_nodes: List[int] = []
        self.sibling_edges: List[tuple] = []
        self.root_modality = None if modality is None else _modality_arg(modality, "modality")

    def path(self, u: int) -> str:
        """The path of node ``u`` from the root, e.g. ``root[0].title``."""
        steps = []
        while u >= 0:
            steps.append(self.step[u])
            u = self.parent[u]
        return "".join(reversed(steps))

    def walk(self, data: Any) -> None:
        stack: List[Any] = [(data, -1, (-1, -1), None, self.root_modality, "root")]
        # ids of the containers on the current path: a container met again inside
        # itself is a cycle (shared, acyclic sub-objects are fine and are copied).
        open_ids: set = set()
        while stack:
            entry = stack.pop()
            if len(entry) == 1:  # the end of a container's subtree
                open_ids.discard(entry[0])
                continue
            item, parent, pos, key, modality, step = entry
            u = len(self.parent)
            self.parent.append(parent)
            self.step.append(step)
            self.position.append(pos)
            self.key.append(key)
            if isinstance(item, (list, tuple, dict, Node)):
                if id(item) in open_ids:
                    raise ValueError(f"cycle at {self.path(u)}: this {type(item).__name__} "
                                     "contains itself, so the data is not a tree")
                open_ids.add(id(item))
                stack.append((id(item),))
            geometry, modality, children = self._expand(item, modality, u)
            self.modality.append(-1 if modality is None else modality)
            self.geometry.append(geometry)
            if geometry is None:
                self.leaves.append(item)
                self.leaf_nodes.append(u)
            # push in reverse so that children get increasing node indices in order
            for child, child_pos, child_key, child_step in reversed(children):
                stack.append((child, u, child_pos, child_key, modality, child_step))

    def _items(self, children: Any, what: str, u: int) -> list:
        if isinstance(children, (str, bytes)) or not isinstance(children, Iterable):
            raise TypeError(f"{what} at {self.path(u)} must be a list, got the "
                            f"{type(children).__name__} {children!r:.40}")
        return list(children)

    def _expand(self, item: Any, modality: Optional[int], u: int):
        if isinstance(item, Node):
            if item.modality is not None:
                modality = _modality_arg(item.modality, f"the Node modality at {self.path(u)}")
            geometry = item.geometry
            if not isinstance(geometry, str) or geometry not in _CODE:
                raise ValueError(f"unknown geometry {geometry!r:.40} at {self.path(u)}; a Node "
                                 f"takes one of {GEOMETRIES} by name")
            edges = item.edges
            if geometry != "graph" and edges is not None and (
                    isinstance(edges, (str, bytes, Tensor, np.ndarray))
                    or not isinstance(edges, Iterable) or len(list(edges))):
                raise ValueError(f"edges were given for the {geometry!r} Node at "
                                 f"{self.path(u)}; only 'graph' nodes have sibling edges")
            if geometry == "grid":
                rows = self._items(item.children, "the rows of a grid Node", u)
                children = [(c, (r, col), None, f"[{r}][{col}]")
                            for r, row in enumerate(rows)
                            for col, c in enumerate(self._items(row, f"row {r}", u))]
            elif geometry == "keyvalue":
                if not isinstance(item.children, dict):
                    raise ValueError(f"a keyvalue Node needs a dict at {self.path(u)}")
                children = [(c, (i, 0), str(name), f".{name}")
                            for i, (name, c) in enumerate(item.children.items())]
            else:
                children = [(c, (i, 0), None, f"[{i}]")
                            for i, c in enumerate(self._items(item.children, "the children "
                                                              "of a Node", u))]
                if geometry == "graph":  # child indices become node ids in build()
                    pairs = _edge_pairs(edges, f"the graph Node at {self.path(u)}")
                    self.sibling_edges.extend((u, i, j) for i, j in pairs)
        elif isinstance(item, dict):
            geometry = "keyvalue"
            children = [(c, (i, 0), str(name), f".{name}")
                        for i, (name, c) in enumerate(item.items())]
        elif isinstance(item, (list, tuple)):
            geometry = "sequence"
            children = [(c, (i, 0), None, f"[{i}]") for i, c in enumerate(item)]
        elif isinstance(item, (Tensor, np.ndarray, int, np.integer)) and not isinstance(item, bool):
            return None, modality, []
        else:
            raise TypeError(f"cannot make a leaf or a node from {type(item).__name__} at "
                            f"{self.path(u)}; use a list, dict, Node, int token id or 1-D "
                            "vector")
        if not children:
            raise ValueError(f"empty {geometry} at {self.path(u)}: an internal node needs "
                             "children")
        return geometry, modality, children

    def build(self, cls) -> NestedSignal:
        x = _stack_leaves(self.leaves, _LazyPaths(self))
        modality = None
        if any(t >= 0 for t in self.modality):
            # nodes above the first tagged Node have no tag: they get 0
            modality = [max(t, 0) for t in self.modality]
        sibling_edge_index = None
        if self.sibling_edges:
            kids: Dict[int, List[int]] = {}
            for child, pa in enumerate(self.parent):
                kids.setdefault(pa, []).append(child)
            pairs = []
            for u, i, j in self.sibling_edges:
                family = kids[u]
                if not (0 <= i < len(family) and 0 <= j < len(family)):
                    raise ValueError(f"graph edge ({i}, {j}) of node {u} at {self.path(u)} is "
                                     f"out of range ({len(family)} children)")
                pairs.append((family[i], family[j]))
            sibling_edge_index = torch.tensor(pairs, dtype=torch.long).t()
        key = self.key if any(k is not None for k in self.key) else None
        return cls.from_parents(self.parent, x, geometry=self.geometry,
                                position=self.position, modality=modality, key=key,
                                sibling_edge_index=sibling_edge_index)


class _LazyPaths:
    """The paths of a builder's leaves, each built only when an error names it."""

    def __init__(self, builder: _NestedBuilder):
        self.builder = builder

    def __len__(self) -> int:
        return len(self.builder.leaf_nodes)

    def __getitem__(self, i: int) -> str:
        return self.builder.path(self.builder.leaf_nodes[i])


def flatten(tree: NestedSignal) -> NestedSignal:
    """The one-level forest over the same leaves: each tree becomes a root (a
    ``sequence``) whose children are its leaves, in order; leaf features, modality and
    any per-leaf attribute are kept. The paper's flat self-attention baseline:
    ``hsa(q, k, v, flatten(tree))`` is standard softmax attention per tree."""
    st = tree.structure
    t = st.num_trees
    device = tree.edge_index.device
    parent = torch.cat([torch.full((t,), -1, dtype=torch.long, device=device),
                        st.leaf_tree])
    # Roots first, then the leaves in their row order.
    modality = torch.cat([torch.zeros(t, dtype=torch.long, device=device),
                          tree.modality[tree.leaf_index]])
    return NestedSignal.from_parents(parent, tree.get("x"), geometry="sequence",
                                     modality=modality)


def _depth_first_by_position(labels: List[Any], parent: List[int], attrs: Any,
                             position: str) -> List[Any]:
    """Labels in depth-first pre-order, siblings sorted by their position attribute
    (iterative: no recursion limit on deep trees)."""
    children: Dict[int, List[int]] = {}
    for u, p in enumerate(parent):
        children.setdefault(p, []).append(u)

    def sort_key(u: int):
        value = attrs[labels[u]].get(position)
        if value is None:
            return (1, (), u)
        return (0, _position_pair(value, labels[u]), u)

    ordered: List[Any] = []
    stack = sorted(children.get(-1, []), key=sort_key, reverse=True)
    while stack:
        u = stack.pop()
        ordered.append(labels[u])
        stack.extend(sorted(children.get(u, []), key=sort_key, reverse=True))
    if len(ordered) != len(labels):
        # nodes unreachable from a root lie on a cycle: from_parents names one
        return labels
    return ordered


# ------------------------------------------------------------------- helpers
_UNSIGNED_64 = tuple(d for d in (getattr(torch, "uint64", None),) if d is not None)


def _as_long_tensor(value: Any, name: str) -> Tensor:
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        out = value.long()
        unsigned = value.dtype in _UNSIGNED_64
    else:
        if isinstance(value, (str, bytes)):
            raise TypeError(f"{name} must be a sequence of integers, got the "
                            f"{type(value).__name__} {value!r:.40}")
        try:
            array = np.asarray(value)
        except Exception as error:  # ragged lists and the like
            raise TypeError(f"{name} must be a sequence of integers: {error}") from None
        if array.dtype == object or not (np.issubdtype(array.dtype, np.integer)
                                         or array.size == 0):
            raise TypeError(f"{name} must be a sequence of integers, got {array.dtype}")
        unsigned = array.dtype == np.uint64
        out = torch.as_tensor(array.astype(np.int64))
    if unsigned and out.numel() and bool((out < 0).any()):
        # int64 wraps unsigned values >= 2**63 to negatives: -1 would become a root
        flat = int((out.reshape(-1) < 0).nonzero()[0])
        raise ValueError(f"{name} holds the unsigned value "
                         f"{int(out.reshape(-1)[flat]) + 2 ** 64} at flat index {flat}, "
                         "beyond the int64 range")
    return out


def _as_features(x: Any) -> Tensor:
    """Leaf features as a tensor, or a TypeError saying what ``x`` was."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"x must be a tensor of leaf features or token ids, got the "
                        f"{type(x).__name__} {x!r:.40}")
    try:
        x = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as error:  # objects, ragged lists
        raise TypeError(f"x must be a tensor of leaf features or token ids (or convertible "
                        f"to one), got a {type(x).__name__}: {error}") from None
    return x


def _geometry_codes(geometry: Any, is_leaf: Tensor) -> Tensor:
    m = is_leaf.numel()
    if isinstance(geometry, str):
        code = _geometry_code(geometry, "geometry")
        return torch.where(is_leaf, LEAF, code).long()
    if isinstance(geometry, np.ndarray) and geometry.dtype != object:
        geometry = _as_long_tensor(geometry, "geometry")
    elif not isinstance(geometry, (Tensor, Iterable)) or isinstance(geometry, bytes):
        raise TypeError(f"geometry must be a name, a sequence of names (None for leaves) or "
                        f"integer codes, got the {type(geometry).__name__} {geometry!r:.40}")
    if isinstance(geometry, Tensor):
        if geometry.is_floating_point() or geometry.is_complex() or geometry.dtype == torch.bool:
            raise TypeError(f"geometry codes must be integers, got dtype {geometry.dtype}")
        codes = geometry.long()
    else:
        geometry = list(geometry)
        if len(geometry) != m:
            raise ValueError(f"geometry must have one entry per node ({m}), got {len(geometry)}")
        codes = torch.tensor([LEAF if g is None else _geometry_code(g, f"node {u}")
                              for u, g in enumerate(geometry)], dtype=torch.long)
    if codes.shape != (m,):
        raise ValueError(f"geometry must have shape [{m}], got {tuple(codes.shape)}")
    codes = codes.to(is_leaf.device)
    out_of_range = (codes < LEAF) | (codes >= len(GEOMETRIES))
    if bool(out_of_range.any()):
        u = int(out_of_range.nonzero()[0])
        raise ValueError(f"node {u} has geometry code {int(codes[u])}; codes lie in "
                         f"[-1, {len(GEOMETRIES) - 1}] (-1 = leaf, else an index into "
                         f"{GEOMETRIES})")
    missing = ~is_leaf & (codes == LEAF)
    if bool(missing.any()):
        u = int(missing.nonzero()[0])
        raise ValueError(f"internal node {u} has no geometry (one of {GEOMETRIES} is needed)")
    misplaced = is_leaf & (codes != LEAF)
    if bool(misplaced.any()):
        u = int(misplaced.nonzero()[0])
        raise ValueError(f"node {u} is a leaf (it has no children) but has geometry "
                         f"{GEOMETRIES[int(codes[u])]!r}")
    return codes


def _positions(position: Any, parent: Tensor, geometry: Tensor, children: Tensor,
               m: int, device) -> Tensor:
    parent_geometry = torch.where(parent >= 0, geometry[parent.clamp_min(0)], LEAF)
    if position is None:
        grid_children = parent_geometry == _CODE["grid"]
        if bool(grid_children.any()):
            u = int(grid_children.nonzero()[0])
            raise ValueError(f"node {int(parent[u])} has geometry 'grid' but no (row, col) "
                             f"positions were given for its children (e.g. node {u})")
        # index among siblings, in node order (children are sorted by parent, stable)
        out = torch.full((m, 2), -1, dtype=torch.long, device=device)
        if children.numel():
            fam = parent[children]
            first = torch.ones_like(fam, dtype=torch.bool)
            first[1:] = fam[1:] != fam[:-1]
            idx = torch.arange(fam.numel(), device=device)
            start = torch.cummax(torch.where(first, idx, 0), 0).values
            out[children, 0] = idx - start
            out[children, 1] = 0
        return out
    if not isinstance(position, (Tensor, np.ndarray)):
        if isinstance(position, (str, bytes)) or not isinstance(position, Iterable):
            raise TypeError(f"position must be a sequence of ints or (row, col) pairs, got the "
                            f"{type(position).__name__} {position!r:.40}")
        position = [(-1, -1) if p is None else p for p in position]
    out = _as_long_tensor(position, "position").to(device)
    if out.dim() == 1:
        out = torch.stack([out, torch.where(out < 0, -1, 0)], 1)  # roots: (-1, -1)
    if out.shape != (m, 2):
        raise ValueError(f"position must have shape [{m}] or [{m}, 2], got {tuple(out.shape)}")
    return out


def _position_pair(value: Any, label: Any) -> tuple:
    if value is None:
        return (-1, -1)
    if _is_int(value):
        return (int(value), 0)
    if isinstance(value, Tensor) and not value.is_floating_point() and value.dim() <= 1:
        value = value.tolist()  # a 0-d tensor gives an int, a 1-d one a list
        if isinstance(value, int):
            return (value, 0)
    try:
        pair = tuple(value)
    except TypeError:
        pair = None
    if pair is None or not all(_is_int(v) for v in pair):
        # floats (2.7, inf) are refused, not truncated
        raise ValueError(f"node {label!r}: position must be an int or an (int, int) pair, "
                         f"got {value!r:.60}")
    pair = tuple(int(v) for v in pair)
    if len(pair) == 1:
        pair = (pair[0], 0)
    if len(pair) != 2:
        raise ValueError(f"node {label!r}: position must have at most 2 entries, got {value!r}")
    return pair


def _stack_leaves(values: List[Any], where: Sequence[Any]) -> Optional[Tensor]:
    """The leaves as ``x``; ``where[i]`` names leaf ``i`` in errors (it is only
    indexed on error, so it may be built lazily)."""
    if not values:
        return None
    if all(_is_int(v) for v in values):
        ids = [int(v) for v in values]
        big = [i for i, v in enumerate(ids) if not -2 ** 63 <= v < 2 ** 63]
        if big:
            raise ValueError(f"leaf at {where[big[0]]} is the int {ids[big[0]]}, outside the "
                             "int64 range of token ids")
        return torch.tensor(ids, dtype=torch.long)
    if all(isinstance(v, Tensor) and v.dim() == 0 for v in values):  # scalars / token ids
        return torch.stack(values)
    tensors = []
    for i, v in enumerate(values):
        if _is_int(v):
            raise ValueError(f"leaf at {where[i]} is a token id but other leaves are vectors")
        try:
            t = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError) as error:  # object arrays
            raise TypeError(f"leaf at {where[i]} is not a numeric vector: {error}") from None
        if t.dim() == 0:
            t = t.reshape(1)
        if t.dim() != 1:
            raise ValueError(f"leaf at {where[i]} must be a 1-D vector, got shape "
                             f"{tuple(t.shape)}")
        tensors.append(t)
    first = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != first:
            raise ValueError(f"leaf at {where[i]} has {t.shape[0]} features, the first leaf "
                             f"has {first[0]}")
    return torch.stack(tensors)


def _check_sibling_edges(edges: Tensor, parent: Tensor, geometry: Tensor) -> Tensor:
    edges = _as_long_tensor(edges, "sibling_edge_index")
    if edges.dim() != 2 or edges.shape[0] != 2:
        raise ValueError(f"sibling_edge_index must have shape [2, E], got {tuple(edges.shape)}")
    m = parent.numel()
    if edges.numel() and bool(((edges < 0) | (edges >= m)).any()):
        raise ValueError(f"sibling_edge_index has nodes outside [0, {m - 1}]")
    pa, pb = parent[edges[0]], parent[edges[1]]
    bad = (pa != pb) | (pa < 0)
    if bool(bad.any()):
        e = int(bad.nonzero()[0])
        raise ValueError(f"sibling edge ({int(edges[0, e])}, {int(edges[1, e])}) joins nodes "
                         "that are not siblings")
    not_graph = geometry[pa] != _CODE["graph"]
    if bool(not_graph.any()):
        e = int(not_graph.nonzero()[0])
        raise ValueError(f"sibling edge ({int(edges[0, e])}, {int(edges[1, e])}) is under node "
                         f"{int(pa[e])}, whose geometry is not 'graph'")
    return edges


def _one_per_child(values, name: str, what: str, count: int) -> list:
    """``values`` as a list of one entry per child (``keys``, ``positions`` of ``join``),
    or a ``TypeError`` / ``ValueError`` that names the argument."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of one {what} per child, got the "
                        f"{type(values).__name__} {values!r:.40}")
    values = list(values)
    if len(values) != count:
        raise ValueError(f"{name} must have one entry per child ({count}), got "
                         f"{len(values)}")
    return values


def _tree_list(values, who: str, noun: str, item: str, batches: bool) -> list:
    """``values`` as a non-empty list of trees for ``join`` / ``collate``, or a
    ``TypeError`` / ``ValueError`` naming the offending item (``batches``: whether a PyG
    ``Batch`` of trees counts as a tree)."""
    if isinstance(values, NestedSignal) or not isinstance(values, Iterable):
        raise TypeError(f"{who} takes a sequence of NestedSignal trees, got the "
                        f"{type(values).__name__}")
    values = list(values)
    if not values:
        raise ValueError(f"{who} needs at least one {noun}")
    for i, value in enumerate(values):
        if not isinstance(value, NestedSignal):
            raise TypeError(f"{item} {i} is a {type(value).__name__}, not a NestedSignal")
        if not batches and isinstance(value, Batch):
            raise TypeError(f"{item} {i} is a {type(value).__name__}, not a NestedSignal tree")
    return values
