"""The hsa-graph command line: help of every option, the train command on real
sentences (results, checkpoints, resume), bench, and clear errors."""
import argparse
import csv
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsa_graph import cli
from hsa_graph.cli import COMMANDS, build_parser, main


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _importable(command):
    try:
        importlib.import_module(COMMANDS[command][0])
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("command", [*COMMANDS, "train", "bench"])
def test_every_option_is_explained(command, capsys):
    if command in COMMANDS and not _importable(command):
        # the module is missing here: the command says so instead of crashing
        assert main([command, "--help"]) == 1
        assert COMMANDS[command][0] in capsys.readouterr().err
        return
    parser = _subparsers(build_parser(command))[command]
    for action in parser._actions:
        assert action.help and action.help.strip(), (command, action.option_strings)
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hsa-graph {command}")
    for action in parser._actions:
        for option in action.option_strings:
            assert option in out


def test_top_level_help_and_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in (*COMMANDS, "train", "bench"):
        assert f"    {command}" in out
    assert main([]) == 2                                  # a command is required
    assert "COMMAND" in capsys.readouterr().err
    assert main(["nonsense"]) == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "hsa_graph", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "hsa-graph 0.1.0")


@pytest.fixture(scope="module")
def sentences_csv(tmp_path_factory):
    """40 real Pang & Lee sentences (20 per class) as a CSV with string labels."""
    from network_data import pang_lee_sentences as load_pang_lee_sentences

    sentences = load_pang_lee_sentences()
    pos = [t for t, label in sentences if label == 1][:20]
    neg = [t for t, label in sentences if label == 0][:20]
    path = tmp_path_factory.mktemp("data") / "sentences.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["review", "sentiment"])
        for p, n in zip(pos, neg):
            writer.writerows([[p, "pos"], [n, "neg"]])
    return path


def _train(csv_path, out, *extra):
    return main(["train", "--data", str(csv_path), "--text-column", "review",
                 "--label-column", "sentiment", "--batch-size", "8", "--channels", "12",
                 "--hidden", "8", "--dropout", "0", "--lr", "0.01", "--no-progress",
                 "--out", str(out), *extra])


def test_train_command(sentences_csv, tmp_path, capsys):
    from hsa_graph.experiments.sentiment import build_review_trees, split_indices
    from hsa_graph.experiments.train import evaluate, load_checkpoint
    from hsa_graph.nn.classifier import TreeClassifier

    assert _train(sentences_csv, tmp_path / "a", "--epochs", "3") == 0
    assert "test accuracy" in capsys.readouterr().out
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["classes"] == ["neg", "pos"]
    assert len(results["runs"][0]["history"]) == 3
    assert results["command"].startswith("hsa-graph train --data")
    assert (tmp_path / "a" / "results.md").read_text().startswith("# HSA on ")
    # the reported test metrics are those of best.pt's weights on the held-out split
    rows = list(csv.DictReader(open(sentences_csv)))
    labels = torch.tensor([int(r["sentiment"] == "pos") for r in rows])
    trees = build_review_trees([(r["review"], int(y)) for r, y in zip(rows, labels)],
                               "static")
    splits = split_indices(labels, 0.2, 0.1, 0, 0)           # the documented defaults
    assert results["sizes"] == {"train": splits[0].numel(), "val": splits[1].numel(),
                                "test": 8}
    test = [trees[i] for i in splits[2].tolist()]
    model = TreeClassifier(384, 2, 12, 3, hidden_channels=8, dropout=0.0)
    best = load_checkpoint(tmp_path / "a" / "checkpoints" / "best.pt")
    model.load_state_dict(best["model"])
    assert best["epoch"] == results["best_epoch"]
    assert evaluate(model, test) == pytest.approx(results["test"])

    # 2 epochs, then resumed to 3: the same run
    assert _train(sentences_csv, tmp_path / "b", "--epochs", "2") == 0
    assert _train(sentences_csv, tmp_path / "b", "--epochs", "3", "--resume") == 0
    resumed = json.loads((tmp_path / "b" / "results.json").read_text())
    for a, b in zip(resumed["runs"][0]["history"], results["runs"][0]["history"]):
        a.pop("seconds"), b.pop("seconds")
        assert a == pytest.approx(b)
    assert resumed["test"] == pytest.approx(results["test"])


