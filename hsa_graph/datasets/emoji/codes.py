r"""Emoji codes: code point sequences in hex, and the key shared by both packages'
spellings of them (:func:`emoji_join_key`: upper case, hyphen-separated, without the
``U+FE0F`` variation selector).
"""
from __future__ import annotations

import re

__all__ = ["emoji_join_key"]

_CODE_POINT = re.compile(r"[0-9A-F]{4,6}")


def emoji_join_key(code: str) -> str:
    """The key on which the two packages are joined: upper case, hyphen-separated code
    points, without the ``U+FE0F`` variation selector.

    Raises:
        ValueError: ``code`` is not a sequence of 4 to 6 digit hex code points.

    Example:
        >>> emoji_join_key("00a9-fe0f"), emoji_join_key("1F468_200D_1F373")
        ('00A9', '1F468-200D-1F373')
    """
    if not isinstance(code, str):
        raise TypeError(f"an emoji code must be a str, got {type(code).__name__}")
    parts = [p for p in re.split(r"[-_\s]+", code.strip().upper()) if p]
    if not parts or not all(_CODE_POINT.fullmatch(p) for p in parts):
        raise ValueError(f"{code!r} is not an emoji code (hex code points joined by '-')")
    key = "-".join(p for p in parts if p != "FE0F")
    if not key:
        raise ValueError(f"{code!r} holds only variation selectors")
    return key
