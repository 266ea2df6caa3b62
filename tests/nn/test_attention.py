"""HSAttention and ModalityLinear: against torch.nn.MultiheadAttention on flat trees,
against the independent dense reference (tests/reference.py) on hierarchical ones, and
each option (modalities, norms, positions, modes, dropout) on its own."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import dense_hsa
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph import NestedSignal, Node
from hsa_graph.nn import HSAttention, ModalityLinear, attention_tree

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-10}
# a 3-level tree: root 0 -> {1, 2, 3}; 1 -> {4, 5}; 2 -> {6, 7, 8}; 3 -> {9}; 4 -> {10, 11}
PARENT = [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4]
LEAVES = [5, 6, 7, 8, 9, 10, 11]


def flat_tree(n: int) -> NestedSignal:
    return NestedSignal.from_parents([-1] + [0] * n)


def copy_from_mha(attn: HSAttention, mha: torch.nn.MultiheadAttention) -> None:
    with torch.no_grad():
        attn.qkv.weight[0].copy_(mha.in_proj_weight)
        attn.qkv.bias[0].copy_(mha.in_proj_bias)
        attn.out_proj.weight.copy_(mha.out_proj.weight)
        attn.out_proj.bias.copy_(mha.out_proj.bias)


def reference_output(attn: HSAttention, x: torch.Tensor, parent, modality=None, pos=None):
    """The layer's formula with the dense reference HSA of tests/reference.py."""
    h, d = attn.heads, attn.head_channels
    w, b = attn.qkv.weight, attn.qkv.bias
    if modality is None:
        modality = torch.zeros(x.shape[0], dtype=torch.long)
    qkv = torch.einsum("nio,ni->no", w[modality].transpose(1, 2), x) + b[modality]
    q, k, v = qkv.view(-1, 3, h, d).unbind(1)
    if attn.q_norm is not None:
        q = F.layer_norm(q, (d,), attn.q_norm.weight, attn.q_norm.bias)
        k = F.layer_norm(k, (d,), attn.k_norm.weight, attn.k_norm.bias)
    if attn.v_norm is not None:
        v = F.layer_norm(v, (d,), attn.v_norm.weight, attn.v_norm.bias)
    y = dense_hsa(parent, q, k, v, include_self=attn.include_self, pos=pos)
    if attn.query_residual:
        y = y + q
    return attn.out_proj(y.reshape(x.shape[0], h * d))


@pytest.mark.parametrize("include_self", [True, False])
def test_flat_tree_matches_multihead_attention(include_self):
    torch.manual_seed(0)
    n, c, heads = 9, 12, 3
    mha = torch.nn.MultiheadAttention(c, heads, batch_first=True, dtype=DT)
    torch.nn.init.normal_(mha.in_proj_bias)
    attn = HSAttention(c, heads, qk_norm=False, include_self=include_self).to(DT)
    copy_from_mha(attn, mha)
    x = torch.randn(n, c, dtype=DT)
    mask = None if include_self else torch.eye(n, dtype=torch.bool)  # True = not allowed
    expected = mha(x[None], x[None], x[None], attn_mask=mask, need_weights=False)[0][0]
    torch.testing.assert_close(attn(x, flat_tree(n)), expected, **TOL)


def test_flat_trees_in_a_batch_match_multihead_attention_per_sequence():
    torch.manual_seed(1)
    c, heads = 8, 2
    mha = torch.nn.MultiheadAttention(c, heads, batch_first=True, dtype=DT)
    attn = HSAttention(c, heads, qk_norm=False).to(DT)
    copy_from_mha(attn, mha)
    sizes = [4, 7, 1]
    xs = [torch.randn(s, c, dtype=DT) for s in sizes]
    batch = Batch.from_data_list([flat_tree(s) for s in sizes])
    out = attn(torch.cat(xs), batch).split(sizes)
    for x, y in zip(xs, out):
        torch.testing.assert_close(y, mha(x[None], x[None], x[None])[0][0], **TOL)


