"""GPU tests of the training step and primitives: float64 reference, CPU backend,
torch autograd; outputs come from a memory pool poisoned with NaN first."""
import os

import numpy as np
import pytest

import twellpy as tw
from twellpy import _ffn_train as T
from twellpy import ops
from twellpy._array import bfloat16

from conftest import poison_gpu_pool as poison
from _train_ref import dense_gated, dense_relu, f64, make_problem, step_outputs, to_gpu

pytestmark = pytest.mark.gpu

TOL = {np.dtype(np.float32): 1e-5, bfloat16: 1e-2, np.dtype(np.float64): 1e-10, np.dtype(np.float16): 1e-2}


def rel(got, ref):
    got, ref = f64(got), f64(ref)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / den) if den else float(np.linalg.norm(got))


CASES = {
    "uniform": dict(M=2048, D=256, H=1024, nnz=30),
    "uneven03": dict(M=1024, D=256, H=1024, nnz=30, sigma=0.3),
    "uneven1": dict(M=1024, D=128, H=1024, nnz=30, sigma=1.0),
    "hot2000": dict(M=256, D=64, H=2304, nnz=20, hot=(17, 2000)),
    "empty_rows": dict(M=300, D=64, H=512, nnz=10, empty=(0, 5, 299)),
    "M1": dict(M=1, D=64, H=512, nnz=20),
    "odd": dict(M=333, D=37, H=301, nnz=9, sigma=0.5),
    "wide_D": dict(M=256, D=4096, H=11008, nnz=30),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16, np.dtype(np.float16)], ids=str)
def test_gated_gpu_matches_reference_and_cpu(case, dtype):
    import cupy as cp

    host = [a.astype(dtype) for a in make_problem(**CASES[case], seed=11)]
    dev = [to_gpu(a) for a in host]
    l1 = 0.05
    poison()
    y, ctx = T.gated_forward_train(*dev[:4], l1=l1)
    poison()
    grads = T.gated_backward(ctx, dev[4])
    assert isinstance(y, cp.ndarray)
    ref = dense_gated(*host, l1)
    yc, cctx = T.gated_forward_train(*host[:4], l1=l1)
    cgrads = T.gated_backward(cctx, host[4])
    for name, got, cpu in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), (y,) + grads, (yc,) + cgrads):
        assert got.dtype == dtype and got.shape == ref[name].shape, name
        assert rel(got, ref[name]) <= TOL[dtype], (name, rel(got, ref[name]))
        assert rel(got, cpu) <= 2 * TOL[dtype], (name, rel(got, cpu))
    if dtype == np.float32:
        np.testing.assert_array_equal(f64(ctx.stats["token_counts"]), ref["token_counts"])
        np.testing.assert_array_equal(f64(ctx.stats["neuron_counts"]), ref["neuron_counts"])
    assert ctx.stats["l1"] == pytest.approx(ref["l1"], rel=TOL[dtype])


@pytest.mark.parametrize("case", ["uniform", "hot2000", "odd", "M1"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16, np.dtype(np.float16)], ids=str)
def test_relu_gpu_matches_reference(case, dtype):
    host = [a.astype(dtype) for a in make_problem(**CASES[case], seed=12, gated=False)]
    dev = [to_gpu(a) for a in host]
    poison()
    y, ctx = T.relu_forward_train(*dev[:3], l1=0.1)
    poison()
    grads = T.relu_backward(ctx, dev[3])
    ref = dense_relu(*host, 0.1)
    for name, got in zip(("y", "dx", "dw_up", "dw_down"), (y,) + grads):
        assert rel(got, ref[name]) <= TOL[dtype], (name, rel(got, ref[name]))


def _relu_pattern_input(dtype, H, seed):
    """Sparse rows (under 1% positive), a row firing everything, an empty row, a vector of
    eight actives, special values, and for 16-bit types every bit pattern in some row."""
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((96, H)) - 2.5).astype(np.float32)
    z[1] = np.abs(z[1]) + 0.5
    z[2] = -1.0
    z[3, 8:16] = 2.0
    z[4, :6] = [np.nan, -0.0, 1e-40, -1e-40, np.inf, -np.inf]
    z = z.astype(dtype)
    if z.dtype.itemsize == 2:
        flat = z[6:].reshape(-1)
        n = min(flat.size, 1 << 16)
        flat[:n] = rng.permutation(np.arange(1 << 16, dtype=np.uint16))[:n].view(z.dtype)
        z[6:] = flat.reshape(z[6:].shape)
    return z


@pytest.mark.parametrize("words", [0, 1], ids=["value-test", "word-test"])
@pytest.mark.parametrize("H", [1000, 999, 5632])
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_relu_pattern_kernels_on_every_bit_pattern_gpu(monkeypatch, dtype, H, words):
    """relu_count, the CSR pack, relu_to_hybrid and the count-and-pack, value by value and
    with TW_PACK_WORDS=1 (16-bit values two at a time on 32-bit words, the warp scan's
    ballot shortcuts), against numpy's own relu(z) != 0 (positive, denormals included, or
    NaN) and the CPU twins, bit for bit, on every dtype: every 16-bit pattern, sparse,
    empty and full rows; H a multiple of the vector (vector loops) and not (scalar ones)."""
    import cupy as cp
    from twellpy.backends import cpu_train
    from twellpy.backends import cuda_train as ct

    monkeypatch.setattr(ct, "PACK_DEFINES", {"TW_PACK_WORDS": words})

    z = _relu_pattern_input(dtype, H, H)
    f = z.astype(np.float64)
    on = (f > 0) | np.isnan(f)
    zd = cp.asarray(z)
    poison()
    counts = ct.relu_count(zd).get()
    np.testing.assert_array_equal(counts, on.sum(axis=1))
    poison()
    row_nnz, indptr, col, val = (a.get() for a in ct.relu_csr(zd))
    r, c = np.nonzero(on)
    np.testing.assert_array_equal(row_nnz, counts)
    np.testing.assert_array_equal(col, c)
    np.testing.assert_array_equal(val.view(np.uint8), np.ascontiguousarray(z[r, c]).view(np.uint8))
    W = int(np.sort(counts)[len(counts) // 2])                   # narrow rows and wide ones
    wide = int(np.count_nonzero(counts > W))
    row_map = cpu_train.row_maps(counts, W, wide)[:len(counts)]
    want = cpu_train.relu_to_hybrid(z, row_map, W, wide)
    poison()
    got = [a.get() for a in ct.relu_to_hybrid(zd, cp.asarray(row_map), W, wide)]
    # the kernels copy each kept value's bits (NaN payloads too, checked against z above);
    # the CPU twin may canonicalise a bfloat16 NaN, so values compare bit for bit except
    # where both are NaN
    _same_bits_but_nan_payloads(got[0], want[0], "vals")
    for g, w, name in zip(got[1:], want[1:], ("ell_idx", "ell_nnz", "neuron_counts")):
        np.testing.assert_array_equal(np.ascontiguousarray(g).view(np.uint8), np.ascontiguousarray(w).view(np.uint8),
                                      err_msg=name)
    np.testing.assert_array_equal(got[3], on.sum(axis=0))
    poison()
    packed = [a.get() for a in ct.relu_count_pack(zd, W, wide)]
    n = len(counts) * W
    np.testing.assert_array_equal(packed[4], counts)
    _same_bits_but_nan_payloads(packed[0][:n], want[0][:n], "packed vals")
    for g, w in zip(packed[1:4], want[1:4]):
        np.testing.assert_array_equal(g, w)


def _same_bits_but_nan_payloads(got, want, name):
    """``got`` and ``want`` bit for bit, except that where both are NaN the payloads may differ."""
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    g_nan, w_nan = np.isnan(g.astype(np.float64)), np.isnan(w.astype(np.float64))
    np.testing.assert_array_equal(g_nan, w_nan, err_msg=f"{name}: NaN positions")
    keep = ~g_nan
    np.testing.assert_array_equal(g[keep].view(np.uint8), w[keep].view(np.uint8), err_msg=name)


def test_gpu_deterministic_bits():
    import cupy as cp

    dev = [to_gpu(a.astype(bfloat16)) for a in make_problem(**CASES["uneven03"], seed=13)]
    outs = []
    for _ in range(2):
        poison()
        y, ctx = T.gated_forward_train(*dev[:4], l1=0.01, deterministic=True)
        outs.append((y,) + T.gated_backward(ctx, dev[4]))
    for a, b in zip(*outs):
        assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


def test_torch_autograd_cross_check():
    torch = pytest.importorskip("torch")
    host = make_problem(M=4096, D=512, H=1408, nnz=30, sigma=0.3, seed=14)
    l1 = 2e-3
    tt = [torch.tensor(a, device="cuda", dtype=torch.bfloat16) for a in host]
    x, wg, wu, wd = (t.clone().requires_grad_(True) for t in tt[:4])
    dy = tt[4]
    M = x.shape[0]
    h = torch.relu(x @ wg.T) * (x @ wu.T)
    y_t = h @ wd.T
    pen = l1 * h.abs().sum() / M
    torch.autograd.backward([y_t, pen], [dy, torch.ones_like(pen)])
    # twellpy takes the torch tensors directly (DLPack) and returns torch tensors
    y, ctx = T.gated_forward_train(tt[0], tt[1], tt[2], tt[3], l1=l1)
    dx, dwg, dwu, dwd = T.gated_backward(ctx, dy)
    assert isinstance(y, torch.Tensor) and isinstance(dwg, torch.Tensor)
    ref = dense_gated(*(t.float().cpu().numpy() for t in tt), l1)
    for name, ours, theirs in (("y", y, y_t), ("dx", dx, x.grad), ("dw_gate", dwg, wg.grad),
                               ("dw_up", dwu, wu.grad), ("dw_down", dwd, wd.grad)):
        a = ours.float().cpu().numpy()
        b = theirs.detach().float().cpu().numpy()
        assert rel(a, ref[name]) <= 1e-2, (name, rel(a, ref[name]))
        assert rel(b, ref[name]) <= 1e-2, (name, "torch", rel(b, ref[name]))
        assert rel(a, b) <= 2e-2, (name, rel(a, b))


@pytest.mark.gpu_exclusive
def test_large_m_and_h():
    """M = 131072 tokens, H = 11008 neurons (int32 offsets, big grids), bf16."""
    import cupy as cp

    M, D, H = 131072, 128, 11008
    rs = cp.random.default_rng(15)
    x = rs.standard_normal((M, D), dtype=cp.float32)
    x *= cp.exp(0.3 * rs.standard_normal((M, 1), dtype=cp.float32))
    x[:, 0] = 1
    wg = rs.standard_normal((H, D), dtype=cp.float32) / np.sqrt(D - 1)
    wg[:, 0] = -2.3  # about 1% of 11008 neurons fire per token
    wu = rs.standard_normal((H, D), dtype=cp.float32) / np.sqrt(D)
    wd = rs.standard_normal((D, H), dtype=cp.float32) / np.sqrt(H)
    dy = rs.standard_normal((M, D), dtype=cp.float32)
    from twellpy.backends import cuda_train as ct

    b = [ct.from_acc(a, bfloat16) for a in (x, wg, wu, wd, dy)]
    poison()
    y, ctx = T.gated_forward_train(*b[:4], l1=1e-4)
    poison()
    dx, dwg, dwu, dwd = T.gated_backward(ctx, b[4])
    xf, wgf, wuf, wdf, dyf = (ct.to_acc(a) for a in b)
    z = xf @ wgf.T
    pat = z > 0
    g = cp.where(pat, z, 0)
    u = xf @ wuf.T
    hh = g * u
    del z
    dh = cp.where(pat, dyf @ wdf + (1e-4 / M) * cp.sign(hh), 0)
    du, dg = dh * g, dh * u
    del dh
    refs = {"y": hh @ wdf.T, "dx": du @ wuf + dg @ wgf, "dw_gate": dg.T @ xf, "dw_up": du.T @ xf,
            "dw_down": dyf.T @ hh}
    for name, got in (("y", y), ("dx", dx), ("dw_gate", dwg), ("dw_up", dwu), ("dw_down", dwd)):
        r = float(cp.linalg.norm(ct.to_acc(got) - refs[name]) / cp.linalg.norm(refs[name]))
        assert r <= 1e-2, (name, r)
    # two correct GEMMs (bf16 cuBLAS vs fp32) may disagree on a handful of
    # gate values within rounding of 0; nothing else may differ
    assert abs(int(ctx.stats["token_counts"].sum()) - int(pat.sum())) <= 1e-5 * int(pat.sum())


# ---------------------------------------------------------------------------
def _dense_sparse(M, N, density, seed, hot_row=None):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, N)) * (rng.random((M, N)) < density)
    if hot_row is not None:
        a[hot_row] = rng.standard_normal(N)
    if M > 2:
        a[1] = 0.0
    return a


