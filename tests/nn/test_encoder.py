"""The HTE layer (paper figure 4), the pre-norm block and the encoder stack: their
formulas, equivalence with torch's TransformerEncoderLayer on flat trees, shared
position features, baselines, gradcheck, and training on real text (float32, bfloat16
autocast, CUDA when present)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from network_data import pang_lee_sentences as load_pang_lee_sentences
from torch_geometric.data import Batch
from torch_geometric.loader import DataLoader

from hsa_graph import NestedSignal, Node, hsa
from hsa_graph.builders.text import WordTokenizer, text_trees
from hsa_graph.nn import (
    HierarchicalTransformerEncoder,
    HierarchicalTransformerEncoderLayer,
    HSATransformerEncoderLayer,
    global_leaf_pool,
)

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-10}
PARENT = [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4]
N_LEAVES = 7


def randomise_norms(module):
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, torch.nn.LayerNorm):
                sub.weight.normal_()
                sub.bias.normal_()


def test_hte_layer_is_figure_4():
    """LN after the per-modality projection (q, k, v), HSA per head plus the query,
    concat, linear, LN, FFN with a residual."""
    torch.manual_seed(0)
    modality = torch.tensor([0, 0, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0])
    tree = NestedSignal.from_parents(PARENT, modality=modality)
    layer = HierarchicalTransformerEncoderLayer(8, heads=2, num_modalities=2).to(DT)
    randomise_norms(layer)
    attn = layer.attn
    assert not attn.include_self and attn.query_residual  # the paper's defaults
    x = torch.randn(N_LEAVES, 8, dtype=DT)
    leaf_modality = modality[tree.leaf_index]
    qkv = torch.stack([attn.qkv.weight[t] @ row + attn.qkv.bias[t]
                       for row, t in zip(x, leaf_modality)])
    q, k, v = qkv.view(N_LEAVES, 3, 2, 4).unbind(1)
    q, k, v = attn.q_norm(q), attn.k_norm(k), attn.v_norm(v)
    heads = hsa(q, k, v, tree, include_self=False) + q
    h = layer.norm(attn.out_proj(heads.reshape(N_LEAVES, 8)))
    torch.testing.assert_close(layer(x, tree), h + layer.ffn(h), **TOL)


def test_pre_norm_layer_on_a_flat_tree_is_torch_transformer_layer():
    torch.manual_seed(1)
    c, heads, n = 8, 2, 6
    ref = torch.nn.TransformerEncoderLayer(c, heads, dim_feedforward=16, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True, dtype=DT)
    layer = HSATransformerEncoderLayer(c, heads, ffn_channels=16, qk_norm=False).to(DT)
    with torch.no_grad():
        layer.attn.qkv.weight[0].copy_(ref.self_attn.in_proj_weight)
        layer.attn.qkv.bias[0].copy_(ref.self_attn.in_proj_bias)
        layer.attn.out_proj.load_state_dict(ref.self_attn.out_proj.state_dict())
        layer.norm1.load_state_dict(ref.norm1.state_dict())
        layer.norm2.load_state_dict(ref.norm2.state_dict())
        layer.ffn[0].load_state_dict(ref.linear1.state_dict())
        layer.ffn[3].load_state_dict(ref.linear2.state_dict())
    x = torch.randn(n, c, dtype=DT)
    tree = NestedSignal.from_parents([-1] + [0] * n)
    torch.testing.assert_close(layer(x, tree), ref(x[None])[0], **TOL)


def test_encoder_shares_raw_position_features_across_layers():
    torch.manual_seed(2)
    tree = NestedSignal.from_nested({
        "title": [torch.randn(6) for _ in range(3)],
        "body": Node([[torch.randn(6) for _ in range(2)] for _ in range(2)], "grid"),
        "refs": Node([torch.randn(6) for _ in range(3)], "graph", edges=[(0, 1), (1, 2)])})
    encoder = HierarchicalTransformerEncoder(6, num_layers=2, heads=2, pos_dim=3).to(DT)
    first, second = (layer.attn.pos_encoder for layer in encoder.layers)
    assert first.field_names is second.field_names      # one field-name table
    assert first.lins["sequence"] is not second.lins["sequence"]   # a projection per layer
    x = tree.x.to(DT)
    expected = encoder.layers[1](encoder.layers[0](x, tree), tree)   # each its own features
    torch.testing.assert_close(encoder(x, tree), expected, **TOL)
    assert set(first.vocabulary if hasattr(first, "vocabulary") else
               first.field_names.vocabulary) == {"title", "body", "refs"}


@pytest.mark.parametrize("layer", ["hte", "pre_norm"])
def test_baselines_on_the_same_code_path(layer):
    torch.manual_seed(3)
    tree = NestedSignal.from_parents(PARENT)
    x = torch.randn(N_LEAVES, 8)
    hier = HierarchicalTransformerEncoder(8, 2, heads=2, layer=layer, pos_dim=2)
    flat = HierarchicalTransformerEncoder(8, 2, heads=2, layer=layer, pos_dim=2,
                                          attention="flat")
    deepset = HierarchicalTransformerEncoder(8, 2, heads=2, layer=layer, attention="none")
    flat.load_state_dict(hier.state_dict())
    deepset.load_state_dict(hier.state_dict(), strict=False)
    from hsa_graph import flatten
    torch.testing.assert_close(flat(x, tree), hier(x, flatten(tree)))
    # DeepSet: a leaf's output depends on that leaf only
    x2 = x.clone()
    x2[1:] = torch.randn(N_LEAVES - 1, 8)
    torch.testing.assert_close(deepset(x2, tree)[0], deepset(x, tree)[0])
    assert not torch.allclose(hier(x2, tree)[0], hier(x, tree)[0])


def _node_token_case(layer, num_layers, seed, schedule=None, scope="tree"):
    """Three ListOps trees with node tokens as one batch (``schedule``: the update layers
    each leaf draws from), an encoder in float64, inputs, and the leaf rows of the node
    tokens and of their sources, found by hand (a node's leaf row is its place among
    the leaves, in node order)."""
    from hsa_graph.datasets.listops import listops_tree

    torch.manual_seed(seed)
    trees = [listops_tree(e, node_tokens=True) for e in (
        "[SM [MAX 2 9 [MIN 4 7 ] ] 0 [MED 1 2 3 ] ]", "[MIN 5 [SM 3 4 ] ]", "[MAX 1 2 ]")]
    if schedule is not None:
        for t in trees:
            t.update_layer = torch.tensor(schedule)[torch.randint(len(schedule),
                                                                  (t.num_leaves,))]
    batch = Batch.from_data_list(trees)
    encoder = HierarchicalTransformerEncoder(6, num_layers, heads=2, layer=layer,
                                             pos_dim=2, scope=scope).to(DT)
    randomise_norms(encoder)
    x = torch.randn(batch.num_leaves, 6, dtype=DT)
    leaves = batch.is_leaf.nonzero().view(-1).tolist()
    rows = [leaves.index(u) for u in batch.mirror_index.tolist()]
    sources = [leaves.index(u) for u in batch.mirror_source_index.tolist()]
    return trees, batch, encoder, x, rows, sources


def _tree_by_tree(encoder, x, trees):
    starts = torch.tensor([0] + [t.num_leaves for t in trees]).cumsum(0).tolist()
    return torch.cat([encoder(x[a:a + t.num_leaves], t) for a, t in zip(starts, trees)])


@pytest.mark.parametrize("layer", ["hte", "pre_norm"])
def test_node_tokens_take_their_source_s_features_after_every_layer(layer):
    trees, batch, encoder, x, rows, sources = _node_token_case(layer, 3, 5)
    assert len(rows) == 4
    h = x
    for block in encoder.layers:
        h = block(h, batch).clone()
        h[rows] = h[sources]
    expected = h if encoder.norm is None else encoder.norm(h)
    out = encoder(x, batch)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(out[rows], out[sources], **TOL)
    # trees one by one: the same rows (batching offsets the node ids)
    torch.testing.assert_close(out, _tree_by_tree(encoder, x, trees), **TOL)
    # without the node tokens' attributes the same leaves are plain tokens
    del batch.mirror_index, batch.mirror_source_index
    assert not torch.allclose(encoder(x, batch), out)


def test_node_token_attributes_are_checked():
    tree = NestedSignal.from_parents(PARENT)
    encoder = HierarchicalTransformerEncoder(4, 1)
    x = torch.randn(N_LEAVES, 4)
    leaves = tree.is_leaf.nonzero().view(-1)
    internal = (~tree.is_leaf).nonzero().view(-1)
    for index, source, match in [
            (leaves[:1], None, "needs both"),
            (leaves[:2], leaves[2:3], "same length"),
            (leaves[:2].float(), leaves[2:4], "1-D long tensor"),
            (leaves[:1], internal[1:2], "must name leaves; node 1 is internal"),
            (torch.tensor([40]), leaves[:1], r"outside \[0, 12\)"),
            (leaves[[0, 0]], leaves[1:3], "each leaf once"),
            (leaves[:2], leaves[1:3], "itself be a node token")]:
        bad = tree.clone()
        bad.mirror_index = index
        if source is not None:
            bad.mirror_source_index = source
        with pytest.raises(ValueError, match=match):
            encoder(x, bad)


@pytest.mark.parametrize("layer", ["hte", "pre_norm"])
def test_update_layer_has_each_leaf_take_one_layer_s_output(layer):
    # layer 3 of 4 is nobody's turn
    trees, batch, encoder, x, rows, sources = _node_token_case(layer, 4, 6, [0, 1, 2, 4])
    step = batch.update_layer.tolist()
    h = x.clone()
    for t, block in enumerate(encoder.layers, 1):   # by hand, row by row
        out = block(h, batch)
        for i in range(len(step)):
            if step[i] == t:
                h[i] = out[i]
        h[rows] = h[sources]
    expected = h if encoder.norm is None else encoder.norm(h)
    calls = []
    handles = [b.register_forward_hook(lambda m, a, o, t=t: calls.append(t))
               for t, b in enumerate(encoder.layers, 1)]
    out = encoder(x, batch)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(out, expected, **TOL)
    assert calls == [1, 2, 4]                       # the idle layer is skipped
    kept = [i for i in range(len(step)) if step[i] == 0 and i not in rows]
    assert kept and torch.equal(h[kept], x[kept])    # 0: the input, for good
    torch.testing.assert_close(out, _tree_by_tree(encoder, x, trees), **TOL)
    # without the schedule every leaf takes every layer's output: another result
    del batch.update_layer
    assert not torch.allclose(encoder(x, batch), out)


def _cut_above(batch, leaf_rows, siblings=False):
    """The batch's parent list with the parents of ``leaf_rows`` made roots (and with
    ``siblings`` those parents' internal children too), by hand."""
    parent = batch.parent.tolist()
    leaves = [u for u in range(len(parent)) if u not in parent]
    families = {parent[leaves[i]] for i in leaf_rows}
    cut = list(parent)
    for u in range(len(parent)):
        if u in families or (siblings and parent[u] in families and u in parent):
            cut[u] = -1
    return cut


