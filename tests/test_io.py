"""twellpy.save / twellpy.load: round trips and clear errors on bad files."""
import zipfile

import numpy as np
import pytest

import twellpy as tw
from _containers import FORMATS, bits_equal
from conftest import DTYPES
from makers import MAKERS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", ["empty", "over_capacity", "one_hot_row", "wide", "single_column"])
def test_save_load_roundtrip(backend, xp, tmp_path, maker, fmt, dtype):
    x = xp.asarray(MAKERS[maker](np.random.default_rng(2)).astype(dtype))
    cls, params = FORMATS[fmt]
    A = cls.from_dense(x, **params)
    path = tmp_path / "a.twell"  # any name: the file is written to exactly this path
    tw.save(path, A)
    assert path.exists()
    B = tw.load(path, device=A.device)
    assert type(B) is cls and B.shape == A.shape and B.dtype == A.dtype and B.device == A.device
    assert B._params() == A._params()
    for k in A._array_names:
        assert bits_equal(getattr(A, k), getattr(B, k)), k


def _write(path, **entries):
    with open(path, "wb") as f:
        np.savez(f, **entries)


def test_newer_version_is_refused(tmp_path):
    p = tmp_path / "new.npz"
    tw.save(p, tw.ELL.from_dense(np.eye(3)))
    with np.load(p) as z:
        d = dict(z)
    d["__twellpy_version__"] = np.int64(99)
    _write(p, **d)
    with pytest.raises(ValueError, match=r"new\.npz was written with twellpy file format version 99.*upgrade"):
        tw.load(p)


def test_truncated_corrupt_and_foreign_files(tmp_path):
    good = tmp_path / "good.npz"
    tw.save(good, tw.TwELL.from_dense(MAKERS["over_capacity"](np.random.default_rng(0))))
    raw = good.read_bytes()
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="trunc.npz is not a readable twellpy .npz file"):
        tw.load(trunc)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"hello, not a zip file" * 10)
    with pytest.raises(ValueError, match="junk.npz"):
        tw.load(junk)
    foreign = tmp_path / "foreign.npz"
    _write(foreign, a=np.arange(3))
    with pytest.raises(ValueError, match=r"foreign.npz is not a twellpy file"):
        tw.load(foreign)
    with pytest.raises(FileNotFoundError):
        tw.load(tmp_path / "missing.npz")


@pytest.mark.parametrize("field,value,msg", [
    ("indices", lambda a: np.where(a >= 0, a + 300, a), "out of range"),
    ("counts", lambda a: a + 40, "counts"),
    ("backup_rows", lambda a: a[::-1].copy(), "backup_rows must be sorted"),
    ("format", lambda a: np.str_("csr"), "unknown format 'csr'"),
    ("values", lambda a: a[:1], "values has shape"),
])
def test_tampered_contents_give_value_error_naming_file(tmp_path, field, value, msg):
    p = tmp_path / "t.npz"
    tw.save(p, tw.TwELL.from_dense(MAKERS["over_capacity"](np.random.default_rng(0))))
    with np.load(p) as z:
        d = dict(z)
    d[field] = value(d[field])
    _write(p, **d)
    with pytest.raises(ValueError, match=msg) as e:
        tw.load(p)
    assert "t.npz" in str(e.value)


def test_save_rejects_non_container(tmp_path):
    with pytest.raises(TypeError, match="A must be a twellpy ELL, TwELL or Hybrid"):
        tw.save(tmp_path / "x.npz", np.eye(3))


def test_file_is_plain_npz_without_pickles(tmp_path):
    p = tmp_path / "b.npz"
    tw.save(p, tw.Hybrid.from_dense(MAKERS["one_hot_row"](np.random.default_rng(0)).astype(tw._array.bfloat16)))
    assert zipfile.is_zipfile(p)
    with np.load(p, allow_pickle=False) as z:
        assert int(z["__twellpy_version__"]) == 1 and str(z["dtype"]) == "bfloat16"
        assert z["values"].dtype == np.uint16
