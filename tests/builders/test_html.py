"""Web pages and websites as nested signals (hsa_graph.builders.html).

Real pages: the libffi manual, the libxslt API reference and a Node.js API page, copied
from Debian packages into tests/data/html (sources and licences in its README.md)."""
import re
import time
from pathlib import Path

import pytest
import torch
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph import NestedSignal
from hsa_graph.builders.html import SKIP_TAGS, hash_tokens, html_tree, website_tree
from hsa_graph.builders.html_parse import _parse
from hsa_graph.builders.text import WordTokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "html"
LIBFFI = sorted((DATA / "libffi").glob("*.html"))


class Vocab:
    """An ``embed`` that numbers tokens as it meets them, so trees can be read back."""

    def __init__(self):
        self.words, self.index = [], {}

    def __call__(self, tokens):
        for t in tokens:
            if t not in self.index:
                self.index[t] = len(self.words)
                self.words.append(t)
        return torch.tensor([self.index[t] for t in tokens], dtype=torch.long)


def read(tree, vocab):
    """The tree as nested lists of token strings (iterative: trees may be deep)."""
    parent = tree.parent.tolist()
    kids = [[] for _ in parent]
    for u, p in enumerate(parent):
        if p >= 0:
            kids[p].append(u)
    leaf_word = dict(zip(tree.leaf_index.tolist(), (vocab.words[i] for i in tree.x.tolist())))
    value = {}
    for u in reversed(range(len(parent))):   # children have larger ids than parents
        value[u] = leaf_word[u] if not kids[u] else [value[c] for c in kids[u]]
    roots = [u for u, p in enumerate(parent) if p < 0]
    return value[roots[0]]


def tokens(tree, vocab):
    return [vocab.words[i] for i in tree.x.tolist()]


def page(html, **kwargs):
    vocab = Vocab()
    tree = html_tree(html, embed=vocab, **kwargs)
    return tree, vocab


def children(tree, u):
    return (tree.parent == u).nonzero().flatten().tolist()


def words(sentence):
    """Tokens as the builder makes them (the text builder's tokenizer, tested in
    test_text.py); the expectations below fix the sentence and block structure."""
    return WordTokenizer()(sentence)


# ----------------------------------------------------------------- real pages
def test_libffi_page_structure():
    """Introduction.html: title, the texinfo navigation header, then the chapter as a
    heading section (heading + four paragraphs), each paragraph split in sentences."""
    tree, vocab = page((DATA / "libffi" / "Introduction.html").read_text())
    title, body = read(tree, vocab)
    assert title == words("Introduction ( libffi : the portable foreign function interface "
                          "library )")
    header, chapter = body
    assert header == words("Next : Using libffi , Previous : libffi , Up : libffi [ Index ]")
    heading, *paragraphs = chapter
    assert heading == words("1 What is libffi ?")
    assert len(paragraphs) == 4
    assert paragraphs[0][:3] == [
        words("Compilers for high level languages generate code that follow certain "
              "conventions ."),
        words("These conventions are necessary , in part , for separate compilation to "
              "work ."),
        words("One such convention is the calling convention .")]
    assert paragraphs[3][0] == words("FFI stands for Foreign Function Interface .")
    assert len(paragraphs[3]) == 4
    # every leaf is a token of the page text, in document order
    flat = tokens(tree, vocab)
    assert flat[:2] == ["Introduction", "("] and flat[-3:] == ["two", "languages", "."]
    assert (tree.modality == 0).all()
    assert tree.geometry_names()[0] == "sequence"


def test_libffi_lists_and_pre():
    """Using-libffi.html has a table-of-contents list; Simple-Example.html code in <pre>,
    one sentence per line."""
    tree, vocab = page((DATA / "libffi" / "Using-libffi.html").read_text())
    toc = read(tree, vocab)[1][1][1]
    assert toc == [words("The Basics"), words("Simple Example"), "Types",
                   words("Multiple ABIs"), words("The Closure API"),
                   words("Closure Example"), words("Thread Safety")]
    tree, vocab = page((DATA / "libffi" / "Simple-Example.html").read_text())
    heading, intro, code = read(tree, vocab)[1][1]
    assert heading == words("2.2 Simple Example")
    assert intro == words("Here is a trivial example that calls puts a few times .")
    assert len(code) == 27                  # one sentence per line of the <pre>
    assert code[:4] == [words("# include < stdio.h >"), words("# include < ffi.h >"),
                        words("int main ( )"), "{"]
    assert code[-2:] == [words("return 0 ;"), "}"]


