"""Tests of hsa_graph/structure.py: the TreeStructure layout (unified numbering, levels,
leaf counts, families and buckets) and its reductions, checked against brute force on
hand-made and random forests; caching on NestedSignal; scale."""

from __future__ import annotations

import math
import time
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch_geometric.data import Batch

from hsa_graph import NestedSignal, TreeStructure
from hsa_graph.structure import FamilyBucket

DT = torch.float64


# ----------------------------------------------------------------------------------------
# brute force on plain parent lists
# ----------------------------------------------------------------------------------------


class Brute:
    """Everything about a forest computed the slow, obvious way."""

    def __init__(self, parent: list[int]):
        self.parent = list(parent)
        m = self.m = len(parent)
        self.children = [[] for _ in range(m)]
        for u, p in enumerate(parent):
            if p >= 0:
                self.children[p].append(u)
        self.leaves = [u for u in range(m) if not self.children[u]]
        self.internal = [u for u in range(m) if self.children[u]]
        self.roots = [u for u in range(m) if parent[u] < 0]
        self.depth = [self._depth(u) for u in range(m)]
        self.root_of = [self._root(u) for u in range(m)]
        self.leaf_row = {u: r for r, u in enumerate(self.leaves)}

    def _depth(self, u):
        d = 0
        while self.parent[u] >= 0:
            u = self.parent[u]
            d += 1
        return d

    def _root(self, u):
        while self.parent[u] >= 0:
            u = self.parent[u]
        return u

    def ancestors(self, u):
        """u and everything above it."""
        out = [u]
        while self.parent[u] >= 0:
            u = self.parent[u]
            out.append(u)
        return out

    def leaves_under(self, a):
        return [u for u in self.leaves if a in self.ancestors(u)]

    def n(self, a):
        return len(self.leaves_under(a))


def random_forest(rng_draw, m: int, root_prob: float) -> list[int]:
    """A random forest on m nodes: node k of a random order hangs under an earlier
    one (or is a root); labels are then shuffled so parents need not precede."""
    order_parent = [-1]
    for k in range(1, m):
        order_parent.append(-1 if rng_draw.random() < root_prob else rng_draw.randrange(k))
    label = list(range(m))
    rng_draw.shuffle(label)
    parent = [-1] * m
    for k, p in enumerate(order_parent):
        parent[label[k]] = -1 if p < 0 else label[p]
    return parent


# ----------------------------------------------------------------------------------------
# the full invariant check
# ----------------------------------------------------------------------------------------


