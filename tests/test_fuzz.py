"""Property fuzzing of every public operation against scipy.sparse or float64.

Search space: random shapes (M = 0 and 1, N = 1, occasionally N > 65535),
every value dtype, every format and parameter (tile, slots, overflow mode,
ELL/Hybrid width strategies), and adversarial sparsity (all-zero rows, full
rows, one row holding everything, tiles over capacity, power-law row lengths,
popular columns).

Profiles (environment variable ``TWELLPY_FUZZ_PROFILE``):

* ``ci`` (default): 40 examples per property and backend, a fixed seed, and
  the stored database ``tests/hypothesis_db`` replayed read-only (so a failure
  stored there is retried first, and CI runs the same examples every time).
* ``gpu``: 300 examples per property, random seed, failures written to
  ``tests/hypothesis_db``. Run with ``-m gpu`` on the device to fuzz the
  CUDA backend (cupy inputs); the CPU variants run too without ``-m gpu``.
* ``dev``: like ``gpu`` with 100 examples; for local hunting.
* ``sanitize``: ``ci`` with 8 examples, chosen automatically when
  ``TWELLPY_SANITIZE`` is set (compute-sanitizer runs are much slower).

The number of examples executed is counted per property and printed at the
end of the session (and written per process to ``$OUT/fuzz_counts_<worker>.json`` when ``OUT`` is set).
"""
from __future__ import annotations

import collections
import functools
import json
import os
import tempfile

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, seed, settings, strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

import twellpy as tw
from _reliability_util import bits_equal, host, poison_cuda_allocations
from _train_ref import dense_gated, dense_relu, f64, to_gpu
from conftest import BACKENDS, DTYPES, rel_err
from twellpy._array import bfloat16


def rmatmul(w, A):
    """``w @ A``; cupy operands call ``A.__rmatmul__`` directly, because whether
    ``cupy.ndarray.__matmul__`` defers to a foreign ``__rmatmul__`` depends on the
    CuPy version (the operator form on cupy is tested once, in test_gpu_reliability)."""
    return w @ A if isinstance(w, np.ndarray) else A.__rmatmul__(w)


DB_DIR = os.path.join(os.path.dirname(__file__), "hypothesis_db")
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture,
             HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=_SUPPRESS,
                          database=ReadOnlyDatabase(DirectoryBasedExampleDatabase(DB_DIR)),
                          print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=_SUPPRESS,
                          database=DirectoryBasedExampleDatabase(DB_DIR), print_blob=True)
settings.register_profile("gpu", max_examples=300, deadline=None, suppress_health_check=_SUPPRESS,
                          database=DirectoryBasedExampleDatabase(DB_DIR), print_blob=True)
# compute-sanitizer runs (benchmarks/device_suite.sh sets TWELLPY_SANITIZE) are 10-100x slower
settings.register_profile("sanitize", parent=settings.get_profile("ci"), max_examples=8)
PROFILE = os.environ.get("TWELLPY_FUZZ_PROFILE", "sanitize" if os.environ.get("TWELLPY_SANITIZE") else "ci")
FUZZ_SETTINGS = settings.get_profile(PROFILE)
#: fixed seed of the CI profile (reproducible runs); other profiles explore
CI_SEED = 20261202

#: property name -> examples executed in this session
EXAMPLES = collections.Counter()

#: norm-wise relative error allowed against a float64 reference (fp32 accumulation)
TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 1e-2,
       bfloat16: 4e-2}


