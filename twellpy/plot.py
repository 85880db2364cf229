"""Figures of activation sparsity, in the style of the TwELL paper.

Needs matplotlib (``pip install twellpy[plot]``); it is imported only when a
function here is called. Every function returns a
:class:`matplotlib.figure.Figure` built without pyplot, so nothing is shown
or kept in global state: save it with ``fig.savefig("out.png")`` or display
it in a notebook. Pass ``ax=`` to draw into an existing axes instead (the
axes' figure is returned).

Inputs follow :mod:`twellpy.stats`: dense activations (numpy, cupy, torch,
jax, any DLPack array) or twellpy containers, or precomputed per-token counts.
"""
from __future__ import annotations

import numpy as np

from . import stats as _stats
from ._array import as_array

__all__ = [
    "nnz_histogram",
    "nnz_vs_position",
    "layer_summary",
    "tile_heatmap",
    "tile_occupancy_histogram",
    "top_tokens",
]


def _mpl():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("twellpy.plot needs matplotlib; install it with "
                          "`pip install twellpy[plot]` or `pip install matplotlib`") from exc
    return matplotlib, Figure


def _new_axes(ax, figsize, ncols=1):
    _, Figure = _mpl()
    if ax is not None:
        if ncols != 1:
            raise ValueError("ax= is not supported by this figure (it draws several panels)")
        return ax.figure, [ax]
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _counts(acts_or_counts, name="acts"):
    """Per-token counts from activations or from a 1-D array of counts."""
    if _stats._is_container(acts_or_counts):
        return _stats.nnz_per_token(acts_or_counts)
    arr, _ = as_array(acts_or_counts, name)
    if arr.ndim == 1:
        return _stats._whole_counts(arr, name)
    return _stats.nnz_per_token(arr)


def nnz_histogram(acts, bins=50, log=False, ax=None, title=None):
    """Histogram of active neurons per token.

    Parameters
    ----------
    acts : array_like or twellpy container
        Activations (..., H), or per-token counts (M,).
    bins : int or sequence
        Passed to ``Axes.hist``.
    log : bool
        Logarithmic count axis (shows the heavy tail of busy tokens).
    ax : matplotlib.axes.Axes, optional
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        One axes with the histogram, a dashed line at the mean and a dotted
        line at the maximum.
    """
    counts = _counts(acts)
    if counts.size == 0:
        raise ValueError("acts holds no tokens")
    fig, (ax,) = _new_axes(ax, (6, 4))
    ax.hist(counts, bins=bins, color="tab:blue", alpha=0.85, log=log)
    mean = float(counts.mean())
    ax.axvline(mean, color="k", linestyle="--", label=f"mean {mean:.1f}")
    ax.axvline(int(counts.max()), color="tab:red", linestyle=":", label=f"max {int(counts.max())}")
    ax.set_xlabel("active neurons per token")
    ax.set_ylabel("tokens")
    ax.set_title(title or f"non-zeros per token ({counts.size} tokens)")
    ax.legend()
    return fig


def nnz_vs_position(acts, seq_len=None, trend="power", band=True, ax=None, title=None):
    """Mean active neurons against position in the sequence, with a fitted decay.

    Parameters
    ----------
    acts : array_like or twellpy container
        (B, T, H), or (M, H) / per-token counts (M,) with ``seq_len``.
    seq_len : int, optional
    trend : {"power", "exp", None}
        Fit and draw :func:`twellpy.stats.fit_position_trend`; None draws no trend.
    band : bool
        Shade mean +- one standard deviation over sequences.
    ax : matplotlib.axes.Axes, optional
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        Lines: the per-position mean (label ``"mean"``) and, if requested, the
        trend (its label holds the fitted formula). The fitted
        :class:`~twellpy.stats.PositionTrend` is attached to the figure as
        ``fig.twellpy_trend`` (None without a trend).
    """
    if trend not in ("power", "exp", None):
        raise ValueError(f"trend must be 'power', 'exp' or None, got {trend!r}")
    if _stats._is_container(acts):
        ps = _stats.nnz_per_position(acts, seq_len)
    else:
        arr, _ = as_array(acts, "acts")
        ps = _stats.nnz_per_position(arr, seq_len)
    if trend is not None and ps.position.size < 2:
        raise ValueError(f"trend={trend!r} needs at least 2 positions, got seq_len={ps.position.size}; "
                         f"pass trend=None")
    fig, (ax,) = _new_axes(ax, (6, 4))
    ax.plot(ps.position, ps.mean, marker=".", color="tab:blue", label="mean")
    if band and ps.n_sequences > 1:
        ax.fill_between(ps.position, ps.mean - ps.std, ps.mean + ps.std, color="tab:blue", alpha=0.2,
                        label="± 1 std")
    fitted = None
    if trend is not None:
        fitted = _stats.fit_position_trend(ps.position, ps.mean, kind=trend)
        grid = np.linspace(0, ps.position[-1], max(200, ps.position.size))
        ax.plot(grid, fitted(grid), color="tab:red", linestyle="--", label=f"fit: {fitted.label()}")
    ax.set_xlabel("position in sequence")
    ax.set_ylabel("active neurons per token")
    ax.set_title(title or f"non-zeros against position ({ps.n_sequences} sequences)")
    ax.legend()
    fig.twellpy_trend = fitted
    return fig


