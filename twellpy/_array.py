"""The one place that turns user inputs into numpy or cupy arrays and back.

Every public entry point calls :func:`as_array` on its array arguments and
:func:`to_caller` on its results, so that torch in gives torch out, jax in
gives jax out, cupy in gives cupy out.
"""
from __future__ import annotations

import functools
import sys
import threading

import ml_dtypes
import numpy as np

#: The bfloat16 dtype used on numpy (and accepted by CuPy 14).
bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: Value dtypes every container and kernel supports.
FLOAT_DTYPES = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))
INDEX_DTYPE = np.dtype(np.int32)

#: Unsigned dtype of each float width: bit tests run on this view of the data.
UINT_OF_WIDTH = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}

#: (exponent, mantissa) bits of each float dtype. A value is NaN or Inf when all
#: its exponent bits are set, and NaN when a mantissa bit is set as well. The
#: one table for every NaN/Inf test (numpy, cupy, Numba and the CUDA check kernel),
#: so bfloat16 needs no float arithmetic anywhere.
_FLOAT_BIT_MASKS = {
    np.dtype(np.float16): (0x7C00, 0x03FF),
    bfloat16: (0x7F80, 0x007F),
    np.dtype(np.float32): (0x7F800000, 0x007FFFFF),
    np.dtype(np.float64): (0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
}

_lock = threading.Lock()


def quiet_underflow(fn):
    """Decorator: run ``fn`` with numpy's underflow errors off.

    Rounding a result to a subnormal or to zero (float16 and bfloat16 results
    above all) is IEEE arithmetic, not an error; a caller's
    ``np.seterr(under="raise")`` is for their own code and would otherwise turn
    twellpy's internal casts into ``FloatingPointError``. Overflow and invalid
    operations keep the caller's setting (twellpy reports NaN/Inf itself).
    """
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with np.errstate(under="ignore"):
            return fn(*args, **kwargs)

    return run


@functools.lru_cache(maxsize=1)
def cupy_module():
    """Return the cupy module, or None when CuPy is not installed."""
    try:
        import cupy  # noqa: F401
    except Exception:  # pragma: no cover - depends on the machine
        return None
    return cupy


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """Whether twellpy's GPU backend can run here.

    Returns
    -------
    bool
        True when CuPy is installed and at least one CUDA device is usable;
        False otherwise (never raises).

    Examples
    --------
    >>> import twellpy as tw
    >>> device = "cuda" if tw.gpu_available() else "cpu"
    """
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_cupy(a) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(a, cp.ndarray)


def xp_of(a):
    """numpy or cupy, whichever module owns ``a``."""
    return cupy_module() if is_cupy(a) else np


def device_of(a) -> str:
    """'cpu' for numpy arrays, 'cuda:N' for cupy arrays."""
    if is_cupy(a):
        return f"cuda:{a.device.id}"
    return "cpu"


def _torch_kind(x):
    # isinstance, not the module name: a torch.Tensor subclass defined elsewhere (a user's
    # or a library's) is a torch tensor too. torch is looked up only when already imported.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _jax_kind(x):
    mod = type(x).__module__
    return mod.startswith("jax") or mod.startswith("jaxlib")


def _torch_to_xp(t, name="x"):
    import torch

    t = t.detach()
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{name} is a torch tensor on {t.device.type}; twellpy takes CPU or CUDA "
                        f"tensors (move it with .cpu() or .cuda())")
    if t.layout != torch.strided:
        raise TypeError(f"{name} is a torch tensor with layout {t.layout}; twellpy takes dense "
                        f"(strided) tensors, so pass {name}.to_dense()")
    is_bf16 = t.dtype == torch.bfloat16
    if is_bf16:
        t = t.view(torch.int16)  # numpy/DLPack consumers may not know bfloat16
    if t.is_cuda:
        cp = cupy_module()
        if cp is None:
            raise TypeError("a CUDA torch tensor was given but CuPy is not installed; "
                            "install twellpy[cuda] or move the tensor to the CPU")
        arr = cp.from_dlpack(t)
    else:
        try:
            arr = t.resolve_conj().resolve_neg().numpy()
        except TypeError:  # torch's "Got unsupported ScalarType ..." names no argument
            names = ", ".join(str(d) for d in FLOAT_DTYPES)
            raise TypeError(f"{name} has dtype {t.dtype}, expected one of {names}") from None
    if is_bf16:
        arr = arr.view(bfloat16)
    return arr


