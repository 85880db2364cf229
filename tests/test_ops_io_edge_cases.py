"""Edge cases of twellpy.ops, twellpy.save/load and twellpy.jax found in review (CPU only)."""
import io
import warnings
import zipfile

import numpy as np
import pytest
import scipy.sparse as sp

import twellpy as tw
from twellpy import ops


def _activation(seed=0, m=8, n=300):
    """Sparse rows, one full row (a backup row at width 2) and one empty row."""
    rng = np.random.default_rng(seed)
    h = np.maximum(rng.standard_normal((m, n)) - 1.5, 0).astype(np.float32)
    h[2] = rng.uniform(0.5, 2.0, n)
    h[5] = 0
    return h


def _assert_ieee_close(got, ref, tol=1e-5):
    """Same NaN/+Inf/-Inf positions, finite values within ``tol``."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=tol, atol=tol)


def _formats(h):
    return {
        "ell": tw.ELL.from_dense(h),
        "twell": tw.TwELL.from_dense(h, tile=64, slots=8),
        "hybrid": tw.Hybrid.from_dense(h, width=2),
    }


# --------------------------------------------------------------------------
# ops: no spurious numpy warnings from the backup-row GEMMs
# --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ell", "twell", "hybrid"])
def test_spmm_inf_in_b_does_not_warn_and_matches_scipy(fmt):
    h = _activation()
    A = _formats(h)[fmt]
    rng = np.random.default_rng(1)
    B = rng.standard_normal((300, 3)).astype(np.float32)
    B[13, 0] = np.inf  # row 2 (a backup row of the Hybrid) stores column 13
    B[11, 1] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the slot formats are silent, so every format must be
        y = ops.spmm(A, B)
    _assert_ieee_close(y, sp.csr_array(h.astype(np.float64)) @ B.astype(np.float64))


@pytest.mark.parametrize("fmt", ["ell", "twell", "hybrid"])
def test_sddmm_inf_in_y_off_pattern_does_not_warn(fmt):
    h = _activation()
    h[2, 7] = 0.0  # the full row (a backup row of the Hybrid) misses column 7
    A = _formats(h)[fmt]
    rng = np.random.default_rng(2)
    X = rng.standard_normal((8, 4)).astype(np.float32)
    X[2, 0] = 0.0  # so the dense product of that row meets 0 * Inf off the pattern
    Y = rng.standard_normal((300, 4)).astype(np.float32)
    Y[7, 0] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        S = ops.sddmm(X, Y, A)
    with np.errstate(invalid="ignore"):  # the reference's own 0 * Inf, off the pattern
        ref = np.where(h != 0, X.astype(np.float64) @ Y.astype(np.float64).T, 0)
    _assert_ieee_close(S.toarray(), ref)


# --------------------------------------------------------------------------
# ops: numpy subclasses as dense operands
# --------------------------------------------------------------------------
def test_masked_array_operand_is_refused_by_name():
    h = _activation()
    A = tw.Hybrid.from_dense(h, width=2)
    W = np.random.default_rng(3).standard_normal((300, 3)).astype(np.float32)
    Wm = np.ma.masked_array(W, mask=W > 1)
    with pytest.raises(TypeError, match=r"B is a numpy.ma.MaskedArray.*filled"):
        ops.spmm(A, Wm)
    with pytest.raises(TypeError, match=r"B is a numpy.ma.MaskedArray"):
        ops.spmm_t(A, Wm[:8])
    with pytest.raises(TypeError, match=r"X is a numpy.ma.MaskedArray"):
        ops.sddmm(Wm[:8], W, A)
    with pytest.raises(TypeError, match=r"Y is a numpy.ma.MaskedArray"):
        ops.sddmm(W[:8], Wm, A)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix itself warns
def test_matrix_operand_gives_plain_arrays():
    h = _activation()
    rng = np.random.default_rng(4)
    W = rng.standard_normal((300, 3)).astype(np.float32)
    for A in _formats(h).values():
        y = ops.spmm(A, np.matrix(W))
        assert type(y) is np.ndarray
        np.testing.assert_allclose(y, h.astype(np.float64) @ W, rtol=1e-5, atol=1e-5)
        z = ops.spmm_t(A, np.matrix(W[:8]))
        assert type(z) is np.ndarray
        np.testing.assert_allclose(z, h.T.astype(np.float64) @ W[:8], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# ops.transpose keeps the width strategy
# --------------------------------------------------------------------------
@pytest.mark.parametrize("width", ["auto", "min_storage", "quantile:0.5", 3])
def test_transpose_records_width_strategy(width):
    h = _activation()
    A = tw.Hybrid.from_dense(h, width=2)
    T = ops.transpose(A, width=width)
    assert T.width_strategy == tw.Hybrid.from_dense(h.T, width=width).width_strategy
    np.testing.assert_array_equal(T.toarray(), h.T)
    np.testing.assert_array_equal(T.T.toarray(), h)


# --------------------------------------------------------------------------
# io: file objects, non-npz files, damaged compressed archives, versions
# --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ell", "twell", "hybrid"])
def test_save_load_file_objects(tmp_path, fmt):
    h = _activation()
    A = _formats(h)[fmt]
    buf = io.BytesIO()
    tw.save(buf, A)
    assert not buf.closed
    buf.seek(0)
    B = tw.load(buf)
    assert not buf.closed
    np.testing.assert_array_equal(B.toarray(), h)
    path = tmp_path / "a.npz"
    with open(path, "wb") as f:
        tw.save(f, A)
    with open(path, "rb") as f:
        np.testing.assert_array_equal(tw.load(f).toarray(), h)


def test_bad_path_type_names_the_argument():
    A = tw.ELL.from_dense(_activation())
    with pytest.raises(TypeError, match=r"path must be a str, an os.PathLike or a binary file object, got builtins.int"):
        tw.save(3, A)
    with pytest.raises(TypeError, match=r"path must be .*got builtins.NoneType"):
        tw.load(None)


def test_text_mode_file_objects_are_refused(tmp_path):
    A = tw.ELL.from_dense(_activation())
    path = tmp_path / "a.npz"
    with open(path, "w") as f, pytest.raises(TypeError, match=r"path is a text-mode file object.*'wb'"):
        tw.save(f, A)
    tw.save(path, A)
    with open(path, "r") as f, pytest.raises(TypeError, match=r"path is a text-mode file object.*'rb'"):
        tw.load(f)
    with pytest.raises(TypeError, match=r"text-mode.*StringIO"):
        tw.load(io.StringIO("x"))


def test_load_npy_file_is_a_clear_value_error(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros(3))
    with pytest.raises(ValueError, match=r"x.npy is not a readable twellpy .npz file.*not an .npz archive"):
        tw.load(path)


def test_load_damaged_compressed_archive(tmp_path):
    A = tw.Hybrid.from_dense(_activation(), width=2)
    plain = tmp_path / "a.npz"
    tw.save(plain, A)
    with np.load(plain) as z:
        entries = {k: z[k] for k in z.files}
    comp = tmp_path / "c.npz"
    np.savez_compressed(comp, **entries)
    np.testing.assert_array_equal(tw.load(comp).toarray(), A.toarray())  # a compressed file loads
    raw = comp.read_bytes()
    with zipfile.ZipFile(comp) as zf:
        info = zf.getinfo("values.npy")
    # flip bytes inside the deflate stream of one member (after its local header)
    # the data start after the local header (its name and extra lengths are at bytes 26..29)
    h0 = info.header_offset
    start = h0 + 30 + int.from_bytes(raw[h0 + 26:h0 + 28], "little") + int.from_bytes(raw[h0 + 28:h0 + 30], "little")
    seen = set()
    for off in range(0, info.compress_size, 7):
        b = bytearray(raw)
        b[start + off] ^= 0xFF
        bad = tmp_path / "bad.npz"
        bad.write_bytes(bytes(b))
        with pytest.raises(ValueError, match=r"bad.npz is not a readable twellpy .npz file") as e:
            tw.load(bad)
        seen.add(str(e.value).split("(")[1].split(":")[0])
    assert "error" in seen  # zlib.error was among the failures, and it became a ValueError


@pytest.mark.parametrize("version", [np.float64(1.7), np.bool_(True), np.str_("1"), np.array([1, 1])])
def test_load_version_must_be_an_integer_scalar(tmp_path, version):
    A = tw.ELL.from_dense(_activation())
    path = tmp_path / "a.npz"
    tw.save(path, A)
    with np.load(path) as z:
        entries = {k: z[k] for k in z.files}
    entries["__twellpy_version__"] = version
    np.savez(path, **entries)
    with pytest.raises(ValueError, match=r"unreadable __twellpy_version__ entry: expected an integer scalar"):
        tw.load(path)


# --------------------------------------------------------------------------
# jax adapter: dtype errors name the culprit
# --------------------------------------------------------------------------
def test_jax_int_x_is_named():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import twellpy.jax as twj

    rng = np.random.default_rng(0)
    wg, wu = (jnp.asarray(rng.standard_normal((16, 4)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    x = jnp.ones((3, 4), jnp.int32)
    with pytest.raises(TypeError, match=r"^x has dtype int32, expected one of float16"):
        twj.gated_ffn(x, wg, wu, wd)
    with pytest.raises(TypeError, match=r"^x has dtype int32"):
        twj.relu_ffn(x, wu, wd)
    with pytest.raises(TypeError, match=r"^x has dtype bool"):
        twj.relu_ffn(x.astype(bool), wu, wd)


def test_jax_bool_array_l1_is_refused():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import twellpy.jax as twj

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    wu = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    wd = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    for l1 in (np.array(True), jnp.asarray(True)):
        with pytest.raises(TypeError, match="l1 must be a real number"):
            twj.relu_ffn(x, wu, wd, l1=l1)
    y = twj.relu_ffn(x, wu, wd, l1=np.array(0.5, np.float32))  # a numeric 0-d array is fine
    assert y.shape == (3, 4)


@pytest.mark.parametrize("d, h", [(0, 4), (4, 0)])
def test_jax_empty_weights_are_refused_in_every_mode(d, h):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import twellpy.jax as twj

    x = jnp.ones((3, d))
    wg, wu, wd = jnp.ones((h, d)), jnp.ones((h, d)), jnp.ones((d, h))
    msg = r"w_gate has shape .*expected \(H, D\) with H, D >= 1"
    with pytest.raises(ValueError, match=msg):
        twj.gated_ffn(x, wg, wu, wd)
    with pytest.raises(ValueError, match=msg):  # jax.grad took the training path, which accepted H = 0
        jax.grad(lambda *p: twj.gated_ffn(*p).sum(), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    with pytest.raises(ValueError, match=r"w_up has shape .*H, D >= 1"):
        jax.jit(lambda x: twj.relu_ffn(x, wu, wd))(x)


# --------------------------------------------------------------------------
# the same operand rules everywhere (twellpy._array.as_array is the one entry)
# --------------------------------------------------------------------------
def test_masked_arrays_are_refused_by_every_entry_point():
    h = _activation()
    A = tw.TwELL.from_dense(h, tile=64, slots=16)
    rng = np.random.default_rng(5)
    W = rng.standard_normal((300, 3)).astype(np.float32)
    Wm = np.ma.masked_array(W, mask=W > 1)
    with pytest.raises(TypeError, match=r"W is a numpy.ma.MaskedArray|numpy.ma.MaskedArray"):
        A @ Wm
    x = rng.standard_normal((4, 8)).astype(np.float32)
    wg = rng.standard_normal((16, 8)).astype(np.float32)
    wd = rng.standard_normal((8, 16)).astype(np.float32)
    with pytest.raises(TypeError, match=r"x is a numpy.ma.MaskedArray"):
        tw.ffn.gated_forward(np.ma.masked_array(x), wg, wg, wd)
    with pytest.raises(TypeError, match=r"w_down is a numpy.ma.MaskedArray"):
        tw.ffn.relu_forward_train(x, wg, np.ma.masked_array(wd))
    with pytest.raises(TypeError, match=r"numpy.ma.MaskedArray"):
        tw.ELL.from_dense(np.ma.masked_array(h))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_matrix_operands_compute_as_plain_arrays():
    h = _activation()
    W = np.random.default_rng(6).standard_normal((300, 3)).astype(np.float32)
    A = tw.ELL.from_dense(h)
    y = A @ np.matrix(W)
    assert type(y) is np.ndarray
    np.testing.assert_allclose(y, h.astype(np.float64) @ W, rtol=1e-5, atol=1e-5)
    B = tw.ELL.from_dense(np.matrix(h))
    np.testing.assert_array_equal(B.toarray(), h)


# --------------------------------------------------------------------------
# training refuses empty layers like inference; fixed widths are capped at N
# --------------------------------------------------------------------------
@pytest.mark.parametrize("d, h", [(0, 4), (4, 0)])
def test_training_refuses_empty_weights(d, h):
    x = np.ones((3, d), np.float32)
    with pytest.raises(ValueError, match=r"w_up has shape .*H, D >= 1"):
        tw.ffn.gated_forward_train(x, np.ones((h, d), np.float32), np.ones((h, d), np.float32),
                                   np.ones((d, h), np.float32))
    with pytest.raises(ValueError, match=r"w_up has shape .*H, D >= 1"):
        tw.ffn.relu_forward_train(x, np.ones((h, d), np.float32), np.ones((d, h), np.float32))


def test_fixed_width_beyond_the_row_length_is_capped():
    h = _activation()
    n = h.shape[1]
    for width in (10**12, f"fixed:{10**12}", n + 1):
        A = tw.Hybrid.from_dense(h, width=width)
        assert A.width == n and A.backup_rows.shape[0] == 0
        np.testing.assert_array_equal(A.toarray(), h)
    # a strategy read back from a crafted file must not allocate M x 2**64 slots either
    A = tw.Hybrid.from_dense(h, width=3)
    B = tw.Hybrid(A.values, A.indices, A.row_nnz, shape=A.shape, backup=A.backup,
                  backup_rows=A.backup_rows, width_strategy=2**64 - 1)
    np.testing.assert_array_equal(B.T.T.toarray(), h)
    assert B.T.width <= h.shape[0]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    wu = rng.standard_normal((16, 8)).astype(np.float32)
    wd = rng.standard_normal((8, 16)).astype(np.float32)
    y, ctx = tw.ffn.relu_forward_train(x, wu, wd, width=10**12)
    assert ctx.width <= 16
    np.testing.assert_allclose(y, np.maximum(x.astype(np.float64) @ wu.T, 0) @ wd.T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)
