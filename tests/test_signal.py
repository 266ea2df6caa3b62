"""Tests of hsa_graph/signal.py: NestedSignal constructors, validation, PyG batching,
networkx round trips, from_nested and flatten (SPEC sections 1 and 4)."""

from __future__ import annotations

import re

import networkx as nx
import numpy as np
import pytest
import torch
from torch_geometric.data import Batch
from torch_geometric.loader import DataLoader

from hsa_graph import GEOMETRIES, NestedSignal, Node, flatten

CODE = {name: code for code, name in enumerate(GEOMETRIES)}
F = 3  # feature size of the vector leaves used below


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def children_of(parent):
    kids = {u: [] for u in range(len(parent))}
    for u, p in enumerate(parent):
        if p >= 0:
            kids[p].append(u)
    return kids


def leaves_of(parent):
    kids = children_of(parent)
    return [u for u in range(len(parent)) if not kids[u]]


def edge_set(edge_index):
    return sorted(map(tuple, edge_index.t().tolist()))


def assert_same_signal(a: NestedSignal, b: NestedSignal):
    """Every stored attribute equal (values, dtypes and shapes)."""
    assert a.num_nodes == b.num_nodes
    for name in ("edge_index", "geometry", "position", "modality", "sibling_edge_index"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert ta.dtype == tb.dtype, name
        assert ta.shape == tb.shape, name
        assert torch.equal(ta, tb), name
    xa, xb = a.get("x"), b.get("x")
    assert (xa is None) == (xb is None)
    if xa is not None:
        assert xa.dtype == xb.dtype
        assert xa.shape == xb.shape
        assert torch.equal(xa, xb)
    assert list(a.key) == list(b.key)


def error_message(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    return str(info.value)


def mentions_node(message: str, u) -> bool:
    return re.search(rf"\b{u}\b", message) is not None


# ----------------------------------------------------------------------------------------
# from_parents: stored fields and derived properties
# ----------------------------------------------------------------------------------------


def test_from_parents_stored_fields_simple_tree():
    parent = [-1, 0, 0, 1, 1, 2, 2, 2]
    x = torch.randn(5, F)
    tree = NestedSignal.from_parents(parent, x=x)
    assert isinstance(tree, NestedSignal)
    assert tree.num_nodes == 8
    assert torch.equal(tree.x, x)
    # parent -> child edges, one per non-root node
    assert tree.edge_index.dtype == torch.long
    assert tree.edge_index.shape == (2, 7)
    assert edge_set(tree.edge_index) == [(p, u) for u, p in enumerate(parent) if p >= 0]
    assert tree.geometry.tolist() == [CODE["sequence"]] * 3 + [-1] * 5
    assert tree.geometry_names() == ["sequence"] * 3 + [None] * 5
    # default position = index among siblings (node order), roots (-1, -1)
    assert tree.position.shape == (8, 2)
    assert tree.position.tolist() == [[-1, -1], [0, 0], [1, 0], [0, 0], [1, 0],
                                      [0, 0], [1, 0], [2, 0]]
    assert tree.modality.tolist() == [0] * 8
    assert tree.modality.dtype == torch.long
    assert list(tree.key) == [None] * 8
    assert tree.sibling_edge_index.shape == (2, 0)
    assert tree.sibling_edge_index.dtype == torch.long
    # derived
    assert tree.parent.tolist() == parent
    assert tree.is_leaf.tolist() == [False] * 3 + [True] * 5
    assert tree.leaf_index.tolist() == [3, 4, 5, 6, 7]
    assert tree.num_leaves == 5


def test_from_parents_unordered_labels():
    """Internal nodes need not come first; leaves are childless nodes in index order."""
    parent = [2, -1, 1, 2, 1, 0, 0]
    tree = NestedSignal.from_parents(torch.tensor(parent), x=torch.arange(4))
    assert tree.parent.tolist() == parent
    assert tree.leaf_index.tolist() == [3, 4, 5, 6]
    assert tree.num_leaves == 4
    assert tree.is_leaf.tolist() == [False, False, False, True, True, True, True]
    assert tree.geometry.tolist() == [0, 0, 0, -1, -1, -1, -1]
    # siblings in node order: {0, 3} under 2, {2, 4} under 1, {5, 6} under 0
    assert tree.position[:, 0].tolist() == [0, -1, 0, 1, 1, 0, 1]
    assert tree.position[:, 1].tolist() == [0, -1, 0, 0, 0, 0, 0]
    assert edge_set(tree.edge_index) == sorted(
        (p, u) for u, p in enumerate(parent) if p >= 0)
    # token ids stay a 1-D long tensor
    assert tree.x.dtype == torch.long and tree.x.shape == (4,)


@pytest.mark.parametrize("as_type", [list, np.array, torch.tensor,
                                     lambda p: torch.tensor(p, dtype=torch.int32),
                                     lambda p: np.array(p, dtype=np.int16)])
def test_from_parents_accepts_integer_containers(as_type):
    parent = [-1, 0, 0, 1]
    tree = NestedSignal.from_parents(as_type(parent))
    assert tree.parent.tolist() == parent
    assert tree.parent.dtype == torch.long
    assert tree.num_leaves == 2


def test_from_parents_forest_and_single_node():
    tree = NestedSignal.from_parents([-1, 0, -1, 2, 2, -1])
    assert tree.leaf_index.tolist() == [1, 3, 4, 5]
    assert tree.position[[0, 2, 5]].tolist() == [[-1, -1]] * 3
    assert tree.structure.num_trees == 3
    single = NestedSignal.from_parents([-1], x=torch.ones(1, F))
    assert single.num_leaves == 1
    assert single.edge_index.shape == (2, 0)
    assert single.geometry.tolist() == [-1]
    assert single.position.tolist() == [[-1, -1]]
    assert single.parent.tolist() == [-1]


def test_per_node_geometry_list_and_codes():
    parent = [-1, 0, 0, 1, 1, 2, 2]
    names = ["graph", "set", "keyvalue", None, None, None, None]
    key = [None, None, None, None, None, "a", "b"]
    tree = NestedSignal.from_parents(parent, geometry=names, key=key)
    assert tree.geometry.tolist() == [4, 2, 3, -1, -1, -1, -1]
    assert tree.geometry_names() == names
    assert list(tree.key) == key
    # integer codes, as a list or a tensor, give the same thing
    codes = [4, 2, 3, -1, -1, -1, -1]
    for geometry in (codes, torch.tensor(codes)):
        other = NestedSignal.from_parents(parent, geometry=geometry, key=key)
        assert other.geometry.tolist() == codes
    # one name for all internal nodes
    tree = NestedSignal.from_parents(parent, geometry="set")
    assert tree.geometry.tolist() == [2, 2, 2, -1, -1, -1, -1]


def test_grid_positions():
    parent = [-1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="grid") as info:
        NestedSignal.from_parents(parent, geometry="grid")
    assert mentions_node(str(info.value), 0)
    pos = [None, (0, 0), (0, 1), (1, 0), (1, 1)]
    tree = NestedSignal.from_parents(parent, geometry="grid", position=pos)
    assert tree.position.tolist() == [[-1, -1], [0, 0], [0, 1], [1, 0], [1, 1]]
    as_tensor = torch.tensor([[-1, -1], [0, 0], [0, 1], [1, 0], [1, 1]])
    tree2 = NestedSignal.from_parents(parent, geometry="grid", position=as_tensor)
    assert torch.equal(tree2.position, as_tensor)


def test_one_dimensional_positions_padded_with_zero_column():
    tree = NestedSignal.from_parents([-1, 0, 0], position=[-1, 5, 7])
    # a root's "no position" (-1) stays (-1, -1), as when positions are left out
    assert tree.position.tolist() == [[-1, -1], [5, 0], [7, 0]]
    assert NestedSignal.from_parents([-1, 0, 0]).position[0].tolist() == [-1, -1]


def test_modality_key_sibling_edges_stored():
    parent = [-1, 0, 0, 0]
    tree = NestedSignal.from_parents(parent, geometry="graph", modality=[0, 1, 2, 1],
                                     sibling_edge_index=torch.tensor([[1, 2], [2, 3]]))
    assert tree.modality.tolist() == [0, 1, 2, 1]
    assert tree.sibling_edge_index.tolist() == [[1, 2], [2, 3]]
    tree = NestedSignal.from_parents(parent, geometry="keyvalue",
                                     key=[None, "title", "image", "body"])
    assert list(tree.key) == [None, "title", "image", "body"]


def test_extra_attributes_are_stored():
    tree = NestedSignal.from_parents([-1, 0, 0], y=torch.tensor([3]))
    assert tree.y.tolist() == [3]


# ----------------------------------------------------------------------------------------
# from_parents: invalid input
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("parent, node", [([-1, 5], 1), ([-1, 0, 3], 2), ([-2, 0], 0),
                                          ([-1, 0, -7], 2)])
def test_parent_out_of_range(parent, node):
    msg = error_message(ValueError, NestedSignal.from_parents, parent)
    assert "range" in msg
    assert mentions_node(msg, node)


def test_self_parent():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 2, 0])
    assert "cycle" in msg or "own parent" in msg
    assert mentions_node(msg, 2)