def _jax_to_xp(a):
    try:
        dev = list(a.devices())[0]
        platform = dev.platform
    except Exception:
        platform = "cpu"
    if platform == "gpu" or platform == "cuda":
        cp = cupy_module()
        if cp is None:
            raise TypeError("a GPU jax array was given but CuPy is not installed")
        if a.dtype == bfloat16:
            import jax

            return cp.from_dlpack(jax.lax.bitcast_convert_type(a, np.int16)).view(bfloat16)
        return cp.from_dlpack(a)
    return np.asarray(a)  # jax uses ml_dtypes too, so bfloat16 survives


def as_array(x, name: str, *, ndim=None, allow_none: bool = False):
    """Convert ``x`` to a numpy or cupy array without copying when possible.

    Parameters
    ----------
    x : array_like
        numpy or cupy array, torch tensor, jax array, or any object with
        ``__dlpack__``. Python lists are accepted too.
    name : str
        Argument name used in error messages.
    ndim : int, optional
        Required number of dimensions.
    allow_none : bool
        Return ``(None, None)`` for ``None``.

    Returns
    -------
    arr : numpy.ndarray or cupy.ndarray
    kind : str
        One of ``"numpy"``, ``"cupy"``, ``"torch"``, ``"jax"``, ``"dlpack"``;
        pass it to :func:`to_caller` to return results in the caller's type.
    """
    if x is None:
        if allow_none:
            return None, None
        raise TypeError(f"{name} must be an array, got None")
    if isinstance(x, np.ma.MaskedArray):
        # the kernels read the data buffer, so masked entries would count silently
        raise TypeError(f"{name} is a numpy.ma.MaskedArray; twellpy ignores masks, so pass "
                        f"{name}.filled(0) (or the value masked entries should have)")
    if isinstance(x, np.ndarray):
        # np.matrix and other subclasses: their operators differ (matrix * is @), so
        # compute on the plain data (a view, no copy)
        arr, kind = (x if type(x) is np.ndarray else x.view(np.ndarray)), "numpy"
    elif is_cupy(x):
        arr, kind = x, "cupy"
    elif _torch_kind(x):
        arr, kind = _torch_to_xp(x, name), "torch"
    elif _jax_kind(x) and hasattr(x, "devices"):
        arr, kind = _jax_to_xp(x), "jax"
    elif hasattr(x, "__dlpack__"):
        dev_type = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else 1
        if dev_type == 1:
            try:
                arr = np.from_dlpack(x)
            except (BufferError, RuntimeError, TypeError, ValueError) as exc:
                # numpy's "Unsupported dtype in DLTensor." (e.g. bfloat16) or the producer's
                # own refusal name no argument
                raise TypeError(f"{name} ({type(x).__module__}.{type(x).__name__}) could not be read "
                                f"through DLPack: {exc}; pass a numpy array or a supported float "
                                f"dtype") from exc
        else:
            cp = cupy_module()
            if cp is None:
                raise TypeError(f"{name} lives on a GPU but CuPy is not installed")
            arr = cp.from_dlpack(x)
        kind = "dlpack"
    elif isinstance(x, (list, tuple, int, float)) or np.isscalar(x):
        arr, kind = np.asarray(x), "numpy"
    elif hasattr(x, "__array__") and not hasattr(x, "tocsr"):
        arr, kind = np.asarray(x), "numpy"
    else:
        raise TypeError(f"{name} must be a numpy/cupy array or support __dlpack__, "
                        f"got {type(x).__module__}.{type(x).__name__}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {arr.ndim}-D array of shape {tuple(arr.shape)}")
    return arr, kind


