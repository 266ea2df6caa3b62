"""ListOps: generator, exact evaluator, LRA's TSV format and the parse-tree builder."""
import time

import numpy as np
import pytest
import torch

from hsa_graph.datasets.listops import (
    MAX_EXPECTED_DRAWS,
    VOCAB,
    _operator_ids,
    _sample_batch,
    evaluate_listops,
    generate_listops,
    generate_listops_splits,
    listops_dependence,
    listops_kept_fraction,
    listops_tree,
    parse_listops,
    read_listops_tsv,
    to_lra_form,
    write_listops_tsv,
)

SMALL = dict(max_depth=4, max_args=5, min_length=10, max_length=60)


def reference_value(expression: str) -> int:
    """A recursive evaluator written independently of the vectorised one."""
    words = [w for w in expression.split() if w not in "()"]
    at = 0

    def item():
        nonlocal at
        word = words[at]
        at += 1
        if word.isdigit():
            return int(word)
        args = []
        while words[at] != "]":
            args.append(item())
        at += 1
        return {"[MAX": max, "[MIN": min, "[MED": lambda a: int(np.median(a)),
                "[SM": lambda a: sum(a) % 10}[word](args)

    value = item()
    assert at == len(words)
    return value


def nesting_depth(expression: str) -> int:
    depth = best = 0
    for word in expression.split():
        if word.startswith("["):
            depth += 1
            best = max(best, depth)
        elif word == "]":
            depth -= 1
    return best


@pytest.mark.parametrize("expression, value", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[MIN 3 8 ]", 3),
    ("[MED 1 2 ]", 1),              # LRA: int(np.median) = floor of the middle mean
    ("[MED 1 2 3 6 ]", 2),          # (2 + 3) / 2 = 2.5 -> 2
    ("[MED 9 1 5 ]", 5),
    ("[MED 8 9 ]", 8),
    ("[SM 5 [MED 1 2 ] 7 ]", 3),    # 5 + 1 + 7 = 13 -> 3
    ("[SM 9 9 9 9 ]", 6),
    ("7", 7),
    ("[MAX [MIN [SM 4 8 ] 9 ] [MED 0 0 1 ] ]", 2),
])
def test_evaluator_exact(expression, value):
    assert evaluate_listops(expression) == value
    assert evaluate_listops(to_lra_form(expression)) == value


def test_lra_form_matches_lra_currying():
    # LRA writes ((((op, a), b), END)) as nested round brackets
    assert to_lra_form("[MAX 2 9 [MIN 4 7 ] 0 ]") == (
        "( ( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )")
    assert to_lra_form("5") == "5"


def test_generator_deterministic_by_seed():
    a = generate_listops(50, seed=3, **SMALL)
    b = generate_listops(50, seed=3, **SMALL)
    c = generate_listops(50, seed=4, **SMALL)
    assert a == b
    assert a != c


def test_generator_respects_settings_and_labels():
    data = generate_listops(300, seed=0, **SMALL)
    assert len({e for e, _ in data}) == 300               # distinct
    for expression, value in data:
        tokens = expression.split()
        assert 10 < len(tokens) < 60
        assert nesting_depth(expression) <= 4
        assert value == reference_value(expression)
        p = parse_listops(expression)
        args = np.bincount(p.parent[(p.tokens < 14) & (p.parent >= 0)],
                           minlength=p.tokens.size)
        ops = (p.tokens >= 10) & (p.tokens < 14)
        assert args[ops].min() >= 2 and args[ops].max() <= 5
    assert len({v for _, v in data}) == 10                # every class occurs


def test_generator_lra_settings():
    start = time.perf_counter()
    data = generate_listops(40, seed=0)                   # LRA's defaults
    assert time.perf_counter() - start < 10
    lengths = [len(e.split()) for e, _ in data]
    assert min(lengths) > 500 and max(lengths) < 2000
    assert max(nesting_depth(e) for e, _ in data) <= 10
    for expression, value in data[:10]:
        assert value == reference_value(expression)