def counted(fn):
    """Count the examples a property executes (shrinking replays included)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        EXAMPLES[fn.__name__] += 1
        return fn(*args, **kwargs)

    return wrapper


def fuzz(test):
    """Apply the active profile (and the fixed CI seed) to a @given test."""
    test = FUZZ_SETTINGS(test)
    if PROFILE in ("ci", "sanitize"):
        test = seed(CI_SEED)(test)
    return test


class _ExampleReport:
    """pytest plugin (registered by the fixture below) printing the counts last."""

    def pytest_terminal_summary(self, terminalreporter):
        total = sum(EXAMPLES.values())
        terminalreporter.write_sep("-", f"fuzz profile {PROFILE!r}: {total} examples executed")
        for k, v in sorted(EXAMPLES.items()):
            terminalreporter.write_line(f"  {k}: {v}")

    def pytest_sessionfinish(self, session):
        # one file per process: under pytest-xdist every worker counts its own
        # share (the total is the sum over fuzz_counts_*.json)
        out = os.environ.get("OUT")
        if out and EXAMPLES:
            who = os.environ.get("PYTEST_XDIST_WORKER", "main")
            with open(os.path.join(out, f"fuzz_counts_{who}.json"), "w") as f:
                json.dump({"profile": PROFILE, "process": who, "total": sum(EXAMPLES.values()),
                           "per_property": dict(EXAMPLES)}, f, indent=1)


_REPORTER = _ExampleReport()


@pytest.fixture(scope="module", autouse=True)
def _report_examples(request):
    pm = request.config.pluginmanager
    if not pm.is_registered(_REPORTER):
        pm.register(_REPORTER, "twellpy-fuzz-counts")
    yield


@pytest.fixture(autouse=True)
def _poisoned_cuda_outputs(request, monkeypatch):
    """CUDA variants: every backend output starts as NaN/garbage (unwritten elements fail)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "cuda":
        poison_cuda_allocations(monkeypatch)


# ---------------------------------------------------------------------------
# strategies

PATTERNS = ["random", "zero_rows", "full_rows", "hot_row", "over_capacity", "power_law",
            "popular_cols", "all_zero"]


def _vals(rng, n):
    # +-[0.5, 2): exact enough in every dtype, never cancels, never underflows
    return rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)