def layer_summary(layers, ax=None, title=None):
    """Per-layer mean and maximum of active neurons per token.

    Parameters
    ----------
    layers : mapping or sequence
        ``{name: acts}`` or a list of activations, as in
        :func:`twellpy.stats.nnz_per_layer`.
    ax : matplotlib.axes.Axes, optional
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        Two bar series per layer: ``"mean"`` (with a std error bar) and
        ``"max"``; the x tick labels are the layer names.
    """
    ls = _stats.nnz_per_layer(layers)
    fig, (ax,) = _new_axes(ax, (max(5, 0.5 * len(ls.names) + 2), 4))
    x = np.arange(len(ls.names))
    width = 0.4
    ax.bar(x - width / 2, ls.mean, width, yerr=ls.std, capsize=2, color="tab:blue", label="mean")
    ax.bar(x + width / 2, ls.max, width, color="tab:orange", label="max")
    ax.set_xticks(x)
    ax.set_xticklabels(ls.names, rotation=45 if len(ls.names) > 8 else 0)
    ax.set_xlabel("layer")
    ax.set_ylabel("active neurons per token")
    ax.set_title(title or "non-zeros per token by layer")
    ax.legend()
    return fig


def tile_heatmap(acts, tile=256, slots=None, max_rows=512, ax=None, title=None):
    """Heat map of tile occupancy: active neurons per (token, tile) cell.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations.
    tile : int
        Tile width T.
    slots : int, optional
        When given, cells holding more than ``slots`` entries (which TwELL
        would move to its backup rows) are outlined in red, and the colour
        bar marks ``slots``.
    max_rows : int
        Draw at most this many tokens (the first ``max_rows``), so the image
        stays readable.
    ax : matplotlib.axes.Axes, optional
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        The axes holds one image of shape (min(M, max_rows), n_tiles) and a
        colour bar.
    """
    _stats._check_int(max_rows, "max_rows")
    occ = _stats.tile_occupancy(acts, tile)
    if occ.size == 0:
        raise ValueError("acts holds no tiles")
    shown = occ[:max_rows]
    fig, (ax,) = _new_axes(ax, (6, 5))
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="viridis",
                   vmin=0, vmax=max(int(occ.max()), 1))
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_label("entries in tile")
    if slots is not None:
        slots = _stats._check_slots(slots)
        cbar.ax.axhline(slots, color="tab:red", linewidth=2)
        over = shown > slots
        if over.any():
            ax.add_collection(_outline_cells(over))
    ax.set_xlabel(f"tile (width {tile})")
    ax.set_ylabel("token")
    ax.set_title(title or f"tile occupancy ({shown.shape[0]} of {occ.shape[0]} tokens)")
    return fig


def _outline_cells(mask):
    """A LineCollection tracing the edges of the True cells of ``mask``, in the
    pixel coordinates of ``imshow`` (cell (i, j) spans j +- 0.5, i +- 0.5).

    Drawn edge by edge rather than with ``Axes.contour``, which needs a grid of
    at least 2 x 2 and so fails for one token or one tile."""
    from matplotlib.collections import LineCollection

    padded = np.pad(mask, 1)
    # a horizontal edge lies between vertically adjacent cells that differ ...
    hi, hj = np.nonzero(padded[1:, 1:-1] != padded[:-1, 1:-1])
    # ... a vertical one between horizontally adjacent cells that differ
    vi, vj = np.nonzero(padded[1:-1, 1:] != padded[1:-1, :-1])
    segs = [((j - 0.5, i - 0.5), (j + 0.5, i - 0.5)) for i, j in zip(hi, hj)]
    segs += [((j - 0.5, i - 0.5), (j - 0.5, i + 0.5)) for i, j in zip(vi, vj)]
    return LineCollection(segs, colors="tab:red", linewidths=0.8)


