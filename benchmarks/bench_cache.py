"""Generation with causal HSA: the batched hierarchical cache against a flat KV cache.

The trees are balanced ``b``-ary hierarchies over the tokens (``b`` tokens per window,
``b`` windows per window above, ...), deep enough to hold each length. The script
prints, and writes to ``benchmarks/results/bench_cache.{json,md}``:

* **per step**: one :meth:`~hsa_graph.ops.cache.BatchedHSACache.step` (the next token of
  every sequence) at ``B = 1`` with 4,096 and 65,536 cached tokens and at ``B = 32``
  with 4,096 each, against a flat KV cache's step: write the new key and value, then
  one batched ``scaled_dot_product_attention`` of the new queries over all cached keys
  and values. The caches are filled with :meth:`prefill` (untimed). The step runs as
  users get it (the fused kernel where numba is installed) and, timed interleaved on a
  second cache, as the eager step (:data:`hsa_graph.typing.WITH_NUMBA` off).
* **prefill**: :meth:`~hsa_graph.ops.cache.BatchedHSACache.prefill` of a 4,096-token
  prompt (state and outputs) against :func:`~hsa_graph.ops.causal.causal_hsa`'s
  forward on it;
* **state bytes** per sequence at 4k / 64k / 1M tokens against a flat KV cache
  (``2 L H D`` numbers): measured where a cache was built, from
  :meth:`~hsa_graph.ops.cache.BatchedHSACache.bytes_for` at 1M.

Run: ``python benchmarks/bench_cache.py`` (``--quick``: tiny sizes, a check that the
script works; it prints and writes nothing else).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

import hsa_graph
import hsa_graph.typing
from hsa_graph.ops.cache import BatchedHSACache
from hsa_graph.ops.causal import causal_hsa

RESULTS = Path(__file__).resolve().parent / "results"


def balanced_parents(branching: int, depth: int) -> torch.Tensor:
    """Parent array of the complete ``branching``-ary tree of ``depth`` levels below the
    root, node ids level by level (so leaves are the last ``branching ** depth`` ids, in
    order)."""
    parts = [torch.tensor([-1])]
    first = 0                                   # id of the first node of the level above
    for d in range(1, depth + 1):
        count = branching ** d
        parts.append(first + torch.arange(count) // branching)
        first += branching ** (d - 1)
    return torch.cat(parts)


def attach_of(i: int, branching: int, depth: int) -> int:
    """Depth of the node token ``i`` of the balanced tree hangs under: one level up per
    trailing zero of ``i`` in base ``branching``."""
    closes = 0
    while i % branching == 0 and closes < depth - 1:
        i //= branching
        closes += 1
    return depth - 1 - closes


@contextlib.contextmanager
def eager_step():
    """The cache's eager step (its tensor ops one by one), as without numba."""
    held = hsa_graph.typing.WITH_NUMBA
    hsa_graph.typing.WITH_NUMBA = False
    try:
        yield
    finally:
        hsa_graph.typing.WITH_NUMBA = held


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def step_row(batch: int, length: int, args, gen: torch.Generator) -> Dict:
    """Per-step time of the hierarchical and the flat KV cache, ``batch`` sequences of
    ``length`` cached tokens."""
    b, h, d = args.branching, args.heads, args.dim
    depth = max(1, math.ceil(math.log(length + args.steps, b) - 1e-9))
    tree = hsa_graph.NestedSignal.from_parents(balanced_parents(b, depth).tolist())
    n_tree = tree.num_leaves
    q, k, v = (torch.randn(length + args.steps, h, d, generator=gen) for _ in range(3))
    # prompts: the first ``length`` leaves of the tree, the same for every sequence
    prompt = hsa_graph.NestedSignal.from_parents(
        hsa_graph.ops.cache.parents_of_moves(hsa_graph.HSACache.moves_of(tree)[:length]))
    forest = prompt if batch == 1 else hsa_graph.collate([prompt] * batch)
    rep = lambda t: t[:length].repeat(batch, 1, 1)  # noqa: E731
    cache, eager = BatchedHSACache(), BatchedHSACache()
    cache.prefill(rep(q), rep(k), rep(v), forest, return_outputs=False)
    eager.prefill(rep(q), rep(k), rep(v), forest, return_outputs=False)
    kv_k = torch.zeros(batch, h, length + args.steps, d)
    kv_v = torch.zeros_like(kv_k)
    kv_k[:, :, :length] = k[:length].transpose(0, 1)
    kv_v[:, :, :length] = v[:length].transpose(0, 1)
    t_hsa, t_eager, t_flat = [], [], []
    for i in range(length, length + args.steps):
        qi, ki, vi = (t[i].expand(batch, h, d).contiguous() for t in (q, k, v))
        place = attach_of(i, b, depth) if i < n_tree else 0
        start = time.perf_counter()
        cache.step(qi, ki, vi, attach=place)
        t_hsa.append(time.perf_counter() - start)
        with eager_step():
            start = time.perf_counter()
            eager.step(qi, ki, vi, attach=place)
            t_eager.append(time.perf_counter() - start)
        start = time.perf_counter()
        kv_k[:, :, i], kv_v[:, :, i] = ki, vi
        F.scaled_dot_product_attention(qi.unsqueeze(2), kv_k[:, :, :i + 1], kv_v[:, :, :i + 1])
        t_flat.append(time.perf_counter() - start)
    best_hsa, best_flat = min(t_hsa), min(t_flat)
    return dict(batch=batch, tokens=length, depth=depth, hsa_step_ms=1e3 * best_hsa,
                flat_kv_step_ms=1e3 * best_flat, ratio=best_hsa / best_flat,
                fused_kernel=hsa_graph.typing.WITH_NUMBA, eager_step_ms=1e3 * min(t_eager),
                eager_ratio=min(t_eager) / best_flat,
                hsa_step_median_ms=1e3 * statistics.median(t_hsa),
                flat_kv_step_median_ms=1e3 * statistics.median(t_flat),
                median_ratio=statistics.median(t_hsa) / statistics.median(t_flat),
                state_bytes_per_sequence=cache.state_bytes(per_sequence=True),
                flat_kv_bytes_per_sequence=2 * (length + args.steps) * h * d * 4)


