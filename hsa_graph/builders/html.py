r"""Web pages as nested signals, and websites as graph families of page trees.

:func:`html_tree` turns one HTML page into a tree that follows its content structure;
:func:`website_tree` puts the trees of a set of pages under one ``graph`` root whose
sibling edges are the hyperlinks between them (the paper's website example).

**Parsing.** The page is read with the standard library's :mod:`html.parser`, driven
by an explicit stack of open elements (no recursion at any depth), with the implied
end tags of HTML5 that matter for structure: a new ``<p>``, ``<div>``, ``<ul>``,
``<table>``... closes an open ``<p>``; ``<li>`` closes the open ``<li>`` of its list;
``<dt>``/``<dd>``, ``<tr>``, ``<td>``/``<th>`` and table sections close their open
siblings; a heading closes an open heading. An end tag closes the nearest open
element of that name and everything opened inside it; an end tag with no open element
(a stray ``</div>``) is ignored, and so is the end tag of an inline element (``</b>``)
that would close a block opened inside it. ``<x/>`` is an empty element. Input that
the standard parser handles in quadratic time or rejects (markup that never closes,
``<![...``) is first rewritten in linear time the way browsers read it: a ``<`` that
no later ``>`` can close is text, and so is a ``<!--`` that no later ``-->`` closes;
``<![...>`` is a bogus comment.

**Which elements make nodes.** *Blocks* (``html``, ``body``, ``main``, ``article``,
``section``, ``div``, ``p``, ``h1``-``h6``, ``ul``/``ol``/``li``, ``dl``/``dt``/``dd``,
``table`` and its parts, ``pre``, ``blockquote``, ``figure``, ``header``,
``footer``...: see ``BLOCK_TAGS``) are groupings. Every other element (``a``, ``em``,
``code``, ``span``, unknown and custom tags...) is *inline*: its text flows into the
enclosing block. A maximal run of text between block boundaries is a *text run*
(whitespace collapsed except inside ``<pre>``; ``<br>`` is a line break; entities
decoded). Nodes, in document order:

* a block is a ``sequence`` of its content: child blocks, text runs and images;
* a text run is a ``sequence`` of sentences, each a ``sequence`` of token leaves
  (the default splitter below, or ``text_tree``);
* ``<img>`` cannot be fetched: it becomes the tokens of its ``alt`` text, or one
  ``image_token`` leaf when it has none, with modality ``1`` on every node of that
  subtree (text is modality ``0``);
* a ``<table>`` is a ``grid`` of its non-empty cells, each at its ``(row, col)`` in the
  HTML table model (``rowspan``/``colspan`` honoured, within a linear work budget
  that only absurd spans exceed); a caption or stray content
  makes the table a ``sequence`` of those items followed by the grid;
* headings open implicit sections (the HTML outline): among the children of one
  block, an ``<hN>`` starts a ``sequence`` holding it and everything after it up to
  the next heading of the same or a higher level, nested by level;
* the page's ``<title>`` (``title=True``) is a text run before the body.

**Collapsing and skipping.** A block with no content is dropped; a block with a
single item is replaced by that item (which takes its position), and so is a text
run of one sentence or a sentence of one token: unary nodes are transparent to HSA,
so this changes no attention, only depth. Skipped with everything inside them: the
tags in ``skip`` (default ``SKIP_TAGS``: ``head`` except the title, ``script``,
``style``, ``noscript``, ``template``, ``nav``, ``svg``, ``math``, ``iframe``,
``object``, ``canvas``, ``audio``, ``video``, form controls...), and elements with
the ``hidden`` attribute, ``aria-hidden="true"`` or ``role="navigation"``. With
``main_only=True`` only the first ``<main>`` (or ``role="main"``) element is kept,
when the page has one. Blocks nested deeper than ``max_depth`` are read as inline
(their text joins the block at that depth, as a line), as browsers cap their DOM
depth: this bounds the tree depth, and with it the time HSA spends per level. Families
are bounded by ``max_children`` (default 512), which bounds HSA's per-family cost: a
longer sentence is cut into consecutive pieces, and a wider block (a list of 10,000
items) or run (of many sentences) into consecutive chunks, level by level (a sequence
of sequences); a table of more cells into bands of whole rows, each a ``grid``.

**Default text splitting** (when no ``text_tree`` is given): a run's lines (``<br>``
or newlines inside ``<pre>``) are split into sentences by the text builder's
:func:`~hsa_graph.builders.text.split_sentences` (each line of a ``<pre>`` is one
sentence) and into tokens by its :class:`~hsa_graph.builders.text.WordTokenizer`.
``embed`` maps every token of the page, in one call, to leaf features: ``[T]`` token
ids or ``[T, F]`` vectors. The default, :func:`hash_tokens`, gives each case-folded
token a stable hashed id in ``[0, 2**18)``, to be embedded later. With ``text_tree``
(``str -> NestedSignal``, e.g. the text builder) each run, and each image's alt text
(or ``image_token``), becomes the tree it returns, spliced in whole.

**Edge cases.** A page with no content (an empty string, only tags, only skipped
elements) raises ``ValueError`` unless ``empty_token`` is given, then it is one leaf
with that token. Plain text without tags is a page of one block. Malformed markup
never fails (see Parsing). A non-``str`` page is a ``TypeError``.

Example:
    >>> page = ('<html><head><title>Demo</title><script>var x;</script></head><body>'
    ...         '<h1>Cats</h1><p>Cats purr. They sleep a lot.</p>'
    ...         '<ul><li>Tabby</li><li>Siamese cat</li></ul>'
    ...         '<img src="cat.png" alt="a sleeping cat"></body></html>')
    >>> tree = html_tree(page)
    >>> tree.num_leaves, tree.x.dtype, tree.geometry_names()[0]
    (16, torch.int64, 'sequence')
    >>> tree.parent.tolist().count(0)  # the root: the title 'Demo' and the <h1> section
    2
    >>> int(tree.modality.sum())      # the image: 'a sleeping cat' and its sequence node
    4
"""
from __future__ import annotations

