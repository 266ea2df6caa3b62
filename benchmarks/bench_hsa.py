"""Benchmark of Hierarchical Self-Attention (``hsa_graph.hsa``) against flat attention.

Reproduce the table and figure (from the project root)::

    python benchmarks/bench_hsa.py                 # N = 256 ... 65536 (a few minutes)
    python benchmarks/bench_hsa.py --quick         # N <= 4096, 3 repeats (< 1 minute)

Outputs ``<out>/bench_hsa.md``, ``<out>/bench_hsa.json`` and ``<out>/bench_hsa.png``
(``--out`` defaults to ``benchmarks/results``).

Trees are balanced with branching 16 at every level, numbered breadth-first (root first,
leaves last). When ``N`` is not a power of 16 the root takes the remainder
(``N = 1024``: the root has 4 children, every other internal node 16). Inputs are
``q, k, v`` of shape ``[N, H, D]`` (default 8 heads of 64), float32, on the CPU.

Timed, with warm-up and the median of the repeats (``time.perf_counter``):

* ``hsa fwd``: ``hsa(q, k, v, tree)`` under ``torch.no_grad``;
* ``hsa f+b``: the same with autograd, ``y.sum().backward()`` (grads of q, k, v);
* ``floor``: ``scaled_dot_product_attention`` over the leaf families only
  (``q`` viewed as ``[N / 16, H, 16, D]``), the cost of the finest level of HSA
  alone, forward and forward+backward;
* ``flat``: ``scaled_dot_product_attention`` over all ``N`` leaves (one sequence),
  forward and forward+backward, skipped when its ``H * N * N`` float32 matrix would
  exceed ``--flat-limit-gb`` (4 GB by default);
* ``dense``: ``hsa_weights(q, k, tree) @ v``, forward, for ``N <= --dense-max``;
* ``build``: ``NestedSignal.from_parents(parent)`` (which builds and caches the
  ``TreeStructure``) and ``TreeStructure.from_parent(parent)`` alone;
* ``hsa 1st`` / ``hsa 2nd``: the first and the second forward call on a freshly built
  tree (the second one reuses the cached structure).

These are wall-clock timings on a shared machine: no test asserts on them. The 1-minute
load average is recorded before and after each size; a load above the number of cores
means other processes competed for the CPU (with ``--threads 2`` on 2 busy cores every
parallel region can wait a scheduler time slice, inflating times many-fold;
``--threads 1`` is steadier there). On some Linux VMs page faults on fresh large
allocations dominate at large ``N``; running with
``MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736`` lets glibc reuse
freed memory (these and the OpenMP variables are recorded in the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import hsa_graph

BRANCHING = 16
DEFAULT_SIZES = [256, 1024, 4096, 16384, 65536]
QUICK_SIZES = [256, 1024, 4096]


# ------------------------------------------------------------------------- trees
def level_sizes(n: int, branching: int = BRANCHING) -> List[int]:
    """Number of nodes on each level, root first, of a balanced tree with ``n`` leaves.

    Every internal node has ``branching`` children except the root, which takes the
    remainder when ``n`` is not a power of ``branching``.
    """
    if n < branching or n % branching:
        raise ValueError(f"N must be a positive multiple of {branching}, got {n}")
    sizes = [n]
    while sizes[-1] % branching == 0 and sizes[-1] > 1:
        sizes.append(sizes[-1] // branching)
    if sizes[-1] > 1:  # the root takes the remainder
        sizes.append(1)
    return sizes[::-1]


def balanced_parents(n: int, branching: int = BRANCHING) -> torch.Tensor:
    """Parent array (BFS numbering: root first, leaves last) of a balanced tree."""
    sizes = level_sizes(n, branching)
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    parts = [torch.full((1,), -1, dtype=torch.long)]
    for level in range(1, len(sizes)):  # a loop over levels only, never over nodes
        fan_out = sizes[level] // sizes[level - 1]
        parts.append(offsets[level - 1] + torch.arange(sizes[level]) // fan_out)
    return torch.cat(parts)


# ------------------------------------------------------------------------ timing
def _now() -> float:
    return time.perf_counter()


def _loadavg() -> Optional[float]:
    """The 1-minute load average (other processes competing for the cores)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def measure(fn: Callable[[], object], repeats: int, warmup: int,
            budget_s: Optional[float]) -> Dict[str, object]:
    """Median wall time of ``fn`` in ms after ``warmup`` calls.

    When ``budget_s`` is given, the number of repeats is lowered (never below 3) so that
    the repeats take about ``budget_s`` seconds, judged from the last warm-up call; a
    call slower than ``3 * budget_s`` (a machine under heavy load) is timed once.
    """
    last = 0.0
    for i in range(warmup):
        t0 = _now()
        fn()
        last = _now() - t0
        if budget_s is not None and i == 0 and last > budget_s / 4:
            break  # a slow call: one warm-up is enough
    if budget_s is not None and last > 0:
        floor = 1 if last > 3 * budget_s else min(3, repeats)
        repeats = max(floor, min(repeats, int(budget_s / last)))
    times = []
    for _ in range(repeats):
        t0 = _now()
        fn()
        times.append((_now() - t0) * 1e3)
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "repeats": repeats,
        "times_ms": times,
    }


