r"""The emoji dataset: :class:`EmojiDataset`, a sequence of :class:`EmojiRecord` with
its columns (RGBA images, codes, names, tags, groups, subgroups) also available whole,
and lookup by code in either package's spelling.
:func:`~hsa_graph.datasets.emoji.load_emoji` builds it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, List, NamedTuple, Tuple

import numpy as np
import torch
from torch import Tensor

from .codes import emoji_join_key
from .png import IMAGE_SIZE

if TYPE_CHECKING:  # the join builds the dataset and hands it its statistics
    from .join import EmojiJoinStats

__all__ = ["EmojiDataset", "EmojiRecord"]


class EmojiRecord(NamedTuple):
    """One emoji of :class:`EmojiDataset`.

    Attributes:
        code: the fully qualified code point sequence as emoji-datasource writes it,
            e.g. ``"1F600"``, ``"00A9-FE0F"``, ``"1F468-200D-1F373"``.
        char: the emoji itself (the string of those code points).
        name: emojibase's English label (CLDR name), e.g. ``"grinning face"``; unique.
        short_name: emoji-datasource's short name, e.g. ``"grinning"``.
        tags: emojibase's tags, e.g. ``("cheerful", "cheery", "face", ...)``.
        group: one of the 9 group names, e.g. ``"smileys-emotion"``.
        subgroup: one of the 98 subgroup names, e.g. ``"face-smiling"``.
        image: ``uint8 [4, 64, 64]`` RGBA pixels (a view into
            :attr:`EmojiDataset.images`).
    """

    code: str
    char: str
    name: str
    short_name: str
    tags: Tuple[str, ...]
    group: str
    subgroup: str
    image: Tensor


class EmojiDataset:
    r"""The 1,906 emoji with Google images, names, tags, groups and subgroups.

    A sequence of :class:`EmojiRecord` (``len``, ``dataset[i]``, iteration; ``code
    in dataset`` and :meth:`row` look emoji up by code); the columns are also
    available whole:

    Attributes:
        images: ``uint8 [N, 4, 64, 64]`` RGBA pixels (see :func:`emoji_rgb`).
        codes, chars, names, short_names: ``N`` strings each (see :class:`EmojiRecord`).
        tags: ``N`` tuples of strings.
        group: ``long [N]`` index into :attr:`group_names` (9 names, emojibase order).
        subgroup: ``long [N]`` index into :attr:`subgroup_names` (98 names).
        join: the :class:`EmojiJoinStats` of the load.

    Build it with :func:`load_emoji`.
    """

    def __init__(self, *, images: Tensor, codes: List[str], names: List[str],
                 short_names: List[str], tags: List[Tuple[str, ...]], group: Tensor,
                 subgroup: Tensor, group_names: Tuple[str, ...],
                 subgroup_names: Tuple[str, ...], join: EmojiJoinStats):
        n = images.shape[0]
        columns = {"codes": codes, "names": names, "short_names": short_names, "tags": tags,
                   "group": group, "subgroup": subgroup}
        bad = [name for name, column in columns.items() if len(column) != n]
        if images.shape[1:] != (4, IMAGE_SIZE, IMAGE_SIZE) or images.dtype != torch.uint8 \
                or bad:
            raise ValueError(f"inconsistent emoji columns: images {tuple(images.shape)} "
                             f"{images.dtype}, wrong length: {bad}")
        self.images = images
        self.codes = codes
        self.chars = ["".join(chr(int(p, 16)) for p in code.split("-")) for code in codes]
        self.names = names
        self.short_names = short_names
        self.tags = tags
        self.group = group
        self.subgroup = subgroup
        self.group_names = group_names
        self.subgroup_names = subgroup_names
        self.join = join

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> EmojiRecord:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"emoji indices must be int, got {type(index).__name__}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"emoji index {index} is out of range ({n} emoji)")
        i = int(index) % n
        return EmojiRecord(self.codes[i], self.chars[i], self.names[i], self.short_names[i],
                           self.tags[i], self.group_names[int(self.group[i])],
                           self.subgroup_names[int(self.subgroup[i])], self.images[i])

    def __iter__(self) -> Iterator[EmojiRecord]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self)} emoji, {len(self.group_names)} groups, "
                f"{len(self.subgroup_names)} subgroups, images {list(self.images.shape)})")

    def row(self, code: str) -> int:
        """The row of an emoji given its code in either package's spelling (e.g.
        ``"1f600"``, ``"00A9"`` or ``"00A9-FE0F"``).

        Raises:
            KeyError: no such emoji in the dataset.
            ValueError: ``code`` is not a code (see :func:`emoji_join_key`).
        """
        if not hasattr(self, "_rows"):
            self._rows = {emoji_join_key(c): i for i, c in enumerate(self.codes)}
        try:
            return self._rows[emoji_join_key(code)]
        except KeyError:
            raise KeyError(f"no emoji {code!r} in the dataset") from None

    def __contains__(self, code: object) -> bool:
        try:
            self.row(code)  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError):
            return False
        return True

    def texts(self, style: str = "name+tags") -> List[str]:
        """One text per emoji: ``"name"`` (``"grinning face"``) or ``"name+tags"``
        (``"grinning face: cheerful, cheery, face, grin, ..."``). Both are unique per
        emoji (tags alone are not: several emoji share theirs)."""
        if style == "name":
            return list(self.names)
        if style == "name+tags":
            return [f"{name}: {', '.join(tags)}" if tags else name
                    for name, tags in zip(self.names, self.tags)]
        raise ValueError(f"text style must be 'name' or 'name+tags', got {style!r}")
