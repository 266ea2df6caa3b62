"""The ListOps experiment: a tiny real training run, its report and checkpoints, and
``hsa-graph listops evaluate`` / ``generate`` through the command line."""
import json

import pytest
import torch
from torch_geometric.data import Batch

from hsa_graph.cli import main
from hsa_graph.datasets.listops import (
    VOCAB,
    evaluate_listops,
    generate_listops,
    read_listops_tsv,
    write_listops_tsv,
)
from hsa_graph.experiments.listops import (
    MAX_NESTING,
    QUICK,
    VARIANTS,
    ListOpsConfig,
    build_examples,
    build_model,
    evaluate_checkpoint,
    load_model,
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


def test_breakdown_by_operator_depth_and_dependence_adds_up_to_the_test_accuracy(tiny_run):
    out, result = tiny_run
    from hsa_graph.datasets.listops import (
        generate_listops_splits,
        listops_dependence,
        parse_listops,
    )

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
    dependence = {}
    for expr, _ in test:
        # in ninths of a nested result (checked against re-evaluation elsewhere)
        ninths = round(listops_dependence(expr).sum() * 9)
        name = next(name for name, high in (("0-1", 1), ("1-2", 2), ("2-3", 3), ("3-5", 5),
                                             ("5-8", 8), ("8-13", 13), ("13+", 1e9))
                    if ninths < 9 * high)
        dependence[name] = dependence.get(name, 0) + 1
    assert len(dependence) > 1                   # the bins tell the test split apart
    for run in result["runs"]:
        for kind, counts in (("by_operator", roots), ("by_depth", depths),
                             ("by_dependence", dependence)):
            table = run["breakdown"][kind]
            assert {k: v["n"] for k, v in table.items()} == counts
            if kind != "by_operator":            # increasing order, depths as numbers
                assert list(table) == sorted(table, key=lambda k: float(
                    k.split("-")[0].strip("+")))
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
    # the feed-forward width, over --quick's 64
    args = build_parser("listops").parse_args(["listops", "--quick", "--hidden-channels", "96",
                                              "--variants", "hsa-tree", "tree-recursive"])
    config = config_from_args(args)
    assert config.hidden_channels == 96
    assert build_model("hsa-tree", **config.model_spec()).classifier.mlp[0].out_features == 96
    recursive = build_model("tree-recursive", **config.model_spec())
    assert recursive.encoder.hidden_channels == 96 and recursive.mlp[0].out_features == 96


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


def test_evaluate_checkpoint_reads_each_example_once(tiny_run, tmp_path, monkeypatch):
    """The breakdown comes from the predictions of the metrics' own forward passes."""
    import hsa_graph.experiments.listops as listops

    out, result = tiny_run
    run = result["runs"][0]
    data = generate_listops_test_file(tmp_path, result)
    seen = []
    load = listops.load_model

    def counting(path):
        variant, spec, model = load(path)
        model.register_forward_hook(lambda m, args, out: seen.append(args[0].num_graphs))
        return variant, spec, model

    monkeypatch.setattr(listops, "load_model", counting)
    metrics = evaluate_checkpoint(run["checkpoint"], str(data), batch_size=5)
    assert sum(seen) == metrics["n"] == 16
    assert metrics["breakdown"] == run["breakdown"]
    assert "predictions" not in metrics


def _write_splits(root, splits):
    root.mkdir()
    for name, rows in splits.items():
        write_listops_tsv(root / f"basic_{name}.tsv", rows)
    return root


def test_a_run_on_files_records_what_it_read(tmp_path):
    """With ``data_dir`` the files make the data: the results give their counts, and
    no generator setting that did not make them."""
    rows = generate_listops(30, seed=3, max_depth=3, max_args=3, min_length=4,
                            max_length=20)
    root = _write_splits(tmp_path / "data", {"train": rows[:20], "val": rows[20:23],
                                             "test": rows[23:]})
    settings = {**TINY, "seeds": 1, "epochs": 1}
    result = run_listops(ListOpsConfig(variants=("deepset",), data_dir=str(root),
                                       output_dir=str(tmp_path / "out"), **settings))
    cfg = result["config"]
    assert (cfg["num_train"], cfg["num_val"], cfg["num_test"]) == (20, 3, 7)
    assert all(cfg[name] is None for name in (
        "max_depth", "max_args", "min_length", "max_length", "operators", "data_seed"))
    assert cfg["data_dir"] == str(root)
    saved = json.loads((tmp_path / "out" / "listops.json").read_text())
    assert {k: saved["config"][k] for k in ("num_train", "max_depth")} == {
        "num_train": 20, "max_depth": None}
    assert saved["data"]["train"] == 20
    generated = run_listops(ListOpsConfig(variants=("deepset",), **settings))["config"]
    assert generated["num_train"] == 48 and generated["max_depth"] == 3


def test_the_estimate_extrapolates_timed_steps_to_an_epoch(tmp_path, monkeypatch):
    import hsa_graph.experiments.listops as listops

    settings = dict(TINY, num_train=480, batch_size=8, operators=("MAX", "SM"))
    drawn = []
    generate = listops.generate_listops_splits

    def recording(*args, **kwargs):
        drawn.append(kwargs)
        return generate(*args, **kwargs)

    monkeypatch.setattr(listops, "generate_listops_splits", recording)
    rows = listops.estimate_epoch_seconds(
        ListOpsConfig(variants=("hsa-tree", "deepset"), **settings))
    assert [r["model"] for r in rows] == ["hsa-tree", "deepset"]
    for r in rows:
        assert r["seconds_per_step"] > 0 and r["peak_memory_mib"] >= 0
        assert r["seconds_per_epoch"] == pytest.approx(r["seconds_per_step"] * 480 / 8)
    assert drawn[0]["operators"] == ("MAX", "SM")     # the settings reach the data drawn

    # on files: the training file's rows are timed and its count makes the epoch; nothing
    # is generated
    drawn.clear()
    train = generate_listops(20, seed=5, max_depth=3, max_args=3, min_length=4,
                             max_length=20)
    root = _write_splits(tmp_path / "data", {"train": train, "val": train[:2],
                                             "test": train[:2]})
    rows = listops.estimate_epoch_seconds(ListOpsConfig(variants=("deepset",),
                                                        data_dir=str(root), **settings))
    assert drawn == []
    assert rows[0]["seconds_per_epoch"] == pytest.approx(rows[0]["seconds_per_step"] * 20 / 8)
    with pytest.raises(ValueError, match="basic_train.tsv: 20 rows, fewer than one batch"):
        listops.estimate_epoch_seconds(ListOpsConfig(
            variants=("deepset",), data_dir=str(root), **{**settings, "batch_size": 32}))


def _with_a_bad_line(path, bad_row):
    """The file with blank lines before a bad last row, so that its line (not its row
    number) names it."""
    lines = path.read_text().splitlines()
    text = "\n".join(lines[:2] + ["", "   ", ""] + lines[2:] + ["\t".join(bad_row)]) + "\n"
    path.write_text(text)
    return len(lines) + 4


@pytest.mark.parametrize("bad_row, match", [
    (("[MAX 1 2 ]", "1"), "the label is 1 but the expression's value is 2"),
    (("[MAX 1 2", "2"), "at token 0 is never closed"),
])
def test_a_bad_expression_in_a_file_is_named_by_its_line(tiny_run, tmp_path, bad_row,
                                                          match):
    out, result = tiny_run
    rows = generate_listops(12, seed=4, max_depth=3, max_args=3, min_length=4,
                            max_length=20)
    root = _write_splits(tmp_path / "data", {"train": rows[:6], "val": rows[6:9],
                                             "test": rows[9:]})
    line = _with_a_bad_line(root / "basic_train.tsv", bad_row)
    settings = {**TINY, "seeds": 1, "epochs": 1}
    with pytest.raises(ValueError, match=f"basic_train.tsv, line {line}: .*{match}"):
        run_listops(ListOpsConfig(variants=("deepset",), data_dir=str(root), **settings))
    line = _with_a_bad_line(root / "basic_test.tsv", bad_row)
    with pytest.raises(ValueError, match=f"basic_test.tsv, line {line}: .*{match}"):
        evaluate_checkpoint(result["runs"][0]["checkpoint"], str(root / "basic_test.tsv"))


def test_accuracy_breakdown_needs_one_prediction_per_row():
    from hsa_graph.experiments.listops import accuracy_breakdown

    rows = [("[MAX 1 2 ]", 2), ("[SM 3 4 ]", 7), ("5", 5)]
    got = accuracy_breakdown([2, 0, 5], rows)
    assert got["by_operator"] == {"MAX": {"accuracy": 1.0, "n": 1},
                                  "SM": {"accuracy": 0.0, "n": 1},
                                  "digit": {"accuracy": 1.0, "n": 1}}
    with pytest.raises(ValueError, match="2 predictions for 3 rows"):
        accuracy_breakdown([2, 0], rows)
    for bad in (2.9, "2", True, None):   # a class index, never a truncated number
        with pytest.raises(TypeError, match=r"predictions\[1\] must be a class index"):
            accuracy_breakdown([2, bad, 5], rows)
    assert accuracy_breakdown(torch.tensor([2, 0, 5]).numpy().tolist(), rows) == got


@pytest.mark.parametrize("row, match", [
    (("[MAX 1 2 ]", 2.7), "example 1: the label must be an int"),
    (("[MAX 1 2 ]", "2"), "example 1: the label must be an int"),
    (("[MAX 1 2 ]", None), "example 1: the label must be an int"),
    (("[MAX 1 2 ]", True), "example 1: the label must be an int"),
    (("[MAX 1 2 ]", 2, 0), "example 1: expected an \\(expression, label\\) pair"),
    ((None, 2), "example 1: a ListOps expression must be a str"),
])
def test_build_examples_names_the_bad_row(row, match):
    with pytest.raises(ValueError, match=match):
        build_examples([("[MIN 1 2 ]", 1), row], "parse", where="f.tsv")


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
    by_depth = run["breakdown"]["by_depth"]      # the run's own breakdown of the test split
    assert "by depth (accuracy, count): " + ", ".join(
        f"{k} {v['accuracy']:.3f} ({v['n']})" for k, v in by_depth.items()) in printed
    assert "by dependence on nested results (accuracy, count): " + ", ".join(
        f"{k} {v['accuracy']:.3f} ({v['n']})"
        for k, v in run["breakdown"]["by_dependence"].items()) in printed
    assert evaluate_checkpoint(run["checkpoint"], str(data))["breakdown"] == run["breakdown"]
    bad = tmp_path / "bad.tsv"
    bad.write_text("Source\tTarget\n[MAX 1 2\t2\n")
    assert main(["listops", "evaluate", "--checkpoint", run["checkpoint"],
                 "--data", str(bad)]) == 1
    assert "bad.tsv, line 2: operator [MAX at token 0 is never closed" in (
        capsys.readouterr().err)


def test_cli_generate(tmp_path):
    assert main(["listops", "generate", "--out", str(tmp_path), "--num-train", "5",
                 "--num-val", "2", "--num-test", "3", "--max-depth", "3", "--max-args", "3",
                 "--min-length", "4", "--max-length", "20"]) == 0
    rows = read_listops_tsv(tmp_path / "basic_test.tsv", check=True)
    assert len(rows) == 3


def test_cli_generate_bad_places_and_sizes(tmp_path, capsys):
    small = ["--num-val", "1", "--num-test", "1", "--max-depth", "3", "--max-args", "3",
             "--min-length", "4", "--max-length", "20"]
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "below"):       # a file where a folder is asked for
        assert main(["listops", "generate", "--out", str(out), "--num-train", "1",
                     *small]) == 1
        err = capsys.readouterr().err
        assert err.startswith("hsa-graph listops: error: ") and "Traceback" not in err
    assert main(["listops", "generate", "--out", str(tmp_path / "x"), "--num-train",
                 str(10**13), *small]) == 1
    assert "cannot fit in this machine's memory" in capsys.readouterr().err


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


