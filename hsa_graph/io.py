r"""Safe saving and loading of nested signals, batches and model weights.

A file written by :func:`save` is a :func:`torch.save` archive of plain containers
only (dicts, lists, str, int, float, bool, ``None`` and tensors), read back with
``torch.load(..., weights_only=True)``: loading never runs pickled code. The payload
carries a SHA-256 digest of its content, and :func:`load` rebuilds every tree through
:meth:`~hsa_graph.NestedSignal.from_parents`, which validates it (parent ranges,
cycles, geometries, positions, keys). So a truncated, corrupted, tampered or
foreign file raises ``ValueError`` naming the problem instead of crashing later or
loading something else.

What is stored:

* a :class:`~hsa_graph.NestedSignal`: its parent array, ``x``, ``geometry``,
  ``position``, ``modality``, ``key``, ``sibling_edge_index`` and any extra attribute
  a builder added (``tokens``, ``span``...: tensors, numbers, strings, or flat lists of
  those);
* a PyG :class:`~torch_geometric.data.Batch` of them: each tree as above; loading
  batches them again, so ``batch``, ``ptr`` and the per-tree slices come back equal;
* a ``state_dict`` (a mapping of names to tensors, e.g. ``model.state_dict()``;
  modules' extra state may be plain dicts, lists, strings and numbers).

Example:
    >>> import os, tempfile, hsa_graph
    >>> from hsa_graph.builders import text_tree
    >>> tree = text_tree("Safe to load. Always!")
    >>> path = os.path.join(tempfile.mkdtemp(), "tree.pt")
    >>> hsa_graph.io.save(tree, path)
    >>> back = hsa_graph.io.load(path)
    >>> back.tokens == tree.tokens, torch.equal(back.parent, tree.parent)
    (True, True)
    >>> os.truncate(path, os.path.getsize(path) // 2)    # a broken download
    >>> try:
    ...     hsa_graph.io.load(path)
    ... except ValueError as error:
    ...     print("rejected")
    rejected
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from typing import Any, Dict, List, Mapping, Union

import torch
from torch import Tensor
from torch_geometric.data import Batch

from .signal import NestedSignal, collate

__all__ = ["load", "save"]

FORMAT = "hsa_graph.io"
VERSION = 1
_KINDS = ("tree", "batch", "state_dict")
#: Stored per tree; everything else a tree carries goes under "extras".
_FIELDS = ("parent", "x", "geometry", "position", "modality", "key", "sibling_edge_index")
_CORE = frozenset(_FIELDS) | {"edge_index", "num_nodes"}
_SCALARS = (str, int, float, bool, type(None))

PathLike = Union[str, "os.PathLike[str]"]


def save(obj: Union[NestedSignal, Batch, Mapping[str, Tensor]], path: PathLike) -> None:
    """Write a :class:`~hsa_graph.NestedSignal`, a ``Batch`` of them, or a
    ``state_dict`` to ``path`` in the safe format of this module.

    Tensors are stored detached, on the CPU.

    Raises:
        TypeError: ``obj`` is none of the above (e.g. a ``torch.nn.Module``: save its
            ``state_dict()``), or an attribute holds a value that is not a tensor,
            number, string, ``None`` or a flat list of those (naming it).
    """
    if isinstance(obj, Batch):
        if not isinstance(obj, NestedSignal):
            raise TypeError("only batches of NestedSignal can be saved, got a batch of "
                            f"{type(obj).__mro__[2].__name__}")
        kind, content = "batch", [_tree_content(t, f"tree {i}")
                                  for i, t in enumerate(obj.to_data_list())]
    elif isinstance(obj, NestedSignal):
        kind, content = "tree", _tree_content(obj, "the tree")
    elif isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"a state_dict maps str names to tensors, got the key {bad[0]!r}")
        kind = "state_dict"
        content = {k: _plain(v) if isinstance(v, Tensor) else v for k, v in obj.items()}
        try:  # also proves every value is plain data (e.g. a module's extra state)
            _digest(kind, content)
        except TypeError as error:
            raise TypeError(f"the state_dict holds a value that cannot be saved safely: "
                            f"{error}") from None
    elif isinstance(obj, torch.nn.Module):
        raise TypeError("save the module's weights: hsa_graph.io.save(model.state_dict(), "
                        "path), and load them with model.load_state_dict(load(path))")
    else:
        raise TypeError(f"cannot save a {type(obj).__name__}: expected a NestedSignal, a "
                        "Batch of them or a state_dict")
    payload = {"format": FORMAT, "version": VERSION, "kind": kind, "content": content}
    payload["sha256"] = _digest(kind, content)
    torch.save(payload, path)


def load(path: PathLike, map_location: Union[str, torch.device] = "cpu"
         ) -> Union[NestedSignal, Batch, Dict[str, Tensor]]:
    """Read what :func:`save` wrote, without executing any pickled code.

    Args:
        path: the file.
        map_location: where the tensors go (as in :func:`torch.load`).

    Returns:
        The :class:`~hsa_graph.NestedSignal`, ``Batch`` or ``state_dict`` that was saved.

    Raises:
        ValueError: the file is missing pieces, truncated, corrupted or tampered with
            (its digest does not match), not written by :func:`save`, of an unknown
            version, holds objects that need code to load, holds tensors that
            :func:`save` never writes (sparse, meta, nested or quantized ones, or views
            declaring more elements than their storage holds), or holds a tree or a
            batch that is not valid (naming the tree and the problem).

    Loading costs memory and time linear in the file's size: the archive's entries are
    checked to be stored uncompressed (as :func:`torch.save` writes them) before
    anything is read, and no tensor is expanded before its size is checked.
    """
    _check_archive(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - torch raises many kinds on bad bytes
        # (AssertionError, RuntimeError, NotImplementedError, UnpicklingError...)
        text = str(error).strip()
        first = text.splitlines()[0] if text else ""
        raise ValueError(f"{_name(path)} is not a readable hsa_graph.io file (truncated, "
                         f"corrupted, or it needs code to load): {type(error).__name__}: "
                         f"{first[:200]}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{_name(path)} was not written by hsa_graph.io.save")
    if payload.get("version") != VERSION:
        raise ValueError(f"{_name(path)} has format version "
                         f"{_short(payload.get('version'))}; this hsa_graph reads version "
                         f"{VERSION}")
    kind, content = payload.get("kind"), payload.get("content")
    if not isinstance(kind, str) or kind not in _KINDS:
        raise ValueError(f"{_name(path)} holds an unknown kind {_short(kind)}")
    try:
        digest = _digest(kind, content)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{_name(path)} holds malformed content: {error}") from None
    if payload.get("sha256") != digest:
        raise ValueError(f"{_name(path)} was modified after it was saved (its SHA-256 "
                         "digest does not match its content)")
    if kind == "state_dict":
        if not isinstance(content, dict) or not all(isinstance(k, str) for k in content):
            raise ValueError(f"{_name(path)}: a state_dict must be a dict with str keys")
        return content
    if kind == "tree":
        return _tree_from(content, "the tree")
    if not isinstance(content, list) or not content:
        raise ValueError(f"{_name(path)}: a batch must hold a non-empty list of trees")
    trees = [_tree_from(c, f"tree {i}") for i, c in enumerate(content)]
    try:  # collate names the two trees that cannot share a batch
        return collate(trees)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{_name(path)}: the saved trees do not form a batch: "
                         f"{error}") from None
    except Exception as error:  # noqa: BLE001 - PyG's collate on forged content
        raise ValueError(f"{_name(path)}: the saved trees do not form a batch: "
                         f"{type(error).__name__}: {str(error)[:200]}") from None


def _short(value: Any) -> str:
    """A bounded description of a header value (never a recursive ``repr``: a deeply
    nested forged value would raise RecursionError)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return repr(value)[:80]
    return f"<a {type(value).__name__}>"


