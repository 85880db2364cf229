"""Hypothesis property tests: random shapes, densities, tiles, slots and widths."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twellpy as tw
from _containers import bits_equal, host
from conftest import RTOL, rel_err

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

dims = st.one_of(st.integers(0, 3), st.integers(1, 40), st.sampled_from([255, 256, 257, 513]))
dtypes = st.sampled_from([np.float32, np.float64, np.float16, tw._array.bfloat16])
widths = st.one_of(st.integers(0, 12), st.sampled_from(["auto", "min_storage", "quantile:0.5",
                                                         "quantile:0.9", "quantile:1", "fixed:3"]))


@st.composite
def matrices(draw):
    wide = draw(st.integers(0, 19)) == 0  # occasionally N = 70000
    m = draw(st.integers(0, 3)) if wide else draw(dims)
    n = 70000 if wide else draw(dims)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    density = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]))
    x = np.where(rng.random((m, n)) < density, rng.uniform(0.5, 2.0, (m, n)) * rng.choice([-1, 1], (m, n)), 0.0)
    if m and n and draw(st.booleans()):
        x[draw(st.integers(0, m - 1))] = rng.uniform(0.5, 2.0, n)  # a hot row
    return x.astype(draw(dtypes))


def _containers(x, tile, slots, width):
    return [tw.TwELL.from_dense(x, tile=tile, slots=slots), tw.ELL.from_dense(x),
            tw.Hybrid.from_dense(x, width=width)]


@SETTINGS
@given(x=matrices(), tile=st.sampled_from([1, 7, 32, 256]), slots=st.sampled_from([1, 2, 5, 32]), width=widths)
def test_roundtrip_and_invariants(x, tile, slots, width):
    nnz = int(np.count_nonzero(x.astype(np.float64)))
    for A in _containers(x, tile, slots, width):
        A.check_format(full_check=True)
        assert A.nnz == nnz
        assert bits_equal(A.toarray(), x)
        assert bits_equal(A.T.toarray(), np.ascontiguousarray(x.T))
        s = A.to_scipy()
        assert s.nnz == nnz and np.array_equal(s.toarray(), x.astype(s.dtype))
        for fmt in ("twell", "ell", "hybrid"):
            assert bits_equal(A.asformat(fmt).toarray(), x)
    T = tw.TwELL.from_dense(x, tile=tile, slots=slots)
    # every stored row fits; every backup row truly overflows
    if x.shape[0] and x.shape[1]:
        br = host(T.backup_rows)
        nt = -(-x.shape[1] // tile)
        pad = np.zeros((x.shape[0], nt * tile), bool)
        pad[:, :x.shape[1]] = x.astype(np.float64) != 0
        over = (pad.reshape(x.shape[0], nt, tile).sum(-1) > slots).any(1)
        assert np.array_equal(np.nonzero(over)[0], br)


@SETTINGS
@given(x=matrices(), k=st.integers(1, 6), tile=st.sampled_from([7, 256]), slots=st.sampled_from([1, 32]),
       width=widths, seed=st.integers(0, 1000))
def test_products_match_float64_reference(x, k, tile, slots, width, seed):
    rng = np.random.default_rng(seed)
    m, n = x.shape
    w = rng.standard_normal((n, k)).astype(x.dtype)
    wl = rng.standard_normal((k, m)).astype(x.dtype)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    refl = wl.astype(np.float64) @ x.astype(np.float64)
    tol = 4 * RTOL[np.dtype(x.dtype)]
    for A in _containers(x, tile, slots, width):
        assert rel_err(A @ w, ref) <= tol
        assert rel_err(wl @ A, refl) <= tol


@SETTINGS
@given(x=matrices(), slots=st.sampled_from([1, 3, 32]))
def test_overflow_raise_or_exact(x, slots):
    xs = x.astype(np.float64) != 0
    n = x.shape[1]
    tiles = [xs[:, t:t + 256].sum(1) for t in range(0, n, 256)]
    worst = int(max((c.max() for c in tiles if c.size), default=0))
    if worst > slots:
        with pytest.raises(tw.TileOverflowError, match=f"pass slots={worst} or more"):
            tw.TwELL.from_dense(x, slots=slots, overflow="raise")
        tw.TwELL.from_dense(x, slots=worst, overflow="raise").check_format(full_check=True)
    else:
        A = tw.TwELL.from_dense(x, slots=slots, overflow="raise")
        assert A.n_backup == 0 and bits_equal(A.toarray(), x)
