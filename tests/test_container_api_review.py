"""The containers as a scipy.sparse user meets them, found in an API review:
scalar factors that are complex or too large for a float, products with dense
operands through ``*``, ``with_values`` and its padding slots, and ``==``.
Every numeric result is compared with a float64 numpy reference."""
import numpy as np
import pytest

import twellpy as tw
from twellpy._array import bfloat16

CLASSES = [tw.ELL, tw.TwELL, tw.Hybrid]
# the second row of X goes to a dense backup row in TwELL and Hybrid with these parameters
BACKUP_PARAMS = {tw.ELL: {}, tw.TwELL: {"tile": 4, "slots": 1}, tw.Hybrid: {"width": 1}}
DTYPES = [np.float16, bfloat16, np.float32, np.float64]


def _x(dtype=np.float32):
    return np.array([[0, 1.5, 0, -2], [3, 0, 4, 5], [0, 0, 0, 0]]).astype(dtype)


def _build(cls, dtype=np.float32):
    return cls.from_dense(_x(dtype), **BACKUP_PARAMS[cls])


def _f64(a):
    return np.asarray(a).astype(np.float64)


# ---- complex scalar factors --------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("factor", [np.complex64(1 + 2j), np.complex128(1 + 2j), 1 + 2j, np.complex64(3 + 0j)],
                         ids=["c64", "c128", "py-complex", "c64-real-valued"])
@pytest.mark.parametrize("op", ["mul", "rmul", "div", "multiply"])
def test_complex_scalar_is_refused_not_truncated(cls, factor, op):
    """A real container times a complex number is complex: the imaginary part must
    not be dropped in silence (numpy.complex64 is no Python complex, and float()
    of it discards the imaginary part with only a ComplexWarning)."""
    A = _build(cls)
    call = {"mul": lambda: A * factor, "rmul": lambda: factor * A, "div": lambda: A / factor,
            "multiply": lambda: A.multiply(factor)}[op]
    with pytest.raises(TypeError, match=r"(?s)real.*complex"):
        call()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("factor", [np.float32(2.5), np.int8(-3), 7, np.float64(0.25)])
def test_real_numpy_scalars_still_scale(cls, factor):
    A = _build(cls)
    ref = _x().astype(np.float64) * float(factor)
    np.testing.assert_allclose(_f64((A * factor).toarray()), ref, rtol=1e-6)
    np.testing.assert_allclose(_f64((factor * A).toarray()), ref, rtol=1e-6)
    np.testing.assert_allclose(_f64((A / factor).toarray()), _x().astype(np.float64) / float(factor), rtol=1e-6)
