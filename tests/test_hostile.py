"""Hostile inputs to the constructors and builders that once crashed, hung or were
silently misread (each found by tests/fuzz or by hand, then fixed), and the places where
one root is required."""
from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from hsa_graph import NestedSignal, Node
from hsa_graph.builders import document_tree, image_tree, text_tree


def test_float_geometry_codes_are_refused_not_truncated():
    with pytest.raises(TypeError, match="geometry codes must be integers"):
        NestedSignal.from_parents([-1, 0, 0], geometry=torch.tensor([2.7, -1.0, -1.0]))


def test_key_given_as_one_string_is_refused_not_split():
    with pytest.raises(TypeError, match="got the str 'abc'"):
        NestedSignal.from_parents([-1, 0, 0], key="abc")


def test_keys_must_be_strings_everywhere():
    with pytest.raises(TypeError, match="key of node 2 is a int"):
        NestedSignal.from_parents([-1, 0, 0], key=[None, None, 7])


def test_negative_modality_is_refused():
    with pytest.raises(ValueError, match="node 1 has modality -2"):
        NestedSignal.from_parents([-1, 0, 0], modality=[0, -2, 0])
    with pytest.raises(ValueError, match="modality must be a non-negative int"):
        image_tree(np.zeros((4, 4, 3), np.uint8), 2, modality=-1)
    with pytest.raises(ValueError, match="root.a: Node modality must be >= 0"):
        document_tree({"a": Node(["x"], modality=-1)})
    with pytest.raises(ValueError, match="text_modality must be >= 0"):
        document_tree({"a": "x"}, text_modality=-1)


def test_int_leaf_beyond_int64_names_its_place():
    with pytest.raises(ValueError, match=r"leaf at root\[1\] is the int "
                                         r"36893488147419103234, outside the int64"):
        NestedSignal.from_nested([1, 2 ** 64 * 2 + 2])


def test_multigraph_is_refused_with_a_reason():
    with pytest.raises(TypeError, match="multigraph"):
        NestedSignal.from_networkx(nx.MultiDiGraph([(0, 1), (0, 2)]))


def test_image_pad_value_must_be_a_number():
    with pytest.raises(TypeError, match="pad_value must be a number"):
        image_tree(np.zeros((3, 3, 3), np.uint8), 2, pad_value="white")


def test_join_keeps_builder_attributes():
    a = text_tree("It rained. We stayed in.")
    b = text_tree("Sun!")
    doc = NestedSignal.join([a, b], "keyvalue", keys=["first", "second"])
    assert doc.tokens == a.tokens + b.tokens
    assert doc.span.tolist() == [[-1, -1]] + a.span.tolist() + b.span.tolist()
    assert doc.key[1] == "first" and doc.key[1 + a.num_nodes] == "second"
    # leaf rows of x and tokens still line up
    assert doc.x.tolist() == a.x.tolist() + b.x.tolist()
    assert len(doc.tokens) == doc.num_leaves
    # an attribute only some children carry is dropped, not mis-sized
    plain = NestedSignal.from_parents([-1, 0, 0], x=torch.tensor([5, 6]))
    mixed = NestedSignal.join([a, plain])
    assert "tokens" not in mixed.keys() and mixed.num_leaves == a.num_leaves + 2


def test_join_single_node_children():
    one = NestedSignal.from_parents([-1], x=torch.ones(1, 2))
    one.tag = torch.tensor([7])
    one.words = ["w"]
    doc = NestedSignal.join([one, one])
    assert doc.tag.tolist() == [-1, 7, 7]            # tensors: per node
    assert doc.words == ["w", "w"]                  # lists: per leaf


def test_where_one_root_is_required():
    forest = NestedSignal.from_parents([-1, 0, 0, -1, 3, 3])
    with pytest.raises(ValueError, match="child 0 is a forest of 2 trees"):
        NestedSignal.join([forest])
    with pytest.raises(ValueError, match="root.a: the subtree is a forest of 2 trees"):
        document_tree({"a": forest})
    batch = Batch.from_data_list([text_tree("One."), text_tree("Two.")])
    with pytest.raises(ValueError, match="forest of 2 trees"):
        NestedSignal.join([batch])


