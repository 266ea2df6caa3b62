r"""Decoding the emoji's PNG files into ``uint8`` RGBA pixels.

PIL reads each file (RGBA, palette with transparency, or gray + alpha) and converts it
to RGBA; an image that is not ``IMAGE_SIZE x IMAGE_SIZE`` or does not decode is an
``OSError`` naming the file.
"""
from __future__ import annotations

import io
from typing import List

import numpy as np

__all__: List[str] = []

IMAGE_SIZE = 64


def _decode(data: bytes, name: str) -> np.ndarray:
    from PIL import Image  # pillow comes with matplotlib; only the loader needs it

    try:
        with Image.open(io.BytesIO(data)) as image:
            # convert() applies palette transparency and expands gray + alpha
            pixels = np.asarray(image.convert("RGBA"))
    except (OSError, ValueError, SyntaxError) as error:
        raise OSError(f"cannot decode {name}: {error}") from None
    if pixels.shape != (IMAGE_SIZE, IMAGE_SIZE, 4):
        raise OSError(f"{name} is {pixels.shape[1]} x {pixels.shape[0]}, expected "
                      f"{IMAGE_SIZE} x {IMAGE_SIZE}")
    return pixels