def to_caller(arr, kind):
    """Return ``arr`` (numpy/cupy) as the caller's array type ``kind``."""
    if arr is None or kind in (None, "numpy", "cupy"):
        return arr
    if kind == "torch":
        import torch

        if not is_cupy(arr) and not arr.flags.writeable:
            # torch tensors are always writable: a read-only buffer (e.g. a view
            # of a jax array) must be copied rather than shared.
            arr = arr.copy()
        if arr.dtype == bfloat16:
            if is_cupy(arr):
                return torch.from_dlpack(arr.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
        if is_cupy(arr):
            return torch.from_dlpack(arr)
        return torch.from_numpy(np.ascontiguousarray(arr))
    if kind == "jax":
        import jax
        import jax.numpy as jnp

        if is_cupy(arr):
            if arr.dtype == bfloat16:
                return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(arr.view(np.int16)), jnp.bfloat16)
            return jax.dlpack.from_dlpack(arr)
        return jnp.asarray(arr)
    return arr  # generic DLPack producers get numpy/cupy back (both are DLPack producers)


def count_in_range(values, n):
    """``bincount(values, minlength=n)`` as int32, for values known to lie in [0, n).

    On cupy this queues one scatter-add (integer atomics: exact and
    order-independent) instead of ``cupy.bincount``, which synchronises with
    the host twice (a negativity check and the maximum) before counting.
    """
    xp = xp_of(values)
    if xp is np:
        return np.bincount(values, minlength=n)[:n].astype(np.int32, copy=False)
    import cupyx

    counts = xp.zeros(n, dtype=np.int32)
    if values.size:
        cupyx.scatter_add(counts, values, 1)
    return counts


def float_or_inf(v) -> float:
    """``float(v)``, where an int (or Fraction ...) beyond the float64 range becomes +-inf
    instead of raising OverflowError, so the caller's rules for infinities apply to it."""
    try:
        return float(v)
    except OverflowError:
        return float("inf") if v > 0 else float("-inf")


def check_float(arr, name: str, *, allowed=FLOAT_DTYPES):
    """Raise TypeError unless ``arr`` has a supported floating dtype."""
    if arr.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        if not arr.dtype.isnative and arr.dtype.newbyteorder("=") in allowed:
            # '>f4' is float32 in the other byte order: say so, the bare dtype reads like a match
            raise TypeError(f"{name} has dtype {arr.dtype.str} ({arr.dtype.newbyteorder('=')} in non-native "
                            f"byte order), expected one of {names} in native byte order; convert with "
                            f"{name}.astype({name}.dtype.newbyteorder('='))")
        raise TypeError(f"{name} has dtype {arr.dtype}, expected one of {names}")
    return arr


def finfo(dtype):
    """Machine limits of a float dtype, bfloat16 included.

    ``np.finfo(bfloat16)`` works only where the installed ml_dtypes registers
    bfloat16 with numpy's ``finfo`` (newer releases); ``ml_dtypes.finfo`` knows
    numpy's own float dtypes and bfloat16 with every release.

    Parameters
    ----------
    dtype : dtype-like
        A float dtype.

    Returns
    -------
    finfo
        With ``max``, ``eps``, ``tiny`` and the rest of ``numpy.finfo``'s fields.
    """
    return ml_dtypes.finfo(np.dtype(dtype))


def float_bit_masks(dtype):
    """Exponent and mantissa masks of a float dtype, as scalars of its unsigned view.

    Parameters
    ----------
    dtype : numpy dtype
        One of :data:`FLOAT_DTYPES`.

    Returns
    -------
    (exponent_mask, mantissa_mask) : tuple of numpy unsigned integers
        ``bits & exponent_mask == exponent_mask`` means NaN or Inf.
    """
    dt = np.dtype(dtype)
    exp_mask, man_mask = _FLOAT_BIT_MASKS[dt]
    word = UINT_OF_WIDTH[dt.itemsize].type
    return word(exp_mask), word(man_mask)


