r"""A tree classifier: the architecture of the paper's experiments (appendix I.2)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.nn import Dropout, Linear, Module, Sequential
from torch_geometric.nn.inits import reset
from torch_geometric.nn.resolver import activation_resolver

from .attention import ATTENTIONS, _structure, attention_tree, leaf_modalities
from .encoder import HierarchicalTransformerEncoder
from .linear import ModalityLinear
from .pool import _GLOBAL_REDUCE, global_leaf_pool

__all__ = ["TreeClassifier", "attention_flops"]


class TreeClassifier(Module):
    r"""Classify whole nested signals: input projection, one attention layer, global
    mean pooling over the leaves (or another read-out, ``pool``) and a one-hidden-layer
    MLP (paper appendix I.2).

    .. math::
        h_i &= W^{t_i}_{\text{in}}\, x_i + b^{t_i}_{\text{in}}
            \quad (\text{one map per modality tag } t_i) \\
        h &\leftarrow \mathrm{HTE}(h, \text{tree})
            \quad (\text{``num\_layers'' HTE layers, 3 heads by default}) \\
        \bar h_T &= \frac{1}{|l(T)|} \sum_{i \in l(T)} h_i \quad (\text{per tree } T) \\
        \text{logits}_T &= W_2\, \mathrm{Dropout}(\sigma(W_1 \bar h_T + b_1)) + b_2

    The three models of the paper's comparisons differ **only** in ``attention`` and
    share every parameter shape, so their parameter counts are equal:

    * ``"hierarchical"``: HSA on the tree (the paper's *HSA*);
    * ``"flat"``: the same layer on the flattened tree, i.e. softmax attention over all
      leaves of each tree (*FSA*);
    * ``"none"``: the attention is disabled and each leaf is transformed on its own,
      which pooled is a DeepSet (*DeepSet*). Its position encoder is then unused (kept
      so the three share one parameter layout and one checkpoint format).

    Args:
        in_channels: leaf feature size ``F`` (e.g. 384 for MiniLM embeddings).
        num_classes: number of classes ``K``.
        channels: width ``C`` of the attention layer (paper: 128).
        heads: attention heads (paper: 3); each gets ``head_channels`` channels,
            ``C // heads`` by default.
        hidden_channels: hidden size of the MLP (paper: 128).
        attention: ``"hierarchical"``, ``"flat"`` or ``"none"`` (see above).
        num_layers: attention layers (paper: 1).
        layer: the encoder's layer, ``"hte"`` (the paper's HTE layer,
            :class:`~hsa_graph.nn.HierarchicalTransformerEncoderLayer`) or ``"pre_norm"``
            (the standard pre-norm residual block,
            :class:`~hsa_graph.nn.HSATransformerEncoderLayer`).
        num_modalities: ``T``; with ``T > 1`` the input projection and the q/k/v maps
            have one set of weights per modality tag (``tree.modality``).
        pos_dim: per-head size of the position embeddings (``None``: none).
        pos_kwargs: arguments of :class:`~hsa_graph.geometry.PositionEncoder`.
        dropout: dropout in the attention layer and before the last linear map.
        act: activation of the MLP and of the layer's feed-forward network.
        pool: the read-out over each tree's leaves (:func:`~hsa_graph.nn.global_leaf_pool`:
            ``"mean"``, the paper's; ``"sum"``, ``"max"``, ``"min"``, or ``"first"``, the
            first leaf's output, as a CLS token is read).
        **kwargs: further arguments of
            :class:`~hsa_graph.nn.HierarchicalTransformerEncoderLayer`
            (``head_channels``, ``ffn_channels``, ``include_self``, ...).

    Shapes:
        - **input:** a :class:`~hsa_graph.NestedSignal` or PyG ``Batch`` of them with
          floating leaf features ``x`` ``[N, F]`` (any float dtype: they are cast to
          the parameters' dtype, so features may be stored in float16); or ``x`` and
          the tree separately.
        - **output:** logits ``[num_trees, K]``.

    Example:
        >>> import hsa_graph
        >>> from torch_geometric.data import Batch
        >>> _ = torch.manual_seed(0)
        >>> trees = [hsa_graph.NestedSignal.from_nested([[torch.randn(6)] * 2, [torch.randn(6)]]),
        ...          hsa_graph.NestedSignal.from_nested([torch.randn(6)] * 3)]
        >>> batch = Batch.from_data_list(trees)
        >>> models = [TreeClassifier(6, 2, channels=12, heads=3, attention=a, pos_dim=4)
        ...           for a in ("hierarchical", "flat", "none")]
        >>> models[0](batch).shape
        torch.Size([2, 2])
        >>> len({m.num_parameters() for m in models})   # same size for HSA, FSA, DeepSet
        1
    """

    def __init__(self, in_channels: int, num_classes: int, channels: int = 128, heads: int = 3,
                 *, hidden_channels: int = 128, attention: str = "hierarchical",
                 num_layers: int = 1, layer: str = "hte", num_modalities: int = 1,
                 pos_dim: Optional[int] = 16,
                 pos_kwargs: Optional[Dict[str, Any]] = None, dropout: float = 0.1,
                 act: str = "gelu", pool: str = "mean", **kwargs: Any):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes),
                            ("channels", channels), ("heads", heads),
                            ("hidden_channels", hidden_channels)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if pool not in _GLOBAL_REDUCE:
            raise ValueError(f"pool must be one of {_GLOBAL_REDUCE}, got {pool!r}")
        self.pool = pool
        if channels % heads and "head_channels" not in kwargs:
            kwargs["head_channels"] = channels // heads
        self.in_channels, self.num_classes = in_channels, num_classes
        self.channels, self.hidden_channels = channels, hidden_channels
        self.attention, self.num_modalities, self.layer = attention, num_modalities, layer
        self.input = ModalityLinear(in_channels, channels, num_modalities)
        self.encoder = HierarchicalTransformerEncoder(
            channels, num_layers, heads, layer=layer, attention=attention, pos_dim=pos_dim,
            pos_kwargs=pos_kwargs, num_modalities=num_modalities, dropout=dropout, act=act,
            **kwargs)
        self.mlp = Sequential(Linear(channels, hidden_channels), activation_resolver(act),
                              Dropout(dropout), Linear(hidden_channels, num_classes))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise the input projection, the encoder and the MLP."""
        self.input.reset_parameters()
        self.encoder.reset_parameters()
        reset(self.mlp)

    def num_parameters(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def embed(self, x: Tensor, tree) -> Tensor:
        """Pooled tree vectors ``[num_trees, C]`` (the MLP's input)."""
        return global_leaf_pool(self.encode(x, tree), tree, self.pool)

    def encode(self, x: Tensor, tree) -> Tensor:
        """The encoder's leaf outputs ``[N, C]`` (before the read-out), e.g. to read out
        other nodes with :func:`~hsa_graph.nn.subtree_pool` and :attr:`mlp`."""
        structure = _structure(tree, x)
        n = structure.num_leaves
        if x.dim() != 2 or x.shape[0] != n or x.shape[1] != self.in_channels:
            raise ValueError(f"x must have shape [N, {self.in_channels}] with one row per leaf "
                             f"(N = {n}), got {tuple(x.shape)}")
        x = x.to(self.input.weight.dtype)
        modality = leaf_modalities(tree, structure, self.num_modalities, x.device)
        return self.encoder(self.input(x, modality), tree)

    def forward(self, x, tree=None) -> Tensor:
        """Logits ``[num_trees, K]`` of ``model(batch)`` or ``model(x, batch)``."""
        if tree is None:
            tree = x
            x = getattr(tree, "x", None)
            if not isinstance(x, Tensor):
                raise TypeError(f"model(tree) needs a NestedSignal or Batch with leaf "
                                f"features x, got {type(tree).__name__} with x={type(x).__name__}")
        return self.read_out(self.encode(x, tree), tree)

    def read_out(self, leaf_outputs: Tensor, tree) -> Tensor:
        """Logits ``[num_trees, K]`` from the encoder's leaf outputs ``[N, C]``
        (:meth:`encode`): the pooling, then the MLP."""
        return self.mlp(global_leaf_pool(leaf_outputs, tree, self.pool))

    def attention_flops(self, tree) -> int:
        """FLOPs of this model's attention on ``tree`` (see :func:`attention_flops`).
        Layers that induce their tree (``induce=``) are counted on the trees they build
        for ``tree.x`` (one forward pass without gradient, in evaluation mode)."""
        attn = self.encoder.layers[0].attn
        if attn.induce is None:
            return len(self.encoder.layers) * attention_flops(
                tree, attn.heads, attn.head_channels, attention=self.attention)
        return sum(attention_flops(t, attn.heads, attn.head_channels)
                   for t in self.induced_trees(tree))

    @torch.no_grad()
    def induced_trees(self, tree, x: Optional[Tensor] = None) -> List[Any]:
        """The tree each attention layer induces for ``tree`` (leaf features ``x``,
        default ``tree.x``), in evaluation mode: a list of one tree per layer.

        Raises:
            ValueError: the layers do not induce their trees (``induce=None``).
        """
        x = tree.x if x is None else x
        trees: List[Any] = []

        def record(module, args, kwargs):
            trees.append(module.induced_tree(args[0], args[1]))

        hooks = [layer.attn.register_forward_pre_hook(record, with_kwargs=True)
                 for layer in self.encoder.layers]
        was_training = self.training
        try:
            self.eval()
            if self.encoder.layers[0].attn.induce is None:
                raise ValueError("induced_trees needs layers built with induce=")
            self.embed(x, tree)
        finally:
            for hook in hooks:
                hook.remove()
            self.train(was_training)
        return trees

    def __repr__(self) -> str:
        attn = self.encoder.layers[0].attn
        return (f"{self.__class__.__name__}({self.in_channels}, {self.num_classes}, "
                f"channels={self.channels}, heads={attn.heads}, attention={self.attention!r}, "
                f"num_layers={len(self.encoder.layers)}, "
                f"hidden_channels={self.hidden_channels}, "
                f"num_modalities={self.num_modalities}, pos_dim={attn.pos_dim}"
                + ("" if self.layer == "hte" else f", layer={self.layer!r}")
                + ("" if self.pool == "mean" else f", pool={self.pool!r}") + ")")


def attention_flops(tree, heads: int, head_channels: int, value_channels: Optional[int] = None,
                    *, attention: str = "hierarchical", include_self: bool = False) -> int:
    r"""Floating-point operations of one multi-head attention on ``tree``, counted from
    the work the formula needs (no padding, no bookkeeping), the same way for HSA and
    for flat attention, per head:

    .. math::
        \sum_{\text{families } F} |F|(|F| - 1)\,(2D + 2D_v + 3)
        \;+\; (M - 1)(2D + D_v) + I\,(2D + D_v) + (M - 1)(2 D_v + 8)

    * per ordered pair of siblings: a ``D``-dot product (:math:`2D`), the soft-max
      (exp, add, divide: 3) and a weighted sum of ``D_v`` values (:math:`2D_v`);
    * the bottom-up means of q, k, v (an add per child, a divide per internal node);
    * the top-down pass: per non-root node, the mass and log-sum-exp scalars (8) and
      one scaled vector added to its path (:math:`2D_v`).

    ``attention="flat"`` counts the flattened tree (one family of the ``N`` leaves, so
    :math:`N(N-1)(2D+2D_v+3)` dominates: standard softmax attention), and ``"none"``
    gives 0. ``include_self`` adds the diagonal (:math:`N (2D + 2D_v + 3)`).
    Projections, norms and the feed-forward network are the same in every variant and
    are not counted.

    Args:
        tree: a :class:`~hsa_graph.NestedSignal` or ``Batch`` (the sum over its trees).
        heads: ``H``.
        head_channels: ``D`` of queries and keys.
        value_channels: ``D_v`` (default ``D``).
        attention: ``"hierarchical"``, ``"flat"`` or ``"none"``.
        include_self: whether leaves attend to themselves.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> attention_flops(tree, 1, 4, attention="flat")   # 20 pairs * 19 + 5 * 12 + 12 + 5 * 16
        532
        >>> attention_flops(tree, 1, 4)   # 2 + 2 + 6 pairs * 19 + 7 * 12 + 3 * 12 + 7 * 16
        422
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    for name, value in (("heads", heads), ("head_channels", head_channels)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if attention == "none":
        return 0
    d = head_channels
    dv = d if value_channels is None else value_channels
    structure = attention_tree(tree, attention).structure_for(torch.device("cpu"))
    pairs = structure.num_attention_weights  # ordered sibling pairs, sum |F|(|F| - 1)
    if include_self:
        pairs += structure.num_leaves
    m, i = structure.num_nodes, structure.num_internal
    t = structure.num_trees
    per_head = (pairs * (2 * d + 2 * dv + 3) + (m - t) * (2 * d + dv) + i * (2 * d + dv)
                + (m - t) * (2 * dv + 8))
    return heads * per_head