@pytest.mark.parametrize("include_self", [True, False])
def test_hierarchical_tree_matches_dense_reference(include_self):
    torch.manual_seed(2)
    tree = NestedSignal.from_parents(PARENT)
    attn = HSAttention(8, heads=2, include_self=include_self, v_norm=True).to(DT)
    with torch.no_grad():  # non-trivial norm parameters
        for norm in (attn.q_norm, attn.k_norm, attn.v_norm):
            norm.weight.normal_()
            norm.bias.normal_()
    x = torch.randn(len(LEAVES), 8, dtype=DT)
    torch.testing.assert_close(attn(x, tree), reference_output(attn, x, PARENT), **TOL)


def test_per_modality_projections():
    torch.manual_seed(3)
    modality = torch.tensor([0, 0, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0])
    tree = NestedSignal.from_parents(PARENT, modality=modality)
    attn = HSAttention(6, heads=2, num_modalities=2).to(DT)
    with torch.no_grad():
        attn.qkv.bias.normal_()
    x = torch.randn(len(LEAVES), 6, dtype=DT)
    leaf_modality = modality[LEAVES]
    expected = reference_output(attn, x, PARENT, modality=leaf_modality)
    torch.testing.assert_close(attn(x, tree), expected, **TOL)
    # the second set of weights matters exactly for the leaves of modality 1
    single = NestedSignal.from_parents(PARENT)  # all modality 0
    before = attn(x, single)
    with torch.no_grad():
        attn.qkv.weight[1].normal_()
    torch.testing.assert_close(attn(x, single), before, **TOL)
    assert not torch.allclose(attn(x, tree), expected)


def test_modality_out_of_range_is_named():
    tree = NestedSignal.from_parents([-1, 0, 0], modality=[0, 0, 2])
    attn = HSAttention(4, num_modalities=2)
    with pytest.raises(ValueError, match="row 1 has modality tag 2"):
        attn(torch.randn(2, 4), tree)


def test_modality_linear_groups_rows_by_tag():
    torch.manual_seed(4)
    lin = ModalityLinear(3, 5, num_modalities=3)
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(7, 3)
    tag = torch.tensor([2, 0, 1, 2, 2, 0, 1])
    expected = torch.stack([lin.weight[t] @ row + lin.bias[t] for row, t in zip(x, tag)])
    torch.testing.assert_close(lin(x, tag), expected)
    assert repr(lin) == "ModalityLinear(3, 5, num_modalities=3, bias=True)"
    with pytest.raises(ValueError, match="pass each row's modality tag"):
        lin(x)


def test_positions_enter_the_logits_per_geometry():
    torch.manual_seed(5)
    tree = NestedSignal.from_nested({
        "title": [torch.randn(4) for _ in range(3)],
        "body": Node([[torch.randn(4) for _ in range(2)] for _ in range(2)], "grid"),
        "tags": Node([torch.randn(4) for _ in range(3)], "set")})
    attn = HSAttention(4, heads=2, head_channels=3, pos_dim=5).to(DT)
    x = tree.x.to(DT)
    pos = attn.pos_encoder(tree)
    assert pos.shape == (tree.num_nodes, 2, 5) and pos.abs().sum() > 0
    expected = reference_output(attn, x, tree.parent.tolist(), pos=pos)
    out = attn(x, tree)
    torch.testing.assert_close(out, expected, **TOL)
    # precomputed raw features, or a ready tensor, give the same
    torch.testing.assert_close(attn(x, tree, attn.pos_encoder.features(tree)), out, **TOL)
    torch.testing.assert_close(attn(x, tree, pos.detach()), out, **TOL)
    # and positions do change the output
    plain = HSAttention(4, heads=2, head_channels=3).to(DT)
    plain.load_state_dict({k: v for k, v in attn.state_dict().items()
                           if not k.startswith("pos_encoder")})
    assert not torch.allclose(plain(x, tree), out)


def test_set_children_get_no_position():
    """Children of 'set' nodes (and roots) have zero embeddings: a tree of sets gives
    the same output with or without a position encoder."""
    torch.manual_seed(6)
    tree = NestedSignal.from_parents(PARENT, geometry="set")
    attn = HSAttention(6, heads=2, pos_dim=4)
    plain = HSAttention(6, heads=2)
    plain.load_state_dict({k: v for k, v in attn.state_dict().items()
                           if not k.startswith("pos_encoder")})
    x = torch.randn(len(LEAVES), 6)
    torch.testing.assert_close(attn(x, tree), plain(x, tree))


