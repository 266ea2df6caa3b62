r"""Neural modules around HSA: attention layer, transformer layers, pooling.

* :class:`HSAttention`: multi-head HSA with (per-modality) q/k/v projections,
  LayerNorm on queries and keys, per-geometry position embeddings and an output
  projection; ``attention="flat"`` / ``"none"`` give the flat self-attention and
  DeepSet baselines on the same code path; ``causal=True`` makes it causal HSA,
  with :meth:`~HSAttention.new_cache` / :meth:`~HSAttention.step` for generating one
  token at a time.
* :class:`CausalDecoderLayer` and :class:`HierarchicalCausalLM` (a pre-norm decoder
  block and a small language model on causal ``HSAttention``);
  :class:`CausalHSAttention` is a compatibility alias of ``HSAttention(causal=True,
  qk_norm=False)``.
* :class:`HierarchicalTransformerEncoderLayer` (the paper's HTE layer),
  :class:`HSATransformerEncoderLayer` (pre-norm block) and
  :class:`HierarchicalTransformerEncoder` (a stack of either).
* :func:`global_leaf_pool`, :func:`subtree_pool`, :func:`pool_leaves`: one vector per
  tree, per node (internal nodes included), and local pooling into parents.
* :class:`RecursiveTreeEncoder`: not HSA but the recursive model it is compared with,
  every internal node computed from its children's vectors, deepest first.
"""
from .attention import ATTENTIONS, HSAttention, attention_tree
from .causal import CausalDecoderLayer, CausalHSAttention, HierarchicalCausalLM
from .classifier import TreeClassifier, attention_flops
from .encoder import (
    HierarchicalTransformerEncoder,
    HierarchicalTransformerEncoderLayer,
    HSATransformerEncoderLayer,
)
from .linear import ModalityLinear
from .pool import PooledTree, global_leaf_pool, pool_leaves, subtree_pool
from .recursive import RecursiveTreeEncoder

__all__ = [
    "ATTENTIONS",
    "CausalDecoderLayer",
    "CausalHSAttention",
    "HierarchicalCausalLM",
    "HSAttention",
    "HSATransformerEncoderLayer",
    "HierarchicalTransformerEncoder",
    "HierarchicalTransformerEncoderLayer",
    "ModalityLinear",
    "PooledTree",
    "RecursiveTreeEncoder",
    "TreeClassifier",
    "attention_flops",
    "attention_tree",
    "global_leaf_pool",
    "pool_leaves",
    "subtree_pool",
]
