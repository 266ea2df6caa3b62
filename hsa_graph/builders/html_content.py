r"""Shaping a page's content tree: tables, sections, collapsing and chunking.

``_Content`` takes the flat content tree read by
:mod:`~hsa_graph.builders.html_parse` and gives it the structure of
:func:`~hsa_graph.builders.html.html_tree`: a table becomes a ``grid`` of its cells at
their ``(row, col)`` in the HTML table model, headings open nested implicit sections,
empty blocks are dropped and single-item ones replaced by their item, and families
wider than ``max_children`` are cut into chunks (a wide grid into bands of whole rows).
"""
from __future__ import annotations

import bisect
from typing import Callable, Dict, List, Optional, Tuple

from ..signal import GEOMETRIES
from .html_parse import _CELLS, _ELEMENT, _HEADINGS, _RUN, _TABLE_SECTIONS, _WHITESPACE, _Page

__all__: List[str] = []

_SEQUENCE, _GRID = GEOMETRIES.index("sequence"), GEOMETRIES.index("grid")


class _Content:
    """The content tree of a page after tables, sections and collapsing."""

    def __init__(self, page: _Page, title: bool, main_only: bool):
        self.kind, self.parent, self.tag = page.kind, page.parent, page.tag
        self.text, self.pre, self.span = page.text, page.pre, page.span
        self.children: List[List[int]] = [[] for _ in self.kind]
        for u in range(1, len(self.kind)):
            self.children[self.parent[u]].append(u)
        self.grid_position: Dict[int, Tuple[int, int]] = {}
        self.geometry: Dict[int, int] = {}
        for u in range(len(self.tag)):
            if self.tag[u] == "table":
                self._table(u)
        if main_only and page.main is not None:
            self.children[0] = [page.main]
            self.grid_position.pop(page.main, None)
        title_text = _WHITESPACE.sub(" ", "".join(page.title_parts)).strip()
        if title and title_text:
            self.children[0].insert(0, self._add(_RUN, "#title", 0, title_text))
        for u in range(len(self.kind)):
            if self.kind[u] == _ELEMENT and self.geometry.get(u) != _GRID:
                self._sections(u)

    def _add(self, kind: int, tag: str, parent: int, text: Optional[str] = None) -> int:
        self.kind.append(kind)
        self.parent.append(parent)
        self.tag.append(tag)
        self.text.append(text)
        self.pre.append(False)
        self.children.append([])
        return len(self.kind) - 1

    def _table(self, table: int) -> None:
        """A ``grid`` of the table's cells at their (row, col) in the HTML table model."""
        rows: List[List[int]] = []
        extras: List[int] = []
        pending: List[int] = []               # cells outside any <tr> form a row
        items = list(self.children[table])
        i = 0
        while i < len(items):
            u = items[i]
            i += 1
            tag = self.tag[u] if self.kind[u] == _ELEMENT else ""
            if tag in _CELLS:
                pending.append(u)
                continue
            if pending:
                rows.append(pending)
                pending = []
            if tag in _TABLE_SECTIONS:
                items[i:i] = self.children[u]     # read the section's rows in place
            elif tag == "tr":
                cells = [c for c in self.children[u] if self.tag[c] in _CELLS]
                extras.extend(c for c in self.children[u] if self.tag[c] not in _CELLS)
                rows.append(cells)
            else:
                extras.append(u)
        if pending:
            rows.append(pending)
        cells = [c for row in rows for c in row]
        if not cells:
            self.children[table] = extras
            return
        # Spans of earlier rows still covering this one: (first col, end col, last row),
        # sorted by column; one sweep per row, so the work is rows x live spans, which is
        # bounded by a budget (beyond it, rowspans of the rest of the table are ignored).
        live: List[Tuple[int, int, int]] = []
        budget = 1_000_000
        for r, row in enumerate(rows):
            live = [span for span in live if span[2] >= r]
            budget -= len(live) + len(row)
            if budget < 0:
                live = []
            column, k, started = 0, 0, []
            for cell in row:
                while k < len(live) and live[k][0] <= column:
                    column = max(column, live[k][1])
                    k += 1
                rowspan, colspan = self.span.get(cell, (1, 1))
                self.grid_position[cell] = (r, column)
                if rowspan > 1 and budget >= 0:
                    started.append((column, column + colspan, r + rowspan - 1))
                column += colspan
            if started:
                live = sorted(live + started)
        if extras:
            grid = self._add(_ELEMENT, "#grid", table)
            self.children[table] = extras + [grid]
        else:
            grid = table
        self.children[grid] = cells
        self.geometry[grid] = _GRID

    def _sections(self, u: int) -> None:
        """Headings among ``u``'s children open nested implicit sections."""
        kids = self.children[u]
        if not any(self.tag[c] in _HEADINGS for c in kids):
            return
        top: List[int] = []
        open_sections: List[Tuple[int, int]] = []   # (level, section node)
        for c in kids:
            level = _HEADINGS.get(self.tag[c]) if self.kind[c] == _ELEMENT else None
            if level is not None:
                while open_sections and open_sections[-1][0] >= level:
                    open_sections.pop()
                target = self.children[open_sections[-1][1]] if open_sections else top
                section = self._add(_ELEMENT, "#section",
                                    open_sections[-1][1] if open_sections else u)
                target.append(section)
                open_sections.append((level, section))
            (self.children[open_sections[-1][1]] if open_sections else top).append(c)
        self.children[u] = top

    def collapse(self, parts: Callable[[int], List[int]], max_children: Optional[int]
                 ) -> Tuple[int, Dict[int, List[int]]]:
        """Drop empty elements, replace single-item ones by their item, cut families
        wider than ``max_children`` into chunks (bottom-up, with an explicit stack).
        ``parts(run)`` gives the runs that stand for ``run`` (none if it is empty).
        Returns the root and the children of the kept elements."""
        order, stack = [], [0]
        while stack:
            u = stack.pop()
            order.append(u)
            if self.kind[u] == _ELEMENT:
                stack.extend(self.children[u])
        rep: Dict[int, Optional[int]] = {}
        kids_of: Dict[int, List[int]] = {}
        for u in reversed(order):             # children before parents
            if self.kind[u] == _RUN:
                kids = parts(u)
                if len(kids) >= 2:            # a run cut into parts becomes their parent
                    self.kind[u] = _ELEMENT
            else:
                kids = [rep[c] for c in self.children[u] if rep[c] is not None]
            if not kids:
                rep[u] = None
            elif len(kids) == 1:
                rep[u] = kids[0]              # the item takes the element's place
                if u in self.grid_position:
                    self.grid_position[kids[0]] = self.grid_position[u]
                elif kids[0] != u:
                    self.grid_position.pop(kids[0], None)
            else:
                rep[u] = u
                if max_children is not None and len(kids) > max_children:
                    if self.geometry.get(u) == _GRID:
                        kids = self._bands(u, kids, max_children, kids_of)
                    kids = self._chunks(u, kids, max_children, kids_of)
                kids_of[u] = kids
        root = rep[0]
        return (-1 if root is None else root), kids_of

    def _bands(self, u: int, cells: List[int], size: int,
               kids_of: Dict[int, List[int]]) -> List[int]:
        """Cut a grid of more than ``size`` cells into bands of consecutive rows (of
        at most ``size`` cells; a longer row is cut itself), each a ``grid`` with rows
        counted from its first; ``u`` becomes the ``sequence`` of the bands."""
        rows = [self.grid_position[c][0] for c in cells]
        row_start = [i for i in range(len(cells)) if i == 0 or rows[i] != rows[i - 1]]
        bands, i = [], 0
        while i < len(cells):
            end = min(i + size, len(cells))
            if end < len(cells):      # end the band at a row boundary when there is one
                j = bisect.bisect_right(row_start, end) - 1
                if row_start[j] > i:
                    end = row_start[j]
            band = cells[i:end]
            if len(band) == 1:
                self.grid_position.pop(band[0])
                bands.append(band[0])
            else:
                node = self._add(_ELEMENT, "#band", u)
                first = rows[i]
                for c in band:
                    r, col = self.grid_position[c]
                    self.grid_position[c] = (r - first, col)
                kids_of[node] = band
                self.geometry[node] = _GRID
                bands.append(node)
            i = end
        del self.geometry[u]
        return bands

    def _chunks(self, u: int, kids: List[int], size: int,
                kids_of: Dict[int, List[int]]) -> List[int]:
        """Group ``kids`` into consecutive chunks of at most ``size``, level by level,
        until at most ``size`` remain (a balanced sequence of sequences)."""
        while len(kids) > size:
            grouped = []
            for i in range(0, len(kids), size):
                group = kids[i:i + size]
                if len(group) == 1:
                    grouped.append(group[0])
                    continue
                chunk = self._add(_ELEMENT, "#chunk", u)
                kids_of[chunk] = group
                grouped.append(chunk)
            kids = grouped
        return kids