def test_nesting_is_each_token_s_count_of_open_operators_and_reaches_the_model():
    rows = [("[MAX 2 9 [MIN 4 7 ] 0 ]", 9), ("[SM [MED 1 [MAX 3 ] 5 ] 2 ]", 5)]
    # the operators open around each token, counted by hand (the root operator: 0)
    expected = [[0, 1, 1, 1, 2, 2, 1, 1, 0], [0, 1, 2, 2, 3, 2, 2, 1, 1, 0]]
    for structure in ("parse", "parse_brackets", "windows"):
        for tree, (expr, _), depths in zip(build_examples(rows, structure), rows, expected):
            keep = [d for d, w in zip(depths, expr.split())
                    if structure != "parse" or w != "]"]
            assert tree.nesting.tolist() == keep, structure
    batch = Batch.from_data_list(build_examples(rows, "parse"))
    assert batch.nesting.tolist() == [d for depths, (expr, _) in zip(expected, rows)
                                      for d, w in zip(depths, expr.split()) if w != "]"]
    torch.manual_seed(0)
    plain = build_model("hsa-tree", channels=16, heads=2, layers=1, hidden_channels=16)
    torch.manual_seed(0)
    nested = build_model("hsa-tree", channels=16, heads=2, layers=1, hidden_channels=16,
                         nesting_embedding=True)
    assert nested.nesting is not None and plain.nesting is None
    zero = torch.zeros(MAX_NESTING + 1, 16)
    nested.load_state_dict({**plain.state_dict(), "nesting.weight": zero})
    assert torch.allclose(nested(batch), plain(batch))   # a zero embedding adds nothing
    with torch.no_grad():
        nested.nesting.weight[1:].normal_()
    assert not torch.allclose(nested(batch), plain(batch))
    deep = batch.nesting.clone()
    batch.nesting = torch.full_like(deep, 40)       # deeper than MAX_NESTING: capped
    capped = nested(batch)
    batch.nesting = torch.full_like(deep, MAX_NESTING)
    assert torch.equal(nested(batch), capped)
    batch.nesting = deep - 1
    with pytest.raises(ValueError, match="depths >= 0"):
        nested(batch)
    batch.nesting = deep.float()
    with pytest.raises(ValueError, match="depths >= 0"):
        nested(batch)
    del batch.nesting
    with pytest.raises(ValueError, match="nesting_embedding needs trees with nesting"):
        nested(batch)
    from hsa_graph.cli import build_parser
    from hsa_graph.experiments.listops import config_from_args
    args = build_parser("listops").parse_args(["listops", "--quick", "--nesting-embedding"])
    assert config_from_args(args).model_spec()["nesting_embedding"] is True
    with pytest.raises(ValueError, match="the h-transformer-1d variant has none"):
        ListOpsConfig(nesting_embedding=True).validate()


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


