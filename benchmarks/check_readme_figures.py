"""Check the README's experiment figures against the output files they were copied from.

The README's table of figures quotes results whose outputs are stored in the repository
(``docs/figures/*.md``: the Markdown tables that the commands wrote). Each README row that
names such a file, or (for the zero-shot rows) belongs to its experiment, is parsed for
the figures it quotes (accuracies with intervals, attention MFLOPs, probe accuracies, KL
means, wall times), and every figure is compared with the output file, rounded to the
digits the README shows. Nothing is hard-coded: both sides are read from the files.

Run: ``python benchmarks/check_readme_figures.py`` (exit status 1 on a mismatch).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"\**(-?\d+(?:\.\d+)?)\**"


class Check(NamedTuple):
    """One README figure against its output: ``ok`` when they agree at the README's
    precision."""

    source: str
    claim: str
    readme: str
    output: Optional[float]
    ok: bool


def markdown_tables(text: str) -> List[List[Dict[str, str]]]:
    """Every pipe table of a Markdown text, as lists of ``{header: cell}`` rows."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip("|").split("|")]
                rows.append(dict(zip(header, cells)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def _agrees(readme: str, value: Optional[float]) -> bool:
    if value is None:
        return False
    digits = len(readme.split(".")[1]) if "." in readme else 0
    # the README's figure is the output rounded to its digits (either way on a tie)
    return abs(value - float(readme)) <= 0.5 * 10 ** -digits + 1e-9


def _cell_numbers(cell: str) -> List[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", cell.replace(",", ""))]


def _readme_rows(readme: str) -> List[str]:
    start = readme.index("## Figures")
    return [line for line in readme[start:].splitlines() if line.startswith("| ")]


def _comparison_checks(row: str, source: str, table: List[Dict[str, str]]) -> List[Check]:
    """``HSA 0.797 +- 0.035``-style figures, per embedding when the table has one."""
    checks = []
    text = row.split(" | ")[1]
    per_embedding = "embedding" in table[0]
    # sentiment-style tables name the attention "variant"; ListOps tables name the "model"
    key = "model" if per_embedding or "variant" not in table[0] else "variant"
    segments = re.split(r"(static|contextual)", text) if per_embedding else [text]
    embedding = None
    for part in segments:
        if part in ("static", "contextual"):
            embedding = part
            continue
        if per_embedding and embedding is None:
            continue
        seen = set()
        for model, mean, ci in re.findall(
                r"\b(HSA-induced|HSA|FSA|DeepSet|hsa-tree|fsa)(?: over all leaves)? " + NUMBER
                + r" \+- " + NUMBER, part):
            if model in seen:  # the first figure per model is the accuracy
                continue
            seen.add(model)
            rows = [r for r in table if r.get(key) == model
                    and (not per_embedding or r["embedding"] == embedding)]
            values = _cell_numbers(rows[0]["accuracy (95% CI)"]) if rows else []
            for name, said, value in (("accuracy", mean, values[0] if values else None),
                                      ("95% interval", ci, values[1] if values else None)):
                checks.append(Check(source, f"{embedding or ''} {model} {name}".strip(), said,
                                    value, _agrees(said, value)))
    return checks


def _mflops_checks(row: str, source: str, table: List[Dict[str, str]]) -> List[Check]:
    checks = []
    column = next((c for c in table[0] if c.startswith("attention MFLOPs")), None)
    match = re.search(r"HSA " + NUMBER + r",? (?:vs )?FSA " + NUMBER, row) or re.search(
        NUMBER + r" vs " + NUMBER + r" attention MFLOPs", row)
    if column is None or match is None:
        return checks
    for model, said in zip(("HSA", "FSA"), match.groups()):
        rows = [r for r in table if r.get("model") == model and r.get("variant", model)
                == model]
        value = _cell_numbers(rows[0][column])[0] if rows else None
        checks.append(Check(source, f"{model} attention MFLOPs", said, value,
                            _agrees(said, value)))
    return checks


def _zero_shot_checks(rows: List[str], source: str, text: str) -> List[Check]:
    tables = markdown_tables(text)
    checks = []
    headline = tables[0][0]
    joined = " ".join(rows)
    match = re.search(r"probe accuracy " + NUMBER + " -> " + NUMBER, joined)
    if match:
        for name, said, cell in (("original probe accuracy", match.group(1), "Acc original"),
                                 ("HSA probe accuracy", match.group(2), "Acc HSA")):
            value = float(headline[cell])
            checks.append(Check(source, name, said, value, _agrees(said, value)))
    match = re.search(r"cosine to the original " + NUMBER, joined)
    if match:
        value = float(headline["cosine"])
        checks.append(Check(source, "cosine", match.group(1), value,
                            _agrees(match.group(1), value)))
    match = re.search(NUMBER + r"x fewer\*\* at the mean", joined) or re.search(
        r"\*\*" + NUMBER + r"x fewer", joined)
    if match:
        value = float(headline["FLOP reduction"].rstrip("x"))
        checks.append(Check(source, "FLOP reduction", match.group(1), value,
                            _agrees(match.group(1), value)))
    # mean KL over the layers (and heads) for the headline hierarchy, on sentences
    hierarchy = headline["hierarchy"]
    sentences = next(t for t, title in zip(tables[2:], re.findall(r"^## (.*)$", text, re.M)[2:])
                     if "sentences" in title) if len(tables) > 2 else None
    match = re.search(r"HSA " + NUMBER + r", block average " + NUMBER
                      + r", mean-pooled-key softmax " + NUMBER, joined)
    if match and sentences:
        for approx, said in zip(("hsa", "block_average", "pooled_softmax"), match.groups()):
            row = next(r for r in sentences if r["hierarchy"] == hierarchy
                       and r["approximation"] == approx)
            layers = [float(row[c]) for c in row if re.fullmatch(r"L\d+", c)]
            value = sum(layers) / len(layers)
            checks.append(Check(source, f"mean KL {approx}", said, value, _agrees(said, value)))
    match = re.search(r"original " + NUMBER + r" s, HSA in layers [\d, ]+ " + NUMBER
                      + r" s, HSA everywhere " + NUMBER + " s", joined)
    if match:
        timing_table = next(t for t in tables if t and "model" in t[0] and "seconds" in t[0])
        timing = {r["model"]: float(r["seconds"]) for r in timing_table}
        keys = ["original", next(k for k in timing if k.startswith("HSA in layers")),
                "HSA in all layers"]
        for key, said in zip(keys, match.groups()):
            checks.append(Check(source, f"wall time {key}", said, timing[key],
                                _agrees(said, timing[key])))
    return checks


def check(readme: str, figures: Path) -> List[Check]:
    """Every checkable figure of ``readme``'s table of figures against ``figures``."""
    checks: List[Check] = []
    rows = _readme_rows(readme)
    for path in sorted(figures.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        tables = markdown_tables(text)
        source = f"docs/figures/{path.name}"
        if path.name.startswith("zero_shot"):
            checks += _zero_shot_checks([r for r in rows if r.startswith("| zero-shot")],
                                        source, text)
            continue
        for row in rows:
            if path.name in row or path.stem in row:
                checks += _comparison_checks(row, source, tables[0])
                checks += _mflops_checks(row, source, tables[0])
    return checks


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--readme", default=str(ROOT / "README.md"), help="README to check")
    parser.add_argument("--figures", default=str(ROOT / "docs" / "figures"),
                        help="folder of the output files")
    args = parser.parse_args(argv)
    checks = check(Path(args.readme).read_text(encoding="utf-8"), Path(args.figures))
    for c in checks:
        output = "missing" if c.output is None else f"{c.output:g}"
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.source}: {c.claim}: README {c.readme}, "
              f"output {output}")
    bad = [c for c in checks if not c.ok]
    print(f"{len(checks) - len(bad)} of {len(checks)} README figures agree with their outputs")
    return 1 if bad or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