@pytest.mark.parametrize("parent, cycle", [
    ([-1, 2, 1], {1, 2}),                               # 2-cycle beside a root
    ([-1, 0, 3, 4, 5, 2], {2, 3, 4, 5}),                # long cycle
    ([1, 2, 0], {0, 1, 2}),                             # no root at all
    ([-1, 3, 3, 1, 2, 4, 0], {1, 3}),                   # tail hanging off a 2-cycle
    ([-1, 0, 0, 1, 6, 4, 7, 8, 5, 8], {4, 5, 6, 7, 8}), # cycle unreachable from the root
])
def test_cycles_raise_naming_a_node_on_the_cycle(parent, cycle):
    msg = error_message(ValueError, NestedSignal.from_parents, parent)
    assert "cycle" in msg
    named = {int(s) for s in re.findall(r"node (\d+)", msg)}
    assert named and named <= cycle, msg


@pytest.mark.parametrize("parent", [[], np.zeros(0, dtype=np.int64),
                                    torch.zeros(0, dtype=torch.long)])
def test_empty_parent(parent):
    msg = error_message(ValueError, NestedSignal.from_parents, parent)
    assert "empty" in msg


def test_parent_not_one_dimensional():
    error_message(ValueError, NestedSignal.from_parents, torch.tensor([[-1, 0]]))


