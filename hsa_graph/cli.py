r"""The ``hsa-graph`` command line (also ``python -m hsa_graph``).

Subcommands::

    hsa-graph sentiment ...     # HSA vs flat attention vs DeepSet on Pang & Lee reviews
    hsa-graph multimodal ...    # the same on image + text emoji trees
    hsa-graph listops ...       # ListOps from scratch: HSA on the parse tree vs baselines
    hsa-graph zero-shot ...     # pre-trained MiniLM with its attention made hierarchical
    hsa-graph train ...         # train and test one text classifier on your own data
    hsa-graph bench NAME ...    # run benchmarks/bench_NAME.py of a source checkout

``hsa-graph COMMAND --help`` explains every option of a command. The experiment
commands come from modules with an ``add_arguments(parser)`` / ``run(args) -> dict``
pair, imported only when their command runs (so ``hsa-graph --help`` is fast and the
other commands work when one module's dependencies are missing).

``train`` is the command to launch on several processes::

    torchrun --nproc_per_node 2 -m hsa_graph train --data pang-lee --out runs/pl

(:func:`~hsa_graph.experiments.train.fit` joins the process group, uses
``DistributedDataParallel`` and a ``DistributedSampler``; rank 0 writes checkpoints
and results).
"""
from __future__ import annotations

import argparse
import csv
import importlib
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["COMMANDS", "benchmark_dir", "build_parser", "main", "show_progress"]

#: Experiment commands: name -> (module with add_arguments/run, one-line help).
COMMANDS: Dict[str, Tuple[str, str]] = {
    "sentiment": ("hsa_graph.experiments.sentiment",
                  "hierarchical sentiment on the Pang & Lee reviews: HSA vs flat attention vs "
                  "DeepSet (the paper's Table 1 analogue)"),
    "multimodal": ("hsa_graph.experiments.multimodal",
                   "image-text matching of emoji as key-value trees (any single modality "
                   "is at chance): HSA vs flat attention vs DeepSet (the paper's "
                   "Table 2 analogue)"),
    "listops": ("hsa_graph.experiments.listops",
                "ListOps (regenerated Long Range Arena data) from scratch: HSA on the parse "
                "tree vs hopping windows vs flat attention vs H-Transformer-1D vs DeepSet; "
                "'listops evaluate' scores a checkpoint on a TSV file"),
    "zero-shot": ("hsa_graph.pretrained.zero_shot",
                  "zero-shot evaluation of the pre-trained MiniLM with hierarchical "
                  "attention"),
}

_EXTRAS = {"transformers": "hf", "tokenizers": "text", "safetensors": "hf", "tqdm": "experiments",
           "scipy": "test"}


def show_progress(no_progress: bool = False) -> bool:
    """Whether a command shows tqdm progress bars: not with ``--no-progress``, and by
    default only when stderr is a terminal (a redirected log would fill with bars).

    Args:
        no_progress: the ``--no-progress`` flag.

    Returns:
        ``True`` when bars should be drawn.

    Example:
        >>> show_progress(no_progress=True)
        False
    """
    if no_progress:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


# ------------------------------------------------------------------ bench
def benchmark_dir() -> Path:
    """The ``benchmarks`` folder of the source checkout this package runs from.

    Raises:
        FileNotFoundError: the package is not run from a checkout (e.g. installed from
            a wheel), so there are no benchmark scripts.
    """
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    if not root.is_dir() or not any(root.glob("bench_*.py")):
        raise FileNotFoundError(
            f"no benchmark scripts at {root}: 'hsa-graph bench' runs the scripts of a source "
            f"checkout; clone the repository and install it with 'pip install -e .'")
    return root


def _benchmarks() -> Dict[str, Path]:
    return {p.stem[len("bench_"):]: p for p in sorted(benchmark_dir().glob("bench_*.py"))}


