"""ListOps with every operator's value supervised: does a nested ``SM`` become learnable?

On ListOps the root ``SM`` (sum modulo 10) stays at chance once its arguments nest and
are drawn from all four operators (``examples/listops_probes.py``). A sum modulo 10 is
wrong unless every argument's value is exact, so the root label alone says nothing about
any one nested value until all of them are right. This script tests that reading: it
trains the ListOps model of ``hsa-graph listops`` (HSA on the parse tree, pre-norm
blocks, mean read-out) with, next to the root's loss, ``--weight`` times the loss of
the same read-out applied to every nested operator's subtree (the mean of its leaves'
outputs, which is what its parent's attention sees of it) against that operator's value.
The values come from the expression itself (:func:`~hsa_graph.datasets.listops.
parse_listops`); LRA's protocol uses the root label only, so figures with
``--weight > 0`` are not comparable to it. ``--weight 0`` is the plain model, trained
by the same loop.

Data: LRA-format files (``--data-dir``, ``basic_{train,val,test}.tsv``, e.g. a probe set)
or ListOps regenerated at the ``--quick`` settings of ``hsa-graph listops`` (10,000 /
500 / 1,000 expressions, ``--max-depth``). Prints the validation accuracy per epoch and
the test accuracy (overall and by root operator) of the best validation epoch, and
writes them as JSON to ``--out``.

Run: ``python examples/listops_node_supervision.py --data-dir probes/mixed --weight 1``
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch_geometric.data import Batch

from hsa_graph.datasets.listops import (
    CLOSE,
    generate_listops_splits,
    listops_tree,
    parse_listops,
    read_listops_tsv,
)
from hsa_graph.experiments.listops import QUICK, ListOpsConfig, accuracy_breakdown, build_model
from hsa_graph.nn import global_leaf_pool, subtree_pool


def supervised_tree(expression: str):
    """The parse tree of ``expression`` with ``operator_index`` (``[K]``, the node index
    of every nested operator: every internal node but the root) and ``operator_y``
    (``[K]``, their values)."""
    parsed = parse_listops(expression)
    tree = listops_tree(parsed)
    del tree.depth
    is_op = (parsed.tokens >= 10) & (parsed.tokens < CLOSE)
    has_children = torch.zeros(tree.num_nodes, dtype=torch.bool)
    has_children[tree.parent[tree.parent >= 0]] = True
    # internal nodes are numbered in token order, one per operator token
    internal = has_children.nonzero().flatten()
    values = torch.from_numpy(parsed.values[is_op].astype(np.int64))
    tree.operator_index = internal[1:]
    tree.operator_y = values[1:]
    return tree


def settings(args: argparse.Namespace) -> ListOpsConfig:
    """The ``hsa-graph listops --quick`` settings of the runs this script compares with
    (10,000 / 500 / 1,000 expressions, width 64, pre-norm, lr 1e-3)."""
    return ListOpsConfig(**{**QUICK, "num_train": 10_000, "num_val": 500, "num_test": 1_000,
                            "max_depth": args.max_depth, "channels": 64, "lr": 1e-3,
                            "layer": "pre_norm", "data_dir": args.data_dir})


def load(config: ListOpsConfig) -> Dict[str, List[Tuple[str, int]]]:
    if config.data_dir:
        return {s: read_listops_tsv(Path(config.data_dir) / f"basic_{s}.tsv")
                for s in ("train", "val", "test")}
    return generate_listops_splits(
        config.num_train, config.num_val, config.num_test, seed=config.data_seed,
        max_depth=config.max_depth, max_args=config.max_args, min_length=config.min_length,
        max_length=config.max_length)


def accuracy(model, trees: Sequence, rows: Sequence[Tuple[str, int]]) -> Dict[str, float]:
    """Accuracy, overall and by root operator (:func:`accuracy_breakdown`)."""
    by_operator = accuracy_breakdown(model, trees, rows, batch_size=64)["by_operator"]
    total = sum(g["n"] for g in by_operator.values())
    out = {"all": sum(g["accuracy"] * g["n"] for g in by_operator.values()) / total}
    out.update({op: g["accuracy"] for op, g in by_operator.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="LRA-format basic_{train,val,test}.tsv")
    parser.add_argument("--max-depth", type=int, default=4, help="regenerated data only")
    parser.add_argument("--weight", type=float, default=1.0,
                        help="weight of the nested operators' loss (0: the plain model)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("node_supervision.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = settings(args)
    config.validate()
    splits = load(config)
    trees = {s: [supervised_tree(e) for e, _ in rows] for s, rows in splits.items()}
    torch.manual_seed(args.seed)
    model = build_model("hsa-tree", **config.model_spec())
    readout = model.classifier
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    history, best, best_state, start = [], -1.0, None, time.time()
    for epoch in range(args.epochs):
        order = torch.randperm(len(trees["train"]),
                               generator=torch.Generator().manual_seed(args.seed + epoch))
        for i in range(0, len(order), config.batch_size):
            batch = Batch.from_data_list([trees["train"][j]
                                          for j in order[i:i + config.batch_size]])
            h = readout.encode(model.embedding(batch.x), batch)
            loss = F.cross_entropy(readout.mlp(global_leaf_pool(h, batch)), batch.y)
            if args.weight:
                nested = readout.mlp(subtree_pool(h, batch, batch.operator_index))
                loss = loss + args.weight * F.cross_entropy(nested, batch.operator_y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val = accuracy(model, trees["val"], splits["val"])["all"]
        history.append({"epoch": epoch + 1, "val_accuracy": round(val, 4),
                        "seconds": round(time.time() - start, 1)})
        print(history[-1], flush=True)
        if val > best:
            best, best_state = val, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    test = accuracy(model, trees["test"], splits["test"])
    result = {"command": "python examples/listops_node_supervision.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "test_accuracy": test, "best_epoch": max(history, key=lambda r: r["val_accuracy"])
        ["epoch"], "history": history}
    args.out.write_text(json.dumps(result, indent=1))
    print("test accuracy", {k: round(v, 3) for k, v in test.items()})


if __name__ == "__main__":
    main()
