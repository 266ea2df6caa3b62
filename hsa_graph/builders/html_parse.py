r"""Reading an HTML page into a flat content tree: the parser behind
:func:`~hsa_graph.builders.html.html_tree`.

``_Page`` drives the standard library's :mod:`html.parser` with an explicit stack
of open elements and the implied end tags of HTML5 that matter for structure, skips
hidden and ``skip`` elements, and records each block element and each text run or image
as a content node (the rules are in :mod:`hsa_graph.builders.html`, *Parsing* and
*Which elements make nodes*). It also collects the page's title, hyperlinks and
``<base href>`` for :func:`~hsa_graph.builders.website.website_tree`. Input that
:mod:`html.parser` would read in quadratic time is first rewritten in linear time.
"""
from __future__ import annotations

import bisect
import re
from html.parser import HTMLParser
from typing import Any, Dict, Iterable, List, Optional, Tuple

__all__ = ["BLOCK_TAGS", "SKIP_TAGS"]

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
_ELEMENT, _RUN = 0, 1

_WHITESPACE = re.compile(r"\s+")
_COMMENT_CLOSE = re.compile(r"--\s*>")


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