# ------------------------------------------------------------------ nested values' loss
def _spans(tree, expression, keep_close):
    """Each nested operator's span as its tokens, read back through the leaves."""
    words = [w for w in expression.split() if keep_close or w != "]"]
    row = {int(n): i for i, n in enumerate(tree.leaf_index)}
    return [" ".join(words[row[a]:row[b] + 1]) for a, b in zip(
        tree.nested_index.tolist(), tree.nested_last_index.tolist())]


@pytest.mark.parametrize("structure", ["parse", "parse_brackets", "windows"])
def test_nested_targets_are_each_nested_operator_s_span_and_value(structure):
    keep = structure != "parse"
    rows = [("[SM [MAX 2 9 [MIN 4 7 ] ] 0 [MED 1 2 3 ] ]", 1), ("[MIN 5 [SM 3 4 ] ]", 5),
            ("[MAX 1 2 ]", 2), ("7", 7)]
    trees = build_examples(rows, structure, nested_targets=True)
    close = " ]" if keep else ""
    assert _spans(trees[0], rows[0][0], keep) == [
        f"[MAX 2 9 [MIN 4 7{close}{close}", f"[MIN 4 7{close}", f"[MED 1 2 3{close}"]
    assert trees[0].nested_y.tolist() == [9, 4, 2]
    assert _spans(trees[1], rows[1][0], keep) == [f"[SM 3 4{close}"]
    assert trees[1].nested_y.tolist() == [7]
    for tree in trees[2:]:                          # no nested operator
        assert tree.nested_index.numel() == tree.nested_last_index.numel() == 0
    assert not hasattr(build_examples(rows[:1], structure)[0], "nested_index")


def test_on_the_parse_tree_a_span_is_the_operator_s_subtree():
    from torch_geometric.data import Batch

    from hsa_graph.nn import subtree_pool

    rows = generate_listops(6, seed=3, max_depth=4, max_args=4, min_length=10,
                            max_length=40)
    batch = Batch.from_data_list(build_examples(rows, "parse", nested_targets=True))
    leaf_rows = torch.randn(batch.num_leaves, 3, dtype=torch.float64)
    # the internal node just before each operator token is its operator's node
    subtree = subtree_pool(leaf_rows, batch, batch.nested_index - 1)
    structure = batch.structure
    first = structure.unified_of_node[batch.nested_index].tolist()
    last = structure.unified_of_node[batch.nested_last_index].tolist()
    span = torch.stack([leaf_rows[a:b + 1].mean(0) for a, b in zip(first, last)])
    assert batch.nested_index.numel() > 6
    torch.testing.assert_close(span, subtree, rtol=1e-12, atol=1e-12)