def make_pattern(kind, m, n, rng):
    """Dense float64 (m, n) matrix with the adversarial structure ``kind``."""
    x = np.zeros((m, n))
    if m == 0:
        return x
    if kind == "all_zero":
        return x
    if kind == "power_law":
        # row lengths ~ Zipf: most rows tiny, a few very long
        lens = np.minimum(rng.zipf(1.6, m) - 1, n)
    elif kind == "full_rows":
        lens = rng.integers(0, max(1, n // 8) + 1, m)
        lens[rng.random(m) < 0.4] = n
    else:
        lens = rng.integers(0, max(1, n // 10) + 1, m)
    for r in range(m):
        k = int(lens[r])
        if kind == "popular_cols":
            # every row picks from a few hot columns first (column skew)
            hot = rng.choice(n, min(n, 3), replace=False)
            cols = np.unique(np.concatenate([hot[: min(k, hot.size)], rng.choice(n, k, replace=False)]))[:max(k, 1)]
        else:
            cols = rng.choice(n, k, replace=False)
        x[r, cols] = _vals(rng, cols.size)
    if kind == "zero_rows":
        x[rng.random(m) < 0.5] = 0.0
    elif kind == "hot_row":
        x[:] = 0.0
        x[int(rng.integers(m))] = _vals(rng, n)  # one row with everything
    elif kind == "over_capacity":
        # a dense run of columns inside one tile-sized window in some rows
        for r in np.flatnonzero(rng.random(m) < 0.5):
            lo = int(rng.integers(0, n))
            hi = min(n, lo + int(rng.integers(1, 70)))
            x[r, lo:hi] = _vals(rng, hi - lo)
    return x


@st.composite
def matrices(draw, max_m=40, max_n=600, allow_wide=True):
    """(x float64 dense, dtype, pattern name): random shape, dtype and structure."""
    # Hypothesis favours boundary values, so the rare shapes are picked from a
    # sampled list at fixed rates: wide N ~1/6, M in {0, 1} ~1/3, N = 1 ~1/6
    wide = allow_wide and draw(st.sampled_from([False] * 5 + [True]))
    if wide:
        m = draw(st.integers(0, 3))
        n = draw(st.integers(65536, 70001))
    else:
        m = draw(st.sampled_from([0, 1, None, None, None, None]))
        m = draw(st.integers(2, max_m)) if m is None else m
        n = draw(st.sampled_from([1, None, None, None, None, None]))
        n = draw(st.integers(2, max_n)) if n is None else n
    kind = draw(st.sampled_from(PATTERNS))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = make_pattern(kind, m, n, rng)
    return x.astype(dtype), dtype, kind


@st.composite
def formats(draw):
    """(class, construction parameters) over every format and parameter."""
    fmt = draw(st.sampled_from(["twell", "ell", "hybrid"]))
    if fmt == "twell":
        p = {"tile": draw(st.sampled_from([1, 5, 32, 64, 256, 1024])),
             "slots": draw(st.sampled_from([1, 2, 3, 8, 32])),
             "overflow": draw(st.sampled_from(["backup", "backup", "raise"]))}
        return tw.TwELL, p
    if fmt == "ell":
        return tw.ELL, {"width": draw(st.one_of(st.none(), st.integers(0, 80)))}
    width = draw(st.one_of(st.integers(0, 40), st.sampled_from(
        ["auto", "min_storage", "quantile:0.0", "quantile:0.5", "quantile:0.9", "quantile:1.0", "fixed:3"])))
    return tw.Hybrid, {"width": width}


def _expected_error(x, cls, params):
    """(ValueError class, regex of its message) a valid-looking construction must raise, or None.

    The messages name the argument and the numbers computed here: the slots (width)
    that would suffice and how many rows overflow."""
    nz = (x.astype(np.float64) != 0)
    if cls is tw.TwELL and params["overflow"] == "raise" and x.size:
        t = params["tile"]
        n = x.shape[1]
        pad = (-n) % t
        per_tile = np.pad(nz, ((0, 0), (0, pad))).reshape(x.shape[0], -1, t).sum(-1)
        slots = params["slots"]
        if per_tile.size and per_tile.max() > slots:
            row_max = per_tile.max(1)
            need, n_over = int(row_max.max()), int((row_max > slots).sum())
            return tw.TileOverflowError, (rf"row {int(np.argmax(row_max))}, tile \d+ .* holds {need} non-zeros "
                                          rf"but slots={slots} \({n_over} rows overflow\); pass slots={need} or more")
    if cls is tw.ELL and params["width"] is not None and x.size and nz.sum(1).max() > params["width"]:
        w, row_nnz = params["width"], nz.sum(1)
        return ValueError, (rf"width={w} is too small: {int((row_nnz > w).sum())} rows have more than {w} "
                            rf"non-zeros, the widest has {int(row_nnz.max())}")
    return None


def _device(a, backend):
    """numpy array -> numpy (cpu) or cupy (cuda), 16-bit moved as raw bits."""
    return to_gpu(a) if backend == "cuda" else a


def build(x, cls, params, backend):
    """Container from dense x, or None after checking the expected error was raised."""
    err = _expected_error(x, cls, params)
    xd = _device(x, backend)
    if err is not None:
        with pytest.raises(err[0], match=err[1]):
            cls.from_dense(xd, **params)
        return None
    return cls.from_dense(xd, **params)


def assert_exact(A, x):
    """A holds exactly the dense matrix x (bit patterns, -0 is not stored)."""
    assert A.shape == x.shape and A.dtype == x.dtype
    got = host(A.toarray())
    assert bits_equal(got, x + np.zeros((), x.dtype))  # +0 turns -0.0 into +0.0
    assert A.nnz == int(np.count_nonzero(x.astype(np.float64)))
    A.check_format(full_check=True)


# ---------------------------------------------------------------------------
# containers

@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=matrices(), fmt=formats())
@counted
def test_from_dense_is_exact(backend, data, fmt):
    x, dtype, _ = data
    cls, params = fmt
    A = build(x, cls, params, backend)
    if A is None:
        return
    assert_exact(A, x)
    assert A.device == ("cpu" if backend == "cpu" else "cuda:0")
    ref = sp.csr_array(x.astype(np.float64))
    got = A.to_scipy("csr")
    assert (abs(got.astype(np.float64) - ref)).nnz == 0
    assert got.nnz == ref.nnz


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=matrices(), fmt=formats(), n_dup=st.integers(0, 5))
@counted
def test_from_scipy_with_duplicates_and_zeros(backend, data, fmt, n_dup):
    x, dtype, _ = data
    cls, params = fmt
    m, n = x.shape
    coo = sp.coo_array(x.astype(np.float64))
    rows, cols, vals = list(coo.row), list(coo.col), list(coo.data)
    rng = np.random.default_rng(n_dup)
    zeros = np.argwhere(x.astype(np.float64) == 0)
    if zeros.size:
        # at an empty position: an explicit zero and a pair that cancels exactly
        # (at a stored position v + 0.75 - 0.75 could round, so those are avoided)
        for _ in range(n_dup):
            r, c = (int(v) for v in zeros[int(rng.integers(len(zeros)))])
            rows += [r, r, r]
            cols += [c, c, c]
            vals += [0.0, 0.75, -0.75]
    m_in = sp.coo_array((vals, (rows, cols)), shape=(m, n)).tocsr()
    err = _expected_error(x, cls, params)
    if err is not None:
        with pytest.raises(err[0], match=err[1]):
            cls.from_scipy(m_in, dtype=dtype, **params)
        return
    A = cls.from_scipy(m_in, dtype=dtype, **params)
    if backend == "cuda":
        A = A.to_device("cuda")
    assert_exact(A, x)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=matrices(), fmt=formats(), fmt2=formats())
@counted
def test_components_save_load_asformat(backend, data, fmt, fmt2):
    x, dtype, _ = data
    A = build(x, *fmt, backend)
    if A is None:
        return
    B = type(A).from_components(A.components(), check="full")
    for k in A._array_names:
        a, b = getattr(A, k), getattr(B, k)
        assert (a is None and b is None) or bits_equal(a, b)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.npz")
        tw.save(path, A)
        L = tw.load(path, device="cpu" if backend == "cpu" else "cuda")
    assert L.format == A.format and L._params() == A._params()
    for k in A._array_names:
        assert bits_equal(getattr(A, k), getattr(L, k)), k
    cls2, params2 = fmt2
    err = _expected_error(x, cls2, params2)
    if err is not None:
        with pytest.raises(err[0], match=err[1]):
            A.asformat(cls2.format, **params2)
        return
    C = A.asformat(cls2.format, **params2)
    assert C.format == cls2.format
    assert_exact(C, x)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=matrices(), fmt=formats(), dtype2=st.sampled_from(DTYPES))
