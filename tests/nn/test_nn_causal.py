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


# ------------------------------------------------------------------ batched generation
from hsa_graph.ops.cache import BatchedHSACache, parents_of_moves  # noqa: E402


def prefix_tree(moves, n):
    return hsa_graph.NestedSignal.from_parents(parents_of_moves(moves[:n]))


def test_lm_batched_prefill_and_steps_equal_parallel_forward(review_tree):
    tree, vocab = review_tree
    torch.manual_seed(1)
    lm = HierarchicalCausalLM(vocab, channels=16, num_layers=2, heads=2).double().eval()
    tokens, moves = tree.x, HSACache.moves_of(tree)
    starts, more = [40, 23, 61], 12                  # prompts of different lengths
    caches = lm.new_caches(0)
    prompts = hsa_graph.collate([prefix_tree(moves, n) for n in starts])
    last = lm.prefill(torch.cat([tokens[:n] for n in starts]), prompts, caches)
    assert isinstance(caches[0], BatchedHSACache) and caches[0].num_tokens == starts
    rows = [last]
    for t in range(more):
        at = [n + t for n in starts]
        rows.append(lm.step(tokens[at], caches,
                            attach=[moves[i].get("attach") for i in at],
                            depth=[moves[i].get("depth") for i in at]))
    got = torch.stack(rows)                          # [more + 1, B, vocab]
    for b, n in enumerate(starts):
        full = lm(tokens[:n + more], prefix_tree(moves, n + more))
        torch.testing.assert_close(got[:, b], full[n - 1:], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("settings", [dict(), dict(attention="flat", include_self=False),
                                      dict(attention="none"), dict(num_modalities=2)])
def test_attention_batched_step_equals_forward_on_ragged_trees(settings):
    torch.manual_seed(4)
    attn = hsa_graph.nn.HSAttention(8, heads=2, causal=True, **settings).double()
    parents = [[-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3], [-1, 0, 0, 0, 0, 0],
               [-1, 0, 0, 1, 2, 2, 3, 3, 3]]
    trees = [hsa_graph.NestedSignal.from_parents(p) for p in parents]
    moves = [HSACache.moves_of(t) for t in trees]
    n = min(t.num_leaves for t in trees)
    x = torch.randn(len(trees), n, 8, dtype=torch.float64)
    tags = torch.tensor([0, 1, 1])
    cache = attn.new_cache(len(trees))
    steps = [attn.step(x[:, i], cache, attach=[m[i].get("attach") for m in moves],
                       depth=[m[i].get("depth") for m in moves],
                       **({"modality": tags} if "num_modalities" in settings else {}))
             for i in range(n)]
    for b in range(len(trees)):
        cut = prefix_tree(moves[b], n)
        if "num_modalities" in settings:
            cut.modality = torch.full((cut.num_nodes,), int(tags[b]))
        ref = attn(x[b], cut)
        torch.testing.assert_close(torch.stack(steps)[:, b], ref, atol=1e-10, rtol=1e-10)


def test_generate_batch_equals_each_prompt_alone(review_tree):
    tree, vocab = review_tree
    torch.manual_seed(2)
    lm = HierarchicalCausalLM(vocab, channels=8, num_layers=2, heads=2).double()
    tokens, moves = tree.x.tolist(), HSACache.moves_of(tree)
    prompts, wheres = [tokens[:20], tokens[:33]], [moves[:20], prefix_tree(moves, 33)]

    def where(seq):  # a new word after a space token, else the same word
        return {"attach": 1} if seq[-1] == tokens[19] else {}

    batch = lm.generate(prompts, wheres, 8, where, temperature=0)
    alone = [lm.generate(p, w, 8, where, temperature=0) for p, w in zip(prompts, wheres)]
    assert batch == alone and [len(s) for s in batch] == [28, 41]
    # and the one-prompt call equals stepping an HSACache token by token
    caches = lm.new_caches()
    for t, place in zip(prompts[0], moves[:20]):
        logits = lm.step(t, caches, **place)
    seq = list(prompts[0])
    for _ in range(8):
        nxt = int(logits.argmax())
        place = where(seq)
        seq.append(nxt)
        logits = lm.step(nxt, caches, **place)
    assert seq == alone[0]


def test_batched_generation_bad_input(review_tree):
    tree, vocab = review_tree
    lm = HierarchicalCausalLM(vocab, channels=8, num_layers=1, heads=2)
    caches = lm.new_caches(2)
    with pytest.raises(ValueError, match="one integer id per sequence"):
        lm.step(torch.tensor([1, 2, 3]), caches)
    with pytest.raises(ValueError, match=r"attach\[0\].*no token yet"):
        lm.step(torch.tensor([1, 2]), caches, attach=[0, None])
    with pytest.raises(ValueError, match="placements"):
        lm.generate([[1, 2], [3]], [[{}, {}], [{}, {}]], 2, lambda s: {})
    with pytest.raises(ValueError, match="empty"):
        lm.generate([[1, 2], []], [[{}, {}], []], 2, lambda s: {})
    with pytest.raises(ValueError, match=r"moves\[1\]: attach"):
        lm.generate([1, 2], [dict(depth=2), dict(attach=5)], 2, lambda s: {})
    attn = lm.layers[0].attn
    with pytest.raises(ValueError, match="B = 2"):
        attn.step(torch.randn(3, 8), attn.new_cache(2))
    with pytest.raises(TypeError, match="BatchedHSACache"):
        attn.prefill(torch.randn(3, 8), hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0]),
                     attn.new_cache())