def _run_bench(args: argparse.Namespace) -> int:
    scripts = _benchmarks()
    if args.list or args.name is None:
        for name, path in scripts.items():
            parts = path.read_text().split('"""')
            doc = parts[1].strip().splitlines()[0] if len(parts) > 2 else ""
            print(f"{name:12s} {doc}")
        if args.name is None and not args.list:
            print("\nhsa-graph bench: error: name a benchmark (see above)", file=sys.stderr)
            return 2
        return 0
    if args.name not in scripts:
        raise ValueError(f"no benchmark {args.name!r}; available: {', '.join(scripts)}")
    path = scripts[args.name]
    saved_argv, saved_path = sys.argv, list(sys.path)
    # the script runs as if started with python benchmarks/bench_NAME.py ARGS
    sys.argv = [str(path), *args.args]
    sys.path.insert(0, str(path.parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


# ------------------------------------------------------------------ train
def _read_table(path: Path, text_column: str, label_column: str) -> List[Tuple[str, str]]:
    """``(text, label)`` rows of a CSV, TSV or JSON-lines file."""
    if not path.is_file():
        raise FileNotFoundError(f"--data: no file {path}")
    suffix = path.suffix.lower()
    with open(path, newline="", encoding="utf-8-sig") as handle:
        if suffix in (".jsonl", ".ndjson"):
            records = []
            for line_no, line in enumerate(handle, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise ValueError(f"--data {path}, line {line_no}: not JSON: "
                                         f"{error}") from None
        elif suffix in (".csv", ".tsv"):
            records = list(csv.DictReader(handle, delimiter="\t" if suffix == ".tsv" else ","))
        else:
            raise ValueError(f"--data {path}: expected a .csv, .tsv or .jsonl file")
    rows = []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or text_column not in record or \
                label_column not in record:
            raise ValueError(f"--data {path}: record {i} lacks the columns {text_column!r} "
                             f"and {label_column!r} (set --text-column / --label-column)")
        text = record[text_column]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"--data {path}: record {i} has no text")
        rows.append((text, str(record[label_column])))
    if not rows:
        raise ValueError(f"--data {path}: no records")
    return rows


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from .experiments.train import SELECT_METRICS

    data = parser.add_argument_group("data")
    data.add_argument("--data", required=True,
                      help="'pang-lee' (the 1,500 Pang & Lee movie reviews, fetched on first "
                           "use) or a .csv/.tsv/.jsonl file with a text and a label column; "
                           "each line of a text is one sentence, blank lines separate "
                           "paragraphs")
    data.add_argument("--text-column", default="text", help="text column (default: text)")
    data.add_argument("--label-column", default="label",
                      help="label column (default: label); any values, one class each")
    data.add_argument("--embedding", choices=("static", "contextual"), default="static",
                      help="MiniLM token vectors: its input embeddings (static) or its "
                           "outputs per sentence (contextual; computed once, cached); "
                           "default static")
    data.add_argument("--max-tokens", type=int, default=None,
                      help="keep each text's first sentences up to this many word pieces "
                           "(default: whole texts)")
    data.add_argument("--test-fraction", type=float, default=0.2,
                      help="held-out test share, stratified, fixed by --split-seed; never "
                           "used for model selection (default 0.2)")
    data.add_argument("--val-fraction", type=float, default=0.1,
                      help="validation share of the rest, used to pick the best epoch "
                           "(default 0.1)")
    data.add_argument("--split-seed", type=int, default=0, help="seed of the splits (0)")
    data.add_argument("--cache-dir", default=None,
                      help="corpus and embedding cache (default $HSA_GRAPH_CACHE or "
                           "~/.cache/hsa_graph)")
    model = parser.add_argument_group("model (hsa_graph.nn.TreeClassifier)")
    model.add_argument("--attention", choices=("hierarchical", "flat", "none"),
                       default="hierarchical",
                       help="hierarchical = HSA, flat = softmax attention over all tokens, "
                            "none = DeepSet (default hierarchical)")
    model.add_argument("--channels", type=int, default=128, help="attention width (128)")
    model.add_argument("--heads", type=int, default=3, help="attention heads (3)")
    model.add_argument("--hidden", type=int, default=128, help="MLP hidden size (128)")
    model.add_argument("--dropout", type=float, default=0.1, help="dropout (0.1)")
    train = parser.add_argument_group("training (hsa_graph.experiments.train.fit)")
    train.add_argument("--epochs", type=int, default=10, help="epochs (10)")
    train.add_argument("--batch-size", type=int, default=32,
                       help="global batch size, split over torchrun processes (32)")
    train.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    train.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay "
                       "(0.01)")
    train.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                       help="the learning rate over the steps: constant, or a half cosine "
                       "from --lr down to --min-lr (constant)")
    train.add_argument("--min-lr", type=float, default=0.0,
                       help="where the cosine schedule ends (0)")
    train.add_argument("--warmup-steps", type=int, default=0,
                       help="steps of linear warm-up to --lr (0)")
    train.add_argument("--grad-clip", type=float, default=1.0,
                       help="gradient norm clipping; 0 = off (1.0)")
    train.add_argument("--seed", type=int, default=0,
                       help="seed of the initialisation, the shuffling and the validation "
                            "split (0)")
    train.add_argument("--select-metric", choices=tuple(SELECT_METRICS), default="accuracy",
                       help="validation metric that picks the best epoch (accuracy)")
    train.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    train.add_argument("--checkpoint-dir", default=None,
                       help="write last.pt every epoch and best.pt on the best validation "
                            "metric here (default: <out>/checkpoints)")
    train.add_argument("--resume", action="store_true",
                       help="continue from <checkpoint-dir>/last.pt")
    parser.add_argument("--out", default="results/train",
                        help="output folder: results.json, results.md, learning curves "
                             "(default results/train)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (shown by default only when stderr is a "
                             "terminal, so redirected logs stay short)")