@counted
def test_astype_transpose_neg_abs_scale(backend, data, fmt, dtype2):
    x, dtype, _ = data
    A = build(x, *fmt, backend)
    if A is None:
        return
    B = A.astype(dtype2)
    assert B.dtype == dtype2 and B.format == A.format
    got = host(B.toarray()).astype(np.float64)
    assert rel_err(got, x.astype(np.float64)) <= TOL[np.dtype(dtype2)]
    assert (got != 0).sum() == np.count_nonzero(x.astype(np.float64))  # +-[0.5, 2) survives every cast
    B.check_format(full_check=True)
    T = A.T
    assert T.format == A.format
    assert_exact(T, np.ascontiguousarray(x.T))
    assert_exact(-A, -x)
    assert_exact(abs(A), np.abs(x))
    got = host((A * 2).toarray())
    assert bits_equal(got, (x.astype(np.float64) * 2).astype(dtype))  # x2 is exact


def _dense_operand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _product_dtype(a, b):
    """The documented dtype of a product of ``a`` and ``b`` values: equal dtypes stay,
    float64 wins, any other mix gives float32 (written out here, not the library's rule)."""
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    return np.dtype(np.float64) if np.dtype(np.float64) in (a, b) else np.dtype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=matrices(), fmt=formats(), k=st.integers(1, 9), vec=st.booleans(),
       bdtype=st.sampled_from(DTYPES), s=st.integers(0, 2**31))
@counted
def test_matmul_both_sides(backend, data, fmt, k, vec, bdtype, s):
    x, dtype, _ = data
    A = build(x, *fmt, backend)
    if A is None:
        return
    m, n = x.shape
    rng = np.random.default_rng(s)
    b = _dense_operand(rng, (n,) if vec else (n, k), bdtype)
    w = _dense_operand(rng, (m,) if vec else (k, m), bdtype)
    # the inputs are exact in the float64 reference: only the accumulation and the one
    # rounding to the result dtype err, so the tolerance is the result dtype's (the larger
    # of the two input tolerances let a float32 product rounded to bfloat16 pass)
    res = _product_dtype(dtype, bdtype)
    tol = TOL[res]
    y = A @ _device(b, backend)
    assert y.shape == ((m,) if vec else (m, k)) and y.dtype == res
    assert rel_err(f64(y), x.astype(np.float64) @ b.astype(np.float64)) <= tol
    z = rmatmul(_device(w, backend), A)
    assert z.shape == ((n,) if vec else (k, n)) and z.dtype == res
    assert rel_err(f64(z), w.astype(np.float64) @ x.astype(np.float64)) <= tol


