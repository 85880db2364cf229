"""twellpy: activation-sparse computation with TwELL, ELL and Hybrid formats.

The containers :class:`ELL`, :class:`TwELL` and :class:`Hybrid`, the
:class:`TileOverflowError`, :func:`vstack`, :func:`save`/:func:`load` and
:func:`gpu_available` are imported eagerly.
The optional areas ``twellpy.ops``, ``twellpy.ffn``, ``twellpy.stats``,
``twellpy.plot`` and ``twellpy.dask`` are imported on first attribute access,
so a missing optional dependency never breaks ``import twellpy``.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

from ._array import gpu_available
from ._base import SparseArray, TileOverflowError
from .ell import ELL
from .hybrid import Hybrid
from ._stack import vstack
from .io import load, save
from .twell import TwELL

_LAZY = ("ops", "ffn", "stats", "plot", "dask")

__all__ = ["ELL", "TwELL", "Hybrid", "SparseArray", "TileOverflowError", "vstack", "save", "load",
           "gpu_available", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        mod = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = mod
        return mod
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
