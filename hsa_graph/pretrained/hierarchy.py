r"""One signal hierarchy per example of a padded batch, for HSA inside a pre-trained
transformer.

A tokenized batch is ``[B, L]`` with an ``attention_mask`` (1 = token, 0 = pad). The
hierarchy is a forest with one tree per example whose leaves are exactly that
example's tokens (pads are not leaves), in order, so the leaves of the forest are the
rows of ``x[attention_mask.bool()]``. Two kinds:

* **hopping windows** (:func:`window_hierarchy`): a fixed hierarchy given by a
  bottom-up branching tuple, e.g. ``(2, 4, 8, 16)`` (the paper's choice): it depends
  only on the lengths, so it can be built from the mask inside the model. ``()`` is
  the one-level tree (a root over all tokens), under which HSA is exactly softmax
  attention.
* **induced** (:class:`InducedHierarchy`): built in every layer from that layer's
  own keys (:mod:`hsa_graph.induce`), so it needs the layer and is resolved inside
  the patched attention, not from the mask.
* **semantic** (:func:`semantic_hierarchy`): tokens -> words -> sentences -> example,
  from the tokenizer's word ids and character offsets and
  :func:`~hsa_graph.builders.text.split_sentences`; special tokens (``[CLS]``,
  ``[SEP]``) are children of the root.

:func:`resolve_hierarchy` turns either (or a ready forest) into the forest for a
given token mask and checks that they match.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.data import Batch

from ..builders.text import split_sentences
from ..builders.windows import _check_branching, hopping_window_forest
from ..signal import NestedSignal
from .approximations import SparsePattern

__all__ = ["Hierarchy", "INDUCE_METHODS", "InducedHierarchy",
           "check_hierarchy", "resolve_hierarchy", "semantic_hierarchy", "token_mask",
           "window_hierarchy"]

#: What a patched layer accepts as a hierarchy: a bottom-up branching tuple (hopping
#: windows built from the mask), a forest with one tree per example, an
#: :class:`InducedHierarchy` (a tree per layer from its own keys) or a
#: :class:`~hsa_graph.pretrained.approximations.SparsePattern` (masked softmax
#: attention on a fixed pattern instead of HSA, for comparison).
Hierarchy = Union[Tuple[int, ...], Sequence[int], NestedSignal, Batch, "InducedHierarchy",
                  SparsePattern]


def token_mask(attention_mask: Any) -> Tensor:
    """The ``[B, L]`` boolean token mask of a 2-D ``attention_mask`` (ints, bools or a
    list of lists), checked: every example needs at least one token.

    Example:
        >>> token_mask([[1, 1, 0], [1, 1, 1]]).sum(1).tolist()
        [2, 3]
    """
    mask = torch.as_tensor(attention_mask)
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, length], got shape "
                         f"{tuple(mask.shape)}")
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"attention_mask must hold 0/1 integers or bools, got {mask.dtype}")
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            b, t = bad.nonzero()[0].tolist()
            raise ValueError(f"attention_mask[{b}, {t}] = {int(mask[b, t])}; expected 0 or 1")
        mask = mask.bool()
    empty = ~mask.any(1)
    if bool(empty.any()):
        raise ValueError(f"example {int(empty.nonzero()[0])} has no tokens "
                         "(its attention_mask is all 0)")
    return mask


def window_hierarchy(attention_mask: Any, branching: Sequence[int] = (2, 4, 8, 16)
                     ) -> NestedSignal:
    r"""Hopping windows over the tokens of each example (pads excluded): one tree per
    example, built by :func:`~hsa_graph.builders.windows.hopping_window_forest` from
    the number of tokens of each row of the mask.

    Args:
        attention_mask: ``[B, L]``, 1 for tokens, 0 for pads (any side).
        branching: bottom-up window sizes; ``()`` gives the one-level tree.

    Returns:
        A forest of ``B`` trees with ``attention_mask.sum()`` leaves.

    Example:
        >>> forest = window_hierarchy([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], (2,))
        >>> forest.num_leaves, forest.structure.num_trees
        (11, 2)
    """
    mask = token_mask(attention_mask)
    return hopping_window_forest(mask.sum(1).cpu(), branching)


def semantic_hierarchy(encoding: Any, texts: Sequence[str], *, split_lines: bool = False
                       ) -> NestedSignal:
    r"""Tokens -> words -> sentences -> example: one tree per example of a tokenized
    batch, from the tokenizer's own word ids and character offsets.

    A token's word is the tokenizer's ``word_ids`` (word pieces of one word share a
    parent); a word's sentence is the sentence of
    :func:`~hsa_graph.builders.text.split_sentences` holding its first token's first
    character. Tokens without a word (``[CLS]``, ``[SEP]``) are children of the root;
    pads are not in the tree. Words of one piece and sentences of one word are unary
    nodes, which change nothing in HSA (:ref:`def-prop-5`). Every internal node is a
    ``sequence``; positions are reading order.

    Args:
        encoding: what a fast Hugging Face tokenizer returns for ``texts`` with
            ``return_offsets_mapping=True`` (``attention_mask`` and
            ``offset_mapping`` ``[B, L, 2]`` as tensors, and ``word_ids(b)``).
        texts: the ``B`` strings that were tokenized.
        split_lines: one sentence per line (as in the Pang & Lee reviews) instead of
            the rule-based splitter.

    Returns:
        A forest of ``B`` trees whose leaves are the tokens with mask 1, in order.

    Raises:
        ValueError: missing offsets or word ids, or a batch size that does not match
            ``texts``.

    Example:
        >>> from hsa_graph.pretrained import load_minilm
        >>> _, tokenizer = load_minilm()
        >>> texts = ["It rained. We stayed in.", "Sunny!"]
        >>> enc = tokenizer(texts, padding=True, return_offsets_mapping=True,
        ...                 return_tensors="pt")
        >>> tree = semantic_hierarchy(enc, texts)
        >>> tree.num_leaves == int(enc["attention_mask"].sum())
        True
        >>> tree.parent[:9].tolist()   # [CLS] it rained . we stayed in . [SEP]
        [25, 13, 14, 15, 16, 17, 18, 19, 25]
        >>> tree.parent[13:22].tolist()  # the words of example 0, then of example 1
        [22, 22, 22, 23, 23, 23, 23, 24, 24]
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError("texts must be a list of strings (the tokenized batch)")
    for key in ("attention_mask", "offset_mapping"):
        if key not in encoding:
            raise ValueError(f"the encoding has no {key!r}: call the tokenizer with "
                             "padding=True, return_offsets_mapping=True, return_tensors='pt'")
    mask = token_mask(encoding["attention_mask"])
    num_ex, length = mask.shape
    if len(texts) != num_ex:
        raise ValueError(f"the encoding holds {num_ex} examples but {len(texts)} texts "
                         "were given")
    offsets = torch.as_tensor(encoding["offset_mapping"]).cpu().contiguous()
    if offsets.shape != (num_ex, length, 2):
        raise ValueError(f"offset_mapping must be [{num_ex}, {length}, 2], got "
                         f"{tuple(offsets.shape)}")
    if not callable(getattr(encoding, "word_ids", None)):
        raise ValueError("the encoding has no word_ids(): use a fast tokenizer")
    # Per example (not per token): the tokenizer hands word ids over as Python lists,
    # and sentences are found per text.
    word = torch.tensor([[-1 if w is None else w for w in encoding.word_ids(b)]
                         for b in range(num_ex)], dtype=torch.long).view(num_ex, length)
    sentence = torch.full((num_ex, length), -1, dtype=torch.long)
    for b, text in enumerate(texts):
        starts = torch.tensor([a for a, _ in split_sentences(text, split_lines=split_lines)]
                              or [0], dtype=torch.long)
        sentence[b] = torch.searchsorted(starts, offsets[b, :, 0].contiguous(), right=True) - 1
        sentence[b].clamp_(min=0)
    mask = mask.cpu()
    ex, _ = mask.nonzero(as_tuple=True)              # leaves, in reading order
    word, sentence = word[mask], sentence[mask]
    n = ex.numel()
    in_word = word >= 0
    # Words and sentences as (example, id) keys, numbered in reading order; a word
    # keeps the sentence of its first token.
    span = int(max(word.max(), sentence.max())) + 1
    word_key = torch.where(in_word, ex * span + word, -1)
    words, word_of = torch.unique(word_key[in_word], return_inverse=True)
    first = torch.full((words.numel(),), n, dtype=torch.long).scatter_reduce(
        0, word_of, in_word.nonzero().flatten(), "amin")
    sent_key = ex[first] * span + sentence[first]
    sents, sent_of_word = torch.unique(sent_key, return_inverse=True)
    num_w, num_s = words.numel(), sents.numel()
    word_node = n + torch.arange(num_w)
    sent_node = n + num_w + torch.arange(num_s)
    root_node = n + num_w + num_s + torch.arange(num_ex)
    parent = torch.cat([
        torch.where(in_word, word_node[word_of.new_zeros(n).masked_scatter(in_word, word_of)],
                    root_node[ex]),
        sent_node[sent_of_word],
        root_node[torch.div(sents, span, rounding_mode="floor")],
        torch.full((num_ex,), -1, dtype=torch.long)])
    # Reading order among siblings: rank by the first token under each node.
    first_token = torch.cat([torch.arange(n), first,
                             torch.full((num_s,), n, dtype=torch.long).scatter_reduce(
                                 0, sent_of_word, first, "amin"),
                             torch.zeros(num_ex, dtype=torch.long)])
    order = torch.argsort(parent * (n + 1) + first_token, stable=True)
    sorted_parent = parent[order]
    start = torch.searchsorted(sorted_parent, sorted_parent)     # first slot of each family
    position = torch.empty_like(parent)
    position[order] = torch.arange(parent.numel()) - start
    position = torch.stack([position, torch.zeros_like(position)], 1)
    position[parent < 0] = -1
    return NestedSignal.from_parents(parent, position=position)