def _containers(a, dtype):
    ah = a.astype(dtype)
    return [tw.ELL.from_dense(ah), tw.TwELL.from_dense(ah, tile=64, slots=4),
            tw.Hybrid.from_dense(ah, width="auto")]


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16])
@pytest.mark.parametrize("shape", [(1, 70), (257, 300), (1200, 1000)])
def test_ops_gpu(dtype, shape):
    import cupy as cp

    M, N = shape
    a = _dense_sparse(M, N, 0.03, 16, hot_row=0)
    tol = 2 * TOL[dtype]
    for A in _containers(a, dtype):
        Ad = A.to_device("cuda")
        ad = f64(A.toarray())
        rng = np.random.default_rng(17)
        B = rng.standard_normal((N, 24)).astype(dtype)
        C = rng.standard_normal((M, 24)).astype(dtype)
        X = rng.standard_normal((M, 40)).astype(dtype)
        Y = rng.standard_normal((N, 40)).astype(dtype)
        poison()
        got = ops.spmm(Ad, to_gpu(B))
        assert isinstance(got, cp.ndarray)
        assert rel(got, ad @ f64(B)) <= tol, A.format
        poison()
        assert rel(ops.spmm_t(Ad, to_gpu(C)), ad.T @ f64(C)) <= tol, A.format
        poison()
        S = ops.sddmm(to_gpu(X), to_gpu(Y), Ad)
        assert S.format == A.format and S.device.startswith("cuda")
        assert rel(S.toarray(), (f64(X) @ f64(Y).T) * (ad != 0)) <= tol, A.format
        poison()
        Tt = ops.transpose(Ad)
        np.testing.assert_array_equal(f64(Tt.toarray()), ad.T)
        assert Tt.indices.dtype == np.int32
        if dtype == np.float32:
            Tc = ops.transpose(Ad, format="csr")
            np.testing.assert_array_equal(Tc.get().toarray(), ad.T)
        P = ops.multiply(Ad, Ad)
        # one rounding of an exact product (the float32 product of two float32 or bfloat16
        # values is exact before it): bit-equal to float64's, rounded once (rtol=1e-2 let a
        # float32 result off in its 7th bit pass)
        np.testing.assert_array_equal(f64(P.toarray()), f64((ad * ad).astype(dtype)))


def test_transpose_gpu_many_rows():
    """A (131072+, N) matrix transposes to (N, M) with int32 indices, deterministically."""
    import cupy as cp
    import cupyx.scipy.sparse as csp

    M, N = 140000, 600
    m = csp.random(M, N, density=0.01, format="csr", dtype=cp.float32, random_state=18)
    A = tw.Hybrid.from_dense(m.toarray())
    T1 = ops.transpose(A)
    T2 = ops.transpose(A)
    assert T1.shape == (N, M) and T1.indices.dtype == cp.int32
    assert bool((T1.values == T2.values).all()) and bool((T1.indices == T2.indices).all())
    np.testing.assert_array_equal(T1.toarray().get(), m.toarray().get().T)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("case", ["uneven1", "hot2000", "empty_rows", "M1", "odd"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16])
def test_direct_pack_matches_the_csr_path_gpu(monkeypatch, case, dtype, gated):
    """relu(z) packed straight into the Hybrid (twellpy_train_relu_to_hybrid) against the CSR
    path on the same gate output: the same bits in every output, with poisoned pools, for
    vector (H % 8 == 0) and scalar ("odd": H = 301) rows, and fixed widths that force
    backup rows. Also the per-row |h| sums of the forward kernel: the L1 statistic."""
    prob = [to_gpu(a.astype(dtype)) for a in make_problem(**CASES[case], seed=21, gated=gated)]
    x, wg, wu, wd, dy = prob if gated else (prob[0], None, *prob[1:])
    for width in ("auto", 2):
        poison()
        direct, l1_direct, w_direct = step_outputs(x, wg, wu, wd, dy, width, gated)
        monkeypatch.setattr(T, "_DIRECT_PACK", False)
        poison()
        via_csr, l1_csr, w_csr = step_outputs(x, wg, wu, wd, dy, width, gated)
        monkeypatch.undo()
        assert w_direct == w_csr
        for k in direct:
            assert direct[k].tobytes() == via_csr[k].tobytes(), (width, k)
        assert l1_direct == l1_csr  # the same saved values go through the same kernel
        # the L1 statistic against the host: h on the pattern from the saved values
        g = f64(direct["gvals"])
        h = g * f64(direct["uvals"]) if gated else g
        if dtype == bfloat16:
            h = f64(h.astype(np.float32).astype(bfloat16))
        M = x.shape[0]
        assert l1_direct == pytest.approx(0.05 * float(np.abs(h).sum()) / M, rel=1e-5)


@pytest.mark.parametrize("M,N,K,R", [(1, 1, 1, 0), (17, 33, 5, 2), (1000, 600, 12, 7), (40000, 70001, 3, 3),
                                     (140000, 256, 4, 0)])
def test_transpose_pattern_matches_cpu_bitwise(M, N, K, R):
    """The counting sort (tr_count, tr_scan, tr_place) against the Numba twin: the same indptr,
    rows and positions, for one and many row blocks, N > 65535, and backup rows."""
    import cupy as cp

    from twellpy.backends import cpu_train, cuda_train

    rng = np.random.default_rng(M + N)
    idx = np.full((M, K), -1, np.int32)
    for r in range(min(M, 5000)):  # the rest stay empty rows
        n = int(rng.integers(0, min(K, N) + 1))
        idx[r, :n] = np.sort(rng.choice(N, n, replace=False))
    if M > 5000:
        idx[5000:, 0] = rng.integers(0, N, M - 5000)  # one entry per row
    row_map = np.full(M, -1, np.int32)
    rows_b = rng.choice(M, R, replace=False) if R else np.zeros(0, int)
    row_map[rows_b] = np.arange(R, dtype=np.int32)
    idx[rows_b] = -1  # backup rows keep padding only in the slots
    backup = (rng.random((R, N)) < 0.2) * rng.standard_normal((R, N))
    backup = backup.astype(np.float32)
    want = cpu_train.transpose_pattern(idx, row_map, backup, N)
    poison()
    got = cuda_train.transpose_pattern(cp.asarray(idx), cp.asarray(row_map), cp.asarray(backup), N)
    for name, a, b in zip(("indptr", "rows", "pos"), got, want):
        assert a.dtype == np.int32 and a.shape == b.shape, name
        np.testing.assert_array_equal(a.get(), b, err_msg=name)
    assert int(want[0][-1]) == int((idx >= 0).sum() + (backup != 0).sum())


