r"""Swap HSA into chosen layers of a pre-trained Hugging Face encoder, and back.

Theorem 3.2 of the paper makes HSA the KL-closest block-constrained approximation of
softmax attention, so it can replace attention in a trained model without retraining
(section 5.3). :func:`patch_hsa` does this through ``transformers``' own attention
interface: it registers an attention function (``AttentionInterface``) and its mask
function (``AttentionMaskInterface``) under the name ``"hsa_graph"`` and switches the
model to it with ``model.set_attn_implementation``. The function receives the
model's own projected queries, keys and values ``[B, H, L, D]``; in the replaced
layers it computes, for every example ``b`` of the batch and its tree ``T_b``,

.. math::
    y_{b,i} = \mathrm{HSA}(q_b, k_b, v_b; T_b)_i
    \quad\text{with scale } s = \texttt{module.scaling},\ \text{self included},

over the non-pad tokens only (pads are not leaves), and in the other layers it calls
the model's original implementation (``sdpa`` or ``eager``) unchanged. With a
one-level hierarchy (``hierarchy=()``: a root over all tokens) HSA is softmax
attention, so the patched model reproduces the original.

**Pad positions** get an attention output of zero in the replaced layers (the
original lets pad queries attend to the tokens); their hidden states therefore differ
from the original's, are finite, and are ignored by any masked pooling. Attention
dropout is not applied in replaced layers (zero-shot use is in eval mode), and
``output_attentions`` gives ``None`` for them. Only padding masks are supported (an
encoder's bidirectional mask); a custom 4-D mask that is not one raises
``ValueError``.

The hierarchy is one tree per example: a bottom-up branching tuple (hopping windows,
built from the mask inside the model; the paper uses ``(2, 4, 8, 16)``) or a forest
such as :func:`~hsa_graph.pretrained.semantic_hierarchy` (tokens -> words ->
sentences). It is chosen per call, by precedence: the keyword ``hsa_hierarchy=`` of the
model's forward (passed down to the attention function by ``transformers``),
:meth:`HSAPatch.use`, or the default given to :func:`patch_hsa`.
"""
from __future__ import annotations

import contextlib
import sys
import time
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..ops.hsa import hsa
from .approximations import SparsePattern, attention_flops, hsa_budget
from .hierarchy import Hierarchy, InducedHierarchy, check_hierarchy, resolve_hierarchy

__all__ = ["HSAPatch", "hsa_attention_forward", "patch_hsa", "unpatch_hsa", "IMPLEMENTATION"]

#: The name under which the attention and mask functions are registered.
IMPLEMENTATION = "hsa_graph"

# Patched configs (by id) -> (a weak reference to the config, its patch); both
# registered functions look it up. The config is held weakly, and the patch holds its
# model and configs weakly too, so a patched model deleted without unpatch() is freed
# (and its entry dropped) like any other; a reused id never finds a dead config's patch.
_PATCHES: Dict[int, Tuple[weakref.ReferenceType, HSAPatch]] = {}


def _patch_of(config: Any) -> Optional[HSAPatch]:
    """The live patch of ``config`` (``None`` when it is not patched)."""
    entry = _PATCHES.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


def _register_config(config: Any, patch: HSAPatch) -> None:
    key = id(config)

    def forget(ref: weakref.ReferenceType) -> None:
        if _PATCHES.get(key, (None,))[0] is ref:
            del _PATCHES[key]

    _PATCHES[key] = (weakref.ref(config, forget), patch)


def _unregister_config(config: Any) -> None:
    if _patch_of(config) is not None:
        del _PATCHES[id(config)]


