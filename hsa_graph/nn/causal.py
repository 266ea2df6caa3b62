r"""Causal HSA modules: an attention layer, a decoder layer and a small language model.

Training runs :func:`~hsa_graph.ops.causal.causal_hsa` over whole trees (or a PyG batch
of them) at once; generation runs one token at a time through one
:class:`~hsa_graph.ops.cache.HSACache` per layer, whose outputs equal the parallel ones.
A flat transformer is the same model on a flat tree (one root over the tokens), which
makes the comparison in ``examples/causal_lm.py`` like for like.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Embedding, LayerNorm, Linear, Module, ModuleList, Sequential

from ..ops.cache import HSACache
from ..ops.causal import causal_hsa
from ..ops.inputs import resolve_structure
from .attention import _positive, check_features

__all__ = ["CausalHSAttention", "CausalDecoderLayer", "HierarchicalCausalLM"]


class CausalHSAttention(Module):
    r"""Multi-head causal HSA with learnable projections.

    .. math::
        y = W_o \big\Vert_h \mathrm{CausalHSA}(W_q x, W_k x, W_v x)_h + b_o

    where row :math:`i` of causal HSA reads only leaves :math:`\le i` (see
    :func:`~hsa_graph.ops.causal.causal_hsa`).

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
        super().__init__()
        _positive("channels", channels)
        _positive("heads", heads)
        if channels % heads:
            raise ValueError(f"channels ({channels}) must be divisible by heads ({heads})")
        self.channels, self.heads, self.include_self = channels, heads, include_self
        self.qkv = Linear(channels, 3 * channels)
        self.out = Linear(channels, channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.qkv.reset_parameters()
        self.out.reset_parameters()

    def _split(self, x: Tensor):
        return self.qkv(x).unflatten(-1, (3, self.heads, self.channels // self.heads)).unbind(-3)

    def forward(self, x: Tensor, tree) -> Tensor:
        check_features(self, x)
        q, k, v = self._split(x)
        y = causal_hsa(q, k, v, tree, include_self=self.include_self)
        return self.out(y.flatten(1))

    def new_cache(self) -> HSACache:
        """An empty :class:`~hsa_graph.ops.cache.HSACache` for :meth:`step`."""
        return HSACache(include_self=self.include_self)

    def step(self, x: Tensor, cache: HSACache, **where) -> Tensor:
        """The output for one new token ``x`` ``[C]``; ``where`` (``attach``, ``depth``)
        says where it hangs, as in :meth:`HSACache.append`."""
        check_features(self, x)
        q, k, v = self._split(x)
        return self.out(cache.append(q, k, v, **where).flatten())

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, heads={self.heads}, "
                f"include_self={self.include_self})")


class CausalDecoderLayer(Module):
    r"""Pre-norm decoder block: :math:`x + \mathrm{Attn}(\mathrm{LN}(x))`, then
    :math:`x + \mathrm{MLP}(\mathrm{LN}(x))` with a GELU MLP of ``ffn_channels``.

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.nn.causal import CausalDecoderLayer
        >>> layer = CausalDecoderLayer(8, heads=2)
        >>> tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0])
        >>> layer(torch.randn(3, 8), tree).shape
        torch.Size([3, 8])
    """

    def __init__(self, channels: int, heads: int = 1, ffn_channels: Optional[int] = None,
                 include_self: bool = True):
        super().__init__()
        ffn_channels = ffn_channels or 4 * channels
        self.norm1, self.norm2 = LayerNorm(channels), LayerNorm(channels)
        self.attn = CausalHSAttention(channels, heads, include_self)
        self.mlp = Sequential(Linear(channels, ffn_channels), torch.nn.GELU(),
                              Linear(ffn_channels, channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.norm1.reset_parameters()
        self.norm2.reset_parameters()
        self.attn.reset_parameters()
        for layer in (self.mlp[0], self.mlp[2]):
            layer.reset_parameters()

    def forward(self, x: Tensor, tree) -> Tensor:
        check_features(self, x)
        x = x + self.attn(self.norm1(x), tree)
        return x + self.mlp(self.norm2(x))

    def step(self, x: Tensor, cache: HSACache, **where) -> Tensor:
        check_features(self, x)
        x = x + self.attn.step(self.norm1(x), cache, **where)
        return x + self.mlp(self.norm2(x))

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.attn.channels}, heads={self.attn.heads}, "
                f"ffn_channels={self.mlp[0].out_features})")


def _sinusoid(position: Tensor, channels: int) -> Tensor:
    """Transformer sinusoidal embedding of integer positions ``[N]`` -> ``[N, C]``."""
    half = channels // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=position.device) / half)
    angle = position.float()[:, None] * freq[None, :]
    out = torch.cat([angle.sin(), angle.cos()], -1)
    return F.pad(out, (0, channels - 2 * half))


class HierarchicalCausalLM(Module):
    r"""A small decoder-only language model over the leaves (tokens) of trees.

    Token embedding plus a sinusoidal embedding of the token's index in its tree, a stack
    of :class:`CausalDecoderLayer`, a final LayerNorm and an output projection tied to
    the embedding. Row :math:`i` of :meth:`forward` predicts token :math:`i + 1` of the
    same tree.

    Args:
        vocab_size: number of token ids.
        channels, num_layers, heads, ffn_channels: model size.
        include_self: passed to the attention layers.

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
                 heads: int = 4, ffn_channels: Optional[int] = None, include_self: bool = True):
        super().__init__()
        self.vocab_size, self.channels = vocab_size, channels
        self.embed = Embedding(vocab_size, channels)
        self.layers = ModuleList([CausalDecoderLayer(channels, heads, ffn_channels,
                                                     include_self) for _ in range(num_layers)])
        self.norm = LayerNorm(channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.embed.weight, std=self.channels ** -0.5)
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()

    def _input(self, tokens: Tensor, position: Tensor) -> Tensor:
        return self.embed(tokens) * math.sqrt(self.channels) + _sinusoid(position,
                                                                          self.channels)

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

    def new_caches(self) -> List[HSACache]:
        """One empty cache per layer."""
        return [layer.attn.new_cache() for layer in self.layers]

    def step(self, token: int, caches: Sequence[HSACache], **where) -> Tensor:
        """Feed one token (hung as ``where`` says) and return the next-token logits."""
        position = torch.tensor([caches[0].num_tokens], device=self.embed.weight.device)
        x = self._input(torch.tensor([token], device=position.device), position)[0]
        for layer, cache in zip(self.layers, caches):
            x = layer.step(x, cache, **where)
        return self._logits(x)

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], prompt_where: Sequence[Dict],
                 steps: int, where: Callable[[List[int]], Dict],
                 temperature: float = 1.0, generator: Optional[torch.Generator] = None
                 ) -> List[int]:
        """Sample ``steps`` tokens after ``prompt``.

        Args:
            prompt: token ids; ``prompt_where``: where each hangs (``attach`` /
                ``depth`` of :meth:`HSACache.append`, e.g. from
                :meth:`HSACache.moves_of`).
            where: ``tokens so far -> dict`` placing the next token (e.g. a new
                sentence after a full stop).
            temperature: ``0`` for greedy decoding.
        """
        if len(prompt) == 0 or len(prompt) != len(prompt_where):
            raise ValueError("prompt must be non-empty with one placement per token")
        caches = self.new_caches()
        tokens = list(prompt)
        for token, place in zip(prompt, prompt_where):
            logits = self.step(token, caches, **place)
        for _ in range(steps):
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, -1)
                nxt = int(torch.multinomial(probs, 1, generator=generator))
            place = where(tokens)
            tokens.append(nxt)
            logits = self.step(nxt, caches, **place)
        return tokens

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(vocab_size={self.vocab_size}, "
                f"channels={self.channels}, num_layers={len(self.layers)})")