@pytest.mark.parametrize("scope", ["family", "siblings"])
@pytest.mark.parametrize("layer", ["hte", "pre_norm"])
def test_family_scope_confines_each_layer_to_its_rows_families(layer, scope):
    trees, batch, encoder, x, rows, sources = _node_token_case(layer, 4, 8, [0, 1, 2, 4],
                                                               scope=scope)
    step = batch.update_layer.tolist()
    h = x.clone()
    for t, block in enumerate(encoder.layers, 1):   # by hand, a cut tree per layer
        turn = [i for i in range(len(step)) if step[i] == t]
        if not turn:
            continue
        position = batch.position.clone()
        cut = _cut_above(batch, turn, siblings=scope == "siblings")
        position[[u for u in range(len(cut)) if cut[u] < 0]] = -1
        scoped = NestedSignal.from_parents(cut, geometry=batch.geometry, position=position)
        features = encoder.layers[0].attn.pos_encoder.features(scoped)
        out = block(h, scoped, features)
        h[turn] = out[turn]
        h[rows] = h[sources]
    expected = h if encoder.norm is None else encoder.norm(h)
    out = encoder(x, batch)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(out, _tree_by_tree(encoder, x, trees), **TOL)
    encoder.scope = "tree"                            # the whole tree: another result
    assert not torch.allclose(encoder(x, batch), out)


