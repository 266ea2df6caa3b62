r"""Hierarchical sentiment: HSA vs flat attention vs DeepSet on Pang & Lee's reviews
(the analogue of the paper's Table 1, section 5.1).

**Data.** The 1,500 full movie reviews of Pang & Lee (750 positive, 750 negative,
:func:`~hsa_graph.datasets.load_pang_lee_reviews`), each a tree
document -> paragraph -> sentences -> word pieces built by :func:`~hsa_graph.text_trees`
with MiniLM's tokenizer and the corpus' own sentence split (one per line; the corpus
has no paragraph breaks, so the single paragraph node is unary, which HSA ignores).
The leaves carry MiniLM token embeddings (:mod:`~hsa_graph.experiments.embeddings`):
``static`` (input embedding rows: the Word2Vec analogue) or ``contextual`` (last hidden
states, the model run per sentence: the T5 analogue).

**Protocol.** A stratified test split (``test_fraction``, drawn once with
``split_seed``) is set aside and never used for selection. For each of ``seeds`` seeds
the rest is split again into train and validation (``val_fraction``), each model is
initialised from that seed (so HSA, FSA and DeepSet start from the same weights: they
share one parameter layout), trained with :func:`~hsa_graph.experiments.fit`, which
keeps the epoch with the best validation accuracy, and scored once on the test split.
Accuracy and macro F1 are reported as mean and 95 % interval over the seeds
(Student's t with ``seeds - 1`` degrees of freedom), with the wall time per training
epoch and the attention FLOPs per review (:func:`~hsa_graph.nn.attention_flops`,
averaged over the test reviews).

**Models.** :class:`~hsa_graph.nn.TreeClassifier` (appendix I.2: input projection, one
HTE layer with 3 heads, global mean pooling, one-hidden-layer MLP) with
``attention="hierarchical"`` (HSA), ``"flat"`` (FSA) and ``"none"`` (DeepSet); and,
with ``"induced"`` among the attentions (not by default), HSA on the hierarchy the
layer induces from its own keys (``induce="contiguous"``, families of at most 4,
contiguous in the review's token order: *HSA-induced*), next to the semantic one.

Command line (through ``hsa-graph sentiment`` or ``python -m hsa_graph.experiments.sentiment``):
``--quick`` is the main job's short version (a subset of short reviews, 2 seeds, few
epochs); without it, the full protocol runs.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..cli import show_progress
from ..nn.attention import ATTENTIONS
from ..nn.classifier import TreeClassifier
from .embeddings import EMBEDDINGS, cached_embeddings, sentence_lengths
from .train import TrainConfig, evaluate, fit

__all__ = [
    "ExperimentConfig",
    "MODEL_NAMES",
    "VARIANTS",
    "SentimentConfig",
    "add_arguments",
    "build_review_trees",
    "compare",
    "interval",
    "markdown_table",
    "run",
    "run_sentiment",
    "write_results",
    "split_indices",
    "summarize",
    "truncate_reviews",
]

#: The paper's names of the three attention variants, and the induced hierarchy.
MODEL_NAMES = {"hierarchical": "HSA", "flat": "FSA", "none": "DeepSet",
               "induced": "HSA-induced"}

#: The variants the comparisons can run: the attention modes of
#: :class:`~hsa_graph.nn.HSAttention`, and ``"induced"``: HSA on a tree each layer
#: builds from its own keys (:func:`~hsa_graph.induce.contiguous_tree`, no gradient
#: through the choice) instead of the semantic tree, which then only delimits the
#: examples.
VARIANTS = ATTENTIONS + ("induced",)


@dataclass
class ExperimentConfig:
    """Settings every comparison shares: training, the model, and where results go.

    Args:
        seeds: number of seeds (model initialisations; see each experiment for splits).
        split_seed: the seed of the fixed test split.
        epochs, batch_size, lr, weight_decay, grad_clip: training (AdamW).
        channels, heads, hidden_channels, pos_dim, dropout: the model
            (:class:`~hsa_graph.nn.TreeClassifier`).
        cache_dir: cache of the corpus and the embeddings.
        output_dir: where JSON, Markdown and plots go (``None``: nowhere).
        progress: progress bars.
        command: the command line that runs this configuration (for the report).
    """

    seeds: int = 5
    split_seed: int = 0
    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    grad_clip: Optional[float] = 1.0
    channels: int = 128
    heads: int = 3
    hidden_channels: int = 128
    pos_dim: Optional[int] = 16
    dropout: float = 0.1
    cache_dir: Optional[str] = None
    output_dir: Optional[str] = None
    progress: bool = True
    command: Optional[str] = None


@dataclass
class SentimentConfig(ExperimentConfig):
    """Settings of :func:`run_sentiment` (the defaults are the full run); training,
    model and output settings are those of :class:`ExperimentConfig`.

    Args:
        embeddings: token embeddings to compare (``"static"``, ``"contextual"``).
        attentions: variants (``"hierarchical"``, ``"flat"``, ``"none"``, and
            ``"induced"``, see :data:`VARIANTS`).
        seeds: number of seeds (train/validation splits and initialisations).
        num_reviews: use a stratified subset of this many reviews (``None``: all 1,500).
        max_tokens: keep whole sentences of each review up to this many word pieces
            (``None``: whole reviews). Default 256, which keeps the full run (1,500
            reviews, 5 seeds, 6 variants) near an hour on 2 CPU cores; the paper trains
            on at most 512 tokens (``max_tokens=512``).
        epochs: training epochs (default 6).
        keep: keep the ``"last"`` sentences (a review's verdict closes it) or the
            ``"first"`` ones (see :func:`truncate_reviews`).
        test_fraction / val_fraction: the fixed test split, and the validation share
            of the rest.
    """

    embeddings: Tuple[str, ...] = ("static", "contextual")
    attentions: Tuple[str, ...] = ("hierarchical", "flat", "none")
    num_reviews: Optional[int] = None
    max_tokens: Optional[int] = 256
    epochs: int = 6
    keep: str = "last"
    test_fraction: float = 0.2
    val_fraction: float = 0.1

    def validate(self) -> None:
        for name in self.embeddings:
            if name not in EMBEDDINGS:
                raise ValueError(f"unknown embedding {name!r}; choose from {EMBEDDINGS}")
        for name in self.attentions:
            if name not in VARIANTS:
                raise ValueError(f"unknown attention {name!r}; choose from {VARIANTS}")
        if not self.embeddings or not self.attentions:
            raise ValueError("give at least one embedding and one attention")
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")
        if self.num_reviews is not None and self.num_reviews < 10:
            raise ValueError(f"num_reviews must be >= 10 (or None), got {self.num_reviews}")
        if self.keep not in ("first", "last"):
            raise ValueError(f"keep must be 'first' or 'last', got {self.keep!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None), got {self.max_tokens}")
        for name in ("test_fraction", "val_fraction"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"{name} must lie in (0, 1), got {value}")


#: ``--quick``: the main job's short version (minutes on 2 CPU cores).
QUICK = dict(seeds=3, num_reviews=300, max_tokens=128, epochs=4, batch_size=16, lr=2e-3)


# ------------------------------------------------------------------ data
def truncate_reviews(texts: Sequence[str], max_tokens: int, tokenizer: Any,
                     keep: str = "last") -> List[str]:
    """Each text cut to its last (``keep="last"``) or first (``"first"``) whole lines
    (sentences) that hold at most ``max_tokens`` word pieces together; at least one line
    is kept. A review's verdict usually closes it, hence the default.

    Example:
        >>> from hsa_graph.builders.text import load_minilm_tokenizer
        >>> tokenizer = load_minilm_tokenizer()
        >>> truncate_reviews(["a good film .\\nbad ending .\\nfine ."], 6, tokenizer)
        ['bad ending .\\nfine .']
        >>> truncate_reviews(["a good film .\\nbad ending .\\nfine ."], 7, tokenizer, "first")
        ['a good film .\\nbad ending .']
    """
    if keep not in ("first", "last"):
        raise ValueError(f"keep must be 'first' or 'last', got {keep!r}")
    lines = [text.splitlines() for text in texts]
    if keep == "last":
        lines = [doc[::-1] for doc in lines]
    flat = [line for doc in lines for line in doc]
    counts = torch.tensor([len(e.ids) for e in tokenizer.encode_batch(
        flat, add_special_tokens=False)] if flat else [], dtype=torch.long)
    per_doc = torch.tensor([len(doc) for doc in lines])
    doc_of = torch.repeat_interleave(torch.arange(len(lines)), per_doc)
    # word pieces from the kept end up to and including each line, within its document
    total = torch.cumsum(counts, 0)
    start = torch.repeat_interleave(torch.cumsum(per_doc, 0) - per_doc, per_doc)
    before = torch.cat([torch.zeros(1, dtype=torch.long), total])[start]
    first = torch.arange(len(flat)) == start
    kept = torch.bincount(doc_of[(total - before <= max_tokens) | first],
                          minlength=len(lines)).tolist()
    if keep == "last":
        return ["\n".join(doc[:k][::-1]) for doc, k in zip(lines, kept)]
    return ["\n".join(doc[:k]) for doc, k in zip(lines, kept)]


def _stratified_subset(labels: Tensor, size: int, generator: torch.Generator) -> Tensor:
    """``size`` indices, classes in proportion (sorted)."""
    chosen = []
    for c in labels.unique().tolist():
        members = (labels == c).nonzero().view(-1)
        share = round(size * members.numel() / labels.numel())
        chosen.append(members[torch.randperm(members.numel(), generator=generator)[:share]])
    return torch.cat(chosen).sort().values


def split_indices(labels: Tensor, test_fraction: float, val_fraction: float, split_seed: int,
                  seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(train, val, test)`` index tensors: a stratified test split fixed by
    ``split_seed`` (the same for every ``seed``), then a stratified validation split of
    the rest drawn with ``seed``.

    Example:
        >>> labels = torch.tensor([0, 1] * 10)
        >>> a = split_indices(labels, 0.2, 0.25, 0, seed=1)
        >>> b = split_indices(labels, 0.2, 0.25, 0, seed=2)
        >>> [t.numel() for t in a], torch.equal(a[2], b[2]), torch.equal(a[1], b[1])
        ([12, 4, 4], True, False)
    """
    n = labels.numel()
    test = _stratified_subset(labels, round(n * test_fraction),
                              torch.Generator().manual_seed(split_seed))
    rest = torch.ones(n, dtype=torch.bool)
    rest[test] = False
    rest = rest.nonzero().view(-1)
    val = rest[_stratified_subset(labels[rest], round(rest.numel() * val_fraction),
                                  torch.Generator().manual_seed(10_000 + seed))]
    train = torch.ones(n, dtype=torch.bool)
    train[test] = False
    train[val] = False
    return train.nonzero().view(-1), val, test


def build_review_trees(reviews: Sequence[Tuple[str, int]], embedding: str, *,
                       max_tokens: Optional[int] = None, keep: str = "last",
                       cache_dir: Optional[str] = None, progress: bool = False) -> List[Any]:
    """One tree per review (see the module docstring) with ``x`` ``[n, 384]`` float16
    MiniLM embeddings of kind ``embedding`` and ``y`` ``[1]`` its label.

    Example:
        >>> trees = build_review_trees([("a good film .\\nfine .", 1)], "static")
        >>> trees[0].x.shape, trees[0].y.tolist(), trees[0].num_nodes   # doc, par, 2 sentences
        (torch.Size([6, 384]), [1], 10)
    """
    from ..builders.text import load_minilm_tokenizer, text_trees

    if embedding not in EMBEDDINGS:
        raise ValueError(f"embedding must be one of {EMBEDDINGS}, got {embedding!r}")
    if len(reviews) == 0:
        raise ValueError("no reviews given")
    tokenizer = load_minilm_tokenizer()
    texts = [text for text, _ in reviews]
    if max_tokens is not None:
        texts = truncate_reviews(texts, max_tokens, tokenizer, keep)
    batch = text_trees(texts, tokenizer=tokenizer, split_lines=True)
    ids = batch.x
    x = cached_embeddings(ids, sentence_lengths(batch), embedding, cache_dir=cache_dir,
                          progress=progress)
    batch.x = x
    trees = batch.to_data_list()
    for tree, (_, label) in zip(trees, reviews):
        del tree.tokens, tree.span  # not needed for training
        tree.y = torch.tensor([label], dtype=torch.long)
    return trees


# ------------------------------------------------------------------ statistics
def interval(values: Sequence[float], confidence: float = 0.95) -> Tuple[float, float]:
    """``(mean, half-width)`` of the Student-t confidence interval of the mean
    (half-width ``nan`` for a single value).

    Example:
        >>> m, h = interval([0.7, 0.8, 0.9])
        >>> round(m, 3), round(h, 3)        # t(0.975, 2) = 4.303, s = 0.1
        (0.8, 0.248)
    """
    from scipy.stats import t as student_t

    values = [float(v) for v in values]
    if not values:
        raise ValueError("interval of no values")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, float(student_t.ppf(0.5 + confidence / 2, len(values) - 1)) * sd / math.sqrt(
        len(values))


def _fmt(mean: float, half: float) -> str:
    return f"{mean:.4f} ± {half:.4f}" if half == half else f"{mean:.4f}"


def markdown_table(summary: Sequence[Dict[str, Any]], column: str = "embedding",
                   unit: str = "review") -> str:
    """The comparison as a Markdown table: one row per ``summary`` entry, first column
    its ``column`` value (e.g. the embedding), then the model and the figures."""
    lines = [f"| {column} | model | accuracy (95% CI) | macro F1 (95% CI) | seeds | "
             f"attention MFLOPs / {unit} | s / epoch | parameters |",
             "|---|---|---|---|---|---|---|---|"]
    for row in summary:
        lines.append(
            f"| {row[column]} | {row['model']} | "
            f"{_fmt(row['accuracy_mean'], row['accuracy_ci95'])} | "
            f"{_fmt(row['f1_mean'], row['f1_ci95'])} | {row['seeds']} | "
            f"{row['attention_mflops_per_example']:.2f} | {row['seconds_per_epoch']:.2f} | "
            f"{row['parameters']:,} |")
    return "\n".join(lines)


def summarize(runs: Sequence[Dict[str, Any]], group: Sequence[str]) -> List[Dict[str, Any]]:
    """Per ``group`` key tuple (e.g. embedding, attention): mean and 95 % interval of
    the test accuracy and F1, mean seconds per epoch, FLOPs and parameters."""
    keys: List[Tuple] = []
    for r in runs:
        key = tuple(r[g] for g in group)
        if key not in keys:
            keys.append(key)
    out = []
    for key in keys:
        rows = [r for r in runs if tuple(r[g] for g in group) == key]
        acc, acc_h = interval([r["test_accuracy"] for r in rows])
        f1, f1_h = interval([r["test_f1"] for r in rows])
        out.append({**dict(zip(group, key)), "model": MODEL_NAMES[rows[0]["attention"]],
                    "accuracy_mean": acc, "accuracy_ci95": acc_h, "f1_mean": f1,
                    "f1_ci95": f1_h, "seeds": len(rows),
                    "seconds_per_epoch": sum(r["seconds_per_epoch"] for r in rows) / len(rows),
                    "attention_mflops_per_example": rows[0]["attention_mflops_per_example"],
                    "parameters": rows[0]["parameters"]})
    return out


# ------------------------------------------------------------------ protocol
def compare(datasets: Dict[str, List[Any]], splits: Callable[[int], Tuple[Tensor, ...]],
            config: Any, *, in_channels: int, num_classes: int, num_modalities: int = 1,
            variants: Optional[Sequence[Tuple[str, str]]] = None) -> Dict[str, Any]:
    """Train and test every (dataset name, attention) pair over the seeds of ``config``.

    ``datasets`` maps a name (an embedding, a modality subset, ...) to the list of
    examples (same order and labels for every name); ``splits(seed)`` gives the
    ``(train, val, test)`` indices of a seed (the test indices must not depend on it);
    ``variants`` lists the ``(name, attention)`` pairs to run (default: every name with
    every ``config.attentions``). Every model of a seed starts from the same weights.
    Shared by the sentiment and multi-modal experiments.
    """
    if variants is None:
        variants = [(name, att) for name in datasets for att in config.attentions]
    runs = []
    for seed in range(config.seeds):
        train_idx, val_idx, test_idx = splits(seed)
        for name, attention in variants:
            data = datasets[name]
            train = [data[i] for i in train_idx.tolist()]
            val = [data[i] for i in val_idx.tolist()]
            test = [data[i] for i in test_idx.tolist()]
            torch.manual_seed(seed)
            induce = {"induce": "contiguous"} if attention == "induced" else {}
            model = TreeClassifier(in_channels, num_classes, config.channels, config.heads,
                                   hidden_channels=config.hidden_channels,
                                   attention="hierarchical" if induce else attention,
                                   num_modalities=num_modalities,
                                   pos_dim=config.pos_dim, dropout=config.dropout, **induce)
            if config.progress:
                print(f"[{name} / {MODEL_NAMES[attention]} / seed {seed}] "
                      f"{len(train)} train, {len(val)} val, {len(test)} test", flush=True)
            result = fit(model, train, val, TrainConfig(
                epochs=config.epochs, batch_size=config.batch_size, lr=config.lr,
                weight_decay=config.weight_decay, seed=seed, grad_clip=config.grad_clip,
                progress=config.progress))
            metrics = evaluate(model, test, batch_size=config.batch_size)
            history = result["history"]
            flops = _mean_attention_flops(model, test, config.batch_size)
            runs.append({"name": name, "attention": attention, "seed": seed,
                         "test_accuracy": metrics["accuracy"], "test_f1": metrics["macro_f1"],
                         "test_loss": metrics["loss"], "best_epoch": result["best_epoch"],
                         "seconds_per_epoch": sum(h["seconds"] for h in history)
                         / max(len(history), 1),
                         "attention_mflops_per_example": flops / 1e6,
                         "parameters": model.num_parameters(), "history": history})
    return {"runs": runs}


def _mean_attention_flops(model: TreeClassifier, data: Sequence, batch_size: int) -> float:
    from torch_geometric.data import Batch

    total = 0
    for at in range(0, len(data), batch_size):
        total += model.attention_flops(Batch.from_data_list(list(data[at:at + batch_size])))
    return total / max(len(data), 1)


def run_sentiment(config: Optional[SentimentConfig] = None) -> Dict[str, Any]:
    """Run the comparison; returns ``{"config", "data", "runs", "summary", "markdown",
    "seconds"}`` (and writes them under ``config.output_dir`` when set)."""
    from ..datasets.pang_lee import load_pang_lee_reviews

    config = config or SentimentConfig()
    config.validate()
    start = time.perf_counter()
    reviews = load_pang_lee_reviews(config.cache_dir)
    labels = torch.tensor([label for _, label in reviews])
    if config.num_reviews is not None and config.num_reviews < len(reviews):
        keep = _stratified_subset(labels, config.num_reviews,
                                  torch.Generator().manual_seed(config.split_seed))
        reviews = [reviews[i] for i in keep.tolist()]
        labels = labels[keep]
    datasets, embed_seconds = {}, {}
    for name in config.embeddings:
        t0 = time.perf_counter()
        if config.progress:
            print(f"embedding {len(reviews)} reviews: {name}", flush=True)
        datasets[name] = build_review_trees(reviews, name, max_tokens=config.max_tokens,
                                            keep=config.keep, cache_dir=config.cache_dir,
                                            progress=config.progress)
        embed_seconds[name] = time.perf_counter() - t0
    some = next(iter(datasets.values()))
    leaves = torch.tensor([t.num_leaves for t in some], dtype=torch.float)
    nodes = torch.tensor([t.num_nodes for t in some], dtype=torch.float)
    data = {"reviews": len(reviews), "positive": int(labels.sum()),
            "mean_leaves": float(leaves.mean()), "max_leaves": int(leaves.max()),
            "mean_nodes": float(nodes.mean()), "build_seconds": embed_seconds}
    result = compare(datasets, lambda seed: split_indices(
        labels, config.test_fraction, config.val_fraction, config.split_seed, seed), config,
        in_channels=some[0].x.shape[1], num_classes=2)
    for r in result["runs"]:
        r["embedding"] = r.pop("name")
        r["label"] = f"{r['embedding']} / {MODEL_NAMES[r['attention']]}"
    summary = summarize(result["runs"], ("embedding", "attention"))
    for row in summary:
        row["label"] = f"{row['embedding']} / {row['model']}"
    out = {"task": "sentiment", "title": "Hierarchical sentiment (Pang & Lee reviews): "
           "HSA vs FSA vs DeepSet", "command": config.command,
           "config": asdict(config), "data": data,
           "runs": result["runs"], "summary": summary, "markdown": markdown_table(summary),
           "seconds": time.perf_counter() - start}
    if config.output_dir is not None:
        write_results(out, config.output_dir, "sentiment")
    return out


def write_results(out: Dict[str, Any], output_dir: str, name: str) -> List[str]:
    """JSON, Markdown and plots of ``out`` in ``output_dir`` (through
    :mod:`hsa_graph.experiments.report` when it is installed; JSON and Markdown
    otherwise). Returns the paths written."""
    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    try:
        from . import report
    except ImportError:
        report = None
    if report is not None:
        return [str(p) for p in report.write_report(out, path, name)]
    (path / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))
    (path / f"{name}.md").write_text(out["markdown"] + "\n")
    return [str(path / f"{name}.json"), str(path / f"{name}.md")]


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add this experiment's options to ``parser`` (used by ``hsa-graph sentiment``)."""
    d = SentimentConfig()
    parser.add_argument("--quick", action="store_true",
                        help="the main job's short version: " + ", ".join(
                            f"{k}={v}" for k, v in QUICK.items()) + " (explicit options win)")
    parser.add_argument("--embeddings", nargs="+", choices=EMBEDDINGS, default=None,
                        help=f"token embeddings to compare (default: {' '.join(d.embeddings)})")
    parser.add_argument("--attentions", nargs="+", choices=VARIANTS, default=None,
                        help="attention variants: hierarchical = HSA, flat = FSA, none = "
                             "DeepSet (default: these three), induced = HSA on the tree "
                             "each layer builds from its keys")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"seeds (train/val splits and initialisations; default {d.seeds})")
    parser.add_argument("--num-reviews", type=int, default=None,
                        help="stratified subset of the 1,500 reviews (default: all)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="keep whole sentences of each review up to this many word pieces; "
                             f"0 = whole reviews (default {d.max_tokens}, which keeps the full "
                             "run near an hour on 2 CPU cores; 512 is the paper's length)")
    parser.add_argument("--keep", choices=("last", "first"), default=None,
                        help="which sentences --max-tokens keeps (default: last, where a "
                             "review's verdict is)")
    parser.add_argument("--epochs", type=int, default=None, help=f"default {d.epochs}")
    parser.add_argument("--batch-size", type=int, default=None, help=f"default {d.batch_size}")
    parser.add_argument("--lr", type=float, default=None, help=f"AdamW lr (default {d.lr})")
    parser.add_argument("--test-fraction", type=float, default=None,
                        help=f"fixed held-out test share (default {d.test_fraction})")
    parser.add_argument("--channels", type=int, default=None,
                        help=f"attention width (default {d.channels})")
    parser.add_argument("--cache-dir", default=None,
                        help="corpus and embedding cache (default $HSA_GRAPH_CACHE or "
                             "~/.cache/hsa_graph)")
    parser.add_argument("--out", "--output-dir", dest="output_dir", default=None,
                        help="write JSON, Markdown and plots here")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (shown by default only when stderr is a "
                             "terminal, so redirected logs stay short)")
    return parser


def config_from_args(args: argparse.Namespace) -> SentimentConfig:
    """The :class:`SentimentConfig` of parsed arguments (``--quick`` first, then the
    explicit options)."""
    values: Dict[str, Any] = dict(QUICK) if getattr(args, "quick", False) else {}
    for name in ("embeddings", "attentions", "seeds", "num_reviews", "max_tokens", "keep",
                 "epochs", "batch_size", "lr", "test_fraction", "channels", "cache_dir",
                 "output_dir"):
        value = getattr(args, name, None)
        if value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    if values.get("max_tokens") == 0:
        values["max_tokens"] = None
    values["progress"] = show_progress(getattr(args, "no_progress", False))
    argv = getattr(args, "argv", None)
    if argv is not None:
        values["command"] = "hsa-graph sentiment " + " ".join(argv)
    return SentimentConfig(**values)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Run from parsed arguments, print the table, return the results."""
    out = run_sentiment(config_from_args(args))
    print(out["markdown"])
    return out


if __name__ == "__main__":  # pragma: no cover
    run(add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                          allow_abbrev=False)).parse_args())
