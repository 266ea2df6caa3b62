r"""The image-text matching task on the emoji (:func:`emoji_matching_pairs`), in which
neither modality alone helps: every image is paired once with its own text (label 1)
and once with the text of a partner emoji (label 0), so within a split each image and
each text occurs once with each label.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from .dataset import EmojiDataset

__all__ = ["EmojiPair", "EmojiSplits", "emoji_matching_pairs"]


class EmojiPair(NamedTuple):
    """One example of the matching task.

    Attributes:
        image: ``uint8 [4, 64, 64]`` RGBA pixels of emoji ``image_index``.
        text: the text of emoji ``text_index``.
        label: ``1`` if the text is the image's own (``image_index == text_index``),
            else ``0``.
        image_index, text_index: rows of the :class:`EmojiDataset`.
    """

    image: Tensor
    text: str
    label: int
    image_index: int
    text_index: int


class EmojiSplits(NamedTuple):
    """The train / validation / test lists of :class:`EmojiPair`."""

    train: List[EmojiPair]
    val: List[EmojiPair]
    test: List[EmojiPair]


_SPLITS = ("train", "val", "test")


def _check_fractions(fractions: Any) -> Tuple[float, float, float]:
    try:
        values = tuple(float(f) for f in fractions)
    except (TypeError, ValueError):
        raise TypeError(f"fractions must be three numbers (train, val, test), got "
                        f"{fractions!r}") from None
    if len(values) != 3 or any(not np.isfinite(f) or f < 0 for f in values) \
            or abs(sum(values) - 1) > 1e-6 or values[0] == 0 or values[2] == 0:
        raise ValueError(f"fractions must be (train, val, test) >= 0 summing to 1, with "
                         f"train and test > 0, got {fractions!r}")
    return values


def _shuffled_sort(key: Tensor, generator: torch.Generator) -> Tensor:
    """A permutation that sorts ``key``, ties in random order."""
    perm = torch.randperm(key.numel(), generator=generator)
    return perm[torch.sort(key[perm], stable=True).indices]


def _cell_ranks(cell: Tensor, generator: torch.Generator) -> Tuple[Tensor, Tensor, Tensor]:
    """For each element: a random rank within its cell, the cell's size, and (as the
    third tensor) the element order that lists the cells one after the other."""
    order = _shuffled_sort(cell, generator)
    sizes = torch.bincount(cell)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(cell)
    rank[order] = torch.arange(cell.numel()) - starts[cell[order]]
    return rank, sizes[cell], order


def _derangement(cell: Tensor, generator: torch.Generator) -> Tensor:
    """``partner[i]``: another element of ``i``'s cell, with ``partner`` a permutation
    (each element is the partner of exactly one other): the cell's members in random
    order, each mapped to the next one, cyclically."""
    rank, size, order = _cell_ranks(cell, generator)
    if bool((size < 2).any()):
        raise ValueError("a cell has a single emoji, which has no partner")
    sorted_rank = rank[order]
    first = torch.arange(cell.numel()) - sorted_rank  # where each member's cell begins
    successor = first + (sorted_rank + 1) % size[order]
    partner = torch.empty_like(order)
    partner[order] = order[successor]
    return partner


def emoji_matching_pairs(
    dataset: EmojiDataset,
    *,
    seed: int = 0,
    negatives: str = "same_group",
    split: str = "emoji",
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    text: str = "name+tags",
) -> EmojiSplits:
    r"""Image-text matching: does this text describe this emoji image?

    Every emoji ``i`` gives two examples: its image with its own text (label 1) and its
    image with the text of its *partner* ``j`` (label 0). Partners form a permutation
    without fixed points inside each cell of emoji (those of one split with
    ``split="emoji"``, of one group with ``negatives="same_group"``, both by default),
    so every text is also used exactly once as a negative:

    .. math::
        \{(x_i, t_i, 1)\}_i \cup \{(x_i, t_{\pi(i)}, 0)\}_i, \quad \pi(i) \ne i,\;
        \pi \text{ a permutation of each cell.}

    **Why neither modality alone helps.** Within each split, each image occurs exactly
    twice, once with each label, and so does each text. Any classifier that looks only
    at the image (or only at the text) gives both examples of that image (text) the
    same answer, one right and one wrong: it scores exactly 50 % on every split,
    whatever it learned. More generally the positive and the negative examples hold
    the same images and the same texts, so even a sum ``g(image) + h(text)`` of
    unimodal scores has the same mean on both labels: the modalities must interact
    (e.g. attention across the image and text subtrees). With same-group negatives
    both texts of an image also name an emoji of the image's group, so recognising the
    group (a face, a flag, an animal) from either side does not help either; the model
    must match the fine content of the image to the words (which face, which flag).

    **Splits.** ``split="emoji"`` (default) assigns *emoji* to train / val / test,
    stratified by group, and pairs only within a split: test images and texts are never
    seen in training, so test accuracy measures generalisation to new emoji. ``split=
    "pair"`` pairs over the whole dataset (partners within the group) and then splits
    the positive and the negative examples separately at random (so every split stays
    balanced): an image can be seen in training with one label and tested with the
    other, which rewards memorising the training pairs; per-image balance then holds
    over the whole dataset, not per split. The split and the partners depend only on
    ``seed`` (a fixed held-out test set: keep ``seed`` fixed and vary the model's own
    seed).

    Args:
        dataset: from :func:`load_emoji`.
        seed: seed of the split, the partners and the order of the examples.
        negatives: ``"same_group"`` (partner from the same group) or ``"any"`` (from
            the whole split: easier, a group mismatch then gives the answer away).
        split: ``"emoji"`` or ``"pair"``.
        fractions: ``(train, val, test)`` shares of the emoji (``"emoji"``) or of the
            examples of each label (``"pair"``); val may be 0.
        text: :meth:`EmojiDataset.texts` style, ``"name+tags"`` or ``"name"``.

    Returns:
        :class:`EmojiSplits` of lists of :class:`EmojiPair`, each split half label 1,
        half label 0, in random order.

    Raises:
        ValueError: a bad option, or fractions that leave a single emoji of a group in
            a split (it would have no partner).

    Example (not run here: it needs the archives)::

        train, val, test = emoji_matching_pairs(load_emoji(), seed=0)
        len(train), len(val), len(test)       # 2 examples per emoji of each split
        pair = train[0]
        tree = emoji_document(pair.image, pair.text, embed_text=..., embed_patches=...)
        target = pair.label
    """
    if negatives not in ("same_group", "any"):
        raise ValueError(f"negatives must be 'same_group' or 'any', got {negatives!r}")
    if split not in ("emoji", "pair"):
        raise ValueError(f"split must be 'emoji' or 'pair', got {split!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    f_train, f_val, _ = _check_fractions(fractions)
    texts = dataset.texts(text)
    group = dataset.group.long().cpu()
    n = group.numel()
    generator = torch.Generator().manual_seed(int(seed))

    def cut(rank: Tensor, size: Tensor) -> Tensor:
        """Split id (0, 1, 2) of each element from its rank among ``size`` elements."""
        train_end = torch.round(size * f_train).long()
        val_end = torch.round(size * (f_train + f_val)).long()
        return (rank >= train_end).long() + (rank >= val_end).long()

    pool = group if negatives == "same_group" else torch.zeros_like(group)
    if split == "emoji":
        rank, size, _ = _cell_ranks(group, generator)
        emoji_split = cut(rank, size)  # stratified: every group in every split
        cell = emoji_split * (int(pool.max()) + 1) + pool  # (split, group) cells
        positive_split = negative_split = emoji_split
    else:
        cell = pool
    if len(set(texts)) != len(texts):  # a negative could then read like a positive
        raise ValueError(f"the {text!r} texts of the dataset are not unique")
    groups = int(pool.max()) + 1
    sizes = torch.bincount(cell)
    lonely = (sizes == 1).nonzero().flatten().tolist()
    if lonely:
        where = []
        for c in lonely[:3]:
            part, g = divmod(c, groups)
            where.append(", ".join(
                ([f"the {_SPLITS[part]} split"] if split == "emoji" else [])
                + ([f"group {dataset.group_names[g]!r}"] if negatives == "same_group" else [])))
        raise ValueError(f"a single emoji in {'; '.join(where)}: it has no partner for a "
                         f"negative example; change fractions (got {tuple(fractions)})")
    partner = _derangement(cell, generator)
    if split == "pair":
        everyone = torch.zeros(n, dtype=torch.long)
        rank, size, _ = _cell_ranks(everyone, generator)
        positive_split = cut(rank, size)
        rank, size, _ = _cell_ranks(everyone, generator)
        negative_split = cut(rank, size)

    image_index = torch.cat([torch.arange(n), torch.arange(n)])
    text_index = torch.cat([torch.arange(n), partner])
    label = torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)])
    example_split = torch.cat([positive_split, negative_split])
    order = _shuffled_sort(example_split, generator)  # by split, shuffled within
    counts = torch.bincount(example_split[order], minlength=3).tolist()
    images = dataset.images
    pairs = [EmojiPair(images[i], texts[t], y, i, t) for i, t, y in zip(
        image_index[order].tolist(), text_index[order].tolist(), label[order].tolist())]
    bounds = np.cumsum([0] + counts).tolist()
    return EmojiSplits(*(pairs[bounds[s]:bounds[s + 1]] for s in range(3)))