def _sentences_of(nested):
    """All lists of strings in a nested reading."""
    out, stack = [], [nested]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            if all(isinstance(i, str) for i in item):
                out.append(item)
            else:
                stack.extend(item)
    return out


def test_pre_lines_are_sentences():
    html = (DATA / "nodejs" / "synopsis.html").read_text()
    tree, vocab = page(html, main_only=True)
    sentences = _sentences_of(read(tree, vocab))
    assert words("const hostname = ' 127.0.0.1 ' ;") in sentences
    assert words("const port = 3000 ;") in sentences
    assert words("mkdir ~ / projects") in sentences and words("cd ~ / projects") in sentences


def test_nodejs_noise_is_skipped():
    """script, style, svg, buttons, hidden elements and role=navigation are skipped;
    main_only keeps the title and the <div role=main> only."""
    html = (DATA / "nodejs" / "synopsis.html").read_text()
    tree, vocab = page(html)
    flat = tokens(tree, vocab)
    for noise in ("storedTheme", "matchMedia", "copy", "Toggle", "M0"):
        assert noise not in flat
    assert "Skip" in flat                 # the visible skip link stays
    assert flat.count("Assertion") == 1   # the header's copy of the index; not the nav's
    tree, vocab = page(html, main_only=True)
    title, (heading, usage, example) = read(tree, vocab)
    assert title == words("Usage and example | Node.js v20.20.2 Documentation")
    assert heading == words("Usage and example #")
    assert usage == [words("Usage #"),
                     words("node [ options ] [ V8 options ] [ script.js | - e \" script \" | "
                           "- ] [ arguments ]"),
                     words("Please see the Command-line options document for more "
                           "information .")]
    assert example[0] == words("Example #")
    assert "Assertion" not in tokens(tree, vocab)


def test_libxslt_tables_are_grids_and_images_modality_one():
    tree, vocab = page((DATA / "libxslt" / "libxslt-attributes.html").read_text())
    names = tree.geometry_names()
    grids = [u for u, g in enumerate(names) if g == "grid"]
    assert len(grids) == 5          # the navigation bar and four parameter tables
    nav = grids[0]
    cells = children(tree, nav)
    assert [tuple(tree.position[c].tolist()) for c in cells] == [(0, 0), (0, 1), (0, 2),
                                                                  (0, 3)]
    leaf_row = {u: i for i, u in enumerate(tree.leaf_index.tolist())}
    assert [vocab.words[int(tree.x[leaf_row[c]])] for c in cells[:3]] == ["Up", "Home",
                                                                          "Next"]
    assert tree.modality[cells[:3]].tolist() == [1, 1, 1]
    assert int(tree.modality.sum()) == 3                 # only the three images
    # a parameter table: name cells in column 0, descriptions in column 1
    params = grids[1]
    positions = [tuple(tree.position[c].tolist()) for c in children(tree, params)]
    assert positions == [(r, c) for r in range(4) for c in range(2)]


def test_libffi_pages_and_real_site_build():
    for path in LIBFFI:
        tree, vocab = page(path.read_text())
        assert tree.num_leaves > 30
        assert tree.structure.max_depth < 10
        # leaves come out in document order: the title comes first
        title = re.search(r"<title>([^<]*)</title>", path.read_text()).group(1)
        assert tokens(tree, vocab)[:2] == re.findall(r"\w+|[^\w\s]", title)[:2]


# ----------------------------------------------------------- structure rules
def test_implied_end_tags_and_nesting():
    tree, vocab = page("<ul><li>one<li>two <b>bold</b><li>three</ul>"
                       "<p>first<p>second<div>block</div>")
    assert read(tree, vocab) == [["one", ["two", "bold"], "three"], "first", "second",
                                 "block"]


def test_wrappers_collapse():
    wrapped, v1 = page("<html><body><div><div><section><div><p>Hello world .</p></div>"
                       "</section></div></div></body></html>")
    plain, v2 = page("Hello world .")
    assert read(wrapped, v1) == read(plain, v2) == ["Hello", "world", "."]
    assert wrapped.num_nodes == plain.num_nodes == 4


