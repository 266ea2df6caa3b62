"""Builders: from data (text, images, documents, web pages, sequences) to NestedSignals.

Each returns a :class:`~hsa_graph.NestedSignal` (or a batch of them); networkx trees go
through :meth:`~hsa_graph.NestedSignal.from_networkx`.
"""
from .document import document_tree
from .html import html_tree
from .html_text import hash_tokens
from .image import image_tree
from .text import (
    WordTokenizer,
    load_minilm_tokenizer,
    split_paragraphs,
    split_sentences,
    text_tree,
    text_trees,
)
from .website import website_tree
from .windows import (
    HoppingWindows,
    hopping_window_forest,
    hopping_window_parents,
    hopping_window_tree,
)

__all__ = [
    "HoppingWindows",
    "WordTokenizer",
    "document_tree",
    "hash_tokens",
    "hopping_window_forest",
    "hopping_window_parents",
    "hopping_window_tree",
    "html_tree",
    "image_tree",
    "load_minilm_tokenizer",
    "split_paragraphs",
    "split_sentences",
    "text_tree",
    "text_trees",
    "website_tree",
]