@pytest.mark.parametrize("scope", ["family", "siblings"])
def test_family_scope_reads_nothing_outside_the_rows_families(scope):
    """A nested operator's token, computed at its height, is the same whatever its
    expression sits in: nothing outside its own subtree reaches it."""
    from hsa_graph.experiments.listops import build_examples

    torch.manual_seed(3)
    inner = "[MED 1 [MAX 4 5 ] 6 ]"      # height 2 in both expressions
    batch = Batch.from_data_list(build_examples(
        [(f"[MIN 3 {inner} ]", 3), (f"[SM 9 9 [MAX 0 {inner} 8 ] 2 ]", 8)],
        "parse_bottom_up"))
    x = torch.randn(int(batch.x.max()) + 1, 6, dtype=DT)[batch.x]   # one input per token
    med = (batch.update_layer == 2).nonzero().view(-1)
    assert med.numel() == 2 and batch.x[med[0]] == batch.x[med[1]]
    encoder = HierarchicalTransformerEncoder(6, 4, heads=2, layer="pre_norm",
                                             scope=scope).to(DT)
    randomise_norms(encoder)
    out = encoder(x, batch)
    torch.testing.assert_close(out[med[0]], out[med[1]], **TOL)
    other = "siblings" if scope == "family" else "family"
    encoder.scope = other                # the subtrees as blocks, or not: another result
    assert not torch.allclose(encoder(x, batch)[med[0]], out[med[0]])
    encoder.scope = "tree"               # the whole tree: the contexts differ
    out = encoder(x, batch)
    assert not torch.allclose(out[med[0]], out[med[1]])


