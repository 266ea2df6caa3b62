r"""Transformer layers and encoders built on :class:`~hsa_graph.nn.HSAttention`.

Two layer designs:

* :class:`HierarchicalTransformerEncoderLayer`: the paper's HTE layer (appendix F,
  figure 4): per-modality q/k/v projections, LayerNorm *after* the projection, HSA per
  head with the query added back (the residual is post-projection), concatenation, an
  output projection, LayerNorm, and a point-wise feed-forward network with a residual.
* :class:`HSATransformerEncoderLayer`: the standard pre-norm transformer block
  (``x + Attn(LN(x))``, then ``x + FFN(LN(x))``) with HSA as its attention.

:class:`HierarchicalTransformerEncoder` stacks either kind. Neither layer changes the
tree: the same tree (and the same raw position features, projected per layer as in
the paper) goes to every layer.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Dropout, LayerNorm, Linear, Module, ModuleList, Sequential
from torch_geometric.nn.inits import reset
from torch_geometric.nn.resolver import activation_resolver

from ..geometry import FieldNameEmbedding
from .attention import (
    ATTENTIONS,
    HSAttention,
    PositionInput,
    _structure,
    attention_tree,
    check_features,
)

__all__ = [
    "HSATransformerEncoderLayer",
    "HierarchicalTransformerEncoder",
    "HierarchicalTransformerEncoderLayer",
]


def _feed_forward(channels: int, hidden: int, act: str, dropout: float) -> Sequential:
    return Sequential(Linear(channels, hidden), activation_resolver(act), Dropout(dropout),
                      Linear(hidden, channels))


class HierarchicalTransformerEncoderLayer(Module):
    r"""The paper's Hierarchical Transformer Encoder (HTE) layer (appendix F, fig. 4).

    .. math::
        q, k, v &= \mathrm{LN}(W^{t}_{q,k,v}\, x) \quad \text{(per modality } t,
            \text{ per head)} \\
        h &= \mathrm{LN}\big(W_o \big\Vert_{\text{heads}}
            [\mathrm{HSA}(q, k, v) + q]\big) \\
        \text{out} &= h + \mathrm{FFN}(h)

    The residual around the attention adds the normalised query of each head (the
    paper's residual "applied post-linear projection"), so by default a leaf does not
    attend to itself inside HSA (``include_self=False``, as in the paper): it keeps
    its own information through that residual. Dropout acts on each head's
    attention output (see :class:`~hsa_graph.nn.HSAttention`) and on the FFN.

    Args:
        channels: leaf feature size ``C`` (input and output).
        heads: number of heads; each has ``C // heads`` channels unless
            ``head_channels`` is given.
        ffn_channels: hidden size of the feed-forward network (``4 C``).
        num_modalities: per-modality q/k/v projections when ``> 1``.
        v_norm: LayerNorm on values too (figure 4 draws it on q, k and v).
        act: activation of the FFN (any name of :mod:`torch_geometric.nn.resolver`).
        dropout: dropout on attention outputs and inside/after the FFN.
        **kwargs: further arguments of :class:`~hsa_graph.nn.HSAttention`
            (``head_channels``, ``pos_dim``, ``pos_kwargs``, ``include_self``,
            ``qk_norm`` (default ``True``), ``attention``, ``scale``, ``bias``).

    Shapes:
        - **input:** ``x`` ``[N, C]``, ``tree`` with ``N`` leaves, ``pos`` as in
          :class:`~hsa_graph.nn.HSAttention`.
        - **output:** ``[N, C]``.

    Example:
        >>> import hsa_graph
        >>> _ = torch.manual_seed(0)
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> layer = HierarchicalTransformerEncoderLayer(16, heads=2, pos_dim=4)
        >>> layer(torch.randn(5, 16), tree).shape
        torch.Size([5, 16])
    """

    def __init__(self, channels: int, heads: int = 1, *, ffn_channels: Optional[int] = None,
                 num_modalities: int = 1, v_norm: bool = True, act: str = "gelu",
                 dropout: float = 0.0, **kwargs: Any):
        super().__init__()
        kwargs.setdefault("include_self", False)
        kwargs.setdefault("qk_norm", True)
        self.channels = channels
        self.attn = HSAttention(channels, heads, out_channels=channels,
                                num_modalities=num_modalities, v_norm=v_norm,
                                dropout=dropout, query_residual=True, **kwargs)
        self.norm = LayerNorm(channels)
        self.ffn = _feed_forward(channels, ffn_channels or 4 * channels, act, dropout)
        self.dropout = float(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise the attention, the norm and the feed-forward network."""
        self.attn.reset_parameters()
        self.norm.reset_parameters()
        reset(self.ffn)

    def forward(self, x: Tensor, tree, pos: PositionInput = None,
                rows: Optional[Tensor] = None) -> Tensor:
        """``[N, C] -> [N, C]``; with ``rows`` (leaf row indices) the outputs of those
        rows alone, ``[R, C]`` (the attention still reads every row)."""
        h = self.attn(x, tree, pos)
        h = self.norm(h if rows is None else h[rows])
        return h + F.dropout(self.ffn(h), self.dropout, self.training)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, heads={self.attn.heads}, "
                f"attention={self.attn.attention!r}, pos_dim={self.attn.pos_dim}, "
                f"num_modalities={self.attn.num_modalities})")