def _run_train(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    from .experiments.report import write_report
    from .experiments.sentiment import build_review_trees, split_indices
    from .experiments.train import TrainConfig, evaluate, fit, init_distributed
    from .nn.classifier import TreeClassifier

    for name in ("test_fraction", "val_fraction"):
        value = getattr(args, name)
        if not 0 < value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must lie in (0, 1), got {value}")
    if args.data == "pang-lee":
        from .datasets.pang_lee import load_pang_lee_reviews

        rows = [(text, ["negative", "positive"][label])
                for text, label in load_pang_lee_reviews(args.cache_dir)]
    else:
        rows = _read_table(Path(args.data), args.text_column, args.label_column)
    classes = sorted({label for _, label in rows})
    if len(classes) < 2:
        raise ValueError(f"--data: need at least two classes, found {classes}")
    index = {label: i for i, label in enumerate(classes)}
    labels = torch.tensor([index[label] for _, label in rows])
    rank, world = init_distributed(args.device)
    progress = show_progress(args.no_progress) and rank == 0
    trees = build_review_trees([(text, index[label]) for text, label in rows], args.embedding,
                               max_tokens=args.max_tokens, cache_dir=args.cache_dir,
                               progress=progress)
    train_idx, val_idx, test_idx = split_indices(labels, args.test_fraction, args.val_fraction,
                                                 args.split_seed, args.seed)
    if min(train_idx.numel(), val_idx.numel(), test_idx.numel()) == 0:
        raise ValueError(f"--data: {len(rows)} examples leave an empty split (train "
                         f"{train_idx.numel()}, val {val_idx.numel()}, test "
                         f"{test_idx.numel()}); use more data or larger fractions")
    train, val, test = ([trees[i] for i in idx.tolist()]
                        for idx in (train_idx, val_idx, test_idx))
    torch.manual_seed(args.seed)
    model = TreeClassifier(trees[0].x.shape[1], len(classes), args.channels, args.heads,
                           hidden_channels=args.hidden, attention=args.attention,
                           dropout=args.dropout)
    out = Path(args.out)
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                         weight_decay=args.weight_decay, lr_schedule=args.lr_schedule,
                         min_lr=args.min_lr, warmup_steps=args.warmup_steps, seed=args.seed,
                         grad_clip=args.grad_clip or None, device=args.device,
                         checkpoint_dir=args.checkpoint_dir or out / "checkpoints",
                         resume=args.resume, select_metric=args.select_metric,
                         progress=progress)
    start = time.perf_counter()
    result = fit(model, train, val, config)
    test_metrics = evaluate(model, test, batch_size=args.batch_size, device=args.device)
    label = {"hierarchical": "HSA", "flat": "FSA", "none": "DeepSet"}[args.attention]
    results = {
        "title": f"{label} on {args.data} ({args.embedding} embeddings)",
        "command": "hsa-graph train " + " ".join(args.argv),
        "classes": classes, "sizes": {"train": len(train), "val": len(val), "test": len(test)},
        "processes": world, "config": config.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - start, "best_epoch": result["best_epoch"],
        "val": result["best"], "test": test_metrics,
        "runs": [{"model": label, "history": result["history"]}],
        "summary": [{"model": label, "embedding": args.embedding,
                     "accuracy": test_metrics["accuracy"], "macro_f1": test_metrics["macro_f1"],
                     "test examples": test_metrics["n"], "best epoch": result["best_epoch"],
                     "s / epoch": sum(h["seconds"] for h in result["history"])
                     / max(1, len(result["history"]))}],
    }
    if rank == 0:
        written = write_report(results, out)
        print(f"test accuracy {test_metrics['accuracy']:.4f}, macro F1 "
              f"{test_metrics['macro_f1']:.4f} ({test_metrics['n']} examples); wrote "
              + ", ".join(str(p) for p in written))
    return results


