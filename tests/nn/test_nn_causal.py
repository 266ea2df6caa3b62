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
