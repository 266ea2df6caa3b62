import sys
from pathlib import Path

import pytest
import torch

from hsa_graph.pretrained import (
    HSAPatch,
    patch_hsa,
    semantic_hierarchy,
    unpatch_hsa,
    window_hierarchy,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference import dense_hsa_weights  # noqa: E402  (independent SPEC implementation)


def _run(model, batch, **kwargs):
    with torch.no_grad():
        return model(**batch, output_hidden_states=True, **kwargs)


def _batch(tokenizer, texts):
    return tokenizer(texts, padding=True, return_tensors="pt")


def test_one_level_hierarchy_reproduces_the_model(minilm, sentences):
    model, tokenizer = minilm
    batch = _batch(tokenizer, sentences)
    keep = batch["attention_mask"].bool()
    assert not bool(keep.all())  # really padded
    before = _run(model, batch).last_hidden_state
    with patch_hsa(model, hierarchy=()):       # all six layers, a root over all tokens
        patched = _run(model, batch)
    assert (patched.last_hidden_state[keep] - before[keep]).abs().max() < 1e-5
    # pads get a zero attention output: finite, but not the original's values
    assert bool(torch.isfinite(patched.last_hidden_state).all())


def test_eager_models_too(minilm, sentences):
    """An eager model gets an additive mask; the patch reads its padding the same way."""
    model, tokenizer = minilm
    batch = _batch(tokenizer, sentences[:3])
    keep = batch["attention_mask"].bool()
    model.set_attn_implementation("eager")
    try:
        before = _run(model, batch).last_hidden_state
        with patch_hsa(model, layers=[0, 5], hierarchy=()) as patch:
            assert patch.original == "eager"
            flat = _run(model, batch).last_hidden_state
        assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")
    assert (flat[keep] - before[keep]).abs().max() < 1e-5


def test_unpatch_restores_exactly(minilm, sentences):
    model, tokenizer = minilm
    batch = _batch(tokenizer, sentences)
    before = _run(model, batch).last_hidden_state
    patch = patch_hsa(model, layers=[2, 5], hierarchy=(2, 2))
    changed = _run(model, batch).last_hidden_state
    patch.unpatch()
    after = _run(model, batch).last_hidden_state
    assert not torch.allclose(changed, before, atol=1e-3)
    assert torch.equal(after, before)
    assert model.config._attn_implementation == "sdpa"
    patch.unpatch()  # idempotent
    patch_hsa(model, layers=[0])
    unpatch_hsa(model)
    assert torch.equal(_run(model, batch).last_hidden_state, before)


def test_one_tree_per_example(minilm, sentences):
    model, tokenizer = minilm
    a = _batch(tokenizer, [sentences[0], sentences[1], sentences[2]])
    b = _batch(tokenizer, [sentences[0], sentences[3] + " " + sentences[4], sentences[2]])
    assert a["input_ids"].shape[1] != b["input_ids"].shape[1]   # other padding too
    with patch_hsa(model, layers=[1, 3, 5], hierarchy=(2, 4, 8, 16)):
        ya = _run(model, a).last_hidden_state
        yb = _run(model, b).last_hidden_state
    for row in (0, 2):
        n = int(a["attention_mask"][row].sum())
        assert (ya[row, :n] - yb[row, :n]).abs().max() < 1e-5


def test_replaced_layer_matches_the_reference(minilm, sentences):
    """Layer 0 under HSA, recomputed by hand from the model's own projections and the
    independent dense reference of SPEC.md."""
    model, tokenizer = minilm
    batch = _batch(tokenizer, sentences[:3])
    mask = batch["attention_mask"].bool()
    branching = (2, 4)
    with patch_hsa(model, layers=[0], hierarchy=branching):
        out = _run(model, batch).hidden_states
    h0 = out[0]
    layer = model.encoder.layer[0]
    attn = layer.attention.self
    heads, dim = attn.num_attention_heads, attn.attention_head_size
    forest = window_hierarchy(batch["attention_mask"], branching)
    with torch.no_grad():
        x = h0[mask]                                       # [N, 384], the leaves
        q, k, v = (proj(x).view(-1, heads, dim).double()
                   for proj in (attn.query, attn.key, attn.value))
        theta = dense_hsa_weights(forest.parent, q, k, scale=attn.scaling)
        ctx = torch.einsum("hij,jhd->ihd", theta, v).reshape(-1, heads * dim).float()
        full = torch.zeros(*mask.shape, heads * dim)
        full[mask] = ctx
        expected = layer.output(layer.intermediate(layer.attention.output(full, h0)),
                                layer.attention.output(full, h0))
    assert (out[1][mask] - expected[mask]).abs().max() < 1e-4
    with torch.no_grad():  # and HSA did change the layer
        original = model(**batch, output_hidden_states=True).hidden_states[1]
    assert (original[mask] - expected[mask]).abs().max() > 1e-2


def test_per_call_hierarchy(minilm, sentences):
    model, tokenizer = minilm
    texts = sentences[:3]
    enc = tokenizer(texts, padding=True, return_offsets_mapping=True, return_tensors="pt")
    batch = {k: v for k, v in enc.items() if k != "offset_mapping"}
    semantic = semantic_hierarchy(enc, texts)
    with patch_hsa(model, layers=[4, 5], hierarchy=(2, 4, 8, 16)) as patch:
        default = _run(model, batch).last_hidden_state
        by_kwarg = _run(model, batch, hsa_hierarchy=semantic).last_hidden_state
        with patch.use(semantic):
            by_context = _run(model, batch).last_hidden_state
            windows = _run(model, batch, hsa_hierarchy=(2, 4, 8, 16)).last_hidden_state
    assert torch.equal(by_kwarg, by_context)
    assert torch.equal(windows, default)
    assert not torch.allclose(by_kwarg, default, atol=1e-4)


def test_capture_records_queries_and_keys(minilm, sentences):
    model, tokenizer = minilm
    batch = _batch(tokenizer, sentences[:2])
    mask = batch["attention_mask"].bool()
    with patch_hsa(model, layers=()) as patch, patch.capture() as records, torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states
    assert sorted(records) == list(range(6))
    attn = model.encoder.layer[3].attention.self
    q, k, scale = records[3]
    with torch.no_grad():
        expected = attn.query(hidden[3][mask]).view(-1, 12, 32)
    assert torch.allclose(q, expected, atol=1e-6)
    assert k.shape == q.shape and scale == attn.scaling


def test_errors(minilm, sentences):
    model, tokenizer = minilm
    with pytest.raises(ValueError, match="layer 6 is not an attention layer"):
        patch_hsa(model, layers=[6])
    with pytest.raises(ValueError, match="semantic_hierarchy"):
        patch_hsa(model, hierarchy="semantic")
    with pytest.raises(ValueError, match="must be >= 1"):
        patch_hsa(model, hierarchy=(2, 0))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        patch_hsa(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not patched"):
        unpatch_hsa(model)
    batch = _batch(tokenizer, sentences[:2])
    with patch_hsa(model, layers=[0]) as patch:
        assert isinstance(patch, HSAPatch)
        with pytest.raises(ValueError, match="already patched"):
            patch_hsa(model)
        wrong = window_hierarchy([[1] * 5])
        with pytest.raises(ValueError, match="1 trees but the batch has 2"):
            _run(model, batch, hsa_hierarchy=wrong)
    assert model.config._attn_implementation == "sdpa"


def test_deleted_patched_model_is_freed_without_unpatch():
    """The registry and the patch hold the model and its configs weakly: a patched
    model dropped without unpatch() is collected, and its entry goes with it."""
    import gc
    import weakref

    from hsa_graph.pretrained import load_minilm
    from hsa_graph.pretrained.patch import _PATCHES
    model, _ = load_minilm()
    patch = patch_hsa(model, hierarchy=())
    alive, before = weakref.ref(model), len(_PATCHES)
    assert before >= 1 and patch.model is model
    del model
    gc.collect()
    assert alive() is None
    assert len(_PATCHES) < before
    with pytest.raises(ReferenceError, match="no longer exists"):
        _ = patch.model
    patch.unpatch()      # harmless once the model is gone
    assert "deleted model" in repr(patch)


def _layer0_by_hand(model, h0, mask, weights_of):
    """Layer 0 recomputed from its own projections with attention weights
    ``weights_of(q, k, v, scale) -> [H, N, N]`` over the non-pad tokens."""
    layer = model.encoder.layer[0]
    attn = layer.attention.self
    heads, dim = attn.num_attention_heads, attn.attention_head_size
    with torch.no_grad():
        x = h0[mask]
        q, k, v = (proj(x).view(-1, heads, dim).double()
                   for proj in (attn.query, attn.key, attn.value))
        theta = weights_of(q, k, attn.scaling)
        ctx = torch.einsum("hij,jhd->ihd", theta, v).reshape(-1, heads * dim).float()
        full = torch.zeros(*mask.shape, heads * dim)
        full[mask] = ctx
        return layer.output(layer.intermediate(layer.attention.output(full, h0)),
                            layer.attention.output(full, h0)), k


def test_induced_hierarchy_is_built_from_the_layers_keys(minilm, sentences):
    """induced:C: the layer's own keys (heads concatenated) through contiguous_tree,
    then exact HSA; recomputed by hand with the dense reference."""
    from hsa_graph.induce import contiguous_tree
    from hsa_graph.pretrained.hierarchy import InducedHierarchy

    model, tokenizer = minilm
    batch = _batch(tokenizer, sentences[:3])
    mask = batch["attention_mask"].bool()
    rows_of = mask.nonzero(as_tuple=True)[0]
    induced = InducedHierarchy(3)
    with patch_hsa(model, layers=[0], hierarchy=induced) as patch:
        out = _run(model, batch).hidden_states
        timings = dict(patch.timings)
    trees = {}

    def weights(q, k, scale):
        tree = contiguous_tree(k.float().flatten(1), rows_of, max_children=3)
        trees["tree"] = tree
        return dense_hsa_weights(tree.parent, q, k, scale=scale)

    expected, _ = _layer0_by_hand(model, out[0], mask, weights)
    assert (out[1][mask] - expected[mask]).abs().max() < 1e-4
    tree = trees["tree"]
    assert tree.structure.num_trees == 3 and torch.equal(tree.structure.leaf_tree, rows_of)
    # the tree is the data's: not the hopping windows of the same family bound
    windows = window_hierarchy(batch["attention_mask"], (3, 3, 3, 3))
    assert not torch.equal(tree.parent, windows.parent)
    assert timings["layer_calls"] == 1 and timings["tree_s"] > 0
    assert timings["rows"] == int(mask.sum())


@pytest.mark.parametrize("name", ["local:2", "fixed:4", "bigbird:1", "topk:5"])
def test_sparse_pattern_is_masked_attention(minilm, sentences, name):
    """A SparsePattern in a patched layer: softmax renormalised over the pattern's
    support (sparse_weights), recomputed by hand; pads take no place in it."""
    from hsa_graph.pretrained import softmax_weights
    from hsa_graph.pretrained.approximations import sparse_weights
    from hsa_graph.pretrained.zero_shot import parse_hierarchy

    model, tokenizer = minilm
    tokenizer.padding_side = "left"      # pads first: positions must skip them
    try:
        batch = _batch(tokenizer, sentences[:3])
    finally:
        tokenizer.padding_side = "right"
    mask = batch["attention_mask"].bool()
    assert not bool(mask[:, 0].all())
    rows_of = mask.nonzero(as_tuple=True)[0]
    pattern = parse_hierarchy(name)
    with patch_hsa(model, layers=[0], hierarchy=pattern) as patch:
        out = _run(model, batch).hidden_states
        timings = dict(patch.timings)
    flat = window_hierarchy(batch["attention_mask"], ())

    def weights(q, k, scale):
        p = softmax_weights(q, k, flat, scale)
        return sparse_weights(p, pattern.support(rows_of, p))

    expected, _ = _layer0_by_hand(model, out[0], mask, weights)
    assert (out[1][mask] - expected[mask]).abs().max() < 1e-4
    with torch.no_grad():
        original = model(**batch, output_hidden_states=True).hidden_states[1]
    assert (original[mask] - out[1][mask]).abs().max() > 1e-3
    assert timings["budget"] / timings["rows"] < mask.sum(1).double().mean()
