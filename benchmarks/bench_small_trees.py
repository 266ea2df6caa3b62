"""Small trees: ``hsa`` on batches of small balanced trees against flat attention per tree.

The workloads of the performance issue: batches of balanced trees (branching 16) of
16, 64, 256, 1,024 and 4,096 leaves, always 4,096 leaves per batch (256 trees of 16
leaves ... one tree of 4,096), 4 heads, D = Dv = 64, float32, at 1 and 2 threads. For
each size, in one process and interleaved:

* **hsa**: :func:`hsa_graph.hsa` on the PyG ``Batch`` of the trees;
* **flat**: ``scaled_dot_product_attention`` over each tree's leaves (``[B, H, n, D]``),
  the attention a flat model of the same trees computes;
* **floor**: ``scaled_dot_product_attention`` inside the leaf families of 16 alone
  (HSA's largest single cost; no tree work at all);
* **passes**: the floor plus the other passes over full-size tensors that HSA makes,
  written with plain torch ops and no tree bookkeeping: the leaf families' means of
  ``q``, ``k``, ``v`` (one more read of each) and the family softmax over them at the
  deepest internal level (random operands of the right shapes above it), and the
  weighing of the output (``acc + m * o``, one more read and write). In the forward
  this is the least the algorithm costs in eager PyTorch (the means are operands of
  the internal families, and the weights ``m`` need the leaf families' log-sum-exps,
  so neither pass folds into the leaf families' kernel call): where ``passes`` exceeds
  ``flat``, "no slower than flat" is out of reach without a fused kernel. In the
  backward it is autograd over those ops, which the library's fused backward can beat.
* **one tree**: :func:`hsa_graph.hsa` on the first tree of the batch alone: about what
  a call costs whatever the batch (its bookkeeping over buckets and levels, a small
  kernel call per bucket), which ``hsa`` pays on top of ``passes``; where ``passes +
  one tree`` exceeds ``flat``, so does ``hsa`` short of fewer ops per call.

Forward (under ``torch.no_grad``) and forward + backward (``y.square().sum()``), the
median of ``--repeats`` calls after a warm-up.

A second table times the two kernels the library has for the family softmax on the
leaf families of a batch (256 families of 16 leaves x 4 heads, token-major rows), the
choice ``_small_families`` makes: PyTorch's fused CPU kernel (``fused``) and batched
matmuls one head at a time (``batched``), forward and forward + backward (each kernel's
own backward, given random upstream gradients of the output and the log-sum-exp).

Goals: hsa no slower than flat at 64 leaves and above, within 3x of the floor, and
within 1.5x of flat at 16 leaves (one family per tree, where HSA is flat attention plus
bookkeeping).

Run: ``python benchmarks/bench_small_trees.py`` (writes
``benchmarks/results/bench_small_trees.{md,json}``; ``--quick``: fewer repeats).
Measure on a quiet machine, in the default environment.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch_geometric.data import Batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hsa import balanced_parents, level_sizes  # noqa: E402

import hsa_graph  # noqa: E402

SIZES = [16, 64, 256, 1024, 4096]
TOTAL, H, D = 4096, 4, 64
RESULTS = Path(__file__).resolve().parent / "results"


def median_ms(fns: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """Median wall time of each function, the calls interleaved (so load changes hit
    all of them alike) and their order rotated from one repeat to the next (so no
    function always runs first: the call after a forward + backward pays for the pages
    the allocator handed back, 0.96-1.06x the other's time at 16 leaves by order
    alone)."""
    for fn in fns.values():
        fn()
    items = list(fns.items())
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for repeat in range(repeats):
        shift = repeat % len(items)
        for name, fn in items[shift:] + items[:shift]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}


def _passes(n: int, q, k, v, blocks) -> Callable[[], object]:
    """The floor and the full-size passes of HSA on balanced trees of ``n`` leaves (see
    the module docstring), without the library; differentiable, so that the forward +
    backward workload times their backward too."""
    sizes = level_sizes(n)                  # nodes per level, root first, leaves last
    trees, families = TOTAL // n, TOTAL // 16
    # the families of each internal level below the root, (count, width), deepest
    # first: the deepest attend over the leaf families' means, the others over random
    # operands of their shapes
    levels = [(trees * sizes[d - 1], sizes[d] // sizes[d - 1])
              for d in range(len(sizes) - 2, 0, -1)]
    upper = [torch.randn(f * b, H, D) for f, b in levels[1:]]
    m = torch.rand(families, 1, H, 1)
    family = torch.arange(TOTAL) // 16

    def passes():
        out = F.scaled_dot_product_attention(blocks(q, 16), blocks(k, 16), blocks(v, 16))
        if not levels:  # one family per tree: HSA is the floor and nothing else
            return out
        # one more read of q, k, v, the rows in order (as the library sums them)
        means = [torch.zeros(families, H, D).index_add_(0, family, t).div_(16)
                 for t in (q, k, v)]
        f, b = levels[0]
        rq, rk, rv = (t.view(f, b, H, D).transpose(1, 2) for t in means)
        above = F.scaled_dot_product_attention(rq, rk, rv)
        for (f, b), r in zip(levels[1:], upper):
            rows = r.view(f, b, H, D).transpose(1, 2)
            F.scaled_dot_product_attention(rows, rows, rows)
        acc = above.transpose(1, 2).reshape(families, 1, H, D)
        return torch.addcmul(acc, out.transpose(1, 2), m)   # one more read and write
    return passes


def workloads(n: int, backward: bool) -> Dict[str, Callable[[], object]]:
    trees = TOTAL // n
    tree = Batch.from_data_list(
        [hsa_graph.NestedSignal.from_parents(balanced_parents(n)) for _ in range(trees)])
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(TOTAL, H, D, generator=gen, requires_grad=backward)
               for _ in range(3))

    def blocks(t, size):
        return t.view(TOTAL // size, size, H, D).transpose(1, 2)

    ops = {"hsa": lambda: hsa_graph.hsa(q, k, v, tree),
           "flat": lambda: F.scaled_dot_product_attention(
               blocks(q, n), blocks(k, n), blocks(v, n)),
           "floor": lambda: F.scaled_dot_product_attention(
               blocks(q, 16), blocks(k, 16), blocks(v, 16))}
    ops["passes"] = _passes(n, q, k, v, blocks)
    one = hsa_graph.NestedSignal.from_parents(balanced_parents(n))
    ops["one tree"] = lambda: hsa_graph.hsa(q[:n], k[:n], v[:n], one)

    def run(op):
        if not backward:
            def forward():
                with torch.no_grad():
                    return op()
            return forward

        def forward_backward():
            op().square().sum().backward()
            for t in (q, k, v):
                t.grad = None
        return forward_backward

    return {name: run(op) for name, op in ops.items()}


def family_kernels(backward: bool) -> Dict[str, Callable[[], object]]:
    """The family softmax of 256 families of 16 leaves through each kernel (see the
    module docstring), without autograd: the backward is each kernel's own."""
    from hsa_graph.ops.hsa import (
        _batched_family_attention,
        _batched_family_attention_backward,
        _family_attention_forward,
        _family_attention_grads,
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(TOTAL, H, D, generator=gen).view(TOTAL // 16, 16, H, D)
                      .transpose(1, 2) for _ in range(4))
    d_lse = torch.randn(TOTAL // 16, H, 16, generator=gen)
    needs = (True, True, True)

    def fused():
        out, lse = _family_attention_forward(q, k, v, None, D ** -0.5)
        if backward:
            _family_attention_grads(q, k, v, None, out, lse, d_out, d_lse, D ** -0.5, needs)

    def batched():
        out, lse, p = _batched_family_attention(q, k, v, None, D ** -0.5)
        if backward:
            _batched_family_attention_backward(q, k, v, p, d_out, d_lse, D ** -0.5, needs)

    return {"fused": fused, "batched": batched}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="5 repeats, sizes 16 and 64")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = [16, 64] if args.quick else SIZES
    repeats = 5 if args.quick else args.repeats
    load_start = os.getloadavg()[0]
    rows, kernels = [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in sizes:
            for backward in (False, True):
                ms = median_ms(workloads(n, backward), repeats)
                rows.append({"threads": threads, "leaves": n, "trees": TOTAL // n,
                             "pass": "fwd+bwd" if backward else "fwd", **ms})
                print(f"  {threads}t n={n} {rows[-1]['pass']}: hsa {ms['hsa']:.2f} ms, "
                      f"flat {ms['flat']:.2f}, floor {ms['floor']:.2f}, "
                      f"passes {ms['passes']:.2f}, one tree {ms['one tree']:.2f}",
                      file=sys.stderr)
        for backward in (False, True):
            with torch.no_grad():
                ms = median_ms(family_kernels(backward), repeats)
            kernels.append({"threads": threads, "pass": "fwd+bwd" if backward else "fwd",
                            **ms})
    meta = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_start": load_start, "load_end": os.getloadavg()[0],
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith(("MALLOC_", "OMP_", "MKL_"))}}
    lines = [f"Command: `python benchmarks/{meta['command']}`; load average "
             f"{meta['load_start']:.2f} -> {meta['load_end']:.2f}; torch {meta['torch']}; "
             f"environment variables: {meta['env'] or 'none'}", "",
             "| threads | leaves per tree x trees | pass | hsa ms | flat ms | floor ms "
             "| passes ms | one tree ms | hsa / flat | hsa / floor | passes / flat "
             "| (passes + one tree) / flat |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['leaves']} x {r['trees']} | {r['pass']} | "
                     f"{r['hsa']:.2f} | {r['flat']:.2f} | {r['floor']:.2f} | {r['passes']:.2f} | "
                     f"{r['one tree']:.2f} | {r['hsa'] / r['flat']:.2f} | "
                     f"{r['hsa'] / r['floor']:.2f} | {r['passes'] / r['flat']:.2f} | "
                     f"{(r['passes'] + r['one tree']) / r['flat']:.2f} |")
    lines += ["", "Family softmax of 256 families of 16 leaves x 4 heads (D = 64), per kernel:",
              "", "| threads | pass | fused ms | batched ms | batched / fused |",
              "|---|---|---|---|---|"]
    for r in kernels:
        lines.append(f"| {r['threads']} | {r['pass']} | {r['fused']:.2f} | "
                     f"{r['batched']:.2f} | {r['batched'] / r['fused']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_small_trees.md").write_text(
            "# hsa on small trees vs flat attention per tree\n\n" + table + "\n")
        (args.out / "bench_small_trees.json").write_text(
            json.dumps({"meta": meta, "rows": rows, "kernels": kernels}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