def nan_inf_counts(arr):
    """Numbers of NaN and of Inf elements of a float array (numpy or cupy).

    Works on the bits, so bfloat16 needs no upcast and any CuPy version works.
    """
    exp_mask, man_mask = float_bit_masks(arr.dtype)
    bits = arr.view(UINT_OF_WIDTH[arr.dtype.itemsize])
    special = (bits & exp_mask) == exp_mask
    n_special = int(special.sum())
    n_nan = int((special & ((bits & man_mask) != 0)).sum()) if n_special else 0
    return n_nan, n_special - n_nan


def switch_setting(name, value):
    """The bool of an on/off environment variable ``name`` whose value is ``value``
    ("0" or "1"; anything else raises, naming the variable)."""
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def check_finite(arr, name: str):
    """Raise ValueError if ``arr`` holds NaN or Inf (works on numpy and cupy).

    The message names ``name`` and says how many NaN and Inf values there are.
    """
    if arr.size == 0 or (arr.dtype not in FLOAT_DTYPES and arr.dtype.kind not in "fc"):
        return arr  # integer and boolean data are always finite
    xp = xp_of(arr)
    if arr.dtype not in FLOAT_DTYPES:  # other float widths, complex: no bit table, plain test
        if not bool(xp.isfinite(arr).all()):
            raise ValueError(f"{name} contains {int(xp.isnan(arr).sum())} NaN and "
                             f"{int(xp.isinf(arr).sum())} Inf values; pass check_finite=False "
                             f"to keep IEEE semantics (NaN propagates)")
        return arr
    if xp is not np and (arr.flags.c_contiguous or arr.flags.f_contiguous):
        # one pass over the bits on the device; counting NaN vs Inf is for the error only
        from .backends import cuda as _cuda

        ok = _cuda.count_nonfinite(arr) == 0
    elif arr.dtype.itemsize == 2:
        # bit test: CuPy has no bfloat16 arithmetic, and an upcast would cost a copy
        exp_mask, _ = float_bit_masks(arr.dtype)
        ok = not bool(((arr.view(UINT_OF_WIDTH[2]) & exp_mask) == exp_mask).any())
    else:
        ok = bool(xp.isfinite(arr).all())
    if not ok:
        raise_nonfinite(arr, name)
    return arr


def raise_nonfinite(arr, name: str):
    """Raise the ValueError of :func:`check_finite` for ``arr``, which holds NaN or Inf."""
    n_nan, n_inf = nan_inf_counts(arr)
    raise ValueError(f"{name} contains {n_nan} NaN and {n_inf} Inf values; pass "
                     f"check_finite=False to keep IEEE semantics (NaN propagates)")


def contiguous(arr, name: str):
    """C-contiguous view or copy (negative strides and transposes are copied)."""
    xp = xp_of(arr)
    return xp.ascontiguousarray(arr)


def same_device(pairs):
    """Raise ValueError if the named arrays are not all on one device.

    ``pairs`` is a sequence of ``(name, array)``; ``None`` arrays are skipped.
    """
    first = None
    for name, a in pairs:
        if a is None:
            continue
        d = device_of(a)
        if first is None:
            first = (name, d)
        elif d != first[1]:
            raise ValueError(f"{name} is on {d} but {first[0]} is on {first[1]}; "
                             f"move all arrays to one device (e.g. .to_device('{first[1]}'))")
    return first[1] if first else "cpu"


def result_dtype(*dtypes):
    """Promoted float dtype, bfloat16 aware and independent of numpy/ml_dtypes versions.

    Mixed 16-bit types (float16 with bfloat16) promote to float32: some
    numpy/ml_dtypes releases refuse that pair outright.
    """
    dts = [np.dtype(d) for d in dtypes]
    if bfloat16 in dts:
        others = {d for d in dts if d != bfloat16}
        if not others:
            return bfloat16
        if others == {np.dtype(np.float16)}:
            return np.dtype(np.float32)
        dts = [np.dtype(np.float32) if d in (bfloat16, np.dtype(np.float16)) else d for d in dts]
    try:
        return np.result_type(*dts)
    except TypeError:
        return np.dtype(np.float32)


def accum_dtype(dtype):
    """float64 for float64 data, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
