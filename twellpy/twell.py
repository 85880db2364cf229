"""TwELL (tile-wise ELLPACK): per (row, column tile) slot lists of fixed capacity.

Columns are cut into tiles of ``tile`` columns (the last tile may be
narrower); each (row, tile) stores up to ``slots`` (column, value) pairs.
Indices are **global** column ids. A row with any tile holding more than
``slots`` non-zeros cannot be stored in slots without loss; what happens is
chosen with ``overflow``:

* ``"backup"`` (default): the whole row is stored, exactly, as a dense row in
  ``backup``; its counts are 0 and its slots are padding. Every operation
  honours the backup rows.
* ``"raise"``: :class:`twellpy.TileOverflowError` names the worst (row, tile),
  its count, and a ``slots`` value sufficient for the whole matrix.
"""
from __future__ import annotations

import numpy as np

from . import _array, backends
from ._base import (SparseArray, TileOverflowError, _as_host, _to_int, backup_parts,
                    check_index_array, check_shape, check_value_array, csr_rows_to_dense, dense_backup_rows,
                    positive_int, worst_tile, zero_rows)

_OVERFLOW = ("backup", "raise")


def n_tiles_of(n_cols, tile):
    return -(-n_cols // tile) if n_cols else 0


class TwELL(SparseArray):
    """Tile-wise ELLPACK sparse array.

    Parameters
    ----------
    values : array, (M, ceil(N/tile), S)
        Values, 0 in padding; S = ``slots``.
    indices : array, (M, ceil(N/tile), S), int32
        Global column ids, sorted within a (row, tile) and packed at the
        front; a column in tile t lies in ``[t*tile, min((t+1)*tile, N))``;
        -1 in padding.
    counts : array, (M, ceil(N/tile)), int32
        Entries stored in each (row, tile), ``<= S``.
    shape : tuple (M, N)
    tile : int
        Columns per tile (default 256).
    backup : array, (R, N), optional
        Dense backup rows (same dtype as ``values``).
    backup_rows : array, (R,), int32, optional
        Sorted ids of the rows held in ``backup``.
    check : bool or "full"
        ``True`` (default) validates shapes, dtypes and devices and scans the
        contents: counts within [0, S], indices of used slots inside their
        tile and sorted, padding exactly (0, -1), backup rows without slot
        entries (see :class:`twellpy.ELL`); ``"full"`` is the same;
        ``False`` trusts the caller.
    check_finite : bool
        Reject NaN/Inf in ``values``/``backup``.
    """

    format = "twell"
    _array_names = ("values", "indices", "counts", "backup", "backup_rows", "row_map")

    def __init__(self, values, indices, counts, *, shape, tile=256, backup=None, backup_rows=None,
                 row_map=None, check=True, check_finite=True):
        self._validate_check(check)
        m, n = check_shape(shape)
        tile = positive_int(tile, "tile")
        if check:
            values = check_value_array(values, "values", 3)
            nt = n_tiles_of(n, tile)
            if tuple(values.shape[:2]) != (m, nt):
                raise ValueError(f"values has shape {tuple(values.shape)}, expected ({m}, {nt}, slots) "
                                 f"for shape {(m, n)} and tile={tile}")
            if values.shape[2] == 0:
                raise ValueError(f"values has shape {tuple(values.shape)}: slots must be at least 1")
            indices = check_index_array(indices, "indices", 3, shape=values.shape)
            counts = check_index_array(counts, "counts", 2, shape=(m, nt))
            xp = _array.xp_of(values)
            backup, backup_rows, row_map = backup_parts(xp, values.dtype, m, n, backup, backup_rows, row_map)
            _array.same_device([("values", values), ("indices", indices), ("counts", counts),
                                ("backup", backup), ("backup_rows", backup_rows)])
        elif row_map is None or backup is None:
            backup, backup_rows, row_map = backup_parts(_array.xp_of(values), values.dtype, m, n,
                                                        backup, backup_rows)
        self.values, self.indices, self.counts = values, indices, counts
        self.backup, self.backup_rows, self.row_map = backup, backup_rows, row_map
        self._shape = (m, n)
        self.tile = tile
        self._finish_init(check, check_finite)

    @property
    def slots(self) -> int:
        """Slots per (row, tile), S."""
        return int(self.values.shape[2])

    @property
    def n_tiles(self) -> int:
        return int(self.values.shape[1])

    def _params(self):
        return {"tile": self.tile, "slots": self.slots}

    def _transpose_params(self):
        return {"tile": self.tile, "slots": self.slots, "overflow": "backup"}

    def _slots(self):
        m = self.shape[0]
        return (self.values.reshape(m, self.n_tiles * self.slots),
                self.indices.reshape(m, self.n_tiles * self.slots))

    def _spmm(self, b):
        fast = getattr(self._backend(), "twell_spmm", None)  # optional fast path
        if fast is None:
            return super()._spmm(b)
        return fast(self.values, self.indices, self.counts, b)

    def _spmm_t(self, b):
        fast = getattr(self._backend(), "twell_spmm_t", None)
        if fast is None:
            return super()._spmm_t(b)
        return fast(self.values, self.indices, self.counts, b, self.shape[1])

    def _transpose_slots(self):
        fast = getattr(self._backend(), "twell_transpose", None)
        if fast is None:
            return super()._transpose_slots()
        return fast(self.values, self.indices, self.counts, self.shape[1])

    def _row_counts(self):
        return self.counts.sum(axis=1, dtype=np.int64).astype(np.int32)

    @classmethod
    def _init_from_components(cls, d, check, check_finite):
        try:
            obj = cls(d["values"], d["indices"], d["counts"], shape=d["shape"], tile=d.get("tile", 256),
                      backup=d.get("backup"), backup_rows=d.get("backup_rows"),
                      row_map=d.get("row_map") if check else None, check=check, check_finite=check_finite)
        except KeyError as e:
            raise ValueError(f"components of a TwELL need {e.args[0]!r}") from None
        if check and "slots" in d and _to_int(d["slots"], "slots") != obj.slots:
            raise ValueError(f"slots is {d['slots']}, expected {obj.slots} (values.shape[2])")
        return obj

    @classmethod
    def from_dense(cls, x, *, tile=256, slots=32, overflow="backup", check_finite=True):
        """Build from a dense (M, N) array in one pass.

        Parameters
        ----------
        x : array
            numpy, cupy or any ``__dlpack__`` object; float16, bfloat16,
            float32 or float64. Non-zero test on the bit pattern: NaN is
            kept, -0.0 is dropped.
        tile, slots : int
            Tile width T (default 256) and capacity S per (row, tile)
            (default 32).
        overflow : {"backup", "raise"}
            What to do with rows having a tile over capacity (module docstring).
        check_finite : bool
            Reject NaN/Inf in ``x``.
        """
        return super().from_dense(x, tile=tile, slots=slots, overflow=overflow, check_finite=check_finite)

    @classmethod
    def from_scipy(cls, m, *, tile=256, slots=32, overflow="backup", dtype=None, check_finite=True):
        """Build from a scipy.sparse array/matrix; see :meth:`SparseArray.from_scipy`.

        Parameters
        ----------
        m : scipy.sparse array or matrix
            (M, N) matrix; float32 or float64 (integers only with ``dtype``).
        tile, slots : int
            Tile width T (default 256) and capacity S per (row, tile)
            (default 32).
        overflow : {"backup", "raise"}
            What to do with rows having a tile over capacity (module docstring).
        dtype : dtype, optional
            Value dtype (float16, bfloat16, float32 or float64); default that of ``m``.
        check_finite : bool
            Reject NaN/Inf values.
        """
        return super().from_scipy(m, tile=tile, slots=slots, overflow=overflow, dtype=dtype,
                                  check_finite=check_finite)

    @staticmethod
    def _params_ok(tile, slots, overflow):
        tile = positive_int(tile, "tile")
        slots = positive_int(slots, "slots")
        if overflow not in _OVERFLOW:
            raise ValueError(f"overflow must be 'backup' or 'raise', got {overflow!r}")
        return tile, slots

    @classmethod
    def _finish_build(cls, values, indices, counts, row_max, shape, tile, slots, overflow, row_cols):
        """Move overflowing rows to backup (or raise); ``row_cols(r)`` gives a row's columns."""
        xp = _array.xp_of(values)
        m, n = shape
        over = row_max > slots
        n_over = int(_as_host(over.sum())) if m else 0
        if n_over == 0:
            return cls(values, indices, counts, shape=shape, tile=tile, check=False, check_finite=False)
        if overflow == "raise":
            r = int(_as_host(xp.argmax(row_max)))
            t, c = worst_tile(row_cols(r), tile)
            need = int(_as_host(row_max.max()))
            raise TileOverflowError(
                f"row {r}, tile {t} (columns {t * tile}..{min((t + 1) * tile, n) - 1}) holds {c} non-zeros "
                f"but slots={slots} ({n_over} rows overflow); pass slots={need} or more, or "
                f"overflow='backup' to keep those rows as dense backup rows")
        return over

    @classmethod
    def _from_dense_xp(cls, x, tile=256, slots=32, overflow="backup", check_finite=False):
        tile, slots = cls._params_ok(tile, slots, overflow)
        xp = _array.xp_of(x)
        be = backends.get(x)
        fused = getattr(be, "dense_to_twell_finite", None)  # optional: NaN/Inf test in the same pass
        if check_finite and fused is not None:
            values, indices, counts, row_max, finite = fused(x, tile, slots)
            if not finite:
                _array.check_finite(x, "x")
        else:
            if check_finite:
                cls._check_dense_finite(x)
            values, indices, counts, row_max = be.dense_to_twell(x, tile, slots)

        def row_cols(r):
            from ._base import nonzero_mask
            return _as_host(xp.nonzero(nonzero_mask(x[r]))[0])

        res = cls._finish_build(values, indices, counts, row_max, x.shape, tile, slots, overflow, row_cols)
        if isinstance(res, cls):
            return res
        backup_rows = xp.nonzero(res)[0].astype(np.int32)
        backup = dense_backup_rows(x, backup_rows)  # -0.0 becomes +0.0, as in the slots
        zero_rows(backup_rows, (values, 0), (indices, -1), (counts, 0))
        return cls(values, indices, counts, shape=x.shape, tile=tile, backup=backup,
                   backup_rows=backup_rows, check=False, check_finite=False)

    @classmethod
    def _from_csr(cls, indptr, indices, data, shape, tile=256, slots=32, overflow="backup"):
        tile, slots = cls._params_ok(tile, slots, overflow)
        xp = _array.xp_of(data)
        m, n = shape
        values, idx, counts, row_max = backends.get(data).csr_to_twell(indptr, indices, data, n, tile, slots)

        def row_cols(r):
            lo, hi = (int(v) for v in _as_host(indptr[r:r + 2]))
            return _as_host(indices[lo:hi])

        res = cls._finish_build(values, idx, counts, row_max, shape, tile, slots, overflow, row_cols)
        if isinstance(res, cls):
            return res
        backup_rows = xp.nonzero(res)[0].astype(np.int32)
        r = int(backup_rows.shape[0])
        row_map = xp.full(m, -1, np.int32)
        row_map[backup_rows] = xp.arange(r, dtype=np.int32)
        backup = csr_rows_to_dense(indptr, indices, data, row_map, r, n)
        zero_rows(backup_rows, (values, 0), (idx, -1), (counts, 0))
        return cls(values, idx, counts, shape=shape, tile=tile, backup=backup, backup_rows=backup_rows,
                   row_map=row_map, check=False, check_finite=False)

    def _check_slots_full(self, quick=False):
        xp = self.xp
        m, n = self.shape
        lo = xp.broadcast_to(xp.arange(self.n_tiles, dtype=np.int64) * self.tile, (m, self.n_tiles))
        hi = xp.minimum(lo + self.tile, n)
        return self._check_slot_lists(self.values, self.indices, self.counts, lo, hi,
                                      lambda p: f"row {p[0]}, tile {p[1]}", "counts", quick=quick)