def test_nested_targets_grow_with_the_operators_not_with_tokens_times_depth():
    deep = "[SM " * 1000 + "1 " * 20_000 + "] " * 1000      # 22,000 tokens, 1,000 deep
    tree = build_examples([(deep, 0)], "parse", nested_targets=True)[0]
    assert tree.nested_index.numel() == tree.nested_last_index.numel() == 999
    assert sum(v.numel() for k, v in tree.items() if k.startswith("nested")) == 4 * 999


@pytest.mark.parametrize("variant,pool", [("hsa-tree", "mean"), ("fsa", "mean"),
                                          ("hsa-tree-brackets", "first")])
def test_nested_value_loss_is_the_read_out_on_each_span(variant, pool):
    import torch.nn.functional as F
    from torch_geometric.data import Batch

    from hsa_graph.experiments import ClassifierOutput
    from hsa_graph.experiments.listops import NestedValueLoss

    rows = [("[SM [MAX 2 9 [MIN 4 7 ] ] 0 [MED 1 2 3 ] ]", 1), ("[MAX 1 2 ]", 2),
            ("[MIN 5 [SM 3 4 ] ]", 5)]
    structure = VARIANTS[variant][0]
    batch = Batch.from_data_list(build_examples(rows, structure, nested_targets=True))
    torch.manual_seed(0)
    model = build_model(variant, channels=16, heads=2, layers=2, hidden_channels=16,
                        layer="pre_norm", pool=pool).double()
    out = NestedValueLoss(model, 0.5)(batch)
    assert isinstance(out, ClassifierOutput)
    torch.testing.assert_close(out.logits, model(batch))
    # independently: each tree's token outputs, its nested operators found by a
    # bracket matcher, each span read out by hand against its evaluated value
    keep = structure != "parse"
    expected = []
    for tree, (expr, _) in zip(batch.to_data_list(), rows):
        h = model.encode(Batch.from_data_list([tree]))
        words = expr.split()
        leaf_of = {t: j for j, t in enumerate(i for i, w in enumerate(words)
                                               if keep or w != "]")}
        opens, spans = [], []
        for t, w in enumerate(words):
            if w.startswith("["):
                opens.append(t)
            elif w == "]":
                start = opens.pop()
                if opens:                                 # inside another operator
                    spans.append((start, t))
        losses = []
        for start, end in sorted(spans):
            inside = [leaf_of[u] for u in range(start, end + 1) if u in leaf_of]
            z = h[inside[0]] if pool == "first" else h[inside].mean(0)
            value = evaluate_listops(" ".join(words[start:end + 1]))
            losses.append(F.cross_entropy(model.classifier.mlp(z)[None],
                                          torch.tensor([value])))
        expected.append(0.5 * torch.stack(losses).mean() if losses else h.new_zeros(()))
    torch.testing.assert_close(out.extra_loss, torch.stack(expected))
    # validation and test batches carry no targets: plain logits
    plain = Batch.from_data_list(build_examples(rows, structure))
    torch.testing.assert_close(NestedValueLoss(model)(plain), model(plain))