def test_generator_operator_subset():
    data = generate_listops(200, seed=2, operators=("MAX", "MED"), **SMALL)
    ops = {t for e, _ in data for t in e.split() if t.startswith("[")}
    assert ops == {"[MAX", "[MED"}
    for expression, value in data[:50]:
        assert value == reference_value(expression)
    # the full set, in any order, draws exactly what the default draws
    assert generate_listops(30, seed=2, operators=("SM", "MED", "MIN", "MAX"), **SMALL) == \
        generate_listops(30, seed=2, **SMALL)
    with pytest.raises(ValueError, match="operators"):
        generate_listops(5, operators=("MAX", "POW"), **SMALL)
    with pytest.raises(ValueError, match="operators"):
        generate_listops(5, operators=(), **SMALL)
    with pytest.raises(TypeError, match="operators"):
        generate_listops(5, operators="MAX", **SMALL)


def test_splits_disjoint():
    s = generate_listops_splits(30, 10, 10, seed=1, **SMALL)
    sets = [{e for e, _ in s[k]} for k in ("train", "val", "test")]
    assert [len(x) for x in sets] == [30, 10, 10]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])


def test_generator_bad_settings():
    with pytest.raises(ValueError, match="max_args"):
        generate_listops(5, max_args=1)
    with pytest.raises(ValueError, match="min_length"):
        generate_listops(5, max_depth=2, max_args=3, min_length=100, max_length=200)
    with pytest.raises(ValueError, match="distinct"):   # only 10 one-digit expressions
        generate_listops(11, max_depth=1, min_length=0, max_length=2)


def reference_kept_fraction(max_depth, max_args, operator_prob, min_length, max_length):
    """P(min_length < T < max_length) by direct convolution over every level, with no
    FFT and no cut in depth: written apart from ``listops_kept_fraction``."""
    lengths = np.zeros(max_length)
    lengths[1] = 1.0                                    # a digit at max_depth
    for _ in range(max_depth - 1):
        total, power = np.zeros(max_length), lengths
        for _ in range(2, max_args + 1):
            power = np.convolve(power, lengths)[:max_length]
            total += power
        nxt = np.zeros(max_length)
        nxt[2:] = operator_prob * total[:-2] / (max_args - 1)
        nxt[1] = 1.0 - operator_prob
        lengths = nxt
    return lengths[min_length + 1:].sum()


@pytest.mark.parametrize("settings", [
    (10, 10, 0.25, 500, 2000),     # LRA's
    (4, 5, 0.25, 10, 60),          # --quick
    (30, 2, 0.9, 20, 40),          # deeper than any tree under 40 tokens: cut in depth
    (6, 2, 0.7, 5, 21),
    (1, 10, 0.25, 0, 2),           # one digit
    (3, 7, 1.0, 3, 5),             # a window that no tree reaches
])
def test_kept_fraction_is_exact(settings):
    kept = listops_kept_fraction(**dict(zip(
        ("max_depth", "max_args", "operator_prob", "min_length", "max_length"), settings)))
    assert kept == pytest.approx(reference_kept_fraction(*settings), rel=1e-9, abs=1e-15)


def test_kept_fraction_is_what_the_generator_keeps():
    """The share of 100,000 drawn trees that the generator keeps, within 5 standard
    errors of the computed fraction."""
    for depth, args, prob, low, high in [(10, 10, 0.25, 500, 2000), (6, 2, 0.7, 5, 21),
                                         (5, 4, 0.5, 30, 80)]:
        rng = np.random.default_rng(3)
        kept = sum(len(_sample_batch(rng, 10_000, depth, args, prob, low, high,
                                     _operator_ids(("MAX", "MIN", "MED", "SM")))[0])
                   for _ in range(10)) / 100_000
        q = listops_kept_fraction(max_depth=depth, max_args=args, operator_prob=prob,
                                  min_length=low, max_length=high)
        assert abs(kept - q) < 5 * (q * (1 - q) / 100_000) ** 0.5, (depth, args, kept, q)


def test_kept_fraction_above_the_resolved_lengths():
    """Windows above 4,096 tokens: an upper bound that holds the exact fraction."""
    exact = reference_kept_fraction(5, 10, 0.5, 3000, 4200)
    bound = listops_kept_fraction(max_depth=5, max_args=10, operator_prob=0.5,
                                  min_length=3000, max_length=4200)
    assert exact <= bound <= exact + 1e-3
    assert listops_kept_fraction(max_depth=10**6, max_args=10, min_length=3000,
                                 max_length=10**6) is None      # too long to compute