def check_structure(parent: list[int], s: TreeStructure) -> None:
    b = Brute(parent)
    m, n, i = b.m, len(b.leaves), len(b.internal)
    assert (s.num_nodes, s.num_leaves, s.num_internal, s.num_trees) == (m, n, i, len(b.roots))

    # unified numbering: leaves first in node order, internal by (depth, parent, index)
    nou = s.node_of_unified.tolist()
    assert nou[:n] == b.leaves
    assert nou[n:] == sorted(b.internal, key=lambda u: (b.depth[u], b.parent[u], u))
    assert sorted(nou) == list(range(m))
    assert s.unified_of_node[s.node_of_unified].tolist() == list(range(m))

    # depth of every unified node
    assert s.depth.tolist() == [b.depth[u] for u in nou]

    # parents as internal rows (null row i for roots)
    row_of = {u: r for r, u in enumerate(nou[n:])}
    assert s.leaf_parent.tolist() == [row_of[b.parent[u]] if b.parent[u] >= 0 else i
                                      for u in b.leaves]
    assert s.internal_parent.tolist() == [row_of[b.parent[u]] if b.parent[u] >= 0 else i
                                          for u in nou[n:]]
    pu = s.parent_unified().tolist()
    assert [nou[p] if p >= 0 else -1 for p in pu] == [b.parent[u] for u in nou]

    # leaf counts n(A)
    assert s.leaf_size.tolist() == [1.0] * n
    assert s.internal_size.dtype == DT
    assert s.internal_size.tolist() == [float(b.n(u)) for u in nou[n:]]

    # levels: level_ptr[d]:level_ptr[d+1] are exactly the internal nodes of depth d
    max_depth = max((b.depth[u] for u in b.internal), default=-1)
    assert s.max_depth == max_depth
    ptr = s.level_ptr
    assert len(ptr) == max_depth + 3
    assert ptr[0] == 0 and ptr[-1] == ptr[-2] == i
    for d in range(max_depth + 1):
        assert set(nou[n + ptr[d]:n + ptr[d + 1]]) == {u for u in b.internal if b.depth[u] == d}
    assert len(s.level_parent) == max(max_depth, 0) + 1
    assert s.level_parent[0].numel() == 0
    for d in range(1, max_depth + 1):
        rows = range(ptr[d], ptr[d + 1])
        expected = [row_of[b.parent[nou[n + r]]] - ptr[d - 1] for r in rows]
        assert s.level_parent[d].tolist() == expected
        assert all(0 <= e < ptr[d] - ptr[d - 1] for e in expected)

    # trees numbered by their roots' node index
    rank = {r: k for k, r in enumerate(sorted(b.roots))}
    assert s.leaf_tree.tolist() == [rank[b.root_of[u]] for u in b.leaves]

    # families with >= 2 members: each in exactly one bucket, with the right members
    families = {p: kids for p, kids in enumerate(b.children) if len(kids) >= 2}
    seen = {}
    grid = defaultdict(list)       # (leaf-only, grid size) -> the sizes its families got
    for bucket in s.buckets:
        assert isinstance(bucket, FamilyBucket)
        size, f = bucket.size, bucket.num_families
        assert size >= 2 and size == padded_size(size)  # a size of the rounding grid
        assert bucket.log_size.shape == (f, size)
        slot_member = {}
        for slot, src in zip(bucket.leaf_slot.tolist(), bucket.leaf_src.tolist()):
            slot_member[slot] = nou[src]
        for slot, src in zip(bucket.internal_slot.tolist(), bucket.internal_src.tolist()):
            assert slot not in slot_member
            slot_member[slot] = nou[n + src]
        assert all(0 <= slot < f * size for slot in slot_member)
        log_size = bucket.log_size.flatten().tolist()
        for fam in range(f):
            members = [slot_member[fam * size + k] for k in range(size)
                       if fam * size + k in slot_member]
            # members fill the first slots, padding after them
            assert all(fam * size + k in slot_member for k in range(len(members)))
            assert len(members) >= 2
            parents = {b.parent[u] for u in members}
            assert len(parents) == 1
            p = parents.pop()
            assert nou[n + int(bucket.parent[fam])] == p
            assert p not in seen, f"family of node {p} in two buckets"
            seen[p] = members
            assert sorted(members) == families[p]
            # padded size: the smallest grid size holding the family, or a wider one
            # where small buckets merged (check_bucket_merges, below)
            leaf_only = all(u in b.leaves for u in members)
            grid[leaf_only, padded_size(len(members))].append(size)
            assert size >= padded_size(len(members))
            for k in range(size):
                value = log_size[fam * size + k]
                if k < len(members):
                    assert value == pytest.approx(math.log(b.n(members[k])))
                else:
                    assert value == float("-inf")
        # fast paths agree with the slot lists (a bucket whose every slot holds a leaf
        # lists them in slot order: scatter_leaves reads its rows as they are)
        if bucket.leaf_slot.numel() == f * size:
            assert bucket.leaf_slot.tolist() == list(range(f * size))
        if bucket.leaf_range is not None:
            lo, hi = bucket.leaf_range
            assert hi - lo == f * size and bucket.internal_slot.numel() == 0
            assert bucket.leaf_src.tolist() == [lo + slot for slot in bucket.leaf_slot.tolist()]
        if bucket.leaf_block is not None:
            lo, per_family = bucket.leaf_block
            assert bucket.leaf_src.tolist() == list(range(lo, lo + f * per_family))
            assert bucket.leaf_slot.tolist() == [fam * size + j for fam in range(f)
                                                 for j in range(per_family)]
            assert bucket.internal_slot.numel() == f * (size - per_family)
        if bucket.internal_range is not None:
            lo, hi = bucket.internal_range
            assert hi - lo == f * size and bucket.leaf_slot.numel() == 0
            assert bucket.internal_src.tolist() == [lo + slot
                                                    for slot in bucket.internal_slot.tolist()]
    assert set(seen) == set(families)
    check_bucket_merges(grid, s)
    assert s.num_families == len(families)
    assert s.num_attention_weights == sum(len(k) ** 2 - len(k) for k in families.values())

    # gather_bucket / scatter_buckets against the slot lists
    leaf_ids = torch.arange(n, dtype=DT).unsqueeze(1) + 1
    internal_ids = -(torch.arange(i, dtype=DT).unsqueeze(1) + 1)
    gathered = []
    for bucket in s.buckets:
        g = s.gather_bucket(bucket, leaf_ids, internal_ids)
        assert g.shape == (bucket.num_families, bucket.size, 1)
        flat = g.reshape(-1).tolist()
        expected = [None] * (bucket.num_families * bucket.size)
        for slot, src in zip(bucket.leaf_slot.tolist(), bucket.leaf_src.tolist()):
            expected[slot] = float(src + 1)
        for slot, src in zip(bucket.internal_slot.tolist(), bucket.internal_src.tolist()):
            expected[slot] = float(-(src + 1))
        for slot, (got, want) in enumerate(zip(flat, expected)):
            if want is not None:
                assert got == want, f"slot {slot}"
            else:  # padding: zero, or a copy of a member of the same family
                fam = slot // bucket.size
                members = expected[fam * bucket.size:(fam + 1) * bucket.size]
                assert got == 0.0 or got in members, f"padding slot {slot} holds {got}"
        gathered.append(g.reshape(-1, 1))
    # the same members through one scratch shared by the copied buckets, taken in turn
    # (leaf_block buckets are copied alone, or yielded in two parts: no scratch)
    copied = [bk.num_families * bk.size for bk in s.buckets if bk.leaf_range is None
              and bk.internal_range is None and bk.leaf_block is None]
    assert [not bk.is_view for bk in s.buckets] == [
        bk.leaf_range is None and bk.internal_range is None for bk in s.buckets]
    # read: the first of the ways that applies, by_index when none does
    ways = ("leaf_range", "internal_range", "leaf_block", "leaf_gather", "internal_gather")
    for bk in s.buckets:
        given = [w for w in ways if getattr(bk, w) is not None]
        assert bk.read == (given[0] if given else "by_index")
        assert bk.copies_by_index == (not given)
    assert s.copied_slots == max(copied, default=0)
    # a leaf_block bucket in two parts (its leaves, a view of the leaf rows; its
    # internal members), the others as gather_bucket; the scatters take those rows
    to_scatter = {"leaf": [], "internal": []}
    for bucket, g, part in zip(s.buckets, gathered, s.gather_buckets(
            leaf_ids, internal_ids, reuse=True)):
        if bucket.leaf_block is None:
            assert part.reshape(-1, 1).tolist() == g.tolist()
            to_scatter["leaf"].append(g)
            to_scatter["internal"].append(g)
            continue
        leaves, inner = part
        lo, per_family = bucket.leaf_block
        f = bucket.num_families
        assert leaves.shape == (f, per_family, 1)
        assert inner.shape == (f, bucket.size - per_family, 1)
        assert leaves.data_ptr() == leaf_ids[lo].data_ptr()  # in place
        assert torch.cat([leaves, inner], 1).reshape(-1, 1).tolist() == g.tolist()
        to_scatter["leaf"].append(leaves.reshape(-1, 1))
        to_scatter["internal"].append(inner.reshape(-1, 1))
    # every slot's leaf row, N (the scatter's spare row) where a slot holds no leaf
    for bucket, rows in zip(s.buckets, s.leaf_of_slot):
        if rows is not None:
            expected = [n] * (bucket.num_families * bucket.size)
            for slot, src in zip(bucket.leaf_slot.tolist(), bucket.leaf_src.tolist()):
                expected[slot] = src
            assert rows.tolist() == expected
    like = torch.zeros(1, 1, dtype=DT)
    leaf_rows = s.scatter_leaves(to_scatter["leaf"], 0.5, like)
    internal_rows = s.scatter_internal(to_scatter["internal"], 0.5, like)
    # recorded: the scatters' one-gather paths read the same rows
    grads = [t.clone().requires_grad_() for t in to_scatter["leaf"]]
    assert s.scatter_leaves(grads, 0.5, like).tolist() == leaf_rows.tolist()
    grads = [t.clone().requires_grad_() for t in to_scatter["internal"]]
    assert s.scatter_internal(grads, 0.5, like).tolist() == internal_rows.tolist()
    in_family = {u for kids in families.values() for u in kids}
    assert leaf_rows.reshape(-1).tolist() == [float(r + 1) if u in in_family else 0.5
                                              for r, u in enumerate(b.leaves)]
    assert internal_rows.shape == (i + 1, 1)
    assert internal_rows.reshape(-1).tolist() == [
        float(-(r + 1)) if u in in_family else 0.5 for r, u in enumerate(nou[n:])] + [0.5]
    assert s.lonely_leaf.tolist() == [r for r, u in enumerate(b.leaves) if u not in in_family]
    whole = s.whole_leaf_bucket
    if whole is not None:
        assert s.buckets[whole].leaf_range == (0, n)

    # reductions
    torch.manual_seed(len(parent))
    values = torch.randn(n, 2, 3, dtype=DT)
    sums = s.subtree_sum(values)
    assert sums.shape == (i + 1, 2, 3)
    expected = torch.stack([values[[b.leaf_row[v] for v in b.leaves_under(u)]].sum(0)
                            for u in nou[n:]] + [torch.zeros(2, 3, dtype=DT)])
    # rows of the internal nodes (the null row is checked in test_null_row_is_zero)
    torch.testing.assert_close(sums[:i], expected[:i], rtol=1e-12, atol=1e-12)
    means = s.subtree_mean(values)
    sizes = torch.tensor([b.n(u) for u in nou[n:]] + [1], dtype=DT).view(-1, 1, 1)
    torch.testing.assert_close(means[:i], (expected / sizes)[:i], rtol=1e-12, atol=1e-12)
    direct = s.to_internal(values)
    assert direct.shape == (i + 1, 2, 3)
    expected_direct = torch.zeros(i + 1, 2, 3, dtype=DT)
    for r, u in enumerate(b.leaves):
        if b.parent[u] >= 0:
            expected_direct[row_of[b.parent[u]]] += values[r]
    torch.testing.assert_close(direct[:i], expected_direct[:i], rtol=1e-12, atol=1e-12)

    delta = torch.randn(i + 1, 4, dtype=DT)
    got = s.path_sum(delta)
    assert got.shape == (i + 1, 4)
    rows = []
    for u in nou[n:]:
        acc = torch.zeros(4, dtype=DT)
        for a in b.ancestors(u):
            if b.parent[a] >= 0:  # value(root) = 0: the root's delta is not added
                acc = acc + delta[row_of[a]]
        rows.append(acc)
    rows.append(torch.zeros(4, dtype=DT))
    torch.testing.assert_close(got, torch.stack(rows), rtol=1e-12, atol=1e-12)

    # leaf_paths: ancestors of each leaf by depth
    paths = s.leaf_paths()
    assert paths.shape == (n, max_depth + 2)
    uni = s.unified_of_node.tolist()
    for r, u in enumerate(b.leaves):
        want = [-1] * (max_depth + 2)
        for a in b.ancestors(u):
            want[b.depth[a]] = uni[a]
        assert paths[r].tolist() == want