def test_node_loss_trains_and_leaves_the_evaluation_to_the_root_label(tmp_path, capsys):
    config = dict(TINY, seeds=1, epochs=1)
    plain = run_listops(ListOpsConfig(variants=("hsa-tree",), **config))
    # without progress bars, one line per epoch
    history = plain["runs"][0]["history"][0]
    assert (f"epoch 1/1: train loss {history['train_loss']:.4f}, val accuracy "
            f"{history['val_accuracy']:.4f}") in capsys.readouterr().out
    with_loss = run_listops(ListOpsConfig(variants=("hsa-tree", "fsa"), node_loss=1.0,
                                          output_dir=str(tmp_path), **config))
    first, second = plain["runs"][0], with_loss["runs"][0]
    # the same data and initial weights; the extra term raises the training loss
    assert second["history"][0]["train_loss"] > first["history"][0]["train_loss"]
    assert with_loss["config"]["node_loss"] == 1.0
    assert "nested_breakdown" not in first
    assert second["nested_breakdown"]["all"]["n"] > 0 and "acc_nested" in with_loss["summary"][0]
    # the saved model is the classifier itself: it evaluates to the reported accuracy
    test = generate_listops_test_file(tmp_path, with_loss)
    out = evaluate_checkpoint(second["checkpoint"], str(test), nested=True)
    assert out["accuracy"] == pytest.approx(second["test_accuracy"])
    assert out["nested"].keys() == second["nested_breakdown"].keys()
    for key, value in second["nested_breakdown"].items():
        assert out["nested"][key] == pytest.approx(value), key
    capsys.readouterr()
    assert main(["listops", "evaluate", "--checkpoint", second["checkpoint"], "--data",
                 str(test), "--nested"]) == 0
    nested = second["nested_breakdown"]["all"]
    assert f"all {nested['accuracy']:.3f} ({nested['n']})" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs,match", [
    ({"node_loss": -1.0}, "node_loss must be a finite number >= 0"),
    ({"node_loss": float("nan")}, "node_loss must be a finite number >= 0"),
    ({"node_loss": True}, "node_loss must be a finite number >= 0"),
    ({"node_loss": 1.0, "variants": ("h-transformer-1d",)}, "h-transformer-1d"),
])
def test_bad_node_loss(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ListOpsConfig(**kwargs).validate()


def test_nested_value_loss_refuses_other_models_and_weights():
    from hsa_graph.experiments.listops import NestedValueLoss

    model = build_model("hsa-tree", channels=16, heads=2, layers=1, hidden_channels=16)
    with pytest.raises(TypeError, match="wraps a ListOpsClassifier"):
        NestedValueLoss(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="weight must be a finite number >= 0"):
        NestedValueLoss(model, float("inf"))
    assert repr(NestedValueLoss(model, 0.5)) == "NestedValueLoss(weight=0.5)"


def test_cli_node_loss_reaches_the_config():
    import argparse

    from hsa_graph.experiments.listops import add_arguments, config_from_args

    parser = add_arguments(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args(["--quick", "--node-loss", "0.5"])).node_loss \
        == 0.5
    assert config_from_args(parser.parse_args(["--quick"])).node_loss == 0.0


def test_the_learning_rate_schedule_reaches_training():
    """--lr-schedule / --min-lr / --warmup-steps reach fit: the rates it reports per
    epoch are TrainConfig.lr_at's at each epoch's last step."""
    import argparse

    from hsa_graph.experiments.listops import add_arguments, config_from_args

    parser = add_arguments(argparse.ArgumentParser(allow_abbrev=False))
    config = config_from_args(parser.parse_args(
        ["--quick", "--lr", "0.01", "--lr-schedule", "cosine", "--min-lr", "0.001",
         "--warmup-steps", "2"]))
    assert (config.lr_schedule, config.min_lr, config.warmup_steps) == ("cosine", 0.001, 2)
    assert config.train_config(3).lr_at(1, 10) == 0.01 and config.train_config(3).seed == 3
    tiny = dict(TINY, seeds=1, epochs=3)
    result = run_listops(ListOpsConfig(variants=("hsa-tree",), lr=0.01, lr_schedule="cosine",
                                       min_lr=0.001, warmup_steps=2, **tiny))
    steps = -(-tiny["num_train"] // tiny["batch_size"])      # batches per epoch
    rates = [h["lr"] for h in result["runs"][0]["history"]]
    expected = ListOpsConfig(lr=0.01, lr_schedule="cosine", min_lr=0.001, warmup_steps=2,
                             **tiny).train_config(0)
    assert rates == pytest.approx([expected.lr_at((e + 1) * steps - 1, 3 * steps)
                                   for e in range(3)])
    assert rates[-1] == pytest.approx(0.001) and rates[0] > rates[1] > rates[2]
    with pytest.raises(ValueError, match="min_lr"):
        ListOpsConfig(lr=1e-3, min_lr=1e-2).validate()
    with pytest.raises(ValueError, match="lr_schedule"):
        ListOpsConfig(lr_schedule="linear").validate()


def test_an_abbreviated_option_is_refused(tmp_path, capsys):
    """argparse would read --seed as --seeds (a model option that generate ignores),
    silently giving data of the default seed: refused instead."""
    assert main(["listops", "generate", "--seed", "1", "--num-train", "2", "--num-val", "1",
                 "--num-test", "1", "--out", str(tmp_path)]) == 2
    assert "unrecognized arguments: --seed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_init_from_starts_each_run_from_the_earlier_run_s_checkpoint(tiny_run, tmp_path):
    from hsa_graph.experiments.listops import _initial_model

    out, result = tiny_run
    config = ListOpsConfig(variants=("hsa-tree", "fsa"), init_from=str(out), **TINY)
    for variant in ("hsa-tree", "fsa"):
        for seed in (0, 1):
            model = _initial_model(config, variant, seed)
            saved = load_model(out / "checkpoints" / f"{variant}_seed{seed}.pt")[2]
            for (name, a), (_, b) in zip(model.state_dict().items(),
                                         saved.state_dict().items()):
                assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name
    # a curriculum step: deeper data, the same models
    deeper = run_listops(ListOpsConfig(**{**TINY, "variants": ("hsa-tree",), "seeds": 1,
                                          "epochs": 1, "max_depth": 4, "max_length": 30,
                                          "init_from": str(out)}))
    assert deeper["config"]["init_from"] == str(out) and len(deeper["runs"]) == 1
    with pytest.raises(ValueError, match="no checkpoint of hsa-windows, seed 0"):
        _initial_model(ListOpsConfig(init_from=str(out), **TINY), "hsa-windows", 0)
    with pytest.raises(ValueError, match=r"other model settings: channels=16 \(here 32\)"):
        _initial_model(ListOpsConfig(init_from=str(out), **{**TINY, "channels": 32}),
                       "hsa-tree", 0)
    with pytest.raises(ValueError, match="init_from: no checkpoint"):
        _initial_model(ListOpsConfig(init_from=str(tmp_path), **TINY), "hsa-tree", 0)


def test_nested_accuracy_by_operator_and_height():
    from hsa_graph.experiments.listops import nested_accuracy

    rows = [("[SM [MAX 2 9 [MIN 4 7 ] ] 0 [MED 1 2 3 ] ]", 1), ("[MIN 5 [SM 3 4 ] ]", 5),
            ("[MAX 1 2 ]", 2)]
    examples = build_examples(rows, "parse", nested_targets=True)
    assert [t.nested_height.tolist() for t in examples] == [[2, 1, 1], [1], []]
    torch.manual_seed(0)
    model = build_model("hsa-tree", channels=16, heads=2, layers=1, hidden_channels=16)
    out = nested_accuracy(model, examples, batch_size=2)
    assert list(out) == ["all", "MAX/2", "MIN/1", "MED/1", "SM/1"]
    assert [out[k]["n"] for k in out] == [4, 1, 1, 1, 1]
    # against the read-out's predictions, computed once for the whole batch
    from torch_geometric.data import Batch

    batch = Batch.from_data_list(examples)
    with torch.no_grad():
        hit = (model.read_out_nested(model.encode(batch), batch).argmax(-1)
               == batch.nested_y).float()
    assert out["all"]["accuracy"] == pytest.approx(float(hit.mean()))
    assert [out[k]["accuracy"] for k in ("MAX/2", "MIN/1", "MED/1", "SM/1")] == \
        hit[[0, 1, 2, 3]].tolist()
    with pytest.raises(ValueError, match="nested_targets=True"):
        nested_accuracy(model, build_examples(rows, "parse"))


# ------------------------------------------------------------------ the recursive model
def test_the_recursive_variant_trains_saves_and_evaluates(tmp_path):
    result = run_listops(ListOpsConfig(variants=("tree-recursive",), output_dir=str(tmp_path),
                                       **{**TINY, "seeds": 1}))
    (run,) = result["runs"]
    assert run["variant"] == "tree-recursive" and len(run["history"]) == 2
    assert run["parameters"] == sum(p.numel() for p in build_model(
        "tree-recursive", channels=16, heads=2, layers=2, hidden_channels=16).parameters())
    data = generate_listops_test_file(tmp_path, result)
    metrics = evaluate_checkpoint(run["checkpoint"], str(data))
    assert metrics["variant"] == "tree-recursive"
    assert metrics["accuracy"] == pytest.approx(run["test_accuracy"])


def test_the_recursive_model_reads_the_parse_not_the_argument_order():
    """No positions inside a family: the arguments of an operator are a set (the four
    operators are symmetric in them), and the operator token is what is read out."""
    torch.manual_seed(0)
    model = build_model("tree-recursive", channels=16, heads=2, layers=2,
                        hidden_channels=16).eval()
    same = ["[MAX 2 [MIN 4 7 ] 9 [SM 1 [MED 3 8 5 ] ] ]",
            "[MAX [SM [MED 5 3 8 ] 1 ] 9 [MIN 7 4 ] 2 ]"]
    other = ["[MIN 2 [MIN 4 7 ] 9 [SM 1 [MED 3 8 5 ] ] ]",     # another root operator
             "[MAX 2 [MIN 4 7 9 ] [SM 1 [MED 3 8 5 ] ] ]"]     # another nesting
    rows = [(e, evaluate_listops(e)) for e in same + other]
    with torch.no_grad():
        logits = model(Batch.from_data_list(build_examples(rows, "parse")))
    torch.testing.assert_close(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2], atol=1e-4)
    assert not torch.allclose(logits[0], logits[3], atol=1e-4)


@pytest.mark.parametrize("setting", [dict(node_loss=1.0), dict(nesting_embedding=True),
                                     dict(include_self=True), dict(share_weights=True),
                                     dict(pool="first")])
def test_the_recursive_variant_refuses_settings_it_would_ignore(setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"{name}.*tree-recursive variant has none|"
                       f"tree-recursive variant has no counterpart of {name}"):
        ListOpsConfig(variants=("tree-recursive",), **TINY, **setting).validate()
    if name != "node_loss":
        with pytest.raises(ValueError, match=f"tree-recursive variant has no.*{name}"):
            build_model("tree-recursive", channels=16, heads=2, layers=1, **setting)


def test_first_seed_runs_the_later_seeds_of_a_comparison_alone(tiny_run, tmp_path):
    """Seeds split across processes give the runs one process gives."""
    from hsa_graph.cli import build_parser
    from hsa_graph.experiments.listops import config_from_args

    _, result = tiny_run
    alone = run_listops(ListOpsConfig(variants=("hsa-tree",), output_dir=str(tmp_path),
                                      **{**TINY, "seeds": 1, "first_seed": 1}))
    (run,) = alone["runs"]
    together = next(r for r in result["runs"] if r["variant"] == "hsa-tree" and r["seed"] == 1)
    assert run["seed"] == 1 and run["checkpoint"].endswith("hsa-tree_seed1.pt")
    assert run["test_accuracy"] == together["test_accuracy"]
    assert [h["train_loss"] for h in run["history"]] == pytest.approx(
        [h["train_loss"] for h in together["history"]])
    args = build_parser("listops").parse_args(["listops", "--first-seed", "2", "--seeds", "1"])
    assert config_from_args(args).first_seed == 2
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="first_seed must be an int >= 0"):
            ListOpsConfig(first_seed=bad).validate()


