"""The ListOps experiment: a tiny real training run, its report and checkpoints, and
``hsa-graph listops evaluate`` / ``generate`` through the command line."""
import json

import pytest
import torch

from hsa_graph.cli import main
from hsa_graph.datasets.listops import generate_listops, read_listops_tsv, write_listops_tsv
from hsa_graph.experiments.listops import (
    QUICK,
    VARIANTS,
    ListOpsConfig,
    build_examples,
    build_model,
    evaluate_checkpoint,
    run_listops,
)

TINY = dict(num_train=48, num_val=16, num_test=16, max_depth=3, max_args=3, min_length=4,
            max_length=20, epochs=2, layers=2, channels=16, heads=2, hidden_channels=16,
            batch_size=16, seeds=2, progress=False)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("listops")
    result = run_listops(ListOpsConfig(variants=("hsa-tree", "fsa", "deepset"),
                                       output_dir=str(out), **TINY))
    return out, result


def test_tiny_run_reports_every_variant(tiny_run):
    out, result = tiny_run
    assert [row["model"] for row in result["summary"]] == ["hsa-tree", "fsa", "deepset"]
    assert len(result["runs"]) == 6
    for row in result["summary"]:
        assert 0.0 <= row["accuracy_mean"] <= 1.0 and row["seeds"] == 2
        assert row["accuracy_ci95"] == row["accuracy_ci95"]   # an interval, not nan
        assert row["seconds_per_epoch"] > 0 and row["peak_memory_mib"] >= 0
    # equal parameter counts across the HSA, FSA and DeepSet variants
    assert len({row["parameters"] for row in result["summary"]}) == 1
    assert len(result["runs"][0]["history"]) == 2
    saved = json.loads((out / "listops.json").read_text())
    assert saved["data"]["test"] == 16
    assert (out / "listops_curves.png").is_file() and (out / "listops.md").is_file()


def test_breakdown_by_operator_and_depth_adds_up_to_the_test_accuracy(tiny_run):
    out, result = tiny_run
    from hsa_graph.datasets.listops import generate_listops_splits, parse_listops

    cfg = result["config"]
    test = generate_listops_splits(cfg["num_train"], cfg["num_val"], cfg["num_test"],
                                   seed=cfg["data_seed"], max_depth=cfg["max_depth"],
                                   max_args=cfg["max_args"], min_length=cfg["min_length"],
                                   max_length=cfg["max_length"])["test"]
    roots = {}
    for expr, _ in test:   # counted here from the text, apart from the breakdown's parse
        root = expr.split()[0]
        roots[root[1:] if root.startswith("[") else "digit"] = roots.get(
            root[1:] if root.startswith("[") else "digit", 0) + 1
    depths = {}
    for expr, _ in test:
        d = str(parse_listops(expr).depth)
        depths[d] = depths.get(d, 0) + 1
    for run in result["runs"]:
        for kind, counts in (("by_operator", roots), ("by_depth", depths)):
            table = run["breakdown"][kind]
            assert {k: v["n"] for k, v in table.items()} == counts
            right = sum(v["accuracy"] * v["n"] for v in table.values())
            assert right == pytest.approx(run["test_accuracy"] * len(test))
    row = result["summary"][0]
    assert {f"acc_{op}" for op in roots} <= set(row)


def test_model_options_reach_the_models():
    from hsa_graph.cli import build_parser
    from hsa_graph.experiments.listops import config_from_args

    args = build_parser("listops").parse_args(["listops", "--quick", "--operators", "MAX", "MIN",
                                      "--pool", "first", "--include-self", "--threads", "1"])
    config = config_from_args(args)
    assert config.operators == ("MAX", "MIN") and config.pool == "first"
    assert config.include_self
    model = build_model("hsa-tree", **config.model_spec())
    assert model.classifier.pool == "first" and "pool='first'" in repr(model.classifier)
    assert all(layer.attn.include_self for layer in model.classifier.encoder.layers)
    with pytest.raises(ValueError, match="pool"):
        ListOpsConfig(pool="max").validate()
    with pytest.raises(ValueError, match="layer must be"):
        ListOpsConfig(layer="post_norm").validate()


def test_the_layer_option_builds_pre_norm_stacks():
    from hsa_graph.cli import build_parser
    from hsa_graph.experiments.listops import config_from_args
    from hsa_graph.nn import HierarchicalTransformerEncoderLayer, HSATransformerEncoderLayer

    args = build_parser("listops").parse_args(["listops", "--quick", "--layer", "pre_norm"])
    config = config_from_args(args)
    assert config.layer == "pre_norm" and config.model_spec()["layer"] == "pre_norm"
    pre = build_model("hsa-tree", **config.model_spec())
    assert all(isinstance(layer, HSATransformerEncoderLayer)
               for layer in pre.classifier.encoder.layers)
    assert not any(layer.attn.include_self for layer in pre.classifier.encoder.layers)
    assert "layer='pre_norm'" in repr(pre.classifier)
    hte = build_model("hsa-tree", **ListOpsConfig(**QUICK).model_spec())
    assert all(isinstance(layer, HierarchicalTransformerEncoderLayer)
               for layer in hte.classifier.encoder.layers)
    assert "layer=" not in repr(hte.classifier)
    # the same parameter count whatever the attention, for either layer
    for layer in ("hte", "pre_norm"):
        counts = {sum(p.numel() for p in build_model(v, channels=16, heads=2, layers=2,
                                                     hidden_channels=16, layer=layer)
                      .parameters()) for v in ("hsa-tree", "fsa", "deepset")}
        assert len(counts) == 1
    with pytest.raises(ValueError, match="layer must be one of"):
        build_model("hsa-tree", channels=16, heads=2, layers=1, layer="post_norm")


