"""Row selection ``A[rows]`` of every format: maker grid, dtypes, backends,
backup rows, property tests and bad keys."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twellpy as tw
from _containers import FORMATS, bits_equal, host
from conftest import DTYPES
from makers import MAKERS, SMALL_MAKERS

# every kind of key, as a function of the number of rows m (m >= 1)
KEYS = {
    "one row": lambda m: [m // 2],
    "one row, negative": lambda m: slice(-1, None),
    "slice": lambda m: slice(1, None, 2),
    "reversed slice": lambda m: slice(None, None, -1),
    "empty slice": lambda m: slice(m, m),
    "list with repeats": lambda m: [m - 1, 0, 0, m // 2],
    "int array, negative": lambda m: np.array([-1, 0, -m], np.int64),
    "uint32 array": lambda m: np.arange(m, dtype=np.uint32)[::-1].copy(),
    "mask": lambda m: np.arange(m) % 3 != 1,
    "empty list": lambda m: [],
    "rows and all columns": lambda m: (slice(0, m, 2), slice(None)),
    "rows and an explicit full column slice": lambda m: ([0], slice(0, None, 1)),
}


def _dense_rows(dense, key):
    """What A[key] must hold: the container's dense form indexed the numpy way."""
    k = key[0] if isinstance(key, tuple) else key
    k = host(k) if hasattr(k, "get") else k  # a device mask indexes the host copy
    if isinstance(k, list) and not k:
        return dense[np.zeros(0, np.int64)]
    return dense[k]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", [k for k in SMALL_MAKERS if k != "empty"])  # no rows: the test below
def test_rows_of_every_format(backend, xp, maker, fmt, dtype):
    x64 = MAKERS[maker](np.random.default_rng(11))
    cls, params = FORMATS[fmt]
    A = cls.from_dense(xp.asarray(x64.astype(dtype)), **params)
    dense = host(A.toarray())
    m = A.shape[0]
    for name, make_key in KEYS.items():
        key = make_key(m)
        if isinstance(key, np.ndarray) and xp is not np and name == "mask":
            key = xp.asarray(key)  # a device mask for a device container
        B = A[key]
        want = _dense_rows(dense, key)
        assert type(B) is type(A) and B.shape == want.shape, name
        assert B.dtype == A.dtype and B.xp is A.xp, name
        assert B.components().keys() == A.components().keys(), name
        for p, v in A._params().items():
            assert B._params()[p] == v, (name, p)
        B.check_format(full_check=True)
        assert bits_equal(B.toarray(), want), name
        assert B.nnz == np.count_nonzero(want.astype(np.float64)), name  # NaN counts, -0.0 does not


def test_rows_of_an_empty_container(backend, xp):
    A = tw.TwELL.from_dense(xp.zeros((0, 300), np.float32))
    for key in (slice(None), [], np.zeros(0, bool)):
        B = A[key]
        assert B.shape == (0, 300)
    with pytest.raises(IndexError, match="row index 0 is out of range for a TwELL with 0 rows"):
        A[[0]]


@pytest.mark.parametrize("fmt", ["twell_backup", "hybrid_narrow"])
def test_backup_rows_stay_backup_rows(backend, xp, fmt):
    rng = np.random.default_rng(5)
    x = np.zeros((30, 600), np.float32)
    for i in range(30):
        k = 300 if i in (2, 9, 17) else 4
        x[i, rng.choice(600, k, replace=False)] = rng.uniform(0.5, 2.0, k)
    if fmt == "twell_backup":
        A = tw.TwELL.from_dense(xp.asarray(x), tile=256, slots=8, overflow="backup")
    else:
        A = tw.Hybrid.from_dense(xp.asarray(x), width=6)
    assert host(A.backup_rows).tolist() == [2, 9, 17]
    key = [17, 0, 2, 2, 29, 9]
    B = A[key]
    assert host(B.backup_rows).tolist() == [0, 2, 3, 5]     # positions of 17, 2, 2, 9 in the selection
    assert bits_equal(B.backup, x[[17, 2, 2, 9]])
    assert host(B.row_map).tolist() == [0, -1, 1, 2, -1, 3]
    assert bits_equal(B.toarray(), x[key])
    B.check_format(full_check=True)
    C = A[[0, 1, 3]]                                          # no backup row selected
    assert C.n_backup == 0 and bits_equal(C.toarray(), x[[0, 1, 3]])


def test_selection_does_not_alias_the_source(backend, xp):
    x = np.eye(5, 300, dtype=np.float32) * 3
    A = tw.ELL.from_dense(xp.asarray(x))
    B = A[1:3]
    B.values[...] = 7
    assert bits_equal(A.toarray(), x)


