"""RecursiveTreeEncoder against a node-by-node reference (one family at a time, no
padding, written from the parent list alone), batching, gradients and bad input."""
from __future__ import annotations

import random

import pytest
import torch
from torch_geometric.data import Batch

from hsa_graph import NestedSignal
from hsa_graph.nn import RecursiveTreeEncoder

FORESTS = [
    [-1, 0],                                       # a root over one leaf
    [-1, 0, 0, 1, 1, 1, -1, 6, 6, -1],             # a forest with a leaf root
    [-1, 0, 1, 2, 3, 3, 2],                        # only children on a chain
    [-1] + [0] * 19 + [1, 1, 2, 2, 2, 22, 22],     # a wide family and narrow ones
]


def random_tree(rng: random.Random, nodes: int) -> list[int]:
    return [-1] + [rng.randrange(u) for u in range(1, nodes)]


def reference(encoder: RecursiveTreeEncoder, parent: list[int], x: torch.Tensor):
    """{node: vector}: each internal node from its children (its leaves by node index,
    then its internal children by node index), one family per call, roots last."""
    children = {u: [] for u in range(len(parent))}
    for u, p in enumerate(parent):
        if p >= 0:
            children[p].append(u)
    leaves = [u for u in range(len(parent)) if not children[u]]
    h = {u: x[r] for r, u in enumerate(leaves)}

    def encode(u):
        if u in h:
            return h[u]
        kids = [c for c in children[u] if not children[c]] + [
            c for c in children[u] if children[c]]
        family = torch.stack([encode(c) for c in kids]).unsqueeze(0)
        for block in encoder.blocks:
            family = block(family)
        h[u] = encoder.norm(family[0, 0])
        return h[u]

    for u in range(len(parent)):
        encode(u)
    return h, leaves


def internal_in_row_order(tree, h):
    s = tree.structure
    return torch.stack([h[int(u)] for u in s.node_of_unified[s.num_leaves:]])


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("parent", FORESTS + [random_tree(random.Random(i), 60)
                                             for i in range(4)])
def test_matches_the_node_by_node_reference(parent, train):
    torch.manual_seed(0)
    encoder = RecursiveTreeEncoder(8, heads=2, num_layers=2, hidden_channels=16).double()
    encoder.train(train)
    tree = NestedSignal.from_parents(torch.tensor(parent))
    x = torch.randn(tree.num_leaves, 8, dtype=torch.float64)
    h, leaves = reference(encoder, parent, x)
    out = encoder(x, tree)
    assert out.shape == (tree.structure.num_internal, 8)
    if out.numel():
        torch.testing.assert_close(out, internal_in_row_order(tree, h))
    roots = [u for u, p in enumerate(parent) if p < 0]
    torch.testing.assert_close(encoder.roots(x, tree), torch.stack([h[u] for u in roots]))


@pytest.mark.parametrize("train", [True, False])   # eval: PyTorch's fused path
def test_a_batch_is_its_trees_one_by_one(train):
    torch.manual_seed(1)
    encoder = RecursiveTreeEncoder(16, heads=4, num_layers=1, hidden_channels=32)
    encoder.train(train)
    rng = random.Random(5)
    trees = [NestedSignal.from_parents(torch.tensor(random_tree(rng, n)))
             for n in (2, 9, 30, 1, 17)]
    xs = [torch.randn(t.num_leaves, 16) for t in trees]
    batch = Batch.from_data_list(trees)
    with torch.no_grad():
        together = encoder.roots(torch.cat(xs), batch)
        alone = torch.cat([encoder.roots(x, t) for x, t in zip(xs, trees)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_gradients_reach_every_parameter_and_leaf():
    torch.manual_seed(2)
    encoder = RecursiveTreeEncoder(8, heads=2, num_layers=2, hidden_channels=16).double()
    tree = NestedSignal.from_parents(torch.tensor(FORESTS[3]))
    x = torch.randn(tree.num_leaves, 8, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda v: encoder.roots(v, tree), (x,), atol=1e-6)
    encoder.roots(x, tree).square().sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0)
               for p in encoder.parameters())
    assert bool((x.grad.abs().sum(1) > 0).all())   # every leaf reaches its root


def test_reset_parameters_and_repr():
    encoder = RecursiveTreeEncoder(8, heads=2, num_layers=3, hidden_channels=16)
    before = [p.detach().clone() for p in encoder.parameters()]
    with torch.no_grad():
        for p in encoder.parameters():
            p.fill_(0.5)
    encoder.reset_parameters()
    after = list(encoder.parameters())
    weights = [i for i, p in enumerate(after) if p.dim() > 1]
    assert all(not torch.equal(after[i], torch.full_like(after[i], 0.5)) for i in weights)
    assert [p.shape for p in after] == [p.shape for p in before]
    assert repr(encoder) == ("RecursiveTreeEncoder(8, heads=2, num_layers=3, "
                             "hidden_channels=16)")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="multiple of heads"):
        RecursiveTreeEncoder(10, heads=4)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        RecursiveTreeEncoder(8, heads=2, num_layers=0)
    with pytest.raises(ValueError, match="channels must be a positive int"):
        RecursiveTreeEncoder(True)
    encoder = RecursiveTreeEncoder(8, heads=2)
    tree = NestedSignal.from_parents(torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="one row per leaf"):
        encoder(torch.randn(3, 8), tree)
    with pytest.raises(ValueError, match=r"x must be \[N, 8\]"):
        encoder(torch.randn(2, 4), tree)
    with pytest.raises(TypeError, match="NestedSignal"):
        encoder(torch.randn(2, 8), [-1, 0, 0])