# ------------------------------------------------------------------ node tokens
def test_node_token_examples_carry_nesting_spans_and_mirrors():
    rows = [("[SM [MAX 2 9 [MIN 4 7 ] ] 0 [MED 1 2 3 ] ]", 1), ("[MIN 5 [SM 3 4 ] ]", 5),
            ("7", 7)]
    trees = build_examples(rows, "parse_nodes", nested_targets=True)
    words = lambda t: [VOCAB[i] for i in t.x.tolist()]  # noqa: E731
    assert words(trees[0]) == ("[SM [MAX [MAX 2 9 [MIN [MIN 4 7 0 [MED [MED 1 2 3").split()
    # a node token sits in its parent's family: its nesting is its operator's
    assert trees[0].nesting.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 1, 1, 1, 2, 2, 2]
    assert trees[1].nesting.tolist() == [0, 1, 1, 1, 2, 2]
    # each nested operator's span: from its own token (after its node token) to its last
    row = {int(n): i for i, n in enumerate(trees[0].leaf_index)}
    spans = [" ".join(words(trees[0])[row[a]:row[b] + 1]) for a, b in zip(
        trees[0].nested_index.tolist(), trees[0].nested_last_index.tolist())]
    assert spans == ["[MAX 2 9 [MIN [MIN 4 7", "[MIN 4 7", "[MED 1 2 3"]
    assert trees[0].nested_y.tolist() == [9, 4, 2]
    # every node token mirrors its operator's token, the first leaf of that span
    assert trees[0].mirror_source_index.tolist() == trees[0].nested_index.tolist()
    assert trees[2].mirror_index.numel() == 0 and trees[2].nested_index.numel() == 0


