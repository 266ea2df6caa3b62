r"""Websites as nested signals: a ``graph`` family of page trees whose sibling edges
are the hyperlinks between the pages (the paper's website example).

:func:`website_tree` builds each page's tree as :func:`~hsa_graph.builders.html.html_tree`
does and joins them under one ``graph`` root; links come from the pages' ``<a href>``
and ``<area href>`` (resolved against each page's URL or ``<base href>``) or are given
explicitly. URLs are compared after normalisation (scheme and host lower-cased,
fragment dropped).
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Tuple, Union
from urllib.parse import urldefrag, urljoin, urlsplit, urlunsplit

import numpy as np

from ..signal import NestedSignal
from .html_assembly import _page_tree
from .html_parse import SKIP_TAGS
from .html_text import Embed, TextTree

__all__ = ["website_tree"]


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
