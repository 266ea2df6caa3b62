r"""ListOps (Nangia and Bowman 2018; Long Range Arena, Tay et al. 2021): nested list
operations over the digits 0-9 whose parse tree is the nested signal.

An expression is written in prefix form with brackets, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]``
(value 9); its label is its value (ten classes). The operators are

* ``MAX`` and ``MIN`` of the arguments;
* ``MED``: the median, ``int(numpy.median(args))`` as in LRA's generator, so for an
  even number of arguments the mean of the two middle values rounded down
  (``[MED 1 2 ]`` is 1, ``[MED 1 2 3 6 ]`` is 2);
* ``SM``: the sum modulo 10.

**LRA's files.** LRA's generator writes a header ``Source\tTarget`` and one expression
and its label per line, with the expression *curried* in round brackets:
``( ( ( [MAX 2 ) 9 ) ] )`` is ``[MAX 2 9 ]``. :func:`parse_listops` accepts both forms
(the round brackets must balance; they carry nothing else and are dropped), and
:func:`write_listops_tsv` writes either (``parens=True``: LRA's form, byte for byte
what its generator writes for the same expression).

**Generator.** :func:`generate_listops` draws expressions as LRA's generator does
(``lra_benchmarks/data/listops.py``): a node at depth ``d < max_depth`` (the root has
depth 1) is an operator with probability ``operator_prob`` (0.25), otherwise a digit;
at ``max_depth`` always a digit; an operator draws its number of arguments uniformly
from ``2 .. max_args`` and its operator uniformly from the four. An expression is kept
when its length in tokens (operators, digits and closing brackets, not the round
brackets) lies strictly between ``min_length`` and ``max_length``, and duplicates are
dropped. LRA's settings are the defaults: ``max_depth=10``, ``max_args=10``,
lengths 500 to 2,000, and 96,000 / 2,000 / 2,000 examples
(:func:`generate_listops_splits`). The draw is vectorised over thousands of
candidate trees at once with a seeded :class:`numpy.random.Generator`, so the data is
a deterministic function of the seed and the settings (not the same expressions as
LRA's files, which came from Python's ``random``; the distribution is the same).
:func:`listops_kept_fraction` computes the share of drawn trees that is kept (about 1 in
12 at LRA's settings), so that settings which would take more than
:data:`MAX_EXPECTED_DRAWS` draws are refused at once.

**Parse tree** (:func:`listops_tree`): one internal node per bracketed operator, its
children in order: the operator token as the *first leaf* of its family, then its
arguments (digits as leaves, nested operators as internal nodes); the closing bracket
is implied by the tree and dropped (``brackets=True`` keeps it as the last leaf of the
family, so the leaves are the whole token sequence). Leaves carry token ids
(:data:`VOCAB`), so a model embeds them. Every internal node has the ``sequence``
geometry. Why the operator enters as a leaf: HSA computes only leaf outputs and sees
a sibling subtree through the mean of its leaves, so the operator must be something
its arguments can attend to inside their family; a position feature would only bias
attention logits, never carry a value.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..signal import NestedSignal, _is_int

__all__ = [
    "LRA_SETTINGS",
    "OPERATORS",
    "VOCAB",
    "ListOpsParse",
    "evaluate_listops",
    "generate_listops",
    "generate_listops_splits",
    "listops_dependence",
    "listops_kept_fraction",
    "listops_token_ids",
    "listops_tree",
    "parse_listops",
    "read_listops_tsv",
    "to_lra_form",
    "write_listops_tsv",
]

#: The four operators, in the order of their token ids (10 + index).
OPERATORS = ("MAX", "MIN", "MED", "SM")
#: The token of each id, ``VOCAB[i]``. The digits 0-9 are ids 0-9, ``[MAX [MIN [MED
#: [SM`` are 10-13 and ``]`` is 14.
VOCAB = tuple(str(d) for d in range(10)) + tuple("[" + op for op in OPERATORS) + ("]",)
CLOSE = 14
_OPEN_PAREN, _CLOSE_PAREN, _UNKNOWN = 15, 16, -1

#: LRA's generator settings (the defaults of :func:`generate_listops_splits`).
LRA_SETTINGS = dict(max_depth=10, max_args=10, min_length=500, max_length=2000,
                    num_train=96_000, num_val=2_000, num_test=2_000)


class _Lookup(dict):
    """Token -> id; unknown tokens map to -1 without being stored."""

    def __missing__(self, key):
        return _UNKNOWN


_IDS = _Lookup({token: i for i, token in enumerate(VOCAB)})
_IDS["("], _IDS[")"] = _OPEN_PAREN, _CLOSE_PAREN
_VOCAB_ARRAY = np.array(VOCAB, dtype=object)


class ListOpsParse(NamedTuple):
    """A parsed expression (round brackets dropped), as arrays over its ``T`` tokens.

    Attributes:
        tokens: ``[T]`` token ids (:data:`VOCAB`).
        source: ``[T]`` index of each token among the input's whitespace-separated
            tokens (round brackets included), for error messages.
        level: ``[T]`` number of operators open before the token (0 for the root
            operator's token and its closing bracket).
        parent: ``[T]`` index (into ``tokens``) of the operator whose family the token
            belongs to: for an operator token the enclosing operator (``-1`` at the
            root), for a digit the operator it is an argument of, for ``]`` the
            operator it closes.
        values: ``[T]`` the value of each digit and of each operator's subexpression
            (at the operator token; -1 at closing brackets).
        value: the value of the whole expression.
    """

    tokens: np.ndarray
    source: np.ndarray
    level: np.ndarray
    parent: np.ndarray
    values: np.ndarray
    value: int

    @property
    def depth(self) -> int:
        """The nesting depth, the number of operators on the longest root-to-digit path
        (0 for a lone digit)."""
        is_op = (self.tokens >= 10) & (self.tokens < CLOSE)
        return int(self.level[is_op].max()) + 1 if is_op.any() else 0


def listops_token_ids(expression: str) -> np.ndarray:
    """Token ids ``[T]`` of ``expression`` with round brackets dropped (validated as
    :func:`parse_listops` does).

    Example:
        >>> listops_token_ids("( ( ( [MAX 2 ) 9 ) ] )").tolist()
        [10, 2, 9, 14]
    """
    return parse_listops(expression).tokens


def parse_listops(expression: str, *, max_depth: Optional[int] = 1000) -> ListOpsParse:
    r"""Parse and evaluate one expression in linear time (a few array operations per
    nesting level, none per token).

    Args:
        expression: whitespace-separated tokens: digits ``0``-``9``, ``[MAX``,
            ``[MIN``, ``[MED``, ``[SM``, ``]``, and optionally LRA's round brackets.
        max_depth: refuse expressions nested deeper than this (``None``: no limit);
            the evaluation does a few array operations per level.

    Returns:
        a :class:`ListOpsParse`.

    Raises:
        TypeError: ``expression`` is not a string.
        ValueError: naming the token (0-based, counting round brackets) for an unknown
            token, a ``]`` or ``)`` that closes nothing, an operator left open, an
            operator without arguments, or tokens after the end of the expression.

    Example:
        >>> p = parse_listops("[MAX 2 9 [MIN 4 7 ] 0 ]")
        >>> p.value, p.parent.tolist(), p.depth
        (9, [-1, 0, 0, 0, 3, 3, 3, 0, 0], 2)
    """
    if not isinstance(expression, str):
        raise TypeError(f"a ListOps expression must be a str, got {type(expression).__name__}")
    if max_depth is not None:
        max_depth = _check_int("max_depth", max_depth, 1)
    words = expression.split()
    if not words:
        raise ValueError("empty ListOps expression")
    ids = np.fromiter(map(_IDS.__getitem__, words), dtype=np.int64, count=len(words))
    unknown = np.flatnonzero(ids == _UNKNOWN)
    if unknown.size:
        i = int(unknown[0])
        raise ValueError(f"unknown token {words[i]!r:.40} at token {i}; expected a digit, "
                         f"[MAX, [MIN, [MED, [SM, ] or LRA's ( )")
    # LRA's round brackets: they must balance, then they are dropped
    paren = (ids == _OPEN_PAREN).astype(np.int64) - (ids == _CLOSE_PAREN)
    if paren.any():
        depth = np.cumsum(paren)
        if (depth < 0).any():
            i = int(np.flatnonzero(depth < 0)[0])
            raise ValueError(f"')' at token {i} closes no '('")
        if depth[-1] != 0:
            i = int(np.flatnonzero((paren == 1) & (depth == 1))[-1])
            raise ValueError(f"'(' at token {i} is never closed")
    source = np.flatnonzero(paren == 0) if paren.any() else np.arange(ids.size)
    tokens = ids[source]
    if tokens.size == 0:
        raise ValueError("the expression holds only round brackets")
    n = tokens.size
    is_open = (tokens >= 10) & (tokens < CLOSE)
    is_close = tokens == CLOSE
    after = np.cumsum(is_open.astype(np.int64) - is_close)
    if (after < 0).any():
        i = int(source[np.flatnonzero(after < 0)[0]])
        raise ValueError(f"']' at token {i} closes no operator")
    # operators open before the token; a ']' gets the level of the operator it closes
    level = after - is_open
    if after[-1] != 0:
        i = int(source[np.flatnonzero(is_open & (level == 0))[-1]])
        raise ValueError(f"operator {words[i]} at token {i} is never closed "
                         f"({int(after[-1])} operator(s) left open at the end)")
    top = np.flatnonzero((level == 0) & ~is_close)
    if top.size > 1:
        raise ValueError(f"token {int(source[top[1]])} ({words[source[top[1]]]}) follows the "
                         f"end of the expression that starts at token {int(source[top[0]])}; "
                         "an expression is one digit or one bracketed operator")
    depth = int(level[is_open].max()) + 1 if is_open.any() else 0
    if max_depth is not None and depth > max_depth:
        raise ValueError(f"the expression is nested {depth} operators deep, more than "
                         f"max_depth={max_depth}")
    # parent: the last operator opened before the token at level - 1 (for ']': at its
    # own level). Operators keyed by (level, position): one searchsorted for all tokens.
    open_pos = np.flatnonzero(is_open)
    keys = level[open_pos] * (n + 1) + open_pos
    by_key = np.argsort(keys, kind="stable")
    keys, open_pos = keys[by_key], open_pos[by_key]
    target = level - 1 + is_close
    found = np.searchsorted(keys, target * (n + 1) + np.arange(n), side="right") - 1
    parent = np.where(target >= 0, open_pos[np.clip(found, 0, None)] if open_pos.size else -1,
                      -1)
    values = _evaluate(tokens, level, parent, is_open, source, words)
    return ListOpsParse(tokens, source, level, parent, values, int(values[0]))


def _evaluate(tokens, level, parent, is_open, source, words) -> np.ndarray:
    """Values of digits and operators, bottom-up one level at a time."""
    values = np.where(tokens < 10, tokens, -1)
    is_arg = (tokens < CLOSE) & (parent >= 0)
    args = np.flatnonzero(is_arg)
    counts = np.bincount(parent[args], minlength=tokens.size)
    empty = np.flatnonzero(is_open & (counts == 0))
    if empty.size:
        i = int(source[empty[0]])
        raise ValueError(f"operator {words[i]} at token {i} has no arguments")
    if not args.size:
        return values
    # arguments grouped by level (deepest first), in token order within a level: the
    # arguments of one operator are then contiguous
    args = args[np.argsort(-level[args], kind="stable")]
    arg_level = level[args]
    bounds = np.flatnonzero(np.diff(arg_level)) + 1
    for chunk in np.split(args, bounds):
        owner = parent[chunk]
        starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        ops = owner[starts]
        vals = values[chunk]
        sizes = np.diff(np.r_[starts, chunk.size])
        group = np.repeat(np.arange(starts.size), sizes)
        ordered = vals[np.lexsort((vals, group))]
        med = (ordered[starts + (sizes - 1) // 2] + ordered[starts + sizes // 2]) // 2
        table = np.stack([np.maximum.reduceat(vals, starts), np.minimum.reduceat(vals, starts),
                          med, np.add.reduceat(vals, starts) % 10])
        values[ops] = table[tokens[ops] - 10, np.arange(ops.size)]
    return values


def evaluate_listops(expression: str) -> int:
    """The exact value (0-9) of a ListOps expression (see :func:`parse_listops`).

    Example:
        >>> evaluate_listops("[SM 5 [MED 1 2 ] 7 ]"), evaluate_listops("( ( ( [MED 1 ) 2 ) ] )")
        (3, 1)
    """
    return parse_listops(expression).value


def _order_statistic(cumulative: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """The ``rank``-th smallest value (0-based) of digit histograms given as their
    cumulative counts ``[..., 10]``."""
    return (cumulative <= rank[..., None]).sum(-1)


def listops_dependence(expression: Union[str, ListOpsParse]) -> np.ndarray:
    r"""How much the value of the expression depends on each nested operator's value.

    For every operator token below the root: the fraction of the 9 wrong values that
    operator could take (the others unchanged) which change the value of the whole
    expression; 0 for the root and for every other token. The sum over the tokens is
    the expected number of nested results whose error reaches the answer, for a model
    that gets each one wrong with a uniformly drawn wrong value: a ``SM`` passes every
    error of every argument on, a ``MAX`` only those of its arguments that can exceed
    its maximum. Computed top-down, a few array operations per level (each operator's
    function from its value to the root's value is a table of 10 entries).

    Args:
        expression: an expression (:func:`parse_listops` checks it) or its parse.

    Returns:
        ``[T]`` float64, one entry per token of the parse (round brackets dropped).

    Example:
        >>> dep = listops_dependence("[SM 1 [MAX 2 3 ] [MIN 4 [MAX 0 5 ] ] ]")
        >>> dep.round(3).tolist()
        [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.444, 0.0, 0.0, 0.0, 0.0, 0.0]
        >>> float(dep.sum().round(3))
        2.444
    """
    parsed = expression if isinstance(expression, ListOpsParse) else parse_listops(expression)
    tokens, level, parent, values = parsed.tokens, parsed.level, parsed.parent, parsed.values
    n = tokens.size
    dependence = np.zeros(n)
    is_open = (tokens >= 10) & (tokens < CLOSE)
    nested = np.flatnonzero(is_open & (parent >= 0))
    if not nested.size:
        return dependence
    # histogram of every operator's argument values
    args = np.flatnonzero((tokens < CLOSE) & (parent >= 0))
    histogram = np.zeros((n, 10), dtype=np.int64)
    np.add.at(histogram, (parent[args], values[args]), 1)
    # root_of[i, v]: the expression's value were operator i's value v
    root_of = np.zeros((n, 10), dtype=np.int64)
    root_of[0] = np.arange(10)
    by_level = nested[np.argsort(level[nested], kind="stable")]
    bounds = np.flatnonzero(np.diff(level[by_level])) + 1
    # chunks of one level at a time, small enough to bound the [C, 10, 10] temporaries
    for same_level in np.split(by_level, bounds):
        for child in np.array_split(same_level, -(-same_level.size // _DEPENDENCE_CHUNK)):
            _propagate_dependence(child, parent[child], tokens, values, histogram, root_of,
                                  dependence, parsed.value)
    return dependence


#: at most this many operators per step of :func:`listops_dependence`
_DEPENDENCE_CHUNK = 16_384


def _propagate_dependence(child, owner, tokens, values, histogram, root_of, dependence,
                          root_value) -> None:
    """One step of :func:`listops_dependence`: the tables of operators ``child`` from
    those of their ``owner`` operators."""
    digits = np.arange(10)
    # the owner's argument histogram with the child's value replaced by each v
    swapped = np.repeat(histogram[owner][:, None, :], 10, axis=1)        # [C, v, 10]
    swapped[np.arange(child.size), :, values[child]] -= 1
    swapped[:, digits, digits] += 1
    cumulative = swapped.cumsum(-1)
    count = cumulative[..., -1]
    low = _order_statistic(cumulative, (count - 1) // 2)
    high = _order_statistic(cumulative, count // 2)
    outcome = np.stack([_order_statistic(cumulative, count - 1),          # MAX
                        _order_statistic(cumulative, np.zeros_like(count)),  # MIN
                        (low + high) // 2,                                # MED
                        (swapped * digits).sum(-1) % 10])                 # SM
    owner_value = outcome[tokens[owner] - 10, np.arange(child.size)]      # [C, v]
    root_of[child] = np.take_along_axis(root_of[owner], owner_value, axis=1)
    dependence[child] = (root_of[child] != root_value).sum(-1) / 9.0


def to_lra_form(expression: str) -> str:
    """``expression`` curried in round brackets as LRA's generator writes it.

    Example:
        >>> to_lra_form("[MAX 2 9 ]")
        '( ( ( [MAX 2 ) 9 ) ] )'
    """
    p = parse_listops(expression)
    n = p.tokens.size
    is_open = (p.tokens >= 10) & (p.tokens < CLOSE)
    is_arg = (p.tokens < CLOSE) & (p.parent >= 0)
    nargs = np.bincount(p.parent[is_arg], minlength=n)
    before = np.where(is_open, nargs + 1, 0)
    # a digit argument closes one bracket; a ']' closes its operator's pair and, when
    # that operator is an argument, the argument's pair
    op_of_close = np.where(p.tokens == CLOSE, p.parent, 0)
    after = np.where(p.tokens < 10, is_arg.astype(np.int64),
                     np.where(p.tokens == CLOSE, 1 + (p.parent[op_of_close] >= 0), 0))
    words = _VOCAB_ARRAY[p.tokens]
    # token i becomes before[i] "(", itself, after[i] ")": laid out with array ops
    counts = before + 1 + after
    out = np.empty(int(counts.sum()), dtype=object)
    start = np.cumsum(counts) - counts
    out[:] = "("
    ends = start + before
    out[ends] = words
    close_mask = np.zeros(out.size, dtype=bool)
    span = np.repeat(np.arange(n), after)
    offs = np.arange(span.size) - np.repeat(np.cumsum(after) - after, after)
    close_mask[ends[span] + 1 + offs] = True
    out[close_mask] = ")"
    return " ".join(out.tolist())


# ------------------------------------------------------------------ trees
def listops_tree(expression: Union[str, ListOpsParse], *, brackets: bool = False,
                 node_tokens: bool = False, max_depth: Optional[int] = 1000) -> NestedSignal:
    r"""The parse tree of an expression as a :class:`~hsa_graph.NestedSignal`: one
    internal node per bracketed operator whose children are, in order, the operator
    token (a leaf), its arguments (digit leaves, nested operators' nodes) and, with
    ``brackets=True``, the closing bracket (a leaf).

    Nodes are numbered in token order (an operator's internal node just before its
    operator leaf), so the leaves are the tokens in order. A lone digit becomes a
    root with that one leaf.

    With ``node_tokens=True`` every nested operator is also an argument of its parent
    as one leaf, its *node token* (the operator's token id, placed just before the
    operator's node), and the tree records ``mirror_index`` ``[K]`` (the node tokens'
    nodes) and ``mirror_source_index`` ``[K]`` (the nodes of the operator leaves they
    stand for). A model that copies each operator leaf's features into its node token
    after every layer (:class:`~hsa_graph.nn.HierarchicalTransformerEncoder`'s
    ``mirrors``) lets the parent's family read a nested result as one vector computed
    inside the operator's family, instead of only as its subtree's mean.

    Args:
        expression: the expression, or its :func:`parse_listops` result.
        brackets: keep ``]`` as the last leaf of each family.
        node_tokens: give every nested operator a node token in its parent's family.
        max_depth: see :func:`parse_listops`.

    Returns:
        a tree with ``x`` ``[N]`` token ids (long, :data:`VOCAB`), ``y`` ``[1]`` the
        value, and ``depth`` ``[1]`` the nesting depth.

    Example:
        >>> tree = listops_tree("[MAX 2 9 [MIN 4 7 ] 0 ]")
        >>> tree.parent.tolist()            # MAX node, its leaves, MIN node, its leaves
        [-1, 0, 0, 0, 0, 4, 4, 4, 0]
        >>> tree.x.tolist(), tree.y.tolist()
        ([10, 2, 9, 11, 4, 7, 0], [9])
        >>> tree = listops_tree("[MAX 2 9 [MIN 4 7 ] 0 ]", node_tokens=True)
        >>> tree.parent.tolist()            # MIN's node token (node 4) before MIN's node
        [-1, 0, 0, 0, 0, 0, 5, 5, 5, 0]
        >>> tree.x.tolist(), tree.mirror_index.tolist(), tree.mirror_source_index.tolist()
        ([10, 2, 9, 11, 11, 4, 7, 0], [4], [6])
    """
    p = expression if isinstance(expression, ListOpsParse) else parse_listops(
        expression, max_depth=max_depth)
    tokens = p.tokens
    keep = np.ones(tokens.size, dtype=bool) if brackets else tokens != CLOSE
    kept = np.flatnonzero(keep)
    mirrors = np.zeros(0, dtype=np.int64)
    if kept.size == 1:  # a lone digit: a root with one leaf
        parent = torch.tensor([-1, 0])
        x = torch.as_tensor(tokens[kept])
    else:
        is_open = (tokens[kept] >= 10) & (tokens[kept] < CLOSE)
        owner = p.parent[kept]
        # a nested operator's node token comes just before its node
        has_token = is_open & (owner >= 0) if node_tokens else np.zeros_like(is_open)
        leaf_node = np.arange(kept.size) + np.cumsum(is_open) + np.cumsum(has_token)
        node_of_op = np.full(tokens.size, -1, dtype=np.int64)
        node_of_op[kept[is_open]] = leaf_node[is_open] - 1
        parent = np.empty(kept.size + int(is_open.sum()) + int(has_token.sum()),
                          dtype=np.int64)
        # a leaf's family: its own operator for an operator token, else its parent's
        parent[leaf_node] = np.where(is_open, leaf_node - 1,
                                     node_of_op[np.clip(owner, 0, None)])
        op_owner = owner[is_open]
        parent[leaf_node[is_open] - 1] = np.where(op_owner >= 0,
                                                  node_of_op[np.clip(op_owner, 0, None)], -1)
        mirrors = leaf_node[has_token] - 2
        parent[mirrors] = parent[mirrors + 1]
        parent = torch.from_numpy(parent)
        x = tokens[kept]
        if node_tokens:  # a node token's id: its operator's, inserted before it
            x = np.insert(x, np.flatnonzero(has_token), x[has_token])
        x = torch.from_numpy(x.copy())
    tree = NestedSignal.from_parents(parent, x, geometry="sequence")
    tree.y = torch.tensor([p.value], dtype=torch.long)
    tree.depth = torch.tensor([p.depth], dtype=torch.long)
    if node_tokens:
        tree.mirror_index = torch.from_numpy(mirrors)
        tree.mirror_source_index = torch.from_numpy(mirrors + 2)
    return tree


# ------------------------------------------------------------------ generator
def _check_int(name: str, value, low: int) -> int:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _operator_ids(operators: Sequence[str]) -> np.ndarray:
    if isinstance(operators, str) or not isinstance(operators, (list, tuple)):
        raise TypeError(f"operators must be a list or tuple of names from {OPERATORS}, got "
                        f"{operators!r}")
    unknown = [op for op in operators if op not in OPERATORS]
    if unknown or not operators or len(set(operators)) != len(operators):
        raise ValueError(f"operators must be distinct names from {OPERATORS}, at least one, "
                         f"got {list(operators)!r}")
    # the ids in OPERATORS' order, so the full set draws exactly as before
    return np.array(sorted(OPERATORS.index(op) for op in operators), dtype=np.int64)


#: The longest expression :func:`generate_listops` draws (tokens): a batch of trees grows
#: level by level up to ``max_length`` tokens each, in arrays of that many entries.
MAX_GENERATED_LENGTH = 1 << 24

#: Tokens that the trees of one batch of :func:`generate_listops` may hold at once.
_BATCH_TOKENS = 1 << 23


def _fits_in_memory(num_examples: int, min_length: int) -> bool:
    """Whether ``num_examples`` expressions of more than ``min_length`` tokens (two bytes
    of text per token at least, and about 100 bytes of Python objects per expression)
    could fit in this machine's physical memory (``True`` where it cannot be read)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return True
    return num_examples * (2 * (min_length + 1) + 100) <= memory


def _max_possible_length(max_depth: int, max_args: int) -> int:
    length = 1
    for _ in range(max_depth - 1):
        length = 2 + max_args * length
        if length > 10**12:
            break
    return length


#: The most draws :func:`generate_listops` is expected to make (about 20 minutes at LRA's
#: settings on one core): settings that keep fewer expressions than ``num_examples`` in
#: as many draws are refused before the first draw, not after minutes of rejections.
MAX_EXPECTED_DRAWS = 10**8

#: The longest length up to which :func:`listops_kept_fraction` resolves the
#: distribution of lengths; the mass above it is bounded, not resolved.
_LENGTH_DISTRIBUTION_CAP = 1 << 12


def _checked_settings(max_depth, max_args, operator_prob, min_length, max_length
                      ) -> Tuple[int, int, float, int, int]:
    """The generator's settings, checked (ValueError naming the setting) and as plain
    ``int`` / ``float``."""
    max_depth = _check_int("max_depth", max_depth, 1)
    max_args = _check_int("max_args", max_args, 2)
    min_length = _check_int("min_length", min_length, 0)
    max_length = _check_int("max_length", max_length, 2)
    if isinstance(operator_prob, (bool, np.bool_)) or \
            not isinstance(operator_prob, (int, float, np.integer, np.floating)) or \
            not 0.0 < float(operator_prob) <= 1.0:
        raise ValueError(f"operator_prob must be a number in (0, 1], got {operator_prob!r}")
    if max_length - min_length < 2:
        raise ValueError(f"no length lies strictly between min_length={min_length} and "
                         f"max_length={max_length}")
    if max_length > MAX_GENERATED_LENGTH + 1:
        raise ValueError(f"max_length={max_length:,}: generate_listops draws expressions of "
                         f"at most {MAX_GENERATED_LENGTH:,} tokens")
    return max_depth, max_args, float(operator_prob), min_length, max_length


def _drawn_max_args(max_args: int, max_length: int) -> int:
    """The most arguments an operator is drawn with: an operator of k arguments spans at
    least k + 2 tokens, so no kept expression has one of more than ``max_length - 3``,
    and drawing from 2 .. that bound keeps the distribution of kept expressions (the
    draws above it were all rejected)."""
    return max(2, min(max_args, max_length - 3))


def listops_kept_fraction(*, max_depth: int = 10, max_args: int = 10,
                          operator_prob: float = 0.25, min_length: int = 500,
                          max_length: int = 2000) -> Optional[float]:
    r"""The probability that one tree drawn by :func:`generate_listops` is kept, i.e. has
    ``min_length < T < max_length`` tokens, computed (not sampled), or ``None`` where
    the computation would be long (very deep and wide settings). Exact for
    ``max_length <= 4,096``; above, an upper bound (the mass at 4,096 tokens and more
    counts as kept).

    With :math:`P_d` the distribution of the length of a subtree rooted at depth
    :math:`d` (:math:`P_{D} = \delta_1` at ``max_depth`` :math:`D`), an operator adds
    its token and ``]`` to the lengths of its :math:`k \sim U\{2..A\}` arguments:

    .. math::
        P_d = (1 - p)\, \delta_1 + \frac{p}{A - 1} \sum_{k=2}^{A} \delta_2 * P_{d+1}^{*k},

    every distribution truncated at ``max_length`` (lengths only grow, so what lies
    beyond never comes back below it); the result is the mass of :math:`P_1` strictly
    between the bounds.

    Raises:
        ValueError: a setting :func:`generate_listops` refuses (naming it).

    Example:
        >>> round(listops_kept_fraction(), 3)   # LRA's settings: about 1 draw in 12
        0.083
    """
    max_depth, max_args, operator_prob, min_length, max_length = _checked_settings(
        max_depth, max_args, operator_prob, min_length, max_length)
    max_args = _drawn_max_args(max_args, max_length)
    cap = min(max_length, _LENGTH_DISTRIBUTION_CAP)
    # a tree with an operator at depth d spans at least 2 d + 1 tokens: from depth
    # (cap + 1) // 2 on, an operator's tree is never under cap, and its mass drops out
    depth = min(max_depth, (cap + 1) // 2)
    if (depth - 1) * (max_args - 1) > 1024:
        return None
    size = 1 << (2 * cap - 1).bit_length()       # FFT length with no wraparound below cap

    def convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        both = np.fft.rfft(a, size) * np.fft.rfft(b, size)
        return np.fft.irfft(both, size)[:cap].clip(min=0.0)

    pmf = np.zeros(cap)
    pmf[1] = 1.0 if depth == max_depth else 1.0 - operator_prob
    for _ in range(depth - 1):
        power, arguments = pmf, np.zeros(cap)
        for _ in range(2, max_args + 1):
            power = convolve(power, pmf)
            arguments += power
        pmf = np.zeros(cap)
        pmf[2:] = operator_prob / (max_args - 1) * arguments[:cap - 2]
        pmf[1] += 1.0 - operator_prob
    kept = float(pmf[min(min_length + 1, cap):].sum())
    if cap < max_length:   # the mass at cap and above: some of it may be kept
        kept += max(0.0, 1.0 - float(pmf.sum()))
    return min(kept, 1.0)


def _sample_batch(rng: np.random.Generator, size: int, max_depth: int, max_args: int,
                  operator_prob: float, min_length: int, max_length: int,
                  operator_ids: np.ndarray) -> Tuple[List[str], List[int]]:
    """Draw ``size`` candidate trees level by level; return the expressions (and
    values) whose length lies strictly between the bounds, in draw order."""
    tree = np.arange(size)
    known = np.zeros(size, dtype=np.int64)  # tokens of the levels drawn so far
    alive = np.ones(size, dtype=bool)
    levels = []
    for depth in range(1, max_depth + 1):
        n = tree.size
        if n == 0:
            break
        is_op = (rng.random(n) < operator_prob) if depth < max_depth else np.zeros(n, bool)
        nargs = np.where(is_op, rng.integers(2, max_args + 1, n), 0)
        op = operator_ids[rng.integers(0, operator_ids.size, n)]
        digit = rng.integers(0, 10, n)
        known += np.bincount(tree, weights=np.where(is_op, 2, 1), minlength=size).astype(
            np.int64)
        pending = np.bincount(tree, weights=nargs, minlength=size).astype(np.int64)
        # every pending argument adds at least one token: stop growing hopeless trees
        alive &= known + pending < max_length
        levels.append((tree, is_op, nargs, np.where(is_op, 10 + op, digit)))
        # children of live trees only: a dead tree's would be dropped at once, and a
        # huge max_args would make them an array of max_args entries per operator
        tree = np.repeat(tree, np.where(alive[tree], nargs, 0))
        if depth < max_depth:
            levels[-1] = levels[-1] + (alive[levels[-1][0]],)
    accept = alive & (known > min_length) & (known < max_length)
    if not accept.any():
        return [], []
    # keep the accepted trees' nodes; children stay grouped by parent, in order
    kept = []
    for entry in levels:
        t, is_op, nargs, tok = entry[:4]
        mask = accept[t]
        kept.append((t[mask], is_op[mask], nargs[mask], tok[mask]))
    # bottom-up: subtree token lengths and values
    lengths, values = [None] * len(kept), [None] * len(kept)
    for d in range(len(kept) - 1, -1, -1):
        t, is_op, nargs, tok = kept[d]
        length = np.ones(t.size, dtype=np.int64)
        value = np.where(is_op, -1, tok)
        ops = np.flatnonzero(is_op)
        if ops.size:
            starts = (np.cumsum(nargs) - nargs)[ops]
            child_len, child_val = lengths[d + 1], values[d + 1]
            length[ops] = 2 + np.add.reduceat(child_len, starts)
            sizes = nargs[ops]
            group = np.repeat(np.arange(ops.size), sizes)
            ordered = child_val[np.lexsort((child_val, group))]
            med = (ordered[starts + (sizes - 1) // 2] + ordered[starts + sizes // 2]) // 2
            table = np.stack([np.maximum.reduceat(child_val, starts),
                              np.minimum.reduceat(child_val, starts), med,
                              np.add.reduceat(child_val, starts) % 10])
            value[ops] = table[tok[ops] - 10, np.arange(ops.size)]
        lengths[d], values[d] = length, value
    # top-down: each node's first token offset in the concatenated token array
    roots_len = lengths[0]
    offset = [np.cumsum(roots_len) - roots_len]
    for d in range(len(kept) - 1):
        t, is_op, nargs, tok = kept[d]
        if not kept[d + 1][0].size:
            break
        child_len = lengths[d + 1]
        parent_start = np.repeat(offset[d], nargs)
        group_first = np.repeat(np.cumsum(nargs) - nargs, nargs)
        before = np.cumsum(child_len) - child_len
        offset.append(parent_start + 1 + before - before[group_first])
    out = np.empty(int(roots_len.sum()), dtype=np.int64)
    for d, start in enumerate(offset):
        t, is_op, nargs, tok = kept[d]
        out[start] = tok
        out[(start + lengths[d] - 1)[is_op]] = CLOSE
    words = _VOCAB_ARRAY[out].tolist()
    bounds = np.cumsum(roots_len).tolist()
    begin = [0] + bounds[:-1]
    exprs = [" ".join(words[a:b]) for a, b in zip(begin, bounds)]
    return exprs, values[0].tolist()


def generate_listops(num_examples: int, *, max_depth: int = 10, max_args: int = 10,
                     min_length: int = 500, max_length: int = 2000,
                     operator_prob: float = 0.25, seed: int = 0, unique: bool = True,
                     exclude: Iterable[str] = (),
                     operators: Sequence[str] = OPERATORS) -> List[Tuple[str, int]]:
    r"""Draw ``num_examples`` ListOps expressions and their values (LRA's settings by
    default; see the module docstring for the distribution).

    Args:
        num_examples: how many to draw.
        max_depth: deepest nesting (the root is depth 1; digits at ``max_depth``).
        max_args: most arguments per operator (at least 2).
        min_length, max_length: keep expressions of ``min_length < T < max_length``
            tokens (operators, digits and ``]``).
        operator_prob: probability that a node above ``max_depth`` is an operator.
        seed: the seed; the same seed and settings give the same list.
        unique: drop repeated expressions (as LRA does).
        exclude: expressions never to return, as strings or as ``(expression,
            label)`` pairs (e.g. another split), whatever ``unique`` says.
        operators: the operators drawn from (uniformly), a subset of :data:`OPERATORS`;
            all four by default (a subset isolates one operator's share of the task,
            e.g. without ``SM``, the only one that needs counting).

    Returns:
        ``[(expression, value), ...]`` in draw order, expressions without LRA's round
        brackets (:func:`to_lra_form` adds them).

    Raises:
        ValueError: a bad setting, a length window that no tree of these settings can
            reach, a window so rare that ``num_examples`` would take more than
            :data:`MAX_EXPECTED_DRAWS` draws (:func:`listops_kept_fraction`; raised
            before the first draw), ``max_length`` above :data:`MAX_GENERATED_LENGTH` + 1,
            more expressions than this machine's memory could hold, or (with ``unique``)
            settings with fewer distinct expressions than asked for.
        TypeError: ``exclude`` is one string or holds something else than
            expressions and pairs.

    Example:
        >>> data = generate_listops(3, max_depth=3, max_args=3, min_length=4, max_length=12)
        >>> all(4 < len(e.split()) < 12 and evaluate_listops(e) == v for e, v in data)
        True
    """
    num_examples = _check_int("num_examples", num_examples, 0)
    seed = _check_int("seed", seed, 0)
    max_depth, max_args, operator_prob, min_length, max_length = _checked_settings(
        max_depth, max_args, operator_prob, min_length, max_length)
    if not _fits_in_memory(num_examples, min_length):
        raise ValueError(f"{num_examples:,} expressions of more than {min_length} tokens "
                         f"cannot fit in this machine's memory")
    longest = _max_possible_length(max_depth, max_args)
    if longest <= min_length:
        raise ValueError(f"with max_depth={max_depth} and max_args={max_args} no expression is "
                         f"longer than {longest} tokens, so none exceeds min_length="
                         f"{min_length}")
    kept = listops_kept_fraction(max_depth=max_depth, max_args=max_args,
                                 operator_prob=operator_prob, min_length=min_length,
                                 max_length=max_length)
    if kept is not None and num_examples > kept * MAX_EXPECTED_DRAWS:
        rate = (f"about 1 in {float(f'{1 / kept:.3g}'):,.0f}" if kept > 1e-12
                else "fewer than 1 in 10^12")
        raise ValueError(
            f"with max_depth={max_depth}, max_args={max_args} and operator_prob="
            f"{operator_prob} {rate} drawn trees has more than min_length={min_length} "
            f"and fewer than max_length={max_length} tokens: {num_examples:,} expressions "
            f"would take more than {MAX_EXPECTED_DRAWS:,} draws (widen the length window "
            f"or raise max_depth, max_args or operator_prob)")
    max_args = _drawn_max_args(max_args, max_length)
    operator_ids = _operator_ids(operators)
    seen = _excluded_expressions(exclude)
    rng = np.random.default_rng(seed)
    out: List[Tuple[str, int]] = []
    idle = 0
    # the batch size is a function of the settings alone, so the draw is one of the
    # seed and settings; 4,096 trees unless so many could outgrow the memory bound
    batch = max(1, min(4096, _BATCH_TOKENS // max_length))
    patience = -(-200 * 4096 // batch)
    while len(out) < num_examples:
        exprs, values = _sample_batch(rng, batch, max_depth, max_args, float(operator_prob),
                                      min_length, max_length, operator_ids)
        before = len(out)
        for expr, value in zip(exprs, values):
            if expr in seen:
                continue
            if unique:
                seen.add(expr)
            out.append((expr, int(value)))
            if len(out) == num_examples:
                break
        idle = idle + 1 if len(out) == before else 0
        if idle >= patience:
            raise ValueError(f"drew only {len(out)} of {num_examples} "
                             f"{'distinct ' if unique else ''}expressions in "
                             f"{patience * batch:,} tries: these settings rarely (or never) "
                             f"give more")
    return out


def _excluded_expressions(exclude: Iterable) -> set:
    """The expressions of ``exclude``: strings, or ``(expression, label)`` pairs as a
    split holds them."""
    if isinstance(exclude, (str, bytes)):
        raise TypeError("exclude must be a collection of expressions (or of (expression, "
                        "label) pairs), not one string")
    out = set()
    for i, item in enumerate(exclude):
        if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
            item = item[0]
        if not isinstance(item, str):
            raise TypeError(f"exclude[{i}] must be an expression (str) or an (expression, "
                            f"label) pair, got {type(item).__name__}")
        out.add(item)
    return out


def generate_listops_splits(num_train: int = 96_000, num_val: int = 2_000,
                            num_test: int = 2_000, *, seed: int = 0,
                            **settings) -> Dict[str, List[Tuple[str, int]]]:
    """Disjoint ``train`` / ``val`` / ``test`` splits drawn as one pool of distinct
    expressions and cut in that order (LRA's protocol; LRA's sizes by default).
    ``settings`` are those of :func:`generate_listops`.

    Example:
        >>> s = generate_listops_splits(4, 2, 2, max_depth=3, max_args=4, min_length=5,
        ...                             max_length=20)
        >>> [len(s[k]) for k in ("train", "val", "test")]
        [4, 2, 2]
    """
    for name, value in (("num_train", num_train), ("num_val", num_val),
                        ("num_test", num_test)):
        _check_int(name, value, 0)
    pool = generate_listops(num_train + num_val + num_test, seed=seed, unique=True, **settings)
    return {"train": pool[:num_train], "val": pool[num_train:num_train + num_val],
            "test": pool[num_train + num_val:]}


# ------------------------------------------------------------------ TSV files
def read_listops_tsv(path: Union[str, os.PathLike], *, check: bool = False
                     ) -> List[Tuple[str, int]]:
    r"""Read a file in LRA's format: a header ``Source\tTarget``, then one expression
    and its label (0-9) per line, tab-separated.

    Lines end in ``\n``, ``\r\n`` or ``\r``; a UTF-8 byte-order mark before the
    header is skipped; blank lines are skipped; spaces around each field are dropped.
    Fields are taken as written (no CSV quoting: a ``"`` is a character of the
    expression, which LRA's expressions never hold), with no limit on their length.

    Args:
        path: the file.
        check: also parse every expression and check its label against its value.

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file and line, for text that is not UTF-8, a wrong
            header, a line without exactly two fields, a label that is not a digit
            0-9, and (``check``) a malformed expression or a label that is not its
            value.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no ListOps file {path}")
    rows: List[Tuple[str, int]] = []
    line_no = 0
    with open(path, "rb") as handle:
        for line_no, line in enumerate(_text_lines(handle, path), 1):
            if line_no == 1:
                fields = [c.strip() for c in line.lstrip("\ufeff").split("\t")]
                if fields != ["Source", "Target"]:
                    raise ValueError(f"{path}, line 1: the header must be "
                                     f"'Source<TAB>Target', got {fields!r:.80}")
                continue
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise ValueError(f"{path}, line {line_no}: expected 2 tab-separated "
                                 f"fields (Source, Target), got {len(fields)}")
            source, target = fields[0].strip(), fields[1].strip()
            if target not in VOCAB[:10]:
                raise ValueError(f"{path}, line {line_no}: the label must be a digit "
                                 f"0-9, got {target!r:.40}")
            label = int(target)
            if check:
                try:
                    value = evaluate_listops(source)
                except ValueError as error:
                    raise ValueError(f"{path}, line {line_no}: {error}") from None
                if value != label:
                    raise ValueError(f"{path}, line {line_no}: the label is {label} but "
                                     f"the expression's value is {value}")
            rows.append((source, label))
    if line_no == 0:
        raise ValueError(f"{path} is empty (expected the header 'Source<TAB>Target')")
    return rows


def _text_lines(handle, path: Path) -> Iterable[str]:
    """The lines of a binary file as text, split at ``\n``, ``\r\n`` and ``\r``
    alone (and nowhere else), each decoded as UTF-8 on its own, so that an error
    names its line."""
    line_no = 0
    for raw in handle:
        parts = raw.rstrip(b"\n").split(b"\r")
        if len(parts) > 1 and not parts[-1]:   # a \r (or \r\n) ended the last line
            parts.pop()
        for part in parts:
            line_no += 1
            try:
                yield part.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}, line {line_no}: not UTF-8 text (byte "
                                 f"{part[error.start]:#04x} at column {error.start + 1})"
                                 ) from None


def write_listops_tsv(path: Union[str, os.PathLike], examples: Sequence[Tuple[str, int]], *,
                      parens: bool = False) -> Path:
    r"""Write ``examples`` (``(expression, label)`` pairs) in LRA's format: header
    ``Source\tTarget``, one example per line; ``parens=True`` writes the expressions
    in LRA's curried form (:func:`to_lra_form`).

    The file is replaced whole or not at all: every example is checked first and the
    text is written under a temporary name, then renamed.

    Raises:
        ValueError: naming the example, for a label that is not an int 0-9, an
            expression holding a tab or a line break, beginning or ending with
            whitespace, or not encodable as UTF-8 (a lone surrogate), or (``parens``)
            one that :func:`to_lra_form` cannot read.
    """
    path = Path(path)
    lines = [b"Source\tTarget"]
    for i, example in enumerate(examples):
        if not isinstance(example, (tuple, list)) or len(example) != 2:
            raise ValueError(f"example {i} must be an (expression, label) pair")
        expr, label = example
        if not isinstance(expr, str):
            raise ValueError(f"example {i}: the expression must be a str, got "
                             f"{type(expr).__name__}")
        if not _is_int(label) or not 0 <= label <= 9:
            raise ValueError(f"example {i}: the label must be an int 0-9, got {label!r}")
        if any(c in expr for c in "\t\r\n"):
            raise ValueError(f"example {i}: the expression holds a tab or a line break")
        if expr != expr.strip():
            raise ValueError(f"example {i}: the expression begins or ends with "
                             f"whitespace, which the reader drops")
        try:
            text = to_lra_form(expr) if parens else expr
            lines.append(f"{text}\t{int(label)}".encode())
        except (ValueError, UnicodeEncodeError) as error:
            raise ValueError(f"example {i}: {error}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    # every example checked and encoded before the file is touched, then written
    # under a temporary name and renamed: a failure leaves any earlier file whole
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(b"\n".join(lines) + b"\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