# ----------------------------------------------------------------------------------------
# hand-made trees
# ----------------------------------------------------------------------------------------


HAND_MADE = {
    "single_leaf": [-1],
    "flat": [-1, 0, 0, 0, 0, 0],
    "two_levels": [-1, 0, 0, 1, 1, 2, 2, 2],
    "unordered_labels": [2, -1, 1, 2, 1, 0, 0],
    "chain": [-1, 0, 1, 2, 3],
    "unary_nodes": [-1, 0, 1, 1, 0, 4, 5, 5, 5],
    "mixed_families": [-1, 0, 0, 0, 1, 1, 1, 2, 2, 4, 4, 4, 4, 4],
    "forest_with_lone_leaves": [-1, -1, 1, 1, -1, 4, 5, 5, -1],
    "sizes_2_3_4_5": [-1] + [0] * 4 + [1] * 2 + [2] * 3 + [3] * 4 + [4] * 5,
    "leaf_and_internal_siblings": [-1, 0, 0, 0, 2, 2, 3, 6, 6],
    "equal_leaf_families": [-1, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2],
    "equal_leaf_families_unordered": [-1, 0, 0, 2, 1, 2, 1, 1, 2, 1, 2],
    "flat_forest": [-1, 0, 0, -1, 3, 3],
    # spine nodes with 3 leaves each and the next spine node: leaf blocks, read in place
    "caterpillar": [-1, 0, 1, 2, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
    # ragged leaf families (2..5 members, rounded up above 16 only): index_select gathers
    "ragged_leaf_families": [-1, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4],
}


@pytest.mark.parametrize("name", sorted(HAND_MADE))
def test_structure_hand_made(name):
    parent = HAND_MADE[name]
    check_structure(parent, TreeStructure.from_parent(torch.tensor(parent)))
    # the one cached on a NestedSignal is the same layout
    tree = NestedSignal.from_parents(parent)
    check_structure(parent, tree.structure)


@pytest.mark.parametrize("parent", [
    [-1],                                   # a single node: a root that is a leaf
    [-1, 0, 0, -1],                         # a tree and a lone-leaf tree
    [-1, -1, 1, 1, -1, 4, 5, 5, -1],        # lone leaves first, in between and last
    [-1, 0, 0, 1, 1],                       # no lone leaf (null row trivially zero)
])
def test_null_row_is_zero(parent):
    """to_internal / subtree_sum / subtree_mean document a zero null row (the row
    standing for "no parent") even when some trees of the forest are single leaves."""
    s = TreeStructure.from_parent(torch.tensor(parent))
    i = s.num_internal
    values = torch.arange(1.0, s.num_leaves + 1, dtype=DT).unsqueeze(1)
    zero = torch.zeros(1, dtype=DT)
    for name in ("to_internal", "subtree_sum", "subtree_mean"):
        out = getattr(s, name)(values)
        assert out.shape == (i + 1, 1), name
        assert torch.equal(out[i], zero), f"{name}: null row {out[i].tolist()}"


def test_concrete_numbers():
    s = TreeStructure.from_parent(torch.tensor([-1, 0, 0, 1, 1, 2, 2, 2]))
    assert s.node_of_unified.tolist() == [3, 4, 5, 6, 7, 0, 1, 2]
    assert s.internal_size.tolist() == [5.0, 2.0, 3.0]
    assert s.depth.tolist() == [2, 2, 2, 2, 2, 0, 1, 1]
    assert s.level_ptr == [0, 1, 3, 3]
    assert s.leaf_parent.tolist() == [1, 1, 2, 2, 2]
    assert s.internal_parent.tolist() == [3, 0, 0]
    # the root's family of two internal nodes; the leaf families of 2 and 3 share a
    # bucket of width 3 (small buckets merge)
    assert sorted((bk.size, bk.num_families) for bk in s.buckets) == [(2, 1), (3, 2)]
    assert s.num_families == 3
    assert s.num_attention_weights == 2 + 2 + 6


def test_batch_structure_is_forest_of_graphs():
    parents = [[-1, 0, 0, 1, 1], [-1], [2, 2, -1, 0, 0, 0], [-1, 0, 0]]
    trees = [NestedSignal.from_parents(p) for p in parents]
    batch = Batch.from_data_list(trees)
    flat = []
    offset = 0
    for p in parents:
        flat += [q + offset if q >= 0 else -1 for q in p]
        offset += len(p)
    check_structure(flat, batch.structure)
    assert batch.structure.num_trees == batch.num_graphs
    assert batch.structure.leaf_tree.tolist() == batch.batch[batch.leaf_index].tolist()


def test_structure_to_device_copy():
    s = TreeStructure.from_parent(torch.tensor(HAND_MADE["mixed_families"]))
    c = s.to("cpu")
    assert c.device == torch.device("cpu")
    check_structure(HAND_MADE["mixed_families"], c)


def test_from_parent_rejects_non_tensors():
    with pytest.raises(TypeError):
        TreeStructure.from_parent([-1, 0, 0])
    with pytest.raises(TypeError):
        TreeStructure.from_parent(torch.tensor([-1.0, 0.0]))
    with pytest.raises(ValueError, match="cycle"):
        TreeStructure.from_parent(torch.tensor([-1, 2, 1]))


# ----------------------------------------------------------------------------------------
# random forests
# ----------------------------------------------------------------------------------------


@st.composite
def forests(draw):
    m = draw(st.integers(1, 40))
    root_prob = draw(st.sampled_from([0.0, 0.05, 0.3]))
    rnd = draw(st.randoms(use_true_random=False))
    return random_forest(rnd, m, root_prob)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests())
