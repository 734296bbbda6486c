"""Figures drawn with matplotlib's object API, never through pyplot.

pyplot is process state: ``matplotlib.use("Agg")`` switches a notebook kernel's
backend for good (its figures then no longer show), and a figure pyplot made is
shown by the kernel at the end of the cell *and* again as the cell's value. A
``matplotlib.figure.Figure`` built directly belongs to no backend: it is saved
with ``savefig`` anywhere, and in a notebook it shows once, as the value it is.

``subplots`` and ``close`` stand in for pyplot's, so plotting code written for
``plt`` takes this module as its ``plt``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["subplots", "close", "show_in_notebook", "warm_up"]


def subplots(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float] | None = None,
             **options: Any) -> tuple[Any, Any]:
    """A new ``Figure`` and its axes, as ``pyplot.subplots`` returns them, without pyplot.

    Args:
        nrows, ncols: the grid of axes.
        figsize: inches (width, height).
        **options: ``Figure.subplots``'s keywords (``squeeze``, ``sharex``, ...).

    Returns:
        (figure, axes): one ``Axes`` or an array of them, as pyplot's.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **options)


def close(fig: Any) -> None:
    """Nothing to do: no backend holds a figure of ``subplots`` (pyplot's ``close``)."""


def show_in_notebook() -> None:
    """In an IPython kernel, make a returned ``Figure`` display as an image.

    IPython shows figures through a formatter that matplotlib's inline backend
    registers when pyplot first loads it; a figure built without pyplot in a
    fresh kernel would otherwise show as ``<Figure size ...>``. Where no
    formatter for figures is registered yet, IPython's own PNG one is
    (``select_figure_formats``, what the inline backend does); one the user or
    the backend chose is kept. Nothing else changes: no backend, no pyplot.
    Outside IPython nothing happens.
    """
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    formatters = getattr(getattr(shell, "display_formatter", None), "formatters", None)
    if not formatters:
        return
    from matplotlib.figure import Figure

    for formatter in formatters.values():
        try:
            formatter.lookup_by_type(Figure)
            return  # a format for figures is registered: it is the user's or the backend's
        except KeyError:
            continue
    from IPython.core.pylabtools import select_figure_formats

    select_figure_formats(shell, {"png"})


def warm_up() -> None:
    """Import matplotlib's figure, Agg canvas and tickers and render a tiny figure with
    text (its fonts loaded and cached), so that the first real figure of the process
    does not pay for them (about a second); ``tpu-pod plan`` runs it in a thread while
    its workers cost the points. It writes nothing."""
    import io

    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, ax = subplots(figsize=(2, 1))
    ax.barh([0], [1.0], label="x")
    ax.annotate("x", (1.0, 0), fontsize=7)
    ax.set_yticks([0], ["x"], fontsize=8)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.set_title("x", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(io.BytesIO(), format="png", dpi=20)
