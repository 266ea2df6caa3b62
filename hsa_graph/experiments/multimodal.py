r"""Multi-modal classification: emoji image-text matching as key-value trees (the
analogue of the paper's Table 2, section 5.2).

**Data.** The 1,906 emoji of :func:`~hsa_graph.datasets.emoji.load_emoji` (Google's
64 x 64 images with emojibase's names and tags) and the matching task of
:func:`~hsa_graph.datasets.emoji.emoji_matching_pairs`: each emoji's image paired once
with its own text (label 1) and once with the text of another emoji (label 0), emoji
split into train / validation / test (stratified by group; a fixed test split, never
used for selection). The negative partner comes from any group (``negatives="any"``,
the default) or from the emoji's own group (``"same_group"``: the model must then tell
which face or which flag, from 64 x 64 pixels and about 1,500 training emoji).

**Why neither modality alone solves it.** Within a split every image occurs exactly
twice, once per label, and so does every text: a model that sees only the image (or
only the text) must give both examples of an image (a text) the same answer, so it
scores exactly 50 %, whatever it learned. Only the *interaction* of image and text
carries the label: with ``"any"`` negatives, e.g. whether the picture shows a flag and
the words name a flag. This module measures it too: ``HSA (image)`` and ``HSA (text)``
are HSA on one modality's subtree.

**Trees.** Each example is :func:`~hsa_graph.datasets.emoji.emoji_document`: a
``keyvalue`` root with an ``image`` field (a grid of 8 x 16 RGB patches: 32 leaves of
384 values, the *ink* ``1 - rgb`` on a white background, so blank patches are zero:
with raw pixels, mostly 1.0, the image side did not train at all) and a ``text``
field (paragraph -> sentence -> MiniLM word pieces with their static MiniLM
embeddings, 384 values). The classifier projects each modality with its own weights
(``num_modalities=2``).

**Models** (:class:`~hsa_graph.nn.TreeClassifier`, one HTE layer with 3 heads, mean
pooling, MLP; the same parameter count for all):

* ``HSA``: hierarchical attention on the image + text tree;
* ``FSA (text)``: flat softmax attention on the text only, the paper's FSA baseline
  (which concatenates the text fields and drops the image); here it is at chance by
  construction, the point of the task;
* ``FSA``: flat attention over all leaves of the image + text tree (added: the fair
  flat baseline for this task);
* ``DeepSet``: no attention, image + text leaves pooled;
* ``HSA (image)`` / ``HSA (text)``: one modality only (chance by construction).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..cli import show_progress
from .embeddings import static_embeddings
from .sentiment import (
    MODEL_NAMES,
    ExperimentConfig,
    compare,
    markdown_table,
    summarize,
    write_results,
)

__all__ = ["MultimodalConfig", "VARIANTS", "add_arguments", "build_emoji_trees", "run",
           "run_multimodal"]

#: ``(variant, data, attention)``: the compared models.
VARIANTS = (
    ("HSA", "image+text", "hierarchical"),
    ("FSA (text)", "text", "flat"),
    ("FSA", "image+text", "flat"),
    ("DeepSet", "image+text", "none"),
    ("HSA (image)", "image", "hierarchical"),
    ("HSA (text)", "text", "hierarchical"),
)

PATCH = (8, 16)  # 8 * 16 * 3 = 384 raw values, the width of MiniLM's token vectors


@dataclass
class MultimodalConfig(ExperimentConfig):
    """Settings of :func:`run_multimodal` (the defaults are the full run).

    Args:
        variants: names from :data:`VARIANTS` to run.
        seeds: model seeds (the split is fixed by ``split_seed``).
        num_emoji: use a group-stratified subset of about this many emoji, at least 20
            per group (``None``: all 1,906).
        limit: keep at most this many examples of each split (quick checks; the
            pairs come in random order, so the kept ones are a random sample).
        negatives: where a negative text comes from, ``"any"`` group or the
            ``"same_group"`` (see :func:`~hsa_graph.datasets.emoji.emoji_matching_pairs`).
        epochs: training epochs (default 10); ``split_seed`` fixes the split and the
            negative partners; the other settings are those of
            :class:`~hsa_graph.experiments.sentiment.ExperimentConfig`.
    """

    variants: Tuple[str, ...] = tuple(v[0] for v in VARIANTS)
    num_emoji: Optional[int] = None
    limit: Optional[int] = None
    negatives: str = "any"
    epochs: int = 10

    def validate(self) -> None:
        known = [v[0] for v in VARIANTS]
        for name in self.variants:
            if name not in known:
                raise ValueError(f"unknown variant {name!r}; choose from {known}")
        if not self.variants:
            raise ValueError("give at least one variant")
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")
        if self.negatives not in ("any", "same_group"):
            raise ValueError(f"negatives must be 'any' or 'same_group', got "
                             f"{self.negatives!r}")
        if self.limit is not None and self.limit < 2:
            raise ValueError(f"limit must be >= 2 (or None), got {self.limit}")
        if self.num_emoji is not None and self.num_emoji < 180:
            raise ValueError(f"num_emoji must be >= 180 (20 per group, or None), got "
                             f"{self.num_emoji}")


QUICK = dict(seeds=2, num_emoji=400, epochs=5)


def build_emoji_trees(pairs: Sequence[Any], data: str = "image+text") -> List[Any]:
    """One tree per :class:`~hsa_graph.datasets.emoji.EmojiPair` with ``y`` its label:
    ``"image+text"`` (the key-value document), ``"image"`` (its image subtree only) or
    ``"text"`` (its text subtree only); leaves are 384-dimensional in every case."""
    from ..builders.image import image_tree
    from ..builders.text import load_minilm_tokenizer, text_tree
    from ..datasets.emoji import emoji_document, emoji_rgb

    if data not in ("image+text", "image", "text"):
        raise ValueError(f"data must be 'image+text', 'image' or 'text', got {data!r}")
    tokenizer = load_minilm_tokenizer()

    def patches(p):
        return 1.0 - p.flatten(1)  # ink on a white background: blank patches are 0

    trees = []
    for pair in pairs:
        if data == "image+text":
            tree = emoji_document(pair.image, pair.text, embed_text=static_embeddings,
                                  embed_patches=patches, tokenizer=tokenizer,
                                  patch_size=PATCH)
        elif data == "image":
            tree = image_tree(emoji_rgb(pair.image), PATCH, channels_first=True,
                              embed=patches, modality=1)
        else:
            tree = text_tree(pair.text, tokenizer=tokenizer, embed=static_embeddings,
                             modality=0)
            del tree.tokens, tree.span
        tree.y = torch.tensor([int(pair.label)])
        trees.append(tree)
    return trees


def _subset(dataset, size: int, seed: int) -> Any:
    """A group-stratified subset of the emoji dataset (same class, fewer rows)."""
    from ..datasets.emoji import EmojiDataset

    generator = torch.Generator().manual_seed(seed)
    keep = []
    for g in dataset.group.unique().tolist():
        members = (dataset.group == g).nonzero().view(-1)
        # >= 20 per group: 10 % validation and test shares then hold two emoji of it
        share = max(20, round(size * members.numel() / len(dataset)))
        keep.append(members[torch.randperm(members.numel(), generator=generator)[:share]])
    rows = torch.cat(keep).sort().values.tolist()
    return EmojiDataset(images=dataset.images[rows], codes=[dataset.codes[i] for i in rows],
                        names=[dataset.names[i] for i in rows],
                        short_names=[dataset.short_names[i] for i in rows],
                        tags=[dataset.tags[i] for i in rows], group=dataset.group[rows],
                        subgroup=dataset.subgroup[rows], group_names=dataset.group_names,
                        subgroup_names=dataset.subgroup_names, join=dataset.join)


def run_multimodal(config: Optional[MultimodalConfig] = None) -> Dict[str, Any]:
    """Run the comparison; returns ``{"config", "data", "runs", "summary", "markdown",
    "seconds"}`` (and writes them under ``config.output_dir`` when set)."""
    from ..datasets.emoji import emoji_matching_pairs, load_emoji

    config = config or MultimodalConfig()
    config.validate()
    start = time.perf_counter()
    dataset = load_emoji(config.cache_dir)
    if config.num_emoji is not None and config.num_emoji < len(dataset):
        dataset = _subset(dataset, config.num_emoji, config.split_seed)
    train, val, test = emoji_matching_pairs(dataset, seed=config.split_seed,
                                            negatives=config.negatives)
    if config.limit is not None:
        train, val, test = (split[:config.limit] for split in (train, val, test))
    pairs = list(train) + list(val) + list(test)
    bounds = torch.tensor([0, len(train), len(train) + len(val), len(pairs)])
    index = [torch.arange(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]
    chosen = [v for v in VARIANTS if v[0] in config.variants]
    datasets = {}
    for data in dict.fromkeys(v[1] for v in chosen):
        if config.progress:
            print(f"building {len(pairs)} {data} trees", flush=True)
        datasets[data] = build_emoji_trees(pairs, data)
    # Each variant gets its own name so that summaries keep them apart.
    named = {name: datasets[data] for name, data, _ in chosen}
    result = compare(named, lambda seed: tuple(index), config, in_channels=384, num_classes=2,
                     num_modalities=2, variants=[(name, att) for name, _, att in chosen])
    for r in result["runs"]:
        r["variant"] = r.pop("name")
        r["label"] = r["variant"]
    summary = summarize(result["runs"], ("variant", "attention"))
    for row in summary:
        row["model"] = MODEL_NAMES[row["attention"]]
        row["data"] = next(d for n, d, _ in chosen if n == row["variant"])
        row["label"] = row["variant"]
    leaves = torch.tensor([t.num_leaves for t in datasets[chosen[0][1]]], dtype=torch.float)
    out = {"task": "multimodal", "title": "Emoji image-text matching: HSA vs FSA vs DeepSet",
           "command": config.command,
           "config": asdict(config),
           "data": {"emoji": len(dataset), "train": len(train), "val": len(val),
                    "test": len(test), "mean_leaves": float(leaves.mean())},
           "runs": result["runs"], "summary": summary,
           "markdown": markdown_table(summary, "variant", "example"),
           "seconds": time.perf_counter() - start}
    if config.output_dir is not None:
        write_results(out, config.output_dir, "multimodal")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add this experiment's options to ``parser`` (used by ``hsa-graph multimodal``)."""
    d = MultimodalConfig()
    parser.add_argument("--quick", action="store_true",
                        help="a short version: " + ", ".join(f"{k}={v}" for k, v in
                                                            QUICK.items()))
    parser.add_argument("--variants", nargs="+", choices=[v[0] for v in VARIANTS],
                        default=None, help="models to compare (default: all)")
    parser.add_argument("--seeds", type=int, default=None, help=f"default {d.seeds}")
    parser.add_argument("--num-emoji", type=int, default=None,
                        help="group-stratified subset of the 1,906 emoji (default: all)")
    parser.add_argument("--negatives", choices=["any", "same_group"], default=None,
                        help="negative texts from any group, or from the image's own "
                             f"group (harder) (default {d.negatives})")
    parser.add_argument("--epochs", type=int, default=None, help=f"default {d.epochs}")
    parser.add_argument("--batch-size", type=int, default=None, help=f"default {d.batch_size}")
    parser.add_argument("--lr", type=float, default=None, help=f"AdamW lr (default {d.lr})")
    parser.add_argument("--cache-dir", default=None,
                        help="emoji archive cache (default $HSA_GRAPH_CACHE or "
                             "~/.cache/hsa_graph)")
    parser.add_argument("--out", "--output-dir", dest="output_dir", default=None,
                        help="write JSON, Markdown and plots here")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (shown by default only when stderr is a "
                             "terminal, so redirected logs stay short)")
    return parser


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Run from parsed arguments, print the table, return the results."""
    values: Dict[str, Any] = dict(QUICK) if getattr(args, "quick", False) else {}
    for name in ("variants", "seeds", "num_emoji", "negatives", "epochs", "batch_size", "lr",
                 "cache_dir", "output_dir"):
        value = getattr(args, name, None)
        if value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    values["progress"] = show_progress(getattr(args, "no_progress", False))
    if getattr(args, "argv", None) is not None:
        values["command"] = "hsa-graph multimodal " + " ".join(args.argv)
    out = run_multimodal(MultimodalConfig(**values))
    print(out["markdown"])
    return out


if __name__ == "__main__":  # pragma: no cover
    run(add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                          allow_abbrev=False)).parse_args())
