r"""A recursive tree encoder: every internal node computed from its children, one depth at
a time, deepest first.

HSA lets every leaf read the whole tree in one layer, through the means of subtrees; a
stack of ``L`` layers composes what the tree nests in ``L`` steps, whatever its depth. A
recursive encoder composes along the tree instead (as a Tree-LSTM does): a node's
vector is a function of its children's vectors only, the same function at every node,
so a tree of any depth or width is encoded by as many steps as it has levels, and a
subtree is seen by its parent as one vector, never diluted into a mean of its leaves.
It is the model to compare HSA with where the answer is a composition along the tree
(ListOps: :mod:`hsa_graph.experiments.listops`).
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor
from torch.nn import LayerNorm, Module, ModuleList, TransformerEncoderLayer

from .pool import _check_leaf_rows, _structure

__all__ = ["RecursiveTreeEncoder"]


class RecursiveTreeEncoder(Module):
    r"""Encode every internal node of a forest from its children, deepest depth first.

    For an internal node :math:`A` with children :math:`C_1, \dots, C_k` in unified
    order (its leaves first, in leaf order, then its internal children):

    .. math::
        h_A = \mathrm{LN}\Big(\mathrm{Blocks}\big(h_{C_1}, \dots, h_{C_k}\big)_1\Big),

    where a leaf's :math:`h` is its row of ``x``, :math:`\mathrm{Blocks}` is
    ``num_layers`` pre-norm transformer blocks over the family (softmax attention among
    the :math:`k` children, no positions: a family is a set whose first member is read
    out, e.g. the operator token of a parse tree, a CLS leaf) and the same parameters
    serve every node at every depth. The families of one depth run as a few batched
    calls (grouped by their padded size, :attr:`~hsa_graph.TreeStructure.child_levels`),
    so a forest costs one step per level and :math:`O(M)` rows in all.

    Args:
        channels: ``C``, the width of the leaf rows and of the node vectors.
        heads: attention heads of each block.
        num_layers: blocks applied to each family.
        hidden_channels: width of each block's feed-forward layer.
        dropout: dropout inside the blocks.

    Shapes:
        - **input:** ``x`` ``[N, C]`` leaf rows (leaf order), ``tree`` a
          :class:`~hsa_graph.NestedSignal` or a PyG ``Batch`` of them.
        - **output:** ``[I, C]`` the internal nodes' vectors in internal row order
          (unified index ``N + row``); :meth:`roots` gives one vector per tree.
    """

    def __init__(self, channels: int, heads: int = 4, num_layers: int = 2,
                 hidden_channels: int = 128, dropout: float = 0.0):
        super().__init__()
        for name, value in (("channels", channels), ("heads", heads),
                            ("num_layers", num_layers), ("hidden_channels", hidden_channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if channels % heads:
            raise ValueError(f"channels ({channels}) must be a multiple of heads ({heads})")
        self.channels, self.heads, self.num_layers = channels, heads, num_layers
        self.hidden_channels, self.dropout = hidden_channels, float(dropout)
        self.blocks = ModuleList([
            TransformerEncoderLayer(channels, heads, hidden_channels, dropout=dropout,
                                    activation="gelu", batch_first=True, norm_first=True)
            for _ in range(num_layers)])
        self.norm = LayerNorm(channels)

    def reset_parameters(self) -> None:
        """Re-initialise every block and the output norm."""
        for module in self.modules():
            if module is self:
                continue
            reset = getattr(module, "reset_parameters", None) or getattr(
                module, "_reset_parameters", None)
            if reset is not None:
                reset()

    def forward(self, x: Tensor, tree) -> Tensor:
        """The internal nodes' vectors ``[I, C]`` (see the class docstring)."""
        structure = _structure(tree, x.device)
        _check_leaf_rows(x, structure)
        if x.dim() != 2 or x.shape[1] != self.channels:
            raise ValueError(f"x must be [N, {self.channels}], got {tuple(x.shape)}")
        levels: List[Tensor] = []
        below = x.new_zeros(0, self.channels)
        for level in structure.child_levels:   # deepest first
            table = torch.cat([below, x.new_zeros(1, self.channels)])   # + the null row
            outputs = []
            for group in level.groups:
                h = torch.where(group.from_leaf.unsqueeze(-1), x[group.leaf_index],
                                table[group.internal_index])
                padding = group.padding if group.width > 1 else None
                for block in self.blocks:
                    h = block(h, src_key_padding_mask=padding)
                outputs.append(h[:, 0])
            below = self.norm(torch.cat(outputs)[level.order])
            levels.append(below)
        if not levels:
            return x.new_zeros(0, self.channels)
        return torch.cat(levels[::-1])

    def roots(self, x: Tensor, tree) -> Tensor:
        """One vector per tree ``[T, C]``, trees in the order of their roots' node index
        (as :func:`~hsa_graph.nn.global_leaf_pool`): an internal root's vector, or the
        leaf row of a tree that is one leaf."""
        structure = _structure(tree, x.device)
        return torch.cat([x, self(x, tree)])[structure.tree_root]

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, heads={self.heads}, "
                f"num_layers={self.num_layers}, hidden_channels={self.hidden_channels})")
