"""GPU tests of the CUDA container backend (``twellpy/backends/cuda.py``).

Every kernel is checked against the Numba CPU backend (bit for bit where the
operation only moves values: construction, conversion, transposition, casts)
and against an independent float64 reference (products). Outputs are poisoned
(every buffer the backend allocates starts as NaN / 0x7b7b7b7b) so a kernel
that forgets to write a slot fails. Inputs come fresh from a seeded generator
per test. Run with ``pytest -m gpu tests/test_gpu_containers.py``.
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import scipy.sparse as sp

from conftest import DTYPES, GPU_COUNT, HAS_GPU, RTOL, rel_err
from makers import MAKERS, SMALL_MAKERS, random_sparse
from twellpy._array import bfloat16
from twellpy.backends import cpu

pytestmark = pytest.mark.gpu

if HAS_GPU:  # pragma: no branch - the module is skipped without a GPU
    import cupy as cp

    from twellpy.backends import cuda

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Under compute-sanitizer (TWELLPY_SANITIZE=1) the largest cases shrink.
SANITIZE = os.environ.get("TWELLPY_SANITIZE") == "1"
TWELL_PARAMS = [(256, 32), (64, 4), (100, 7), (8, 1)]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def to_gpu(a):
    """numpy -> cupy, moving bytes (independent of CuPy's bfloat16 support)."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "f" or a.dtype == bfloat16:
        return cp.asarray(a.view(_UINT[a.itemsize])).view(a.dtype)
    return cp.asarray(a)


def to_cpu(a):
    """cupy -> numpy, moving bytes."""
    if a.dtype.kind == "f" or a.dtype == bfloat16:
        return cp.asnumpy(a.view(_UINT[a.dtype.itemsize])).view(a.dtype)
    return cp.asnumpy(a)


def bits(a):
    a = to_cpu(a) if not isinstance(a, np.ndarray) else a
    if a.dtype.kind == "f" or a.dtype == bfloat16:
        return a.view(_UINT[a.dtype.itemsize])
    return a


def assert_same_bits(got, want, what):
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
    if not np.array_equal(g, w):
        bad = np.argwhere(g != w)
        raise AssertionError(f"{what}: {len(bad)} elements differ, first at {tuple(bad[0])}: "
                             f"{g[tuple(bad[0])]} != {w[tuple(bad[0])]}")


def make(maker, dtype, seed):
    """A maker's dense matrix in ``dtype`` (host) and on the GPU."""
    x = maker(np.random.default_rng(seed)).astype(dtype)
    return x, to_gpu(x)


def misaligned_copy(x_gpu):
    """Same values, C-contiguous, but the base pointer is off 16-byte alignment."""
    flat = cp.empty(x_gpu.size + 1, x_gpu.dtype)
    out = flat[1:].reshape(x_gpu.shape)
    if x_gpu.size:
        out.data.copy_from_device_async(x_gpu.data, x_gpu.nbytes)
    assert out.data.ptr % 16 != 0
    return out


def nonzero_mask(x):
    """Bitwise non-zero test (-0.0 is zero, NaN is non-zero)."""
    b = bits(x)
    return (b & ~_UINT[x.dtype.itemsize](0) >> 1) != 0


def ref_twell(x, tile, slots):
    """Independent host reference for dense -> TwELL."""
    m, n = x.shape
    n_tiles = -(-n // tile) if n else 0
    vals = np.zeros((m, n_tiles, slots), x.dtype)
    idx = np.full((m, n_tiles, slots), -1, np.int32)
    counts = np.zeros((m, n_tiles), np.int32)
    row_max = np.zeros(m, np.int32)
    nz = nonzero_mask(x)
    for i in range(m):
        for t in range(n_tiles):
            cols = np.flatnonzero(nz[i, t * tile:(t + 1) * tile]) + t * tile
            k = min(len(cols), slots)
            vals[i, t, :k] = x[i, cols[:k]]
            idx[i, t, :k] = cols[:k]
            counts[i, t] = k
            row_max[i] = max(row_max[i], len(cols))
    return vals, idx, counts, row_max


def spmm_ref(a_dense, b):
    return a_dense.astype(np.float64) @ b.astype(np.float64)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every array the backend allocates starts as garbage (NaN for floats)."""
    real = cuda._alloc

    def poisoned(shape, dtype):
        a = real(shape, dtype)
        if a.nbytes:
            kind = np.dtype(dtype).kind
            a.data.memset_async(0xFF if kind == "f" or np.dtype(dtype) == bfloat16 else 0x7B, a.nbytes)
        return a

    monkeypatch.setattr(cuda, "_alloc", poisoned)


# ---------------------------------------------------------------------------
# construction from dense
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tile,slots", TWELL_PARAMS)
def test_construct_dense_to_twell_matches_cpu_and_reference(maker, dtype, tile, slots):
    x, xg = make(MAKERS[maker], dtype, seed=zlib.crc32(f"{maker}-{dtype}-{tile}".encode()))
    got = cuda.dense_to_twell(xg, tile, slots)
    want = cpu.dense_to_twell(x, tile, slots)
    names = ("values", "indices", "counts", "row_max_count")
    for g, w, name in zip(got, want, names):
        assert_same_bits(g, w, name)
    if x.shape[1] <= 2000:
        for g, w, name in zip(got, ref_twell(x, tile, slots), names):
            assert_same_bits(g, w, name + " (reference)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tiles_per_warp", [1, 3, 8, 1000])
def test_construct_dense_to_twell_vector_and_scalar_paths(dtype, tiles_per_warp, monkeypatch):
    """Aligned (16-byte loads) and misaligned (scalar) inputs, any warp split of a row."""
    monkeypatch.setattr(cuda, "CONSTRUCT_TILES_PER_WARP", tiles_per_warp)
    rng = np.random.default_rng(7)
    x = random_sparse(rng, 37, 2000, 45).astype(dtype)
    x[5, :300] = 1.5  # one row over capacity in two tiles
    x[6, 1999] = -2.0
    xg = to_gpu(x)
    want = cpu.dense_to_twell(x, 256, 32)
    for src in (xg, misaligned_copy(xg)):
        got = cuda.dense_to_twell(src, 256, 32)
        for g, w, name in zip(got, want, ("values", "indices", "counts", "row_max_count")):
            assert_same_bits(g, w, name)
    assert int(want[3][5]) == 256


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tiles_per_warp", [1, 3, 1000])
@pytest.mark.parametrize("variant", ["registers", "prefetch", "async-ring", "unroll3-prefetch",
                                     "unroll1-fast-prefix", "async-ring-2", "async-ring-12-6blocks"])
def test_construct_loop_variants_give_the_same_bits(dtype, tiles_per_warp, variant, monkeypatch):
    """The construction loop variants benchmarks/kernels.py sweeps (prefetch of the
    next chunks, the cp.async ring, the two-ballot prefix) write the same slots
    and flags as numpy, from aligned (ring) and misaligned (scalar) inputs."""
    extra = {"unroll3-prefetch": {"CONSTRUCT_UNROLL": 3, "CONSTRUCT_PREFETCH": 1, "CONSTRUCT_ASYNC_DEPTH": 0,
                                  "CONSTRUCT_FAST_PREFIX": 0},
             "unroll1-fast-prefix": {"CONSTRUCT_UNROLL": 1, "CONSTRUCT_ASYNC_DEPTH": 0},
             "async-ring-2": {"CONSTRUCT_ASYNC_DEPTH": 2, "CONSTRUCT_FAST_PREFIX": 0},  # ring + warp-scan prefix
             "async-ring-12-6blocks": {"CONSTRUCT_ASYNC_DEPTH": 12, "CONSTRUCT_MIN_BLOCKS": 6,
                                       "CONSTRUCT_FAST_PREFIX": 1}}
    defines = cuda.CONSTRUCT_VARIANTS.get(variant) or extra[variant]
    monkeypatch.setattr(cuda, "CONSTRUCT_TILES_PER_WARP", tiles_per_warp)
    monkeypatch.setattr(cuda, "CONSTRUCT_DEFINES", dict(defines))
    rng = np.random.default_rng(zlib.crc32(f"{variant}-{dtype}-{tiles_per_warp}".encode()))
    x = random_sparse(rng, 41, 2056, 20).astype(dtype)
    x[0] = 0                                                # an empty row
    x[5, :300] = 1.5                                        # tiles over capacity, one bit per lane and more
    x[6] = rng.standard_normal(2056).astype(dtype)          # a full row
    x[7, 2055] = -2.0                                       # the last column
    want = cpu.dense_to_twell(x, 256, 32)
    xg = to_gpu(x)
    for src in (xg, misaligned_copy(xg)):
        *got, finite = cuda.dense_to_twell_finite(src, 256, 32)
        assert finite is True
        for g, w, name in zip(got, want, ("values", "indices", "counts", "row_max_count")):
            assert_same_bits(g, w, name)
    x[40, 2000] = np.nan                                    # in the last row's last group of chunks
    *got, finite = cuda.dense_to_twell_finite(to_gpu(x), 256, 32)
    assert finite is False
    for g, w, name in zip(got, cpu.dense_to_twell(x, 256, 32), ("values", "indices", "counts", "row_max_count")):
        assert_same_bits(g, w, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_construct_dense_to_twell_special_values(dtype):
    """-0.0 is zero; NaN, Inf and subnormals are non-zero and kept bit-exactly."""
    x = np.zeros((3, 300), dtype)
    tiny = np.finfo(dtype).smallest_subnormal if dtype != bfloat16 else bfloat16.type(2.0**-133)
    x[0, 3] = -0.0
    x[0, 4] = np.nan
    x[1, 255] = np.inf
    x[1, 256] = -np.inf
    x[2, 10] = tiny
    x[2, 299] = -tiny
    xg = to_gpu(x)
    got = cuda.dense_to_twell(xg, 256, 32)
    want = cpu.dense_to_twell(x, 256, 32)
    for g, w, name in zip(got, want, ("values", "indices", "counts", "row_max_count")):
        assert_same_bits(g, w, name)
    assert to_cpu(got[2]).tolist() == [[1, 0], [1, 1], [1, 1]]
    assert_same_bits(cuda.dense_row_nnz(xg), np.array([1, 2, 2], np.int32), "row_nnz")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_construct_finiteness_check_fused_into_the_pass(dtype):
    rng = np.random.default_rng(59)
    x = random_sparse(rng, 40, 1000, 20).astype(dtype)
    x[3, 17] = 60000.0 if dtype == np.float16 else 1e30  # large but finite
    xg = to_gpu(x)
    *built, finite = cuda.dense_to_twell_finite(xg, 256, 32)
    assert finite is True
    for g, w, name in zip(built, cpu.dense_to_twell(x, 256, 32), ("values", "indices", "counts", "row_max")):
        assert_same_bits(g, w, name)
    row_nnz, finite = cuda.dense_row_nnz_finite(xg)
    assert finite is True
    assert_same_bits(row_nnz, cpu.dense_row_nnz(x), "row_nnz")
    assert cuda.all_finite(xg) is True and cuda.all_finite(xg.reshape(-1)) is True
    for bad in (np.nan, np.inf, -np.inf):
        for r, c in ((39, 999), (0, 0), (20, 512)):
            y = x.copy()
            y[r, c] = bad
            yg = to_gpu(y)
            assert cuda.dense_to_twell_finite(yg, 256, 32)[4] is False, (bad, r, c)
            assert cuda.dense_row_nnz_finite(yg)[1] is False, (bad, r, c)
            assert cuda.all_finite(yg) is False
            assert cuda.all_finite(yg.reshape(-1)) is False  # 1-D: 8192-wide rows plus a tail
            assert cpu.all_finite(y) is False


@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_construct_dense_row_nnz_and_dense_to_ell(maker, dtype):
    x, xg = make(MAKERS[maker], dtype, seed=11)
    row_nnz = cuda.dense_row_nnz(xg)
    assert_same_bits(row_nnz, cpu.dense_row_nnz(x), "row_nnz")
    rn = to_cpu(row_nnz)
    widest = int(rn.max()) if rn.size else 0
    for width in sorted({0, 1, max(widest // 2, 1), widest, widest + 3}):
        for src in (xg, misaligned_copy(xg)):
            got = cuda.dense_to_ell(src, width, row_nnz)
            want = cpu.dense_to_ell(x, width, rn)
            assert_same_bits(got[0], want[0], f"values width={width}")
            assert_same_bits(got[1], want[1], f"indices width={width}")


# ---------------------------------------------------------------------------
# construction from CSR
# ---------------------------------------------------------------------------
def host_csr(x):
    m = sp.csr_array(x.astype(np.float64))
    m.sort_indices()
    return m.indptr.astype(np.int32), m.indices.astype(np.int32), m.data.astype(x.dtype)


@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_construct_csr_to_twell_and_ell(maker, dtype):
    x, _ = make(MAKERS[maker], dtype, seed=13)
    indptr, cols, data = host_csr(x)
    g_args = (to_gpu(indptr), to_gpu(cols), to_gpu(data))
    for tile, slots in TWELL_PARAMS[:3]:
        got = cuda.csr_to_twell(*g_args, x.shape[1], tile, slots)
        want = cpu.csr_to_twell(indptr, cols, data, x.shape[1], tile, slots)
        for g, w, name in zip(got, want, ("values", "indices", "counts", "row_max_count")):
            assert_same_bits(g, w, f"{name} T={tile} S={slots}")
        # same result as the dense path
        for g, w in zip(got, cuda.dense_to_twell(to_gpu(x), tile, slots)):
            assert_same_bits(g, w, "csr vs dense construction")
    widest = int(np.diff(indptr).max()) if x.shape[0] else 0
    for width in sorted({0, max(widest - 1, 0), widest}):
        got = cuda.csr_to_ell(*g_args, width)
        want = cpu.csr_to_ell(indptr, cols, data, width)
        for g, w, name in zip(got, want, ("values", "indices", "row_nnz")):
            assert_same_bits(g, w, f"{name} width={width}")


def test_construct_csr_to_twell_long_rows_cross_chunks():
    """Rows longer than a warp chunk with a tile that spans chunk boundaries."""
    x = np.zeros((4, 1024), np.float32)
    x[0, :] = 1.0                       # 1024 entries, every tile over capacity
    x[1, 200:300] = 2.0                 # tile 0 / tile 1 split inside one chunk
    x[2, ::3] = -1.0
    x[3, 255] = 3.0
    indptr, cols, data = host_csr(x)
    got = cuda.csr_to_twell(to_gpu(indptr), to_gpu(cols), to_gpu(data), 1024, 256, 40)
    want = cpu.csr_to_twell(indptr, cols, data, 1024, 256, 40)
    for g, w, name in zip(got, want, ("values", "indices", "counts", "row_max_count")):
        assert_same_bits(g, w, name)
    assert to_cpu(got[3]).tolist() == [256, 56, 86, 1]


BAD_COLUMNS = {
    "unsorted": [0, 5, 2, 1],
    "duplicate": [0, 0, 1, 1],
    "negative": [-1, 1, 2, 3],
}


@pytest.mark.parametrize("case", list(BAD_COLUMNS))
def test_construct_csr_bad_columns_raise(case):
    indptr = to_gpu(np.array([0, 3, 4], np.int32))
    data = to_gpu(np.ones(4, np.float32))
    cols = to_gpu(np.array(BAD_COLUMNS[case], np.int32))
    with pytest.raises(ValueError, match="strictly increasing"):
        cuda.csr_to_twell(indptr, cols, data, 600, 256, 32)
    with pytest.raises(ValueError, match="strictly increasing"):
        cuda.csr_to_ell(indptr, cols, data, 4)


def test_construct_csr_column_out_of_range_raises():
    indptr = to_gpu(np.array([0, 3, 4], np.int32))
    data = to_gpu(np.ones(4, np.float32))
    cols = to_gpu(np.array([0, 1, 2, 700], np.int32))
    with pytest.raises(ValueError, match=r"outside \[0, n_cols\)"):
        cuda.csr_to_twell(indptr, cols, data, 600, 256, 32)


# ---------------------------------------------------------------------------
# slot lists back to dense / CSR
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_slots_to_dense_and_csr(maker, dtype):
    x, xg = make(MAKERS[maker], dtype, seed=17)
    m, n = x.shape
    vals, idx, counts, row_max = cuda.dense_to_twell(xg, 256, 32)
    k = vals.shape[1] * vals.shape[2] if vals.ndim == 3 else 0
    v2, i2 = vals.reshape(m, k), idx.reshape(m, k)
    dense = cuda.slots_to_dense(v2, i2, n)
    assert_same_bits(dense, cpu.slots_to_dense(to_cpu(v2), to_cpu(i2), n), "slots_to_dense")
    fits = to_cpu(row_max) <= 32
    assert_same_bits(to_cpu(dense)[fits], x[fits], "round trip of rows that fit")
    row_counts = counts.sum(axis=1, dtype=np.int32) if counts.size else cp.zeros(m, np.int32)
    got = cuda.slots_to_csr(v2, i2, row_counts)
    want = cpu.slots_to_csr(to_cpu(v2), to_cpu(i2), to_cpu(row_counts))
    for g, w, name in zip(got, want, ("indptr", "col", "data")):
        assert_same_bits(g, w, name)
    # ELL path
    rn = cuda.dense_row_nnz(xg)
    width = int(rn.max()) if m else 0
    ev, ei = cuda.dense_to_ell(xg, width, rn)
    assert_same_bits(cuda.slots_to_dense(ev, ei, n), x, "ELL round trip")
    csr = cuda.slots_to_csr(ev, ei, rn)
    ref = sp.csr_array(x.astype(np.float64))
    ref.sort_indices()
    assert_same_bits(csr[0], ref.indptr.astype(np.int32), "ELL indptr")
    assert_same_bits(csr[1], ref.indices.astype(np.int32), "ELL col")
    assert_same_bits(csr[2], ref.data.astype(dtype), "ELL data")


def test_slots_to_csr_inconsistent_counts_raise():
    vals = to_gpu(np.ones((2, 4), np.float32))
    idx = to_gpu(np.array([[0, 1, -1, -1], [2, -1, -1, -1]], np.int32))
    with pytest.raises(ValueError, match="row_counts"):
        cuda.slots_to_csr(vals, idx, to_gpu(np.array([2, 2], np.int32)))


# ---------------------------------------------------------------------------
# transpose
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transpose_slots_matches_cpu(maker, dtype):
    x, xg = make(MAKERS[maker], dtype, seed=19)
    m, n = x.shape
    vals, idx, _, _ = cuda.dense_to_twell(xg, 64, 64)  # S = T: never over capacity
    k = vals.shape[1] * vals.shape[2] if vals.ndim == 3 else 0
    v2, i2 = vals.reshape(m, k), idx.reshape(m, k)
    got = cuda.transpose_slots(v2, i2, n)
    want = cpu.transpose_slots(to_cpu(v2), to_cpu(i2), n)
    for g, w, name in zip(got, want, ("indptr", "col", "data")):
        assert_same_bits(g, w, name)
    ref = sp.csr_array(x.astype(np.float64).T)
    ref.sort_indices()
    assert_same_bits(got[0], ref.indptr.astype(np.int32), "indptr vs scipy")
    assert_same_bits(got[1], ref.indices.astype(np.int32), "col vs scipy")


def slot_lists_from_columns(rng, raw_cols, dtype):
    """Sorted unique columns per row, duplicates turned into padding at the back."""
    cols = np.sort(raw_cols, axis=1)
    dup = np.zeros_like(cols, bool)
    dup[:, 1:] = cols[:, 1:] == cols[:, :-1]
    cols = np.where(dup, -1, cols)
    order = np.argsort(cols < 0, axis=1, kind="stable")
    cols = np.take_along_axis(cols, order, axis=1).astype(np.int32)
    vals = rng.uniform(0.5, 2.0, cols.shape) * rng.choice([-1.0, 1.0], cols.shape)
    return np.where(cols >= 0, vals, 0.0).astype(dtype), cols


@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_transpose_large_m_and_wide_n(dtype):
    """M >= 131072 and N > 65535, with a popular column hit by every row."""
    rng = np.random.default_rng(23)
    m, n, k = (131072, 70000, 8) if not SANITIZE else (131072, 70000, 2)
    raw = rng.integers(0, n - 1, size=(m, k))
    raw[:, 0] = n - 1  # the hot column
    vals, cols = slot_lists_from_columns(rng, raw, dtype)
    got = cuda.transpose_slots(to_gpu(vals), to_gpu(cols), n)
    want = cpu.transpose_slots(vals, cols, n)
    for g, w, name in zip(got, want, ("indptr", "col", "data")):
        assert_same_bits(g, w, name)
    indptr = to_cpu(got[0])
    assert int(indptr[-1] - indptr[-2]) == m
    ref = sp.csr_array((vals[cols >= 0].astype(np.float64),
                        (np.repeat(np.arange(m), (cols >= 0).sum(axis=1)), cols[cols >= 0])),
                       shape=(m, n)).T.tocsr()
    ref.sort_indices()
    assert_same_bits(got[1], ref.indices.astype(np.int32), "col vs scipy")


# ---------------------------------------------------------------------------
# products
# ---------------------------------------------------------------------------
K_COLS = [1, 5, 64, 300, 2048, 2056]


@pytest.mark.parametrize("maker", list(SMALL_MAKERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k_cols", K_COLS)
def test_spmm_kernels_against_float64(maker, dtype, k_cols):
    x, xg = make(MAKERS[maker], dtype, seed=29)
    m, n = x.shape
    rng = np.random.default_rng(31)
    b = rng.standard_normal((n, k_cols)).astype(dtype)
    bg = to_gpu(b)
    vals, idx, counts, _ = cuda.dense_to_twell(xg, 256, 32)
    kk = vals.shape[1] * vals.shape[2] if vals.ndim == 3 else 0
    v2, i2 = vals.reshape(m, kk), idx.reshape(m, kk)
    a_stored = cpu.slots_to_dense(to_cpu(v2), to_cpu(i2), n)  # what the slots hold
    ref = spmm_ref(a_stored, b)
    tol = RTOL[np.dtype(dtype)]
    for name, out in (("twell_spmm", cuda.twell_spmm(vals, idx, counts, bg)),
                      ("slots_spmm", cuda.slots_spmm(v2, i2, bg))):
        assert out.dtype == dtype and out.shape == (m, k_cols), name
        assert rel_err(to_cpu(out), ref) <= tol, name
        cpu_out = cpu.slots_spmm(to_cpu(v2), to_cpu(i2), b)
        assert rel_err(to_cpu(out), cpu_out.astype(np.float64)) <= tol, name + " vs cpu"
    # A.T @ G
    g = rng.standard_normal((m, k_cols)).astype(dtype)
    out_t = cuda.slots_spmm_t(v2, i2, to_gpu(g), n)
    assert out_t.dtype == dtype and out_t.shape == (n, k_cols)
    assert rel_err(to_cpu(out_t), a_stored.astype(np.float64).T @ g.astype(np.float64)) <= tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_spmm_misaligned_and_strided_b(dtype):
    rng = np.random.default_rng(37)
    x = random_sparse(rng, 33, 700, 20).astype(dtype)
    b_big = rng.standard_normal((700, 130)).astype(dtype)
    xg = to_gpu(x)
    vals, idx, counts, _ = cuda.dense_to_twell(xg, 256, 32)
    ref = spmm_ref(x, b_big[:, 1:129])
    bg = to_gpu(b_big)[:, 1:129]          # non-contiguous view: copied
    b_mis = misaligned_copy(to_gpu(np.ascontiguousarray(b_big[:, 1:129])))  # scalar path
    for b in (bg, b_mis):
        out = cuda.twell_spmm(vals, idx, counts, b)
        assert rel_err(to_cpu(out), ref) <= RTOL[np.dtype(dtype)]


@pytest.mark.parametrize("a_dtype,b_dtype,res", [
    (bfloat16, np.dtype(np.float32), np.dtype(np.float32)),
    (np.dtype(np.float16), bfloat16, np.dtype(np.float32)),
    (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float64)),
], ids=str)
def test_spmm_mixed_dtypes_promote_like_cpu(a_dtype, b_dtype, res):
    rng = np.random.default_rng(41)
    x = random_sparse(rng, 20, 300, 10).astype(a_dtype)
    b = rng.standard_normal((300, 17)).astype(b_dtype)
    vals, idx, counts, _ = cuda.dense_to_twell(to_gpu(x), 256, 32)
    out = cuda.twell_spmm(vals, idx, counts, to_gpu(b))
    cpu_out = cpu.slots_spmm(to_cpu(vals).reshape(20, -1), to_cpu(idx).reshape(20, -1), b)
    assert out.dtype == res == cpu_out.dtype
    assert rel_err(to_cpu(out), spmm_ref(x, b)) <= RTOL[res]


def test_spmm_w1_shape_bf16():
    """W1-16k-like rows (5632 columns, 30 non-zeros) times a 5632 x 2048 bf16 weight."""
    rng = np.random.default_rng(43)
    x = random_sparse(rng, 64 if SANITIZE else 512, 5632, 30).astype(bfloat16)
    w = (rng.standard_normal((5632, 2048)) / np.sqrt(5632)).astype(bfloat16)
    vals, idx, counts, row_max = cuda.dense_to_twell(to_gpu(x), 256, 32)
    assert int(row_max.max()) <= 32
    wg = to_gpu(w)
    out = cuda.twell_spmm(vals, idx, counts, wg)
    ref = sp.csr_array(x.astype(np.float64)) @ w.astype(np.float64)
    assert rel_err(to_cpu(out), ref) <= RTOL[bfloat16]
    # the fp32 accumulator rounds once: close to the bf16 rounding of the reference
    assert rel_err(to_cpu(out), ref.astype(bfloat16)) <= 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strips", [1, 2])
def test_twell_spmm_row_block_rounds_and_wide_rows(dtype, strips):
    """The row-block kernel on rows longer than its shared-memory list (several
    rounds), with more tiles than threads (chunked tile scans, N > 65535), empty
    rows, and one or two strips per thread (the second output width leaves a
    partial column block); against float64 and bit-equal to the warp-per-row
    kernel (same summation order)."""
    rng = np.random.default_rng(zlib.crc32(f"{dtype}-{strips}".encode()))
    vec = 16 // np.dtype(dtype).itemsize
    k_cols = cuda.SPMM_ROWS_THREADS * vec * strips + (vec if strips == 2 else 0)
    n = 70000 if not SANITIZE else 33000  # 274 (129) tiles of 256: more than 128 threads
    m = 7
    x = np.zeros((m, n), dtype)
    x[0] = rng.standard_normal(n)                            # full row: every tile at capacity
    x[2, rng.choice(n, 1500, replace=False)] = rng.standard_normal(1500)  # more than one list
    x[4, n - 1] = 1.0                                        # the last column only
    x[6, rng.choice(n, 30, replace=False)] = rng.standard_normal(30)
    b = (rng.standard_normal((n, k_cols), dtype=np.float32) / np.float32(np.sqrt(n))).astype(dtype)
    bg = to_gpu(b)
    vals, idx, counts, row_max = cuda.dense_to_twell(to_gpu(x), 256, 32)
    plan = cuda._spmm_rows_plan(k_cols, np.dtype(dtype), bg, bg)
    assert plan is not None and plan[1] == strips  # the kernel and strip count this test is for
    a_stored = cpu.slots_to_dense(to_cpu(vals).reshape(m, -1), to_cpu(idx).reshape(m, -1), n)
    ref = sp.csr_array(a_stored.astype(np.float64)) @ b.astype(np.float64)
    out = cuda.twell_spmm(vals, idx, counts, bg)
    assert out.dtype == dtype and out.shape == (m, k_cols)
    got = to_cpu(out).astype(np.float64)
    assert rel_err(got, ref) <= RTOL[np.dtype(dtype)]
    assert not np.any(got[[1, 3, 5]]), "empty rows must be exact zeros (outputs start poisoned)"
    old = cuda.SPMM_ROW_BLOCK
    try:
        cuda.SPMM_ROW_BLOCK = False
        warp_out = cuda.twell_spmm(vals, idx, counts, bg)
    finally:
        cuda.SPMM_ROW_BLOCK = old
    assert_same_bits(out, warp_out, "row-block vs warp-per-row twell_spmm")


@pytest.mark.parametrize("threads,inflight,min_blocks", [(128, 16, 3), (128, 8, 5), (256, 8, 2), (64, 4, 8)])
def test_twell_spmm_row_block_tunings(threads, inflight, min_blocks, monkeypatch):
    """Every tuning the benchmark sweeps computes the same bits."""
    rng = np.random.default_rng(53)
    x = random_sparse(rng, 37, 5632, 40).astype(bfloat16)
    x[5] = rng.standard_normal(5632)  # a hot row: every tile over capacity
    w = (rng.standard_normal((5632, 2048)) / np.sqrt(5632)).astype(bfloat16)
    vals, idx, counts, _ = cuda.dense_to_twell(to_gpu(x), 256, 32)
    wg = to_gpu(w)
    base = cuda.twell_spmm(vals, idx, counts, wg)
    monkeypatch.setattr(cuda, "SPMM_ROWS_THREADS", threads)
    monkeypatch.setattr(cuda, "SPMM_ROWS_INFLIGHT", inflight)
    # SPMM_ROWS_THREADS reaches the kernel from the module constant (cuda._spmm_rows_defines)
    monkeypatch.setattr(cuda, "SPMM_DEFINES", {"SPMM_ROWS_MIN_BLOCKS": min_blocks})
    tuned = cuda.twell_spmm(vals, idx, counts, wg)
    assert_same_bits(tuned, base, f"twell_spmm with {threads} threads, {inflight} loads, {min_blocks} blocks")
    a_stored = cpu.slots_to_dense(to_cpu(vals).reshape(37, -1), to_cpu(idx).reshape(37, -1), 5632)
    assert rel_err(to_cpu(tuned), spmm_ref(a_stored, w)) <= RTOL[bfloat16]


# ---------------------------------------------------------------------------
# resident-slice SpMM (raw_kernels/spmm_resident.cu)
# ---------------------------------------------------------------------------
def _twell_spmm_with(resident, vals, idx, counts, b, expect_resident=None):
    """twell_spmm with SPMM_RESIDENT set; ``expect_resident`` (bool) asserts which kernel ran."""
    old, launch = cuda.SPMM_RESIDENT, cuda._resident_spmm
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return launch(*a, **k)

    try:
        cuda.SPMM_RESIDENT, cuda._resident_spmm = resident, counted
        out = cuda.twell_spmm(vals, idx, counts, b)
    finally:
        cuda.SPMM_RESIDENT, cuda._resident_spmm = old, launch
    if expect_resident is not None:
        assert bool(calls) == expect_resident, f"resident kernel {'not ' if expect_resident else ''}expected"
    return out


# N = 70000 ("wide"): B is only built for narrow K (its slice never fits, so K <= 64 covers the fallback)
_RESIDENT_CASES = [(mk, k) for mk in MAKERS for k in (8, 24, 64, 300, 2056) if mk != "wide" or k <= 64]


@pytest.mark.parametrize("maker,k_cols", _RESIDENT_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_resident_spmm_same_bits_as_gather(maker, dtype, k_cols):
    """The resident kernel sums the same entries in the same order with the same
    fma as the gather kernels: bit-equal outputs, and float64-close. K = 2056,
    and K = 300 in fp32 / fp64, leave a partial last slice (16-bit types take the
    gather kernel at K = 300: 300 % 8 != 0); K = 8 is narrower than a slice of
    two vectors."""
    x, xg = make(MAKERS[maker], dtype, seed=61)
    m, n = x.shape
    rng = np.random.default_rng(63)
    b = rng.standard_normal((n, k_cols)).astype(dtype)
    bg = to_gpu(b)
    vals, idx, counts, _ = cuda.dense_to_twell(xg, 64, 4)   # small tiles: many tiles over capacity
    if m == 0 or n == 0:   # no kernel runs: the forced resident path must still give the right shape
        out = _twell_spmm_with(True, vals, idx, counts, bg)
        assert out.shape == (m, k_cols) and out.dtype == dtype
        assert not bool(cp.isnan(out).any()) and not bool(out.any())
        return
    vec = 16 // np.dtype(dtype).itemsize
    plan = cuda._resident_plan(m, n, k_cols, vals.shape[1] * vals.shape[2], np.dtype(dtype), bg, bg, mode=True)
    limit = cuda._device_limits(cp.cuda.Device().id)[1]
    fits = cuda.resident_layout(max(m, 1), n, k_cols, np.dtype(dtype).itemsize, 1, limit, cuda.RESIDENT_THREADS,
                                cuda.RESIDENT_STAGE, 1) is not None
    if k_cols % vec or not fits:   # the "wide" maker's B (70000 rows) does not fit
        assert plan is None
        got = _twell_spmm_with(True, vals, idx, counts, bg, expect_resident=False)   # forced: gather fallback
        assert_same_bits(got, _twell_spmm_with(False, vals, idx, counts, bg), "fallback")
        return
    assert plan is not None, "a small B must fit the shared memory"
    got = _twell_spmm_with(True, vals, idx, counts, bg, expect_resident=True)
    want = _twell_spmm_with(False, vals, idx, counts, bg, expect_resident=False)
    assert_same_bits(got, want, f"resident vs gather twell_spmm ({maker}, K={k_cols})")
    a_stored = cpu.slots_to_dense(to_cpu(vals).reshape(m, -1), to_cpu(idx).reshape(m, -1), n)
    assert rel_err(to_cpu(got), spmm_ref(a_stored, b)) <= RTOL[np.dtype(dtype)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_resident_spmm_long_rows_chunks_and_warps(dtype, monkeypatch):
    """Rows longer than a warp's stage (several windows, rows crossing window
    edges), empty rows, M not a multiple of the rows a warp takes, and many row
    chunks (a chunk boundary inside a warp's group of rows); every tuning gives
    the same bits as the gather kernel."""
    rng = np.random.default_rng(zlib.crc32(str(dtype).encode()))
    m, n = (203, 3000) if SANITIZE else (1237, 5632)
    x = random_sparse(rng, m, n, 30)
    x[3] = rng.standard_normal(n)                                     # a full row: 5632 entries
    x[4, rng.choice(n, 700, replace=False)] = rng.standard_normal(700)
    x[[0, 17, m - 1]] = 0.0                                           # empty rows, the last one too
    x = x.astype(dtype)
    k_cols = 7 * 16 // np.dtype(dtype).itemsize   # 7 vectors: a partial last slice when a slice holds 2 or 4
    b = (rng.standard_normal((n, k_cols)) / np.sqrt(n)).astype(dtype)
    bg = to_gpu(b)
    vals, idx, counts, _ = cuda.dense_to_twell(to_gpu(x), 256, 32)
    want = _twell_spmm_with(False, vals, idx, counts, bg)
    a_stored = cpu.slots_to_dense(to_cpu(vals).reshape(m, -1), to_cpu(idx).reshape(m, -1), n)
    ref = spmm_ref(a_stored, b)
    monkeypatch.setattr(cuda, "_RESIDENT_MIN_CHUNK_ROWS", 1)   # as many row chunks as SMs allow
    for threads, stage in ((512, 256), (1024, 128), (64, 32), (256, 64)):
        monkeypatch.setattr(cuda, "RESIDENT_THREADS", threads)
        monkeypatch.setattr(cuda, "RESIDENT_STAGE", stage)
        plan = cuda._resident_plan(m, n, k_cols, vals.shape[1] * vals.shape[2], np.dtype(dtype), bg, bg,
                                   mode=True)
        assert plan is not None and plan[3] > 1, plan
        got = _twell_spmm_with(True, vals, idx, counts, bg, expect_resident=True)
        assert_same_bits(got, want, f"resident ({threads} threads, stage {stage}) vs gather")
        out = to_cpu(got).astype(np.float64)
        assert rel_err(out, ref) <= RTOL[np.dtype(dtype)]
        assert not np.any(out[[0, 17, m - 1]]), "empty rows must be exact zeros (outputs start poisoned)"


def test_resident_spmm_skips_out_of_range_indices_like_gather():
    """Raw TwELL arrays whose counted slots hold indices outside [0, N): both
    kernels skip those entries (the containers never build such arrays)."""
    rng = np.random.default_rng(67)
    m, n, k_cols = 40, 512, 64
    x = random_sparse(rng, m, n, 20).astype(np.float32)
    vals, idx, counts, _ = cuda.dense_to_twell(to_gpu(x), 256, 32)
    idx[1, 0, 0] = -3
    idx[2, 1, 0] = n + 5
    idx[5, 0, 1] = 2**31 - 1
    bg = to_gpu(rng.standard_normal((n, k_cols)).astype(np.float32))
    assert_same_bits(_twell_spmm_with(True, vals, idx, counts, bg, expect_resident=True),
                     _twell_spmm_with(False, vals, idx, counts, bg), "out-of-range indices")


def test_resident_spmm_plan_limits():
    """Which calls take the resident kernel: "auto" needs RESIDENT_MIN_ROWS rows;
    a B whose slice does not fit the shared memory (N = 70000), a misaligned B or
    K not a multiple of the vector width run the gather kernel; the widest slice
    that fits is chosen."""
    dt = bfloat16
    b = cp.zeros((5632, 2048), dt)
    big = cuda.RESIDENT_MIN_ROWS
    assert cuda._resident_plan(big - 1, 5632, 2048, 704, dt, b, b, mode="auto") is None   # too few rows
    plan = cuda._resident_plan(big, 5632, 2048, 704, dt, b, b, mode="auto")
    assert plan is not None
    lpr, smem, n_slices, n_chunks, rows = plan
    limit = cuda._device_limits(cp.cuda.Device().id)[1]
    stage = smem - 5632 * lpr * 16
    assert smem <= limit
    assert lpr == 4 or 5632 * (2 * lpr) * 16 + stage > limit, "the widest slice that fits is used"
    assert n_slices * lpr * 8 >= 2048 and n_chunks * rows >= big
    assert cuda._resident_plan(big, 70000, 2048, 704, dt, b, b, mode=True) is None        # slice too large
    assert cuda._resident_plan(big, 5632, 2047, 704, dt, b, b, mode=True) is None         # K % 8
    assert cuda._resident_plan(big, 5632, 2048, 704, dt, misaligned_copy(b), b, mode=True) is None
    assert cuda._resident_plan(big, 5632, 2048, 704, dt, b, b, mode=False) is None
    assert cuda._resident_plan(1, 5632, 2048, 704, dt, b, b, mode=True) is not None       # forced: any M
    old = cuda.SPMM_RESIDENT
    try:  # the module switch is what mode defaults to
        cuda.SPMM_RESIDENT = True
        assert cuda._resident_plan(1, 5632, 2048, 704, dt, b, b) is not None
        cuda.SPMM_RESIDENT = False
        assert cuda._resident_plan(big, 5632, 2048, 704, dt, b, b) is None
    finally:
        cuda.SPMM_RESIDENT = old


def test_resident_spmm_w1_shape_bf16():
    """The benchmark's shape (h @ w_down at W1, 30 non-zeros per row) on enough rows
    to take the resident kernel by default; bit-equal to the gather kernel."""
    rng = np.random.default_rng(71)
    m = cuda.RESIDENT_MIN_ROWS if not SANITIZE else 512
    x = random_sparse(rng, m, 5632, 30).astype(bfloat16)
    w = (rng.standard_normal((5632, 2048)) / np.sqrt(5632)).astype(bfloat16)
    vals, idx, counts, _ = cuda.dense_to_twell(to_gpu(x), 256, 32)
    wg = to_gpu(w)
    got = _twell_spmm_with("auto" if not SANITIZE else True, vals, idx, counts, wg, expect_resident=True)
    assert_same_bits(got, _twell_spmm_with(False, vals, idx, counts, wg), "W1 shape")
    ref = sp.csr_array(x.astype(np.float64)) @ w.astype(np.float64)
    assert rel_err(to_cpu(got), ref) <= RTOL[bfloat16]


def test_spmm_empty_shapes():
    z = cp.zeros((0, 1, 32), np.float32)
    zi = cp.full((0, 1, 32), -1, np.int32)
    zc = cp.zeros((0, 1), np.int32)
    b = cp.ones((100, 7), np.float32)
    assert cuda.twell_spmm(z, zi, zc, b).shape == (0, 7)
    assert cuda.slots_spmm(z.reshape(0, 32), zi.reshape(0, 32), b).shape == (0, 7)
    out = cuda.slots_spmm_t(z.reshape(0, 32), zi.reshape(0, 32), cp.ones((0, 7), np.float32), 100)
    assert out.shape == (100, 7) and not bool(out.any())
    empty_slots = cuda.slots_spmm(cp.zeros((3, 0), np.float32), cp.zeros((3, 0), np.int32), b)
    assert empty_slots.dtype == np.float32 and empty_slots.shape == (3, 7)
    assert not bool(empty_slots.any())


# ---------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_bitwise_deterministic(dtype):
    rng = np.random.default_rng(47)
    m = 300 if SANITIZE else 3000
    x = random_sparse(rng, m, 5632, 30).astype(dtype)
    x[:, 17] = 1.0  # a column hit by every row: the transpose order matters
    xg = to_gpu(x)
    b = to_gpu(rng.standard_normal((5632, 256)).astype(dtype))
    g = to_gpu(rng.standard_normal((m, 256)).astype(dtype))

    def run():
        vals, idx, counts, row_max = cuda.dense_to_twell(xg, 256, 32)
        m = vals.shape[0]
        v2, i2 = vals.reshape(m, -1), idx.reshape(m, -1)
        return [vals, idx, counts, row_max, cuda.twell_spmm(vals, idx, counts, b),
                cuda.slots_spmm(v2, i2, b), *cuda.transpose_slots(v2, i2, 5632),
                cuda.slots_spmm_t(v2, i2, g, 5632)]

    first = [to_cpu(a) for a in run()]
    for _ in range(3):
        for a, b0 in zip(run(), first):
            assert_same_bits(a, b0, "repeat")


# ---------------------------------------------------------------------------
# astype
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("src", DTYPES, ids=str)
@pytest.mark.parametrize("dst", DTYPES, ids=str)
def test_astype_matches_numpy(src, dst):
    rng = np.random.default_rng(53)
    # values exactly representable in float32 so numpy's and the kernel's
    # float64 -> 16-bit rounding cannot differ by a double rounding
    x = (rng.standard_normal(5000) * np.exp(rng.uniform(-30, 30, 5000))).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -3e-39, 2.0**-149, 65504.0, 70000.0,
                        2.0**-24, 2.0**-25 * 1.5, 3.0e38], np.float32)
    x = np.concatenate([x, special]).astype(np.float64).astype(src).reshape(-1, 7)
    got = to_cpu(cuda.astype(to_gpu(x), dst))
    want = x.astype(dst)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_same_bits(got, want, f"{src} -> {dst}")
    nan = to_cpu(cuda.astype(to_gpu(np.array([np.nan], src)), dst))
    assert np.isnan(nan.astype(np.float64)).all()


def test_astype_float64_subnormals_to_float32():
    vals = np.array([1e-40, -1e-45, 2.0**-149 * 0.5, 2.0**-149 * 0.75, 2.0**-126 * (1 - 2.0**-30),
                     1.0e-39, -0.0], np.float64)
    got = to_cpu(cuda.astype(to_gpu(vals), np.float32))
    assert_same_bits(got, vals.astype(np.float32), "float64 -> float32 subnormals")


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------
def test_bad_input_errors_name_the_argument():
    with pytest.raises(TypeError, match="x must be a cupy array"):
        cuda.dense_to_twell(np.zeros((2, 2), np.float32), 256, 32)
    with pytest.raises(TypeError, match="x has dtype int32"):
        cuda.dense_to_twell(cp.zeros((2, 2), np.int32), 256, 32)
    with pytest.raises(ValueError, match="x must be 2-D"):
        cuda.dense_row_nnz(cp.zeros(5, np.float32))
    with pytest.raises(ValueError, match="tile must be >= 1"):
        cuda.dense_to_twell(cp.zeros((2, 2), np.float32), 0, 32)
    with pytest.raises(ValueError, match="indices has shape"):
        cuda.slots_to_dense(cp.zeros((2, 3), np.float32), cp.zeros((2, 4), np.int32), 5)
    with pytest.raises(ValueError, match="row_nnz has shape"):
        cuda.dense_to_ell(cp.zeros((2, 3), np.float32), 2, cp.zeros(3, np.int32))
    with pytest.raises(TypeError, match="dtype is int64"):
        cuda.astype(cp.zeros(3, np.float32), np.int64)


@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fmt", ["twell", "ell", "hybrid"])
def test_vstack_on_the_second_gpu_with_the_first_current(fmt):
    """Parts on cuda:1 stack on cuda:1 whatever device is current."""
    import cupy as cp

    import twellpy as tw

    cls = {"twell": tw.TwELL, "ell": tw.ELL, "hybrid": tw.Hybrid}[fmt]
    rng = np.random.default_rng(3)
    a, b = (np.where(rng.random((n, 300)) < 0.05, rng.standard_normal((n, 300)), 0).astype(np.float32)
            for n in (37, 50))
    with cp.cuda.Device(1):
        A, B = cls.from_dense(cp.asarray(a)), cls.from_dense(cp.asarray(b))
    with cp.cuda.Device(0):
        S = tw.vstack([A, B])
    assert S.values.device.id == 1
    with cp.cuda.Device(1):
        np.testing.assert_array_equal(cp.asnumpy(S.toarray()), np.vstack([a, b]))
