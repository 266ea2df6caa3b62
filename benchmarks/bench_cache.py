"""Per-token cost of generating with causal HSA: hierarchical cache vs recomputation vs a
flat KV cache, as the sequence grows.

The tree is a balanced ``b``-ary hierarchy over the tokens (hopping windows of ``b``
tokens, ``b`` windows, ...; leaves at a fixed depth so that it holds ``max_len``
tokens): token ``i`` closes one level per trailing zero of ``i`` in base ``b``.
For each length ``L`` the script times

* **hsa cache**: :meth:`hsa_graph.ops.cache.HSACache.append` of the next tokens
  (``O(b * depth * D)`` per token, depth = ``log_b max_len``);
* **recompute**: :func:`hsa_graph.ops.causal.causal_hsa` over all ``L`` tokens, which is
  what generation without a cache does for every new token;
* **flat kv cache**: ``scaled_dot_product_attention`` of the new query over all ``L``
  cached keys and values (a standard transformer's KV cache, ``O(L * D)`` per token);

and the memory each keeps (floating-point numbers). Writes ``bench_cache.json``,
``bench_cache.md`` and ``bench_cache.png`` to ``benchmarks/results/``.

Run: ``python benchmarks/bench_cache.py`` (``--quick`` stops at 4,096 tokens).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hsa_graph
from hsa_graph.ops.cache import HSACache
from hsa_graph.ops.causal import causal_hsa

RESULTS = Path(__file__).resolve().parent / "results"


def attach_of(i: int, branching: int, depth: int) -> int:
    """Depth of the node token ``i`` hangs under: one level up per trailing zero of
    ``i`` in base ``branching``."""
    closes = 0
    while i % branching == 0 and closes < depth - 1:
        i //= branching
        closes += 1
    return depth - 1 - closes


def cache_floats(cache: HSACache) -> int:
    total = 0
    for level in cache.levels:
        for name in ("rq", "rk", "rv", "logn", "lam", "fixed"):
            t = getattr(level, name)
            total += 0 if t is None else t.numel()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--branching", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="timed tokens per length")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [256, 1024, 4096] + ([] if args.quick else [16384])
    max_len = lengths[-1] + args.tokens
    b, h, d = args.branching, args.heads, args.dim
    depth = max(1, math.ceil(math.log(max_len, b)))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(max_len, h, d, generator=gen) for _ in range(3))

    cache = HSACache()
    kv_k, kv_v = torch.empty(max_len, h, d), torch.empty(max_len, h, d)
    rows = []
    n = 0
    for length in lengths:
        while n < length:  # grow the cache (untimed)
            place = dict(depth=depth) if n == 0 else dict(attach=attach_of(n, b, depth))
            cache.append(q[n], k[n], v[n], **place)
            n += 1
        # hierarchical cache: the next tokens
        start = time.perf_counter()
        for _ in range(args.tokens):
            cache.append(q[n], k[n], v[n], attach=attach_of(n, b, depth))
            n += 1
        t_cache = (time.perf_counter() - start) / args.tokens
        # flat KV cache: same number of tokens around this length
        kv_k[:n], kv_v[:n] = k[:n], v[:n]
        start = time.perf_counter()
        for j in range(n - args.tokens, n):
            kv_k[j], kv_v[j] = k[j], v[j]
            F.scaled_dot_product_attention(q[j].unsqueeze(1), kv_k[:j + 1].transpose(0, 1),
                                           kv_v[:j + 1].transpose(0, 1))
        t_flat = (time.perf_counter() - start) / args.tokens
        # recomputation over the whole prefix, once (best of 2)
        tree = hsa_graph.NestedSignal.from_parents(cache.parent)
        t_full = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            causal_hsa(q[:n], k[:n], v[:n], tree)
            t_full = min(t_full, time.perf_counter() - start)
        rows.append(dict(length=n, depth=depth, cache_ms=1e3 * t_cache, flat_kv_ms=1e3 * t_flat,
                         recompute_ms=1e3 * t_full, cache_floats=cache_floats(cache),
                         flat_kv_floats=2 * n * h * d))
        print(f"L={n:6d}  cache {rows[-1]['cache_ms']:.3f} ms/token  flat kv "
              f"{rows[-1]['flat_kv_ms']:.3f} ms/token  recompute {rows[-1]['recompute_ms']:.1f} "
              f"ms/token  cache floats {rows[-1]['cache_floats']}  kv floats "
              f"{rows[-1]['flat_kv_floats']}", flush=True)

    RESULTS.mkdir(exist_ok=True)
    meta = dict(branching=b, heads=h, dim=d, depth=depth, timed_tokens=args.tokens,
                threads=args.threads, torch=torch.__version__, rows=rows)
    (RESULTS / "bench_cache.json").write_text(json.dumps(meta, indent=2))
    lines = [f"Per-token generation cost, balanced {b}-ary tree of depth {depth}, "
             f"H={h}, D={d}, {args.threads} thread(s), CPU.", "",
             "| tokens | hsa cache (ms/token) | flat KV cache (ms/token) | "
             "recompute causal_hsa (ms/token) | hsa cache floats | flat KV floats |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['length']} | {r['cache_ms']:.3f} | {r['flat_kv_ms']:.3f} | "
                     f"{r['recompute_ms']:.1f} | {r['cache_floats']} | {r['flat_kv_floats']} |")
    (RESULTS / "bench_cache.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["length"] for r in rows]
    for key, label in (("cache_ms", "hsa cache"), ("flat_kv_ms", "flat KV cache"),
                       ("recompute_ms", "recompute (causal_hsa)")):
        ax.loglog(x, [r[key] for r in rows], "o-", label=label)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("ms per generated token")
    ax.set_title(f"Causal HSA generation, {b}-ary tree, H={h}, D={d}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_cache.png", dpi=120)
    print(f"wrote {RESULTS / 'bench_cache.json'}, .md, .png")


if __name__ == "__main__":
    main()