# ---------------------------------------------------------------------------
# twellpy.ops

@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=matrices(max_n=300), fmt=formats(), k=st.integers(1, 7), vec=st.booleans(),
       bdtype=st.sampled_from(DTYPES), s=st.integers(0, 2**31))
@counted
def test_ops_spmm_spmm_t_sddmm(backend, data, fmt, k, vec, bdtype, s):
    x, dtype, _ = data
    A = build(x, *fmt, backend)
    if A is None:
        return
    m, n = x.shape
    x64 = x.astype(np.float64)
    rng = np.random.default_rng(s)
    res = _product_dtype(dtype, bdtype)
    tol = TOL[res]  # as in test_matmul_both_sides: the result dtype's tolerance
    b = _dense_operand(rng, (n,) if vec else (n, k), bdtype)
    y = tw.ops.spmm(A, _device(b, backend))
    assert y.shape == ((m,) if vec else (m, k)) and y.dtype == res
    assert rel_err(f64(y), x64 @ b.astype(np.float64)) <= tol
    g = _dense_operand(rng, (m,) if vec else (m, k), bdtype)
    z = tw.ops.spmm_t(A, _device(g, backend))
    assert z.shape == ((n,) if vec else (n, k)) and z.dtype == res
    assert rel_err(f64(z), x64.T @ g.astype(np.float64)) <= tol
    X = _dense_operand(rng, (m, k), bdtype)
    Y = _dense_operand(rng, (n, k), bdtype)
    P = tw.ops.sddmm(_device(X, backend), _device(Y, backend), A)
    assert P.format == A.format and P.shape == A.shape and P.dtype == bdtype  # the dtype of X and Y
    want = np.where(x64 != 0, X.astype(np.float64) @ Y.astype(np.float64).T, 0.0)
    assert rel_err(f64(P.toarray()), want) <= TOL[np.dtype(bdtype)] * 2
    for k2 in A._array_names:  # sddmm keeps the pattern arrays
        if k2 not in ("values", "backup"):
            assert bits_equal(getattr(A, k2), getattr(P, k2))


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=matrices(max_n=300), fmt=formats(), width=st.one_of(st.integers(0, 20), st.sampled_from(
    ["auto", "min_storage", "quantile:0.5"])), s=st.integers(0, 2**31))
@counted
def test_ops_transpose_and_multiply(backend, data, fmt, width, s):
    x, dtype, _ = data
    A = build(x, *fmt, backend)
    if A is None:
        return
    T = tw.ops.transpose(A, width=width)
    assert T.format == "hybrid"
    assert_exact(T, np.ascontiguousarray(x.T))
    if dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        C = tw.ops.transpose(A, format="csr")
        C = C.get() if backend == "cuda" else C
        assert C.shape == x.T.shape and C.has_sorted_indices
        assert (abs(sp.csr_array(C) - sp.csr_array(x.T.astype(np.float64)))).nnz == 0
    else:
        with pytest.raises(TypeError, match="format='csr'"):
            tw.ops.transpose(A, format="csr")
    rng = np.random.default_rng(s)
    # a second container with A's exact pattern and other non-zero values
    factors = rng.uniform(0.5, 2.0, A.values.shape).astype(dtype)
    new_vals = _device((f64(A.values) * factors).astype(dtype), backend)
    new_bk = None
    if A.backup is not None:
        bf = rng.uniform(0.5, 2.0, A.backup.shape).astype(dtype)
        new_bk = _device((f64(A.backup) * bf).astype(dtype), backend)
    B = A.with_values(new_vals, new_bk)
    P = tw.ops.multiply(A, B)
    assert P.format == A.format
    assert rel_err(f64(P.toarray()), x.astype(np.float64) * f64(B.toarray())) <= TOL[np.dtype(dtype)]
    for k2 in A._array_names:
        if k2 not in ("values", "backup"):
            assert bits_equal(getattr(A, k2), getattr(P, k2))


# ---------------------------------------------------------------------------
# twellpy.ffn