class HSAPatch:
    r"""A model whose attention layers ``layers`` run HSA (made by :func:`patch_hsa`).

    Attributes:
        model: the patched model.
        layers: the replaced layer indices (``module.layer_idx``).
        hierarchy: the default hierarchy.
        original: the model's attention implementation before patching.

    Use it as a context manager to unpatch on exit. :meth:`use` sets the hierarchy
    for the calls inside a ``with`` block; :meth:`capture` records each layer's
    queries and keys (for inspecting the attention, as
    :mod:`~hsa_graph.pretrained.zero_shot` does).
    """

    def __init__(self, model: Any, layers: Tuple[int, ...], hierarchy: Hierarchy,
                 original: str, configs: List[Any]):
        self._model = weakref.ref(model)
        self.layers = frozenset(layers)
        self.hierarchy = hierarchy
        self.original = original
        self._configs = [weakref.ref(c) for c in configs]
        self._stack: List[Hierarchy] = []
        self._records: Optional[Dict[int, Tuple[Tensor, Tensor, float]]] = None
        self._cache: Optional[tuple] = None
        self.active = True
        #: Wall seconds spent in the replaced layers since the last
        #: :meth:`reset_timings`: ``tree_s`` building induced trees, ``attention_s``
        #: the attention itself (HSA, or masked attention for a sparse pattern),
        #: ``layer_calls``, the replaced-layer calls they cover, and the cost model
        #: summed over those calls: ``flops`` (:func:`attention_flops`' HSA count, or
        #: :func:`sparse_cost`'s) over ``examples``, and ``budget`` (distinct weights
        #: per query row) over ``rows``.
        self.timings: Dict[str, float] = {}
        self.reset_timings()

    def reset_timings(self) -> None:
        """Zero :attr:`timings`."""
        self.timings = {"tree_s": 0.0, "attention_s": 0.0, "layer_calls": 0, "flops": 0.0,
                        "examples": 0, "budget": 0.0, "rows": 0}

    @property
    def model(self) -> Any:
        """The patched model (held weakly: the patch does not keep it alive).

        Raises:
            ReferenceError: the model was deleted.
        """
        model = self._model()
        if model is None:
            raise ReferenceError("the patched model no longer exists")
        return model

    def __repr__(self) -> str:
        model = self._model()
        name = type(model).__name__ if model is not None else "<deleted model>"
        return (f"{self.__class__.__name__}({name}, "
                f"layers={sorted(self.layers)}, hierarchy={_describe(self.hierarchy)}, "
                f"original={self.original!r}{'' if self.active else ', unpatched'})")

    def __enter__(self) -> HSAPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def unpatch(self) -> None:
        """Restore the original attention implementation (idempotent)."""
        if not self.active:
            return
        model = self._model()
        if model is not None:
            model.set_attn_implementation(self.original)
        for ref in self._configs:
            config = ref()
            if config is not None:
                _unregister_config(config)
        self._cache = None
        self.active = False

    @contextlib.contextmanager
    def use(self, hierarchy: Hierarchy) -> Iterator[HSAPatch]:
        """Run the calls inside the block with ``hierarchy`` (unless a call passes
        ``hsa_hierarchy=``)."""
        self._stack.append(hierarchy)
        try:
            yield self
        finally:
            self._stack.pop()

    @contextlib.contextmanager
    def capture(self) -> Iterator[Dict[int, Tuple[Tensor, Tensor, float]]]:
        """Record, for every attention layer a call runs, ``layer_idx -> (q, k, scale)``:
        the queries and keys ``[N, H, D]`` of the non-pad tokens (detached, in the
        leaf order of the call's forest) and the layer's logit scale."""
        self._records = {}
        try:
            yield self._records
        finally:
            self._records = None

    def _chosen(self, hierarchy: Optional[Hierarchy]) -> Hierarchy:
        """The hierarchy of a call: its ``hsa_hierarchy=``, else :meth:`use`'s, else
        the default."""
        if hierarchy is None:
            hierarchy = self._stack[-1] if self._stack else self.hierarchy
        return hierarchy

    def _layout(self, attention_mask: Optional[Tensor], batch: int, length: int,
                device: torch.device, hierarchy: Hierarchy):
        """The token mask ``[B, L]`` and the forest of a call (``None`` for an induced
        hierarchy or a sparse pattern, which each layer builds). The model hands every
        layer the same mask object, so both are computed once per call and reused."""
        key = attention_mask if attention_mask is not None else (batch, length, device)
        cache = self._cache
        if cache is not None and cache[1] is hierarchy and (
                cache[0] is key or (attention_mask is None and cache[0] == key)):
            return cache[2], cache[3]
        mask = _token_mask(attention_mask, batch, length, device)
        forest = None if isinstance(hierarchy, (InducedHierarchy, SparsePattern)) else \
            resolve_hierarchy(hierarchy, mask)
        self._cache = (key, hierarchy, mask, forest)
        return mask, forest


