"""Long fuzzing run over the targets of tests/fuzz/targets.py (every builder, the
constructors, hsa against the dense reference, hsa_graph.io round trips).

    python benchmarks/fuzz.py --minutes 10 --seed 0

Each target gets an equal share of the time and runs hypothesis in chunks of
``--chunk`` examples with seeds derived from ``--seed``, so a run is reproducible
chunk by chunk. Printed and written to ``benchmarks/results/fuzz.json``: per target
the cases run, how many were refused with a documented error (``ValueError`` /
``TypeError``), failures (a wrong answer, an undocumented exception, a recursion
error: none expected), the slowest case and the process's peak resident memory after
the target. The recursion limit is lowered to 250 for the whole run.

Budgets turn super-linear behaviour into failures: a case of size ``s`` (the target's
``size(case)``: containers, characters, tensor elements) may take at most
``--case-base-s + --case-per-unit-us * s`` seconds, and may raise the process's peak
resident memory by at most ``--rss-base-mb + --rss-per-unit-kb * s``. A quadratic
path (a path string per leaf of a deep nesting, a rescan per token) blows through
both long before the largest cases.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "fuzz")]

import torch  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from targets import TARGETS, Rejected  # noqa: E402


class Budget:
    """Per-case limits that grow linearly with the case's size."""

    def __init__(self, base_s: float, per_unit_us: float, rss_base_mb: float,
                 rss_per_unit_kb: float):
        self.base_s, self.per_unit_s = base_s, per_unit_us * 1e-6
        self.rss_base_kb, self.rss_per_unit_kb = rss_base_mb * 1024, rss_per_unit_kb

    def time_s(self, size: int) -> float:
        return self.base_s + self.per_unit_s * size

    def rss_kb(self, size: int) -> float:
        return self.rss_base_kb + self.rss_per_unit_kb * size


def _peak_rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _short_repr(case) -> str:
    try:
        return repr(case)[:500]
    except RecursionError:  # a 20,000-deep nesting
        return f"<a {type(case).__name__} too deep to print>"


def fuzz_target(name: str, budget_s: float, base_seed: int, chunk: int,
                limits: Budget) -> dict:
    target = TARGETS[name]
    stats = {"cases": 0, "refused": 0, "failures": 0, "over_budget": 0, "max_case_s": 0.0,
             "max_size": 0, "max_rss_growth_mb": 0.0, "chunks": 0, "first_failures": []}
    deadline = time.perf_counter() + budget_s

    def fail(case, error: str, where: str) -> None:
        stats["failures"] += 1
        if len(stats["first_failures"]) < 5:
            stats["first_failures"].append({"case": _short_repr(case), "error": error[:500],
                                            "where": where[-800:]})

    def one(case):
        if time.perf_counter() > deadline:  # out of time: let the chunk run out idle
            return
        size = target.size(case)
        rss_before = _peak_rss_kb()
        start = time.perf_counter()
        try:
            target.run(case)
        except Rejected:
            stats["refused"] += 1
        except Exception as error:  # noqa: BLE001 - every failure is recorded
            fail(case, f"{type(error).__name__}: {error}", traceback.format_exc(limit=3))
        finally:
            took = time.perf_counter() - start
            growth = _peak_rss_kb() - rss_before
            stats["cases"] += 1
            stats["max_case_s"] = max(stats["max_case_s"], took)
            stats["max_size"] = max(stats["max_size"], size)
            stats["max_rss_growth_mb"] = max(stats["max_rss_growth_mb"], growth / 1024)
            if took > limits.time_s(size):
                stats["over_budget"] += 1
                fail(case, f"too slow: {took:.2f} s for a case of size {size} (budget "
                     f"{limits.time_s(size):.2f} s): super-linear?", "")
            if growth > limits.rss_kb(size):
                stats["over_budget"] += 1
                fail(case, f"peak RSS grew by {growth / 1024:.0f} MB for a case of size "
                     f"{size} (budget {limits.rss_kb(size) / 1024:.0f} MB): super-linear?", "")

    while time.perf_counter() < deadline:
        test = seed(base_seed * 1_000_003 + stats["chunks"])(
            settings(max_examples=chunk, deadline=None, database=None, derandomize=False,
                     suppress_health_check=list(HealthCheck))(given(target.strategy())(one)))
        stats["chunks"] += 1
        test()
    stats["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=200, help="examples per hypothesis run")
    parser.add_argument("--targets", nargs="*", default=sorted(TARGETS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--case-base-s", type=float, default=5.0,
                        help="time budget of a case of size 0")
    parser.add_argument("--case-per-unit-us", type=float, default=20.0,
                        help="extra time budget per unit of case size (microseconds)")
    parser.add_argument("--rss-base-mb", type=float, default=128.0,
                        help="peak-RSS growth allowed for a case of size 0")
    parser.add_argument("--rss-per-unit-kb", type=float, default=1.0,
                        help="extra peak-RSS growth allowed per unit of case size")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz.json"))
    args = parser.parse_args()
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; known: {sorted(TARGETS)}")
    torch.set_num_threads(args.threads)
    sys.setrecursionlimit(250)
    budget = args.minutes * 60 / len(args.targets)
    limits = Budget(args.case_base_s, args.case_per_unit_us, args.rss_base_mb,
                    args.rss_per_unit_kb)
    results = {}
    print(f"{'target':<22}{'cases':>8}{'refused':>9}{'failures':>10}{'over budget':>13}"
          f"{'max case s':>12}{'max size':>10}{'peak RSS MB':>13}")
    for name in args.targets:
        stats = fuzz_target(name, budget, args.seed, args.chunk, limits)
        results[name] = stats
        print(f"{name:<22}{stats['cases']:>8}{stats['refused']:>9}{stats['failures']:>10}"
              f"{stats['over_budget']:>13}{stats['max_case_s']:>12.3f}{stats['max_size']:>10}"
              f"{stats['peak_rss_mb']:>13.0f}", flush=True)
        for failure in stats["first_failures"]:
            print("  FAILURE", failure["error"], "\n  case:", failure["case"][:200])
    total = sum(s["cases"] for s in results.values())
    failures = sum(s["failures"] for s in results.values())
    print(f"total: {total} cases, {failures} failures in {args.minutes} min "
          f"(seed {args.seed}, {args.threads} thread(s))")
    record = {"minutes": args.minutes, "seed": args.seed, "chunk": args.chunk,
              "budget": {"case_base_s": args.case_base_s,
                         "case_per_unit_us": args.case_per_unit_us,
                         "rss_base_mb": args.rss_base_mb,
                         "rss_per_unit_kb": args.rss_per_unit_kb},
              "threads": args.threads, "python": platform.python_version(),
              "torch": torch.__version__, "machine": platform.machine(),
              "total_cases": total, "total_failures": failures, "targets": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