def test_the_node_token_variant_trains_saves_and_evaluates(tmp_path):
    result = run_listops(ListOpsConfig(variants=("hsa-tree-nodes", "hsa-tree"),
                                       output_dir=str(tmp_path), node_loss=0.5,
                                       **{**TINY, "seeds": 1}))
    nodes, tree = result["runs"]
    assert nodes["variant"] == "hsa-tree-nodes" and len(nodes["history"]) == 2
    assert nodes["parameters"] == tree["parameters"]          # the same model, other trees
    data = generate_listops_test_file(tmp_path, result)
    metrics = evaluate_checkpoint(nodes["checkpoint"], str(data), nested=True)
    assert metrics["variant"] == "hsa-tree-nodes"
    assert metrics["accuracy"] == pytest.approx(nodes["test_accuracy"])


def test_node_tokens_carry_a_nested_operator_that_its_subtree_mean_cannot():
    """The same tokens under the nested operator, nested the other way round: after one
    layer the plain parse tree's root operator has read the same subtree mean in both;
    with node tokens it reads the nested operator's own token."""
    rows = [("[MAX 1 [MIN 9 [MAX 8 2 ] ] ]", 8), ("[MAX 1 [MAX 9 [MIN 8 2 ] ] ]", 9)]
    for variant, differs in (("hsa-tree", False), ("hsa-tree-nodes", True)):
        torch.manual_seed(0)
        model = build_model(variant, channels=8, heads=2, layers=1, hidden_channels=8,
                            layer="pre_norm", pos_dim=None).double().eval()
        trees = build_examples(rows, VARIANTS[variant][0])
        with torch.no_grad():       # the root operator's token is each tree's first leaf
            roots = [model.encode(Batch.from_data_list([t]))[0] for t in trees]
        assert torch.allclose(roots[0], roots[1]) != differs, variant


# ------------------------------------------------------------------ bottom-up schedule
def _bracket_match(expr):
    """The words of ``expr``, each operator's height (1 over digits only) by the index of
    its word, and each word's enclosing operator (its word's index; ``None``: none), by a
    bracket matcher."""
    words, height, opens, owner = expr.split(), {}, [], []
    for t, w in enumerate(words):
        owner.append(opens[-1][0] if opens else None)
        if w.startswith("["):
            opens.append([t, 1])
        elif w == "]":
            start, h = opens.pop()
            height[start] = h
            if opens:
                opens[-1][1] = max(opens[-1][1], h + 1)
    return words, height, owner


def _schedule_by_hand(expr, families):
    """Each leaf's ``update_layer`` in a tree with node tokens (each just before its
    operator); ``]`` dropped. Bottom-up: an operator token's height, 0 for the others
    (digits; node tokens are copied). With ``families``: every token's family's, an
    operator token's own height, a digit's and a node token's that of the operator
    whose argument it is (0 for a lone digit)."""
    words, height, owner = _bracket_match(expr)
    out = []
    for t, w in enumerate(words):
        of_parent = height[owner[t]] if families and owner[t] is not None else 0
        if w.startswith("[") and owner[t] is not None:
            out.append(of_parent)                       # its node token
        if w != "]":
            out.append(height[t] if w.startswith("[") else of_parent)
    return out


@pytest.mark.parametrize("structure,expected", [
    # x: [SM [MAX [MAX 2 9 [MIN [MIN 4 7 0 [MED [MED 1 2 3; [MIN 5 [SM [SM 3 4; 7
    ("parse_bottom_up", [[3, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0], [2, 0, 0, 1, 0, 0],
                         [0]]),
    ("parse_bottom_up_families", [[3, 3, 2, 2, 2, 2, 1, 1, 1, 3, 3, 1, 1, 1, 1],
                                  [2, 2, 2, 1, 1, 1], [0]])])
def test_scheduled_examples_schedule_each_token(structure, expected):
    """``parse_bottom_up``: each operator at its height; ``parse_bottom_up_families``:
    every token at its family's operator's height, so a family shares its turn."""
    rows = [("[SM [MAX 2 9 [MIN 4 7 ] ] 0 [MED 1 2 3 ] ]", 1), ("[MIN 5 [SM 3 4 ] ]", 5),
            ("7", 7)]
    assert [t.update_layer.tolist() for t in build_examples(rows, structure)] == expected
    rows += [(e, v) for e, v in generate_listops(40, seed=3, max_depth=5, max_args=4,
                                                 min_length=3, max_length=60)]
    nodes = build_examples(rows, "parse_nodes")
    for tree, plain, (expr, _) in zip(build_examples(rows, structure), nodes, rows):
        for key in ("x", "nesting", "mirror_index", "mirror_source_index", "edge_index",
                    "position"):
            assert torch.equal(tree[key], plain[key]), key
        families = structure == "parse_bottom_up_families"
        assert tree.update_layer.tolist() == _schedule_by_hand(expr, families)
        if families:  # every leaf of a family shares its turn
            parent = tree.parent[tree.leaf_index]
            for node in parent.unique().tolist():
                assert tree.update_layer[parent == node].unique().numel() == 1