def _is_forest(hierarchy: Any) -> bool:
    return isinstance(hierarchy, NestedSignal) or (
        isinstance(hierarchy, Batch) and hasattr(hierarchy, "structure_for"))


def check_hierarchy(hierarchy: Hierarchy) -> Union[Tuple[int, ...], None]:
    """The branching tuple of a window hierarchy (``None`` for a forest, an
    :class:`InducedHierarchy` or a sparse pattern).

    Raises:
        ValueError: a bad branching tuple, or a string such as ``"semantic"`` (a
            semantic hierarchy needs the texts: build it per call with
            :func:`semantic_hierarchy`).

    Example:
        >>> check_hierarchy([2, 4])
        (2, 4)
    """
    if isinstance(hierarchy, str):
        raise ValueError(f"hierarchy {hierarchy!r}: pass a branching tuple such as "
                         "(2, 4, 8, 16), or a forest (e.g. semantic_hierarchy(encoding, "
                         "texts)) for each call")
    if _is_forest(hierarchy) or isinstance(hierarchy, (InducedHierarchy, SparsePattern)):
        return None
    return _check_branching(hierarchy)


def resolve_hierarchy(hierarchy: Hierarchy, mask: Tensor) -> NestedSignal:
    r"""The forest for a ``[B, L]`` boolean token mask: hopping windows for a branching
    tuple, or ``hierarchy`` itself when it is a forest, after checking that it has one
    tree per example with that example's number of tokens as leaves.

    Raises:
        ValueError: a bad branching tuple, the string ``"semantic"`` (a semantic
            hierarchy needs the texts: build it with :func:`semantic_hierarchy`), or a
            forest whose trees do not match the mask.

    Example:
        >>> mask = torch.tensor([[True, True, False], [True, True, True]])
        >>> resolve_hierarchy((2,), mask).num_leaves
        5
        >>> resolve_hierarchy(window_hierarchy([[1, 1, 1]]), mask)
        Traceback (most recent call last):
        ...
        ValueError: the hierarchy has 1 trees but the batch has 2 examples
    """
    branching = check_hierarchy(hierarchy)
    if branching is not None:
        return hopping_window_forest(mask.sum(1).cpu(), branching)
    if isinstance(hierarchy, (InducedHierarchy, SparsePattern)):
        raise ValueError(f"{hierarchy.name} is built inside each layer (from its keys or "
                         "its pattern), not from the mask")
    st = hierarchy.structure_for(mask.device)
    lengths = mask.sum(1)
    if st.num_trees != lengths.numel():
        raise ValueError(f"the hierarchy has {st.num_trees} trees but the batch has "
                         f"{lengths.numel()} examples")
    counts = torch.bincount(st.leaf_tree, minlength=st.num_trees)
    if not torch.equal(counts, lengths) or bool((st.leaf_tree.diff() < 0).any()):
        bad = int((counts != lengths).nonzero()[0]) if not torch.equal(counts, lengths) else 0
        raise ValueError(
            f"tree {bad} of the hierarchy has {int(counts[bad])} leaves but example {bad} "
            f"has {int(lengths[bad])} tokens (one leaf per non-pad token, trees in batch "
            "order)")
    return hierarchy


