r"""A linear map with one set of weights per modality tag (paper appendix F)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module, Parameter

__all__ = ["ModalityLinear"]


class ModalityLinear(Module):
    r"""``y_i = W_{t_i} x_i + b_{t_i}``: a linear map whose weights depend on the
    modality tag :math:`t_i` of each row (e.g. 0 = text token, 1 = image patch).

    The paper's HTE layer projects the leaves of each modality with their own
    query/key/value maps, because one map for heterogeneous inputs "may be an
    over-simplification" (appendix F); HSA itself then treats all leaves alike. With
    ``num_modalities=1`` this is a plain :class:`torch.nn.Linear` (``modality`` is
    ignored). Rows are grouped by tag with one sort, so the cost is one matmul per
    modality type, never a loop over rows.

    Weights are drawn like :class:`torch.nn.MultiheadAttention`'s input projection
    (Xavier-uniform, zero bias), each modality independently.

    Args:
        in_channels: input size ``F``.
        out_channels: output size ``C``.
        num_modalities: ``T``, the number of tags; tags lie in ``[0, T)``.
        bias: whether to add a bias per modality.

    Shapes:
        - **input:** ``x`` ``[N, F]``, ``modality`` ``[N]`` (long, ``T > 1`` only).
        - **output:** ``[N, C]``.

    Example:
        >>> lin = ModalityLinear(4, 3, num_modalities=2)
        >>> x, tag = torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1])
        >>> y = lin(x, tag)
        >>> torch.allclose(y[1], lin.weight[1] @ x[1] + lin.bias[1])
        True
    """

    def __init__(self, in_channels: int, out_channels: int, num_modalities: int = 1,
                 bias: bool = True):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels),
                            ("num_modalities", num_modalities)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.num_modalities = num_modalities
        self.weight = Parameter(torch.empty(num_modalities, out_channels, in_channels))
        self.bias = Parameter(torch.empty(num_modalities, out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights and zero biases, for every modality."""
        bound = math.sqrt(6.0 / (self.in_channels + self.out_channels))
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: Tensor, modality: Optional[Tensor] = None) -> Tensor:
        """``[N, F] -> [N, C]``; ``modality`` ``[N]`` picks each row's weights."""
        if x.dim() != 2 or x.shape[1] != self.in_channels:
            raise ValueError(f"x must have shape [N, {self.in_channels}], got {tuple(x.shape)}")
        if self.num_modalities == 1:
            return F.linear(x, self.weight[0], None if self.bias is None else self.bias[0])
        if modality is None:
            raise ValueError(f"this layer has {self.num_modalities} modalities: pass each "
                             "row's modality tag")
        modality = _check_modality(modality, x.shape[0], self.num_modalities)
        # Group the rows by tag (stable sort), one matmul per tag, and undo the sort.
        order = torch.argsort(modality, stable=True)
        counts = torch.bincount(modality, minlength=self.num_modalities).tolist()
        parts = [F.linear(chunk, self.weight[t], None if self.bias is None else self.bias[t])
                 for t, chunk in enumerate(x[order].split(counts))]
        return torch.cat(parts)[torch.argsort(order)]

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, "
                f"num_modalities={self.num_modalities}, bias={self.bias is not None})")


def _check_modality(modality: Tensor, n: int, num_modalities: int) -> Tensor:
    if not isinstance(modality, Tensor) or modality.is_floating_point() or \
            modality.dtype == torch.bool:
        raise TypeError("modality must be an integer tensor [N]")
    if modality.shape != (n,):
        raise ValueError(f"modality must have shape [{n}] (one tag per row), got "
                         f"{tuple(modality.shape)}")
    modality = modality.long()
    if n and bool(((modality < 0) | (modality >= num_modalities)).any()):
        bad = int(((modality < 0) | (modality >= num_modalities)).nonzero()[0])
        raise ValueError(f"row {bad} has modality tag {int(modality[bad])}, outside "
                         f"[0, {num_modalities}) (num_modalities={num_modalities})")
    return modality