def test_heading_sections_nest_by_level():
    tree, vocab = page("<h1>A</h1><p>a1</p><h2>B</h2><p>b1</p><p>b2</p><h3>C</h3><p>c1</p>"
                       "<h2>D</h2><p>d1</p><h1>E</h1><p>e1</p>")
    assert read(tree, vocab) == [
        ["A", "a1", ["B", "b1", "b2", ["C", "c1"]], ["D", "d1"]],
        ["E", "e1"]]


def test_content_before_first_heading_stays_outside():
    tree, vocab = page("<p>intro</p><h2>B</h2><p>b1</p>")
    assert read(tree, vocab) == ["intro", ["B", "b1"]]


def test_table_grid_with_spans_caption_and_sections():
    html = ("<table><caption>Cap</caption><thead><tr><th>h1<th>h2<th>h3</thead>"
            "<tbody><tr><td rowspan=2>a<td colspan=2>b"
            "<tr><td>c<td>d</tbody></table>")
    tree, vocab = page(html)
    caption, grid = read(tree, vocab)
    assert caption == "Cap" and grid == ["h1", "h2", "h3", "a", "b", "c", "d"]
    grid_node = tree.geometry_names().index("grid")
    cells = children(tree, grid_node)
    assert [tuple(tree.position[c].tolist()) for c in cells] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 1), (2, 2)]


def test_table_of_one_cell_is_its_content():
    tree, vocab = page("<table><tr><td></td><td>only cell</td></tr></table>")
    assert read(tree, vocab) == ["only", "cell"]
    assert "grid" not in tree.geometry_names()


def test_images():
    tree, vocab = page('<p>See <img src="a.png" alt="a red  fox"> and <img src="b.png">'
                       '<img src="c.png" alt="x" hidden></p>', image_token="<image>")
    assert read(tree, vocab) == ["See", ["a", "red", "fox"], "and", "<image>"]
    mod = dict(zip(tokens(tree, vocab), tree.modality[tree.leaf_index].tolist()))
    assert mod == {"See": 0, "a": 1, "red": 1, "fox": 1, "and": 0, "<image>": 1}
    fox_node = tree.parent[tree.leaf_index[1]]
    assert int(tree.modality[fox_node]) == 1 and int(tree.modality[0]) == 0


def test_positions_are_indices_among_siblings():
    tree, _ = page("<p>a b c .</p><p>d e .</p>")
    for u in range(1, tree.num_nodes):
        siblings = children(tree, int(tree.parent[u]))
        assert tree.position[u].tolist() == [siblings.index(u), 0]
    assert tree.position[0].tolist() == [-1, -1]


def test_sentence_splitting():
    text = ('Dr. Smith paid $3.50 for it, i.e. a bargain. "Really?" she asked. '
            'J. R. R. Tolkien wrote it... Then it ended! Was it 5 p.m.? Yes. '
            'It was 3 a.m. Nobody knew. 日本語です。次の文。')
    tree, vocab = page(f"<p>{text}</p>")
    # the text builder's splitter (tested on real reviews in test_text.py)
    assert read(tree, vocab) == [words(s) for s in [
        "Dr. Smith paid $3.50 for it, i.e. a bargain.",
        '"Really?" she asked.',
        "J. R. R. Tolkien wrote it...",
        "Then it ended!",
        "Was it 5 p.m.?",
        "Yes.",
        "It was 3 a.m.",
        "Nobody knew.",
        "日本語です。",
        "次の文。"]]


def test_line_breaks_and_whitespace():
    tree, vocab = page("<p>first   line<br>second\n\t line<br/>third</p>")
    assert read(tree, vocab) == [["first", "line"], ["second", "line"], "third"]


def test_entities_are_decoded():
    tree, vocab = page("<p>caf&eacute; &amp; cr&#232;me &lt;b&gt; &nbsp;x</p>")
    assert tokens(tree, vocab) == ["café", "&", "crème", "<", "b", ">", "x"]


def test_max_children_chunks_wide_families():
    items = "".join(f"<li>item {i}</li>" for i in range(10))
    tree, vocab = page(f"<ul>{items}</ul>", max_children=4)
    nested = read(tree, vocab)
    assert len(nested) == 3 and [len(c) for c in nested] == [4, 4, 2]
    assert sum(nested, []) == [["item", str(i)] for i in range(10)]
    # a long sentence is cut into pieces, a long run into chunks of sentences
    tree, vocab = page("<p>" + "w " * 9 + "</p>", max_children=3)
    assert read(tree, vocab) == [["w"] * 3] * 3
    # every family is at most max_children wide
    tree, _ = page("<p>" + "w " * 5000 + "</p>" + "<p>x</p>" * 700)
    fam = torch.bincount(tree.parent[tree.parent >= 0])
    assert int(fam.max()) <= 512 and tree.num_leaves == 5700
    tree, _ = page("<p>" + "w " * 5000 + "</p>", max_children=None)
    assert int(torch.bincount(tree.parent[tree.parent >= 0]).max()) == 5000