@pytest.mark.parametrize("parent", [
    torch.tensor([-1.0, 0.0, 0.0]), np.array([-1.0, 0.0, 0.0]), [-1.0, 0.0, 0.0],
    torch.tensor([True, False]), ["a", "b"], None, [[-1], [0, 0]],
])
def test_non_integer_parent_raises_type_error(parent):
    msg = error_message(TypeError, NestedSignal.from_parents, parent)
    assert "parent" in msg


@pytest.mark.parametrize("x", [torch.randn(2, F), torch.randn(5, F), torch.tensor(1.0),
                               torch.arange(6)])
def test_x_with_wrong_number_of_rows(x):
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0, 1, 1], x=x)
    assert "leaves" in msg and "3" in msg


def test_geometry_none_on_internal_node():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0, 1, 1],
                        geometry=["sequence", None, None, None, None])
    assert "internal node 1" in msg


def test_geometry_code_minus_one_on_internal_node():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0],
                        geometry=torch.tensor([-1, -1, -1]))
    assert "node 0" in msg


def test_geometry_given_to_a_leaf():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0],
                        geometry=["set", None, "grid"])
    assert "node 2" in msg and "leaf" in msg


@pytest.mark.parametrize("geometry", ["tree", ["sequence", "bogus", None],
                                      ["sequence", 17, None]])
def test_unknown_geometry_name(geometry):
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 1], geometry=geometry)
    assert "unknown geometry" in msg


@pytest.mark.parametrize("codes", [[9, -1, -1], [0, 9, -1], [0, -1, 5], [0, -7, -1],
                                   [-3, -1, -1]])
def test_out_of_range_geometry_codes_raise_value_error(codes):
    """Integer codes outside [-1, 4] are rejected with ValueError wherever they sit
    (also on a leaf), never an IndexError from looking the code up."""
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0],
                        geometry=torch.tensor(codes))
    assert "geometry" in msg


def test_geometry_list_of_wrong_length():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0],
                        geometry=["sequence", None])
    assert "geometry" in msg


def test_keyvalue_without_keys():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0, 1, 1],
                        geometry=["sequence", "keyvalue", None, None, None])
    assert "keyvalue" in msg and "node 1" in msg


def test_keyvalue_child_without_string_key():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0], geometry="keyvalue",
                        key=[None, "a", None])
    assert "node 2" in msg and "key" in msg


def test_key_list_of_wrong_length():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0], geometry="keyvalue",
                        key=["a", "b"])
    assert "key" in msg


def test_sibling_edges_between_non_siblings():
    # 3 is a child of 1, 4 a child of 2: cousins, not siblings
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0, 1, 2],
                        geometry="graph", sibling_edge_index=torch.tensor([[3], [4]]))
    assert "sibling" in msg and "(3, 4)" in msg


def test_sibling_edges_involving_a_root():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0], geometry="graph",
                        sibling_edge_index=torch.tensor([[0], [1]]))
    assert "(0, 1)" in msg


def test_sibling_edges_under_a_non_graph_node():
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0, 1, 1],
                        geometry=["graph", "set", None, None, None],
                        sibling_edge_index=torch.tensor([[1, 3], [2, 4]]))
    assert "graph" in msg and "node 1" in msg and "(3, 4)" in msg


@pytest.mark.parametrize("edges", [torch.tensor([1, 2]), torch.tensor([[1, 2, 3]]),
                                   torch.tensor([[1], [7]]), torch.tensor([[-1], [1]])])
def test_sibling_edges_bad_shape_or_range(edges):
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0], geometry="graph",
                        sibling_edge_index=edges)
    assert "sibling_edge_index" in msg


def test_sibling_edges_float_dtype():
    error_message(TypeError, NestedSignal.from_parents, [-1, 0, 0], geometry="graph",
                  sibling_edge_index=torch.tensor([[1.0], [2.0]]))


@pytest.mark.parametrize("position", [torch.zeros(3, 3, dtype=torch.long),
                                      torch.zeros(2, dtype=torch.long),
                                      torch.zeros(3, 2, 1, dtype=torch.long),
                                      [(0, 0), (0, 0)], torch.zeros(4, 2, dtype=torch.long)])
def test_bad_position_shapes(position):
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0], position=position)
    assert "position" in msg


def test_float_positions():
    error_message(TypeError, NestedSignal.from_parents, [-1, 0, 0],
                  position=torch.zeros(3, 2))


@pytest.mark.parametrize("modality", [[0, 1], [[0, 1, 2]]])
def test_bad_modality_shape(modality):
    msg = error_message(ValueError, NestedSignal.from_parents, [-1, 0, 0], modality=modality)
    assert "modality" in msg


# ----------------------------------------------------------------------------------------
# batching
# ----------------------------------------------------------------------------------------


