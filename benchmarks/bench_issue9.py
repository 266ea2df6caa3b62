"""Every figure of issue 9 (performance), with one command.

Reproduce (from the project root)::

    python benchmarks/bench_issue9.py --threads 2

Each workload runs in its own process (so the memory of one never adds to the next),
in the environment the benchmark was started in: what a user calling ``hsa`` from a
plain Python process gets. ``--malloc-env`` adds glibc's ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` (freed memory then stays in the heap, and fresh large buffers
do not page-fault on every call); its figures go to ``*_malloc`` files, to be quoted only
next to the default ones.

Prints a Markdown table of medians and ratios with pass/fail per goal and writes
``bench_issue9_<threads>t.md``, ``.json`` and ``.png`` (time vs N of HSA,
the floor, flat attention and the peer) to ``--out`` (``benchmarks/results``).

Workloads (float32, 8 heads, D = Dv = 64, ``include_self=True``, no positions):

* **balanced**: branching 16 at every level, N = 16,384 / 65,536 / 262,144;
* **floor**: ``scaled_dot_product_attention`` over the leaf families alone
  (``q`` viewed as ``[N / b, H, b, D]``), timed interleaved with HSA so that both see
  the same machine load; ratios are medians of the per-repeat ratios;
* **flat**: SDPA over all N leaves (N = 16,384 only);
* **peer**: ``HAttention1D`` of the PyPI package ``h-transformer-1d`` (block size 16,
  same heads and head size, on a 1-D sequence of N), with its input and output
  projections replaced by identities so only its attention is timed;
* **ragged**: N = 262,144 with family sizes drawn uniformly from 2..30 at every level;
* **forest**: 16,384 trees of 16 leaves (N = 262,144);
* **deep**: a caterpillar, a spine of 4,096 internal nodes with 63 leaf children each
  plus the next spine node (N = 258,048, 4,097 levels), against its own floor
  (SDPA over families of 64);
* **memory**: extra peak memory of one forward above its inputs, from the allocation
  events of ``torch.profiler`` (``profile_memory=True``, the raw kineto ``[memory]``
  events): the running sum of bytes allocated minus freed during the call, its
  maximum, against the bytes of q + k + v (the floor's figure alongside);
* **cache**: the first and second ``hsa`` call on a fresh tree, counting the calls
  of ``TreeStructure.from_parent`` (the second call must make none);
* **structure**: ``TreeStructure.from_parent`` of a 1,000,000-leaf balanced tree;
* **compile**: ``torch.compile(hsa, fullgraph=True)`` on a 1,024-leaf tree: whether
  it compiles without graph breaks, compile time, compiled vs eager forward.

Timings on a shared machine are noisy: the 1-minute load average is recorded, and
each goal is judged on medians of interleaved ratios.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hsa import balanced_parents  # noqa: E402
from bench_structure import balanced as balanced_1m  # noqa: E402
from bench_structure import caterpillar  # noqa: E402

import hsa_graph  # noqa: E402
from hsa_graph import TreeStructure  # noqa: E402

H, D = 8, 64
SIZES = [16384, 65536, 262144]
BIG = 262144


# ------------------------------------------------------------------------- trees
def ragged_parents(n: int, low: int = 2, high: int = 30, seed: int = 0) -> torch.Tensor:
    """Leaves grouped into families of sizes uniform in ``low..high``, then those
    parents likewise, up to one root (BFS numbering: root first, leaves last)."""
    gen = torch.Generator().manual_seed(seed)
    levels = [n]
    groups: List[torch.Tensor] = []
    while levels[-1] > 1:
        count = levels[-1]
        sizes = torch.randint(low, high + 1, (count // low + 1,), generator=gen)
        ends = torch.cumsum(sizes, 0)
        k = int(torch.searchsorted(ends, torch.tensor(count)).item()) + 1
        sizes = sizes[:k].clone()
        sizes[-1] -= int(ends[k - 1]) - count  # the last family takes the remainder
        if sizes[-1] < 1:
            sizes = sizes[:-1]
        groups.append(torch.repeat_interleave(torch.arange(sizes.numel()), sizes))
        levels.append(sizes.numel())
    # levels: [n, ..., 1] leaves first; number nodes root first
    offsets, total = [], 0
    for size in reversed(levels):
        offsets.append(total)
        total += size
    offsets.reverse()  # offsets[i] is the first index of level i (leaves = 0)
    parent = torch.full((total,), -1, dtype=torch.long)
    for i, group in enumerate(groups):
        parent[offsets[i]:offsets[i] + levels[i]] = offsets[i + 1] + group
    return parent


def forest_parents(num_trees: int, leaves: int) -> torch.Tensor:
    tree = torch.cat([torch.tensor([-1]), torch.zeros(leaves, dtype=torch.long)])
    offsets = torch.arange(num_trees).repeat_interleave(leaves + 1) * (leaves + 1)
    parent = tree.repeat(num_trees)
    return torch.where(parent >= 0, parent + offsets, -1)


# ------------------------------------------------------------------- operators
def floor(q, k, v, b: int):
    """SDPA inside consecutive families of ``b`` leaves (``N`` divisible by ``b``)."""
    n = q.shape[0]

    def fam(t):
        return t.view(n // b, b, H, t.shape[-1]).transpose(1, 2)

    return F.scaled_dot_product_attention(fam(q), fam(k), fam(v)).transpose(1, 2)


def flat(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1))


def make_peer():
    """HAttention1D's attention alone: identity projections, q, k, v concatenated."""
    from h_transformer_1d.h_transformer_1d import HAttention1D

    peer = HAttention1D(dim=H * D, heads=H, dim_head=D, block_size=16)
    peer.to_qkv = torch.nn.Identity()  # forward() chunks its output into q, k, v
    peer.to_out = torch.nn.Identity()
    return peer


