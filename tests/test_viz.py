"""Pictures of nested signals and of their attention (hsa_graph.viz)."""
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib import cbook
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.figure import Figure
from PIL import Image
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph import NestedSignal, Node
from hsa_graph.viz import draw_tree, flat_attention, plot_attention, tree_layout

TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "gettysburg.txt"


def gettysburg():
    """The Gettysburg Address: paragraphs -> sentences -> words (token ids = word
    lengths: what the leaves carry does not matter for pictures), and the words."""
    text = TEXT.read_text(encoding="utf-8")
    paragraphs = [[re.findall(r"\w+(?:[-']\w+)*|[^\w\s]", s)
                   for s in re.split(r"(?<=[.!?])\s+", p) if s.strip()]
                  for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    tree = NestedSignal.from_nested([[[len(w) for w in s] for s in p] for p in paragraphs])
    words = [w for p in paragraphs for s in p for w in s]
    return tree, words


def grace_hopper(size=64, patch=16):
    """Grace Hopper's portrait (matplotlib sample data) as a quadtree of patches."""
    with cbook.get_sample_data("grace_hopper.jpg") as handle:
        image = np.asarray(Image.open(handle).convert("RGB").resize((size, size))) / 255.0
    cells = size // patch
    patches = (image.reshape(cells, patch, cells, patch, 3).transpose(0, 2, 1, 3, 4)
               .reshape(cells, cells, -1)[..., ::97].astype(np.float32))
    grid = [[torch.from_numpy(patches[r, c].copy()) for c in range(cells)]
            for r in range(cells)]
    while len(grid) > 2:
        grid = [[Node([[grid[2 * r][2 * c], grid[2 * r][2 * c + 1]],
                       [grid[2 * r + 1][2 * c], grid[2 * r + 1][2 * c + 1]]], "grid")
                 for c in range(len(grid) // 2)] for r in range(len(grid) // 2)]
    return NestedSignal.from_nested(Node(grid, "grid", modality=1))


def without_x(tree):
    """The tree without leaf features, so that trees of different leaf kinds batch."""
    tree.x = None
    return tree


def node_markers(fig):
    """The one scatter collection of node markers of the first axes."""
    markers = [c for c in fig.axes[0].collections if c.get_gid() == "nodes"]
    assert len(markers) == 1
    return markers[0]


def assert_png(path: Path, min_size=(200, 100)):
    assert path.exists() and path.stat().st_size > 5000
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size[0] >= min_size[0] and image.size[1] >= min_size[1]
        # not a blank page: a real drawing has many colours
        assert len(image.convert("RGB").getcolors(2 ** 20)) > 10


# ------------------------------------------------------------------------ layout
def test_layout_of_a_real_text_is_tidy():
    tree, words = gettysburg()
    x, depth = tree_layout(tree)
    leaves = tree.leaf_index
    # leaves left to right in row order, one unit apart
    assert torch.equal(x[leaves], torch.arange(len(words), dtype=torch.float64))
    assert bool((depth[leaves] == 3).all()) and int(depth[0]) == 0
    # every parent is centred between its first and its last child
    parent = tree.parent
    for p in (~tree.is_leaf).nonzero().flatten().tolist():
        kids = (parent == p).nonzero().flatten()
        assert x[p] == (x[kids.min()] + x[kids.max()]) / 2
        assert bool((depth[kids] == depth[p] + 1).all())


def test_layout_follows_the_tree_not_the_node_numbering():
    # breadth-first numbering with the children of node 1 numbered after those of 2
    parent = [-1, 0, 0, 2, 2, 1, 1, 1]
    tree = NestedSignal.from_parents(parent)
    x, depth = tree_layout(tree)
    assert x[[5, 6, 7, 3, 4]].tolist() == [0, 1, 2, 3, 4]  # depth-first order
    assert x[1] == 1 and x[2] == 3.5 and x[0] == 2.25
    # no crossing edges: the order of parents agrees with the order of their children
    assert x[1] < x[2]


def test_layout_of_a_forest_and_of_a_deep_chain():
    tree, _ = gettysburg()
    forest = Batch.from_data_list([without_x(grace_hopper()), without_x(tree)])
    x, depth = tree_layout(forest)
    n_image = 16
    leaves = forest.leaf_index
    # the second tree starts one empty slot after the first one's last leaf
    assert x[leaves[:n_image]].tolist() == list(range(n_image))
    assert x[leaves[n_image]] == n_image + 1
    chain = torch.cat([torch.arange(-1, 2000), torch.tensor([1999])])  # depth 2000
    x, depth = tree_layout(NestedSignal.from_parents(chain))
    assert int(depth.max()) == 2000
    assert x[:2000].eq(0.5).all() and x[2000] == 0 and x[2001] == 1


# --------------------------------------------------------------------- draw_tree
def test_draw_tree_of_a_real_text(tmp_path):
    tree, words = gettysburg()
    labels = {int(u): w for u, w in zip(tree.leaf_index, words)}
    fig = draw_tree(tree, tmp_path / "text.png", labels=labels, dpi=40)
    assert isinstance(fig, Figure)
    markers = node_markers(fig)
    offsets = np.asarray(markers.get_offsets())
    x, depth = tree_layout(tree)
    assert offsets.shape == (tree.num_nodes, 2)  # one marker per node, in node order
    np.testing.assert_allclose(offsets[:, 0], x.numpy())
    np.testing.assert_allclose(offsets[:, 1], -depth.numpy())
    drawn = sorted(t.get_text() for t in fig.axes[0].texts)
    assert drawn == sorted(words)
    edges = [c for c in fig.axes[0].collections if isinstance(c, LineCollection)]
    assert len(edges[0].get_segments()) == tree.num_nodes - 1
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["sequence", "leaf"]
    assert_png(tmp_path / "text.png")


def test_draw_tree_of_a_real_image_and_a_document_by_modality(tmp_path):
    image = grace_hopper()
    fig = draw_tree(image, tmp_path / "image.png")
    assert len(node_markers(fig).get_offsets()) == image.num_nodes == 21
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["grid", "leaf"]
    assert_png(tmp_path / "image.png")

    text, _ = gettysburg()
    text.x = torch.randn(text.num_leaves, image.x.shape[1])
    doc = NestedSignal.join([text, image], "keyvalue", keys=["text", "image"])
    fig = draw_tree(doc, tmp_path / "doc.png", color_by="modality",
                    modality_names={0: "text", 1: "image"})
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["text", "image"]
    colors = node_markers(fig).get_facecolors()
    is_image = doc.modality == 1
    assert len({tuple(c) for c in colors[is_image.numpy()]}) == 1
    assert not np.allclose(colors[is_image.numpy()][0], colors[(~is_image).numpy()][0])
    assert_png(tmp_path / "doc.png")


def test_draw_tree_graph_edges_and_given_axes():
    tree = NestedSignal.from_nested(Node([1, 2, 3, [4, 5]], "graph",
                                         edges=[(0, 1), (1, 2), (2, 3)]))
    fig = Figure()
    ax = fig.add_subplot()
    assert draw_tree(tree, ax=ax) is fig
    arcs = [c for c in ax.collections if isinstance(c, PathCollection) and
            len(c.get_paths()) == 3]
    assert len(arcs) == 1  # one arc per sibling edge
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["sequence", "graph", "leaf", "graph edge"]


@pytest.mark.parametrize("kwargs, match", [
    ({"color_by": "depth"}, "color_by"),
    ({"labels": ["a", "b"]}, "one entry per node"),
    ({"labels": {99: "x"}}, "not a node index"),
])
def test_draw_tree_bad_arguments(kwargs, match):
    tree = NestedSignal.from_nested([[1, 2], [3]])
    with pytest.raises(ValueError, match=match):
        draw_tree(tree, **kwargs)


# ---------------------------------------------------------------- plot_attention
def test_plot_attention_shows_hsa_weights_and_flat_attention(tmp_path):
    tree, _ = gettysburg()
    torch.manual_seed(0)
    q, k = torch.randn(tree.num_leaves, 2, 8), torch.randn(tree.num_leaves, 2, 8)
    fig = plot_attention(q, k, tree, tmp_path / "att.png", head=1, include_self=False, dpi=80)
    shown_hsa = fig.axes[0].images[0].get_array()
    shown_flat = fig.axes[1].images[0].get_array()
    theta = hsa_graph.hsa_weights(q, k, tree, include_self=False)[1]
    flat = hsa_graph.hsa_weights(q, k, hsa_graph.flatten(tree), include_self=False)[1]
    np.testing.assert_allclose(shown_hsa, theta.double().numpy(), atol=1e-7)
    np.testing.assert_allclose(shown_flat, flat.double().numpy(), atol=1e-6)
    # one colour scale for both, covering both
    a, b = fig.axes[0].images[0].norm, fig.axes[1].images[0].norm
    assert (a.vmin, a.vmax) == (b.vmin, b.vmax)
    assert a.vmax == pytest.approx(max(theta.max(), flat.max()).item())
    # boxes: every paragraph and sentence with more than one leaf (13 of them)
    boxes = [c for c in fig.axes[0].collections if isinstance(c, LineCollection)]
    internal = int((~tree.is_leaf).sum()) - 1
    assert len(boxes[0].get_segments()) == internal
    assert_png(tmp_path / "att.png", min_size=(900, 500))


def test_plot_attention_of_a_real_image_with_positions():
    tree = grace_hopper()
    from hsa_graph.geometry import PositionEncoder
    pos = PositionEncoder(4, heads=2)(tree).detach()
    q = k = torch.as_tensor(tree.x)[:, None].expand(-1, 2, -1) * 3
    fig = plot_attention(q, k, tree, head=1, pos=pos)
    theta = hsa_graph.hsa_weights(q, k, tree, pos=pos)[1]
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), theta.double().numpy(),
                               atol=1e-6)


def test_plot_attention_reorders_leaves_to_tree_order():
    tree = NestedSignal.from_parents([-1, 0, 0, 2, 2, 1, 1, 1])
    q = torch.randn(5, 3)
    fig = plot_attention(q, q, tree)
    order = [2, 3, 4, 0, 1]  # leaves 5, 6, 7 (rows 2..4) come first in the drawing
    theta = hsa_graph.hsa_weights(q, q, tree)[order][:, order]
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), theta.double().numpy(),
                               atol=1e-7)