@pytest.mark.parametrize("settings, match", [
    (dict(max_depth=0), "max_depth"), (dict(max_args=1), "max_args"),
    (dict(min_length=-1), "min_length"), (dict(max_length=1), "max_length"),
    (dict(min_length=10, max_length=11), "strictly between"),
    (dict(operator_prob=0.0), "operator_prob"), (dict(operator_prob=True), "operator_prob"),
    (dict(max_length=(1 << 24) + 2), "at most"), (dict(max_depth=2.0), "max_depth"),
])
def test_kept_fraction_bad_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        listops_kept_fraction(**settings)


def test_generator_refuses_rare_windows_at_once():
    for settings in (dict(max_depth=4, max_args=5, min_length=150, max_length=188),
                     dict(min_length=1990, max_length=2000)):
        start = time.perf_counter()
        with pytest.raises(ValueError, match=f"more than {MAX_EXPECTED_DRAWS:,} draws"):
            generate_listops(10**6, **settings)
        assert time.perf_counter() - start < 1.0
    # the same rare window, for as few expressions as a few thousand draws find
    data = generate_listops(1, min_length=1990, max_length=2000, seed=4)
    assert 1990 < len(data[0][0].split()) < 2000


@pytest.mark.parametrize("parens", [False, True])
def test_tsv_round_trip(tmp_path, parens):
    data = generate_listops(20, seed=2, **SMALL)
    path = write_listops_tsv(tmp_path / "x.tsv", data, parens=parens)
    assert path.read_text().splitlines()[0] == "Source\tTarget"
    back = read_listops_tsv(path, check=True)
    if parens:
        assert [v for _, v in back] == [v for _, v in data]
        assert [evaluate_listops(e) for e, _ in back] == [v for _, v in data]
        assert back[0][0].startswith("(")
    else:
        assert back == data


@pytest.mark.parametrize("text, match", [
    ("Src\tTarget\n[MAX 1 2 ]\t2\n", "header"),
    ("Source\tTarget\n[MAX 1 2 ]\n", "line 2: expected 2"),
    ("Source\tTarget\n[MAX 1 2 ]\t12\n", "line 2: the label"),
    ("Source\tTarget\n[MAX 1 2 ]\t1\n", "line 2: the label is 1 but"),
    ("Source\tTarget\n[MAX 1 2\t2\n", "line 2: operator \\[MAX at token 0 is never closed"),
    ("", "empty"),
])
def test_tsv_errors(tmp_path, text, match):
    path = tmp_path / "bad.tsv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_listops_tsv(path, check=True)


def test_parse_tree_structure():
    tree = listops_tree("[MAX 2 9 [MIN 4 7 ] 0 ]")
    # nodes in token order: MAX node, [MAX, 2, 9, MIN node, [MIN, 4, 7, 0
    assert tree.parent.tolist() == [-1, 0, 0, 0, 0, 4, 4, 4, 0]
    assert [VOCAB[i] for i in tree.x.tolist()] == ["[MAX", "2", "9", "[MIN", "4", "7", "0"]
    assert tree.y.tolist() == [9] and tree.depth.tolist() == [2]
    full = listops_tree("[MAX 2 9 [MIN 4 7 ] 0 ]", brackets=True)
    assert [VOCAB[i] for i in full.x.tolist()] == "[MAX 2 9 [MIN 4 7 ] 0 ]".split()
    assert full.parent.tolist() == [-1, 0, 0, 0, 0, 4, 4, 4, 4, 0, 0]


