r"""Results of experiments as JSON, a Markdown table and plots (shared by all of them).

:func:`write_report` takes the result dictionary of an experiment and writes, in one
output directory,

* ``<name>.json``: the whole dictionary (tensors as lists, paths as strings,
  non-finite floats as ``null``);
* ``<name>.md``: a title, the comparison table and links to the figures;
* ``<name>_curves.png``: learning curves (:func:`learning_curves_figure`) of the
  runs that carry a training ``history`` (as returned by
  :func:`~hsa_graph.experiments.train.fit`), one line per variant, averaged over its
  runs (seeds) with the min-max band shaded;
* ``<name>_comparison.png``: a bar chart (:func:`comparison_figure`) of one metric per
  variant with its error bars.

The result dictionary is free-form; these keys are used when present:

``title`` (str)
    heading of the Markdown file (default: ``name``).
``command`` (str)
    the command that produced the results, quoted under the title.
``markdown`` (str)
    a ready table; otherwise ``summary`` (or ``rows``) is rendered by
    :func:`markdown_table`.
``summary`` / ``rows`` (list of dicts)
    one row per variant: string fields name the variant (``embedding``, ``model``,
    ...); ``<metric>_mean`` and ``<metric>_ci95`` give the bar and its error bar.
``runs`` (list of dicts)
    one per training run, with its string fields naming the variant and a
    ``history`` (list of per-epoch dicts).

Figures are drawn on :class:`matplotlib.figure.Figure` objects directly (no pyplot
state, no display needed).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "comparison_figure",
    "learning_curves_figure",
    "markdown_table",
    "to_jsonable",
    "variant_label",
    "write_json",
    "write_report",
]

PathLike = Union[str, os.PathLike]

# Fields that describe a run or row but do not name its variant.
_NOT_A_LABEL = frozenset({"markdown", "title", "command", "label"})


def to_jsonable(obj: Any) -> Any:
    """``obj`` with tensors, NumPy values, paths, dataclasses and tuples turned into
    JSON types; non-finite floats become ``None``.

    Example:
        >>> to_jsonable({"acc": torch.tensor(0.5), "w": torch.ones(2), "p": Path("a"),
        ...              "bad": float("nan"), 3: (1, 2)})
        {'acc': 0.5, 'w': [1.0, 1.0], 'p': 'a', 'bad': None, '3': [1, 2]}
    """
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, torch.Tensor):
        return to_jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, Mapping):
        return {str(key): to_jsonable(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(value) for value in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "tolist"):  # NumPy arrays and scalars
        return to_jsonable(obj.tolist())
    if isinstance(obj, torch.dtype):
        return str(obj)
    raise TypeError(f"cannot write a {type(obj).__name__} as JSON: {obj!r:.80}")


def write_json(obj: Any, path: PathLike) -> Path:
    """Write :func:`to_jsonable` of ``obj`` as indented, strict JSON to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(obj), indent=1, allow_nan=False) + "\n")
    return path


def variant_label(row: Mapping[str, Any]) -> str:
    """The name of a run's or row's variant: its ``label`` field, else its string
    fields joined by ``" / "`` (e.g. ``"static / HSA"``).

    Example:
        >>> variant_label({"embedding": "static", "model": "HSA", "seed": 0})
        'static / HSA'
    """
    if isinstance(row.get("label"), str):
        return row["label"]
    parts = [value for key, value in row.items() if isinstance(value, str)
             and key not in _NOT_A_LABEL]
    return " / ".join(parts) if parts else "run"


