"""HSAttention(induce=...): the tree built from the layer's own keys at forward time,
checked against the same layer on that tree given explicitly and against the dense
reference (tests/reference.py)."""
from __future__ import annotations

import functools

import pytest
import torch
from reference import dense_hsa
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph.induce import contiguous_tree
from hsa_graph.nn import HSAttention
from hsa_graph.nn.classifier import TreeClassifier, attention_flops

DT = torch.float64


def _pair(**kwargs):
    """An inducing layer and the same weights attending over a given tree."""
    torch.manual_seed(0)
    induced = HSAttention(8, heads=2, **kwargs).to(DT)
    kwargs.pop("induce")
    plain = HSAttention(8, heads=2, **kwargs).to(DT)
    plain.load_state_dict(induced.state_dict())
    return induced, plain


@pytest.mark.parametrize("induce", ["contiguous", "cluster"])
def test_exact_on_the_induced_tree(induce):
    induced, plain = _pair(induce=induce, include_self=False)
    batch = torch.tensor([0] * 9 + [1] + [2] * 6)
    x = torch.randn(16, 8, dtype=DT)
    tree = induced.induced_tree(x, batch=batch)
    assert torch.equal(tree.structure.leaf_tree, batch)
    y = induced(x, batch=batch)
    torch.testing.assert_close(y, plain(x, tree))
    # and the formula, with the dense reference HSA on that tree
    q, k, v = plain._project(x, None)
    ref = dense_hsa(tree.parent.tolist(), q, k, v, include_self=False)
    torch.testing.assert_close(y, plain.out_proj(ref.reshape(16, 8)))


def test_gradients_are_those_of_hsa_on_the_chosen_tree():
    induced, plain = _pair(induce="contiguous")
    x = torch.randn(12, 8, dtype=DT, requires_grad=True)
    tree = induced.induced_tree(x)
    (induced(x) ** 2).sum().backward()
    grad_x, grad_w = x.grad.clone(), induced.qkv.weight.grad.clone()
    x.grad = None
    (plain(x, tree) ** 2).sum().backward()
    torch.testing.assert_close(grad_x, x.grad)
    torch.testing.assert_close(grad_w, plain.qkv.weight.grad)
    assert grad_w[0, 8:16].abs().sum() > 0  # the keys get gradient through HSA itself


def test_given_tree_sets_the_sequences_and_is_replaced():
    induced, plain = _pair(induce="contiguous")
    trees = [hsa_graph.hopping_window_tree(torch.randn(t, 8, dtype=DT), (2,))
             for t in (7, 5)]
    forest = Batch.from_data_list(trees)
    y = induced(forest.x, forest)
    tree = induced.induced_tree(forest.x, forest)
    assert torch.equal(tree.structure.leaf_tree, forest.structure.leaf_tree)
    torch.testing.assert_close(y, plain(forest.x, tree))
    assert not torch.allclose(y, plain(forest.x, forest))
    # attention never crosses the given trees
    x2 = forest.x.clone()
    x2[7:] = torch.randn(5, 8, dtype=DT)
    torch.testing.assert_close(induced(x2, forest)[:7], y[:7])


def test_callable_inducer_and_family_bound():
    pairs = functools.partial(contiguous_tree, max_children=2)
    layer = HSAttention(8, heads=2, induce=pairs).to(DT)
    x = torch.randn(11, 8, dtype=DT)
    tree = layer.induced_tree(x)
    sizes = torch.bincount(tree.parent[tree.parent >= 0])
    assert int(sizes.max()) == 2
    assert layer(x).shape == (11, 8)
    assert "induce=functools.partial" in repr(layer)


def test_positions_embed_the_induced_tree():
    induced, plain = _pair(induce="contiguous", pos_dim=4)
    x = torch.randn(10, 8, dtype=DT)
    tree = induced.induced_tree(x)
    torch.testing.assert_close(induced(x), plain(x, tree))


def test_classifier_with_induced_trees():
    torch.manual_seed(1)
    trees = [hsa_graph.NestedSignal.from_nested([[torch.randn(6)] * 3, [torch.randn(6)] * 4]),
             hsa_graph.NestedSignal.from_nested([torch.randn(6)] * 5)]
    for t, label in zip(trees, (0, 1)):
        t.y = torch.tensor([label])
    batch = Batch.from_data_list(trees)
    model = TreeClassifier(6, 2, channels=12, heads=3, pos_dim=4, num_layers=2,
                           induce="contiguous")
    model.train()
    loss = torch.nn.functional.cross_entropy(model(batch), batch.y)
    loss.backward()
    assert all(layer.attn.qkv.weight.grad.abs().sum() > 0 for layer in model.encoder.layers)
    induced = model.induced_trees(batch)
    assert len(induced) == 2 and model.training
    assert model.attention_flops(batch) == sum(attention_flops(t, 3, 4) for t in induced)
    assert all(torch.equal(t.structure.leaf_tree, batch.structure.leaf_tree) for t in induced)
    with pytest.raises(ValueError, match="induce="):
        TreeClassifier(6, 2, channels=12, heads=3).induced_trees(batch)


def test_bad_options_and_inputs():
    with pytest.raises(ValueError, match="induce must be one of"):
        HSAttention(8, induce="windows")
    with pytest.raises(TypeError, match="induce must be one of"):
        HSAttention(8, induce=3)
    with pytest.raises(ValueError, match="attention='flat' does not use"):
        HSAttention(8, induce="contiguous", attention="flat")
    with pytest.raises(ValueError, match="later tokens"):
        HSAttention(8, induce="contiguous", causal=True)
    x = torch.randn(5, 8)
    with pytest.raises(TypeError, match="needs a tree"):
        HSAttention(8)(x)
    layer = HSAttention(8, heads=2, induce="contiguous", pos_dim=4)
    tree = hsa_graph.hopping_window_tree(x, (2,))
    with pytest.raises(ValueError, match="pass pos=None"):
        layer(x, tree, torch.zeros(tree.num_nodes, 4))
    with pytest.raises(ValueError, match="batch= goes with tree=None"):
        layer(x, tree, batch=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch must be sorted"):
        layer(x, batch=torch.tensor([0, 1, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"x must have shape \[N, 8\]"):
        layer(torch.randn(5, 3))
    with pytest.raises(ValueError, match="one leaf per row of x"):
        HSAttention(8, induce=lambda k, b: contiguous_tree(k[:-1]))(x)
    with pytest.raises(ValueError, match="one leaf per row of x"):
        HSAttention(8, induce=lambda k, b: None)(x)
    with pytest.raises(ValueError, match="modalities: pass a tree"):
        HSAttention(8, induce="contiguous", num_modalities=2)(x)
    with pytest.raises(ValueError, match="induce="):
        HSAttention(8).induced_tree(x, tree)