def test_parse_tree_one_internal_node_per_operator():
    for expression, _ in generate_listops(30, seed=5, **SMALL):
        tree = listops_tree(expression)
        words = expression.split()
        num_ops = sum(w.startswith("[") for w in words)
        assert tree.num_nodes - tree.num_leaves == num_ops
        # leaves are the tokens without closing brackets, in order
        assert [VOCAB[i] for i in tree.x.tolist()] == [w for w in words if w != "]"]
        # every family starts with its operator token, then its arguments in order
        parent = tree.parent
        leaf_rows = torch.cumsum(tree.is_leaf.long(), 0) - 1
        for node in (~tree.is_leaf).nonzero().view(-1).tolist():
            children = (parent == node).nonzero().view(-1)
            first = children[0]
            assert bool(tree.is_leaf[first])
            assert VOCAB[int(tree.x[leaf_rows[first]])].startswith("[")
            assert tree.position[children, 0].tolist() == list(range(children.numel()))


@pytest.mark.parametrize("brackets", [False, True])
def test_node_tokens_are_each_nested_operator_once_more_in_its_parent_s_family(brackets):
    for expression, _ in generate_listops(30, seed=6, **SMALL) + [("[MAX 1 2 ]", 2), ("4", 4)]:
        plain = listops_tree(expression, brackets=brackets)
        tree = listops_tree(expression, brackets=brackets, node_tokens=True)
        words = [w for w in expression.split() if brackets or w != "]"]
        ops = [i for i, w in enumerate(words) if w.startswith("[")]
        # the leaves: the tokens in order, each nested operator's token twice
        expected = []
        for i, w in enumerate(words):
            expected += [w, w] if i in ops[1:] else [w]
        assert [VOCAB[i] for i in tree.x.tolist()] == expected
        assert tree.num_nodes - tree.num_leaves == plain.num_nodes - plain.num_leaves
        parent = tree.parent.tolist()
        assert tree.mirror_index.numel() == tree.mirror_source_index.numel() == len(ops[1:])
        for token, source in zip(tree.mirror_index.tolist(), tree.mirror_source_index.tolist()):
            assert bool(tree.is_leaf[token]) and bool(tree.is_leaf[source])
            node = parent[source]                     # the operator's node
            assert parent[token] == parent[node]      # one of its parent's arguments
            siblings = [u for u, p in enumerate(parent) if p == parent[node]]
            assert siblings[siblings.index(node) - 1] == token   # just before its node
            assert [u for u, p in enumerate(parent) if p == node][0] == source
        # without the node tokens: the plain parse tree
        keep = torch.ones(tree.num_nodes, dtype=torch.bool)
        keep[tree.mirror_index] = False
        old = torch.cumsum(keep.long(), 0) - 1
        kept_parent = tree.parent[keep]
        pruned = torch.where(kept_parent >= 0, old[kept_parent.clamp_min(0)], kept_parent)
        assert pruned.tolist() == plain.parent.tolist()


@pytest.mark.parametrize("expression, match", [
    ("[MAX 1 2 ] ]", "token 4 closes no operator"),
    ("[MAX 1 [MIN 2 ]", "token 0 is never closed"),
    ("[MAX 1 [FOO 2 ] ]", "unknown token '\\[FOO' at token 2"),
    ("[MAX ]", "operator \\[MAX at token 0 has no arguments"),
    ("[MAX 1 ] 3", "token 3 \\(3\\) follows the end"),
    ("1 2", "token 1"),
    ("", "empty"),
    ("( [MAX 1 ) ] ) )", "token 5 closes no"),
    ("( ( [MAX 1 ) ]", "'\\(' at token 0 is never closed"),
    ("12", "unknown token '12' at token 0"),
])
def test_malformed_expressions_name_the_position(expression, match):
    with pytest.raises(ValueError, match=match):
        listops_tree(expression)


def test_hostile_inputs():
    with pytest.raises(TypeError):
        parse_listops(b"[MAX 1 2 ]")
    deep = "[MAX " * 3000 + "1 " + "] " * 3000
    with pytest.raises(ValueError, match="max_depth"):
        parse_listops(deep)
    assert parse_listops(deep, max_depth=None).value == 1
    # a long flat expression: linear time
    wide = "[SM " + "7 " * 200_000 + "]"
    start = time.perf_counter()
    assert evaluate_listops(wide) == (7 * 200_000) % 10
    assert time.perf_counter() - start < 5
    with pytest.raises(ValueError, match="unknown token"):
        parse_listops("[MAX " + "x" * 1_000_000 + " ]")


