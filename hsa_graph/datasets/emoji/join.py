r"""The two-source join: :func:`load_emoji` reads ``emoji-datasource-google`` (codes,
short names, categories, Google images) and ``emojibase-data`` (English names, tags,
groups, subgroups) from their archives and joins them on :func:`emoji_join_key` into an
:class:`EmojiDataset`, leaving out group :data:`EXCLUDED_GROUP`; the figures of the
join are its :class:`EmojiJoinStats` (see :mod:`hsa_graph.datasets.emoji`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from ..pang_lee import _resolve_cache
from .codes import emoji_join_key
from .dataset import EmojiDataset
from .npm import _archive, _NpmArchive
from .png import _decode
from .tar import _json, _read_members

__all__ = ["EmojiJoinStats", "load_emoji"]

DATASOURCE = _NpmArchive("emoji-datasource-google", "16.0.0",
                         "fb5fd131b362aab7a55542d2a147a79708cce0a8b1c1bbacd470172708b5c438", 74)
EMOJIBASE = _NpmArchive("emojibase-data", "17.0.0",
                        "d01d0e2ca4e22cb402679532155342c71e2e871f25c32223c013b8b166ebdf5a", 6.7)
#: the emojibase group left out: skin-tone swatches and hair-style components
EXCLUDED_GROUP = "component"
_IMAGE_DIR = "package/img/google/64/"
_IMAGE_NAME = re.compile(r"[0-9a-f]{4,6}(-[0-9a-f]{4,6})*\.png")


def _is_datasource_member(name: str) -> bool:
    """``emoji.json`` and the 64 x 64 Google images: plain code-point file names only."""
    return name == "package/emoji.json" or (
        name.startswith(_IMAGE_DIR) and _IMAGE_NAME.fullmatch(name[len(_IMAGE_DIR):])
        is not None)


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