# ------------------------------------------------------------------ flat KV cache
from hsa_graph.ops.kv_cache import KVCache  # noqa: E402


def test_flat_layer_batched_cache_is_a_kv_cache():
    flat = hsa_graph.nn.HSAttention(8, heads=2, causal=True, attention="flat")
    assert isinstance(flat.new_cache(2), KVCache) and flat.new_cache(2).batch_size == 2
    assert isinstance(flat.new_cache(), HSACache)           # one sequence: as before
    hier = hsa_graph.nn.HSAttention(8, heads=2, causal=True)
    assert isinstance(hier.new_cache(2), BatchedHSACache)
    with pytest.raises(TypeError, match="KVCache holds flat attention"):
        hier.step(torch.randn(2, 8), flat.new_cache(2))
    with pytest.raises(TypeError, match="KVCache holds flat attention"):
        hier.prefill(torch.randn(3, 8), hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0]),
                     flat.new_cache(0))


def test_flat_lm_prefill_and_steps_equal_parallel_forward(review_tree):
    tree, vocab = review_tree
    torch.manual_seed(5)
    lm = HierarchicalCausalLM(vocab, channels=16, num_layers=2, heads=2,
                              attention="flat").double().eval()
    tokens, moves = tree.x, HSACache.moves_of(tree)
    starts, more = [40, 23, 61], 12
    caches = lm.new_caches(0)
    prompts = hsa_graph.collate([prefix_tree(moves, n) for n in starts])
    rows = [lm.prefill(torch.cat([tokens[:n] for n in starts]), prompts, caches)]
    assert all(isinstance(c, KVCache) for c in caches) and caches[1].num_tokens == starts
    for t in range(more):                      # placements are ignored by flat layers
        at = [n + t for n in starts]
        rows.append(lm.step(tokens[at], caches, attach=[moves[i].get("attach") for i in at]))
    got = torch.stack(rows)
    for b, n in enumerate(starts):
        full = lm(tokens[:n + more], prefix_tree(moves, n + more))
        torch.testing.assert_close(got[:, b], full[n - 1:], atol=1e-10, rtol=0)
    # dropping a finished sequence leaves the others' next steps unchanged
    for cache in caches:
        cache.drop(1)
    nxt = lm.step(tokens[[starts[0] + more, starts[2] + more]], caches)
    for row, n in enumerate([starts[0], starts[2]]):
        full = lm(tokens[:n + more + 1], prefix_tree(moves, n + more + 1))
        torch.testing.assert_close(nxt[row], full[-1], atol=1e-10, rtol=0)


def test_flat_lm_greedy_generation_equals_parallel_argmax(review_tree):
    tree, vocab = review_tree
    torch.manual_seed(6)
    lm = HierarchicalCausalLM(vocab, channels=16, num_layers=2, heads=2,
                              attention="flat").double()
    tokens = tree.x.tolist()
    prompts = [tokens[:15], tokens[:31]]
    flat_where = [[{}] * len(p) for p in prompts]
    out = lm.generate(prompts, flat_where, 10, lambda seq: {}, temperature=0)
    for seq, prompt in zip(out, prompts):
        assert seq[:len(prompt)] == prompt and len(seq) == len(prompt) + 10
        ids = torch.tensor(seq)
        flat = hsa_graph.NestedSignal.from_parents([-1] + [0] * len(seq))
        greedy = lm(ids, flat).argmax(-1)       # the parallel forward's argmax tokens
        assert greedy[len(prompt) - 1:-1].tolist() == seq[len(prompt):]
    # the batch equals each prompt generated alone
    assert [lm.generate(p, w, 10, lambda s: {}, temperature=0)
            for p, w in zip(prompts, flat_where)] == out


def test_flat_prefill_refuses_trees_whose_leaves_interleave():
    attn = hsa_graph.nn.HSAttention(8, heads=2, causal=True, attention="flat")
    interleaved = hsa_graph.NestedSignal.from_parents([-1, -1, 0, 1, 0])   # leaves 0, 1, 0
    cache = attn.new_cache(0)
    with pytest.raises(ValueError, match="leaf row 2 goes back to tree 0"):
        attn.prefill(torch.randn(3, 8), interleaved, cache)
    assert cache.batch_size == 0                             # nothing was added
