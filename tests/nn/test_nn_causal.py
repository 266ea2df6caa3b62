"""Causal HSA modules (hsa_graph.nn.causal): parallel forward == cached generation,
causality, and the language model on a real Pang & Lee review."""
from __future__ import annotations

import re

import pytest
import torch

import hsa_graph
from hsa_graph.nn.causal import CausalDecoderLayer, CausalHSAttention, HierarchicalCausalLM
from hsa_graph.ops.cache import HSACache


@pytest.fixture(scope="module")
def review_tree():
    """The first Pang & Lee review: review -> lines -> words -> characters."""
    from network_data import pang_lee_reviews as load_pang_lee_reviews
    text = load_pang_lee_reviews()[0][0][:600]
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    tree = hsa_graph.text_tree(text.replace("\n", "\n\n"),
                               tokenizer=lambda s: [vocab[c] for c in s] + [vocab[" "]],
                               sentence_splitter=lambda p: re.findall(r"\S+\s*", p))
    return tree, len(vocab)


def test_moves_rebuild_the_tree(review_tree):
    tree, _ = review_tree
    cache = HSACache()
    x = torch.zeros(1, 2)
    for place in HSACache.moves_of(tree):
        cache.append(x, x, x, **place)
    rebuilt = hsa_graph.NestedSignal.from_parents(cache.parent)
    assert rebuilt.num_leaves == tree.num_leaves
    assert [b.size for b in rebuilt.structure.buckets] == [
        b.size for b in tree.structure.buckets]
    assert torch.equal(rebuilt.structure.depth[:rebuilt.num_leaves],
                       tree.structure.depth[:tree.num_leaves])


def test_lm_step_equals_parallel_forward(review_tree):
    tree, vocab = review_tree
    torch.manual_seed(0)
    lm = HierarchicalCausalLM(vocab, channels=16, num_layers=2, heads=2).double().eval()
    tokens = tree.x
    logits = lm(tokens, tree)
    caches = lm.new_caches()
    steps = [lm.step(int(t), caches, **place)
             for t, place in zip(tokens.tolist(), HSACache.moves_of(tree))]
    torch.testing.assert_close(torch.stack(steps), logits, atol=1e-9, rtol=1e-9)


def test_lm_is_causal_and_learns(review_tree):
    tree, vocab = review_tree
    torch.manual_seed(0)
    lm = HierarchicalCausalLM(vocab, channels=16, num_layers=1, heads=2)
    tokens = tree.x.clone()
    logits = lm(tokens, tree)
    changed = tokens.clone()
    changed[50:] = (changed[50:] + 1) % vocab
    torch.testing.assert_close(lm(changed, tree)[:50], logits[:50], atol=0, rtol=0)
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    with torch.no_grad():
        first = float(lm.loss(tokens, tree))
    for _ in range(15):
        opt.zero_grad()
        loss = lm.loss(tokens, tree)
        loss.backward()
        opt.step()
    assert float(loss) < first - 0.5


def test_generate_places_tokens_and_is_deterministic(review_tree):
    tree, vocab = review_tree
    lm = HierarchicalCausalLM(vocab, channels=8, num_layers=1, heads=2)
    prompt = tree.x[:20].tolist()
    moves = HSACache.moves_of(tree)[:20]
    out = [lm.generate(prompt, moves, 10, lambda toks: {}, temperature=0) for _ in range(2)]
    assert out[0] == out[1] and out[0][:20] == prompt and len(out[0]) == 30


def test_layers_validate():
    with pytest.raises(ValueError, match="divisible by heads"):
        CausalHSAttention(10, heads=3)
    layer = CausalDecoderLayer(8, heads=2)
    assert "ffn_channels=32" in repr(layer)
    lm = HierarchicalCausalLM(5, channels=8, num_layers=1, heads=2)
    tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0])
    with pytest.raises(ValueError, match="tokens must have shape"):
        lm(torch.tensor([1, 2, 3]), tree)