def mixed_trees():
    g = torch.Generator().manual_seed(0)

    def feats(n):
        return torch.randn(n, F, generator=g)

    return [
        # plain sequence tree
        NestedSignal.from_parents([-1, 0, 0, 1, 1, 2], x=feats(3)),
        # single node: a root that is a leaf
        NestedSignal.from_parents([-1], x=feats(1)),
        # keyvalue tree with field names
        NestedSignal.from_parents([-1, 0, 0, 1, 1, 2],
                                  geometry=["keyvalue", "sequence", "set", None, None, None],
                                  key=[None, "title", "body", None, None, None], x=feats(3)),
        # graph node with sibling edges, root not node 0
        NestedSignal.from_parents([3, 3, 3, -1, 0, 0], geometry=["set", None, None, "graph",
                                                                  None, None],
                                  sibling_edge_index=torch.tensor([[0, 1, 2], [1, 2, 0]]),
                                  x=feats(4)),
        # modality tags and a grid
        NestedSignal.from_parents([-1, 0, 0, 1, 1, 1, 1, 2],
                                  geometry=["sequence", "grid", "sequence"] + [None] * 5,
                                  position=[None, (0, 0), (1, 0), (0, 0), (0, 1), (1, 0),
                                            (1, 1), (0, 0)],
                                  modality=[0, 1, 0, 1, 1, 1, 1, 0], x=feats(5)),
        # a forest inside one graph
        NestedSignal.from_parents([-1, 0, 0, -1, 3, 3, 3], x=feats(5)),
    ]


def expected_batch_parent(trees):
    out, offset = [], 0
    for tree in trees:
        out += [p + offset if p >= 0 else -1 for p in tree.parent.tolist()]
        offset += tree.num_nodes
    return out


def check_batch(batch, trees):
    assert batch.num_graphs == len(trees)
    assert batch.num_nodes == sum(t.num_nodes for t in trees)
    assert batch.parent.tolist() == expected_batch_parent(trees)
    offsets = np.cumsum([0] + [t.num_nodes for t in trees[:-1]]).tolist()
    assert batch.edge_index.tolist() == torch.cat(
        [t.edge_index + o for t, o in zip(trees, offsets)], 1).tolist()
    assert batch.sibling_edge_index.tolist() == torch.cat(
        [t.sibling_edge_index + o for t, o in zip(trees, offsets)], 1).tolist()
    # per-node fields are concatenated, not incremented
    for name in ("geometry", "position", "modality", "x"):
        assert torch.equal(getattr(batch, name), torch.cat([getattr(t, name) for t in trees]))
    assert batch.num_leaves == sum(t.num_leaves for t in trees)
    assert batch.leaf_index.tolist() == torch.cat(
        [t.leaf_index + o for t, o in zip(trees, offsets)]).tolist()
    # the structure sees a forest: one entry per graph... (a graph may itself hold a
    # forest, so count roots)
    roots = sum(int((t.parent < 0).sum()) for t in trees)
    st = batch.structure
    assert st.num_trees == roots
    assert st.num_leaves == batch.num_leaves
    # the round trip gives back every attribute exactly
    back = batch.to_data_list()
    assert len(back) == len(trees)
    for a, b in zip(back, trees):
        assert isinstance(a, NestedSignal)
        assert_same_signal(a, b)
        assert a.parent.tolist() == b.parent.tolist()


def test_batch_from_data_list_mixed_trees():
    trees = mixed_trees()
    batch = Batch.from_data_list(trees)
    assert isinstance(batch, NestedSignal)
    check_batch(batch, trees)
    # keys: one list per tree
    assert [list(k) for k in batch.key] == [list(t.key) for t in trees]


def test_batch_of_single_trees_leaf_tree_is_graph_index():
    trees = [t for t in mixed_trees() if int((t.parent < 0).sum()) == 1]
    batch = Batch.from_data_list(trees)
    st = batch.structure
    assert st.num_trees == batch.num_graphs == len(trees)
    assert st.leaf_tree.tolist() == batch.batch[batch.leaf_index].tolist()


def test_batch_in_shuffled_order_and_twice():
    trees = mixed_trees()
    order = [4, 1, 0, 5, 3, 2, 1]
    chosen = [trees[i] for i in order]
    check_batch(Batch.from_data_list(chosen), chosen)


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_dataloader_over_mixed_trees(batch_size):
    trees = mixed_trees()
    loader = DataLoader(trees, batch_size=batch_size, shuffle=False)
    seen = 0
    for batch in loader:
        chunk = trees[seen:seen + batch.num_graphs]
        check_batch(batch, chunk)
        seen += batch.num_graphs
    assert seen == len(trees)
    assert len(loader) == -(-len(trees) // batch_size)


def test_batch_of_token_trees():
    trees = [NestedSignal.from_nested([[1, 2], [3]]), NestedSignal.from_nested(7),
             NestedSignal.from_nested({"a": [4, 5], "b": 6})]
    batch = Batch.from_data_list(trees)
    assert batch.x.tolist() == [1, 2, 3, 7, 4, 5, 6]
    check_batch(batch, trees)


# ----------------------------------------------------------------------------------------
# networkx
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(6))
def test_networkx_round_trip(index):
    tree = mixed_trees()[index]
    G = tree.to_networkx()
    assert isinstance(G, nx.DiGraph)
    assert sorted(G.edges) == edge_set(tree.edge_index)
    back = NestedSignal.from_networkx(G)
    assert_same_signal(back, tree)


