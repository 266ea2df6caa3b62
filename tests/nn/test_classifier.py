"""TreeClassifier: HSA, FSA and DeepSet on one code path, same size; attention FLOPs."""
import pytest
import torch
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph.builders.text import text_tree
from hsa_graph.nn import global_leaf_pool
from hsa_graph.nn.classifier import TreeClassifier, attention_flops

TEXT = ("Four score and seven years ago our fathers brought forth a new nation.\n\n"
        "Now we are engaged in a great civil war. We are met on a great battle-field.")


def _trees(dim=12):
    g = torch.Generator().manual_seed(0)
    trees = [text_tree(TEXT, embed=lambda ids: torch.randn(len(ids), dim, generator=g)),
             text_tree("It rained. We stayed in.\n\nThe sun came out!",
                       embed=lambda ids: torch.randn(len(ids), dim, generator=g))]
    for t in trees:
        del t.tokens, t.span
    return Batch.from_data_list(trees)


def _model(attention, **kwargs):
    torch.manual_seed(0)
    kwargs.setdefault("channels", 12)
    return TreeClassifier(12, 3, heads=3, hidden_channels=8, attention=attention, pos_dim=4,
                          dropout=0.0, **kwargs).eval()


@pytest.mark.parametrize("num_modalities", [1, 2])
def test_same_parameters_for_hsa_fsa_deepset(num_modalities):
    models = [_model(a, num_modalities=num_modalities) for a in ("hierarchical", "flat", "none")]
    shapes = [[(n, tuple(p.shape)) for n, p in m.named_parameters()] for m in models]
    assert shapes[0] == shapes[1] == shapes[2]
    counts = {m.num_parameters() for m in models}
    assert len(counts) == 1
    # independent count: input map, q/k/v + out, 3 LayerNorms of 4, LN 12, FFN 12-48-12, MLP
    assert models[0].input.weight.numel() == num_modalities * 12 * 12
    # same seed, same layout: identical initial weights, so only the attention differs
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_flat_attention_equals_hsa_on_the_flattened_tree():
    batch = _trees()
    flat_batch = Batch.from_data_list([hsa_graph.flatten(t) for t in batch.to_data_list()])
    fsa, hsa = _model("flat"), _model("hierarchical")
    hsa.load_state_dict(fsa.state_dict())
    out = fsa(batch)
    assert torch.allclose(out, hsa(flat_batch.x, flat_batch), atol=1e-5)
    # ... and HSA on the real tree is a different function
    assert not torch.allclose(out, hsa(batch), atol=1e-3)


def test_deepset_ignores_the_tree():
    batch = _trees()
    flat_batch = Batch.from_data_list([hsa_graph.flatten(t) for t in batch.to_data_list()])
    model = _model("none")
    assert torch.allclose(model(batch), model(flat_batch), atol=1e-6)
    # a leaf's representation is its own: permuting leaves within a tree changes nothing
    sizes = [t.num_leaves for t in batch.to_data_list()]
    perm = torch.cat([torch.randperm(n) + s for s, n in zip([0, sizes[0]], sizes)])
    assert torch.allclose(model(batch.x[perm], batch), model(batch), atol=1e-5)


def test_forward_is_mean_pool_then_mlp():
    batch = _trees()
    model = _model("hierarchical")
    h = model.encoder(model.input(batch.x), batch)
    expected = torch.stack([h[batch.structure.leaf_tree == t].mean(0) for t in range(2)])
    assert torch.allclose(model.embed(batch.x, batch), expected, atol=1e-6)
    assert torch.allclose(model(batch), model.mlp(expected), atol=1e-6)
    assert torch.allclose(global_leaf_pool(h, batch), expected, atol=1e-6)


def test_float16_features_are_accepted():
    batch = _trees()
    model = _model("hierarchical")
    assert torch.allclose(model(batch.x.half(), batch), model(batch.x.half().float(), batch))


def _families(parent):
    sizes = {}
    for p in parent:
        if p >= 0:
            sizes[p] = sizes.get(p, 0) + 1
    return [s for s in sizes.values() if s >= 2]


def test_attention_flops_against_a_direct_count():
    tree = _trees().to_data_list()[0]
    parent = tree.parent.tolist()
    m, n = len(parent), tree.num_leaves
    internal = m - n
    d, dv, h = 5, 7, 3
    pairs = sum(b * (b - 1) for b in _families(parent))
    expected = h * (pairs * (2 * d + 2 * dv + 3) + (m - 1) * (2 * d + dv)
                    + internal * (2 * d + dv) + (m - 1) * (2 * dv + 8))
    assert attention_flops(tree, h, d, dv) == expected
    flat = h * (n * (n - 1) * (2 * d + 2 * dv + 3) + n * (2 * d + dv) + (2 * d + dv)
                + n * (2 * dv + 8))
    assert attention_flops(tree, h, d, dv, attention="flat") == flat
    assert attention_flops(tree, h, d, dv, attention="none") == 0
    assert attention_flops(tree, h, d, dv) < flat
    # a batch counts the sum of its trees
    batch = _trees()
    assert attention_flops(batch, h, d) == sum(attention_flops(t, h, d)
                                               for t in batch.to_data_list())


def test_bad_input():
    batch = _trees()
    model = _model("hierarchical")
    with pytest.raises(ValueError, match="one row per leaf"):
        model(batch.x[:-1], batch)
    with pytest.raises(TypeError, match="floating"):
        model(batch.x.long(), batch)
    with pytest.raises(TypeError, match="NestedSignal"):
        model(batch.x, "tree")
    with pytest.raises(ValueError, match="attention"):
        TreeClassifier(12, 2, attention="sparse")
    with pytest.raises(ValueError, match="num_classes"):
        TreeClassifier(12, 1)
    with pytest.raises(ValueError, match="attention"):
        attention_flops(batch, 3, 4, attention="dense")


def test_repr_and_reset():
    model = _model("flat")
    assert repr(model).startswith("TreeClassifier(12, 3, channels=12, heads=3, attention='flat'")
    before = [p.clone() for p in model.parameters()]
    torch.manual_seed(1)
    model.reset_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_encode_is_what_embed_pools():
    torch.manual_seed(0)
    tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
    model = TreeClassifier(4, 3, 8, 2, pool="max").eval()
    x = torch.randn(5, 4)
    h = model.encode(x, tree)
    assert h.shape == (5, 8)
    torch.testing.assert_close(model.embed(x, tree), global_leaf_pool(h, tree, "max"))
    torch.testing.assert_close(model(x, tree), model.mlp(global_leaf_pool(h, tree, "max")))
