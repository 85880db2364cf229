"""GPU reliability: out-of-memory, adversarial sparsity and poisoned outputs.

Every test carries the ``gpu`` marker (skipped without a GPU).

* Out of memory: requests far beyond the 141 GB of an H200 raise a clear
  error (CuPy's ``OutOfMemoryError`` naming the bytes, a ``MemoryError``, or
  a ``ValueError`` from an up-front size check) and leave every existing
  container intact (SHA-256 checksums of all component arrays before and
  after) and the device usable.
* Tiles over capacity and hot rows: exact on the GPU, bit-equal to the CPU.
* Poisoned outputs: every backend allocation starts as NaN/garbage (the
  ``cuda._alloc`` hook and a NaN-filled memory pool), so an output element
  that a kernel forgets to write cannot pass.
"""
import gc
import hashlib
import os

import numpy as np
import pytest

import twellpy as tw
from _reliability_util import bits_equal, host, poison_cuda_allocations
from _train_ref import dense_gated, f64, to_gpu
from conftest import poison_gpu_pool as poison_pool
from conftest import rel_err
from makers import MAKERS
from twellpy._array import bfloat16

pytestmark = pytest.mark.gpu
#: set by benchmarks/device_suite.sh for the compute-sanitizer runs: smaller sizes
SANITIZE = bool(os.environ.get("TWELLPY_SANITIZE"))

FORMATS = {
    "twell": (tw.TwELL, {}),
    "twell_t64_s4": (tw.TwELL, {"tile": 64, "slots": 4}),
    "twell_t1_s1": (tw.TwELL, {"tile": 1, "slots": 1}),
    "ell": (tw.ELL, {}),
    "hybrid": (tw.Hybrid, {}),
    "hybrid_w2": (tw.Hybrid, {"width": 2}),
}