# ---------------------------------------------------------------------------
# the one-pass kernels around the dense backup rows' GEMMs, and the tiled
# transpose of the weights: each against its numpy twin in cpu_train
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
ALL_DTYPES = [np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64)]


def _host(a):
    """numpy copy of a cupy array of any value dtype (16-bit floats moved as bits)."""
    return a.view(np.uint16).get().view(a.dtype) if a.dtype.itemsize == 2 else a.get()


def _bits_of(a):
    a = np.ascontiguousarray(a)
    return a.view(_BITS[a.dtype.itemsize])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (1, 70001), (33, 65), (70001, 3), (2048, 5632), (66, 130), (2, 140002),
                                   (140002, 4)])
@pytest.mark.parametrize("pairs", [False, True], ids=["one_by_one", "pairs"])
def test_transpose_copy_is_bit_exact(monkeypatch, dtype, shape, pairs):
    """Both kernels (16-bit elements one at a time, or as word pairs where the shape
    allows): the transpose's bits, NaN payloads included."""
    from twellpy.backends import cuda_train as CT

    monkeypatch.setattr(CT, "PAIR_TRANSPOSE", pairs)

    rng = np.random.default_rng(shape[0] * 7 + shape[1])
    a = rng.standard_normal(shape).astype(dtype)
    a.reshape(-1)[::97] = np.nan  # NaN payloads must survive: the copy moves bits
    poison()
    got = CT.transpose_copy(to_gpu(a))
    assert got.dtype == dtype and got.shape == shape[::-1] and got.flags.c_contiguous
    np.testing.assert_array_equal(_bits_of(_host(got)), _bits_of(a.T))


def test_transpose_copy_of_a_strided_view():
    from twellpy.backends import cuda_train as CT

    a = np.random.default_rng(3).standard_normal((300, 257)).astype(bfloat16)
    dev = to_gpu(a)[:, ::2]
    poison()
    got = CT.transpose_copy(dev)
    np.testing.assert_array_equal(_bits_of(_host(got)), _bits_of(a[:, ::2].T))
    with pytest.raises(ValueError, match="2-D"):
        CT.transpose_copy(to_gpu(a)[0])


def test_transpose_copy_of_a_view_off_word_alignment(monkeypatch):
    """A contiguous 16-bit view starting 2 bytes into a word takes the one-element
    kernel (the pairwise one needs 4-byte aligned rows): still the transpose's bits."""
    from twellpy.backends import cuda_train as CT

    monkeypatch.setattr(CT, "PAIR_TRANSPOSE", True)
    flat = np.random.default_rng(4).standard_normal(1 + 64 * 96).astype(bfloat16)
    dev = to_gpu(flat)[1:].reshape(64, 96)
    assert dev.data.ptr % 4 == 2 and dev.flags.c_contiguous
    poison()
    got = CT.transpose_copy(dev)
    np.testing.assert_array_equal(_bits_of(_host(got)), _bits_of(flat[1:].reshape(64, 96).T))


def _backup_problem(dtype, R, H, seed):
    from twellpy.backends import cpu_train as CPU

    rng = np.random.default_rng(seed)
    acc = CPU.compute_dtype(dtype)
    g = np.maximum(rng.standard_normal((R, H)), 0).astype(dtype)
    if g.size > 3:
        g.reshape(-1)[1] = np.nan  # NaN is an entry, and must stay NaN
    u_acc = rng.standard_normal((R, H)).astype(acc)
    dh_acc = rng.standard_normal((R, H)).astype(acc)
    M = R + 9
    rows = np.sort(rng.choice(M, R, replace=False)).astype(np.int32)
    return g, u_acc, dh_acc, rows, M, acc


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("R,H", [(1, 1), (3, 5632), (17, 301), (300, 64)])
def test_backup_row_kernels_match_cpu(dtype, gated, R, H):
    import cupy as cp
    from twellpy.backends import cpu_train as CPU
    from twellpy.backends import cuda_train as CT

    g, u_acc, dh_acc, rows, M, acc = _backup_problem(dtype, R, H, seed=R * 31 + H)
    l1s = 0.013
    # CPU twin
    habs_c = np.full(M, 7.0, dtype=acc)
    u_c = np.empty((R, H), dtype=dtype)
    h_c = CPU.backup_rows_forward(g, u_acc, u_c, rows, habs_c, gated)
    da_c, db_c = np.empty((R, H), dtype=dtype), np.empty((R, H), dtype=dtype)
    hb_c = np.empty((R, H), dtype=dtype) if gated else None
    CPU.backup_rows_backward(dh_acc, g, u_c if gated else None, l1s, gated, da_c, db_c if gated else None,
                             h_out=hb_c)
    # GPU, outputs poisoned first
    g_d, rows_d = to_gpu(g), cp.asarray(rows)
    habs_d = cp.asarray(np.full(M, 7.0, dtype=acc))
    poison()
    u_d = cp.empty((R, H), dtype=dtype) if gated else None
    h_d = CT.backup_rows_forward(g_d, cp.asarray(u_acc) if gated else None, u_d, rows_d, habs_d, gated)
    poison()
    da_d = cp.empty((R, H), dtype=dtype)
    db_d = cp.empty((R, H), dtype=dtype) if gated else None
    hb_d = cp.empty((R, H), dtype=dtype) if gated else None
    CT.backup_rows_backward(cp.asarray(dh_acc), g_d, u_d, l1s, gated, da_d, db_d, h_out=hb_d)
    cp.cuda.get_current_stream().synchronize()
    # element-wise results: the same bits (same fp32/fp64 operations, one rounding)
    outs = [("h", h_d, h_c), ("da", da_d, da_c)]
    if gated:
        outs += [("u", u_d, u_c), ("db", db_d, db_c), ("h_out", hb_d, hb_c), ("h_out = h", hb_d, h_c)]
    for name, got, want in outs:
        got = _host(got)
        nan = np.isnan(want.astype(np.float64))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), nan, err_msg=name)
        # a NaN that arithmetic makes is the GPU's canonical NaN; numpy keeps the operand's payload
        np.testing.assert_array_equal(_bits_of(got)[~nan], _bits_of(want)[~nan], err_msg=name)
    # |h| sums: only the backup rows are written; the order of the sum differs
    got = habs_d.get()
    others = np.setdiff1d(np.arange(M), rows)
    np.testing.assert_array_equal(got[others], 7.0)
    np.testing.assert_allclose(got[rows], habs_c[rows], rtol=1e-5 if acc == np.float32 else 1e-12)
    if g.size > 3:
        assert np.isnan(got[rows[0]]), "a NaN in h must reach the L1 statistic"


def test_backup_rows_count_a_denormal_as_an_entry():
    import cupy as cp
    from twellpy.backends import cpu_train as CPU
    from twellpy.backends import cuda_train as CT

    tiny = np.float32(1e-40)  # float32 denormal; the GPU kernels run with -ftz
    g = np.array([[tiny, 0.0, 2.0]], dtype=np.float32)
    u_acc = np.array([[3.0, 5.0, 7.0]], dtype=np.float32)
    rows = np.array([0], dtype=np.int32)
    for be, xp in ((CPU, np), (CT, cp)):
        g_x = xp.asarray(g)
        u = xp.empty((1, 3), dtype=np.float32)
        habs = xp.zeros(1, dtype=np.float32)
        be.backup_rows_forward(g_x, xp.asarray(u_acc), u, rows if xp is np else cp.asarray(rows), habs, True)
        u = u.get() if xp is cp else u
        np.testing.assert_array_equal(u, [[3.0, 0.0, 7.0]], err_msg=be.__name__)


def test_put_rows_from_acc_and_accumulating_gemm():
    import cupy as cp
    from twellpy.backends import cuda_train as CT

    rng = np.random.default_rng(8)
    dst = rng.standard_normal((50, 70)).astype(bfloat16)
    rows = np.array([0, 7, 49], dtype=np.int32)
    src = rng.standard_normal((3, 70)).astype(np.float32)
    d = to_gpu(dst)
    CT.put_rows_from_acc(d, cp.asarray(rows), cp.asarray(src))
    want = dst.copy()
    want[rows] = src.astype(bfloat16)
    np.testing.assert_array_equal(_bits_of(_host(d)), _bits_of(want))
    a = rng.standard_normal((5, 64)).astype(bfloat16)
    b = rng.standard_normal((64, 33)).astype(bfloat16)
    c0 = rng.standard_normal((5, 33)).astype(np.float32)
    c = cp.asarray(c0)
    out = CT.gemm_acc(to_gpu(a), to_gpu(b), out=c)
    assert out is c
    ref = c0.astype(np.float64) + f64(a) @ f64(b)
    np.testing.assert_allclose(c.get(), ref, rtol=1e-5, atol=1e-5)


