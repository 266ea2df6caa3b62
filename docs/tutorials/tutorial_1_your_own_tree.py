"""
A tree from your own text and image
===================================

Build nested signals from a text (the Gettysburg Address, shipped in ``examples/data``)
and an image (Grace Hopper's portrait, shipped with matplotlib), put both in one
key-value document, look at the trees, and run HSA on them.
"""

# %%
# Text: document -> paragraphs -> sentences -> tokens
# ---------------------------------------------------
# :func:`~hsa_graph.text_tree` splits paragraphs at blank lines and sentences with a
# rule-based splitter. Without a tokenizer it uses words and punctuation with hashed
# ids; ``embed`` turns all tokens of the document into vectors in one call. Here the
# embedding looks tokens up by their text (``embed_input="tokens"``): a fixed random
# vector per lower-cased word.
import zlib
from pathlib import Path

import numpy as np
import torch
from matplotlib import cbook
from PIL import Image

import hsa_graph
from hsa_graph.builders import image_tree, text_tree
from hsa_graph.viz import draw_tree, plot_attention

# the repository root: sphinx-gallery runs this from docs/tutorials
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "examples" / "data").is_dir())
text = (ROOT / "examples" / "data" / "gettysburg.txt").read_text(encoding="utf-8")
FEATURES = 32


def embed_words(tokens):
    """One fixed random vector per lower-cased token: ``N`` strings -> ``[N, 32]``."""
    rows = [np.random.default_rng(zlib.crc32(t.lower().encode())).standard_normal(FEATURES)
            for t in tokens]
    return torch.tensor(np.stack(rows), dtype=torch.float32)


speech = text_tree(text, embed=embed_words, embed_input="tokens")
print(f"{speech.num_nodes} nodes, {speech.num_leaves} tokens, features {tuple(speech.x.shape)}")
print("first tokens:", speech.tokens[:8])

# %%
# Image: a grid of grids of patches
# ---------------------------------
# :func:`~hsa_graph.image_tree` cuts an ``H x W x C`` array into patches; with
# ``quadtree=True`` it groups 2 x 2 neighbouring patches, recursively, up to one root.
# ``embed`` maps the patches ``[N, 16, 16, 3]`` to leaf features.
with cbook.get_sample_data("grace_hopper.jpg") as handle:
    pixels = np.asarray(Image.open(handle).convert("RGB").resize((128, 128)))
projection = torch.randn(16 * 16 * 3, FEATURES) / 16
portrait = image_tree(pixels, patch_size=16, quadtree=True,
                      embed=lambda patches: patches.flatten(1) @ projection)
print(f"{portrait.num_leaves} patches in {portrait.num_nodes} nodes")

# %%
# One document holding both
# -------------------------
# :meth:`~hsa_graph.NestedSignal.join` hangs trees under a new root of any geometry;
# a ``keyvalue`` root names its fields. :func:`~hsa_graph.viz.draw_tree` colours nodes
# by geometry.
doc = hsa_graph.NestedSignal.join([speech, portrait], "keyvalue", keys=["text", "image"])
fig = draw_tree(doc, color_by="geometry")

# %%
# HSA on the document
# -------------------
# Random projections stand in for a trained layer. HSA evaluates far fewer attention
# weights than flat attention over the same leaves, and its matrix (left) is constant
# on blocks: a token sees a distant paragraph, or the whole image, as one block.
torch.manual_seed(0)
heads, dim = 2, 16
w_q, w_k, w_v = (torch.randn(FEATURES, heads, dim) / FEATURES ** 0.5 for _ in range(3))
q, k, v = (torch.einsum("nf,fhd->nhd", doc.x, w) for w in (w_q, w_k, w_v))
y = hsa_graph.hsa(q, k, v, doc)
theta = hsa_graph.hsa_weights(q, k, doc)
print(f"output {tuple(y.shape)}; rows of theta sum to "
      f"{float(theta.sum(-1).min()):.6f}..{float(theta.sum(-1).max()):.6f}")
print(f"{doc.structure.num_attention_weights:,} weights evaluated by HSA vs "
      f"{doc.num_leaves ** 2:,} for flat attention")
fig = plot_attention(q, k, doc, head=0)
