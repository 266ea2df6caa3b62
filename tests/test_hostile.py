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