def test_family_scope_is_checked():
    tree = NestedSignal.from_parents(PARENT)
    x = torch.randn(N_LEAVES, 4)
    with pytest.raises(ValueError, match="scope must be one of"):
        HierarchicalTransformerEncoder(4, 2, scope="subtree")
    encoder = HierarchicalTransformerEncoder(4, 2, scope="family")
    with pytest.raises(ValueError, match="needs a layer schedule"):
        encoder(x, tree)
    # a node whose children are all parents of a layer's rows would become a leaf
    orphan = NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2])
    orphan.update_layer = torch.tensor([1, 0, 1, 0])
    with pytest.raises(ValueError, match="cuts node 0 off every one of its children"):
        encoder(torch.randn(4, 4), orphan)


def test_update_layer_is_checked():
    tree = NestedSignal.from_parents(PARENT)
    encoder = HierarchicalTransformerEncoder(4, 2)
    x = torch.randn(N_LEAVES, 4)
    for schedule, match in [(torch.ones(N_LEAVES), "long tensor"),
                            (torch.ones(N_LEAVES - 1, dtype=torch.long), r"\[N\] = \[7\]"),
                            ([1] * N_LEAVES, "long tensor"),
                            (torch.tensor([0, 1, 2, 3, 0, 0, 0]), "0..2.*got 3"),
                            (torch.tensor([0, 1, -1, 0, 0, 0, 0]), "0..2.*got -1")]:
        bad = tree.clone()
        bad.update_layer = schedule
        with pytest.raises(ValueError, match=match):
            encoder(x, bad)


def test_gradcheck_hte_layer_float64():
    torch.manual_seed(4)
    tree = NestedSignal.from_parents(PARENT)
    layer = HierarchicalTransformerEncoderLayer(4, heads=2, ffn_channels=6, pos_dim=2).to(DT)
    x = torch.randn(N_LEAVES, 4, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: layer(x, tree), (x,))


def test_reset_parameters_and_repr():
    encoder = HierarchicalTransformerEncoder(8, num_layers=2, heads=2, pos_dim=4)
    before = encoder.layers[1].ffn[0].weight.clone()
    encoder.reset_parameters()
    assert not torch.equal(before, encoder.layers[1].ffn[0].weight)
    assert repr(encoder) == ("HierarchicalTransformerEncoder(8, num_layers=2, heads=2, "
                             "layer='hte', attention='hierarchical', pos_dim=4)")
    assert repr(encoder.layers[0]) == ("HierarchicalTransformerEncoderLayer(8, heads=2, "
                                       "attention='hierarchical', pos_dim=4, num_modalities=1)")
    with pytest.raises(ValueError, match="layer must be one of"):
        HierarchicalTransformerEncoder(8, 2, layer="post_norm")