def test_checkpoint_evaluates_to_the_reported_accuracy(tiny_run, tmp_path):
    out, result = tiny_run
    run = result["runs"][0]
    data = generate_listops_test_file(tmp_path, result)
    metrics = evaluate_checkpoint(run["checkpoint"], str(data))
    assert metrics["variant"] == "hsa-tree"
    assert metrics["n"] == 16
    assert metrics["accuracy"] == pytest.approx(run["test_accuracy"])


def generate_listops_test_file(tmp_path, result):
    """The run's test split, written in LRA's curried form."""
    from hsa_graph.datasets.listops import generate_listops_splits

    cfg = result["config"]
    splits = generate_listops_splits(cfg["num_train"], cfg["num_val"], cfg["num_test"],
                                     seed=cfg["data_seed"], max_depth=cfg["max_depth"],
                                     max_args=cfg["max_args"], min_length=cfg["min_length"],
                                     max_length=cfg["max_length"])
    return write_listops_tsv(tmp_path / "test.tsv", splits["test"], parens=True)


def test_cli_evaluate(tiny_run, tmp_path, capsys):
    out, result = tiny_run
    data = generate_listops_test_file(tmp_path, result)
    run = result["runs"][1]
    assert main(["listops", "evaluate", "--checkpoint", run["checkpoint"],
                 "--data", str(data)]) == 0
    printed = capsys.readouterr().out
    assert f"accuracy {run['test_accuracy']:.4f} (16 examples)" in printed
    bad = tmp_path / "bad.tsv"
    bad.write_text("Source\tTarget\n[MAX 1 2\t2\n")
    assert main(["listops", "evaluate", "--checkpoint", run["checkpoint"],
                 "--data", str(bad)]) == 1
    assert "example 0: operator [MAX at token 0 is never closed" in capsys.readouterr().err


def test_cli_generate(tmp_path):
    assert main(["listops", "generate", "--out", str(tmp_path), "--num-train", "5",
                 "--num-val", "2", "--num-test", "3", "--max-depth", "3", "--max-args", "3",
                 "--min-length", "4", "--max-length", "20"]) == 0
    rows = read_listops_tsv(tmp_path / "basic_test.tsv", check=True)
    assert len(rows) == 3


def test_structures_and_models_agree_on_leaves():
    rows = generate_listops(4, seed=0, max_depth=3, max_args=3, min_length=4, max_length=20)
    parse = build_examples(rows, "parse")
    full = build_examples(rows, "parse_brackets")
    windows = build_examples(rows, "windows")
    for a, b, c, (expr, value) in zip(parse, full, windows, rows):
        assert torch.equal(b.x, c.x)                  # both: every token, in order
        assert a.num_leaves == len([w for w in expr.split() if w != "]"])
        assert a.y.item() == b.y.item() == c.y.item() == value
    with pytest.raises(ValueError, match="example 0: the label is"):
        build_examples([(rows[0][0], (rows[0][1] + 1) % 10)], "parse")
    with pytest.raises(ValueError, match="unknown variant"):
        build_model("tree-lstm")
    assert set(VARIANTS) >= {"hsa-tree", "hsa-windows", "fsa", "deepset", "h-transformer-1d"}


def test_shared_weights_count_one_layer():
    a = build_model("hsa-tree", channels=16, heads=2, layers=4, hidden_channels=16)
    b = build_model("hsa-tree", channels=16, heads=2, layers=4, hidden_channels=16,
                    share_weights=True)
    one = build_model("hsa-tree", channels=16, heads=2, layers=1, hidden_channels=16)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(b) == count(one) < count(a)
    assert len(b.classifier.encoder.layers) == 4


def test_h_transformer_on_short_sequences():
    pytest.importorskip("h_transformer_1d")
    from torch_geometric.data import Batch

    rows = generate_listops(3, seed=0, max_depth=3, max_args=3, min_length=4, max_length=20)
    batch = Batch.from_data_list(build_examples(rows, "windows"))
    torch.manual_seed(0)
    model = build_model("h-transformer-1d", channels=16, heads=2, layers=2,
                        hidden_channels=16, max_length=20)
    assert model(batch).shape == (3, 10)        # 20 tokens < four blocks of 16: padded


def test_the_experiments_package_exports_the_listops_entry_points():
    import hsa_graph.experiments as experiments
    from hsa_graph.experiments import listops

    exported = {"ListOpsClassifier", "ListOpsConfig", "HTransformerClassifier",
                "estimate_epoch_seconds", "evaluate_checkpoint", "run_listops"}
    assert exported <= set(experiments.__all__)
    for name in exported:
        assert getattr(experiments, name) is getattr(listops, name), name
    # the command-line hooks stay with their module: every experiment module has a `run`
    assert not {"run", "add_arguments", "VARIANTS"} & set(experiments.__all__)