def test_backup_row_launchers_check_their_operands():
    import cupy as cp
    from twellpy.backends import cuda_train as CT

    g = cp.zeros((4, 8), dtype=cp.float32)
    habs = cp.zeros(10, dtype=cp.float32)
    with pytest.raises(ValueError, match="backup_rows"):
        CT.backup_rows_forward(g, g, g, cp.zeros(4, dtype=cp.int64), habs, True)
    with pytest.raises(ValueError, match="u_acc"):
        CT.backup_rows_forward(g, g[:, :4], g, cp.zeros(4, dtype=cp.int32), habs, True)
    with pytest.raises(ValueError, match="db_bk"):
        CT.backup_rows_backward(g, g, g, 0.0, True, g, g.T)
    with pytest.raises(ValueError, match="src"):
        CT.put_rows_from_acc(cp.zeros((10, 8), cp.float32), cp.zeros(4, cp.int32), g.astype(cp.float64))
    with pytest.raises(ValueError, match="h_out"):
        CT.backup_rows_backward(g, g, g, 0.0, True, g, g, h_out=g[:, :4])
    with pytest.raises(ValueError, match="h_out"):
        CT.backup_rows_backward(g, g, None, 0.0, False, g, None, h_out=g)
    ip, rows = cp.zeros(9, cp.int32), cp.zeros(0, cp.int32)
    x = cp.zeros((3, 4), cp.float32)
    good = cp.zeros((8, 4), cp.float32)
    with pytest.raises(ValueError, match="base dw_downT"):
        CT.ffn_weight_grads(ip, rows, rows, x, x, g, g, g, g, 8, True, base=(good, good, good[:, :2]))
    with pytest.raises(ValueError, match="base dw_gate"):
        CT.ffn_weight_grads(ip, rows, rows, x, x, g, g, g, g, 8, True, base=(good, None, good))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_gemm_weight_grads_with_unchecked_nan_inputs_gpu(monkeypatch, dtype, gated):
    """check_finite=False, an Inf in a backup row's x and NaN/Inf in dy: the GEMM route
    (twellpy_train_backup_wgrad_exact redoes what 0 * NaN spoilt) puts NaN and Inf
    exactly where the gather route does, and its finite values are close."""
    prob = [a.astype(dtype) for a in make_problem(**CASES["uneven1"], seed=9, gated=gated)]
    host = prob if gated else [prob[0], None, *prob[1:]]
    _, ctx = (T.gated_forward_train(*host[:4], width=3) if gated else
              T.relu_forward_train(host[0], host[2], host[3], width=3))
    r0, r1 = (int(r) for r in np.asarray(ctx.backup_rows)[[0, -1]])
    host[0][r1, 7] = np.inf
    host[4][r0, 3] = np.nan
    host[4][r1, 9] = -np.inf
    dev = [None if a is None else to_gpu(a) for a in host]

    def grads():
        poison()
        if gated:
            _, c = T.gated_forward_train(*dev[:4], l1=0.05, width=3, check_finite=False)
            return T.gated_backward(c, dev[4])
        _, c = T.relu_forward_train(dev[0], dev[2], dev[3], l1=0.05, width=3, check_finite=False)
        return T.relu_backward(c, dev[4])

    from twellpy.backends import cuda_train

    seen, real = [], cuda_train.ffn_weight_grads

    def spy(*args, base=None, **kw):
        seen.append(base is not None)
        return real(*args, base=base, **kw)

    monkeypatch.setattr(cuda_train, "ffn_weight_grads", spy)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", False)
    gather = [f64(a) for a in grads()]
    monkeypatch.setattr(T, "BACKUP_CHUNK_BYTES", 5 * host[2].shape[0] * 4)  # chunks of 5 rows (H > D)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", True)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_ROWS", 1)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", 0)
    by_gemm = [f64(a) for a in grads()]
    assert seen == [False, True]  # the gather route, then the GEMM route
    for a, b in zip(by_gemm[1:], gather[1:]):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        fin = np.isfinite(b)
        assert fin.mean() > 0.2
        assert rel(a[fin], b[fin]) <= 2 * TOL[dtype]


# the backup rows in chunks, with their weight gradients as GEMMs: a W2-like
# density (about 100 active neurons a token) where nearly every row is a backup row
BACKUP_GEMM_CASES = {
    "dense100": dict(M=1536, D=256, H=1024, nnz=100),
    "hot2000": CASES["hot2000"],
    "odd": CASES["odd"],
    "M1": CASES["M1"],
    "empty_rows": CASES["empty_rows"],
}


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("case", list(BACKUP_GEMM_CASES))
def test_backup_rows_in_chunks_with_gemm_weight_grads_gpu(monkeypatch, case, dtype, gated):
    from twellpy.backends import cpu_train, cuda_train

    prob = [a.astype(dtype) for a in make_problem(**BACKUP_GEMM_CASES[case], seed=5, gated=gated)]
    host = prob if gated else [prob[0], None, *prob[1:]]  # (x, w_gate, w_up, w_down, dy)
    H, D = host[2].shape
    monkeypatch.setattr(T, "BACKUP_CHUNK_BYTES", 7 * max(H, D) * 4)  # chunks of 7 rows
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", True)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_ROWS", 1)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", 0)
    seen = []
    for be in (cpu_train, cuda_train):
        real = be.ffn_weight_grads

        def spy(*args, base=None, _real=real, **kw):
            seen.append(base is not None)
            return _real(*args, base=base, **kw)

        monkeypatch.setattr(be, "ffn_weight_grads", spy)
    dev = [None if a is None else to_gpu(a) for a in host]
    poison()
    out, l1, width = step_outputs(*dev, 4, gated)
    again, _, _ = step_outputs(*dev, 4, gated)
    cpu, cpu_l1, _ = step_outputs(*host, 4, gated)
    R = int((out["token_counts"] > width).sum())
    assert seen == [R >= 1] * 3
    if case != "empty_rows":
        assert R >= 1
    if case == "dense100":
        assert R >= 0.9 * host[0].shape[0]
    ref = dense_gated(*host, 0.05) if gated else dense_relu(*prob, 0.05)
    names = ("dx", "dw_gate", "dw_up", "dw_down") if gated else ("dx", "dw_up", "dw_down")
    assert rel(out["y"], ref["y"]) <= TOL[dtype]
    for i, name in enumerate(names):
        got = out[f"grad{i}"]
        assert rel(got, ref[name]) <= TOL[dtype], (name, rel(got, ref[name]))
        assert rel(got, cpu[f"grad{i}"]) <= 2 * TOL[dtype], name
        assert got.tobytes() == again[f"grad{i}"].tobytes(), name  # deterministic
    assert l1 == pytest.approx(ref["l1"], rel=TOL[dtype])


@pytest.fixture
def pooled_allocator():
    """CuPy's memory pool for one test, under compute-sanitizer too.

    Memcheck runs (``TWELLPY_SANITIZE=1``) take every array straight from cudaMalloc
    (see conftest), and the cudaFree of a temporary waits for the whole device, a
    held stream included: the backward then looked as if it waited for its own
    kernels (4.15 s and 4.24 s under memcheck on 2026-12-06, H100). Normal runs
    always have the pool, so the timing is measured as users see it."""
    import cupy as cp

    if os.environ.get("TWELLPY_SANITIZE") != "1":
        yield
        return
    pool = cp.cuda.MemoryPool()
    cp.cuda.set_allocator(pool.malloc)
    try:
        yield
    finally:
        cp.cuda.Device().synchronize()
        cp.cuda.set_allocator(None)
        pool.free_all_blocks()


