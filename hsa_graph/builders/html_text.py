r"""The text of a page as subtrees: each text run (and each image's alt text) becomes
the nodes of its sentences and tokens.

Two strategies fill the page's per-node arrays: ``_DefaultRuns`` splits runs into
sentences and words with the text builder's splitter and lays their nodes out with
array code, the tokens embedded by ``embed`` (default :func:`hash_tokens`, stable
hashed ids); ``_CustomRuns`` turns each run into the tree of a user
``text_tree`` and splices it in whole. Images get modality ``1``, text ``0``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..signal import NestedSignal
from .html_content import _SEQUENCE, _Content
from .html_parse import _RUN
from .text import WordTokenizer, split_sentences

if TYPE_CHECKING:  # the arrays are filled here and built there
    from .html_assembly import _Arrays

__all__ = ["hash_tokens"]

_TEXT_MODALITY, _IMAGE_MODALITY = 0, 1

TextTree = Callable[[str], NestedSignal]
Embed = Callable[[List[str]], Tensor]


def hash_tokens(tokens: Sequence[str], num_buckets: int = 2 ** 18) -> Tensor:
    r"""Stable token ids of the case-folded tokens, hashed as by the text builder's
    :class:`~hsa_graph.builders.text.WordTokenizer`, as a ``[T]`` long tensor (the same
    on every run and machine, unlike Python's ``hash``).

    Example:
        >>> hash_tokens(["Cat", "cat", "dog"], num_buckets=1000).tolist()
        [939, 939, 465]
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be positive, got {num_buckets}")
    hashing = WordTokenizer(num_buckets=num_buckets)
    return torch.tensor(hashing.token_ids([t.casefold() for t in tokens]), dtype=torch.long)


_WORDS = WordTokenizer()


def _sentences(line: str) -> List[str]:
    """Split one line into sentences with the text builder's splitter."""
    return [s for s in (line[a:b].strip() for a, b in split_sentences(line)) if s]


def _run_sentences(text: str, pre: bool, max_tokens: Optional[int]) -> List[List[str]]:
    """Tokens of each sentence of a text run; sentences longer than ``max_tokens`` are
    cut into consecutive pieces."""
    if pre:
        lines = text.split("\n")
        if lines and not lines[0].strip():
            lines = lines[1:]                 # HTML drops a newline right after <pre>
        sentences = [line for line in lines if line.strip()]
    else:
        sentences = [s for line in text.split("\n") for s in _sentences(line)]
    tokenised = [tokens for tokens in map(_WORDS, sentences) if tokens]
    if max_tokens is None or all(len(t) <= max_tokens for t in tokenised):
        return tokenised
    return [t[i:i + max_tokens] for t in tokenised for i in range(0, len(t), max_tokens)]



class _DefaultRuns:
    """Runs split by the built-in splitter; their nodes are laid out with array code."""

    key = None
    sibling_edges = None

    @staticmethod
    def root_offset(u: int) -> int:
        return 0                                  # a run's root is its first node

    def __init__(self, content: _Content, image_token: str, max_children: Optional[int]):
        self.content = content
        self.image_token = image_token
        self.max_children = max_children
        self.sentences: Dict[int, List[List[str]]] = {}

    def parts(self, u: int) -> List[int]:
        """Tokenise run ``u``: ``[u]``, or ``[]`` without tokens, or new runs of at most
        ``max_children`` sentences each when it has more."""
        content, limit = self.content, self.max_children
        text, tag = content.text[u], content.tag[u]
        if text is None:                          # an image without alt text
            sentences = [[self.image_token]]
        elif tag == "#token":
            sentences = [[text]]
        else:
            sentences = _run_sentences(text, content.pre[u], limit)
        if not sentences:
            return []
        if limit is None or len(sentences) <= limit:
            self.sentences[u] = sentences
            return [u]
        pieces = []
        for i in range(0, len(sentences), limit):
            piece = content._add(_RUN, tag, u, "")
            self.sentences[piece] = sentences[i:i + limit]
            pieces.append(piece)
        return pieces

    def sizes(self, runs: List[int]) -> np.ndarray:
        self.tokens = [t for u in runs for tokens in self.sentences[u] for t in tokens]
        self.n_sent = np.asarray([len(self.sentences[u]) for u in runs], dtype=np.int64)
        self.n_tok = np.asarray([len(tokens) for u in runs for tokens in self.sentences[u]],
                                dtype=np.int64)
        # A sentence of one token is that token; a run of one sentence is that sentence.
        self.sentence_node = self.n_tok >= 2
        self.run_node = self.n_sent >= 2
        self.sentence_run = np.repeat(np.arange(self.n_sent.size), self.n_sent)
        self.sentence_size = self.n_tok + self.sentence_node
        run_size = np.bincount(self.sentence_run, weights=self.sentence_size,
                               minlength=self.n_sent.size).astype(np.int64)
        return run_size + self.run_node

    def fill(self, arrays: _Arrays, runs: List[int], base: np.ndarray, run_parent: np.ndarray,
             is_image: np.ndarray, embed: Optional[Embed]) -> Tensor:
        n_sent, n_tok, run_of = self.n_sent, self.n_tok, self.sentence_run
        modality = np.where(is_image, _IMAGE_MODALITY, _TEXT_MODALITY)
        # run nodes (runs of two or more sentences)
        has = self.run_node
        arrays.parent[base[has]] = run_parent[has]
        arrays.geometry[base[has]] = _SEQUENCE
        arrays.modality[base[has]] = modality[has]
        # sentences: offset in their run = sum of the sizes of the run's earlier sentences
        before = np.cumsum(self.sentence_size) - self.sentence_size
        first_sentence = np.cumsum(n_sent) - n_sent
        local = before - before[first_sentence][run_of]
        sentence_id = base[run_of] + has[run_of] + local
        sentence_parent = np.where(has[run_of], base[run_of], run_parent[run_of])
        node = self.sentence_node
        arrays.parent[sentence_id[node]] = sentence_parent[node]
        arrays.geometry[sentence_id[node]] = _SEQUENCE
        arrays.modality[sentence_id[node]] = modality[run_of][node]
        # tokens (leaves; geometry stays -1)
        token_sentence = np.repeat(np.arange(n_tok.size), n_tok)
        first_token = np.cumsum(n_tok) - n_tok
        k = np.arange(token_sentence.size) - first_token[token_sentence]
        token_id = sentence_id[token_sentence] + node[token_sentence] + k
        arrays.parent[token_id] = np.where(node[token_sentence], sentence_id[token_sentence],
                                           sentence_parent[token_sentence])
        arrays.modality[token_id] = modality[run_of][token_sentence]
        x = (embed or hash_tokens)(self.tokens)
        if not isinstance(x, Tensor):
            raise TypeError(f"embed must return a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[0] != len(self.tokens):
            raise ValueError(f"embed must return one row per token: got shape "
                             f"{tuple(x.shape)} for {len(self.tokens)} tokens")
        # Tokens were collected in pre-order, which is leaf order; the sort makes it exact.
        return x[torch.from_numpy(np.argsort(token_id, kind="stable"))]


class _CustomRuns:
    """Runs turned into trees by a user ``text_tree`` and spliced in whole."""

    def __init__(self, content: _Content, image_token: str, text_tree: TextTree):
        self.content = content
        self.image_token = image_token
        self.text_tree = text_tree
        self.trees: Dict[int, NestedSignal] = {}
        self.key: Optional[List[Optional[str]]] = None
        self.sibling_edges: Optional[Tensor] = None

    def parts(self, u: int) -> List[int]:
        text = self.content.text[u]
        if text is None:
            text = self.image_token
        elif self.content.pre[u] and text.startswith("\n"):
            text = text[1:]                       # HTML drops a newline right after <pre>
        tree = self.text_tree(text)
        if not isinstance(tree, NestedSignal):
            raise TypeError(f"text_tree must return a NestedSignal, got "
                            f"{type(tree).__name__} for {text[:40]!r}")
        if tree.structure.num_trees != 1:
            raise ValueError(f"text_tree returned a forest of {tree.structure.num_trees} "
                             f"trees for {text[:40]!r}; one tree per text is needed")
        self.trees[u] = tree
        return [u]

    def sizes(self, runs: List[int]) -> np.ndarray:
        return np.asarray([self.trees[u].num_nodes for u in runs], dtype=np.int64)

    def root_offset(self, u: int) -> int:
        return int((self.trees[u].parent < 0).nonzero()[0])

    def fill(self, arrays: _Arrays, runs: List[int], base: np.ndarray, run_parent: np.ndarray,
             is_image: np.ndarray, embed: Optional[Embed]) -> Optional[Tensor]:
        trees = [self.trees[u] for u in runs]
        xs = [t.get("x") for t in trees]
        if any(x is not None for x in xs) and any(x is None for x in xs):
            raise ValueError("text_tree returned trees with and without x")
        keys: List[Optional[str]] = [None] * arrays.parent.size
        edges = []
        for tree, start, parent, image in zip(trees, base.tolist(), run_parent.tolist(),
                                              is_image.tolist()):
            local = tree.parent.cpu().numpy()
            node = np.arange(start, start + local.size)
            arrays.parent[node] = np.where(local >= 0, local + start, parent)
            arrays.geometry[node] = tree.geometry.cpu().numpy()
            arrays.modality[node] = _IMAGE_MODALITY if image else tree.modality.cpu().numpy()
            arrays.position[node] = tree.position.cpu().numpy()
            arrays.fixed[node[local >= 0]] = True
            if any(k is not None for k in tree.key):
                keys[start:start + local.size] = list(tree.key)
                self.key = keys
            if tree.sibling_edge_index.numel():
                edges.append(tree.sibling_edge_index.cpu() + start)
        if edges:
            self.sibling_edges = torch.cat(edges, 1)
        if xs[0] is None:
            return None
        first = xs[0]
        for x in xs:
            if x.shape[1:] != first.shape[1:] or x.dtype != first.dtype:
                raise ValueError(f"text_tree returned x of shape {tuple(x.shape)} "
                                 f"({x.dtype}) and of {tuple(first.shape)} ({first.dtype})")
        return torch.cat([x.cpu() for x in xs])