def test_flat_mode_is_the_layer_on_the_flattened_tree():
    torch.manual_seed(7)
    tree = NestedSignal.from_parents(PARENT)
    hier = HSAttention(6, heads=3, pos_dim=2)
    flat = HSAttention(6, heads=3, pos_dim=2, attention="flat")
    flat.load_state_dict(hier.state_dict())
    x = torch.randn(len(LEAVES), 6)
    torch.testing.assert_close(flat(x, tree), hier(x, hsa_graph.flatten(tree)))
    assert not torch.allclose(flat(x, tree), hier(x, tree))
    assert attention_tree(tree, "flat") is attention_tree(tree, "flat")  # cached


def test_none_mode_attends_only_to_itself():
    torch.manual_seed(8)
    tree = NestedSignal.from_parents(PARENT)
    attn = HSAttention(6, heads=2, attention="none", v_norm=True)
    x = torch.randn(len(LEAVES), 6)
    out = attn(x, tree)
    v = attn.qkv(x)[:, 12:].view(-1, 2, 3)
    torch.testing.assert_close(out, attn.out_proj(attn.v_norm(v).reshape(-1, 6)))
    # a leaf's output depends on nothing else
    x2 = x.clone()
    x2[1:] = torch.randn(len(LEAVES) - 1, 6)
    torch.testing.assert_close(attn(x2, tree)[0], out[0])


def test_dropout_zeroes_attention_outputs_only_in_training():
    torch.manual_seed(9)
    tree = NestedSignal.from_parents(PARENT)
    attn = HSAttention(8, heads=2, dropout=0.5)
    with torch.no_grad():  # identity output projection: the output is the dropped HSA
        attn.out_proj.weight.copy_(torch.eye(8))
        attn.out_proj.bias.zero_()
    x = torch.randn(len(LEAVES), 8)
    attn.eval()
    clean = attn(x, tree)
    torch.testing.assert_close(attn(x, tree), clean)
    attn.train()
    dropped = attn(x, tree)
    kept = dropped != 0
    assert 0.25 < kept.float().mean() < 0.75
    torch.testing.assert_close(dropped[kept], 2 * clean[kept])


def test_batch_independence_and_leaf_rows():
    torch.manual_seed(10)
    a = NestedSignal.from_parents(PARENT)
    b = NestedSignal.from_parents([-1, 0, 0, 1, 1])
    attn = HSAttention(4, heads=2, pos_dim=2).to(DT)
    xa, xb = torch.randn(7, 4, dtype=DT), torch.randn(3, 4, dtype=DT)
    out = attn(torch.cat([xb, xa]), Batch.from_data_list([b, a]))
    torch.testing.assert_close(out[:3], attn(xb, b), **TOL)
    torch.testing.assert_close(out[3:], attn(xa, a), **TOL)