def _check_archive(path: PathLike) -> None:
    """Refuse archives whose entries are compressed: :func:`torch.save` stores them
    uncompressed, so a compressed entry (a possible zip bomb) was not written by it."""
    start = path.tell() if hasattr(path, "tell") else None
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED or \
                        info.file_size != info.compress_size:
                    raise ValueError(f"{_name(path)} has the compressed entry "
                                     f"{info.filename[:80]!r}; hsa_graph.io.save never "
                                     "writes one, so the file was made by something else")
    except FileNotFoundError:
        raise
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - zipfile raises many kinds on bad bytes
        if isinstance(error, IsADirectoryError):
            raise ValueError(f"{_name(path)} is a directory, not a file") from None
        raise ValueError(f"{_name(path)} is not a readable hsa_graph.io file (not a "
                         f"complete zip archive: {type(error).__name__}: "
                         f"{str(error)[:200]})") from None
    finally:
        if start is not None:  # a file object: torch.load reads it from the start again
            path.seek(start)


def _name(path: Any) -> str:
    try:
        return repr(os.fspath(path))
    except TypeError:  # a file object
        return f"the {type(path).__name__}"


# ------------------------------------------------------------------ writing
def _plain(t: Tensor) -> Tensor:
    # a plain CPU tensor: subclasses (PyG's Index...) would need their code to load
    return t.detach().cpu().as_subclass(Tensor).clone()