def reference_dependence(expression: str) -> list:
    """For each token: replace the subexpression an operator token opens by each other
    digit and evaluate the whole text again (the root and other tokens: 0)."""
    words = [w for w in expression.split() if w not in "()"]
    value = reference_value(" ".join(words))
    out = [0.0] * len(words)
    for i, word in enumerate(words[1:], start=1):
        if not word.startswith("["):
            continue
        depth, end = 0, i
        while True:
            depth += words[end].startswith("[") - (words[end] == "]")
            if depth == 0:
                break
            end += 1
        own = reference_value(" ".join(words[i:end + 1]))
        out[i] = sum(reference_value(" ".join(words[:i] + [str(v)] + words[end + 1:])) != value
                     for v in range(10) if v != own) / 9
    return out


@pytest.mark.parametrize("settings", [
    SMALL,
    dict(max_depth=6, max_args=10, min_length=20, max_length=200),   # even-sized MEDs
    dict(max_depth=10, max_args=3, min_length=10, max_length=120),   # deep, narrow
])
def test_dependence_equals_replacing_each_subexpression(settings):
    rows = generate_listops(40, seed=5, **settings)
    for expression, _ in rows:
        got = listops_dependence(expression)
        assert got.dtype == np.float64 and got.shape == (len(expression.split()),)
        np.testing.assert_allclose(got, reference_dependence(expression), atol=1e-12)
        assert np.array_equal(listops_dependence(parse_listops(expression)), got)
        assert np.array_equal(listops_dependence(to_lra_form(expression)), got)


def test_dependence_known_cases_and_large_inputs():
    assert listops_dependence("7").tolist() == [0.0]
    assert listops_dependence("[MAX 1 2 ]").tolist() == [0.0] * 4
    # SM passes every error on; MAX only values above its other arguments' maximum
    assert listops_dependence("[SM [MIN 1 2 ] 3 ]")[1] == 1.0
    assert listops_dependence("[MAX [MIN 1 2 ] 7 ]")[1] == pytest.approx(2 / 9)
    # a chain 3,000 deep (one step per level) and 60,000 siblings (chunked)
    chain = "[SM " * 3000 + "1 " + "] " * 3000
    start = time.perf_counter()
    deep = listops_dependence(parse_listops(chain, max_depth=None))
    assert deep[1:3000].tolist() == [1.0] * 2999 and deep[0] == 0.0
    wide = listops_dependence("[MAX " + "[MIN 1 2 ] " * 60_000 + "9 ]")
    assert time.perf_counter() - start < 10
    assert wide.sum() == 0.0            # below 9: no nested value can change the maximum
    with pytest.raises(ValueError, match="never closed"):
        listops_dependence("[MAX 1 2")


def test_the_datasets_package_exports_every_public_name():
    import hsa_graph.datasets as datasets
    from hsa_graph.datasets import listops

    for name in listops.__all__:
        assert name in datasets.__all__, name
        assert getattr(datasets, name) is getattr(listops, name), name


# ------------------------------------------------------------------ attacks
def test_exclude_takes_expressions_or_pairs_whatever_unique_says():
    tiny = dict(max_depth=2, max_args=2, min_length=3, max_length=5)
    test = generate_listops(300, seed=1, **tiny)
    held_out = {e for e, _ in test}
    for exclude in (test, [e for e, _ in test], held_out):     # pairs, strings, a set
        for unique in (True, False):
            train = generate_listops(100, seed=2, exclude=exclude, unique=unique, **tiny)
            assert not held_out & {e for e, _ in train}
    # without exclude the same draw does repeat the held-out expressions (the test bites)
    assert held_out & {e for e, _ in generate_listops(100, seed=2, **tiny)}
    with pytest.raises(TypeError, match="not one string"):
        generate_listops(5, exclude="[MAX 1 2 ]", **tiny)
    with pytest.raises(TypeError, match=r"exclude\[1\]"):
        generate_listops(5, exclude=["[MAX 1 2 ]", 3], **tiny)


