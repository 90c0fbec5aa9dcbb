"""Where every bench, the demo and the trainers write what they measured: a table of rows as markdown, results as
JSON (written whole or not at all), and figures as PNG (grouped bars, lines), so that each tool keeps only what
it measures and how it lays it out."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Sequence

import numpy as np


def cell(v: Any, missing: str = "") -> str:
    """A table cell: `missing` for None, JSON for lists and dicts, `str` otherwise."""
    if v is None:
        return missing
    return json.dumps(v, default=jsonable) if isinstance(v, (list, dict)) else str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None, missing: str = "") -> list[str]:
    """The lines of a markdown table of `rows` (dicts) over `columns` (default: every key, in first-seen order);
    [] for no rows."""
    if not rows:
        return []
    cols = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(cell(r.get(c), missing) for c in cols) + " |" for r in rows])


def jsonable(x):
    """`json.dump`'s fallback: numbers and arrays (numpy, JAX) as numbers and lists, anything else as its string."""
    if isinstance(x, (np.generic, np.ndarray)) or hasattr(x, "__array__"):
        a = np.asarray(x)
        return a.item() if a.ndim == 0 else a.tolist()
    return str(x)


def write_json(path: str, obj, indent: int = 2) -> str:
    """`obj` as JSON at `path`, through a temporary file, so a reader never sees half a result."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent, default=jsonable)
    os.replace(tmp, path)
    return path


def write_text(path: str, lines: str | Sequence[str]) -> str:
    """Markdown (or any text) at `path`; a list of lines is joined, and the file ends with a newline."""
    text = lines if isinstance(lines, str) else "\n".join(lines)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    return path


@contextlib.contextmanager
def figure(path: str, nrows: int = 1, ncols: int = 1, figsize=(7.0, 4.0), dpi: int = 110, title: str | None = None,
           **subplots) -> Iterator[tuple[Any, np.ndarray] | None]:
    """`with figure(path, ...) as fa:` gives (fig, axes [nrows, ncols]) to draw on, then saves the PNG at `path`
    and closes it; gives None (and saves nothing) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        yield None
        return
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False, **subplots)
    try:
        yield fig, axes
        if title:
            fig.suptitle(title, fontsize=9)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def grouped_bars(ax, groups: Sequence[str], series: dict[str, Sequence[float | None]], ylabel: str,
                 ref: float | None = 1.0, dots: dict[str, Sequence[float | None]] | None = None,
                 title: str | None = None, fontsize: int = 7, rotation: int = 30) -> None:
    """Bars of each series (legend entries) per group (x ticks) on `ax`; a missing value (None) leaves a gap;
    `dots`: per series a second value marked on its bars (e.g. a prediction); `ref`: a horizontal line."""
    x = np.arange(len(groups))
    w = 0.8 / max(1, len(series))
    nan = lambda vals: [np.nan if v is None else v for v in vals]  # noqa: E731
    for j, (name, vals) in enumerate(series.items()):
        xs = x + (j - (len(series) - 1) / 2) * w
        ax.bar(xs, nan(vals), w, label=name)
        if dots and name in dots:
            ax.plot(xs, nan(dots[name]), "k.", ms=3)
    if ref is not None:
        ax.axhline(ref, color="gray", lw=0.8)
    ax.set_xticks(x, list(groups), fontsize=fontsize, rotation=rotation, ha="right" if rotation else "center")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6, ncol=min(4, max(1, len(series))))


def pivot(rows: Sequence[dict], group: str, series: str, value: str) -> tuple[list[str], dict[str, list]]:
    """(groups, {series name: values per group}) of long-format rows, in first-seen order; None where a
    (group, series) pair has no row."""
    groups = list(dict.fromkeys(str(r[group]) for r in rows))
    names = list(dict.fromkeys(str(r[series]) for r in rows))
    at = {(str(r[group]), str(r[series])): r.get(value) for r in rows}
    return groups, {n: [at.get((g, n)) for g in groups] for n in names}


def bar_chart(path: str, rows: Sequence[dict], group: str, series: str, value: str, ylabel: str, title: str,
              ref: float | None = 1.0, dots: str | None = None) -> str | None:
    """One panel of `grouped_bars` over long-format rows (a bar per `series` value in each `group`, height
    `value`, a dot at `dots` where given); returns `path`, or None without rows or matplotlib."""
    if not rows:
        return None
    groups, vals = pivot(rows, group, series, value)
    marks = pivot(rows, group, series, dots)[1] if dots else None
    with figure(path, figsize=(max(6.0, 0.45 * len(groups) * max(1, len(vals))), 3.6), dpi=120) as fa:
        if fa is None:
            return None
        grouped_bars(fa[1][0, 0], groups, vals, ylabel, ref, marks, title)
    return path


def cost_plot(table, path: str) -> str | None:
    """A cost table's rounds in AR steps against the draft depth (`jspec.costs.CostTable`), saved at `path`."""
    with figure(path, figsize=(5, 3.2), dpi=120) as fa:
        if fa is None:
            return None
        ax = fa[1][0, 0]
        d = np.arange(len(table.step_s))
        ax.plot(d, table.relative(), "o-", label="a round drafting to depth d")
        ax.axhline(1.0, color="gray", ls="--", label="an AR step")
        ax.set_xlabel("draft depth d")
        ax.set_ylabel("cost (AR steps)")
        ax.set_title(f"{table.device}, batch {table.batch}", fontsize=9)
        ax.legend(fontsize=8)
    return path
