"""Causal HSA against HSA on the same tree and inputs (the training-side figures of the
generation issue), with one command::

    python benchmarks/bench_causal.py --threads 2

Runs in the environment it was started in (no allocator or threading variables).
Workloads (float32, 8 heads, D = Dv = 64, ``include_self=True``):

* **balanced** trees of depth 2, 3, 4 and 5 at about 65,536 leaves (branching 256, 40,
  16, 9): causal HSA takes one b-wide step per level of each query's spine, so the
  depth is the bound it is compared with (``ratio / depth``);
* **ragged**: family sizes uniform in 2..30 at every level, 65,536 leaves;
* **document**: document -> paragraphs -> sentences -> words -> characters, ragged
  counts (about 65,000 characters);
* forward, and forward + backward, each interleaved with HSA's (same machine load;
  ratios are medians of per-repeat ratios); the warm-up call builds the structure and
  its causal plan, which every later call (and every layer of a stack) reuses.

Prints a Markdown table with the load average and writes it with a JSON copy to
``--out`` (``benchmarks/results``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hsa import balanced_parents  # noqa: E402
from bench_issue9 import (  # noqa: E402
    fwd_bwd,
    interleaved,
    loadavg,
    med,
    no_grad,
    ragged_parents,
    ratio_of,
)

import hsa_graph  # noqa: E402

H, D = 8, 64
BALANCED = {2: 256, 3: 40, 4: 16, 5: 9}   # depth -> branching, about 65,536 leaves


def document_parents(paragraphs: int = 90, seed: int = 0) -> torch.Tensor:
    """document -> paragraphs (5..12 sentences) -> sentences (5..25 words) -> words
    (2..9 characters), numbered depth-first so that every node's leaves are
    contiguous (document order)."""
    gen = torch.Generator().manual_seed(seed)
    parent: List[int] = [-1]

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    for _ in range(paragraphs):
        parent.append(0)
        p = len(parent) - 1
        for _ in range(draw(5, 12)):
            parent.append(p)
            s = len(parent) - 1
            for _ in range(draw(5, 25)):
                parent.append(s)
                w = len(parent) - 1
                parent.extend([w] * draw(2, 9))
    return torch.tensor(parent)


def trees() -> Dict[str, torch.Tensor]:
    out = {f"balanced depth {d}": balanced_parents(b ** d, b) for d, b in BALANCED.items()}
    out["ragged 2..30"] = ragged_parents(65536)
    out["document"] = document_parents()
    return out


def depth_of(tree: hsa_graph.NestedSignal) -> int:
    st = tree.structure_for(torch.device("cpu"))
    return int(st.depth[: st.num_leaves].max())


def bench(name: str, parent: torch.Tensor, repeats: int) -> Dict:
    tree = hsa_graph.NestedSignal.from_parents(parent)
    n = tree.num_leaves
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, H, D, generator=gen).requires_grad_() for _ in range(3))
    hsa = lambda: hsa_graph.hsa(q, k, v, tree)                  # noqa: E731
    causal = lambda: hsa_graph.causal_hsa(q, k, v, tree)        # noqa: E731
    fwd = interleaved({"hsa": no_grad(hsa), "causal": no_grad(causal)}, repeats)
    both = interleaved({"hsa": fwd_bwd(hsa, q, k, v), "causal": fwd_bwd(causal, q, k, v)},
                       max(1, repeats // 2))
    depth = depth_of(tree)
    return {"tree": name, "leaves": n, "depth": depth,
            "hsa_ms": med(fwd["hsa"]), "causal_ms": med(fwd["causal"]),
            "ratio": ratio_of(fwd["causal"], fwd["hsa"]),
            "hsa_fb_ms": med(both["hsa"]), "causal_fb_ms": med(both["causal"]),
            "ratio_fb": ratio_of(both["causal"], both["hsa"])}


def report(rows: List[Dict], meta: Dict) -> str:
    lines = [f"causal_hsa vs hsa, {meta['threads']} threads, float32, H = {H}, D = {D}, "
             f"load average {meta['load_before']} before / {meta['load_after']} after "
             f"({meta['machine']}, torch {meta['torch']})", "",
             "| tree | leaves | depth | hsa fwd ms | causal fwd ms | causal / hsa | "
             "ratio / depth | hsa f+b ms | causal f+b ms | f+b ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['tree']} | {r['leaves']:,} | {r['depth']} | {r['hsa_ms']:.0f} | "
            f"{r['causal_ms']:.0f} | {r['ratio']:.2f} | {r['ratio'] / r['depth']:.2f} | "
            f"{r['hsa_fb_ms']:.0f} | {r['causal_fb_ms']:.0f} | {r['ratio_fb']:.2f} |")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trees", nargs="*", default=None,
                        help="names of the workloads to run (default: all)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = {"threads": args.threads, "load_before": loadavg(), "torch": torch.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count()}
    rows = []
    for name, parent in trees().items():
        if args.trees and name not in args.trees:
            continue
        rows.append(bench(name, parent, args.repeats))
        print(f"{name}: causal / hsa {rows[-1]['ratio']:.2f} (f+b {rows[-1]['ratio_fb']:.2f})",
              flush=True)
    meta["load_after"] = loadavg()
    text = report(rows, meta)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_causal_{args.threads}t.md").write_text(text + "\n")
    (out / f"bench_causal_{args.threads}t.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
