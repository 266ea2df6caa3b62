r"""Mixed documents: nested fields of text, images, lists and sets as one nested signal.

:func:`document_tree` turns nested Python data such as a news article::

    {"headline": str, "abstract": str, "image": H x W x C array, "caption": str,
     "body": [paragraph, paragraph, ...]}

into one tree, as in the paper's multi-modal N24News experiment (section 5.2):

========================================  =============================================
value                                     becomes
========================================  =============================================
``dict`` (any ``Mapping``)                a ``keyvalue`` node; each field at position
                                          ``i`` (insertion order) with ``key`` = name
``list`` / ``tuple``                      a ``sequence`` node
``set`` / ``frozenset``                   a ``set`` node (members sorted, see below)
:class:`~hsa_graph.Node`                  a node of that geometry (``grid``: a list of
                                          rows; ``graph``: ``edges`` between children)
``str``                                   the tree of the ``text`` builder
image: numpy / torch ``[H, W(, C)]``,     the tree of the ``image`` builder
PIL image
:class:`~hsa_graph.NestedSignal`          inserted as it is (a precomputed subtree)
========================================  =============================================

Values nest to any depth; the walk uses an explicit stack (10,000 levels are fine).

**Leaf widths.** All leaves of one tree share one feature width and dtype, so the
builders of the different modalities must end at the same width: pass per-modality
callables, e.g. ``text=lambda s: text_tree(s, embed=token_embedding)`` and
``image=lambda a: image_tree(a, embed=patch_projection)`` both giving ``[n, D]``
vectors. Mismatched widths raise ``ValueError`` naming the two fields.

**Modality tags.** ``text_modality`` (default 0) and ``image_modality`` (default 1)
overwrite the tags of every node the text / image builder returns (``None`` keeps the
builder's tags); a ``Node(..., modality=t)`` tags its node and everything under it; a
precomputed ``NestedSignal`` keeps its tags; any other container takes the tag its
children share, or ``mixed_modality`` (default 0) when they differ.

**Edge cases.** Field names must be ``str`` (``TypeError`` otherwise: ``str()``-ing
them could silently merge ``1`` and ``"1"``). Empty dicts, lists, sets and ``Node``
children raise ``ValueError``; values of any other type (``None``, numbers, bytes...)
raise ``TypeError``; both name the path of the field, e.g. ``root.body[2]``; so does
the ``ValueError`` for a container that contains itself (a cycle). Errors
raised by the text or image builder are re-raised with the field path in front.
Attributes a builder stores beyond the standard ``NestedSignal`` fields (e.g. the text
builder's ``tokens`` and ``span``) are not carried into a composed document.
Set members are sorted (``sorted()``, or by ``(type name, repr)`` when they do not
compare) so that leaf rows are reproducible; HSA does not depend on their order.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..signal import GEOMETRIES, NestedSignal, Node

__all__ = ["document_tree"]

_CODE = {name: code for code, name in enumerate(GEOMETRIES)}

#: a field path, kept as a linked chain (parent chain, segment) so that deep
#: documents do not build O(depth^2) strings; rendered only for error messages
_Path = Optional[Tuple[Any, str]]


def _render(path: _Path) -> str:
    parts = []
    while path is not None:
        path, segment = path
        parts.append(segment)
    return "root" + "".join(reversed(parts))


def _field_segment(name: str) -> str:
    return f".{name}" if name.isidentifier() else f"[{name!r}]"


def _default_text_builder() -> Callable[[str], NestedSignal]:
    try:
        from .text import text_tree  # lazy: only documents with text need it
    except ImportError as error:
        raise RuntimeError(
            "no default text builder (hsa_graph.builders.text.text_tree could not be "
            f"imported: {error}); pass text=<callable str -> NestedSignal>") from error
    return text_tree


def _default_image_builder() -> Callable[[Any], NestedSignal]:
    from .image import image_tree
    return image_tree


def _is_image(value: Any) -> bool:
    return (isinstance(value, (np.ndarray, Tensor))
            or (type(value).__module__.startswith("PIL.") and hasattr(value, "convert")))


def _sorted_members(members: Any) -> List[Any]:
    try:
        return sorted(members)
    except TypeError:  # members that do not compare (mixed types)
        return sorted(members, key=lambda v: (type(v).__name__, repr(v)))


class _Document:
    """Walks the document with an explicit stack; the containers ("skeleton" nodes)
    are recorded one by one (this is the parsing), the text and image subtrees
    ("components") are spliced in with tensor ops, one set per component."""

    def __init__(self, text, image, text_modality, image_modality, mixed_modality):
        self.text, self.image = text, image
        self.text_modality, self.image_modality = text_modality, image_modality
        self.mixed_modality = mixed_modality
        self.count = 0
        # skeleton nodes
        self.skel_id: List[int] = []
        self.skel_parent: List[int] = []
        self.skel_geometry: List[int] = []
        self.skel_position: List[Tuple[int, int]] = []
        self.skel_key: List[Optional[str]] = []
        self.skel_override: List[Optional[int]] = []
        self.child_modality: Dict[int, List[int]] = {}
        # components: (offset, tree, parent id, position, key, local root, path)
        self.components: List[tuple] = []
        self.graph_edges: List[Tuple[int, int, int, _Path]] = []
        self.children_ids: Dict[int, List[int]] = {}

    # ---------------------------------------------------------------- walking
    def walk(self, data: Any) -> None:
        stack: List[Any] = [(data, -1, (-1, -1), None, None, None)]
        # ids of the containers on the current path: meeting one again inside itself
        # is a cycle (shared, acyclic sub-objects are fine and are copied).
        open_ids: set = set()
        while stack:
            entry = stack.pop()
            if len(entry) == 1:  # the end of a container's subtree
                open_ids.discard(entry[0])
                continue
            value, parent, pos, key, override, path = entry
            if isinstance(value, (Node, Mapping, list, tuple)):
                if id(value) in open_ids:
                    raise ValueError(f"{_render(path)}: cycle: this {type(value).__name__} "
                                     "contains itself, so the document is not a tree")
                open_ids.add(id(value))
                stack.append((id(value),))
            node = self.count
            if parent in self.children_ids:  # a child of a graph node
                self.children_ids[parent].append(node)
            expanded = self._expand(value, path, node)
            if expanded is None:  # a component: a whole subtree
                tree = self._component(value, path, override)
                root = _root_of(tree)
                self.components.append((node, tree, parent, pos, key, root, path))
                self.count += tree.num_nodes
                if parent >= 0:
                    self.child_modality[parent].append(int(tree.modality[root]))
                continue
            geometry, children, own_tag = expanded
            if own_tag is not None:  # a Node's modality tags everything beneath it
                override = own_tag
            self.count += 1
            self.skel_id.append(node)
            self.skel_parent.append(parent)
            self.skel_geometry.append(_CODE[geometry])
            self.skel_position.append(pos)
            self.skel_key.append(key)
            self.skel_override.append(override)
            self.child_modality[node] = []
            if geometry == "graph":
                self.children_ids[node] = []
            # reversed: children are popped, and numbered, in document order
            for child, child_pos, child_key, segment in reversed(children):
                stack.append((child, node, child_pos, child_key, override, (path, segment)))

    def _expand(self, value: Any, path: _Path, node: int):
        """(geometry, children, modality override) of a container, or None for a
        component. Each child is (value, position, key, path segment)."""
        override = None
        if isinstance(value, Node):
            geometry, items, override = value.geometry, value.children, value.modality
            if geometry not in _CODE:
                raise ValueError(f"{_render(path)}: unknown geometry {geometry!r}; "
                                 f"expected one of {GEOMETRIES}")
            if override is not None and (isinstance(override, bool)
                                         or not isinstance(override, (int, np.integer))):
                raise TypeError(f"{_render(path)}: Node modality must be an int, got "
                                f"{override!r}")
            if override is not None and not 0 <= override < 2 ** 63:
                raise ValueError(f"{_render(path)}: Node modality must be >= 0 (an int64), "
                                 f"got {override!r:.40}")
            if list(value.edges) and geometry != "graph":
                raise ValueError(f"{_render(path)}: edges are only for graph nodes, this "
                                 f"Node is {geometry!r}")
            if geometry == "keyvalue":
                if not isinstance(items, Mapping):
                    raise TypeError(f"{_render(path)}: a keyvalue Node needs a dict, got "
                                    f"{type(items).__name__}")
                children = self._fields(items, path)
            elif geometry == "grid":
                children = []
                for r, row in enumerate(_as_list(items, path, "grid rows")):
                    row_path = (path, f"[{r}]")
                    children += [(c, (r, col), None, f"[{r}][{col}]")
                                 for col, c in enumerate(_as_list(row, row_path, "a grid row"))]
            else:
                if isinstance(items, (set, frozenset)):
                    items = _sorted_members(items)
                children = [(c, (i, 0), None, f"[{i}]")
                            for i, c in enumerate(_as_list(items, path, geometry))]
                if geometry == "graph":
                    for edge in value.edges:
                        try:
                            i, j = (int(e) for e in edge)
                        except (TypeError, ValueError):
                            raise ValueError(f"{_render(path)}: graph edge {edge!r} is not a "
                                             "pair of child indices") from None
                        if not (0 <= i < len(children) and 0 <= j < len(children)):
                            raise ValueError(f"{_render(path)}: graph edge ({i}, {j}) is out "
                                             f"of range ({len(children)} children)")
                        self.graph_edges.append((node, i, j, path))
        elif isinstance(value, Mapping):
            geometry, children = "keyvalue", self._fields(value, path)
        elif isinstance(value, (list, tuple)):
            geometry = "sequence"
            children = [(c, (i, 0), None, f"[{i}]") for i, c in enumerate(value)]
        elif isinstance(value, (set, frozenset)):
            geometry = "set"
            children = [(c, (i, 0), None, f"[{i}]")
                        for i, c in enumerate(_sorted_members(value))]
        elif isinstance(value, (str, NestedSignal)) or _is_image(value):
            return None
        else:
            raise TypeError(f"{_render(path)}: unsupported field value of type "
                            f"{type(value).__name__}; expected str (text), an image array, "
                            "dict, list, tuple, set, Node or NestedSignal")
        if not children:
            raise ValueError(f"{_render(path)}: empty {geometry} (a container needs at "
                             "least one item)")
        return geometry, children, override

    @staticmethod
    def _fields(items: Mapping, path: _Path) -> list:
        children = []
        for i, (name, child) in enumerate(items.items()):
            if not isinstance(name, str):
                raise TypeError(f"{_render(path)}: field names must be str, got "
                                f"{type(name).__name__} {name!r} (convert keys with str() "
                                "if that is what you mean)")
            children.append((child, (i, 0), name, _field_segment(name)))
        return children

    def _component(self, value: Any, path: _Path, override: Optional[int]) -> NestedSignal:
        if isinstance(value, NestedSignal):
            tree, tag = value, None
        else:
            is_text = isinstance(value, str)
            builder = self.text if is_text else self.image
            if builder is None:
                builder = _default_text_builder() if is_text else _default_image_builder()
                if is_text:
                    self.text = builder
                else:
                    self.image = builder
            tag = self.text_modality if is_text else self.image_modality
            kind = "text" if is_text else "image"
            try:
                tree = builder(value)
            except (ValueError, TypeError) as error:
                cls = ValueError if isinstance(error, ValueError) else TypeError
                raise cls(f"{_render(path)}: the {kind} builder failed: {error}") from error
            if not isinstance(tree, NestedSignal):
                raise TypeError(f"{_render(path)}: the {kind} builder returned a "
                                f"{type(tree).__name__}, not a NestedSignal")
        if tree.structure.num_trees != 1:
            raise ValueError(f"{_render(path)}: the subtree is a forest of "
                             f"{tree.structure.num_trees} trees; a field needs one tree")
        if override is not None:
            tag = override
        if tag is not None:
            tree = tree.clone()
            tree.modality = torch.full_like(tree.modality, int(tag))
        return tree

    # --------------------------------------------------------------- assembly
    def build(self) -> NestedSignal:
        if not self.skel_id:  # the document is a single text or image
            return self.components[0][1]
        self._infer_modality()
        m = self.count
        parent = torch.empty(m, dtype=torch.long)
        geometry = torch.empty(m, dtype=torch.long)
        position = torch.empty((m, 2), dtype=torch.long)
        modality = torch.empty(m, dtype=torch.long)
        key: List[Optional[str]] = [None] * m
        skel = torch.tensor(self.skel_id, dtype=torch.long)
        parent[skel] = torch.tensor(self.skel_parent, dtype=torch.long)
        geometry[skel] = torch.tensor(self.skel_geometry, dtype=torch.long)
        position[skel] = torch.tensor(self.skel_position, dtype=torch.long)
        modality[skel] = torch.tensor(self.skel_modality, dtype=torch.long)
        for u, k in zip(self.skel_id, self.skel_key):
            key[u] = k
        xs, sibling = [], []
        first_x = None
        for offset, tree, up, pos, name, root, path in self.components:
            span = slice(offset, offset + tree.num_nodes)
            local = tree.parent.cpu()
            parent[span] = torch.where(local >= 0, local + offset, up)
            geometry[span] = tree.geometry.cpu()
            position[span] = tree.position.cpu()
            position[offset + root] = torch.tensor(pos)
            modality[span] = tree.modality.cpu()
            key[span] = list(tree.key)
            key[offset + root] = name
            if tree.sibling_edge_index.numel():
                sibling.append(tree.sibling_edge_index.cpu() + offset)
            x = tree.get("x")
            if first_x is None:
                first_x = (x, path)
            elif (x is None) != (first_x[0] is None) or (
                    x is not None and (x.shape[1:] != first_x[0].shape[1:]
                                       or x.dtype != first_x[0].dtype)):
                raise ValueError(
                    f"{_render(path)} has leaf features {_describe(x)} but "
                    f"{_render(first_x[1])} has {_describe(first_x[0])}; all leaves "
                    "need one width and dtype: give per-modality builders that embed to "
                    "the same width (text=..., image=...)")
            if x is not None:
                xs.append(x.cpu())
        if self.graph_edges:
            pairs = [(self.children_ids[u][i], self.children_ids[u][j])
                     for u, i, j, _ in self.graph_edges]
            sibling.append(torch.tensor(pairs, dtype=torch.long).t())
        x = torch.cat(xs) if xs else None
        return NestedSignal.from_parents(
            parent, x, geometry=geometry, position=position, modality=modality, key=key,
            sibling_edge_index=torch.cat(sibling, 1) if sibling else None)

    def _infer_modality(self) -> None:
        """Containers: the override, else their children's shared tag, else mixed.
        Children are numbered after their parent, so one reverse pass suffices."""
        tags = [0] * len(self.skel_id)
        for s in range(len(self.skel_id) - 1, -1, -1):
            u = self.skel_id[s]
            if self.skel_override[s] is not None:
                tag = int(self.skel_override[s])
            else:
                kinds = set(self.child_modality[u])
                tag = kinds.pop() if len(kinds) == 1 else int(self.mixed_modality)
            tags[s] = tag
            if self.skel_parent[s] >= 0:
                self.child_modality[self.skel_parent[s]].append(tag)
        self.skel_modality = tags


def _root_of(tree: NestedSignal) -> int:
    return int((tree.parent < 0).nonzero()[0])


def _describe(x: Optional[Tensor]) -> str:
    if x is None:
        return "none (x unset)"
    if x.dim() == 1:
        return f"[n] ({x.dtype}, token ids)"
    return f"of shape [n, {', '.join(map(str, x.shape[1:]))}] ({x.dtype})"


def _as_list(items: Any, path: _Path, what: str) -> list:
    if isinstance(items, (str, bytes, Mapping)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{_render(path)}: {what} must be a list, got {type(items).__name__}")
    return list(items)


def document_tree(
    fields: Any,
    *,
    text: Optional[Callable[[str], NestedSignal]] = None,
    image: Optional[Callable[[Any], NestedSignal]] = None,
    text_modality: Optional[int] = 0,
    image_modality: Optional[int] = 1,
    mixed_modality: int = 0,
) -> NestedSignal:
    r"""A mixed document (nested dicts, lists, sets of texts and images) as one tree.

    Args:
        fields: the document, usually a ``dict`` of named fields (see the module
            docstring for every accepted value).
        text: the text builder, a callable ``str -> NestedSignal`` (e.g.
            paragraphs -> sentences -> tokens). Default:
            :func:`hsa_graph.builders.text.text_tree` with its defaults (token ids).
        image: the image builder, a callable ``array -> NestedSignal``. Default:
            :func:`~hsa_graph.builders.image.image_tree` with its defaults (16 x 16
            patches of raw pixels).
        text_modality: tag of every node of a text subtree (``None``: the builder's).
        image_modality: tag of every node of an image subtree (``None``: the builder's).
        mixed_modality: tag of a container whose children have different tags.

    Returns:
        One tree; containers are numbered before their contents, fields in order, so
        the leaves (rows of ``x``) follow the document's reading order.

    Raises:
        TypeError: an unsupported value or a non-str field name (naming its path).
        ValueError: an empty container, a cycle, a builder's error, leaves of different
            widths, a negative modality tag.

    Example:
        >>> from hsa_graph.builders.image import image_tree
        >>> words = lambda s: NestedSignal.from_nested(                # a toy text builder
        ...     [torch.ones(12) * len(w) for w in s.split()])
        >>> patches = lambda a: image_tree(a, 2)                        # 2x2x3 = 12 features
        >>> doc = document_tree({"title": "Grace Hopper", "photo": torch.rand(4, 4, 3),
        ...                      "tags": {"navy", "cobol"}}, text=words, image=patches)
        >>> doc.key[:3], doc.geometry_names()[0], doc.x.shape
        ([None, 'title', None], 'keyvalue', torch.Size([8, 12]))
        >>> doc.modality.tolist()[:2], doc.modality[doc.leaf_index].tolist()
        ([0, 0], [0, 0, 1, 1, 1, 1, 0, 0])
    """
    for name, tag in (("text_modality", text_modality), ("image_modality", image_modality),
                      ("mixed_modality", mixed_modality)):
        if tag is not None and (isinstance(tag, bool) or not isinstance(tag, (int, np.integer))):
            raise TypeError(f"{name} must be an int, got {tag!r}")
        if tag is not None and not 0 <= tag < 2 ** 63:
            raise ValueError(f"{name} must be >= 0 (an int64), got {tag!r:.40}")
    document = _Document(text, image, text_modality, image_modality, mixed_modality)
    document.walk(fields)
    return document.build()