#: How :class:`InducedHierarchy` builds its trees: the functions of
#: :mod:`hsa_graph.induce` by name.
INDUCE_METHODS = ("contiguous", "cluster")


@dataclass(frozen=True)
class InducedHierarchy:
    r"""A hierarchy the data chooses: in every replaced layer, one tree per example
    built at run time from that layer's own keys, without gradient.

    The keys of the non-pad tokens ``[N, H, D]`` become one vector per token (the
    heads concatenated, ``pool="concat"``, i.e. the layer's key projection, or their
    mean, ``pool="mean"``), and :func:`hsa_graph.induce.contiguous_tree` (neighbours
    merged bottom-up by similarity; every node's leaves contiguous) or
    :func:`hsa_graph.induce.cluster_tree` (recursive balanced clustering; order
    ignored) builds a forest with at most ``max_children`` children per node. HSA
    then runs exactly on that forest.

    Args:
        max_children: the bound on family size (``>= 2``).
        method: ``"contiguous"`` or ``"cluster"``.
        pool: ``"concat"`` or ``"mean"`` over heads.

    Example:
        >>> InducedHierarchy(4).name, InducedHierarchy(8, "cluster").name
        ('induced:4', 'cluster:8')
    """

    max_children: int = 4
    method: str = "contiguous"
    pool: str = "concat"

    def __post_init__(self) -> None:
        c = self.max_children
        if isinstance(c, bool) or not isinstance(c, int) or c < 2:
            raise ValueError(f"max_children must be an int >= 2, got {c!r}")
        if self.method not in INDUCE_METHODS:
            raise ValueError(f"method {self.method!r}: expected one of "
                             f"{', '.join(INDUCE_METHODS)}")
        if self.pool not in ("concat", "mean"):
            raise ValueError(f"pool {self.pool!r}: expected 'concat' or 'mean'")

    @property
    def name(self) -> str:
        """``"induced:C"`` (contiguous) or ``"cluster:C"``, as the command line spells it
        (with ``"/mean"`` appended for mean pooling)."""
        base = "induced" if self.method == "contiguous" else "cluster"
        return f"{base}:{self.max_children}" + ("/mean" if self.pool == "mean" else "")

    def build(self, keys: Tensor, batch: Tensor) -> NestedSignal:
        r"""The forest over the rows of ``keys``.

        Args:
            keys: ``[N, H, D]`` (or ``[N, C]``), one row per token.
            batch: ``[N]`` sorted example index of each row.

        Returns:
            A forest of one tree per example whose leaf ``i`` is row ``i``.
        """
        from ..induce import cluster_tree, contiguous_tree

        if not isinstance(keys, Tensor) or keys.dim() not in (2, 3):
            raise ValueError("keys must be a tensor [N, H, D] or [N, C]")
        with torch.no_grad():
            x = keys.detach()
            if x.dim() == 3:
                x = x.flatten(1) if self.pool == "concat" else x.mean(1)
            if self.method == "contiguous":
                return contiguous_tree(x, batch, max_children=self.max_children)
            return cluster_tree(x, batch, max_children=self.max_children)
