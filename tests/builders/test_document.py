"""Tests of hsa_graph/builders/document.py: a realistic news-article dict (real text:
the Zen of Python, public domain, shipped with Python; real image: matplotlib's sample
grace_hopper.jpg) and malformed documents."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import zlib

import numpy as np
import pytest
import torch
from matplotlib import cbook
from PIL import Image
from reference import dense_hsa
from torch_geometric.data import Batch

from hsa_graph import GEOMETRIES, NestedSignal, Node, hsa
from hsa_graph.builders.document import document_tree
from hsa_graph.builders.image import image_tree

D = 32  # the common leaf width of both modalities
CODE = {name: code for code, name in enumerate(GEOMETRIES)}


# --------------------------------------------------------- small real builders
WORD = re.compile(r"\w+(?:'\w+)?|[^\w\s]")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(A-Z0-9])")


def trigram_vector(token: str) -> torch.Tensor:
    """Hashed character trigrams of ``#token#``, L2-normalised: a tiny text embedding."""
    padded = f"#{token.lower()}#"
    v = torch.zeros(D)
    for i in range(max(1, len(padded) - 2)):
        v[zlib.crc32(padded[i:i + 3].encode()) % D] += 1.0
    return v / v.norm()


def text_builder(text: str) -> NestedSignal:
    """paragraphs (blank lines) -> sentences -> word tokens, leaves = trigram vectors."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    if not paragraphs:
        raise ValueError("the text is empty")
    nested = [[[trigram_vector(w) for w in WORD.findall(s)]
               for s in SENTENCE_END.split(" ".join(p.split())) if WORD.search(s)]
              for p in paragraphs]
    return NestedSignal.from_nested(nested)


PROJECTION = torch.randn(32 * 32 * 3, D, generator=torch.Generator().manual_seed(0)) / 50


def image_builder(image) -> NestedSignal:
    """32 x 32 patches projected to D features (a stand-in for a ViT patch embedding)."""
    return image_tree(image, 32, quadtree=True,
                      embed=lambda p: p.reshape(len(p), -1) @ PROJECTION)


@pytest.fixture(scope="module")
def zen() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen
        this = importlib.import_module("this")
    text = "".join(this.d.get(c, c) for c in this.s)  # rot13-decoded
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def article(zen, photo) -> dict:
    aphorisms = zen[1:]
    return {
        "headline": zen[0],  # "The Zen of Python, by Tim Peters"
        "abstract": " ".join(aphorisms[:3]),
        "image": photo,
        "caption": "Grace Hopper, who wrote the first compiler. She believed that code "
                   "should read like English.",
        "body": [" ".join(aphorisms[i:i + 3]) + "\n\n" + " ".join(aphorisms[i + 3:i + 5])
                 for i in (3, 8, 13)],  # 3 items of 2 paragraphs
        "tags": {"python", "design", "zen"},
        "meta": {"source": "PEP 20", "related": ["PEP 8. Style Guide."]},
    }


def subtree_nodes(tree: NestedSignal, root: int) -> list[int]:
    """Nodes of the subtree under ``root`` (independent: via networkx)."""
    import networkx as nx
    g = tree.to_networkx()
    return sorted([root, *nx.descendants(g, root)])


def field_roots(tree: NestedSignal, parent_node: int) -> list[int]:
    return (tree.parent == parent_node).nonzero().flatten().tolist()


# ------------------------------------------------------------------ the article
def test_news_article_structure(article):
    doc = document_tree(article, text=text_builder, image=image_builder)
    names = ["headline", "abstract", "image", "caption", "body", "tags", "meta"]
    assert doc.geometry_names()[0] == "keyvalue"
    assert doc.parent[0] == -1 and doc.structure.num_trees == 1
    roots = field_roots(doc, 0)
    assert [doc.key[u] for u in roots] == names
    assert doc.position[roots].tolist() == [[i, 0] for i in range(len(names))]
    field = dict(zip(names, roots))

    # each text / image field is exactly the tree its builder makes, spliced in
    for name in ["headline", "abstract", "caption", "image"]:
        alone = (image_builder if name == "image" else text_builder)(article[name])
        nodes = subtree_nodes(doc, field[name])
        assert len(nodes) == alone.num_nodes
        local = {u: i for i, u in enumerate(nodes)}
        expected_parent = alone.parent.tolist()
        got = [local.get(int(doc.parent[u]), -1) for u in nodes]
        assert got == expected_parent, name
        assert doc.geometry[nodes].tolist() == alone.geometry.tolist()
        inner = nodes[1:]  # below the field root the positions are the builder's
        assert doc.position[inner].tolist() == alone.position[1:].tolist()
        assert all(doc.key[u] is None for u in inner)
        leaves = [u for u in nodes if doc.geometry[u] == -1]
        rows = [int(r) for r in torch.searchsorted(doc.leaf_index, torch.tensor(leaves))]
        torch.testing.assert_close(doc.x[rows], alone.x)
        tag = 1 if name == "image" else 0
        assert doc.modality[nodes].tolist() == [tag] * len(nodes), name
    assert doc.geometry_names()[field["image"]] == "grid"

    body = field["body"]
    assert doc.geometry_names()[body] == "sequence"
    paragraphs = field_roots(doc, body)
    assert len(paragraphs) == len(article["body"]) == 3
    assert doc.position[paragraphs, 0].tolist() == [0, 1, 2]
    assert [doc.key[u] for u in paragraphs] == [None] * 3
    # each body item has 2 paragraphs (blank line) of sentences of words
    for p in paragraphs:
        assert len(field_roots(doc, p)) == 2

    tags = field["tags"]
    assert doc.geometry_names()[tags] == "set"
    members = field_roots(doc, tags)
    first_leaf = [subtree_nodes(doc, u)[-1] for u in members]  # one word each
    rows = torch.searchsorted(doc.leaf_index, torch.tensor(first_leaf))
    torch.testing.assert_close(doc.x[rows], torch.stack(
        [trigram_vector(w) for w in ["design", "python", "zen"]]))  # sorted members

    meta = field["meta"]
    assert doc.geometry_names()[meta] == "keyvalue"
    assert [doc.key[u] for u in field_roots(doc, meta)] == ["source", "related"]

    # modality: text containers 0, the mixed root gets mixed_modality (0)
    assert int(doc.modality[body]) == 0 and int(doc.modality[0]) == 0
    assert doc.x.shape[1] == D and doc.x.dtype == torch.float32
    # leaves in reading order: headline words first, then abstract, ...
    headline = text_builder(article["headline"]).x
    torch.testing.assert_close(doc.x[:len(headline)], headline)


def test_same_as_composing_with_join(zen, photo):
    """document_tree splices subtrees in one pass; the result is the tree that
    NestedSignal.join builds container by container."""
    document = {"headline": zen[0], "image": photo,
                "body": [zen[1], zen[2] + "\n\n" + zen[3]], "tags": {"b", "a"}}
    doc = document_tree(document, text=text_builder, image=image_builder)
    body = NestedSignal.join([text_builder(zen[1]), text_builder(zen[2] + "\n\n" + zen[3])],
                             "sequence")
    tags = NestedSignal.join([text_builder("a"), text_builder("b")], "set")
    image = image_builder(photo)
    image.modality = torch.ones_like(image.modality)
    joined = NestedSignal.join([text_builder(zen[0]), image, body, tags], "keyvalue",
                               keys=["headline", "image", "body", "tags"])
    for name in ["parent", "geometry", "position", "modality", "x", "sibling_edge_index"]:
        assert torch.equal(getattr(doc, name), getattr(joined, name)), name
    assert doc.key == joined.key


def test_hsa_runs_on_the_article(article):
    doc = document_tree(article, text=text_builder, image=image_builder)
    proj = torch.randn(D, 2, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q = torch.einsum("nd,dhe->nhe", doc.x.double(), proj)
    ones = torch.ones(doc.num_leaves, 2, 1, dtype=torch.float64)
    y = hsa(q, q, ones, doc, include_self=False)
    torch.testing.assert_close(y, ones)  # rows of theta sum to one
    out = hsa(q, q, q, doc)
    assert out.shape == q.shape and bool(out.isfinite().all())


def test_hsa_on_a_small_document_matches_dense_reference(zen, photo):
    small_image = lambda a: image_tree(a[::150, ::128], 2, embed=lambda p: p.reshape(  # noqa: E731
        len(p), -1) @ PROJECTION[:12])
    doc = document_tree({"headline": zen[0], "image": photo,
                         "body": [zen[1], zen[2] + " " + zen[3]]},
                        text=text_builder, image=small_image)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(doc.num_leaves, 2, 8, generator=g, dtype=torch.float64)
               for _ in range(3))
    torch.testing.assert_close(hsa(q, k, v, doc, include_self=False),
                               dense_hsa(doc.parent, q, k, v, include_self=False))


def test_batch_of_documents(zen, photo):
    docs = [document_tree({"title": zen[i], "image": photo[: 64 * (i + 1)]},
                          text=text_builder, image=image_builder) for i in range(2)]
    batch = Batch.from_data_list(docs)
    assert batch.num_leaves == sum(d.num_leaves for d in docs)
    assert batch.key[0][1] == "title" and batch.key[1][1] == "title"
    q = batch.x.unsqueeze(1)
    y = hsa(q, q, q, batch)
    n0 = docs[0].num_leaves
    torch.testing.assert_close(y[:n0], hsa(q[:n0], q[:n0], q[:n0], docs[0]))


# ------------------------------------------------------- nodes, modality, subtrees
def test_nodes_grid_graph_and_precomputed_subtrees(zen, photo):
    pooled = NestedSignal.from_parents([-1], x=torch.ones(1, D), modality=[7])
    pages = Node([zen[1], zen[2], pooled], geometry="graph", edges=[(0, 1), (1, 2)])
    grid = Node([[zen[3], zen[4]], [zen[5]]], geometry="grid")
    doc = document_tree({"pages": pages, "grid": grid, "gallery": [photo, photo[:100]]},
                        text=text_builder, image=image_builder)
    roots = dict(zip(["pages", "grid", "gallery"], field_roots(doc, 0)))
    kids = field_roots(doc, roots["pages"])
    assert doc.geometry[roots["pages"]] == CODE["graph"]
    assert doc.sibling_edge_index.t().tolist() == [[kids[0], kids[1]], [kids[1], kids[2]]]
    assert int(doc.modality[kids[2]]) == 7  # a precomputed subtree keeps its tag
    assert int(doc.modality[roots["pages"]]) == 0  # children 0, 0, 7: mixed
    cells = field_roots(doc, roots["grid"])
    assert doc.geometry[roots["grid"]] == CODE["grid"]
    assert doc.position[cells].tolist() == [[0, 0], [0, 1], [1, 0]]
    assert int(doc.modality[roots["gallery"]]) == 1  # all images: image tag


def test_modality_options(zen, photo):
    doc = document_tree({"t": zen[1], "i": photo, "n": Node([zen[2]], modality=5)},
                        text=text_builder, image=image_builder, text_modality=3,
                        image_modality=None, mixed_modality=9)
    t, i, n = field_roots(doc, 0)
    assert doc.modality[subtree_nodes(doc, t)].unique().tolist() == [3]
    assert doc.modality[subtree_nodes(doc, i)].unique().tolist() == [1]  # builder's own
    assert doc.modality[subtree_nodes(doc, n)].unique().tolist() == [5]  # Node override
    assert int(doc.modality[0]) == 9


def test_single_value_document_and_default_image_builder(zen, photo):
    assert document_tree(zen[1], text=text_builder).num_leaves == text_builder(zen[1]).num_leaves
    doc = document_tree({"image": photo[:40, :40]})  # default: 16x16 raw patches
    assert doc.x.shape == (9, 16 * 16 * 3)
    assert doc.modality.tolist() == [1] * doc.num_nodes  # the root's only child is an image


def test_default_text_builder(zen):
    try:
        text_tree = importlib.import_module("hsa_graph.builders.text").text_tree
    except (ImportError, AttributeError):
        with pytest.raises(RuntimeError, match="text="):
            document_tree({"title": zen[1]})
    else:  # the package's text builder: token ids at the leaves
        doc = document_tree({"title": zen[1], "body": [zen[2], zen[3]]})
        title, body = field_roots(doc, 0)
        assert doc.key[title] == "title" and doc.geometry_names()[body] == "sequence"
        expected = torch.cat([text_tree(z).x for z in zen[1:4]])
        assert doc.x.dtype == torch.long and torch.equal(doc.x, expected)


# ------------------------------------------------------------------- bad input
@pytest.mark.parametrize("document, path", [
    ({"headline": "Title.", "score": 3.5}, "root.score"),
    ({"body": ["One.", "Two.", None]}, r"root.body\[2\]"),
    ({"meta": {"authors": [b"bytes"]}}, r"root.meta.authors\[0\]"),
    ({"a b": object()}, r"root\['a b'\]"),
    (3, "root"),
])
def test_unknown_field_types_name_the_path(document, path):
    with pytest.raises(TypeError, match=path + ": unsupported field value"):
        document_tree(document, text=text_builder, image=image_builder)


@pytest.mark.parametrize("document, path", [
    ({}, "root"),
    ({"body": []}, "root.body"),
    ({"meta": {"tags": set()}}, "root.meta.tags"),
    ({"x": ["A.", {"y": {}}]}, r"root.x\[1\].y"),
    ({"n": Node([], geometry="set")}, "root.n"),
    ({"g": Node([[]], geometry="grid")}, "root.g"),
])
def test_empty_containers_name_the_path(document, path):
    with pytest.raises(ValueError, match=path + ": empty"):
        document_tree(document, text=text_builder)


def test_non_str_keys_are_rejected():
    with pytest.raises(TypeError, match=r"root.body\[0\]: field names must be str.*int 1"):
        document_tree({"body": [{1: "One."}]}, text=text_builder)


def test_builder_errors_carry_the_path(photo):
    with pytest.raises(ValueError, match=r"root.body\[1\]: the text builder failed: "
                                         "the text is empty"):
        document_tree({"body": ["Fine.", "   "]}, text=text_builder)
    with pytest.raises(ValueError, match=r"root.pics\[0\]: the image builder failed: .*empty"):
        document_tree({"pics": [photo[:0]]}, image=image_builder)
    with pytest.raises(TypeError, match=r"root.pics\[0\]: the image builder failed"):
        document_tree({"pics": [photo.astype(bool)]}, image=image_builder)
    with pytest.raises(TypeError, match="root.t: the text builder returned a list"):
        document_tree({"t": "x"}, text=lambda s: [s])
    forest = NestedSignal.from_parents([-1, -1], x=torch.ones(2, D))
    with pytest.raises(ValueError, match="root.f: the subtree is a forest of 2"):
        document_tree({"f": forest})


def test_mismatched_leaf_widths(photo):
    with pytest.raises(ValueError, match=r"root.image has leaf features of shape \[n, 3072\] "
                                         r".* but root.title has .*\[n, 32\].*text=\.\.\., "
                                         r"image=\.\.\."):
        document_tree({"title": "Hello there.", "image": photo},
                      text=text_builder, image=lambda a: image_tree(a, 32))
    ids = lambda s: NestedSignal.from_nested([len(w) for w in s.split()])  # noqa: E731
    with pytest.raises(ValueError, match="token ids"):
        document_tree({"title": "Hello there.", "body": ["A b."]},
                      text=lambda s: ids(s) if len(s) > 5 else text_builder(s))


def test_bad_nodes_and_options():
    with pytest.raises(ValueError, match="root.n: unknown geometry 'tree'"):
        document_tree({"n": Node(["A."], geometry="tree")}, text=text_builder)
    with pytest.raises(ValueError, match=r"root.n: graph edge \(0, 5\) is out of range"):
        document_tree({"n": Node(["A.", "B."], geometry="graph", edges=[(0, 5)])},
                      text=text_builder)
    with pytest.raises(ValueError, match="edges are only for graph"):
        document_tree({"n": Node(["A.", "B."], edges=[(0, 1)])}, text=text_builder)
    with pytest.raises(TypeError, match="a keyvalue Node needs a dict"):
        document_tree({"n": Node(["A."], geometry="keyvalue")}, text=text_builder)
    with pytest.raises(TypeError, match="text_modality must be an int"):
        document_tree({"t": "A."}, text=text_builder, text_modality="text")


def test_ten_thousand_levels_no_recursion_error():
    depth = 10_000
    document = "The deepest sentence. It is here."
    for level in range(depth):  # alternate dicts and lists
        document = {"inner": document} if level % 2 else [document]
    doc = document_tree(document, text=text_builder)
    leaf_count = text_builder("The deepest sentence. It is here.").num_leaves
    assert doc.num_leaves == leaf_count
    assert doc.num_nodes == depth + text_builder("The deepest sentence. It is here.").num_nodes
    # the outermost level (9999, odd) is a dict
    assert doc.geometry_names()[:4] == ["keyvalue", "sequence", "keyvalue", "sequence"]
    assert doc.key[:4] == [None, "inner", None, "inner"]
    q = torch.randn(leaf_count, 1, 4, dtype=torch.float64)
    ones = torch.ones(leaf_count, 1, 1, dtype=torch.float64)
    torch.testing.assert_close(hsa(q, q, ones, doc), ones)
    # an error deep down names the full path without building huge strings up front
    bad = 1.5
    for _ in range(depth):
        bad = [bad]
    with pytest.raises(TypeError, match=r"root(\[0\]){10000}: unsupported"):
        document_tree(bad, text=text_builder)