def test_networkx_round_trip_token_ids():
    """Token-id leaves (x long [N]) come back as [N], not [N, 1]."""
    tree = NestedSignal.from_nested({"title": [3, 1, 4], "body": [[1, 5], [9]]})
    assert tree.x.shape == (6,)
    back = NestedSignal.from_networkx(tree.to_networkx())
    assert_same_signal(back, tree)


def test_to_networkx_attributes():
    tree = mixed_trees()[2]
    G = tree.to_networkx()
    assert G.nodes[0]["geometry"] == "keyvalue"
    assert G.nodes[1]["key"] == "title" and G.nodes[2]["key"] == "body"
    assert "geometry" not in G.nodes[3]
    assert torch.equal(G.nodes[3]["x"], tree.x[0])
    assert G.nodes[0]["position"] == (-1, -1)
    G = mixed_trees()[3].to_networkx()
    assert sorted(G.graph["sibling_edges"]) == [(0, 1), (1, 2), (2, 0)]


def test_from_networkx_string_labels():
    G = nx.DiGraph()
    G.add_node("doc", geometry="keyvalue")
    G.add_node("title", key="title", geometry="sequence")
    G.add_node("w1", x=torch.tensor([1.0, 2.0]))
    G.add_node("w2", x=torch.tensor([3.0, 4.0]))
    G.add_node("img", key="image", x=torch.tensor([5.0, 6.0]), modality=1)
    G.add_edges_from([("doc", "title"), ("title", "w1"), ("title", "w2"), ("doc", "img")])
    tree = NestedSignal.from_networkx(G)
    assert tree.parent.tolist() == [-1, 0, 1, 1, 0]
    assert tree.geometry_names() == ["keyvalue", "sequence", None, None, None]
    assert list(tree.key) == [None, "title", None, None, "image"]
    assert tree.modality.tolist() == [0, 0, 0, 0, 1]
    assert tree.x.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert tree.position.tolist() == [[-1, -1], [0, 0], [0, 0], [1, 0], [1, 0]]


def test_from_networkx_string_labels_sibling_edges_and_positions():
    G = nx.DiGraph()
    G.add_node("site", geometry="graph")
    for i, page in enumerate(["p", "q", "r"]):
        G.add_node(page, x=torch.tensor([float(i)]), position=i)
        G.add_edge("site", page)
    G.graph["sibling_edges"] = [("p", "q"), ("r", "p")]
    tree = NestedSignal.from_networkx(G)
    assert tree.sibling_edge_index.tolist() == [[1, 3], [2, 1]]
    assert tree.position.tolist() == [[-1, -1], [0, 0], [1, 0], [2, 0]]


def test_from_networkx_undirected_with_root():
    G = nx.Graph()
    G.add_edges_from([(0, 1), (0, 2), (1, 3), (1, 4)])
    tree = NestedSignal.from_networkx(G, root=0)
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1]
    # another root orients the edge 0-1 the other way (nodes keep their numbers)
    tree = NestedSignal.from_networkx(G, root=1)
    assert edge_set(tree.edge_index) == [(0, 2), (1, 0), (1, 3), (1, 4)]
    assert tree.parent.tolist() == [1, -1, 0, 1, 1]
    assert tree.leaf_index.tolist() == [2, 3, 4]


def test_from_networkx_undirected_keeps_graph_node_order():
    """Nodes (and so leaf rows) are numbered in the graph's node order, also for an
    undirected tree (the documented numbering), not in breadth-first order."""
    G = nx.Graph()
    G.add_node("a", x=torch.tensor([1.0]))
    G.add_node("b", x=torch.tensor([2.0]))
    G.add_node("r")
    G.add_node("m")
    G.add_edges_from([("r", "m"), ("m", "a"), ("r", "b")])
    tree = NestedSignal.from_networkx(G, root="r")
    # graph order: a=0, b=1, r=2, m=3
    assert tree.parent.tolist() == [3, 2, -1, 2]
    assert tree.x.flatten().tolist() == [1.0, 2.0]


def test_from_networkx_forest():
    G = nx.DiGraph([(0, 1), (0, 2), (3, 4)])
    tree = NestedSignal.from_networkx(G)
    assert tree.parent.tolist() == [-1, 0, 0, -1, 3]
    assert tree.structure.num_trees == 2


def test_from_networkx_two_parents():
    G = nx.DiGraph([("r", "a"), ("r", "b"), ("a", "c"), ("b", "c")])
    msg = error_message(ValueError, NestedSignal.from_networkx, G)
    assert "two parents" in msg and "'c'" in msg


def test_from_networkx_self_loop():
    G = nx.DiGraph([(0, 1), (1, 1)])
    msg = error_message(ValueError, NestedSignal.from_networkx, G)
    assert "self-loop" in msg and mentions_node(msg, 1)


def test_from_networkx_undirected_without_root():
    G = nx.Graph([(0, 1), (1, 2)])
    msg = error_message(ValueError, NestedSignal.from_networkx, G)
    assert "root" in msg


