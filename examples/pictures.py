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

The trees are built with small local helpers (a regex splitter and hashed trigrams,
as in ``examples/main.py``), independent of the package's builders.

Run: ``python examples/pictures.py``
"""
from __future__ import annotations

import re
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from matplotlib import cbook
from PIL import Image

import hsa_graph
from hsa_graph import NestedSignal, Node
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


def split_text(text: str) -> list:
    """paragraphs (blank lines) -> sentences (after . ! ?) -> word and punctuation tokens."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return [[re.findall(r"\w+(?:[-']\w+)*|[^\w\s]", sentence)
             for sentence in re.split(r"(?<=[.!?])\s+", paragraph) if sentence.strip()]
            for paragraph in paragraphs]


def text_signal(text: str):
    """The text's nested signal and a label per node (words on leaves, P1/S1.2 above)."""
    paragraphs = split_text(text)
    tree = NestedSignal.from_nested(
        [[[trigram_vector(tok) for tok in sentence] for sentence in paragraph]
         for paragraph in paragraphs], modality=0)
    # from_nested numbers nodes depth-first, so the labels follow the same walk.
    labels = ["document"]
    for p, paragraph in enumerate(paragraphs, 1):
        labels.append(f"P{p}")
        for s, sentence in enumerate(paragraph, 1):
            labels.append(f"S{p}.{s}")
            labels.extend(sentence)
    return tree, labels


def image_quadtree(image: np.ndarray, patch: int = 16) -> Node:
    """An ``H x W x C`` image as a grid of 2 x 2 grids of ... of patch vectors."""
    rows, cols = image.shape[0] // patch, image.shape[1] // patch
    projection = np.random.default_rng(0).standard_normal((patch * patch * image.shape[2],
                                                           FEATURES)) / 64
    patches = (image[: rows * patch, : cols * patch]
               .reshape(rows, patch, cols, patch, -1).transpose(0, 2, 1, 3, 4)
               .reshape(rows, cols, -1) @ projection)
    patches = patches - patches.mean((0, 1))  # centred, so similar patches align
    grid = [[patches[r, c] for c in range(cols)] for r in range(rows)]
    while len(grid) > 2:  # group 2 x 2 blocks of cells into regions
        grid = [[Node([[grid[2 * r][2 * c], grid[2 * r][2 * c + 1]],
                       [grid[2 * r + 1][2 * c], grid[2 * r + 1][2 * c + 1]]], "grid")
                 for c in range(len(grid[0]) // 2)] for r in range(len(grid) // 2)]
    return Node(grid, "grid", modality=1)


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

    text_tree, labels = text_signal(text)
    image_tree = NestedSignal.from_nested(image_quadtree(image))
    document = NestedSignal.join([text_tree, image_tree], "keyvalue", keys=["text", "image"])
    written = []

    start = time.perf_counter()
    draw_tree(text_tree, OUTPUT / "text_tree.png", labels=labels,
              title="Gettysburg Address: document > paragraphs > sentences > words")
    q, k = queries_and_keys(text_tree, temperature=48.0)
    plot_attention(q, k, text_tree, OUTPUT / "text_attention.png",
                   title="Gettysburg Address, q = k = word trigram vectors: HSA vs flat "
                         "attention (boxes: paragraphs and sentences)")
    written += ["text_tree.png", "text_attention.png"]

    # each node labelled with its (row, col) in its parent's grid
    cells = {u: f"({r},{c})" for u, (r, c) in enumerate(image_tree.position.tolist()) if u}
    draw_tree(image_tree, OUTPUT / "image_tree.png", labels=cells,
              title="Grace Hopper, 128 x 128: quadtree of 8 x 8 patches of 16 x 16 pixels, "
                    "(row, col) in the parent grid")
    q, k = queries_and_keys(image_tree, temperature=48.0)
    # grid positions enter the logits through a (randomly initialised) position encoder
    pos = PositionEncoder(16, kind="sinusoidal", dim=16)(image_tree).detach()
    plot_attention(q, k, image_tree, OUTPUT / "image_attention.png", pos=pos,
                   title="Grace Hopper patches, q = k = patch vectors, with grid positions: "
                         "HSA vs flat attention (boxes: quadtree regions)")
    written += ["image_tree.png", "image_attention.png"]

    draw_tree(document, OUTPUT / "document_tree.png", color_by="modality",
              modality_names={0: "text", 1: "image"},
              labels={0: "document", 1: "text", int(text_tree.num_nodes) + 1: "image"},
              title='{"text": Gettysburg Address, "image": Grace Hopper} by modality')
    written.append("document_tree.png")
    elapsed = time.perf_counter() - start

    for name in written:
        print(f"wrote {OUTPUT / name} ({(OUTPUT / name).stat().st_size // 1024} KiB)")
    print(f"{len(written)} pictures in {elapsed:.1f} s; text: {text_tree.num_nodes} nodes, "
          f"image: {image_tree.num_nodes} nodes, document: {document.num_nodes} nodes; "
          f"hsa_graph {hsa_graph.__version__}")


if __name__ == "__main__":
    main()
