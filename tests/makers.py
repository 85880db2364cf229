"""Shared grid of sparsity patterns for container, kernel and FFN tests.

Every maker takes a ``numpy.random.Generator`` and returns a dense float64
numpy array. Non-zero values are drawn from +-[0.5, 2) so that they survive a
cast to float16/bfloat16 (no underflow to zero, no overflow) and never cancel.
Import ``MAKERS`` (name -> maker) to parametrize a test over the whole grid;
``SMALL_MAKERS`` leaves out the wide N = 70000 case for slow paths.
"""
from __future__ import annotations

import numpy as np


def _values(rng, n):
    return rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)


def random_sparse(rng, m, n, nnz_per_row):
    """(m, n) with exactly ``min(nnz_per_row, n)`` non-zeros per row at random columns."""
    x = np.zeros((m, n))
    k = min(int(nnz_per_row), n)
    if m == 0 or k == 0:
        return x
    cols = np.argsort(rng.random((m, n)), axis=1)[:, :k]
    x[np.arange(m)[:, None], cols] = _values(rng, m * k).reshape(m, k)
    return x


def empty(rng):
    """No rows at all: shape (0, 300)."""
    return np.zeros((0, 300))


def all_zero(rng):
    """Rows and columns but no non-zero: (6, 300)."""
    return np.zeros((6, 300))


def zero_rows(rng):
    """Sparse rows with every other row entirely zero: (9, 520)."""
    x = random_sparse(rng, 9, 520, 12)
    x[::2] = 0.0
    return x


def full_rows(rng):
    """Some rows completely dense (every tile over a 32-slot capacity): (5, 300)."""
    x = random_sparse(rng, 5, 300, 7)
    x[1] = _values(rng, 300)
    x[4] = _values(rng, 300)
    return x


def one_hot_row(rng):
    """One row with 1000 non-zeros among rows with 5: (16, 1500)."""
    x = random_sparse(rng, 16, 1500, 5)
    cols = rng.choice(1500, 1000, replace=False)
    x[7, cols] = _values(rng, 1000)
    return x


def max_width(rng):
    """Exactly 32 non-zeros in one tile of every row (the largest that fits S=32): (4, 256)."""
    return random_sparse(rng, 4, 256, 32)


def over_capacity(rng):
    """A few rows with 33 to 40 non-zeros inside one 256-column tile: (10, 700)."""
    x = random_sparse(rng, 10, 700, 9)
    for r, k in ((2, 33), (5, 40), (9, 64)):
        t = r % 2
        cols = t * 256 + rng.choice(256, k, replace=False)
        x[r, cols] = _values(rng, k)
    return x


def ragged_n(rng):
    """N % 256 != 0 and a last tile 1 column wide with a non-zero in it: (13, 513)."""
    x = random_sparse(rng, 13, 513, 20)
    x[3, 512] = 1.25
    return x


def single_row(rng):
    """M = 1: (1, 1000)."""
    return random_sparse(rng, 1, 1000, 40)


def single_column(rng):
    """N = 1: (11, 1)."""
    x = np.zeros((11, 1))
    x[rng.random(11) < 0.5, 0] = 1.5
    return x


def wide(rng):
    """N = 70000 (column ids above 65535): (3, 70000)."""
    x = random_sparse(rng, 3, 70000, 50)
    x[1, 69999] = -0.75
    x[2, 65536] = 0.625
    return x


MAKERS = {
    "empty": empty,
    "all_zero": all_zero,
    "zero_rows": zero_rows,
    "full_rows": full_rows,
    "one_hot_row": one_hot_row,
    "max_width": max_width,
    "over_capacity": over_capacity,
    "ragged_n": ragged_n,
    "single_row": single_row,
    "single_column": single_column,
    "wide": wide,
}

SMALL_MAKERS = {k: v for k, v in MAKERS.items() if k != "wide"}
