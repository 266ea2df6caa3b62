"""hsa_graph: Hierarchical Self-Attention on nested signals stored as PyG graphs.

The core names (the operator is defined on the documentation's *Definition* page)::

    tree = hsa_graph.NestedSignal.from_parents(parent)
    y = hsa_graph.hsa(q, k, v, tree, include_self=True, scale=None)
    theta = hsa_graph.hsa_weights(q, k, tree)

The names below are imported on first use (PEP 562), so that ``import hsa_graph`` and
``hsa-graph --help`` do not pay for torch and PyTorch Geometric until a name that needs
them is touched.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, List

__version__ = "0.1.0"

# public name -> the submodule that defines it; a submodule maps to itself.
_LAZY: Dict[str, str] = {
    "GEOMETRIES": ".signal",
    "NestedSignal": ".signal",
    "Node": ".signal",
    "flatten": ".signal",
    "collate": ".signal",
    "FieldNameEmbedding": ".geometry",
    "PositionEncoder": ".geometry",
    "document_tree": ".builders",
    "hopping_window_forest": ".builders",
    "hopping_window_tree": ".builders",
    "html_tree": ".builders",
    "image_tree": ".builders",
    "text_tree": ".builders",
    "text_trees": ".builders",
    "website_tree": ".builders",
    "cluster_tree": ".induce",
    "contiguous_tree": ".induce",
    "induce": ".induce",
    "TreeStructure": ".structure",
    "BatchedHSACache": ".ops.cache",
    "HSACache": ".ops.cache",
    "KVCache": ".ops.kv_cache",
    "causal_hsa": ".ops.causal",
    "cross_hsa": ".ops.cross",
    "hsa_weights": ".ops.dense",
    "hsa": ".ops.hsa",
    "io": ".io",
    "nn": ".nn",
}

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
    "cluster_tree",
    "contiguous_tree",
    "induce",
    "BatchedHSACache",
    "HSACache",
    "KVCache",
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


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'hsa_graph' has no attribute {name!r}")
    module = importlib.import_module(target, __name__)
    value = module if target == "." + name else getattr(module, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