def test_structure_random_forests(parent):
    check_structure(parent, TreeStructure.from_parent(torch.tensor(parent)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests(), st.sampled_from([torch.int64, torch.int32]))
def test_signal_structure_random_forests(parent, dtype):
    tree = NestedSignal.from_parents(torch.tensor(parent, dtype=dtype))
    assert tree.parent.tolist() == parent
    check_structure(parent, tree.structure)


# ----------------------------------------------------------------------------------------
# caching
# ----------------------------------------------------------------------------------------


def test_structure_is_cached():
    tree = NestedSignal.from_parents([-1, 0, 0, 1, 1])
    first = tree.structure
    assert tree.structure is first
    assert tree.structure_for("cpu") is first
    assert tree.structure_for(torch.device("cpu")) is first


def test_constants_are_made_once_per_key():
    st = NestedSignal.from_parents([-1, 0, 0, 1, 1, 1, 2, 2]).structure
    made = []

    def build():
        made.append(1)
        return torch.ones(2)

    first = st.constant(("test", torch.float32), build)
    assert st.constant(("test", torch.float32), build) is first
    st.constant(("test", torch.float64), build)
    assert len(made) == 2
    assert st.constant(("none",), lambda: None) is None
    assert st.constant(("none",), build) is None           # a kept None is kept too
    # a copy on a device has its own, made afresh
    assert "_constants" not in vars(st.to("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_node_size_as_and_bottom_up_weights(dtype):
    parent = [-1, 0, 0, 1, 1, 1, 2, 2, -1]                 # node 8: a lonely root leaf
    st = NestedSignal.from_parents(parent).structure
    size = st.node_size_as(dtype)
    assert size.dtype == dtype and size.shape == (st.num_nodes + 1,)
    assert size[-1] == 1 and torch.equal(size[:-1], st.node_size.to(dtype))
    leaf_weight, child_weight = st.bottom_up_weights(dtype)
    n = st.num_leaves
    internal = size[n:]
    torch.testing.assert_close(leaf_weight[:, 0], 1 / internal[st.leaf_parent])
    torch.testing.assert_close(child_weight[:, 0], internal[:-1] / internal[st.internal_parent])
    assert st.node_size_as(dtype) is size


def test_in_place_edit_of_edge_index_invalidates_cache():
    tree = NestedSignal.from_parents([-1, 0, 0, 1, 1])
    first = tree.structure
    assert first.internal_size.tolist() == [3.0, 2.0]
    # move leaf 4 from node 1 to node 0 (in place)
    col = tree.edge_index[1].tolist().index(4)
    tree.edge_index[0, col] = 0
    second = tree.structure
    assert second is not first
    check_structure([-1, 0, 0, 1, 0], second)
    assert tree.structure is second


def test_replacing_edge_index_invalidates_cache():
    tree = NestedSignal.from_parents([-1, 0, 0, 1, 1])
    first = tree.structure
    tree.edge_index = NestedSignal.from_parents([-1, 0, 1, 2, 3]).edge_index
    second = tree.structure
    assert second is not first
    check_structure([-1, 0, 1, 2, 3], second)


def test_batch_and_unbatched_trees_build_their_own_structure():
    trees = [NestedSignal.from_parents([-1, 0, 0]), NestedSignal.from_parents([-1, 0])]
    batch = Batch.from_data_list(trees)
    assert batch.structure.num_nodes == 5
    assert batch.structure is batch.structure
    back = batch.to_data_list()
    assert back[0].structure.num_nodes == 3 and back[1].structure.num_nodes == 2


# ----------------------------------------------------------------------------------------
# scale
# ----------------------------------------------------------------------------------------


def test_deep_chain_without_recursion():
    m = 10_000
    parent = torch.arange(-1, m - 1)
    tree = NestedSignal.from_parents(parent)
    s = tree.structure
    assert s.num_leaves == 1 and s.num_trees == 1
    assert s.max_depth == m - 2
    assert s.depth[0].item() == m - 1
    assert s.internal_size.tolist() == [1.0] * (m - 1)
    assert s.num_families == 0
    sums = s.subtree_sum(torch.ones(1, 2, dtype=DT))
    assert torch.equal(sums[:-1], torch.ones(m - 1, 2, dtype=DT))
    path = s.path_sum(torch.ones(m, dtype=DT))
    assert path[:-1].tolist() == [float(d) for d in range(m - 1)]


def balanced_parent(num_leaves: int, branching: int) -> torch.Tensor:
    """Levels built bottom-up: every node of a level hangs under node k // branching
    of the level above, until one root. Node ids: root first, leaves last."""
    sizes = [num_leaves]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // branching))
    sizes.reverse()  # root level first
    starts = [0]
    for s in sizes[:-1]:
        starts.append(starts[-1] + s)
    parts = [torch.tensor([-1])]
    for level in range(1, len(sizes)):
        k = torch.arange(sizes[level])
        parts.append(starts[level - 1] + k // branching)
    return torch.cat(parts), sizes


def test_million_leaf_balanced_tree_builds():
    parent, sizes = balanced_parent(1_000_000, 16)
    assert sizes == [1, 16, 245, 3907, 62500, 1_000_000]
    start = time.perf_counter()
    tree = NestedSignal.from_parents(parent)
    s = tree.structure
    elapsed = time.perf_counter() - start
    # timing goals live in benchmarks/bench_structure.py; here only the result counts
    print(f"\n1,000,000-leaf tree ({parent.numel()} nodes, branching 16): "
          f"from_parents + structure in {elapsed:.2f} s")
    assert s.num_leaves == 1_000_000
    assert s.num_internal == sum(sizes[:-1])
    assert s.internal_size[0].item() == 1_000_000.0
    assert s.max_depth == len(sizes) - 2
    assert s.level_ptr == [0, 1, 17, 262, 4169, 66669, 66669]
    # leaf counts add up to N on every level
    for d in range(s.max_depth + 1):
        assert s.internal_size[s.level_ptr[d]:s.level_ptr[d + 1]].sum().item() == 1_000_000
    # no unary node here: every internal node is a family, every non-root node a member
    assert s.num_families == s.num_internal
    total = sum(bucket.leaf_slot.numel() + bucket.internal_slot.numel() for bucket in s.buckets)
    assert total == parent.numel() - 1


def padded_size(s: int) -> int:
    """Independent statement of the bucket grid: exact up to 16, then ``c * 2^e`` with
    ``8 <= c < 16``: the smallest such number >= s."""
    if s <= 16:
        return s
    step = 2 ** (s.bit_length() - 4)
    return -(-s // step) * step


def min_merged_cost(widths: list[int], counts: list[int], overhead: int) -> int:
    """Independent statement of the merge rule: the least ``sum(overhead + families x
    width)`` over every cut of the small buckets (``widths`` ascending) into runs of
    consecutive widths, each padded to its widest (brute force over the 2^(k-1) cuts)."""
    best = None
    for cuts in range(1 << max(len(widths) - 1, 0)):
        cost, count = 0, 0
        for j, (width, f) in enumerate(zip(widths, counts)):
            count += f
            if j == len(widths) - 1 or cuts >> j & 1:
                cost, count = cost + overhead + count * width, 0
        best = cost if best is None else min(best, cost)
    return best or 0


def check_bucket_merges(grid: dict, s: TreeStructure) -> None:
    """``grid``: (leaf-only, grid size) -> the bucket size each of its families got.
    Buckets of at least BUCKET_SLOTS slots keep their size; the small ones share
    buckets at the least cost (:func:`min_merged_cost`), each grid size in one."""
    from hsa_graph.structure import BUCKET_SLOTS
    for kind in (False, True):
        small = sorted((size, len(got)) for (leaf_only, size), got in grid.items()
                       if leaf_only == kind and len(got) * size < BUCKET_SLOTS)
        for (leaf_only, size), got in grid.items():
            if leaf_only == kind:
                assert len(set(got)) == 1, "the families of one grid size split up"
                if len(got) * size >= BUCKET_SLOTS:
                    assert got[0] == size, "a large bucket was padded"
        merged = defaultdict(int)                         # width -> families
        for size, count in small:
            merged[grid[kind, size][0]] += count
        cost = sum(BUCKET_SLOTS + f * width for width, f in merged.items())
        assert cost == min_merged_cost(*zip(*small), BUCKET_SLOTS) if small else not merged


def test_bucket_merges_by_hand():
    """Small buckets merge where padding is cheaper than a bucket; large ones stay."""
    from hsa_graph.structure import _merged_bucket_keys
    # leaf-only keys are odd: widths 2 (3 families), 3 (2), 16 (200: large)
    assert _merged_bucket_keys([5, 7, 33], [3, 2, 200], 512) == [7, 7, 33]
    # two small buckets whose merge would pad more than a bucket costs stay apart
    assert _merged_bucket_keys([4, 200], [100, 3], 512) == [4, 200]
    # kinds never mix: a mixed bucket (even key) and a leaf-only one of one width
    assert _merged_bucket_keys([4, 5], [1, 1], 512) == [4, 5]
    assert _merged_bucket_keys([], [], 512) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 400)), max_size=7),
       st.integers(0, 3000))
def test_merged_widths_are_the_cheapest_runs(pairs, overhead):
    """_merged_widths pads runs of consecutive widths to their widest, at the least
    cost over every cut (min_merged_cost, brute force)."""
    from hsa_graph.structure import _merged_widths
    widths = sorted({2 + 3 * step for step, _ in pairs})
    weights = [w for _, w in pairs][:len(widths)]
    weights += [1] * (len(widths) - len(weights))
    out = _merged_widths(widths, weights, overhead)
    assert len(out) == len(widths)
    assert all(o >= w for o, w in zip(out, widths)) and out == sorted(out)
    assert all(o in widths for o in out)          # a run takes its widest member's width
    groups = defaultdict(int)
    for o, weight in zip(out, weights):
        groups[o] += weight
    cost = sum(overhead + weight * width for width, weight in groups.items())
    assert cost == min_merged_cost(widths, weights, overhead) if widths else out == []


def test_causal_widths_merge_per_depth():
    """The causal plan's family widths: merged within a depth by the rows under them,
    never across depths."""
    from hsa_graph.structure import CAUSAL_GROUP_PAIRS, _causal_widths
    depth = torch.tensor([1, 1, 2, 2, 2])
    width = torch.tensor([2, 3, 2, 3, 16])
    few = torch.tensor([4, 4, 4, 4, 4])           # few rows: a depth's widths share one
    assert _causal_widths(depth, width, few).tolist() == [3, 3, 16, 16, 16]
    many = torch.full((5,), CAUSAL_GROUP_PAIRS)   # padding a width costs more than a group
    assert _causal_widths(depth, width, many).tolist() == [2, 3, 2, 3, 16]


def test_causal_plan_family_parents_and_lambda_sources():
    """Each causal group names its families' parents, and every member the node whose
    lambda it has: itself, or the end of its chain of only children (a leaf, or a node
    with two or more children)."""
    # 0 -> (1, 2); 1 -> 3 -> 4 -> (5, 6); 2 -> 7 (a leaf alone); leaves 5, 6, 7, 8
    parent = [-1, 0, 0, 1, 3, 4, 4, 2, 0]
    st = TreeStructure.from_parent(torch.tensor(parent))
    unified = st.unified_of_node
    seen = {}
    for level in st.causal_plan.levels:
        for g in level.groups:
            for parent_u, members, sources in zip(g.family_parent.tolist(),
                                                  g.members.tolist(), g.member_lam.tolist()):
                seen[parent_u] = {m: s for m, s in zip(members, sources)
                                  if m < st.num_nodes}
    root, fam_4 = int(unified[0]), int(unified[4])
    assert set(seen) == {root, fam_4}                   # the families of two or more
    assert seen[fam_4] == {int(unified[5]): int(unified[5]),
                           int(unified[6]): int(unified[6])}
    assert seen[root] == {int(unified[1]): fam_4,       # 1 -> 3 -> 4: 4's lambda
                          int(unified[2]): int(unified[7]),  # 2 -> 7: the leaf's
                          int(unified[8]): int(unified[8])}


def test_padded_size_grid():
    assert [padded_size(s) for s in (2, 15, 16, 17, 19, 31, 33, 63, 64, 65, 1000)] == [
        2, 15, 16, 18, 20, 32, 36, 64, 64, 72, 1024]
    from hsa_graph.structure import _padded_size
    sizes = torch.arange(1, 5000)
    assert _padded_size(sizes).tolist() == [padded_size(s) for s in sizes.tolist()]


def _dense_passes(s: TreeStructure):
    """Independent matrices of the two linear passes over internal rows ``[I + 1]``:
    subtree sums ``U[a, b] = 1`` when ``b`` is ``a`` or below it, path sums
    ``P[a, b] = 1`` when ``b`` is on the path from ``a`` up to, not including, its root
    (the null row and the roots read nothing)."""
    i = s.num_internal
    parent = s.internal_parent.tolist()
    up = torch.zeros(i + 1, i + 1, dtype=DT)
    up[i, i] = 1.0
    path = torch.zeros(i + 1, i + 1, dtype=DT)
    for b in range(i):
        a = b
        while a != i:  # for every ancestor-or-self a of b: b is in a's subtree sum,
            up[a, b] = 1.0
            if parent[a] != i:  # and a's delta (a not a root) in b's path sum
                path[b, a] = 1.0
            a = parent[a]
    return up, path


@pytest.mark.parametrize("name", ["two_levels", "chain", "unary_nodes", "mixed_families",
                                  "forest_with_lone_leaves", "caterpillar",
                                  "leaf_and_internal_siblings"])
def test_linear_passes_and_their_gradients(name):
    """bottom_up (no combine) and path_sum recorded by autograd are one node each whose
    backward is the adjoint pass: values and gradients (first and second order) match
    dense matrices built independently from the parent pointers."""
    s = TreeStructure.from_parent(torch.tensor(HAND_MADE[name]))
    up, path = _dense_passes(s)
    gen = torch.Generator().manual_seed(len(name))
    x = torch.randn(s.num_internal + 1, 2, 3, dtype=DT, generator=gen, requires_grad=True)
    for fn, dense in ((s.bottom_up, up), (s.path_sum, path)):
        y = fn(x)
        torch.testing.assert_close(y, torch.einsum("ab,bhd->ahd", dense, x), rtol=0, atol=1e-12)
        g = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(gx, torch.einsum("ab,ahd->bhd", dense, g), rtol=0, atol=1e-12)
        assert torch.autograd.gradcheck(fn, (x,))
        assert torch.autograd.gradgradcheck(fn, (x,))


# leaf families of sizes 2, 3, 2, 3 (each size's two families apart in leaf order), and
# internal families likewise: buckets that read by index, two per size
INTERLEAVED_LEAF_FAMILIES = [-1, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4]
INTERLEAVED_INTERNAL_FAMILIES = [-1, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4] + [
    node for node in range(5, 15) for _ in range(2)]


# two families (sizes 3 and 2) that mix leaves and internal members, read by index
MIXED_FAMILIES = [-1, 0, 0, 0, 1, 2, 2, 5]


@pytest.mark.parametrize("parent, shared, mixed", [
    (INTERLEAVED_LEAF_FAMILIES, "leaf", False), (INTERLEAVED_INTERNAL_FAMILIES, "internal", False),
    (HAND_MADE["ragged_leaf_families"], None, False),
    (HAND_MADE["mixed_families"], None, False), (HAND_MADE["caterpillar"], None, False),
    (MIXED_FAMILIES, None, True)])
def test_gather_buckets_equals_gather_bucket(parent, shared, mixed, monkeypatch):
    """gather_buckets (one shared gather per source for index-read buckets, and for
    buckets mixing leaves and internal members, where autograd records) gives every
    bucket's gather_bucket, values and gradients."""
    # every grid size its own bucket (small buckets would merge into one)
    monkeypatch.setattr("hsa_graph.structure.BUCKET_SLOTS", 0)
    s = TreeStructure.from_parent(torch.tensor(parent))
    assert [kind for kind, *_ in s.shared_gathers] == ([shared] if shared else [])
    assert (s.shared_source_gathers is not None) == mixed
    if mixed:
        assert len(s.shared_source_gathers.buckets) == 2
    gen = torch.Generator().manual_seed(3)
    leaf = torch.randn(s.num_leaves, 2, 3, dtype=DT, generator=gen, requires_grad=True)
    inner = torch.randn(s.num_internal + 1, 2, 3, dtype=DT, generator=gen, requires_grad=True)
    # (a leaf_block bucket comes in two parts: leaves in place, internal members)
    together = [torch.cat(t, 1) if isinstance(t, tuple) else t
                for t in s.gather_buckets(leaf, inner)]
    alone = [s.gather_bucket(b, leaf, inner) for b in s.buckets]
    assert len(together) == len(alone) == len(s.buckets)
    weights = [torch.randn(t.shape, dtype=DT, generator=gen) for t in alone]
    grads = []
    for parts in (together, alone):
        loss = sum((p * w).sum() for p, w in zip(parts, weights))
        grads.append(torch.autograd.grad(loss, (leaf, inner), allow_unused=True))
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(*grads):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_chain_runs():
    """Runs of one-node internal levels (their passes are one cumulative sum)."""
    assert TreeStructure.from_parent(torch.tensor(HAND_MADE["chain"])).chain_runs == ((0, 3),)
    cat = TreeStructure.from_parent(torch.tensor(HAND_MADE["caterpillar"]))
    assert cat.chain_runs == ((0, 3),)
    assert TreeStructure.from_parent(torch.tensor(HAND_MADE["two_levels"])).chain_runs == ()
    # root, one unary node, then a level of two: the run is levels 0..1 only
    assert TreeStructure.from_parent(torch.tensor([-1, 0, 1, 1, 2, 2, 3, 3])).chain_runs == (
        (0, 1),)


def test_leaf_block_window_and_leaf_rows_in():
    """A leaf_block bucket's leaves as wider overlapping windows (each family's leaves,
    then the next leaf rows), ``None`` past the last leaf; and the rows of an output
    buffer that hold a bucket's leaves in one block, which scatter_leaves then does not
    copy again."""
    s = TreeStructure.from_parent(torch.tensor([-1, 0, 1] + [0] * 3 + [1] * 3 + [2] * 3))
    (bucket,) = [b for b in s.buckets if b.leaf_block is not None]
    lo, per_family = bucket.leaf_block
    f = bucket.num_families
    rows = torch.arange(s.num_leaves, dtype=DT).unsqueeze(1)
    window = s.leaf_block_window(bucket, rows, per_family + 2)
    assert window.reshape(f, -1).tolist() == [
        [lo + fam * per_family + j for j in range(per_family + 2)] for fam in range(f)]
    assert s.leaf_block_window(bucket, rows, per_family).data_ptr() == rows[lo].data_ptr()
    past_the_end = s.num_leaves - lo - (f - 1) * per_family + 1
    assert s.leaf_block_window(bucket, rows, past_the_end) is None
    assert s.leaf_block_window(bucket, rows, per_family - 1) is None

    out = s.new_leaf_rows(rows)
    assert out.shape == (s.num_leaves + 1, 1)
    block = s.leaf_rows_in(out, bucket)
    assert block.shape == (f * per_family, 1) and block.data_ptr() == out[lo].data_ptr()
    block.copy_(rows[lo:lo + f * per_family])
    parts = list(s.gather_buckets(rows, -rows[:s.num_internal]))
    per_bucket = [block if b is bucket else p.reshape(-1, 1)
                  for b, p in zip(s.buckets, parts)]
    assert s.scatter_leaves(per_bucket, 0.5, rows, out=out).tolist() == rows.tolist()


def test_to_internal_family_sums_honour_out():
    """Sums handed in (``family_sums``) land where summing the leaves would: in ``out``
    when one is given (also while autograd records), else in a new tensor."""
    s = TreeStructure.from_parent(torch.tensor(HAND_MADE["equal_leaf_families"]))
    whole = s.buckets[s.whole_leaf_bucket]
    leaf = torch.randn(s.num_leaves, 3, dtype=DT, requires_grad=True)
    sums = leaf.view(whole.num_families, whole.size, 3).sum(1)
    expected = s.to_internal(leaf.detach())
    torch.testing.assert_close(s.to_internal(leaf, family_sums=sums), expected)
    out = torch.zeros(s.num_internal + 1, 3, dtype=DT)
    result = s.to_internal(leaf, out=out, family_sums=sums)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, expected)


