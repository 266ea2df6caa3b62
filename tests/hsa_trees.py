"""Parent-array helpers and hypothesis strategies for random trees and forests.

A parent array ``parent[u]`` gives the parent of node ``u`` (``-1`` for a root);
leaves are the childless nodes in increasing node index.  Nothing here imports
``hsa_graph``.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

# ----------------------------------------------------------------------------------------
# Plain helpers
# ----------------------------------------------------------------------------------------


def leaves_of(parent: list[int]) -> list[int]:
    has_child = [False] * len(parent)
    for p in parent:
        if p >= 0:
            has_child[p] = True
    return [u for u in range(len(parent)) if not has_child[u]]


def relabel(parent: list[int], sigma: list[int]) -> tuple[list[int], list[int]]:
    """Rename node u to sigma[u].

    Returns (new_parent, leaf_perm) with ``leaf_perm[r_new] = r_old``: row ``r_new`` of
    the relabelled tree's leaf-ordered tensors is row ``r_old`` of the original's."""
    m = len(parent)
    new_parent = [-1] * m
    for u, p in enumerate(parent):
        new_parent[sigma[u]] = -1 if p < 0 else sigma[p]
    old_leaves = leaves_of(parent)
    old_row = {u: r for r, u in enumerate(old_leaves)}
    inv = [0] * m
    for u in range(m):
        inv[sigma[u]] = u
    leaf_perm = [old_row[inv[w]] for w in leaves_of(new_parent)]
    return new_parent, leaf_perm


def insert_unary(parent: list[int], u: int) -> list[int]:
    """Insert a new node (index len(parent)) between u and its parent."""
    new = list(parent) + [parent[u]]
    new[u] = len(parent)
    return new


def concat_parents(parents: list[list[int]]) -> list[int]:
    """The forest made of several parent arrays, node ids offset in order."""
    out: list[int] = []
    for par in parents:
        off = len(out)
        out += [p + off if p >= 0 else -1 for p in par]
    return out


def dfs_relabel(parent: list[int], child_order: dict[int, list[int]] | None = None
                ) -> list[int]:
    """sigma numbering the nodes in depth-first preorder (roots in index order), with
    the children of node p visited in ``child_order[p]`` when given."""
    m = len(parent)
    children: list[list[int]] = [[] for _ in range(m)]
    for u, p in enumerate(parent):
        if p >= 0:
            children[p].append(u)
    if child_order:
        for p, order in child_order.items():
            assert sorted(order) == sorted(children[p])
            children[p] = list(order)
    sigma = [0] * m
    counter = 0
    stack = [u for u in range(m) if parent[u] < 0][::-1]
    while stack:
        u = stack.pop()
        sigma[u] = counter
        counter += 1
        stack.extend(children[u][::-1])
    return sigma


def random_inputs(n_leaves: int, n_nodes: int, heads: int, d: int, dv: int, seed: int,
                  dtype=torch.float64, pos_dim: int = 0, pos_per_head: bool = False,
                  pos_scale: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_leaves, heads, d, generator=g, dtype=dtype)
    k = torch.randn(n_leaves, heads, d, generator=g, dtype=dtype)
    v = torch.randn(n_leaves, heads, dv, generator=g, dtype=dtype)
    pos = None
    if pos_dim:
        shape = (n_nodes, heads, pos_dim) if pos_per_head else (n_nodes, pos_dim)
        pos = pos_scale * torch.randn(*shape, generator=g, dtype=dtype)
    return q, k, v, pos


# ----------------------------------------------------------------------------------------
# Hypothesis strategies
# ----------------------------------------------------------------------------------------


@st.composite
def random_forest(draw, max_nodes: int = 20) -> list[int]:
    """Random forest: each new node hangs under an earlier node or (rarely) starts a new
    tree; then the ids are shuffled so parents need not come first."""
    m = draw(st.integers(1, max_nodes))
    parent = [-1]
    for u in range(1, m):
        new_root = draw(st.integers(0, 9)) == 0
        parent.append(-1 if new_root else draw(st.integers(0, u - 1)))
    sigma = draw(st.permutations(range(m)))
    return relabel(parent, list(sigma))[0]


@st.composite
def unary_chain_tree(draw, max_len: int = 25) -> list[int]:
    """A deep unary chain ending either in a single leaf or in a small family, possibly
    with a sibling subtree hanging off the chain."""
    length = draw(st.integers(1, max_len))
    parent = [-1] + list(range(length - 1))  # 0 <- 1 <- ... <- length-1
    tail = draw(st.integers(0, 4))  # leaves under the chain's end (0: the end is a leaf)
    parent += [length - 1] * tail
    if draw(st.booleans()):  # a side leaf somewhere on the chain
        parent.append(draw(st.integers(0, length - 1)))
    sigma = draw(st.permutations(range(len(parent))))
    return relabel(parent, list(sigma))[0]


@st.composite
def wide_mixed_tree(draw, max_children: int = 8) -> list[int]:
    """A root whose family mixes leaves, small subtrees and unary wrappers."""
    parent = [-1]
    for _ in range(draw(st.integers(1, max_children))):
        kind = draw(st.sampled_from(["leaf", "pair", "unary_leaf", "unary_pair"]))
        top = len(parent)
        parent.append(0)
        if kind.startswith("unary"):
            parent.append(top)
            top = len(parent) - 1
        if kind.endswith("pair"):
            parent += [top, top]
    sigma = draw(st.permutations(range(len(parent))))
    return relabel(parent, list(sigma))[0]


SPECIAL_TREES = [
    [-1],  # a single node: a root that is itself a leaf
    [-1, 0],  # a single leaf under a root
    [-1, 0, 1, 2, 3],  # single leaf at the end of a unary chain
    [-1, 0, 0],  # two leaves
    [-1, -1, -1],  # three single-node trees
    [1, -1, 1, 1],  # flat tree whose root is not node 0
    [-1, 0, 0, 1, 1, 2],  # leaf 5 under a unary node next to a family
    [-1, 0, 0, 0, 1, 1, 3, 6, 6, 6, -1, 10],  # mixed, plus a second tree
]


def parent_arrays(max_nodes: int = 20):
    return st.one_of(
        random_forest(max_nodes),
        unary_chain_tree(),
        wide_mixed_tree(),
        st.sampled_from(SPECIAL_TREES),
    )