import bisect
import re
from html.parser import HTMLParser
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import urldefrag, urljoin, urlsplit, urlunsplit

import numpy as np
import torch
from torch import Tensor

from ..signal import GEOMETRIES, NestedSignal
from .text import WordTokenizer, split_sentences

__all__ = ["BLOCK_TAGS", "SKIP_TAGS", "hash_tokens", "html_tree", "website_tree"]

#: Elements that group their content (every other element is inline).
BLOCK_TAGS = frozenset("""
    address article aside blockquote body caption center dd details dialog dir div dl dt
    fieldset figcaption figure footer form h1 h2 h3 h4 h5 h6 header hgroup html legend li
    listing main menu ol p pre search section summary table tbody td tfoot th thead tr ul
    xmp""".split())
#: Elements skipped with all their content by default.
SKIP_TAGS = frozenset("""
    applet audio button canvas datalist frameset head iframe map math nav noembed
    noframes noscript object option optgroup script select style svg template textarea
    video""".split())

_VOID = frozenset("""area base basefont bgsound br col embed frame hr image img input keygen
    link meta param source track wbr""".split())
_HEADINGS = {f"h{i}": i for i in range(1, 7)}
_PRE = frozenset({"pre", "listing", "xmp"})
_HEAD_CONTENT = frozenset({"base", "basefont", "bgsound", "link", "meta", "noscript",
                           "script", "style", "template", "title"})
# An open <p> is closed by these (HTML5 "close a p element" on their start tag).
_CLOSES_P = frozenset("""address article aside blockquote center dd details dialog dir div dl
    dt fieldset figcaption figure footer form h1 h2 h3 h4 h5 h6 header hgroup hr li listing
    main menu nav ol p plaintext pre search section summary table ul xmp""".split())
# Elements that stop the search for an open <p>/<li>/<dd> (HTML5 "scope").
_SCOPE = ("applet", "caption", "html", "table", "td", "th", "marquee", "object", "template",
          "button")
_TABLE_SECTIONS = ("thead", "tbody", "tfoot")
_CELLS = ("td", "th")
# Implied end tags: a start tag closes the lowest open element of ``closes`` above the
# innermost open element of the ``boundary`` group (HTML5 scopes, simplified).
_GROUPS = {
    "scope": _SCOPE,
    "list": ("ul", "ol", "menu") + _SCOPE,
    "dl": ("dl",) + _SCOPE,
    "row": ("tr", "table") + _TABLE_SECTIONS,
    "section": ("table",) + _TABLE_SECTIONS,
    "table": ("table",),
    "select": ("select", "datalist"),
}
_MEMBER = {tag: tuple(g for g, tags in _GROUPS.items() if tag in tags)
           for tag in set().union(*_GROUPS.values())}
_IMPLIED = {
    "li": (("li",), "list"),
    "dt": (("dt", "dd"), "dl"),
    "dd": (("dt", "dd"), "dl"),
    "td": (_CELLS, "row"),
    "th": (_CELLS, "row"),
    "tr": (("tr",) + _CELLS, "section"),
    "option": (("option",), "select"),
    "optgroup": (("option", "optgroup"), "select"),
}
_IMPLIED.update({tag: (_TABLE_SECTIONS + ("tr", "caption", "colgroup") + _CELLS, "table")
                 for tag in _TABLE_SECTIONS + ("caption", "colgroup")})
