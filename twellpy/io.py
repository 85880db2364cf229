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

import io
import os
import zipfile
import zlib

import numpy as np

from ._array import FLOAT_DTYPES
from ._base import SparseArray, _as_host

#: File format version written by :func:`save`.
FORMAT_VERSION = 1

_VALUE_ARRAYS = ("values", "backup")
_DTYPES = {str(d): d for d in FLOAT_DTYPES}


def _is_file(path, mode):
    """True for an open file object (anything with ``read`` or ``write``), not a path.

    A text-mode file is refused here: npz archives are bytes, and the error of the
    first write (or the decode error of the first read) would not say so.
    """
    if not (hasattr(path, "write") or hasattr(path, "read")):
        return False
    if isinstance(path, io.TextIOBase):
        raise TypeError(f"path is a text-mode file object ({type(path).__name__}); open the file "
                        f"in binary mode ({mode!r}) or pass io.BytesIO")
    return True


def _fspath(path):
    """``os.fspath(path)`` with an error that names the argument."""
    try:
        return os.fspath(path)
    except TypeError:
        raise TypeError(f"path must be a str, an os.PathLike or a binary file object, "
                        f"got {type(path).__module__}.{type(path).__name__}") from None


def save(path, A):
    """Write container ``A`` to ``path`` (npz, written to exactly that path).

    Parameters
    ----------
    path : str, os.PathLike or binary file object
        A file object (opened ``"wb"``, or ``io.BytesIO``) is written from its
        current position and left open.
    A : ELL, TwELL or Hybrid
        Arrays on the GPU are copied to the host first.
    """
    is_file = _is_file(path, "wb")
    if not is_file:
        path = _fspath(path)  # checked before A is copied off the GPU
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
    if is_file:
        np.savez(path, **out)
        return
    with open(path, "wb") as f:
        np.savez(f, **out)


def load(path, *, device="cpu"):
    """Read a container written by :func:`save`.

    Parameters
    ----------
    path : str, os.PathLike or binary file object
        A file object must be readable and seekable (opened ``"rb"``, or
        ``io.BytesIO``); it is left open.
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
    if _is_file(path, "rb"):
        src, p = path, getattr(path, "name", None)
        p = p if isinstance(p, str) else f"the file object {type(path).__name__}"
    else:
        src = p = _fspath(path)
    try:
        z = np.load(src, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            # a .npy file (one array) or a text file: np.load gives an array, no archive
            raise ValueError(f"it holds a single {type(z).__name__}, not an .npz archive")
        with z:
            entries = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    # zlib.error: a damaged np.savez_compressed member; NotImplementedError/RuntimeError:
    # an unknown zip compression method or an encrypted member
    except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError,
            NotImplementedError, RuntimeError) as e:
        raise ValueError(f"{p} is not a readable twellpy .npz file ({type(e).__name__}: {e})") from None
    if "__twellpy_version__" not in entries:
        raise ValueError(f"{p} is not a twellpy file (no __twellpy_version__ entry)")
    v = entries.pop("__twellpy_version__")
    if v.dtype.kind not in "iu" or v.ndim != 0:
        # int() would read 1.7 or True as version 1, "1" as well
        raise ValueError(f"{p} has an unreadable __twellpy_version__ entry: expected an integer "
                         f"scalar, got {v.dtype} {v.tolist()!r}")
    version = int(v)
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
