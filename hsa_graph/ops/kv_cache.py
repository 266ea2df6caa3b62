r"""A flat key/value cache: causal softmax attention one token per sequence per step.

The baseline of the hierarchical caches (:mod:`hsa_graph.ops.cache`), and what a flat
causal model (``HSAttention(causal=True, attention="flat")``) generates with. Causal HSA
on a flat tree (a root over the tokens) is causal softmax attention,

.. math::
    y_i = \sum_{j \in J_i} \frac{e^{s \langle q_i, k_j\rangle}}
        {\sum_{j' \in J_i} e^{s \langle q_i, k_{j'}\rangle}}\, v_j, \qquad
    J_i = \{j \le i\} \ (\texttt{include\_self}) \text{ or } \{j < i\},

so the state of a sequence after :math:`L` tokens is its :math:`L` keys and values:
:math:`O(L \cdot H D)` numbers, against :math:`O(b \cdot \mathrm{depth} \cdot H D)` for
the hierarchical cache. A sequence with no visible token (its first one, without
``include_self``) gets :math:`y = 0`, as :func:`~hsa_graph.ops.causal.causal_hsa`.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from .inputs import (
    check_scale,
    check_step_tokens,
    check_tensors,
    compute_dtype,
    first_true,
    kept_rows,
    no_autocast,
)

__all__ = ["KVCache"]

#: The smallest token capacity a growing buffer allocates.
_MIN_CAPACITY = 16


def _lengths_of(lengths, batch: int, longest: int) -> Tensor:
    """``lengths`` as given (``None``: ``longest`` each) -> checked CPU longs ``[B]``."""
    if lengths is None:
        return torch.full((batch,), longest, dtype=torch.long)
    if isinstance(lengths, Tensor):
        if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(f"lengths must be an integer tensor, got {lengths.dtype}")
        values = lengths.to("cpu", torch.long)
    elif isinstance(lengths, (list, tuple)):
        if any(isinstance(n, bool) or not isinstance(n, int) for n in lengths):
            raise TypeError(f"lengths must be ints, got {list(lengths)!r}")
        values = torch.tensor(list(lengths), dtype=torch.long)
    else:
        raise TypeError(f"lengths must be None, a sequence of ints or an integer tensor, "
                        f"got {type(lengths).__name__}")
    if values.dim() != 1 or values.shape[0] != batch:
        raise ValueError(f"lengths must hold one length per prompt ({batch}), got shape "
                         f"{tuple(values.shape)}")
    bad = (values < 0) | (values > longest)
    if bool(bad.any()):
        r = first_true(bad)
        raise ValueError(f"lengths[{r}] = {int(values[r])} is outside 0..{longest} (the "
                         "prompts' padded length)")
    return values


class KVCache:
    r"""Flat key/value cache of ``B`` sequences for causal softmax attention.

    One :meth:`step` takes the next token of every sequence (``q, k`` ``[B, H, D]``,
    ``v`` ``[B, H, Dv]``), stores its key and value and returns ``[B, H, Dv]``: one
    :func:`~torch.nn.functional.scaled_dot_product_attention` call of the new queries
    over each sequence's cached keys and values (sequences of different lengths are
    masked). Row ``b`` equals (to rounding) the newest row of
    :func:`~hsa_graph.ops.causal.causal_hsa` on a flat tree over sequence ``b``'s
    tokens (the module docstring gives the formula).

    Keys and values live in preallocated buffers ``[B, H, C, D]`` whose token capacity
    ``C`` doubles when a sequence outgrows it, so a step writes one slot per sequence
    (amortised :math:`O(1)` growth, no concatenation per step). :meth:`prefill` starts
    sequences from whole prompts, :meth:`add` starts empty ones, :meth:`drop` removes
    finished ones; the other sequences keep their state (both copy the buffers once,
    :math:`O(B C H D)`).

    Args:
        batch_size: number of empty sequences to start with.
        include_self: whether a token attends to itself (as in
            :func:`~hsa_graph.ops.causal.causal_hsa`).
        scale: logit scale :math:`s`, ``1 / sqrt(D)`` by default (as HSA's).

    Example:
        >>> import torch, hsa_graph
        >>> from hsa_graph.ops.causal import causal_hsa
        >>> from hsa_graph.ops.kv_cache import KVCache
        >>> q, k, v = torch.randn(3, 2, 4, 2, 8, dtype=torch.float64)  # [B, L, H, D]
        >>> cache = KVCache()
        >>> y = cache.prefill(k[:, :3], v[:, :3], q=q[:, :3])       # [B, 3, H, D]
        >>> last = cache.step(q[:, 3], k[:, 3], v[:, 3])            # [B, H, D]
        >>> flat = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0, 0])
        >>> ref = causal_hsa(q[0], k[0], v[0], flat)
        >>> bool(torch.allclose(last[0], ref[3]) and torch.allclose(y[0], ref[:3]))
        True
        >>> cache.num_tokens
        [4, 4]
    """

    def __init__(self, batch_size: int = 0, include_self: bool = True,
                 scale: Optional[float] = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
        if not isinstance(include_self, (bool, int)) or isinstance(include_self, float):
            raise TypeError(f"include_self must be a bool, got {type(include_self).__name__}")
        self.include_self = bool(include_self)
        self.scale = check_scale(scale)
        #: ``(H, D, Dv, dtype, device)`` of the tokens, fixed by the first ones
        self.token_spec: Optional[tuple] = None
        self._keys: Optional[Tensor] = None      # [B, H, C, D]
        self._values: Optional[Tensor] = None    # [B, H, C, Dv]
        # lengths on the host (capacity decisions never wait on the device) and on the
        # device (the attention mask, without a copy per step)
        self._lengths = torch.zeros(batch_size, dtype=torch.long)
        self._lengths_dev: Optional[Tensor] = None

    # ----------------------------------------------------------------- inspection
    @property
    def batch_size(self) -> int:
        """Number of sequences ``B``."""
        return self._lengths.shape[0]

    @property
    def num_tokens(self) -> List[int]:
        """Tokens held by each sequence."""
        return self._lengths.tolist()

    @property
    def capacity(self) -> int:
        """Tokens per sequence the buffers hold before they grow again."""
        return 0 if self._keys is None else self._keys.shape[2]

    def state_bytes(self, per_sequence: bool = False) -> int:
        """Bytes of the cache state: the allocated key/value buffers (``C`` token slots
        per sequence, up to twice the longest sequence) and the host lengths; with
        ``per_sequence`` divided by ``B``."""
        total = self._lengths.numel() * self._lengths.element_size()
        for t in (self._keys, self._values, self._lengths_dev):
            if t is not None:
                total += t.numel() * t.element_size()
        return total // max(1, self.batch_size) if per_sequence else total

    @staticmethod
    def bytes_for(length: int, heads: int, dim: int, dim_v: Optional[int] = None,
                  dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the keys and values of one sequence of ``length`` tokens
        (``length * heads * (dim + dim_v)`` numbers, ``dim_v = dim`` by default), without
        the buffers' spare capacity."""
        dim_v = dim if dim_v is None else dim_v
        item = torch.empty((), dtype=dtype).element_size()
        return length * heads * (dim + dim_v) * item

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(batch_size={self.batch_size}, "
                f"tokens={self.num_tokens}, capacity={self.capacity}, "
                f"include_self={self.include_self})")

    # ----------------------------------------------------------------- state layout
    def _scale(self) -> float:
        return (1.0 / math.sqrt(self.token_spec[1]) if self.scale is None
                else float(self.scale))

    def _set_spec(self, spec: tuple) -> None:
        """Fix the token spec; a held state must match it (a batch whose sequences hold
        no token yet may change it)."""
        if self.token_spec is not None and self.token_spec != spec:
            if bool((self._lengths > 0).any()):
                held = self.token_spec
                raise ValueError(
                    f"token shapes changed: the cache holds H={held[0]}, D={held[1]}, "
                    f"Dv={held[2]} ({held[3]} on {held[4]}), got H={spec[0]}, D={spec[1]}, "
                    f"Dv={spec[2]} ({spec[3]} on {spec[4]})")
            self._keys = self._values = self._lengths_dev = None
        self.token_spec = spec
        if self._keys is None:
            self._keys, self._values = self._buffers(self.batch_size, 0)
            self._lengths_dev = self._lengths.to(spec[4])

    def _buffers(self, batch: int, capacity: int) -> Tuple[Tensor, Tensor]:
        h, d, dv, dtype, device = self.token_spec
        dtype = compute_dtype(dtype)
        # zeros, not empty: masked slots are read by the attention (with weight 0), and
        # 0 * NaN garbage would be NaN
        return (torch.zeros(batch, h, capacity, d, dtype=dtype, device=device),
                torch.zeros(batch, h, capacity, dv, dtype=dtype, device=device))

    def _ensure(self, tokens: int) -> None:
        """Grow the buffers to hold ``tokens`` per sequence (the capacity doubles)."""
        cur = self.capacity
        if tokens <= cur:
            return
        new = max(tokens, 2 * cur, _MIN_CAPACITY)
        keys, values = self._buffers(self.batch_size, new)
        keys[:, :, :cur] = self._keys
        values[:, :, :cur] = self._values
        self._keys, self._values = keys, values

    # ----------------------------------------------------------------- sequences
    def add(self, count: int = 1) -> List[int]:
        """Start ``count`` empty sequences; returns their row indices. The other
        sequences are not touched."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        first = self.batch_size
        self._lengths = torch.cat([self._lengths, self._lengths.new_zeros(count)])
        if self._keys is not None:
            keys, values = self._buffers(count, self.capacity)
            self._keys = torch.cat([self._keys, keys])
            self._values = torch.cat([self._values, values])
            self._lengths_dev = torch.cat([self._lengths_dev,
                                           self._lengths_dev.new_zeros(count)])
        return list(range(first, first + count))

    def drop(self, indices: Union[int, Sequence[int], Tensor]) -> None:
        """Remove the sequences at rows ``indices``; the others keep their state and
        order (row ``r`` moves down by the number of dropped rows before it).

        Raises:
            ValueError: an index outside ``0 .. B - 1`` or given twice.
            TypeError: a non-integer index.
        """
        b = self.batch_size
        kept = kept_rows(indices, b)
        self._lengths = self._lengths[kept]
        if self._keys is not None:
            kept = kept.to(self._keys.device)
            self._keys = self._keys.index_select(0, kept)
            self._values = self._values.index_select(0, kept)
            self._lengths_dev = self._lengths_dev.index_select(0, kept)

    # ----------------------------------------------------------------- one step
    def _check_tokens(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        check_step_tokens(q, k, v, self.batch_size, check_finite=True)
        self._set_spec((q.shape[1], q.shape[2], v.shape[2], q.dtype, q.device))
        dtype = compute_dtype(q.dtype)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        r"""Add one token to every sequence and return their attention outputs.

        Args:
            q, k: ``[B, H, D]``; v: ``[B, H, Dv]``: the new token of each sequence.

        Returns:
            ``[B, H, Dv]`` in the tokens' dtype: row ``b`` is the softmax over sequence
            ``b``'s keys so far (with the new one when ``include_self``) of
            :math:`s \langle q_b, k_j\rangle`, applied to its values; zeros for a
            sequence that sees no token.

        Raises:
            ValueError: shapes that do not fit ``B`` or each other, tokens of another
                shape, dtype or device than the cache holds, or a NaN or inf in a row
                (naming it).
            TypeError: non-tensors or mixed dtypes.
        """
        q, k, v = self._check_tokens(q, k, v)
        lengths = self._lengths
        longest, shortest = int(lengths.max()), int(lengths.min())
        self._ensure(longest + 1)
        with no_autocast(q.device):
            if longest == shortest:       # one slot for all: a plain slice write
                self._keys[:, :, longest] = k
                self._values[:, :, longest] = v
            else:
                rows = torch.arange(self.batch_size, device=q.device)
                self._keys[rows, :, self._lengths_dev] = k
                self._values[rows, :, self._lengths_dev] = v
            y = self._attend(q, longest, shortest)
        self._lengths = lengths + 1
        self._lengths_dev = self._lengths_dev + 1
        return y.to(self.token_spec[3])

    def _attend(self, q: Tensor, longest: int, shortest: int) -> Tensor:
        """The new queries ``[B, H, D]`` over the cached tokens (before this step's
        lengths are counted): ``longest`` / ``shortest`` are the old host lengths."""
        own = int(self.include_self)
        seen = longest + own               # key slots the longest sequence sees
        if seen == 0:                      # no sequence sees a token
            return q.new_zeros(q.shape[0], q.shape[1], self._values.shape[-1])
        keys, values = self._keys[:, :, :seen], self._values[:, :, :seen]
        mask = None
        if longest != shortest or shortest + own == 0:
            visible = self._lengths_dev + own                                # [B]
            # a sequence that sees nothing gets slot 0 (zeroed below), not a NaN row
            mask = torch.arange(seen, device=q.device) < visible.clamp_min(1)[:, None]
            mask = mask[:, None, None, :]                                    # [B, 1, 1, S]
        y = scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask,
                                         scale=self._scale())[:, :, 0]
        if shortest + own == 0:
            y = torch.where((visible > 0)[:, None, None], y, 0.0)
        return y

    # ----------------------------------------------------------------- prefill
    def prefill(self, k: Tensor, v: Tensor, lengths: Union[None, Sequence[int], Tensor] = None,
                *, q: Optional[Tensor] = None) -> Optional[Tensor]:
        r"""Start one sequence per prompt from its keys and values, in one copy.

        Args:
            k: ``[P, L, H, D]``, v: ``[P, L, H, Dv]``: ``P`` prompts padded to ``L``
                tokens (rows past a prompt's length are ignored).
            lengths: tokens of each prompt ``[P]`` (in ``0 .. L``); ``L`` each by default.
            q: ``[P, L, H, D]`` (optional): the prompts' queries, to return their
                outputs too.

        Returns:
            with ``q``: the prompts' causal attention outputs ``[P, L, H, Dv]`` (one
            :func:`~torch.nn.functional.scaled_dot_product_attention` call; rows past a
            prompt's length are zeros), which :meth:`step` would have returned token by
            token; else ``None``. The new sequences are the last ``P`` rows of the batch.

        Raises:
            ValueError: shapes that do not fit each other, bad ``lengths``, tokens of
                another shape than the cache holds, or a NaN or inf (naming the prompt
                and token).
            TypeError: non-tensors, mixed dtypes or non-integer lengths.
        """
        named = (("k", k), ("v", v)) + ((("q", q),) if q is not None else ())
        check_tensors(named, k.device if isinstance(k, Tensor) else torch.device("cpu"))
        for name, t in named:
            if t.dim() != 4:
                raise ValueError(f"{name} must have shape [P, L, H, D] (prompts padded to L "
                                 f"tokens), got {tuple(t.shape)}")
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(f"k and v must agree in [P, L, H], got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if q is not None and q.shape != k.shape:
            raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and "
                             f"{tuple(k.shape)}")
        p, length, h, d = k.shape
        if h == 0 or d == 0 or v.shape[3] == 0:
            raise ValueError(f"a token needs at least one head and one feature, got k "
                             f"{tuple(k.shape)} and v {tuple(v.shape)}")
        sizes = _lengths_of(lengths, p, length)
        valid = torch.arange(length)[None, :] < sizes[:, None]                 # [P, L]
        valid_dev = valid.to(k.device)
        for name, t in named:
            bad = ~torch.isfinite(t).flatten(2).all(2) & valid_dev
            if bool(bad.any()):
                row = bad.nonzero()[0].tolist()
                raise ValueError(f"{name} holds a NaN or inf at prompt {row[0]}, token "
                                 f"{row[1]}")
        spec = (h, d, v.shape[3], k.dtype, k.device)
        if p == 0:
            return None if q is None else v.new_zeros(v.shape)
        self._set_spec(spec)          # before add(): a refused prompt changes nothing
        first = self.add(p)[0]
        dtype = compute_dtype(k.dtype)
        keys, values = k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2)  # [P, H, L, .]
        mask = valid_dev[:, None, :, None]
        longest = int(sizes.max())
        self._ensure(longest)
        self._keys[first:, :, :longest] = torch.where(mask, keys, 0.0)[:, :, :longest]
        self._values[first:, :, :longest] = torch.where(mask, values, 0.0)[:, :, :longest]
        self._lengths[first:] = sizes
        self._lengths_dev[first:] = sizes.to(k.device)
        if q is None:
            return None
        with no_autocast(k.device):
            y = self._prompt_outputs(q.to(dtype).transpose(1, 2), keys, values)
        y = torch.where(mask, y, 0.0).transpose(1, 2)
        return y.to(k.dtype)

    def _prompt_outputs(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of padded prompts ``[P, H, L, .]``: padding sits after each
        prompt's tokens, so the causal mask alone keeps it out of the valid rows."""
        if self.include_self:
            return scaled_dot_product_attention(q, k, v, is_causal=True, scale=self._scale())
        length = q.shape[2]
        before = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-1)
        before[0, 0] = True                   # row 0 sees nothing: a finite row, zeroed
        y = scaled_dot_product_attention(q, k, v, attn_mask=before, scale=self._scale())
        return torch.cat([torch.zeros_like(y[:, :, :1]), y[:, :, 1:]], 2)

    def prefill_rows(self, q: Tensor, k: Tensor, v: Tensor,
                     lengths: Union[Sequence[int], Tensor]) -> Tensor:
        r""":meth:`prefill` from prompts laid end to end: rows ``[N, H, D]`` (``v``
        ``[N, H, Dv]``) of which the first ``lengths[0]`` are prompt 0, the next
        ``lengths[1]`` prompt 1, ... (``sum(lengths) = N``, every length ``>= 1``).

        Returns:
            the prompts' causal attention outputs ``[N, H, Dv]`` (row ``i`` of each
            prompt attends to that prompt's rows ``<= i``, or ``< i`` without
            ``include_self``).

        Raises:
            ValueError / TypeError: as :meth:`prefill`, rows that do not add up to the
                lengths, or an empty prompt.
        """
        check_tensors((("q", q), ("k", k), ("v", v)),
                      q.device if isinstance(q, Tensor) else torch.device("cpu"))
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise ValueError(f"{name} must have shape [N, H, D], got {tuple(t.shape)}")
        if not isinstance(lengths, (list, tuple, Tensor)) or (
                isinstance(lengths, Tensor) and lengths.dim() != 1):
            raise TypeError("lengths must be a sequence of ints or an integer tensor [P], "
                            f"got {lengths!r}")
        count = len(lengths)
        if count == 0:
            raise ValueError("prefill_rows needs at least one prompt")
        sizes = _lengths_of(lengths, count, 1 << 62)   # bounded by the sum check below
        if bool((sizes == 0).any()):
            raise ValueError(f"prompt {first_true(sizes == 0)} is empty")
        n = q.shape[0]
        if int(sizes.sum()) != n or k.shape[0] != n or v.shape[0] != n:
            raise ValueError(f"the prompts' lengths add up to {int(sizes.sum())} rows, but "
                             f"q, k, v have {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
        longest = int(sizes.max())
        device = q.device
        prompt = torch.repeat_interleave(torch.arange(count), sizes).to(device)   # [N]
        start = (torch.cumsum(sizes, 0) - sizes).to(device)
        slot = torch.arange(n, device=device) - start[prompt]

        def padded(t: Tensor) -> Tensor:
            out = t.new_zeros(count, longest, *t.shape[1:])
            out[prompt, slot] = t
            return out
        y = self.prefill(padded(k), padded(v), sizes, q=padded(q))
        return y[prompt, slot]