@pytest.mark.parametrize("gated", [True, False])
def test_backward_check_of_dy_does_not_wait_for_its_own_kernels(monkeypatch, gated, pooled_allocator):
    # the NaN/Inf count of dy is queued first and read only after every backward
    # kernel is queued: (1) with the stream held *before* the call, the backward
    # still queues its kernels at once (the old synchronous check waited for the
    # held stream first); (2) a hold queued after the count does not keep the call
    # from returning; (3) a NaN still raises before the call returns
    import threading
    import time

    import cupy as cp
    from _stream_hold import StreamHold

    *inputs, dy = [a.astype(np.float32) for a in make_problem(M=700, D=64, H=512, nnz=12, sigma=0.5,
                                                                hot=(3, 300), seed=21, gated=gated)]
    fwd, bwd = (T.gated_forward_train, T.gated_backward) if gated else (T.relu_forward_train, T.relu_backward)
    y, ctx = fwd(*[to_gpu(a) for a in inputs], l1=0.05, width=16)  # width 16: some rows are backup rows
    assert ctx.R > 0
    want = [f64(g) for g in bwd(fwd(*inputs, l1=0.05, width=16)[1], dy)]  # CPU backend
    dy_gpu = to_gpu(dy)
    bwd(ctx, dy_gpu)  # compiles and loads every kernel of the backward outside the timed calls
    cp.cuda.Device().synchronize()
    hold = StreamHold()
    be = ctx._be
    backward_ell = be.ffn_backward_ell
    seen = {}

    def held_backward_ell(*a, **k):
        seen["stream_still_held"] = int(hold._flag[0]) == 0
        if seen.get("hold_here"):
            hold.enqueue()
        return backward_ell(*a, **k)

    monkeypatch.setattr(be, "ffn_backward_ell", held_backward_ell)
    # (1) held before the call: the first kernel is queued while the hold is still on
    hold.enqueue()
    release = threading.Timer(0.5, hold.release)
    release.start()
    grads = bwd(ctx, dy_gpu)
    release.join()
    cp.cuda.Device().synchronize()
    assert seen["stream_still_held"], "the backward waited for earlier work before queuing its kernels"
    for g, r in zip(grads, want):
        assert rel(g, r) <= 2e-5
    # (2) held after the count: the call returns while its kernels wait
    hold.rearm()
    seen["hold_here"] = True
    poison()
    t0 = time.perf_counter()
    grads = bwd(ctx, dy_gpu)
    returned_after = time.perf_counter() - t0
    hold.release()
    cp.cuda.Device().synchronize()
    assert returned_after < 2.0, f"the backward waited {returned_after:.2f} s for its own kernels"
    for g, r in zip(grads, want):
        assert rel(g, r) <= 2e-5
    # (3) NaN in dy
    hold.rearm()
    bad = dy_gpu.copy()
    bad[5, 7] = cp.nan
    release = threading.Timer(0.2, hold.release)
    release.start()
    with pytest.raises(ValueError, match="dy contains 1 NaN and 0 Inf"):
        bwd(ctx, bad)
    release.join()
    cp.cuda.Device().synchronize()
    for g, r in zip(bwd(ctx, dy_gpu), want):  # the context is still usable
        assert rel(g, r) <= 2e-5


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16])
@pytest.mark.parametrize("gated", [True, False])
def test_split_training_step_gives_the_fused_bits(monkeypatch, case, dtype, gated):
    """The split ELL forward (y from twellpy_spmm_resident with a slice of w_down,
    h = g * u formed while staging) and backward (dx from slices of w_up and
    w_gate) give the fused kernels' bits for y, u and every gradient, on every
    case of CASES (uneven rows, a token firing 2000 neurons, empty rows, M = 1,
    odd shapes); shapes whose slices cannot fit (D not a multiple of the vector
    width, H = 11008 with two slices) keep the fused kernels."""
    import cupy as cp

    from twellpy.backends import cuda, cuda_train

    *inputs, dy = [a.astype(dtype) for a in make_problem(**CASES[case], seed=13, gated=gated)]
    dev = [to_gpu(a) for a in inputs]
    dyg = to_gpu(dy)
    fwd, bwd = (T.gated_forward_train, T.gated_backward) if gated else (T.relu_forward_train, T.relu_backward)
    launch = cuda._resident_spmm
    outs = {}
    for split in (False, True):
        calls = []

        def counted(*a, **k):
            calls.append("dual" if k.get("B2") is not None else "single")
            return launch(*a, **k)

        monkeypatch.setattr(cuda_train, "SPLIT", split)
        monkeypatch.setattr(cuda, "_resident_spmm", counted)
        poison()
        y, ctx = fwd(*dev, l1=0.05)
        poison()
        grads = bwd(ctx, dyg)
        outs[split] = (y, ctx.uvals if gated else ctx.gvals) + tuple(grads)
        D, H, W = ctx.D, ctx.H, ctx.width
        vec_ok = D % (16 // np.dtype(dtype).itemsize) == 0
        fwd_fits = vec_ok and cuda._resident_plan(ctx.M, H, D, 0, dtype, dyg, dyg, mode=True) is not None
        bwd_fits = vec_ok and cuda._resident_plan(ctx.M, H, D, 0, dtype, dyg, dyg, mode=True, dual=gated) is not None
        want = [] if not split else ((["single"] if fwd_fits and W else [])
                                     + ([("dual" if gated else "single")] if bwd_fits and W else []))
        assert calls == want, (split, calls, want)
    u = np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32
    for a, b in zip(outs[False], outs[True]):
        assert bool((cp.asarray(a).view(u) == cp.asarray(b).view(u)).all())



ROW_CASES = dict(CASES, w1_shape=dict(M=512, D=2048, H=5632, nnz=30, sigma=0.3),
                 fp64_edge=dict(M=64, D=512, H=700, nnz=40))


# float64 runs the smaller cases only (the same loops with N = 2 elements a vector)
ROW_CASE_DTYPES = ([(c, d) for c in ROW_CASES for d in (np.dtype(np.float32), bfloat16)]
                   + [(c, np.dtype(np.float64)) for c in ("uniform", "odd", "fp64_edge", "M1")])


@pytest.mark.parametrize("case, dtype", ROW_CASE_DTYPES, ids=lambda v: str(v))
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("variant, two_pass", [({}, False), ({"TW_XSRC_SMEM": 1, "TW_SLOT_BATCH": 3}, False),
                                               ({}, True)], ids=["default", "smem-b3", "two-pass"])
def test_training_row_loops_give_the_vector_loop_bits(monkeypatch, case, dtype, gated, variant, two_pass):
    """The ELL kernels' row-keeping loops (vec = 2, cuda_train.ROWS), in one pass or two
    (cuda_train.TWO_PASS: y and dx by twellpy_train_ell_y / _ell_dx), give the bits of the
    one-pass loops that re-read the row per slot (vec = 1, ROWS = None) for y, u and every
    gradient, on every case (a token firing 2000 neurons, empty rows, M = 1, odd D that
    takes neither, D = 4096 past the registers' reach, which keeps vec = 1)."""
    import cupy as cp

    from twellpy.backends import cuda_train

    *inputs, dy = [a.astype(dtype) for a in make_problem(**ROW_CASES[case], seed=17, gated=gated)]
    dev = [to_gpu(a) for a in inputs]
    dyg = to_gpu(dy)
    fwd, bwd = (T.gated_forward_train, T.gated_backward) if gated else (T.relu_forward_train, T.relu_backward)
    outs = {}
    for label, rows, two in (("row", variant, two_pass), ("vec1", None, False)):
        monkeypatch.setattr(cuda_train, "ROWS", rows)
        monkeypatch.setattr(cuda_train, "TWO_PASS", two)
        poison()
        y, ctx = fwd(*dev, l1=0.05)
        poison()
        grads = bwd(ctx, dyg)
        outs[label] = (y, ctx.uvals if gated else ctx.gvals) + tuple(grads)
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    for name, a, b in zip(("y", "u", "dx", "dw_a", "dw_b", "dw_c"), outs["row"], outs["vec1"]):
        assert bool((cp.asarray(a).view(u) == cp.asarray(b).view(u)).all()), name
    ref = (dense_gated if gated else dense_relu)(*inputs, dy, 0.05)
    assert rel(outs["row"][0], ref["y"]) <= TOL[np.dtype(dtype)]


@pytest.mark.parametrize("gated", [True, False])
def test_split_training_step_refuses_an_empty_model_dimension(monkeypatch, gated):
    """D = 0 with the split forced on: refused before any kernel, like inference and the CPU
    backend (test_ops_io_edge_cases.py). The resident plan's own 0-column case, which this test
    reached before training refused empty layers, is test_resident_spmm_with_no_output_columns."""
    import cupy as cp

    from twellpy.backends import cuda_train

    monkeypatch.setattr(cuda_train, "SPLIT", True)
    M, H = 7, 16
    x = cp.zeros((M, 0), np.float32)
    w_gate, w_up, w_down = cp.zeros((H, 0), np.float32), cp.zeros((H, 0), np.float32), cp.zeros((0, H), np.float32)
    with pytest.raises(ValueError, match=r"w_up has shape \(16, 0\), expected \(H, D\) with H, D >= 1"):
        if gated:
            T.gated_forward_train(x, w_gate, w_up, w_down, l1=0.05)
        else:
            T.relu_forward_train(x, w_up, w_down, l1=0.05)


def test_resident_spmm_with_no_output_columns(monkeypatch):
    """ops.spmm with B of 0 columns and the resident kernel forced on: a (M, 0) result."""
    import cupy as cp

    from twellpy.backends import cuda

    monkeypatch.setattr(cuda, "SPMM_RESIDENT", True)
    A = tw.TwELL.from_dense(cp.eye(64, 256, dtype=np.float32))
    out = ops.spmm(A, cp.zeros((256, 0), np.float32))
    assert out.shape == (64, 0)

def test_split_backward_fits_the_reference_shape():
    """Two bf16 slices of a 5632-row weight (W1's w_up and w_gate) fit this GPU's
    shared memory, so the benchmark's split backward really runs split."""
    import cupy as cp

    from twellpy.backends import cuda

    w = cp.zeros((5632, 2048), bfloat16)
    plan = cuda._resident_plan(16384, 5632, 2048, 0, bfloat16, w, w, w, mode=True, dual=True)
    assert plan is not None and plan[0] == 1, plan


@pytest.mark.parametrize("M,W", [(0, 5), (1, 3), (1023, 30), (8192, 30), (8193, 30), (70000, 31), (4096, 0),
                                 (4096, 10**6)])
def test_row_maps_kernel_matches_cpu(M, W):
    """The Hybrid's row maps built on the device (one block, rounds of 8192 rows
    with a carry) equal the numpy twin; nothing is written past M + R."""
    import cupy as cp

    from twellpy.backends import cpu_train, cuda_train

    rng = np.random.default_rng(M + W)
    counts = rng.poisson(30, M).astype(np.int32)
    counts[rng.random(M) < 0.01] = 700                        # heavy tokens
    R = int(np.count_nonzero(counts > W))
    want = cpu_train.row_maps(counts, W, R)
    guard = cp.full(M + R + 64, -0x3C3C3C3C, dtype=cp.int32)  # poisoned, with words past the end
    got = cuda_train.row_maps(cp.asarray(counts), W, R)
    assert got.dtype == cp.int32 and got.shape == (M + R,)
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    # the kernel itself, into a larger poisoned buffer: the words past M + R stay
    if M:
        cuda_train._launch_row_maps(cp.asarray(counts), guard, W, R, 0, M, None, True)
        np.testing.assert_array_equal(cp.asnumpy(guard[:M + R]), want)
        assert bool((guard[M + R:] == -0x3C3C3C3C).all())


# ---------------------------------------------------------------------------
# speculative layout (issue 5): W and the backup capacity from the layer's
# previous step, the token counts read only after the ELL kernel is queued
@pytest.fixture
def fresh_layouts(monkeypatch):
    """Every test starts with no remembered layer (and leaves none behind)."""
    monkeypatch.setattr(T, "_LAYOUTS", type(T._LAYOUTS)())
    return T._LAYOUTS


def _hit_and_exact(x, wg, wu, wd, dy, width, gated, ctxs):
    """A first speculative step (it remembers the layout), a second (a hit) and a
    non-speculative one, pools poisoned before each: ``step_outputs`` of the last two."""
    poison()
    step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
    poison()
    hit = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
    poison()
    return hit, step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=False)