_SEQUENCE, _GRID = GEOMETRIES.index("sequence"), GEOMETRIES.index("grid")
_TEXT_MODALITY, _IMAGE_MODALITY = 0, 1
_ELEMENT, _RUN = 0, 1

_WHITESPACE = re.compile(r"\s+")
_COMMENT_CLOSE = re.compile(r"--\s*>")

TextTree = Callable[[str], NestedSignal]
Embed = Callable[[List[str]], Tensor]


def hash_tokens(tokens: Sequence[str], num_buckets: int = 2 ** 18) -> Tensor:
    r"""Stable token ids of the case-folded tokens, hashed as by the text builder's
    :class:`~hsa_graph.builders.text.WordTokenizer`, as a ``[T]`` long tensor (the same
    on every run and machine, unlike Python's ``hash``).

    Example:
        >>> hash_tokens(["Cat", "cat", "dog"], num_buckets=1000).tolist()
        [939, 939, 465]
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be positive, got {num_buckets}")
    hashing = WordTokenizer(num_buckets=num_buckets)
    return torch.tensor(hashing.token_ids([t.casefold() for t in tokens]), dtype=torch.long)


# --------------------------------------------------------------------------- parsing
def _sanitise(html: str) -> str:
    """Rewrite, in linear time, the markup that ``html.parser`` would scan to the end
    of the input again and again (quadratic time) or reject, as browsers read it."""
    # A '<' after the last '>' can never close: it is text.
    last_gt = html.rfind(">") + 1
    head, tail = html[:last_gt], html[last_gt:].replace("<", "&lt;")
    # <![CDATA[...]]>, <![if ...]> are bogus comments in HTML (up to the next '>', which
    # exists in ``head``); html.parser asserts on unknown marked sections.
    head = head.replace("<![", "<!-[")
    # A <!-- with no --> after it is text.
    last_close = 0   # openers from 3 characters before the last closer have none after
    for match in _COMMENT_CLOSE.finditer(head):
        last_close = match.start()
    cut = max(last_close - 3, 0)
    if "<!--" in head[cut:]:
        head = head[:cut] + head[cut:].replace("<!--", "&lt;!--")
    return head + tail


class _Page(HTMLParser):
    """Reads a page into a flat content tree: elements (blocks) and runs (text, images).

    Content node 0 is the document. Lists, one entry per content node: ``kind``
    (element or run), ``parent``, ``tag`` (elements; ``'#img'`` for image runs),
    ``text`` and ``pre`` (runs), ``span`` (``(rowspan, colspan)`` of table cells).
    """

    def __init__(self, skip: frozenset, max_depth: int):
        super().__init__(convert_charrefs=True)
        self.skip_tags = skip
        self.max_depth = max_depth
        self.kind: List[int] = [_ELEMENT]
        self.parent: List[int] = [-1]
        self.tag: List[str] = ["#document"]
        self.text: List[Optional[str]] = [None]
        self.pre: List[bool] = [False]
        self.span: Dict[int, Tuple[int, int]] = {}
        self.title_parts: List[str] = []
        self.links: List[str] = []
        self.base: Optional[str] = None
        self.main: Optional[int] = None
        self.seen_body = False
        # The stack of open elements: (tag, container, is_block, skipped, pre, title).
        self.stack: List[Tuple[str, int, bool, bool, bool, bool]] = []
        self.open: Dict[str, List[int]] = {}   # tag -> stack positions, increasing
        self.blocks: List[int] = []             # stack positions of block containers
        self.groups: Dict[str, List[int]] = {g: [] for g in _GROUPS}   # likewise per group
        self.buffer: List[str] = []             # pending text of the current container

    # state of the innermost open element (the document when none is open)
    def _top(self) -> Tuple[str, int, bool, bool, bool, bool]:
        return self.stack[-1] if self.stack else ("#document", 0, True, False, False, False)

    def _lowest_above(self, tags: Iterable[str], boundary: int) -> int:
        """The lowest stack position of an open element of ``tags`` above ``boundary``."""
        best = -1
        for t in tags:
            positions = self.open.get(t)
            if positions:
                j = bisect.bisect_right(positions, boundary)
                if j < len(positions) and (best < 0 or positions[j] < best):
                    best = positions[j]
        return best

    def _new(self, kind: int, tag: str, text: Optional[str] = None, pre: bool = False) -> int:
        self.kind.append(kind)
        self.parent.append(self._top()[1])
        self.tag.append(tag)
        self.text.append(text)
        self.pre.append(pre)
        return len(self.kind) - 1

    def _flush(self) -> None:
        """The pending text becomes a run of the current container."""
        if self.buffer:
            text = "".join(self.buffer)
            self.buffer = []
            if text.strip():
                self._new(_RUN, "#text", text, self._top()[4])

    def _push(self, tag: str, container: int, is_block: bool, skipped: bool, pre: bool,
              title: bool) -> None:
        position = len(self.stack)
        self.stack.append((tag, container, is_block, skipped, pre, title))
        self.open.setdefault(tag, []).append(position)
        if is_block:
            self.blocks.append(position)
        for group in _MEMBER.get(tag, ()):
            self.groups[group].append(position)

    def _pop_to(self, position: int) -> None:
        """Close the open element at stack ``position`` and all opened inside it."""
        while len(self.stack) > position:
            tag, _, is_block, skipped, _, _ = self.stack[-1]
            if is_block:
                self._flush()
                self.blocks.pop()
            elif tag in BLOCK_TAGS and not skipped:
                self.buffer.append("\n")         # a block read as inline: a line break
            self.stack.pop()
            self.open[tag].pop()
            for group in _MEMBER.get(tag, ()):
                self.groups[group].pop()

    def _close_implied(self, tag: str) -> None:
        if tag in _CLOSES_P and self.open.get("p"):
            self._close_lowest(("p",), "scope")
        rule = _IMPLIED.get(tag)
        if rule is not None:
            self._close_lowest(*rule)
        if tag in _HEADINGS and self.stack and self.stack[-1][0] in _HEADINGS:
            self._pop_to(len(self.stack) - 1)

    def _close_lowest(self, tags: Tuple[str, ...], group: str) -> None:
        boundary = self.groups[group]
        position = self._lowest_above(tags, boundary[-1] if boundary else -1)
        if position >= 0:
            self._pop_to(position)

    # ------------------------------------------------------------ parser events
    def handle_starttag(self, tag: str, attrs: List[Tuple[str, Optional[str]]]) -> None:
        if self.open.get("head") and tag not in _HEAD_CONTENT and tag != "head":
            self._pop_to(self.open["head"][-1])   # body content ends the head
        if tag in ("html", "body", "head"):
            seen = tag == "head" and self.seen_body
            if self.open.get(tag) or seen:
                return                              # a second <html>/<body>: merged
            self.seen_body |= tag == "body"
        attributes = dict(attrs)
        if tag in ("a", "area") and attributes.get("href"):
            self.links.append(attributes["href"])
        elif tag == "base" and self.base is None and attributes.get("href"):
            self.base = attributes["href"]
        self._close_implied(tag)
        _, container, _, skipped, pre, _ = self._top()
        if tag in _VOID:
            if skipped:
                return
            if tag == "br":
                self.buffer.append("\n")
            elif tag == "hr":
                self._flush()
            elif tag == "img" and not _hidden(attributes):
                self._flush()
                alt = _WHITESPACE.sub(" ", attributes.get("alt") or "").strip()
                self._new(_RUN, "#img", alt or None)
            return
        title = (tag == "title" and not self.title_parts
                 and not (self.open.get("svg") or self.open.get("math")))
        skipped = skipped or (tag in self.skip_tags and not title) or _hidden(attributes)
        is_block = (tag in BLOCK_TAGS and not skipped
                    and len(self.blocks) < self.max_depth)
        if tag in BLOCK_TAGS and not skipped and not is_block:
            self.buffer.append("\n")             # a block read as inline: a line break
        if is_block:
            self._flush()
            pre = pre or tag in _PRE
            container = self._new(_ELEMENT, tag, pre=pre)
            if tag in _CELLS:
                self.span[container] = (_span(attributes.get("rowspan"), 65534),
                                        _span(attributes.get("colspan"), 1000))
            if self.main is None and (tag == "main" or attributes.get("role") == "main"):
                self.main = container
        self._push(tag, container, is_block, skipped, pre, title)

    def handle_startendtag(self, tag: str, attrs: List[Tuple[str, Optional[str]]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in _VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag == "br":                            # </br> is read as <br>
            self.handle_starttag("br", [])
            return
        positions = self.open.get(tag)
        if tag in ("html", "body") or not positions:
            return
        position = positions[-1]
        if tag not in BLOCK_TAGS and self.blocks and self.blocks[-1] > position:
            return           # an inline end tag never closes a block opened inside it
        self._pop_to(position)

    def handle_data(self, data: str) -> None:
        tag, _, _, skipped, pre, title = self._top()
        if title:
            self.title_parts.append(data)
            return
        if tag == "head" and data.strip():
            self._pop_to(self.open["head"][-1])    # text ends the head
            _, _, _, skipped, pre, _ = self._top()
        if skipped:
            return
        self.buffer.append(data if pre else _WHITESPACE.sub(" ", data))

    def finish(self) -> None:
        self.close()
        self._pop_to(0)
        self._flush()


def _hidden(attributes: Dict[str, Optional[str]]) -> bool:
    return ("hidden" in attributes or (attributes.get("aria-hidden") or "").lower() == "true"
            or (attributes.get("role") or "").lower() == "navigation")


def _span(value: Optional[str], limit: int) -> int:
    try:
        return min(max(int(value), 1), limit)
    except (TypeError, ValueError):
        return 1


def _parse(html: Any, skip: Iterable[str], max_depth: int) -> _Page:
    if not isinstance(html, str):
        raise TypeError(f"html must be a str, got {type(html).__name__}")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be a positive int, got {max_depth!r}")
    if isinstance(skip, str):
        raise TypeError(f"skip must be a collection of tag names, not the str {skip!r}")
    page = _Page(frozenset(t.lower() for t in skip), max_depth)
    try:
        page.feed(_sanitise(html))
        page.finish()
    except AssertionError as error:  # html.parser's internal checks; not expected
        raise ValueError(f"html.parser could not read the page: {error}") from None
    return page


# ----------------------------------------------------------- content structure
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


# ------------------------------------------------------------------ default text
_WORDS = WordTokenizer()


def _sentences(line: str) -> List[str]:
    """Split one line into sentences with the text builder's splitter."""
    return [s for s in (line[a:b].strip() for a, b in split_sentences(line)) if s]


