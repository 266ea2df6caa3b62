import argparse
import json

import pytest
import torch

from hsa_graph.pretrained import zero_shot


def test_ablation_figure_has_intervals_and_starts_at_zero():
    results = {"stride": 2, "probe": {"test": 600, "accuracy_original": 0.7333},
               "ablation": [{"start_layer": s, "hierarchy": h, "accuracy": a}
                            for h, accs in (("(2, 4, 8, 16)", (0.7017, 0.7050)),
                                            ("semantic", (0.7267, 0.7383)))
                            for s, a in zip((0, 1), accs)]}
    ax = zero_shot.ablation_figure(results).axes[0]
    assert ax.get_ylim()[0] == 0.0
    assert [round(float(p.get_height()), 4) for p in ax.patches] == [0.7017, 0.705, 0.7267,
                                                                     0.7383]
    halves = sorted(float(seg[1, 1] - seg[0, 1]) / 2 for c in ax.collections
                    for seg in c.get_segments())
    expected = sorted(1.96 * (a * (1 - a) / 600) ** 0.5 for a in (0.7017, 0.705, 0.7267,
                                                                  0.7383))
    assert halves == pytest.approx(expected)
    with pytest.raises(ValueError, match="probe.*test"):
        zero_shot.ablation_figure({**results, "probe": {"test": 0, "accuracy_original": 0.7}})


def test_parse_hierarchy():
    assert zero_shot.parse_hierarchy(" 2,4,8,16 ") == (2, 4, 8, 16)
    assert zero_shot.parse_hierarchy("semantic") == "semantic"
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
        zero_shot.parse_hierarchy("2;4")
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
        zero_shot.parse_hierarchy("2,0")


def test_bad_sizes(tmp_path):
    parser = argparse.ArgumentParser()
    zero_shot.add_arguments(parser)
    args = parser.parse_args(["--quick", "--review-length", "600", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="at most 512"):
        zero_shot.run(args)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_shot")
    torch.manual_seed(0)
    results = zero_shot.main(["--quick", "--no-progress", "--out", str(out)])
    return out, results


def test_quick_run_writes_everything(quick):
    out, results = quick
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    text = (out / "results.md").read_text()
    assert "## Headline" in text and "| 1, 3, 5 | (2, 4, 8, 16) |" in text
    for name in ("ablation.png", "kl.png"):
        assert (out / name).stat().st_size > 10_000
    # the ablation: every hierarchy at start layer 3 (layers 3, 5), plus the headline
    cells = {(r["start_layer"], r["hierarchy"]) for r in results["ablation"]}
    assert cells == {(3, h) for h in ("(2, 2, 2, 2)", "(2, 4, 8, 16)", "(7, 7, 7, 7)",
                                      "(8, 4, 2)", "semantic")} | {(1, "(2, 4, 8, 16)")}


def test_quick_run_figures_are_consistent(quick):
    _, results = quick
    probe = results["probe"]
    # real embeddings of real sentences: the probe beats chance on held-out data
    assert probe["accuracy_original"] > 0.55
    for row in results["ablation"]:
        assert 0.0 <= row["accuracy"] <= 1.0
        assert row["accuracy_drop"] == pytest.approx(probe["accuracy_original"] - row["accuracy"])
        assert 0.0 < row["cosine_mean"] < 1.0            # changed, but related
        assert row["flop_reduction"] > 1.0
    head = results["headline"]
    assert head["layers"] == [1, 3, 5]
    # flat FLOPs at the mean length: 4 L^2 x 384
    length = round(probe["mean_tokens"])
    assert head["mflops_flat_at_mean_length"] == pytest.approx(4 * length ** 2 * 384 / 1e6)


def test_quick_run_hsa_has_the_lowest_kl(quick):
    """Theorem 3.2 on the real model's queries and keys: per layer and head, HSA's
    KL to softmax is at most that of the other block-constrained approximations."""
    _, results = quick
    for group in results["kl"].values():
        assert group["tokens"] > 0
        for per in group["kl"].values():
            hsa = torch.tensor(per["hsa"])
            assert hsa.shape == (6, 12) and bool((hsa > 0).all())
            for other in ("block_average", "pooled_softmax"):
                assert bool((hsa <= torch.tensor(per[other]) + 1e-9).all())


def test_parse_hierarchy_induced_and_sparse():
    from hsa_graph.pretrained.approximations import SparsePattern
    from hsa_graph.pretrained.hierarchy import InducedHierarchy

    assert zero_shot.parse_hierarchy("induced:4") == InducedHierarchy(4, "contiguous")
    assert zero_shot.parse_hierarchy("cluster:8") == InducedHierarchy(8, "cluster")
    assert zero_shot.parse_hierarchy("induced:4/mean").pool == "mean"
    assert zero_shot.parse_hierarchy("topk:16") == SparsePattern("topk", 16)
    for bad, match in (("induced:1", "max_children"), ("induced:x", "KIND:SIZE"),
                       ("ring:4", "KIND:SIZE"), ("topk:0", "topk size"),
                       ("local:-1", "KIND:SIZE"), ("local:2/mean", "induced hierarchies only")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            zero_shot.parse_hierarchy(bad)


def test_quick_run_budget_comparison(quick):
    out, results = quick
    assert (out / "kl_budget.png").stat().st_size > 10_000
    assert "## HSA vs sparse attention at matched budgets" in (out / "results.md").read_text()
    for group, table in results["budget"].items():
        methods = table["methods"]
        # the same KL as the KL table's HSA on the same texts (two code paths)
        for name in ("(2, 4, 8, 16)", "semantic"):
            expected = torch.tensor(results["kl"][group]["kl"][name]["hsa"])
            assert torch.allclose(torch.tensor(methods[name]["kl"]), expected, atol=1e-9)
        for kind in ("local", "topk"):   # nested supports: KL falls as the size grows
            points = sorted((m["size"], m["kl_mean"], m["budget"]) for m in methods.values()
                            if m["kind"] == kind)
            assert len(points) > 3
            assert all(b[1] <= a[1] + 1e-9 and b[2] >= a[2] for a, b in zip(points, points[1:]))
        for name, row in table["matched"].items():
            assert methods[name]["kind"] == "hsa" and row["sparse"]
            for s in row["sparse"].values():
                assert s["budget"] <= row["budget"] + 1e-9
                assert 0.0 <= s["hsa_lower_heads"] <= 1.0
        assert methods["induced:4"]["tree_ms_per_layer"] > 0
        assert methods["(2, 4, 8, 16)"]["tree_ms_per_layer"] == 0
    rows = {r["hierarchy"]: r for r in results["budget_probe"]}
    assert {"(2, 4, 8, 16)", "semantic", "induced:4", "cluster:4", "local:4", "topk:8"} <= set(rows)
    for r in rows.values():
        assert r["layers"] == [1, 3, 5] and 0.0 <= r["accuracy"] <= 1.0
        assert 0.0 < r["cosine_mean"] <= 1.0 and r["mflops_hsa_mean"] > 0
    assert rows["induced:4"]["tree_ms_per_layer"] > 0
    assert rows["(2, 4, 8, 16)"]["budget_mean"] > 1
    assert set(results["goals"]) == {"sentences", "reviews", "probe"}