def test_turn_layers_are_for_scheduled_variants():
    import argparse

    from hsa_graph.experiments.listops import add_arguments, config_from_args

    parser = add_arguments(argparse.ArgumentParser())
    config = config_from_args(parser.parse_args(
        ["--quick", "--variants", "hsa-tree-bottom-up-families", "--turn-layers", "3"]))
    assert config.turn_layers == 3 and config.model_spec()["turn_layers"] == 3
    for variant in ("hsa-tree", "fsa", "tree-recursive", "h-transformer-1d"):
        with pytest.raises(ValueError, match=f"turn_layers=2 .*the {variant} variant has"):
            ListOpsConfig(variants=(variant,), turn_layers=2).validate()
        with pytest.raises(ValueError, match=f"turn_layers=2 .*the {variant} variant has"):
            build_model(variant, turn_layers=2)
    with pytest.raises(ValueError, match="turn_layers must be a positive int"):
        ListOpsConfig(variants=("hsa-tree-bottom-up",), turn_layers=0).validate()
    one = build_model("hsa-tree-bottom-up-families", channels=8, heads=2, layers=3,
                      share_weights=True, turn_layers=1, pos_dim=None)
    two = build_model("hsa-tree-bottom-up-families", channels=8, heads=2, layers=3,
                      share_weights=True, turn_layers=2, pos_dim=None)
    encoder = two.classifier.encoder
    assert encoder.num_turns == 3 and len(encoder.layers) == 6
    assert encoder.layers[0] is encoder.layers[2] is not encoder.layers[1]
    per_layer = sum(p.numel() for p in encoder.layers[0].parameters())
    assert (sum(p.numel() for p in two.parameters())
            == sum(p.numel() for p in one.parameters()) + per_layer)
    distinct = build_model("hsa-tree-bottom-up", channels=8, heads=2, layers=3,
                           turn_layers=2, pos_dim=None).classifier.encoder
    assert len({id(layer) for layer in distinct.layers}) == 6


@pytest.mark.parametrize("variant", ["hsa-tree-bottom-up", "hsa-tree-bottom-up-family",
                                     "hsa-tree-bottom-up-siblings",
                                     "hsa-tree-bottom-up-families"])
def test_the_bottom_up_variant_trains_saves_and_evaluates(tmp_path, variant):
    spec = {**TINY, "seeds": 1, "layers": 2, "share_weights": True, "pool": "first",
            "include_self": True, "pos_dim": None, "layer": "pre_norm",
            "turn_layers": 2 if variant.endswith("families") else 1}
    result = run_listops(ListOpsConfig(variants=(variant,), output_dir=str(tmp_path),
                                       **spec))
    run, = result["runs"]
    assert run["variant"] == variant and len(run["history"]) == 2
    data = generate_listops_test_file(tmp_path, result)
    _, _, model = load_model(run["checkpoint"])
    encoder = model.classifier.encoder
    assert encoder.scope == {"hsa-tree-bottom-up": "tree", "hsa-tree-bottom-up-families":
                             "siblings"}.get(variant, variant.rsplit("-", 1)[1])
    assert encoder.turn_layers == spec["turn_layers"] and encoder.num_turns == 2
    metrics = evaluate_checkpoint(run["checkpoint"], str(data))
    assert metrics["accuracy"] == pytest.approx(run["test_accuracy"])
    # one level per layer: deeper data than layers is refused, naming both
    with pytest.raises(ValueError, match="train nests operators 2 deep.*layers >= 2, got 1"):
        run_listops(ListOpsConfig(variants=(variant,), **{**spec, "layers": 1}))
    deep = write_listops_tsv(tmp_path / "deep.tsv",
                             [("[MAX 1 [MIN 2 [MAX 3 [MIN 4 5 ] ] ] ]", 2)])
    with pytest.raises(ValueError, match="deep.tsv nests operators 4 deep.*got 2"):
        evaluate_checkpoint(run["checkpoint"], str(deep))


def test_a_resumed_run_ends_as_one_that_never_stopped(tmp_path):
    """``--resume`` continues each run from the state it saved after its last epoch:
    one epoch, then resumed to three, gives the three-epoch run's history and model;
    a run with no state starts afresh; other settings are refused, naming them."""
    config = dict(TINY, seeds=1, variants=("hsa-tree", "fsa"), dropout=0.1)
    straight = run_listops(ListOpsConfig(**dict(config, epochs=3),
                                         output_dir=str(tmp_path / "a")))
    first = run_listops(ListOpsConfig(**dict(config, epochs=1),
                                      output_dir=str(tmp_path / "b")))
    assert (tmp_path / "b" / "runs" / "fsa_seed0" / "last.pt").is_file()
    resumed = run_listops(ListOpsConfig(**dict(config, epochs=3), resume=True,
                                        output_dir=str(tmp_path / "b")))
    for a, b, one in zip(straight["runs"], resumed["runs"], first["runs"]):
        assert len(b["history"]) == 3
        assert b["history"][0] == one["history"][0]   # its first epoch was not run again
        for x, y in zip(a["history"], b["history"]):
            assert {k: v for k, v in x.items() if k != "seconds"} == {
                k: v for k, v in y.items() if k != "seconds"}
        assert a["test_accuracy"] == b["test_accuracy"]
        saved = [torch.load(run["checkpoint"], weights_only=False)["model"]
                 for run in (a, b)]
        assert saved[0].keys() == saved[1].keys()
        for key, value in saved[0].items():     # (extra states: plain objects)
            assert (torch.equal(value, saved[1][key]) if isinstance(value, torch.Tensor)
                    else value == saved[1][key]), key
    fresh = run_listops(ListOpsConfig(**dict(config, epochs=1), resume=True,
                                      output_dir=str(tmp_path / "c")))
    assert [len(r["history"]) for r in fresh["runs"]] == [1, 1]
    with pytest.raises(ValueError, match=r"cannot resume from .*hsa-tree_seed0: it was "
                                         r"trained with lr=0.001, this run has lr=0.002"):
        run_listops(ListOpsConfig(**dict(config, epochs=3, lr=2e-3), resume=True,
                                  output_dir=str(tmp_path / "b")))
    with pytest.raises(ValueError, match="resume continues the runs saved under output_dir"):
        ListOpsConfig(**config, resume=True).validate()
    from hsa_graph.cli import build_parser
    from hsa_graph.experiments.listops import config_from_args

    args = build_parser("listops").parse_args(["listops", "--resume", "--out", str(tmp_path)])
    assert config_from_args(args).resume
