r"""Multi-head Hierarchical Self-Attention with learnable projections."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import LayerNorm, Linear, Module

from ..geometry import PositionEncoder
from ..ops.cache import BatchedHSACache, HSACache
from ..ops.causal import causal_hsa
from ..ops.hsa import hsa
from ..ops.inputs import compute_dtype, no_autocast
from ..ops.kv_cache import KVCache
from ..signal import flatten
from .linear import ModalityLinear

__all__ = ["ATTENTIONS", "INDUCERS", "HSAttention", "attention_tree"]

#: What :class:`HSAttention` attends over: the tree itself (HSA), the flattened tree
#: (standard softmax attention per tree) or nothing (each leaf only sees itself).
ATTENTIONS = ("hierarchical", "flat", "none")

PositionInput = Union[None, Tensor, Dict[str, Tuple[Tensor, Tensor]]]

#: The tree builders :class:`HSAttention` can run on its own keys (``induce=``):
#: :func:`~hsa_graph.induce.contiguous_tree` and :func:`~hsa_graph.induce.cluster_tree`.
INDUCERS = ("contiguous", "cluster")


def attention_tree(tree, attention: str = "hierarchical"):
    """The tree an :class:`HSAttention` layer with mode ``attention`` runs HSA on:
    ``tree`` itself (``"hierarchical"``), :func:`~hsa_graph.flatten` of it (``"flat"``,
    computed once per tree and cached on it like its structure) or ``None``
    (``"none"``). Position embeddings are computed on this tree.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> attention_tree(tree, "flat").parent.tolist()   # a root over the 5 leaves
        [-1, 0, 0, 0, 0, 0]
        >>> attention_tree(tree, "flat") is attention_tree(tree, "flat")
        True
    """
    if attention == "hierarchical":
        return tree
    if attention == "none":
        return None
    if attention != "flat":
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    edge_index = getattr(tree, "edge_index", None)
    if edge_index is None:
        raise TypeError(f"expected a NestedSignal (or a Batch of them), got "
                        f"{type(tree).__name__}")
    # Same invalidation rule as NestedSignal.structure: rebuilt when edge_index changes.
    signature = (edge_index.data_ptr(), edge_index._version, tuple(edge_index.shape),
                 tree.num_nodes)
    cache = tree.__dict__.get("_flat_tree_cache")
    if cache is None or cache[0] != signature:
        cache = (signature, flatten(tree))
        tree.__dict__["_flat_tree_cache"] = cache
    return cache[1]


class HSAttention(Module):
    r"""Multi-head Hierarchical Self-Attention over the leaves of a nested signal.

    For leaf features :math:`x_i` (rows in increasing node index) and each head
    :math:`h`:

    .. math::
        q_i, k_i, v_i &= W^{t_i}_{q,k,v}\, x_i + b^{t_i}_{q,k,v}
            \quad (\text{one set per modality tag } t_i \text{ if } T > 1) \\
        q_i, k_i &\leftarrow \mathrm{LayerNorm}(q_i), \mathrm{LayerNorm}(k_i)
            \quad (\texttt{qk\_norm}, \text{per head}) \\
        y_i &= W_o\, \big\Vert_h \big[\mathrm{Dropout}(\mathrm{HSA}(q, k, v)_i)
            \;(+\, q_i \text{ with } \texttt{query\_residual})\big] + b_o

    where :func:`~hsa_graph.hsa` adds :math:`\langle \varepsilon(A),
    \varepsilon(B)\rangle` to sibling logits, :math:`\varepsilon` coming from this
    layer's own :class:`~hsa_graph.geometry.PositionEncoder` (a projection per geometry
    type, as in the paper's appendix F) when ``pos_dim`` is set.

    **Causal** (``causal=True``): :math:`\mathrm{HSA}` becomes
    :func:`~hsa_graph.causal_hsa` (same ``include_self``, ``scale`` and ``pos``): row
    :math:`i` is row :math:`i` of HSA on the prefix tree of the leaves :math:`\le i`,
    so output :math:`y_i` depends on leaves :math:`\le i` only (every node's leaves
    must be a contiguous run in leaf order). With ``attention="flat"`` this is causal
    softmax attention within each tree; ``attention="none"`` is causal already. The
    layer then also generates one token at a time: :meth:`new_cache` and
    :meth:`step` give, token by token, the rows of the parallel forward (to
    rounding). Projections, ``qk_norm`` / ``v_norm``, modalities, ``query_residual``
    and dropout act on each token alone, so :meth:`step` applies them unchanged;
    position embeddings (``pos_dim``) are refused by :meth:`step`, since a node's
    embedding comes from its place in the whole tree (its parent's geometry), which
    the cache does not hold.

    **Induced trees** (``induce=``): the tree comes from the layer's own keys at
    forward time: :func:`~hsa_graph.induce.contiguous_tree` (``"contiguous"``) or
    :func:`~hsa_graph.induce.cluster_tree` (``"cluster"``) of the normalised keys of
    all heads side by side, ``[N, H * D]``, without gradient (the choice of tree is
    discrete); HSA on it is exact and differentiable in ``q, k, v`` as on any tree.
    A given ``tree`` then only says which leaves form one sequence (one induced tree
    per tree of the forest, ``tree.structure.leaf_tree``) and their modalities; with
    ``tree=None``, ``batch=`` does (default: one sequence). Position embeddings are
    computed on the induced tree by this layer's encoder (``pos`` must be ``None``).
    Not with ``causal=True`` (the tree would read later tokens) nor with the
    ``"flat"`` / ``"none"`` baselines.

    **Dropout.** :func:`~hsa_graph.hsa` never forms the attention matrix, so there is
    no attention-*weight* dropout (zeroing entries :math:`\theta_{ij}` as
    :class:`torch.nn.MultiheadAttention` does): ``dropout`` zeroes entries of each
    head's attention *output* :math:`\mathrm{HSA}(q, k, v)_i` (scaled by
    :math:`1/(1-p)`), before the query residual and the output projection. It
    regularises like attention dropout but is not the same random function: on a flat
    tree (with ``qk_norm=False``, ``include_self=True``, no positions) the layer equals
    :class:`torch.nn.MultiheadAttention` given the same weights only in evaluation mode
    or with ``dropout=0``.

    **Precision.** The attention itself runs in float32 (float64 for float64 inputs)
    with autocast switched off: under ``torch.autocast`` the projections run in
    bfloat16/float16, but the logits, soft-maxes and masses of HSA do not.

    **Baselines on the same code path** (``attention=``): ``"hierarchical"`` (HSA on
    the tree), ``"flat"`` (the same layer on :func:`~hsa_graph.flatten` of the tree:
    standard softmax attention within each tree, positions then being each leaf's
    index in its tree) and ``"none"`` (attention disabled: each leaf attends only to
    itself, :math:`\mathrm{HSA}(q, k, v)_i = v_i`; a stack of such layers followed by a
    global pooling is a DeepSet).

    Args:
        in_channels: leaf feature size ``F``.
        heads: ``H``.
        head_channels: ``D`` per head; default ``in_channels // heads``.
        out_channels: output size; default ``in_channels``.
        num_modalities: ``T``; with ``T > 1`` the query/key/value projections have
            one set of weights per modality tag (``tree.modality`` of the leaves).
        qk_norm: LayerNorm on queries and keys after projection, over each head's
            ``D`` channels (the paper's choice: it makes HSA the minimiser of the
            energy in its Theorem 3.2).
        v_norm: LayerNorm on values too (the paper's figure 4 draws it on all three).
        pos_dim: ``P``, the size of the position embeddings per head; ``None`` for no
            position embeddings.
        pos_kwargs: further arguments of :class:`~hsa_graph.geometry.PositionEncoder`
            (``dim``, ``kind``, ``sigma``, ``seed``, ``graph``, ``graph_dim``,
            ``field_names``, ``bias``).
        include_self: whether a leaf attends to itself inside HSA (``True``: a flat
            tree gives softmax attention; the paper's HTE layer uses ``False`` and a
            query residual).
        attention: ``"hierarchical"``, ``"flat"`` or ``"none"`` (see above).
        dropout: probability of zeroing attention outputs (see above).
        query_residual: add each head's (normalised) query to its attention output
            before the output projection, as in the paper's figure 4.
        causal: causal HSA (see above): leaf :math:`i` reads leaves :math:`\le i`.
        bias: biases of the projections.
        scale: logit scale; ``1 / sqrt(D)`` by default.
        induce: build the tree at forward time from this layer's own keys (see
            above): ``"contiguous"``, ``"cluster"`` or a callable
            ``(keys [N, H * D], batch [N]) -> NestedSignal``; ``None`` (default)
            attends over the given tree.

    Shapes:
        - **input:** ``x`` ``[N, F]`` (one row per leaf of ``tree``); ``tree`` a
          :class:`~hsa_graph.NestedSignal` or a PyG ``Batch`` of them (a forest:
          attention never crosses trees); ``pos`` optional: ``None`` (this layer's
          encoder computes the embeddings), a ``dict`` of raw features from
          :meth:`PositionEncoder.features` (shared by the layers of an encoder), or a
          ready tensor ``[M, P]`` / ``[M, H, P]`` over the nodes of
          :func:`attention_tree`.
        - **output:** ``[N, out_channels]``.
        - :meth:`step` (``causal=True``): one token ``[F]`` -> ``[out_channels]``.

    Example:
        >>> import hsa_graph
        >>> _ = torch.manual_seed(0)
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> attn = HSAttention(16, heads=4, pos_dim=8)
        >>> attn
        HSAttention(16, 16, heads=4, head_channels=4, attention='hierarchical',
                    include_self=True, qk_norm=True, v_norm=False, num_modalities=1,
                    pos_dim=8, dropout=0.0)
        >>> attn(torch.randn(5, 16), tree).shape
        torch.Size([5, 16])

        Causal, in parallel and one token at a time (``moves_of`` says where each
        leaf of ``tree`` hangs):

        >>> causal = HSAttention(16, heads=4, causal=True).double()
        >>> x = torch.randn(5, 16, dtype=torch.float64)
        >>> cache = causal.new_cache()
        >>> steps = [causal.step(x[i], cache, **move)
        ...          for i, move in enumerate(hsa_graph.HSACache.moves_of(tree))]
        >>> bool(torch.allclose(torch.stack(steps), causal(x, tree)))
        True

        A tree from the layer's own keys, for leaves that come without one (two
        sequences of 4 and 3 leaves):

        >>> induced = HSAttention(16, heads=4, induce="contiguous")
        >>> x = torch.randn(7, 16)
        >>> induced(x, batch=torch.tensor([0, 0, 0, 0, 1, 1, 1])).shape
        torch.Size([7, 16])
        >>> induced.induced_tree(x).structure.num_leaves
        7
    """

    def __init__(self, in_channels: int, heads: int = 1, head_channels: Optional[int] = None,
                 out_channels: Optional[int] = None, *, num_modalities: int = 1,
                 qk_norm: bool = True, v_norm: bool = False, pos_dim: Optional[int] = None,
                 pos_kwargs: Optional[Dict[str, Any]] = None, include_self: bool = True,
                 attention: str = "hierarchical", dropout: float = 0.0,
                 query_residual: bool = False, bias: bool = True,
                 scale: Optional[float] = None, causal: bool = False,
                 induce: Union[None, str, Callable[[Tensor, Tensor], Any]] = None):
        super().__init__()
        _positive("in_channels", in_channels)
        _positive("heads", heads)
        if head_channels is None:
            if in_channels % heads:
                raise ValueError(f"in_channels={in_channels} is not divisible by heads={heads}; "
                                 "pass head_channels=")
            head_channels = in_channels // heads
        _positive("head_channels", head_channels)
        out_channels = in_channels if out_channels is None else out_channels
        _positive("out_channels", out_channels)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
        if pos_dim is not None:
            _positive("pos_dim", pos_dim)
        elif pos_kwargs:
            raise ValueError("pos_kwargs given without pos_dim")
        if scale is not None and not scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        _check_induce(induce, attention, causal)

        self.in_channels, self.out_channels = in_channels, out_channels
        self.heads, self.head_channels = heads, head_channels
        self.num_modalities = num_modalities
        self.include_self, self.attention = bool(include_self), attention
        self.dropout, self.query_residual = float(dropout), bool(query_residual)
        self.scale = scale
        self.pos_dim = pos_dim
        self.causal = bool(causal)
        self.induce = induce
        inner = heads * head_channels
        # q, k and v in one matmul; rows laid out [q | k | v], each [H, D] (as the
        # in_proj of torch.nn.MultiheadAttention).
        self.qkv = ModalityLinear(in_channels, 3 * inner, num_modalities, bias=bias)
        self.q_norm = LayerNorm(head_channels) if qk_norm else None
        self.k_norm = LayerNorm(head_channels) if qk_norm else None
        self.v_norm = LayerNorm(head_channels) if v_norm else None
        self.pos_encoder = (PositionEncoder(pos_dim, heads=heads, **(pos_kwargs or {}))
                            if pos_dim is not None else None)
        self.out_proj = Linear(inner, out_channels, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise every projection, norm and position encoder."""
        self.qkv.reset_parameters()
        for norm in (self.q_norm, self.k_norm, self.v_norm):
            if norm is not None:
                norm.reset_parameters()
        if self.pos_encoder is not None:
            self.pos_encoder.reset_parameters()
        self.out_proj.reset_parameters()

    def attention_tree(self, tree):
        """The tree this layer attends over (see :func:`attention_tree`)."""
        return attention_tree(tree, self.attention)

    def _project(self, x: Tensor, modality: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
        """``[N, F]`` -> ``q, k, v`` ``[N, H, D]``, normalised as configured (row-wise:
        the same for a whole tree and for one token)."""
        q, k, v = self.qkv(x, modality).view(x.shape[0], 3, self.heads,
                                              self.head_channels).unbind(1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        return q, k, v

    def _finish(self, y: Tensor, q: Tensor) -> Tensor:
        """Dropout, query residual and output projection of attention outputs
        ``[N, H, D]`` -> ``[N, out_channels]``."""
        y = F.dropout(y, self.dropout, self.training)
        if self.query_residual:
            y = y + q.to(y.dtype)
        return self.out_proj(y.reshape(y.shape[0], self.heads * self.head_channels))

    def forward(self, x: Tensor, tree=None, pos: PositionInput = None, *,
                batch: Optional[Tensor] = None) -> Tensor:
        """Leaf outputs ``[N, out_channels]`` (see the class docstring); ``tree`` may be
        ``None`` (and ``batch`` given) only when the layer induces its tree."""
        structure = self._input_structure(x, tree, batch)
        n = structure.num_leaves if structure is not None else x.shape[0]
        if x.dim() != 2 or x.shape[0] != n or x.shape[1] != self.in_channels:
            raise ValueError(f"x must have shape [N, {self.in_channels}] with one row per leaf "
                             f"(N = {n}), got {tuple(x.shape)}")
        modality = (leaf_modalities(tree, structure, self.num_modalities, x.device)
                    if structure is not None else None)
        q, k, v = self._project(x, modality)

        if self.induce is not None:
            target = self._induce(k, structure, batch)
        else:
            target = self.attention_tree(tree)
        if target is None:  # attention disabled: theta = identity
            y = v
        else:
            embeddings = self._positions(target, pos)
            # The op's compute dtype, outside autocast: under autocast the projections
            # are half precision and the norms float32, and autocast would run HSA's
            # matmuls in half precision again.
            dtype = compute_dtype(torch.promote_types(q.dtype, v.dtype))
            op = causal_hsa if self.causal else hsa
            with no_autocast(x.device):
                y = op(q.to(dtype), k.to(dtype), v.to(dtype), target,
                       include_self=self.include_self, scale=self.scale,
                       pos=None if embeddings is None else embeddings.to(dtype))
            y = y.to(v.dtype)
        return self._finish(y, q)

    @torch.no_grad()
    def induced_tree(self, x: Tensor, tree=None, *, batch: Optional[Tensor] = None):
        """The tree :meth:`forward` attends over for input ``x`` (``induce=`` set):
        built from this layer's keys of ``x``, one per tree of ``tree`` (or per
        ``batch`` id). Used to count the attention's cost (FLOPs) on it.

        Raises:
            ValueError: the layer does not induce its tree (``induce=None``).
        """
        if self.induce is None:
            raise ValueError("induced_tree needs a layer that induces its tree "
                             "(HSAttention(..., induce='contiguous'))")
        structure = self._input_structure(x, tree, batch)
        modality = (leaf_modalities(tree, structure, self.num_modalities, x.device)
                    if structure is not None else None)
        return self._induce(self._project(x, modality)[1], structure, batch)

    def _input_structure(self, x: Tensor, tree, batch: Optional[Tensor]):
        """The given tree's structure (``None`` when an inducing layer gets none)."""
        if tree is None and self.induce is not None:
            check_features(self, x)
            if self.num_modalities > 1:
                raise ValueError(f"this layer has {self.num_modalities} modalities: pass "
                                 "a tree (its leaves' modality tags) with the leaves")
            return None
        if tree is None:
            raise TypeError("HSAttention needs a tree (a NestedSignal or a Batch of them); "
                            "only a layer with induce= builds its own")
        if batch is not None:
            raise ValueError("batch= goes with tree=None (an inducing layer reads the "
                             "sequences of a given tree from the tree)")
        return _structure(tree, x, self)

    def _induce(self, k: Tensor, structure, batch: Optional[Tensor]):
        """The tree built from keys ``[N, H, D]`` (no gradient)."""
        if structure is not None:
            batch = structure.leaf_tree
        build = self.induce
        if isinstance(build, str):
            from .. import induce as _induce_module

            build = getattr(_induce_module, f"{build}_tree")
        keys = k.detach().reshape(k.shape[0], -1)
        with torch.no_grad():
            target = build(keys, batch)
        made = getattr(target, "structure_for", None)
        if made is None or target.structure_for(k.device).num_leaves != k.shape[0]:
            raise ValueError(f"induce= must return a NestedSignal with one leaf per row of "
                             f"x ({k.shape[0]}), got {type(target).__name__}"
                             + (f" with {target.num_leaves} leaves" if made is not None
                                else ""))
        return target

    def new_cache(self, batch_size: Optional[int] = None
                  ) -> Union[HSACache, BatchedHSACache, KVCache]:
        """An empty cache for :meth:`step`, with this layer's ``include_self`` and
        ``scale``: an :class:`~hsa_graph.HSACache` (one sequence, tokens ``[F]``), or
        with ``batch_size`` a :class:`~hsa_graph.ops.cache.BatchedHSACache` of that
        many empty sequences (tokens ``[B, F]``; :meth:`prefill` adds prompts). A
        ``"flat"`` layer gets a flat :class:`~hsa_graph.ops.kv_cache.KVCache` there
        instead (its keys and values: causal softmax attention, what the layer computes
        on the flattened tree).

        Raises:
            ValueError: the layer is not causal, or a bad ``batch_size``.
        """
        self._check_generates("new_cache")
        if batch_size is None:
            return HSACache(include_self=self.include_self, scale=self.scale)
        if self.attention == "flat":
            return KVCache(batch_size, include_self=self.include_self, scale=self.scale)
        return BatchedHSACache(batch_size, include_self=self.include_self, scale=self.scale)

    def _check_cache(self, cache, kinds: tuple) -> None:
        if not isinstance(cache, kinds):
            names = " or ".join(kind.__name__ for kind in kinds)
            raise TypeError(f"cache must be an {names} (from new_cache()), got "
                            f"{type(cache).__name__}")
        if isinstance(cache, KVCache) and self.attention != "flat":
            # a flat cache would silently turn this layer's attention into softmax
            raise TypeError(f"a KVCache holds flat attention, but this layer has attention="
                            f"{self.attention!r}: make its cache with new_cache()")
        if cache.include_self != self.include_self or cache.scale != (
                None if self.scale is None else float(self.scale)):
            raise ValueError(
                f"cache was made with include_self={cache.include_self}, "
                f"scale={cache.scale} but this layer has include_self={self.include_self}, "
                f"scale={self.scale}: make it with this layer's new_cache()")

    def prefill(self, x: Tensor, tree, cache: Union[BatchedHSACache, KVCache],
                modality: Optional[Tensor] = None) -> Tensor:
        r"""Start one sequence of ``cache`` per tree of ``tree`` from its prompt and return
        the prompt's outputs ``[N, out_channels]``: :meth:`forward` on it, while the
        cache takes the state that stepping through the prompt would build
        (:meth:`BatchedHSACache.prefill <hsa_graph.ops.cache.BatchedHSACache.prefill>`).

        Args:
            x: ``[N, F]`` leaf rows of ``tree`` (one tree or a batch: one sequence each).
            tree: the prompts' trees; cache: a batched cache from :meth:`new_cache` (a
                :class:`~hsa_graph.ops.kv_cache.KVCache` of a ``"flat"`` layer takes
                each tree's tokens in leaf order).
            modality: leaf modality tags ``[N]`` (else read from ``tree`` as in
                :meth:`forward`).

        Raises:
            ValueError / TypeError: as :meth:`forward` and :meth:`step`.
        """
        self._check_generates("prefill")
        self._refuse_positions("prefill")
        self._check_cache(cache, (BatchedHSACache, KVCache))
        structure = _structure(tree, x, self)
        n = structure.num_leaves
        if x.dim() != 2 or x.shape[0] != n or x.shape[1] != self.in_channels:
            raise ValueError(f"x must have shape [N, {self.in_channels}] with one row per leaf "
                             f"(N = {n}), got {tuple(x.shape)}")
        if modality is None:
            modality = leaf_modalities(tree, structure, self.num_modalities, x.device)
        q, k, v = self._project(x, modality)
        # with attention "none" the cache still records the prompts' trees
        target = tree if self.attention == "none" else self.attention_tree(tree)
        dtype = compute_dtype(torch.promote_types(q.dtype, v.dtype))
        with no_autocast(x.device):
            if isinstance(cache, KVCache):
                y = cache.prefill_rows(q.to(dtype), k.to(dtype), v.to(dtype),
                                       _tree_lengths(structure))
            else:
                y = cache.prefill(q.to(dtype), k.to(dtype), v.to(dtype), target)
        y = v if self.attention == "none" else y.to(v.dtype)
        return self._finish(y, q)

    def _refuse_positions(self, what: str) -> None:
        if self.pos_encoder is not None:
            raise ValueError(
                f"HSAttention.{what} does not support position embeddings (pos_dim="
                f"{self.pos_dim}): a node's embedding comes from its place in its "
                "parent's geometry, which needs the whole tree; use pos_dim=None to "
                "generate token by token")

    def step(self, x: Tensor, cache: Union[HSACache, BatchedHSACache, KVCache], *,
             modality: Optional[Union[int, Tensor]] = None, **where: Any) -> Tensor:
        r"""The output for one new token (per sequence), equal (to rounding) to its row of
        the parallel causal :meth:`forward` on the tree the calls so far have built.

        The token is projected (per modality), normalised, attended with
        :meth:`HSACache.append <hsa_graph.HSACache.append>` (which stores it) and
        projected out, as one row of :meth:`forward`. With ``attention="flat"`` the
        placement is ignored: every token joins one root, as on
        :func:`~hsa_graph.flatten` of the tree. With ``attention="none"`` the output
        is the token's own value; the token is still recorded in ``cache`` (so
        ``cache.parent`` and ``cache.num_tokens`` follow the tree).

        Args:
            x: the token's features ``[F]``; ``[B, F]`` (one token per sequence) with a
                :class:`~hsa_graph.ops.cache.BatchedHSACache` or
                :class:`~hsa_graph.ops.kv_cache.KVCache`.
            cache: from :meth:`new_cache`.
            modality: the token's modality tag (needed when ``num_modalities > 1``,
                ignored otherwise, as ``tree.modality`` is in :meth:`forward`); for a
                batch an int for all or an integer tensor ``[B]``.
            **where: ``attach`` / ``depth``, where the token hangs (see
                :meth:`HSACache.append <hsa_graph.HSACache.append>`; per sequence for
                a batch, see :meth:`BatchedHSACache.step
                <hsa_graph.ops.cache.BatchedHSACache.step>`).

        Returns:
            ``[out_channels]`` (``[B, out_channels]`` for a batch).

        Raises:
            ValueError: the layer is not causal or has position embeddings
                (``pos_dim``: a node's embedding needs the whole tree), ``x`` is not
                ``[F]`` (``[B, F]``), ``cache`` was made with another ``include_self`` /
                ``scale``, a bad ``modality`` or placement.
            TypeError: ``x`` is not a floating tensor of the parameters' dtype,
                ``cache`` is not an :class:`~hsa_graph.HSACache` (or batched one), or
                an unknown keyword.
        """
        self._check_generates("step")
        self._refuse_positions("step")
        check_features(self, x)
        if isinstance(cache, (BatchedHSACache, KVCache)):
            return self._step_batch(x, cache, modality, where)
        if x.dim() != 1 or x.shape[0] != self.in_channels:
            raise ValueError(f"x must be one token of shape [{self.in_channels}], got "
                             f"{tuple(x.shape)}")
        self._check_cache(cache, (HSACache,))
        self._check_where(where)
        tag = self._token_modality(modality, x.device)
        q, k, v = self._project(x[None], tag)
        if self.attention == "flat":   # one root over all tokens, as flatten(tree)
            where = {}
        dtype = compute_dtype(torch.promote_types(q.dtype, v.dtype))
        with no_autocast(x.device):
            y = cache.append(q[0].to(dtype), k[0].to(dtype), v[0].to(dtype), **where)
        y = v[0] if self.attention == "none" else y.to(v.dtype)
        return self._finish(y[None], q)[0]

    @staticmethod
    def _check_where(where: Dict[str, Any]) -> None:
        unknown = sorted(set(where) - {"attach", "depth"})
        if unknown:
            raise TypeError(f"step got unexpected keyword(s) {unknown}; a placement is "
                            "attach= and/or depth=")

    def _step_batch(self, x: Tensor, cache: Union[BatchedHSACache, KVCache], modality,
                    where) -> Tensor:
        """:meth:`step` for a batch of sequences: ``[B, F]`` -> ``[B, out_channels]``."""
        self._check_cache(cache, (BatchedHSACache, KVCache))
        self._check_where(where)
        if x.dim() != 2 or x.shape[1] != self.in_channels or x.shape[0] != cache.batch_size:
            raise ValueError(f"x must have shape [B, {self.in_channels}] with B = "
                             f"{cache.batch_size} sequences (one token each), got "
                             f"{tuple(x.shape)}")
        tags = self._batch_modality(modality, x.shape[0], x.device)
        q, k, v = self._project(x, tags)
        if self.attention == "flat":   # one root over all tokens, as flatten(tree)
            where = {}
        dtype = compute_dtype(torch.promote_types(q.dtype, v.dtype))
        with no_autocast(x.device):
            y = cache.step(q.to(dtype), k.to(dtype), v.to(dtype), **where)
        y = v if self.attention == "none" else y.to(v.dtype)
        return self._finish(y, q)

    def _batch_modality(self, modality, batch: int, device: torch.device
                        ) -> Optional[Tensor]:
        if self.num_modalities <= 1:
            return None
        if isinstance(modality, Tensor):
            if modality.is_floating_point() or modality.dtype == torch.bool or \
                    modality.shape != (batch,):
                raise TypeError(f"modality must be an integer tensor [B] (B = {batch}), got "
                                f"a {modality.dtype} tensor of shape {tuple(modality.shape)}")
            bad = (modality < 0) | (modality >= self.num_modalities)
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise ValueError(f"modality[{row}] = {int(modality[row])} is outside "
                                 f"[0, {self.num_modalities}) (num_modalities="
                                 f"{self.num_modalities})")
            return modality.to(device)
        return self._token_modality(modality, device).expand(batch)

    def _check_generates(self, what: str) -> None:
        if not self.causal:
            raise ValueError(f"HSAttention.{what} needs a causal layer "
                             "(HSAttention(..., causal=True))")

    def _token_modality(self, modality: Optional[int], device: torch.device
                        ) -> Optional[Tensor]:
        if self.num_modalities <= 1:
            return None
        if modality is None:
            raise ValueError(f"this layer has {self.num_modalities} modalities: pass the "
                             "token's tag, step(x, cache, modality=t)")
        if isinstance(modality, Tensor):
            if modality.numel() != 1 or modality.is_floating_point() or \
                    modality.dtype == torch.bool:
                raise TypeError(f"modality must be one integer tag, got a {modality.dtype} "
                                f"tensor of shape {tuple(modality.shape)}")
            modality = int(modality)
        if isinstance(modality, bool) or not isinstance(modality, int):
            raise TypeError(f"modality must be an int tag, got {type(modality).__name__}")
        if not 0 <= modality < self.num_modalities:
            raise ValueError(f"modality {modality} is outside [0, {self.num_modalities}) "
                             f"(num_modalities={self.num_modalities})")
        return torch.tensor([modality], device=device)

    def _positions(self, target, pos: PositionInput) -> Optional[Tensor]:
        if self.induce is not None and pos is not None:
            raise ValueError("positions were given for the input tree, but this layer "
                             "attends over the tree it induces: pass pos=None (its encoder "
                             "embeds the induced tree)")
        if isinstance(pos, Tensor):
            return pos
        if pos is not None and not isinstance(pos, dict):
            raise TypeError(f"pos must be None, a tensor or a dict of raw position features, "
                            f"got {type(pos).__name__}")
        if self.pos_encoder is None:
            if pos is not None:
                raise ValueError("raw position features were given but this layer has no "
                                 "position encoder (pos_dim=None)")
            return None
        return self.pos_encoder(target, pos)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, "
                f"heads={self.heads}, head_channels={self.head_channels}, "
                f"attention={self.attention!r}, include_self={self.include_self}, "
                f"qk_norm={self.q_norm is not None}, v_norm={self.v_norm is not None}, "
                f"num_modalities={self.num_modalities}, pos_dim={self.pos_dim}, "
                f"dropout={self.dropout}"
                + (", query_residual=True" if self.query_residual else "")
                + (", causal=True" if self.causal else "")
                + (f", induce={self.induce!r}" if self.induce is not None else "") + ")")


def _check_induce(induce: Any, attention: str, causal: bool) -> None:
    if induce is None:
        return
    if isinstance(induce, str):
        if induce not in INDUCERS:
            raise ValueError(f"induce must be one of {INDUCERS}, a callable or None, got "
                             f"{induce!r}")
    elif not callable(induce):
        raise TypeError(f"induce must be one of {INDUCERS}, a callable or None, got "
                        f"{type(induce).__name__}")
    if attention != "hierarchical":
        raise ValueError(f"induce= builds a hierarchy; attention={attention!r} does not use "
                         "one (use attention='hierarchical')")
    if causal:
        raise ValueError("induce= with causal=True: the induced tree would depend on later "
                         "tokens' keys, so outputs would no longer depend on leaves <= i "
                         "only")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def leaf_modalities(tree, structure, num_modalities: int,
                    device: torch.device) -> Optional[Tensor]:
    """The modality tag of each leaf row of ``tree`` (``None`` with one modality)."""
    if num_modalities <= 1:
        return None
    tags = getattr(tree, "modality", None)
    if tags is None:
        raise ValueError("num_modalities > 1 needs tree.modality")
    # leaves are the first N unified nodes, in increasing node index = row order
    return tags.to(device)[structure.node_of_unified[:structure.num_leaves]]


def check_features(module: Module, x: Tensor) -> None:
    """Raise ``TypeError`` unless ``x`` is a floating tensor of ``module``'s parameter
    dtype (a float64 ``x`` into a float32 layer would otherwise fail deep in a matmul)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point (embed token ids first), got {x.dtype}")
    param = next(module.parameters(), None)
    if param is not None and x.dtype != param.dtype and not torch.is_autocast_enabled(
            x.device.type):
        raise TypeError(
            f"x is {x.dtype} but the parameters of {module.__class__.__name__} are "
            f"{param.dtype}: cast one to the other (e.g. module.to({x.dtype}))")


def _tree_lengths(structure) -> Tensor:
    """Leaves per tree ``[T]`` (CPU) of a forest whose trees hold consecutive leaf rows
    (what a flat cache needs to take each tree as one sequence).

    Raises:
        ValueError: the leaves of a tree are not consecutive rows, or a tree has none.
    """
    leaf_tree = structure.leaf_tree
    if leaf_tree.numel() > 1 and bool((leaf_tree[1:] < leaf_tree[:-1]).any()):
        row = int((leaf_tree[1:] < leaf_tree[:-1]).nonzero()[0, 0]) + 1
        raise ValueError(f"prefill needs the leaves of each tree in consecutive rows, but "
                         f"leaf row {row} goes back to tree {int(leaf_tree[row])}")
    lengths = torch.bincount(leaf_tree, minlength=structure.num_trees).cpu()
    if bool((lengths == 0).any()):
        raise ValueError(f"tree {int((lengths == 0).nonzero()[0, 0])} of the prompts has "
                         "no leaf (an empty prompt)")
    return lengths


def _structure(tree, x: Tensor, module: Optional[Module] = None):
    """The structure of ``tree`` on ``x``'s device; ``x`` is checked against ``module``'s
    dtype when one is given (callers that cast ``x`` themselves pass none)."""
    if module is not None:
        check_features(module, x)
    elif not isinstance(x, Tensor) or not x.is_floating_point():
        check_features(Module(), x)  # the type checks alone, for their messages
    structure_for = getattr(tree, "structure_for", None)
    if structure_for is None:
        raise TypeError(f"tree must be a NestedSignal or a PyG Batch of them, got "
                        f"{type(tree).__name__}")
    return structure_for(x.device)