# ------------------------------------------------------------------------ timing
def loadavg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def interleaved(fns: Dict[str, Callable[[], object]], repeats: int, warmup: int = 1
                ) -> Dict[str, List[float]]:
    """Time each function ``repeats`` times, round robin (same load for all)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name].append(timed(fn))
    return out


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def fwd_bwd(fn, *leaves):
    def run():
        for t in leaves:
            t.grad = None
        fn().sum().backward()
    return run


def med(times: List[float]) -> float:
    return statistics.median(times)


def ratio_of(a: List[float], b: List[float]) -> float:
    """Median of the per-repeat ratios of two interleaved series."""
    return statistics.median(x / y for x, y in zip(a, b))


def inputs(n: int, grad: bool = False):
    gen = torch.Generator().manual_seed(n)
    qkv = [torch.randn(n, H, D, generator=gen) for _ in range(3)]
    return [t.requires_grad_() for t in qkv] if grad else qkv


# ---------------------------------------------------------------------- workloads
def bench_balanced(n: int, repeats: int, with_flat: bool, with_bwd: bool) -> Dict:
    q, k, v = inputs(n)
    tree = hsa_graph.NestedSignal.from_parents(balanced_parents(n))
    peer = make_peer()
    x = torch.cat([q, k, v], -1).reshape(1, n, 3 * H * D)  # prepared once, not timed
    fns = {"hsa": no_grad(lambda: hsa_graph.hsa(q, k, v, tree)),
           "floor": no_grad(lambda: floor(q, k, v, 16)),
           "peer": no_grad(lambda: peer(x))}
    row: Dict[str, object] = {"N": n, "load_before": loadavg()}
    row["fwd"] = interleaved(fns, repeats)
    if with_flat:
        row["flat"] = interleaved({"flat": no_grad(lambda: flat(q, k, v))}, 1, warmup=0)
    if with_bwd:
        qg, kg, vg = inputs(n, grad=True)
        row["fwdbwd"] = interleaved({
            "hsa": fwd_bwd(lambda: hsa_graph.hsa(qg, kg, vg, tree), qg, kg, vg),
            "floor": fwd_bwd(lambda: floor(qg, kg, vg, 16), qg, kg, vg)}, repeats)
    row["load_after"] = loadavg()
    return row


def bench_shapes(repeats: int) -> Dict:
    """Ragged and forest trees against the balanced tree of the same N."""
    q, k, v = inputs(BIG)
    trees = {"balanced": balanced_parents(BIG), "ragged": ragged_parents(BIG),
             "forest": forest_parents(BIG // 16, 16)}
    trees = {name: hsa_graph.NestedSignal.from_parents(p) for name, p in trees.items()}
    out: Dict[str, object] = {"load_before": loadavg()}
    out["shapes"] = interleaved(
        {name: no_grad(lambda t=t: hsa_graph.hsa(q, k, v, t)) for name, t in trees.items()},
        repeats)
    out["ragged_families"] = trees["ragged"].structure.num_families
    out["ragged_buckets"] = len(trees["ragged"].structure.buckets)
    out["load_after"] = loadavg()
    return out


def bench_deep(repeats: int) -> Dict:
    """The caterpillar against its own floor, and what its depth costs."""
    out: Dict[str, object] = {"load_before": loadavg()}
    spine, per = 4096, 63
    deep = hsa_graph.NestedSignal.from_parents(caterpillar(spine, per))
    n = spine * per
    dq, dk, dv = inputs(n)
    out["deep_N"] = n
    out["deep_levels"] = deep.structure.max_depth + 2
    out["deep"] = interleaved({"hsa": no_grad(lambda: hsa_graph.hsa(dq, dk, dv, deep)),
                               "floor": no_grad(lambda: floor(dq, dk, dv, 64))}, repeats)
    # what depth costs: the same per-level passes on a tree with no attention work
    st = deep.structure
    small = torch.zeros(st.num_internal + 1, H)
    out["deep_path_sum_ms"] = med([timed(lambda: st.path_sum(small)) for _ in range(3)])
    out["deep_bottom_up_ms"] = med([timed(lambda: st.bottom_up(small)) for _ in range(3)])
    out["load_after"] = loadavg()
    return out


def peak_extra_bytes(fn: Callable[[], object]) -> Dict[str, float]:
    """Largest running total of bytes allocated minus freed during ``fn``, and the
    largest single allocation, from torch.profiler's CPU memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # the raw kineto events: FunctionEvent lists drop some allocations
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running = peak = biggest = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
        biggest = max(biggest, event.nbytes())
    return {"peak_extra": float(peak), "largest_allocation": float(biggest)}