class HSATransformerEncoderLayer(Module):
    r"""The standard pre-norm transformer block with HSA as its attention.

    .. math::
        x &\leftarrow x + \mathrm{Dropout}(\mathrm{HSAttention}(\mathrm{LN}(x))) \\
        x &\leftarrow x + \mathrm{Dropout}(\mathrm{FFN}(\mathrm{LN}(x)))

    With ``qk_norm=False``, ``include_self=True`` (the defaults here are
    ``qk_norm=True``, ``include_self=True``) and a flat tree this is
    :class:`torch.nn.TransformerEncoderLayer` with ``norm_first=True`` (up to
    dropout placement).

    Args:
        channels: leaf feature size ``C``.
        heads: number of heads.
        ffn_channels: hidden size of the feed-forward network (``4 C``).
        act: activation of the FFN.
        dropout: dropout on the attention outputs, and on both residual branches.
        **kwargs: further arguments of :class:`~hsa_graph.nn.HSAttention`
            (``head_channels``, ``num_modalities``, ``qk_norm``, ``v_norm``,
            ``pos_dim``, ``pos_kwargs``, ``include_self``, ``attention``, ...).

    Shapes:
        - **input:** ``x`` ``[N, C]``, ``tree`` with ``N`` leaves.
        - **output:** ``[N, C]``.

    Example:
        >>> import hsa_graph
        >>> _ = torch.manual_seed(0)
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> layer = HSATransformerEncoderLayer(8, heads=2)
        >>> layer(torch.randn(5, 8), tree).shape
        torch.Size([5, 8])
    """

    def __init__(self, channels: int, heads: int = 1, *, ffn_channels: Optional[int] = None,
                 act: str = "gelu", dropout: float = 0.0, **kwargs: Any):
        super().__init__()
        self.channels = channels
        self.norm1 = LayerNorm(channels)
        self.attn = HSAttention(channels, heads, out_channels=channels, dropout=dropout,
                                **kwargs)
        self.norm2 = LayerNorm(channels)
        self.ffn = _feed_forward(channels, ffn_channels or 4 * channels, act, dropout)
        self.dropout = float(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise the norms, the attention and the feed-forward network."""
        self.norm1.reset_parameters()
        self.attn.reset_parameters()
        self.norm2.reset_parameters()
        reset(self.ffn)

    def forward(self, x: Tensor, tree, pos: PositionInput = None,
                rows: Optional[Tensor] = None) -> Tensor:
        """``[N, C] -> [N, C]``; with ``rows`` (leaf row indices) the outputs of those
        rows alone, ``[R, C]`` (the attention still reads every row)."""
        check_features(self, x)
        h = self.attn(self.norm1(x), tree, pos)
        if rows is not None:
            x, h = x[rows], h[rows]
        x = x + F.dropout(h, self.dropout, self.training)
        return x + F.dropout(self.ffn(self.norm2(x)), self.dropout, self.training)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, heads={self.attn.heads}, "
                f"attention={self.attn.attention!r}, pos_dim={self.attn.pos_dim})")


_LAYERS = {"hte": HierarchicalTransformerEncoderLayer, "pre_norm": HSATransformerEncoderLayer}
#: the layer names :class:`HierarchicalTransformerEncoder` takes.
LAYERS = tuple(_LAYERS)


def _mirror_rows(tree, x: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """The leaf rows of ``tree``'s node tokens and of the leaves they mirror (its
    ``mirror_index`` and ``mirror_source_index``), or ``None`` where it has none."""
    nodes = getattr(tree, "mirror_index", None)
    sources = getattr(tree, "mirror_source_index", None)
    if nodes is None and sources is None:
        return None
    if nodes is None or sources is None:
        raise ValueError("a tree with node tokens needs both mirror_index and "
                         "mirror_source_index")
    structure = _structure(tree, x)
    rows = structure.leaf_rows_of(nodes, "mirror_index")
    source_rows = structure.leaf_rows_of(sources, "mirror_source_index")
    if rows.shape != source_rows.shape:
        raise ValueError(f"mirror_index and mirror_source_index must have the same length, "
                         f"got {rows.numel()} and {source_rows.numel()}")
    if rows.numel() and (torch.unique(rows).numel() != rows.numel()
                         or bool(torch.isin(source_rows, rows).any())):
        raise ValueError("mirror_index must name each leaf once, and no mirrored leaf "
                         "(mirror_source_index) may itself be a node token")
    return rows, source_rows


def _update_layers(tree, x: Tensor, num_layers: int) -> Optional[List[Optional[Tensor]]]:
    """For each layer, the leaf rows that take its output (``None`` where none does),
    from ``tree``'s ``update_layer`` (one host read per forward), or ``None`` where the
    tree has none."""
    schedule = getattr(tree, "update_layer", None)
    if schedule is None:
        return None
    if not isinstance(schedule, Tensor) or schedule.dtype != torch.long or (
            schedule.shape != (x.shape[0],)):
        raise ValueError(f"update_layer must be a long tensor [N] = [{x.shape[0]}] (one "
                         f"layer per leaf), got {getattr(schedule, 'dtype', type(schedule))} "
                         f"{tuple(getattr(schedule, 'shape', ()))}")
    schedule = schedule.to(x.device)
    counts = torch.bincount(schedule.clamp(-1, num_layers + 1) + 1, minlength=num_layers + 3)
    counts = counts.tolist()
    if counts[0] or counts[-1]:
        bad = schedule[(schedule < 0) | (schedule > num_layers)][0].item()
        raise ValueError(f"update_layer must lie in 0..{num_layers} (the encoder's layers; "
                         f"0: the leaf keeps its input), got {bad}")
    # the rows of each layer's turn: one stable sort, split by the counts
    turns = torch.argsort(schedule, stable=True).split(counts[1:-1])[1:]
    return [rows if rows.numel() else None for rows in turns]


#: what a scheduled layer attends over (:class:`HierarchicalTransformerEncoder`'s ``scope``)
SCOPES = ("tree", "family", "siblings")


def _cut_signal(tree, cut):
    """The :class:`~hsa_graph.NestedSignal` of a :class:`~hsa_graph.structure.ForestCut`
    of ``tree``, with the node attributes it keeps (geometry, positions, modality tags)
    of the kept nodes; the nodes it made roots have a root's position: none."""
    from ..signal import NestedSignal

    attrs = {name: getattr(tree, name) for name in ("geometry", "position", "modality")
             if isinstance(getattr(tree, name, None), Tensor)}
    if "position" in attrs:
        attrs["position"] = attrs["position"].clone()
        attrs["position"][cut.roots.to(attrs["position"].device)] = -1
    if cut.kept is not None:
        attrs = {name: value[cut.kept.to(value.device)] for name, value in attrs.items()}
    return NestedSignal.from_parents(cut.parent, **attrs)