@st.composite
def ffn_problems(draw, max_m=70):
    m = draw(st.sampled_from([0, 1, None, None, None, None]))
    m = draw(st.integers(2, max_m)) if m is None else m
    d = draw(st.integers(1, 24))
    h = draw(st.sampled_from([1, None, None, None, None]))
    h = draw(st.integers(2, 300)) if h is None else h
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # gate bias column: most neurons silent, some tokens fire many (hot rows)
    x = rng.standard_normal((m, d))
    if d > 1:
        x[:, 0] = 1.0
        hot = rng.random(m) < 0.1
        x[hot, 0] = -4.0
    wg = rng.standard_normal((h, d)) / np.sqrt(d)
    if d > 1:
        wg[:, 0] = -abs(rng.normal(1.0, 0.5, h))
    wu = rng.standard_normal((h, d)) / np.sqrt(d)
    wd = rng.standard_normal((d, h)) / np.sqrt(h)
    dy = rng.standard_normal((m, d))
    return tuple(a.astype(dtype) for a in (x, wg, wu, wd, dy)) + (dtype,)


def _ffn_ref(x, wg, wu, wd, gated):
    x, wu, wd = f64(x), f64(wu), f64(wd)
    z = x @ (f64(wg) if gated else wu).T
    h = np.where(z > 0, z, 0.0)
    if gated:
        h = h * (x @ wu.T)
    return h @ wd.T, h


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(prob=ffn_problems(), gated=st.booleans(), mode=st.sampled_from(["auto", "sparse", "dense"]),
       tile=st.sampled_from([1, 16, 64, 256]), slots=st.sampled_from([1, 4, 32]))
@counted
def test_ffn_inference(backend, prob, gated, mode, tile, slots):
    x, wg, wu, wd, _, dtype = prob
    dev = [_device(a, backend) for a in (x, wg, wu, wd)]
    if gated:
        y, h = tw.ffn.gated_forward(*dev, mode=mode, tile=tile, slots=slots, return_activations=True)
    else:
        y, h = tw.ffn.relu_forward(dev[0], dev[2], dev[3], mode=mode, tile=tile, slots=slots,
                                   return_activations=True)
    y_ref, h_ref = _ffn_ref(x, wg, wu, wd, gated)
    assert y.shape == y_ref.shape and y.dtype == dtype
    tol = TOL[np.dtype(dtype)] * 2
    assert rel_err(f64(y), y_ref) <= tol
    assert h.format == "twell" and h.shape == h_ref.shape and h.tile == tile
    h.check_format(full_check=True, check_finite=False)
    assert rel_err(f64(h.toarray()), h_ref) <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(prob=ffn_problems(max_m=50), gated=st.booleans(), l1=st.sampled_from([0.0, 1e-3, 0.5]),
       width=st.one_of(st.integers(0, 12), st.sampled_from(["auto", "min_storage", "quantile:0.5",
                                                             "fixed:2"])))
@counted
def test_ffn_train_forward_backward(backend, prob, gated, l1, width):
    x, wg, wu, wd, dy, dtype = prob
    d = {k: _device(a, backend) for k, a in zip(("x", "wg", "wu", "wd", "dy"), (x, wg, wu, wd, dy))}
    tol = TOL[np.dtype(dtype)] * 3
    if gated:
        y, ctx = tw.ffn.gated_forward_train(d["x"], d["wg"], d["wu"], d["wd"], l1=l1, width=width)
        grads = tw.ffn.gated_backward(ctx, d["dy"])
        ref = dense_gated(x, wg, wu, wd, dy, l1)
        names = ("dx", "dw_gate", "dw_up", "dw_down")
    else:
        y, ctx = tw.ffn.relu_forward_train(d["x"], d["wu"], d["wd"], l1=l1, width=width)
        grads = tw.ffn.relu_backward(ctx, d["dy"])
        ref = dense_relu(x, wu, wd, dy, l1)
        names = ("dx", "dw_up", "dw_down")
    assert y.dtype == dtype and rel_err(f64(y), ref["y"]) <= tol
    for name, gval in zip(names, grads):
        assert gval.dtype == dtype and gval.shape == ref[name].shape, name
        assert rel_err(f64(gval), ref[name]) <= tol, name
    # the saved context is lossless: h on its pattern, backup rows included
    h_ref = dense_h(x, wg, wu, gated)
    assert rel_err(f64(ctx.h.toarray()), h_ref) <= tol
    assert ctx.h.n_backup == int(ctx.stats["n_backup_rows"])


def dense_h(x, wg, wu, gated):
    return _ffn_ref(x, wg, wu, wu.T, gated)[1]