def test_a_cycle_inside_a_node_is_refused():
    children = [1]
    node = Node(children, geometry="set")
    children.append(node)
    with pytest.raises(ValueError, match="cycle"):
        NestedSignal.from_nested(node)


# ------------------------------------------------- issue 17: types and silent values
@pytest.mark.parametrize("x, match", [("ab", "got the str 'ab'"), (object(), "got a object"),
                                      ([[1, 2], [3]], "got a list")])
def test_non_tensor_x_is_a_type_error(x, match):
    with pytest.raises(TypeError, match=match):
        NestedSignal.from_parents([-1, 0, 0], x=x)


def test_join_checks_keys_positions_and_edges():
    a = NestedSignal.from_parents([-1, 0, 0], x=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"keys must have one entry per child \(2\), got 1"):
        NestedSignal.join([a, a], "keyvalue", keys=["k"])
    with pytest.raises(ValueError, match=r"keys must have one entry per child \(2\), got 1"):
        NestedSignal.join([a, a], "sequence", keys=["k"])
    with pytest.raises(ValueError, match=r"positions must have one entry per child"):
        NestedSignal.join([a, a], positions=[0])
    with pytest.raises(ValueError, match=r"edge 0 is \(0,\); each edge is a pair"):
        NestedSignal.join([a, a], "graph", sibling_edges=[(0,)])
    with pytest.raises(ValueError, match="not 'graph'"):
        NestedSignal.join([a, a], "set", sibling_edges=[(0, 1)])
    with pytest.raises(TypeError, match="join takes a sequence"):
        NestedSignal.join(None)


def test_join_accepts_integer_geometry_codes():
    a = NestedSignal.from_parents([-1, 0, 0], x=torch.ones(2, 3))
    by_code = NestedSignal.join([a, a], 3, keys=["p", "q"])
    by_name = NestedSignal.join([a, a], "keyvalue", keys=["p", "q"])
    assert torch.equal(by_code.geometry, by_name.geometry) and by_code.key == by_name.key
    with pytest.raises(ValueError, match="leaf code -1"):
        NestedSignal.join([a, a], -1)
    with pytest.raises(ValueError, match="unknown geometry True"):
        NestedSignal.join([a, a], True)


@pytest.mark.parametrize("bad", [float("inf"), 1.5, 2.0, 2 ** 64, -1])
def test_modalities_are_non_negative_ints_not_truncated(bad):
    a = NestedSignal.from_parents([-1, 0], x=torch.ones(1, 2))
    error = ValueError if isinstance(bad, int) else TypeError
    with pytest.raises(error, match="modality must be"):
        NestedSignal.join([a], modality=bad)
    with pytest.raises(error, match="the Node modality at root"):
        NestedSignal.from_nested(Node([1, 2], modality=bad))
    with pytest.raises(error, match="modality must be"):
        NestedSignal.from_nested([1, 2], modality=bad)
    graph = nx.DiGraph([(0, 1), (0, 2)])
    nx.set_node_attributes(graph, {1: bad}, "modality")
    with pytest.raises(error, match="node 1: modality must be"):
        NestedSignal.from_networkx(graph)
    for builder in (lambda: text_tree("a b", modality=bad),
                    lambda: image_tree(np.zeros((4, 4, 3), np.uint8), 2, modality=bad)):
        with pytest.raises((ValueError, TypeError), match="modality must be"):
            builder()
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="text_modality must be >= 0"):
            document_tree({"a": "x"}, text_modality=bad)


@pytest.mark.parametrize("bad", [float("inf"), 2.7, (1.5, 0), (0, float("nan"))])
def test_float_positions_are_refused_not_truncated(bad):
    a = NestedSignal.from_parents([-1, 0], x=torch.ones(1, 2))
    with pytest.raises(ValueError, match="position must be an int or an"):
        NestedSignal.join([a, a], positions=[bad, 1])
    graph = nx.DiGraph([(0, 1), (0, 2)])
    nx.set_node_attributes(graph, {1: bad}, "position")
    with pytest.raises(ValueError, match="node 1: position must be"):
        NestedSignal.from_networkx(graph)


