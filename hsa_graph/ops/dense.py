r"""The dense HSA attention matrix, for inspection, plots and tests (small ``N``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .hsa import hsa_statistics
from .inputs import no_autocast, prepare_attention

__all__ = ["hsa_weights"]


def hsa_weights(q: Tensor, k: Tensor, tree, include_self: bool = True,
                scale: Optional[float] = None, pos: Optional[Tensor] = None, *,
                check_finite: bool = False) -> Tensor:
    r"""The attention matrix :math:`\theta` of :func:`~hsa_graph.hsa`, per head.

    .. math::
        \theta_{ij} = m(\mathrm{LCA}(i, j))\, e^{z(A, B) - \mathrm{logaddexp}(\lambda(A), \eta(A))},
        \qquad \theta_{ii} = m(i)\ (0 \text{ without } \texttt{include\_self})

    with :math:`A \ni i`, :math:`B \ni j` the children of the lowest common ancestor;
    zero between leaves of different trees. It uses the same per-node statistics as
    :func:`~hsa_graph.hsa`, so ``hsa_weights(q, k, tree) @ v`` equals
    ``hsa(q, k, v, tree)``. Memory is :math:`O(H N^2 + H M^2)`: use it on small trees.

    Args:
        q, k: ``[N, H, D]`` (or ``[N, D]``), one row per leaf.
        tree, include_self, scale, pos: as in :func:`~hsa_graph.hsa`.
        check_finite: when ``True``, a NaN or inf in ``q``, ``k`` or ``pos`` raises
            ``ValueError`` naming the tensor and its first offending leaf row (node
            row for ``pos``). When ``False`` (default) nothing is checked, and a
            non-finite input only affects the rows and columns of its own tree.

    Returns:
        ``[H, N, N]`` (``[N, N]`` for two-dimensional inputs); row ``i`` is the
        distribution leaf ``i`` attends with.
    """
    x = prepare_attention(q, k, None, tree, include_self=include_self, scale=scale,
                          pos=pos, check_finite=check_finite, need_v=False)
    n = x.structure.num_leaves
    if x.empty:
        return x.empty_result((x.q.shape[1], n, n), head_dim=0)
    with no_autocast(x.device):
        theta = _dense_weights(x.structure, x.q, x.k, x.include_self, x.scale, x.pos)
    return x.finish(theta, head_dim=0)


def _dense_weights(st, q: Tensor, k: Tensor, include_self: bool, scale: float,
                   pos: Optional[Tensor]) -> Tensor:
    stats = hsa_statistics(st, q, k, include_self, scale, pos)
    rq, rk = stats.rq, stats.rk
    dtype = q.dtype

    n = st.num_leaves
    node_q = torch.cat([q, rq[:-1]]).transpose(0, 1)           # [H, M, D], unified order
    node_k = torch.cat([k, rk[:-1]]).transpose(0, 1)
    logits = torch.matmul(node_q, node_k.transpose(-1, -2)) * scale   # [H, M, M]
    if pos is not None:
        node_pos = st.to_unified(pos.to(dtype))
        node_pos = (node_pos.unsqueeze(1) if node_pos.dim() == 2 else node_pos).transpose(0, 1)
        logits = logits + torch.matmul(node_pos, node_pos.transpose(-1, -2))
    total = torch.cat([stats.total_leaf, stats.total_internal[:-1]]).transpose(0, 1)  # [H, M]
    log_m = torch.cat([stats.log_m_leaf, stats.log_m_internal[:-1]]).transpose(0, 1)

    # Children A (holding i) and B (holding j) of the lowest common ancestor of i and j.
    a, b, lca, off_diagonal = st.pair_blocks()
    # Mask the exponent, not the result, so that junk on masked pairs (the diagonal,
    # other trees) cannot turn into NaN gradients.
    log_theta = log_m[:, lca] + logits[:, a, b] - total[:, a]
    theta = torch.exp(log_theta.masked_fill(~off_diagonal, float("-inf")))
    if include_self:
        theta = theta + torch.diag_embed(log_m[:, :n].exp())
    return theta
