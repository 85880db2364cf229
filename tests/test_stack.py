"""``twellpy.vstack``: row-wise stacking of every format on both backends."""
import numpy as np
import pytest

import twellpy as tw
from _containers import FORMATS, bits_equal, host
from conftest import DTYPES
from makers import MAKERS, SMALL_MAKERS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", SMALL_MAKERS)
def test_vstack_of_row_chunks_is_the_whole(backend, xp, maker, fmt, dtype):
    x = MAKERS[maker](np.random.default_rng(17)).astype(dtype)
    cls, params = FORMATS[fmt]
    whole = cls.from_dense(xp.asarray(x), **params)
    cuts = sorted({0, x.shape[0] // 3, x.shape[0] // 2, x.shape[0]})
    parts = [cls.from_dense(xp.asarray(x[a:b]), **params) for a, b in zip(cuts[:-1], cuts[1:])] or [whole]
    S = tw.vstack(parts)
    assert type(S) is cls and S.shape == x.shape and S.dtype == whole.dtype and S.xp is xp
    S.check_format(full_check=True)
    assert bits_equal(S.toarray(), whole.toarray())
    assert S.nnz == whole.nnz


def test_vstack_keeps_backup_rows_and_pads_slots(backend, xp):
    rng = np.random.default_rng(2)
    x = np.where(rng.random((40, 700)) < 0.01, rng.uniform(0.5, 2, (40, 700)), 0).astype(np.float32)
    x[3] = rng.uniform(0.5, 2, 700)                       # backup rows in both parts
    x[31] = rng.uniform(0.5, 2, 700)
    a = tw.TwELL.from_dense(xp.asarray(x[:20]), tile=128, slots=4, overflow="backup")
    b = tw.TwELL.from_dense(xp.asarray(x[20:]), tile=128, slots=16, overflow="backup")
    S = tw.vstack([a, b])
    want_rows = host(a.backup_rows).tolist() + [r + 20 for r in host(b.backup_rows).tolist()]
    assert 3 in want_rows and 31 in want_rows
    assert S.slots == 16 and host(S.backup_rows).tolist() == want_rows
    assert bits_equal(S.toarray(), x)
    h1 = tw.Hybrid.from_dense(xp.asarray(x[:25]), width=3)
    h2 = tw.Hybrid.from_dense(xp.asarray(x[25:]), width=9)
    H = tw.vstack([h1, h2, h1[:0]])                       # an empty part too
    assert H.values.shape[1] == 9 and host(H.backup_rows).tolist() == host(
        np.nonzero(np.count_nonzero(x, axis=1) > np.array([3] * 25 + [9] * 15))[0]).tolist()
    assert bits_equal(H.toarray(), x)


def test_vstack_of_one_part_is_a_copy(backend, xp):
    A = tw.ELL.from_dense(xp.asarray(np.eye(4, 9, dtype=np.float32)))
    S = tw.vstack([A])
    assert S is not A and bits_equal(S.toarray(), A.toarray())
    S.values[...] = 5
    assert bits_equal(A.toarray(), np.eye(4, 9, dtype=np.float32))


def test_vstack_checks_its_parts(backend, xp):
    x = np.eye(6, 10, dtype=np.float32)
    a = tw.ELL.from_dense(xp.asarray(x))
    with pytest.raises(ValueError, match="parts is empty"):
        tw.vstack([])
    with pytest.raises(TypeError, match=r"parts\[1\] is a ndarray, expected a twellpy container"):
        tw.vstack([a, x])
    with pytest.raises(TypeError, match=r"parts\[1\] has format 'hybrid', expected 'ell'.*asformat\('ell'\)"):
        tw.vstack([a, tw.Hybrid.from_dense(xp.asarray(x))])
    with pytest.raises(TypeError, match=r"parts\[1\] has dtype float64, expected float32"):
        tw.vstack([a, a.astype(np.float64)])
    with pytest.raises(ValueError, match=r"parts\[1\] has 9 columns, expected 10"):
        tw.vstack([a, tw.ELL.from_dense(xp.asarray(x[:, :9]))])
    t = tw.TwELL.from_dense(xp.asarray(x), tile=4)
    with pytest.raises(ValueError, match=r"parts\[1\] has tile 8, expected 4"):
        tw.vstack([t, tw.TwELL.from_dense(xp.asarray(x), tile=8)])


@pytest.mark.gpu
def test_vstack_refuses_mixed_devices():
    import cupy as cp

    x = np.eye(6, 10, dtype=np.float32)
    with pytest.raises(ValueError, match=r"parts\[1\] is on cuda:0, expected cpu.*to_device"):
        tw.vstack([tw.ELL.from_dense(x), tw.ELL.from_dense(cp.asarray(x))])