def test_unified_rows_read_the_stacked_node_table():
    """unified_rows(leaf, internal, ids) is row ids of cat([leaf, internal]) (unified
    ids: leaves first, the null row last), without forming that table."""
    s = TreeStructure.from_parent(torch.tensor([-1, 0, 0, 1, 1, 2, 2, 2]))
    n, i = s.num_leaves, s.num_internal
    leaf = torch.randn(n, 2, 3)
    internal = torch.randn(i + 1, 2, 3)
    ids = torch.tensor([0, n - 1, n, n + i, 2, n + 1, n + i])
    torch.testing.assert_close(s.unified_rows(leaf, internal, ids),
                               torch.cat([leaf, internal])[ids], atol=0, rtol=0)


def test_flat_trees_are_blocks_padded_at_the_end():
    """A forest of flat trees is F blocks of the largest tree's size: a view for equal
    sizes, else each tree's leaves then its last leaf repeated; anything else (a deeper
    tree, a single-node tree, padding beyond FLAT_PADDING x the leaves) is None."""
    def flat(sizes):
        trees = [NestedSignal.from_parents([-1] + [0] * s) for s in sizes]
        return Batch.from_data_list(trees).structure.flat_trees

    equal = flat([3, 3])
    assert (equal.num_trees, equal.width, equal.slots, equal.rows) == (2, 3, None, None)
    ragged = flat([2, 3, 1])
    assert (ragged.num_trees, ragged.width) == (3, 3)
    assert ragged.slots.tolist() == [0, 1, 1, 2, 3, 4, 5, 5, 5]
    assert ragged.rows.tolist() == [0, 1, 3, 4, 5, 6]
    assert ragged.slots[ragged.rows].tolist() == list(range(6))    # rows invert slots
    assert flat([1] * 10 + [30]) is None                          # 11 x 30 > 2 x 40 rows
    assert TreeStructure.from_parent(torch.tensor([-1, 0, 0, 1, 1])).flat_trees is None
    assert TreeStructure.from_parent(torch.tensor([-1])).flat_trees is None
    # two roots whose leaves interleave: no blocks of consecutive rows
    assert TreeStructure.from_parent(torch.tensor([-1, -1, 0, 1, 0])).flat_trees is None
    s = Batch.from_data_list([NestedSignal.from_parents([-1, 0, 0]),
                              NestedSignal.from_parents([-1, 0])]).structure
    assert torch.equal(s.to("cpu").flat_trees.slots, s.flat_trees.slots)   # moved along


