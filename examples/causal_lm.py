"""A hierarchical causal character language model on the Pang & Lee movie reviews.

Each review becomes a tree with :func:`hsa_graph.text_tree`: review -> lines (the corpus
stores one sentence per line) -> words -> characters, every word ending with its space
character. Two models of identical size (:class:`hsa_graph.nn.causal.HierarchicalCausalLM`)
are trained on the same characters:

* **hierarchical**: causal HSA over that tree;
* **flat**: the same model on the flattened tree (one root over the characters), i.e. a
  standard causal transformer (causal HSA on a flat tree is causal softmax attention).

Both train for the same wall time (``--train-seconds``; training also stops at
``--steps`` when that comes first, and ``--quick`` counts steps only), so the
comparison is perplexity at equal training time, the question a user with a compute
budget asks. The script reports validation perplexity per character, the steps each
model took, and the generation speed with
the cache (:class:`hsa_graph.ops.cache.HSACache`, one per layer; for the hierarchical
model a space opens a new word, and a space after ``.``, ``!`` or ``?`` a new line), and
writes the figures to ``examples/output/causal_lm.json``.

Run: ``python examples/causal_lm.py --quick`` (a couple of minutes on 2 cores) or
``python examples/causal_lm.py`` (1,200 reviews of up to 2,000 characters, 12 minutes of
training per model).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import torch
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph.datasets.pang_lee import load_pang_lee_reviews
from hsa_graph.nn.causal import HierarchicalCausalLM
from hsa_graph.ops.cache import HSACache

OUT = Path(__file__).resolve().parent / "output"

CONFIGS = {
    # steps and train_seconds: training stops at whichever comes first (0: no limit)
    "quick": dict(train_docs=48, val_docs=8, max_chars=300, steps=16, train_seconds=0,
                  batch=4, channels=32, layers=2, heads=4, prompt=60, generate=100),
    "full": dict(train_docs=1200, val_docs=150, max_chars=2000, steps=0, train_seconds=720,
                 batch=8, channels=128, layers=4, heads=4, prompt=200, generate=400),
}


def review_tree(text: str, vocab: dict) -> hsa_graph.NestedSignal:
    """review -> lines -> words -> characters (each word keeps its trailing space)."""
    return hsa_graph.text_tree(
        text.replace("\n", "\n\n"),
        tokenizer=lambda word: [vocab[c] for c in word] + [vocab[" "]],
        sentence_splitter=lambda line: re.findall(r"\S+\s*", line))


def placement(chars: list):
    """Where the hierarchical model hangs the next character, from the text so far."""
    def where(tokens):
        last = chars[tokens[-1]]
        if last != " ":
            return dict(attach=2)                          # same word
        before = chars[tokens[-2]] if len(tokens) > 1 else ""
        return dict(attach=0 if before in ".!?" else 1)    # new line / new word
    return where


def cut(text: str, max_chars: int) -> str:
    """The first lines of ``text`` up to about ``max_chars`` characters."""
    out, total = [], 0
    for line in text.split("\n"):
        if out and total + len(line) > max_chars:
            break
        out.append(line)
        total += len(line) + 1
    return "\n".join(out)


def evaluate(model, batches) -> float:
    """Perplexity per predicted character."""
    model.eval()
    loss, count = 0.0, 0
    with torch.no_grad():
        for tokens, tree in batches:
            st = tree.structure
            same = int((st.leaf_tree[1:] == st.leaf_tree[:-1]).sum())
            loss += float(model.loss(tokens, tree)) * same
            count += same
    return math.exp(loss / count)


def one_cycle(fraction: float, peak: float) -> float:
    """The learning rate at ``fraction`` of the training budget: a cosine warm-up from
    ``peak / 25`` over the first 10 %, then a cosine decay to ``peak / 25e4`` (the
    schedule of ``torch.optim.lr_scheduler.OneCycleLR``, on a budget of steps or of
    seconds alike)."""
    start, end = peak / 25, peak / 25e4
    if fraction < 0.1:
        low, high, t = start, peak, fraction / 0.1
    else:
        low, high, t = peak, end, (min(fraction, 1.0) - 0.1) / 0.9
    return high + (low - high) * (1 + math.cos(math.pi * t)) / 2


def train(name, model, batches, steps: int, seconds: float, lr=3e-3):
    """Train until ``steps`` steps or ``seconds`` of wall time (0: no limit), whichever
    comes first; returns the seconds and the steps taken."""
    if steps <= 0 and seconds <= 0:
        raise ValueError("give steps or train_seconds (> 0)")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    start = time.perf_counter()
    step, report = 0, 0.0

    def spent() -> float:
        return max(step / steps if steps > 0 else 0.0,
                   (time.perf_counter() - start) / seconds if seconds > 0 else 0.0)

    while spent() < 1.0:
        for group in opt.param_groups:
            group["lr"] = one_cycle(spent(), lr)
        tokens, tree = batches[step % len(batches)]
        loss = model.loss(tokens, tree)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if spent() >= report or spent() >= 1.0:
            report += 0.2
            print(f"  [{name}] step {step:4d}  loss {loss.item():.3f}  "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    return time.perf_counter() - start, step


def generation_speed(model, tree, tokens, chars, cfg, hierarchical: bool):
    moves = HSACache.moves_of(tree)[:cfg["prompt"]]
    if not hierarchical:
        moves = [dict(depth=1)] + [{}] * (len(moves) - 1)
    where = placement(chars) if hierarchical else (lambda toks: {})
    model.eval()
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    out = model.generate(tokens[:cfg["prompt"]].tolist(), moves, cfg["generate"], where,
                         temperature=0.8, generator=gen)
    elapsed = time.perf_counter() - start
    return len(out) / elapsed, "".join(chars[t] for t in out[cfg["prompt"]:])


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small run (minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT / "causal_lm.json")
    for key, value in CONFIGS["full"].items():  # e.g. --steps 200 --max-chars 400
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                            help=f"override (quick {CONFIGS['quick'][key]}, full {value})")
    args = parser.parse_args()
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    cfg.update({key: getattr(args, key) for key in cfg if getattr(args, key) is not None})
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    reviews = [text for text, _ in load_pang_lee_reviews()]
    random.Random(args.seed).shuffle(reviews)
    reviews = [cut(r, cfg["max_chars"]) for r in reviews[:cfg["train_docs"] + cfg["val_docs"]]]
    chars = sorted(set("".join(reviews).replace("\n", "")) | {" "})   # lines are nodes
    vocab = {c: i for i, c in enumerate(chars)}
    trees = [review_tree(r, vocab) for r in reviews]
    train_trees, val_trees = trees[:cfg["train_docs"]], trees[cfg["train_docs"]:]

    def batches(tree_list, flat: bool):
        out = []
        for i in range(0, len(tree_list), cfg["batch"]):
            group = tree_list[i:i + cfg["batch"]]
            if flat:
                group = [hsa_graph.flatten(t) for t in group]
            batch = Batch.from_data_list(group)
            tokens = torch.cat([t.x for t in tree_list[i:i + cfg["batch"]]])
            out.append((tokens, batch))
        return out

    print(f"{len(train_trees)} training / {len(val_trees)} validation reviews, "
          f"{sum(t.num_leaves for t in train_trees)} training characters, vocabulary "
          f"{len(chars)}")
    results = {"config": cfg, "seed": args.seed, "threads": args.threads, "models": {}}
    for name, flat in (("hierarchical", False), ("flat", True)):
        torch.manual_seed(args.seed)
        model = HierarchicalCausalLM(len(chars), cfg["channels"], cfg["layers"], cfg["heads"])
        seconds, steps = train(name, model, batches(train_trees, flat), cfg["steps"],
                               cfg["train_seconds"])
        ppl = evaluate(model, batches(val_trees, flat))
        tree = val_trees[0]
        speed, sample = generation_speed(model, tree, tree.x, chars, cfg, not flat)
        results["models"][name] = dict(
            parameters=sum(p.numel() for p in model.parameters()), train_seconds=seconds,
            train_steps=steps,
            val_perplexity=ppl, generation_tokens_per_s=speed, sample=sample)

    print(f"\n{'model':<14}{'params':>9}{'train s':>9}{'steps':>7}{'val ppl/char':>14}"
          f"{'gen tok/s':>11}")
    for name, r in results["models"].items():
        print(f"{name:<14}{r['parameters']:>9}{r['train_seconds']:>9.0f}{r['train_steps']:>7}"
              f"{r['val_perplexity']:>14.3f}{r['generation_tokens_per_s']:>11.1f}")
    for name, r in results["models"].items():
        print(f"\n{name} sample: {r['sample']!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