def _run_sentences(text: str, pre: bool, max_tokens: Optional[int]) -> List[List[str]]:
    """Tokens of each sentence of a text run; sentences longer than ``max_tokens`` are
    cut into consecutive pieces."""
    if pre:
        lines = text.split("\n")
        if lines and not lines[0].strip():
            lines = lines[1:]                 # HTML drops a newline right after <pre>
        sentences = [line for line in lines if line.strip()]
    else:
        sentences = [s for line in text.split("\n") for s in _sentences(line)]
    tokenised = [tokens for tokens in map(_WORDS, sentences) if tokens]
    if max_tokens is None or all(len(t) <= max_tokens for t in tokenised):
        return tokenised
    return [t[i:i + max_tokens] for t in tokenised for i in range(0, len(t), max_tokens)]


# --------------------------------------------------------------------- assembly
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


def html_tree(
    html: str,
    *,
    text_tree: Optional[TextTree] = None,
    embed: Optional[Embed] = None,
    skip: Iterable[str] = SKIP_TAGS,
    title: bool = True,
    main_only: bool = False,
    image_token: str = "[IMG]",
    empty_token: Optional[str] = None,
    max_depth: int = 256,
    max_children: Optional[int] = 512,
) -> NestedSignal:
    r"""An HTML page as a nested signal (the rules are in the module docstring).

    Args:
        html: the page source.
        text_tree: ``str -> NestedSignal`` for each text run and image text; by
            default the built-in sentence and word splitter with ``embed``.
        embed: ``list[str] -> Tensor``: the leaf features of the page's tokens,
            ``[T]`` ids or ``[T, F]`` vectors, called once per page (default
            :func:`hash_tokens`). Not used with ``text_tree``.
        skip: tags skipped with their content (default ``SKIP_TAGS``).
        title: put the ``<title>`` text first.
        main_only: keep only the page's ``<main>`` element when it has one.
        image_token: the token of an image without ``alt`` text.
        empty_token: the single token of a page without content (default: raise).
        max_depth: block nesting beyond this depth is read as inline.
        max_children: the widest family: longer sentences are cut into pieces, and
            wider blocks and runs into consecutive chunks (``None``: no limit).

    Example:
        >>> tree = html_tree("<ul><li>Red fox.</li><li>Cat</li></ul>")
        >>> tree.parent.tolist(), tree.geometry_names()
        ([-1, 0, 1, 1, 1, 0], ['sequence', 'sequence', None, None, None, None])

    Returns:
        one tree with ``M`` nodes: ``x`` ``[N]`` token ids (or ``[N, F]`` from
        ``embed``/``text_tree``), leaves in document order; ``modality`` ``[M]``,
        ``0`` for text and ``1`` for images; ``geometry`` ``sequence`` everywhere but
        tables (``grid``, cells at ``(row, col)``) and inside ``text_tree`` subtrees.

    Raises:
        TypeError: ``html`` is not a ``str``; ``text_tree`` returns no NestedSignal.
        ValueError: the page has no content and no ``empty_token``; ``embed`` returns
            the wrong number of rows; ``text_tree`` trees disagree on ``x``.
    """
    tree, _ = _page_tree(html, text_tree, embed, skip, title, main_only, image_token,
                         empty_token, max_depth, max_children)
    return tree


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


