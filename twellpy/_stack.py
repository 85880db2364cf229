"""Row-wise stacking of containers: :func:`twellpy.vstack`.

TwELL, ELL and Hybrid are row formats, so stacking moves each part's row
arrays and offsets the ids of its dense backup rows; nothing is rebuilt and
every stored entry keeps its bits. ``twellpy.dask`` registers the same
operation as Dask's concatenation of container chunks.
"""
from __future__ import annotations

import numpy as np

from ._base import SparseArray, _bits


def _pad_last(xp, arr, width, fill):
    """Pad the last axis of ``arr`` to ``width`` with ``fill`` (0 for value arrays)."""
    extra = width - arr.shape[-1]
    if extra == 0:
        return arr
    if arr.dtype.kind in "iu":
        pad = xp.full(arr.shape[:-1] + (extra,), fill, dtype=arr.dtype)
        return xp.concatenate([arr, pad], axis=-1)
    # values move as bits: no 16-bit float kernels (CuPy's bfloat16 support is minimal)
    bits = _bits(arr)
    pad = xp.zeros(arr.shape[:-1] + (extra,), dtype=bits.dtype)
    return xp.concatenate([bits, pad], axis=-1).view(arr.dtype)


def _concat_values(xp, arrays, axis):
    """Concatenate float arrays through their bit patterns."""
    return xp.concatenate([_bits(a) for a in arrays], axis=axis).view(arrays[0].dtype)


def _stack_backup(xp, parts, n_cols, dtype):
    """Concatenate the dense backup rows of the parts, offsetting their row ids."""
    backups, rows = [], []
    offset = 0
    for p in parts:
        backups.append(p.backup)
        rows.append(p.backup_rows.astype(np.int64) + offset)
        offset += p.shape[0]
    backup = _concat_values(xp, backups, 0) if backups else xp.zeros((0, n_cols), dtype)
    backup_rows = xp.concatenate(rows).astype(np.int32) if rows else xp.zeros((0,), np.int32)
    return backup, backup_rows


def _check_parts(parts):
    if isinstance(parts, SparseArray) or parts is None or isinstance(parts, (str, bytes)):
        raise TypeError(f"parts must be a sequence of containers (e.g. [A, B]), got {type(parts).__name__}")
    try:
        parts = list(parts)
    except TypeError:
        raise TypeError(f"parts must be a sequence of containers (e.g. [A, B]), got {type(parts).__name__}") from None
    if not parts:
        raise ValueError("parts is empty; need at least one container to stack")
    first = parts[0]
    for i, p in enumerate(parts):
        if not isinstance(p, SparseArray):
            raise TypeError(f"parts[{i}] is a {type(p).__name__}, expected a twellpy container "
                            f"(TwELL, ELL or Hybrid)")
        if p.format != first.format:
            raise TypeError(f"parts[{i}] has format {p.format!r}, expected {first.format!r} (the format of "
                            f"parts[0]); convert with parts[{i}].asformat({first.format!r})")
        if p.dtype != first.dtype:
            raise TypeError(f"parts[{i}] has dtype {p.dtype}, expected {first.dtype} (the dtype of parts[0]); "
                            f"convert with .astype()")
        if p.shape[1] != first.shape[1]:
            raise ValueError(f"parts[{i}] has {p.shape[1]} columns, expected {first.shape[1]} (parts[0])")
        if p.device != first.device:
            raise ValueError(f"parts[{i}] is on {p.device}, expected {first.device} (parts[0]); "
                             f"move it with .to_device()")
        if first.format == "twell" and p.tile != first.tile:
            raise ValueError(f"parts[{i}] has tile {p.tile}, expected {first.tile} (parts[0])")
    n_rows = sum(p.shape[0] for p in parts)
    if n_rows > np.iinfo(np.int32).max:
        raise ValueError(f"the stacked container would have {n_rows} rows, more than int32 row ids allow")
    return parts


def vstack(parts):
    """Stack containers of one format on top of each other (row-wise).

    Parameters
    ----------
    parts : sequence of TwELL, ELL or Hybrid
        Containers of one format, dtype, device and column count (and, for
        TwELL, tile width).

    Returns
    -------
    TwELL, ELL or Hybrid
        A new container holding the rows of all parts in order, bit for bit.
        Slot counts that differ between parts (TwELL ``slots``, ELL/Hybrid
        width) are padded to the widest with value 0 and index -1; rows kept as
        dense backup rows stay backup rows. A single part is copied.

    Raises
    ------
    TypeError
        A part that is not a container, or parts of different formats or dtypes.
    ValueError
        No parts, different column counts, devices or TwELL tiles, or more than
        2**31 - 1 rows in all.
    """
    parts = _check_parts(parts)
    if len(parts) == 1:
        return parts[0].copy()
    first = parts[0]
    if first.xp is not np:
        with first.values.device:  # the result lives where the parts do, whatever device is current
            return _vstack(parts)
    return _vstack(parts)


def _vstack(parts):
    """:func:`vstack` of checked parts (two or more), on the current device."""
    first = parts[0]
    xp = first.xp
    shape = (sum(p.shape[0] for p in parts), first.shape[1])
    cls = type(first)
    # check=False, check_finite=False: every part was validated (or built by twellpy) already,
    # and stacking valid parts row by row gives valid arrays, so the content scan is not repeated
    if first.format == "twell":
        slots = max(p.values.shape[2] for p in parts)
        values = _concat_values(xp, [_pad_last(xp, p.values, slots, 0) for p in parts], 0)
        indices = xp.concatenate([_pad_last(xp, p.indices, slots, -1) for p in parts], axis=0)
        counts = xp.concatenate([p.counts for p in parts], axis=0)
        backup, backup_rows = _stack_backup(xp, parts, shape[1], first.dtype)
        return cls(values, indices, counts, shape=shape, tile=first.tile, backup=backup,
                   backup_rows=backup_rows, check=False, check_finite=False)
    width = max(p.values.shape[1] for p in parts)
    values = _concat_values(xp, [_pad_last(xp, p.values, width, 0) for p in parts], 0)
    indices = xp.concatenate([_pad_last(xp, p.indices, width, -1) for p in parts], axis=0)
    row_nnz = xp.concatenate([p.row_nnz for p in parts], axis=0)
    if first.format == "ell":
        return cls(values, indices, row_nnz, shape=shape, check=False, check_finite=False)
    backup, backup_rows = _stack_backup(xp, parts, shape[1], first.dtype)
    # a strategy string shared by every part still describes the result; otherwise
    # (different strategies, or fixed widths such as 1 and 3) only its width does
    strategies = {p.width_strategy for p in parts}
    strategy = first.width_strategy if len(strategies) == 1 and isinstance(first.width_strategy, str) else width
    return cls(values, indices, row_nnz, shape=shape, backup=backup, backup_rows=backup_rows,
               width_strategy=strategy, check=False, check_finite=False)
