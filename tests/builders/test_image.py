"""Tests of hsa_graph/builders/image.py on a real photograph (matplotlib's sample
grace_hopper.jpg, read with PIL) and on malformed input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib import cbook
from PIL import Image
from reference import dense_hsa
from torch_geometric.data import Batch

from hsa_graph import hsa
from hsa_graph.builders.image import image_tree


@pytest.fixture(scope="module")
def hopper() -> np.ndarray:
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as im:
        return np.asarray(im.convert("RGB"))  # 600 x 512 x 3, uint8


def patch_of(array: np.ndarray, row: int, col: int, p: int) -> np.ndarray:
    """The pixels of patch (row, col), zero-padded at the image's bottom/right edge."""
    h, w, c = array.shape
    out = np.zeros((p, p, c), dtype=np.float64)
    block = array[row * p:(row + 1) * p, col * p:(col + 1) * p]
    out[:block.shape[0], :block.shape[1]] = block
    return out


def reference_quadtree(rows: int, cols: int, region: int = 2):
    """Per-node construction: levels of region grids bottom-up until one node; numbered
    root first, top-down, row-major; returns (parent, position) lists."""
    shapes = [(rows, cols)]
    while shapes[-1] != (1, 1):
        r, c = shapes[-1]
        shapes.append(((r + region - 1) // region, (c + region - 1) // region))
    if len(shapes) == 1:
        shapes.append((1, 1))
    shapes.reverse()
    ids, next_id = [], 0
    for r, c in shapes:
        ids.append({(i, j): next_id + i * c + j for i in range(r) for j in range(c)})
        next_id += r * c
    parent, position = [-1] * next_id, [(-1, -1)] * next_id
    for level in range(1, len(shapes)):
        for (i, j), u in ids[level].items():
            parent[u] = ids[level - 1][(i // region, j // region)]
            position[u] = (i % region, j % region)
    return parent, position


# -------------------------------------------------------------- the real photograph
def test_grid_of_patches_on_a_photograph(hopper):
    assert hopper.shape == (600, 512, 3) and hopper.dtype == np.uint8
    tree = image_tree(hopper, 16)
    rows, cols = 38, 32  # 600 / 16 = 37.5: the last row of patches is half padding
    assert tree.num_leaves == rows * cols
    assert tree.num_nodes == rows * cols + 1
    assert tree.x.shape == (rows * cols, 16 * 16 * 3) and tree.x.dtype == torch.float32
    assert tree.geometry_names()[0] == "grid"
    assert tree.parent.tolist() == [-1] + [0] * (rows * cols)
    leaf_pos = tree.position[tree.leaf_index]
    assert leaf_pos.tolist() == [[i // cols, i % cols] for i in range(rows * cols)]
    assert tree.modality.tolist() == [1] * tree.num_nodes
    # features: the patch pixels, channels last, scaled to [0, 1]
    for row, col in [(0, 0), (10, 7), (37, 31), (37, 0), (20, 31)]:
        expected = patch_of(hopper, row, col, 16).reshape(-1) / 255
        np.testing.assert_allclose(tree.x[row * cols + col].numpy(), expected, atol=1e-6)
    # the layout: feature (py * 16 + px) * 3 + c is pixel (row*16 + py, col*16 + px, c)
    assert tree.x[3 * cols + 5, (4 * 16 + 9) * 3 + 2] == pytest.approx(
        hopper[3 * 16 + 4, 5 * 16 + 9, 2] / 255)
    # bottom row: its lower 8 pixel rows are padding
    last = tree.x[37 * cols + 4].reshape(16, 16, 3)
    assert float(last[8:].abs().sum()) == 0.0 and float(last[:8].sum()) > 0


def test_mask_channel_and_pad_value(hopper):
    tree = image_tree(hopper, 16, mask_channel=True, pad_value=0.5)
    patches = tree.x.reshape(-1, 16, 16, 4)
    assert float(patches[:36 * 32, ..., 3].min()) == 1.0  # full rows: all real pixels
    last_row = patches[37 * 32:]
    assert last_row[:, :8, :, 3].eq(1).all() and last_row[:, 8:, :, 3].eq(0).all()
    assert last_row[:, 8:, :, :3].eq(0.5).all()


def test_crop(hopper):
    tree = image_tree(hopper, 16, fit="crop")
    assert tree.num_leaves == 37 * 32
    np.testing.assert_allclose(tree.x[-1].numpy(),
                               patch_of(hopper, 36, 31, 16).reshape(-1) / 255, atol=1e-6)


def test_inputs_torch_float_pil_grayscale_channels_first(hopper):
    base = image_tree(hopper, 32)
    as_torch = image_tree(torch.from_numpy(hopper.copy()), 32)
    torch.testing.assert_close(as_torch.x, base.x)
    as_float = image_tree(hopper.astype(np.float64) / 255, 32)
    assert as_float.x.dtype == torch.float64
    torch.testing.assert_close(as_float.x.float(), base.x)
    chw = torch.from_numpy(hopper.copy()).permute(2, 0, 1)
    torch.testing.assert_close(image_tree(chw, 32, channels_first=True).x, base.x)
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as im:
        torch.testing.assert_close(image_tree(im, 32).x, base.x)  # a PIL image directly
        gray = np.asarray(im.convert("L"))
        palette = im.convert("P")
        assert image_tree(palette, 32).x.shape == base.x.shape  # palette -> RGB pixels
    tree = image_tree(gray, 32)  # H x W: one channel
    assert tree.x.shape == (19 * 16, 32 * 32)
    assert tree.x[0, 33] == pytest.approx(gray[1, 1] / 255)
    sixteen = image_tree(gray.astype(np.uint16) * 257, 32)  # uint16 scaled by 65535
    torch.testing.assert_close(sixteen.x, tree.x)


def test_non_square_patches_and_images():
    image = torch.rand(20, 50, 3)
    tree = image_tree(image, (10, 25))
    assert tree.num_leaves == 4
    assert tree.position[1:].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    torch.testing.assert_close(tree.x[3], image[10:20, 25:50].reshape(-1))


def test_embed_callable(hopper):
    seen = {}
    weight = torch.randn(16 * 16 * 3, 24, generator=torch.Generator().manual_seed(0))

    def embed(patches):
        seen["shape"] = tuple(patches.shape)
        return patches.reshape(len(patches), -1) @ weight

    tree = image_tree(hopper, 16, embed=embed)
    assert seen["shape"] == (38 * 32, 16, 16, 3)
    assert tree.x.shape == (38 * 32, 24)
    torch.testing.assert_close(tree.x, image_tree(hopper, 16).x @ weight)
    with pytest.raises(ValueError, match="embed must map"):
        image_tree(hopper, 16, embed=lambda p: p.reshape(-1))
    with pytest.raises(ValueError, match="embed must map"):
        image_tree(hopper, 16, embed=lambda p: p[:3].reshape(3, -1))


# ----------------------------------------------------------------------- quadtree
def test_quadtree_on_a_photograph(hopper):
    tree = image_tree(hopper, 16, quadtree=True)
    parent, position = reference_quadtree(38, 32)
    assert tree.parent.tolist() == parent
    assert tree.position.tolist() == [list(p) for p in position]
    assert tree.num_leaves == 38 * 32
    # 38x32 -> 19x16 -> 10x8 -> 5x4 -> 3x2 -> 2x1 -> 1x1: 6 region levels above patches
    assert tree.structure.max_depth == 5
    assert set(tree.geometry_names()) == {"grid", None}
    # same leaves, in the same row-major order, as the flat grid
    torch.testing.assert_close(tree.x, image_tree(hopper, 16).x)
    # each leaf's ancestors are the regions (r >> k, c >> k): check via parents
    par = tree.parent
    leaves = tree.leaf_index
    r, c = torch.arange(38 * 32) // 32, torch.arange(38 * 32) % 32
    up = par[leaves]
    for k in range(1, 6):
        pos = tree.position[up]
        assert torch.equal(pos[:, 0], (r >> k) % 2) and torch.equal(pos[:, 1], (c >> k) % 2)
        up = par[up]
    assert up.eq(0).all()  # level 6 is the root


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (3, 3), (5, 2), (4, 4), (7, 1)])
@pytest.mark.parametrize("region", [2, 3])
def test_quadtree_ragged_shapes(shape, region):
    rows, cols = shape
    image = torch.rand(rows * 4, cols * 4, 1)
    tree = image_tree(image, 4, quadtree=True, region=region)
    parent, position = reference_quadtree(rows, cols, region)
    assert tree.parent.tolist() == parent
    assert tree.position.tolist() == [list(p) for p in position]
    counts = torch.bincount(tree.parent[tree.parent >= 0], minlength=tree.num_nodes)
    assert int(counts.max()) <= region * region


# ---------------------------------------------------------------------------- HSA
def test_flat_grid_is_softmax_attention_and_quadtree_matches_reference():
    image = torch.rand(24, 20, 3, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    flat = image_tree(image, 4)
    n = flat.num_leaves
    q, k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(hsa(q, k, v, flat), expected)
    quad = image_tree(image, 4, quadtree=True)
    torch.testing.assert_close(hsa(q, k, v, quad, include_self=False),
                               dense_hsa(quad.parent, q, k, v, include_self=False))


def test_batch_of_images():
    trees = [image_tree(torch.rand(h, w, 3), 8, quadtree=True) for h, w in [(16, 16), (9, 30)]]
    batch = Batch.from_data_list(trees)
    q = torch.randn(batch.num_leaves, 4, 8)
    y = hsa(q, q, q, batch)
    n0 = trees[0].num_leaves
    torch.testing.assert_close(y[:n0], hsa(q[:n0], q[:n0], q[:n0], trees[0]))


# ------------------------------------------------------------------------ bad input
def test_one_pixel_image_is_one_padded_patch():
    pixel = np.array([[[255, 0, 128]]], dtype=np.uint8)
    tree = image_tree(pixel, 16)
    assert tree.num_leaves == 1 and tree.parent.tolist() == [-1, 0]
    assert tree.x[0, :3].tolist() == pytest.approx([1.0, 0.0, 128 / 255])
    assert float(tree.x[0, 3:].abs().sum()) == 0.0
    assert image_tree(pixel, 16, quadtree=True).parent.tolist() == [-1, 0]
    with pytest.raises(ValueError, match="smaller than one patch"):
        image_tree(pixel, 16, fit="crop")
    y = hsa(torch.randn(1, 4), torch.randn(1, 4), torch.ones(1, 4), tree)
    assert y.tolist() == [[1.0] * 4]


@pytest.mark.parametrize("image, match", [
    (np.zeros((0, 5, 3), np.uint8), "empty"),
    (np.zeros((5, 0), np.uint8), "empty"),
    (np.zeros(5, np.uint8), r"\[H, W, C\]"),
    (np.zeros((2, 4, 4, 3), np.uint8), r"\[H, W, C\]"),
    (np.zeros((8, 8, 0), np.uint8), "0 channels"),
    (np.zeros((8, 8, 5), np.uint8), "5 channels"),
    (np.zeros((3, 32, 32), np.uint8), "channels_first=True"),
])
def test_bad_shapes(image, match):
    with pytest.raises(ValueError, match=match):
        image_tree(image, 4)


@pytest.mark.parametrize("image", [
    np.zeros((8, 8, 3), bool), np.zeros((8, 8, 3), complex), np.zeros((8, 8, 3), np.int32),
    np.array([[object()]]), np.full((2, 2), "a"), torch.zeros(8, 8, 3, dtype=torch.bool),
    torch.zeros(8, 8, 3, dtype=torch.int64), torch.zeros(8, 8, 3, dtype=torch.complex64),
    [[1, 2], [3]],
])
def test_bad_dtypes(image):
    with pytest.raises(TypeError):
        image_tree(image, 4)


@pytest.mark.parametrize("kwargs", [{"patch_size": 0}, {"patch_size": -4},
                                    {"patch_size": 2.5}, {"patch_size": (4,)},
                                    {"patch_size": True}, {"region": 1}, {"region": 2.0},
                                    {"fit": "stretch"}])
def test_bad_options(kwargs):
    with pytest.raises(ValueError):
        image_tree(np.zeros((8, 8, 3), np.uint8), **{"patch_size": 4, **kwargs})
    with pytest.raises(TypeError):
        image_tree(np.zeros((8, 8, 3), np.uint8), 4, quadtree="yes")