def test_generator_cost_follows_the_output_not_the_settings():
    # max_args far above what max_length allows: the same expressions, at once
    start = time.perf_counter()
    huge = generate_listops(30, max_depth=3, max_args=10**7, min_length=4, max_length=12)
    assert time.perf_counter() - start < 5
    assert all(4 < len(e.split()) < 12 and evaluate_listops(e) == v for e, v in huge)
    assert generate_listops(30, max_depth=3, max_args=2**70, min_length=4, max_length=12) \
        == huge == generate_listops(30, max_depth=3, max_args=9, min_length=4, max_length=12)
    with pytest.raises(ValueError, match="at most 16,777,216 tokens"):
        generate_listops(1, max_depth=60, operator_prob=0.5, min_length=10,
                         max_length=10**9)
    for count in (10**12, 10**15):   # refused before drawing anything
        start = time.perf_counter()
        with pytest.raises(ValueError, match="cannot fit in this machine's memory"):
            generate_listops(count, max_depth=3, max_args=3, min_length=4, max_length=12)
        with pytest.raises(ValueError, match="cannot fit"):
            generate_listops_splits(count, 2, 2, max_depth=3, max_args=3, min_length=4,
                                    max_length=12)
        assert time.perf_counter() - start < 1
    for bad in (True, "0.5", float("nan"), 0.0, 1.5):
        with pytest.raises(ValueError, match="operator_prob"):
            generate_listops(2, operator_prob=bad, **SMALL)
    # numpy numbers are numbers
    assert generate_listops(3, operator_prob=np.float32(0.25), seed=5, **SMALL) == \
        generate_listops(3, operator_prob=0.25, seed=5, **SMALL)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_depth"):
            parse_listops("5", max_depth=bad)


def test_tsv_reads_what_it_writes_whatever_the_text(tmp_path):
    long = "[SM " + "1 " * 70_000 + "]"                       # 140,004 characters
    rows = [(long, 0), ('"[MAX 1 2 ]', 2), ("[MIN 3 4 ]", 3), ('"', 0)]
    path = write_listops_tsv(tmp_path / "x.tsv", rows)
    assert read_listops_tsv(path) == rows                     # a quote is a character
    with pytest.raises(ValueError, match="line 3: unknown token"):
        read_listops_tsv(path, check=True)
    with pytest.raises(ValueError, match="example 1: .*whitespace"):
        write_listops_tsv(tmp_path / "y.tsv", [("[MAX 1 2 ]", 2), (" [MAX 1 2 ]", 2)])


def test_tsv_write_failure_leaves_the_earlier_file_whole(tmp_path):
    path = write_listops_tsv(tmp_path / "x.tsv", [("[MAX 1 2 ]", 2)] * 3)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="example 1"):
        write_listops_tsv(path, [("[MAX 1 2 ]", 2), ("[MAX 1 2 ]\ud800", 2)])
    with pytest.raises(ValueError, match="example 1: .*never closed"):
        write_listops_tsv(path, [("[MAX 1 2 ]", 2), ("[MAX", 0)], parens=True)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.tsv"]  # no temporary left


@pytest.mark.parametrize("raw", [
    b"\xef\xbb\xbfSource\tTarget\n[MAX 1 2 ]\t2\n[SM 3 4 ]\t7\n",     # byte-order mark
    b"Source\tTarget\r\n[MAX 1 2 ]\t2\r\n[SM 3 4 ]\t7\r\n",          # CRLF
    b"Source\tTarget\r[MAX 1 2 ]\t2\r[SM 3 4 ]\t7\r",                # CR alone
    b"Source\tTarget\n[MAX 1 2 ]\t2\n\n[SM 3 4 ]\t7",                # blank, no last \n
])
def test_tsv_line_endings_and_byte_order_mark(tmp_path, raw):
    path = tmp_path / "x.tsv"
    path.write_bytes(raw)
    assert read_listops_tsv(path, check=True) == [("[MAX 1 2 ]", 2), ("[SM 3 4 ]", 7)]


def test_tsv_decoding_error_names_the_line(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_bytes(b"Source\tTarget\n" + b"[MAX 1 2 ]\t2\n" * 5000 + b"[MAX 1 \xff ]\t2\n")
    with pytest.raises(ValueError, match=r"line 5002: not UTF-8 text \(byte 0xff at column 8\)"):
        read_listops_tsv(path)