def test_from_networkx_undirected_root_not_in_graph():
    G = nx.Graph([(0, 1), (1, 2)])
    msg = error_message(ValueError, NestedSignal.from_networkx, G, root=9)
    assert "9" in msg


def test_from_networkx_undirected_with_cycle():
    G = nx.Graph([(0, 1), (1, 2), (2, 0), (0, 3)])
    msg = error_message(ValueError, NestedSignal.from_networkx, G, root=0)
    assert "cycle" in msg or "not a tree" in msg


def test_from_networkx_directed_cycle():
    G = nx.DiGraph([("r", "a"), ("a", "b"), ("b", "c"), ("c", "a")])
    # 'a' has two parents ('r' and 'c') -> caught either way, as a ValueError
    error_message(ValueError, NestedSignal.from_networkx, G)
    G = nx.DiGraph([(0, 1), (1, 2), (2, 0)])
    msg = error_message(ValueError, NestedSignal.from_networkx, G)
    assert "cycle" in msg


def test_from_networkx_wrong_inputs():
    error_message(TypeError, NestedSignal.from_networkx, [(0, 1)])
    error_message(ValueError, NestedSignal.from_networkx, nx.DiGraph())
    G = nx.DiGraph([(0, 1), (0, 2)])
    G.nodes[1]["x"] = torch.ones(2)
    msg = error_message(ValueError, NestedSignal.from_networkx, G)
    assert "2" in msg and "x" in msg


# ----------------------------------------------------------------------------------------
# from_nested
# ----------------------------------------------------------------------------------------


def test_from_nested_lists_are_sequences():
    tree = NestedSignal.from_nested([[1, 2, 3], [4, 5]])
    assert tree.parent.tolist() == [-1, 0, 1, 1, 1, 0, 5, 5]
    assert tree.geometry_names() == ["sequence", "sequence", None, None, None,
                                     "sequence", None, None]
    assert tree.x.dtype == torch.long and tree.x.tolist() == [1, 2, 3, 4, 5]
    assert tree.position.tolist() == [[-1, -1], [0, 0], [0, 0], [1, 0], [2, 0],
                                      [1, 0], [0, 0], [1, 0]]
    assert tree.modality.tolist() == [0] * 8
    assert list(tree.key) == [None] * 8
    # tuples too
    assert_same_signal(NestedSignal.from_nested(((1, 2, 3), (4, 5))), tree)


def test_from_nested_dicts_are_keyvalue():
    tree = NestedSignal.from_nested({"title": [1, 2], "body": 3})
    assert tree.parent.tolist() == [-1, 0, 1, 1, 0]
    assert tree.geometry_names() == ["keyvalue", "sequence", None, None, None]
    assert list(tree.key) == [None, "title", None, None, "body"]
    assert tree.x.tolist() == [1, 2, 3]
    assert tree.position[:, 0].tolist() == [-1, 0, 0, 1, 1]


def test_from_nested_node_geometries():
    tree = NestedSignal.from_nested([
        Node([1, 2, 3], geometry="set"),
        Node([[4, 5], [6, 7]], geometry="grid"),
        Node([8, 9, 10], geometry="graph", edges=[(0, 1), (2, 0)]),
        Node({"k": 11, "v": 12}, geometry="keyvalue"),
    ])
    names = tree.geometry_names()
    assert names[0] == "sequence"
    parent = tree.parent.tolist()
    kids = children_of(parent)
    set_node, grid_node, graph_node, kv_node = kids[0]
    assert names[set_node] == "set" and names[grid_node] == "grid"
    assert names[graph_node] == "graph" and names[kv_node] == "keyvalue"
    assert tree.position[kids[grid_node]].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    g = kids[graph_node]
    assert tree.sibling_edge_index.tolist() == [[g[0], g[2]], [g[1], g[0]]]
    assert [tree.key[u] for u in kids[kv_node]] == ["k", "v"]
    assert tree.x.tolist() == list(range(1, 13))


def test_from_nested_modality():
    tree = NestedSignal.from_nested([[1, 2], Node([[3], 4], modality=2)], modality=1)
    assert tree.parent.tolist() == [-1, 0, 1, 1, 0, 4, 5, 4]
    assert tree.modality.tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    tree = NestedSignal.from_nested([[1, 2], Node([3, 4], modality=1)])
    assert tree.modality.tolist() == [0, 0, 0, 0, 1, 1, 1]


def test_from_nested_vector_leaves():
    a, b, c = torch.randn(F), torch.randn(F), torch.randn(F)
    tree = NestedSignal.from_nested([a, [b, c]])
    assert tree.x.shape == (3, F)
    assert torch.equal(tree.x, torch.stack([a, b, c]))
    arr = np.arange(F, dtype=np.float32)
    tree = NestedSignal.from_nested({"img": arr, "txt": [arr + 1]})
    assert tree.x.shape == (2, F) and tree.x.tolist() == [arr.tolist(), (arr + 1).tolist()]


def test_from_nested_single_leaf():
    tree = NestedSignal.from_nested(5)
    assert tree.parent.tolist() == [-1]
    assert tree.x.tolist() == [5]