def _family_scope(tree, rows: Tensor):
    """``tree`` cut above the parents of leaf rows ``rows``: each of those parents becomes
    the root of its own tree, so that HSA confines the rows to their families' subtrees.
    The leaves stay the same rows (a node cut off from every one of its children would
    become a leaf: refused, naming it)."""
    return _cut_signal(tree, tree.structure_for(rows.device).cut_above(
        rows, "a scoped layer"))


def _sibling_forest(tree, rows: Tensor) -> Tuple[Any, Tensor]:
    """The families of leaf rows ``rows``, each a tree of its leaves alone (its parent
    over its leaf children; HSA over it is softmax attention among them), as one forest,
    and the leaf rows of ``tree`` it holds (its leaves, in order: every leaf child of
    those parents; a row without a parent is a tree of its own). Nothing else is
    kept, so a layer over the forest costs what the families hold."""
    cut = tree.structure_for(rows.device).family_forest(rows)
    return _cut_signal(tree, cut), cut.leaf_rows


class HierarchicalTransformerEncoder(Module):
    r"""A stack of HSA transformer layers over the leaves of a nested signal.

    Every layer sees the same tree. With position embeddings (``pos_dim``), the raw
    features of each node's position (:meth:`PositionEncoder.features
    <hsa_graph.geometry.PositionEncoder.features>`) are computed once per forward
    pass and projected by each layer's own linear maps (one per geometry type), with
    one field-name table shared by all layers, as in the paper's appendix F. A
    pre-norm stack ends with a LayerNorm.

    Node tokens: a tree with ``mirror_index`` and ``mirror_source_index`` (node ids of
    leaves, e.g. :func:`~hsa_graph.datasets.listops.listops_tree`'s ``node_tokens``) has
    each leaf of ``mirror_index`` stand for the leaf of ``mirror_source_index`` at the
    same place: after every layer (every turn, below) its features are replaced by that
    leaf's, so a leaf placed in one family (an operator among its arguments) is read in
    another (its parent's) as one vector, one level further up per layer.

    The leaf outputs can be read out with :mod:`hsa_graph.nn.pool`: one vector per
    tree (:func:`~hsa_graph.nn.global_leaf_pool`) or per node, internal nodes
    included (:func:`~hsa_graph.nn.subtree_pool`).

    Layer schedule: a tree with ``update_layer`` (``[N]`` long, one entry per leaf, in
    ``0 .. num_layers``, or ``0 ..`` :attr:`num_turns` with turns, below) has leaf
    ``i`` take the output of layer ``update_layer[i]`` alone and keep its features
    through every other layer (``0``: its input, for
    good); a layer's attention reads every row, its residual, norms and feed-forward
    network run on the rows of its turn alone, and a layer whose turn no leaf has is
    skipped. Each leaf is then computed once, by the layer its place in the tree
    names, from what the others hold at that point: e.g. a ListOps operator token at
    its operator's height, with shared weights and node tokens, so that every operator
    is composed once, deepest first, from its arguments' final vectors (the
    ``hsa-tree-bottom-up`` variant of :mod:`hsa_graph.experiments.listops`), every
    layer still HSA over the whole tree. With ``scope="family"`` a layer attends over
    the tree cut above the parents of its turn's rows instead: each row sees its own
    family's subtree alone (its siblings, and its siblings' subtrees as HSA's blocks),
    nothing outside it; with ``scope="siblings"`` the subtrees are cut off too, and each
    row sees its family's leaves alone (softmax attention among them): the layer then
    runs on those families' leaves alone (one forest per turn), so a leaf costs the
    layers of its own family's turn, not every layer.

    Turns: with ``turn_layers=B`` the stack is ``num_layers / B`` turns of ``B``
    consecutive layers, ``update_layer`` counts turns, and the leaves of turn ``t`` take
    the output of its ``B`` layers, one after the other, each reading what the previous
    one left (the other leaves keep their features); node tokens are copied after each
    turn. So when every leaf of a family shares its turn (a ListOps operator token, its
    digits and its nested operators' node tokens at the operator's height: the
    ``hsa-tree-bottom-up-families`` variant), each family is computed by ``B`` layers over
    all its members, deepest first, as a recursive tree model composes.

    Args:
        channels: leaf feature size ``C``.
        num_layers: number of layers.
        heads: heads per layer.
        layer: ``"hte"`` (:class:`HierarchicalTransformerEncoderLayer`) or
            ``"pre_norm"`` (:class:`HSATransformerEncoderLayer`).
        attention: ``"hierarchical"`` (HSA), or the baselines ``"flat"`` (softmax
            attention over each tree's leaves) and ``"none"`` (no attention: a
            DeepSet once pooled), see :class:`~hsa_graph.nn.HSAttention`.
        pos_dim: size of the position embeddings per head (``None``: none).
        pos_kwargs: arguments of :class:`~hsa_graph.geometry.PositionEncoder`
            shared by all layers (``dim``, ``kind``, ``sigma``, ``seed``, ``graph``,
            ``graph_dim``, ``bias``).
        scope: with a layer schedule, what a layer's rows attend over: ``"tree"`` (the
            whole tree), ``"family"`` (their parents' subtrees) or ``"siblings"``
            (their parents' leaf children); the last two build one tree per turn and
            forward, from the tree's ``parent`` and ``leaf_index``.
        turn_layers: layers per turn of a layer schedule (``num_layers`` must be a
            multiple); ``1``: a turn is a layer.
        **kwargs: further arguments of the layer (``ffn_channels``, ``act``,
            ``dropout``, ``num_modalities``, ``include_self``, ``head_channels``, ...).

    Shapes:
        - **input:** ``x`` ``[N, C]``, ``tree`` with ``N`` leaves.
        - **output:** ``[N, C]``.

    Example:
        >>> import hsa_graph
        >>> from torch_geometric.data import Batch
        >>> from hsa_graph.nn import global_leaf_pool
        >>> _ = torch.manual_seed(0)
        >>> trees = [hsa_graph.NestedSignal.from_nested([[torch.randn(8)] * 2, [torch.randn(8)]]),
        ...          hsa_graph.NestedSignal.from_nested([torch.randn(8)] * 3)]
        >>> batch = Batch.from_data_list(trees)
        >>> encoder = HierarchicalTransformerEncoder(8, num_layers=2, heads=2, pos_dim=4)
        >>> out = encoder(batch.x, batch)
        >>> out.shape, global_leaf_pool(out, batch).shape
        (torch.Size([6, 8]), torch.Size([2, 8]))
    """

    def __init__(self, channels: int, num_layers: int, heads: int = 1, *, layer: str = "hte",
                 attention: str = "hierarchical", pos_dim: Optional[int] = None,
                 pos_kwargs: Optional[Dict[str, Any]] = None, scope: str = "tree",
                 turn_layers: int = 1, **kwargs: Any):
        super().__init__()
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        if layer not in _LAYERS:
            raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        for name, value in (("num_layers", num_layers), ("turn_layers", turn_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_layers % turn_layers:
            raise ValueError(f"num_layers ({num_layers}) must be a multiple of turn_layers "
                             f"({turn_layers}): a turn is turn_layers layers")
        pos_kwargs = dict(pos_kwargs or {})
        if pos_dim is not None and "field_names" not in pos_kwargs:
            # one field-name table for the whole stack: the raw features are shared
            pos_kwargs["field_names"] = FieldNameEmbedding(pos_kwargs.get("dim", 32))
        self.channels, self.num_layers, self.layer_type = channels, num_layers, layer
        self.attention, self.scope, self.turn_layers = attention, scope, turn_layers
        self.layers = ModuleList([
            _LAYERS[layer](channels, heads, attention=attention, pos_dim=pos_dim,
                           pos_kwargs=pos_kwargs if pos_dim is not None else None, **kwargs)
            for _ in range(num_layers)])
        self.norm = LayerNorm(channels) if layer == "pre_norm" else None

    def reset_parameters(self) -> None:
        """Re-initialise every layer."""
        for layer in self.layers:
            layer.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()

    @property
    def num_turns(self) -> int:
        """The turns of the stack: ``turn_layers`` consecutive layers each (with shared
        weights one module may fill several)."""
        return len(self.layers) // self.turn_layers

    def forward(self, x: Tensor, tree) -> Tensor:
        """``[N, C] -> [N, C]``: leaf outputs."""
        check_features(self, x)
        if len(self.layers) % self.turn_layers:
            raise ValueError(f"the encoder's {len(self.layers)} layers do not split into "
                             f"turns of turn_layers={self.turn_layers}")
        target = attention_tree(tree, self.attention)
        encoder = self.layers[0].attn.pos_encoder
        # an inducing layer embeds the tree it builds, not the given one
        features = (encoder.features(target) if encoder is not None and target is not None
                    and self.layers[0].attn.induce is None else None)
        mirrors = _mirror_rows(tree, x)
        turns = _update_layers(tree, x, self.num_turns)
        if self.scope != "tree" and turns is None:
            raise ValueError(f"scope={self.scope!r} confines a layer's rows: it needs a "
                             f"layer schedule (the tree's update_layer)")
        for t in range(self.num_turns):
            stack = self.layers[t * self.turn_layers:(t + 1) * self.turn_layers]
            if turns is None:
                for layer in stack:
                    x = layer(x, tree, features)
            elif turns[t] is None:  # nobody's turn: nothing changes, nothing to copy
                continue
            else:
                x = self._turn(x, tree, features, turns[t], stack, encoder)
            if mirrors is not None:
                x = x.index_copy(0, mirrors[0], x.index_select(0, mirrors[1]))
        return x if self.norm is None else self.norm(x)

    def _turn(self, x: Tensor, tree, features: Optional[Tensor], rows: Tensor,
              stack: ModuleList, encoder: Optional[Module]) -> Tensor:
        """``x`` with leaf rows ``rows`` replaced by the output of the layers ``stack``,
        one after the other, each reading what the previous one left (the other rows
        keep their features), over what ``self.scope`` lets the rows see (``encoder``:
        the position encoder that embeds a cut tree, where ``features`` are given)."""
        held = None                                  # the rows the layers compute over
        if self.scope == "tree":
            scoped, scoped_features = tree, features
        elif self.scope == "family":
            scoped = _family_scope(tree, rows)
            scoped_features = None if features is None else encoder.features(scoped)
        else:  # the rows' families alone: nothing else is computed
            scoped, held = _sibling_forest(tree, rows)
            scoped_features = None if features is None else encoder.features(scoped)
        h = x if held is None else x[held]
        local = rows if held is None else (
            None if held.numel() == rows.numel() else torch.searchsorted(held, rows))
        for layer in stack:
            out = layer(h, scoped, scoped_features, rows=local)
            h = out if local is None else h.index_copy(0, local, out)
        if held is None:
            return h
        return x.index_copy(0, rows, h if local is None else h[local])

    def __repr__(self) -> str:
        first = self.layers[0].attn
        return (f"{self.__class__.__name__}({self.channels}, num_layers={self.num_layers}, "
                f"heads={first.heads}, layer={self.layer_type!r}, "
                f"attention={self.attention!r}, pos_dim={first.pos_dim}"
                + (f", scope={self.scope!r}" if self.scope != "tree" else "")
                + (f", turn_layers={self.turn_layers}" if self.turn_layers != 1 else "") + ")")
