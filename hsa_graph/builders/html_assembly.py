r"""From a page's source to its tree: the pipeline of
:func:`~hsa_graph.builders.html.html_tree` and the assembly of its kept content.

``_page_tree`` checks the options, parses the page
(:mod:`~hsa_graph.builders.html_parse`), shapes its content
(:mod:`~hsa_graph.builders.html_content`), splits its text
(:mod:`~hsa_graph.builders.html_text`) and collapses it; ``_assemble`` numbers the
kept content in pre-order, fills the per-node arrays (parents, geometries, modalities,
positions) and builds the tree with one :meth:`~hsa_graph.NestedSignal.from_parents`.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np
import torch

from ..signal import NestedSignal
from .html_content import _SEQUENCE, _Content
from .html_parse import _ELEMENT, _RUN, _Page, _parse
from .html_text import Embed, TextTree, _CustomRuns, _DefaultRuns

__all__: List[str] = []

class _Arrays:
    """Per-node arrays of the page, filled in node-id order blocks."""

    def __init__(self, m: int):
        self.parent = np.full(m, -1, dtype=np.int64)
        self.geometry = np.full(m, -1, dtype=np.int64)
        self.modality = np.zeros(m, dtype=np.int64)
        self.position = np.full((m, 2), -1, dtype=np.int64)
        self.fixed = np.zeros(m, dtype=bool)     # position given (grid cells, subtrees)


def _sibling_rank(parent: np.ndarray) -> np.ndarray:
    """Each node's index among its siblings in node order (0 for roots)."""
    m = parent.size
    order = np.lexsort((np.arange(m), parent))
    sorted_parent = parent[order]
    first = np.ones(m, dtype=bool)
    first[1:] = sorted_parent[1:] != sorted_parent[:-1]
    idx = np.arange(m)
    start = np.maximum.accumulate(np.where(first, idx, 0))
    rank = np.empty(m, dtype=np.int64)
    rank[order] = idx - start
    return rank



def _page_tree(html: Any, text_tree: Optional[TextTree], embed: Optional[Embed],
               skip: Iterable[str], title: bool, main_only: bool, image_token: str,
               empty_token: Optional[str], max_depth: int, max_children: Optional[int]
               ) -> Tuple[NestedSignal, _Page]:
    if max_children is not None and (isinstance(max_children, bool)
                                     or not isinstance(max_children, int) or max_children < 2):
        raise ValueError(f"max_children must be an int >= 2 or None, got {max_children!r}")
    if text_tree is not None and not callable(text_tree):
        raise TypeError(f"text_tree must be callable, got {type(text_tree).__name__}")
    if embed is not None and not callable(embed):
        raise TypeError(f"embed must be callable, got {type(embed).__name__}")
    page = _parse(html, skip, max_depth)
    content = _Content(page, title, main_only)
    runs = _DefaultRuns(content, image_token, max_children) if text_tree is None else \
        _CustomRuns(content, image_token, text_tree)
    root, kids_of = content.collapse(runs.parts, max_children)
    if root < 0:
        if empty_token is None:
            raise ValueError("the page has no content: no text or image outside skipped "
                             "elements (pass empty_token=... to get a one-leaf tree)")
        root, kids_of = content._add(_RUN, "#token", -1, empty_token), {}
        runs.parts(root)
    return _assemble(content, root, kids_of, runs, embed), page


def _assemble(content: _Content, root: int, kids_of: Dict[int, List[int]],
              runs: Union[_DefaultRuns, _CustomRuns], embed: Optional[Embed]) -> NestedSignal:
    """Number the kept content in pre-order (an element takes one id, a run a block of
    ids), fill the per-node arrays and build the tree with one ``from_parents``."""
    order: List[int] = []                # content nodes in pre-order
    order_parent: List[int] = []         # index into ``order`` of the parent, -1 at the root
    stack = [(root, -1)]
    while stack:
        u, parent_slot = stack.pop()
        order.append(u)
        order_parent.append(parent_slot)
        if content.kind[u] == _ELEMENT:
            slot = len(order) - 1
            stack.extend((c, slot) for c in reversed(kids_of[u]))
    is_run = np.asarray([content.kind[u] == _RUN for u in order], dtype=bool)
    run_nodes = [u for u, r in zip(order, is_run) if r]
    size = np.ones(len(order), dtype=np.int64)
    size[is_run] = runs.sizes(run_nodes)
    ids = np.cumsum(size) - size
    parent_slot = np.asarray(order_parent, dtype=np.int64)
    parent_id = np.where(parent_slot >= 0, ids[parent_slot.clip(0)], -1)
    arrays = _Arrays(int(size.sum()))
    element = ~is_run
    arrays.parent[ids[element]] = parent_id[element]
    arrays.geometry[ids[element]] = [content.geometry.get(u, _SEQUENCE)
                                     for u, r in zip(order, is_run) if not r]
    is_image = np.asarray([content.tag[u] == "#img" for u in run_nodes], dtype=bool)
    x = runs.fill(arrays, run_nodes, ids[is_run], parent_id[is_run], is_image, embed)
    # Positions: index among siblings, except grid cells and inside text_tree subtrees.
    rank = _sibling_rank(arrays.parent)
    position = np.where(arrays.fixed[:, None], arrays.position,
                        np.stack([rank, np.zeros_like(rank)], 1))
    for slot, u in enumerate(order):
        cell = content.grid_position.get(u)
        if cell is not None:
            position[ids[slot] + (runs.root_offset(u) if is_run[slot] else 0)] = cell
    position[arrays.parent < 0] = -1
    return NestedSignal.from_parents(
        torch.from_numpy(arrays.parent), x, geometry=torch.from_numpy(arrays.geometry),
        position=torch.from_numpy(position), modality=torch.from_numpy(arrays.modality),
        key=runs.key, sibling_edge_index=runs.sibling_edges)