@pytest.mark.gpu
def test_index_arrays_from_the_other_device():
    import cupy as xp

    x = np.eye(6, 300, dtype=np.float32)
    A = tw.Hybrid.from_dense(xp.asarray(x))
    assert bits_equal(A[np.array([5, 1])].toarray(), x[[5, 1]])       # numpy index, GPU container
    H = tw.Hybrid.from_dense(x)
    assert bits_equal(H[xp.asarray([5, 1])].toarray(), x[[5, 1]])     # cupy index, CPU container
    assert bits_equal(H[xp.asarray(np.arange(6) > 3)].toarray(), x[4:])


@pytest.mark.parametrize("key,exc,msg", [
    ((slice(None), 3), TypeError, r"selects whole rows only \(A\[rows\] or A\[rows, :\]\)"),
    ((1, 2), TypeError, "selects whole rows only"),
    (3, TypeError, r"ELL has no 1-D rows: select row 3 as A\[\[3\]\] or A\[3:4\] \(shape \(1, N\)\)"),
    (np.int64(-1), TypeError, r"select row -1 as A\[\[-1\]\] or A\[-1:\]"),
    (np.array(2), TypeError, r"got a 0-d array \(int64\); select one row as A\[\[i\]\]"),
    (np.array(True), TypeError, "got a 0-d array"),
    ((slice(None), slice(0, 19)), TypeError, "selects whole rows only"),
    ([0, 8], IndexError, "row index 8 is out of range for a ELL with 8 rows"),
    ([-9, 0], IndexError, "row index -9 is out of range"),
    (np.ones(7, bool), IndexError, "boolean row mask has 7 entries, expected one per row \\(8\\)"),
    (np.zeros((2, 2), np.int64), IndexError, "row indices must be one-dimensional, got shape \\(2, 2\\)"),
    (1.5, TypeError, "row indices must be integers or booleans, got dtype float64"),
    ([0.5, 1.0], TypeError, "got dtype float64"),
    (True, TypeError, "row index must be a slice, an integer array or a boolean mask, got True"),
    ({"a": 1}, TypeError, "row indices must be integers or booleans, got dtype object"),
    (None, TypeError, "got None"),
    (Ellipsis, TypeError, "got Ellipsis"),
])
def test_bad_keys_name_what_was_expected(backend, xp, key, exc, msg):
    A = tw.ELL.from_dense(xp.asarray(np.eye(8, 20, dtype=np.float32)))
    with pytest.raises(exc, match=msg):
        A[key]


@st.composite
def selections(draw):
    m = draw(st.integers(1, 40))
    n = draw(st.sampled_from([1, 7, 256, 300, 70000 if m <= 3 else 513]))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["slice", "ints", "mask"]))
    if kind == "slice":
        key = slice(draw(st.integers(-m - 2, m + 2)), draw(st.integers(-m - 2, m + 2)),
                    draw(st.sampled_from([1, 2, 3, -1, -2])))
    elif kind == "ints":
        key = draw(st.lists(st.integers(-m, m - 1), max_size=2 * m + 1))
    else:
        key = np.array(draw(st.lists(st.booleans(), min_size=m, max_size=m)))
    return m, n, seed, key


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sel=selections(), fmt=st.sampled_from(list(FORMATS) + ["twell_backup"]),
       dtype=st.sampled_from([np.float32, np.float64, np.float16, tw._array.bfloat16]))
def test_selection_matches_numpy_rows(sel, fmt, dtype):
    m, n, seed, key = sel
    rng = np.random.default_rng(seed)
    x = np.where(rng.random((m, n)) < 0.05, rng.uniform(0.5, 2.0, (m, n)), 0.0)
    if m > 1:
        x[rng.integers(m)] = rng.uniform(0.5, 2.0, n)          # a hot row (a backup row where formats keep them)
    x = x.astype(dtype)
    if fmt == "twell_backup":
        A = tw.TwELL.from_dense(x, tile=64, slots=4, overflow="backup")
    else:
        cls, params = FORMATS[fmt]
        A = cls.from_dense(x, **params)
    B = A[key]
    want = x[key] if not isinstance(key, list) else x[np.asarray(key, np.int64)]
    assert B.shape == want.shape
    B.check_format(full_check=True)
    assert bits_equal(B.toarray(), want)


def test_containers_are_not_iterable(backend, xp):
    A = tw.ELL.from_dense(xp.asarray(np.eye(3, 5, dtype=np.float32)))
    with pytest.raises(TypeError, match="ELL is not iterable; select rows with A\\[i:j\\]"):
        list(A)
    with pytest.raises(TypeError, match="'in' is not defined for a ELL"):
        5 in A