def _gpu_problem(case, dtype, gated, seed):
    prob = [to_gpu(a.astype(dtype)) for a in make_problem(**CASES[case], seed=seed, gated=gated)]
    return prob if gated else (prob[0], None, *prob[1:])


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_speculative_step_gives_the_exact_bits_gpu(fresh_layouts, case, dtype, gated):
    """Second call of a layer on the previous call's layout (backup GEMMs over the
    R wide rows, as the exact path, the unused capacity never read): every output
    equals the exact path's with the same width strategy, bit for bit, with pools poisoned
    (uniform, sigma 0.3 and 1.0, a token firing 2000 neurons, empty rows, M = 1,
    odd shapes, D = 4096 with H = 11008)."""
    x, wg, wu, wd, dy = _gpu_problem(case, dtype, gated, seed=51)
    for width in ("auto", 2):
        ctxs = []
        (spec, l1_spec, w_spec), (exact, l1_exact, w_exact) = _hit_and_exact(x, wg, wu, wd, dy, width, gated, ctxs)
        assert [c.speculation for c in ctxs] == ["exact", "hit", "off"], width
        assert w_spec == w_exact and l1_spec == l1_exact, width
        for k in exact:
            assert spec[k].shape == exact[k].shape, (width, k)
            assert spec[k].tobytes() == exact[k].tobytes(), (width, k)
        assert ctxs[1].stats["n_backup_rows"] == ctxs[2].stats["n_backup_rows"]
        assert ctxs[1].stats["l0"] == ctxs[2].stats["l0"] and ctxs[1].nnz_total == ctxs[2].nnz_total