def _cell(value: Any, digits: int) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.{digits}f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Optional[Sequence[str]] = None,
                   digits: int = 4) -> str:
    r"""A Markdown table of ``rows`` (dicts), one column per key (``columns`` picks and
    orders them; default: the keys of the rows in first-seen order, nested values
    left out).

    A column ``X_mean`` whose row also has ``X_ci95`` is shown as ``mean ± half-width``
    under the header ``X (95% CI)``, and ``X_ci95`` gets no column of its own. Floats
    get ``digits`` decimals (non-finite ones ``n/a``), ints thousands separators.

    Example:
        >>> print(markdown_table([{"model": "HSA", "accuracy_mean": 0.8125,
        ...                        "accuracy_ci95": 0.02, "parameters": 12345}]))
        | model | accuracy (95% CI) | parameters |
        |---|---|---|
        | HSA | 0.8125 ± 0.0200 | 12,345 |
    """
    if not rows:
        raise ValueError("markdown_table needs at least one row")
    if columns is None:
        columns = []
        for row in rows:
            columns += [key for key, value in row.items() if key not in columns
                        and not isinstance(value, (Mapping, list, tuple))]
    merged = {c for c in columns if c.endswith("_mean") and c[:-5] + "_ci95" in rows[0]}
    columns = [c for c in columns if not (c.endswith("_ci95") and c[:-5] + "_mean" in merged)]
    headers = [f"{c[:-5]} (95% CI)" if c in merged else c for c in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            value = row.get(c, "")
            half = row.get(c[:-5] + "_ci95") if c in merged else None
            cell = _cell(value, digits)
            if isinstance(half, (int, float)) and math.isfinite(half):
                cell += f" ± {_cell(float(half), digits)}"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _curves(runs: Sequence[Mapping[str, Any]], metric: str) -> Dict[str, torch.Tensor]:
    """label -> ``[runs, epochs]`` values of ``metric`` (NaN past a run's last epoch)."""
    grouped: Dict[str, List[List[float]]] = {}
    for run in runs:
        history = run.get("history") or []
        values = [float(h[metric]) if h.get(metric) is not None else math.nan
                  for h in history]
        if any(v == v for v in values):  # some epoch has the metric
            grouped.setdefault(variant_label(run), []).append(values)
    out = {}
    for label, series in grouped.items():
        table = torch.full((len(series), max(map(len, series))), math.nan, dtype=torch.float64)
        for i, values in enumerate(series):
            table[i, :len(values)] = torch.tensor(values, dtype=torch.float64)
        out[label] = table
    return out


def learning_curves_figure(runs: Sequence[Mapping[str, Any]],
                           metrics: Sequence[str] = ("train_loss", "val_loss", "val_accuracy"),
                           title: Optional[str] = None):
    """Learning curves: one panel per metric of the runs' ``history``, one line per
    variant (:func:`variant_label`): the mean over its runs, with the min-max band.

    Args:
        runs: dicts with a ``history`` (list of per-epoch dicts, e.g.
            ``fit(...)["history"]``) and string fields naming the variant.
        metrics: history keys to plot (missing ones are skipped).
        title: figure title.

    Returns:
        a :class:`matplotlib.figure.Figure`; each line's y-data is the per-epoch
        mean and its x-data the epoch number (1-based).

    Example:
        >>> runs = [{"model": "HSA", "history": [{"train_loss": 0.7}, {"train_loss": 0.5}]},
        ...         {"model": "HSA", "history": [{"train_loss": 0.6}, {"train_loss": 0.3}]}]
        >>> fig = learning_curves_figure(runs, metrics=["train_loss"])
        >>> fig.axes[0].lines[0].get_ydata().tolist()
        [0.6499999999999999, 0.4]
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [(m, _curves(runs, m)) for m in metrics]
    panels = [(m, c) for m, c in panels if c]
    if not panels:
        raise ValueError(f"no run has a history with any of {list(metrics)}")
    fig = Figure(figsize=(4.2 * len(panels), 3.4), layout="constrained")
    for ax, (metric, curves) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for label, table in curves.items():
            epochs = torch.arange(1, table.shape[1] + 1).tolist()
            counted = (~table.isnan()).sum(0).clamp_min(1)
            mean = (torch.nan_to_num(table).sum(0) / counted).tolist()
            low = torch.where(table.isnan(), math.inf, table).min(0).values.tolist()
            high = torch.where(table.isnan(), -math.inf, table).max(0).values.tolist()
            line, = ax.plot(epochs, mean, marker="o", markersize=3, label=label)
            if table.shape[0] > 1:
                ax.fill_between(epochs, low, high, alpha=0.2, color=line.get_color(),
                                linewidth=0)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(metric.replace("_", " "))
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def comparison_figure(rows: Sequence[Mapping[str, Any]], metric: str = "accuracy",
                      title: Optional[str] = None):
    """A bar per row (variant, :func:`variant_label`) of ``<metric>_mean`` (or
    ``metric``) with error bars ``<metric>_ci95`` when present.

    The value axis starts at zero whenever every bar and interval is non-negative: a
    cut axis would make differences of a point or two look large.

    Returns:
        a :class:`matplotlib.figure.Figure`; bar heights are the values.

    Example:
        >>> rows = [{"model": "HSA", "accuracy_mean": 0.8, "accuracy_ci95": 0.05},
        ...         {"model": "FSA", "accuracy_mean": 0.7, "accuracy_ci95": 0.04}]
        >>> fig = comparison_figure(rows)
        >>> [float(bar.get_height()) for bar in fig.axes[0].patches]
        [0.8, 0.7]
    """
    from matplotlib.figure import Figure

    key = f"{metric}_mean" if rows and f"{metric}_mean" in rows[0] else metric
    missing = [i for i, row in enumerate(rows) if not isinstance(row.get(key), (int, float))]
    if not rows or missing:
        raise ValueError(f"comparison_figure: rows {missing or '[]'} have no number "
                         f"{key!r}")
    labels = [variant_label(row) for row in rows]
    values = [float(row[key]) for row in rows]
    errors = [float(row.get(f"{metric}_ci95") or 0.0) for row in rows]
    errors = [e if math.isfinite(e) else 0.0 for e in errors]
    fig = Figure(figsize=(max(4.0, 0.9 * len(rows) + 1.5), 3.6), layout="constrained")
    ax = fig.subplots()
    ax.bar(range(len(rows)), values, yerr=errors, capsize=4,
           color=[f"C{i % 10}" for i in range(len(rows))])
    ax.set_xticks(range(len(rows)), labels, rotation=30 if len(rows) > 3 else 0,
                  ha="right" if len(rows) > 3 else "center", fontsize="small")
    ax.set_ylabel(metric + (" (95% CI)" if any(errors) else ""))
    low = min(v - e for v, e in zip(values, errors))
    high = max(v + e for v, e in zip(values, errors))
    pad = 0.1 * (high - min(low, 0.0)) if high > min(low, 0.0) else 0.05
    ax.set_ylim(0.0 if low >= 0 else low - pad, high + pad)
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title)
    return fig


def write_report(results: Mapping[str, Any], out_dir: PathLike, name: str = "results", *,
                 metric: str = "accuracy", title: Optional[str] = None) -> List[Path]:
    """Write ``<name>.json``, ``<name>.md`` and the figures of ``results`` (see the module
    docstring for the keys used) into ``out_dir``; return the paths written.

    Args:
        results: the experiment's result dictionary.
        out_dir: output directory (created if needed).
        name: file name stem (``"results"``: ``results.json``, ``results.md``, ...).
        metric: the metric of the comparison plot (``<metric>_mean`` in the rows).
        title: heading (default ``results["title"]``, else ``name``).

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> paths = write_report({"summary": [{"model": "HSA", "accuracy_mean": 0.8}]}, out)
        >>> [p.name for p in paths]
        ['results.json', 'results_comparison.png', 'results.md']
    """
    if not isinstance(results, Mapping):
        raise TypeError(f"results must be a dict, got {type(results).__name__}")
    if not isinstance(name, str) or not name or any(c in name for c in "/\\\0"):
        raise ValueError(f"name must be a plain file name stem, got {name!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = title or results.get("title") or name
    written = [write_json(results, out / f"{name}.json")]
    figures = []
    runs = [r for r in results.get("runs") or [] if isinstance(r, Mapping) and r.get("history")]
    if runs:
        path = out / f"{name}_curves.png"
        learning_curves_figure(runs, title=f"{title}: learning curves").savefig(path, dpi=120)
        figures.append(("learning curves", path))
    rows = results.get("summary") or results.get("rows")
    if rows and any(isinstance(r.get(f"{metric}_mean", r.get(metric)), (int, float))
                    for r in rows):
        path = out / f"{name}_comparison.png"
        comparison_figure(rows, metric, title=title).savefig(path, dpi=120)
        figures.append((f"{metric} by variant", path))
    written += [path for _, path in figures]

    lines = [f"# {title}", ""]
    if results.get("command"):
        lines += ["```", str(results["command"]), "```", ""]
    if isinstance(results.get("markdown"), str):
        lines += [results["markdown"], ""]
    elif rows:
        lines += [markdown_table(rows), ""]
    for caption, path in figures:
        lines += [f"![{caption}]({path.name})", ""]
    md = out / f"{name}.md"
    md.write_text("\n".join(lines))
    written.append(md)
    return written
