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
