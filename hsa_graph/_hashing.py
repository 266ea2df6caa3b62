"""The SHA-256 of a file, shared by the corpus caches and the checkpoints."""
from __future__ import annotations

import hashlib
import os
from typing import Union


def file_sha256(path: Union[str, os.PathLike]) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