def _describe(hierarchy: Hierarchy) -> str:
    if isinstance(hierarchy, (tuple, list)):
        return repr(tuple(hierarchy))
    return type(hierarchy).__name__


def _token_mask(attention_mask: Optional[Tensor], batch: int, length: int,
                device: torch.device) -> Tensor:
    """The ``[B, L]`` key-padding mask behind the 4-D mask the model built (boolean for
    sdpa, additive 0 / min for eager; ``None`` when nothing is padded)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or \
            attention_mask.shape[-1] != length:
        raise ValueError(f"HSA layers take a padding mask [B, 1, L, L]; got an attention "
                         f"mask of shape {tuple(attention_mask.shape)}")
    rows = attention_mask[:, 0]
    if not bool((rows == rows[:, :1]).all()):
        raise ValueError("HSA layers support padding masks only (every query sees the "
                         "same keys); this attention mask differs between query rows")
    keys = rows[:, 0]
    mask = keys if keys.dtype == torch.bool else keys == 0
    return mask.expand(batch, length)


def hsa_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs: Any) -> Tuple[Tensor, None]:
    r"""The attention function registered as ``"hsa_graph"`` (``transformers``'
    signature): HSA in the patched layers, the original implementation elsewhere.

    Args:
        module: the attention module (its ``config`` finds the patch, its
            ``layer_idx`` whether this layer is replaced).
        query, key, value: ``[B, H, L, D]`` projections.
        attention_mask: the 4-D mask made by the registered mask function.
        scaling: the logit scale (``module.scaling``).
        dropout: ignored in replaced layers.
        **kwargs: ``hsa_hierarchy=`` overrides the hierarchy for this call; the rest
            goes to the original implementation.

    Returns:
        ``([B, L, H, Dv], None)``; zeros at pad positions in replaced layers.
    """
    patch = _patch_of(getattr(module, "config", None))
    hierarchy = kwargs.pop("hsa_hierarchy", None)
    if patch is None:
        raise RuntimeError("the 'hsa_graph' attention runs only in a model patched with "
                           "hsa_graph.pretrained.patch_hsa (this module's config is not)")
    layer = getattr(module, "layer_idx", None)
    records = patch._records
    if layer not in patch.layers and records is None:
        return _original(patch, module)(module, query, key, value, attention_mask,
                                        scaling=scaling, dropout=dropout, **kwargs)
    batch, heads, length, dim = query.shape
    if key.shape[2] != length:
        raise ValueError(f"HSA replaces self-attention only: {length} queries but "
                         f"{key.shape[2]} keys (cross-attention or a cache)")
    groups = heads // key.shape[1]  # grouped keys and values: one copy per query head
    hierarchy = patch._chosen(hierarchy)
    mask, forest = patch._layout(attention_mask, batch, length, query.device, hierarchy)
    q = query.transpose(1, 2)[mask]                                   # [N, H, D]
    k = key.repeat_interleave(groups, dim=1).transpose(1, 2)[mask]
    if records is not None:
        records[layer] = (q.detach(), k.detach(),
                          dim ** -0.5 if scaling is None else float(scaling))
        if layer not in patch.layers:
            return _original(patch, module)(module, query, key, value, attention_mask,
                                            scaling=scaling, dropout=dropout, **kwargs)
    timings = patch.timings
    timings["layer_calls"] += 1
    timings["examples"] += batch
    timings["rows"] += q.shape[0]
    if isinstance(hierarchy, SparsePattern):
        start = time.perf_counter()
        out, support = _sparse_attention(hierarchy, query, key.repeat_interleave(groups, dim=1),
                                         value.repeat_interleave(groups, dim=1), mask,
                                         dim ** -0.5 if scaling is None else float(scaling))
        timings["attention_s"] += time.perf_counter() - start
        count = support.expand(batch, heads, length, length).sum(-1).double()   # [B, H, L]
        timings["flops"] += 4 * dim * float(count.sum())
        timings["budget"] += float(count.mean(1)[mask].sum())
        return out, None
    if isinstance(hierarchy, InducedHierarchy):
        start = time.perf_counter()
        forest = hierarchy.build(k, mask.nonzero(as_tuple=True)[0])
        timings["tree_s"] += time.perf_counter() - start
    start = time.perf_counter()
    v = value.repeat_interleave(groups, dim=1).transpose(1, 2)[mask]
    y = hsa(q, k, v, forest, include_self=True, scale=scaling)
    out = query.new_zeros(batch, length, heads, value.shape[-1])
    out[mask] = y.to(out.dtype)
    timings["attention_s"] += time.perf_counter() - start
    timings["flops"] += float(attention_flops(forest, dim, heads)["hsa"].sum())
    timings["budget"] += float(hsa_budget(forest).sum())
    return out, None


def _sparse_attention(pattern: SparsePattern, query: Tensor, key: Tensor, value: Tensor,
                      mask: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    r"""Masked softmax attention on a sparse pattern, ``[B, H, L, D]`` in, ``[B, L, H,
    Dv]`` out (zeros at pads), with the support ``[B, H or 1, L, L]`` (pad rows
    empty): the softmax of the logits restricted to each query's
    support, i.e. softmax attention renormalised over it
    (:func:`~hsa_graph.pretrained.approximations.sparse_weights`). Positions are ranks
    among an example's tokens, so pads (on any side) take no place in the pattern."""
    batch, _, length, _ = query.shape
    logits = torch.matmul(query, key.transpose(-1, -2)) * scale           # [B, H, L, L]
    keys = mask[:, None, None, :]
    if pattern.kind == "topk":
        p = torch.softmax(logits.masked_fill(~keys, float("-inf")), -1)
        support = pattern.support(None, p) & keys
    else:
        ex, tok = mask.nonzero(as_tuple=True)
        rows, cols = pattern.support(ex).nonzero(as_tuple=True)
        padded = torch.zeros(batch, length, length, dtype=torch.bool, device=query.device)
        padded[ex[rows], tok[rows], tok[cols]] = True
        support = padded[:, None]
    support = support & mask[:, None, :, None]
    # Pad queries have an empty support: they see every key, and are zeroed below.
    seen = support | ~mask[:, None, :, None]
    weights = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1)
    out = torch.matmul(weights, value).transpose(1, 2)                   # [B, L, H, Dv]
    return out * mask[:, :, None, None].to(out.dtype), support


