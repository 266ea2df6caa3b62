"""Probe sets for ListOps: which part of a nested ``SM`` defeats the model?

On ListOps with every operator and nested arguments, the root ``SM`` (sum modulo 10)
stays at chance while ``MAX`` and ``MIN`` reach 0.8-0.9. Three explanations compete:
HSA weighs a nested argument by its number of leaves (a sum needs each argument once),
the value of a nested argument must be composed before it is summed, and ``SM`` shares
the model with three other operators. Each probe set isolates one of them; every
expression is ``[SM a_1 .. a_n ]`` with ``n`` in 2..6 arguments, each argument itself an
operator over digits:

* ``equal``: every argument is ``[MAX d d ]`` or ``[MIN d d ]`` (three leaves each), so
  the leaf count cannot matter;
* ``varied``: ``MAX`` or ``MIN`` over 2..6 digits (3..7 leaves), so a sum weighted by
  leaf count is wrong;
* ``mixed``: any of the four operators over 2..6 digits, so the arguments' values need
  ``MED`` and ``SM`` themselves.

Each set is written as ``OUT/<name>/basic_{train,val,test}.tsv`` in LRA's format (10,000
/ 500 / 1,000 distinct expressions, labels from :func:`~hsa_graph.datasets.listops.
evaluate_listops`), deterministic by ``--seed``; train on one with
``hsa-graph listops --data-dir OUT/<name> ...`` (``docs/figures/listops_probes.md``
has the commands and the results).

Run: ``python examples/listops_probes.py OUT [--seed 0]``
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from hsa_graph.datasets.listops import evaluate_listops, write_listops_tsv

PROBES: Dict[str, Tuple[Tuple[str, ...], int, int]] = {
    # name: (operators of the arguments, fewest and most digits per argument)
    "equal": (("MAX", "MIN"), 2, 2),
    "varied": (("MAX", "MIN"), 2, 6),
    "mixed": (("MAX", "MIN", "MED", "SM"), 2, 6),
}
SPLITS = (("train", 10_000), ("val", 500), ("test", 1_000))


def probe_examples(name: str, num_examples: int, seed: int = 0) -> List[Tuple[str, int]]:
    """``num_examples`` distinct ``(expression, label)`` pairs of the probe ``name``."""
    if name not in PROBES:
        raise ValueError(f"unknown probe {name!r}; choose from {tuple(PROBES)}")
    operators, low, high = PROBES[name]
    rng = np.random.default_rng(seed)
    seen: Dict[str, int] = {}
    while len(seen) < num_examples:
        args = []
        for _ in range(int(rng.integers(2, 7))):
            size = low if low == high else int(rng.integers(low, high + 1))
            op = operators[int(rng.integers(len(operators)))]
            digits = rng.integers(0, 10, size)
            args.append(f"[{op} " + " ".join(map(str, digits)) + " ]")
        expression = "[SM " + " ".join(args) + " ]"
        seen.setdefault(expression, evaluate_listops(expression))
    return list(seen.items())


def write_probes(out: Path, seed: int = 0) -> List[Path]:
    """Write every probe's three splits under ``out``; returns the files written."""
    written = []
    total = sum(n for _, n in SPLITS)
    for name in PROBES:
        rows = probe_examples(name, total, seed)
        start = 0
        for split, n in SPLITS:
            written.append(write_listops_tsv(out / name / f"basic_{split}.tsv",
                                             rows[start:start + n]))
            start += n
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the probe sets into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write_probes(args.out, args.seed):
        print(path)