def test_train_command_schedule(sentences_csv, tmp_path, capsys):
    assert _train(sentences_csv, tmp_path, "--epochs", "2", "--lr-schedule", "cosine",
                  "--min-lr", "0.001", "--warmup-steps", "1") == 0
    results = json.loads((tmp_path / "results.json").read_text())
    config = results["config"]
    assert (config["lr_schedule"], config["min_lr"], config["warmup_steps"]) == (
        "cosine", 0.001, 1)
    history = results["runs"][0]["history"]
    assert history[-1]["lr"] == pytest.approx(0.001) and history[0]["lr"] > 0.001
    assert _train(sentences_csv, tmp_path, "--min-lr", "0.1") == 1      # above --lr 0.01
    assert "min_lr (0.1) must not exceed lr (0.01)" in capsys.readouterr().err
    assert _train(sentences_csv, tmp_path, "--lr-sched", "cosine") == 2  # no abbreviations
    assert "unrecognized arguments: --lr-sched" in capsys.readouterr().err


def test_every_lr_schedule_flag_offers_the_trainers_schedules():
    """The parsers spell the schedules out (so that building them imports no torch
    module); they must stay the trainer's."""
    from hsa_graph.cli import build_parser
    from hsa_graph.experiments.train import LR_SCHEDULES

    for command in ("train", "listops"):
        parser = build_parser(command)
        actions = [a for sub in parser._subparsers._group_actions
                   for p in sub.choices.values() for a in p._actions
                   if "--lr-schedule" in a.option_strings]
        assert actions and all(tuple(a.choices) == LR_SCHEDULES for a in actions), command


def test_train_command_errors(sentences_csv, tmp_path, capsys):
    assert _train(tmp_path / "missing.csv", tmp_path) == 1
    assert "no file" in capsys.readouterr().err
    assert main(["train", "--data", str(sentences_csv), "--out", str(tmp_path)]) == 1
    assert "lacks the columns 'text' and 'label'" in capsys.readouterr().err
    one_class = tmp_path / "one.jsonl"
    one_class.write_text('{"review": "good .", "sentiment": 1}\n' * 3)
    assert _train(one_class, tmp_path) == 1
    assert "at least two classes" in capsys.readouterr().err
    assert _train(sentences_csv, tmp_path, "--test-fraction", "1.5") == 1
    assert "--test-fraction must lie in (0, 1)" in capsys.readouterr().err
    assert _train(sentences_csv, tmp_path, "--epochs", "x") == 2     # argparse
    assert "invalid int value" in capsys.readouterr().err
    assert _train(sentences_csv, tmp_path / "c", "--resume") == 1
    assert "no checkpoint at" in capsys.readouterr().err


def test_bench(capsys, monkeypatch):
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"hsa", "structure"} <= set(listed)
    # arguments reach the script (its own --help), run as benchmarks/bench_hsa.py
    assert main(["bench", "hsa", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: bench_hsa.py")
    assert sys.argv[0] != "bench_hsa.py"                               # restored
    assert main(["bench", "nope"]) == 1
    err = capsys.readouterr().err
    assert "no benchmark 'nope'; available: " in err and "hsa, " in err
    assert main(["bench"]) == 2
    # an installation without the source checkout says so
    monkeypatch.setattr(cli, "__file__", str(Path("/nonexistent/hsa_graph/cli.py")))
    assert main(["bench", "hsa"]) == 1
    assert "runs the scripts of a source checkout" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="runs the scripts of a source checkout"):
        cli.benchmark_dir()


def test_top_level_help_imports_neither_torch_nor_pyg():
    # `hsa-graph --help` must stay fast: the heavy packages load when a command runs
    code = ("import sys; from hsa_graph.cli import main; code = main(['--help']); "
            "print(code, sorted(m for m in ('torch', 'torch_geometric', 'transformers') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 []"


def test_package_names_load_on_first_use():
    import hsa_graph
    from hsa_graph.ops.hsa import hsa

    assert hsa_graph.hsa is hsa
    assert set(hsa_graph.__all__) <= set(dir(hsa_graph))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        hsa_graph.no_such_name  # noqa: B018


def test_progress_bars_only_on_a_terminal():
    # stderr a pipe (a redirected log) -> no bars; stderr a real terminal -> bars
    import os
    import pty

    code = "from hsa_graph.cli import show_progress; print(show_progress(), show_progress(True))"
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert piped.stdout.split() == ["False", "False"], piped.stderr
    leader, follower = pty.openpty()
    try:
        on_tty = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=follower, text=True, timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    assert on_tty.stdout.split() == ["True", "False"]