def _cp():
    import cupy

    return cupy


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every array the container backend allocates starts as garbage, and so does the pool."""
    poison_cuda_allocations(monkeypatch)
    poison_pool()


def checksum(A):
    """SHA-256 over every component array of a container (host copies of the bytes)."""
    h = hashlib.sha256()
    for k in A._array_names:
        a = getattr(A, k)
        if a is not None:
            a = np.ascontiguousarray(host(a))
            h.update(k.encode() + str(a.shape).encode() + str(a.dtype).encode() + a.tobytes())
    return h.hexdigest()


def _existing_containers():
    rng = np.random.default_rng(1)
    x = MAKERS["over_capacity"](rng).astype(np.float32)
    hot = MAKERS["one_hot_row"](rng).astype(bfloat16)
    return [tw.TwELL.from_dense(to_gpu(x)), tw.Hybrid.from_dense(to_gpu(hot)), tw.ELL.from_dense(to_gpu(x))]


def _oom_types():
    cp = _cp()
    return (cp.cuda.memory.OutOfMemoryError, MemoryError, ValueError)


def _one_per_row_csr(cp, m, n):
    """cupyx CSR (m, n) with one non-zero per row (small itself; its dense rows are not)."""
    import cupyx.scipy.sparse as csp

    indptr = cp.arange(m + 1, dtype=cp.int32)
    indices = (cp.arange(m, dtype=cp.int64) * 997 % n).astype(cp.int32)
    return csp.csr_matrix((cp.ones(m, cp.float64), indices, indptr), shape=(m, n))


OOM_REQUESTS = {
    # ~384 GiB of slots for a 2 MiB input
    "TwELL.from_dense huge slots": lambda cp: tw.TwELL.from_dense(cp.ones((1024, 1024), cp.float16), tile=1,
                                                                   slots=1 << 16),
    # a (2**20, 2**17) float32 result: 512 GiB
    "A @ W huge result": lambda cp: tw.ELL.from_dense(cp.ones((1 << 20, 8), cp.float32)) @ cp.ones((8, 1 << 17),
                                                                                                     cp.float32),
    # dense backup rows of a huge-N Hybrid: 2**14 rows x 2**24 columns of float64 = 2 TiB
    "Hybrid.from_cupyx huge backup": lambda cp: tw.Hybrid.from_cupyx(_one_per_row_csr(cp, 1 << 14, 1 << 24),
                                                                      width=0),
    # every neuron of 2**21 tokens fires: the saved pattern alone needs 2**36 entries
    "ffn.gated_forward_train huge": lambda cp: tw.ffn.gated_forward_train(
        cp.ones((1 << 21, 16), cp.float32), cp.ones((1 << 15, 16), cp.float32), cp.ones((1 << 15, 16), cp.float32),
        cp.ones((16, 1 << 15), cp.float32)),
}


@pytest.mark.gpu_exclusive
@pytest.mark.slow
@pytest.mark.skipif(SANITIZE, reason="allocation failures are API errors under compute-sanitizer")
@pytest.mark.parametrize("request_name", list(OOM_REQUESTS))
def test_out_of_memory_is_clear_and_harmless(request_name):
    cp = _cp()
    existing = _existing_containers()
    before = [checksum(A) for A in existing]
    dense_before = [host(A.toarray()).copy() for A in existing]
    with pytest.raises(_oom_types()) as info:
        OOM_REQUESTS[request_name](cp)
    msg = str(info.value)
    # the traceback holds the frames of the failed request (partial allocations of up to the
    # whole GPU): drop it now, or the reference cycle keeps them until the next gc run
    del info
    gc.collect()
    assert any(w in msg.lower() for w in ("memory", "bytes", "int32", "exceeds", "too large")), msg
    cp.get_default_memory_pool().free_all_blocks()
    assert cp.get_default_memory_pool().used_bytes() < 1 << 30, "the failed request left memory in use"
    # every existing container is bit-for-bit unchanged and still works
    assert [checksum(A) for A in existing] == before
    for A, d in zip(existing, dense_before):
        assert bits_equal(host(A.toarray()), d)
        A.check_format(full_check=True)
        w = to_gpu(np.ones((A.shape[1], 3), dtype=A.dtype))
        ref = d.astype(np.float64) @ np.ones((A.shape[1], 3))
        assert rel_err(f64(A @ w), ref) < 2e-2
    # and the device still runs fresh work
    B = tw.TwELL.from_dense(cp.eye(300, dtype=cp.float32))
    assert bits_equal(host(B.toarray()), np.eye(300, dtype=np.float32))


def _hot_matrix(rng, m=None, n=70001):
    """Ordinary rows, one row holding every column, and rows over capacity in one tile."""
    from scipy import sparse as sp

    m = m or (300 if SANITIZE else 3000)
    a = sp.random(m, n, density=20 / n, format="lil", random_state=np.random.default_rng(0), dtype=np.float64)
    a[17, :] = rng.uniform(0.5, 2.0, n)               # one row with everything (n > 65535)
    for r in (5, m // 3, m - 1):
        a[r, 256:256 + 200] = rng.uniform(0.5, 2.0, 200)  # tile over capacity
    a = a.tocsr()
    a.data = np.where(a.data == 0, 1.0, a.data)
    return a


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiles_over_capacity_and_hot_rows(fmt, dtype):
    cls, params = FORMATS[fmt]
    rng = np.random.default_rng(2)
    m_csr = _hot_matrix(rng)
    x = m_csr.toarray().astype(dtype)
    A_gpu = cls.from_dense(to_gpu(x), **params)
    A_cpu = cls.from_dense(x, **params)
    for k in A_cpu._array_names:  # construction on the GPU gives the CPU bits
        assert bits_equal(getattr(A_gpu, k), getattr(A_cpu, k)), k
    assert bits_equal(host(A_gpu.toarray()), x)
    A_gpu.check_format(full_check=True)
    B = cls.from_scipy(m_csr, dtype=dtype, **params).to_device("cuda")
    assert bits_equal(host(B.toarray()), x)
    W = rng.standard_normal((x.shape[1], 4)).astype(dtype)
    ref = x.astype(np.float64) @ W.astype(np.float64)
    tol = 2e-2 if dtype == bfloat16 else 1e-5
    assert rel_err(f64(A_gpu @ to_gpu(W)), ref) <= tol
    assert rel_err(f64(tw.ops.spmm(A_gpu, to_gpu(W))), ref) <= tol
    G = rng.standard_normal((x.shape[0], 3)).astype(dtype)
    assert rel_err(f64(tw.ops.spmm_t(A_gpu, to_gpu(G))), x.astype(np.float64).T @ G.astype(np.float64)) <= tol
    T = A_gpu.T
    assert bits_equal(host(T.toarray()), np.ascontiguousarray(x.T))
    T2 = tw.ops.transpose(A_gpu)
    assert bits_equal(host(T2.toarray()), np.ascontiguousarray(x.T))


@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_poisoned_outputs_every_maker(fmt, maker):
    cls, params = FORMATS[fmt]
    x = MAKERS[maker](np.random.default_rng(4)).astype(np.float32)
    A = cls.from_dense(to_gpu(x), **params)
    assert bits_equal(host(A.toarray()), x)
    A.check_format(full_check=True)
    assert bits_equal(host(A.T.toarray()), np.ascontiguousarray(x.T))
    for fmt2, (cls2, p2) in FORMATS.items():
        if cls2 is tw.ELL and maker == "wide":
            continue
        assert bits_equal(host(A.asformat(cls2.format, **p2).toarray()), x), fmt2
    W = np.random.default_rng(5).standard_normal((x.shape[1], 3)).astype(np.float32)
    y = f64(A @ to_gpu(W))
    assert np.isfinite(y).all() and rel_err(y, x.astype(np.float64) @ W.astype(np.float64)) <= 1e-5
    V = np.random.default_rng(6).standard_normal((2, x.shape[0])).astype(np.float32)
    z = f64(A.__rmatmul__(to_gpu(V)))
    assert np.isfinite(z).all() and rel_err(z, V.astype(np.float64) @ x.astype(np.float64)) <= 1e-5


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_poisoned_pool_ffn_and_training(dtype):
    rng = np.random.default_rng(7)
    m, d, h = 700, 64, 512
    x = rng.standard_normal((m, d))
    x[:, 0] = 1.0
    x[::50, 0] = -8.0  # hot tokens: almost every neuron fires
    wg = rng.standard_normal((h, d)) / 8
    wg[:, 0] = -1.2
    wu = rng.standard_normal((h, d)) / 8
    wd = rng.standard_normal((d, h)) / 22
    dy = rng.standard_normal((m, d))
    arrs = [a.astype(dtype) for a in (x, wg, wu, wd, dy)]
    g = [to_gpu(a) for a in arrs]
    ref = dense_gated(*arrs, 1e-3)
    tol = 3e-2 if dtype == bfloat16 else 1e-4
    x64, wg64, wu64 = (a.astype(np.float64) for a in arrs[:3])
    h_ref = np.maximum(x64 @ wg64.T, 0.0) * (x64 @ wu64.T)  # float64, from the same (rounded) inputs
    # tiles of 128 neurons holding more than slots=16 entries: those rows go to h's dense backup
    assert (np.count_nonzero(h_ref.reshape(m, h // 128, 128), axis=2) > 16).any()
    for mode in ("sparse", "dense", "auto"):
        poison_pool()
        y, hh = tw.ffn.gated_forward(*g[:4], mode=mode, return_activations=True, slots=16, tile=128)
        assert np.isfinite(f64(y)).all() and rel_err(f64(y), ref["y"]) <= tol, mode
        hh.check_format(full_check=True)
        h_got = f64(hh.toarray())  # written from the poisoned pool too: its values, not only its format
        assert np.isfinite(h_got).all() and rel_err(h_got, h_ref) <= tol, mode
    poison_pool()
    y, ctx = tw.ffn.gated_forward_train(*g[:4], l1=1e-3)
    poison_pool()
    grads = tw.ffn.gated_backward(ctx, g[4])
    assert rel_err(f64(y), ref["y"]) <= tol
    for name, got in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads):
        assert np.isfinite(f64(got)).all() and rel_err(f64(got), ref[name]) <= tol, name


def test_nan_semantics_match_cpu():
    """check_finite=False: NaN kept in construction and propagated as on the CPU."""
    x = MAKERS["zero_rows"](np.random.default_rng(8)).astype(np.float32)
    x[1, 3] = np.nan
    x[3, 7] = np.inf
    for cls, params in FORMATS.values():
        A = cls.from_dense(to_gpu(x), check_finite=False, **params)
        C = cls.from_dense(x, check_finite=False, **params)
        assert bits_equal(host(A.toarray()), host(C.toarray()))
        with pytest.raises(ValueError, match=r"x contains 1 NaN and 1 Inf"):
            cls.from_dense(to_gpu(x), **params)


def test_cupy_operands_on_both_sides_of_at():
    """``cupy_W @ A`` and ``A @ cupy_W`` with the operators themselves."""
    cp = _cp()
    x = MAKERS["ragged_n"](np.random.default_rng(9)).astype(np.float32)
    A = tw.TwELL.from_dense(to_gpu(x))
    W = np.random.default_rng(10).standard_normal((3, x.shape[0])).astype(np.float32)
    z = cp.asarray(W) @ A
    assert isinstance(z, cp.ndarray)
    assert rel_err(f64(z), W.astype(np.float64) @ x.astype(np.float64)) <= 1e-5
    y = A @ cp.ones((x.shape[1], 2), cp.float32)
    want = np.repeat(x.astype(np.float64).sum(1, keepdims=True), 2, axis=1)
    assert isinstance(y, cp.ndarray) and rel_err(f64(y), want) <= 1e-5


# ---- the one-pass finiteness check (raw_kernels/check.cu) -------------------
def _nonfinite_reference(host_array):
    """NaN/Inf count decided on the bits in numpy (float64 view not needed)."""
    dt = np.dtype(host_array.dtype)
    if dt == bfloat16:
        bits, mask = host_array.view(np.uint16), 0x7F80
    else:
        bits = host_array.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize])
        mask = {2: 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}[dt.itemsize]
    return int(np.count_nonzero((bits & bits.dtype.type(mask)) == bits.dtype.type(mask)))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_count_nonfinite_every_16_bit_pattern(dtype):
    from twellpy.backends import cuda

    cp = _cp()
    host_bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    host_vals = host_bits.view(dtype)
    want = _nonfinite_reference(host_vals)
    assert want == 2 * ((1 << (7 if dtype is bfloat16 else 10)))  # +-Inf and every NaN payload, both signs
    dev = cp.asarray(host_bits).view(dtype)
    assert cuda.count_nonfinite(dev) == want
    # misaligned starts (element by element path); aligned starts with fewer elements than a
    # vector (0x7C00 and 0x7F80 are 16-byte aligned offsets); one element
    for start, stop in ((1, None), (3, 1 << 15), (0, 7), (0x7C00, 0x7C01), (0x7F80, 0x7F81), (5, 6)):
        sub = dev[start:stop]
        assert cuda.count_nonfinite(sub) == _nonfinite_reference(host_vals[start:stop]), (start, stop)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (257, 129), (2, 70001)])
def test_count_nonfinite_against_numpy(dtype, shape):
    from twellpy.backends import cuda

    cp = _cp()
    rng = np.random.default_rng(int(np.prod(shape)) + np.dtype(dtype).itemsize)
    host_vals = rng.standard_normal(shape).astype(np.float32)
    flat = host_vals.reshape(-1)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, 3.0e38], np.float32)
    picks = rng.integers(0, flat.size, size=min(flat.size, 9))
    flat[picks] = specials[rng.integers(0, specials.size, size=picks.size)]
    host_vals = host_vals.astype(dtype)
    dev = to_gpu(host_vals)
    assert cuda.count_nonfinite(dev) == _nonfinite_reference(host_vals)
    word = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    fortran = cp.asfortranarray(dev.view(word)).view(dtype)  # copied as raw words (CuPy has no bf16)
    assert fortran.flags.f_contiguous and (min(shape) == 1 or not fortran.flags.c_contiguous)
    assert cuda.count_nonfinite(fortran) == _nonfinite_reference(host_vals)
    # misaligned 4- and 8-byte views (the element-by-element path of the wider words)
    flat_dev, flat_host = dev.reshape(-1), host_vals.reshape(-1)
    for start in (1, 3):
        if flat_host.size > start:
            assert cuda.count_nonfinite(flat_dev[start:]) == _nonfinite_reference(flat_host[start:]), start
    # check_finite: raises exactly when there is something to find, and names the argument
    if _nonfinite_reference(host_vals):
        with pytest.raises(ValueError, match="x contains"):
            tw._array.check_finite(dev, "x")
    else:
        assert tw._array.check_finite(dev, "x") is dev
    # a non-contiguous view still goes through the (slow) counting path and agrees
    if shape[1] > 1:
        strided = dev[:, ::2]
        finite = _nonfinite_reference(np.ascontiguousarray(host_vals[:, ::2])) == 0
        if finite:
            assert tw._array.check_finite(strided, "x") is strided
        else:
            with pytest.raises(ValueError, match="x contains"):
                tw._array.check_finite(strided, "x")


def test_count_nonfinite_reuses_its_counter_across_streams_and_threads():
    """The per-(thread, device) counter is zeroed on the caller's stream: no call sees another's count."""
    import threading

    from twellpy.backends import cuda

    cp = _cp()
    arrays = []
    for k in range(8):
        a = cp.zeros((64, 1000 + k), cp.float32)
        a.reshape(-1)[: 3 * k + 1] = cp.nan  # each array has its own count
        arrays.append(a)
    want = [3 * k + 1 for k in range(8)]
    cp.cuda.get_current_stream().synchronize()  # the fills ran there; a non-blocking stream would not wait
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        assert [cuda.count_nonfinite(a) for a in arrays] == want
    assert [cuda.count_nonfinite(a) for a in arrays[::-1]] == want[::-1]
    got, errors = {}, []

    def work(k):
        try:
            with cp.cuda.Stream(non_blocking=True):
                got[k] = [cuda.count_nonfinite(arrays[(k + j) % 8]) for j in range(16)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(got[k] == [want[(k + j) % 8] for j in range(16)] for k in range(8))