def prefill_row(length: int, args, gen: torch.Generator) -> Dict:
    b, h, d = args.branching, args.heads, args.dim
    depth = max(1, math.ceil(math.log(length, b) - 1e-9))
    parents = balanced_parents(b, depth)
    tree = hsa_graph.NestedSignal.from_parents(
        hsa_graph.ops.cache.parents_of_moves(hsa_graph.HSACache.moves_of(
            hsa_graph.NestedSignal.from_parents(parents.tolist()))[:length]))
    q, k, v = (torch.randn(length, h, d, generator=gen) for _ in range(3))
    causal_hsa(q, k, v, tree)                       # the layout, built once per tree
    # interleaved, so that a change of the machine's speed hits both alike
    t_prefill = t_causal = float("inf")
    for _ in range(args.repeats):
        t_prefill = min(t_prefill, best_of(
            lambda: BatchedHSACache().prefill(q, k, v, tree), 1))
        t_causal = min(t_causal, best_of(lambda: causal_hsa(q, k, v, tree), 1))
    return dict(tokens=length, depth=depth, prefill_ms=1e3 * t_prefill,
                causal_hsa_ms=1e3 * t_causal, ratio=t_prefill / t_causal)


def memory_rows(args, measured: List[Dict]) -> List[Dict]:
    h, d, b = args.heads, args.dim, args.branching
    rows = []
    for tokens in args.memory_tokens:
        depth = max(1, math.ceil(math.log(tokens, b) - 1e-9))
        hit = [r for r in measured if r["tokens"] == tokens and r["batch"] == 1]
        hsa_bytes = (hit[0]["state_bytes_per_sequence"] if hit else
                     BatchedHSACache.bytes_for(depth, 2 * (b - 1), h, d))
        flat = 2 * tokens * h * d * 4
        rows.append(dict(tokens=tokens, depth=depth, hsa_bytes=hsa_bytes, flat_kv_bytes=flat,
                         measured=bool(hit), ratio=flat / hsa_bytes))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, print only")
    parser.add_argument("--branching", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20,
                        help="timed steps (best of, and their median)")
    parser.add_argument("--repeats", type=int, default=3, help="prefill timings (best of)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.branching, args.heads, args.dim, args.steps, args.repeats = 4, 2, 8, 3, 1
        step_configs, prefill_len = [(1, 64), (1, 256), (4, 64)], 64
        args.memory_tokens = [64, 256, 4096]
    else:
        step_configs, prefill_len = [(1, 4096), (1, 65536), (32, 4096)], 4096
        args.memory_tokens = [4096, 65536, 1 << 20]
    gen = torch.Generator().manual_seed(0)
    steps = []
    for batch, length in step_configs:
        steps.append(step_row(batch, length, args, gen))
        r = steps[-1]
        print(f"step B={batch:2d} at {length:6d} tokens: hsa {r['hsa_step_ms']:.3f} ms, flat kv "
              f"{r['flat_kv_step_ms']:.3f} ms, hsa / flat {r['ratio']:.2f} (best of "
              f"{args.steps}; medians {r['hsa_step_median_ms']:.3f} / "
              f"{r['flat_kv_step_median_ms']:.3f} ms, {r['median_ratio']:.2f}); eager step "
              f"{r['eager_step_ms']:.3f} ms ({r['eager_ratio']:.2f})", flush=True)
    prefill = prefill_row(prefill_len, args, gen)
    print(f"prefill {prefill_len} tokens: {prefill['prefill_ms']:.1f} ms vs causal_hsa "
          f"{prefill['causal_hsa_ms']:.1f} ms ({prefill['ratio']:.2f}x)", flush=True)
    memory = memory_rows(args, steps)
    for r in memory:
        print(f"state at {r['tokens']:8d} tokens: hsa {r['hsa_bytes']:,} B vs flat kv "
              f"{r['flat_kv_bytes']:,} B ({r['ratio']:.0f}x smaller"
              f"{'' if r['measured'] else ', from bytes_for'})")
    if args.quick:
        return

    RESULTS.mkdir(exist_ok=True)
    meta = dict(branching=args.branching, heads=args.heads, dim=args.dim,
                timed_steps=args.steps, threads=args.threads, dtype="float32",
                torch=torch.__version__, steps=steps, prefill=prefill, memory=memory)
    (RESULTS / "bench_cache.json").write_text(json.dumps(meta, indent=2))
    path = ("the fused step kernel (numba)" if hsa_graph.typing.WITH_NUMBA else
            "the eager step (numba not installed)")
    lines = [f"Generation with the batched HSA cache vs a flat KV cache: balanced "
             f"{args.branching}-ary trees, H={args.heads}, D={args.dim}, float32, "
             f"{args.threads} thread(s), CPU, best of {args.steps} steps; hsa step: {path}, "
             "eager step: the same cache without the kernel, timed interleaved.", "",
             "| B | cached tokens | depth | hsa step (ms) | flat KV step (ms) | hsa / flat "
             "| eager step (ms) | eager / flat |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['tokens']} | {r['depth']} | {r['hsa_step_ms']:.3f} | "
              f"{r['flat_kv_step_ms']:.3f} | {r['ratio']:.2f} | {r['eager_step_ms']:.3f} | "
              f"{r['eager_ratio']:.2f} |" for r in steps]
    lines += ["", "| prefill tokens | prefill (ms) | causal_hsa forward (ms) | ratio |",
              "|---:|---:|---:|---:|",
              f"| {prefill['tokens']} | {prefill['prefill_ms']:.1f} | "
              f"{prefill['causal_hsa_ms']:.1f} | {prefill['ratio']:.2f} |", "",
              "| tokens | hsa state (bytes / sequence) | flat KV (bytes / sequence) | "
              "flat / hsa |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['hsa_bytes']:,}{'' if r['measured'] else ' (bytes_for)'} "
              f"| {r['flat_kv_bytes']:,} | {r['ratio']:.0f} |" for r in memory]
    (RESULTS / "bench_cache.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {RESULTS / 'bench_cache.json'}, .md")


if __name__ == "__main__":
    main()
