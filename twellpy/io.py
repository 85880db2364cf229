"""Saving and loading containers as ``.npz`` files.

File layout (format version 1): an uncompressed npz archive (no pickles) with

* ``__twellpy_version__``: int, the file format version;
* ``format``: ``"ell"``, ``"twell"`` or ``"hybrid"``;
* ``shape``: int64 (2,);
* ``dtype``: the value dtype name (``"bfloat16"``, ``"float32"`` ...);
* one entry per component array; 16-bit values are stored as their uint16
  bit patterns so that no custom dtype needs pickling;
* ``param_<name>``: the container parameters (``tile``, ``slots``,
  ``width``, ``width_strategy``).

:func:`load` validates everything it reads (``check_format(full_check=True)``),
so a corrupt file gives a ``ValueError`` naming the file, never a crash.
"""
from __future__ import annotations

import os
import zipfile

import numpy as np

from ._array import FLOAT_DTYPES
from ._base import SparseArray, _as_host

#: File format version written by :func:`save`.
FORMAT_VERSION = 1

_VALUE_ARRAYS = ("values", "backup")
_DTYPES = {str(d): d for d in FLOAT_DTYPES}


def save(path, A):
    """Write container ``A`` to ``path`` (npz, written to exactly that path).

    Parameters
    ----------
    path : str or os.PathLike
    A : ELL, TwELL or Hybrid
        Arrays on the GPU are copied to the host first.
    """
    if not isinstance(A, SparseArray):
        raise TypeError(f"A must be a twellpy ELL, TwELL or Hybrid, got {type(A).__module__}.{type(A).__name__}")
    d = A.components()
    out = {
        "__twellpy_version__": np.int64(FORMAT_VERSION),
        "format": np.str_(d.pop("format")),
        "shape": np.asarray(d.pop("shape"), dtype=np.int64),
        "dtype": np.str_(str(A.dtype)),
    }
    for name in A._array_names:
        a = np.ascontiguousarray(_as_host(d.pop(name)))
        if name in _VALUE_ARRAYS and a.dtype.itemsize == 2:
            a = a.view(np.uint16)
        out[name] = a
    for k, v in d.items():
        out[f"param_{k}"] = np.str_(v) if isinstance(v, str) else np.int64(v)
    with open(os.fspath(path), "wb") as f:
        np.savez(f, **out)


def load(path, *, device="cpu"):
    """Read a container written by :func:`save`.

    Parameters
    ----------
    path : str or os.PathLike
    device : str
        ``"cpu"`` (default), ``"cuda"`` or ``"cuda:N"``.

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    ValueError
        The file is truncated, corrupt, not a twellpy file, or was written by
        a newer twellpy (the message names the file).
    """
    p = os.fspath(path)
    try:
        with np.load(p, allow_pickle=False) as z:
            entries = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise ValueError(f"{p} is not a readable twellpy .npz file ({type(e).__name__}: {e})") from None
    if "__twellpy_version__" not in entries:
        raise ValueError(f"{p} is not a twellpy file (no __twellpy_version__ entry)")
    try:
        version = int(entries.pop("__twellpy_version__"))
    except (TypeError, ValueError):
        raise ValueError(f"{p} has an unreadable __twellpy_version__ entry") from None
    if version > FORMAT_VERSION:
        raise ValueError(f"{p} was written with twellpy file format version {version}; this twellpy "
                         f"reads versions up to {FORMAT_VERSION}; upgrade twellpy to load it")
    if version < 1:
        raise ValueError(f"{p} has an invalid file format version {version}")
    try:
        shape = entries.pop("shape")
        if shape.dtype.kind not in "iu" or shape.ndim != 1:
            # int() would truncate a float shape such as [9.5, 30] silently
            raise ValueError(f"shape must be a 1-D integer array (M, N), got {shape.dtype} {shape.tolist()!r}")
        d = {"format": str(entries.pop("format")), "shape": tuple(int(s) for s in shape)}
        dtype_name = str(entries.pop("dtype"))
        if dtype_name not in _DTYPES:
            raise ValueError(f"unsupported value dtype {dtype_name!r}")
        dtype = _DTYPES[dtype_name]
        for k, v in entries.items():
            if k.startswith("param_"):
                if v.dtype.kind not in "Uiu" or v.ndim != 0:
                    raise ValueError(f"parameter {k[6:]!r} must be a string or an integer scalar, "
                                     f"got {v.dtype} {v.tolist()!r}")
                d[k[6:]] = str(v) if v.dtype.kind == "U" else int(v)
            elif k in _VALUE_ARRAYS:
                if v.dtype.itemsize != dtype.itemsize:
                    raise ValueError(f"array {k!r} has {v.dtype.itemsize}-byte items, expected {dtype}")
                d[k] = v.view(dtype)
            else:
                d[k] = v
        A = SparseArray.from_components(d, check="full", check_finite=False)
    except KeyError as e:  # a required entry (shape, format, dtype, an array) is absent
        raise ValueError(f"{p} holds an invalid twellpy container: missing entry {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{p} holds an invalid twellpy container: {e}") from None
    return A.to_device(device)