@pytest.mark.parametrize("count_pack", [True, False], ids=["count_pack", "count_then_pack"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_speculative_count_pack_gives_the_exact_bits_gpu(fresh_layouts, monkeypatch, count_pack, case, dtype, gated):
    """COUNT_PACK on (the default) and off, on the device (on:
    twellpy_train_relu_to_hybrid's modes 1 and 2, count and pack in one read of z, then
    the wide rows' backup rows): a hit gives the exact path's bits, pools poisoned; so
    does a step re-run because its capacity was short."""
    from twellpy.backends import cuda_train

    monkeypatch.setattr(T, "COUNT_PACK", count_pack)
    one = [1] if count_pack else []  # the relu_count_pack calls of a hit
    calls, real = [], cuda_train.relu_count_pack
    monkeypatch.setattr(cuda_train, "relu_count_pack", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, wg, wu, wd, dy = _gpu_problem(case, dtype, gated, seed=57)
    ctxs = []
    poison()
    step_outputs(x, wg, wu, wd, dy, 2, gated, ctxs, speculate=True)
    poison()
    spec, _, _ = step_outputs(x, wg, wu, wd, dy, 2, gated, ctxs, speculate=True)
    poison()
    exact, _, _ = step_outputs(x, wg, wu, wd, dy, 2, gated, ctxs, speculate=False)
    assert [c.speculation for c in ctxs] == ["exact", "hit", "off"] and calls == one
    for k in exact:
        assert spec[k].tobytes() == exact[k].tobytes(), k
    if ctxs[-1].R:
        (key,) = fresh_layouts
        fresh_layouts[key] = T._Layout(2, ctxs[-1].R - 1, T._SPEC_SLACK)
        poison()
        again, _, _ = step_outputs(x, wg, wu, wd, dy, 2, gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == "rerun" and calls == one * 2
        for k in exact:
            assert again[k].tobytes() == exact[k].tobytes(), k


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_speculative_overflow_runs_the_step_again_gpu(fresh_layouts, dtype, gated):
    """A step with more wide rows than the remembered capacity is run again on the
    exact path: the same bits as speculate=False, the float64 reference's values,
    a larger capacity for the next step, which then fits."""
    *inputs, dy = [a.astype(dtype) for a in make_problem(M=1024, D=256, H=1024, nnz=30, sigma=0.3, seed=52,
                                                           gated=gated)]
    narrow = inputs[0].copy()
    narrow[8:, 1:] = 0   # at most 8 rows can be wide: capacity 16 or 32
    dev = [to_gpu(a) for a in inputs]
    x, wg, wu, wd = dev if gated else (dev[0], None, *dev[1:])
    dyg = to_gpu(dy)
    ctxs = []
    step_outputs(to_gpu(narrow), wg, wu, wd, dyg, 24, gated, ctxs, speculate=True)
    (lay,) = fresh_layouts.values()
    assert lay.capacity <= 32
    poison()
    got, _, _ = step_outputs(x, wg, wu, wd, dyg, 24, gated, ctxs, speculate=True)
    assert ctxs[-1].speculation == "rerun" and ctxs[-1].R > 32, ctxs[-1].R
    poison()
    want, _, _ = step_outputs(x, wg, wu, wd, dyg, 24, gated, ctxs, speculate=False)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
    (lay,) = fresh_layouts.values()
    assert lay.capacity > ctxs[-1].R and lay.slack == 2 * T._SPEC_SLACK and lay.skip == 1
    for how in ("exact", "hit"):   # one step backing off, then the grown capacity holds
        poison()
        again, _, _ = step_outputs(x, wg, wu, wd, dyg, 24, gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == how
        for k in want:
            assert again[k].tobytes() == want[k].tobytes(), (how, k)
    ref = dense_gated(*inputs, dy, 0.05) if gated else dense_relu(*inputs, dy, 0.05)
    assert rel(got["y"], ref["y"]) <= TOL[dtype]
    names = ("dx", "dw_gate", "dw_up", "dw_down") if gated else ("dx", "dw_up", "dw_down")
    for i, name in enumerate(names):
        assert rel(got[f"grad{i}"], ref[name]) <= TOL[dtype], name


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_speculative_capacity_boundary_gpu(fresh_layouts, dtype, gated):
    """Room for exactly the wide rows is a hit, one row less a re-run; rows with
    exactly W active neurons stay ELL rows; a remembered W that width="auto" would
    not pick now is a re-run with auto's bits, even with room for every row; every
    result is the exact path's for its strategy, bit for bit, pools poisoned (the
    CPU twins: test_ffn_train.py)."""
    x, wg, wu, wd, dy = _gpu_problem("uneven03", dtype, gated, seed=55)
    ctxs = []
    poison()
    auto, _, w_auto = step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=False)
    counts = f64(auto["token_counts"]).astype(np.int64)
    W = next(int(w) for w in np.unique(counts)[::-1]
             if w >= 1 and (counts == w).any() and (counts > w).sum() >= 2)
    R = int((counts > W).sum())
    poison()
    want, _, _ = step_outputs(x, wg, wu, wd, dy, W, gated, ctxs, speculate=True)   # seeds W's entry
    poison()
    step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=True)   # seeds auto's entry
    key_w, key_auto = fresh_layouts
    M = ctxs[0].M
    for key, width, lay, how, ref in ((key_w, W, T._Layout(W, R, T._SPEC_SLACK), "hit", want),
                                      (key_w, W, T._Layout(W, R - 1, T._SPEC_SLACK), "rerun", want),
                                      (key_auto, "auto", T._Layout(w_auto + 8, M, T._SPEC_SLACK), "rerun", auto),
                                      (key_auto, "auto", T._Layout(max(w_auto - 8, 1), M, T._SPEC_SLACK), "rerun",
                                       auto)):
        fresh_layouts[key] = lay
        poison()
        got, _, w_got = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == how, (width, lay, R)
        assert w_got == (W if width == W else w_auto)
        for k in ref:
            assert got[k].tobytes() == ref[k].tobytes(), (width, how, k)
    assert not np.isin(np.flatnonzero(counts == W), f64(want["backup_rows"])).any()


def test_speculation_is_on_by_default_on_the_gpu(fresh_layouts, monkeypatch):
    """TWELLPY_TRAIN_SPECULATE's default ("auto") speculates on GPU arrays: the
    second step of a layer is a hit, with the bits of speculate=False."""
    monkeypatch.setattr(T, "SPECULATE", "auto")
    x, wg, wu, wd, dy = _gpu_problem("uneven03", np.dtype(np.float32), True, seed=56)
    ctxs = []
    for _ in range(2):
        got, _, _ = step_outputs(x, wg, wu, wd, dy, "auto", True, ctxs)
    want, _, _ = step_outputs(x, wg, wu, wd, dy, "auto", True, ctxs, speculate=False)
    assert [c.speculation for c in ctxs] == ["exact", "hit", "off"]
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
def test_speculative_forward_queues_the_ell_kernel_before_reading_counts(fresh_layouts, monkeypatch, gated,
                                                                         pooled_allocator):
    """What the speculation is for: with the stream held before the call, the
    speculative forward reaches the ELL kernel while the hold is still on (it has
    not waited for the counts); the exact path waits for them first. A NaN in x
    is still reported, and the results are the exact ones. ``pooled_allocator``:
    under memcheck (no pool) the cudaFree of z before the ELL kernel would wait
    for the held stream."""
    import threading

    import cupy as cp
    from _stream_hold import StreamHold

    *inputs, dy = [a.astype(np.float32) for a in make_problem(M=700, D=64, H=512, nnz=12, sigma=0.5,
                                                                hot=(3, 300), seed=53, gated=gated)]
    dev = [to_gpu(a) for a in inputs]
    fwd = T.gated_forward_train if gated else T.relu_forward_train
    want_y, want_ctx = fwd(*inputs, l1=0.05, width=16)                     # CPU backend
    _, seed_ctx = fwd(*dev, l1=0.05, width=16, speculate=True)   # seeds the layout; compiles every kernel
    # one hit outside the held window, so the pools already hold the hit's block sizes
    # (the capacity's buffers differ from the seeding call's): no allocation in the window
    assert fwd(*dev, l1=0.05, width=16, speculate=True)[1].speculation == "hit"
    cp.cuda.Device().synchronize()
    hold = StreamHold()
    be = seed_ctx._be
    forward_ell = be.ffn_forward_ell
    seen = {}

    def watched_forward_ell(*a, **k):
        seen["stream_still_held"] = int(hold._flag[0]) == 0
        return forward_ell(*a, **k)

    monkeypatch.setattr(be, "ffn_forward_ell", watched_forward_ell)
    for speculate, ahead in ((True, True), (False, False)):
        hold.rearm()
        hold.enqueue()
        release = threading.Timer(0.5, hold.release)
        release.start()
        y, ctx = fwd(*dev, l1=0.05, width=16, speculate=speculate)
        release.join()
        cp.cuda.Device().synchronize()
        assert seen["stream_still_held"] is ahead, speculate
        assert ctx.speculation == ("hit" if speculate else "off")
        assert ctx.R == want_ctx.R > 0 and ctx.width == 16
        assert rel(y, want_y) <= 2e-5
    # a NaN is found when the counts arrive (after the ELL kernel is queued) and still raises
    bad = dev[0].copy()
    bad[5, 7] = cp.nan
    with pytest.raises(ValueError, match="x contains 1 NaN and 0 Inf"):
        fwd(bad, *dev[1:], l1=0.05, width=16, speculate=True)
    y, ctx = fwd(*dev, l1=0.05, width=16, speculate=True)
    assert ctx.speculation == "hit" and rel(y, want_y) <= 2e-5


def test_speculative_torch_autograd_cross_check(fresh_layouts):
    """Torch tensors in and out through DLPack, the second step on the first one's
    layout: within tolerance of torch's dense autograd and bit-equal to the exact path."""
    torch = pytest.importorskip("torch")
    host = make_problem(M=4096, D=512, H=1408, nnz=30, sigma=0.3, seed=54)
    l1 = 2e-3
    tt = [torch.tensor(a, device="cuda", dtype=torch.bfloat16) for a in host]
    x, wg, wu, wd = (t.clone().requires_grad_(True) for t in tt[:4])
    dy = tt[4]
    h = torch.relu(x @ wg.T) * (x @ wu.T)
    y_t = h @ wd.T
    pen = l1 * h.abs().sum() / x.shape[0]
    torch.autograd.backward([y_t, pen], [dy, torch.ones_like(pen)])
    outs, paths = [], []
    for speculate in (True, True, False):
        y, ctx = T.gated_forward_train(*tt[:4], l1=l1, speculate=speculate)
        outs.append((y,) + T.gated_backward(ctx, dy))
        paths.append(ctx.speculation)
        if speculate:
            width = ctx.width
    # the second call must have used the first one's layout (DLPack views of the same
    # torch storage give the same key), else the bit comparison below proves nothing
    assert paths == ["exact", "hit", "off"], paths
    assert ctx.width == width
    ref = dense_gated(*(t.float().cpu().numpy() for t in tt), l1)
    for name, ours, exact, theirs in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), outs[1], outs[2],
                                         (y_t, x.grad, wg.grad, wu.grad, wd.grad)):
        assert isinstance(ours, torch.Tensor)
        assert torch.equal(ours.view(torch.int16), exact.view(torch.int16)), name
        a = ours.float().cpu().numpy()
        assert rel(a, ref[name]) <= 1e-2, (name, rel(a, ref[name]))
        assert rel(a, theirs.detach().float().cpu().numpy()) <= 2e-2, name


@pytest.mark.parametrize("M,W", [(1, 3), (1023, 30), (8193, 30), (70000, 31), (4096, 0)])
@pytest.mark.parametrize("room", ["more", "fewer"])
def test_row_maps_kernel_with_a_capacity_matches_cpu(M, W, room):
    """Row maps for a capacity chosen before the counts (the speculative forward):
    unused backup slots -1, wide rows past a short capacity -1, nothing written
    past M + capacity; the same as the numpy twin."""
    import cupy as cp

    from twellpy.backends import cpu_train, cuda_train

    rng = np.random.default_rng(M + W + 1)
    counts = rng.poisson(30, M).astype(np.int32)
    counts[rng.random(M) < 0.01] = 700
    wide = int(np.count_nonzero(counts > W))
    cap = wide + 2000 if room == "more" else wide // 2
    want = cpu_train.row_maps(counts, W, cap, capacity=True)
    got = cuda_train.row_maps(cp.asarray(counts), W, cap, capacity=True)
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    guard = cp.full(M + cap + 64, -0x3C3C3C3C, dtype=cp.int32)
    cuda_train._launch_row_maps(cp.asarray(counts), guard, W, cap, 0, M, None, True)
    np.testing.assert_array_equal(cp.asnumpy(guard[:M + cap]), want)
    assert bool((guard[M + cap:] == -0x3C3C3C3C).all())


def test_queue_to_host_waits_for_its_copy_only(pooled_allocator):
    """The counts' copy lands while later work on the stream is still held
    (``pooled_allocator``: without a pool, memcheck's cudaFree would wait for the hold)."""
    import threading

    import cupy as cp
    from _stream_hold import StreamHold

    from twellpy.backends import cuda_train

    a = cp.arange(70001, dtype=cp.int32)
    hold = StreamHold()
    pending = cuda_train.queue_to_host(a)
    hold.enqueue()
    release = threading.Timer(3.0, hold.release)
    release.start()
    got = pending.read()
    still_held = int(hold._flag[0]) == 0
    release.join()
    cp.cuda.Device().synchronize()
    assert still_held
    np.testing.assert_array_equal(got, np.arange(70001, dtype=np.int32))
    empty = cuda_train.queue_to_host(cp.zeros(0, cp.int32)).read()
    assert empty.shape == (0,) and empty.dtype == np.int32
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda_train.queue_to_host(cp.zeros((4, 4), cp.int32).T)


@pytest.mark.parametrize("route", ["gather", "gemm"], ids=["backup_gather", "backup_gemm"])
@pytest.mark.parametrize("width", ["auto", 3])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case,dtype", [(c, d) for c in CASES for d in (np.dtype(np.float32), bfloat16)]
                         + [(c, np.dtype(np.float64)) for c in ("uneven03", "hot2000", "M1", "odd")],
                         ids=lambda v: str(v))
def test_dh_by_neuron_matches_the_row_flow_and_the_reference_gpu(monkeypatch, route, width, gated, case, dtype):
    """DH_BY_NEURON on the device (twellpy_train_wgrad_dh: dh, du, dg with the weight
    gradients, one block per neuron; then twellpy_train_ell_dx leaving the backup rows'
    dx alone): the forward's bits unchanged, the gradients within the dtype's tolerance
    of the row-oriented flow's (the dot products' order differs) and of float64,
    the same bits on a second run, pools poisoned. Rows that vector loads cannot take
    (odd D) run the row flow."""
    from twellpy.backends import cuda_train

    if route == "gemm":
        monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", True)
        monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_ROWS", 1)
        monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", 0)
    calls, real = [], cuda_train.ffn_backward_by_neuron
    monkeypatch.setattr(cuda_train, "ffn_backward_by_neuron", lambda *a, **k: calls.append(1) or real(*a, **k))
    host = [a.astype(dtype) for a in make_problem(**CASES[case], seed=61, gated=gated)]
    x, wg, wu, wd, dy = _gpu_problem(case, dtype, gated, seed=61)
    monkeypatch.setattr(T, "DH_BY_NEURON", False)
    poison()
    ctxs = []
    rows, _, _ = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs)
    wide = np.flatnonzero(ctxs[0].row_map.get() >= 0)  # backup rows: dx from the same step 2 both ways
    monkeypatch.setattr(T, "DH_BY_NEURON", True)
    runs = []
    for _ in range(2):
        poison()
        runs.append(step_outputs(x, wg, wu, wd, dy, width, gated)[0])
    assert calls == ([] if case == "odd" else [1, 1])
    ref = dense_gated(*host, 0.05) if gated else dense_relu(*host, 0.05)
    names = ("dx", "dw_gate", "dw_up", "dw_down") if gated else ("dx", "dw_up", "dw_down")
    for k in rows:
        assert runs[1][k].tobytes() == runs[0][k].tobytes(), k
        if not k.startswith("grad"):
            assert runs[0][k].tobytes() == rows[k].tobytes(), k
    assert runs[0]["grad0"][wide].tobytes() == rows["grad0"][wide].tobytes(), "the backup rows' dx"
    for i, name in enumerate(names):
        got = runs[0][f"grad{i}"]
        assert rel(got, rows[f"grad{i}"]) <= TOL[dtype], (name, rel(got, rows[f"grad{i}"]))
        assert rel(got, ref[name]) <= TOL[dtype], (name, rel(got, ref[name]))