def test_unsigned_parents_beyond_int64_do_not_become_roots():
    parent = np.array([2 ** 64 - 1, 0], dtype=np.uint64)   # int64 would wrap it to -1
    with pytest.raises(ValueError, match="unsigned value 18446744073709551615"):
        NestedSignal.from_parents(parent)
    with pytest.raises(ValueError, match="unsigned value"):
        NestedSignal.from_parents(torch.from_numpy(parent))


def test_one_element_sibling_edges_are_named():
    graph = nx.DiGraph([(0, 1), (0, 2)])
    nx.set_node_attributes(graph, {0: "graph"}, "geometry")
    graph.graph["sibling_edges"] = [(1,)]
    with pytest.raises(ValueError, match=r"sibling edge 0 is \(1,\)"):
        NestedSignal.from_networkx(graph)
    with pytest.raises(ValueError, match=r"graph Node at root: edge 0 is \(0,\)"):
        NestedSignal.from_nested(Node([1, 2], geometry="graph", edges=[(0,)]))
    with pytest.raises(ValueError, match=r"edge 0 is \(0.5, 1\)"):
        NestedSignal.from_nested(Node([1, 2], geometry="graph", edges=[(0.5, 1)]))


def test_edges_on_a_non_graph_node_are_refused_not_dropped():
    with pytest.raises(ValueError, match="edges were given for the 'set' Node at root"):
        NestedSignal.from_nested(Node([1, 2], geometry="set", edges=[(0, 1)]))
    assert NestedSignal.from_nested(Node([1, 2], geometry="set")).num_leaves == 2


def test_bad_node_children_are_type_errors_naming_the_place():
    with pytest.raises(TypeError, match=r"the children of a Node at root\[1\] must be a list"):
        NestedSignal.from_nested([1, Node(5)])
    with pytest.raises(TypeError, match="row 0 at root must be a list"):
        NestedSignal.from_nested(Node([1, 2], geometry="grid"))
    with pytest.raises(ValueError, match="a Node takes one of"):
        NestedSignal.from_nested(Node([1, 2], geometry=2))


@pytest.mark.parametrize("kwargs, match", [
    ({"geometry": None}, "geometry must be a name"), ({"key": 5}, "key must be a sequence"),
    ({"position": 5}, "position must be a sequence"), ({"geometry": [True, None, None]},
                                                       "unknown geometry True")])
def test_from_parents_argument_types(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        NestedSignal.from_parents([-1, 0, 0], **kwargs)


@pytest.mark.parametrize("name", ["structure", "is_leaf", "to", "batch", "ptr", "_x",
                                  "edge_index", "num_leaves"])
def test_reserved_attribute_names_are_refused(name):
    with pytest.raises(ValueError, match="attribute name"):
        NestedSignal.from_parents([-1, 0], **{name: torch.tensor([1, 2])})
    ok = NestedSignal.from_parents([-1, 0], y=torch.tensor([1]), tokens=["a"])
    assert ok.y.tolist() == [1] and ok.tokens == ["a"]


def test_huge_windows_and_regions_are_the_same_tree():
    from hsa_graph.builders import hopping_window_parents
    wide = hopping_window_parents([5, 7], (2, 2 ** 70))
    exact = hopping_window_parents([5, 7], (2, 7))
    assert all(torch.equal(a, b) for a, b in zip(wide, exact))
    with pytest.raises(ValueError, match="lengths\\[0\\] is 9,223,372,036,854,775,808 tokens"):
        hopping_window_parents([2 ** 63], (2,))
    image = np.zeros((6, 10, 3), np.uint8)
    for quadtree in (True, False):
        huge = image_tree(image, 2, quadtree=quadtree, region=2 ** 70)
        side = image_tree(image, 2, quadtree=quadtree, region=5)
        assert torch.equal(huge.parent, side.parent)
        assert torch.equal(huge.position, side.position)