def _original(patch: HSAPatch, module: torch.nn.Module):
    """The model's own attention function for the layers HSA leaves alone."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if patch.original == "eager":  # each modeling file defines its own eager function
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[patch.original]


def _hsa_mask(*args: Any, config: Any = None, **kwargs: Any):
    """The mask function registered as ``"hsa_graph"``: the original implementation's
    mask, so the untouched layers get exactly what they got before."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    patch = _patch_of(config)
    original = patch.original if patch is not None else "sdpa"
    return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, config=config, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, hsa_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _hsa_mask)


def _attention_layers(model: Any) -> List[int]:
    return sorted({m.layer_idx for m in model.modules()
                   if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "scaling")})


def patch_hsa(model: Any, layers: Optional[Iterable[int]] = None,
              hierarchy: Hierarchy = (2, 4, 8, 16)) -> HSAPatch:
    r"""Replace softmax attention by HSA in ``layers`` of a pre-trained encoder.

    Args:
        model: a ``transformers`` encoder using the attention interface (BERT,
            RoBERTa, MiniLM, ...), with implementation ``"sdpa"`` or ``"eager"``.
        layers: the layer indices to replace (``module.layer_idx``, from 0); all
            layers by default; ``()`` replaces none (for :meth:`HSAPatch.capture`).
        hierarchy: the default hierarchy: a bottom-up branching tuple (``()`` is the
            one-level tree, i.e. softmax attention) or a forest with one tree per
            example (see the module docstring for per-call choice).

    Returns:
        The :class:`HSAPatch`; ``patch.unpatch()`` (or :func:`unpatch_hsa`, or leaving
        ``with patch_hsa(...):``) restores the original.

    Raises:
        TypeError: a model that does not use ``transformers``' attention interface.
        ValueError: a decoder, an attention implementation other than sdpa/eager,
            layers out of range, or a model that is already patched.

    Example:
        >>> from hsa_graph.pretrained import load_minilm
        >>> model, tokenizer = load_minilm()
        >>> batch = tokenizer(["a fine film .", "dull ."], padding=True, return_tensors="pt")
        >>> with torch.no_grad():
        ...     before = model(**batch).last_hidden_state
        ...     with patch_hsa(model, layers=[3, 4, 5], hierarchy=()) as patch:
        ...         flat = model(**batch).last_hidden_state      # one level = softmax
        ...         windows = model(**batch, hsa_hierarchy=(2, 2)).last_hidden_state
        >>> keep = batch["attention_mask"].bool()
        >>> bool(torch.allclose(flat[keep], before[keep], atol=1e-5))
        True
        >>> bool(torch.allclose(windows[keep], before[keep], atol=1e-5))
        False
        >>> patch
        HSAPatch(BertModel, layers=[3, 4, 5], hierarchy=(), original='sdpa', unpatched)
    """
    if not callable(getattr(model, "set_attn_implementation", None)) or not hasattr(
            model, "config"):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        raise TypeError(f"{type(model).__name__} does not use transformers' attention "
                        "interface, so its attention cannot be swapped")
    config = model.config
    if getattr(config, "is_decoder", False):
        raise ValueError("HSA replaces bidirectional self-attention: this model is a "
                         "decoder (config.is_decoder)")
    original = config._attn_implementation
    if original == IMPLEMENTATION or _patch_of(config) is not None:
        raise ValueError("the model is already patched; call unpatch() first")
    if original not in ("sdpa", "eager"):
        raise ValueError(f"attention implementation {original!r} is not supported; load "
                         "the model with attn_implementation='sdpa' or 'eager'")
    available = _attention_layers(model)
    if not available:
        raise TypeError(f"{type(model).__name__} has no attention modules with a layer_idx")
    if layers is None:
        layers = available
    layers = tuple(layers)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in available:
            raise ValueError(f"layer {layer!r} is not an attention layer of the model "
                             f"(layers {available[0]}..{available[-1]})")
    check_hierarchy(hierarchy)  # fail now, not inside the forward
    _register()
    configs = [config] + [m.config for m in model.modules()
                          if hasattr(m, "config") and m.config is not config
                          and hasattr(m.config, "_attn_implementation")]
    patch = HSAPatch(model, layers, hierarchy, original, configs)
    for c in configs:
        _register_config(c, patch)
    try:
        model.set_attn_implementation(IMPLEMENTATION)
    except Exception:
        for c in configs:
            _unregister_config(c)
        raise
    return patch


def unpatch_hsa(model: Any) -> None:
    """Restore the original attention of a model patched by :func:`patch_hsa`.

    Raises:
        ValueError: the model is not patched.
    """
    patch = _patch_of(getattr(model, "config", None))
    if patch is None:
        raise ValueError("the model is not patched by patch_hsa")
    patch.unpatch()