def test_gradcheck_float64():
    torch.manual_seed(11)
    modality = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1])
    tree = NestedSignal.from_parents(PARENT, modality=modality)
    attn = HSAttention(4, heads=2, num_modalities=2, pos_dim=2, v_norm=True,
                       include_self=False, query_residual=True).to(DT)
    params = dict(attn.named_parameters())
    names = ["qkv.weight", "pos_encoder.lins.sequence.weight", "q_norm.weight"]

    def f(x, *weights):
        return torch.func.functional_call(attn, {**params, **dict(zip(names, weights))},
                                          (x, tree))

    x = torch.randn(len(LEAVES), 4, dtype=DT, requires_grad=True)
    weights = [params[n].detach().clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(f, (x, *weights))


def test_autocast_bfloat16_keeps_attention_in_float32(monkeypatch):
    torch.manual_seed(12)
    tree = NestedSignal.from_parents(PARENT)
    attn = HSAttention(16, heads=2, pos_dim=4)
    x = torch.randn(len(LEAVES), 16)
    full = attn(x, tree)
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, kwargs["pos"].dtype,
                     torch.is_autocast_enabled("cpu")))
        return hsa_graph.hsa(q, k, v, *args, **kwargs)

    monkeypatch.setattr("hsa_graph.nn.attention.hsa", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = attn(x, tree)
    assert seen == [(torch.float32,) * 4 + (False,)]   # HSA itself: float32, no autocast
    assert half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max() < 0.05
    bf16 = attn.to(torch.bfloat16)(x.bfloat16(), tree)     # a bfloat16 model, no autocast
    assert bf16.dtype == torch.bfloat16 and (bf16.float() - full).abs().max() < 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    torch.manual_seed(13)
    tree = NestedSignal.from_parents(PARENT)
    attn = HSAttention(8, heads=2, pos_dim=4, num_modalities=1)
    x = torch.randn(len(LEAVES), 8)
    expected = attn(x, tree)
    out = attn.cuda()(x.cuda(), tree.to("cuda"))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        half = attn(x.cuda(), tree.to("cuda"))
    assert half.dtype == torch.bfloat16
    assert (half.float().cpu() - expected).abs().max() < 0.05


def test_reset_parameters_and_repr():
    attn = HSAttention(8, heads=2, out_channels=6, pos_dim=4, num_modalities=2)
    before = {k: v.clone() for k, v in attn.state_dict().items() if isinstance(v, torch.Tensor)}
    attn.reset_parameters()
    after = attn.state_dict()
    assert not torch.equal(before["qkv.weight"], after["qkv.weight"])
    assert not torch.equal(before["out_proj.weight"], after["out_proj.weight"])
    assert not torch.equal(before["pos_encoder.lins.sequence.weight"],
                           after["pos_encoder.lins.sequence.weight"])
    assert repr(attn) == (
        "HSAttention(8, 6, heads=2, head_channels=4, attention='hierarchical', "
        "include_self=True, qk_norm=True, v_norm=False, num_modalities=2, pos_dim=4, "
        "dropout=0.0)")


def test_bad_inputs_are_named():
    tree = NestedSignal.from_parents(PARENT)
    attn = HSAttention(4, heads=2)
    with pytest.raises(ValueError, match=r"one row per leaf \(N = 7\)"):
        attn(torch.randn(6, 4), tree)
    with pytest.raises(ValueError, match=r"shape \[N, 4\]"):
        attn(torch.randn(7, 5), tree)
    with pytest.raises(TypeError, match="embed token ids first"):
        attn(torch.arange(7), tree)
    with pytest.raises(TypeError, match="NestedSignal"):
        attn(torch.randn(7, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="no position encoder"):
        attn(torch.randn(7, 4), tree, {})
    with pytest.raises(ValueError, match="not divisible by heads"):
        HSAttention(6, heads=4)
    with pytest.raises(ValueError, match="attention must be one of"):
        HSAttention(4, attention="sparse")
    with pytest.raises(ValueError, match="dropout"):
        HSAttention(4, dropout=1.0)
    with pytest.raises(ValueError, match="pos_kwargs given without pos_dim"):
        HSAttention(4, pos_kwargs={"dim": 8})


# ------------------------------------------------------------------------ causal
# root 0 -> {1, 2, 3}; 1 -> {4, 5, 6}; 2 -> {7, 8}; 3 -> {9}; 9 -> {10, 11}: every
# node's leaves are a contiguous run, as causal HSA needs
CAUSAL_PARENT = [-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 9, 9]


def steps_over(attn: HSAttention, x: torch.Tensor, tree, tags=None) -> torch.Tensor:
    """The layer's outputs token by token, each hung where ``tree`` has it (with its
    modality tag from ``tags``)."""
    cache = attn.new_cache()
    moves = hsa_graph.HSACache.moves_of(tree)
    extra = [{} if tags is None else dict(modality=t) for t in tags or [None] * len(moves)]
    return torch.stack([attn.step(x[i], cache, **moves[i], **extra[i])
                        for i in range(x.shape[0])])


@pytest.mark.parametrize("settings", [
    dict(qk_norm=True), dict(qk_norm=False), dict(qk_norm=False, include_self=False),
    dict(v_norm=True, query_residual=True, include_self=False), dict(scale=0.3),
    dict(head_channels=5, out_channels=7), dict(attention="flat"), dict(attention="none")])
def test_causal_step_equals_parallel_forward(settings):
    torch.manual_seed(10)
    tree = NestedSignal.from_parents(CAUSAL_PARENT)
    attn = HSAttention(12, heads=3, causal=True, **settings).to(DT).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for module in (attn.q_norm, attn.k_norm, attn.v_norm):
            if module is not None:
                module.weight.normal_()
                module.bias.normal_()
        attn.qkv.bias.normal_()
    x = torch.randn(tree.num_leaves, 12, dtype=DT)
    full = attn(x, tree)
    assert full.shape == (tree.num_leaves, attn.out_channels)
    torch.testing.assert_close(steps_over(attn, x, tree), full, rtol=0, atol=1e-10)


def test_causal_step_with_modalities_equals_parallel_forward():
    torch.manual_seed(11)
    modality = torch.tensor([0, 0, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0])
    tree = NestedSignal.from_parents(CAUSAL_PARENT, modality=modality)
    attn = HSAttention(8, heads=2, num_modalities=2, causal=True).to(DT).eval()
    with torch.no_grad():
        attn.qkv.bias.normal_()
    x = torch.randn(tree.num_leaves, 8, dtype=DT)
    leaf_tags = modality[[4, 5, 6, 7, 8, 10, 11]].tolist()
    got = steps_over(attn, x, tree, tags=leaf_tags)
    torch.testing.assert_close(got, attn(x, tree), rtol=0, atol=1e-10)
    # the tags matter: all-zero tags give other outputs
    zeros = steps_over(attn, x, tree, tags=[0] * len(leaf_tags))
    assert not torch.allclose(zeros, got)


def test_causal_forward_is_the_causal_op_on_the_attention_tree():
    torch.manual_seed(12)
    tree = NestedSignal.from_parents(CAUSAL_PARENT)
    x = torch.randn(tree.num_leaves, 8, dtype=DT)
    for attention in ("hierarchical", "flat"):
        attn = HSAttention(8, heads=2, causal=True, attention=attention).to(DT)
        q, k, v = attn._project(x, None)
        target = attention_tree(tree, attention)
        expected = attn.out_proj(hsa_graph.causal_hsa(q, k, v, target).reshape(-1, 8))
        torch.testing.assert_close(attn(x, tree), expected, rtol=0, atol=1e-12)
        full = HSAttention(8, heads=2, attention=attention).to(DT)
        full.load_state_dict(attn.state_dict())     # the same weights, not causal
        assert not torch.allclose(full(x, tree), attn(x, tree))
        torch.testing.assert_close(full(x, tree)[-1], attn(x, tree)[-1], **TOL)  # last row


@pytest.mark.parametrize("include_self", [True, False])
def test_causal_flat_attention_matches_masked_multihead_attention(include_self):
    torch.manual_seed(13)
    tree = NestedSignal.from_parents(CAUSAL_PARENT)     # flattened: 7 leaves in a row
    n, c, heads = tree.num_leaves, 12, 3
    mha = torch.nn.MultiheadAttention(c, heads, batch_first=True, dtype=DT)
    torch.nn.init.normal_(mha.in_proj_bias)
    attn = HSAttention(c, heads, qk_norm=False, include_self=include_self, attention="flat",
                       causal=True).to(DT)
    copy_from_mha(attn, mha)
    x = torch.randn(n, c, dtype=DT)
    offset = 0 if include_self else 1
    mask = torch.ones(n, n, dtype=torch.bool).triu(1 - offset)       # True = not allowed
    mask[0, 0] = False   # MHA needs one allowed key per row; row 0 is checked separately
    expected = mha(x[None], x[None], x[None], attn_mask=mask, need_weights=False)[0][0]
    got = attn(x, tree)
    start = 0 if include_self else 1
    torch.testing.assert_close(got[start:], expected[start:], **TOL)
    if not include_self:  # the first token sees nothing: zero attention output
        torch.testing.assert_close(got[0], mha.out_proj.bias, **TOL)


def test_causal_outputs_ignore_later_leaves_with_positions_and_batches():
    torch.manual_seed(14)
    trees = [NestedSignal.from_parents(CAUSAL_PARENT), NestedSignal.from_parents(
        [-1, 0, 0, 1, 1, 2, 2, 2])]
    batch = Batch.from_data_list(trees)
    attn = HSAttention(8, heads=2, pos_dim=4, causal=True).to(DT)
    x = torch.randn(batch.num_leaves, 8, dtype=DT)
    y = attn(x, batch)
    n0 = trees[0].num_leaves
    for i, tree_x in enumerate(x.split([n0, x.shape[0] - n0])):   # a forest = its trees
        torch.testing.assert_close(y.split([n0, x.shape[0] - n0])[i], attn(tree_x, trees[i]),
                                   **TOL)
    changed = x.clone()
    changed[4:n0] += 1.0                       # later leaves of the first tree
    changed[n0 + 2:] -= 1.0                    # later leaves of the second tree
    y2 = attn(changed, batch)
    torch.testing.assert_close(y2[:4], y[:4], rtol=0, atol=0)
    torch.testing.assert_close(y2[n0:n0 + 2], y[n0:n0 + 2], rtol=0, atol=0)
    assert not torch.allclose(y2[4:n0], y[4:n0])


def test_causal_step_refuses_what_it_cannot_do():
    tree = NestedSignal.from_parents(CAUSAL_PARENT)
    plain = HSAttention(8, heads=2)
    with pytest.raises(ValueError, match="needs a causal layer"):
        plain.new_cache()
    with pytest.raises(ValueError, match="needs a causal layer"):
        plain.step(torch.randn(8), hsa_graph.HSACache())
    positioned = HSAttention(8, heads=2, pos_dim=4, causal=True)
    assert positioned(torch.randn(tree.num_leaves, 8), tree).shape == (7, 8)  # forward works
    with pytest.raises(ValueError, match="does not support position embeddings"):
        positioned.step(torch.randn(8), positioned.new_cache(), depth=2)
    attn = HSAttention(8, heads=2, causal=True)
    cache = attn.new_cache()
    with pytest.raises(ValueError, match=r"one token of shape \[8\]"):
        attn.step(torch.randn(1, 8), cache)
    with pytest.raises(TypeError, match="float64 but the parameters"):
        attn.step(torch.randn(8, dtype=DT), cache)
    with pytest.raises(TypeError, match="cache must be an HSACache"):
        attn.step(torch.randn(8), [])
    with pytest.raises(ValueError, match="include_self=False"):
        attn.step(torch.randn(8), hsa_graph.HSACache(include_self=False))
    with pytest.raises(ValueError, match="scale=0.5"):
        attn.step(torch.randn(8), hsa_graph.HSACache(scale=0.5))
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['atach'\]"):
        attn.step(torch.randn(8), cache, atach=0)
    with pytest.raises(ValueError, match="attach must be None"):
        attn.step(torch.randn(8), cache, attach=0)
    assert cache.num_tokens == 0           # nothing was stored by the refused calls
    multi = HSAttention(8, heads=2, num_modalities=2, causal=True)
    with pytest.raises(ValueError, match="pass the token's tag"):
        multi.step(torch.randn(8), multi.new_cache())
    with pytest.raises(ValueError, match=r"modality 2 is outside \[0, 2\)"):
        multi.step(torch.randn(8), multi.new_cache(), modality=2)
    with pytest.raises(TypeError, match="modality must be an int"):
        multi.step(torch.randn(8), multi.new_cache(), modality=0.5)
    with pytest.raises(TypeError, match="causal must be a bool"):
        HSAttention(8, causal="yes")


def test_causal_repr_and_reset_parameters():
    attn = HSAttention(8, heads=2, causal=True)
    assert repr(attn) == (
        "HSAttention(8, 8, heads=2, head_channels=4, attention='hierarchical', "
        "include_self=True, qk_norm=True, v_norm=False, num_modalities=1, pos_dim=None, "
        "dropout=0.0, causal=True)")
    before = attn.qkv.weight.clone()
    attn.reset_parameters()
    assert not torch.equal(before, attn.qkv.weight)
