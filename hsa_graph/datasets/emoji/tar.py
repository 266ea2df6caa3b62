r"""Reading files from a ``.tgz`` archive into memory, and JSON among them.

Only regular files whose names are wanted are read, in one pass; nothing is written to
disk, so member paths (``../``, links) can do no harm. A damaged archive is an
``OSError`` that says to delete it (it is then fetched again).
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any, Callable, Dict, List

__all__: List[str] = []


def _read_members(archive: Path, wanted: Callable[[str], bool]) -> Dict[str, bytes]:
    """The contents of the members whose names ``wanted`` accepts, read into memory in
    one pass (nothing is written to disk, so member paths cannot escape anywhere)."""
    files: Dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if not wanted(member.name):
                    continue
                if not member.isfile():  # a link or device where a data file belongs
                    raise OSError(f"{member.name} is not a regular file")
                if member.name in files:
                    raise OSError(f"{member.name} occurs twice")
                files[member.name] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError, ValueError) as error:
        raise OSError(f"could not read {archive}: {error}; delete it to fetch it again") \
            from None
    return files


def _json(files: Dict[str, bytes], name: str, archive: Path) -> Any:
    if name not in files:
        raise FileNotFoundError(f"{archive} has no {name}")
    try:
        return json.loads(files[name])
    except ValueError as error:
        raise OSError(f"{name} in {archive} is not valid JSON: {error}") from None
