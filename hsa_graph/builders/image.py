r"""Images as nested signals: a grid of patches, or a quadtree of patch regions.

:func:`image_tree` cuts an ``H x W x C`` image into ``patch x patch`` patches (the
leaves, in row-major order) under one ``grid`` root, each at its ``(row, col)``; with
``quadtree=True`` patches are grouped into ``2 x 2`` regions, regions into ``2 x 2``
regions of regions, and so on up to a single root (every region a ``grid`` node whose
children sit at ``(row % 2, col % 2)``), a grid of grids.

**Leaf features** (without ``embed``): the patch pixels flattened channels-last, so
feature ``(py * pw + px) * C' + c`` of patch ``row * cols + col`` is pixel
``(row * ph + py, col * pw + px)``, channel ``c``; ``C' = C`` or ``C + 1`` with
``mask_channel=True``, whose extra last channel is ``1`` on image pixels and ``0`` on
padding. ``uint8`` pixels are scaled to ``[0, 1]`` (``/ 255``), ``uint16`` by
``/ 65535``; floating-point pixels are kept as they are (and in their dtype).

**Sizes that are not a multiple of the patch**: ``fit="pad"`` (default) pads the
bottom and right edges with ``pad_value`` up to the next multiple (so every pixel is
in a patch; an image smaller than one patch, e.g. ``1 x 1``, is one padded patch);
``fit="crop"`` drops the remainder rows and columns (an image smaller than one patch
is then a ``ValueError``).

**Quadtree ragged edges**: an odd number of rows or columns at some level leaves
regions at the bottom/right edge with fewer than 4 children (a corner region may have
only one: a unary node, transparent to HSA). The quadtree of a single patch is the
root with one child, like the flat grid.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ..signal import NestedSignal

__all__ = ["image_tree"]

#: integer pixel dtypes with an unambiguous range, and their full-scale value
_SCALE = {np.dtype(np.uint8): 255.0, np.dtype(np.uint16): 65535.0}


#: Padding may always reach this many values (a small image in one big patch); beyond
#: it, at most twice the image.
_MAX_PADDED = 2 ** 24


def _as_tensor(image: Any) -> Tensor:
    """A tensor view of ``image`` (torch, numpy, PIL image or nested lists), dtype
    checked: ``uint8``/``uint16`` or floating point."""
    if isinstance(image, Tensor):
        if image.dtype == torch.uint8 or image.is_floating_point():
            return image
        raise TypeError(f"image dtype {image.dtype} is not supported: use uint8 (0..255) "
                        "or a floating-point dtype")
    if type(image).__module__.startswith("PIL.") and hasattr(image, "convert"):
        # palette, bilevel, CMYK... images: their raw arrays are not pixel values
        if image.mode not in ("L", "LA", "RGB", "RGBA", "I;16", "F"):
            alpha = image.mode in ("PA", "RGBa", "La") or "transparency" in image.info
            image = image.convert("RGBA" if alpha else "RGB")
    try:
        array = np.asarray(image)
    except Exception as error:  # ragged nested lists and the like
        raise TypeError(f"cannot read the image as an array: {error}") from None
    if array.dtype in _SCALE:
        scaled = array.astype(np.float32) / np.float32(_SCALE[array.dtype])
        return torch.from_numpy(scaled)
    if array.dtype.kind == "f":
        if array.dtype not in (np.float16, np.float32, np.float64):  # e.g. longdouble
            array = array.astype(np.float64)
        return torch.from_numpy(np.ascontiguousarray(array))
    kind = {"b": "bool", "O": "object", "c": "complex", "U": "str", "S": "bytes",
            "i": "signed integer (ambiguous value range)"}.get(array.dtype.kind,
                                                             str(array.dtype))
    raise TypeError(f"image dtype {array.dtype} ({kind}) is not supported: use uint8 "
                    "(0..255), uint16 or a floating-point dtype")


def _pair(value: Any, name: str) -> Tuple[int, int]:
    values = (value, value) if not isinstance(value, (tuple, list)) else tuple(value)
    if len(values) != 2 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral)
                               for v in values):
        raise ValueError(f"{name} must be a positive int or a pair (height, width), "
                         f"got {value!r}")
    if min(values) < 1:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return int(values[0]), int(values[1])


def _grid_levels(rows: int, cols: int, region: int):
    """Grid shapes from the patches up to a single node: [(rows, cols), ..., (1, 1)]."""
    shapes = [(rows, cols)]
    while shapes[-1] != (1, 1):
        r, c = shapes[-1]
        shapes.append((-(-r // region), -(-c // region)))
    return shapes


def _tree_arrays(rows: int, cols: int, quadtree: bool, region: int):
    """``parent`` and ``position`` ``[M, 2]`` of the patch tree: the root first, then
    the region levels top-down, then the patches, each level in row-major order; one
    set of tensor ops per level."""
    shapes = _grid_levels(rows, cols, region) if quadtree else [(rows, cols), (1, 1)]
    if len(shapes) == 1:  # a single patch: a root over it, as in the flat grid
        shapes.append((1, 1))
    shapes = shapes[::-1]  # top-down: root first, patches last
    sizes = [r * c for r, c in shapes]
    start = np.cumsum([0] + sizes).tolist()
    parent = torch.full((start[-1],), -1, dtype=torch.long)
    position = torch.full((start[-1], 2), -1, dtype=torch.long)
    for level in range(1, len(shapes)):
        pc, (r, c) = shapes[level - 1][1], shapes[level]
        idx = torch.arange(r * c)
        row, col = torch.div(idx, c, rounding_mode="floor"), idx % c
        nodes = slice(start[level], start[level + 1])
        if level == 1 and not quadtree:  # every patch directly under the root
            parent[nodes] = 0
            position[nodes] = torch.stack([row, col], 1)
        else:
            up_row = torch.div(row, region, rounding_mode="floor")
            up_col = torch.div(col, region, rounding_mode="floor")
            parent[nodes] = start[level - 1] + up_row * pc + up_col
            position[nodes] = torch.stack([row % region, col % region], 1)
    return parent, position


def image_tree(
    image: Any,
    patch_size: Union[int, Tuple[int, int]] = 16,
    *,
    quadtree: bool = False,
    region: int = 2,
    fit: str = "pad",
    pad_value: float = 0.0,
    mask_channel: bool = False,
    channels_first: bool = False,
    embed: Optional[Callable[[Tensor], Tensor]] = None,
    modality: int = 1,
) -> NestedSignal:
    r"""An image as a grid of patches (or a quadtree of patch regions).

    Args:
        image: ``[H, W, C]`` (or ``[H, W]`` grayscale, taken as ``C = 1``) torch
            tensor, numpy array or anything ``numpy.asarray`` reads (a PIL image);
            dtype ``uint8``, ``uint16`` (numpy) or floating point; ``C`` in 1..4 (gray,
            gray + alpha, RGB, RGBA).
        patch_size: patch side ``p`` or ``(ph, pw)``.
        quadtree: group patches into ``region x region`` regions, recursively, up to
            one root (a grid of grids); otherwise all patches are children of the root.
        region: the side of a quadtree region (2: a quadtree).
        fit: ``"pad"`` (bottom/right edges padded with ``pad_value``) or ``"crop"``
            (the remainder dropped) when ``H`` or ``W`` is not a multiple of the patch.
        pad_value: the value of padded pixels (after scaling to ``[0, 1]``).
        mask_channel: append a channel that is 1 on image pixels, 0 on padding.
        channels_first: the image is ``[C, H, W]`` (torchvision's layout).
        embed: optional callable from the patches ``[N, ph, pw, C']`` (float, scaled;
            row-major patch order) to leaf features ``[N, F]``, e.g. a linear patch
            embedding or a ViT; default: the flattened pixels ``[N, ph * pw * C']``.
        modality: the modality tag of every node (text builders use 0).

    Returns:
        One tree: the root is node 0 (geometry ``grid``); the patches are the leaves,
        in row-major order (rows of ``x``), at ``(row, col)`` (``(row % region, col %
        region)`` inside their region with ``quadtree``).

    Raises:
        TypeError: bool, object, complex, str, signed integer dtypes; non-array input.
        ValueError: not 2 or 3 dimensions, 0 or more than 4 channels, an empty image,
            ``fit="crop"`` on an image smaller than a patch, padding that would need
            more than ``max(2 ** 24, 2 * H * W * C)`` values (a patch far larger than
            the image), a bad ``patch_size``, ``region``, ``fit``, ``modality`` or
            ``embed`` output.

    Example:
        >>> image = torch.rand(40, 50, 3)             # H x W x C
        >>> tree = image_tree(image, 16)              # pads to 48 x 64: 3 x 4 patches
        >>> tree.num_leaves, tree.x.shape, tree.position[-1].tolist()
        (12, torch.Size([12, 768]), [2, 3])
        >>> quad = image_tree(image, 16, quadtree=True)   # 3x4 -> 2x2 regions -> root
        >>> quad.num_nodes, quad.geometry_names()[:2]
        (17, ['grid', 'grid'])
    """
    if not isinstance(quadtree, bool):
        raise TypeError(f"quadtree must be True or False, got {quadtree!r}")
    ph, pw = _pair(patch_size, "patch_size")
    if isinstance(region, bool) or not isinstance(region, numbers.Integral) or region < 2:
        raise ValueError(f"region must be an int >= 2, got {region!r}")
    if fit not in ("pad", "crop"):
        raise ValueError(f"fit must be 'pad' or 'crop', got {fit!r}")
    if isinstance(modality, bool) or not isinstance(modality, numbers.Integral) or \
            not 0 <= modality < 2 ** 63:
        raise ValueError(f"modality must be a non-negative int (int64), got {modality!r:.40}")
    if isinstance(pad_value, bool) or not isinstance(pad_value, numbers.Real):
        raise TypeError(f"pad_value must be a number, got {type(pad_value).__name__}")
    pixels = _as_tensor(image)
    if pixels.dim() == 2:
        pixels = pixels.unsqueeze(0 if channels_first else -1)
    if pixels.dim() != 3:
        raise ValueError(f"image must be [H, W, C] or [H, W] (grayscale), got shape "
                         f"{tuple(pixels.shape)}")
    if channels_first:
        pixels = pixels.permute(1, 2, 0)
    height, width, channels = pixels.shape
    if not 1 <= channels <= 4:
        hint = ""
        if 1 <= pixels.shape[0] <= 4 and not channels_first:
            hint = " (a [C, H, W] image? pass channels_first=True)"
        raise ValueError(f"image has {channels} channels; expected 1 to 4 (gray, gray + "
                         f"alpha, RGB, RGBA) in the last dimension{hint}")
    if height == 0 or width == 0:
        raise ValueError(f"the image is empty (shape {tuple(pixels.shape)})")
    if not pixels.is_floating_point():  # uint8 tensor
        pixels = pixels.float() / 255.0

    if fit == "crop":
        rows, cols = height // ph, width // pw
        if rows == 0 or cols == 0:
            raise ValueError(f"the image ({height} x {width}) is smaller than one patch "
                             f"({ph} x {pw}) and fit='crop' keeps no patch; use fit='pad'")
    else:
        rows, cols = -(-height // ph), -(-width // pw)
    out_h, out_w = rows * ph, cols * pw
    padded_size = out_h * out_w * (channels + int(mask_channel))
    if padded_size > max(_MAX_PADDED, 2 * pixels.numel()):
        # a patch far larger than the image would allocate the padding (and crash)
        raise ValueError(f"padding the {height} x {width} image to whole {ph} x {pw} patches "
                         f"needs {padded_size:,} values, more than twice the image; use a "
                         "smaller patch_size")
    if mask_channel:
        pixels = torch.cat([pixels, torch.ones_like(pixels[..., :1])], -1)
    if out_h > height or out_w > width:
        padded = pixels.new_full((out_h, out_w, pixels.shape[-1]), pad_value)
        if mask_channel:
            padded[..., -1] = 0
        padded[:height, :width] = pixels
        pixels = padded
    else:
        pixels = pixels[:out_h, :out_w]
    # [rows * ph, cols * pw, C'] -> [rows * cols, ph, pw, C'], patches in row-major order
    patches = (pixels.reshape(rows, ph, cols, pw, -1).permute(0, 2, 1, 3, 4)
               .reshape(rows * cols, ph, pw, -1))
    if embed is None:
        x = patches.reshape(rows * cols, -1)
    else:
        x = embed(patches)
        if not isinstance(x, Tensor):
            x = torch.as_tensor(np.asarray(x))
        if x.dim() != 2 or x.shape[0] != rows * cols:
            raise ValueError(f"embed must map the patches [{rows * cols}, {ph}, {pw}, "
                             f"{patches.shape[-1]}] to [{rows * cols}, F], got shape "
                             f"{tuple(x.shape)}")
    # a region wider than the grid is one region: the same tree as region = the grid's
    # side, and int64 arithmetic never sees a huge region
    region = min(int(region), max(rows, cols, 2))
    parent, position = _tree_arrays(rows, cols, quadtree, region)
    parent, position = parent.to(x.device), position.to(x.device)
    return NestedSignal.from_parents(parent, x, geometry="grid", position=position,
                                     modality=torch.full_like(parent, int(modality)))