# ------------------------------------------------------------ training, real text
@pytest.fixture(scope="module")
def sentences():
    """96 labelled snippets of Pang & Lee's sentence polarity data, as text trees
    with hashed ids into a small table."""
    data = load_pang_lee_sentences()
    data = data[:48] + data[-48:]  # both classes
    trees = text_trees([text for text, _ in data],
                       tokenizer=WordTokenizer(num_buckets=4096)).to_data_list()
    for tree, (_, label) in zip(trees, data):
        tree.y = torch.tensor([label])
        del tree.tokens, tree.span
    return trees


class Classifier(torch.nn.Module):
    def __init__(self, layer: str = "hte"):
        super().__init__()
        self.embed = torch.nn.Embedding(4096, 16)
        self.encoder = HierarchicalTransformerEncoder(16, 2, heads=2, layer=layer, pos_dim=4)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, batch):
        x = self.encoder(self.embed(batch.x), batch)
        return self.head(global_leaf_pool(x, batch))


def train_steps(trees, device: str = "cpu", autocast_dtype=None, layer: str = "hte",
                steps: int = 12):
    torch.manual_seed(5)
    model = Classifier(layer).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = next(iter(DataLoader(trees, batch_size=len(trees)))).to(device)
    losses = []
    for _ in range(steps):
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = F.cross_entropy(model(batch), batch.y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("layer", ["hte", "pre_norm"])
def test_training_float32_lowers_the_loss(sentences, layer):
    losses = train_steps(sentences, layer=layer)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]


def test_training_bfloat16_autocast_lowers_the_loss(sentences):
    losses = train_steps(sentences, autocast_dtype=torch.bfloat16)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]


def test_dataloader_batches_match_single_trees(sentences):
    torch.manual_seed(6)
    model = Classifier().eval()
    batch = next(iter(DataLoader(sentences[:5], batch_size=5)))
    assert isinstance(batch, Batch)
    together = model(batch)
    alone = torch.cat([model(Batch.from_data_list([tree])) for tree in sentences[:5]])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_training_on_cuda(sentences, autocast_dtype):
    losses = train_steps(sentences, device="cuda", autocast_dtype=autocast_dtype)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("step,held", [([1, 0, 2, 0], [[0, 1], [2, 3]]),
                                       ([1, 0, 1, 2, 0, 0, 0], [[0, 1, 2], [3, 4, 5]]),
                                       ([1, 0, 0, 2, 0, 0, 2, 1], [[0, 1, 2, 7],
                                                                   [3, 4, 5, 6]])])
def test_siblings_scope_computes_the_turn_s_families_alone(step, held, monkeypatch):
    """``scope="siblings"`` runs each turn's layers over its rows' families alone (one
    forest per turn, the families' leaf rows and nothing else: ``held``), with the
    result of the whole tree cut above the rows' parents and their internal children.
    The trees: node 0 over nodes 1 and 2 (and a leaf, 9, in the second and third), and
    in the third a lone leaf (node 10, row 7), scheduled: a tree of its own."""
    import hsa_graph.nn.encoder as encoder_module

    parent = {4: [-1, 0, 0, 1, 1, 2, 2], 7: [-1, 0, 0, 1, 1, 1, 2, 2, 2, 0],
              8: [-1, 0, 0, 1, 1, 1, 2, 2, 2, 0, -1]}[len(step)]
    tree = NestedSignal.from_parents(parent)
    tree.update_layer = torch.tensor(step)
    torch.manual_seed(5)
    encoder = HierarchicalTransformerEncoder(4, 2, heads=2, layer="pre_norm",
                                             scope="siblings").to(DT)
    randomise_norms(encoder)
    x = torch.randn(len(step), 4, dtype=DT)
    forests, sizes = [], []
    real = encoder_module._sibling_forest

    def spy(*args, **kwargs):
        forest, rows = real(*args, **kwargs)
        forests.append(rows.tolist())
        return forest, rows

    monkeypatch.setattr(encoder_module, "_sibling_forest", spy)
    handles = [layer.register_forward_pre_hook(
        lambda module, args: sizes.append(args[0].shape[0])) for layer in encoder.layers]
    out = encoder(x, tree)
    for handle in handles:
        handle.remove()
    assert forests == held and sizes == [len(rows) for rows in held]
    h = x.clone()
    for t, block in enumerate(encoder.layers, 1):      # by hand, the whole tree cut
        turn = [i for i in range(len(step)) if step[i] == t]
        scoped = NestedSignal.from_parents(_cut_above(tree, turn, siblings=True))
        h[turn] = block(h, scoped)[turn]
    torch.testing.assert_close(out, encoder.norm(h), **TOL)