def test_max_children_cuts_big_tables_into_row_bands():
    rows = "".join(f"<tr><td>a{r}<td>b{r}<td>c{r}" for r in range(5))
    tree, vocab = page(f"<table>{rows}<tr>" + "<td>x" * 6 + "</table>", max_children=4)
    nested = read(tree, vocab)
    assert nested == [[["a0", "b0", "c0"], ["a1", "b1", "c1"], ["a2", "b2", "c2"],
                       ["a3", "b3", "c3"]],
                      [["a4", "b4", "c4"], ["x"] * 4, ["x"] * 2]]
    grids = [u for u, g in enumerate(tree.geometry_names()) if g == "grid"]
    assert len(grids) == 7
    for g in grids[:5]:          # whole rows, counted from the band's first row
        assert [tuple(tree.position[c].tolist()) for c in children(tree, g)] == [
            (0, 0), (0, 1), (0, 2)]
    assert [tree.position[c].tolist() for c in children(tree, grids[6])] == [[0, 4], [0, 5]]
    assert int(torch.bincount(tree.parent[tree.parent >= 0]).max()) <= 4


def test_custom_skip_and_title_options():
    html = "<title>T</title><header>menu</header><p>body</p>"
    tree, vocab = page(html)
    assert read(tree, vocab) == ["T", "menu", "body"]
    tree, vocab = page(html, skip=SKIP_TAGS | {"header"}, title=False)
    assert read(tree, vocab) == "body"


# ------------------------------------------------------------- leaf features
def test_default_leaves_are_stable_hashed_ids():
    tree = html_tree("<p>Cats purr. cats</p>")
    assert tree.x.dtype == torch.long
    assert tree.x.tolist() == hash_tokens(["Cats", "purr", ".", "cats"]).tolist()
    assert tree.x[0] == tree.x[3] and int(tree.x.max()) < 2 ** 18
    assert hash_tokens(["a", "ä"], 7).tolist() == WordTokenizer(num_buckets=7).token_ids(
        ["a", "ä"])