class _DefaultRuns:
    """Runs split by the built-in splitter; their nodes are laid out with array code."""

    key = None
    sibling_edges = None

    @staticmethod
    def root_offset(u: int) -> int:
        return 0                                  # a run's root is its first node

    def __init__(self, content: _Content, image_token: str, max_children: Optional[int]):
        self.content = content
        self.image_token = image_token
        self.max_children = max_children
        self.sentences: Dict[int, List[List[str]]] = {}

    def parts(self, u: int) -> List[int]:
        """Tokenise run ``u``: ``[u]``, or ``[]`` without tokens, or new runs of at most
        ``max_children`` sentences each when it has more."""
        content, limit = self.content, self.max_children
        text, tag = content.text[u], content.tag[u]
        if text is None:                          # an image without alt text
            sentences = [[self.image_token]]
        elif tag == "#token":
            sentences = [[text]]
        else:
            sentences = _run_sentences(text, content.pre[u], limit)
        if not sentences:
            return []
        if limit is None or len(sentences) <= limit:
            self.sentences[u] = sentences
            return [u]
        pieces = []
        for i in range(0, len(sentences), limit):
            piece = content._add(_RUN, tag, u, "")
            self.sentences[piece] = sentences[i:i + limit]
            pieces.append(piece)
        return pieces

    def sizes(self, runs: List[int]) -> np.ndarray:
        self.tokens = [t for u in runs for tokens in self.sentences[u] for t in tokens]
        self.n_sent = np.asarray([len(self.sentences[u]) for u in runs], dtype=np.int64)
        self.n_tok = np.asarray([len(tokens) for u in runs for tokens in self.sentences[u]],
                                dtype=np.int64)
        # A sentence of one token is that token; a run of one sentence is that sentence.
        self.sentence_node = self.n_tok >= 2
        self.run_node = self.n_sent >= 2
        self.sentence_run = np.repeat(np.arange(self.n_sent.size), self.n_sent)
        self.sentence_size = self.n_tok + self.sentence_node
        run_size = np.bincount(self.sentence_run, weights=self.sentence_size,
                               minlength=self.n_sent.size).astype(np.int64)
        return run_size + self.run_node

    def fill(self, arrays: _Arrays, runs: List[int], base: np.ndarray, run_parent: np.ndarray,
             is_image: np.ndarray, embed: Optional[Embed]) -> Tensor:
        n_sent, n_tok, run_of = self.n_sent, self.n_tok, self.sentence_run
        modality = np.where(is_image, _IMAGE_MODALITY, _TEXT_MODALITY)
        # run nodes (runs of two or more sentences)
        has = self.run_node
        arrays.parent[base[has]] = run_parent[has]
        arrays.geometry[base[has]] = _SEQUENCE
        arrays.modality[base[has]] = modality[has]
        # sentences: offset in their run = sum of the sizes of the run's earlier sentences
        before = np.cumsum(self.sentence_size) - self.sentence_size
        first_sentence = np.cumsum(n_sent) - n_sent
        local = before - before[first_sentence][run_of]
        sentence_id = base[run_of] + has[run_of] + local
        sentence_parent = np.where(has[run_of], base[run_of], run_parent[run_of])
        node = self.sentence_node
        arrays.parent[sentence_id[node]] = sentence_parent[node]
        arrays.geometry[sentence_id[node]] = _SEQUENCE
        arrays.modality[sentence_id[node]] = modality[run_of][node]
        # tokens (leaves; geometry stays -1)
        token_sentence = np.repeat(np.arange(n_tok.size), n_tok)
        first_token = np.cumsum(n_tok) - n_tok
        k = np.arange(token_sentence.size) - first_token[token_sentence]
        token_id = sentence_id[token_sentence] + node[token_sentence] + k
        arrays.parent[token_id] = np.where(node[token_sentence], sentence_id[token_sentence],
                                           sentence_parent[token_sentence])
        arrays.modality[token_id] = modality[run_of][token_sentence]
        x = (embed or hash_tokens)(self.tokens)
        if not isinstance(x, Tensor):
            raise TypeError(f"embed must return a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[0] != len(self.tokens):
            raise ValueError(f"embed must return one row per token: got shape "
                             f"{tuple(x.shape)} for {len(self.tokens)} tokens")
        # Tokens were collected in pre-order, which is leaf order; the sort makes it exact.
        return x[torch.from_numpy(np.argsort(token_id, kind="stable"))]


class _CustomRuns:
    """Runs turned into trees by a user ``text_tree`` and spliced in whole."""

    def __init__(self, content: _Content, image_token: str, text_tree: TextTree):
        self.content = content
        self.image_token = image_token
        self.text_tree = text_tree
        self.trees: Dict[int, NestedSignal] = {}
        self.key: Optional[List[Optional[str]]] = None
        self.sibling_edges: Optional[Tensor] = None

    def parts(self, u: int) -> List[int]:
        text = self.content.text[u]
        if text is None:
            text = self.image_token
        elif self.content.pre[u] and text.startswith("\n"):
            text = text[1:]                       # HTML drops a newline right after <pre>
        tree = self.text_tree(text)
        if not isinstance(tree, NestedSignal):
            raise TypeError(f"text_tree must return a NestedSignal, got "
                            f"{type(tree).__name__} for {text[:40]!r}")
        if tree.structure.num_trees != 1:
            raise ValueError(f"text_tree returned a forest of {tree.structure.num_trees} "
                             f"trees for {text[:40]!r}; one tree per text is needed")
        self.trees[u] = tree
        return [u]

    def sizes(self, runs: List[int]) -> np.ndarray:
        return np.asarray([self.trees[u].num_nodes for u in runs], dtype=np.int64)

    def root_offset(self, u: int) -> int:
        return int((self.trees[u].parent < 0).nonzero()[0])

    def fill(self, arrays: _Arrays, runs: List[int], base: np.ndarray, run_parent: np.ndarray,
             is_image: np.ndarray, embed: Optional[Embed]) -> Optional[Tensor]:
        trees = [self.trees[u] for u in runs]
        xs = [t.get("x") for t in trees]
        if any(x is not None for x in xs) and any(x is None for x in xs):
            raise ValueError("text_tree returned trees with and without x")
        keys: List[Optional[str]] = [None] * arrays.parent.size
        edges = []
        for tree, start, parent, image in zip(trees, base.tolist(), run_parent.tolist(),
                                              is_image.tolist()):
            local = tree.parent.cpu().numpy()
            node = np.arange(start, start + local.size)
            arrays.parent[node] = np.where(local >= 0, local + start, parent)
            arrays.geometry[node] = tree.geometry.cpu().numpy()
            arrays.modality[node] = _IMAGE_MODALITY if image else tree.modality.cpu().numpy()
            arrays.position[node] = tree.position.cpu().numpy()
            arrays.fixed[node[local >= 0]] = True
            if any(k is not None for k in tree.key):
                keys[start:start + local.size] = list(tree.key)
                self.key = keys
            if tree.sibling_edge_index.numel():
                edges.append(tree.sibling_edge_index.cpu() + start)
        if edges:
            self.sibling_edges = torch.cat(edges, 1)
        if xs[0] is None:
            return None
        first = xs[0]
        for x in xs:
            if x.shape[1:] != first.shape[1:] or x.dtype != first.dtype:
                raise ValueError(f"text_tree returned x of shape {tuple(x.shape)} "
                                 f"({x.dtype}) and of {tuple(first.shape)} ({first.dtype})")
        return torch.cat([x.cpu() for x in xs])


# --------------------------------------------------------------------- websites
def _normalise_url(url: str) -> str:
    """Scheme and host lower-cased, fragment dropped, the empty path of a host is '/'."""
    url, _ = urldefrag(url.strip())
    parts = urlsplit(url)
    path = parts.path or ("/" if parts.netloc else "")
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, parts.query, ""))