# root -> 3 sentences of 3, 2 and 2 tokens: every node's leaves are contiguous
SMALL = [-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("settings", [dict(), dict(qk_norm=False), dict(dropout=0.3),
                                      dict(attention="flat", include_self=False),
                                      dict(v_norm=True, query_residual=True)])
def test_decoder_layer_step_equals_parallel_forward(settings):
    torch.manual_seed(3)
    tree = hsa_graph.NestedSignal.from_parents(SMALL)
    layer = CausalDecoderLayer(8, heads=2, **settings).double().eval()
    assert layer.attn.causal and isinstance(layer.attn, hsa_graph.nn.HSAttention)
    assert (layer.attn.q_norm is not None) == settings.get("qk_norm", True)
    x = torch.randn(tree.num_leaves, 8, dtype=torch.float64)
    cache = layer.new_cache()
    steps = [layer.step(x[i], cache, **move)
             for i, move in enumerate(HSACache.moves_of(tree))]
    torch.testing.assert_close(torch.stack(steps), layer(x, tree), rtol=0, atol=1e-10)


def test_decoder_layer_arguments():
    layer = CausalDecoderLayer(8, 2, 12, False, act="relu")
    assert layer.ffn[0].out_features == 12 and not layer.attn.include_self
    assert isinstance(layer.ffn[1], torch.nn.ReLU)
    assert repr(layer) == ("CausalDecoderLayer(8, heads=2, ffn_channels=12, "
                           "attention='hierarchical', qk_norm=True, causal=True)")
    with pytest.raises(TypeError, match="always causal"):
        CausalDecoderLayer(8, causal=False)
    with pytest.raises(ValueError, match="ffn_channels must be a positive int"):
        CausalDecoderLayer(8, ffn_channels=-1)


def test_alias_is_causal_hsattention_without_qk_norm():
    attn = CausalHSAttention(8, heads=2, include_self=False)
    assert isinstance(attn, hsa_graph.nn.HSAttention)
    assert attn.causal and attn.q_norm is None and not attn.include_self
    assert attn.channels == 8 and attn.pos_encoder is None and attn.num_modalities == 1
    assert "causal=True" in repr(attn)


@pytest.mark.parametrize("settings", [dict(channels=16, qk_norm=False),
                                      dict(channels=15, heads=3),
                                      dict(channels=16, attention="flat")])
def test_lm_step_equals_parallel_forward_for_other_settings(settings):
    torch.manual_seed(4)
    tree = hsa_graph.NestedSignal.from_parents(SMALL)
    lm = HierarchicalCausalLM(7, num_layers=2, **{"heads": 2, **settings}).double().eval()
    tokens = torch.tensor([1, 2, 3, 4, 5, 6, 0])
    caches = lm.new_caches()
    steps = [lm.step(int(t), caches, **place)
             for t, place in zip(tokens.tolist(), HSACache.moves_of(tree))]
    torch.testing.assert_close(torch.stack(steps), lm(tokens, tree), rtol=0, atol=1e-9)


def test_lm_input_is_token_embedding_plus_sinusoidal_encoding():
    from hsa_graph.geometry import sinusoidal_encoding
    lm = HierarchicalCausalLM(5, channels=8, num_layers=1, heads=2).double()
    tokens, position = torch.tensor([3, 1, 4]), torch.tensor([0, 1, 2])
    expected = lm.embed(tokens) * 8 ** 0.5 + sinusoidal_encoding(position, 8).double()
    torch.testing.assert_close(lm._input(tokens, position), expected, rtol=0, atol=1e-12)
    odd = HierarchicalCausalLM(5, channels=7, num_layers=1, heads=7).double()
    torch.testing.assert_close(odd._input(tokens, position) - odd.embed(tokens) * 7 ** 0.5,
                               sinusoidal_encoding(position, 8).double()[:, :7])


def test_lm_validates_sizes_and_caches():
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        HierarchicalCausalLM(5, channels=8, num_layers=0, heads=2)
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        HierarchicalCausalLM(0, channels=8, num_layers=1, heads=2)
    lm = HierarchicalCausalLM(5, channels=8, num_layers=2, heads=2)
    with pytest.raises(ValueError, match=r"one cache per layer \(2\), got 1"):
        lm.step(1, lm.new_caches()[:1], depth=1)
    positioned = HierarchicalCausalLM(5, channels=8, num_layers=1, heads=2, pos_dim=4)
    tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0])
    assert positioned(torch.tensor([1, 2]), tree).shape == (2, 5)
    with pytest.raises(ValueError, match="does not support position embeddings"):
        positioned.step(1, positioned.new_caches())