# ------------------------------------------------------------------ parser
def _import(command: str):
    module_name = COMMANDS[command][0]
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        missing = getattr(error, "name", None) or ""
        if missing and (missing == module_name or module_name.startswith(missing + ".")):
            raise ImportError(f"'hsa-graph {command}' needs {module_name}, which this "
                              f"installation of hsa_graph does not have") from error
        extra = _EXTRAS.get(missing.split(".")[0])
        hint = (f": pip install {missing.split('.')[0]}" + (f" (or hsa_graph[{extra}])"
                                                             if extra else "")) if missing else ""
        raise ImportError(f"'hsa-graph {command}' cannot import {module_name}: {error}"
                          f"{hint}") from error


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The ``hsa-graph`` parser; the options of ``command`` (if given) are added, which
    imports that command's module.

    Example:
        >>> parser = build_parser("bench")
        >>> parser.parse_args(["bench", "hsa", "--quick"]).args
        ['--quick']
    """
    from . import __version__

    # allow_abbrev=False everywhere: a prefix must never stand for another option
    # (``--seed`` silently meant ``--seeds`` where both prefixes exist)
    parser = argparse.ArgumentParser(
        prog="hsa-graph", allow_abbrev=False,
        description="Hierarchical Self-Attention on nested signals: experiments, training and "
        "benchmarks.",
        epilog="'hsa-graph COMMAND --help' lists the options of a command. Results go to "
               "the command's output folder as JSON, a Markdown table and plots.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, allow_abbrev=False)
        if name == command:
            module = _import(name)
            p.description = (module.__doc__ or text).strip().split("\n\n")[0]
            module.add_arguments(p)
    p = sub.add_parser(
        "train", allow_abbrev=False,
        help="train and test one text classifier (HSA, flat attention or DeepSet) on the "
        "Pang & Lee reviews or your own CSV/TSV/JSONL; runs under torchrun",
        description="Train a TreeClassifier on text trees (document -> paragraphs -> "
        "sentences -> MiniLM word pieces), pick the best epoch on a validation split and "
        "score it on a held-out test split. Under 'torchrun --nproc_per_node W -m hsa_graph "
        "train ...' the W processes train one model with DistributedDataParallel.")
    if command == "train":
        _add_train_arguments(p)
    try:
        names = ", ".join(_benchmarks())
    except FileNotFoundError:
        names = "none: not a source checkout"
    p = sub.add_parser("bench", allow_abbrev=False,
                       help="run a benchmark script of the source checkout "
                       "(benchmarks/bench_NAME.py)",
                       description="Run benchmarks/bench_NAME.py of the source checkout with "
                       f"the remaining arguments. Available: {names}. 'hsa-graph bench NAME "
                       "--help' shows a benchmark's own options.")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("name", nargs="?", help="benchmark name (bench_NAME.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark script")
    return parser


def _command_of(argv: Sequence[str]) -> Optional[str]:
    names = (*COMMANDS, "train", "bench")
    for token in argv:
        if not token.startswith("-"):
            return token if token in names else None
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``hsa-graph`` with ``argv`` (default ``sys.argv[1:]``); return the exit
    status (0 success, 1 an error of the inputs or environment, 2 bad usage, 130
    interrupted).

    Example:
        >>> main(["train", "--data", "no-such-file.csv"])   # the message goes to stderr
        1
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    try:
        try:
            parser = build_parser(command)
        except ImportError as error:
            print(f"hsa-graph: error: {error}", file=sys.stderr)
            return 1
        args = parser.parse_args(argv)
        args.argv = argv[argv.index(args.command) + 1:]
        if args.command == "bench":
            return _run_bench(args)
        if args.command == "train":
            _run_train(args)
        else:
            _import(args.command).run(args)
        return 0
    except SystemExit as done:  # argparse: --help, --version, usage errors
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
    except KeyboardInterrupt:
        print("hsa-graph: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, ImportError) as error:  # OSError: a bad path (--out, ...)
        print(f"hsa-graph {command or ''}: error: {error}".replace("  ", " "),
              file=sys.stderr)
        return 1
    finally:
        _leave_process_group()


def _leave_process_group() -> None:
    dist = sys.modules.get("torch.distributed")  # not imported: nothing to leave
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