def tile_occupancy_histogram(acts, tile=256, slots=None, model="mixture", ax=None, title=None):
    """Histogram of tile occupancy with the fitted model and the overflow line.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations.
    tile : int
    slots : int, optional
        Draws a vertical line at ``slots`` with the empirical and predicted
        overflow rates in its label.
    model : {"mixture", "binomial", None}
        Overlay the fitted :class:`~twellpy.stats.OverflowModel` occupancy
        distribution (None: no overlay).
    ax : matplotlib.axes.Axes, optional
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        Bars (label ``"observed"``) of the fraction of cells per occupancy,
        log scale, up to the largest occupancy observed.
    """
    # checked before any work: a caller's ax must not get a partial drawing
    if model is not None and model not in ("mixture", "binomial"):  # fit_overflow_model calls it "kind"
        raise ValueError(f"model must be 'mixture', 'binomial' or None, got {model!r}")
    hist = _stats.tile_occupancy_histogram(acts, tile)
    total = hist.sum()
    if total == 0:
        raise ValueError("acts holds no tiles")
    kmax = int(np.flatnonzero(hist).max())
    k = np.arange(kmax + 1)
    frac = hist[: kmax + 1] / total
    fig, (ax,) = _new_axes(ax, (6, 4))
    ax.bar(k, frac, width=1.0, color="tab:blue", alpha=0.7, label="observed")
    fitted = None
    if model is not None:
        from scipy.stats import binom

        fitted = _stats.fit_overflow_model(acts, tile, kind=model)
        p = fitted._p()
        pmf = binom.pmf(k[:, None, None], fitted.tile_width[None, None, :], p[None])
        pred = (fitted.weights[None, :, None] * pmf).sum(axis=1).mean(axis=1)
        ax.plot(k, pred, color="tab:red", marker=".", label=f"{model} model")
    if slots is not None:
        slots = _stats._check_slots(slots)
        emp = float(hist[slots + 1:].sum() / total)
        txt = f"slots={slots}: observed overflow {emp:.2e}"
        if fitted is not None:
            txt += f", predicted {fitted.probability(slots):.2e}"
        ax.axvline(slots + 0.5, color="k", linestyle="--", label=txt)
    ax.set_yscale("log")
    ax.set_xlabel(f"entries per tile (tile width {tile})")
    ax.set_ylabel("fraction of (token, tile) cells")
    ax.set_title(title or "tile occupancy")
    ax.legend(fontsize="small")
    fig.twellpy_model = fitted
    return fig


def top_tokens(tokens, nnz, k=10, min_count=1, title=None):
    """Bar charts of the tokens that fire the most and the fewest neurons.

    Parameters
    ----------
    tokens : sequence
        One label per token (bytes, str or int), length M.
    nnz : array_like or twellpy container
        Per-token counts (M,) or activations (M, H) / (..., H).
    k : int
        Labels per panel.
    min_count : int
        Ignore labels seen fewer times than this.
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        Two horizontal bar axes: ``"most active neurons"`` (left) and
        ``"fewest active neurons"`` (right); bar labels are the token labels
        (bytes shown with ``repr``), bar lengths the mean counts.
    """
    most, fewest = _stats.token_ranking(tokens, nnz, k=k, min_count=min_count)
    fig, axes = _new_axes(None, (10, max(3, 0.3 * k + 1.5)), ncols=2)
    for ax, rows, name, color in ((axes[0], most, "most active neurons", "tab:red"),
                                  (axes[1], fewest, "fewest active neurons", "tab:green")):
        labels = [_label(r[0]) for r in rows]
        y = np.arange(len(rows))
        ax.barh(y, [r[1] for r in rows], color=color)
        ax.set_yticks(y)
        ax.set_yticklabels(labels)
        ax.invert_yaxis()  # rank 1 on top
        ax.set_xlabel("mean active neurons")
        ax.set_title(name)
    if title:
        fig.suptitle(title)
    return fig


def _label(tok):
    if isinstance(tok, (bytes, bytearray)):
        return repr(bytes(tok))
    if isinstance(tok, str):
        # Make whitespace tokens visible.
        return repr(tok) if (not tok.strip() or tok != tok.strip()) else tok
    return str(tok)
