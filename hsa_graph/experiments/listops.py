r"""ListOps from scratch: what a first-class hierarchy buys when the hierarchy is exact.

**Data.** Long Range Arena's ListOps (:mod:`hsa_graph.datasets.listops`), regenerated
from LRA's specification with a fixed seed (LRA's files cannot be downloaded here):
train / validation / test splits of distinct expressions (LRA: 96,000 / 2,000 / 2,000,
lengths 500 to 2,000 tokens, depth at most 10, at most 10 arguments). Figures on
regenerated data are not leaderboard figures. ``data_dir`` reads LRA-format files
(``basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv``) instead.

**Models** (:data:`VARIANTS`), all trained from scratch, the same width, depth and
parameter layout (token embedding, :class:`~hsa_graph.nn.TreeClassifier` with
``layers`` layers, HTE or pre-norm (``layer``), mean pooling over the leaves, an MLP),
so the HSA, FSA and DeepSet variants have equal parameter counts:

* ``hsa-tree``: HSA on the parse tree (:func:`~hsa_graph.datasets.listops.listops_tree`:
  one internal node per operator, the operator token its first leaf, closing
  brackets dropped);
* ``hsa-tree-brackets``: the same with ``]`` kept as each family's last leaf (the
  alternative placement of the bracket tokens; leaves = the whole token sequence);
* ``hsa-tree-nodes``: the parse tree with a node token per nested operator (the
  operator's token again, as an argument of its parent, just before its node), which the
  encoder sets to the operator token's features after every layer
  (``listops_tree(node_tokens=True)``): a nested result reaches its operator as one
  vector computed in its own family, not only as its subtree's mean;
* ``hsa-tree-bottom-up``: the node-token tree with a layer schedule: an operator's token
  takes the output of the layer numbered by its height (1: over digits only) and keeps
  its features through every other layer, digits and node tokens never take one
  (``update_layer``, honoured by :class:`~hsa_graph.nn.HierarchicalTransformerEncoder`).
  With ``share_weights`` every operator is composed once, deepest first, from its
  arguments' final vectors by the same HSA block, as the recursive model composes,
  while each layer is still HSA over the whole tree; ``layers`` must reach the deepest
  nesting of the data (refused otherwise, naming both);
* ``hsa-tree-bottom-up-family``: the same, each layer confined to the families of its
  turn (the encoder's ``scope="family"``: an operator's token attends over its own
  operator's subtree alone, its nested operators as their node tokens and their
  subtrees as HSA's blocks): the recursive model's reach with HSA's blocks;
* ``hsa-tree-bottom-up-siblings``: confined further to the family's leaves (the
  encoder's ``scope="siblings"``: the operator token, its digits and its nested
  operators' node tokens, no blocks), which is the recursive model's family:
  softmax attention over an operator and its arguments' vectors;
* ``hsa-tree-bottom-up-families``: the siblings' scope with every token of a family
  scheduled at its operator's height (the operator token, its digits and its nested
  operators' node tokens: ``"parse_bottom_up_families"``), so with ``turn_layers=B``
  each family is computed by ``B`` HSA layers over all its members at its turn, deepest
  first, and its operator token handed up as the node token: the recursive model's
  depth per composition step, as HSA;
* ``hsa-windows``: HSA on fixed hopping windows over the token sequence
  (:func:`~hsa_graph.hopping_window_tree`, branching ``(2, 4, 8, 16)``, no parse);
* ``fsa``: flat softmax attention over the tokens (positions: each token's index);
* ``deepset``: no attention (the bag of tokens);
* ``h-transformer-1d``: the peer model of the ``bench`` extra (``pip install
  h-transformer-1d``) at the same width, depth and heads, mean-pooled into the same MLP
  (its parameter count differs and is reported);
* ``tree-recursive``: not HSA but the recursive model HSA is measured against
  (:class:`RecursiveListOpsClassifier`, :class:`~hsa_graph.nn.RecursiveTreeEncoder`):
  each operator's vector computed from its operator token and its arguments' vectors,
  deepest operators first, ``layers`` pre-norm blocks shared by every node (its
  parameter count differs and is reported).

``nesting_embedding`` adds to every token's embedding a learned one of its nesting depth
(the number of operators open around it), for any variant but the peer: how much of
the parse a flat model can be handed as a feature (measured, see the README: FSA 0.40 ->
0.54 at depth <= 4, HSA on the parse tree unchanged).

Why depth matters: an HSA layer lets every leaf of a family read its siblings (and the
siblings of its ancestors, through the means of their subtrees), so one layer can
compose one level of the tree; an expression of depth 10 needs about 10 layers
(``share_weights`` applies one layer ``layers`` times instead, as a recurrent tree
model would).

Why the layer matters for ``SM`` (the sum modulo 10; measured, see the README): the
paper's HTE layer carries a token's own features past the attention only as its
normalised query, and four of them stacked stay at chance on ``SM`` for 60 epochs, with
HSA, FSA or no attention alike, even on single-family expressions; one HTE layer, or four
standard pre-norm residual blocks (``layer="pre_norm"``, ``x + attention(LN(x))``), learn
it (pre-norm HSA: 0.97 there). Over nested arguments ``SM`` stays at chance once they
are drawn from all four operators; over ``MAX`` / ``MIN`` arguments of any size it is
learned (``examples/listops_probes.py``), so the leaf-count weight HSA gives a nested
argument is not what blocks it.
``operators`` draws a subset (e.g. without ``SM``) to measure each operator's share, and
every run reports test accuracy by root operator, by nesting depth and by how many
nested results the answer depends on
(:func:`accuracy_breakdown`).

**Levers beyond LRA's protocol.** ``node_loss`` also trains the read-out on every
nested operator's span against its value (:class:`NestedValueLoss`, the values taken
from the expression) and reports that read-out's test accuracy by operator and height
(:func:`nested_accuracy`); ``init_from`` starts every run from an earlier run's
checkpoints, so shallow data first and deeper data next is a curriculum.

**Protocol.** The test split is fixed (drawn with ``data_seed``); for each of ``seeds``
seeds every model is initialised from the seed, trained with
:func:`~hsa_graph.experiments.fit` (the epoch with the best validation accuracy is
kept) and scored once on the test split. Reported: test accuracy (mean and 95 %
Student-t interval over the seeds, and by root operator), seconds per training epoch,
peak memory of training (CUDA: peak allocated; CPU: peak resident memory above the level
before the run, sampled every 10 ms), parameters, validation accuracy per epoch (plot).

Command line (``hsa-graph listops``): ``--quick`` runs a short version (shallower,
shorter expressions, fewer examples, 3 seeds) in minutes on 2 CPU cores; without it,
LRA's settings. ``hsa-graph listops evaluate --checkpoint PATH --data FILE.tsv``
scores a saved model on any LRA-format file (``--nested``: also its nested operators'
read-out); ``hsa-graph listops generate --out DIR``
writes the regenerated splits.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Dropout, Embedding, Linear, Module, ModuleList, Sequential
from torch_geometric.nn.resolver import activation_resolver
from torch_geometric.utils import scatter

from ..datasets.listops import (
    CLOSE,
    LRA_SETTINGS,
    OPERATORS,
    VOCAB,
    generate_listops_splits,
    listops_dependence,
    listops_tree,
    parse_listops,
    read_listops_tsv,
    write_listops_tsv,
)
from ..nn.classifier import TreeClassifier
from ..nn.encoder import LAYERS
from ..nn.recursive import RecursiveTreeEncoder
from ..signal import _is_int
from .train import (
    LR_SCHEDULES,
    ClassifierOutput,
    TrainConfig,
    _cpu_state,
    _forward,
    evaluate,
    fit,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "DEPENDENCE_BINS",
    "ListOpsClassifier",
    "ListOpsConfig",
    "QUICK",
    "RecursiveListOpsClassifier",
    "VARIANTS",
    "HTransformerClassifier",
    "MAX_NESTING",
    "NestedValueLoss",
    "accuracy_breakdown",
    "add_arguments",
    "build_examples",
    "build_model",
    "estimate_epoch_seconds",
    "evaluate_checkpoint",
    "load_model",
    "nested_accuracy",
    "run",
    "run_listops",
]

#: variant -> (structure of the example, attention).
VARIANTS: Dict[str, Tuple[str, str]] = {
    "hsa-tree": ("parse", "hierarchical"),
    "hsa-tree-brackets": ("parse_brackets", "hierarchical"),
    "hsa-tree-nodes": ("parse_nodes", "hierarchical"),
    "hsa-tree-bottom-up": ("parse_bottom_up", "hierarchical"),
    "hsa-tree-bottom-up-family": ("parse_bottom_up", "hierarchical"),
    "hsa-tree-bottom-up-siblings": ("parse_bottom_up", "hierarchical"),
    "hsa-tree-bottom-up-families": ("parse_bottom_up_families", "hierarchical"),
    "hsa-windows": ("windows", "hierarchical"),
    "fsa": ("windows", "flat"),
    "deepset": ("windows", "none"),
    "h-transformer-1d": ("windows", "h-transformer-1d"),
    "tree-recursive": ("parse", "recursive"),
}
#: variants whose encoder confines each scheduled layer (the encoder's ``scope``)
_SCOPES = {"hsa-tree-bottom-up-family": "family", "hsa-tree-bottom-up-siblings": "siblings",
           "hsa-tree-bottom-up-families": "siblings"}
#: the tree layouts of :func:`build_examples`
STRUCTURES = ("parse", "parse_brackets", "parse_nodes", "parse_bottom_up",
              "parse_bottom_up_families", "windows")
#: the layouts with a layer schedule (``update_layer``), one turn per level of operators
_SCHEDULED = ("parse_bottom_up", "parse_bottom_up_families")
NUM_CLASSES = 10
#: the deepest nesting :class:`ListOpsClassifier`'s ``nesting_embedding`` tells apart
MAX_NESTING = 16
WINDOWS = (2, 4, 8, 16)
#: bins of :func:`accuracy_breakdown`'s ``"by_dependence"``: name -> [low, high) of the
#: summed :func:`~hsa_graph.datasets.listops.listops_dependence`
DEPENDENCE_BINS: Dict[str, Tuple[float, float]] = {
    "0-1": (0.0, 1.0), "1-2": (1.0, 2.0), "2-3": (2.0, 3.0), "3-5": (3.0, 5.0),
    "5-8": (5.0, 8.0), "8-13": (8.0, 13.0), "13+": (13.0, float("inf"))}


# ------------------------------------------------------------------ models
class ListOpsClassifier(Module):
    r"""Token embedding, then :class:`~hsa_graph.nn.TreeClassifier` (input map,
    ``layers`` HTE or pre-norm layers, mean pooling over the leaves, MLP) on trees whose
    leaves carry token ids.

    Args:
        attention: ``"hierarchical"``, ``"flat"`` or ``"none"``.
        channels, heads, hidden_channels, pos_dim, dropout: of the classifier.
        layers: attention layers.
        layer: the layer, ``"hte"`` (the paper's HTE layer: the attention's residual is
            the normalised query) or ``"pre_norm"`` (the standard pre-norm residual
            block); see :class:`~hsa_graph.nn.TreeClassifier`.
        share_weights: one layer applied ``layers`` times (parameters of one layer).
        pool: the read-out, ``"mean"`` over the leaves or ``"first"``, the first leaf
            (the root operator of a parse tree, the first token of a sequence).
        include_self: whether each token also attends to itself (the paper: no); with
            it the weight a token keeps for itself reveals how many siblings it has.
        nesting_embedding: add a learned embedding of each token's nesting depth (the
            number of operators open around it, ``nesting``, capped at
            :data:`MAX_NESTING`) to its token embedding, so a token's value, not only
            its attention logits, can say at which depth it sits.
        scope: what a scheduled layer attends over (see
            :class:`~hsa_graph.nn.HierarchicalTransformerEncoder`): ``"tree"``,
            ``"family"`` or ``"siblings"``.
        turn_layers: layers per turn of a layer schedule (the encoder's): ``layers``
            turns of ``turn_layers`` layers each; with ``share_weights`` the same
            ``turn_layers`` layers serve every turn.

    Shapes:
        - **input:** a batch of trees with ``x`` ``[N]`` token ids (and ``nesting``
          ``[N]`` with ``nesting_embedding``, as :func:`build_examples` attaches).
        - **output:** logits ``[num_trees, 10]``.
    """

    def __init__(self, attention: str = "hierarchical", *, channels: int = 64, heads: int = 4,
                 layers: int = 10, layer: str = "hte", share_weights: bool = False,
                 hidden_channels: int = 128, pos_dim: Optional[int] = 8,
                 dropout: float = 0.0, pool: str = "mean", include_self: bool = False,
                 nesting_embedding: bool = False, scope: str = "tree",
                 turn_layers: int = 1):
        super().__init__()
        self.embedding = Embedding(len(VOCAB), channels)
        self.nesting = Embedding(MAX_NESTING + 1, channels) if nesting_embedding else None
        self.classifier = TreeClassifier(
            channels, NUM_CLASSES, channels, heads, hidden_channels=hidden_channels,
            attention=attention, num_layers=turn_layers * (1 if share_weights else layers),
            layer=layer, pos_dim=pos_dim, dropout=dropout, pool=pool,
            include_self=bool(include_self), scope=scope, turn_layers=turn_layers)
        if share_weights:  # the same turn `layers` times: the parameters of one
            self.classifier.encoder.layers = ModuleList(
                list(self.classifier.encoder.layers) * layers)

    def forward(self, batch) -> Tensor:
        """Logits ``[num_trees, 10]``."""
        return self.classifier.read_out(self.encode(batch), batch)

    def encode(self, batch) -> Tensor:
        """The encoder's outputs at the tokens (the leaves), ``[N, channels]``."""
        x = batch.x
        if not isinstance(x, Tensor) or x.dtype != torch.long or x.dim() != 1:
            raise TypeError("ListOpsClassifier needs trees whose x holds token ids [N] (long)")
        h = self.embedding(x)
        if self.nesting is not None:
            nesting = getattr(batch, "nesting", None)
            if not isinstance(nesting, Tensor) or nesting.shape != x.shape:
                raise ValueError("nesting_embedding needs trees with nesting [N] (the "
                                 "tokens' nesting depths; build_examples attaches them)")
            if nesting.dtype != torch.long:
                raise ValueError(f"nesting must hold depths >= 0 (long), got {nesting.dtype}")
            if bool((nesting < 0).any()):
                raise ValueError("nesting must hold depths >= 0 (long), got minimum "
                                 f"{nesting.min().item()}")
            h = h + self.nesting(nesting.clamp_max(MAX_NESTING))
        return self.classifier.encode(h, batch)

    def read_out_nested(self, token_outputs: Tensor, batch) -> Tensor:
        """Logits ``[K, 10]`` of the nested operators of a batch built with
        ``nested_targets`` (:func:`build_examples`): the read-out of each one's span
        of tokens (their mean, or with ``pool="first"`` the operator token), then the
        MLP. ``token_outputs``: :meth:`encode`'s."""
        structure = batch.structure_for(token_outputs.device)
        first = structure.leaf_rows_of(batch.nested_index, "nested_index")
        if self.classifier.pool == "first":  # the span's first token: the operator
            pooled = token_outputs[first]
        else:  # the mean over each span: consecutive leaf rows (leaves come first, in
            # node order), a difference of prefix sums, in float64 so that a short
            # span keeps its digits next to sums over the whole batch
            last = structure.leaf_rows_of(batch.nested_last_index, "nested_last_index")
            prefix = F.pad(token_outputs.double().cumsum(0), (0, 0, 1, 0))
            pooled = ((prefix[last + 1] - prefix[first])
                      / (last - first + 1).unsqueeze(-1)).to(token_outputs.dtype)
        return self.classifier.mlp(pooled)


def _check_loss_weight(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            value >= 0 and np.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class NestedValueLoss(Module):
    r"""Training wrapper of a :class:`ListOpsClassifier` that also asks for the value
    of every nested operator: the model's read-out (pooling, then MLP) applied to the
    tokens of each nested operator's span (``[OP`` through its arguments; with
    ``]`` leaves, through its ``]``) against that operator's value, next to the root's
    loss. For a graph with nested operators :math:`K_T`,

    .. math::
        \ell_T = \mathrm{CE}(f(T), y_T) + w \frac{1}{|K_T|} \sum_{k \in K_T}
        \mathrm{CE}\big(\mathrm{MLP}(\mathrm{pool}_{i \in \mathrm{span}(k)} h_i), y_k\big),

    the second term returned as the ``extra_loss`` of a
    :class:`~hsa_graph.experiments.ClassifierOutput`, so :func:`~hsa_graph.experiments.fit`
    adds it in training steps and leaves it out of validation. On the parse tree a
    span is the operator's subtree, so its mean is what the parent's attention reads of
    it; on windows and flat attention the same tokens are pooled. The values come from
    the expression (:func:`build_examples` with ``nested_targets=True``): this is not
    LRA's protocol, which trains on the root label alone.

    Args:
        model: the classifier (its parameters are this module's).
        weight: :math:`w \ge 0`.

    Shapes:
        - **input:** a batch of :func:`build_examples` trees; those with
          ``nested_index`` get the extra term, others (validation, test) give logits.
        - **output:** :class:`~hsa_graph.experiments.ClassifierOutput` (logits
          ``[num_trees, 10]``, ``extra_loss`` ``[num_trees]``), or logits.
    """

    def __init__(self, model: ListOpsClassifier, weight: float = 1.0):
        super().__init__()
        if not isinstance(model, ListOpsClassifier):
            raise TypeError(f"NestedValueLoss wraps a ListOpsClassifier, got "
                            f"{type(model).__name__}")
        _check_loss_weight("weight", weight)
        self.model = model
        self.weight = float(weight)

    def forward(self, batch):
        """A :class:`~hsa_graph.experiments.ClassifierOutput` for batches that carry
        nested targets, else logits ``[num_trees, 10]``."""
        h = self.model.encode(batch)
        logits = self.model.classifier.read_out(h, batch)
        if getattr(batch, "nested_index", None) is None:
            return logits
        loss = F.cross_entropy(self.model.read_out_nested(h, batch), batch.nested_y,
                               reduction="none")
        # the mean over each graph's nested operators (0 for a graph without any)
        per_graph = scatter(loss, batch.batch[batch.nested_index], 0,
                            dim_size=int(batch.num_graphs), reduce="mean")
        return ClassifierOutput(logits, self.weight * per_graph)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(weight={self.weight})"


class HTransformerClassifier(Module):
    r"""The peer H-Transformer-1D (``h_transformer_1d.HTransformer1D``, the ``bench``
    extra) over the token sequence (the leaves of each tree, in order, right-padded),
    mean-pooled over the real tokens into the same MLP as :class:`ListOpsClassifier`.

    Args:
        channels, heads, layers, hidden_channels: as :class:`ListOpsClassifier`.
        max_length: longest sequence (padded up to a power of two).
        block_size: the block size of its hierarchical attention.
    """

    def __init__(self, *, channels: int = 64, heads: int = 4, layers: int = 10,
                 hidden_channels: int = 128, max_length: int = 2048, block_size: int = 16,
                 dropout: float = 0.0, **_: Any):
        super().__init__()
        try:
            from h_transformer_1d import HTransformer1D
        except ImportError as error:
            raise ImportError("the h-transformer-1d variant needs the bench extra: pip install "
                              "h-transformer-1d") from error
        # its hierarchy needs at least four blocks: pad short batches up to that
        self.min_length = 4 * block_size
        length = max(1 << max(int(max_length) - 1, 1).bit_length(), self.min_length)
        self.max_length = length
        self.net = HTransformer1D(num_tokens=len(VOCAB) + 1, dim=channels, depth=layers,
                                  max_seq_len=length, heads=heads, dim_head=channels // heads,
                                  block_size=block_size)
        self.net.to_logits = self.net.to_logits[0]  # keep its final LayerNorm only
        self.mlp = Sequential(Linear(channels, hidden_channels), activation_resolver("gelu"),
                              Dropout(dropout), Linear(hidden_channels, NUM_CLASSES))

    def forward(self, batch) -> Tensor:
        """Logits ``[num_trees, 10]``."""
        from torch_geometric.utils import to_dense_batch

        leaf_tree = batch.structure.leaf_tree
        ids, mask = to_dense_batch(batch.x, leaf_tree, fill_value=len(VOCAB),
                                   batch_size=int(batch.num_graphs))
        if ids.shape[1] > self.max_length:
            raise ValueError(f"a sequence of {ids.shape[1]} tokens exceeds this model's "
                             f"max_length {self.max_length}")
        if ids.shape[1] < self.min_length:
            pad = self.min_length - ids.shape[1]
            ids = torch.nn.functional.pad(ids, (0, pad), value=len(VOCAB))
            mask = torch.nn.functional.pad(mask, (0, pad), value=False)
        h = self.net(ids, mask=mask)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        return self.mlp(pooled)


class RecursiveListOpsClassifier(Module):
    r"""Token embedding, then :class:`~hsa_graph.nn.RecursiveTreeEncoder` up the parse
    tree (each operator's vector from its operator token and its arguments' vectors,
    deepest operators first, the same blocks at every node), the root's vector, an MLP.

    Not HSA: the recursive model HSA is measured against where the answer composes
    along the tree. Of :class:`ListOpsClassifier`'s settings it takes ``channels``,
    ``heads``, ``layers`` (blocks per family), ``hidden_channels`` (the blocks'
    feed-forward width and the MLP's) and ``dropout``; its blocks are pre-norm and a
    family has no positions, so ``layer`` and ``pos_dim`` do not apply.

    Shapes:
        - **input:** a batch of parse trees (:func:`build_examples` ``"parse"``) with
          ``x`` ``[N]`` token ids.
        - **output:** logits ``[num_trees, 10]``.
    """

    def __init__(self, *, channels: int = 64, heads: int = 4, layers: int = 2,
                 hidden_channels: int = 128, dropout: float = 0.0):
        super().__init__()
        self.embedding = Embedding(len(VOCAB), channels)
        self.encoder = RecursiveTreeEncoder(channels, heads, layers, hidden_channels, dropout)
        self.mlp = Sequential(Linear(channels, hidden_channels), activation_resolver("gelu"),
                              Dropout(dropout), Linear(hidden_channels, NUM_CLASSES))

    def forward(self, batch) -> Tensor:
        """Logits ``[num_trees, 10]``."""
        x = batch.x
        if not isinstance(x, Tensor) or x.dtype != torch.long or x.dim() != 1:
            raise TypeError("RecursiveListOpsClassifier needs trees whose x holds token ids "
                            "[N] (long)")
        return self.mlp(self.encoder.roots(self.embedding(x), batch))


#: settings of :class:`ListOpsClassifier` (name: the value that turns one on) that the
#: recursive model has no counterpart of: refused for it rather than ignored
_NOT_RECURSIVE = {"share_weights": True, "include_self": True, "nesting_embedding": True,
                  "pool": "first"}


def build_model(variant: str, **spec: Any) -> Module:
    """The model of ``variant`` (:data:`VARIANTS`) with the settings ``spec``
    (``channels``, ``heads``, ``layers``, ``layer``, ``share_weights``, ``hidden_channels``,
    ``pos_dim``, ``dropout``, ``pool``, ``include_self``, ``nesting_embedding``,
    ``max_length``, and ``turn_layers`` for the variants with a layer schedule; the peer
    H-Transformer-1D takes ``channels``, ``heads``, ``layers``, ``hidden_channels``,
    ``max_length`` and mean-pools; the recursive model takes
    ``channels``, ``heads``, ``layers``, ``hidden_channels``, ``dropout`` and refuses
    ``share_weights``, ``include_self``, ``nesting_embedding`` and ``pool="first"``)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {tuple(VARIANTS)}")
    attention = VARIANTS[variant][1]
    if spec.get("turn_layers", 1) != 1 and VARIANTS[variant][0] not in _SCHEDULED:
        raise ValueError(f"turn_layers={spec['turn_layers']} stacks layers per turn of a "
                         f"layer schedule; the {variant} variant has none")
    spec = {k: v for k, v in spec.items() if k != "turn_layers" or v != 1}
    if attention == "h-transformer-1d":
        return HTransformerClassifier(**spec)
    if attention == "recursive":
        refused = [k for k, v in _NOT_RECURSIVE.items() if spec.get(k) == v]
        if refused:
            raise ValueError(f"the {variant} variant has no counterpart of " + ", ".join(
                f"{k}={spec[k]!r}" for k in refused))
        return RecursiveListOpsClassifier(**{k: spec[k] for k in (
            "channels", "heads", "layers", "hidden_channels", "dropout") if k in spec})
    spec = {k: v for k, v in spec.items() if k != "max_length"}
    return ListOpsClassifier(attention, scope=_SCOPES.get(variant, "tree"), **spec)


# ------------------------------------------------------------------ data
def _operator_heights(parsed, is_open: np.ndarray) -> np.ndarray:
    """``[T]`` the height of each operator token's subtree (1: over digits only; 0
    for other tokens), a few array operations per nesting level."""
    height = is_open.astype(np.int64)
    for level in range(int(parsed.level.max()), 0, -1):
        ops = np.flatnonzero(is_open & (parsed.level == level))
        np.maximum.at(height, parsed.parent[ops], height[ops] + 1)
    return height


def _attach_nested_targets(tree, parsed, keep_close: bool, node_tokens: bool = False) -> None:
    """The targets :class:`NestedValueLoss` reads, on ``tree`` whose leaves are the
    tokens of ``parsed`` in order (without ``]`` unless ``keep_close``): for every
    nested operator (one inside another), ``nested_index`` (the node of its operator
    token, the first of its span), ``nested_last_index`` (the node of its span's last
    token), ``nested_y`` (its value) and ``nested_height`` (1: over digits only, 2: over
    operators over digits, ...). A span is the leaves between the two, in leaf order:
    two indices per operator, so the targets grow with the operators, not with tokens
    times depth. Node indices, so batching offsets them."""
    tokens = parsed.tokens
    is_close = tokens == CLOSE
    is_open = (tokens >= 10) & (tokens < CLOSE)
    is_nested = is_open & (parsed.parent >= 0)
    nested = np.flatnonzero(is_nested)
    end = np.zeros(tokens.size, dtype=np.int64)
    end[parsed.parent[is_close]] = np.flatnonzero(is_close)  # the ']' of each operator
    closes = np.cumsum(is_close)
    if keep_close:
        first, last = nested, end[nested]
    else:  # a token's leaf: its position less the ']' before it
        first, last = nested - closes[nested], end[nested] - closes[end[nested]]
    expected = tokens.size if keep_close else tokens.size - int(closes[-1])
    if node_tokens:  # and plus the node tokens up to it (its own just before it)
        tokens_before = np.cumsum(is_nested)
        first, last = first + tokens_before[nested], last + tokens_before[end[nested]]
        expected += nested.size
    leaves = tree.leaf_index
    if leaves.numel() != expected:
        raise ValueError(f"the tree has {leaves.numel()} leaves for {expected} tokens")
    tree.nested_index = leaves[torch.from_numpy(first)]
    tree.nested_last_index = leaves[torch.from_numpy(last)]
    tree.nested_y = torch.from_numpy(parsed.values[nested].astype(np.int64))
    tree.nested_height = torch.from_numpy(_operator_heights(parsed, is_open)[nested])


def build_examples(rows: Sequence[Tuple[str, int]], structure: str, *,
                   where: str = "data", nested_targets: bool = False) -> List[Any]:
    """One tree per ``(expression, label)`` row: the parse tree (``"parse"``, or
    ``"parse_brackets"`` with ``]`` leaves, ``"parse_nodes"`` with node tokens,
    ``"parse_bottom_up"`` with node tokens and each operator token's height as its
    ``update_layer``, ``"parse_bottom_up_families"`` with node tokens and every token's
    family's height as its ``update_layer``: the height of the operator whose
    arguments it is, an operator token its own operator's) or hopping windows over all
    tokens (``"windows"``), each with ``x`` token ids, ``nesting`` each token's nesting
    depth (the number of operators open around it: 0 for the root operator and its
    ``]``) and ``y`` the label; with
    ``nested_targets`` also the values of the nested operators and their spans
    (for :class:`NestedValueLoss`).

    Raises:
        ValueError: naming the row (0-based, blank lines of a file not counted), for a
            row that is not a pair, a label that is not an int, a malformed expression
            or a label that is not the expression's value.
    """
    from ..builders.windows import hopping_window_tree

    if structure not in STRUCTURES:
        raise ValueError(f"unknown structure {structure!r}; choose from {STRUCTURES}")
    node_tokens = structure in ("parse_nodes",) + _SCHEDULED
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, (tuple, list)) or len(row) != 2:
            raise ValueError(f"{where}, example {i}: expected an (expression, label) pair, "
                             f"got {type(row).__name__}")
        expr, label = row
        if not _is_int(label):
            raise ValueError(f"{where}, example {i}: the label must be an int 0-9, got "
                             f"{label!r:.40}")
        try:
            parsed = parse_listops(expr)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where}, example {i}: {error}") from None
        if parsed.value != int(label):
            raise ValueError(f"{where}, example {i}: the label is {label} but the "
                             f"expression's value is {parsed.value}")
        if structure == "windows":
            tree = hopping_window_tree(torch.from_numpy(parsed.tokens.copy()), WINDOWS)
            tree.y = torch.tensor([parsed.value], dtype=torch.long)
        else:
            tree = listops_tree(parsed, brackets=structure == "parse_brackets",
                                node_tokens=node_tokens)
            del tree.depth
        keep_close = structure in ("parse_brackets", "windows")
        kept = parsed.level if keep_close else parsed.level[parsed.tokens != CLOSE]
        if structure in _SCHEDULED:
            is_open = (parsed.tokens >= 10) & (parsed.tokens < CLOSE)
            height = _operator_heights(parsed, is_open)
            # the height of the operator whose argument a token is (0: none), and of a
            # token's family: its own operator's for an operator token, else that one
            of_parent = np.where(parsed.parent >= 0, height[parsed.parent.clip(0)], 0)
            family = np.where(is_open, height, of_parent)
            height, family, of_parent = (a[parsed.tokens != CLOSE]
                                         for a in (height, family, of_parent))
        if node_tokens:  # a node token sits where its operator is, just before it
            kept_tokens = parsed.tokens[parsed.tokens != CLOSE]
            kept_parent = parsed.parent[parsed.tokens != CLOSE]
            nested = np.flatnonzero((kept_tokens >= 10) & (kept_parent >= 0))
            kept = np.insert(kept, nested, kept[nested])
            if structure == "parse_bottom_up":  # a node token is copied, not computed
                tree.update_layer = torch.from_numpy(np.insert(height, nested, 0))
            elif structure == "parse_bottom_up_families":  # in its parent's family
                tree.update_layer = torch.from_numpy(np.insert(family, nested,
                                                               of_parent[nested]))
        tree.nesting = torch.from_numpy(kept.astype(np.int64))
        if nested_targets:
            _attach_nested_targets(tree, parsed, keep_close=keep_close,
                                   node_tokens=node_tokens)
        out.append(tree)
    return out


# ------------------------------------------------------------------ config
@dataclass
class ListOpsConfig:
    """Settings of :func:`run_listops` (defaults: LRA's data settings; the model and
    training defaults are this module's choices).

    Args:
        variants: models to compare (:data:`VARIANTS`).
        seeds: model initialisations (>= 1; >= 3 for intervals worth the name).
        first_seed: the first of them: seeds ``first_seed .. first_seed + seeds - 1``
            (so the seeds of one comparison can run as separate processes).
        num_train, num_val, num_test, max_depth, max_args, min_length, max_length: the
            data (:func:`~hsa_graph.datasets.listops.generate_listops_splits`).
        operators: the operators drawn, a subset of ``MAX MIN MED SM`` (all four).
        data_seed: seed of the data (the test split is fixed by it).
        data_dir: read ``basic_{train,val,test}.tsv`` (LRA's format) from here instead
            (the settings above are then unused: the results record the counts read and
            ``None`` for the generator's settings).
        epochs, batch_size, lr, weight_decay, grad_clip: training (AdamW).
        lr_schedule, min_lr, warmup_steps: the learning rate's schedule over the steps
            (:class:`~hsa_graph.experiments.TrainConfig`; ``"constant"`` by default,
            ``"cosine"`` decays from ``lr`` to ``min_lr``).
        channels, heads, layers, layer, share_weights, hidden_channels, pos_dim, dropout:
            the models (:class:`ListOpsClassifier`).
        turn_layers: layers per turn of the variants with a layer schedule (the
            ``hsa-tree-bottom-up`` family): each level of operators is computed by
            ``turn_layers`` layers, one after the other (refused for the others).
        pool, include_self, nesting_embedding: the read-out, the self term and the
            nesting-depth embedding of the models (ditto; the peer H-Transformer-1D
            has none, so ``nesting_embedding`` refuses it).
        node_loss: weight of the loss on every nested operator's value
            (:class:`NestedValueLoss`; ``0``: the root label alone, LRA's protocol).
        init_from: the output directory of an earlier run: each variant and seed
            starts from its checkpoint there (same model settings), e.g. to train on
            shallow expressions first and then on deeper ones (a curriculum).
        device: ``"cpu"`` or ``"cuda"``.
        output_dir: JSON, Markdown, plots and checkpoints go here (``None``: nowhere);
            each run also writes its state after every epoch to
            ``runs/<variant>_seed<s>/last.pt`` there (see ``resume``).
        resume: continue each run from its state in ``output_dir`` (the epochs after
            the last one it finished, as if it had not stopped: weights, optimizer and
            random states); a run with no state there starts afresh. Refused where the
            state was written under other settings (``epochs`` aside, which may grow).
        progress: progress bars; without them, one line per epoch (training loss,
            validation accuracy, seconds).
        command: the command line (for the report).
    """

    variants: Tuple[str, ...] = ("hsa-tree", "hsa-tree-brackets", "hsa-windows", "fsa",
                                 "deepset", "h-transformer-1d")
    seeds: int = 3
    first_seed: int = 0
    num_train: int = LRA_SETTINGS["num_train"]
    num_val: int = LRA_SETTINGS["num_val"]
    num_test: int = LRA_SETTINGS["num_test"]
    max_depth: int = LRA_SETTINGS["max_depth"]
    max_args: int = LRA_SETTINGS["max_args"]
    min_length: int = LRA_SETTINGS["min_length"]
    max_length: int = LRA_SETTINGS["max_length"]
    operators: Tuple[str, ...] = OPERATORS
    data_seed: int = 0
    data_dir: Optional[str] = None
    epochs: int = 20
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    grad_clip: Optional[float] = 1.0
    lr_schedule: str = "constant"
    min_lr: float = 0.0
    warmup_steps: int = 0
    channels: int = 64
    heads: int = 4
    layers: int = 10
    layer: str = "hte"
    share_weights: bool = False
    turn_layers: int = 1
    hidden_channels: int = 128
    pos_dim: Optional[int] = 8
    dropout: float = 0.0
    pool: str = "mean"
    include_self: bool = False
    nesting_embedding: bool = False
    node_loss: float = 0.0
    init_from: Optional[str] = None
    device: str = "cpu"
    output_dir: Optional[str] = None
    resume: bool = False
    progress: bool = True
    command: Optional[str] = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if not self.variants:
            raise ValueError("give at least one variant")
        for name in self.variants:
            if name not in VARIANTS:
                raise ValueError(f"unknown variant {name!r}; choose from {tuple(VARIANTS)}")
        if isinstance(self.first_seed, bool) or not isinstance(self.first_seed, int) or (
                self.first_seed < 0):
            raise ValueError(f"first_seed must be an int >= 0, got {self.first_seed!r}")
        for name in ("seeds", "num_train", "num_val", "num_test", "epochs", "batch_size",
                     "channels", "heads", "layers", "turn_layers", "hidden_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.layer not in LAYERS:
            raise ValueError(f"layer must be one of {LAYERS}, got {self.layer!r}")
        if self.pool not in ("mean", "first"):
            raise ValueError(f"pool must be 'mean' or 'first', got {self.pool!r}")
        _check_loss_weight("node_loss", self.node_loss)
        for other in ("h-transformer-1d", "tree-recursive"):
            if self.node_loss and other in self.variants:
                raise ValueError("node_loss reads the tokens' outputs of a "
                                 f"ListOpsClassifier; the {other} variant has none")
        for name, value in _NOT_RECURSIVE.items():
            if getattr(self, name) == value and "tree-recursive" in self.variants:
                raise ValueError(f"the tree-recursive variant has no counterpart of "
                                 f"{name}={value!r}")
        unscheduled = [v for v in self.variants if VARIANTS[v][0] not in _SCHEDULED]
        if self.turn_layers != 1 and unscheduled:
            raise ValueError(f"turn_layers={self.turn_layers} stacks layers per turn of a "
                             f"layer schedule; the {unscheduled[0]} variant has none")
        if self.resume and self.output_dir is None:
            raise ValueError("resume continues the runs saved under output_dir: give one")
        if self.nesting_embedding and "h-transformer-1d" in self.variants:
            raise ValueError("nesting_embedding adds to a ListOpsClassifier's token "
                             "embedding; the h-transformer-1d variant has none")
        if self.channels % self.heads:
            raise ValueError(f"channels ({self.channels}) must be a multiple of heads "
                             f"({self.heads})")
        self.train_config(seed=0).validate()

    def train_config(self, seed: int) -> TrainConfig:
        """The :class:`~hsa_graph.experiments.TrainConfig` of the run of seed ``seed``."""
        return TrainConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                           weight_decay=self.weight_decay, lr_schedule=self.lr_schedule,
                           min_lr=self.min_lr, warmup_steps=self.warmup_steps, seed=seed,
                           grad_clip=self.grad_clip, device=self.device,
                           progress=self.progress, log_epochs=not self.progress)

    def model_spec(self) -> Dict[str, Any]:
        """The settings :func:`build_model` takes."""
        return dict(channels=self.channels, heads=self.heads, layers=self.layers,
                    layer=self.layer, share_weights=self.share_weights,
                    turn_layers=self.turn_layers,
                    hidden_channels=self.hidden_channels, pos_dim=self.pos_dim,
                    dropout=self.dropout, pool=self.pool,
                    include_self=self.include_self,
                    nesting_embedding=self.nesting_embedding, max_length=self.max_length)


#: ``--quick``: shallower and shorter expressions, fewer examples (minutes on 2 CPUs).
QUICK = dict(num_train=2000, num_val=200, num_test=500, max_depth=4, max_args=5,
             min_length=10, max_length=60, epochs=6, layers=4, channels=32, heads=4,
             hidden_channels=64, batch_size=32, lr=2e-3)


#: What makes the data when no ``data_dir`` is given (recorded as ``None`` when one is).
_GENERATOR_SETTINGS = ("max_depth", "max_args", "min_length", "max_length", "operators",
                       "data_seed")


def _split_file(config: ListOpsConfig, split: str) -> Path:
    return Path(config.data_dir) / f"basic_{split}.tsv"


def _load_splits(config: ListOpsConfig) -> Dict[str, List[Tuple[str, int]]]:
    if config.data_dir is not None:
        return {split: read_listops_tsv(_split_file(config, split))
                for split in ("train", "val", "test")}
    return generate_listops_splits(
        config.num_train, config.num_val, config.num_test, seed=config.data_seed,
        max_depth=config.max_depth, max_args=config.max_args, min_length=config.min_length,
        max_length=config.max_length, operators=tuple(config.operators))


def _file_examples(path: Union[str, os.PathLike], rows: Sequence[Tuple[str, int]],
                   structure: str, nested_targets: bool = False) -> List[Any]:
    """:func:`build_examples` of the rows read from ``path``; an error names the line of
    the file (read again with ``check=True``, only when building failed), where
    :func:`build_examples` alone can only count rows."""
    try:
        return build_examples(rows, structure, where=str(path), nested_targets=nested_targets)
    except ValueError:
        read_listops_tsv(path, check=True)
        raise


def _check_bottom_up_depth(trees: Sequence[Any], turns: int, where: Any) -> None:
    """Refuse scheduled trees (``parse_bottom_up``, ``parse_bottom_up_families``) whose
    operators (``update_layer``) nest deeper than the model's ``layers`` (its turns):
    one turn composes one level."""
    height = max((int(t.update_layer.max()) for t in trees), default=0)
    if height > turns:
        raise ValueError(f"hsa-tree-bottom-up composes one level of operators per turn: "
                         f"{where} nests operators {height} deep, so the model needs "
                         f"layers >= {height}, got {turns}")


def _split_examples(config: ListOpsConfig, split: str, rows: Sequence[Tuple[str, int]],
                    structure: str, nested_targets: bool) -> List[Any]:
    if config.data_dir is None:
        return build_examples(rows, structure, where=split, nested_targets=nested_targets)
    return _file_examples(_split_file(config, split), rows, structure, nested_targets)


# ------------------------------------------------------------------ measurement
class _PeakMemory:
    """Peak memory of a block: CUDA's peak allocation, or on CPU the peak resident set
    size above the level at entry, sampled every 10 ms from ``/proc/self/statm``."""

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.peak = 0

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as handle:
                return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def __enter__(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base, self.peak, self._stop = self._rss(), self._rss(), threading.Event()

        def sample():
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, self._rss())
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())

    @property
    def mib(self) -> float:
        return max(self.peak - self.base, 0) / 2**20


def accuracy_breakdown(predictions: Sequence[int], rows: Sequence[Tuple[str, int]]
                       ) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Accuracy of ``predictions`` (one class per row, e.g. :func:`~hsa_graph.
    experiments.train.evaluate`'s ``"predictions"``) on the expressions ``rows``, split
    by the root operator (``MAX``, ``MIN``, ``MED``, ``SM``, or ``digit`` for a lone
    digit), by the nesting depth of each expression, and by its dependence on nested
    results (the sum of :func:`~hsa_graph.datasets.listops.listops_dependence`: how
    many nested values the answer hangs on, in the bins of :data:`DEPENDENCE_BINS`):
    ``{"by_operator": {name: {"accuracy", "n"}}, "by_depth": {str(depth): {...}},
    "by_dependence": {bin: {...}}}``, bins in increasing order, empty ones left out."""
    if len(predictions) != len(rows):
        raise ValueError(f"{len(predictions)} predictions for {len(rows)} rows")
    for i, guess in enumerate(predictions):
        if not _is_int(guess):
            raise TypeError(f"predictions[{i}] must be a class index (an int), got "
                            f"{guess!r:.40}")
    hit = [int(guess) == int(label) for guess, (_, label) in zip(predictions, rows)]
    groups: Dict[str, Dict[str, List[bool]]] = {"by_operator": {}, "by_depth": {},
                                                "by_dependence": {}}
    edges = [low for low, _ in DEPENDENCE_BINS.values()]
    bin_names = list(DEPENDENCE_BINS)
    for ok, (expr, _) in zip(hit, rows):
        parsed = parse_listops(expr)
        first = int(parsed.tokens[0])
        op = OPERATORS[first - 10] if 10 <= first < 10 + len(OPERATORS) else "digit"
        groups["by_operator"].setdefault(op, []).append(ok)
        groups["by_depth"].setdefault(str(parsed.depth), []).append(ok)
        # a sum of ninths: rounded back onto them, so that the bins' edges are exact
        dependence = round(float(listops_dependence(parsed).sum()) * 9) / 9
        name = bin_names[int(np.searchsorted(edges, dependence, side="right")) - 1]
        groups["by_dependence"].setdefault(name, []).append(ok)
    order = {"by_operator": sorted, "by_depth": lambda keys: sorted(keys, key=int),
             "by_dependence": lambda keys: [k for k in bin_names if k in keys]}
    return {kind: {key: {"accuracy": sum(table[key]) / len(table[key]), "n": len(table[key])}
                   for key in order[kind](table)} for kind, table in groups.items()}


def nested_accuracy(model: Module, examples: Sequence[Any], *, batch_size: int = 32,
                    device: str = "cpu") -> Dict[str, Dict[str, float]]:
    """Accuracy of the nested operators' read-out (:meth:`ListOpsClassifier.
    read_out_nested`) on ``examples`` built with ``nested_targets``, by operator and
    height (``"SM/1"``: an ``SM`` over digits only, ``"SM/2"``: over operators over
    digits, ...): ``{key: {"accuracy", "n"}}`` with ``"all"`` first. For models
    trained with :class:`NestedValueLoss`: do the nested values get computed?"""
    from torch_geometric.data import Batch

    if not isinstance(model, ListOpsClassifier):
        raise TypeError(f"nested_accuracy reads a ListOpsClassifier, got "
                        f"{type(model).__name__}")
    was_training = model.training
    model.eval()
    hits, keys = [], []
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = Batch.from_data_list(list(examples[start:start + batch_size])).to(device)
            if getattr(batch, "nested_index", None) is None:
                raise ValueError("nested_accuracy needs examples built with "
                                 "nested_targets=True")
            logits = model.read_out_nested(model.encode(batch), batch)
            hits.append((logits.argmax(-1) == batch.nested_y).cpu())
            operator = batch.x[batch.structure_for(batch.x.device).leaf_rows_of(
                batch.nested_index, "nested_index")].cpu() - 10
            keys.append(operator * 1000 + batch.nested_height.cpu())
    model.train(was_training)
    hit, key = (torch.cat(hits), torch.cat(keys)) if hits else (torch.zeros(0), torch.zeros(0))
    out = {"all": {"accuracy": float(hit.float().mean()) if hit.numel() else float("nan"),
                   "n": int(hit.numel())}}
    for k in torch.unique(key).tolist():
        chosen = hit[key == k]
        out[f"{OPERATORS[k // 1000]}/{k % 1000}"] = {"accuracy": float(chosen.float().mean()),
                                                     "n": int(chosen.numel())}
    return out


def _interval(values: Sequence[float]) -> Tuple[float, float]:
    from .sentiment import interval

    return interval(values)


# ------------------------------------------------------------------ protocol
def run_listops(config: Optional[ListOpsConfig] = None) -> Dict[str, Any]:
    """Train and test every variant over the seeds; returns ``{"config", "data",
    "runs", "summary", "markdown", "seconds"}`` and writes them (and each run's best
    checkpoint, ``checkpoints/<variant>_seed<s>.pt``) under ``config.output_dir``."""
    config = config or ListOpsConfig()
    config.validate()
    start = time.perf_counter()
    splits = _load_splits(config)
    lengths = torch.tensor([len(e.split()) for e, _ in splits["test"]], dtype=torch.float)
    data = {split: len(rows) for split, rows in splits.items()}
    data.update(test_mean_tokens=float(lengths.mean()), test_max_tokens=int(lengths.max()),
                source=config.data_dir or f"regenerated (seed {config.data_seed})",
                generate_seconds=time.perf_counter() - start)
    built: Dict[str, Dict[str, List[Any]]] = {}
    runs = []
    out_dir = Path(config.output_dir) if config.output_dir is not None else None
    for variant in config.variants:
        structure = VARIANTS[variant][0]
        if structure not in built:
            t0 = time.perf_counter()
            # with node_loss the nested values train and are reported on the test split;
            # validation selects on the root label alone
            built[structure] = {s: _split_examples(
                config, s, rows, structure, bool(config.node_loss) and s != "val")
                for s, rows in splits.items()}
            data[f"build_seconds_{structure}"] = time.perf_counter() - t0
        sets = built[structure]
        if structure in _SCHEDULED:
            for split, trees in sets.items():
                _check_bottom_up_depth(trees, config.layers, split)
        for seed in range(config.first_seed, config.first_seed + config.seeds):
            torch.manual_seed(seed)
            try:
                model = _initial_model(config, variant, seed)
            except ImportError as error:
                print(f"[{variant}] skipped: {error}", flush=True)
                break
            if config.progress:
                print(f"[{variant} / seed {seed}] {len(sets['train'])} train, "
                      f"{len(sets['val'])} val, {len(sets['test'])} test", flush=True)
            trained = _trained_module(model, config)
            train_config = config.train_config(seed)
            if out_dir is not None:
                train_config = _saved_run(config, out_dir / "runs" / f"{variant}_seed{seed}",
                                          train_config)
            with _PeakMemory(config.device) as memory:
                result = fit(trained, sets["train"], sets["val"], train_config)
            metrics = evaluate(model, sets["test"], batch_size=config.batch_size,
                               device=config.device, predictions=True)
            breakdown = accuracy_breakdown(metrics.pop("predictions"), splits["test"])
            history = result["history"]
            run = {"variant": variant, "seed": seed, "test_accuracy": metrics["accuracy"],
                   "test_f1": metrics["macro_f1"], "best_epoch": result["best_epoch"],
                   "seconds_per_epoch": sum(h["seconds"] for h in history) / max(len(history),
                                                                               1),
                   "peak_memory_mib": memory.mib,
                   "parameters": sum(p.numel() for p in model.parameters()),
                   "breakdown": breakdown, "history": history}
            if config.node_loss:
                run["nested_breakdown"] = nested_accuracy(
                    model, sets["test"], batch_size=config.batch_size, device=config.device)
            # one line per run, with or without progress bars
            nested = ""
            if config.node_loss:
                nested = ", nested operators " + " ".join(
                    f"{k} {v['accuracy']:.3f}" for k, v in run["nested_breakdown"].items())
            print(f"[{variant} / seed {seed}] test accuracy {metrics['accuracy']:.4f}, "
                  f"{run['seconds_per_epoch']:.1f} s / epoch{nested}", flush=True)
            if out_dir is not None:
                path = out_dir / "checkpoints" / f"{variant}_seed{seed}.pt"
                save_checkpoint({"model": _cpu_state(model),
                                 "variant": variant, "spec": config.model_spec(),
                                 "metrics": metrics}, path)
                run["checkpoint"] = str(path)
            runs.append(run)
    summary = []
    for variant in config.variants:
        rows = [r for r in runs if r["variant"] == variant]
        if not rows:
            continue
        acc, half = _interval([r["test_accuracy"] for r in rows])
        summary.append({"model": variant, "accuracy_mean": acc, "accuracy_ci95": half,
                        "seeds": len(rows),
                        "seconds_per_epoch": sum(r["seconds_per_epoch"] for r in rows)
                        / len(rows),
                        "peak_memory_mib": max(r["peak_memory_mib"] for r in rows),
                        "parameters": rows[0]["parameters"],
                        # the share of each root operator answered right (mean over seeds)
                        **{f"acc_{op}": sum(r["breakdown"]["by_operator"][op]["accuracy"]
                                            for r in rows) / len(rows)
                           for op in rows[0]["breakdown"]["by_operator"]},
                        # with node_loss: the nested operators' read-out, all of them
                        **({"acc_nested": sum(r["nested_breakdown"]["all"]["accuracy"]
                                              for r in rows) / len(rows)}
                           if config.node_loss else {})})
    from .report import markdown_table

    recorded = asdict(config)
    if config.data_dir is not None:  # the files made the data, not these settings
        recorded.update({name: None for name in _GENERATOR_SETTINGS}, num_train=data["train"],
                        num_val=data["val"], num_test=data["test"])
    out = {"task": "listops", "title": "ListOps (regenerated LRA data): HSA on the parse tree "
           "vs hopping windows vs FSA vs H-Transformer-1D vs DeepSet",
           "command": config.command, "config": recorded, "data": data,
           "runs": runs, "summary": summary,
           "markdown": markdown_table(summary) if summary else "(no run)",
           "seconds": time.perf_counter() - start}
    if out_dir is not None:
        from .sentiment import write_results

        write_results(out, str(out_dir), "listops")
    return out


def estimate_epoch_seconds(config: ListOpsConfig, steps: int = 2) -> List[Dict[str, Any]]:
    """Time ``steps`` training steps (forward, backward, AdamW) per variant on data of
    ``config``'s settings and extrapolate to one epoch of ``config.num_train`` examples
    (with ``data_dir``: the first rows of its training file, and one epoch of that file);
    also the peak memory of those steps (with ``node_loss``, of the training wrapper).
    For budgeting the full run of a process alone on the machine: runs side by side on
    shared cores take longer (``hsa-tree-bottom-up-families`` with 4 blocks per turn,
    estimated at 492 s per epoch, took 781-915 s per epoch with two one-thread runs on
    two cores and 1,123-1,464 s with three).

    Raises:
        ValueError: a ``data_dir`` training file with fewer rows than one batch.
    """
    from torch_geometric.data import Batch

    config.validate()
    if config.data_dir is not None:
        path = _split_file(config, "train")
        train = read_listops_tsv(path)
        steps = min(steps, len(train) // config.batch_size)
        if steps == 0:
            raise ValueError(f"{path}: {len(train)} rows, fewer than one batch "
                             f"({config.batch_size}) to time")
        rows, num_train = train[:config.batch_size * steps], len(train)
    else:
        num_train = config.num_train
        rows = generate_listops_splits(config.batch_size * steps, 0, 0,
                                       seed=config.data_seed, max_depth=config.max_depth,
                                       max_args=config.max_args,
                                       min_length=config.min_length,
                                       max_length=config.max_length,
                                       operators=tuple(config.operators))["train"]
    out = []
    for variant in config.variants:
        examples = _split_examples(config, "train", rows, VARIANTS[variant][0],
                                   bool(config.node_loss))
        torch.manual_seed(0)
        try:
            model = build_model(variant, **config.model_spec()).to(config.device)
        except ImportError as error:
            out.append({"model": variant, "skipped": str(error)})
            continue
        trained = _trained_module(model, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        with _PeakMemory(config.device) as memory:
            t0 = time.perf_counter()
            for s in range(steps):
                batch = Batch.from_data_list(
                    examples[s * config.batch_size:(s + 1) * config.batch_size]).to(
                    config.device)
                _, _, loss, extra = _forward(trained, batch, F.cross_entropy)
                loss = (loss if extra is None else loss + extra).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            seconds = (time.perf_counter() - t0) / steps
        out.append({"model": variant, "seconds_per_step": seconds,
                    "seconds_per_epoch": seconds * num_train / config.batch_size,
                    "peak_memory_mib": memory.mib,
                    "parameters": sum(p.numel() for p in model.parameters())})
    return out


def load_model(checkpoint: Union[str, os.PathLike]) -> Tuple[str, Dict[str, Any], Module]:
    """The variant, model settings and model (with its weights) of a checkpoint saved
    by :func:`run_listops`."""
    state = load_checkpoint(checkpoint)
    variant, spec = state.get("variant"), state.get("spec")
    if variant not in VARIANTS or not isinstance(spec, dict):
        raise ValueError(f"{checkpoint} is not a ListOps checkpoint (no variant and model "
                         f"settings)")
    model = build_model(variant, **spec)
    model.load_state_dict(state["model"])
    return variant, spec, model


def _trained_module(model: Module, config: ListOpsConfig) -> Module:
    """What training calls: ``model``, or with ``config.node_loss`` its
    :class:`NestedValueLoss` wrapper."""
    return NestedValueLoss(model, config.node_loss) if config.node_loss else model


#: settings a run's saved state does not depend on (``epochs`` may grow on resume)
_NOT_IN_STATE = ("variants", "seeds", "first_seed", "epochs", "init_from", "device",
                 "output_dir", "resume", "progress", "command")


def _saved_run(config: ListOpsConfig, run_dir: Path, train: TrainConfig) -> TrainConfig:
    """``train`` writing its state after every epoch to ``run_dir`` (with the settings
    that define the run in ``settings.json``), and, with ``config.resume`` where a state
    is there, continuing from it: refused, naming the setting, where it differs."""
    settings = json.loads(json.dumps({k: v for k, v in asdict(config).items()
                                      if k not in _NOT_IN_STATE}))
    path = run_dir / "settings.json"
    resume = config.resume and (run_dir / "last.pt").is_file()
    if resume:
        saved = json.loads(path.read_text()) if path.is_file() else {}
        for name in sorted(set(settings) | set(saved)):
            if saved.get(name, "missing") != settings.get(name):
                raise ValueError(f"cannot resume from {run_dir}: it was trained with "
                                 f"{name}={saved.get(name, 'missing')!r}, this run has "
                                 f"{name}={settings.get(name)!r}")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=1))
    return replace(train, checkpoint_dir=str(run_dir), resume=resume)


def _initial_model(config: ListOpsConfig, variant: str, seed: int) -> Module:
    """A fresh model of ``variant``, or with ``config.init_from`` the weights of that
    run's checkpoint of the same variant and seed (its settings must be this run's)."""
    if config.init_from is None:
        return build_model(variant, **config.model_spec())
    path = Path(config.init_from) / "checkpoints" / f"{variant}_seed{seed}.pt"
    if not path.is_file():
        raise ValueError(f"init_from: no checkpoint of {variant}, seed {seed} at {path}")
    _, spec, model = load_model(path)
    ours = config.model_spec()
    # settings added after a checkpoint was saved: their defaults
    spec = {**ListOpsConfig().model_spec(), **spec}
    differ = sorted(k for k in ours.keys() | spec.keys() if k != "max_length"
                    and ours.get(k) != spec.get(k))
    if differ:
        raise ValueError(f"init_from: {path} was trained with other model settings: " +
                         ", ".join(f"{k}={spec.get(k)!r} (here {ours.get(k)!r})"
                                   for k in differ))
    return model


def evaluate_checkpoint(checkpoint: str, data: str, *, batch_size: int = 32,
                        device: str = "cpu", nested: bool = False) -> Dict[str, Any]:
    """Accuracy of the model saved by :func:`run_listops` at ``checkpoint`` on the
    LRA-format file ``data`` (:func:`~hsa_graph.datasets.listops.read_listops_tsv`),
    and ``"breakdown"``, the accuracy by root operator and by nesting depth
    (:func:`accuracy_breakdown`); with ``nested``, also ``"nested"``:
    :func:`nested_accuracy` there (meaningful for models trained with ``node_loss``)."""
    variant, _, model = load_model(checkpoint)
    rows = read_listops_tsv(data)
    if not rows:
        raise ValueError(f"{data} holds no examples")
    examples = _file_examples(data, rows, VARIANTS[variant][0], nested_targets=nested)
    if VARIANTS[variant][0] in _SCHEDULED:
        _check_bottom_up_depth(examples, model.classifier.encoder.num_turns, data)
    metrics = evaluate(model, examples, batch_size=batch_size, device=device,
                       predictions=True)
    breakdown = accuracy_breakdown(metrics.pop("predictions"), rows)
    out = {"variant": variant, "data": str(data), **metrics, "breakdown": breakdown}
    if nested:
        out["nested"] = nested_accuracy(model, examples, batch_size=batch_size, device=device)
    return out


# ------------------------------------------------------------------ command line
_OPTIONS = ("variants", "seeds", "first_seed", "num_train", "num_val", "num_test",
            "max_depth", "max_args", "min_length", "max_length", "operators", "data_seed",
            "data_dir", "epochs", "batch_size", "lr", "lr_schedule", "min_lr", "warmup_steps",
            "channels", "heads", "layers", "turn_layers", "hidden_channels", "layer",
            "pos_dim", "dropout",
            "pool", "node_loss", "init_from", "device", "output_dir")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This experiment's options (``hsa-graph listops``) and its ``evaluate`` and
    ``generate`` actions."""
    d = ListOpsConfig()
    parser.add_argument("action", nargs="?", choices=("train", "evaluate", "generate"),
                        default="train", help="train and compare (default); evaluate a "
                        "checkpoint on a TSV file; generate the data as TSV files")
    parser.add_argument("--quick", action="store_true", help="short version: " + ", ".join(
        f"{k}={v}" for k, v in QUICK.items()) + " (explicit options win)")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=None,
                        help=f"models (default: {' '.join(d.variants)})")
    for name in ("seeds", "first_seed", "num_train", "num_val", "num_test", "max_depth",
                 "max_args", "min_length", "max_length", "data_seed", "epochs", "batch_size",
                 "channels", "heads", "layers", "hidden_channels", "pos_dim", "warmup_steps"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"default {getattr(d, name)}")
    parser.add_argument("--lr", type=float, default=None, help=f"default {d.lr}")
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                        help="the learning rate over the steps: constant, or a half cosine "
                        f"from --lr to --min-lr (default {d.lr_schedule})")
    parser.add_argument("--min-lr", type=float, default=None,
                        help=f"where the cosine schedule ends (default {d.min_lr})")
    parser.add_argument("--dropout", type=float, default=None, help=f"default {d.dropout}")
    parser.add_argument("--layer", choices=LAYERS, default=None,
                        help=f"the attention layer: the paper's HTE layer or the pre-norm "
                        f"residual block (default {d.layer})")
    parser.add_argument("--share-weights", action="store_true",
                        help="one attention layer applied --layers times")
    parser.add_argument("--turn-layers", type=int, default=None,
                        help="the hsa-tree-bottom-up variants: layers per level of "
                        f"operators, one after the other (default {d.turn_layers})")
    parser.add_argument("--operators", nargs="+", choices=OPERATORS, default=None,
                        help="draw only these operators (default: all four)")
    parser.add_argument("--pool", choices=("mean", "first"), default=None,
                        help=f"read-out: mean over the tokens or the first token (default "
                        f"{d.pool})")
    parser.add_argument("--include-self", action="store_true",
                        help="each token also attends to itself")
    parser.add_argument("--nesting-embedding", action="store_true",
                        help="add an embedding of each token's nesting depth to its "
                        "token embedding")
    parser.add_argument("--node-loss", type=float, default=None,
                        help="weight of a loss on every nested operator's value (its span "
                        "read out like the root; not LRA's protocol; default "
                        f"{d.node_loss})")
    parser.add_argument("--init-from", default=None, help="an earlier run's --out: start "
                        "each variant and seed from its checkpoint there (a curriculum)")
    parser.add_argument("--resume", action="store_true",
                        help="continue each run from the state it saved under --out after "
                        "its last finished epoch (runs/<variant>_seed<s>/last.pt); a run "
                        "without one starts afresh")
    parser.add_argument("--data-dir", default=None, help="read basic_{train,val,test}.tsv "
                        "(LRA's format) from here instead of generating")
    parser.add_argument("--device", default=None, help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--out", "--output-dir", dest="output_dir", default=None,
                        help="results, plots and checkpoints (train); TSV files (generate)")
    parser.add_argument("--estimate", action="store_true", help="only time two training "
                        "steps per model and extrapolate to one epoch (a process alone on "
                        "the machine: runs side by side on shared cores take longer)")
    parser.add_argument("--checkpoint", default=None, help="evaluate: a checkpoint of a run")
    parser.add_argument("--data", default=None, help="evaluate: an LRA-format TSV file")
    parser.add_argument("--nested", action="store_true", help="evaluate: also the read-out's "
                        "accuracy on every nested operator, by operator and height")
    parser.add_argument("--parens", action="store_true",
                        help="generate: write LRA's curried form with round brackets")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars: one line per epoch instead")
    return parser


def config_from_args(args: argparse.Namespace) -> ListOpsConfig:
    """The :class:`ListOpsConfig` of parsed arguments (``--quick`` first)."""
    values: Dict[str, Any] = dict(QUICK) if getattr(args, "quick", False) else {}
    for name in _OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    for flag in ("share_weights", "include_self", "nesting_embedding", "resume"):
        if getattr(args, flag, False):
            values[flag] = True
    if values.get("pos_dim") == 0:
        values["pos_dim"] = None
    values["progress"] = not getattr(args, "no_progress", False)
    argv = getattr(args, "argv", None)
    if argv is not None:
        values["command"] = "hsa-graph listops " + " ".join(argv)
    return ListOpsConfig(**values)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the chosen action from parsed arguments; print its result."""
    action = getattr(args, "action", "train")
    threads = getattr(args, "threads", None)
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"--threads must be a positive int, got {threads!r}")
        torch.set_num_threads(threads)
    if action == "evaluate":
        if not args.checkpoint or not args.data:
            raise ValueError("evaluate needs --checkpoint PATH and --data FILE.tsv")
        out = evaluate_checkpoint(args.checkpoint, args.data, device=args.device or "cpu",
                                  nested=args.nested)
        print(f"{out['variant']} on {out['data']}: accuracy {out['accuracy']:.4f} "
              f"({out['n']} examples)")
        for kind, label in (("by_operator", "by root operator"), ("by_depth", "by depth"),
                            ("by_dependence", "by dependence on nested results")):
            print(f"{label} (accuracy, count): " + ", ".join(
                f"{k} {v['accuracy']:.3f} ({v['n']})" for k, v in out["breakdown"][kind].items()))
        if args.nested:
            print("nested operators (operator/height: accuracy, count): " + ", ".join(
                f"{k} {v['accuracy']:.3f} ({v['n']})" for k, v in out["nested"].items()))
        return out
    config = config_from_args(args)
    if action == "generate":
        if config.output_dir is None:
            raise ValueError("generate needs --out DIR")
        splits = _load_splits(config)
        paths = [str(write_listops_tsv(Path(config.output_dir) / f"basic_{s}.tsv", rows,
                                       parens=args.parens)) for s, rows in splits.items()]
        print("\n".join(paths))
        return {"paths": paths}
    if getattr(args, "estimate", False):
        rows = estimate_epoch_seconds(config)
        from .report import markdown_table

        print(markdown_table(rows))
        if config.output_dir is not None:
            Path(config.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(config.output_dir) / "listops_estimate.json").write_text(
                json.dumps({"command": config.command, "rows": rows}, indent=1))
        return {"rows": rows}
    out = run_listops(config)
    print(out["markdown"])
    return out


if __name__ == "__main__":  # pragma: no cover
    run(add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                          allow_abbrev=False)).parse_args())