@pytest.mark.parametrize("scope", ["tree", "family", "siblings"])
@pytest.mark.parametrize("layer", ["hte", "pre_norm"])
def test_turn_layers_run_a_stack_per_turn(layer, scope):
    """With ``turn_layers=2`` turn ``t`` is layers ``2t - 1`` and ``2t``, one after the
    other over the turn's rows (the others keep their features between them), and the
    node tokens take their sources' features after each turn, not between its layers:
    here every leaf of a family shares its turn, node tokens included."""
    trees, batch, encoder, x, rows, sources = _node_token_case(layer, 4, 9, scope=scope)
    for tree in trees:
        tree.update_layer = _family_turns(tree)
    batch = Batch.from_data_list(trees)
    encoder = HierarchicalTransformerEncoder(6, 4, heads=2, layer=layer, pos_dim=2,
                                             scope=scope, turn_layers=2).to(DT)
    randomise_norms(encoder)
    assert encoder.num_turns == 2 and "turn_layers=2" in repr(encoder)
    step = batch.update_layer.tolist()
    assert set(step) == {1, 2} and {step[i] for i in rows} == {2}
    h = x.clone()
    for t in (1, 2):                                   # by hand, a cut tree per turn
        turn = [i for i in range(len(step)) if step[i] == t]
        scoped, features = batch, encoder.layers[0].attn.pos_encoder.features(batch)
        if scope != "tree":
            position = batch.position.clone()
            cut = _cut_above(batch, turn, siblings=scope == "siblings")
            position[[u for u in range(len(cut)) if cut[u] < 0]] = -1
            scoped = NestedSignal.from_parents(cut, geometry=batch.geometry,
                                               position=position)
            features = encoder.layers[0].attn.pos_encoder.features(scoped)
        for block in encoder.layers[2 * t - 2:2 * t]:
            h[turn] = block(h, scoped, features)[turn]
        h[rows] = h[sources]
    expected = h if encoder.norm is None else encoder.norm(h)
    out = encoder(x, batch)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(out, _tree_by_tree(encoder, x, trees), **TOL)
    encoder.turn_layers = 1                            # four turns of one: another result
    batch.update_layer = batch.update_layer * 2 - 1
    assert not torch.allclose(encoder(x, batch), out)


def _family_turns(batch):
    """Each leaf's turn: 1 in a family of leaves alone, 2 in one with an internal child
    (by hand, from the parent list)."""
    parent = batch.parent.tolist()
    leaves = [u for u in range(len(parent)) if u not in parent]
    has_internal = {parent[u] for u in range(len(parent)) if u in parent and parent[u] >= 0}
    return torch.tensor([2 if parent[u] in has_internal else 1 for u in leaves])


def test_turn_layers_are_checked():
    with pytest.raises(ValueError, match="multiple of turn_layers"):
        HierarchicalTransformerEncoder(4, 3, turn_layers=2)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="turn_layers must be a positive int"):
            HierarchicalTransformerEncoder(4, 2, turn_layers=bad)
    tree = NestedSignal.from_parents(PARENT)
    tree.update_layer = torch.tensor([0, 1, 2, 0, 0, 0, 0])
    encoder = HierarchicalTransformerEncoder(4, 2, turn_layers=2)
    with pytest.raises(ValueError, match="0..1.*got 2"):   # one turn of two layers
        encoder(torch.randn(N_LEAVES, 4), tree)
    encoder.layers = torch.nn.ModuleList([encoder.layers[0]] * 3)   # miscounted
    with pytest.raises(ValueError, match="3 layers do not split into turns"):
        encoder(torch.randn(N_LEAVES, 4), tree)