def forward_only(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fn()
    return run


def forward_backward(fn: Callable[[], torch.Tensor], *leaves: torch.Tensor
                     ) -> Callable[[], None]:
    def run() -> None:
        for t in leaves:
            t.grad = None
        fn().sum().backward()
    return run


# --------------------------------------------------------------------- operators
def sdpa_flat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of all ``N`` leaves: ``[N, H, D]`` -> ``[N, H, D]``."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1))
    return out.transpose(0, 1)


def sdpa_floor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention inside each leaf family of ``BRANCHING`` consecutive leaves."""
    n, h, d = q.shape

    def fam(t: torch.Tensor) -> torch.Tensor:
        return t.view(n // BRANCHING, BRANCHING, h, t.shape[-1]).transpose(1, 2)

    out = F.scaled_dot_product_attention(fam(q), fam(k), fam(v))  # [N/16, H, 16, D]
    return out.transpose(1, 2).reshape(n, h, v.shape[-1])


def dense_hsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree) -> torch.Tensor:
    theta = hsa_graph.hsa_weights(q, k, tree)                  # [H, N, N]
    return torch.matmul(theta, v.transpose(0, 1)).transpose(0, 1)


# ------------------------------------------------------------------------- bench
def bench_size(n: int, args: argparse.Namespace, repeats: int) -> Dict[str, object]:
    h, d = args.heads, args.dim
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    parent = balanced_parents(n)
    row: Dict[str, object] = {"N": n, "nodes": parent.numel(),
                              "levels": level_sizes(n), "errors": {},
                              "loadavg_before": _loadavg()}
    budget = args.budget
    errors: Dict[str, str] = row["errors"]  # type: ignore[assignment]

    def attempt(name: str, fn: Callable[[], object], **kw) -> Optional[Dict[str, object]]:
        try:
            return measure(fn, **kw)
        except Exception as exc:  # report and carry on with the other operators
            errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"  N={n}: {name} failed: {errors[name]}", file=sys.stderr)
            return None

    # Structure build, then the first and second hsa calls on that fresh tree.
    build_reps = max(3, repeats)
    row["build_from_parents"] = attempt(
        "build_from_parents", lambda: hsa_graph.NestedSignal.from_parents(parent),
        repeats=build_reps, warmup=1, budget_s=budget)
    row["build_structure"] = attempt(
        "build_structure", lambda: hsa_graph.TreeStructure.from_parent(parent),
        repeats=build_reps, warmup=1, budget_s=budget)
    tree = hsa_graph.NestedSignal.from_parents(parent)
    cached = tree.structure
    with torch.no_grad():
        t0 = _now()
        y = hsa_graph.hsa(q, k, v, tree)
        row["hsa_first_ms"] = (_now() - t0) * 1e3
        t0 = _now()
        hsa_graph.hsa(q, k, v, tree)
        row["hsa_second_ms"] = (_now() - t0) * 1e3
    row["structure_reused"] = tree.structure is cached
    row["nonfinite_output"] = bool(not torch.isfinite(y).all())

    common = {"repeats": repeats, "warmup": args.warmup, "budget_s": budget}
    row["hsa_fwd"] = attempt(
        "hsa_fwd", forward_only(lambda: hsa_graph.hsa(q, k, v, tree)), **common)
    row["hsa_fwdbwd"] = attempt(
        "hsa_fwdbwd",
        forward_backward(lambda: hsa_graph.hsa(qg, kg, vg, tree), qg, kg, vg), **common)
    row["floor_fwd"] = attempt("floor_fwd", forward_only(lambda: sdpa_floor(q, k, v)),
                               **common)
    row["floor_fwdbwd"] = attempt(
        "floor_fwdbwd", forward_backward(lambda: sdpa_floor(qg, kg, vg), qg, kg, vg),
        **common)

    flat_bytes = n * n * h * 4
    row["flat_matrix_gb"] = flat_bytes / 1e9
    if flat_bytes > args.flat_limit_gb * 1e9:
        print(f"  N={n}: flat SDPA skipped (H*N*N*4 = {flat_bytes / 1e9:.1f} GB > "
              f"{args.flat_limit_gb:g} GB)")
        row["flat_fwd"] = row["flat_fwdbwd"] = "skipped"
    else:
        row["flat_fwd"] = attempt("flat_fwd", forward_only(lambda: sdpa_flat(q, k, v)),
                                  **common)
        row["flat_fwdbwd"] = attempt(
            "flat_fwdbwd", forward_backward(lambda: sdpa_flat(qg, kg, vg), qg, kg, vg),
            **common)

    if n <= args.dense_max:
        row["dense_fwd"] = attempt(
            "dense_fwd", forward_only(lambda: dense_hsa(q, k, v, tree)), **common)
        try:
            with torch.no_grad():
                ref = dense_hsa(q, k, v, tree)
            row["dense_max_abs_diff"] = float((ref - y).abs().max())
        except Exception as exc:
            errors["dense_check"] = f"{type(exc).__name__}: {exc}"
    else:
        row["dense_fwd"] = "skipped"
    row["loadavg_after"] = _loadavg()
    return row


def ms(row: Dict[str, object], key: str) -> Optional[float]:
    value = row.get(key)
    if isinstance(value, dict):
        return float(value["median_ms"])
    if isinstance(value, (int, float)):
        return float(value)
    return None


def fmt(value: Optional[float], skipped: bool = False) -> str:
    if value is None:
        return "skipped" if skipped else "n/a"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b is not None and b > 0 else None


def markdown(rows: List[Dict[str, object]], meta: Dict[str, object]) -> str:
    def cell(row, key):
        return fmt(ms(row, key), skipped=row.get(key) == "skipped")

    def rcell(value):
        return "n/a" if value is None else f"{value:.2f}"

    lines = [
        f"Times in ms (median of repeats), H = {meta['heads']}, D = {meta['dim']}, "
        f"float32, {meta['threads']} thread(s), torch {meta['torch']}, branching "
        f"{BRANCHING}.",
        "",
        "| N | hsa fwd | hsa f+b | floor fwd | floor f+b | flat fwd | flat f+b | dense fwd "
        "| hsa/floor fwd | hsa/floor f+b | flat/hsa fwd | flat/hsa f+b |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        hf, hb = ms(row, "hsa_fwd"), ms(row, "hsa_fwdbwd")
        ff, fb = ms(row, "floor_fwd"), ms(row, "floor_fwdbwd")
        lf, lb = ms(row, "flat_fwd"), ms(row, "flat_fwdbwd")
        lines.append(
            f"| {row['N']} | {cell(row, 'hsa_fwd')} | {cell(row, 'hsa_fwdbwd')} "
            f"| {cell(row, 'floor_fwd')} | {cell(row, 'floor_fwdbwd')} "
            f"| {cell(row, 'flat_fwd')} | {cell(row, 'flat_fwdbwd')} "
            f"| {cell(row, 'dense_fwd')} "
            f"| {rcell(ratio(hf, ff))} | {rcell(ratio(hb, fb))} "
            f"| {rcell(ratio(lf, hf))} | {rcell(ratio(lb, hb))} |")
    lines += [
        "",
        "Tree construction and structure caching (ms):",
        "",
        "| N | nodes | from_parents | TreeStructure.from_parent | hsa 1st call "
        "| hsa 2nd call | structure reused | repeats (hsa fwd) | load avg (before/after) |",
        "|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|",
    ]
    for row in rows:
        reps = row["hsa_fwd"]["repeats"] if isinstance(row.get("hsa_fwd"), dict) else "n/a"
        lines.append(
            f"| {row['N']} | {row['nodes']} | {cell(row, 'build_from_parents')} "
            f"| {cell(row, 'build_structure')} | {cell(row, 'hsa_first_ms')} "
            f"| {cell(row, 'hsa_second_ms')} | {'yes' if row['structure_reused'] else 'NO'} "
            f"| {reps} | {row.get('loadavg_before')} / {row.get('loadavg_after')} |")
    notes = []
    for row in rows:
        if "dense_max_abs_diff" in row:
            notes.append(f"N={row['N']}: max |hsa - dense| = {row['dense_max_abs_diff']:.2e}")
        if row.get("nonfinite_output"):
            notes.append(f"N={row['N']}: hsa output has inf/nan")
        for name, err in row["errors"].items():
            notes.append(f"N={row['N']}: {name} failed: {err}")
    for row in rows:
        few = [key for key, value in row.items()
               if isinstance(value, dict) and value.get("repeats", 3) < 3]
        if few:
            notes.append(f"N={row['N']}: timed once (a call took over 3x --budget): {few}")
    busy = [row["N"] for row in rows
            if max(row.get("loadavg_before") or 0, row.get("loadavg_after") or 0)
            > (meta.get("cpu_count") or 1) + 0.5]
    if busy:
        notes.append(f"load average above the {meta.get('cpu_count')} cores during N = "
                     f"{busy}: other processes competed for the CPU, timings are inflated")
    if notes:
        lines += ["", "Checks:", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def plot(rows: List[Dict[str, object]], meta: Dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("hsa_fwd", "hsa fwd", "C0", "-", "o"),
        ("hsa_fwdbwd", "hsa fwd+bwd", "C0", "--", "s"),
        ("floor_fwd", "floor (leaf-family SDPA) fwd", "C2", "-", "^"),
        ("floor_fwdbwd", "floor fwd+bwd", "C2", "--", "v"),
        ("flat_fwd", "flat SDPA fwd", "C3", "-", "D"),
        ("flat_fwdbwd", "flat SDPA fwd+bwd", "C3", "--", "d"),
        ("dense_fwd", "dense hsa_weights @ v", "C1", ":", "x"),
    ]
    fig, ax = plt.subplots(figsize=(7.5, 5.2), dpi=130)
    for key, label, color, style, marker in series:
        pts = [(row["N"], ms(row, key)) for row in rows if ms(row, key) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, linestyle=style, marker=marker, color=color, label=label)
    ns = [row["N"] for row in rows]
    anchor = ms(rows[0], "hsa_fwd") if rows else None
    if anchor and len(ns) > 1:  # slope guides through the first hsa point
        n0 = ns[0]
        ax.plot(ns, [anchor * n / n0 for n in ns], color="0.6", lw=0.8, ls=":")
        ax.annotate("∝ N", (ns[-1], anchor * ns[-1] / n0), color="0.4", fontsize=8,
                    xytext=(4, 0), textcoords="offset points", va="center")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("N (leaves)")
    ax.set_ylabel("time (ms, median)")
    ax.set_title(f"HSA vs flat attention, balanced 16-ary trees\n"
                 f"H={meta['heads']}, D={meta['dim']}, float32, CPU, "
                 f"{meta['threads']} thread(s)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def default_repeats(n: int) -> int:
    if n <= 4096:
        return 10
    if n <= 16384:
        return 7
    return 5


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help=f"numbers of leaves N (default {DEFAULT_SIZES})")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per measurement (default: 10 for N <= 4096, "
                             "7 up to 16384, 5 above; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up calls (default 2; 1 with --quick)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds per measurement; slow operators get fewer repeats "
                             "(at least 3; 1 for a call over 3x the budget). 0 disables "
                             "(default 8; 2 with --quick)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--flat-limit-gb", type=float, default=4.0,
                        help="skip flat SDPA when H*N*N*4 bytes exceed this (default 4)")
    parser.add_argument("--dense-max", type=int, default=None,
                        help="largest N for the dense hsa_weights path (default 4096; "
                             "1024 with --quick, where N = 4096 alone would take ~1 min)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true",
                        help="N up to 4096 and 3 repeats (under a minute)")
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = 2.0 if args.quick else 8.0
    if args.budget <= 0:
        args.budget = None
    if args.dense_max is None:
        args.dense_max = 1024 if args.quick else 4096
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2

    sizes = args.sizes or DEFAULT_SIZES
    if args.quick:
        sizes = [n for n in (args.sizes or QUICK_SIZES) if n <= 4096]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    meta = {
        "heads": args.heads, "dim": args.dim, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "hsa_graph": hsa_graph.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor(), "cpu_count": os.cpu_count(),
        "branching": BRANCHING, "quick": args.quick, "warmup": args.warmup,
        "budget_s": args.budget, "flat_limit_gb": args.flat_limit_gb,
        "dense_max": args.dense_max, "command": " ".join(sys.argv),
        "env": {key: os.environ[key] for key in sorted(os.environ)
                if key.startswith(("MALLOC_", "OMP_", "MKL_", "GOMP_"))},
    }
    print(f"hsa_graph {hsa_graph.__version__}, torch {torch.__version__}, "
          f"{meta['threads']} thread(s), H={args.heads}, D={args.dim}, sizes={sizes}")

    # Warm the allocator and the kernels once, so the first size's "1st call" is fair.
    small = hsa_graph.NestedSignal.from_parents(balanced_parents(BRANCHING ** 2))
    x = torch.randn(BRANCHING ** 2, args.heads, args.dim)
    with torch.no_grad():
        hsa_graph.hsa(x, x, x, small)

    rows = []
    start = _now()
    for n in sizes:
        repeats = 3 if args.quick else (args.repeats or default_repeats(n))
        if args.quick and args.repeats:
            repeats = args.repeats
        t0 = _now()
        row = bench_size(n, args, repeats)
        row["wall_s"] = _now() - t0
        rows.append(row)
        print(f"  N={n}: hsa fwd {fmt(ms(row, 'hsa_fwd'))} ms, f+b "
              f"{fmt(ms(row, 'hsa_fwdbwd'))} ms ({row['wall_s']:.1f} s)", flush=True)
    meta["total_s"] = _now() - start

    table = markdown(rows, meta)
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_hsa.md").write_text(
        "# hsa_graph benchmark\n\n"
        f"Command: `{meta['command']}`\n\n" + table)
    (args.out / "bench_hsa.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
    plot(rows, meta, args.out / "bench_hsa.png")
    print(f"wrote {args.out / 'bench_hsa.md'}, bench_hsa.json, bench_hsa.png "
          f"({meta['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