@pytest.mark.parametrize("data", [[1, torch.randn(F)], [torch.randn(F), [2]],
                                  [torch.randn(F), torch.randn(F + 1)],
                                  [torch.randn(2, F)]])
def test_from_nested_mixed_or_bad_leaves(data):
    msg = error_message(ValueError, NestedSignal.from_nested, data)
    assert "leaf" in msg


@pytest.mark.parametrize("data, path", [([[1], []], "root[1]"), ({}, "root"),
                                        ({"a": [1], "b": {}}, "root.b"),
                                        ([Node([], geometry="set")], "root[0]")])
def test_from_nested_empty_container_names_path(data, path):
    msg = error_message(ValueError, NestedSignal.from_nested, data)
    assert "empty" in msg and path in msg


@pytest.mark.parametrize("data, what", [(["abc"], "str"), ([1, 2.5], "float"),
                                        ([None], "NoneType"), ([True, 1], "bool"),
                                        ({"a": object()}, "object")])
def test_from_nested_unknown_types(data, what):
    msg = error_message(TypeError, NestedSignal.from_nested, data)
    assert what in msg


def test_from_nested_bad_nodes():
    msg = error_message(ValueError, NestedSignal.from_nested, [Node([1, 2], geometry="tree")])
    assert "tree" in msg and "root[0]" in msg
    error_message(ValueError, NestedSignal.from_nested, Node([1, 2], geometry="keyvalue"))
    msg = error_message(ValueError, NestedSignal.from_nested,
                        Node([1, 2], geometry="graph", edges=[(0, 2)]))
    assert "(0, 2)" in msg


def test_from_nested_very_deep():
    depth = 5000
    data = 7
    for _ in range(depth):
        data = [data]
    tree = NestedSignal.from_nested(data)
    assert tree.num_nodes == depth + 1
    assert tree.parent.tolist() == [-1] + list(range(depth))
    assert tree.x.tolist() == [7]
    assert tree.structure.max_depth == depth - 1


# ----------------------------------------------------------------------------------------
# flatten
# ----------------------------------------------------------------------------------------


def check_flat(flat, tree, roots):
    st = tree.structure
    fst = flat.structure
    assert fst.num_trees == roots
    assert flat.num_leaves == tree.num_leaves
    assert fst.max_depth == 0
    # every leaf hangs directly under a root
    flat_parent = flat.parent
    assert bool((flat_parent[flat.leaf_index] >= 0).all())
    assert bool((flat_parent[flat_parent[flat.leaf_index]] == -1).all())
    assert fst.leaf_tree.tolist() == st.leaf_tree.tolist()
    assert torch.equal(flat.x, tree.x)
    assert flat.modality[flat.leaf_index].tolist() == tree.modality[tree.leaf_index].tolist()


def test_flatten_tree():
    tree = mixed_trees()[4]
    flat = flatten(tree)
    check_flat(flat, tree, 1)
    assert flat.parent.tolist() == [-1] + [0] * tree.num_leaves
    assert flat.geometry_names()[0] == "sequence"


def test_flatten_batch():
    trees = mixed_trees()
    batch = Batch.from_data_list(trees)
    roots = sum(int((t.parent < 0).sum()) for t in trees)
    flat = flatten(batch)
    check_flat(flat, batch, roots)


def test_from_networkx_attribute_names_and_position_order():
    G = nx.DiGraph()
    G.add_node("doc", kind="keyvalue")
    # children inserted out of order; their `slot` attribute gives the document order
    for label, slot, feat in [("c", 2, [3.0]), ("a", 0, [1.0]), ("b", 1, [2.0])]:
        G.add_node(label, slot=slot, feat=torch.tensor(feat), field=f"f{slot}", tag=1)
        G.add_edge("doc", label)
    by_graph = NestedSignal.from_networkx(G, x="feat", geometry="kind", position="slot",
                                          key="field", modality="tag")
    assert by_graph.x.flatten().tolist() == [3.0, 1.0, 2.0]
    assert by_graph.geometry_names()[0] == "keyvalue"
    assert by_graph.key == [None, "f2", "f0", "f1"]
    assert by_graph.modality.tolist() == [0, 1, 1, 1]
    by_position = NestedSignal.from_networkx(G, x="feat", geometry="kind", position="slot",
                                             key="field", order="position")
    assert by_position.x.flatten().tolist() == [1.0, 2.0, 3.0]
    assert by_position.position[1:, 0].tolist() == [0, 1, 2]
    assert by_position.key == [None, "f0", "f1", "f2"]
    with pytest.raises(ValueError, match="order"):
        NestedSignal.from_networkx(G, order="alphabetical")


def test_from_networkx_position_order_is_depth_first():
    G = nx.DiGraph([(0, 2), (0, 1), (2, 4), (2, 3), (1, 5)])
    nx.set_node_attributes(G, {1: 0, 2: 1, 3: 0, 4: 1, 5: 0}, "position")
    nx.set_node_attributes(G, {3: 30, 4: 40, 5: 50}, "x")
    tree = NestedSignal.from_networkx(G, order="position")
    # depth first, children by position: 0, 1, 5, 2, 3, 4
    assert tree.x.tolist() == [50, 30, 40]
    assert tree.parent.tolist() == [-1, 0, 1, 0, 3, 3]


