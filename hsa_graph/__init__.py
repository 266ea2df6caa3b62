"""hsa_graph: Hierarchical Self-Attention on nested signals stored as PyG graphs.

The public names of SPEC.md section 4::

    tree = hsa_graph.NestedSignal.from_parents(parent)
    y = hsa_graph.hsa(q, k, v, tree, include_self=True, scale=None)
    theta = hsa_graph.hsa_weights(q, k, tree)
"""
from . import io, nn
from .builders import (
    document_tree,
    hopping_window_forest,
    hopping_window_tree,
    html_tree,
    image_tree,
    text_tree,
    text_trees,
    website_tree,
)
from .geometry import FieldNameEmbedding, PositionEncoder
from .ops.cache import HSACache
from .ops.causal import causal_hsa
from .ops.cross import cross_hsa
from .ops.dense import hsa_weights
from .ops.hsa import hsa
from .signal import GEOMETRIES, NestedSignal, Node, collate, flatten
from .structure import FamilyBucket, TreeStructure

__version__ = "0.1.0"

__all__ = [
    "GEOMETRIES",
    "FieldNameEmbedding",
    "PositionEncoder",
    "document_tree",
    "hopping_window_forest",
    "hopping_window_tree",
    "html_tree",
    "image_tree",
    "text_tree",
    "text_trees",
    "website_tree",
    "FamilyBucket",
    "HSACache",
    "NestedSignal",
    "Node",
    "TreeStructure",
    "causal_hsa",
    "collate",
    "cross_hsa",
    "flatten",
    "hsa",
    "hsa_weights",
    "io",
    "nn",
]
