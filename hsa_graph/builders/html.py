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

**Modules.** The builder is split by idea: :mod:`~hsa_graph.builders.html_parse`
reads the markup, :mod:`~hsa_graph.builders.html_content` shapes the content
(tables, sections, collapsing, chunking), :mod:`~hsa_graph.builders.html_text` turns
text runs into sentence and token nodes, :mod:`~hsa_graph.builders.html_assembly`
numbers the nodes into one tree, and :mod:`~hsa_graph.builders.website` joins pages
into a website.

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

from typing import Iterable, Optional

from ..signal import NestedSignal
from .html_assembly import _page_tree
from .html_parse import BLOCK_TAGS, SKIP_TAGS
from .html_text import Embed, TextTree, hash_tokens
from .website import website_tree

__all__ = ["BLOCK_TAGS", "SKIP_TAGS", "hash_tokens", "html_tree", "website_tree"]


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
