"""Pictures: nested signals and their attention, for a real text and a real image.

Writes PNGs to ``examples/output/``:

* ``text_tree.png``: the Gettysburg Address (``examples/data/gettysburg.txt``) as
  document -> paragraphs -> sentences -> words, coloured by geometry;
* ``text_attention.png``: HSA's attention matrix next to flat softmax attention for
  the same queries and keys (each word's hashed character-trigram vector);
* ``image_tree.png``: Grace Hopper's portrait (shipped with matplotlib) as a quadtree
  over 8 x 8 patches (a grid of 2 x 2 grids);
* ``image_attention.png``: the same two heat maps for the patches;
* ``document_tree.png``: ``{"text": ..., "image": ...}`` as one key-value document,
  coloured by modality.

The trees are built with the package's builders (``text_tree`` with hashed trigram
vectors per token, ``image_tree`` with a quadtree), as in ``examples/main.py``.

Run: ``python examples/pictures.py``
"""
from __future__ import annotations

import time
import zlib
from pathlib import Path

import numpy as np
import torch
from matplotlib import cbook
from PIL import Image

import hsa_graph
from hsa_graph import NestedSignal
from hsa_graph.builders import image_tree, text_tree
from hsa_graph.geometry import PositionEncoder
from hsa_graph.viz import draw_tree, plot_attention

HERE = Path(__file__).parent
DATA, OUTPUT = HERE / "data", HERE / "output"
FEATURES = 64


def trigram_vector(token: str, dim: int = FEATURES) -> np.ndarray:
    """A deterministic unit-norm hashed character-trigram embedding of ``token``."""
    padded = f"<{token.lower()}>"
    vector = np.zeros(dim)
    for i in range(len(padded) - 2):
        vector += np.random.default_rng(zlib.crc32(padded[i:i + 3].encode())).standard_normal(dim)
    return vector / max(np.linalg.norm(vector), 1e-12)


def text_signal(text: str):
    """The text's nested signal (:func:`~hsa_graph.builders.text_tree`, token vectors
    from hashed trigrams) and a label per node (words on leaves, P1 / S1.2 above)."""
    tree = text_tree(text, embed_input="tokens", embed=lambda tokens: torch.from_numpy(
        np.stack([trigram_vector(token) for token in tokens])))
    parent, index = tree.parent.tolist(), tree.position[:, 0].tolist()
    is_leaf, words = tree.is_leaf.tolist(), iter(tree.tokens)
    labels = []
    for u, p in enumerate(parent):  # labels only: a few hundred nodes
        if p < 0:
            labels.append("document")
        elif parent[p] < 0:
            labels.append(f"P{index[u] + 1}")
        elif is_leaf[u]:
            labels.append(next(words))
        else:
            labels.append(f"S{index[p] + 1}.{index[u] + 1}")
    return tree, labels


def image_signal(image: np.ndarray, patch: int = 16) -> NestedSignal:
    """An ``H x W x C`` image as a quadtree of patches (:func:`~hsa_graph.builders.image_tree`),
    each patch a fixed random projection, centred so that similar patches align."""
    def embed(patches) -> torch.Tensor:
        flat = torch.as_tensor(patches, dtype=torch.float64).reshape(len(patches), -1)
        projection = torch.from_numpy(
            np.random.default_rng(0).standard_normal((flat.shape[1], FEATURES)) / 64)
        vectors = flat @ projection
        return vectors - vectors.mean(0)
    return image_tree(image, patch, quadtree=True, embed=embed)


def queries_and_keys(tree: NestedSignal, temperature: float):
    """Queries = keys = the leaf vectors: attention follows similarity, so repeated
    words and similar patches attend to each other."""
    x = torch.as_tensor(tree.x, dtype=torch.float32)
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return x * temperature ** 0.5, x * temperature ** 0.5


def main() -> None:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    text = (DATA / "gettysburg.txt").read_text(encoding="utf-8")
    with cbook.get_sample_data("grace_hopper.jpg") as handle:
        image = np.asarray(Image.open(handle).convert("RGB").resize((128, 128))) / 255.0

    words_tree, labels = text_signal(text)
    picture_tree = image_signal(image)
    document = NestedSignal.join([words_tree, picture_tree], "keyvalue", keys=["text", "image"])
    written = []

    start = time.perf_counter()
    draw_tree(words_tree, OUTPUT / "text_tree.png", labels=labels,
              title="Gettysburg Address: document > paragraphs > sentences > words")
    q, k = queries_and_keys(words_tree, temperature=48.0)
    plot_attention(q, k, words_tree, OUTPUT / "text_attention.png",
                   title="Gettysburg Address, q = k = word trigram vectors: HSA vs flat "
                         "attention (boxes: paragraphs and sentences)")
    written += ["text_tree.png", "text_attention.png"]

    # each node labelled with its (row, col) in its parent's grid
    cells = {u: f"({r},{c})" for u, (r, c) in enumerate(picture_tree.position.tolist()) if u}
    draw_tree(picture_tree, OUTPUT / "image_tree.png", labels=cells,
              title="Grace Hopper, 128 x 128: quadtree of 8 x 8 patches of 16 x 16 pixels, "
                    "(row, col) in the parent grid")
    q, k = queries_and_keys(picture_tree, temperature=48.0)
    # grid positions enter the logits through a (randomly initialised) position encoder
    pos = PositionEncoder(16, kind="sinusoidal", dim=16)(picture_tree).detach()
    plot_attention(q, k, picture_tree, OUTPUT / "image_attention.png", pos=pos,
                   title="Grace Hopper patches, q = k = patch vectors, with grid positions: "
                         "HSA vs flat attention (boxes: quadtree regions)")
    written += ["image_tree.png", "image_attention.png"]

    draw_tree(document, OUTPUT / "document_tree.png", color_by="modality",
              modality_names={0: "text", 1: "image"},
              labels={0: "document", 1: "text", int(words_tree.num_nodes) + 1: "image"},
              title='{"text": Gettysburg Address, "image": Grace Hopper} by modality')
    written.append("document_tree.png")
    elapsed = time.perf_counter() - start

    for name in written:
        print(f"wrote {OUTPUT / name} ({(OUTPUT / name).stat().st_size // 1024} KiB)")
    print(f"{len(written)} pictures in {elapsed:.1f} s; text: {words_tree.num_nodes} nodes, "
          f"image: {picture_tree.num_nodes} nodes, document: {document.num_nodes} nodes; "
          f"hsa_graph {hsa_graph.__version__}")


if __name__ == "__main__":
    main()