def bench_memory(n: int) -> Dict:
    q, k, v = inputs(n)
    tree = hsa_graph.NestedSignal.from_parents(balanced_parents(n))
    assert tree.structure is not None  # built before, not counted
    no_grad(lambda: hsa_graph.hsa(q, k, v, tree))()
    qkv = 3 * q.numel() * q.element_size()
    result = {"N": n, "qkv_bytes": float(qkv)}
    result.update(peak_extra_bytes(no_grad(lambda: hsa_graph.hsa(q, k, v, tree))))
    floor_mem = peak_extra_bytes(no_grad(lambda: floor(q, k, v, 16)))
    result["floor_peak_extra"] = floor_mem["peak_extra"]
    return result


def bench_cache(n: int) -> Dict:
    """First and second call on a fresh tree; structure builds counted by a patch."""
    q, k, v = inputs(n)
    parent = balanced_parents(n)
    builds = []
    original = TreeStructure.from_parent.__func__

    def counting(cls, p):
        builds.append(1)
        return original(cls, p)

    TreeStructure.from_parent = classmethod(counting)
    try:
        tree = hsa_graph.NestedSignal.from_parents(parent)
        after_build = len(builds)
        with torch.no_grad():
            first = timed(lambda: hsa_graph.hsa(q, k, v, tree))
            after_first = len(builds)
            second = timed(lambda: hsa_graph.hsa(q, k, v, tree))
        after_second = len(builds)
    finally:
        TreeStructure.from_parent = classmethod(original)
    return {"N": n, "first_ms": first, "second_ms": second,
            "builds_at_construction": after_build,
            "builds_in_first_call": after_first - after_build,
            "builds_in_second_call": after_second - after_first}


def bench_structure(repeats: int) -> Dict:
    parent = balanced_1m(1_000_000)
    times = [timed(lambda: TreeStructure.from_parent(parent)) for _ in range(repeats)]
    return {"leaves": 1_000_000, "nodes": parent.numel(), "ms": times}