RAGGED_LEAF_FAMILIES = ([-1, 0, 0, 0, 0, 0, 0] + [1] * 2 + [2] * 3 + [3] * 5 + [4] * 3
                        + [5] * 4 + [6])  # leaf families of 2..5 padded to 5, a lonely leaf


def test_gather_leaf_chunks_match_gather_bucket(monkeypatch):
    """A bucket of leaves read by index, a few families at a time: the chunks are the
    rows gather_bucket gives, in family order, and leaf_rows_of_slots names each slot's
    leaf row (N, the spare row, for padding)."""
    from hsa_graph import structure
    s = TreeStructure.from_parent(torch.tensor(RAGGED_LEAF_FAMILIES))
    (index, bucket), = [(i, b) for i, b in enumerate(s.buckets) if b.leaf_gather is not None]
    assert bucket.num_families == 5 and bucket.size == 5
    values = [torch.randn(s.num_leaves, 2, 3, dtype=DT), torch.randn(s.num_leaves, 4)]
    whole = [s.gather_bucket(bucket, t, t[:0]) for t in values]
    for chunk_bytes, families_per_chunk in ((1, 1), (DT.itemsize * 6 * 5 * 2, 2),
                                            (1 << 20, 5)):
        monkeypatch.setattr(structure, "_CHUNK_BYTES", chunk_bytes)
        # (a chunk holds until the next is taken: copied as they come)
        chunks = [(lo, hi, [part.clone() for part in parts])
                  for lo, hi, parts in s.gather_leaf_chunks(bucket, values)]
        assert [hi - lo for lo, hi, _ in chunks][0] == families_per_chunk
        assert [lo for lo, _, _ in chunks] == list(range(0, 5, families_per_chunk))
        for t, w in enumerate(whole):
            got = torch.cat([parts[t] for _, _, parts in chunks])
            assert torch.equal(got, w)
    # into the buffers of new_leaf_chunk_scratch, shared by the buckets of a call
    scratch = s.new_leaf_chunk_scratch(values)
    chunks = [(lo, hi, [(part.data_ptr(), part.clone()) for part in parts])
              for lo, hi, parts in s.gather_leaf_chunks(bucket, values, scratch)]
    for t, w in enumerate(whole):
        assert torch.equal(torch.cat([parts[t][1] for _, _, parts in chunks]), w)
        assert {parts[t][0] for _, _, parts in chunks} == {scratch[t].data_ptr()}
    for bad in (scratch[:1], (scratch[0][:4], scratch[1]), (scratch[0].half(), scratch[1]),
                (scratch[0], scratch[1][:, :2])):
        with pytest.raises(ValueError, match="scratch must hold"):
            next(s.gather_leaf_chunks(bucket, values, bad))
    slots = s.leaf_rows_of_slots(index)
    expected = [s.num_leaves] * (bucket.num_families * bucket.size)
    for slot, src in zip(bucket.leaf_slot.tolist(), bucket.leaf_src.tolist()):
        expected[slot] = src
    assert slots.tolist() == expected
    internal = next(i for i, b in enumerate(s.buckets) if b.internal_slot.numel())
    with pytest.raises(ValueError, match="internal members"):
        s.leaf_rows_of_slots(internal)
    with pytest.raises(ValueError, match="leaf_gather"):
        next(s.gather_leaf_chunks(s.buckets[internal], values))
    with pytest.raises(ValueError, match="autograd"):
        next(s.gather_leaf_chunks(bucket, [values[0].requires_grad_()]))
    # gather_buckets leaves the skipped bucket to the caller
    parts = list(s.gather_buckets(values[1], values[1][:s.num_internal], reuse=True,
                                  skip={index}))
    assert parts[index] is None and all(p is not None for i, p in enumerate(parts)
                                        if i != index)


