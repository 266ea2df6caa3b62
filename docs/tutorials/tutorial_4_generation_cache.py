"""
Generating with the cache
=========================

Causal HSA lets leaf :math:`i` see the leaves :math:`j \\le i` only (see
:ref:`def-causal`). For generation, :class:`~hsa_graph.HSACache` produces the same
outputs one token at a time while keeping only the right edge of the tree:
:math:`O(b \\cdot \\mathrm{depth})` summaries instead of every past key and value.
This tutorial checks the cache against full recomputation, then trains a tiny
character-level hierarchical language model on the Gettysburg Address and samples from
it with the cache.
"""

# %%
# A character tree: speech -> paragraphs -> words -> characters
# -------------------------------------------------------------
# :func:`~hsa_graph.text_tree` takes any tokenizer and sentence splitter: here each
# "sentence" is a word, and each token is a character; a word's characters end with
# one space (the builder strips the whitespace around sentences).
import re
from pathlib import Path

import torch

import hsa_graph
from hsa_graph import HSACache

ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "examples" / "data").is_dir())
text = (ROOT / "examples" / "data" / "gettysburg.txt").read_text(encoding="utf-8")
chars = sorted(set(text) - {"\n"})
vocab = {c: i for i, c in enumerate(chars)}


def char_tree(document: str) -> hsa_graph.NestedSignal:
    return hsa_graph.text_tree(
        document, tokenizer=lambda word: [vocab[c] for c in word.strip()] + [vocab[" "]],
        sentence_splitter=lambda paragraph: re.findall(r"\S+\s*", paragraph))


tree = char_tree(text)
tokens = tree.x
print(f"{tree.num_leaves} characters, {tree.num_nodes} nodes, vocabulary {len(chars)}")

# %%
# The cache equals recomputation
# ------------------------------
# :meth:`HSACache.moves_of` gives, for each leaf of an existing tree, where
# :meth:`~HSACache.append` must hang it (``attach``: the depth of the deepest open node
# it continues; ``depth``: its own depth). Each ``append`` takes one token's
# ``q, k`` ``[H, D]`` and ``v`` ``[H, Dv]`` and returns its output ``[H, Dv]``.
torch.manual_seed(0)
n = 300
prefix = char_tree(text[:n])
q, k, v = torch.randn(3, prefix.num_leaves, 2, 8, dtype=torch.float64).unbind(0)
full = hsa_graph.causal_hsa(q, k, v, prefix)
cache = HSACache()
steps = [cache.append(q[i], k[i], v[i], **move)
         for i, move in enumerate(HSACache.moves_of(prefix))]
print(f"max |cache - causal_hsa| over {prefix.num_leaves} tokens: "
      f"{(torch.stack(steps) - full).abs().max().item():.1e}; {cache}")

# %%
# A tiny hierarchical language model
# ----------------------------------
# :class:`~hsa_graph.nn.HierarchicalCausalLM` stacks causal HSA layers. Trained for a
# few seconds on one speech it learns little beyond letter frequencies and spacing;
# the point is the mechanics of training on trees and generating with per-layer caches.
torch.manual_seed(0)
lm = hsa_graph.nn.HierarchicalCausalLM(len(chars), channels=32, num_layers=2, heads=4)
optimizer = torch.optim.AdamW(lm.parameters(), lr=3e-3)
for step in range(60):
    optimizer.zero_grad()
    loss = lm.loss(tokens, tree)
    loss.backward()
    optimizer.step()
    if step % 20 == 0 or step == 59:
        print(f"step {step:2d}: {loss.item():.3f} nats per character")

# %%
# Generation: where does the next character hang?
# -----------------------------------------------
# The caller decides the tree as it grows: after a space a new word opens
# (``attach=1``), after a full stop and a space a new paragraph (``attach=0``), and
# otherwise the word continues (``attach=2``).


def where(so_far):
    last = chars[so_far[-1]]
    if last not in " \n":
        return dict(attach=2)
    before = chars[so_far[-2]] if len(so_far) > 1 else ""
    return dict(attach=0 if before in ".!?" else 1)


prompt = char_tree("Four score and seven years ago our fathers ")
generated = lm.generate(prompt.x.tolist(), HSACache.moves_of(prompt), steps=80, where=where,
                        temperature=0.5, generator=torch.Generator().manual_seed(0))
print(repr("".join(chars[t] for t in generated)))
