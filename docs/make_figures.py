"""Draw the layout figures of the documentation (docs/images/*.png).

Run ``python docs/make_figures.py`` after changing a figure; the PNGs are
committed so the documentation builds without running this script. The
figures use only numpy and matplotlib, and the layouts are derived from the
storage rules of docs/internals.md on one small hand-made matrix:

* 6 rows x 16 columns, TwELL tile 8 (2 tiles) and 2 slots per tile;
* row 2 has 3 non-zeros in its first tile, more than the 2 slots, so TwELL
  keeps that whole row in a dense backup row;
* Hybrid with width 3 keeps row 2 (5 non-zeros) in a dense backup row.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

OUT = Path(__file__).resolve().parent / "images"

M, N, TILE, SLOTS, HYB_WIDTH = 6, 16, 8, 2, 3
#: Column positions of the non-zeros of each row of the example matrix.
PATTERN = [[1, 5, 10], [3], [0, 2, 4, 9, 12], [], [7, 8, 15], [6, 11, 13]]
ROW_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#b07aa1"]
PAD = "#e6e6e6"


def example_values():
    """Value labels a, b, c, ... in row-major order of the non-zeros."""
    labels, k = {}, 0
    for r, cols in enumerate(PATTERN):
        for c in cols:
            labels[(r, c)] = chr(ord("a") + k)
            k += 1
    return labels


def draw_grid(ax, x0, y0, texts, colors, title=None, col_sep=None, fontsize=9):
    """Draw a grid of cells; ``texts``/``colors`` are lists of rows.

    ``col_sep`` draws a thick vertical line every ``col_sep`` columns (tiles).
    Cell (i, j) covers [x0 + j, x0 + j + 1] x [y0 - i - 1, y0 - i].
    """
    rows = len(texts)
    cols = len(texts[0]) if rows else 0
    for i in range(rows):
        for j in range(cols):
            ax.add_patch(Rectangle((x0 + j, y0 - i - 1), 1, 1, facecolor=colors[i][j],
                                   edgecolor="white", linewidth=1.2))
            if texts[i][j] != "":
                light = colors[i][j] in (PAD, "white")
                ax.text(x0 + j + 0.5, y0 - i - 0.5, texts[i][j], ha="center", va="center",
                        fontsize=fontsize, color="#555555" if light else "white")
    if col_sep:
        for j in range(col_sep, cols, col_sep):
            ax.plot([x0 + j, x0 + j], [y0 - rows, y0], color="black", linewidth=2)
    if title:
        ax.text(x0 + cols / 2, y0 + 0.45, title, ha="center", va="bottom", fontsize=10, weight="bold")
    return x0 + cols


def row_labels(ax, x, y0, labels):
    for i, lab in enumerate(labels):
        ax.text(x, y0 - i - 0.5, lab, ha="right", va="center", fontsize=9, color="#333333")


def draw_dense(ax, x0, y0, labels, title="dense matrix (6 x 16)", tile=None):
    texts = [["" for _ in range(N)] for _ in range(M)]
    colors = [["white" for _ in range(N)] for _ in range(M)]
    for (r, c), v in labels.items():
        texts[r][c] = v
        colors[r][c] = ROW_COLORS[r]
    for r in range(M):  # light grid for the zeros
        for c in range(N):
            if colors[r][c] == "white":
                colors[r][c] = "#f7f7f7"
    row_labels(ax, x0 - 0.2, y0, [f"row {r}" for r in range(M)])
    end = draw_grid(ax, x0, y0, texts, colors, title=title, col_sep=tile)
    for c in range(0, N, 4):
        ax.text(x0 + c + 0.5, y0 - M - 0.35, str(c), ha="center", va="top", fontsize=7, color="#777777")
    return end


def finish(ax, fig, path, width, height):
    ax.set_xlim(-2.5, width)
    ax.set_ylim(-height, 2.4)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def fig_ell(labels):
    width = max(len(p) for p in PATTERN)
    vals = [["0"] * width for _ in range(M)]
    vcol = [[PAD] * width for _ in range(M)]
    idx = [["-1"] * width for _ in range(M)]
    icol = [[PAD] * width for _ in range(M)]
    for r, cols in enumerate(PATTERN):
        for s in range(width):
            if s < len(cols):
                vals[r][s] = labels[(r, cols[s])]
                idx[r][s] = str(cols[s])
                vcol[r][s] = icol[r][s] = ROW_COLORS[r]
            else:
                vals[r][s] = "0"
    nnz = [[str(len(p))] for p in PATTERN]
    ncol = [[ROW_COLORS[r] if PATTERN[r] else PAD] for r in range(M)]
    fig, ax = plt.subplots(figsize=(13, 3.6))
    x = draw_dense(ax, 0, 0, labels)
    x = draw_grid(ax, x + 1.5, 0, vals, vcol, title=f"values\n(M, W={width})")
    x = draw_grid(ax, x + 1.0, 0, idx, icol, title="indices\n(M, W)")
    x = draw_grid(ax, x + 1.0, 0, nnz, ncol, title="row_nnz")
    ax.text(0, -M - 1.2, "ELL: every row gets W slots (W = widest row). Entries are packed to the front, "
            "sorted by column; padding is value 0, index -1 (grey).", fontsize=9, va="top")
    finish(ax, fig, OUT / "ell.png", x + 0.5, M + 2.2)


def fig_twell(labels):
    n_tiles = -(-N // TILE)
    backup_rows = [r for r, cols in enumerate(PATTERN)
                   if any(sum(1 for c in cols if c // TILE == t) > SLOTS for t in range(n_tiles))]
    vals = [["0"] * (n_tiles * SLOTS) for _ in range(M)]
    idx = [["-1"] * (n_tiles * SLOTS) for _ in range(M)]
    vcol = [[PAD] * (n_tiles * SLOTS) for _ in range(M)]
    counts = [["0"] * n_tiles for _ in range(M)]
    ccol = [[PAD] * n_tiles for _ in range(M)]
    for r, cols in enumerate(PATTERN):
        if r in backup_rows:
            continue
        for t in range(n_tiles):
            in_tile = [c for c in cols if c // TILE == t]
            counts[r][t] = str(len(in_tile))
            ccol[r][t] = ROW_COLORS[r] if in_tile else PAD
            for s, c in enumerate(in_tile):
                vals[r][t * SLOTS + s] = labels[(r, c)]
                idx[r][t * SLOTS + s] = str(c)
                vcol[r][t * SLOTS + s] = ROW_COLORS[r]
    backup = [["" for _ in range(N)] for _ in backup_rows]
    bcol = [["#f7f7f7"] * N for _ in backup_rows]
    for i, r in enumerate(backup_rows):
        for c in PATTERN[r]:
            backup[i][c] = labels[(r, c)]
            bcol[i][c] = ROW_COLORS[r]
    row_map = [[str(backup_rows.index(r)) if r in backup_rows else "-1"] for r in range(M)]
    rcol = [[ROW_COLORS[r] if r in backup_rows else PAD] for r in range(M)]

    fig, ax = plt.subplots(figsize=(14, 5.2))
    x = draw_dense(ax, 0, 0, labels, title=f"dense matrix, tile T={TILE}", tile=TILE)
    x = draw_grid(ax, x + 1.5, 0, vals, vcol, title=f"values\n(M, tiles, S={SLOTS})", col_sep=SLOTS)
    x = draw_grid(ax, x + 1.0, 0, idx, vcol, title="indices\n(global column)", col_sep=SLOTS)
    x = draw_grid(ax, x + 1.0, 0, counts, ccol, title="counts")
    x = draw_grid(ax, x + 1.8, 0, row_map, rcol, title="row_map")
    y_b = -M - 1.6
    row_labels(ax, -0.2, y_b, [f"row {r}" for r in backup_rows])
    draw_grid(ax, 0, y_b, backup, bcol, title=None, col_sep=TILE)
    ax.text(N + 0.5, y_b - 0.5, f"backup (R={len(backup_rows)}, N): row 2 has 3 non-zeros in tile 0 > S={SLOTS},\n"
            "so the whole row is kept here, exactly; its counts are 0", fontsize=9, va="center")
    ax.text(0, y_b - len(backup_rows) - 0.6,
            "TwELL: each row is cut into tiles of T columns; each (row, tile) has S slots holding its "
            "non-zeros packed to the front, sorted, with global column indices. Padding: value 0, index -1.",
            fontsize=9, va="top")
    finish(ax, fig, OUT / "twell.png", x + 0.5, M + 4.6)


def fig_hybrid(labels):
    width = HYB_WIDTH
    backup_rows = [r for r, cols in enumerate(PATTERN) if len(cols) > width]
    vals = [["0"] * width for _ in range(M)]
    idx = [["-1"] * width for _ in range(M)]
    vcol = [[PAD] * width for _ in range(M)]
    nnz = [["0"] for _ in range(M)]
    ncol = [[PAD] for _ in range(M)]
    for r, cols in enumerate(PATTERN):
        if r in backup_rows:
            continue
        nnz[r][0] = str(len(cols))
        ncol[r][0] = ROW_COLORS[r] if cols else PAD
        for s, c in enumerate(cols):
            vals[r][s] = labels[(r, c)]
            idx[r][s] = str(c)
            vcol[r][s] = ROW_COLORS[r]
    backup = [["" for _ in range(N)] for _ in backup_rows]
    bcol = [["#f7f7f7"] * N for _ in backup_rows]
    for i, r in enumerate(backup_rows):
        for c in PATTERN[r]:
            backup[i][c] = labels[(r, c)]
            bcol[i][c] = ROW_COLORS[r]
    row_map = [[str(backup_rows.index(r)) if r in backup_rows else "-1"] for r in range(M)]
    rcol = [[ROW_COLORS[r] if r in backup_rows else PAD] for r in range(M)]

    fig, ax = plt.subplots(figsize=(13, 4.8))
    x = draw_dense(ax, 0, 0, labels)
    x = draw_grid(ax, x + 1.5, 0, vals, vcol, title=f"values\n(M, W={width})")
    x = draw_grid(ax, x + 1.0, 0, idx, vcol, title="indices\n(M, W)")
    x = draw_grid(ax, x + 1.0, 0, nnz, ncol, title="row_nnz")
    x = draw_grid(ax, x + 1.8, 0, row_map, rcol, title="row_map")
    y_b = -M - 1.6
    row_labels(ax, -0.2, y_b, [f"row {r}" for r in backup_rows])
    draw_grid(ax, 0, y_b, backup, bcol)
    ax.text(N + 0.5, y_b - 0.5, f"backup (R={len(backup_rows)}, N): row 2 has 5 non-zeros > W={width},\n"
            "so it is kept here as a dense row; its row_nnz is 0", fontsize=9, va="center")
    ax.text(0, y_b - len(backup_rows) - 0.6,
            "Hybrid: an ELL part of width W (fixed or chosen by a strategy) plus dense backup rows for "
            "every row wider than W. No row is ever dropped: R grows as needed.", fontsize=9, va="top")
    finish(ax, fig, OUT / "hybrid.png", x + 0.5, M + 4.6)


def fig_slots():
    """P(some tile of a row overflows) against slots, for a binomial model.

    Each of the T neurons of a tile fires independently with probability
    p = k / H (k = mean active neurons per token, H = hidden size).
    """
    from math import comb

    H, T = 5632, 256
    n_tiles = -(-H // T)
    slots = np.arange(1, 41)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k in (15, 30, 60, 100):
        p = k / H
        pmf = np.array([comb(T, j) * p**j * (1 - p) ** (T - j) for j in range(T + 1)])
        tail = np.array([pmf[s + 1:].sum() for s in slots])  # P(count > s) for one tile
        row = 1 - (1 - tail) ** n_tiles  # any of the row's tiles overflows
        ax.semilogy(slots, np.maximum(row, 1e-16), label=f"{k} active / token")
    ax.axvline(32, color="grey", linestyle=":", linewidth=1)
    ax.text(32.5, 1e-13, "default S=32", fontsize=8, color="grey")
    ax.set_xlabel("slots S per tile")
    ax.set_ylabel("P(row goes to backup)")
    ax.set_ylim(1e-16, 2)
    ax.set_title(f"Uniform firing model, H={H}, T={T}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(OUT / "slots_overflow.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def fig_width():
    """Bytes of Hybrid (ELL part + backup rows) against the width W for a
    skewed row-nnz distribution (log-normal token activity)."""
    rng = np.random.default_rng(0)
    M, H = 4096, 5632
    row_nnz = np.minimum(H, rng.poisson(30 * np.exp(0.6 * rng.standard_normal(M))))
    widths = np.arange(1, int(row_nnz.max()) + 2)
    val, idx = 2, 4  # bfloat16 values, int32 indices
    ell = M * widths * (val + idx)
    backup = np.array([(row_nnz > w).sum() for w in widths]) * H * val
    total = ell + backup + M * 4 * 2  # row_nnz and row_map
    best = widths[np.argmin(total)]
    q90 = int(np.ceil(np.quantile(row_nnz, 0.9)))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(widths, total / 2**20, label="total")
    ax.plot(widths, ell / 2**20, "--", label="ELL part")
    ax.plot(widths, backup / 2**20, ":", label="dense backup rows")
    ax.axvline(best, color="C3", linewidth=1)
    ax.text(best + 1, ax.get_ylim()[1] * 0.9, f"min_storage W={best}", color="C3", fontsize=8)
    ax.axvline(q90, color="grey", linewidth=1, linestyle="-.")
    ax.text(q90 + 1, ax.get_ylim()[1] * 0.75, f"quantile:0.9 W={q90}", color="grey", fontsize=8)
    ax.set_xlabel("ELL width W")
    ax.set_ylabel("MiB (bfloat16 values, int32 indices)")
    ax.set_title(f"Hybrid storage, M={M}, H={H}, skewed row nnz (mean {row_nnz.mean():.0f})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(OUT / "hybrid_width.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    labels = example_values()
    fig_ell(labels)
    fig_twell(labels)
    fig_hybrid(labels)
    fig_slots()
    fig_width()
    print("wrote", ", ".join(sorted(p.name for p in OUT.glob("*.png"))))


if __name__ == "__main__":
    main()
