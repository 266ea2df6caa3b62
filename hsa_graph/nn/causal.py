r"""Causal HSA modules: a decoder layer and a small language model, both on
:class:`~hsa_graph.nn.HSAttention` with ``causal=True``.

Training runs :func:`~hsa_graph.ops.causal.causal_hsa` over whole trees (or a PyG batch
of them) at once; generation prefills one :class:`~hsa_graph.ops.cache.BatchedHSACache`
per layer from a batch of prompts, then runs one token per sequence per step through
it, with outputs equal to the parallel ones (a model with ``attention="flat"``
generates the same way with a flat :class:`~hsa_graph.ops.kv_cache.KVCache`).
A flat transformer is the same model on a flat tree (one root over the tokens), which
makes the comparison in ``examples/causal_lm.py`` like for like.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Embedding, LayerNorm, Module, ModuleList

from ..geometry import sinusoidal_encoding
from ..ops.cache import BatchedHSACache, HSACache, parents_of_moves
from ..ops.inputs import resolve_structure
from ..ops.kv_cache import KVCache
from ..signal import NestedSignal, collate
from .attention import HSAttention, PositionInput, _positive, check_features
from .encoder import HSATransformerEncoderLayer

__all__ = ["CausalHSAttention", "CausalDecoderLayer", "HierarchicalCausalLM"]


class CausalHSAttention(HSAttention):
    r"""Alias kept for compatibility: ``HSAttention(channels, heads,
    include_self=include_self, causal=True, qk_norm=False)``.

    Multi-head causal HSA with plain projections (no q/k LayerNorm, one modality, no
    positions, no dropout),

    .. math::
        y = W_o \big\Vert_h \mathrm{CausalHSA}(W_q x, W_k x, W_v x)_h + b_o,

    where row :math:`i` of causal HSA reads only leaves :math:`\le i` (see
    :func:`~hsa_graph.ops.causal.causal_hsa`). Everything else (:meth:`step`,
    :meth:`new_cache`, ...) is :class:`~hsa_graph.nn.HSAttention`'s; new code should
    use ``HSAttention(..., causal=True)``, which also has ``qk_norm``, modalities,
    position embeddings, dropout and the ``"flat"`` / ``"none"`` baselines.

    Args:
        channels: feature size ``C`` (divisible by ``heads``).
        heads: number of heads ``H``.
        include_self: whether a token attends to itself.

    Shapes: ``x`` ``[N, C]`` (leaf rows) -> ``[N, C]``; :meth:`step`: ``[C]`` -> ``[C]``.

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.nn.causal import CausalHSAttention
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> attn = CausalHSAttention(8, heads=2).double()
        >>> x = torch.randn(5, 8, dtype=torch.float64)
        >>> y = attn(x, tree)
        >>> cache = attn.new_cache()
        >>> steps = [attn.step(x[0], cache, depth=2), attn.step(x[1], cache)]
        >>> steps += [attn.step(x[i], cache, attach=0) if i == 2 else attn.step(x[i], cache)
        ...           for i in (2, 3, 4)]
        >>> cache.parent
        [-1, 0, 1, 1, 0, 4, 4, 4]
        >>> bool(torch.allclose(torch.stack(steps), y))
        True
    """

    def __init__(self, channels: int, heads: int = 1, include_self: bool = True):
        super().__init__(channels, heads, include_self=include_self, qk_norm=False,
                         causal=True)

    @property
    def channels(self) -> int:
        """The feature size ``C`` (``in_channels``)."""
        return self.in_channels


class CausalDecoderLayer(HSATransformerEncoderLayer):
    r"""Pre-norm decoder block on causal :class:`~hsa_graph.nn.HSAttention`:

    .. math::
        x &\leftarrow x + \mathrm{Dropout}(\mathrm{HSAttention}_{\text{causal}}(\mathrm{LN}(x))) \\
        x &\leftarrow x + \mathrm{Dropout}(\mathrm{FFN}(\mathrm{LN}(x)))

    :class:`~hsa_graph.nn.HSATransformerEncoderLayer` with ``causal=True``, plus
    :meth:`step` for generation.

    Args:
        channels: feature size ``C``.
        heads: number of heads.
        ffn_channels: hidden size of the feed-forward network (``4 C``).
        include_self: whether a token attends to itself.
        act: activation of the FFN (any name of :mod:`torch_geometric.nn.resolver`).
        dropout: dropout on the attention outputs and on both residual branches.
        **kwargs: further arguments of :class:`~hsa_graph.nn.HSAttention`
            (``qk_norm`` (default ``True``), ``v_norm``, ``head_channels``,
            ``num_modalities``, ``pos_dim``, ``pos_kwargs``, ``attention``, ``scale``,
            ``bias``, ``query_residual``); :meth:`step` refuses ``pos_dim``.

    Shapes:
        - **input:** ``x`` ``[N, C]``, ``tree`` with ``N`` leaves; :meth:`step`: ``[C]``.
        - **output:** ``[N, C]``; :meth:`step`: ``[C]``.

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.nn.causal import CausalDecoderLayer
        >>> layer = CausalDecoderLayer(8, heads=2)
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0])
        >>> layer(torch.randn(3, 8), tree).shape
        torch.Size([3, 8])
    """

    def __init__(self, channels: int, heads: int = 1, ffn_channels: Optional[int] = None,
                 include_self: bool = True, *, act: str = "gelu", dropout: float = 0.0,
                 **kwargs: Any):
        if "causal" in kwargs:
            raise TypeError("CausalDecoderLayer is always causal: do not pass causal=")
        _positive("channels", channels)
        if ffn_channels is not None:
            _positive("ffn_channels", ffn_channels)
        super().__init__(channels, heads, ffn_channels=ffn_channels, act=act, dropout=dropout,
                         include_self=include_self, causal=True, **kwargs)
        self.ffn_channels = ffn_channels or 4 * channels

    def forward(self, x: Tensor, tree, pos: PositionInput = None) -> Tensor:
        r"""``[N, C] -> [N, C]``; row :math:`i` depends on rows :math:`\le i` only."""
        return super().forward(x, tree, pos)

    def new_cache(self, batch_size: Optional[int] = None
                  ) -> Union[HSACache, BatchedHSACache, KVCache]:
        """An empty cache for :meth:`step` (see :meth:`HSAttention.new_cache`)."""
        return self.attn.new_cache(batch_size)

    def prefill(self, x: Tensor, tree, cache: Union[BatchedHSACache, KVCache]) -> Tensor:
        """:meth:`forward` on prompts ``[N, C]`` that also starts one sequence of
        ``cache`` per tree (see :meth:`HSAttention.prefill`)."""
        check_features(self, x)
        x = x + F.dropout(self.attn.prefill(self.norm1(x), tree, cache), self.dropout,
                          self.training)
        return x + F.dropout(self.ffn(self.norm2(x)), self.dropout, self.training)

    def step(self, x: Tensor, cache: Union[HSACache, BatchedHSACache, KVCache],
             **where: Any) -> Tensor:
        """One token ``[C]`` -> ``[C]`` (or one per sequence, ``[B, C]`` -> ``[B, C]``
        with a batched cache), its row of :meth:`forward`; ``where`` (``attach``,
        ``depth``, ``modality``) as in :meth:`HSAttention.step`."""
        check_features(self, x)
        x = x + F.dropout(self.attn.step(self.norm1(x), cache, **where), self.dropout,
                          self.training)
        return x + F.dropout(self.ffn(self.norm2(x)), self.dropout, self.training)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, heads={self.attn.heads}, "
                f"ffn_channels={self.ffn_channels}, attention={self.attn.attention!r}, "
                f"qk_norm={self.attn.q_norm is not None}, causal=True)")


class HierarchicalCausalLM(Module):
    r"""A small decoder-only language model over the leaves (tokens) of trees.

    .. math::
        x^{(0)}_i = \sqrt{C}\, E[t_i] + e(p_i), \qquad
        x^{(l)} = \mathrm{Decoder}_l(x^{(l-1)}), \qquad
        \mathrm{logits}_i = \mathrm{LN}(x^{(L)}_i)\, E^\top

    with the token embedding :math:`E` (tied to the output projection), the
    Transformer's sinusoidal encoding :math:`e`
    (:func:`~hsa_graph.geometry.sinusoidal_encoding`; for odd ``C`` that of size
    ``C + 1`` without its last channel) of the token's index :math:`p_i` in its tree,
    and a stack of :class:`CausalDecoderLayer`. Row :math:`i` of :meth:`forward`
    predicts token :math:`i + 1` of the same tree; :meth:`step` gives the same rows
    one token at a time.

    Args:
        vocab_size: number of token ids.
        channels, num_layers, heads, ffn_channels: model size.
        include_self: passed to the attention layers.
        **kwargs: further arguments of every :class:`CausalDecoderLayer` (``act``,
            ``dropout``, ``qk_norm``, ``attention``, ...).

    Shapes:
        - **input:** ``tokens`` ``[N]`` (long, leaf order), ``tree`` with ``N`` leaves.
        - **output:** ``[N, vocab_size]``; :meth:`step`: ``[vocab_size]``.

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.nn.causal import HierarchicalCausalLM
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> lm = HierarchicalCausalLM(vocab_size=10, channels=8, num_layers=1, heads=2)
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2, 2])
        >>> tokens = torch.tensor([1, 2, 3, 4, 5])
        >>> lm(tokens, tree).shape
        torch.Size([5, 10])
        >>> bool(lm.loss(tokens, tree) > 0)
        True
    """

    def __init__(self, vocab_size: int, channels: int = 64, num_layers: int = 2,
                 heads: int = 4, ffn_channels: Optional[int] = None, include_self: bool = True,
                 **kwargs: Any):
        super().__init__()
        _positive("vocab_size", vocab_size)
        _positive("channels", channels)
        _positive("num_layers", num_layers)
        self.vocab_size, self.channels = vocab_size, channels
        self.embed = Embedding(vocab_size, channels)
        self.layers = ModuleList([CausalDecoderLayer(channels, heads, ffn_channels,
                                                     include_self, **kwargs)
                                  for _ in range(num_layers)])
        self.norm = LayerNorm(channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the embedding from N(0, 1/C) and re-initialise every layer."""
        torch.nn.init.normal_(self.embed.weight, std=self.channels ** -0.5)
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()

    def _input(self, tokens: Tensor, position: Tensor) -> Tensor:
        """Token embeddings plus position encodings, ``[N]``, ``[N]`` -> ``[N, C]``."""
        c = self.channels
        encoding = sinusoidal_encoding(position, c + c % 2)[:, :c]
        return self.embed(tokens) * math.sqrt(c) + encoding.to(self.embed.weight.dtype)

    def _logits(self, x: Tensor) -> Tensor:
        return self.norm(x) @ self.embed.weight.t()

    def forward(self, tokens: Tensor, tree) -> Tensor:
        """``tokens`` ``[N]`` (leaf order) -> next-token logits ``[N, vocab_size]``."""
        st = resolve_structure(tree, tokens.device)
        if tokens.dim() != 1 or tokens.shape[0] != st.num_leaves:
            raise ValueError(f"tokens must have shape [N] with N = {st.num_leaves} leaves, "
                             f"got {tuple(tokens.shape)}")
        first = torch.full((st.num_trees,), st.num_leaves, device=tokens.device)
        index = torch.arange(st.num_leaves, device=tokens.device)
        first = first.scatter_reduce(0, st.leaf_tree, index, "amin")
        x = self._input(tokens, index - first[st.leaf_tree])
        for layer in self.layers:
            x = layer(x, tree)
        return self._logits(x)

    def loss(self, tokens: Tensor, tree) -> Tensor:
        """Mean cross-entropy of predicting each token from the ones before it, within
        each tree (the last token of a tree predicts nothing)."""
        logits = self(tokens, tree)
        st = resolve_structure(tree, tokens.device)
        same = st.leaf_tree[1:] == st.leaf_tree[:-1]
        return F.cross_entropy(logits[:-1][same], tokens[1:][same])

    def new_caches(self, batch_size: Optional[int] = None
                   ) -> List[Union[HSACache, BatchedHSACache, KVCache]]:
        """One empty cache per layer (batched ones with ``batch_size``: flat
        :class:`~hsa_graph.ops.kv_cache.KVCache` for ``attention="flat"``)."""
        return [layer.new_cache(batch_size) for layer in self.layers]

    def _check_caches(self, caches: Sequence) -> None:
        if len(caches) != len(self.layers):
            raise ValueError(f"caches must hold one cache per layer ({len(self.layers)}), "
                             f"got {len(caches)}: use new_caches()")

    def step(self, token: Union[int, Tensor, Sequence[int]], caches: Sequence,
             **where: Any) -> Tensor:
        """Feed one token (hung as ``where`` says: ``attach`` / ``depth``, see
        :meth:`HSAttention.step`) and return the next-token logits ``[vocab_size]``;
        with batched caches one token per sequence (``[B]`` ids, per-sequence
        placements) and logits ``[B, vocab_size]``."""
        self._check_caches(caches)
        device = self.embed.weight.device
        if isinstance(caches[0], (BatchedHSACache, KVCache)):
            ids = torch.as_tensor(token, device=device)
            b = caches[0].batch_size
            if ids.dtype == torch.bool or ids.is_floating_point() or ids.shape != (b,):
                raise ValueError(f"token must hold one integer id per sequence (B = {b}), "
                                 f"got {tuple(ids.shape)} {ids.dtype}")
            position = torch.tensor(caches[0].num_tokens, device=device)
            x = self._input(ids, position)
        else:
            position = torch.tensor([caches[0].num_tokens], device=device)
            x = self._input(torch.tensor([token], device=device), position)[0]
        for layer, cache in zip(self.layers, caches):
            x = layer.step(x, cache, **where)
        return self._logits(x)

    def prefill(self, tokens: Tensor, tree,
                caches: Sequence[Union[BatchedHSACache, KVCache]]) -> Tensor:
        """Start one sequence per tree of ``tree`` in every layer's batched cache from
        the prompt ``tokens`` ``[N]`` (leaf order); returns the next-token logits of
        each tree's last token ``[trees, vocab_size]`` (row ``i`` of :meth:`forward`
        at those leaves)."""
        self._check_caches(caches)
        st = resolve_structure(tree, tokens.device)
        if tokens.dim() != 1 or tokens.shape[0] != st.num_leaves:
            raise ValueError(f"tokens must have shape [N] with N = {st.num_leaves} leaves, "
                             f"got {tuple(tokens.shape)}")
        index = torch.arange(st.num_leaves, device=tokens.device)
        first = torch.full((st.num_trees,), st.num_leaves, device=tokens.device)
        first = first.scatter_reduce(0, st.leaf_tree, index, "amin")
        last = torch.full((st.num_trees,), -1, device=tokens.device)
        last = last.scatter_reduce(0, st.leaf_tree, index, "amax")
        x = self._input(tokens, index - first[st.leaf_tree])
        for layer, cache in zip(self.layers, caches):
            x = layer.prefill(x, tree, cache)
        return self._logits(x[last])

    @staticmethod
    def _prompt_tree(prompt: Sequence[int], where, row: int):
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty")
        if isinstance(where, NestedSignal):
            return where
        if len(where) != len(prompt):
            raise ValueError(f"prompt {row} has {len(prompt)} tokens but {len(where)} "
                             "placements: one placement per token")
        return NestedSignal.from_parents(parents_of_moves(list(where)))

    @torch.no_grad()
    def generate(self, prompt: Sequence, prompt_where: Sequence, steps: int,
                 where: Callable[[List[int]], Dict], temperature: float = 1.0,
                 generator: Optional[torch.Generator] = None
                 ) -> Union[List[int], List[List[int]]]:
        """Sample ``steps`` tokens after each prompt, all sequences at once: the prompts
        are prefilled (one pass over their trees) into batched caches, then every step
        feeds one token per sequence.

        Args:
            prompt: token ids of one prompt, or a list of prompts (a batch).
            prompt_where: for one prompt, where each token hangs (``attach`` / ``depth``
                of :meth:`HSACache.append`, e.g. from :meth:`HSACache.moves_of`) or its
                tree; for a batch, one such list or tree per prompt.
            steps: tokens to sample per sequence.
            where: ``tokens so far -> dict`` placing a sequence's next token (e.g. a
                new sentence after a full stop), called per sequence.
            temperature: ``0`` for greedy decoding.
            generator: for sampling.

        Returns:
            the prompt followed by its samples (a list of them for a batch).

        Raises:
            ValueError: an empty prompt, placements that do not match it, or a bad
                placement.
        """
        single = len(prompt) > 0 and not isinstance(prompt[0], (list, tuple, Tensor))
        prompts = [list(prompt)] if single else [list(p) for p in prompt]
        placements = [prompt_where] if single else list(prompt_where)
        if not prompts or len(placements) != len(prompts):
            raise ValueError("prompt must be non-empty with one placement list (or tree) "
                             "per prompt")
        trees = [self._prompt_tree(p, w, r) for r, (p, w) in enumerate(zip(prompts,
                                                                             placements))]
        device = self.embed.weight.device
        ids = torch.tensor([t for p in prompts for t in p], device=device)
        caches = self.new_caches(0)
        logits = self.prefill(ids, trees[0] if len(trees) == 1 else collate(trees), caches)
        out = [list(p) for p in prompts]
        for _ in range(steps):
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            places = [where(seq) for seq in out]   # the caller's per-sequence rule
            for seq, token in zip(out, nxt.tolist()):
                seq.append(token)
            keys = {key for place in places for key in place}
            batch_where = {key: [place.get(key) for place in places] for key in keys}
            logits = self.step(nxt, caches, **batch_where)
        return out[0] if single else out

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(vocab_size={self.vocab_size}, "
                f"channels={self.channels}, num_layers={len(self.layers)})")
