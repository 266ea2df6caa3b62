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


def fuzz_target(name: str, budget_s: float, base_seed: int, chunk: int) -> dict:
    strategy, run = TARGETS[name]
    stats = {"cases": 0, "refused": 0, "failures": 0, "max_case_s": 0.0, "chunks": 0,
             "first_failures": []}
    deadline = time.perf_counter() + budget_s

    def one(case):
        if time.perf_counter() > deadline:  # out of time: let the chunk run out idle
            return
        start = time.perf_counter()
        try:
            run(case)
        except Rejected:
            stats["refused"] += 1
        except Exception as error:  # noqa: BLE001 - every failure is recorded
            stats["failures"] += 1
            if len(stats["first_failures"]) < 5:
                stats["first_failures"].append({
                    "case": repr(case)[:500], "error": f"{type(error).__name__}: {error}"[:500],
                    "where": traceback.format_exc(limit=3)[-800:]})
        finally:
            stats["cases"] += 1
            stats["max_case_s"] = max(stats["max_case_s"], time.perf_counter() - start)

    while time.perf_counter() < deadline:
        test = seed(base_seed * 1_000_003 + stats["chunks"])(
            settings(max_examples=chunk, deadline=None, database=None, derandomize=False,
                     suppress_health_check=list(HealthCheck))(given(strategy())(one)))
        stats["chunks"] += 1
        test()
    stats["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=200, help="examples per hypothesis run")
    parser.add_argument("--targets", nargs="*", default=sorted(TARGETS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz.json"))
    args = parser.parse_args()
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; known: {sorted(TARGETS)}")
    torch.set_num_threads(args.threads)
    sys.setrecursionlimit(250)
    budget = args.minutes * 60 / len(args.targets)
    results = {}
    print(f"{'target':<18}{'cases':>8}{'refused':>9}{'failures':>10}{'max case s':>12}"
          f"{'peak RSS MB':>13}")
    for name in args.targets:
        stats = fuzz_target(name, budget, args.seed, args.chunk)
        results[name] = stats
        print(f"{name:<18}{stats['cases']:>8}{stats['refused']:>9}{stats['failures']:>10}"
              f"{stats['max_case_s']:>12.3f}{stats['peak_rss_mb']:>13.0f}", flush=True)
        for failure in stats["first_failures"]:
            print("  FAILURE", failure["error"], "\n  case:", failure["case"][:200])
    total = sum(s["cases"] for s in results.values())
    failures = sum(s["failures"] for s in results.values())
    print(f"total: {total} cases, {failures} failures in {args.minutes} min "
          f"(seed {args.seed}, {args.threads} thread(s))")
    record = {"minutes": args.minutes, "seed": args.seed, "chunk": args.chunk,
              "threads": args.threads, "python": platform.python_version(),
              "torch": torch.__version__, "machine": platform.machine(),
              "total_cases": total, "total_failures": failures, "targets": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