# ----------------------------------------------------------------------------------------
# child_levels: every internal node with its children, one depth at a time
# ----------------------------------------------------------------------------------------


def check_child_levels(parent: list[int]) -> None:
    """child_levels against the brute-force children: every internal node once, at its
    depth, its children in unified order (leaves by original index, then internal
    children in row order), each slot naming the right leaf row or the right row one
    depth below, padding under half of every group."""
    brute = Brute(parent)
    s = TreeStructure.from_parent(torch.tensor(parent))
    n = s.num_leaves
    row_of = {int(u): r for r, u in enumerate(s.node_of_unified[n:].tolist())}
    unified_of = s.unified_of_node.tolist()
    seen = []
    depths = [level.depth for level in s.child_levels]
    assert depths == sorted(set(brute.depth[u] for u in brute.internal), reverse=True)
    for level in s.child_levels:
        lo, hi = level.rows
        assert (lo, hi) == (s.level_ptr[level.depth], s.level_ptr[level.depth + 1])
        below = s.level_ptr[level.depth + 1]
        width_below = s.level_ptr[level.depth + 2] - below
        concatenated = torch.cat([g.nodes for g in level.groups])
        assert sorted(concatenated.tolist()) == list(range(hi - lo))
        assert torch.equal(concatenated[level.order], torch.arange(hi - lo))
        for g in level.groups:
            assert g.width & (g.width - 1) == 0
            for f, node_offset in enumerate(g.nodes.tolist()):
                node = int(s.node_of_unified[n + lo + node_offset])
                assert brute.depth[node] == level.depth
                kids = sorted(brute.children[node], key=lambda c: unified_of[c])
                assert len(kids) <= g.width < 2 * len(kids) or g.width == len(kids) == 1
                got = []
                for slot in range(g.width):
                    if g.padding[f, slot]:
                        assert not g.from_leaf[f, slot]
                        assert g.internal_index[f, slot] == width_below
                        continue
                    if g.from_leaf[f, slot]:
                        got.append(brute.leaves[int(g.leaf_index[f, slot])])
                        assert g.internal_index[f, slot] == width_below
                    else:
                        offset = int(g.internal_index[f, slot])
                        assert 0 <= offset < width_below
                        got.append(int(s.node_of_unified[n + below + offset]))
                assert got == kids
                assert not bool(g.padding[f, :len(kids)].any())
                seen.append(row_of[node])
    assert sorted(seen) == list(range(s.num_internal))


@pytest.mark.parametrize("parent", [
    [-1],                                   # one leaf: no internal node
    [-1, 0],                                # a root over one leaf (a lone ListOps digit)
    [-1, 0, 0, 1, 1, 1, -1, 6, 6, -1],      # a forest with a leaf root
    [-1, 0, 1, 2, 3, 3],                    # a chain of only children
    [-1] + [0] * 37 + [1, 1, 2],            # a wide family beside narrow ones
])
def test_child_levels_hand_made(parent):
    check_child_levels(parent)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests())
def test_child_levels_random_forests(parent):
    check_child_levels(parent)


def test_child_levels_of_a_batch_of_parse_trees():
    from hsa_graph.datasets.listops import listops_tree

    trees = [listops_tree(e) for e in ("[MAX 2 [SM 1 1 ] 9 [MIN 4 7 ] 0 ]", "7",
                                       "[SM [MAX [MIN 1 2 ] 3 ] 4 ]")]
    s = Batch.from_data_list(trees).structure
    # the operator token is each family's first slot (its first leaf)
    tokens = Batch.from_data_list(trees).x
    for level in s.child_levels:
        for g in level.groups:
            first = tokens[g.leaf_index[:, 0]]
            assert bool(g.from_leaf[:, 0].all())
            assert bool(((first >= 10) | (g.width == 1)).all())
    check_child_levels(Batch.from_data_list(trees).parent.tolist())


def test_leaf_rows_of_nodes_is_each_leaf_s_place_in_leaf_order():
    parent = [-1, 0, 0, 1, 1, 2, 2, 2, -1, 8, 8]          # two trees
    tree = NestedSignal.from_parents(parent)
    structure = tree.structure
    leaves = [u for u in range(len(parent)) if u not in parent]
    nodes = torch.tensor([10, 3, 6, 9])
    assert structure.leaf_rows_of(nodes).tolist() == [leaves.index(u) for u in nodes.tolist()]
    assert structure.leaf_rows_of(nodes[:0]).numel() == 0
    with pytest.raises(ValueError, match="mirror_index must name leaves; node 2 is internal"):
        structure.leaf_rows_of(torch.tensor([3, 2]), "mirror_index")
    with pytest.raises(ValueError, match=r"outside \[0, 11\)"):
        structure.leaf_rows_of(torch.tensor([11]))
    with pytest.raises(ValueError, match="1-D long tensor"):
        structure.leaf_rows_of(torch.tensor([[3]]))


def test_tree_root_is_each_tree_s_root_in_tree_order():
    # roots at nodes 0 (internal), 5 (a lone leaf), 6 (internal), in node order
    parent = [-1, 0, 0, 1, 1, -1, -1, 6, 6]
    structure = NestedSignal.from_parents(parent).structure
    roots = structure.node_of_unified[structure.tree_root].tolist()
    assert roots == [0, 5, 6]
    # the tree of each leaf, by that order, is the tree its root heads
    assert structure.leaf_tree.tolist() == [0, 0, 0, 1, 2, 2]


def _forest_cut_by_hand(parent, rows, families):
    """The cut of ``structure.family_forest`` (``families``) or ``cut_above``, from the
    parent list alone: (parent among the kept, kept node ids, new roots, leaf rows)."""
    leaves = [u for u in range(len(parent)) if u not in parent]
    roots = sorted({parent[leaves[r]] for r in rows} - {-1})
    if not families:
        return [-1 if u in roots else p for u, p in enumerate(parent)], None, roots, None
    held = sorted(set(rows) | {r for r, u in enumerate(leaves) if parent[u] in roots})
    kept = sorted(set(roots) | {leaves[r] for r in held})
    cut = [-1 if u in roots or parent[u] < 0 else kept.index(parent[u]) for u in kept]
    return cut, kept, roots, held