def test_embed_vectors():
    table = torch.randn(100, 8)

    def embed(toks):
        return table[hash_tokens(toks, 100)]

    tree = html_tree("<p>a b .</p><p>c</p>", embed=embed)
    assert tree.x.shape == (4, 8)
    assert torch.equal(tree.x[3], table[hash_tokens(["c"], 100)[0]])
    with pytest.raises(ValueError, match="one row per token"):
        html_tree("<p>a b</p>", embed=lambda toks: torch.zeros(len(toks) + 1, 3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        html_tree("<p>a b</p>", embed=lambda toks: [0] * len(toks))


def test_text_tree_callable_is_spliced():
    calls = []

    def text_tree(text):
        calls.append(text)
        sentences = [s.split() for s in text.split(".") if s.strip()]
        return NestedSignal.from_nested([[torch.full((3,), float(len(w))) for w in s]
                                         for s in sentences])

    tree = html_tree("<title>Hi there</title><p>one two. three</p>"
                     "<img src=x alt='big dog'><img src=y><pre>\nline</pre>",
                     text_tree=text_tree, image_token="IMG")
    assert calls == ["Hi there", "one two. three", "big dog", "IMG", "line"]
    # leaves: Hi there | one two | three | big dog | IMG | line (x = word length)
    assert tree.x.shape == (9, 3)
    assert tree.x[:, 0].tolist() == [2, 5, 3, 3, 5, 3, 3, 3, 4]
    assert tree.modality[tree.leaf_index].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0]
    # the subtrees keep their own shape: 'one two. three' is two sentences
    p_root = children(tree, 0)[1]
    assert [len(children(tree, c)) for c in children(tree, p_root)] == [2, 1]


def test_text_tree_root_anywhere_and_in_grid_cells():
    def text_tree(text):            # the root is node 1, between its two leaves
        return NestedSignal.from_parents([1, -1, 1], x=torch.tensor([[len(text)], [0.0]]))

    tree = html_tree("<table><tr><td>ab<td>abc</table>", text_tree=text_tree)
    grid = tree.geometry_names().index("grid")
    cells = children(tree, grid)
    assert [tree.position[c].tolist() for c in cells] == [[0, 0], [0, 1]]
    assert [tree.x[tree.leaf_index.tolist().index(children(tree, c)[0])].item()
            for c in cells] == [2, 3]
    assert tree.x[:, 0].tolist() == [2, 0, 3, 0]


def test_text_tree_errors():
    with pytest.raises(TypeError, match="must return a NestedSignal"):
        html_tree("<p>x</p>", text_tree=lambda s: [1, 2])
    forest = NestedSignal.from_parents([-1, -1], x=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="forest"):
        html_tree("<p>x</p>", text_tree=lambda s: forest)
    shapes = iter([1, 2])
    with pytest.raises(ValueError, match="x of shape"):
        html_tree("<p>x</p><p>y</p>", text_tree=lambda s: NestedSignal.from_nested(
            [torch.zeros(next(shapes))]))
    with pytest.raises(TypeError, match="callable"):
        html_tree("<p>x</p>", text_tree="not callable")


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize("html", ["", "   \n ", "<html><head></head><body></body></html>",
                                  "<script>alert(1)</script><style>p{}</style>",
                                  "<!-- only a comment -->", "<nav>menu</nav>"])
def test_empty_pages(html):
    with pytest.raises(ValueError, match="no content"):
        html_tree(html)
    tree, vocab = page(html, empty_token="[EMPTY]")
    assert tree.num_nodes == 1 and tokens(tree, vocab) == ["[EMPTY]"]


def test_plain_text_without_tags():
    tree, vocab = page("Just some text. No tags at all")
    assert read(tree, vocab) == [["Just", "some", "text", "."], ["No", "tags", "at", "all"]]


@pytest.mark.parametrize("value", [None, b"<p>x</p>", 3, ["<p>x</p>"]])
def test_non_str_input(value):
    with pytest.raises(TypeError, match="html must be a str"):
        html_tree(value)


def test_malformed_html():
    cases = {
        # unclosed tags everywhere
        "<div><p>one<p>two<ul><li>three<li>four": ["one", "two", ["three", "four"]],
        # stray end tags are ignored
        "</div></p>text</span></li> more</table>": ["text", "more"],
        # mis-nested inline/block: </b> does not close the <p> opened inside it
        "<b><p>bold para</b> rest</p><p>next</p>": [["bold", "para", "rest"], "next"],
        # unterminated tag, comment, declaration and marked section at the end
        "<p>a</p><p>b <div": ["a", ["b", "<", "div"]],
        # a <!-- that nothing closes is text (not a comment hiding the rest)
        "<p>a</p><!-- never closed <p>hidden": ["a", ["<", "!", "-", "-", "never", "closed"],
                                                "hidden"],
        # marked sections are bogus comments, as in browsers (no crash in html.parser)
        "<p>x<![CDATA[ y ]]>z</p>": "xz",
        "<p>x<![if !IE]>y<![endif]>z</p>": "xyz",
        "<p>a < b and c > d</p>": ["a", "<", "b", "and", "c", ">", "d"],
        "<td>cell without table</td><tr>row</tr>": [["cell", "without", "table"], "row"],
        "<p>x</p></body></html><p>after end</p>": ["x", ["after", "end"]],
        # a second <body> merges into the first, as in browsers: the text runs on
        "<html><body>one</body><body> two</body></html>": ["one", "two"],
        "<html><body>one</body><body>two</body></html>": "onetwo",
        "<head><title>T</title><p>body without body tag": ["T", ["body", "without", "body",
                                                                 "tag"]],
        "<div/>x<br/>y<p/>z": [["x", "y"], "z"],   # <x/> is an empty element
    }
    for html, expected in cases.items():
        tree, vocab = page(html)
        assert read(tree, vocab) == expected, html


def test_deep_nesting_has_no_recursion_limit():
    n = 10_000
    html = "<div>x " * n + "</div>" * n
    start = time.perf_counter()
    tree, vocab = page(html)
    assert time.perf_counter() - start < 20
    assert tree.num_leaves == n
    # blocks beyond max_depth (256) are read as inline lines of their ancestor
    assert 250 <= tree.structure.max_depth <= 260
    tree, _ = page("<ul><li>" * n + "deep" + "</li></ul>" * n)
    assert tree.num_nodes == 1                          # wrappers collapse entirely
    tree, _ = page("<div>a " * 600, max_depth=1000)  # no cap: depth follows the page
    assert tree.structure.max_depth == 598   # the innermost <div> is a single leaf
    with pytest.raises(ValueError, match="max_depth"):
        html_tree("<p>x</p>", max_depth=0)


def test_entity_flood():
    start = time.perf_counter()
    tree, vocab = page("<p>" + "&amp;" * 100_000 + "</p>")
    assert time.perf_counter() - start < 20
    assert tree.num_leaves == 100_000 and set(vocab.words) == {"&"}
    assert int(torch.bincount(tree.parent[tree.parent >= 0]).max()) <= 512


def test_one_megabyte_single_line_page():
    html = (DATA / "nodejs" / "synopsis.html").read_text()
    body = html.split("<body", 1)[1].split(">", 1)[1].split("</body>")[0]
    body = re.sub(r"\s*\n\s*", " ", body)
    copies = 1_000_000 // len(body) + 1
    html = "<html><body>" + body * copies + "</body></html>"
    assert len(html) > 1_000_000 and "\n" not in html
    start = time.perf_counter()
    tree = html_tree(html)
    assert time.perf_counter() - start < 30
    one = html_tree("<html><body>" + body + "</body></html>")
    assert tree.num_leaves == one.num_leaves * copies
    assert torch.equal(tree.x[:one.num_leaves], one.x)


@pytest.mark.parametrize("unit, text", [
    ("</", "</"), ("<!", "<!"), ("<!-- >", None), ("<?", "<?"), ("<![", "<!["),
    ("<a b='", "<a b='"), ("<", "<")])
def test_markup_that_never_closes_is_linear(unit, text):
    """Markup that never closes: html.parser took quadratic time on these (four minutes
    for 1 MB of '</', a minute for 500 kB) or raised AssertionError ('<!['). Now linear,
    and read as text (a ``<`` that no ``>`` follows) or as a bogus comment, like
    browsers do."""
    html = unit * (500_000 // len(unit))
    start = time.perf_counter()
    parsed = _parse(html, SKIP_TAGS, 256)
    assert time.perf_counter() - start < 10
    runs = [t for t, k in zip(parsed.text, parsed.kind) if k == 1]
    if text is None:   # '<!-- >' twice is a comment ('-- >' closes it); an odd last one: text
        assert runs in ([], ["<!-- >"])
    else:
        assert runs == [text * (500_000 // len(unit))]
    tree, vocab = page(unit * 50, empty_token="[EMPTY]")
    if text is not None:
        assert "".join(tokens(tree, vocab)) == (unit * 50).replace(" ", "")


def test_bad_options():
    with pytest.raises(ValueError, match="max_children"):
        html_tree("<p>x</p>", max_children=1)
    with pytest.raises(TypeError, match="embed must be callable"):
        html_tree("<p>x</p>", embed=3)
    with pytest.raises(TypeError, match="collection of tag names"):
        html_tree("<p>x</p>", skip="nav")
    with pytest.raises(TypeError, match="pair"):
        website_tree({"a.html": "<p>x</p>"}, links=[(0, 0, 0)])


# ------------------------------------------------------------------- websites
def libffi_site(names=None):
    paths = [p for p in LIBFFI if names is None or p.stem in names]
    return {f"https://example.org/libffi/{p.name}": p.read_text() for p in paths}


def expected_links(pages):
    """An independent reading of the links: <a href="X"> with X one of the page names."""
    names = [url.rsplit("/", 1)[1] for url in pages]
    edges = set()
    for i, html in enumerate(pages.values()):
        for href in re.findall(r'<a [^>]*href="([^"#]*)', html):
            if href in names and names.index(href) != i:
                edges.add((i, names.index(href)))
    return edges


def page_roots(site):
    roots = children(site, 0)
    assert site.position[roots, 0].tolist() == list(range(len(roots)))
    return roots


def test_website_links_between_real_pages():
    pages = libffi_site()
    site = website_tree(pages)
    roots = page_roots(site)
    assert site.geometry_names()[0] == "graph" and len(roots) == len(pages) == 10
    page_of = {r: i for i, r in enumerate(roots)}
    edges = {(page_of[a], page_of[b]) for a, b in site.sibling_edge_index.t().tolist()}
    assert edges == expected_links(pages)
    names = [url.rsplit("/", 1)[1] for url in pages]
    intro, using = names.index("Introduction.html"), names.index("Using-libffi.html")
    assert (intro, using) in edges and (using, intro) in edges
    # Index.html is linked from every page but is not in the set: ignored;
    # index.html links to itself (#Top): dropped
    assert all(a != b for a, b in edges)
    # each page's leaves are its own html_tree's, in page order
    offset = 0
    for html in pages.values():
        alone = html_tree(html)
        assert torch.equal(site.x[offset:offset + alone.num_leaves], alone.x)
        offset += alone.num_leaves
    assert offset == site.num_leaves


def test_website_hsa_respects_page_blocks():
    """The paper's website example end to end: a graph family of page trees, HSA over
    it, and the attention between two pages constant over their leaves."""
    pages = libffi_site({"Multiple-ABIs", "Missing-Features", "Thread-Safety", "Types"})
    site = website_tree(pages)
    roots = page_roots(site)
    assert len(roots) == 4
    n = site.num_leaves
    torch.manual_seed(0)
    emb = torch.randn(2 ** 18, 16) * 0.5
    q = emb[site.x].view(n, 2, 8)
    k = torch.roll(emb[site.x], 1, -1).view(n, 2, 8)
    v = torch.randn(n, 2, 4, dtype=torch.float64)
    theta = hsa_graph.hsa_weights(q.double(), k.double(), site)
    assert torch.allclose(theta.sum(-1), torch.ones(2, n, dtype=torch.float64))
    y = hsa_graph.hsa(q.double(), k.double(), v, site)
    assert torch.allclose(y, torch.einsum("hij,jhd->ihd", theta, v), atol=1e-10)
    # leaf ranges of the pages
    sizes = [html_tree(html).num_leaves for html in pages.values()]
    bounds = torch.tensor([0] + sizes).cumsum(0).tolist()
    for a in range(4):
        for b in range(4):
            block = theta[:, bounds[a]:bounds[a + 1], bounds[b]:bounds[b + 1]]
            if a != b:   # one value per head for the whole page-to-page block
                assert torch.allclose(block, block[:, :1, :1].expand_as(block))
                assert (block > 0).all()
    # within a page, attention is not constant (the page structure is finer)
    inner = theta[0, bounds[0]:bounds[1], bounds[0]:bounds[1]]
    assert inner.std() > 0


def test_website_hsa_full_site_is_block_invariant():
    """On the whole site, with the fast operator: permuting the values inside one page
    leaves every other page's outputs unchanged (they see its leaves as one block)."""
    pages = libffi_site()
    site = website_tree(pages)
    n = site.num_leaves
    torch.manual_seed(1)
    q, k, v = torch.randn(3, n, 2, 8).unbind(0)
    y = hsa_graph.hsa(q, k, v, site)
    roots = page_roots(site)
    counts = [int(site.is_leaf[_subtree(site, r)].sum()) for r in roots]
    bounds = torch.tensor([0] + counts).cumsum(0).tolist()
    lo, hi = bounds[2], bounds[3]
    v2 = v.clone()
    v2[lo:hi] = v[lo:hi][torch.randperm(hi - lo)]
    y2 = hsa_graph.hsa(q, k, v2, site)
    outside = torch.ones(n, dtype=torch.bool)
    outside[lo:hi] = False
    assert torch.allclose(y[outside], y2[outside], atol=1e-5)
    assert not torch.allclose(y[lo:hi], y2[lo:hi], atol=1e-3)
    # a batch of a site and a page is a forest: the site's outputs do not change
    batch = Batch.from_data_list([site, html_tree(next(iter(pages.values())))])
    m = batch.num_leaves
    extra = torch.randn(m - n, 2, 8)
    yb = hsa_graph.hsa(torch.cat([q, extra]), torch.cat([k, extra]), torch.cat([v, extra]),
                       batch)
    assert torch.allclose(yb[:n], y, atol=1e-5)


def _subtree(tree, root):
    mask = torch.zeros(tree.num_nodes, dtype=torch.bool)
    mask[root] = True
    for _ in range(tree.structure.max_depth + 2):
        mask = mask | mask[tree.parent.clamp_min(0)] & (tree.parent >= 0)
    return mask


def test_website_url_resolution_and_base():
    pages = {
        "https://Example.org/docs/": '<p>Home <a href="guide/intro.html#s1">intro</a> '
                                     '<a href="https://other.org/">out</a> '
                                     '<a href="/docs/">self</a></p>',
        "https://example.org/docs/guide/intro.html": '<p>Intro <a href="../">up</a> '
                                                     '<a href="next.html">next</a></p>',
        "https://example.org/docs/guide/next.html": '<base href="https://example.org/docs/">'
                                                    '<p>Next <a href="guide/intro.html">back'
                                                    '</a></p>',
    }
    site = website_tree(pages)
    roots = page_roots(site)
    page_of = {r: i for i, r in enumerate(roots)}
    edges = sorted((page_of[a], page_of[b]) for a, b in site.sibling_edge_index.t().tolist())
    assert edges == [(0, 1), (1, 0), (1, 2), (2, 1)]
    undirected = website_tree(pages, links=[(0, 1)], undirected=True)
    assert undirected.sibling_edge_index.shape == (2, 2)


def test_website_relative_urls_and_explicit_links():
    pages = [("a.html", "<p>A</p>"), ("b.html", "<p>B <a href='a.html'>a</a></p>"),
             ("sub/c.html", "<p>C <a href='../b.html'>b</a></p>")]
    site = website_tree(pages)
    roots = page_roots(site)
    assert sorted(map(tuple, site.sibling_edge_index.t().tolist())) == [
        (roots[1], roots[0]), (roots[2], roots[1])]
    site = website_tree(pages, links=[("a.html", "sub/c.html"), (1, 1), (2, 0), (2, 0)])
    assert sorted(map(tuple, site.sibling_edge_index.t().tolist())) == [
        (roots[0], roots[2]), (roots[2], roots[0])]
    with pytest.raises(ValueError, match="not one of the pages"):
        website_tree(pages, links=[("a.html", "z.html")])
    with pytest.raises(ValueError, match="out of range"):
        website_tree(pages, links=[(0, 3)])
    with pytest.raises(TypeError, match="URL or a page index"):
        website_tree(pages, links=[(0, 1.0)])


def test_website_bad_input():
    with pytest.raises(ValueError, match="duplicate page URL"):
        website_tree([("https://x.org/a.html", "<p>1</p>"),
                      ("HTTPS://X.ORG/a.html#top", "<p>2</p>")])
    with pytest.raises(ValueError, match="duplicate page URL"):
        website_tree({"https://x.org": "<p>1</p>", "https://x.org/": "<p>2</p>"})
    # paths are case-sensitive: two different pages
    assert website_tree({"https://x.org/A.html": "<p>1</p>",
                         "https://x.org/a.html": "<p>2</p>"}).num_leaves == 2
    with pytest.raises(ValueError, match="at least one page"):
        website_tree({})
    with pytest.raises(TypeError, match="html must be a str"):
        website_tree({"a.html": None})
    with pytest.raises(TypeError, match="URL must be a str"):
        website_tree([(1, "<p>x</p>")])
    with pytest.raises(TypeError, match=r"\(url, html\) pair"):
        website_tree(["a.html"])
    # an empty page keeps its place in the graph as one leaf
    vocab = Vocab()
    site = website_tree({"a.html": "<p>A <a href=b.html>b</a></p>", "b.html": ""},
                        embed=vocab)
    roots = page_roots(site)
    assert vocab.words[int(site.x[-1])] == "[EMPTY]" and site.is_leaf[roots[1]]
    assert site.sibling_edge_index.tolist() == [[roots[0]], [roots[1]]]
    with pytest.raises(ValueError, match="no content"):
        website_tree({"a.html": "<p>A</p>", "b.html": ""}, empty_token=None)


def test_website_with_malformed_links_and_urls():
    """A malformed href (``http://[::1``: urllib raises "Invalid IPv6 URL") links
    nowhere, as html_tree ignores it; a malformed page URL or link end is named."""
    page = '<p>Hi <a href="http://[::1">bad</a> <a href="b.html">b</a></p>'
    assert html_tree(page).num_leaves > 0
    site = website_tree({"https://x.org/": page,
                         "https://x.org/b.html": '<base href="http://[x"><a href="/">home</a>'})
    roots = site.sibling_edge_index.tolist()
    assert len(roots[0]) == 2 and roots[0] == roots[1][::-1]   # a <-> b, nothing else
    with pytest.raises(ValueError, match=r"page 1: the URL 'http://\[::1' is malformed"):
        website_tree({"https://x.org/": page, "http://[::1": "<p>x</p>"})
    with pytest.raises(ValueError, match=r"link to 'http://\[::1', a malformed URL"):
        website_tree({"https://x.org/": page}, links=[("https://x.org/", "http://[::1")])
