"""Cost of inducing a tree from the keys, next to the HSA call it serves.

Run: ``python benchmarks/bench_induce.py [--lengths 128 512] [--batch 8]`` (prints a
Markdown table; the defaults are tiny so that it runs in seconds on a laptop CPU).

For a batch of ``B`` sequences of ``T`` tokens with ``H`` heads of ``D`` channels
(``H * D`` key channels, as :class:`~hsa_graph.nn.HSAttention` passes them), each row
times: building the tree (:func:`~hsa_graph.induce.contiguous_tree` or
:func:`~hsa_graph.induce.cluster_tree`, which includes ``NestedSignal.from_parents``
and its ``TreeStructure``), then :func:`~hsa_graph.hsa` forward on it, and for
comparison the hopping-window tree ``(2, 4, 8, 16)`` and HSA on it; then both on a
fresh tree each time (what an inducing layer pays per forward). Median of
``--repeats`` runs after one warm-up; wall-clock times on whatever device is given.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import torch

from hsa_graph import hopping_window_forest, hsa
from hsa_graph.induce import cluster_tree, contiguous_tree


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-channels", type=int, default=16)
    parser.add_argument("--max-children", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    h, d = args.heads, args.head_channels
    print(f"B = {args.batch}, H = {h}, D = {d}, max_children = {args.max_children}, "
          f"device {device}, torch threads {torch.get_num_threads()}\n")
    print("| T | tree | build ms | HSA ms | build / HSA | build + HSA, fresh tree ms | nodes "
          "| depth |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        torch.manual_seed(0)
        n = args.batch * length
        q, k, v = (torch.randn(n, h, d, device=device) for _ in range(3))
        batch = torch.arange(args.batch, device=device).repeat_interleave(length)
        keys = k.reshape(n, h * d)
        builders = {
            "contiguous": functools.partial(contiguous_tree, keys, batch,
                                            max_children=args.max_children),
            "cluster": functools.partial(cluster_tree, keys, batch,
                                         max_children=args.max_children),
            "windows (2,4,8,16)": functools.partial(
                hopping_window_forest, torch.full((args.batch,), length, dtype=torch.long),
                (2, 4, 8, 16)),
        }
        for name, build in builders.items():
            print(f"| {length} | {name} | " + _measure(build, q, k, v, args.repeats, device))


def _measure(build: Callable, q, k, v, repeats: int, device: torch.device) -> str:
    """The table cells after ``T`` and the tree's name."""
    tree = build()
    st = tree.structure_for(device)
    build_s = _median_seconds(lambda: build().structure_for(device), repeats, device)
    hsa_s = _median_seconds(lambda: hsa(q, k, v, tree), repeats, device)
    # what an inducing layer pays per forward: a new tree, its lazy tables, HSA
    fresh_s = _median_seconds(lambda: hsa(q, k, v, build()), repeats, device)
    return (f"{1e3 * build_s:.2f} | {1e3 * hsa_s:.2f} | {build_s / hsa_s:.2f} | "
            f"{1e3 * fresh_s:.2f} | {tree.num_nodes:,} | {st.max_depth} |")

if __name__ == "__main__":
    main()
