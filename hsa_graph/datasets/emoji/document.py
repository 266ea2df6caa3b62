r"""Model inputs from the emoji: RGBA composited to float RGB on a background
(:func:`emoji_rgb`), and one example as an image-text document tree
(:func:`emoji_document`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple, Union

import torch
from torch import Tensor

from ...signal import NestedSignal

__all__ = ["emoji_document", "emoji_rgb"]


def emoji_rgb(images: Tensor, background: Union[float, Sequence[float]] = 1.0) -> Tensor:
    r"""RGBA ``uint8`` emoji images as float RGB in ``[0, 1]``, alpha-composited on a
    plain background:

    .. math::
        \mathrm{rgb} = \alpha\, c + (1 - \alpha)\, b, \qquad
        c = \mathrm{RGB} / 255,\; \alpha = \mathrm{A} / 255.

    Args:
        images: ``uint8 [..., 4, H, W]`` (e.g. :attr:`EmojiDataset.images` or one
            record's ``image``).
        background: the background gray level in ``[0, 1]`` (``1.0``: white) or an
            ``(r, g, b)`` triple.

    Returns:
        ``float32 [..., 3, H, W]``.

    Example:
        >>> pixel = torch.tensor([255, 0, 0, 128], dtype=torch.uint8).view(4, 1, 1)
        >>> [round(v, 3) for v in emoji_rgb(pixel).flatten().tolist()]  # red, alpha 0.5
        [1.0, 0.498, 0.498]
    """
    if not isinstance(images, Tensor) or images.dtype != torch.uint8 or images.dim() < 3 \
            or images.shape[-3] != 4:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        dtype = images.dtype if isinstance(images, Tensor) else ""
        raise ValueError(f"expected uint8 RGBA images [..., 4, H, W], got {shape} {dtype}")
    back = torch.as_tensor(background, dtype=torch.float32, device=images.device).flatten()
    if back.numel() not in (1, 3) or bool(((back < 0) | (back > 1)).any()):
        raise ValueError(f"background must be a level or an (r, g, b) triple in [0, 1], got "
                         f"{background!r}")
    pixels = images.float() / 255
    alpha = pixels[..., 3:, :, :]
    return pixels[..., :3, :, :] * alpha + back.view(-1, 1, 1) * (1 - alpha)


def emoji_document(
    image: Tensor,
    text: str,
    *,
    embed_text: Callable[[Tensor], Tensor],
    embed_patches: Callable[[Tensor], Tensor],
    tokenizer: Any = None,
    patch_size: Union[int, Tuple[int, int]] = 16,
    quadtree: bool = False,
    background: Union[float, Sequence[float]] = 1.0,
) -> NestedSignal:
    r"""One example as a key-value tree ``{"image": grid of patches, "text": paragraphs
    -> sentences -> tokens}``, built by :func:`hsa_graph.document_tree` with
    :func:`~hsa_graph.builders.image.image_tree` and
    :func:`~hsa_graph.builders.text.text_tree` (modality 1 for the image, 0 for the
    text).

    The image is composited on ``background`` (:func:`emoji_rgb`) and cut into
    ``patch_size`` patches (``64 / 16 = 4 x 4`` by default); ``embed_patches`` maps
    the patches ``[P, ph, pw, 3]`` to ``[P, F]`` and ``embed_text`` the token ids
    ``[T]`` (of ``tokenizer``, see ``text_tree``) to ``[T, F]``: the two widths must
    agree, as all leaves of a tree share one width. A learned patch projection belongs
    in the model, not here: ``patch_size=(8, 16)`` gives RGB patches of ``8 * 16 * 3
    = 384`` raw values, the width of MiniLM's token vectors (``embed_text=`` its
    embedding table, ``embed_patches=lambda p: p.flatten(1)``), and a
    :class:`~hsa_graph.nn.ModalityLinear` on the leaves' ``modality`` tags then
    projects each modality with its own weights.

    Args:
        image: ``uint8 [4, 64, 64]`` RGBA (an :class:`EmojiPair`'s ``image``).
        text: the text.
        embed_text, embed_patches: the two leaf embeddings.
        tokenizer: passed to ``text_tree`` (default: its word tokenizer).
        patch_size: the patch side.
        quadtree: group patches into a quadtree (see ``image_tree``).
        background: see :func:`emoji_rgb`.

    Example:
        >>> image = torch.zeros(4, 64, 64, dtype=torch.uint8)      # a transparent image
        >>> tree = emoji_document(image, "grinning face: happy, smile",
        ...                       embed_text=lambda ids: torch.zeros(len(ids), 8),
        ...                       embed_patches=lambda p: p.flatten(1)[:, :8])
        >>> tree.key[:2], tree.num_leaves, tree.x.shape       # 16 patches, 6 tokens
        ([None, 'image'], 22, torch.Size([22, 8]))
        >>> tree.x[:16].unique().tolist()                     # white after compositing
        [1.0]
    """
    from ...builders.document import document_tree
    from ...builders.image import image_tree
    from ...builders.text import text_tree

    if not isinstance(image, Tensor) or image.dim() != 3:
        raise ValueError("image must be one uint8 RGBA image [4, H, W], got "
                         f"{tuple(image.shape) if isinstance(image, Tensor) else image!r}")
    rgb = emoji_rgb(image, background)
    return document_tree(
        {"image": rgb, "text": text},
        text=lambda s: text_tree(s, tokenizer=tokenizer, embed=embed_text),
        image=lambda a: image_tree(a, patch_size, quadtree=quadtree, channels_first=True,
                                   embed=embed_patches))