def _tree_content(tree: NestedSignal, where: str) -> Dict[str, Any]:
    x = tree.get("x")
    content: Dict[str, Any] = {
        "parent": _plain(tree.parent),
        "x": None if x is None else _plain(x),
        "geometry": _plain(tree.geometry),
        "position": _plain(tree.position),
        "modality": _plain(tree.modality),
        "key": list(tree.key),
        "sibling_edge_index": _plain(tree.sibling_edge_index),
    }
    extras = {}
    for name in sorted(set(tree.keys()) - _CORE):
        value = tree[name]
        if isinstance(value, Tensor):
            extras[name] = _plain(value)
        elif isinstance(value, _SCALARS):
            extras[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value):
            extras[name] = list(value)
        else:
            raise TypeError(f"attribute {name!r} of {where} is a {type(value).__name__}; "
                            "only tensors, numbers, strings, None and flat lists of those "
                            "can be saved safely")
    content["extras"] = extras
    return content


class _Key:
    """A dict key in the digest walk (apart from values, which may be strings too)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def _digest(kind: str, content: Any) -> str:
    """SHA-256 over a canonical walk of the content (iterative: no recursion limit)."""
    h = hashlib.sha256(f"{FORMAT}/{VERSION}/{kind}".encode())
    stack: List[Any] = [content]
    storages: set = set()  # save gives every tensor its own storage
    while stack:
        value = stack.pop()
        if isinstance(value, _Key):
            h.update(b"K" + json.dumps(value.name).encode())
        elif isinstance(value, Tensor):
            _check_tensor(value)
            storage = value.untyped_storage()
            if storage.nbytes():
                if storage.data_ptr() in storages:
                    raise TypeError("two tensors share one storage, which save never writes")
                storages.add(storage.data_ptr())
            t = value.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError("dict keys must be str")
            h.update(f"D{len(value)}".encode())
            for k in sorted(value, reverse=True):
                stack.append(value[k])
                stack.append(_Key(k))
        elif isinstance(value, (list, tuple)):
            h.update(f"{'L' if isinstance(value, list) else 'U'}{len(value)}".encode())
            stack.extend(reversed(value))
        elif isinstance(value, _SCALARS):
            h.update(b"S" + json.dumps([type(value).__name__, value]).encode())
        else:
            raise TypeError(f"unexpected {type(value).__name__} in the content")
    return h.hexdigest()


def _check_tensor(t: Tensor) -> None:
    """Refuse, before touching its data, a tensor that :func:`save` never writes: one
    that is not a dense array, or a view that declares more elements than its storage
    holds (an expanded 2**40-element view of one number would need terabytes as soon
    as it is made contiguous)."""
    described = f"a {str(t.dtype).replace('torch.', '')} tensor"
    if t.is_nested:
        raise TypeError(f"{described} is a nested tensor; only dense tensors are stored")
    if t.layout != torch.strided:
        raise TypeError(f"{described} has layout {t.layout}; only dense (strided) tensors "
                        "are stored")
    if t.is_meta or t.is_quantized or t.device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise TypeError(f"{described} on device {t.device} "
                        f"{'(quantized) ' if t.is_quantized else ''}holds no plain data; only "
                        "dense tensors with data are stored")
    need = t.numel() * t.element_size()
    have = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    if need > have or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise TypeError(f"{described} of shape {tuple(t.shape)} ({need} bytes) is a view over "
                        f"a storage of {max(have, 0)} bytes (expanded or overlapping); only "
                        "dense tensors are stored")


# ------------------------------------------------------------------ reading
def _tree_from(content: Any, where: str) -> NestedSignal:
    if not isinstance(content, dict) or set(content) != set(_FIELDS) | {"extras"}:
        raise ValueError(f"{where}: expected the fields {sorted(_FIELDS)} and 'extras'")
    for name in ("parent", "geometry", "position", "modality", "sibling_edge_index"):
        if not isinstance(content[name], Tensor):
            raise ValueError(f"{where}: field {name!r} is a {type(content[name]).__name__}, "
                             "expected a tensor")
    x, key, extras = content["x"], content["key"], content["extras"]
    if x is not None and not isinstance(x, Tensor):
        raise ValueError(f"{where}: field 'x' is a {type(x).__name__}, expected a tensor")
    if not isinstance(key, list) or not all(k is None or isinstance(k, str) for k in key):
        raise ValueError(f"{where}: field 'key' must be a list of str or None")
    if not isinstance(extras, dict):
        raise ValueError(f"{where}: field 'extras' must be a dict")
    try:
        return NestedSignal.from_parents(
            content["parent"], x, geometry=content["geometry"], position=content["position"],
            modality=content["modality"], key=key,
            sibling_edge_index=content["sibling_edge_index"], **extras)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where} is not a valid nested signal: {error}") from None
