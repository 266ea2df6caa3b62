"""Redraw the stored comparison plots of ``docs/figures`` from their stored tables.

The full experiment runs take about an hour each; their outputs are kept as Markdown
tables (``docs/figures/*.md``). When the plotting code changes (accuracy axes from zero,
95 % intervals on every bar), this script redraws the bar plots from those tables with
the library's own plotting functions, so the pictures show exactly the figures of the
tables:

* ``sentiment_full.png``, ``multimodal_full.png``, ``main_job.png``:
  :func:`hsa_graph.experiments.report.comparison_figure` of the table's accuracy and its
  95 % t-interval per variant;
* ``zero_shot_ablation.png``: :func:`hsa_graph.pretrained.zero_shot.ablation_figure` of
  the ablation table (95 % binomial intervals over the held-out sentences).

Learning curves need the per-epoch histories, which the tables do not hold: they are
left as the runs drew them. Run: ``python benchmarks/replot_figures.py``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_readme_figures import markdown_tables  # noqa: E402

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"


def comparison_rows(table):
    rows = []
    for row in table:
        mean, ci = (float(x) for x in re.findall(r"\d+\.\d+", row["accuracy (95% CI)"])[:2])
        label = f"{row['embedding']} / {row['model']}" if "embedding" in row else row["variant"]
        rows.append({"label": label, "accuracy_mean": mean, "accuracy_ci95": ci})
    return rows


def replot_comparison(name: str, out: str) -> Path:
    from hsa_graph.experiments.report import comparison_figure

    text = (FIGURES / f"{name}.md").read_text(encoding="utf-8")
    title = text.splitlines()[0].lstrip("# ").strip()
    path = FIGURES / out
    comparison_figure(comparison_rows(markdown_tables(text)[0]), title=title).savefig(
        path, dpi=120)
    return path


def replot_ablation() -> Path:
    from hsa_graph.pretrained.zero_shot import ablation_figure

    text = (FIGURES / "zero_shot_results.md").read_text(encoding="utf-8")
    tables = markdown_tables(text)
    held_out = int(re.search(r"(\d+) held out", text).group(1))
    original = float(tables[0][0]["Acc original"])
    ablation, stride = [], None
    for row in tables[1]:
        for column, cell in row.items():
            match = re.fullmatch(r"SL=(\d+) \(([\d,]+)\)", column)
            if match and cell:
                layers = [int(x) for x in match.group(2).split(",")]
                stride = layers[1] - layers[0] if len(layers) > 1 else stride
                ablation.append({"start_layer": int(match.group(1)),
                                 "hierarchy": row["hierarchy"], "accuracy": float(cell)})
    results = {"ablation": ablation, "stride": stride,
               "probe": {"test": held_out, "accuracy_original": original}}
    path = FIGURES / "zero_shot_ablation.png"
    ablation_figure(results).savefig(path, dpi=120)
    return path


def main() -> None:
    for path in (replot_comparison("sentiment_full", "sentiment_full.png"),
                 replot_comparison("multimodal_full", "multimodal_full.png"),
                 replot_comparison("main_job", "main_job.png"),
                 replot_ablation()):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