def website_tree(
    pages: Union[Mapping[str, str], Iterable[Tuple[str, str]]],
    links: Optional[Iterable[Tuple[Union[str, int], Union[str, int]]]] = None,
    *,
    undirected: bool = False,
    text_tree: Optional[TextTree] = None,
    embed: Optional[Embed] = None,
    skip: Iterable[str] = SKIP_TAGS,
    title: bool = True,
    main_only: bool = False,
    image_token: str = "[IMG]",
    empty_token: Optional[str] = "[EMPTY]",
    max_depth: int = 256,
    max_children: Optional[int] = 512,
) -> NestedSignal:
    r"""A website as a ``graph`` family of page trees, linked by their hyperlinks.

    The root (geometry ``graph``) has one child per page, in the order given, each the
    :func:`html_tree` of the page (position: the page's index); ``sibling_edge_index``
    ``[2, E]`` holds the root node ids ``(a, b)`` of each pair of distinct pages where
    page ``a`` links to page ``b``, sorted.

    Links, when ``links`` is ``None``: every ``<a href>`` and ``<area href>`` of a page,
    including those inside skipped parts such as ``<nav>``, resolved against the
    page's URL (or its ``<base href>``) with :func:`urllib.parse.urljoin`; fragments
    are dropped and scheme and host compared case-insensitively (paths are
    case-sensitive). Links to URLs outside ``pages`` are ignored; links from a page to
    itself are dropped (a sibling edge joins two different pages); repeated links
    count once. Given ``links``: pairs of page URLs or page indices; an unknown URL or
    an index out of range is a ``ValueError``; self-links are dropped.

    Args:
        pages: ``{url: html}`` or ``(url, html)`` pairs; URLs may be relative
            (``"index.html"``). Two URLs that are the same page after
            normalisation are a ``ValueError``.
        links: optional explicit hyperlinks, see above.
        undirected: also add every edge reversed.
        empty_token: the token of a page with no content (``None``: raise); by
            default such a page is one leaf, so that it keeps its place in the graph.
        text_tree, embed, skip, title, main_only, image_token, max_depth, max_children:
            as in :func:`html_tree`, for every page.

    Example:
        >>> site = website_tree({
        ...     "https://x.org/": '<p>Home. See <a href="about.html">about</a>.</p>',
        ...     "https://x.org/about.html": '<p>About us.</p><a href="/#top">home</a>'})
        >>> site.geometry_names()[0], site.sibling_edge_index.tolist()
        ('graph', [[1, 9], [9, 1]])
    """
    items = list(pages.items()) if isinstance(pages, Mapping) else list(pages)
    if not items:
        raise ValueError("website_tree needs at least one page")
    index: Dict[str, int] = {}
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"page {i} must be a (url, html) pair, got {item!r:.60}")
        url, html = item
        if not isinstance(url, str):
            raise TypeError(f"page {i}: the URL must be a str, got {type(url).__name__}")
        if not isinstance(html, str):
            raise TypeError(f"page {url!r}: html must be a str, got {type(html).__name__}")
        try:
            key = _normalise_url(url)
        except ValueError as error:  # urlsplit: "Invalid IPv6 URL", bad port...
            raise ValueError(f"page {i}: the URL {url!r:.80} is malformed ({error})") from None
        if key in index:
            raise ValueError(f"duplicate page URL: {url!r} is the same page as "
                             f"{items[index[key]][0]!r}")
        index[key] = i
    trees, found = [], []
    for i, (url, html) in enumerate(items):
        tree, page = _page_tree(html, text_tree, embed, skip, title, main_only, image_token,
                                empty_token, max_depth, max_children)
        trees.append(tree)
        if links is None:
            base = _resolve(url, page.base) if page.base else url
            for href in page.links:
                # a malformed href (a browser ignores it, as html_tree does) links nowhere
                target = _resolve(base or url, href)
                j = index.get(target) if target is not None else None
                if j is not None:
                    found.append((i, j))
    if links is not None:
        for link in links:
            if not (isinstance(link, (tuple, list)) and len(link) == 2):
                raise TypeError(f"each link must be a pair (from, to), got {link!r:.60}")
            a, b = link
            found.append((_page_index(a, index, len(items)), _page_index(b, index, len(items))))
    edges = {(a, b) for a, b in found if a != b}
    if undirected:
        edges |= {(b, a) for a, b in edges}
    return NestedSignal.join(trees, "graph", sibling_edges=sorted(edges))


def _resolve(base: str, href: str) -> Optional[str]:
    """The normalised URL of ``href`` on a page at ``base``; ``None`` when either is
    malformed (``urllib`` raises ValueError on e.g. ``http://[::1``)."""
    try:
        return _normalise_url(urljoin(base, href))
    except ValueError:
        return None


def _page_index(page: Union[str, int], index: Dict[str, int], n: int) -> int:
    if isinstance(page, str):
        try:
            key = _normalise_url(page)
        except ValueError as error:
            raise ValueError(f"link to {page!r:.80}, a malformed URL ({error})") from None
        j = index.get(key)
        if j is None:
            raise ValueError(f"link to {page!r}, which is not one of the pages")
        return j
    if isinstance(page, (int, np.integer)) and not isinstance(page, bool):
        if not 0 <= int(page) < n:
            raise ValueError(f"link to page index {page}, out of range ({n} pages)")
        return int(page)
    raise TypeError(f"a link end must be a URL or a page index, got {type(page).__name__}")
