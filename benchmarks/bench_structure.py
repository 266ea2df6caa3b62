"""Time to build the tree structure of large trees (vectorised, once per tree).

Run: ``python benchmarks/bench_structure.py`` (prints a Markdown table).

Trees: balanced with branching 16 (N = 1,000,000 leaves, ragged at the end), a forest
of 62,500 trees of 16 leaves, and a caterpillar (a spine of 4,096 internal nodes with
63 leaves each). ``TreeStructure.from_parent`` validates the parent array (range,
cycles) and derives depths, leaf counts, levels and family buckets.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from hsa_graph import NestedSignal, TreeStructure


def balanced(num_leaves: int, branching: int = 16) -> torch.Tensor:
    sizes = [num_leaves]
    while sizes[-1] > 1:
        sizes.append(math.ceil(sizes[-1] / branching))
    sizes.reverse()
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    parent = torch.full((sum(sizes),), -1, dtype=torch.long)
    for level in range(1, len(sizes)):
        index = torch.arange(sizes[level])
        parent[starts[level]:starts[level] + sizes[level]] = starts[level - 1] + index // branching
    return parent


def forest(num_trees: int, leaves: int) -> torch.Tensor:
    tree = torch.cat([torch.tensor([-1]), torch.zeros(leaves, dtype=torch.long)])
    offsets = torch.arange(num_trees).repeat_interleave(leaves + 1) * (leaves + 1)
    parent = tree.repeat(num_trees)
    return torch.where(parent >= 0, parent + offsets, -1)


def caterpillar(spine: int, leaves: int) -> torch.Tensor:
    spine_parent = torch.arange(-1, spine - 1)
    leaf_parent = torch.arange(spine).repeat_interleave(leaves)
    return torch.cat([spine_parent, leaf_parent])


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = {
        "balanced, branching 16, 1,000,000 leaves": balanced(1_000_000),
        "forest of 62,500 trees of 16 leaves": forest(62_500, 16),
        "caterpillar, spine 4,096 x 63 leaves": caterpillar(4096, 63),
    }
    print(f"threads = {args.threads}, median of {args.repeats}\n")
    print("| tree | nodes | leaves | depth | TreeStructure.from_parent (s) | from_parents (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, parent in cases.items():
        times, full = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            structure = TreeStructure.from_parent(parent)
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            NestedSignal.from_parents(parent)
            full.append(time.perf_counter() - start)
        print(f"| {name} | {parent.numel():,} | {structure.num_leaves:,} | "
              f"{structure.max_depth + 2} | {sorted(times)[len(times) // 2]:.2f} | "
              f"{sorted(full)[len(full) // 2]:.2f} |")


if __name__ == "__main__":
    main()