def _poison_both_streams():
    """Poison the pools of the caller's stream and of this thread's side stream."""
    from twellpy.backends import cuda_train

    poison()
    with cuda_train._side_stream():
        poison()


@pytest.mark.parametrize("on_user_stream", [False, True], ids=["null_stream", "user_stream"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", ["uniform", "uneven03", "hot2000", "M1", "odd", "wide_D"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_side_stream_gives_the_in_order_bits_gpu(fresh_layouts, monkeypatch, on_user_stream, case, dtype, gated):
    """TWELLPY_TRAIN_SIDE_STREAM on (the default: the backward's transpose beside the ELL
    kernel, a counted-and-packed forward's row maps and backup rows beside the ELL
    forward) and off give the same bits for the exact step, a speculative hit and the
    backup rows' GEMM route, pools of both streams poisoned; on the caller's own
    non-blocking stream too, where nothing orders the two streams but the events; and
    with the backward's ELL kernel launched before the transpose (BWD_ELL_FIRST) too."""
    import cupy as cp

    from twellpy.backends import cuda_train

    x, wg, wu, wd, dy = _gpu_problem(case, dtype, gated, seed=61)
    made = []
    real = cuda_train.SideWork

    def counted(enabled=True):  # counts the side streams really used
        if enabled:
            made.append(1)
        return real(enabled)

    monkeypatch.setattr(cuda_train, "SideWork", counted)
    user = cp.cuda.Stream(non_blocking=True) if on_user_stream else cp.cuda.Stream.null

    def run(side, ell_first=False, **kw):
        monkeypatch.setattr(T, "SIDE_STREAM", side)
        monkeypatch.setattr(T, "BWD_ELL_FIRST", ell_first)
        monkeypatch.setattr(T, "_LAYOUTS", type(T._LAYOUTS)())
        outs, ctxs = [], []
        with user:
            for speculate in (False, True, True):  # exact, then a remembered layout's hit
                _poison_both_streams()
                outs.append(step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=speculate, **kw)[0])
        assert [c.speculation for c in ctxs] == ["off", "exact", "hit"]
        return outs

    for gemm_route in (False, True):
        # the route's thresholds at 0: every backup row's weight gradients by GEMM (ell-only transpose)
        monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_ROWS", 0 if gemm_route else T.BACKUP_WGRAD_GEMM_MIN_ROWS)
        monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", 0 if gemm_route else T.BACKUP_WGRAD_GEMM_MIN_MEAN)
        made.clear()
        on = run(True)
        assert len(made) >= 4  # a backward per step, the hit's forward (count and pack)
        on_first = run(True, ell_first=True)
        made.clear()
        off = run(False)
        assert made == []
        off_first = run(False, ell_first=True)
        for got in (on, on_first, off_first):
            for a, b in zip(got, off):
                for k in b:
                    assert a[k].tobytes() == b[k].tobytes(), (gemm_route, k)


@pytest.mark.parametrize("on_user_stream", [False, True], ids=["null_stream", "user_stream"])
def test_side_work_started_early_sees_what_came_before_gpu(on_user_stream):
    """SideWork.start_here(): side work queued after the main stream's next kernels
    waits only for what the main stream had queued at start_here, reads those
    values, and the main stream sees the side work's results after join()."""
    import cupy as cp

    from twellpy.backends import cuda_train

    user = cp.cuda.Stream(non_blocking=True) if on_user_stream else cp.cuda.Stream.null
    with user:
        n = 1 << 22
        a = cp.arange(n, dtype=cp.float32)
        side = cuda_train.SideWork().start_here()
        b = a * 3.0  # main stream, queued before the side work
        for _ in range(20):
            b = cp.sqrt(b * b + 1.0)  # keep the main stream busy
        with side:
            c = a + 1.0  # side stream
        side.join()
        got = (c - a).get()  # the main stream, after the join
    assert (got == 1.0).all()
    assert cp.asnumpy(b[:4]).tolist() == pytest.approx([np.sqrt(20.0 + 9.0 * k * k) for k in range(4)], rel=1e-5)


@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", ["uniform", "uneven03", "hot2000", "M1", "odd", "empty_rows"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_gate_chunks_give_the_one_chunk_bits_gpu(fresh_layouts, monkeypatch, chunks, case, dtype, gated):
    """TWELLPY_TRAIN_GATE_CHUNKS: a counted-and-packed forward whose gate GEMM and count
    and pack take turns over row chunks (one relu_count_pack call a chunk, each on its
    rows only) gives the one-chunk step's bits, pools poisoned, wherever cuBLAS computes
    the row ranges' gate products as it does the whole batch's. It may pick another
    kernel for fewer rows (on an H100 it did at D = 37): then the steps must agree to
    the dtype's tolerance, as two exact steps from different gate bits do."""
    import cupy as cp
    from twellpy.backends import cuda_train

    x, wg, wu, wd, dy = _gpu_problem(case, dtype, gated, seed=67)
    w_act = wg if gated else wu
    M = x.shape[0]
    step = -(-M // chunks)
    z_whole = cuda_train.gemm(x, w_act.T, x.dtype)
    z_rows = cp.empty_like(z_whole)
    for a in range(0, M, step):
        cuda_train.gemm(x[a:a + step], w_act.T, x.dtype, into=z_rows[a:a + step])
    same_gate_bits = z_whole.tobytes() == z_rows.tobytes()
    calls, real = [], cuda_train.relu_count_pack
    monkeypatch.setattr(cuda_train, "relu_count_pack", lambda *a, **k: calls.append(k.get("rows")) or real(*a, **k))
    got = {}
    for n in (1, chunks):
        monkeypatch.setattr(T, "GATE_CHUNKS", n)
        monkeypatch.setattr(T, "_LAYOUTS", type(T._LAYOUTS)())
        ctxs = []
        step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=True)
        calls.clear()
        poison()
        got[n], _, _ = step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=True)
        assert [c.speculation for c in ctxs] == ["exact", "hit"]
        step = -(-M // n)
        want = [None] if n == 1 or step >= M else [(a, min(M, a + step)) for a in range(0, M, step)]
        assert calls == want
    for k in got[1]:
        if same_gate_bits:
            assert got[chunks][k].tobytes() == got[1][k].tobytes(), k
        else:
            assert rel(got[chunks][k], got[1][k]) <= TOL[dtype], k


#: the cases of CASES with more than one 256-row gate chunk, and two more that have
CHUNKED_CASES = {**{k: CASES[k] for k in ("uniform", "uneven03", "uneven1", "odd")},
                 "hot2000": dict(M=600, D=64, H=2304, nnz=20, hot=(300, 2000), empty=(0, 256, 599)),
                 "wide_D": dict(M=520, D=4096, H=11008, nnz=30)}


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", list(CHUNKED_CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("width", ["auto", 3])
def test_speculative_chunked_batch_gives_the_exact_bits_gpu(fresh_layouts, monkeypatch, case, dtype, gated, width):
    """TWELLPY_TRAIN_SPECULATE_CHUNKED on the device: gate chunks of 256 rows, each GEMM'd
    into one reused buffer, counted and packed, mapped with the running count of wide
    rows (twellpy_train_row_maps over a row range) and its wide rows written (mode 2
    over a row range) before the next; a hit gives the exact (CSR) path's bits, pools
    poisoned, and a capacity one short runs the step again exactly."""
    from twellpy.backends import cuda_train

    monkeypatch.setattr(T, "GATE_CHUNK_BYTES", 1)
    monkeypatch.setattr(T, "SPECULATE_CHUNKED", True)
    calls, real = [], cuda_train.gate_count_pack_streamed
    monkeypatch.setattr(cuda_train, "gate_count_pack_streamed", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    prob = [to_gpu(a.astype(dtype)) for a in make_problem(**CHUNKED_CASES[case], seed=71, gated=gated)]
    x, wg, wu, wd, dy = prob if gated else (prob[0], None, *prob[1:])
    assert x.shape[0] > 256  # more than one gate chunk: the batch streams
    ctxs = []
    (spec, l1_spec, w_spec), (exact, l1_exact, w_exact) = _hit_and_exact(x, wg, wu, wd, dy, width, gated, ctxs)
    assert [c.speculation for c in ctxs] == ["exact", "hit", "off"] and calls == [256]
    assert w_spec == w_exact and l1_spec == l1_exact
    for k in exact:
        assert spec[k].shape == exact[k].shape and spec[k].tobytes() == exact[k].tobytes(), k
    if ctxs[-1].R:
        (key,) = fresh_layouts
        fresh_layouts[key] = T._Layout(ctxs[-1].width, ctxs[-1].R - 1, T._SPEC_SLACK)
        poison()
        again, _, _ = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == "rerun" and len(calls) == 2
        for k in exact:
            assert again[k].tobytes() == exact[k].tobytes(), k