def _random_parents(gen, size):
    parent = [-1]
    for u in range(1, size):                      # a few roots, the rest anywhere before
        parent.append(-1 if torch.rand(1, generator=gen) < 0.1 else
                      int(torch.randint(u, (1,), generator=gen)))
    return parent


@pytest.mark.parametrize("families", [True, False])
def test_forest_cuts_match_the_parent_list(families):
    """``family_forest`` (the rows' families, leaf children alone) and ``cut_above``
    (every node, the rows' parents made roots) against the parent list: by hand on a
    tree whose leaves and internal nodes interleave in node order (with a lone root
    leaf), then on random forests, alone and batched."""
    parent = [-1, 0, 1, 1, 0, 4, 4, 0, -1]       # leaves 2, 3, 5, 6, 7, 8: rows 0..5
    expect = {True: [([-1, 0, 0], [1]), ([-1, 0], [0]), ([-1], []),
                     ([-1, 0, 0, -1, 3, 3, -1], [1, 4])],
              False: [([-1, -1, 1, 1, 0, 4, 4, 0, -1], [1]),
                      ([-1, 0, 1, 1, 0, 4, 4, 0, -1], [0]), (parent, []),
                      ([-1, -1, 1, 1, -1, 4, 4, 0, -1], [1, 4])]}[families]
    for rows, (cut_parent, roots) in zip([[0], [4], [5], [0, 3, 5]], expect):
        assert _forest_cut_by_hand(parent, rows, families)[::2] == (cut_parent, roots)
    cases = [(NestedSignal.from_parents(parent), rows) for rows in ([0], [4], [5], [0, 3, 5])]
    gen = torch.Generator().manual_seed(3)
    forests = [_random_parents(gen, int(torch.randint(2, 30, (1,), generator=gen)))
               for _ in range(12)]
    for tree in [NestedSignal.from_parents(p) for p in forests[:4]] + [
            Batch.from_data_list([NestedSignal.from_parents(p) for p in forests[4:]])]:
        for _ in range(8):
            count = int(torch.randint(1, 4, (1,), generator=gen))
            rows = torch.randint(tree.num_leaves, (count,), generator=gen)
            cases.append((tree, sorted(set(rows.tolist()))))
    outcomes = defaultdict(int)
    for tree, rows in cases:
        want = _forest_cut_by_hand(tree.parent.tolist(), rows, families)
        assert tree.structure.node_parent.tolist() == tree.parent.tolist()
        call = tree.structure.family_forest if families else tree.structure.cut_above
        childless = set() if families else {
            u for u in set(tree.parent.tolist()) - {-1} if u not in want[0]}
        if childless:                            # cut_above refuses to make a leaf
            with pytest.raises(ValueError, match=f"cuts node {min(childless)} off"):
                call(torch.tensor(rows))
            outcomes["refused"] += 1
            continue
        cut = call(torch.tensor(rows))
        assert cut.parent.tolist() == want[0] and cut.roots.tolist() == want[2]
        if families:
            assert cut.kept.nonzero().view(-1).tolist() == want[1]
            assert cut.leaf_rows.tolist() == want[3]
        else:
            assert cut.kept is None and cut.leaf_rows is None
        outcomes["cut"] += 1
    assert outcomes["cut"] >= 15 and (families or outcomes["refused"] >= 5)


def test_cut_above_names_a_node_left_without_children():
    structure = NestedSignal.from_parents([-1, 0, 1, 1, 0, 4, 4]).structure
    with pytest.raises(ValueError, match="a scoped layer cuts node 0 off every one of its "
                                         "children"):
        structure.cut_above(torch.tensor([0, 2]), "a scoped layer")
    assert structure.cut_above(torch.tensor([0])).parent.tolist() == [-1, -1, 1, 1, 0, 4, 4]


def _leaf_families_alone(parent):
    """Independently of the structure: every family holding a leaf holds leaves alone,
    and no leaf is an only child."""
    children = defaultdict(list)
    for node, p in enumerate(parent):
        if p >= 0:
            children[p].append(node)
    leaves = set(range(len(parent))) - set(children)
    for family in children.values():
        kinds = {node in leaves for node in family}
        if True in kinds and (kinds != {True} or len(family) < 2):
            return False
    return True


@pytest.mark.parametrize("name", sorted(HAND_MADE))
def test_means_buffer_filled_by_the_caller(name):
    """leaf_family_buckets exists exactly where families with a leaf hold leaves alone;
    then the families' sums written into their parents' rows of a new_means_buffer
    (every other row garbage) give subtree_means' own result, and the buffer is it."""
    parent = HAND_MADE[name]
    s = TreeStructure.from_parent(torch.tensor(parent))
    assert (s.leaf_family_buckets is not None) == _leaf_families_alone(parent), name
    for index in s.leaf_only_buckets:   # leaves alone, from the leaf rows
        assert s.source_rows(index)[0] and not s.buckets[index].internal_slot.numel()
    q, k, v = (torch.randn(s.num_leaves, 2, 3, dtype=DT) for _ in range(3))
    want = s.subtree_means(q, k, v)
    if s.leaf_family_buckets is None:
        with pytest.raises(ValueError, match="leaf_family_buckets"):
            s.subtree_means(q, k, v, buffer=s.new_means_buffer(q, k, v))
        return
    buffer = s.new_means_buffer(q, k, v).fill_(float("nan"))
    assert buffer.shape == (3, s.num_internal + 1, 2, 3)
    filled = set()
    for index in s.leaf_family_buckets:
        leaves, rows = s.source_rows(index)
        bucket = s.buckets[index]
        assert leaves and rows.shape == (bucket.num_families, bucket.size)
        real = (bucket.log_size > float("-inf")).to(DT)[..., None, None]   # [F, b, 1, 1]
        for j, t in enumerate((q, k, v)):
            buffer[j, bucket.parent] = (t[rows] * real).sum(1)
        filled |= set(bucket.parent.tolist())
    others = set(s.rows_without_leaf_family.tolist())
    assert others == set(range(s.num_internal + 1)) - filled
    got = s.subtree_means(q, k, v, buffer=buffer)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert got[0].data_ptr() == buffer.data_ptr()
    with pytest.raises(ValueError, match="given alone"):
        s.subtree_means(q, k, v, family_sums=(q, k, v), buffer=buffer)
    with pytest.raises(ValueError, match="where autograd records nothing"):
        s.subtree_means(q.requires_grad_(), k, v, buffer=buffer)


def test_fresh_buffer_hints_large_buffers_only(monkeypatch):
    """fresh_buffer: like's dtype, the shape asked, zeroed on request; a buffer of
    HUGE_PAGE_BYTES or more is hinted once, on page-aligned bounds inside it."""
    import hsa_graph.structure as structure

    calls = []

    def madvise(start, length, advice):
        calls.append((start, length, advice))
        return 0

    monkeypatch.setattr(structure, "_madvise", madvise)
    like = torch.zeros(1, dtype=torch.float32)
    small = structure.fresh_buffer(like, (4, 5), zero=True)
    assert small.shape == (4, 5) and small.dtype == torch.float32 and not small.any()
    assert calls == []
    rows = structure.HUGE_PAGE_BYTES // 4 // 1024 + 1
    large = structure.fresh_buffer(like, (rows, 1024))
    assert large.shape == (rows, 1024)
    [(start, length, advice)] = calls
    assert advice == 14 and start % 4096 == 0 and length % 4096 == 0
    assert large.data_ptr() <= start and start + length <= large.data_ptr() + large.nbytes
