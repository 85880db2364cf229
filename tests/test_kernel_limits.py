"""Size limits of the CUDA kernels and their launchers, checked without a GPU.

Each test here reproduces one problem found by the kernel audit at a size the
CPU can run: a kernel through the emulation of ``tests/cuda_emu`` (the real
``.cu`` source compiled with g++), or a launcher's plan with the kernel replaced
by a recorder (no device needed).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_kernel_emulation import (GXX, _CONSTRUCT_HARNESS, _bits, _build, _construct_input,  # noqa: F401
                                   _emulated_twell)
from twellpy._array import bfloat16
from twellpy.backends import cpu

_INT32_MAX = 2**31 - 1

needs_gxx = pytest.mark.skipif(GXX is None, reason="needs g++ (C++20) to build the CPU emulation of the kernels")


# ---------------------------------------------------------------------------
# construct.cu: a tile wider than the row
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[4, 0], ids=["ring", "registers"])
def construct_lib(request, tmp_path_factory):
    return _build(tmp_path_factory, "construct.cu", _CONSTRUCT_HARNESS,
                  {"CONSTRUCT_WARPS": 2, "CONSTRUCT_ASYNC_DEPTH": request.param})


@needs_gxx
@pytest.mark.parametrize("dtype,vec", [(np.dtype(np.float32), 1), (np.dtype(np.float32), 4), (bfloat16, 8)])
@pytest.mark.parametrize("tile", [_INT32_MAX, _INT32_MAX - 100, 2**31 - 256])
def test_dense_to_twell_tile_near_int32_max(construct_lib, dtype, vec, tile):
    """A tile of up to 2**31 - 1 columns (one tile per row: a legal TwELL) packs every row.

    twellpy_dense_to_twell computed the chunks per tile as (tile + 32*VEC - 1) / (32*VEC)
    in int: for a tile within 32*VEC of 2**31 that overflowed to a negative count, the
    warp's loop ran zero times and values, indices and counts were never written
    (uninitialised memory came back as the container)."""
    rng = np.random.default_rng(3)
    x = _construct_input(rng, dtype, 6, 264)
    *got, finite = _emulated_twell(construct_lib, x, tile, 4, 32, vec)
    want = cpu.dense_to_twell(x, tile, 4)
    for g, w, name in zip(got, want, ("values", "indices", "counts", "row_max")):
        assert g.shape == w.shape, name
        assert np.array_equal(_bits(g), _bits(np.asarray(w))), name
    assert finite


# ---------------------------------------------------------------------------
# launchers, with numpy standing in for cupy and the kernel replaced by a recorder
# ---------------------------------------------------------------------------
class _Recorder:
    """Stands in for a cupy.RawKernel: records each launch (grid, block, args)."""

    def __init__(self):
        self.launches = []

    def __call__(self, grid, block, args, **kw):
        self.launches.append((tuple(grid), tuple(block), args))


@pytest.fixture
def host_only(monkeypatch):
    """``twellpy.backends.cuda`` and ``cuda_ffn`` on numpy arrays: every kernel lookup
    returns one recorder, so a test sees the arguments the launchers pass."""
    from types import SimpleNamespace

    from twellpy.backends import _registry as reg
    from twellpy.backends import cuda, cuda_ffn

    fake_cp = SimpleNamespace(ndarray=np.ndarray, empty=np.empty, zeros=np.zeros,
                              ascontiguousarray=np.ascontiguousarray, nonzero=np.nonzero,
                              int32=np.int32)
    rec = _Recorder()
    monkeypatch.setattr(cuda, "_cp", lambda: fake_cp)
    monkeypatch.setattr(cuda, "_aligned", lambda *arrays: True)
    monkeypatch.setattr(cuda_ffn, "cupy_module", lambda: fake_cp)
    monkeypatch.setattr(reg, "get_kernel", lambda *a, **kw: rec)
    return SimpleNamespace(cuda=cuda, cuda_ffn=cuda_ffn, rec=rec)


def _fits_int32(args):
    return all(not isinstance(a, np.integer) or np.iinfo(np.int32).min <= int(a) <= _INT32_MAX for a in args)


@pytest.mark.parametrize("tile", [300, 2**31 - 1, 2**31, 2**40])
def test_wide_tiles_reach_the_construction_kernels_as_the_row_width(host_only, tile):
    """A tile of 2**31 or more columns (legal: one tile per row) made the launchers raise
    numpy's OverflowError converting it to the kernels' int32 argument; a tile wider
    than the row now goes to the kernels as the row width (the same single tile)."""
    x = np.zeros((3, 300), np.float32)
    host_only.cuda.dense_to_twell(x, tile, 4)
    (_, _, args), = host_only.rec.launches
    assert int(args[8]) == 300 and _fits_int32(args)  # (..., M, N, tile, slots, ...)

    host_only.rec.launches.clear()
    indptr = np.array([0, 1, 1, 2], np.int64)
    host_only.cuda.csr_to_twell(indptr, np.array([5, 299], np.int32), np.ones(2, np.float32), 300, tile, 4)
    (_, _, args), = host_only.rec.launches
    assert int(args[10]) == 300 and _fits_int32(args)  # (..., M, n_cols, tile, slots, n_tiles)

    host_only.rec.launches.clear()
    host_only.cuda_ffn.pack_activation(x, tile, 4)
    (_, _, args), = host_only.rec.launches
    assert int(args[4]) == 300 and _fits_int32(args)  # (h, lds, M, N, tile, slots, n_tiles, ...)


# ---------------------------------------------------------------------------
# rows of more than 2**30 columns
# ---------------------------------------------------------------------------
def test_rows_wider_than_2_30_columns_are_refused_by_name(host_only):
    """The kernels' int column counters may run a chunk (or, in the last tile, a tile)
    past the row's end before their bounds check; near 2**31 columns that wrapped
    negative and read before the row (a CUDA fault). Such rows now get a ValueError
    before any launch. Zero-row inputs of that width need no memory."""
    cuda = host_only.cuda
    wide = 2**30 + 1
    x = np.zeros((0, wide), np.float16)
    with pytest.raises(ValueError, match=r"the number of columns is 1073741825; .*at most 2\*\*30"):
        cuda.dense_to_twell(x, 256, 8)
    with pytest.raises(ValueError, match=r"at most 2\*\*30"):
        cuda._dense_row_nnz(x)
    with pytest.raises(ValueError, match=r"at most 2\*\*30"):
        cuda.csr_to_twell(np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), wide, 256, 8)
    with pytest.raises(ValueError, match=r"the number of columns of B is 1073741825"):
        cuda._dense_operand(x, "B")
    assert not host_only.rec.launches
    # 2**30 columns exactly are accepted (the zero-row launch returns early)
    cuda.dense_to_twell(np.zeros((0, 2**30), np.float16), 256, 8)