def test_flat_attention_equals_hsa_weights_on_the_flattened_forest():
    trees = [without_x(t) for t in (gettysburg()[0], NestedSignal.from_nested([3]),
                                    grace_hopper())]
    forest = Batch.from_data_list(trees)
    torch.manual_seed(3)
    q, k = torch.randn(forest.num_leaves, 2, 4), torch.randn(forest.num_leaves, 2, 4)
    for include_self in (True, False):
        expected = hsa_graph.hsa_weights(q, k, hsa_graph.flatten(forest),
                                         include_self=include_self, scale=0.7)
        got = flat_attention(q, k, forest, include_self=include_self, scale=0.7)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_plot_attention_on_a_few_thousand_nodes(tmp_path):
    # 40 paragraphs x 8 sentences x 8 tokens: 2,921 nodes, 2,560 leaves
    parent = torch.cat([torch.tensor([-1]), torch.zeros(40, dtype=torch.long),
                        torch.arange(1, 41).repeat_interleave(8),
                        torch.arange(41, 361).repeat_interleave(8)])
    tree = NestedSignal.from_parents(parent)
    q = torch.randn(tree.num_leaves, 8)
    start = time.perf_counter()
    fig = plot_attention(q, q, tree, tmp_path / "big.png", max_pixels=640, dpi=60)
    draw_tree(tree, tmp_path / "big_tree.png", dpi=40)
    assert time.perf_counter() - start < 60  # generous: CI machines are shared
    shown = fig.axes[1].images[0].get_array()
    assert shown.shape == (640, 640)  # block means of 4 x 4 leaves
    flat = flat_attention(q, q, tree)
    np.testing.assert_allclose(shown[5, 7], flat[20:24, 28:32].mean().item(), rtol=1e-5)
    assert fig.axes[0].images[0].get_array().shape == (640, 640)
    assert_png(tmp_path / "big.png")
    assert_png(tmp_path / "big_tree.png")


def test_plot_attention_bad_arguments():
    tree = NestedSignal.from_nested([[1, 2], [3]])
    with pytest.raises(ValueError, match="head"):
        plot_attention(torch.randn(3, 2, 4), torch.randn(3, 2, 4), tree, head=2)
    with pytest.raises(ValueError, match="rows"):
        plot_attention(torch.randn(4, 4), torch.randn(4, 4), tree)
    with pytest.raises(TypeError):
        plot_attention([[1.0]], [[1.0]], tree)
