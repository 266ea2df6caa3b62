"""report: JSON, Markdown and the figures, on the histories of real training runs."""
import json
import math
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread
from test_train import make_model, sentence_trees

from hsa_graph.experiments.report import (
    comparison_figure,
    learning_curves_figure,
    markdown_table,
    to_jsonable,
    variant_label,
    write_json,
    write_report,
)
from hsa_graph.experiments.train import TrainConfig, evaluate, fit


@pytest.fixture(scope="module")
def runs():
    """Two variants (learning rates) x two seeds of a real, short training run."""
    trees = sentence_trees(24)
    train, val = trees[:16], trees[16:]
    out = []
    for lr in (0.003, 0.03):
        for seed in (0, 1):
            model = make_model(seed)
            result = fit(model, train, val, TrainConfig(epochs=3, batch_size=8, lr=lr,
                                                        seed=seed))
            test = evaluate(model, val)
            out.append({"variant": f"lr {lr}", "seed": seed, "accuracy": test["accuracy"],
                        "history": result["history"]})
    return out


def _strict(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))


def test_json(tmp_path):
    obj = {"a": torch.tensor([[1, 2]]), "b": (float("inf"), 0.5), "c": Path("x/y"),
           "d": torch.tensor(2.5, dtype=torch.float64), "e": {1: torch.float32}}
    path = write_json(obj, tmp_path / "deep" / "r.json")
    assert _strict(path.read_text()) == {"a": [[1, 2]], "b": [None, 0.5], "c": "x/y",
                                         "d": 2.5, "e": {"1": "torch.float32"}}
    with pytest.raises(TypeError, match="cannot write a object as JSON"):
        to_jsonable({"f": object()})


def test_markdown_table():
    rows = [{"embedding": "static", "model": "HSA", "accuracy_mean": 0.81234,
             "accuracy_ci95": 0.01, "seeds": 5, "parameters": 1234567, "note": "a|b"},
            {"embedding": "static", "model": "FSA", "accuracy_mean": 0.75,
             "accuracy_ci95": float("nan"), "seeds": 1, "parameters": 1234567,
             "note": "two\nlines"}]
    assert markdown_table(rows, digits=3).splitlines() == [
        "| embedding | model | accuracy (95% CI) | seeds | parameters | note |",
        "|---|---|---|---|---|---|",
        "| static | HSA | 0.812 ± 0.010 | 5 | 1,234,567 | a\\|b |",
        "| static | FSA | 0.750 | 1 | 1,234,567 | two lines |"]
    assert markdown_table(rows, ["model", "seeds"]).splitlines()[2] == "| HSA | 5 |"
    with pytest.raises(ValueError, match="at least one row"):
        markdown_table([])


def test_learning_curves_show_the_mean_of_the_runs(runs):
    fig = learning_curves_figure(runs, metrics=("train_loss", "val_accuracy", "absent"))
    assert len(fig.axes) == 2
    for ax, metric in zip(fig.axes, ("train_loss", "val_accuracy")):
        lines = {line.get_label(): line for line in ax.lines}
        assert set(lines) == {"lr 0.003", "lr 0.03"}
        for label, line in lines.items():
            mine = [r["history"] for r in runs if r["variant"] == label]
            expected = [sum(h[e][metric] for h in mine) / len(mine) for e in range(3)]
            assert line.get_xdata().tolist() == [1, 2, 3]
            assert line.get_ydata().tolist() == pytest.approx(expected)
    assert variant_label(runs[0]) == "lr 0.003"
    with pytest.raises(ValueError, match="no run has a history"):
        learning_curves_figure([{"model": "x", "history": []}])


def test_comparison_figure():
    rows = [{"model": "HSA", "accuracy_mean": 0.8, "accuracy_ci95": 0.05},
            {"model": "FSA", "accuracy_mean": 0.7, "accuracy_ci95": float("nan")},
            {"model": "DeepSet", "accuracy_mean": 0.6}]
    ax = comparison_figure(rows).axes[0]
    assert [float(p.get_height()) for p in ax.patches] == pytest.approx([0.8, 0.7, 0.6])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["HSA", "FSA", "DeepSet"]
    segments = ax.collections[0].get_segments()                 # error bars
    assert [float(s[1, 1] - s[0, 1]) for s in segments] == pytest.approx([0.1, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"rows \[1\] have no number 'accuracy_mean'"):
        comparison_figure([rows[0], {"model": "x"}])


def test_comparison_figure_starts_at_zero():
    # close accuracies must not look far apart: the bars start at 0, not near the values
    rows = [{"model": "HSA", "accuracy_mean": 0.797, "accuracy_ci95": 0.035},
            {"model": "FSA", "accuracy_mean": 0.822, "accuracy_ci95": 0.027}]
    low, high = comparison_figure(rows).axes[0].get_ylim()
    assert low == 0.0 and high >= 0.822 + 0.027
    signed = [{"model": "a", "delta": -0.2}, {"model": "b", "delta": 0.1}]
    assert comparison_figure(signed, "delta").axes[0].get_ylim()[0] < -0.2


def test_write_report(runs, tmp_path):
    summary = []
    for label in ("lr 0.003", "lr 0.03"):
        accs = [r["accuracy"] for r in runs if r["variant"] == label]
        summary.append({"variant": label, "accuracy_mean": sum(accs) / len(accs),
                        "accuracy_ci95": 0.01, "runs": len(accs)})
    results = {"title": "learning rates", "command": "hsa-graph train --lr 0.03",
               "runs": runs, "summary": summary}
    paths = write_report(results, tmp_path / "out")
    assert [p.name for p in paths] == ["results.json", "results_curves.png",
                                       "results_comparison.png", "results.md"]
    data = _strict((tmp_path / "out" / "results.json").read_text())
    assert data == to_jsonable(results)
    assert data["runs"][3]["history"][2]["epoch"] == 3
    md = (tmp_path / "out" / "results.md").read_text()
    assert md.startswith("# learning rates\n\n```\nhsa-graph train --lr 0.03\n```\n")
    assert markdown_table(summary) in md
    assert "![learning curves](results_curves.png)" in md
    assert "![accuracy by variant](results_comparison.png)" in md
    for name in ("results_curves.png", "results_comparison.png"):
        image = imread(tmp_path / "out" / name)
        assert image.ndim == 3 and image.shape[0] > 200
        assert float(image[..., :3].std()) > 0.05       # not a blank canvas
    # a ready Markdown table is used as is; no runs or rows: no figures
    paths = write_report({"markdown": "| a |\n|---|\n| 1 |"}, tmp_path / "x", "exp")
    assert [p.name for p in paths] == ["exp.json", "exp.md"]
    assert (tmp_path / "x" / "exp.md").read_text() == "# exp\n\n| a |\n|---|\n| 1 |\n"
    with pytest.raises(ValueError, match="plain file name"):
        write_report({}, tmp_path, "a/b")
    with pytest.raises(TypeError, match="results must be a dict"):
        write_report([], tmp_path)
    assert math.isfinite(summary[0]["accuracy_mean"])