def bench_compile(n: int, repeats: int) -> Dict:
    import torch._dynamo

    q, k, v = inputs(n)
    tree = hsa_graph.NestedSignal.from_parents(balanced_parents(n))
    st = tree.structure
    result: Dict[str, object] = {"N": n}
    torch._dynamo.reset()
    explain = torch._dynamo.explain(lambda a, b, c: hsa_graph.hsa(a, b, c, st))(q, k, v)
    result["graph_breaks"] = explain.graph_break_count
    result["break_reasons"] = [str(b.reason)[:200] for b in explain.break_reasons]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda a, b, c: hsa_graph.hsa(a, b, c, st), fullgraph=True)
        with torch.no_grad():
            start = time.perf_counter()
            y = compiled(q, k, v)
            result["compile_s"] = time.perf_counter() - start
            ref = hsa_graph.hsa(q, k, v, st)
        result["max_abs_diff"] = float((y - ref).abs().max())
        times = interleaved({"eager": no_grad(lambda: hsa_graph.hsa(q, k, v, st)),
                             "compiled": no_grad(lambda: compiled(q, k, v))}, repeats)
        result["times"] = times
        result["fullgraph"] = True
    except Exception as exc:  # report, do not hide
        result["fullgraph"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return result


# ------------------------------------------------------------------------ report
def goal(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def report(res: Dict, meta: Dict) -> str:
    rows = {row["N"]: row for row in res["balanced"]}
    lines = [f"{meta['threads']} thread(s), torch {meta['torch']}, H = {H}, D = Dv = {D}, "
             f"float32, CPU; medians of {meta['repeats']} interleaved repeats, ms; load "
             f"average {meta['load_start']} at start, {meta['load_end']} at end "
             f"({meta['cpu_count']} cores).", "",
             "| N | hsa fwd | floor fwd | hsa/floor | peer fwd | peer/hsa | flat fwd "
             "| flat/hsa | hsa f+b | floor f+b | hsa/floor f+b |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    def num(value: Optional[float], digits: int = 0) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    for n, row in rows.items():
        f, fb = row["fwd"], row.get("fwdbwd")
        hsa_ms = med(f["hsa"])
        flat_ms = med(row["flat"]["flat"]) if "flat" in row else None
        cells = [str(n), num(hsa_ms, 1), num(med(f["floor"]), 1),
                 num(ratio_of(f["hsa"], f["floor"]), 2), num(med(f["peer"]), 1),
                 num(ratio_of(f["peer"], f["hsa"]), 2), num(flat_ms),
                 num(None if flat_ms is None else flat_ms / hsa_ms),
                 num(None if fb is None else med(fb["hsa"])),
                 num(None if fb is None else med(fb["floor"])),
                 num(None if fb is None else ratio_of(fb["hsa"], fb["floor"]), 2)]
        lines.append("| " + " | ".join(cells) + " |")
    big = rows.get(BIG)
    small = rows.get(min(rows))
    shapes = res.get("shapes")
    checks = []
    if big:
        r = ratio_of(big["fwd"]["hsa"], big["fwd"]["floor"])
        checks.append((f"forward <= 2.0x floor at N = {BIG}", f"{r:.2f}x", r <= 2.0))
        if "fwdbwd" in big:
            r = ratio_of(big["fwdbwd"]["hsa"], big["fwdbwd"]["floor"])
            checks.append((f"fwd+bwd <= 2.5x floor at N = {BIG}", f"{r:.2f}x", r <= 2.5))
    if 16384 in rows and "flat" in rows[16384]:
        r = med(rows[16384]["flat"]["flat"]) / med(rows[16384]["fwd"]["hsa"])
        checks.append(("flat / hsa >= 50 at N = 16384", f"{r:.0f}x", r >= 50))
    for n, row in rows.items():
        r = ratio_of(row["fwd"]["peer"], row["fwd"]["hsa"])
        checks.append((f"faster than the peer at N = {n}", f"peer/hsa = {r:.2f}", r > 1))
    if big and small and small is not big:
        r = med(big["fwd"]["hsa"]) / med(small["fwd"]["hsa"])
        checks.append((f"t({BIG}) / t({small['N']}) <= 20", f"{r:.1f}", r <= 20))
    if shapes and "shapes" in shapes:
        s = shapes["shapes"]
        for name in ("ragged", "forest"):
            r = ratio_of(s[name], s["balanced"])
            checks.append((f"{name} <= 1.5x balanced (N = {BIG})", f"{r:.2f}x "
                           f"({med(s[name]):.0f} vs {med(s['balanced']):.0f} ms)", r <= 1.5))
    if shapes and "deep" in shapes:
        dr = ratio_of(shapes["deep"]["hsa"], shapes["deep"]["floor"])
        checks.append((f"deep caterpillar <= 2.5x its floor (N = {shapes['deep_N']}, "
                       f"{shapes['deep_levels']} levels)",
                       f"{dr:.2f}x ({med(shapes['deep']['hsa']):.0f} vs "
                       f"{med(shapes['deep']['floor']):.0f} ms; one path_sum over its "
                       f"levels {shapes['deep_path_sum_ms']:.0f} ms, one bottom_up "
                       f"{shapes['deep_bottom_up_ms']:.0f} ms)", dr <= 2.5))
    mem = res.get("memory")
    if mem:
        r = mem["peak_extra"] / mem["qkv_bytes"]
        checks.append((f"extra peak memory <= 2x bytes(q+k+v) (N = {mem['N']})",
                       f"{r:.2f}x ({mem['peak_extra'] / 2**20:.0f} MiB vs "
                       f"{mem['qkv_bytes'] / 2**20:.0f} MiB; largest allocation "
                       f"{mem['largest_allocation'] / 2**20:.0f} MiB; floor "
                       f"{mem['floor_peak_extra'] / mem['qkv_bytes']:.2f}x)", r <= 2.0))
    cache = res.get("cache")
    if cache:
        checks.append((f"second call does no structure work (N = {cache['N']})",
                       f"builds: {cache['builds_at_construction']} at construction, "
                       f"{cache['builds_in_first_call']} in call 1, "
                       f"{cache['builds_in_second_call']} in call 2; "
                       f"{cache['first_ms']:.0f} / {cache['second_ms']:.0f} ms",
                       cache["builds_in_second_call"] == 0))
    struct = res.get("structure")
    if struct:
        t = med(struct["ms"]) / 1e3
        checks.append(("1,000,000-leaf structure builds in <= 2 s", f"{t:.2f} s", t <= 2.0))
    comp = res.get("compile")
    if comp:
        if comp.get("fullgraph"):
            t = comp["times"]
            r = ratio_of(t["compiled"], t["eager"])
            text = (f"fullgraph, {comp['graph_breaks']} graph breaks, compile "
                    f"{comp['compile_s']:.0f} s, compiled/eager {r:.2f} "
                    f"({med(t['compiled']):.1f} vs {med(t['eager']):.1f} ms), "
                    f"max |diff| {comp['max_abs_diff']:.1e}")
        else:
            text = (f"{comp['graph_breaks']} graph breaks; fullgraph failed: "
                    f"{comp.get('error')}")
        checks.append((f"torch.compile (N = {comp['N']})", text, bool(comp.get("fullgraph"))))
    lines += ["", "| goal | measured | |", "|---|---|:---:|"]
    lines += [f"| {name} | {value} | {goal(ok)} |" for name, value, ok in checks]
    return "\n".join(lines) + "\n"


def plot(res: Dict, meta: Dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["balanced"]
    ns = [row["N"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4.8), dpi=130)
    for key, label, color, marker in (("hsa", "hsa (this library)", "C0", "o"),
                                      ("floor", "floor: SDPA in leaf families", "C2", "^"),
                                      ("peer", "peer: HAttention1D (h-transformer-1d)",
                                       "C1", "s")):
        ax.plot(ns, [med(row["fwd"][key]) for row in rows], marker=marker, color=color,
                label=label)
    flat_pts = [(row["N"], med(row["flat"]["flat"])) for row in rows if "flat" in row]
    if flat_pts:
        xs, ys = zip(*flat_pts)
        ax.plot(xs, ys, "D", color="C3", label="flat SDPA over all N")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("N (leaves)")
    ax.set_ylabel("forward time (ms, median)")
    ax.set_title(f"Balanced 16-ary trees, H={H}, D={D}, float32, CPU, "
                 f"{meta['threads']} thread(s)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


WORKERS: Dict[str, Callable[..., Dict]] = {
    "balanced": bench_balanced, "shapes": bench_shapes, "deep": bench_deep,
    "memory": bench_memory, "cache": bench_cache, "structure": bench_structure,
    "compile": bench_compile}

#: opt-in glibc settings for the workers (``--malloc-env``; what users get is measured
#: without them): keep freed memory in the heap instead of returning it to the system
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}


def run_worker(name: str, threads: int, malloc_env: bool = False, **kwargs) -> Dict:
    """Run one workload in a fresh process (its memory is returned when it exits, so
    the big workloads never add up) and return its JSON result. The worker runs in
    this process's environment, plus :data:`MALLOC_ENV` only with ``malloc_env``."""
    env = {**MALLOC_ENV, **os.environ} if malloc_env else dict(os.environ)
    command = [sys.executable, str(Path(__file__).resolve()), "--threads", str(threads),
               "--worker", json.dumps({"name": name, "kwargs": kwargs})]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"workload {name} {kwargs} failed with exit code "
                           f"{proc.returncode}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["flat", "bwd", "shapes", "deep", "memory", "cache",
                                 "structure", "compile"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--malloc-env", action="store_true",
                        help="run the workers with glibc's MALLOC_MMAP_THRESHOLD_ and "
                             "MALLOC_TRIM_THRESHOLD_ raised (not what users get: figures "
                             "measured so are labelled and written to *_malloc files)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker is not None:  # one workload, result as JSON on the last line
        job = json.loads(args.worker)
        print(json.dumps(WORKERS[job["name"]](**job["kwargs"]), default=str))
        return 0
    if importlib.util.find_spec("h_transformer_1d") is None:  # before minutes of work
        parser.error("the peer of the goals, h-transformer-1d, is not installed: "
                     "pip install -e '.[bench]'")
    meta = {"threads": torch.get_num_threads(), "repeats": args.repeats,
            "torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "command": " ".join(sys.argv),
            "load_start": loadavg(),
            "env": {k: v for k, v in ({**MALLOC_ENV, **os.environ} if args.malloc_env
                                       else os.environ).items()
                    if k.startswith(("MALLOC_", "OMP_", "MKL_", "LD_"))}}
    res: Dict[str, object] = {"balanced": []}
    start = time.perf_counter()

    def step(name, worker, **kwargs):
        t0 = time.perf_counter()
        value = run_worker(worker, args.threads, args.malloc_env, **kwargs)
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return value

    for n in args.sizes:
        res["balanced"].append(step(
            f"balanced N={n}", "balanced", n=n, repeats=args.repeats,
            with_flat=n == 16384 and "flat" not in args.skip, with_bwd="bwd" not in args.skip))
    if "shapes" not in args.skip:
        res["shapes"] = step("ragged/forest", "shapes", repeats=args.repeats)
    if "deep" not in args.skip:
        res["shapes"] = {**res.get("shapes", {}),
                         **step("deep", "deep", repeats=args.repeats)}
    if "memory" not in args.skip:
        res["memory"] = step("memory", "memory", n=max(args.sizes))
    if "cache" not in args.skip:
        res["cache"] = step("cache", "cache", n=65536)
    if "structure" not in args.skip:
        res["structure"] = step("structure", "structure", repeats=3)
    if "compile" not in args.skip:
        res["compile"] = step("compile", "compile", n=1024, repeats=args.repeats)
    meta["load_end"] = loadavg()
    meta["total_s"] = time.perf_counter() - start
    table = report(res, meta)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{meta['threads']}t" + ("_malloc" if args.malloc_env else "")
    (args.out / f"bench_issue9{suffix}.md").write_text(
        f"# issue 9 figures\n\nCommand: `{meta['command']}`\n\n" + table)
    (args.out / f"bench_issue9{suffix}.json").write_text(
        json.dumps({"meta": meta, "results": res}, indent=1, default=str) + "\n")
    plot(res, meta, args.out / f"bench_issue9{suffix}.png")
    print(f"wrote {args.out}/bench_issue9{suffix}.md, .json, .png "
          f"({meta['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
