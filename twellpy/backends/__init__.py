"""Backends: ``cpu`` (Numba) and ``cuda`` (CuPy RawKernels).

Operations pick the backend from where the data lives: numpy arrays go to the
CPU backend, cupy arrays to the CUDA backend. Both export the same functions
with the same argument order (see docs/internals.md).
"""
from __future__ import annotations

import importlib

from .._array import is_cupy


def get(arr, area: str = ""):
    """Backend module for ``arr``.

    Parameters
    ----------
    arr : numpy.ndarray or cupy.ndarray
        Array whose location decides the backend.
    area : str
        ``""`` for container kernels, ``"ffn"`` or ``"train"`` for the FFN
        inference and training kernels (modules ``cpu_ffn``/``cuda_ffn`` ...).
    """
    base = "cuda" if is_cupy(arr) else "cpu"
    name = f"{base}_{area}" if area else base
    return importlib.import_module(f"twellpy.backends.{name}")


def backup_gemm(a, b):
    """``a @ b`` in the accumulator dtype for dense backup rows ``a`` (R, H) and a dense
    ``b`` (H, K) of a's dtype, as if ``a`` were sparse: the GEMM also multiplies a's
    zeros (0 * NaN = NaN), so the rows it leaves non-finite are summed again over a's
    non-zeros only (``backup_exact`` of the training backend: one launch on the GPU,
    no host sync). A NaN/Inf row of ``b`` then reaches exactly the rows that store
    its column, as in the slot formats and scipy.sparse. ``a`` C-contiguous."""
    be = get(a, "train")
    return be.backup_exact(be.gemm_acc(a, b), a, a, b)


def overflow_rows_to_backup(xp, h, values, indices, counts, row_max, slots):
    """Move the rows of a packed activation whose fullest tile overflowed into dense backup.

    ``row_max`` holds each row's largest tile count (before clipping to ``slots``). Those rows
    keep their dense row of ``h`` in ``backup`` and become empty in the slots (counts 0,
    padding), so nothing is lost. Shared by the CPU and CUDA packers (``xp`` numpy or cupy).

    Returns
    -------
    backup : (R, N) array of h's dtype
    backup_rows : (R,) int32
    """
    backup_rows = xp.nonzero(row_max > slots)[0].astype(xp.int32)
    if not backup_rows.size:
        return xp.empty((0, h.shape[1]), h.dtype), backup_rows
    from .._base import dense_backup_rows  # here: _base imports this package

    values[backup_rows] = 0
    indices[backup_rows] = -1
    counts[backup_rows] = 0
    # -0.0 becomes +0.0, the bits the slots (which store no zero) and every container give
    return dense_backup_rows(h, backup_rows), backup_rows
