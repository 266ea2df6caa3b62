"""The causal language model, hierarchical vs flat: a training step and generation.

Both models are :class:`~hsa_graph.nn.causal.HierarchicalCausalLM` with the same size
and the same parameters (the flat one loads the hierarchical one's state dict); the
flat one has ``attention="flat"``: causal softmax attention over the tokens (causal HSA
on the flattened tree, ``scaled_dot_product_attention(is_causal=True)``), generating
with a flat :class:`~hsa_graph.ops.kv_cache.KVCache`. The hierarchical trees are
balanced windows of ``b = 16`` tokens, ``b`` windows per window above, ..., as deep as
the length needs (the first ``L`` leaves of the complete ``b``-ary tree). The script
prints, and writes to ``benchmarks/results/bench_lm.{json,md,png}``:

* **training step** (forward, backward, AdamW step; best of ``--repeats``) at 1,024
  tokens x batch 8 and 8,192 tokens x batch 1, and the ratio hierarchical / flat
  (goals: <= 1.0x and <= 0.25x);
* **generation** at ``B = 1``: prefill a random prompt of ``L`` tokens (1k, 8k, 32k,
  128k) with :meth:`~hsa_graph.nn.causal.HierarchicalCausalLM.prefill` (the batched
  hierarchical cache, resp. the flat KV cache, in every layer), then time ``G`` greedy
  steps (:meth:`~hsa_graph.nn.causal.HierarchicalCausalLM.step`, the loop of
  ``generate``): tokens per second (from the median step) and the caches' bytes (all
  layers). Goals: faster than flat from 8k on; cache >= 100x smaller at 32k (against
  the flat cache's keys and values without spare capacity).

A prompt whose prefill would take longer than ``--budget`` seconds (extrapolated from
the previous length: quadratic for flat, linear for hierarchical) is not run through
the model: each layer's cache is filled with random keys and values of the same shapes
instead ("synthetic" in the table), which leaves the per-step cost and the cache size
as they would be. A failure at one size (e.g. out of memory) is reported and the
script goes on.

Run: ``python benchmarks/bench_lm.py`` (``--quick``: tiny sizes, a check that the
script works in well under a minute; it prints and writes nothing else).
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

import torch

import hsa_graph
from hsa_graph.nn.causal import HierarchicalCausalLM
from hsa_graph.ops.kv_cache import KVCache

RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- trees
def depth_for(length: int, branching: int) -> int:
    """Levels below the root that ``length`` leaves need in a ``branching``-ary tree."""
    depth = 1
    while branching ** depth < length:
        depth += 1
    return depth


def window_tree(length: int, branching: int, depth: int) -> hsa_graph.NestedSignal:
    """The first ``length`` leaves of the complete ``branching``-ary tree of ``depth``
    levels below the root (nodes level by level from the root, leaves last and in
    order). ``branching ** depth >= length`` is required."""
    if branching ** depth < length:
        raise ValueError(f"{length} leaves do not fit {depth} levels of {branching}")
    parts = [torch.tensor([-1])]
    first = 0                         # id of the first node of the level above
    for level in range(1, depth + 1):
        count = -(-length // branching ** (depth - level))       # ceil
        parts.append(first + torch.arange(count) // branching)
        first += parts[-2].numel()
    return hsa_graph.NestedSignal.from_parents(torch.cat(parts).tolist())


def attach_of(i: int, branching: int, depth: int) -> int:
    """Where token ``i`` of the balanced tree hangs (``attach`` of
    :meth:`~hsa_graph.HSACache.append`): one level up per trailing zero of ``i`` in
    base ``branching``."""
    closes = 0
    while i % branching == 0 and closes < depth - 1:
        i //= branching
        closes += 1
    return depth - 1 - closes


# ----------------------------------------------------------------------------- models
def make_models(args) -> Dict[str, HierarchicalCausalLM]:
    torch.manual_seed(0)
    size = dict(vocab_size=args.vocab, channels=args.channels, num_layers=args.layers,
                heads=args.heads)
    hier = HierarchicalCausalLM(**size)
    flat = HierarchicalCausalLM(**size, attention="flat")
    flat.load_state_dict(hier.state_dict())            # the same parameters
    return {"hierarchical": hier, "flat": flat}


def train_row(models, tokens: int, batch: int, args, gen: torch.Generator) -> Dict:
    """Best-of training-step time of both models on ``batch`` trees of ``tokens``."""
    depth = depth_for(tokens, args.branching)
    tree = window_tree(tokens, args.branching, depth)
    forest = tree if batch == 1 else hsa_graph.collate([tree] * batch)
    ids = torch.randint(args.vocab, (tokens * batch,), generator=gen)
    row = dict(tokens=tokens, batch=batch, depth=depth)
    steps, optimisers = {}, {}
    for name, model in models.items():
        model.train()
        optimisers[name] = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=optimisers[name]):
            opt.zero_grad(set_to_none=True)
            model.loss(ids, forest).backward()
            opt.step()
        steps[name] = step
    best = {name: float("inf") for name in models}
    skipped = {}
    for rep in range(args.repeats + 1):            # round 0 is the warm-up (layouts)
        for name, step in steps.items():
            if name in skipped:
                continue
            start = time.perf_counter()
            step()
            took = time.perf_counter() - start
            if rep > 0:
                best[name] = min(best[name], took)
            elif took * args.repeats > args.budget:   # one timing is all we can afford
                best[name] = took
                skipped[name] = took
    for name in models:
        row[f"{name}_s"] = best[name]
    row["ratio"] = best["hierarchical"] / best["flat"]
    row["single_timing"] = sorted(skipped)
    return row


def fill_synthetic(model, caches, length: int, tree, gen: torch.Generator) -> None:
    """Fill every layer's cache as a prompt of ``length`` tokens would, with random
    queries, keys and values (the same shapes, trees and so the same state size)."""
    h = model.layers[0].attn.heads
    d = model.layers[0].attn.head_channels
    for cache in caches:
        q, k, v = (torch.randn(length, h, d, generator=gen) for _ in range(3))
        if isinstance(cache, KVCache):
            cache.prefill(k[None], v[None])
        else:
            cache.prefill(q, k, v, tree, return_outputs=False)


@torch.no_grad()
def generate_row(name: str, model, length: int, args, gen: torch.Generator,
                 estimate: Optional[float]) -> Dict:
    """Prefill ``length`` random tokens, then time ``args.generate`` greedy steps."""
    model.eval()
    b, steps = args.branching, args.generate
    depth = depth_for(length + steps, b)
    tree = window_tree(length, b, depth)
    ids = torch.randint(args.vocab, (length,), generator=gen)
    caches = model.new_caches(0)
    row = dict(model=name, tokens=length, depth=depth, cache=type(caches[0]).__name__)
    if estimate is not None and estimate > args.budget:
        start = time.perf_counter()
        fill_synthetic(model, caches, length, tree, gen)
        row.update(prefill="synthetic", prefill_estimate_s=estimate,
                   fill_s=time.perf_counter() - start)
        nxt = torch.randint(args.vocab, (1,), generator=gen)
    else:
        start = time.perf_counter()
        logits = model.prefill(ids, tree, caches)
        row.update(prefill="model", prefill_s=time.perf_counter() - start)
        nxt = logits.argmax(-1)
    taken = []
    for i in range(length, length + steps):
        start = time.perf_counter()
        logits = model.step(nxt, caches, attach=[attach_of(i, b, depth)])
        nxt = logits.argmax(-1)
        taken.append(time.perf_counter() - start)
    # tokens/s from the median step: the first step after a prefill may regrow the
    # flat cache's buffers (one copy, amortised over the next L tokens, not these G)
    median = sorted(taken)[len(taken) // 2]
    row.update(tokens_per_s=1.0 / median, median_step_ms=1e3 * median,
               mean_tokens_per_s=steps / sum(taken),
               cache_bytes=sum(c.state_bytes(per_sequence=True) for c in caches))
    attn = model.layers[0].attn
    row["flat_kv_bytes"] = len(caches) * KVCache.bytes_for(
        length + steps, attn.heads, attn.head_channels)
    return row


# ----------------------------------------------------------------------------- output
def plot(generation: List[Dict], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for name, marker in (("hierarchical", "o"), ("flat", "s")):
        rows = [r for r in generation if r["model"] == name and "tokens_per_s" in r]
        xs = [r["tokens"] for r in rows]
        speed.plot(xs, [r["tokens_per_s"] for r in rows], marker=marker, label=name)
        # the flat cache's keys and values held, without the buffers' spare capacity
        key = "flat_kv_bytes" if name == "flat" else "cache_bytes"
        memory.plot(xs, [r[key] for r in rows], marker=marker, label=name)
    for ax, label in ((speed, "generated tokens / s"), (memory, "cache bytes (all layers)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    speed.set_yscale("log")
    memory.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def markdown(train: List[Dict], generation: List[Dict], args) -> List[str]:
    lines = [f"HierarchicalCausalLM, channels {args.channels}, {args.heads} heads, "
             f"{args.layers} layers, vocabulary {args.vocab}, float32, {args.threads} "
             f"thread(s), CPU. Hierarchical: balanced windows of {args.branching}; flat: "
             "the same parameters with attention=\"flat\".", "",
             "| tokens x batch | depth | hierarchical step (s) | flat step (s) | "
             "hierarchical / flat |", "|---:|---:|---:|---:|---:|"]
    for r in train:
        if "ratio" not in r:
            lines.append(f"| {r['tokens']} x {r['batch']} | | failed: {r['error']} | | |")
            continue
        note = " (one timing)" if r["single_timing"] else ""
        lines.append(f"| {r['tokens']} x {r['batch']} | {r['depth']} | "
                     f"{r['hierarchical_s']:.3f} | {r['flat_s']:.3f} | "
                     f"{r['ratio']:.2f}{note} |")
    lines += ["", f"Generation, B = 1, {args.generate} greedy tokens after the prompt "
              "(cache bytes of all layers; flat / hierarchical against the flat cache's "
              "keys and values without spare capacity).", "",
              "| context | hierarchical tok/s | flat tok/s | speed-up | hierarchical cache "
              "(B) | flat cache (B) | flat / hierarchical bytes | prefill (s) hier / flat |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(r: Optional[Dict], key: str, fmt: str) -> str:
        if r is not None and key in r:
            return format(r[key], fmt)
        return f"failed: {r['error']}" if r is not None and "error" in r else "-"

    def prefill_text(r: Optional[Dict]) -> str:
        if r is None or "tokens_per_s" not in r:
            return "-"
        if r["prefill"] == "synthetic":
            return f"synthetic (est. {r['prefill_estimate_s']:.0f})"
        return f"{r['prefill_s']:.2f}"
    for length in sorted({r["tokens"] for r in generation}):
        hier = next((r for r in generation if r["tokens"] == length
                     and r["model"] == "hierarchical"), None)
        flat = next((r for r in generation if r["tokens"] == length
                     and r["model"] == "flat"), None)
        ok = [r is not None and "tokens_per_s" in r for r in (hier, flat)]
        speed = (f"{hier['tokens_per_s'] / flat['tokens_per_s']:.2f}x" if all(ok) else "-")
        ratio = (f"{flat['flat_kv_bytes'] / hier['cache_bytes']:.0f}x" if all(ok) else "-")
        lines.append(f"| {length} | {cell(hier, 'tokens_per_s', '.1f')} | "
                     f"{cell(flat, 'tokens_per_s', '.1f')} | {speed} | "
                     f"{cell(hier, 'cache_bytes', ',')} | {cell(flat, 'cache_bytes', ',')} | "
                     f"{ratio} | {prefill_text(hier)} / {prefill_text(flat)} |")
    return lines


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (< 1 min), print only")
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--branching", type=int, default=16)
    parser.add_argument("--generate", type=int, default=32, help="timed generated tokens")
    parser.add_argument("--repeats", type=int, default=3, help="training steps (best of)")
    parser.add_argument("--budget", type=float, default=60.0,
                        help="seconds a single prefill or training step may take")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.channels, args.heads, args.layers, args.vocab = 32, 2, 2, 64
        args.generate, args.repeats, args.budget = 4, 1, 5.0
        train_configs, contexts = [(128, 4), (512, 1)], [256, 1024, 4096]
    else:
        train_configs, contexts = [(1024, 8), (8192, 1)], [1024, 8192, 32768, 131072]
    gen = torch.Generator().manual_seed(0)
    models = make_models(args)
    print(f"models: channels {args.channels}, heads {args.heads}, layers {args.layers}, "
          f"vocabulary {args.vocab}, {sum(p.numel() for p in models['flat'].parameters()):,} "
          "parameters each", flush=True)

    train = []
    for tokens, batch in train_configs:
        try:
            r = train_row(models, tokens, batch, args, gen)
            print(f"train step {tokens:5d} x {batch}: hierarchical {r['hierarchical_s']:.3f} s, "
                  f"flat {r['flat_s']:.3f} s, ratio {r['ratio']:.2f}", flush=True)
        except (RuntimeError, MemoryError) as error:       # e.g. out of memory
            traceback.print_exc()
            r = dict(tokens=tokens, batch=batch, error=type(error).__name__)
        train.append(r)

    generation = []
    for name, model in models.items():
        # untimed warm-up: scripted kernels and first-call allocations, so that the first
        # measured prefill (which the larger ones are extrapolated from) is not inflated
        generate_row(name, model, min(contexts) // 4, args, gen, None)
        # prefill cost growth with the length: quadratic (flat) or about linear
        power = 2.0 if name == "flat" else 1.1
        previous = None
        for length in contexts:
            estimate = (None if previous is None else
                        previous[1] * (length / previous[0]) ** power)
            try:
                r = generate_row(name, model, length, args, gen, estimate)
            except (RuntimeError, MemoryError) as error:
                traceback.print_exc()
                r = dict(model=name, tokens=length, error=type(error).__name__)
                generation.append(r)
                print(f"generate {name:12s} at {length:6d}: failed ({r['error']})",
                      flush=True)
                continue
            generation.append(r)
            if r["prefill"] == "model":
                previous = (length, r["prefill_s"])
            how = (f"prefill {r['prefill_s']:.2f} s" if r["prefill"] == "model" else
                   f"synthetic fill (prefill est. {r['prefill_estimate_s']:.0f} s)")
            print(f"generate {name:12s} at {length:6d}: {r['tokens_per_s']:8.1f} tok/s, "
                  f"cache {r['cache_bytes']:,} B, {how}", flush=True)

    lines = markdown(train, generation, args)
    print("\n".join(lines))
    if args.quick:
        return
    RESULTS.mkdir(exist_ok=True)
    meta = dict(channels=args.channels, heads=args.heads, layers=args.layers,
                vocab=args.vocab, branching=args.branching, generated=args.generate,
                repeats=args.repeats, budget_s=args.budget, threads=args.threads,
                dtype="float32", torch=torch.__version__, train=train,
                generation=generation)
    (RESULTS / "bench_lm.json").write_text(json.dumps(meta, indent=2))
    (RESULTS / "bench_lm.md").write_text("\n".join(lines) + "\n")
    plotted = plot(generation, RESULTS / "bench_lm.png",
                   f"causal LM generation, B = 1 (C={args.channels}, H={args.heads}, "
                   f"{args.layers} layers)")
    print(f"wrote {RESULTS / 'bench_lm.json'}, .md" + (", .png" if plotted else ""))


if __name__ == "__main__":
    main()
