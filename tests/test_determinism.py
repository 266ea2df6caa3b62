"""With ``torch.use_deterministic_algorithms(True)``, hsa, hsa_weights and an
hsa_graph.nn encoder give bitwise identical outputs and gradients run to run on the
CPU, in this process and in a fresh one (on a real text: the Gettysburg Address)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch_geometric.data import Batch

from hsa_graph import hsa, hsa_weights
from hsa_graph.builders import WordTokenizer, hopping_window_tree, text_tree
from hsa_graph.nn import HierarchicalTransformerEncoder

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "examples" / "data" / "gettysburg.txt").read_text(encoding="utf-8")


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def forest():
    """The address (paragraphs -> sentences -> tokens) batched with a hopping-window
    tree, so that buckets of several family sizes, unary chains and two trees meet."""
    text = text_tree(TEXT, tokenizer=WordTokenizer(num_buckets=1024))
    del text.tokens, text.span  # PyG batches only trees with the same attributes
    ids = torch.randint(0, 1024, (37,), generator=torch.Generator().manual_seed(0))
    return Batch.from_data_list([text, hopping_window_tree(ids, (2, 3, 5))])


def run_hsa(batch, seed: int = 0):
    """Outputs and gradients of hsa on the forest, and hsa_weights (dense) on its
    hopping-window tree."""
    g = torch.Generator().manual_seed(seed)
    n = batch.num_leaves
    q, k, v = (torch.randn(n, 4, 16, generator=g).requires_grad_() for _ in range(3))
    pos = torch.randn(batch.num_nodes, 4, 8, generator=g)
    y = hsa(q, k, v, batch, include_self=False, pos=pos)
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    small = batch.to_data_list()[1]
    theta = hsa_weights(q.detach()[-small.num_leaves:], k.detach()[-small.num_leaves:], small)
    return [y.detach(), q.grad, k.grad, v.grad, theta]


def run_encoder(batch, seed: int = 0):
    torch.manual_seed(seed)
    model = HierarchicalTransformerEncoder(32, num_layers=2, heads=4, pos_dim=8)
    x = torch.randn(batch.num_leaves, 32, generator=torch.Generator().manual_seed(seed + 1))
    x.requires_grad_()
    y = model(x, batch)
    y.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) > 10
    return [y.detach(), x.grad] + grads


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_hsa_is_bitwise_reproducible(deterministic):
    first = run_hsa(forest())
    assert all(t is not None and bool(torch.isfinite(t).all()) for t in first)
    for _ in range(2):  # fresh trees too: the cached structure is not what repeats
        for a, b in zip(first, run_hsa(forest())):
            assert torch.equal(a, b)


def test_encoder_outputs_and_gradients_are_bitwise_reproducible(deterministic):
    batch = forest()
    first = run_encoder(batch)
    again = run_encoder(forest())
    assert len(first) == len(again)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.use_deterministic_algorithms(True)
torch.set_num_threads({threads})
import test_determinism as t
batch = t.forest()
print(t.digest(t.run_hsa(batch) + t.run_encoder(batch)))
"""


def test_fresh_process_gives_the_same_bits(deterministic):
    """A new interpreter (same thread count) reproduces this process's bits."""
    batch = forest()
    here = digest(run_hsa(batch) + run_encoder(batch))
    env = dict(os.environ, PYTHONHASHSEED="123")  # any hash seed: no set-order effects
    script = SCRIPT.format(tests=str(Path(__file__).parent), threads=torch.get_num_threads())
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == here