# ---------------------------------------------- issue 17: depth, stale caches, mixing
def test_from_nested_memory_is_linear_in_depth():
    """Each node keeps only its step below its parent; a 40,000-deep nesting once kept
    every leaf's whole path (quadratic memory, gigabytes)."""
    import tracemalloc

    def peak(depth: int) -> int:
        data = [1]
        for _ in range(depth):
            data = [data]
        tracemalloc.start()
        tree = NestedSignal.from_nested(data)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert tree.num_nodes == depth + 2
        return top

    small, big = peak(5_000), peak(40_000)
    assert big < 12 * small  # 8x the nodes: linear, not 64x


def test_from_nested_paths_are_still_named_in_errors():
    data = [[1, 2], {"a": [3, Node([4, "bad"])]}]
    with pytest.raises(TypeError, match=r"from str at root\[1\]\.a\[1\]\[1\]"):
        NestedSignal.from_nested(data)
    deep = [1.5]
    for _ in range(3):
        deep = [deep]
    with pytest.raises(TypeError, match=r"at root\[0\]\[0\]\[0\]\[0\]"):
        NestedSignal.from_nested(deep)


def test_cache_follows_the_edge_index_object_not_its_address():
    """A replacement ``edge_index`` may reuse the freed memory of an earlier one (same
    address, version 0, same shape): the cache must still see a new tensor, so it is
    keyed on the tensor object itself."""
    from hsa_graph.signal import _StructureCache
    tree = NestedSignal.from_parents([-1, 0, 0, 1, 1])
    first = tree.structure
    cache = tree.__dict__["_structure_cache"]
    assert isinstance(cache, _StructureCache) and cache.matches(tree.edge_index, 5)
    alias = tree.edge_index.view(2, -1)   # same address, version counter and shape
    assert alias.data_ptr() == tree.edge_index.data_ptr()
    assert not cache.matches(alias, 5)    # ... but another tensor object
    chain = NestedSignal.from_parents([-1, 0, 1, 2, 3])
    tree.edge_index = chain.edge_index.clone()
    assert tree.structure is not first
    assert tree.structure.internal_size.tolist() == chain.structure.internal_size.tolist()
    with pytest.raises(ValueError, match="node 2 has children but its geometry code is -1"):
        tree.validate()                   # the geometries still describe the old tree
    tree.geometry = chain.geometry
    assert tree.validate()


def test_validate_checks_the_tree_and_drops_a_stale_cache():
    tree = NestedSignal.from_parents([-1, 0, 0, 1, 1])
    before = tree.structure
    tree.edge_index.numpy()[0, 3] = 0        # bypasses torch's version counter
    assert tree.structure is before          # the O(1) check cannot see it ...
    assert tree.validate()                   # ... validate does
    assert tree.structure is not before
    assert tree.structure.internal_size.tolist() == [3.0, 1.0]   # leaves 2, 3, 4 | 3
    tree.edge_index = torch.tensor([[0, 0, 1, 1], [1, 2, 3, 3]])
    with pytest.raises(ValueError, match="node 3 has 2 parents"):
        tree.validate()
    with pytest.warns(UserWarning, match="node 3 has 2 parents"):
        assert tree.validate(raise_on_error=False) is False
    leafy = NestedSignal.from_parents([-1, 0, 0])
    leafy.geometry = torch.tensor([0, 0, -1])
    with pytest.raises(ValueError, match="node 1 is a leaf but its geometry code is 0"):
        leafy.validate()


def test_cache_survives_pickle_and_copies_as_a_rebuild():
    import copy
    import pickle
    tree = NestedSignal.from_parents([-1, 0, 0, 1, 1])
    first = tree.structure
    assert copy.copy(tree).structure is first   # same edge_index object
    for other in (copy.deepcopy(tree), pickle.loads(pickle.dumps(tree))):
        assert other.structure is not first
        assert other.structure.internal_size.tolist() == first.internal_size.tolist()


def test_collate_names_trees_that_cannot_share_a_batch():
    from torch.utils.data import DataLoader as TorchLoader

    from hsa_graph import collate
    from hsa_graph.builders import image_tree, text_tree
    text = text_tree("Hi there. Bye.")
    image = image_tree(np.zeros((4, 4, 3), np.uint8), 2)
    loader = TorchLoader([text, image], batch_size=2, collate_fn=collate)
    with pytest.raises(ValueError, match=r"trees 0 and 1 cannot share a batch: tree 0 has "
                                         r"\['span', 'tokens'\], which tree 1 lacks"):
        next(iter(loader))
    del text.tokens, text.span
    with pytest.raises(ValueError, match=r"'x' is a \[5\] int64 tensor in tree 0 and a "
                                         r"\[4, 12\] float32 tensor in tree 1 \(token ids"):
        collate([text, image])
    embedded = text_tree("Hi there. Bye.", embed=lambda ids: torch.ones(len(ids), 12))
    del embedded.tokens, embedded.span
    batch = collate([embedded, image])
    assert batch.num_graphs == 2 and batch.x.shape == (5 + 4, 12)
    with pytest.raises(TypeError, match="item 1 is a str"):
        collate([image, "tree"])
